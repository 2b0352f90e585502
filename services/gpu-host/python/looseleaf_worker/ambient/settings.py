"""Shell settings a cell changes (``%xmode``, ``%precision``, ``%config``, trait
assignments), kept as their differences from the baseline."""

from __future__ import annotations

import contextlib
import pickle
from typing import TYPE_CHECKING, Any

from .. import quiet

if TYPE_CHECKING:
    from .baseline import Baseline


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
