"""The standard library's process state a notebook sets in one cell and relies on
in later ones: logging's configuration (``logging.basicConfig`` in the first
cell, ``logger.info`` in the rest), decimal's context (``getcontext().prec``),
the recursion limit, names a cell put in ``builtins``, ``sys.argv``, the umask,
socket's default timeout and the last error (``sys.last_value``, ``%tb``). A
fresh worker has none of it, and losing it is silent: log lines vanish, decimals
get 28 digits.

Logging is kept as a description, not as objects: a handler holds a lock and a
stream. Stream handlers on the worker's stdout or stderr and file handlers (which
reopen for appending, so a restore never truncates the log a cell wrote) are
rebuilt with their level and plain formatter; other handlers are left out."""

from __future__ import annotations

import builtins
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import cloudpickle

from .. import quiet

if TYPE_CHECKING:
    from .baseline import Baseline

# a logger as a fresh one is: level, propagate, disabled, no handlers
_FRESH = (logging.NOTSET, True, False, ())

_STYLES = {logging.PercentStyle: "%", logging.StrFormatStyle: "{", logging.StringTemplateStyle: "$"}


def _loggers() -> list[tuple[str, logging.Logger]]:
    """The root (named "") and every logger made so far."""
    made = list(logging.root.manager.loggerDict.items())
    return [("", logging.root), *((n, lg) for n, lg in made if isinstance(lg, logging.Logger))]


def _shape(lg: logging.Logger) -> tuple:
    return (lg.level, lg.propagate, lg.disabled, tuple(id(h) for h in lg.handlers))


def logging_baseline() -> tuple[dict[str, tuple], int]:
    """Each logger's shape before any cell ran, and logging.disable's level."""
    return {name: _shape(lg) for name, lg in _loggers()}, logging.root.manager.disable


def _describe(h: logging.Handler) -> tuple | None:
    """A handler as data to rebuild it from, or None for one that cannot be."""
    if type(h) is logging.StreamHandler:
        stream = "stdout" if h.stream is sys.stdout else "stderr" if h.stream is sys.stderr else None
        if stream is None:
            return None
        target: tuple = ("stream", stream)
    elif type(h) is logging.FileHandler:
        target = ("file", h.baseFilename, h.encoding)
    else:
        return None
    f = h.formatter
    fmt = None
    if f is not None and type(f) is logging.Formatter:
        fmt = (f._fmt, f.datefmt, _STYLES.get(type(f._style), "%"))
    return (target, h.level, fmt)


def _build(d: tuple) -> logging.Handler:
    target, level, fmt = d
    if target[0] == "stream":
        h: logging.Handler = logging.StreamHandler(sys.stdout if target[1] == "stdout" else sys.stderr)
    else:
        h = logging.FileHandler(target[1], mode="a", encoding=target[2], delay=True)
    h.setLevel(level)
    if fmt is not None:
        h.setFormatter(logging.Formatter(fmt[0], fmt[1], style=fmt[2]))
    return h


def capture_logging(base: Baseline) -> dict | None:
    """The loggers a cell configured (level, propagate, disabled, the handlers it
    added), and logging.disable's level; None if nothing differs."""
    shapes, disable = base.logging
    loggers = {}
    for name, lg in _loggers():
        shape = _shape(lg)
        if shapes.get(name, _FRESH) == shape:
            continue
        at_base = set(shapes.get(name, _FRESH)[3])
        handlers = [d for h in lg.handlers if id(h) not in at_base and (d := _describe(h)) is not None]
        if shape[:3] == _FRESH[:3] and not handlers and name not in shapes:
            continue  # a library's logger with only a NullHandler: as its import makes it
        loggers[name] = (lg.level, lg.propagate, lg.disabled, handlers)
    current = logging.root.manager.disable
    if not loggers and current == disable:
        return None
    return {"loggers": loggers, "disable": current}


