"""Naive-serverless baseline, the fresh process: import every package the session
imported, dill-load the whole session, put it in an IPython shell, then print
`READY {breakdown}` — the moment it could execute the cell's first line.

    python naive_child.py SNAPSHOT_JSON

The parent times from just before it spawns this process to the READY line, so
interpreter start-up is included. Only the standard library is imported before
the timed imports.
"""
import importlib
import json
import os
import sys
import time


def main() -> None:
    t_start = time.perf_counter()
    snap = json.load(open(sys.argv[1]))
    os.chdir(snap["cwd"])
    failed = []
    for mod in ["IPython", "dill"] + snap["imports"]:
        try:
            importlib.import_module(mod)
        except Exception as e:  # a package that cannot be imported on its own
            failed.append(f"{mod}: {type(e).__name__}")
    t_imported = time.perf_counter()
    import dill
    with open(snap["state_file"], "rb") as f:
        ns = dill.load(f)
    for alias, mod in snap["modules"].items():
        ns[alias] = importlib.import_module(mod)
    t_loaded = time.perf_counter()
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.user_ns.update(ns)
    t_shell = time.perf_counter()
    breakdown = {
        "imports_ms": (t_imported - t_start) * 1000,
        "load_ms": (t_loaded - t_imported) * 1000,
        "shell_ms": (t_shell - t_loaded) * 1000,
        "in_process_ms": (t_shell - t_start) * 1000,
        "restored_names": len(ns),
        "failed_imports": failed,
    }
    sys.stdout.write("READY " + json.dumps(breakdown) + "\n")
    sys.stdout.flush()
    os._exit(0)  # teardown is not part of the start


if __name__ == "__main__":
    main()
