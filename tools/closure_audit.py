#!/usr/bin/env python3
"""Closure soundness audit: what each notebook cell actually reads.

Runs a notebook's code cells in order in an in-process IPython ``InteractiveShell``
(working directory = a throwaway copy of the notebook's folder, ``MPLBACKEND=Agg``)
and records, for every code cell:

* ``reads``: the global names the cell actually read whose value an earlier cell
  defined, including reads made inside notebook-defined functions, lambdas,
  comprehensions, methods and class bodies that the cell runs;
* ``live_before``: the live variables before the cell (DESIGN.md section 10: user
  names, excluding modules and IPython's own names ``In``, ``Out``, ``_``, ``__``,
  ``___``, ``_iN``, ``_N``, ``exit``, ``quit``, ``get_ipython``);
* ``defined_before``: every user name (modules included) defined before the cell;
* the cell's code and the error it raised, if any.

How reads are recorded (and why this is exact for CPython 3.11)
----------------------------------------------------------------
The shell is created with ``user_ns=RecordingNamespace()``, a ``dict`` subclass.
IPython then uses that very object as the ``__dict__`` of its ``__main__`` module, so
it is the *globals* of every cell and of every function, lambda, comprehension and
method defined in a cell (``f.__globals__ is user_ns``), and also the *locals* of the
cell's top-level code (``exec(code, user_ns, user_ns)``).

CPython's name loads then go through our ``__getitem__``:

* ``LOAD_GLOBAL`` (functions, comprehensions, methods) takes its dict fast path only
  when both globals and builtins are *exact* dicts; for a subclass it calls
  ``PyObject_GetItem(globals, name)``, i.e. our ``__getitem__`` (and the adaptive
  interpreter never specializes it to a ``LOAD_GLOBAL_MODULE`` for a subclass);
* ``LOAD_NAME`` at a cell's top level looks in the *locals* first, and for a
  non-exact dict that is ``PyObject_GetItem(locals, name)``: our ``__getitem__``.
  ``eval``/``exec`` of strings and IPython magics that run code in ``user_ns``
  (``%timeit``) are covered the same way.

The one load that bypasses ``__getitem__`` is ``LOAD_NAME`` in a *class body*: its
locals are the class namespace (an exact dict) and its globals fallback uses
``PyDict_GetItemWithError`` directly. Class bodies are few and run once, so they are
covered statically: every class-body code object reachable from the cell's compiled
code (``co_consts``, recursively) contributes the names its ``LOAD_NAME``
instructions load that the class body itself never stores.

A read counts only if, at the time of the read, the name still holds the value an
earlier cell left (the name was not rebound by this cell through ``__setitem__`` and
the object is the one snapshot at the cell's start). Reads that fail (``KeyError``:
the name fell through to builtins) are not reads of session state.

Not seen (documented limits): ``globals().get(name)``-style access through dict
methods, reads from other processes or from C code that pokes ``__main__.__dict__``
directly (``pickle`` finding a class by name: the planner always adds notebook
classes to the closure for that reason).

Usage: ``closure_audit.py NOTEBOOK.ipynb [--out OUT.json]`` (prints JSON otherwise).
"""

from __future__ import annotations

import argparse
import dis
import json
import os
import re
import shutil
import sys
import tempfile
import time
import types

IPYTHON_NAME = re.compile(r"^(_+|_i+|_i\d+|_\d+|_ih|_oh|_dh|In|Out|exit|quit|get_ipython)$")


class RecordingNamespace(dict):
    """The session namespace; records reads of names an earlier cell defined."""

    __slots__ = ("recording", "snapshot", "written", "reads")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.recording = False
        self.snapshot: dict[str, object] = {}
        self.written: set[str] = set()
        self.reads: set[str] = set()

    def __getitem__(self, name):
        value = dict.__getitem__(self, name)  # KeyError propagates: not a session read
        if self.recording and name not in self.written:
            old = self.snapshot.get(name, _MISSING)
            if old is value:
                self.reads.add(name)
        return value

    def __setitem__(self, name, value):
        if self.recording:
            self.written.add(name)
        dict.__setitem__(self, name, value)

    def __delitem__(self, name):
        if self.recording:
            self.written.add(name)
        dict.__delitem__(self, name)