def apply_logging(st: dict) -> None:
    """Configure the loggers as captured; a handler already there (a kept worker
    applying its own state) is not added twice."""
    for name, (level, propagate, disabled, handlers) in st["loggers"].items():
        lg = logging.getLogger(name) if name else logging.root
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
        have = [_describe(h) for h in lg.handlers]
        for d in handlers:
            if d not in have:
                lg.addHandler(_build(d))
    if logging.root.manager.disable != st["disable"]:
        logging.disable(st["disable"])


def decimal_context() -> Any | None:
    """The main thread's decimal context, where a cell changed it (its flags
    included, as a kernel keeps them); None if decimal is not imported or the
    context is a fresh one."""
    decimal = sys.modules.get("decimal")
    if decimal is None:
        return None
    ctx = decimal.getcontext()
    return None if repr(ctx) == repr(decimal.DefaultContext) else ctx.copy()


def apply_decimal(decimal, ctx) -> None:
    decimal.setcontext(ctx.copy())


def apply_recursion_limit(limit: int) -> None:
    if sys.getrecursionlimit() != limit:
        try:
            sys.setrecursionlimit(limit)
        except (RecursionError, ValueError):
            pass  # lower than the restore's own depth: the nearest it can be


# the worker's own package: what it puts in builtins is not the session's
_RUNTIME = "looseleaf_worker"

# what IPython's builtin trap puts in builtins while a cell runs, and takes out
_TRAPPED = frozenset({"get_ipython", "exit", "quit", "__IPYTHON__"})


def builtins_baseline() -> dict[str, Any]:
    return dict(vars(builtins))


def capture_builtins(base: Baseline) -> dict[str, bytes]:
    """Names a cell bound in ``builtins`` (a helper every module sees), each
    pickled by value on its own: one that cannot be is left out, said in the log."""
    out = {}
    for name, value in list(vars(builtins).items()):
        if name in _TRAPPED or base.builtins.get(name, _TRAPPED) is value:
            continue
        if name.startswith("__") and name.endswith("__"):
            continue  # an extension's own (pybind11 keeps a capsule there), not a cell's
        if str(getattr(value, "__module__", None) or "").startswith(_RUNTIME):
            continue  # the worker's own (its eval and exec route names to the session)
        try:
            out[name] = cloudpickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            quiet.log(f"looseleaf worker: cannot keep builtins.{name}: {type(e).__name__}: {e}")
    return out


def apply_builtins(saved: dict[str, bytes]) -> None:
    for name, blob in saved.items():
        try:
            setattr(builtins, name, cloudpickle.loads(blob))
        except Exception as e:  # noqa: BLE001
            quiet.log(f"looseleaf worker: cannot restore builtins.{name}: {type(e).__name__}: {e}")


def umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def process_settings(base: Baseline) -> dict:
    """sys.argv, the umask and socket's default timeout, where a cell changed them."""
    out: dict[str, Any] = {}
    if sys.argv != base.argv:
        out["argv"] = list(sys.argv)
    if (mask := umask()) != base.umask:
        out["umask"] = mask
    socket = sys.modules.get("socket")
    if socket is not None and socket.getdefaulttimeout() is not None:
        out["socket_timeout"] = socket.getdefaulttimeout()
    return out


def apply_process_settings(st: dict) -> None:
    if "argv" in st:
        sys.argv[:] = st["argv"]
    if "umask" in st:
        os.umask(st["umask"])
    if "socket_timeout" in st:
        import socket

        socket.setdefaulttimeout(st["socket_timeout"])


def last_error() -> bytes | None:
    """The error the session's last failing cell raised (``sys.last_value``, what
    ``%tb`` and ``sys.last_value`` read), pickled; its traceback is not kept."""
    value = getattr(sys, "last_value", None)
    if value is None:
        return None
    try:
        return cloudpickle.dumps(value)
    except Exception:  # noqa: BLE001 - an error holding what cannot be pickled
        return None


def apply_last_error(blob: bytes) -> None:
    try:
        value = cloudpickle.loads(blob)
    except Exception as e:  # noqa: BLE001
        quiet.log(f"looseleaf worker: cannot restore the last error: {type(e).__name__}: {e}")
        return
    sys.last_type, sys.last_value, sys.last_traceback = type(value), value, value.__traceback__
