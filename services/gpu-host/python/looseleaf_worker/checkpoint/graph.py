"""The shared-object graph: which objects several variables reach (each then a
record of its own, so identity holds across variables), which variables share an
object with an unsavable one, and the reference cycles between records."""

from __future__ import annotations

import io
import types
from typing import Any

from .. import comms
from .pickler import RecordPickler, _is_atomic


def _carries_identity(obj: Any) -> bool:
    """An immutable object whose identity a notebook can observe (``x is EMPTY``
    for a sentinel tuple that a grid also holds): the atoms that are not
    interpreter-wide singletons. Such an object keeps one identity across records
    when it is a variable's value or was restored as a record of its own."""
    t = type(obj)
    # (), '' and single characters are cached by the interpreter; numbers are left
    # out as pickle itself never keeps their identity, even inside one record
    return (t is tuple or t is frozenset or t is str or t is bytes) and len(obj) > 1


class _Null(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        return len(b)


def _find_shared(
    roots: list[Any],
    ns: dict,
    keep: list,
    known: dict[int, tuple[str, Any]] | None = None,
    identity: set[int] | frozenset = frozenset(),
) -> list[Any]:
    """Objects (not roots) reached from more than one unit, where units are the
    roots plus the shared objects themselves; iterate so that the insides of a
    shared object are not all split into records of their own. Objects restored
    as records of their own (``known``) stay records: other variables that this
    worker does not hold may share them."""
    known = known or {}
    root_ids = {id(r) for r in roots}
    shared: dict[int, Any] = {}
    for _ in range(5):
        units = list(roots) + list(shared.values())
        unit_refs = {id(u): ("stop", "") for u in units}
        reach: dict[int, set[int]] = {}
        objs: dict[int, Any] = {}
        for u in units:
            p = RecordPickler(_Null(), ns, {id(u)}, unit_refs, lambda b: False)
            p.seen = []
            p.identity = identity
            try:
                p.dump(u)
            except BaseException:  # noqa: BLE001 - unsavable; handled in the real pass
                pass
            keep.append(p.seen)  # keep ids unique for the whole save
            for o in p.seen:
                reach.setdefault(id(o), set()).add(id(u))
                objs[id(o)] = o
        new = {
            i: objs[i]
            for i, rs in reach.items()
            if i not in root_ids and (len(rs) > 1 or (i in known and known[i][1] is objs[i]))
        }
        if new.keys() == shared.keys():
            break
        shared = new
    return list(shared.values())


# How far to follow references when looking for objects an unsavable variable
# shares with others (a bound, not a correctness limit: past it, sharing is missed).
_SHARE_SCAN_LIMIT = 200_000


def _referents(start: Any, ns: dict, limit: int) -> set[int]:
    """Ids of the mutable objects reachable from ``start`` through the garbage
    collector's references, not crossing module globals, modules, classes or code:
    what a generator, a thread or an open file really holds on to. Immutable
    atoms (numbers, strings, tuples themselves) are walked through but not
    returned: sharing them splits no alias."""
    import gc

    stop = (types.ModuleType, type, types.CodeType, types.FunctionType, types.BuiltinFunctionType)
    seen: set[int] = set()
    mutable: set[int] = set()
    todo = [start]
    while todo and len(seen) < limit:
        o = todo.pop()
        if id(o) in seen or o is ns or isinstance(o, stop):
            continue
        seen.add(id(o))
        if not _is_atomic(o):
            mutable.add(id(o))
        if isinstance(o, types.FrameType):
            # a frame's globals are the whole namespace: follow its locals only
            todo.extend(o.f_locals.values())
            continue
        if comms.is_widget(o):
            # what its saved form holds, not the handlers and logger every widget
            # shares (one unsavable widget would make every widget unsavable)
            todo.extend(comms.widget_state(o).values())
            continue
        todo.extend(gc.get_referents(o))
    return mutable


def _keep_sharers(ns: dict, names: list[str], unsavable: dict[str, str], variables: dict) -> None:
    """A variable that shares an object with an unsavable one stays unsavable too,
    so both live in the worker that keeps them and an alias between them is never
    split into a restored copy and the original (DESIGN.md section 6)."""
    if not unsavable:
        return
    held: dict[int, str] = {}
    for bad in list(unsavable):
        for i in _referents(ns[bad], ns, _SHARE_SCAN_LIMIT):
            held.setdefault(i, bad)
    for name in list(variables):
        v = ns.get(name)
        if variables[name].get("oid") is None or v is None:
            continue  # modules
        hit = next((held[i] for i in _referents(v, ns, _SHARE_SCAN_LIMIT) if i in held), None)
        if hit is not None:
            unsavable[name] = f"shares an object with {hit!r}, which cannot be saved ({unsavable[hit]})"
            del variables[name]


def _sccs(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(edges.get(start, [])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, []))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out
