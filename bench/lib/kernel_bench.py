"""bench/kernel: round trips through the LooseLeaf Jupyter kernel (the Kernel issue),
each as a ratio to ipykernel's own, measured in the same run.

For each kernel (ipykernel's `python3`, and LooseLeaf's installed into a scratch
prefix, its cells on the session's CPU worker), a jupyter_client client times
execute_request to the idle status that ends it: an empty cell and a cell that
prints 1 MB, `--reps` times each after a warm-up, and complete_request and
inspect_request round trips answered from a variable a cell made.
Writes bench/results/kernel.json: `empty_cell_ratio` and `print_1mb_ratio` (p50,
with `_p99` beside them; targets 4 and 2 for a CPU cell), `complete_ms_p50` (target
under 50) and every kernel's raw figures; `complete_inferred_ms_p50` is completion
with every cell serverless, inferred from the session's code (no CPU worker). Then
every corpus notebook runs through
nbclient and a `--all-gpu` LooseLeaf kernel (every cell serverless) and nbequiv
compares it with a plain kernel: `notebooks_equal` of `notebooks_total`, and each
notebook's verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import nbformat
from benchlib import CORPUS, LOOSELEAF, PYTHON, REPO, WORK, ensure_release, log, percentile, scratch, write_result
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

TIMEOUT = 300
EMPTY = ""
PRINT_1MB = "print('x' * 1_000_000)"


def round_trip(kc, code: str) -> float:
    """Seconds from execute_request to the idle status it ends with."""
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "status"
            and msg["content"]["execution_state"] == "idle"
        ):
            break
    elapsed = time.perf_counter() - t0
    while True:  # its reply
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            assert reply["content"]["status"] == "ok", reply["content"]
            return elapsed


def query_trip(kc, kind: str, code: str) -> float:
    """Seconds from a complete_request (or inspect_request) to its reply, which
    must come from the live objects (the attribute of a variable a cell made)."""
    t0 = time.perf_counter()
    msg_id = kc.complete(code) if kind == "complete" else kc.inspect(code)
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            elapsed = time.perf_counter() - t0
            content = reply["content"]
            live = "move_to_end" in content.get("matches", []) or "OrderedDict" in str(content.get("data"))
            assert live, f"{kind} was not answered from the session's objects: {content}"
            return elapsed


def queries(kc, kernel: str) -> dict:
    """complete_request and inspect_request round trips on `my_table`, 50 each
    after one to warm up (the first use of jedi imports it)."""
    figures = {}
    for kind, code in (("complete", "my_table.move_"), ("inspect", "my_table")):
        query_trip(kc, kind, code)
        ms = [1000 * query_trip(kc, kind, code) for _ in range(50)]
        figures[kind] = {"p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99), "runs": len(ms)}
        log(f"{kernel}: {kind} p50 {figures[kind]['p50_ms']:.1f} ms p99 {figures[kind]['p99_ms']:.1f} ms")
    return figures


def measure(kernel: str, reps: int) -> dict:
    log(f"{kernel}: starting")
    km, kc = start_new_kernel(kernel_name=kernel, startup_timeout=TIMEOUT)
    try:
        for _ in range(5):  # warm up: the session's CPU worker, imports
            round_trip(kc, EMPTY)
            round_trip(kc, PRINT_1MB)
        round_trip(kc, "import collections\nmy_table = collections.OrderedDict(a=1)")
        figures = {}
        for name, code in (("empty_cell", EMPTY), ("print_1mb", PRINT_1MB)):
            ms = [1000 * round_trip(kc, code) for _ in range(reps)]
            figures[name] = {"p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99), "runs": len(ms)}
            log(f"{kernel}: {name} p50 {figures[name]['p50_ms']:.1f} ms p99 {figures[name]['p99_ms']:.1f} ms")
        return figures | queries(kc, kernel)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)  # a shutdown_request: the kernel stops its cluster


def measure_inferred(kernel: str) -> dict:
    """Completion and inspection with every cell serverless (no CPU worker): the
    kernel infers from the session's code (jedi), after a GPU cell made the name."""
    log(f"{kernel}: starting")
    km, kc = start_new_kernel(kernel_name=kernel, startup_timeout=TIMEOUT)
    try:
        round_trip(kc, "import collections\nmy_table = collections.OrderedDict(a=1)")
        return queries(kc, kernel)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def reads_uninitialised_memory(code: str) -> bool:
    """A cell that shows memory it never initialised (`np.empty`, `torch.empty`):
    what a process's allocator left there is not comparable across processes
    (tests/corpus.rs leaves such cells out too)."""
    return any(("empty(" in line.split("#")[0] or "empty_like(" in line.split("#")[0]) for line in code.splitlines())


def real_mismatches(verdict_path, nb) -> list[int]:
    """The code cells nbequiv found different, less those showing uninitialised memory."""
    try:
        verdict = json.loads(verdict_path.read_text())
    except (OSError, ValueError):
        return [-1]
    code = ["".join(c.source) for c in nb.cells if c.cell_type == "code"]
    mismatched = [c["cell"] for c in verdict.get("cells", []) if c["status"] == "mismatch"]
    return [i for i in mismatched if i >= len(code) or not reads_uninitialised_memory(code[i])]


