"""Ambient session state: everything a later cell can observe that is not a
variable (DESIGN.md section 6). Saved as one pickled blob after every cell and
restored before the next, so a fresh worker continues like a pinned kernel.

Library state is captured only for libraries already imported, and restored
only into a worker that has the library: at once if its zygote imported it, else
when a cell first imports it (``when_imported``; importing torch or matplotlib
at restore would cost up to seconds for cells that never touch them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import linecache
import os
import pickle
import random
import sys
import types
import warnings
from typing import Any

import cloudpickle
from IPython import get_ipython
from IPython.core.alias import Alias

from . import checkpoint, quiet, workdir
from .localmods import LocalModules, Source


class Baseline:
    """What the worker looked like before any cell ran (diffs are against it)."""

    def __init__(self, shell):
        self.env = dict(os.environ)
        self.path = list(sys.path)
        self.np_print = None
        if "numpy" in sys.modules:
            self.np_print = sys.modules["numpy"].get_printoptions()
        mm = shell.magics_manager.magics
        self.magics = {kind: dict(mm[kind]) for kind in ("line", "cell")}
        shell._ll_base = self
        _watch_cells(shell)
        self.settings = _settings(shell)
        self.events = {k: list(v) for k, v in shell.events.callbacks.items()}
        self.formatters = {
            mime: (dict(f.type_printers), dict(f.deferred_printers))
            for mime, f in shell.display_formatter.formatters.items()
        }
        self.printers = {
            (mime, _printer_key(k), id(p))
            for mime, (types_, deferred) in self.formatters.items()
            for k, p in [*types_.items(), *deferred.items()]
        }


def _mpl_state() -> dict | None:
    mpl = sys.modules.get("matplotlib")
    if mpl is None:
        return None
    out = {}
    with quiet.own_warnings(show=False):
        for k, v in mpl.rcParams.items():
            if k in ("backend", "backend_fallback"):
                continue
            if mpl.rcParamsDefault.get(k) != v:
                out[k] = v
    return out


def _pandas_options() -> dict | None:
    pd = sys.modules.get("pandas")
    if pd is None:
        return None
    try:
        from pandas._config import config as pc
    except ImportError:
        return None
    out = {}
    with quiet.own_warnings(show=False):
        for key, opt in pc._registered_options.items():
            try:
                cur = pc._get_option(key, silent=True)
                if cur != opt.defval:
                    out[key] = cur
            except Exception:  # noqa: BLE001 - best effort per option
                pass
    return out


def _pickled(obj, ns: dict) -> tuple[bytes | None, str | None]:
    """Pickle a notebook function, class or object by value, the globals of its
    functions being the live namespace (as checkpoint records do); (blob, None)
    or (None, why not)."""

    class P(cloudpickle.Pickler):
        def persistent_id(self, o):
            return "ns" if o is ns else None

        def reducer_override(self, obj):
            if type(obj) is types.CodeType:
                return checkpoint._reduce_code(obj)  # tracebacks name the cell's file
            return super().reducer_override(obj)

        def _dynamic_function_reduce(self, func):
            # as checkpoint records: the function's globals are the live
            # namespace, not a copy of the names it reads
            red = super()._dynamic_function_reduce(func)
            if func.__globals__ is not ns:
                return red
            fn, newargs, (state, slotstate), a, b, setter = red
            code, _, name, defaults, closure = newargs
            slotstate = dict(slotstate, __globals__={})
            return (fn, (code, ns, name, defaults, closure), (state, slotstate), a, b, setter)

    buf = io.BytesIO()
    try:
        P(buf, protocol=5).dump(obj)
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    return buf.getvalue(), None


def _dumps_with_ns(obj, ns: dict) -> bytes | None:
    blob, why = _pickled(obj, ns)
    if blob is None:
        quiet.log(f"looseleaf worker: cannot keep {obj!r} for later workers: {why}")
    return blob


def _loads_with_ns(blob: bytes, ns: dict):
    up = pickle.Unpickler(io.BytesIO(blob))
    up.persistent_load = lambda pid: ns
    return up.load()


def _magics(shell, base: Baseline) -> list[tuple]:
    """Magics the notebook registered (functions, Magics classes, aliases), as
    records a later worker can register again. Those of loaded extensions come
    back with the extension."""
    ns = shell.user_ns
    ext_modules = set(shell.extension_manager.loaded)
    out, classes = [], set()
    for kind in ("line", "cell"):
        for name, fn in shell.magics_manager.magics[kind].items():
            if base.magics[kind].get(name) is fn:
                continue
            if isinstance(fn, Alias):
                out.append(("alias", name, fn.cmd))
            elif isinstance(fn, types.FunctionType):
                var = next((v for v in (name, fn.__name__) if ns.get(v) is fn), None)
                if var is None:
                    var = next((k for k, v in ns.items() if v is fn and not k.startswith("_")), None)
                out.append(("function", kind, name, var, None if var else _dumps_with_ns(fn, ns)))
            elif isinstance(fn, types.MethodType):
                cls = type(fn.__self__)
                if cls in classes or cls.__module__.split(".")[0] in ext_modules or cls.__module__ in ext_modules:
                    continue
                classes.add(cls)
                blob = _dumps_with_ns(cls, ns)
                if blob is not None:
                    out.append(("class", blob))
    # a magic an earlier worker registered that this one did not need (its
    # function was not in the closure) is still the session's
    have = {(r[1], r[2]) for r in out if r[0] == "function"}
    out += [r for r in getattr(shell, "_ll_unregistered", []) if (r[1], r[2]) not in have]
    return out


def _register_magics(shell, records: list[tuple]) -> None:
    ns = shell.user_ns
    shell._ll_unregistered = []
    for rec in records:
        try:
            if rec[0] == "alias":
                shell.alias_manager.define_alias(rec[1], rec[2])
            elif rec[0] == "function":
                _, kind, name, var, blob = rec
                fn = ns.get(var) if var is not None else None
                if fn is None and blob is not None:
                    fn = _loads_with_ns(blob, ns)
                if fn is None:
                    # the closure did not bring the function: this cell does not
                    # use the magic; keep the record for later workers
                    shell._ll_unregistered.append(rec)
                    continue
                shell.register_magic_function(fn, kind, name)
            elif rec[0] == "class":
                shell.register_magics(_loads_with_ns(rec[1], ns))
        except Exception as e:  # noqa: BLE001 - one magic lost, not the restore
            quiet.log(f"looseleaf worker: could not register magic {rec[:3]}: {type(e).__name__}: {e}")


# ------------------------------------------- what cells register with the interpreter
#
# Import finders, path hooks, input and AST transformers, event callbacks and
# display printers that notebook code made travel by value, like the magics
# above; a later worker puts them back where the cell put them. A printer a
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
# (see _inline_figures) and what loaded extensions register (they come back with
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


# ------------------------------------------------------------- shell settings

# Shell traits that are not settings a cell changes (or are carried elsewhere).
_NOT_SETTINGS = {"ast_transformers", "loop_runner", "inspector_class", "ipython_dir", "banner1", "banner2"}
_PRINTER_TABLES = {"type_printers", "deferred_printers", "singleton_printers"}


_config_names: dict[type, list[str]] = {}


def _names(obj, skip: set[str]) -> list[str]:
    # a class's config trait names (asking traitlets costs ~10 us per class)
    cls = type(obj)
    if cls not in _config_names:
        _config_names[cls] = [n for n in obj.trait_names(config=True) if n not in skip]
    return _config_names[cls]


def _settings(shell) -> dict:
    """What ``%xmode``, ``%precision``, ``%pprint``, ``%colors``, ``%autocall``,
    ``%config`` or an assignment (``ip.ast_node_interactivity = 'all'``) change."""
    out: dict[tuple, Any] = {("shell", n): getattr(shell, n) for n in _names(shell, _NOT_SETTINGS)}
    df = shell.display_formatter
    out.update({("display", n): getattr(df, n) for n in _names(df, set())})
    for mime, f in df.formatters.items():
        out.update({(mime, n): getattr(f, n) for n in _names(f, _PRINTER_TABLES)})
    tb = shell.InteractiveTB
    out[("tb", "mode")] = tb.mode
    out[("tb", "skip_hidden")] = tb.skip_hidden
    with contextlib.suppress(AttributeError):
        out[("tb", "colors")] = tb.color_scheme_table.active_scheme_name
    return out


def _changed_settings(shell, base: Baseline) -> dict:
    out = {}
    for key, value in _settings(shell).items():
        try:
            if key not in base.settings or base.settings[key] == value:
                continue
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - a value that cannot be compared or kept
            quiet.log(f"looseleaf worker: cannot keep the setting {key} = {value!r} for later workers")
            continue
        out[key] = value
    return out


def _apply_settings(shell, st: dict, base: Baseline) -> None:
    want = dict(base.settings)
    want.update(st.get("settings", {}))
    now = _settings(shell)
    for key, value in want.items():
        with contextlib.suppress(Exception):
            if key not in now or now[key] == value:
                continue
        kind, name = key
        try:
            if kind == "shell":
                setattr(shell, name, value)
            elif kind == "display":
                setattr(shell.display_formatter, name, value)
            elif kind == "tb" and name == "mode":
                shell.InteractiveTB.set_mode(mode=value)
            elif kind == "tb" and name == "colors":
                shell.InteractiveTB.set_colors(value)
                shell.SyntaxTB.set_colors(value)
            elif kind == "tb":
                setattr(shell.InteractiveTB, name, value)
            else:
                setattr(shell.display_formatter.formatters[kind], name, value)
        except Exception as e:  # noqa: BLE001 - one setting lost, not the restore
            quiet.log(f"looseleaf worker: could not restore the setting {key}: {type(e).__name__}: {e}")


# ------------------------------------------------------------- sympy printing


def _sympy_printing() -> dict | None:
    """What sympy's init_printing sets besides formatter printers: the printers'
    global settings (unicode, order) and Printable's ``_repr_*_`` methods."""
    if "sympy" not in sys.modules:
        return None
    try:
        from sympy.core._print_helpers import Printable
        from sympy.printing.printer import Printer
    except ImportError:
        return None
    reprs = {}
    for attr in ("_repr_latex_", "_repr_png_", "_repr_svg_"):
        fn = Printable.__dict__.get(attr)
        if fn is not None and getattr(fn, "__qualname__", "") != f"Printable.{attr}":
            reprs[attr] = fn
    if not reprs and not Printer._global_settings:
        return None
    try:
        return {"settings": dict(Printer._global_settings), "reprs": cloudpickle.dumps(reprs)}
    except Exception as e:  # noqa: BLE001
        quiet.log(f"looseleaf worker: cannot keep sympy's printing setup: {type(e).__name__}: {e}")
        return None


