"""What cells register with the interpreter: import finders, path hooks, input
and AST transformers, event callbacks and display printers, carried by value to
later workers and put back where the cell put them."""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from IPython import get_ipython

from .. import checkpoint, quiet
from . import patches
from .byvalue import _loads_with_ns, _pickled

if TYPE_CHECKING:
    from .baseline import Baseline

# Import finders, path hooks, input and AST transformers, event callbacks and
# display printers that notebook code made travel by value, like the magics
# (see magics); a later worker puts them back where the cell put them. A printer a
# library registered (sympy's init_printing) travels too, unpickled when first
# used (its library is imported then). What cannot be pickled is named once, in
# the output of the cell that made it.

# Objects carried, by their pickle: a worker that applies the state it saved
# itself (a kept worker) keeps its very objects, and loads each blob once.
_live: dict[bytes, Any] = {}
# Loaded from a blob: id -> (object, the namespace name it was bound to then).
_loaded_as: dict[int, tuple[Any, str]] = {}
# Objects checked at a cell's end, and those named as uncarriable there or in
# the log (kept, so that ids stay unique).
_checked: dict[int, Any] = {}
_named: dict[int, Any] = {}
# Names that carried notebook code reads, brought in before each cell runs.
_reads_needed: list[str] = []
# Kept out of what is carried: runtime code, the inline backend's figure printers
# (see inline._inline_figures) and what loaded extensions register (they come back with
# the extension).
_RUNTIME = ("looseleaf_worker.", "matplotlib_inline.")
_FIGURE = ("matplotlib.figure", "Figure")


def _made_here(obj, ns: dict) -> bool:
    """Made by notebook code: a function whose globals are the namespace, a
    notebook class, an instance or a bound method of one, a partial of these."""
    obj = getattr(obj, "func", obj)  # functools.partial
    if isinstance(obj, types.MethodType):
        return _made_here(obj.__func__, ns) or _made_here(obj.__self__, ns)
    if isinstance(obj, types.FunctionType):
        return obj.__globals__ is ns
    cls = obj if isinstance(obj, type) else type(obj)
    return getattr(cls, "__module__", None) == "__main__"


def _module_of(fn) -> str:
    fn = getattr(fn, "func", fn)
    return getattr(fn, "__module__", None) or type(fn).__module__ or ""


def _theirs(fn, shell) -> bool:
    """Registered by the runtime or by a loaded extension (never carried)."""
    if isinstance(fn, _LazyPrinter):
        return False
    mod = _module_of(fn)
    if mod.startswith(_RUNTIME):
        return True
    return any(mod == e or mod.startswith(e + ".") for e in shell.extension_manager.loaded)


def _label(obj) -> str:
    name = getattr(getattr(obj, "func", obj), "__qualname__", None)
    return name if isinstance(name, str) else f"{type(obj).__qualname__} object"


def _global_reads(obj, ns: dict) -> list[str]:
    """Names of the namespace the notebook code of ``obj`` reads: a function's,
    or every method of its notebook class (and of a bound method's object)."""
    parts = [obj]
    owners = [obj, getattr(obj, "__self__", None)]
    for owner in owners:
        if owner is None:
            continue
        cls = owner if isinstance(owner, type) else type(owner)
        for c in cls.__mro__:
            if c.__module__ == "__main__":
                for v in vars(c).values():
                    parts.append(getattr(v, "__func__", getattr(v, "fget", v)))
    names: set[str] = set()
    for p in parts:
        names.update(checkpoint.function_global_reads(p, ns))
    return sorted(names)


def _var_of(obj, ns: dict) -> str | None:
    """A namespace name bound to ``obj``: a later worker that restored the name
    uses that object itself (``unregister(after)`` finds it)."""
    hit = _loaded_as.get(id(obj))
    if hit is not None and hit[0] is obj and (hit[1] not in ns or ns[hit[1]] is obj):
        return hit[1]
    return next((k for k, v in ns.items() if v is obj and not k.startswith("_")), None)


