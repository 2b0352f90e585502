"""The checkpoint format (DESIGN.md section 6) on the worker side.

A save turns the user namespace into object records: one per variable root and
one per object shared between roots, each a protocol-5 cloudpickle whose
persistent ids name other records (("root", oid) / ("obj", oid)) or the user
namespace itself (("ns", "") so that notebook functions keep the live globals).
Large buffers (>= 64 KiB PickleBuffers: numpy arrays, pandas blocks, tensors)
leave the pickle as payloads. Every blob is cut into 2 MiB chunks named by
xxh3-128, so a store that already has a chunk is never sent it again.

Reference cycles between records cannot be unpickled one record at a time (an
object would be needed before its own pickle finishes), so the save merges each
cycle (a strongly connected component of the record graph) into one group
record that every member oid points at; identical bytes mean one set of chunks.
"""

from __future__ import annotations

import enum
import importlib
import io
import mmap
import pickle
import sys
import types
import uuid
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import xxhash

from . import comms, files, quiet, setorder
from .protocol import CHUNK_SIZE

OOB_MIN_BYTES = 64 * 1024

# The worker runtime's own modules (reducers live there): every worker has them.
_RUNTIME = ("looseleaf_worker", "cloudpickle", "copyreg", "pickle")

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


# ------------------------------------------------------------------ chunking


def chunk_blob(data, chunks: dict[str, memoryview]) -> dict:
    """Cut ``data`` into CHUNK_SIZE pieces; register each by hash; return a Blob."""
    mv = memoryview(data).cast("B")
    names = []
    for off in range(0, len(mv), CHUNK_SIZE):
        piece = mv[off : off + CHUNK_SIZE]
        h = xxhash.xxh3_128_hexdigest(piece)
        chunks.setdefault(h, piece)
        names.append(h)
    return {"len": len(mv), "chunks": names}


# ------------------------------------------------------------------- pickling


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


def _rebuild_tensor(arr, dtype: str, requires_grad: bool, device: str, is_param: bool):
    import torch

    t = torch.from_numpy(arr)
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    if device.startswith("cuda") and torch.cuda.is_available():
        t = t.to(device)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _owner(np, arr):
    """The ndarray that owns the memory ``arr`` views (walking .base)."""
    base = arr
    while isinstance(base.base, np.ndarray):
        base = base.base
    return base


def _reduce_view(np, arr):
    """A numpy view pickles as (its owner, where it looks), so that it is restored
    as a view of the restored owner and writes through one are seen through the
    other, as in a kernel. Owners that are not contiguous pickle as copies."""
    owner = _owner(np, arr)
    if owner is arr or not (owner.flags.c_contiguous or owner.flags.f_contiguous) or arr.dtype.hasobject:
        return None
    offset = arr.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
    if offset < 0 or offset > owner.nbytes:
        return None
    return (_rebuild_view, (owner, offset, arr.shape, arr.strides, arr.dtype, bool(arr.flags.writeable)))


def _reduce_owner(arr):
    """An array that owns its memory pickles as one buffer (out of band when large)
    and is rebuilt directly on it, so the restored object is the memory's owner and
    views restored later point at it (numpy's own reduce adds a reshape in between)."""
    order = "C" if arr.flags.c_contiguous else "F"
    return (_rebuild_owner, (pickle.PickleBuffer(arr), arr.dtype, arr.shape, order, bool(arr.flags.writeable)))


def _rebuild_owner(buf, dtype, shape, order, writeable):
    import numpy as np

    mv = memoryview(buf)
    if mv.readonly and writeable:
        mv = memoryview(bytearray(mv))  # pickled in band: a private writable copy
    arr = np.ndarray(shape, dtype=dtype, buffer=mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, order=order)
    if not writeable:
        arr.flags.writeable = False
    return arr


def _rebuild_view(owner, offset, shape, strides, dtype, writeable):
    import numpy as np

    # a flat view in memory order exports a plain buffer whatever the owner's order
    buf = owner if owner.flags.c_contiguous else owner.reshape(-1, order="A")
    view = np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset, strides=strides)
    if not writeable:
        view.flags.writeable = False
    return view


def _reduce_code(code):
    """cloudpickle names every code object's file ``<dynamic-code>``; keep the
    cell's code name, so a traceback or warning raised in a function of an earlier
    cell shows that cell's line in a later worker, as in the kernel (whose
    linecache the ambient state rebuilds)."""
    ctor, args = cloudpickle.cloudpickle._code_reduce(code)
    return (_code_in_file, (ctor, args, code.co_filename))


def _code_in_file(ctor, args, filename):
    return ctor(*args).replace(co_filename=filename)


def _next_in_ring(members: list[str], oid: str) -> list[str]:
    if len(members) < 2:
        return []
    return [members[(members.index(oid) + 1) % len(members)]]


class _Group:
    """A record holding a reference cycle of several oids (see module doc)."""

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
        return (_rebuild_tensor, (arr, dtype, bool(t.requires_grad), device, is_param))

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


