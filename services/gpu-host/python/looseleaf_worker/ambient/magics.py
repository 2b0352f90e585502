"""Magics the notebook registered (functions, Magics classes, aliases), kept as
records a later worker registers again."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

from IPython.core.alias import Alias

from .. import quiet
from .byvalue import _dumps_with_ns, _loads_with_ns

if TYPE_CHECKING:
    from .baseline import Baseline


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
