"""Pickling one record and loading it back: the record pickler (cloudpickle with
persistent ids to other records, out-of-band payloads, ordered sets and the
reducers) and its unpickler."""

from __future__ import annotations

import enum
import io
import pickle
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from .. import comms, files, setorder
from .names import _code_names
from .reducers import (
    _STEP_MARKERS,
    _rebuild_optimizer,
    _rebuild_tensor,
    _rebuild_virtual_gpu_array,
    _reduce_code,
    _reduce_owner,
    _reduce_view,
    stored_name,
)

OOB_MIN_BYTES = 64 * 1024

# The worker runtime's own modules (reducers live there): every worker has them.
_RUNTIME = ("looseleaf_worker", "cloudpickle", "copyreg", "pickle")


def _is_atomic(obj: Any) -> bool:
    """Objects whose identity does not matter or that pickle by reference:
    they never get their own record."""
    if obj is None or isinstance(
        obj,
        (
            bool,
            int,
            float,
            complex,
            str,
            bytes,
            tuple,
            frozenset,
            range,
            slice,
            enum.Enum,
            types.ModuleType,
            types.BuiltinFunctionType,
            types.CodeType,
            pickle.PickleBuffer,
        ),
    ):
        return True
    if isinstance(obj, (type, types.FunctionType)):
        return cloudpickle.cloudpickle._should_pickle_by_reference(obj)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.dtype):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, (torch.dtype, torch.device)):
        return True
    return False


@stored_name
class _Group:
    """A record holding a reference cycle of several oids (see the package doc)."""

    def __init__(self, oids, objs):
        self.oids = oids
        self.objs = objs