def _reads_through(rec: Record, records: dict[str, Record], memo: dict[int, set[str]]) -> set[str]:
    """The globals that functions in ``rec`` or in any record it reaches read when
    called: a variable's value may reach a function only through data (a dispatch
    dict), and the planner restores what such a function reads with it. Records
    form a DAG (cycles were merged into groups)."""
    hit = memo.get(id(rec))
    if hit is not None:
        return hit
    memo[id(rec)] = set()  # a guard; a DAG never meets it
    out = set(rec.reads)
    for k in rec.refs:
        out |= _reads_through(records[k], records, memo)
    memo[id(rec)] = out
    return out


# Records at most this large are restored once where they were saved, to find an
# object whose saved form would not restore (cheap: each distinct record once).
TRIAL_MAX_BYTES = 256 * 1024
_restores_checked: set[str] = set()


def _trial_restore(rec: Record, by_oid: dict[str, Any], ns: dict) -> str | None:
    """Why ``rec`` would not restore, found by restoring it here, or None. Skipped
    where that is not harmless (see RecordPickler.no_trial) or not cheap."""
    if rec.error or rec.no_trial or rec.buffers or len(rec.data) > TRIAL_MAX_BYTES:
        return None
    digest = xxhash.xxh3_128_hexdigest(rec.data)
    if digest in _restores_checked:
        return None

    def resolve(pid):
        return ns if pid[0] == "ns" else by_oid[pid[1]]

    try:
        with quiet.own_warnings(show=False):
            _load_record(memoryview(rec.data), [], resolve)
    except BaseException as e:  # noqa: BLE001 - whatever would fail the restore
        return f"it was saved, but its saved form does not restore ({type(e).__name__}: {e})"
    if len(_restores_checked) > 100_000:
        _restores_checked.clear()
    _restores_checked.add(digest)
    return None


@dataclass
class SaveResult:
    delta: dict
    chunks: dict[str, memoryview]
    oid_objects: dict[int, tuple[str, Any]]


def build_delta(
    ns: dict, names: list[str], oid_of: dict[int, tuple[str, Any]], held_before: set[str], ambient_blob: bytes | None
) -> SaveResult:
    """Records, chunks and the Delta for the given user names."""
    chunks: dict[str, memoryview] = {}
    keep: list = []
    variables: dict[str, dict] = {}
    roots: dict[int, Any] = {}
    for name in names:
        v = ns[name]
        if isinstance(v, types.ModuleType):
            variables[name] = {"oid": None, "module": v.__name__, "global_reads": []}
        else:
            roots.setdefault(id(v), v)

    def oid_for(obj) -> str:
        hit = oid_of.get(id(obj))
        if hit is not None and hit[1] is obj:
            return hit[0]
        return uuid.uuid4().hex

    # immutable values that keep one identity wherever they are held (a sentinel
    # tuple in a grid and in its global): variables' values and records restored
    identity = {i for i, v in roots.items() if _carries_identity(v)}
    identity |= {i for i, (_, o) in oid_of.items() if _carries_identity(o)}
    shared = _find_shared(list(roots.values()), ns, keep, oid_of, identity)
    units = {id(o): o for o in list(roots.values()) + shared}
    oids = {i: oid_for(o) for i, o in units.items()}
    refs = {i: (("root" if i in roots else "obj"), oids[i]) for i in units}
    by_oid = {oids[i]: o for i, o in units.items()}

    records = {oids[i]: _pickle_record([o], [oids[i]], ns, refs, identity) for i, o in units.items()}
    # merge reference cycles across records into group records
    edges = {k: r.refs for k, r in records.items()}
    for comp in _sccs(list(records), edges):
        if len(comp) > 1:
            comp.sort()
            g = _pickle_record([by_oid[k] for k in comp], comp, ns, refs, identity)
            for k in comp:
                records[k] = g
    # a record that pickles but would not unpickle is unsavable now, not a failed
    # restore in every later cell that reads it
    for r in {id(r): r for r in records.values()}.values():
        why = _trial_restore(r, by_oid, ns)
        if why is not None:
            r.error = why
    # an object whose graph reaches an unsavable record is unsavable too
    changed = True
    while changed:
        changed = False
        for r in records.values():
            if r.error is None:
                bad = next((x for x in r.refs if records[x].error), None)
                if bad is not None:
                    r.error = records[bad].error
                    changed = True

    unsavable: dict[str, str] = {}
    objects: dict[str, dict] = {}
    read_memo: dict[int, set[str]] = {}
    for name in names:
        v = ns[name]
        if isinstance(v, types.ModuleType):
            continue
        oid = oids[id(v)]
        rec = records[oid]
        if rec.error:
            unsavable[name] = rec.error
            continue
        reads = set(function_global_reads(v, ns)) | _reads_through(rec, records, read_memo)
        variables[name] = {
            "oid": oid,
            "module": None,
            "global_reads": sorted(n for n in reads if n in ns and not n.startswith("__")),
        }
    _keep_sharers(ns, names, unsavable, variables)
    live = [k for k, r in records.items() if r.error is None]
    blobs: dict[int, tuple] = {}  # a group record is cut and hashed once, not per member
    for k in live:
        r = records[k]
        if id(r) not in blobs:
            blobs[id(r)] = (
                chunk_blob(r.data, chunks),
                [dict(chunk_blob(b, chunks), **m) for b, m in zip(r.buffers, r.payload_meta, strict=True)],
            )
        record, payloads = blobs[id(r)]
        # The members of a reference cycle share one record. A ring of refs (each to
        # the next) lets each reach all, so a host that knows a worker holds one knows
        # it holds them all; the group's refs out and its modules are said once, by
        # its first member (a figure's group has thousands of members).
        lead = k == r.oids[0]
        objects[k] = {
            "record": record,
            "refs": (list(r.refs) if lead else []) + _next_in_ring(r.oids, k),
            "payloads": payloads,
            "modules": sorted(r.modules) if lead else [],
            "on_gpu": r.on_gpu,
        }
    delta = {
        "variables": variables,
        "deleted": sorted(held_before - set(names)),
        "objects": objects,
        "unsavable": unsavable,
        "ambient": chunk_blob(ambient_blob, chunks) if ambient_blob is not None else None,
    }
    new_oid_of = {i: (oids[i], units[i]) for i in units if records[oids[i]].error is None}
    del keep
    return SaveResult(delta, chunks, new_oid_of)


