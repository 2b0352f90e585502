"""Baselines for the checkpoint benchmark, each measured in fresh subprocesses.

    python checkpoint_baselines.py --work DIR [--arrays 100] [--array-bytes 10737418] [--reps 3]

The session ("the 1 GiB session"): ARRAYS float64 arrays a000, a001, ... of
ARRAY_BYTES each, filled from np.random.default_rng(i), plus a few small
variables. The cell that changes 1%: `a050 += 1.0` (the middle array).

Figures (raw samples over --reps plus the median):
  dill_full_save_s      dill.dump_session() of the whole session after the 1% cell
  dill_load_session_s   dill.load_session() of that file in a fresh process
  kishu_checkout_s      kishu 0.3.4 KishuForJupyter.checkout() in a fresh kernel
  memcpy_bytes_per_s    np.copyto of a 1 GiB array into a preallocated one

Prints progress on stderr and ONE JSON object on the last stdout line. Large
files go under DIR/cpb-<pid>/, which is removed at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

GIB = 1 << 30
SCRIPT = Path(__file__).resolve()
# Soft wall-clock budget for the whole run; Kishu readers stop early past it.
BUDGET_S = 225.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] checkpoint_baselines: {msg}", file=sys.stderr, flush=True)


def summary(samples: list[float]) -> dict[str, Any]:
    return {"samples": samples, "median": statistics.median(samples) if samples else None}


# ---------------------------------------------------------------- the session


def var_name(i: int, n_arrays: int) -> str:
    return f"a{i:0{max(3, len(str(n_arrays - 1)))}d}"


def session_cells(n_arrays: int, n_elems: int) -> dict[str, Any]:
    """The notebook's cells as source text, shared by the dill and Kishu runs."""
    changed = n_arrays // 2  # a050 of 100: one array = 1% of the bytes
    later = (changed + 1) % n_arrays  # touched by cell 3 only (Kishu's later commit)
    build = ["import numpy as np"]
    build += [f"{var_name(i, n_arrays)} = np.random.default_rng({i}).random({n_elems})" for i in range(n_arrays)]
    build += [
        "n_epochs = 7",
        'label = "looseleaf-checkpoint-bench"',
        f'meta = {{"arrays": {n_arrays}, "elems": {n_elems}, "seed": "index"}}',
    ]
    return {
        "cell1": "\n".join(build),
        "cell2": f"{var_name(changed, n_arrays)} += 1.0",
        "cell3": f"{var_name(later, n_arrays)} += 1.0",
        "changed": var_name(changed, n_arrays),
        "changed_seed": changed,
        "later": var_name(later, n_arrays),
        "later_seed": later,
        "names": [var_name(i, n_arrays) for i in range(n_arrays)],
        "n_elems": n_elems,
    }


def verify_ns(ns: dict[str, Any], cells: dict[str, Any], later_changed: bool) -> str | None:
    """None when NS holds the state after cell 2 (or 3), else what is wrong."""
    import numpy as np

    missing = [n for n in cells["names"] + ["n_epochs", "label", "meta"] if n not in ns]
    if missing:
        return f"missing {len(missing)} names, e.g. {missing[:3]}"
    checks = [
        (cells["changed"], cells["changed_seed"], 1.0),
        (cells["later"], cells["later_seed"], 1.0 if later_changed else 0.0),
    ]
    for name, seed, delta in checks:
        want = np.random.default_rng(seed).random(cells["n_elems"])[:4] + delta
        if not np.array_equal(ns[name][:4], want):
            return f"{name} has wrong contents (expected +{delta})"
    return None


# ------------------------------------------------------------ dill children
# These run as `python -c CODE CFG_JSON` so that __main__ (what dump_session
# saves and load_session fills) holds the session, not this script's functions.

