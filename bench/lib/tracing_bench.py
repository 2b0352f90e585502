"""bench/tracing: the cost of one trace per cell, exported over OTLP (issue 15).

Two arms, measured in the same run and alternating (off, on, on, off, ...) so that
drift on a shared machine falls on both:
- off: `looseleaf up` with OTEL_SDK_DISABLED=true (spans still tie messages
  together, nothing is exported);
- on: `looseleaf up` exporting every span to an OTLP/HTTP receiver on loopback (a
  stand-in for a collector: it takes the protobuf and answers 200), with the SDK's
  default batch settings.
Each arm runs the cold-start bench's notebooks with `looseleaf run --all-gpu`; the
figure is the ratio of the median cold start with tracing to without
(`tracing_overhead_ratio`, target <= 1.05), beside the raw medians, the p95s, the
notebooks' wall times, what the receiver got, each round's median (the noise), and
a paired figure: the median over cells of what tracing adds to the same cell.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B  # noqa: E402
import cold_start as C  # noqa: E402

TARGET_RATIO = 1.05


def run_arm(arm: str, env: dict, corpus: Path, work: Path) -> tuple[list[dict], float]:
    """The notebooks through one cluster; (cells, summed notebook wall seconds)."""
    cluster = B.Cluster(work / "data", virtual_gpus=2, env=env)
    cells, wall = [], 0.0
    try:
        cluster.wait_ready()
        for name in C.NOTEBOOKS:
            out_dir = work / Path(name).parent
            out_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            report = B.run_notebook(corpus / name, cluster.url, out_dir)
            wall += time.monotonic() - t0
            for c in report["cells"]:
                cells.append({"arm": arm, "notebook": name, **{k: c.get(k) for k in C_KEYS}})
    finally:
        cluster.stop()
    return cells, wall


C_KEYS = ["index", "prepare", "start_delay_ms", "restored_bytes", "status"]


def paired_overhead(cells: list[dict]) -> dict:
    """What tracing adds to the same cold cell: for each (notebook, cell) cold in
    both arms, the difference of its median start delay with and without tracing;
    the median of those differences, and 1 + that over the median start without."""
    by_cell: dict[tuple, dict[str, list]] = {}
    for c in cells:
        if C.is_cold(c):
            by_cell.setdefault((c["notebook"], c["index"]), {"on": [], "off": []})[c["arm"]].append(c["start_delay_ms"])
    both = [v for v in by_cell.values() if v["on"] and v["off"]]
    if not both:
        return {"overhead_ms": None, "ratio": None, "cells": 0}
    diffs = [B.median(v["on"]) - B.median(v["off"]) for v in both]
    base = B.median([B.median(v["off"]) for v in both])
    overhead = B.median(diffs)
    return {"overhead_ms": overhead, "ratio": 1 + overhead / base if base else None, "cells": len(both)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4, help="(off, on) pairs, in ABBA order")
    args = ap.parse_args()
    started = time.monotonic()
    B.ensure_release()
    work = B.scratch("tracing")
    corpus = B.copy_corpus(work)
    receiver = B.OtlpReceiver()
    arms = {
        "off": {"OTEL_SDK_DISABLED": "true"},
        "on": receiver.env(),
    }
    order = []
    for i in range(args.pairs):
        order += ["off", "on"] if i % 2 == 0 else ["on", "off"]
    cells, walls = [], {"off": [], "on": []}
    try:
        for i, arm in enumerate(order):
            env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            B.log(f"round {i}: tracing {arm}")
            got, wall = run_arm(arm, {**env, **arms[arm]}, corpus, work / f"round{i}-{arm}")
            cells += [{**c, "round": i} for c in got]
            walls[arm].append(wall)
            B.log(f"  {len(got)} cells, {wall:.1f} s; receiver has {receiver.requests} exports")
    finally:
        receiver.stop()
    cold = {arm: [c["start_delay_ms"] for c in cells if c["arm"] == arm and C.is_cold(c)] for arm in arms}
    # each round's median, to show how far rounds of the same arm differ (the noise)
    round_medians = []
    for i, arm in enumerate(order):
        in_round = [c["start_delay_ms"] for c in cells if c["round"] == i and C.is_cold(c)]
        round_medians.append({"arm": arm, "median_cold_ms": B.median(in_round)})
    if not cold["off"] or not cold["on"]:
        raise SystemExit("no cold cells measured in one arm")
    med = {arm: B.median(v) for arm, v in cold.items()}
    ratio = med["on"] / med["off"]
    paired = paired_overhead(cells)
    result = {
        "bench": "tracing",
        "tracing_overhead_ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "median_cold_ms_tracing_on": med["on"],
        "median_cold_ms_tracing_off": med["off"],
        # the same cells compared across arms: start delays are whole milliseconds
        # and rounds of one arm differ by more than the effect, so this says more
        # precisely what tracing adds to a cold start than the ratio of medians
        "paired_overhead_ms": paired["overhead_ms"],
        "paired_overhead_ratio": paired["ratio"],
        "paired_cells": paired["cells"],
        "p95_cold_ms_tracing_on": B.percentile(cold["on"], 0.95),
        "p95_cold_ms_tracing_off": B.percentile(cold["off"], 0.95),
        "cold_cells": {arm: len(v) for arm, v in cold.items()},
        "notebook_wall_s": walls,
        "wall_ratio": sum(walls["on"]) / sum(walls["off"]),
        "otlp_exports": receiver.requests,
        "otlp_bytes": receiver.bytes,
        "order": order,
        "round_medians": round_medians,
        "notebooks": C.NOTEBOOKS,
        "cold_start_ms": cold,
        "loadavg_end": os.getloadavg(),
        "wall_s": time.monotonic() - started,
    }
    path = B.write_result("tracing", result)
    B.log(
        f"median cold start {med['on']:.1f} ms with tracing, {med['off']:.1f} ms without: ratio {ratio:.3f} "
        f"(target <= {TARGET_RATIO}); {receiver.requests} exports, {receiver.bytes} bytes"
    )
    B.log(f"paired over {paired['cells']} cells: tracing adds {paired['overhead_ms']} ms (ratio {paired['ratio']})")
    B.log(f"wrote {path} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
