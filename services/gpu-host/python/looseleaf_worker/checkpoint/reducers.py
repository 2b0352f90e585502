"""How numpy arrays (owners and views), torch tensors, virtual GPU arrays and code objects are
reduced into a record, and the functions that rebuild them when it is loaded.

Pickle stores a rebuild function by reference: its module and qualified name
are in every record that holds such an object. They were defined in the module
``looseleaf_worker.checkpoint`` (before it became a package) and records say so,
so they keep that module name (``stored_name``) and the package re-exports
them: records saved earlier restore, and records saved now restore in a runtime
that still has the single module.
"""

from __future__ import annotations

import pickle

import cloudpickle

from .. import staging

# The module that checkpoints name for the objects they store by reference.
CHECKPOINT_MODULE = "looseleaf_worker.checkpoint"


def stored_name(obj):
    """Give a function or class that records store by reference the module name
    they store it under (see the module doc); the package must re-export it."""
    obj.__module__ = CHECKPOINT_MODULE
    return obj


@stored_name
def _rebuild_tensor(arr, dtype: str, requires_grad: bool, device: str, is_param: bool, grad=None):
    import torch

    t = torch.from_numpy(arr)
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    # Without a slot (a worker prepared before Run) CUDA is not touched: the
    # tensor waits in host memory and the restore at Run copies it (ADR 70).
    on_device = device.startswith("cuda") and staging.devices_visible() and torch.cuda.is_available()
    if on_device:
        t = t.to(device)
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t = t.requires_grad_(requires_grad)
    if device.startswith("cuda") and not on_device:
        staging.stage(t, device)
    if grad is not None:
        # what backward() left (a later cell's optimizer step reads it); a
        # staged gradient goes to the device with its own copy at Run
        t.grad = grad
    return t


# what an LR scheduler marks its wrapper of optimizer.step with: torch before 2.2
# counts the optimizer's steps, torch 2.2 on notes that step() was called
_STEP_MARKERS = ("_with_counter", "_wrapped_by_lr_sched")


@stored_name
def _rebuild_optimizer(cls, state: dict, extra: dict, marker: str | None):
    """An optimizer as its own pickling restores it, with what that drops: the
    step counter and the wrapper of ``step`` an LR scheduler installed (without
    it the scheduler's first step on a later worker warns that ``step`` was
    overridden)."""
    opt = cls.__new__(cls)
    opt.__setstate__(state)
    opt.__dict__.update(extra)
    if marker in _STEP_MARKERS:
        _count_steps(opt, marker)
    return opt


def _count_steps(opt, marker: str) -> None:
    """The wrapper torch's LR scheduler puts on ``opt.step`` (the same bookkeeping
    and mark), as its ``__init__`` builds it."""
    import functools
    import weakref

    ref, cls = weakref.ref(opt), type(opt)
    func = cls.step

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        instance = ref()
        if marker == "_with_counter":
            instance._step_count += 1
        else:
            instance._opt_called = True
        return func.__get__(instance, cls)(*args, **kwargs)

    setattr(wrapper, marker, True)
    opt.step = wrapper


@stored_name
def _rebuild_virtual_gpu_array(arr, device: str):
    from ..virtual_gpu import VirtualGpuArray

    v = VirtualGpuArray(arr, device)
    # as a tensor saved from a GPU: on the device when the worker holds its slot,
    # else staged in host memory for the copy at Run (ADR 72)
    if staging.devices_visible():
        v.copy_to_device()
    else:
        v.stage()
        staging.stage(v, device)
    return v


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


@stored_name
def _rebuild_owner(buf, dtype, shape, order, writeable):
    import numpy as np

    mv = memoryview(buf)
    if mv.readonly and writeable:
        mv = memoryview(bytearray(mv))  # pickled in band: a private writable copy
    arr = np.ndarray(shape, dtype=dtype, buffer=mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, order=order)
    if not writeable:
        arr.flags.writeable = False
    return arr


@stored_name
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


@stored_name
def _code_in_file(ctor, args, filename):
    return ctor(*args).replace(co_filename=filename)