def _carry(obj, ns: dict) -> tuple[dict | None, str | None]:
    """A record a later worker can rebuild ``obj`` from, or (None, why not)."""
    blob, why = _pickled(obj, ns)
    if blob is None:
        return None, why
    _live[blob] = obj
    reads = _global_reads(obj, ns) if _made_here(obj, ns) else []
    modules = {n: ns[n].__name__ for n in reads if isinstance(ns.get(n), types.ModuleType)}
    return {"var": _var_of(obj, ns), "blob": blob, "reads": reads, "modules": modules}, None


def _uncarry(rec: dict, ns: dict):
    var = rec["var"]
    if var is not None and var in ns:
        return ns[var]
    obj = _live.get(rec["blob"])
    if obj is None:
        obj = _live[rec["blob"]] = _loads_with_ns(rec["blob"], ns)
    if var is not None:
        _loaded_as[id(obj)] = (obj, var)
    return obj


class _LazyPrinter:
    """A library's display printer from an earlier worker, unpickled when first
    called: its library (sympy: ~0.5 s) is imported then, not at every restore."""

    # Its instances sit in the display formatters, where a variable may hold one:
    # a saved record names the class by its module before ambient became a
    # package, which re-exports it under that name.
    __module__ = "looseleaf_worker.ambient"

    def __init__(self, rec: dict, ns: dict):
        self.rec, self._ns, self._fn = rec, ns, None

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            self._fn = _loads_with_ns(self.rec["blob"], self._ns)
        return self._fn(*args, **kwargs)


def _log_once(obj, msg: str) -> None:
    if id(obj) not in _named:
        _named[id(obj)] = obj
        quiet.log(f"looseleaf worker: {msg}")


def _hook_lists(shell) -> dict[str, list]:
    return {
        "meta_path": sys.meta_path,
        "path_hooks": sys.path_hooks,
        "ast_transformers": shell.ast_transformers,
        "input_transformers_cleanup": shell.input_transformers_cleanup,
        "input_transformers_post": shell.input_transformers_post,
    }


_IMPORT_HOOKS = ("meta_path", "path_hooks")


def _printer_key(key) -> tuple[str, str]:
    """A formatter's key as (module, name): a class or a deferred (module, name)."""
    if isinstance(key, type):
        return (key.__module__, key.__name__)
    return tuple(key)


def _notebook_hooks(shell, base: Baseline):
    """(what, where, object) for each thing a cell registered: hook list entries
    made by notebook code, non-baseline callbacks and printers."""
    ns = shell.user_ns
    for name, items in _hook_lists(shell).items():
        for h in items:
            if _made_here(h, ns):
                yield f"{name} entry", name, h
    for event, fns in shell.events.callbacks.items():
        for fn in fns:
            if not any(fn is b for b in base.events.get(event, ())):
                yield f"{event} callback", event, fn
    for mime, f in shell.display_formatter.formatters.items():
        for k, p in [*f.type_printers.items(), *f.deferred_printers.items()]:
            key = _printer_key(k)
            if (mime, key, id(p)) not in base.printers and key != _FIGURE:
                yield f"{mime} printer for {key[1]}", (mime, k), p