def _apply_sympy(st: dict) -> None:
    from sympy.core._print_helpers import Printable
    from sympy.printing.printer import Printer

    Printer.set_global_settings(**st["settings"])
    for attr, fn in pickle.loads(st["reprs"]).items():
        setattr(Printable, attr, fn)


# The session this worker serves drew with the inline backend (ambient state said so).
_session_drew_inline = False


def _inline_figures(shell) -> None:
    """The session drew with the inline backend: a Figure shown as a cell's value
    renders as an image, as in the kernel, without importing pyplot until one is
    shown. The first Figure formatted sets the inline support up for real."""
    inline = sys.modules.get("matplotlib_inline.backend_inline")
    if inline is not None and getattr(inline.configure_inline_support, "current_backend", None) == "inline":
        return  # this worker drew already: the formatters are the real ones
    key = ("matplotlib.figure", "Figure")
    formatters = shell.display_formatter.formatters
    hooks = []

    def hook_for(mime):
        def first_figure(fig):
            # IPython moved the hook that was asked from the deferred printers to
            # the type printers: take every one of ours out, then set up the real ones
            for f in formatters.values():
                if f.deferred_printers.get(key) in hooks:
                    f.deferred_printers.pop(key, None)
                if f.type_printers.get(type(fig)) in hooks:
                    f.type_printers.pop(type(fig), None)
            from IPython.core.pylabtools import select_figure_formats
            from matplotlib_inline.backend_inline import InlineBackend, configure_inline_support

            configure_inline_support(shell, "inline")
            cfg = InlineBackend.instance(parent=shell)
            select_figure_formats(shell, cfg.figure_formats, **cfg.print_figure_kwargs)
            printer = formatters[mime].type_printers.get(type(fig))
            return printer(fig) if printer is not None and printer not in hooks else None

        return first_figure

    for mime in ("image/png", "image/svg+xml", "image/jpeg", "application/pdf"):
        f = formatters.get(mime)
        if f is None or key in f.deferred_printers or any(t.__name__ == "Figure" for t in f.type_printers):
            continue
        hooks.append(hook_for(mime))
        f.for_type_by_name(*key, hooks[-1])


