"""Staged GPU state (ADR 70): a tensor saved from a GPU, restored by a worker that
has no slot yet, waits in host memory without touching CUDA; the restore at Run
copies it to its device in place. No CUDA here: the stand-in copy swaps in new
host memory, in place, as the device copy swaps in device memory."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import ok, stream_text  # noqa: E402
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


def test_a_staged_parameter_s_gradient_goes_to_the_device_with_it(no_slot):
    w = SavedFromGpu(np.ones(4, dtype=np.float32), is_param=True)
    grad = SavedFromGpu(np.full(4, 0.5, dtype=np.float32))
    rebuild, args = w.__reduce__()
    x = pickle.loads(pickle.dumps(_Reduced(rebuild, (*args, grad))))
    assert torch.equal(x.grad, torch.full((4,), 0.5)) and staging.pending() == 2
    moved_to.clear()
    assert staging.stage_in(move=to_copy)[0] == 32 and moved_to == ["cuda:0", "cuda:0"]
    assert torch.equal(x.grad, torch.full((4,), 0.5)), "the same gradient, moved in place"


class _Reduced:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


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


# Virtual GPU slots: the stand-in device (ADR 72), through real workers.

VIRTUAL_SLOT = {"LOOSELEAF_VIRTUAL_DEVICES": "0"}
MAKE = (
    "import numpy as np\nfrom looseleaf_worker.virtual_gpu import to_virtual_gpu\n"
    "v = to_virtual_gpu(np.arange(1_000_000, dtype=np.float32))\nalias = {'v': v}"
)


def test_a_virtual_gpu_array_is_saved_as_gpu_resident(host, zygote):
    w1 = zygote.fork(env=VIRTUAL_SLOT)
    ok(w1.run(MAKE))
    delta = w1.save()["ready"]["delta"]
    rec = delta["objects"][delta["variables"]["v"]["oid"]]
    assert rec["on_gpu"] is True
    assert [(p["device"], p["dtype"], p["len"]) for p in rec["payloads"]] == [("vgpu:0", "float32", 4_000_000)]


def test_a_virtual_gpu_array_waits_in_host_memory_until_run(host, zygote):
    w1 = zygote.fork(env=VIRTUAL_SLOT)
    ok(w1.run(MAKE))
    w1.save()
    prepared = zygote.fork()  # before Run: no slot, no device
    first = prepared.restore(["v", "alias"])
    assert first["ok"] and first.get("staged_in_bytes", 0) == 0, first
    at_run = prepared.restore([], env=VIRTUAL_SLOT)
    assert at_run["ok"] and at_run["staged_in_bytes"] == 4_000_000, at_run
    # the stand-in device memory is an anonymous mapping of its own
    check = "import mmap\nprint(alias['v'] is v, isinstance(v.data.base, mmap.mmap), float(v.sum()), v.device)"
    text = stream_text(ok(prepared.run(check)))
    assert text.split() == ["True", "True", str(float(np.arange(1_000_000, dtype=np.float32).sum())), "vgpu:0"]
    again = prepared.restore([], env=VIRTUAL_SLOT)
    assert again.get("staged_in_bytes", 0) == 0, "copied once"


def test_a_worker_on_its_slot_copies_a_virtual_gpu_array_at_restore(host, zygote):
    w1 = zygote.fork(env=VIRTUAL_SLOT)
    ok(w1.run(MAKE))
    w1.save()
    cold = zygote.fork(env=VIRTUAL_SLOT)
    restored = cold.restore(["v"], env=VIRTUAL_SLOT)
    assert restored["ok"] and restored.get("staged_in_bytes", 0) == 0, restored
    # its bytes are its own (the "device"), not the restore file's
    check = "import mmap\nprint(isinstance(v.data.base, mmap.mmap), v.data.flags.writeable, v.shape)"
    assert stream_text(ok(cold.run(check))).split() == ["True", "True", "(1000000,)"]


def test_a_virtual_gpu_array_reads_as_numpy_with_numpys_copy_rules():
    from looseleaf_worker.virtual_gpu import to_virtual_gpu

    host = np.arange(4, dtype=np.float32)
    v = to_virtual_gpu(host)
    assert not np.shares_memory(v.data, host), "to the device is a copy"
    assert np.asarray(v) is v.data, "no copy asked: the device array itself"
    assert not np.shares_memory(np.array(v, copy=True), v.data)
    assert np.asarray(v, dtype=np.float64).dtype == np.float64
    # numpy >= 2 asks __array__ for the copy; numpy 1 copies itself
    assert not np.shares_memory(v.__array__(copy=True), v.data)
    with pytest.raises(ValueError, match="without a copy"):
        v.__array__(np.float64, copy=False)
