"""Attributes a cell set on a library's module or class: ``torch.backends.cudnn.
benchmark = True``, ``math.golden = ...``, ``pd.DataFrame.total = lambda self:
...``, ``helper.VALUE = 42`` on the session's own module. A module is saved as
its import, so a fresh worker imports it as its file makes it and the change
is lost; in a kernel it stays for every later cell.

After each cell the worker notes the attribute targets of its assignments whose
root names a module, or a class of a module other than the notebook's. After
each cell those attributes' current values are saved (pickled by value with
cloudpickle, one by one: one that cannot be is left out and logged), and a
restore sets them again once the module is imported."""

from __future__ import annotations

import ast
import re
import sys
import types
from typing import Any

import cloudpickle

from .. import quiet
from .onimport import when_imported

# (module name, attribute path from the module) -> the value pickled, or None
# while not yet read
Patches = dict[tuple[str, tuple[str, ...]], "bytes | None"]


# an attribute assignment somewhere in the code (`a.b = `, `a.b += `): most cells
# have none, and parsing a long cell costs a millisecond
_MAYBE = re.compile(r"[\w\]\)]\s*\.\s*[A-Za-z_]\w*\s*(?:[-+*/%&|^@]|//|\*\*|<<|>>)?=(?!=)")


def _targets(code: str) -> set[tuple[str, tuple[str, ...]]]:
    """(root name, attribute path) of each attribute assigned in ``code``."""
    if not _MAYBE.search(code):
        return set()
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            stack = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            stack = [node.target]
        else:
            continue
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
                continue
            if isinstance(t, ast.Starred):
                stack.append(t.value)
                continue
            path = []
            while isinstance(t, ast.Attribute):
                path.append(t.attr)
                t = t.value
            if path and isinstance(t, ast.Name):
                out.add((t.id, tuple(reversed(path))))
    return out


def _owner(root: Any, path: tuple[str, ...]) -> tuple[str, tuple[str, ...]] | None:
    """Where a patch lives, as (module name, path from the module), for a root
    that is a library's module or class; None for the notebook's own objects
    (saved as variables)."""
    if isinstance(root, types.ModuleType):
        name = getattr(root, "__name__", None)
        return (name, path) if isinstance(name, str) and name != "__main__" else None
    if isinstance(root, type):
        mod, qual = getattr(root, "__module__", None), getattr(root, "__qualname__", "")
        if not isinstance(mod, str) or mod in ("__main__", "builtins") or "<locals>" in qual:
            return None
        if sys.modules.get(mod) is None:
            return None
        return mod, (*qual.split("."), *path)
    return None


# the value each attribute held when it could not be pickled
_unsaved: dict[tuple[str, tuple[str, ...]], Any] = {}


def _patches(shell) -> Patches:
    if not hasattr(shell, "_ll_patches"):
        shell._ll_patches = {}
    return shell._ll_patches


def note_cell(shell) -> None:
    """After a cell: the module and class attributes its code assigns."""
    hm = shell.history_manager
    if not hm.input_hist_parsed:
        return
    ns, patches = shell.user_ns, _patches(shell)
    for root_name, path in _targets(hm.input_hist_parsed[-1]):
        where = _owner(ns.get(root_name), path)
        if where is not None:
            patches.setdefault(where, None)


def _resolve(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        obj = getattr(obj, part)
    return obj


def capture(shell) -> dict:
    """Each noted attribute's value now (as restored, for a module this worker
    has not imported)."""
    patches = _patches(shell)
    out = {}
    for (mod, path), blob in list(patches.items()):
        module = sys.modules.get(mod)
        if module is None:
            if blob is not None:
                out[(mod, path)] = blob
            continue
        try:
            value = _resolve(module, path)
        except Exception:  # noqa: BLE001 - not set (yet): nothing to carry
            continue
        try:
            blob = cloudpickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            if _unsaved.get((mod, path)) is not value:  # said once per value
                _unsaved[(mod, path)] = value
                quiet.log(f"looseleaf worker: cannot keep {mod}.{'.'.join(path)}: {type(e).__name__}: {e}")
            continue
        patches[(mod, path)] = out[(mod, path)] = blob
    return out


def apply(shell, saved: dict) -> None:
    """Set the saved attributes again, each module's once it is imported."""
    _patches(shell).update(saved)
    by_module: dict[str, list] = {}
    for (mod, path), blob in saved.items():
        by_module.setdefault(mod, []).append((path, blob))
    for mod, items in by_module.items():
        when_imported(mod, lambda module, items=items: _set(module, items), {})


def _set(module: types.ModuleType, items: list) -> None:
    for path, blob in items:
        try:
            setattr(_resolve(module, path[:-1]), path[-1], cloudpickle.loads(blob))
        except Exception as e:  # noqa: BLE001 - one attribute lost, not the restore
            quiet.log(f"looseleaf worker: cannot set {module.__name__}.{'.'.join(path)}: {type(e).__name__}: {e}")
