"""Naive-serverless baseline, session side: run a notebook in a plain IPython
InteractiveShell and, just before each chosen cell, save what a naive serverless
platform would ship to a fresh process: the whole user namespace (dill) and the
list of packages the session imported. Also measures the pinned-kernel figure.

    python naive_session.py NOTEBOOK OUT_DIR --cells 3,7,12 [--pinned-reps 200]

Writes OUT_DIR/session.json: one snapshot per chosen cell (state file, bytes,
imports, module aliases, skipped names) and the pinned figures.
Runs with the notebook's folder as the working directory, as `looseleaf run` does.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

import dill  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

dill.settings["recurse"] = True  # pickle a function's referenced globals, not its whole module dict

# IPython's own names (DESIGN.md section 10), never user state.
IPY_NAME = re.compile(r"^(_|__|___|_i+|_i\d+|_\d+|_ih|_oh|_dh|In|Out|exit|quit|get_ipython|__.*__)$")


def top_modules() -> list[str]:
    """Top-level packages in sys.modules, in import order."""
    seen: dict[str, None] = {}
    for name in list(sys.modules):
        seen.setdefault(name.split(".")[0], None)
    return list(seen)


def user_names(shell: InteractiveShell) -> list[str]:
    hidden = shell.user_ns_hidden
    return [n for n in shell.user_ns if n not in hidden and not IPY_NAME.match(n)]


def snapshot(shell: InteractiveShell, baseline: set[str], path: Path) -> dict:
    """dill the user namespace to PATH: modules as aliases (imported by name on load),
    every other value that pickles, in one dump so shared references stay shared."""
    modules, values, skipped = {}, {}, {}
    for name in user_names(shell):
        v = shell.user_ns[name]
        if isinstance(v, types.ModuleType):
            modules[name] = v.__name__
            continue
        try:
            dill.dumps(v)
        except Exception as e:  # unpicklable (generators, open files, ...): skipped
            skipped[name] = f"{type(e).__name__}: {str(e)[:120]}"
            continue
        values[name] = v
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            dill.dump(values, f)
    except Exception as e:  # a combination that does not pickle together: keep what does
        skipped["<together>"] = f"{type(e).__name__}: {str(e)[:120]}"
        values = {k: v for k, v in values.items() if _pickles_alone(v)}
        with open(path, "wb") as f:
            dill.dump(values, f)
    dump_ms = (time.perf_counter() - t0) * 1000
    imports = [m for m in top_modules()
               if m not in baseline and not m.startswith("_") and m != "__main__"]
    # Modules the user bound by alias whose package IPython itself had imported.
    for mod in modules.values():
        top = mod.split(".")[0]
        if top not in imports:
            imports.append(top)
    return {"state_file": str(path), "state_bytes": path.stat().st_size, "dump_ms": dump_ms,
            "names": sorted(values), "modules": modules, "skipped": skipped, "imports": imports}


def _pickles_alone(v) -> bool:
    try:
        dill.dumps(v)
        return True
    except Exception:
        return False


def pinned_figure(shell: InteractiveShell, reps: int) -> dict:
    """The pinned kernel prepares nothing: its start delay is the time to run `pass`
    in the already-running shell (upper bound of Run to first line)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        shell.run_cell("pass", store_history=True)
        samples.append((time.perf_counter() - t0) * 1000)
    return {"median_ms": benchlib.median(samples), "p95_ms": benchlib.percentile(samples, 0.95),
            "reps": reps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("notebook", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--cells", default="", help="comma-separated cell indices to snapshot before")
    ap.add_argument("--pinned-reps", type=int, default=0)
    args = ap.parse_args()
    nb = args.notebook.resolve()
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    wanted = {int(c) for c in args.cells.split(",") if c}
    os.chdir(nb.parent)
    os.environ.setdefault("MPLBACKEND", "Agg")

    shell = InteractiveShell.instance()
    baseline = set(top_modules())
    snapshots, cell_errors = {}, {}
    for index, source in benchlib.code_cells(nb):
        if index in wanted:
            snapshots[index] = snapshot(shell, baseline, out / f"state-{index}.dill")
        res = shell.run_cell(source, store_history=True)
        if not res.success:
            err = res.error_in_exec or res.error_before_exec
            cell_errors[index] = f"{type(err).__name__}: {str(err)[:120]}"
    pinned = pinned_figure(shell, args.pinned_reps) if args.pinned_reps else None
    manifest = {"notebook": str(nb), "cwd": str(nb.parent), "snapshots": snapshots,
                "cell_errors": cell_errors, "pinned": pinned}
    (out / "session.json").write_text(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
