"""Notebook functions, classes and objects pickled by value, their functions'
globals being the live namespace (as in checkpoint records), and loaded back
into a namespace."""

from __future__ import annotations

import io
import pickle
import types

import cloudpickle

from .. import checkpoint, quiet


def _pickled(obj, ns: dict) -> tuple[bytes | None, str | None]:
    """Pickle a notebook function, class or object by value, the globals of its
    functions being the live namespace (as checkpoint records do); (blob, None)
    or (None, why not)."""

    class P(cloudpickle.Pickler):
        def persistent_id(self, o):
            return "ns" if o is ns else None

        def reducer_override(self, obj):
            if type(obj) is types.CodeType:
                return checkpoint._reduce_code(obj)  # tracebacks name the cell's file
            return super().reducer_override(obj)

        def _dynamic_function_reduce(self, func):
            # as checkpoint records: the function's globals are the live
            # namespace, not a copy of the names it reads
            red = super()._dynamic_function_reduce(func)
            if func.__globals__ is not ns:
                return red
            fn, newargs, (state, slotstate), a, b, setter = red
            code, _, name, defaults, closure = newargs
            slotstate = dict(slotstate, __globals__={})
            return (fn, (code, ns, name, defaults, closure), (state, slotstate), a, b, setter)

    buf = io.BytesIO()
    try:
        P(buf, protocol=5).dump(obj)
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    return buf.getvalue(), None


def _dumps_with_ns(obj, ns: dict) -> bytes | None:
    blob, why = _pickled(obj, ns)
    if blob is None:
        quiet.log(f"looseleaf worker: cannot keep {obj!r} for later workers: {why}")
    return blob


def _loads_with_ns(blob: bytes, ns: dict):
    up = pickle.Unpickler(io.BytesIO(blob))
    up.persistent_load = lambda pid: ns
    return up.load()
