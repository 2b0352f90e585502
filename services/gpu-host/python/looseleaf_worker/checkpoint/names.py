"""Names in the user namespace: which are user state (variables) and which
globals notebook code reads when it is called."""

from __future__ import annotations

import types
from typing import Any

# IPython's own names, never user state (In history is ambient state; `_`,
# `__`, `___` and `_N` are ordinary variables).
_IPY_NAMES = {"In", "Out", "_ih", "_oh", "_dh", "_i", "_ii", "_iii", "_i00"}


def is_user_name(name: str, value: Any, hidden: dict) -> bool:
    if name in ("_", "__", "___") or (name[:1] == "_" and name[1:].isdigit()):
        return True  # output history: the displayhook marks them hidden, but
        # for the closure analysis they are ordinary variables
    if name.startswith("__") or name in _IPY_NAMES:
        return False
    if name.startswith("_i") and name[2:].isdigit():
        return False  # input history: ambient state
    if name in hidden and hidden[name] is value:
        return False
    return True


# --------------------------------------------------- what notebook code reads


def function_global_reads(value: Any, ns: dict) -> list[str]:
    """Global names a notebook-made callable may read when called: lambdas, nested
    functions returned by factories, partials. (``def`` and ``class`` statements
    are summarised statically by the planner; values made at run time are not,
    so the worker reports them.)"""
    names: set[str] = set()
    seen: set[int] = set()

    def code_names(code) -> None:
        names.update(_code_names(code))

    def visit(obj, depth: int) -> None:
        if depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            if obj.__globals__ is ns:
                code_names(obj.__code__)
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # empty cell
                    pass
        elif isinstance(obj, types.MethodType):
            visit(obj.__func__, depth + 1)
        else:
            inner = getattr(obj, "func", None)  # functools.partial
            if inner is not None and callable(inner):
                visit(inner, depth + 1)

    visit(value, 0)
    return sorted(n for n in names if n in ns and not n.startswith("__"))


def _code_names(code: types.CodeType) -> set[str]:
    """Every name a code object (and the functions, lambdas and comprehensions it
    defines) may look up as a global or attribute."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names