DILL_SAVE_CHILD = r"""
import json, os, sys, time
import dill
import numpy as np


def _bench(cfg):
    g = globals()
    del g["_bench"]  # keep the dumped session to the notebook's own names

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] dill-save child: {msg}", file=sys.stderr, flush=True)

    def memcpy(nbytes, reps):
        src = np.ones(nbytes // 8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # untimed warm-up: faults in dst's pages
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            out.append(nbytes / (time.perf_counter() - t0))
        return out

    def memcpy_fresh(nbytes, reps):
        # a copy into new memory, as any restore into a new process must make
        src = np.ones(nbytes // 8)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst = src.copy()
            out.append(nbytes / (time.perf_counter() - t0))
            del dst
        return out

    t0 = time.perf_counter()
    exec(cfg["cell1"], g)
    cell1_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    exec(cfg["cell2"], g)  # the 1% change
    cell2_s = time.perf_counter() - t0
    log(f"state built in {cell1_s:.1f}s; measuring memcpy")
    bps = memcpy(cfg["memcpy_bytes"], cfg["reps"])
    fresh_bps = memcpy_fresh(cfg["memcpy_bytes"], cfg["reps"])
    path, save_s = cfg["path"], []
    for i in range(cfg["reps"]):
        if os.path.exists(path):
            os.unlink(path)  # so each dump writes a new file rather than truncating one
        t0 = time.perf_counter()
        dill.dump_session(path)
        save_s.append(time.perf_counter() - t0)
        log(f"dump_session {i + 1}/{cfg['reps']}: {save_s[-1]:.2f}s")
    state_bytes = sum(g[n].nbytes for n in cfg["names"])
    return {"save_s": save_s, "bytes": os.path.getsize(path), "memcpy_bps": bps, "memcpy_fresh_bps": fresh_bps,
            "state_bytes": state_bytes, "cell1_s": cell1_s, "cell2_s": cell2_s}


print(json.dumps(_bench(json.loads(sys.argv[1]))))
"""

DILL_LOAD_CHILD = r"""
import json, sys, time
import dill
import numpy as np  # imported before timing: the figure is deserialisation only


def _load(path):
    t0 = time.perf_counter()
    dill.load_session(path)
    return time.perf_counter() - t0


_cfg = json.loads(sys.argv[1])
_dt = _load(_cfg["path"])
_m = sys.modules["__main__"].__dict__
_names = _cfg["names"]
_want = np.random.default_rng(_cfg["changed_seed"]).random(_cfg["n_elems"])[:4] + 1.0
_ok = all(n in _m for n in _names) and np.array_equal(_m[_cfg["changed"]][:4], _want)
print(json.dumps({"load_s": _dt, "verified": bool(_ok)}))
"""


