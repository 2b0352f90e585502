"""bench/jupyterlab: GPU cells typed into JupyterLab in a real browser at 20
characters a second, then run, with the LooseLeaf extension (edits stream to the
kernel, so workers are prepared before Run) and without it, in the same run
(issue 16).

The sample (fixed; named in the JSON):
- 20 cells of the torch corpus notebooks: in each notebook, the last 10 code cells
  of 40 to 200 characters that run without error. Short cells leave speculation
  the least typing time to prepare in.
- 5 cells of a notebook the bench writes, whose cold start costs over 300 ms
  here: a first cell makes a 1 GiB array, and each of the 5 reads it (its
  closure is the array).

Each notebook is opened in JupyterLab on a LooseLeaf kernel (`--all-gpu`: every
cell is a GPU cell, as in bench/speculation); the sampled cells are left empty
in the file and typed in the browser (as text input: the editor adds no brackets
or indentation, and the typed text must equal the source), then run at once;
the other cells are run as they are. A cell's start delay is what its execute
reply says (`metadata.looseleaf.start_delay_ms`: the kernel sending Run to
hearing the cell's first line), and whether its worker was prepared while it was
typed (`prepare` is `speculative`). The two passes run one after the other: each
its own JupyterLab (the extension disabled through JupyterLab's page config in
the second) and its own embedded cluster. Writes bench/results/jupyterlab.json.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B  # noqa: E402

CPS = 20.0
PER_NOTEBOOK = 10
MIN_CHARS, MAX_CHARS = 40, 200
TORCH_NOTEBOOKS = ["mrdbourke_01_pytorch_workflow.ipynb", "rasbt_ch12_part2.ipynb"]
# the 5 slow cells: a 1 GiB closure each
SLOW_NOTEBOOK = "slow_closure.ipynb"
SLOW_SETUP = "import numpy as np\nbig = np.random.default_rng(0).random(2**27)\nprint(big.nbytes)"
SLOW_CELLS = [f"print(round(float(big[{k}]), 6))" for k in (1, 10, 100, 1000, 10000)]
TARGETS = {"prepared_fraction": 0.95, "within_1s": 0.99, "slow_cells_start_ratio": 0.2}
KERNEL = "looseleaf-bench"
KERNEL_DISPLAY = "LooseLeaf (bench)"
EXTENSION = "looseleaf-jupyterlab"


def source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def torch_sample(corpus: Path) -> list[dict]:
    """The fixed sample: per torch notebook, its last PER_NOTEBOOK code cells of
    MIN_CHARS..MAX_CHARS characters that a plain run does not fail. Which cells fail
    is read from their saved outputs (the corpus notebooks were saved run)."""
    sample = []
    for name in TORCH_NOTEBOOKS:
        cells = json.loads((corpus / "torch" / name).read_text())["cells"]
        code = [(i, c) for i, c in enumerate(cells) if c["cell_type"] == "code"]
        fits = [
            (k, i, c)
            for k, (i, c) in enumerate(code)
            if MIN_CHARS <= len(source(c)) <= MAX_CHARS
            and not any(o.get("output_type") == "error" for o in c.get("outputs", []))
            and not source(c).lstrip().startswith("!")
        ]
        for k, i, c in fits[-PER_NOTEBOOK:]:
            sample.append({"notebook": name, "cell": i, "position": k, "source": source(c)})
    return sample


def write_slow_notebook(path: Path) -> list[dict]:
    cells = [SLOW_SETUP, *SLOW_CELLS]
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "id": uuid.uuid4().hex[:8],
                "metadata": {},
                "outputs": [],
                "execution_count": None,
                "source": "" if k else s,
            }
            for k, s in enumerate(cells)
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))
    return [{"notebook": SLOW_NOTEBOOK, "cell": k, "position": k, "source": s} for k, s in enumerate(cells) if k]


def blank_sampled(nb_path: Path, sample: list[dict]) -> None:
    """Leave the sampled cells empty (and every output off): the browser types them."""
    nb = json.loads(nb_path.read_text())
    mine = {s["cell"] for s in sample if s["notebook"] == nb_path.name}
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
            if i in mine:
                c["source"] = ""
    nb_path.write_text(json.dumps(nb, indent=1))


def chromium() -> str:
    for b in ("chromium", "chromium-browser"):
        if Path("/usr/bin", b).exists():
            return str(Path("/usr/bin", b))
    raise SystemExit("no Chromium in /usr/bin: run scripts/setup-tests")


class Lab:
    """A JupyterLab server for one pass: its own config (the extension on or off),
    the bench's kernelspec, and a root holding the notebooks."""

    def __init__(self, work: Path, root: Path, extension: bool):
        self.work, self.root = work, root
        prefix, state = work / "prefix", work / "state"
        subprocess.run(
            [
                str(B.LOOSELEAF),
                "kernel",
                "install",
                "--prefix",
                str(prefix),
                "--name",
                KERNEL,
                "--display-name",
                KERNEL_DISPLAY,
                "--all-gpu",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        labconfig = state / "config" / "labconfig"
        labconfig.mkdir(parents=True)
        if not extension:
            (labconfig / "page_config.json").write_text(json.dumps({"disabledExtensions": {EXTENSION: True}}))
        self.port = B.free_port()
        self.token = uuid.uuid4().hex
        venv_bin = B.PYTHON.parent
        env = {
            **os.environ,
            "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
            "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
            "JUPYTER_CONFIG_DIR": str(state / "config"),
            "JUPYTER_DATA_DIR": str(state / "data"),
            "JUPYTER_RUNTIME_DIR": str(state / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(state / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"),
            "LOOSELEAF_VIRTUAL_GPUS": "2",
            # the pass's kernels share a local cluster of their own (ADR 65)
            "LOOSELEAF_USER_DIR": str(work / "user"),
            "LOOSELEAF_RUNTIME_DIR": str(work / "user" / "run"),
        }
        self.log = open(work / "lab.log", "w")
        self.proc = subprocess.Popen(
            [
                str(venv_bin / "jupyter"),
                "lab",
                "--no-browser",
                "--allow-root",
                "--ip=127.0.0.1",
                f"--port={self.port}",
                f"--ServerApp.token={self.token}",
                f"--ServerApp.root_dir={root}",
                "--LabApp.expose_app_in_browser=True",
            ],
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.5)
        raise SystemExit(f"JupyterLab did not start (see {work / 'lab.log'})")

    def notebook(self, name: str, typed: dict[str, str], shots: Path) -> dict:
        shots.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "LAB_URL": f"http://127.0.0.1:{self.port}",
            "LAB_TOKEN": self.token,
            "NOTEBOOK": name,
            "KERNEL_NAME": KERNEL,
            "KERNEL_DISPLAY": KERNEL_DISPLAY,
            "CHROMIUM": chromium(),
            "OUT": str(shots),
            "TYPED": json.dumps(typed),
            "CPS": str(CPS),
        }
        r = subprocess.run(
            ["node", str(B.BENCH / "lib" / "jupyterlab_bench.mjs")],
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
            stdin=subprocess.DEVNULL,
        )
        if r.returncode != 0:
            raise SystemExit(f"the browser failed on {name} (screenshots in {shots}):\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        # SIGTERM: the server shuts its kernels down; then their local cluster
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        B.stop_local_cluster(self.work / "user" / "run")


def run_pass(name: str, work: Path, corpus: Path, sample: list[dict], extension: bool) -> list[dict]:
    """Every sampled notebook through one JupyterLab; the typed cells' replies."""
    d = work / name
    root = d / "root"
    shutil.copytree(corpus / "torch", root)
    slow = write_slow_notebook(root / SLOW_NOTEBOOK)
    for nb in TORCH_NOTEBOOKS:
        blank_sampled(root / nb, sample)
    lab = Lab(d, root, extension)
    rows = []
    try:
        for nb in [*TORCH_NOTEBOOKS, SLOW_NOTEBOOK]:
            mine = [s for s in sample + slow if s["notebook"] == nb]
            B.log(f"{name}: {nb}, typing {len(mine)} cells")
            seen = lab.notebook(nb, {str(s["position"]): s["source"] for s in mine}, d / "shots")
            if seen.get("extension_active") != extension:
                raise SystemExit(f"{name}: the extension was {'not ' if extension else ''}active")
            by_position = {c["position"]: c for c in seen["cells"]}
            for s in mine:
                reply = by_position.get(s["position"], {})
                ll = reply.get("looseleaf") or {}
                rows.append(
                    {
                        "notebook": nb,
                        "cell": s["cell"],
                        "slow": nb == SLOW_NOTEBOOK,
                        "chars": len(s["source"]),
                        "status": reply.get("status"),
                        "device": ll.get("device"),
                        "prepare": ll.get("prepare"),
                        "start_delay_ms": ll.get("start_delay_ms"),
                    }
                )
    finally:
        lab.stop()
    return rows


def figures(rows: list[dict]) -> dict:
    torch = [r for r in rows if not r["slow"]]
    slow = [r for r in rows if r["slow"]]
    started = [r for r in rows if r["start_delay_ms"] is not None]
    delays = [r["start_delay_ms"] for r in started]
    return {
        "cells": len(rows),
        "errors": sum(1 for r in rows if r["status"] != "ok"),
        "gpu_cells": sum(1 for r in rows if r["device"] == "gpu"),
        "prepared_fraction": sum(1 for r in rows if r["prepare"] == "speculative") / len(rows) if rows else None,
        "within_1s": sum(1 for d in delays if d <= 1000) / len(rows) if rows else None,
        "median_start_ms": B.median(delays),
        "p95_start_ms": B.percentile(delays, 0.95),
        "torch_median_start_ms": B.median([r["start_delay_ms"] for r in torch if r["start_delay_ms"] is not None]),
        "slow_median_start_ms": B.median([r["start_delay_ms"] for r in slow if r["start_delay_ms"] is not None]),
    }


def main() -> None:
    B.ensure_release()
    if not (B.REPO / ".venv" / "share" / "jupyter" / "labextensions" / EXTENSION / "package.json").exists():
        raise SystemExit("the JupyterLab extension is not installed: run scripts/setup")
    work = B.scratch("jupyterlab")
    corpus = B.copy_corpus(work)
    sample = torch_sample(corpus)
    t0 = time.time()
    with_ext = run_pass("extension", work, corpus, sample, extension=True)
    without = run_pass("no_extension", work, corpus, sample, extension=False)
    on, off = figures(with_ext), figures(without)
    ratio = (
        on["slow_median_start_ms"] / off["slow_median_start_ms"]
        if on["slow_median_start_ms"] is not None and off["slow_median_start_ms"]
        else None
    )
    result = {
        "bench": "jupyterlab",
        "prepared_fraction": on["prepared_fraction"],
        "within_1s": on["within_1s"],
        "median_start_ms": on["median_start_ms"],
        "median_start_ms_no_extension": off["median_start_ms"],
        "slow_cells_start_ratio": ratio,
        "slow_median_start_ms": on["slow_median_start_ms"],
        "slow_median_start_ms_no_extension": off["slow_median_start_ms"],
        "targets": {
            **{f"{k}_target": v for k, v in TARGETS.items()},
            "prepared_fraction_met": (on["prepared_fraction"] or 0) >= TARGETS["prepared_fraction"],
            "within_1s_met": (on["within_1s"] or 0) >= TARGETS["within_1s"],
            "slow_cells_start_ratio_met": ratio is not None and ratio <= TARGETS["slow_cells_start_ratio"],
            "slow_cells_cold_over_300ms": (off["slow_median_start_ms"] or 0) > 300,
        },
        "extension": on,
        "no_extension": off,
        "sample": [{k: s[k] for k in ("notebook", "cell", "source")} for s in sample]
        + [{"notebook": SLOW_NOTEBOOK, "cell": k + 1, "source": s} for k, s in enumerate(SLOW_CELLS)],
        "slow_notebook_setup": SLOW_SETUP,
        "cells_extension": with_ext,
        "cells_no_extension": without,
        "setup": {
            "typing_cps": CPS,
            "typing": "text input one character at a time (no editor brackets or indentation); Run at once after",
            "kernel": "looseleaf kernel --all-gpu, its embedded cluster: 1 host, 2 virtual GPUs",
            "start_delay": "execute reply's metadata.looseleaf.start_delay_ms: the kernel sending Run to the "
            "cell's first line",
            "python": platform.python_version(),
            "wall_seconds": round(time.time() - t0, 1),
        },
    }
    path = B.write_result("jupyterlab", result)
    B.log(f"wrote {path}")
    print(json.dumps({k: result[k] for k in list(result)[:8]}, indent=2))


if __name__ == "__main__":
    main()
