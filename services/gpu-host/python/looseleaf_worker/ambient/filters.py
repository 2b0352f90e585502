"""The session's warning filters, saved so that loading the ambient state imports
no library. A filter holds its category class (``torch.jit.TracerWarning``, which
torch's import adds a filter for), and unpickling a class imports its module: a
session that ever imported torch made every restore import torch, a second or
more, for cells that never touch it. So each filter is pickled on its own and
loaded only if its category's module is imported already; the whole list is set
again once a cell imports the module a filter waits for, and carried unchanged
into saves until then."""

from __future__ import annotations

import io
import pickle
import sys
import warnings

from .onimport import when_imported


class _NotImported(Exception):
    def __init__(self, module: str):
        super().__init__(module)
        self.module = module


class _ImportedOnly(pickle.Unpickler):
    """Loads a filter only from modules already imported."""

    def find_class(self, module, name):
        if module not in sys.modules:
            raise _NotImported(module.split(".")[0])
        return super().find_class(module, name)


# what the last apply set while some filter waited for a module's import, and the
# saved list it came from
_waiting: tuple[list, list[bytes], set[str]] | None = None
# the filters last pickled, and their pickles: a cell seldom changes the filters,
# and each is an immutable tuple, so the same objects pickle the same
_last: tuple[list, list[bytes]] = ([], [])


def capture() -> list[bytes]:
    """The filters, each pickled (one that cannot be, a filter on a notebook
    class, is left out); the saved list as it came while a filter it holds waits
    for an import and no cell changed the filters."""
    if _waiting is not None:
        applied, saved, missing = _waiting
        if any(m not in sys.modules for m in missing) and warnings.filters == applied:
            return saved
    global _last
    now = list(warnings.filters)
    seen, blobs = _last
    if len(now) == len(seen) and all(a is b for a, b in zip(now, seen, strict=True)):
        return blobs
    out = []
    for f in now:
        try:
            out.append(pickle.dumps(f, protocol=5))
        except Exception:  # noqa: BLE001
            pass
    _last = (now, out)
    return out


def apply(saved: list) -> None:
    """Make the filters the saved ones, but for those whose category's module is
    not imported yet (set with the rest once it is)."""
    global _waiting
    if saved and not isinstance(saved[0], bytes):
        _set(list(saved))  # saved before filters were pickled one by one
        return
    filters, missing = [], set()
    for blob in saved:
        try:
            filters.append(_ImportedOnly(io.BytesIO(blob)).load())
        except _NotImported as e:
            missing.add(e.module)
    _set(filters)
    _waiting = (list(warnings.filters), list(saved), missing) if missing else None
    for module in missing:
        when_imported(module, lambda _module: apply(saved), {})


def _set(filters: list) -> None:
    # only on a change: a change empties every warning registry, so warnings
    # shown once per location would show again
    if warnings.filters != filters:
        warnings.filters[:] = filters
        warnings._filters_mutated()