def capture(shell, base: Baseline) -> dict:
    """The ambient state as plain picklable values."""
    st: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy_rng"] = np.random.get_state()
        po = np.get_printoptions()
        if po != base.np_print:
            st["numpy_print"] = po
    torch = sys.modules.get("torch")
    if torch is not None:
        st["torch_rng"] = torch.get_rng_state().numpy().copy()
        try:
            if torch.cuda.is_initialized():
                st["torch_cuda_rng"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
        except Exception:  # noqa: BLE001
            pass
    mpl = _mpl_state()
    if mpl is not None:
        st["rcparams"] = mpl
    pdo = _pandas_options()
    if pdo is not None:
        st["pandas"] = pdo
    st.update(workdir.capture())  # a removed one too: see workdir
    st["sys_path"] = list(sys.path)
    st["env_set"] = {k: v for k, v in os.environ.items() if base.env.get(k) != v}
    st["env_unset"] = [k for k in base.env if k not in os.environ]
    filters = []
    for f in warnings.filters:
        try:
            pickle.dumps(f)
            filters.append(f)
        except Exception:  # noqa: BLE001 - a filter on a notebook class: skip
            pass
    st["warnings"] = filters
    st["extensions"] = sorted(shell.extension_manager.loaded)
    st["config"] = {k: dict(v) for k, v in shell.config.items() if k not in ("HistoryManager",) and isinstance(v, dict)}
    st["magics"] = _magics(shell, base)
    st["settings"] = _changed_settings(shell, base)
    st["formatted"] = getattr(shell.display_formatter, "formatted", True)
    st["hooks"] = _capture_hooks(shell, base)
    sympy_printing = _sympy_printing()
    if sympy_printing is not None:
        st["sympy_printing"] = sympy_printing
    dh, ns = shell.displayhook, shell.user_ns
    unders = ("_", "__", "___")
    # those the session has that are not a fresh shell's '' (the displayhook brings
    # them in when a result rotates them; a '' needs no bringing)
    held = {n for n in unders if n in ns and not (type(ns[n]) is str and ns[n] == "")}
    st["unders"] = sorted(held.union(n for n in shell.unders_in_session if n not in ns))
    # `_ = ...` in a cell (the displayhook's copy differs, or it has none: the
    # worker lacked the name): IPython leaves a name a cell assigned alone
    st["unders_user"] = [n for n in unders if n in ns and getattr(dh, n) is not ns[n]]
    # a session that drew inline keeps drawing inline, though this cell did not draw
    st["mpl_inline"] = "matplotlib_inline.backend_inline" in sys.modules or _session_drew_inline
    local = _local_modules()
    if local is not None:
        st["local_modules"] = {n: (s.origin, s.source, s.search) for n, s in local.snapshot().items()}
    st["cell_code"] = {
        name: (number, linecache.cache[name][2])
        for name, number in shell.compile._filename_map.items()
        if name in linecache.cache
    }
    hm = shell.history_manager
    st["execution_count"] = shell.execution_count
    st["hist_parsed"] = list(hm.input_hist_parsed)
    st["hist_raw"] = list(hm.input_hist_raw)
    st["hist_i"] = (hm._i00, hm._i, hm._ii, hm._iii)
    # state of libraries this worker was restored with but no cell imported yet
    for k, v in _on_import().unapplied().items():
        st.setdefault(k, v)
    return st


def _local_modules() -> LocalModules | None:
    return next((f for f in sys.meta_path if isinstance(f, LocalModules)), None)


def dumps(shell, base: Baseline) -> bytes:
    return pickle.dumps(capture(shell, base), protocol=5)


def loads(blob) -> dict:
    return pickle.loads(blob)


def apply_paths(st: dict) -> None:
    """What imports depend on, applied before the restore imports anything: the
    working directory, ``sys.path``, environment variables and the session's own
    modules as it last imported them."""
    # a kept worker: what an earlier restore left pending is stale (before the
    # restore's imports could fire it)
    _on_import().pending.clear()
    workdir.restore(st)
    added = [p for p in st["sys_path"] if p not in sys.path]
    sys.path[:0] = added
    for k in st["env_unset"]:
        os.environ.pop(k, None)
    os.environ.update(st["env_set"])
    local = _local_modules()
    if local is not None:
        local.adopt({n: Source(o, src, search) for n, (o, src, search) in st.get("local_modules", {}).items()})
    _apply_import_hooks(st)


class _OnImport:
    """A meta path finder that runs a callback right after a module's first import
    in this worker. A library's saved state (its RNG, its options) matters only
    once a cell uses the library, so a worker whose zygote lacks it does not
    import it at restore (matplotlib ~80 ms, torch ~1 s): the state is applied
    when the cell imports it. Until then the saved entries are carried into this
    worker's own saves (``unapplied``), so no later worker loses them."""

    def __init__(self):
        self.pending: dict[str, tuple[Any, dict]] = {}  # module -> (callback, saved entries)
        self._finding: set[str] = set()

    def unapplied(self) -> dict:
        """The saved entries of the libraries no cell has imported yet."""
        out: dict = {}
        for name, (_, entries) in self.pending.items():
            if name not in sys.modules:
                out.update(entries)
        return out

    def find_spec(self, name, path, target=None):
        if name not in self.pending or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = importlib.util.find_spec(name)  # the other finders (ours passes now)
        finally:
            self._finding.discard(name)
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a class as loader (builtins, frozen) is shared: never patched
        load = loader.exec_module

        def exec_module(module):
            if module.__name__ != name:  # a loader shared by several modules
                return load(module)
            try:
                load(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # the instance's own method again
            # imported: from here the library's live state is what saves read
            then = self.pending.pop(name, (None, None))[0]
            if then is not None:
                _guarded(then, module)

        # on this loader instance only: its class (and resource reading) stay as
        # they are; one that takes no attributes imports as usual (its state is
        # carried, not applied)
        with contextlib.suppress(AttributeError, TypeError):
            loader.exec_module = exec_module
        return spec


def _guarded(fn, module) -> None:
    # inside a cell's import: a failure must not fail the user's import
    try:
        fn(module)
    except Exception as e:  # noqa: BLE001 - one library's state lost, not the import
        quiet.log(f"looseleaf worker: could not restore {module.__name__} state: {type(e).__name__}: {e}")


def _on_import() -> _OnImport:
    hook = next((f for f in sys.meta_path if isinstance(f, _OnImport)), None)
    if hook is None:
        hook = _OnImport()
        sys.meta_path.insert(0, hook)
    return hook


def when_imported(name: str, fn, entries: dict) -> None:
    """Call ``fn(module)`` now if ``name`` is imported (its errors are the
    restore's), else right after a cell first imports it; ``entries``: the saved
    state ``fn`` applies, carried into saves until then."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
    else:
        _on_import().pending[name] = (fn, entries)


def _entries(st: dict, *keys: str) -> dict:
    return {k: st[k] for k in keys if k in st}


def _apply_numpy(np, st: dict, base: Baseline) -> None:
    if "numpy_rng" in st:
        np.random.set_state(st["numpy_rng"])
    # setting costs ~0.4 ms of every start; a fresh worker already has the baseline
    want = st.get("numpy_print") or base.np_print
    if want and np.get_printoptions() != want:
        np.set_printoptions(**want)


def _apply_torch(torch, st: dict) -> None:
    torch.set_rng_state(torch.from_numpy(st["torch_rng"]))
    if "torch_cuda_rng" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(s) for s in st["torch_cuda_rng"]])


def _set_options(set_one, options: dict) -> None:
    with quiet.own_warnings(show=False):
        for k, v in options.items():
            try:
                set_one(k, v)
            except Exception:  # noqa: BLE001 - an option this version lacks
                pass


def apply(shell, st: dict, base: Baseline) -> None:
    """Make this worker's ambient state equal ``st`` (best effort per item); after
    ``apply_paths`` and after the variables, which registered magics may name."""
    global _session_drew_inline
    random.setstate(st["random"])
    if "torch_rng" in st:
        when_imported("torch", lambda torch: _apply_torch(torch, st), _entries(st, "torch_rng", "torch_cuda_rng"))
    if st.get("rcparams"):
        set_rc = lambda mpl: _set_options(mpl.rcParams.__setitem__, st["rcparams"])  # noqa: E731
        when_imported("matplotlib", set_rc, _entries(st, "rcparams"))
    if st.get("pandas"):
        when_imported("pandas", lambda pd: _set_options(pd.set_option, st["pandas"]), _entries(st, "pandas"))
    if warnings.filters != st["warnings"]:
        # only on a change: a change empties every warning registry, so warnings
        # shown once per location would show again
        warnings.filters[:] = st["warnings"]
        warnings._filters_mutated()
    for ext in st["extensions"]:
        if ext not in shell.extension_manager.loaded:
            try:
                shell.extension_manager.load_extension(ext)
            except Exception:  # noqa: BLE001
                pass
    # whether a %config of a formatter class reaches the formatters (see
    # WorkerDisplayFormatter)
    shell.display_formatter.formatted = st.get("formatted", True)
    if st.get("config"):
        from traitlets.config import Config

        cfg = Config(st["config"])
        shell.config.merge(cfg)
        for c in list(shell.configurables):
            try:
                c.update_config(cfg)
            except Exception:  # noqa: BLE001
                pass
    # after %config (a later assignment wins) and before numpy's options (%precision
    # sets them too: the saved ones win)
    _apply_settings(shell, st, base)
    if "numpy_rng" in st or "numpy_print" in st:
        when_imported("numpy", lambda np: _apply_numpy(np, st, base), _entries(st, "numpy_rng", "numpy_print"))
    _register_magics(shell, st.get("magics", []))
    _apply_hooks(shell, st, base)
    if "sympy_printing" in st:
        apply_sympy = lambda sympy: _apply_sympy(st["sympy_printing"])  # noqa: E731
        when_imported("sympy", apply_sympy, _entries(st, "sympy_printing"))
    shell.unders_in_session = st.get("unders", [])
    shell.unders_user_set = st.get("unders_user", [])
    if st.get("mpl_inline"):
        _session_drew_inline = True
        _inline_figures(shell)
    shell.execution_count = st["execution_count"]
    hm = shell.history_manager
    hm.input_hist_parsed[:] = st["hist_parsed"]
    hm.input_hist_raw[:] = st["hist_raw"]
    hm._i00, hm._i, hm._ii, hm._iii = st["hist_i"]
    ns = shell.user_ns
    ns.update({"_i": hm._i, "_ii": hm._ii, "_iii": hm._iii})
    for n, src in enumerate(hm.input_hist_raw[1:], start=1):
        ns[f"_i{n}"] = src
    # Code of earlier cells, for tracebacks and warnings raised in functions they
    # defined: the kernel keeps it in linecache under each cell's code name, and
    # the name's execution count labels the cell ("Cell In[3]").
    for name, (number, lines) in st.get("cell_code", {}).items():
        shell.compile._filename_map[name] = number
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