# ------------------------------------------------------------------- restore


class RestoreError(Exception):
    """A restore that cannot complete (missing record, bad pickle)."""


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


class _Loader:
    def __init__(self, mm, objects: dict, ns: dict, held: dict | None = None):
        self.mm = memoryview(mm)
        self.objects = objects
        self.ns = ns
        # objects this worker already holds at their current version (a reused
        # worker): records not in the restore file resolve to them
        self.held = held or {}
        self.cache: dict[str, Any] = {}
        self.loading: set[str] = set()
        self.bytes = 0

    def region(self, r):
        off, n = r
        self.bytes += n
        return self.mm[off : off + n]

    def load(self, oid: str) -> Any:
        if oid in self.cache:
            return self.cache[oid]
        spec = self.objects.get(oid)
        if spec is None and oid in self.held:
            return self.held[oid]
        if spec is None:
            raise RestoreError(f"object {oid} is not in the restore file")
        if oid in self.loading:
            raise RestoreError(f"reference cycle through object {oid} across records")
        self.loading.add(oid)
        bufs = [self.region(r) for r in spec["payloads"]]
        obj = _load_record(self.region(spec["record"]), bufs, self._pload)
        self.loading.discard(oid)
        if isinstance(obj, _Group):
            for k, o in zip(obj.oids, obj.objs, strict=True):
                self.cache[k] = o
            return self.cache[oid]
        self.cache[oid] = obj
        return obj

    def _pload(self, pid):
        kind, oid = pid
        if kind == "ns":
            return self.ns
        return self.load(oid)


def restore(
    ns: dict, shm_path: str | None, variables: dict, objects: dict, oid_of: dict[int, tuple[str, Any]]
) -> tuple[int, dict[str, str]]:
    """Bind ``variables`` in ``ns``; returns (restored_bytes, errors by name)."""
    errors: dict[str, str] = {}
    mm = None
    if shm_path:
        with open(shm_path, "rb") as f:
            # private copy-on-write: restored arrays are writable, no copy up front
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    # Objects in the restore file replace what this worker held under their oid
    # (their content changed); every other held object stays and is shared.
    for key in [k for k, (oid, _) in oid_of.items() if oid in objects]:
        del oid_of[key]
    held = {oid: obj for oid, obj in oid_of.values()}
    loader = _Loader(mm if mm is not None else b"", objects, ns, held)
    builtins_before = ns.get("__builtins__")
    # Modules first: unpickling runs notebook code (a class's __setstate__,
    # a __reduce__) that may read them, as it would in the original kernel.
    by_module = sorted(variables.items(), key=lambda item: not item[1].get("module"))
    for name, spec in by_module:
        try:
            if spec.get("module"):
                ns[name] = importlib.import_module(spec["module"])
                continue
            if spec.get("oid") is None:
                raise RestoreError("neither an oid nor a module")
            obj = loader.load(spec["oid"])
            ns[name] = obj
            oid_of[id(obj)] = (spec["oid"], obj)
        except BaseException as e:  # noqa: BLE001 - reported per name
            errors[name] = f"{type(e).__name__}: {e} (restoring '{name}')"
    for oid, obj in loader.cache.items():
        oid_of[id(obj)] = (oid, obj)
    if builtins_before is not None:
        ns["__builtins__"] = builtins_before  # cloudpickle's setstate rebinds it
    return loader.bytes, errors