class RecordPickler(cloudpickle.Pickler):
    """cloudpickle (by-value notebook functions/classes) + persistent ids to other
    records + out-of-band payloads + a tensor reducer."""

    def __init__(
        self, file, ns: dict, own: set[int], refs: dict[int, tuple], buffer_callback, *, stop_all: bool = False
    ):
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self.ns = ns
        self.own = own  # ids pickled inline in this record
        self.refs = refs  # id -> (kind, oid) of other records
        self.used: list[str] = []  # oids referenced, in order
        self.modules: set[str] = set()
        self.on_gpu = False
        self.devices: dict[int, str] = {}  # id(numpy view of a tensor) -> device
        self.seen: list[Any] | None = None  # pre-pass: every non-atomic object
        # ids of immutable objects that keep their identity (see _carries_identity)
        self.identity: set[int] = set()
        # global names that functions pickled by value here read when called
        self.reads: set[str] = set()
        # why restoring this record once, here, to check it, would not be harmless
        self.no_trial: str | None = None
        # sets pickled as ("set", token) and filled after the main object, in order
        self.set_tokens: dict[int, int] = {}
        self.set_alive: list[Any] = []
        self.pending_sets: list[tuple[int, set]] = []

    def persistent_id(self, obj):
        if obj is self.ns:
            return ("ns", "")
        oid = id(obj)
        if oid in self.own:
            return self._set_id(obj)
        if _is_atomic(obj) and oid not in self.identity:
            # the identity of most atoms cannot be observed: never a reference, even
            # when the same object (say '' or None) is also some variable's value
            return self._set_id(obj)
        if self.seen is not None:
            self.seen.append(obj)  # pre-pass: count units reached through stops too
        ref = self.refs.get(oid)
        if ref is not None:
            if ref[1] not in self.used:
                self.used.append(ref[1])
            return ref
        return self._set_id(obj)

    def _set_id(self, obj):
        """A set or frozenset is saved with its iteration order, which plain pickle
        loses when hashes collide (see setorder). A set is made empty where
        it is met and filled after the record's main object (so reference cycles
        through it restore, as pickle's own EMPTY_SET does); a frozenset is made
        whole. One token per object keeps its identity inside the record."""
        t = type(obj)
        if self.seen is not None or (t is not set and t is not frozenset) or len(obj) < 2:
            return None
        token = self.set_tokens.get(id(obj))
        if token is not None:
            return ("setref", token)
        token = len(self.set_tokens)
        self.set_tokens[id(obj)] = token
        self.set_alive.append(obj)  # ids stay unique while the record is pickled
        if t is set:
            self.pending_sets.append((token, obj))
            return ("set", token)
        items = list(obj)
        return ("frozenset", token, items, sys.getsizeof(obj), setorder.table_layout(obj, items))

    def dump_record(self, obj) -> None:
        """The record: its main object, then the content of each set met, in the
        order it iterates (their elements may meet more sets)."""
        self.dump(obj)
        while self.pending_sets:
            token, st = self.pending_sets.pop(0)
            items = list(st)
            self.dump(("fill", token, items, sys.getsizeof(st), setorder.table_layout(st, items)))

    def reducer_override(self, obj):
        t = type(obj)
        if self.no_trial is None and getattr(t, "__del__", None) is not None and t.__module__ != "builtins":
            self.no_trial = f"{t.__qualname__} has a finalizer"
        mod = getattr(t, "__module__", None) or ""
        if mod and mod not in ("builtins", "__main__") and not mod.startswith(_RUNTIME):
            self.modules.add(mod)  # dotted: importing the package alone may not load it
        if isinstance(obj, type) and not cloudpickle.cloudpickle._should_pickle_by_reference(obj):
            # unpickled in this process, cloudpickle finds the live class and sets its
            # attributes to the copies: never restore such a record here to check it
            self.no_trial = "it holds a class pickled by value"
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            # classes and functions pickled by reference load by importing their module
            own = getattr(obj, "__module__", None)
            if isinstance(own, str) and own not in ("builtins", "__main__") and not own.startswith(_RUNTIME):
                self.modules.add(own)
        np = sys.modules.get("numpy")
        if np is not None and t is np.ndarray and not obj.dtype.hasobject:
            if isinstance(obj.base, np.ndarray):
                view = _reduce_view(np, obj)
                if view is not None:
                    return view
            elif self.seen is None and (obj.flags.c_contiguous or obj.flags.f_contiguous):
                return _reduce_owner(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._reduce_tensor(torch, obj)
        if torch is not None and isinstance(obj, torch.optim.Optimizer):
            return _reduce_optimizer(obj)
        virtual_gpu = sys.modules.get("looseleaf_worker.virtual_gpu")  # loaded once one exists
        if virtual_gpu is not None and t is virtual_gpu.VirtualGpuArray:
            return self._reduce_virtual_gpu_array(obj)
        if t is types.CodeType:
            return _reduce_code(obj)
        if files.is_closed_file(obj):
            return files.reduce_closed(obj)
        if comms.is_widget(obj):
            self.no_trial = "it holds a widget"  # a rebuilt widget talks to the client
            return comms.reduce_widget(obj)  # its state, on its model id (ADR 33)
        return super().reducer_override(obj)

    def _reduce_tensor(self, torch, t):
        if self.seen is not None:
            return (int, ())  # pre-pass: identity only; never copy GPU data for it
        device = str(t.device)
        self.no_trial = "it holds a tensor"
        if t.device.type != "cpu":
            self.on_gpu = True
        d = t.detach()
        dtype = str(d.dtype).replace("torch.", "")
        if d.dtype == torch.bfloat16:
            d = d.view(torch.int16)
        arr = d.cpu().contiguous().numpy()
        self.devices[id(arr)] = device
        is_param = isinstance(t, torch.nn.Parameter)
        self.modules.add("torch")
        # a leaf's gradient, as backward() left it: a later cell may step on it
        grad = t.grad if t.is_leaf and t.requires_grad else None
        if grad is not None:
            return (_rebuild_tensor, (arr, dtype, bool(t.requires_grad), device, is_param, grad))
        return (_rebuild_tensor, (arr, dtype, bool(t.requires_grad), device, is_param))

    def _reduce_virtual_gpu_array(self, v):
        # a trial restore would copy it to the "device" again
        self.no_trial = "it holds a virtual GPU array"
        self.on_gpu = True
        self.devices[id(v.data)] = v.device  # its payload's device label
        return (_rebuild_virtual_gpu_array, (v.data, v.device))

    def _dynamic_function_reduce(self, func):
        # Notebook functions keep the user namespace as their globals, looked up
        # at call time as in a kernel; cloudpickle would copy the globals it reads.
        red = super()._dynamic_function_reduce(func)
        if func.__globals__ is not self.ns:
            return red
        # what it reads of the namespace when called, however it was reached (a
        # function in a dispatch dict reads globals no cell names beside it)
        self.reads.update(_code_names(func.__code__))
        fn, newargs, (state, slotstate), a, b, setter = red
        code, _, name, defaults, closure = newargs
        slotstate = dict(slotstate, __globals__={})
        return (fn, (code, self.ns, name, defaults, closure), (state, slotstate), a, b, setter)


@dataclass
class Record:
    oids: list[str]
    data: bytes = b""
    buffers: list[Any] = field(default_factory=list)
    payload_meta: list[dict] = field(default_factory=list)
    refs: list[str] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)
    on_gpu: bool = False
    error: str | None = None
    reads: set[str] = field(default_factory=set)
    no_trial: str | None = None


