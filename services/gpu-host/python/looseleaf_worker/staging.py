"""Staged GPU state (ADR 70). A worker prepared before Run holds no GPU slot and
must not touch CUDA (the devices it may see are set only at Run, and CUDA reads
them once), so the GPU-resident tensors of its closure are restored into host
memory and remembered here. The restore at Run, once the slot's devices are
visible, copies them to their devices in place: the same tensor objects, so
identity across cells and every reference to them hold. On virtual GPU slots the
staged objects are `virtual_gpu.VirtualGpuArray`s and the copy is a stand-in
(ADR 72).
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

# The slot's virtual devices, set by the gpu-host for a run on virtual slots as
# CUDA_VISIBLE_DEVICES is for real ones; empty in a worker without a slot.
VIRTUAL_DEVICES_ENV = "LOOSELEAF_VIRTUAL_DEVICES"

# (the staged tensor, the device it was saved from)
_staged: list[tuple[weakref.ref, str]] = []


def devices_visible() -> bool:
    """Whether this worker was given GPU devices (its slot's), real or virtual."""
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get(VIRTUAL_DEVICES_ENV))


def stage(t: Any, device: str) -> Any:
    """Keep `t`, restored into host memory, for the copy to `device` at Run."""
    _staged.append((weakref.ref(t), device))
    return t


def pending() -> int:
    """Staged tensors still alive and not copied yet."""
    return sum(1 for ref, _ in _staged if ref() is not None)


def _to_device(t: Any, device: str) -> None:
    try:
        t.data = t.data.to(device)
    except RuntimeError:
        # saved from a device index this slot does not have: its first device
        t.data = t.data.to("cuda")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def stage_in(move=None) -> tuple[int, float]:
    """Copy every staged object still alive to its device (`move(t, device)`
    swaps a tensor's data in place); (bytes copied, ms). Called once the slot's
    devices are visible. Tensors stay in host memory when no CUDA device shows
    after all; virtual GPU arrays always take their stand-in copy."""
    global _staged
    move = move or _to_device
    t0 = time.perf_counter()
    nbytes = 0
    staged, _staged = _staged, []
    cuda = None
    for ref, device in staged:
        t = ref()
        if t is None:
            continue
        if hasattr(t, "copy_to_device"):  # a virtual GPU array
            nbytes += t.copy_to_device()
            continue
        if cuda is None:
            cuda = _cuda()
        if not cuda:
            continue
        move(t, device)
        nbytes += t.element_size() * t.nelement()
    return nbytes, (time.perf_counter() - t0) * 1000