def _capture_hooks(shell, base: Baseline) -> dict:
    ns = shell.user_ns
    _live.clear()
    out: dict[str, Any] = {"lists": {}, "callbacks": [], "printers": [], "modules": []}
    lists = _hook_lists(shell)
    for name, items in lists.items():
        first_theirs = next((i for i, h in enumerate(items) if not _made_here(h, ns)), len(items))
        recs = []
        for i, h in enumerate(items):
            if _made_here(h, ns):
                rec, why = _carry(h, ns)
                if rec is None:
                    _log_once(h, f"cannot keep the {name} entry {_label(h)} for later workers: {why}")
                else:
                    recs.append(dict(rec, front=i < first_theirs))
        if recs:
            out["lists"][name] = recs
    printers: dict[int, tuple] = {}  # one printer serves many types (sympy's): pickled once
    for what, where, fn in _notebook_hooks(shell, base):
        if where in lists:
            continue
        if isinstance(where, str):  # an event callback
            if not _made_here(fn, ns):
                if not _theirs(fn, shell):
                    _log_once(fn, f"the {what} {_label(fn)} is a library's: later workers lack it")
                continue
            rec, why = _carry(fn, ns)
            if rec is None:
                _log_once(fn, f"cannot keep the {what} {_label(fn)} for later workers: {why}")
            else:
                out["callbacks"].append((where, rec))
            continue
        mime, k = where
        if _theirs(fn, shell):
            continue
        if isinstance(fn, _LazyPrinter):
            rec, why = fn.rec, None
            _live[rec["blob"]] = fn
        else:
            if id(fn) not in printers:
                printers[id(fn)] = _carry(fn, ns)
            rec, why = printers[id(fn)]
        if rec is None:
            _log_once(fn, f"cannot keep the {what} {_label(fn)} for later workers: {why}")
            continue
        mod, name = _printer_key(k)
        cls_var = _var_of(k, ns) if isinstance(k, type) and mod == "__main__" else None
        qual = k.__qualname__ if isinstance(k, type) else name
        lazy = not _made_here(fn, ns)
        out["printers"].append(
            {"mime": mime, "mod": mod, "name": name, "qual": qual, "var": cls_var, "lazy": lazy, "printer": rec}
        )
    # modules the notebook's finders served: a kernel has them in sys.modules
    if any(n in out["lists"] for n in _IMPORT_HOOKS):
        out["modules"] = [
            n
            for n, m in list(sys.modules.items())
            if _made_here(getattr(getattr(m, "__spec__", None), "loader", None), ns)
        ]
    return out


def _note_uncarried(shell, base: Baseline) -> None:
    """At the end of a cell: name each thing it registered that cannot be
    pickled, once, in its output (a library's go to the log at the save)."""
    ns = shell.user_ns
    try:
        for what, _, obj in _notebook_hooks(shell, base):
            if id(obj) in _checked or not _made_here(obj, ns):
                continue
            _checked[id(obj)] = obj
            blob, why = _pickled(obj, ns)
            if blob is None:
                _named[id(obj)] = obj
                print(
                    f"LooseLeaf: the {what} {_label(obj)} cannot be kept for later cells ({why}); "
                    "cells that run in another worker will not have it",
                    file=sys.stderr,
                )
    except Exception as e:  # noqa: BLE001 - the runtime's check must not fail the cell
        quiet.log(f"looseleaf worker: could not check what the cell registered: {type(e).__name__}: {e}")


def _bring_reads(shell) -> None:
    """Before a cell runs: the names carried notebook code reads (a callback's
    list, a finder's module), so it finds them as in the kernel."""
    ns = shell.user_ns
    for name in _reads_needed:
        if name not in ns and shell.fault_in is not None:
            shell.fault_in(name)


def _watch_cells(shell) -> None:
    if getattr(shell, "_ll_watching", False):
        return
    shell._ll_watching = True
    shell.before_cell.append(lambda: _bring_reads(shell))
    shell.after_cell.append(lambda: _note_uncarried(shell, shell._ll_base))
    shell.after_cell.append(lambda: patches.note_cell(shell))


def _rebuild_list(items: list, recs: list[dict], ns: dict) -> None:
    """``items`` with the notebook's entries replaced by the session's."""
    theirs = [h for h in items if not _made_here(h, ns)]
    front, back = [], []
    for rec in recs:
        try:
            (front if rec["front"] else back).append(_uncarry(rec, ns))
        except Exception as e:  # noqa: BLE001 - one hook lost, not the restore
            quiet.log(f"looseleaf worker: could not restore a hook: {type(e).__name__}: {e}")
    items[:] = front + theirs + back


def _apply_import_hooks(st: dict) -> None:
    """Before the restore imports: the session's finders and path hooks, and the
    modules their code reads."""
    shell = get_ipython()
    if shell is None:
        return
    lists = st.get("hooks", {}).get("lists", {})
    ns = shell.user_ns
    for name in _IMPORT_HOOKS:
        if name not in lists and not any(_made_here(h, ns) for h in _hook_lists(shell)[name]):
            continue
        for rec in lists.get(name, []):
            for var, mod in rec["modules"].items():
                if var not in ns:
                    with contextlib.suppress(ImportError):
                        ns[var] = importlib.import_module(mod)
        before = list(_hook_lists(shell)[name])
        _rebuild_list(_hook_lists(shell)[name], lists.get(name, []), ns)
        if name == "path_hooks" and sys.path_hooks != before:
            sys.path_importer_cache.clear()  # path entries are found again, hooks first


