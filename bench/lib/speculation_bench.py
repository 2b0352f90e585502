"""bench/speculation: how many GPU cells start within a second of Run when workers
are prepared while the user types, against the same platform with speculation
off, in the same run (issue 6).

Corpus notebooks run with `looseleaf run --all-gpu --typing-cps 20`: each code cell
is replayed as typed at 20 characters a second (edits as the text grows), then Run;
the next cell's typing starts when the previous cell finished. Two clusters run at
the same time, one per mode (speculation on, `--no-speculation`), so both see the
same machine load. Two short runs of one notebook with every prepared worker
holding its GPU slot (as workers whose closure lives on a GPU do), one with the
default idle budget and one with a tight one, show that the budget bounds the
idle slot time speculation spends. A fifth run sends the same notebooks through
the services as processes with two planners, killing the one that holds the lease
3 s into the second notebook (`hit_rate_planner_killed`, ADR 60).

Figures (DESIGN.md section 10): a cell's start delay is Run (or the previous cell's
end, if later) to its first line. `hit_rate`: cells that ran on a prepared worker
that needed no refresh at Run, over GPU cells. `idle_slot_seconds`: slot time
speculatively prepared workers spent ready but unused (before their run or their
eviction); workers prepared on the CPU (no GPU-resident state) hold no slot and
add nothing. Writes bench/results/speculation.json.
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B  # noqa: E402

NOTEBOOKS = B.TYPED_NOTEBOOKS
TIGHT_BUDGET_NOTEBOOK = "pdsh_03.03-Operations-in-Pandas.ipynb"
TIGHT_IDLE_SECONDS = 5.0
TARGET_WITHIN_1S = 0.98
TARGET_MEDIAN_MS = 50.0
# the planner-killed run: its active planner dies this long into the second notebook
KILL_AFTER_S = 3.0
TARGET_HIT_RATE_PLANNER_KILLED = 0.9


def run_mode(
    name: str, work: Path, corpus: Path, extra: list[str], notebooks: list[str], env: dict | None, out: dict
) -> None:
    """Every notebook through one cluster of this mode; fills out[name]."""
    d = work / name
    d.mkdir(parents=True)
    cluster = B.Cluster(d / "data", virtual_gpus=2, env=env)
    reports = []
    try:
        cluster.wait_ready()
        for nb in notebooks:
            B.log(f"{name}: {nb}")
            reports.append((nb, B.run_notebook(corpus / nb, cluster.url, d, all_gpu=True, timeout=900, extra=extra)))
    finally:
        cluster.stop()
    out[name] = reports


def run_planner_killed(name: str, work: Path, corpus: Path, extra: list[str], notebooks: list[str], out: dict) -> None:
    """Every notebook through services run as processes with two planners (ADR 60);
    the one holding the lease is killed (SIGKILL) 3 s into the second notebook,
    while its first cell is typed; fills out[name]."""
    d = work / name
    d.mkdir(parents=True)
    services = B.Services(d / "services", planners=2)
    reports = []
    try:
        for i, nb in enumerate(notebooks):
            killer = threading.Timer(KILL_AFTER_S, services.kill, args=("planner-0",)) if i == 1 else None
            if killer:
                killer.start()
            B.log(f"{name}: {nb}")
            reports.append((nb, B.run_notebook(corpus / nb, services.url, d, all_gpu=True, timeout=900, extra=extra)))
            if killer:
                killer.join()
    finally:
        services.stop()
    out[name] = reports


def summary(reports: list) -> dict:
    cells = [c for _, r in reports for c in r["cells"]]
    gpu = [c for c in cells if c["device"] == "gpu" and c["start_delay_ms"] is not None]
    delays = [c["start_delay_ms"] for c in gpu]
    spec = [r["totals"]["speculation"] for _, r in reports]
    clean = sum(s["clean_hits"] for s in spec)
    return {
        "cells": len(cells),
        "gpu_cells_started": len(gpu),
        "errors": sum(1 for c in cells if c["status"] != "ok"),
        "within_1s": sum(1 for d in delays if d <= 1000) / len(delays) if delays else None,
        "median_start_ms": B.median(delays),
        "p95_start_ms": B.percentile(delays, 0.95),
        "max_start_ms": max(delays) if delays else None,
        "prepared_cells": sum(s["prepared_cells"] for s in spec),
        "clean_hits": clean,
        "hit_rate": clean / len(gpu) if gpu else None,
        "ready_events": sum(s["ready_events"] for s in spec),
        "unused_prepared": sum(s["unused"] for s in spec),
        "idle_slot_seconds": sum(s["speculative_idle_slot_seconds"] for s in spec),
        "idle_worker_seconds": sum(s["speculative_idle_worker_seconds"] for s in spec),
        "gpu_slot_seconds": sum(r["totals"]["gpu_slot_seconds"] for _, r in reports),
        "per_notebook": [
            {
                "notebook": nb,
                "cells": r["totals"]["cells"],
                "errors": r["totals"]["errors"],
                "median_start_ms": r["totals"]["median_start_delay_ms"],
                "idle_slot_seconds": r["totals"]["speculation"]["speculative_idle_slot_seconds"],
                "idle_worker_seconds": r["totals"]["speculation"]["speculative_idle_worker_seconds"],
                "wall_s": r["totals"]["wall_seconds"],
            }
            for nb, r in reports
        ],
        "slowest_cells": sorted(
            (
                {
                    "cell": c["cell_id"],
                    "start_delay_ms": c["start_delay_ms"],
                    "prepare": c["prepare"],
                    "refreshed": c.get("refreshed"),
                }
                for c in gpu
            ),
            key=lambda c: -c["start_delay_ms"],
        )[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--typing-cps", type=float, default=20.0)
    ap.add_argument("--notebooks", default=",".join(NOTEBOOKS))
    args = ap.parse_args()
    B.ensure_release()
    work = B.scratch("speculation")
    corpus = B.copy_corpus(work)
    notebooks = args.notebooks.split(",")
    typing = ["--typing-cps", str(args.typing_cps)]
    out: dict = {}
    modes = [
        ("speculation", typing, notebooks, None),
        ("no_speculation", typing + ["--no-speculation"], notebooks, None),
        # workers whose closure lives on a GPU hold their slot while they wait (on
        # CPU-only machines none do, so force it): the idle budget must bound that
        ("holds_slot", typing, [TIGHT_BUDGET_NOTEBOOK], {"LOOSELEAF_PREPARE_HOLDS_SLOT": "true"}),
        (
            "tight_budget",
            typing,
            [TIGHT_BUDGET_NOTEBOOK],
            {"LOOSELEAF_PREPARE_HOLDS_SLOT": "true", "LOOSELEAF_IDLE_GPU_SECONDS": str(TIGHT_IDLE_SECONDS)},
        ),
    ]
    threads = [
        threading.Thread(target=run_mode, args=(name, work, corpus, extra, nbs, env, out))
        for name, extra, nbs, env in modes
    ]
    threads.append(
        threading.Thread(target=run_planner_killed, args=("planner_killed", work, corpus, typing, notebooks, out))
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [name for name in [m[0] for m in modes] + ["planner_killed"] if name not in out]
    if missing:
        raise SystemExit(f"modes failed: {missing} (see bench/work/speculation/*/up.log)")
    spec, nospec, holds, tight, killed = (
        summary(out[m]) for m in ("speculation", "no_speculation", "holds_slot", "tight_budget", "planner_killed")
    )
    result = {
        "bench": "speculation",
        "within_1s": spec["within_1s"],
        "median_start_ms": spec["median_start_ms"],
        "within_1s_no_spec": nospec["within_1s"],
        "median_start_ms_no_spec": nospec["median_start_ms"],
        "idle_slot_seconds": spec["idle_slot_seconds"],
        "hit_rate": spec["hit_rate"],
        # two planners, the active one killed mid-run (ADR 60): the standby takes over
        "hit_rate_planner_killed": killed["hit_rate"],
        "within_1s_planner_killed": killed["within_1s"],
        "errors_planner_killed": killed["errors"],
        "targets": {
            "within_1s_at_least": TARGET_WITHIN_1S,
            "median_start_ms_under": TARGET_MEDIAN_MS,
            "within_1s_met": (spec["within_1s"] or 0) >= TARGET_WITHIN_1S,
            "median_met": (spec["median_start_ms"] or 1e9) < TARGET_MEDIAN_MS,
            "hit_rate_planner_killed_at_least": TARGET_HIT_RATE_PLANNER_KILLED,
            "hit_rate_planner_killed_met": (killed["hit_rate"] or 0) >= TARGET_HIT_RATE_PLANNER_KILLED,
        },
        "budget": {
            "what": (
                "idle GPU-slot seconds of speculative workers per session against the per-session idle "
                "budget (seconds an hour, ADR 50). Workers prepared on the CPU (closures without GPU-resident "
                "state, every one on "
                "this machine) hold no slot; to show the bound, one notebook also runs with every "
                "prepared worker holding its slot, with the default budget and with a tight one"
            ),
            # the planner's default (looseleaf_planner::DEFAULT_BUDGET)
            "default_idle_seconds_per_session_per_hour": 300.0,
            "default_prepared_per_host": 4,
            "slotless_max_session_idle_slot_seconds": max(n["idle_slot_seconds"] for n in spec["per_notebook"]),
            "holds_slot_notebook": TIGHT_BUDGET_NOTEBOOK,
            "holds_slot_default_budget_idle_slot_seconds": holds["idle_slot_seconds"],
            "holds_slot_default_budget_hit_rate": holds["hit_rate"],
            "tight_idle_seconds_per_session": TIGHT_IDLE_SECONDS,
            "holds_slot_tight_budget_idle_slot_seconds": tight["idle_slot_seconds"],
            "holds_slot_tight_budget_within_1s": tight["within_1s"],
            "holds_slot_tight_budget_hit_rate": tight["hit_rate"],
            "slotless_idle_slot_seconds_same_notebook": next(
                n["idle_slot_seconds"] for n in spec["per_notebook"] if n["notebook"] == TIGHT_BUDGET_NOTEBOOK
            ),
        },
        "setup": {
            "typing_cps": args.typing_cps,
            "notebooks": notebooks,
            "virtual_gpus": 2,
            "hosts": 1,
            "python": platform.python_version(),
            "start_delay": "Run (or the previous cell's end, if later) to the cell's first line",
        },
        "speculation": spec,
        "no_speculation": nospec,
        "holds_slot": holds,
        "tight_budget": tight,
        "planner_killed": killed,
    }
    path = B.write_result("speculation", result)
    B.log(
        f"within_1s {spec['within_1s']:.3f} (no spec {nospec['within_1s']:.3f}), median "
        f"{spec['median_start_ms']} ms (no spec {nospec['median_start_ms']} ms), hit rate {spec['hit_rate']:.2f}, "
        f"idle {spec['idle_slot_seconds']:.1f} s; planner killed: hit rate {killed['hit_rate']:.2f}, "
        f"{killed['errors']} errors; wrote {path}"
    )


if __name__ == "__main__":
    main()
