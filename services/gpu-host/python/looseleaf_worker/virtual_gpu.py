"""A stand-in for GPU-resident state on virtual GPU slots (`--virtual-gpus`, which
run on the CPU), so that staged preparation (ADR 70) can be exercised and timed
where no CUDA device exists (ADR 72).

A `VirtualGpuArray` is a numpy array labelled with a device ("vgpu:0"): it is
saved as GPU-resident (its payload's device, the record's `on_gpu`), a worker
prepared without a slot restores it into host memory and stages it, and the
restore at Run copies its bytes into new memory in place, as the real copy puts
a tensor's bytes into device memory. The copy is a host memcpy: it stands in for
a host-to-device copy of the same bytes and is labelled as such wherever it is
reported; it says nothing about a real GPU's bandwidth.

In a cell on a virtual GPU slot:

    import numpy as np
    from looseleaf_worker.virtual_gpu import to_virtual_gpu
    a = to_virtual_gpu(np.random.default_rng(0).random(1 << 20))
    a.sum(), np.asarray(a)[:3]
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np


class VirtualGpuArray:
    """An array that lives on a virtual GPU: its bytes are `data`, an ndarray that
    owns its memory (so that its payload carries the device label). As with a
    tensor whose `.data` is moved, host views taken of `data` (indexing,
    `np.asarray`) do not follow it to the device at Run: take them in the cell
    that uses them."""

    __slots__ = ("__weakref__", "_device_memory", "data", "device")

    def __init__(self, data: np.ndarray, device: str = "vgpu:0"):
        if not isinstance(data, np.ndarray) or data.dtype.hasobject:
            raise TypeError(f"a virtual GPU holds numeric ndarrays, not {type(data).__name__}")
        self.data = data if _owns_contiguous(data) else np.ascontiguousarray(data).copy()
        self.device = device
        self._device_memory: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key) -> Any:
        return self.data[key]

    def __setitem__(self, key, value) -> None:
        self.data[key] = value

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        # numpy >= 2 passes `copy` and takes what this returns as is
        if dtype is not None and np.dtype(dtype) != self.data.dtype:
            if copy is False:
                raise ValueError(f"a {self.data.dtype} array cannot be read as {dtype} without a copy")
            return self.data.astype(dtype)
        return self.data.copy() if copy else self.data

    def sum(self, *args, **kwargs) -> Any:
        return self.data.sum(*args, **kwargs)

    def cpu(self) -> np.ndarray:
        """A host copy, as `tensor.cpu()` gives."""
        return self.data.copy()

    def stage(self) -> None:
        """Staged before Run: fault in the host copy (the restore file maps it
        lazily) and take the stand-in device memory now. A GPU's caching allocator
        hands out memory in microseconds, while host pages cost a fault each (seconds
        for gigabytes on a small VM), so that cost is paid while the user types and
        the copy at Run is the memcpy alone."""
        flat = self.data.reshape(-1).view(np.uint8)
        int(flat[:: mmap.PAGESIZE].sum())  # one read per page
        self._device_memory = device_memory(self.data)

    def copy_to_device(self) -> int:
        """The stand-in device copy: the bytes into new memory, in place (the same
        object, as `t.data = t.data.to(device)` keeps the tensor); bytes copied."""
        moved = self._device_memory if self._device_memory is not None else device_memory(self.data)
        self._device_memory = None
        np.copyto(moved, self.data)
        self.data = moved
        return moved.nbytes

    def __repr__(self) -> str:
        return f"VirtualGpuArray(shape={self.shape}, dtype={self.dtype}, device='{self.device}')"


def to_virtual_gpu(arr: Any, device: str = "vgpu:0") -> VirtualGpuArray:
    """`arr` copied to a virtual GPU (a new array: the original stays on the host)."""
    return VirtualGpuArray(np.array(arr, copy=True, order="C"), device)


def device_memory(like: np.ndarray) -> np.ndarray:
    """Stand-in device memory for an array like `like`: anonymous pages faulted in
    at once (MAP_POPULATE), an array that owns them."""
    if like.nbytes == 0:
        return np.empty_like(like)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.ndarray(like.shape, dtype=like.dtype, buffer=mmap.mmap(-1, like.nbytes, flags=flags))


def _owns_contiguous(arr: np.ndarray) -> bool:
    # a restored array's base is the restore file's buffer, not another array
    return not isinstance(arr.base, np.ndarray) and arr.flags.c_contiguous