def _resolve_class(rec: dict, ns: dict) -> type | None:
    """The class a printer was registered for, as this worker has it: the one the
    namespace holds (a notebook class restored by value), or its module's."""
    cls = ns.get(rec["var"]) if rec["var"] else None
    if isinstance(cls, type) and cls.__name__ == rec["name"]:
        return cls
    if rec["mod"] == "__main__":
        scope = ns
    elif rec["mod"] in sys.modules:
        scope = vars(sys.modules[rec["mod"]])
    else:
        return None  # not imported: a deferred printer, by name
    first, *rest = rec["qual"].split(".")
    obj = scope.get(first)
    for part in rest:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and obj.__name__ == rec["name"] else None


def _apply_hooks(shell, st: dict, base: Baseline) -> None:
    """After the variables: transformers, callbacks and printers as the session
    has them (a kept worker's own make way for them), finders bound to the
    namespace's objects, and the modules the session's finders had served."""
    global _reads_needed
    hooks = st.get("hooks", {"lists": {}, "callbacks": [], "printers": [], "modules": []})
    ns = shell.user_ns
    lists = _hook_lists(shell)
    for name, items in lists.items():
        if name in hooks["lists"] or any(_made_here(h, ns) for h in items):
            _rebuild_list(items, hooks["lists"].get(name, []), ns)
    cbs = shell.events.callbacks
    for event in cbs:
        cbs[event][:] = [fn for fn in cbs[event] if not _made_here(fn, ns)]
    for event, rec in hooks["callbacks"]:
        try:
            fn = _uncarry(rec, ns)
        except Exception as e:  # noqa: BLE001 - one callback lost, not the restore
            quiet.log(f"looseleaf worker: could not restore a {event} callback: {type(e).__name__}: {e}")
            continue
        if event in cbs and fn not in cbs[event]:
            cbs[event].append(fn)
    _apply_printers(shell, hooks["printers"], base)
    reads = {n for recs in hooks["lists"].values() for r in recs for n in r["reads"]}
    reads.update(n for _, r in hooks["callbacks"] for n in r["reads"])
    reads.update(n for p in hooks["printers"] for n in p["printer"]["reads"])
    _reads_needed = sorted(reads)
    for name in hooks["modules"]:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the cell's own import reports it
                quiet.log(f"looseleaf worker: could not import {name} again: {type(e).__name__}: {e}")


def _apply_printers(shell, records: list[dict], base: Baseline) -> None:
    ns = shell.user_ns
    formatters = shell.display_formatter.formatters
    for mime, f in formatters.items():
        base_types, base_deferred = base.formatters.get(mime, ({}, {}))
        for table, base_table in ((f.type_printers, base_types), (f.deferred_printers, base_deferred)):
            for k, p in list(table.items()):
                key = _printer_key(k)
                if (mime, key, id(p)) in base.printers or key == _FIGURE or _theirs(p, shell):
                    continue
                if k in base_table:
                    table[k] = base_table[k]  # a printer the notebook replaced
                else:
                    del table[k]
    for rec in records:
        f = formatters.get(rec["mime"])
        if f is None:
            continue
        try:
            printer = _live.get(rec["printer"]["blob"])
            if printer is None and rec["lazy"]:
                printer = _live[rec["printer"]["blob"]] = _LazyPrinter(rec["printer"], ns)
            elif printer is None:
                printer = _uncarry(rec["printer"], ns)
        except Exception as e:  # noqa: BLE001 - one printer lost, not the restore
            quiet.log(f"looseleaf worker: could not restore a {rec['mime']} printer: {type(e).__name__}: {e}")
            continue
        cls = _resolve_class(rec, ns)
        if cls is not None:
            f.type_printers[cls] = printer
        else:
            f.deferred_printers[(rec["mod"], rec["name"])] = printer
