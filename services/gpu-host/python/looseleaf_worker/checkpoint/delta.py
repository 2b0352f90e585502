"""The delta of a save: the records, chunks and variable entries of what the
namespace holds now, against what this worker held at its last save."""

from __future__ import annotations

import types
import uuid
from dataclasses import dataclass
from typing import Any

import xxhash

from .. import quiet
from .chunks import chunk_blob
from .graph import _carries_identity, _find_shared, _keep_sharers, _sccs
from .names import function_global_reads
from .pickler import Record, _load_record, _pickle_record


def _next_in_ring(members: list[str], oid: str) -> list[str]:
    if len(members) < 2:
        return []
    return [members[(members.index(oid) + 1) % len(members)]]


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
