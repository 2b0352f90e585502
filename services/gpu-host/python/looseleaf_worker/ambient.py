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
from IPython.core.alias import Alias

from . import quiet
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


def _dumps_with_ns(obj, ns: dict) -> bytes | None:
    """Pickle a notebook function or class by value, its globals being the live
    namespace (as checkpoint records do); None if it cannot be pickled."""

    class P(cloudpickle.Pickler):
        def persistent_id(self, o):
            return "ns" if o is ns else None

    buf = io.BytesIO()
    try:
        P(buf, protocol=5).dump(obj)
    except Exception as e:  # noqa: BLE001
        quiet.log(f"looseleaf worker: cannot keep {obj!r} for later workers: {type(e).__name__}: {e}")
        return None
    return buf.getvalue()


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
    st["cwd"] = os.getcwd()
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
    try:
        os.chdir(st["cwd"])
    except OSError:
        pass  # the directory is gone; the cell will see where the host put it
    added = [p for p in st["sys_path"] if p not in sys.path]
    sys.path[:0] = added
    for k in st["env_unset"]:
        os.environ.pop(k, None)
    os.environ.update(st["env_set"])
    local = _local_modules()
    if local is not None:
        local.adopt({n: Source(o, src, search) for n, (o, src, search) in st.get("local_modules", {}).items()})


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
    if "numpy_rng" in st or "numpy_print" in st:
        when_imported("numpy", lambda np: _apply_numpy(np, st, base), _entries(st, "numpy_rng", "numpy_print"))
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
    if st.get("config"):
        from traitlets.config import Config

        cfg = Config(st["config"])
        shell.config.merge(cfg)
        for c in list(shell.configurables):
            try:
                c.update_config(cfg)
            except Exception:  # noqa: BLE001
                pass
    _register_magics(shell, st.get("magics", []))
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
