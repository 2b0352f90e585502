"""The ambient state as a whole: captured into one pickled blob after a cell and
applied, part by part in the order a restore needs, before the next."""

from __future__ import annotations

import linecache
import os
import pickle
import random
import sys
from typing import TYPE_CHECKING, Any

from .. import quiet, workdir
from ..localmods import LocalModules, Source
from . import filters, patches
from .hooks import _apply_hooks, _apply_import_hooks, _capture_hooks
from .inline import _inline_figures
from .libraries import (
    NUMPY_ERR,
    _apply_numpy,
    _apply_sklearn,
    _apply_sympy,
    _apply_torch,
    _mpl_state,
    _pandas_options,
    _set_options,
    _sklearn_config,
    _sympy_printing,
    _torch_settings,
)
from .magics import _magics, _register_magics
from .onimport import _on_import, when_imported
from .settings import _apply_settings, _changed_settings
from .stdlib import (
    apply_builtins,
    apply_decimal,
    apply_last_error,
    apply_logging,
    apply_process_settings,
    apply_recursion_limit,
    capture_builtins,
    capture_logging,
    decimal_context,
    last_error,
    process_settings,
)

if TYPE_CHECKING:
    from .baseline import Baseline

# The session this worker serves drew with the inline backend (ambient state said so).
_session_drew_inline = False


