"""Sets and frozensets restored with the iteration order they had (ADR 51).

A set iterates in hash-table slot order, and elements whose hashes collide
(``-1`` and ``-2``) take slots in the order they were added, which plain pickle
(iteration order) loses. A save records where each element sits
(``table_layout``); a restore adds the elements in an order that puts each back
in its slot, in a table of the same size, or searches for one where the layout
is unknown.
"""

from __future__ import annotations

import sys

# How many rebuilds a set's restore tries to give it the iteration order it had,
# where its slots were not recorded.
_SET_ORDER_TRIES = 32
# Sets up to this size record where each element sits in their hash table.
SET_SLOTS_MAX = 100_000
_EMPTY_SET_BYTES = sys.getsizeof(set())
# CPython's PySetObject (3.9-3.13): head, fill, used, mask, then the table pointer.
_SET_USED, _SET_MASK, _SET_TABLE = 24, 32, 40
_SET_LAYOUT_KNOWN = sys.implementation.name == "cpython" and (3, 9) <= sys.version_info[:2] <= (3, 13)


def _table_slots(table_bytes: int) -> int:
    """A set's hash table size, from its ``sys.getsizeof`` (8 slots live inside
    the object; a larger table is 16 bytes a slot beside it)."""
    return max(8, (table_bytes - _EMPTY_SET_BYTES) // 16)


def table_layout(s, items: list) -> tuple[list[int], list[int]] | None:
    """Where each of ``items`` (``s`` in iteration order) sits in ``s``'s hash
    table, and which slots hold a deleted entry's marker; None if unknown. Read
    from the table itself: iteration order alone does not say which of two
    colliding elements was added first."""
    if not _SET_LAYOUT_KNOWN or len(items) > SET_SLOTS_MAX:
        return None
    import ctypes

    addr = id(s)
    used = ctypes.c_ssize_t.from_address(addr + _SET_USED).value
    mask = ctypes.c_ssize_t.from_address(addr + _SET_MASK).value
    if used != len(items) or mask + 1 != _table_slots(sys.getsizeof(s)):
        return None
    table = ctypes.c_void_p.from_address(addr + _SET_TABLE).value
    where = {id(x): k for k, x in enumerate(items)}
    slots: list[int] = [-1] * len(items)
    deleted: list[int] = []
    for i in range(mask + 1):
        key = ctypes.c_void_p.from_address(table + 16 * i).value
        if key is None:
            continue
        k = where.get(key)
        if k is None:
            deleted.append(i)  # CPython's dummy: an element was removed here
        else:
            slots[k] = i
    if -1 in slots or slots != sorted(slots):
        return None
    return slots, deleted


def _probe(h: int, mask: int):
    """CPython's probe sequence for hash ``h`` (setobject.c: up to 9 linear
    probes, then a jump perturbed by the hash's higher bits)."""
    perturb = h & 0xFFFFFFFFFFFFFFFF
    i = perturb & mask
    while True:
        yield from range(i, i + 10) if i + 9 <= mask else (i,)
        perturb >>= 5
        i = (i * 5 + 1 + perturb) & mask


class _Marker:
    """Holds a slot while the elements that probed past it are added, then is
    removed, leaving the deleted-entry marker the saved set had there."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot

    def __hash__(self):
        return self.slot


def _insertion_order(items: list, slots: list[int], deleted: list[int], table: int) -> list | None:
    """An order of adds (markers included) that puts every element in the slot it
    had: each after whatever sat on its probe path before its slot."""
    mask = table - 1
    at = {slot: k for k, slot in enumerate(slots)}
    gone = set(deleted)
    before: list[list] = []
    for k, x in enumerate(items):
        deps = []
        for step, slot in enumerate(_probe(hash(x), mask)):
            if slot == slots[k]:
                break
            if slot in at:
                deps.append(at[slot])
            elif slot in gone:
                deps.append(("marker", slot))
            else:
                return None  # a free slot on its path: hashes changed since the save
            if step > 16 * table:
                return None
        before.append(deps)
    order: list = []
    state: dict = {}  # 1 while visiting, 2 when placed
    markers: dict[int, _Marker] = {}
    for start in range(len(items)):
        stack = [(start, iter(before[start]))]
        if state.get(start):
            continue
        state[start] = 1
        while stack:
            k, deps = stack[-1]
            dep = next(deps, None)
            if dep is None:
                stack.pop()
                state[k] = 2
                order.append(items[k])
                continue
            if isinstance(dep, tuple):
                if dep[1] not in markers:
                    markers[dep[1]] = _Marker(dep[1])
                    order.append(markers[dep[1]])
                continue
            if state.get(dep) == 1:
                return None  # a cycle: no order of adds makes this layout
            if not state.get(dep):
                state[dep] = 1
                stack.append((dep, iter(before[dep])))
    return order


def _fill_exactly(s: set, items: list, table_bytes: int, layout) -> bool:
    """Fill ``s`` so that every element sits where it sat; False if not done."""
    table = _table_slots(table_bytes)
    order = _insertion_order(items, *layout, table) if layout is not None else None
    if order is None:
        return False
    s.clear()
    if table > 8:
        # a dict update sizes the table up front for its keys (the next power of
        # two above twice their count), but an empty set's 8 slots only for 5 keys
        # or more ((fill + keys) * 5 >= mask * 3): the first keys make it this
        # size, and padding at the end (removed again) does where there are too few
        head = order[: (table - 1) // 2]
        pad = [_Marker(-1) for _ in range(max(0, max(table // 4, 5) - len(head)))]
        s.update(dict.fromkeys(head + pad))
        s.difference_update(pad)
        order = order[len(head) :]
    for x in order:
        s.add(x)
    s.difference_update([x for x in s if type(x) is _Marker])
    return list(s) == items and _table_slots(sys.getsizeof(s)) == table


def _fill_in_order(s: set, order: list, table_bytes: int, presized: bool) -> set:
    """Fill ``s`` with ``order``, either growing as it goes (as by adds), or in a
    table sized up front to the one it had (as a merge makes)."""
    s.clear()
    want = _table_slots(table_bytes)
    if not presized or want <= 8:
        s.update(order)
        return s
    keys = dict.fromkeys(order)
    extra = [object() for _ in range(max(0, (want - 1) // 2 - len(order)))]
    keys.update(dict.fromkeys(extra))
    s.update(keys)
    s.difference_update(extra)
    return s


def _frozenset_sized(order: list, table_bytes: int, presized: bool) -> frozenset:
    """A frozenset of ``order``: grown as it is filled (made from a list), or in a
    table sized up front (made from a set or a dict)."""
    return frozenset(dict.fromkeys(order) if presized else order)


def _in_saved_order(build, target: list):
    """``build(order, presized)`` until what it builds iterates as ``target``,
    where the set's slots were not recorded: try the saved order, then move the
    first element out of place to the end (it was added after the one now in its
    slot), a bounded number of times; else the saved order it is (as plain
    pickle restores a set)."""
    order = list(target)
    for _ in range(min(_SET_ORDER_TRIES, len(target))):
        for presized in (False, True):
            made = build(order, presized)
            got = list(made)
            if got == target:
                return made
        i = next(k for k, (a, b) in enumerate(zip(got, target, strict=True)) if a is not b)
        order.remove(target[i])
        order.append(target[i])
    return build(target, False)


def restore_set(s: set, items: list, table_bytes: int, layout) -> None:
    if not _fill_exactly(s, items, table_bytes, layout):
        _in_saved_order(lambda order, pre: _fill_in_order(s, order, table_bytes, pre), items)


def restore_frozenset(items: list, table_bytes: int, layout) -> frozenset:
    s: set = set()
    if _fill_exactly(s, items, table_bytes, layout):
        made = frozenset(s)  # copies the table as it is when sizes agree
        if list(made) == items:
            return made
    return _in_saved_order(lambda order, pre: _frozenset_sized(order, table_bytes, pre), items)
