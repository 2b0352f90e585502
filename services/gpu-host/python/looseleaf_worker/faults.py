"""The safety net for names a closure missed (DESIGN.md section 6).

Static closures cannot see names that notebook code reaches through a computed
string: a display helper whose ``_repr_html_`` runs ``eval(name)`` on the strings
it was given. While a cell runs, ``eval`` and ``exec`` called from notebook code
(code whose globals are the session's namespace) look names up through a mapping
that, for a name neither the code's locals, the namespace nor the builtins have,
asks the worker to bring it in from the session's committed state (the host
answers a ``fault`` with a restore of just that name, sharing objects as if it had
been restored up front). Every other call of ``eval``/``exec`` (libraries, IPython
running the cell) goes straight to the builtin.

Only ``eval``/``exec`` are covered: a plain name read through the namespace dict's
fast path cannot be intercepted without slowing every global lookup, so the
planner restores cells that use ``globals()`` conservatively instead.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable, MutableMapping

_EVAL = builtins.eval
_EXEC = builtins.exec


class _Names(MutableMapping):
    """The locals of evaluated code: the caller's locals, then (through the
    interpreter) the namespace and the builtins; a name none has is faulted in."""

    def __init__(self, local, ns: dict, fault: Callable[[str], bool]):
        self._local, self._ns, self._fault = local, ns, fault

    def __getitem__(self, name):
        try:
            return self._local[name]
        except KeyError:
            pass
        if name in self._ns or hasattr(builtins, name) or name.startswith("__") or not self._fault(name):
            raise KeyError(name)  # the interpreter goes on to globals and builtins
        return self._ns[name]

    def __setitem__(self, name, value):
        self._local[name] = value

    def __delitem__(self, name):
        del self._local[name]

    def __iter__(self):
        return iter(self._local)

    def __len__(self):
        return len(self._local)


def evaluate(expr: str, ns: dict, fault: Callable[[str], bool]):
    """``eval(expr)`` in the namespace ``ns`` through the net (the runtime's own
    evaluations of user code, such as a run's user_expressions)."""
    return _EVAL(expr, ns, _Names(ns, ns, fault))


def install(ns: dict, fault: Callable[[str], bool]) -> None:
    """Route ``eval``/``exec`` from code running in ``ns`` through the net;
    ``fault(name)`` brings a name into ``ns`` and says whether it could."""

    def scope(args, kwargs):
        """(globals, locals) as the builtin would take them, seen from its caller."""
        caller = sys._getframe(2)
        g = args[1] if len(args) > 1 else kwargs.get("globals")
        loc = args[2] if len(args) > 2 else kwargs.get("locals")
        if g is None:
            g = caller.f_globals
            loc = caller.f_locals if loc is None else loc
        if loc is None:
            loc = g
        if g is ns and caller.f_globals is ns:
            loc = _Names(loc, ns, fault)
        return g, loc

    def eval(*args, **kwargs):  # noqa: A001 - the builtin's name
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
        return _EVAL(args[0], *scope(args, kwargs))

    def exec(*args, **kwargs):  # noqa: A001 - the builtin's name
        __tracebackhide__ = True  # noqa: F841
        extra = {k: v for k, v in kwargs.items() if k not in ("globals", "locals")}
        return _EXEC(args[0], *scope(args, kwargs), **extra)

    eval.__doc__, exec.__doc__ = _EVAL.__doc__, _EXEC.__doc__
    builtins.eval, builtins.exec = eval, exec
    # IPython runs each cell with exec(); it keeps the builtin (one frame less in
    # every traceback, and the cell's own names are never looked up in Python)
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is not None:
        shell_module.exec = _EXEC
