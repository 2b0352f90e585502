"""Restore: binding variables from the records of a restore file (mapped
copy-on-write), each record loaded once and shared by every name that reaches it."""

from __future__ import annotations

import importlib
import mmap
from typing import Any

from .pickler import _Group, _load_record


class RestoreError(Exception):
    """A restore that cannot complete (missing record, bad pickle)."""


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
