"""bench/cold-start: LooseLeaf's cold preparation against naive serverless and a
pinned kernel, the limit this machine allows, and the import cache (issue 5).

One run, all baselines measured in it:
1. limit: fork time of a process holding the base zygote's packages, and memcpy
   bandwidth (bench/lib/limit_probe.py);
2. LooseLeaf: `looseleaf up` exporting every cell's trace over OTLP to a receiver
   on loopback (as a deployment does; bench/tracing measures what that costs), and,
   run as root, each session's workers as a uid of their own (isolation); then
   the corpus notebooks with `looseleaf run --all-gpu`
   (edit then Run at once, so no speculation has time to finish); cells whose
   `prepare` is "cold" and whose restored bytes are under 100 MB; the zygote's
   packages and memory while it is up;
3. naive serverless on a sample of the same cells (bench/lib/naive_session.py, then
   one fresh process per cell, bench/lib/naive_child.py, timed from just before
   spawn to its READY line);
4. pinned kernel: `pass` in an already-running shell.
Writes bench/results/cold-start.json: the median and p95 cold start, where the host's
part of it goes (phases), the targets of issue 12 (within 2x of the limit, 50x naive),
the yardsticks' hashes and the naive baseline's spread across repetitions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B  # noqa: E402

LIB = Path(__file__).resolve().parent
NOTEBOOKS = [
    "kishu_nbexec_test_case_1.ipynb",
    "kishu_numpy.ipynb",
    "kishu_simple.ipynb",
    "kishu_test_unserializable_var.ipynb",
    "pdsh_02.02-The-Basics-Of-NumPy-Arrays.ipynb",
    "pdsh_03.02-Data-Indexing-and-Selection.ipynb",
    "pdsh_05.04-Feature-Engineering.ipynb",
    "torch/mrdbourke_01_pytorch_workflow.ipynb",
]
CLOSURE_LIMIT_BYTES = 100_000_000
TARGET_SPEEDUP = 50.0
TARGET_RATIO_TO_LIMIT = 2.0
TARGET_COLD_MS = 150.0
# The yardsticks LooseLeaf is compared with, frozen: their hashes go in the results,
# so a change to one shows (and the figures before and after it are not compared).
YARDSTICKS = ["limit_probe.py", "naive_child.py", "naive_session.py"]
# Where the host's part of a cold start goes (the report's `phases`).
PHASES = ["claim_ms", "fork_ms", "manifest_ms", "restore_file_ms", "imports_ms", "load_ms", "setup_ms"]


def measure_limit() -> dict:
    B.log("limit: fork time and memcpy bandwidth")
    out = subprocess.run(
        [str(B.PYTHON), str(LIB / "limit_probe.py")], check=True, capture_output=True, text=True, cwd=B.REPO
    )
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    probe["fork_ms_median"] = B.median(probe["fork_ms_samples"])
    return probe


def zygotes(cluster: B.Cluster) -> list[dict]:
    """The cluster's zygotes as its hosts report them (`looseleaf status`: id, pid,
    packages), with each one's memory. Forked processes keep the base zygote's
    command line, so /proc alone cannot tell a child zygote or a worker from it."""
    out = subprocess.run(
        [str(B.LOOSELEAF), "status", "--nats-url", cluster.nats_url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=B.REPO,
    )
    zs = []
    for line in out.stdout.splitlines():
        m = re.match(r"\s+zygote (\S+) pid (\d+): (.*)$", line)
        if not m:
            continue
        pid = int(m.group(2))
        try:
            mem = B.proc_memory(pid)
        except OSError:
            continue
        zs.append({"pid": pid, "id": m.group(1), "packages": [p for p in m.group(3).split(", ") if p], **mem})
    return zs


# Each session's workers run as a uid of their own from this range (ADR 29).
SESSION_UIDS = "200000-265535"


def isolation(corpus: Path) -> dict:
    """Isolation on, as a deployment runs it (issue 12 asks for the figure with
    it): each session's workers as a uid of their own, which needs root. The
    copied corpus becomes writable to those uids, as a session's directory is to
    its user. Returns the env for `looseleaf up` and what the JSON says."""
    if os.geteuid() != 0:
        return {"env": {}, "session_uids": None, "why_off": "not root: workers run as the host's user"}
    for d in [corpus, *corpus.rglob("*")]:
        d.chmod(0o777 if d.is_dir() else 0o666)
    return {"env": {"LOOSELEAF_SESSION_UIDS": SESSION_UIDS}, "session_uids": SESSION_UIDS, **bounds()}


def bounds() -> dict:
    """The workers' bounds `up` sets by default (ADR 52: memory, processes through
    cgroups; no cell timeout), and whether this machine can hold them."""
    own = Path("/proc/self/cgroup").read_text() if Path("/proc/self/cgroup").exists() else ""
    cgroups = os.geteuid() == 0 and any(":memory:" in line or line.startswith("0::") for line in own.splitlines())
    return {"bounds": "defaults: memory RAM/(slots+1), 4096 processes, no cell timeout", "cgroups": cgroups}


def run_looseleaf(
    corpus: Path, work: Path, rounds: int, traces: B.OtlpReceiver, iso: dict
) -> tuple[list[dict], list[dict], list[dict]]:
    """Every notebook `rounds` times through one cluster, exporting every cell's trace
    to `traces` as a deployment would to its collector (issue 15), with `iso`'s
    isolation. Returns (cells, runs, zygotes)."""
    B.log(f"LooseLeaf: looseleaf up --virtual-gpus 2, tracing exported over OTLP, session uids {iso['session_uids']}")
    cluster = B.Cluster(work / "data", virtual_gpus=2, env={**traces.env(), **iso["env"]})
    cells, runs = [], []
    try:
        cluster.wait_ready()
        B.log(f"  up at {cluster.url}")
        for rnd in range(rounds):
            for name in NOTEBOOKS:
                nb = corpus / name
                out_dir = work / f"round{rnd}" / Path(name).parent
                out_dir.mkdir(parents=True, exist_ok=True)
                t0 = time.monotonic()
                report = B.run_notebook(nb, cluster.url, out_dir)
                wall = time.monotonic() - t0
                t = report["totals"]
                runs.append(
                    {
                        "round": rnd,
                        "notebook": name,
                        "cells": t["cells"],
                        "ok": t["ok"],
                        "errors": t["errors"],
                        "wall_s": wall,
                    }
                )
                B.log(f"  round {rnd} {name}: {t['cells']} cells, {t['errors']} errors, {wall:.1f} s")
                for c in report["cells"]:
                    cells.append(
                        {
                            "round": rnd,
                            "notebook": name,
                            "index": c["index"],
                            "prepare": c["prepare"],
                            "start_delay_ms": c["start_delay_ms"],
                            "restored_bytes": c["restored_bytes"],
                            "closure": c["closure"],
                            "imports": c["imports"],
                            "status": c["status"],
                            "import_cache_hit": c.get("import_cache_hit"),
                            "phases": c.get("phases"),
                        }
                    )
        zs = zygotes(cluster)
    finally:
        cluster.stop()
    return cells, runs, zs


def is_cold(c: dict) -> bool:
    return (
        c["prepare"] == "cold" and c["start_delay_ms"] is not None and (c["restored_bytes"] or 0) < CLOSURE_LIMIT_BYTES
    )


def choose_sample(cold: list[dict], n: int) -> list[tuple[str, int, list[str]]]:
    """Evenly spaced (notebook, index, recipe imports) among the distinct cold cells."""
    keys = list({(c["notebook"], c["index"]): (c["notebook"], c["index"], c["imports"]) for c in cold}.values())
    if len(keys) <= n:
        return keys
    step = len(keys) / n
    return [keys[int(i * step)] for i in range(n)]


def time_child_reps(snap_json: Path, reps: int) -> tuple[list[float], dict]:
    """`reps` timings of the same naive start (its spread is the baseline's noise)."""
    times, breakdown = [], {}
    for _ in range(reps):
        ms, breakdown = time_child(snap_json)
        times.append(ms)
    return times, breakdown


def time_child(snap_json: Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [str(B.PYTHON), str(LIB / "naive_child.py"), str(snap_json)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = ""
    for line in p.stdout:
        if line.startswith("READY "):
            break
    ms = (time.perf_counter() - t0) * 1000
    rc = p.wait()
    if not line.startswith("READY "):
        raise RuntimeError(f"naive child failed ({rc}): {p.stderr.read()[-2000:]}")
    return ms, json.loads(line[len("READY ") :])


def run_naive(
    corpus: Path, work: Path, sample: list[tuple[str, int, list[str]]], pinned_reps: int, reps: int
) -> tuple[list[dict], dict]:
    """For each sampled cell: the plain-IPython session up to it, dumped; a fresh process
    that imports and loads it, timed. Returns (per-cell figures, pinned figure)."""
    by_nb: dict[str, list[int]] = {}
    recipe_imports = {}
    for name, idx, imports in sample:
        by_nb.setdefault(name, []).append(idx)
        recipe_imports[(name, idx)] = imports
    cells, pinned = [], []
    for name, indices in by_nb.items():
        out_dir = work / "naive" / Path(name).stem
        B.log(f"naive: session of {name} ({len(indices)} cells sampled)")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(out_dir.parent / f"{Path(name).stem}.session.log", "w") as logf:
            subprocess.run(
                [
                    str(B.PYTHON),
                    str(LIB / "naive_session.py"),
                    str(corpus / name),
                    str(out_dir),
                    "--cells",
                    ",".join(map(str, indices)),
                    "--pinned-reps",
                    str(pinned_reps),
                ],
                check=True,
                stdout=logf,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
        manifest = json.loads((out_dir / "session.json").read_text())
        if manifest["pinned"]:
            pinned.append(manifest["pinned"]["median_ms"])
        for idx in indices:
            snap = manifest["snapshots"].get(str(idx))
            if snap is None:
                continue
            snap["cwd"] = manifest["cwd"]
            # LooseLeaf imports the cell's own imports (its recipe's) before the first
            # line; so does the naive process, or it would be spared that work.
            snap["imports"] += [m for m in recipe_imports[(name, idx)] if m not in snap["imports"]]
            snap_json = out_dir / f"snap-{idx}.json"
            snap_json.write_text(json.dumps(snap))
            times, breakdown = time_child_reps(snap_json, reps)
            cells.append(
                {
                    "notebook": name,
                    "index": idx,
                    "start_ms": B.median(times),
                    "start_ms_reps": times,
                    "state_bytes": snap["state_bytes"],
                    "restored_names": breakdown["restored_names"],
                    "skipped": sorted(snap["skipped"]),
                    "imports": snap["imports"],
                    "breakdown": breakdown,
                }
            )
    return cells, {
        "median_ms": B.median(pinned),
        "per_notebook_median_ms": pinned,
        "reps": pinned_reps,
        "what": "time to run `pass` in an already-running IPython InteractiveShell",
    }


def phase_summary(cold: list[dict]) -> dict:
    """Median and p95 of each host phase over the cold cells that report them, and
    of what the phases do not cover (frontend, planner, bus)."""
    with_phases = [c for c in cold if c.get("phases")]
    out = {
        "what": "the host's phases of each cold cell's start (report field `phases`: from the run recipe's "
        "arrival at the host to the cell's first line); bus_and_planner_ms is the start delay minus "
        "their sum: the frontend, the planner and the NATS hops between them",
        "cells": len(with_phases),
    }
    for k in PHASES:
        xs = [c["phases"][k] for c in with_phases]
        out[k] = {"median": B.median(xs), "p95": B.percentile(xs, 0.95)}
    rest = [c["start_delay_ms"] - sum(c["phases"][k] for k in PHASES) for c in with_phases]
    out["bus_and_planner_ms"] = {"median": B.median(rest), "p95": B.percentile(rest, 0.95)}
    return out


def naive_spread(naive: list[dict]) -> dict:
    """How much the naive baseline moves across repetitions of the same cells."""
    reps = min((len(c["start_ms_reps"]) for c in naive), default=0)
    per_rep = [B.median([c["start_ms_reps"][i] for c in naive]) for i in range(reps)]
    rel = [(max(c["start_ms_reps"]) - min(c["start_ms_reps"])) / B.median(c["start_ms_reps"]) for c in naive]
    return {
        "what": "each sampled cell's naive start timed `reps` times in a row: the median over cells of "
        "each repetition, and the median per-cell spread (max - min) / median",
        "reps": reps,
        "median_ms_per_rep": per_rep,
        "median_relative_spread": B.median(rel),
    }


def yardstick_hashes() -> dict:
    return {name: hashlib.sha256((LIB / name).read_bytes()).hexdigest() for name in YARDSTICKS}


def import_hit(imports: list[str], zygote_packages: set[str]) -> tuple[bool, list[str]]:
    """All of a recipe's imports in the zygote: top-level package imported there, or stdlib."""
    misses = [
        m for m in imports if m.split(".")[0] not in zygote_packages and m.split(".")[0] not in sys.stdlib_module_names
    ]
    return not misses, misses


def isolation_cost(cold_ms: list[float], open_cells: list[dict]) -> dict:
    """Median cold start with session uids and bounds on (the figure) and off."""
    open_ms = [c["start_delay_ms"] for c in open_cells if is_cold(c)]
    on, off = B.median(cold_ms), B.median(open_ms)
    return {
        "what": "median cold start with session uids and default bounds (the figures above), and without, same run",
        "median_cold_ms_on": on,
        "median_cold_ms_off": off,
        "p95_cold_ms_on": B.percentile(cold_ms, 0.95),
        "p95_cold_ms_off": B.percentile(open_ms, 0.95),
        "cells_off": len(open_ms),
        "cost_ms": on - off,
    }


def summarize(
    limit: dict,
    ll_cells: list[dict],
    runs: list[dict],
    zs: list[dict],
    naive: list[dict],
    pinned: dict,
    args,
    wall_s: float,
) -> dict:
    cold = [c for c in ll_cells if is_cold(c)]
    cold_ms = [c["start_delay_ms"] for c in cold]
    naive_ms = [c["start_ms"] for c in naive]
    median_cold = B.median(cold_ms)
    median_naive = B.median(naive_ms)

    # The limit per cold cell: one fork plus copying its closure bytes once.
    bw = limit["memcpy_bytes_per_s"]
    fork_ms = limit["fork_ms_median"]
    limits = [fork_ms + (c["restored_bytes"] or 0) / bw * 1000 for c in cold]
    limit_ms = B.median(limits)

    # Paired view: the same cells under both.
    naive_by_key = {(c["notebook"], c["index"]): c["start_ms"] for c in naive}
    paired = [
        (c["start_delay_ms"], naive_by_key[(c["notebook"], c["index"])])
        for c in cold
        if (c["notebook"], c["index"]) in naive_by_key
    ]

    base = zs[0] if zs else None  # status lists the base zygote first, then its children
    zpkgs = set(base["packages"]) if base else set()
    hits, missed = 0, {}
    mod_total = mod_hits = 0
    for c in cold:
        ok, misses = import_hit(c["imports"], zpkgs)
        # the host says whether the worker's zygote (base or child) had every
        # package already; the base-only estimate is kept for older reports
        if c.get("import_cache_hit") is not None:
            ok = c["import_cache_hit"]
        hits += ok
        for m in misses:
            missed[m.split(".")[0]] = missed.get(m.split(".")[0], 0) + 1
        mod_total += len(c["imports"])
        mod_hits += len(c["imports"]) - len(misses)

    not_cold = {}
    for c in ll_cells:
        if not is_cold(c):
            why = (
                f"prepare={c['prepare']}"
                if c["prepare"] != "cold"
                else ("no start" if c["start_delay_ms"] is None else "closure >= 100 MB")
            )
            not_cold[why] = not_cold.get(why, 0) + 1

    speedup = median_naive / median_cold if median_cold and median_naive else None
    ratio = median_cold / limit_ms if median_cold and limit_ms else None
    return {
        "bench": "cold-start",
        # every cell's trace exported over OTLP while LooseLeaf was measured (issue 15)
        "tracing": {"exported": True, "otlp_exports": args.otlp_exports, "otlp_bytes": args.otlp_bytes},
        # workers isolated per session as a deployment runs them (issue 12), bounded
        # by default (issue 34); and the same cells without either in the same run
        "isolation": {k: v for k, v in args.isolation.items() if k != "env"},
        "isolation_and_bounds_cost": isolation_cost(cold_ms, args.open_cells),
        "median_cold_ms": median_cold,
        "p95_cold_ms": B.percentile(cold_ms, 0.95),
        "median_naive_ms": median_naive,
        "speedup_vs_naive": speedup,
        "limit_ms": limit_ms,
        "ratio_to_limit": ratio,
        "import_cache_hit_rate": hits / len(cold) if cold else None,
        "targets": {
            "speedup_vs_naive_at_least": TARGET_SPEEDUP,
            "ratio_to_limit_at_most": TARGET_RATIO_TO_LIMIT,
            "median_cold_ms_under": TARGET_COLD_MS,
            "speedup_met": speedup is not None and speedup >= TARGET_SPEEDUP,
            "ratio_met": ratio is not None and ratio <= TARGET_RATIO_TO_LIMIT,
            "cold_ms_met": median_cold is not None and median_cold < TARGET_COLD_MS,
        },
        "phases": phase_summary(cold),
        "yardsticks": {
            "what": "sha256 of the limit probe and the naive baseline: frozen, so figures from runs with "
            "different hashes are not comparable",
            "sha256": yardstick_hashes(),
        },
        "looseleaf": {
            "what": "start_delay_ms (Run, or the previous cell's end if later, to the cell's first line) of "
            "cells with prepare == 'cold' and restored_bytes < 100 MB; `looseleaf run --all-gpu` "
            "sends each cell's edit then its Run at once, so no speculation is ready",
            "cold_cells": len(cold),
            "p25_ms": B.percentile(cold_ms, 0.25),
            "p75_ms": B.percentile(cold_ms, 0.75),
            "p95_ms": B.percentile(cold_ms, 0.95),
            "max_ms": max(cold_ms) if cold_ms else None,
            "median_restored_bytes": B.median([c["restored_bytes"] or 0 for c in cold]),
            "max_restored_bytes": max((c["restored_bytes"] or 0 for c in cold), default=None),
            "excluded_cells": not_cold,
            "runs": runs,
            "cells": [
                {
                    k: c[k]
                    for k in (
                        "round",
                        "notebook",
                        "index",
                        "start_delay_ms",
                        "restored_bytes",
                        "closure",
                        "imports",
                        "status",
                        "phases",
                    )
                }
                for c in cold
            ],
        },
        "naive": {
            "what": "fresh `python` (same venv) that imports every top-level package the plain-IPython "
            "session had imported beyond IPython's own (plus IPython, dill and the modules of the cell's "
            "LooseLeaf recipe, which LooseLeaf also imports before the first line), dill-loads the whole "
            "user namespace saved just before the cell (modules by name; unpicklable values skipped), "
            "and pushes it into an InteractiveShell; timed from just before spawn to its READY line",
            "cells_sampled": len(naive),
            "p25_ms": B.percentile(naive_ms, 0.25),
            "p75_ms": B.percentile(naive_ms, 0.75),
            "median_in_process_ms": B.median([c["breakdown"]["in_process_ms"] for c in naive]),
            "median_imports_ms": B.median([c["breakdown"]["imports_ms"] for c in naive]),
            "median_load_ms": B.median([c["breakdown"]["load_ms"] for c in naive]),
            "median_shell_ms": B.median([c["breakdown"]["shell_ms"] for c in naive]),
            "median_state_bytes": B.median([c["state_bytes"] for c in naive]),
            "spread": naive_spread(naive),
            "cells": naive,
        },
        "paired": {
            "what": "the sampled cells only, LooseLeaf (every round) against naive",
            "pairs": len(paired),
            "median_cold_ms": B.median([p[0] for p in paired]),
            "median_naive_ms": B.median([p[1] for p in paired]),
            "median_per_cell_speedup": B.median([p[1] / p[0] for p in paired if p[0] > 0]),
        },
        "pinned_kernel": pinned,
        "limit": {
            "what": "per cold cell: median zygote-like fork time + restored_bytes / memcpy bandwidth; "
            "limit_ms is the median over the cold cells",
            "fork_ms_median": fork_ms,
            "fork_ms_samples": limit["fork_ms_samples"],
            "fork_parent_packages": limit["parent_packages"],
            "fork_parent_rss_bytes": limit["parent_rss_bytes"],
            "memcpy_bytes": limit["memcpy_bytes"],
            "memcpy_s_samples": limit["memcpy_s_samples"],
            "memcpy_bytes_per_s": bw,
            "closure_bytes": [c["restored_bytes"] or 0 for c in cold],
            "per_cell_limit_ms": limits,
        },
        "import_cache": {
            "what": "a cold cell hits when the zygote its worker forked from (base or child) had already "
            "imported every package of its import closure (report field import_cache_hit, set by "
            "the host); module_hit_rate and missed_packages compare with the base zygote only",
            "zygote_packages": sorted(zpkgs),
            "zygotes": zs,
            "zygote_rss_bytes": sum(z.get("rss_bytes", 0) for z in zs),
            "zygote_pss_bytes": sum(z.get("pss_bytes", 0) for z in zs),
            "cells": len(cold),
            "hits": hits,
            "module_hit_rate": mod_hits / mod_total if mod_total else None,
            "missed_packages": dict(sorted(missed.items(), key=lambda kv: -kv[1])),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": args.loadavg_start,
            "loadavg_end": os.getloadavg(),
            "python": platform.python_version(),
            "git_rev": _git_rev(),
            "rounds": args.rounds,
            "wall_s": wall_s,
        },
    }


def _git_rev() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=B.REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="times each notebook runs through LooseLeaf")
    ap.add_argument("--naive-cells", type=int, default=40, help="cells sampled for naive serverless (>= 30)")
    ap.add_argument("--pinned-reps", type=int, default=200)
    ap.add_argument("--naive-reps", type=int, default=3, help="timings of each sampled naive start")
    args = ap.parse_args()
    started = time.monotonic()
    args.loadavg_start = os.getloadavg()
    B.ensure_release()
    work = B.scratch("cold-start")
    corpus = B.copy_corpus(work)
    limit = measure_limit()
    B.log(f"  fork {limit['fork_ms_median']:.2f} ms, memcpy {limit['memcpy_bytes_per_s'] / 1e9:.2f} GB/s")
    traces = B.OtlpReceiver()
    try:
        args.isolation = isolation(corpus)
        ll_cells, runs, zs = run_looseleaf(corpus, work / "looseleaf", args.rounds, traces, args.isolation)
        # the same again with neither session uids nor bounds: what they cost, in one run
        open_iso = {"env": {"LOOSELEAF_WORKER_MEMORY_BYTES": "0", "LOOSELEAF_WORKER_PIDS": "0"}, "session_uids": None}
        args.open_cells, _, _ = run_looseleaf(corpus, work / "looseleaf-open", args.rounds, traces, open_iso)
    finally:
        traces.stop()
    args.otlp_exports, args.otlp_bytes = traces.requests, traces.bytes
    if not traces.requests:
        raise SystemExit("tracing was on but no span reached the OTLP receiver")
    cold = [c for c in ll_cells if is_cold(c)]
    if not cold:
        raise SystemExit("no cold cells measured")
    sample = choose_sample(cold, max(args.naive_cells, 30))
    naive, pinned = run_naive(corpus, work, sample, args.pinned_reps, args.naive_reps)
    result = summarize(limit, ll_cells, runs, zs, naive, pinned, args, time.monotonic() - started)
    path = B.write_result("cold-start", result)
    B.log(
        f"median cold {result['median_cold_ms']:.1f} ms (p95 {result['p95_cold_ms']:.0f}; {len(cold)} cells), naive "
        f"{result['median_naive_ms']:.0f} ms ({len(naive)} cells): {result['speedup_vs_naive']:.1f}x; "
        f"limit {result['limit_ms']:.1f} ms (ratio {result['ratio_to_limit']:.1f}); pinned "
        f"{pinned['median_ms']:.2f} ms; import cache hit rate {result['import_cache_hit_rate']:.2f}"
    )
    B.log(f"wrote {path} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
