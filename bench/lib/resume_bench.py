"""bench/resume: a session holding many arrays (10 GiB by default), detached, then
resumed by new kernels on the same notebook (the Lossless-sessions issue); and
undo and fork of that session's state against a 1 MiB session's.

The four services run as processes of their own (benchlib.Services) with two
virtual GPUs; LooseLeaf's kernel is installed into a scratch prefix with every
cell serverless (`--all-gpu`) and pointed at that frontend (LOOSELEAF_FRONTEND),
so the cluster is already running when each kernel starts. A first kernel on the
notebook fills the session: `--gib` GiB as 64 MiB arrays of random numbers (so
that no chunk is stored once for several), and a 10 MiB array.
Then `--runs` times: the kernel is shut down (its session detaches), a new kernel
starts on the same notebook (JPY_SESSION_NAME), and its first cell, which reads
the 10 MiB array, is timed from its execute_request to its execute_reply; that
span includes opening (resuming) the session. Every setup cell appends a line to
a file, so `cells_rerun` counts the setup cells run more than once.

Undo and fork go through the API on the same session and on a 1 MiB one:
`undo_ms_*` times POST .../undo after a one-line cell, `fork_ms_*` times POST
.../fork (each fork then deleted).

Writes bench/results/resume.json: `resume_first_cell_ms_p50` and `_p99` (target
1000 each), `undo_ms_p50` and `fork_ms_p50` (target 50) with the 1 MiB figures
nested under `small`, `fork_ms_ratio_10g_vs_1m` (target 2), `cells_rerun` (0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.request

from benchlib import LOOSELEAF, Services, ensure_release, log, percentile, scratch, write_result
from jupyter_client.manager import KernelManager

TIMEOUT = 900
KERNEL = "looseleaf-resume-bench"
NOTEBOOK = "bench/resume.ipynb"
SMALL_NOTEBOOK = "bench/resume-small.ipynb"


def api(url: str, method: str = "GET", body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


LIVE: list[Kernel] = []


class Kernel:
    """A LooseLeaf kernel on `notebook`, with a client."""

    def __init__(self, notebook: str, env: dict):
        LIVE.append(self)
        self.km = KernelManager(kernel_name=KERNEL)
        self.km.start_kernel(env={**env, "JPY_SESSION_NAME": notebook})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=TIMEOUT)

    def run(self, code: str) -> tuple[float, str]:
        """Seconds from execute_request to its execute_reply, and what it printed."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        while True:
            reply = self.kc.get_shell_msg(timeout=TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                elapsed = time.perf_counter() - t0
                break
        assert reply["content"]["status"] == "ok", reply["content"]
        text = []
        while True:  # the outputs, up to the idle status that ends the request
            msg = self.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                text.append(msg["content"]["text"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        return elapsed, "".join(text)

    def shutdown(self) -> None:
        """Jupyter's shutdown (not a restart): the session detaches."""
        if self in LIVE:
            LIVE.remove(self)
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)


def session_of(frontend: str, notebook: str) -> str:
    for s in api(f"{frontend}/v1/sessions"):
        if s.get("notebook") == notebook and not s.get("detached_unix_ms"):
            return s["session_id"]
    raise RuntimeError(f"no attached session of {notebook}")


def time_undo_and_fork(frontend: str, sessions: dict, runs: int) -> dict:
    """Milliseconds of POST .../undo (after a one-line cell) and POST .../fork
    for each of `sessions` (name -> (kernel, session id)), taken in turns so that
    the machine's load falls on each alike."""
    undo = {name: [] for name in sessions}
    fork = {name: [] for name in sessions}
    state_bytes = {}
    for i in range(runs):
        for name, (kernel, sid) in sessions.items():
            kernel.run(f"step = {i}")
            t0 = time.perf_counter()
            api(f"{frontend}/v1/sessions/{sid}/undo", "POST")
            undo[name].append(1000 * (time.perf_counter() - t0))
        for name, (_, sid) in sessions.items():
            t0 = time.perf_counter()
            forked = api(f"{frontend}/v1/sessions/{sid}/fork", "POST")
            fork[name].append(1000 * (time.perf_counter() - t0))
            state_bytes[name] = forked["bytes"]
            api(f"{frontend}/v1/sessions/{forked['session_id']}", "DELETE")
    return {
        name: {
            "undo_ms_p50": percentile(undo[name], 0.5),
            "undo_ms_p99": percentile(undo[name], 0.99),
            "fork_ms_p50": percentile(fork[name], 0.5),
            "fork_ms_p99": percentile(fork[name], 0.99),
            "runs": runs,
            "state_bytes": state_bytes[name],
        }
        for name in sessions
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=10, help="GiB the big session holds (default 10)")
    ap.add_argument("--runs", type=int, default=20, help="resumes timed, and undos and forks (default 20)")
    args = ap.parse_args()
    ensure_release()
    work = scratch("resume")
    # a worker may hold the whole state (the default bound is a share of RAM)
    os.environ["LOOSELEAF_WORKER_MEMORY_BYTES"] = "0"
    services = Services(work / "services")
    try:
        prefix = work / "kernel"
        subprocess.run(
            [str(LOOSELEAF), "kernel", "install", "--prefix", str(prefix), "--name", KERNEL, "--all-gpu"], check=True
        )
        env = {
            **os.environ,
            "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
            "LOOSELEAF_FRONTEND": services.url,
            "LOOSELEAF_LOG": "error",
        }
        os.environ["JUPYTER_PATH"] = env["JUPYTER_PATH"]
        ran = work / "setup-runs.txt"
        mark = f"open({str(ran)!r}, 'a').write('ran\\n')"
        arrays = args.gib * 16  # 64 MiB each

        log(f"filling the session: {args.gib} GiB in {arrays} arrays of 64 MiB, and 10 MiB")
        kernel = Kernel(NOTEBOOK, env)
        t0 = time.perf_counter()
        kernel.run(f"import numpy as np\n{mark}")
        # random bytes: chunks are content-addressed, so equal values would be stored once
        for start in range(0, arrays, 16):  # a GiB a cell
            made = (f"a{i} = np.random.default_rng({i}).random(8 << 20)" for i in range(start, start + 16))
            kernel.run(f"{mark}\n" + "\n".join(made))
        kernel.run(f"{mark}\nprobe = np.arange(10 << 17, dtype=np.float64)")
        fill_s = time.perf_counter() - t0
        log(f"filled in {fill_s:.0f} s")
        small_kernel = Kernel(SMALL_NOTEBOOK, env)
        small_kernel.run("import numpy as np\nm = np.ones(1 << 17)")  # 1 MiB
        timed = time_undo_and_fork(
            services.url,
            {
                "big": (kernel, session_of(services.url, NOTEBOOK)),
                "small": (small_kernel, session_of(services.url, SMALL_NOTEBOOK)),
            },
            args.runs,
        )
        small_kernel.shutdown()
        big, small = timed["big"], timed["small"]
        for name, t in timed.items():
            log(f"{name}: undo p50 {t['undo_ms_p50']:.1f} ms, fork p50 {t['fork_ms_p50']:.1f} ms")

        expected = str(float(sum(range(10 << 17))))
        resume_ms, notices = [], 0
        for i in range(args.runs):
            kernel.shutdown()
            kernel = Kernel(NOTEBOOK, env)
            elapsed, text = kernel.run("print(probe.sum())")
            assert expected in text, f"resume {i}: {text!r}"
            notices += "LooseLeaf: resumed" in text
            resume_ms.append(1000 * elapsed)
            log(f"resume {i}: first cell {resume_ms[-1]:.0f} ms")
        kernel.shutdown()

        setup_cells = 2 + arrays // 16
        # what the store holds (the arrays are random: no chunk is shared)
        stored = sum(f.stat().st_size for f in (work / "services" / "store").rglob("*") if f.is_file())
        result = {
            "resume_first_cell_ms_p50": percentile(resume_ms, 0.5),
            "resume_first_cell_ms_p99": percentile(resume_ms, 0.99),
            "undo_ms_p50": big["undo_ms_p50"],
            "fork_ms_p50": big["fork_ms_p50"],
            "fork_ms_ratio_10g_vs_1m": big["fork_ms_p50"] / small["fork_ms_p50"],
            "cells_rerun": len(ran.read_text().splitlines()) - setup_cells,
            "resume_notices": notices,
            "resume_first_cell_ms": resume_ms,
            "big": {**big, "gib": args.gib, "arrays": arrays + 1, "fill_s": fill_s, "store_bytes_on_disk": stored},
            "small": small,
            "how": "bench/resume: services as processes, 2 virtual GPUs, --all-gpu kernels on LOOSELEAF_FRONTEND",
        }
        write_result("resume", result)
        log(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))}))
    finally:
        for kernel in list(LIVE):
            kernel.shutdown()
        services.stop()


if __name__ == "__main__":
    main()