def capture(shell, base: Baseline) -> dict:
    """The ambient state as plain picklable values."""
    st: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy_rng"] = np.random.get_state()
        po = np.get_printoptions()
        if po != base.np_print:
            st["numpy_print"] = po
        err = np.geterr()
        if err != (base.np_err or NUMPY_ERR):
            st["numpy_err"] = err
    torch = sys.modules.get("torch")
    if torch is not None:
        st["torch_rng"] = torch.get_rng_state().numpy().copy()
        try:
            if torch.cuda.is_initialized():
                st["torch_cuda_rng"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
        except Exception:  # noqa: BLE001
            pass
        settings = _torch_settings(torch)
        if settings:
            st["torch_settings"] = settings
    mpl = _mpl_state()
    if mpl is not None:
        st["rcparams"] = mpl
    pdo = _pandas_options()
    if pdo is not None:
        st["pandas"] = pdo
    st.update(workdir.capture())  # a removed one too: see workdir
    # the standard library's state (stdlib.py), each kept only where a cell changed it
    limit = sys.getrecursionlimit()
    changed = {
        "recursion_limit": limit if limit != base.recursion_limit else None,
        "logging": capture_logging(base),
        "decimal": decimal_context(),
        "builtins": capture_builtins(base) or None,
        "process": process_settings(base) or None,
        "last_error": last_error(),
    }
    st.update({k: v for k, v in changed.items() if v is not None})
    st["sys_path"] = list(sys.path)
    if base.env_bytes is not None and getattr(os.environ, "_data", None) == base.env_bytes:
        st["env_set"], st["env_unset"] = {}, []
    else:
        st["env_set"] = {k: v for k, v in os.environ.items() if base.env.get(k) != v}
        st["env_unset"] = [k for k in base.env if k not in os.environ]
    st["warnings"] = filters.capture()
    st["extensions"] = sorted(shell.extension_manager.loaded)
    st["config"] = {k: dict(v) for k, v in shell.config.items() if k not in ("HistoryManager",) and isinstance(v, dict)}
    st["magics"] = _magics(shell, base)
    st["settings"] = _changed_settings(shell, base)
    st["formatted"] = getattr(shell.display_formatter, "formatted", True)
    st["hooks"] = _capture_hooks(shell, base)
    sklearn_config = _sklearn_config()
    if sklearn_config is not None:
        st["sklearn_config"] = sklearn_config
    module_patches = patches.capture(shell)
    if module_patches:
        st["module_patches"] = module_patches
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
    hm = shell.history_manager
    st["execution_count"] = shell.execution_count
    st.update(_history(shell, hm))
    st["hist_i"] = (hm._i00, hm._i, hm._ii, hm._iii)
    # state of libraries this worker was restored with but no cell imported yet
    for k, v in _on_import().unapplied().items():
        st.setdefault(k, v)
    return st


def _cell_lines(code: str) -> list[str]:
    """A cell's code as IPython's compiler puts it in linecache."""
    return [line + "\n" for line in code.splitlines()]


def _history(shell, hm) -> dict:
    """The input history and the cells' code in linecache, each text once: every
    cell is saved after every cell, so three copies of every input (raw, parsed,
    linecache) made the saved bytes grow three times as fast with the session.
    A parsed input is kept only where it differs from the raw one, a cell's
    linecache lines only where they are not its parsed input's."""
    raw, parsed = list(hm.input_hist_raw), list(hm.input_hist_parsed)
    same = len(raw) == len(parsed)
    code = {}
    for name, number in shell.compile._filename_map.items():
        if name not in linecache.cache:
            continue
        lines = linecache.cache[name][2]
        derived = type(number) is int and 0 <= number < len(parsed) and lines == _cell_lines(parsed[number])
        code[name] = (number, None if derived else lines)
    if not same:  # the two disagree in length: the parsed list in full
        return {"hist_raw": raw, "hist_parsed": parsed, "cell_code": code}
    changed = {i: p for i, (p, r) in enumerate(zip(parsed, raw, strict=True)) if p != r}
    return {"hist_raw": raw, "hist_parsed_changed": changed, "cell_code": code}


def _parsed_history(st: dict) -> list[str]:
    if st.get("hist_parsed") is not None:
        return st["hist_parsed"]  # saved in full (also by workers before the compact form)
    parsed = list(st["hist_raw"])
    for i, p in (st.get("hist_parsed_changed") or {}).items():
        parsed[i] = p
    return parsed


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


def _entries(st: dict, *keys: str) -> dict:
    return {k: st[k] for k in keys if k in st}


def apply(shell, st: dict, base: Baseline) -> None:
    """Make this worker's ambient state equal ``st`` (best effort per item); after
    ``apply_paths`` and after the variables, which registered magics may name."""
    global _session_drew_inline
    random.setstate(st["random"])
    if "torch_rng" in st:
        entries = _entries(st, "torch_rng", "torch_cuda_rng", "torch_settings")
        when_imported("torch", lambda torch: _apply_torch(torch, st), entries)
    if "decimal" in st:
        when_imported("decimal", lambda decimal: apply_decimal(decimal, st["decimal"]), _entries(st, "decimal"))
    if "recursion_limit" in st:
        apply_recursion_limit(st["recursion_limit"])
    if "process" in st:
        apply_process_settings(st["process"])
    if "builtins" in st:
        apply_builtins(st["builtins"])
    if "last_error" in st:
        apply_last_error(st["last_error"])
    if "logging" in st:
        try:
            apply_logging(st["logging"])
        except Exception as e:  # noqa: BLE001 - the rest of the state still applies
            quiet.log(f"looseleaf worker: cannot restore logging's configuration: {type(e).__name__}: {e}")
    if st.get("rcparams"):
        set_rc = lambda mpl: _set_options(mpl.rcParams.__setitem__, st["rcparams"])  # noqa: E731
        when_imported("matplotlib", set_rc, _entries(st, "rcparams"))
    if st.get("pandas"):
        when_imported("pandas", lambda pd: _set_options(pd.set_option, st["pandas"]), _entries(st, "pandas"))
    filters.apply(st["warnings"])
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
    if "numpy_rng" in st or "numpy_print" in st or "numpy_err" in st:
        entries = _entries(st, "numpy_rng", "numpy_print", "numpy_err")
        when_imported("numpy", lambda np: _apply_numpy(np, st, base), entries)
    _register_magics(shell, st.get("magics", []))
    _apply_hooks(shell, st, base)
    if "sympy_printing" in st:
        apply_sympy = lambda sympy: _apply_sympy(st["sympy_printing"])  # noqa: E731
        when_imported("sympy", apply_sympy, _entries(st, "sympy_printing"))
    if "sklearn_config" in st:
        apply_sklearn = lambda sklearn: _apply_sklearn(sklearn, st["sklearn_config"])  # noqa: E731
        when_imported("sklearn", apply_sklearn, _entries(st, "sklearn_config"))
    # after the libraries' own state: an attribute a cell set wins
    if st.get("module_patches"):
        patches.apply(shell, st["module_patches"])
    shell.unders_in_session = st.get("unders", [])
    shell.unders_user_set = st.get("unders_user", [])
    if st.get("mpl_inline"):
        _session_drew_inline = True
        _inline_figures(shell)
    shell.execution_count = st["execution_count"]
    hm = shell.history_manager
    parsed = _parsed_history(st)
    hm.input_hist_parsed[:] = parsed
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
        if lines is None:
            lines = _cell_lines(parsed[number])
        shell.compile._filename_map[name] = number
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
