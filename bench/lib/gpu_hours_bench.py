"""bench/gpu-hours: GPU-hours and start delays of every policy on replayed notebook
sessions (`looseleaf simulate`, issue 17), and the simulator checked against the
real system.

1. Simulation: `looseleaf simulate` on the base synthetic workload of
   ../shared/anchors/workloads.md at 24, 48, 72, 720 and 2,400 sessions (a team's
   GPU pool, issue "Scale"), the trace-derived
   workload, the sensitivity variants and the runs with NotebookOS's reserved
   floor. Its plots and Markdown summary go to bench/results/gpu-hours/.
2. Validation, run 3 times: a real cluster of 2 hosts with 2 virtual GPUs each,
   with the hosts' own rule (staged preparation: no prepared worker holds a slot,
   ADR 70), runs 6 corpus notebooks and a session whose closure holds a
   GPU-resident gigabyte (a `looseleaf_worker.virtual_gpu` array, the stand-in of
   ADR 72) at once, each typed at 20 characters a second (`looseleaf run
   --all-gpu --typing-cps 20`). The same sessions are then simulated from their
   REPORT.json files on the same cluster, with LooseLeaf's start costs taken from
   those reports. Errors: GPU-slot seconds (relative), share started within 1 s
   (absolute, in points of a fraction) and median start delay (relative); the
   top-level errors are the worst of the 3 runs, each run's are under
   `validation.runs`.

Writes bench/results/gpu-hours.json: per load (`s24`, `s48`, `s72`, `s720`,
`s2400`, `trace`) `{policy}_gpu_hours`, `_within_1s`, `_p50_start_ms`,
`_p99_start_ms`, `_completion_overhead_ms_p50` and `_p99` (a GPU cell's end
against a pinned run of the same cell, started at Run) and LooseLeaf's
reductions; at the top level LooseLeaf's worst `looseleaf_within_1s`,
`looseleaf_p99_start_ms` and `looseleaf_completion_overhead_ms_p50`/`_p99` over
the base loads, the
closures-10x variant's within 1 s, and the validation errors, with the raw
figures behind them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B  # noqa: E402

NOTEBOOKS = [*B.TYPED_NOTEBOOKS, "gpu-gigabyte.ipynb"]
TYPING_CPS = 20.0
BASE_LOADS = ["s24", "s48", "s72", "s720", "s2400"]
LOADS = [*BASE_LOADS, "trace"]
TARGETS = {
    "reduction_vs_pinned": {"s24": 0.43, "s48": 0.63, "s72": 0.70, "s720": 0.90, "s2400": 0.90},
    "reduction_vs_notebookos": {"s24": 0.55, "s48": 0.32, "s72": 0.32, "s720": 0.30, "s2400": 0.30},
    "looseleaf_within_1s": 0.995,
    "looseleaf_p99_start_ms": 1000.0,
    "closures_10x_within_1s": 0.98,
    "looseleaf_completion_overhead_ms_p50": 50.0,
    "looseleaf_completion_overhead_ms_p99": 1000.0,
    "validation_slot_seconds_error": 0.10,
    "validation_within_1s_error": 0.02,
    "validation_median_start_error": 0.25,
}


def simulate(out: Path, *args: str) -> dict:
    cmd = [str(B.LOOSELEAF), "simulate", "--out", str(out), "--python", str(B.PYTHON), *args]
    B.log(" ".join(cmd[1:]))
    started = time.monotonic()
    subprocess.run(cmd, cwd=B.REPO, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((out / "simulation.json").read_text())
    result["_wall_s"] = time.monotonic() - started
    return result


RUNS = 3
GIGABYTE_NOTEBOOK = "gpu-gigabyte.ipynb"
# A session whose closure holds a GPU-resident gigabyte, read by the cells after it.
GIGABYTE_CELLS = [
    "import numpy as np\nfrom looseleaf_worker.virtual_gpu import to_virtual_gpu\n"
    "weights = to_virtual_gpu(np.random.default_rng(0).random(2**28, dtype=np.float32))",
    "scale = 0.5\nnorm = float(weights.sum()) * scale\nprint(norm)",
    "top = float(np.asarray(weights)[:1000].max())\nprint(top)",
    "half = float(weights.data[: weights.shape[0] // 2].mean())\nprint(half)",
    "print(round(norm / half, 3), top <= 1.0)",
]


def write_gigabyte_notebook(corpus: Path) -> None:
    cells = [
        {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
        for src in GIGABYTE_CELLS
    ]
    nb = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": cells,
    }
    (corpus / GIGABYTE_NOTEBOOK).write_text(json.dumps(nb))


def real_run(work: Path, corpus: Path) -> list[Path]:
    """The notebooks at once on 2 hosts x 2 virtual GPUs; their report files."""
    env = {"LOOSELEAF_HOSTS": "2"}
    cluster = B.Cluster(work / "data", virtual_gpus=2, env=env)
    reports: dict[str, Path] = {}
    errors: list[str] = []

    def one(nb: str) -> None:
        d = work / Path(nb).stem
        d.mkdir(parents=True)
        try:
            extra = ["--typing-cps", str(TYPING_CPS)]
            B.run_notebook(corpus / nb, cluster.url, d, all_gpu=True, timeout=600, extra=extra)
            reports[nb] = d / f"{Path(nb).stem}.report.json"
        except Exception as e:  # noqa: BLE001 (reported below, with the notebook)
            errors.append(f"{nb}: {e}")

    try:
        cluster.wait_ready()
        threads = [threading.Thread(target=one, args=(nb,)) for nb in NOTEBOOKS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        cluster.stop()
    if errors:
        raise SystemExit(f"real runs failed: {errors} (see {work})")
    return [reports[nb] for nb in NOTEBOOKS]


def real_figures(paths: list[Path]) -> dict:
    reports = [json.loads(p.read_text()) for p in paths]
    cells = [c for r in reports for c in r["cells"]]
    gpu = [c for c in cells if c["device"] == "gpu" and c.get("start_delay_ms") is not None]
    delays = [c["start_delay_ms"] for c in gpu]
    return {
        "gpu_slot_seconds": sum(r["totals"]["gpu_slot_seconds"] for r in reports),
        "within_1s": sum(1 for d in delays if d <= 1000) / len(delays),
        "median_start_ms": B.median(delays),
        "gpu_cells": len(gpu),
        "prepared_cells": sum(r["totals"]["speculation"]["prepared_cells"] for r in reports),
        "clean_hits": sum(r["totals"]["speculation"]["clean_hits"] for r in reports),
    }


def validate(work: Path, corpus: Path, recorded: Path) -> dict:
    """One validation run: the notebooks on a real cluster, then simulated from
    their reports; the real and simulated figures and the errors."""
    B.log(f"validation ({work.name}): {len(NOTEBOOKS)} notebooks typed at once on 2 hosts x 2 virtual GPUs")
    paths = real_run(work / "real", corpus)
    real = real_figures(paths)
    recorded.mkdir(parents=True)
    for p in paths:
        shutil.copy(p, recorded / p.name)
    vsim = simulate(
        work / "validation-sim",
        "--recorded",
        *[str(recorded / p.name) for p in paths],
        "--hosts",
        "2",
        "--gpus-per-host",
        "2",
        "--virtual-gpus",
        "--costs-from-reports",
        "--policies",
        "looseleaf",
        "--no-plots",
    )
    ll = vsim["loads"]["recorded"]["policies"][0]
    simulated = {
        "gpu_slot_seconds": ll["held_gpu_hours"] * 3600,
        "within_1s": ll["within_1s"],
        "median_start_ms": ll["p50_start_ms"],
        "gpu_cells": ll["gpu_cells"],
        "counters": ll["counters"],
    }
    errors = {
        "validation_slot_seconds_error": abs(simulated["gpu_slot_seconds"] - real["gpu_slot_seconds"])
        / real["gpu_slot_seconds"],
        "validation_within_1s_error": abs(simulated["within_1s"] - real["within_1s"]),
        "validation_median_start_error": abs(simulated["median_start_ms"] - real["median_start_ms"])
        / real["median_start_ms"],
    }
    B.log(f"validation ({work.name}): {errors}")
    return {"real": real, "simulated": simulated, "errors": errors}


def main() -> None:
    B.ensure_release()
    work = B.scratch("gpu-hours")
    figures = B.RESULTS / "gpu-hours"
    shutil.rmtree(figures, ignore_errors=True)
    sim = simulate(figures)
    (figures / "plot-data.json").unlink(missing_ok=True)  # drawn already; large

    corpus = B.copy_corpus(work)
    write_gigabyte_notebook(corpus)
    recorded = figures / "validation-reports"
    runs = [validate(work / f"run{n}", corpus, recorded / f"run{n}") for n in range(1, RUNS + 1)]
    names = ("validation_slot_seconds_error", "validation_within_1s_error", "validation_median_start_error")
    errors = {name: max(r["errors"][name] for r in runs) for name in names}

    result: dict = {"bench": "gpu-hours", **errors}
    for key in LOADS:
        load = sim["loads"][key]
        result[key] = {k: v for k, v in load.items() if k not in ("policies", "workload", "provisioning")}
    result["looseleaf_within_1s"] = min(result[k]["looseleaf_within_1s"] for k in BASE_LOADS)
    result["looseleaf_p99_start_ms"] = max(result[k]["looseleaf_p99_start_ms"] for k in BASE_LOADS)
    for q in ("p50", "p99"):
        key = f"looseleaf_completion_overhead_ms_{q}"
        result[key] = max(result[k][key] for k in BASE_LOADS)
    tenfold = next(k for k in sim["loads"] if k.endswith("closures-10x") or k.endswith("closures_10x"))
    result["closures_10x_within_1s"] = sim["loads"][tenfold]["looseleaf_within_1s"]
    met = {}
    for key in BASE_LOADS:
        for name in ("reduction_vs_pinned", "reduction_vs_notebookos"):
            met[f"{key}_{name}"] = result[key][name] >= TARGETS[name][key]
        met[f"{key}_looseleaf_within_1s"] = result[key]["looseleaf_within_1s"] >= TARGETS["looseleaf_within_1s"]
        p99 = result[key]["looseleaf_p99_start_ms"]
        met[f"{key}_looseleaf_p99_start_ms"] = p99 <= TARGETS["looseleaf_p99_start_ms"]
    met["closures_10x_within_1s"] = result["closures_10x_within_1s"] >= TARGETS["closures_10x_within_1s"]
    for q in ("p50", "p99"):
        key = f"looseleaf_completion_overhead_ms_{q}"
        met[key] = result[key] <= TARGETS[key]
    for name in names:
        met[name] = errors[name] <= TARGETS[name]
    result["targets"] = {**TARGETS, "met": met}
    result["validation"] = {
        "what": (
            "6 corpus notebooks and a session holding a GPU-resident gigabyte (virtual GPU stand-in) at once, "
            "typed at 20 characters a second (looseleaf run --all-gpu "
            "--typing-cps 20), on 2 hosts x 2 virtual GPUs with staged preparation (ADR 70); then the same "
            "sessions replayed from their REPORT.json files by looseleaf simulate on the same cluster, "
            "LooseLeaf's start costs taken from those reports"
        ),
        "notebooks": NOTEBOOKS,
        "gigabyte_notebook_cells": GIGABYTE_CELLS,
        "runs": runs,
        "reports": "bench/results/gpu-hours/validation-reports/runN/ (rerun a simulation: looseleaf simulate "
        "--recorded bench/results/gpu-hours/validation-reports/run1/*.json --hosts 2 --gpus-per-host 2 "
        "--virtual-gpus --costs-from-reports --policies looseleaf)",
    }
    result["simulation"] = {
        "command": "looseleaf simulate --out bench/results/gpu-hours",
        "wall_seconds": sim["wall_seconds"],
        "s72_looseleaf_wall_seconds": next(
            p["wall_s"] for p in sim["loads"]["s72"]["policies"] if p["policy"] == "looseleaf"
        ),
        "s72_all_policies_wall_seconds": sum(p["wall_s"] for p in sim["loads"]["s72"]["policies"]),
        "budget": sim["budget"],
        "costs": sim["costs_summary"],
        "cost_sources": sim["costs"]["sources"],
        "workload_params": {k: sim["loads"][k]["workload"] for k in LOADS},
        "provisioning": sim["loads"]["s24"]["provisioning"],
        "provisioning_floor_runs": sim["loads"]["s24_ec2_floor"]["provisioning"],
        "policies": {k: sim["loads"][k]["policies"] for k in sim["loads"]},
        "files": "bench/results/gpu-hours/ (summary.md, simulation.json, the PNG plots)",
    }
    path = B.write_result("gpu-hours", result)
    B.log(f"wrote {path}")
    print(json.dumps({k: v for k, v in result.items() if k.startswith("validation_")}, indent=2))
    print(json.dumps(met, indent=2))


if __name__ == "__main__":
    main()
