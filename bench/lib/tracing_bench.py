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
notebooks' wall times and what the receiver got.
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
    result = {
        "bench": "tracing",
        "tracing_overhead_ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "median_cold_ms_tracing_on": med["on"],
        "median_cold_ms_tracing_off": med["off"],
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
    B.log(f"wrote {path} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
