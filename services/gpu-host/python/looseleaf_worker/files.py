"""File objects in a checkpoint.

A notebook often keeps the file of a finished ``with open(...) as f`` block. Such
a file is closed and holds nothing but its name and mode, yet the standard pickler
refuses it, and an unsavable variable pins the session's GPU cells to one kept
worker (ADR 51). A closed file is saved as what it is: restored closed, with the
same type, name, mode and encoding, so ``f.name`` and ``f.closed`` read as in the
kernel. Open files stay unsavable: their position and unflushed data live in the
process that opened them.
"""

from __future__ import annotations

import io
import os

# io's concrete classes (what open() returns); a subclass may carry more state
_FILE_TYPES = (io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def is_closed_file(obj) -> bool:
    return type(obj) in _FILE_TYPES and obj.closed


def reduce_closed(f):
    """(rebuild, args) for a closed file of open()'s types."""
    name = getattr(f, "name", None)
    if not isinstance(name, (str, bytes, int)):
        name = None
    mode = getattr(f, "mode", None)
    if not isinstance(mode, str):
        mode = None
    text = type(f) is io.TextIOWrapper
    encoding = f.encoding if text else None
    errors = f.errors if text else None
    return (_closed_file, (type(f).__name__, name, mode, encoding, errors))


def _closed_file(kind: str, name, mode, encoding, errors):
    # the same kind of object on the null device, named as the original, closed
    m = mode or "r"
    raw_mode = ("a+" if "a" in m else "r+") if "+" in m else "a" if "a" in m else "w" if ("w" in m or "x" in m) else "r"
    f = io.FileIO(os.devnull, raw_mode)
    if name is not None:
        f.name = name
    if kind != "FileIO":
        buffered = {"r": io.BufferedReader, "r+": io.BufferedRandom, "a+": io.BufferedRandom}.get(
            raw_mode, io.BufferedWriter
        )
        f = buffered(f)
        if kind == "TextIOWrapper":
            f = io.TextIOWrapper(f, encoding=encoding, errors=errors)
            if mode is not None:
                f.mode = mode
    f.close()
    return f
