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

Map (one concern per module):
  names     which names are user state; which globals notebook code reads
  chunks    blobs cut into 2 MiB chunks named by xxh3-128
  reducers  numpy arrays and views, tensors, virtual GPU arrays and code objects,
            and their rebuilders
  pickler   one record pickled (persistent ids, payloads, ordered sets) and loaded
  graph     objects shared between variables, sharers of unsavables, cycles
  delta     a save: records, chunks and variable entries (build_delta)
  loader    a restore: variables bound from a restore file (restore)

Records name the rebuild functions and the group record's class by reference,
as ``looseleaf_worker.checkpoint.<name>``: they are re-exported here under those
names and keep that module name (see reducers.stored_name).
"""

from .delta import SaveResult, build_delta
from .graph import _carries_identity
from .loader import RestoreError, restore
from .names import function_global_reads, is_user_name
from .pickler import _Group
from .reducers import (
    _code_in_file,
    _rebuild_optimizer,
    _rebuild_owner,
    _rebuild_tensor,
    _rebuild_view,
    _rebuild_virtual_gpu_array,
    _reduce_code,
)

__all__ = [
    "RestoreError",
    "SaveResult",
    "build_delta",
    "function_global_reads",
    "is_user_name",
    "restore",
    # used by ambient (a cell's code objects keep their file name)
    "_reduce_code",
    # see test_identity
    "_carries_identity",
    # stored by reference in saved records: these names must keep resolving
    "_Group",
    "_code_in_file",
    "_rebuild_owner",
    "_rebuild_optimizer",
    "_rebuild_tensor",
    "_rebuild_view",
    "_rebuild_virtual_gpu_array",
]
