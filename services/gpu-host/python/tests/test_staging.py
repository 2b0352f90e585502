"""Staged GPU state (ADR 70): a tensor saved from a GPU, restored by a worker that
has no slot yet, waits in host memory without touching CUDA; the restore at Run
copies it to its device in place. No CUDA here: the stand-in copy swaps in new
host memory, in place, as the device copy swaps in device memory."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from looseleaf_worker import staging  # noqa: E402
from looseleaf_worker.checkpoint import _rebuild_tensor  # noqa: E402
from looseleaf_worker.worker import Worker  # noqa: E402


class SavedFromGpu:
    """Pickles as the checkpoint pickles a tensor that lived on `device`."""

    def __init__(self, arr: np.ndarray, device: str = "cuda:0", is_param: bool = False):
        self.arr, self.device, self.is_param = arr, device, is_param

    def __reduce__(self):
        return (_rebuild_tensor, (self.arr, "float32", self.is_param, self.device, self.is_param))


moved_to: list[str] = []


def to_copy(t, device):
    """The stand-in device copy: the tensor's data replaced by a copy, in place."""
    moved_to.append(device)
    t.data = t.data.clone()


@pytest.fixture
def no_slot(monkeypatch):
    """A worker prepared before Run: no devices visible, CUDA never asked."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    staging._staged.clear()
    yield asked
    staging._staged.clear()


def test_a_gpu_tensor_restored_without_a_slot_waits_in_host_memory(no_slot):
    arr = np.arange(1000, dtype=np.float32)
    state = pickle.loads(pickle.dumps({"x": SavedFromGpu(arr), "w": SavedFromGpu(arr, is_param=True)}))
    assert state["x"].device.type == "cpu" and torch.equal(state["x"], torch.from_numpy(arr))
    assert isinstance(state["w"], torch.nn.Parameter)
    assert staging.pending() == 2
    assert no_slot == [], "CUDA is not touched before the slot's devices are set"


def test_stage_in_moves_the_same_objects_and_counts_their_bytes(no_slot):
    state = pickle.loads(pickle.dumps({"x": SavedFromGpu(np.ones(256, dtype=np.float32), is_param=True)}))
    x = state["x"]
    refs = [x, {"again": x}]
    before = x.data_ptr()
    moved_to.clear()
    nbytes, ms = staging.stage_in(move=to_copy)
    assert (nbytes, moved_to) == (1024, ["cuda:0"])
    assert x.data_ptr() != before and torch.equal(x, torch.ones(256)), "new memory, same values"
    assert refs[0] is x and refs[1]["again"] is x and isinstance(x, torch.nn.Parameter)
    assert ms >= 0 and staging.pending() == 0, "copied once"
    assert staging.stage_in(move=to_copy)[0] == 0


def test_a_collected_staged_tensor_is_not_copied(no_slot):
    pickle.loads(pickle.dumps(SavedFromGpu(np.ones(8, dtype=np.float32))))
    assert staging.pending() == 0
    assert staging.stage_in(move=to_copy)[0] == 0


def test_the_restore_at_run_stages_in_once_the_slot_is_visible(no_slot, monkeypatch):
    x = pickle.loads(pickle.dumps(SavedFromGpu(np.ones(16, dtype=np.float32))))
    errors: dict[str, str] = {}
    assert Worker._stage_in(errors) == (0, 0.0), "no slot yet: nothing moves"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(staging, "_to_device", to_copy)
    before = x.data_ptr()
    nbytes, _ = Worker._stage_in(errors)
    assert (nbytes, x.data_ptr() != before, errors) == (64, True, {})


def test_a_failed_copy_is_named_in_the_restore_errors(no_slot, monkeypatch):
    kept = pickle.loads(pickle.dumps(SavedFromGpu(np.ones(4, dtype=np.float32))))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    def out_of_memory(t, device):
        raise RuntimeError(f"CUDA out of memory on {device}")

    monkeypatch.setattr(staging, "_to_device", out_of_memory)
    errors: dict[str, str] = {}
    assert Worker._stage_in(errors) == (0, 0.0)
    assert errors == {"stage_in": "RuntimeError: CUDA out of memory on cuda:0"}
    assert kept.device.type == "cpu"