def _pickle_record(objs: list[Any], oids: list[str], ns: dict, refs: dict, identity: set[int]) -> Record:
    rec = Record(oids=oids)
    own = {id(o) for o in objs}
    buf = io.BytesIO()

    def on_buffer(pb: pickle.PickleBuffer):
        raw = pb.raw()
        if raw.nbytes < OOB_MIN_BYTES:
            return True  # small: in-band
        owner = raw.obj
        meta = {"dtype": "bytes", "shape": [raw.nbytes], "device": "cpu"}
        np = sys.modules.get("numpy")
        if np is not None and isinstance(owner, np.ndarray):
            meta = {"dtype": str(owner.dtype), "shape": list(owner.shape), "device": p.devices.get(id(owner), "cpu")}
        rec.buffers.append(raw)
        rec.payload_meta.append(meta)
        return False

    p = RecordPickler(buf, ns, own, refs, on_buffer)
    p.identity = identity
    try:
        p.dump_record(objs[0] if len(objs) == 1 else _Group(oids, objs))
    except BaseException as e:  # noqa: BLE001 - any failure means unsavable
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.data = buf.getvalue()
    rec.refs = [o for o in p.used if o not in oids]
    rec.modules = p.modules
    rec.on_gpu = p.on_gpu
    rec.reads = p.reads
    rec.no_trial = p.no_trial
    return rec


def _load_record(data, buffers: list, resolve) -> Any:
    """Unpickle one record: its main object, then the content of its sets in the
    order they iterated (see RecordPickler._set_id); ``resolve`` answers the
    other persistent ids."""
    sets: dict[int, Any] = {}

    def pload(pid):
        kind = pid[0]
        if kind == "set":
            sets[pid[1]] = made = set()
            return made
        if kind == "setref":
            return sets[pid[1]]
        if kind == "frozenset":
            sets[pid[1]] = made = setorder.restore_frozenset(pid[2], pid[3], pid[4])
            return made
        return resolve(pid)

    stream = io.BytesIO(data)
    up = pickle.Unpickler(stream, buffers=buffers)
    up.persistent_load = pload
    obj = up.load()
    end = len(stream.getbuffer())
    while stream.tell() < end:
        _, token, items, table_bytes, layout = up.load()
        setorder.restore_set(sets[token], items, table_bytes, layout)
    return obj


def _reduce_optimizer(opt):
    """An optimizer's own pickled state, and the instance attributes it drops that
    an LR scheduler keeps on it (see ``_rebuild_optimizer``)."""
    own = opt.__dict__
    extra = {k: own[k] for k in ("_step_count", "_opt_called") if k in own}
    step = own.get("step")
    marker = next((m for m in _STEP_MARKERS if getattr(step, m, False)), None)
    return (_rebuild_optimizer, (type(opt), opt.__getstate__(), extra, marker))