_MISSING = object()


def _class_body_reads(code: types.CodeType) -> set[str]:
    """Names loaded by LOAD_NAME in class bodies nested anywhere in `code`."""
    out: set[str] = set()
    stack = [code]
    while stack:
        co = stack.pop()
        stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType))
        is_class_body = co is not code and not (co.co_flags & (0x1 | 0x2))  # !OPTIMIZED, !NEWLOCALS
        if not is_class_body:
            continue
        loads, stores = set(), set()
        for ins in dis.get_instructions(co):
            if ins.opname == "LOAD_NAME":
                loads.add(ins.argval)
            elif ins.opname in ("STORE_NAME", "DELETE_NAME"):
                stores.add(ins.argval)
        out |= loads - stores - {"__name__", "__module__", "__qualname__"}
    return out


def _source(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def audit(notebook: str, keep_dir: bool = False) -> dict:
    import nbformat

    os.environ.setdefault("MPLBACKEND", "Agg")
    nb_path = os.path.abspath(notebook)
    nb = nbformat.read(nb_path, as_version=4)
    workdir = tempfile.mkdtemp(prefix="closure-audit-")
    src_dir = os.path.dirname(nb_path)
    run_dir = os.path.join(workdir, os.path.basename(src_dir) or "nb")
    shutil.copytree(src_dir, run_dir, ignore=shutil.ignore_patterns("*.ipynb_checkpoints", ".git"))
    old_cwd = os.getcwd()
    os.chdir(run_dir)
    sys.path.insert(0, run_dir)

    from IPython.core.interactiveshell import InteractiveShell

    ns = RecordingNamespace()
    shell = InteractiveShell.instance(user_ns=ns)
    if shell.user_ns is not ns or shell.user_global_ns is not ns:
        raise RuntimeError("IPython did not adopt the recording namespace")
    # `%matplotlib inline` asks the shell for a GUI event loop; a plain
    # InteractiveShell has none (a kernel's is a no-op for inline too).
    shell.enable_gui = lambda gui=None: None
    initial = set(ns.keys())

    def user_names() -> dict[str, object]:
        return {k: v for k, v in dict.items(ns) if k not in initial and not IPYTHON_NAME.match(k)}

    cells = []
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            code = _source(cell)
            if not code.strip():
                continue
            before = user_names()
            live = sorted(k for k, v in before.items() if not isinstance(v, types.ModuleType))
            ns.snapshot = before
            ns.written = set()
            ns.reads = set()
            t0 = time.perf_counter()
            ns.recording = True
            try:
                result = shell.run_cell(code, store_history=True, silent=False)
            finally:
                ns.recording = False
            elapsed = time.perf_counter() - t0
            reads = set(ns.reads)
            # Class bodies: static LOAD_NAME targets (see the module doc).
            try:
                transformed = shell.transform_cell(code)
                compiled = compile(transformed, "<cell>", "exec")
                for name in _class_body_reads(compiled):
                    if name in before and name not in ns.written:
                        reads.add(name)
            except (SyntaxError, ValueError):
                pass
            err = None
            if result.error_before_exec is not None:
                err = repr(result.error_before_exec)
            elif result.error_in_exec is not None:
                err = repr(result.error_in_exec)
            cells.append(
                {
                    "index": index,
                    "cell_id": cell.get("id") or f"cell-{index}",
                    "code": code,
                    "reads": sorted(reads),
                    "live_before": live,
                    "defined_before": sorted(before),
                    "error": err,
                    "seconds": round(elapsed, 4),
                }
            )
    finally:
        os.chdir(old_cwd)
        if run_dir in sys.path:
            sys.path.remove(run_dir)
        if not keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"notebook": nb_path, "python": sys.version.split()[0], "cells": cells}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook")
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    args = ap.parse_args()
    # Cell output goes to stdout; keep the JSON apart.
    real_stdout = sys.stdout
    result = audit(args.notebook)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        real_stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