def compare(source, executed, verdict, cache, runs: int):
    """nbequiv of `executed` against `runs` plain-kernel runs of `source` (kept in
    `cache`): (its output, whether every comparable cell matched)."""
    cmp = subprocess.run(
        [str(PYTHON), str(REPO.parent / "shared" / "tools" / "nbequiv.py"), str(source), str(executed)]
        + ["--cwd", str(source.parent), "--runs", str(runs), "--reference-cache", str(cache)]
        + ["--json", str(verdict)],
        capture_output=True,
        text=True,
    )
    return cmp, cmp.returncode == 0 or not real_mismatches(verdict, nbformat.read(source, 4))


def corpus_through_kernel(kernel: str, work) -> dict:
    """Every corpus notebook run by nbclient through the kernel (every cell
    serverless) and compared by nbequiv with a plain kernel's run. The notebooks
    run in a copy of the corpus at a fixed path with a reference cache of its own
    (outputs name the folder a notebook ran in)."""
    corpus = work / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    shutil.copytree(CORPUS, corpus)
    results = {}
    for source in sorted(corpus.rglob("*.ipynb")):
        rel = str(source.relative_to(corpus))
        executed = work / "executed" / rel
        executed.parent.mkdir(parents=True, exist_ok=True)
        nb = nbformat.read(source, as_version=4)
        t0 = time.perf_counter()
        error = None
        try:
            NotebookClient(
                nb,
                kernel_name=kernel,
                timeout=600,
                startup_timeout=300,
                allow_errors=True,  # as nbequiv runs the reference
                resources={"metadata": {"path": str(source.parent)}},
            ).execute()
        except Exception as e:  # noqa: BLE001 - recorded, the next notebook runs
            error = f"{type(e).__name__}: {e}"[:800]
        seconds = time.perf_counter() - t0
        nbformat.write(nb, executed)
        verdict = work / "verdicts" / (rel.replace("/", "__") + ".json")
        verdict.parent.mkdir(parents=True, exist_ok=True)
        cmp, same = compare(source, executed, verdict, WORK / "kernel-nbequiv-cache", 2)
        if error is None and not same:
            # a cell whose plain-kernel output varies run to run (an unseeded draw)
            # may have agreed twice in the cached reference: four fresh reference
            # runs, as tests/corpus.rs checks, mark it nondeterministic
            with tempfile.TemporaryDirectory() as fresh:
                cmp, same = compare(source, executed, verdict, fresh, 4)
        equal = error is None and same
        results[rel] = {"equal": equal, "seconds": round(seconds, 1), "error": error}
        if not equal:
            results[rel]["nbequiv"] = (cmp.stdout + cmp.stderr)[-1500:]
        log(f"{kernel}: {rel}: {'equal' if equal else 'DIFFERENT'} ({seconds:.0f} s)")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200, help="timed runs of each cell per kernel")
    args = ap.parse_args()
    ensure_release()
    work = scratch("kernel")
    prefix = work / "prefix"
    subprocess.run(
        [str(LOOSELEAF), "kernel", "install", "--prefix", str(prefix), "--name", "looseleaf-bench"], check=True
    )
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
    os.environ.setdefault("LOOSELEAF_PYTHON", str(PYTHON))
    os.environ.setdefault("LOOSELEAF_NATS_SERVER", str(REPO / ".venv" / "bin" / "nats-server"))
    os.environ["PATH"] = f"{PYTHON.parent}:{os.environ.get('PATH', '')}"
    os.chdir(work)
    ipykernel = measure("python3", args.reps)
    looseleaf = measure("looseleaf-bench", args.reps)
    subprocess.run(
        [str(LOOSELEAF), "kernel", "install", "--prefix", str(prefix), "--name", "looseleaf-bench-gpu", "--all-gpu"],
        check=True,
    )
    inferred = measure_inferred("looseleaf-bench-gpu")
    notebooks = corpus_through_kernel("looseleaf-bench-gpu", work)

    def ratio(name: str, q: str) -> float:
        return looseleaf[name][q] / ipykernel[name][q]

    result = {
        "empty_cell_ratio": ratio("empty_cell", "p50_ms"),
        "empty_cell_ratio_p99": ratio("empty_cell", "p99_ms"),
        "print_1mb_ratio": ratio("print_1mb", "p50_ms"),
        "print_1mb_ratio_p99": ratio("print_1mb", "p99_ms"),
        "complete_ms_p50": looseleaf["complete"]["p50_ms"],
        "complete_ms_p99": looseleaf["complete"]["p99_ms"],
        "complete_ratio": ratio("complete", "p50_ms"),
        "inspect_ms_p50": looseleaf["inspect"]["p50_ms"],
        # every reply was checked to name the live object's attribute (or type)
        "complete_served_from_objects": True,
        # every cell serverless (no CPU worker): inferred from the session's code
        "complete_inferred_ms_p50": inferred["complete"]["p50_ms"],
        "complete_inferred_ms_p99": inferred["complete"]["p99_ms"],
        "inspect_inferred_ms_p50": inferred["inspect"]["p50_ms"],
        "targets": {"empty_cell_ratio": 4, "print_1mb_ratio": 2, "complete_ms_p50": 50},
        "placement": "CPU cells (the session's persistent CPU worker)",
        # every corpus notebook through nbclient and the kernel, every cell serverless
        "notebooks_equal": sum(r["equal"] for r in notebooks.values()),
        "notebooks_total": len(notebooks),
        "notebooks": notebooks,
        "ipykernel": ipykernel,
        "looseleaf": looseleaf,
        "looseleaf_inferred": inferred,
        "reps": args.reps,
        "machine_cores": os.cpu_count(),
    }
    write_result("kernel", result)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