def run_child(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a child (stderr passes through) and parse the JSON on its last stdout line."""
    proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = " | ".join(lines[-5:])
        raise RuntimeError(f"child exited rc={proc.returncode} without a JSON line; stdout tail: {tail}") from None
    if "error" in out:
        raise RuntimeError(f"{out['error']}\n{out.get('traceback', '')}")
    return out


def measure_dill(run_dir: Path, cells: dict[str, Any], reps: int) -> dict[str, Any]:
    path = run_dir / "session.dill"
    cfg = {**cells, "path": str(path), "reps": reps, "memcpy_bytes": GIB}
    log("dill: building the session, memcpy, dump_session")
    saved = run_child([sys.executable, "-c", DILL_SAVE_CHILD, json.dumps(cfg)], run_dir)
    load_cfg = {k: cells[k] for k in ("names", "changed", "changed_seed", "n_elems")} | {"path": str(path)}
    loads, verified = [], True
    for i in range(reps):
        out = run_child([sys.executable, "-c", DILL_LOAD_CHILD, json.dumps(load_cfg)], run_dir)
        loads.append(out["load_s"])
        verified &= out["verified"]
        log(f"dill: load_session {i + 1}/{reps}: {out['load_s']:.2f}s (verified={out['verified']})")
    path.unlink()
    return {
        "dill_full_save_s": summary(saved["save_s"]),
        "dill_full_save_bytes": saved["bytes"],
        "dill_load_session_s": summary(loads),
        "dill_load_verified": verified,
        "memcpy_bytes_per_s": summary(saved["memcpy_bps"]),
        "memcpy_fresh_bytes_per_s": summary(saved["memcpy_fresh_bps"]),
        "state_bytes": saved["state_bytes"],
        "cell_s_plain": {"cell1_build": saved["cell1_s"], "cell2_change": saved["cell2_s"]},
    }


# ----------------------------------------------------------- kishu children
# Kishu is driven as its own tests do (tests/conftest.py, tests/helpers): an
# IPython InteractiveShell, ENV_KISHU_TEST_MODE (no Jupyter frontend to save or
# reload; counter commit ids), TEST_NOTEBOOK_PATH (a notebook file without a
# server), KISHU_PATH_ROOT (a private .kishu dir). Cells run through
# shell.run_cell, so Kishu's pre/post_run_cell hooks commit after each one.


def kishu_env(run_dir: Path) -> dict[str, str]:
    return os.environ | {
        "ENV_KISHU_TEST_MODE": "true",
        "TEST_NOTEBOOK_PATH": str(run_dir / "bench.ipynb"),
        "KISHU_PATH_ROOT": str(run_dir),
        "IPYTHONDIR": str(run_dir / "ipython"),  # keep IPython's history db out of $HOME
    }


def kishu_attach(notebook: str) -> tuple[Any, Any]:
    """A new shell with Kishu attached via init_kishu, the user-facing entry point.
    On a notebook that already has a Kishu db this is Kishu's re-attach to a fresh kernel."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    # silent: the hooks get installed mid-cell, so this cell's own post hook would fail
    res = shell.run_cell(f"from kishu import init_kishu; init_kishu({notebook!r})", silent=True)
    if not res.success:
        res.raise_error()
    return shell, shell.user_ns["_kishu"]


def run_cell(shell: Any, kishu: Any, code: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = shell.run_cell(code, store_history=True)
    wall = time.perf_counter() - t0
    if not res.success:
        res.raise_error()
    commit_id = kishu._kishu_branch.get_head().commit_id
    entry = kishu._kishu_commit.get_commit(commit_id)
    return {"commit": commit_id, "wall_s": wall, "kishu_checkpoint_s": entry.checkpoint_runtime_s}


def kishu_write(cfg: dict[str, Any]) -> dict[str, Any]:
    """Cells 1-3 under Kishu, then in-session checkouts (commit 3 -> 2) for reference."""
    nb = Path(cfg["notebook"])
    nb.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    shell, kishu = kishu_attach(str(nb))
    cells = [run_cell(shell, kishu, cfg[c]) for c in ("cell1", "cell2", "cell3")]
    for i, c in enumerate(cells, 1):
        log(f"kishu-write: cell {i} -> commit {c['commit']} in {c['wall_s']:.2f}s")
    c2, c3 = cells[1]["commit"], cells[2]["commit"]
    timer = RestoreRunTimer()
    samples, restore_run, plan = [], [], {}
    for _ in range(cfg["insession_reps"]):
        kishu.checkout(c3)
        plan = plan_summary(kishu, c2)
        timer.take()
        t0 = time.perf_counter()
        kishu.checkout(c2)
        samples.append(time.perf_counter() - t0)
        restore_run.append(timer.take())
    return {
        "cells": cells,
        "insession_s": samples,
        "insession_restore_run_s": restore_run,
        "insession_plan": plan,
        "insession_error": verify_ns(shell.user_ns, cfg, False),
    }


def plan_summary(kishu: Any, commit_id: str) -> dict[str, Any]:
    """What checkout will do: the incremental restore plan it builds (same call, untimed).
    Kishu stores and loads "variable snapshots": groups of names whose objects are linked."""
    from kishu.planning.plan import IncrementalLoadRestoreAction, MoveVariableRestoreAction, RerunCellRestoreAction

    plan = kishu._cr_planner.generate_incremental_restore_plan(kishu.database_path(), commit_id)
    loaded: list[frozenset[str]] = []
    moved: set[str] = set()
    reruns = 0
    for action in plan.actions.values():
        if isinstance(action, IncrementalLoadRestoreAction):
            loaded += [frozenset(vs.name) for vs in action.variable_snapshots]
        elif isinstance(action, MoveVariableRestoreAction):
            moved.update(action.vars_to_move.keyset())
        elif isinstance(action, RerunCellRestoreAction):
            reruns += 1
    return {
        "vars_loaded_from_store": sum(len(g) for g in loaded),
        "snapshots_loaded": len(loaded),
        "largest_snapshot_vars": max((len(g) for g in loaded), default=0),
        "largest_snapshot_some_names": sorted(max(loaded, key=len, default=()))[:6],
        "vars_moved_from_namespace": len(moved),
        "cells_rerun": reruns,
    }


class RestoreRunTimer:
    """Wraps kishu's RestorePlan.run (read the store + dill.loads into a scratch shell)
    to split a checkout into that part and the rest (planning, hashing, bookkeeping)."""

    def __init__(self) -> None:
        from kishu.planning.plan import RestorePlan

        self.seconds = 0.0
        inner = RestorePlan.run

        def timed(plan: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(plan, *a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        RestorePlan.run = timed

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


def kishu_read(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fresh process = fresh kernel: re-attach Kishu, time checkout to commit 2."""
    shell, kishu = kishu_attach(cfg["notebook"])
    before = len(kishu._user_ns.keyset())
    plan = plan_summary(kishu, cfg["target"])
    timer = RestoreRunTimer()
    t0 = time.perf_counter()
    kishu.checkout(cfg["target"])
    dt = time.perf_counter() - t0
    return {
        "checkout_s": dt,
        "restore_run_s": timer.take(),
        "ns_vars_before": before,
        "plan": plan,
        "verify_error": verify_ns(shell.user_ns, cfg, False),
    }


def kishu_version() -> str:
    from importlib.metadata import version

    return version("kishu")


def measure_kishu(run_dir: Path, cells: dict[str, Any], reps: int, deadline: float) -> dict[str, Any]:
    env = kishu_env(run_dir)
    cfg = {**cells, "notebook": env["TEST_NOTEBOOK_PATH"], "insession_reps": reps}
    log("kishu: running cells 1-3 under Kishu (cell 1 commits the whole state into its sqlite store)")
    wrote = run_child([sys.executable, str(SCRIPT), "--child", "kishu-write", json.dumps(cfg)], run_dir, env)
    c2 = wrote["cells"][1]["commit"]
    read_cfg = {**cfg, "target": c2}
    samples, reads, note = [], [], None
    for i in range(reps):
        t0 = time.monotonic()
        out = run_child([sys.executable, str(SCRIPT), "--child", "kishu-read", json.dumps(read_cfg)], run_dir, env)
        samples.append(out["checkout_s"])
        reads.append(out)
        log(f"kishu: fresh-kernel checkout {i + 1}/{reps}: {out['checkout_s']:.2f}s, plan {out['plan']}")
        if i + 1 < reps and time.monotonic() + (time.monotonic() - t0) > deadline:
            note = f"kishu reps reduced to {i + 1} of {reps}: next reader would pass the {BUDGET_S:.0f}s budget"
            log(note)
            break
    verify = [r["verify_error"] for r in reads if r["verify_error"]]
    commits = [c["commit"] for c in wrote["cells"]]
    db_bytes = sum(p.stat().st_size for p in run_dir.glob("bench.kishudb*"))
    group = reads[0]["plan"]["largest_snapshot_vars"]
    return {
        "kishu_note": (
            f"Kishu stores/loads per 'variable snapshot' (linked names); here one snapshot held {group} names "
            f"({reads[0]['plan']['largest_snapshot_some_names']}...), so every commit re-stored that whole group "
            f"(db {db_bytes} bytes after 3 commits) and even the in-session checkout reloads it."
        ),
        "kishu_checkout_s": summary(samples),
        "kishu_checkout_restore_run_s": summary([r["restore_run_s"] for r in reads]),
        "kishu_path": (
            f"kishu {kishu_version()}: KishuForJupyter.checkout('{c2}') (= `_kishu.checkout`, the call "
            "`kishu checkout` sends to the kernel), timed in a FRESH process: new IPython InteractiveShell, "
            "`init_kishu(nb)` re-attaching to the notebook's existing Kishu db (empty namespace, head reset), "
            f"target = commit after cell 2 `{cells['cell2']}`; commits {commits} (cells 1-3) were made earlier "
            f"in another process. Restore plan: {reads[0]['plan']}, i.e. the whole state is read from Kishu's "
            "sqlite store and dill.loads'ed. Timed span includes planning, the load (restore_run_s), "
            "namespace swap, notebook-file rewrite and re-hashing the restored objects."
        ),
        "kishu_checkout_verified": not verify,
        "kishu_verify_errors": verify,
        "kishu_ns_vars_before_checkout": reads[0]["ns_vars_before"],
        "kishu_reps_note": note,
        "kishu_insession_checkout_s": summary(wrote["insession_s"]),
        "kishu_insession_restore_run_s": summary(wrote["insession_restore_run_s"]),
        "kishu_insession_path": (
            f"reference only: the kernel that ran cells 1-3, checkout('{commits[2]}') untimed, then "
            f"checkout('{c2}') timed (Kishu's incremental checkout); plan {wrote['insession_plan']}; "
            f"verify error: {wrote['insession_error']}"
        ),
        "kishu_cells": wrote["cells"],
        "kishu_db_bytes": db_bytes,
    }


# ------------------------------------------------------------------ parent


def child_main(kind: str, cfg_json: str) -> None:
    """Entry for `--child kishu-write|kishu-read`: one JSON line, errors included."""
    try:
        fn = {"kishu-write": kishu_write, "kishu-read": kishu_read}[kind]
        out = fn(json.loads(cfg_json))
    except Exception as e:  # reported to the parent, which records kishu_error
        tb = traceback.format_exc().strip().splitlines()
        out = {"error": f"{type(e).__name__}: {e}", "traceback": "\n".join(tb[-12:])}
    print(json.dumps(out))


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in ("numpy", "dill", "kishu", "ipython"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="folder for temporary files (required)")
    ap.add_argument("--arrays", type=int, default=100)
    ap.add_argument("--array-bytes", type=int, default=10737418)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the temporary files")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("cfg", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.child and args.work is None:
        ap.error("--work is required")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args.child, args.cfg)
        return
    start = time.monotonic()
    cells = session_cells(args.arrays, args.array_bytes // 8)
    run_dir = args.work.resolve() / f"cpb-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "config": {
            "arrays": args.arrays,
            "array_bytes": args.array_bytes,
            "array_elems": cells["n_elems"],
            "reps": args.reps,
            "change_cell": cells["cell2"],
            "memcpy_bytes": GIB,
            "versions": versions(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
    }
    try:
        result |= measure_dill(run_dir, cells, args.reps)
        try:
            result |= measure_kishu(run_dir, cells, args.reps, start + BUDGET_S)
        except Exception as e:  # still report the dill figures
            result["kishu_error"] = str(e)
            log(f"kishu failed: {e}")
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    result["config"]["loadavg_end"] = os.getloadavg()
    result["total_wall_s"] = time.monotonic() - start
    result["notes"] = [
        "dill: dump_session writes to the page cache (no fsync); load_session reads a file just written "
        "(warm page cache, caches not dropped); numpy is imported before the load timer starts.",
        "dill save: one process built the state, ran the 1% cell, measured memcpy, then dumped --reps times "
        "(file unlinked between dumps); each load is a fresh `python -c` process.",
        "memcpy: np.copyto of a 1 GiB float64 array into a preallocated, pre-faulted one (raw bandwidth); "
        "memcpy_fresh: a.copy() of it, into new memory as a restore must (page faults included).",
        "host: shared 2-core machine (see loadavg); figures are wall-clock.",
    ]
    log(f"done in {result['total_wall_s']:.0f}s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
