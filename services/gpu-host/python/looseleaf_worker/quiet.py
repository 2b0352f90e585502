"""LooseLeaf's own work in a worker (restore, save, ambient state) never writes
into a cell's output and never changes what the user's warning filters do.

``warnings.catch_warnings`` cannot be used for this: leaving it marks the filters
changed, which empties every module's warning registry, so a warning a plain
kernel shows once per location would show again after each save. Swapping the
filter list object and ``showwarning`` and putting both back leaves the
registries alone.
"""

from __future__ import annotations

import contextlib
import os
import warnings


def log(msg: str) -> None:
    """One line to the worker's stderr, which the host logs."""
    os.write(2, (msg.rstrip("\n") + "\n").encode(errors="replace"))


def _to_log(message, category, filename, lineno, file=None, line=None):
    log("looseleaf worker: " + warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def own_warnings(show: bool = True):
    """Warnings raised inside go to the host's log (or nowhere with show=False),
    whatever filters the user set; the user's filters are untouched afterwards."""
    filters, showwarning = warnings.filters, warnings.showwarning
    warnings.filters = [("always" if show else "ignore", None, Warning, None, 0)]
    warnings.showwarning = _to_log
    try:
        yield
    finally:
        warnings.filters, warnings.showwarning = filters, showwarning
