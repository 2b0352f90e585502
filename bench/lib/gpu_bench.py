"""bench/gpu: the checks only a real GPU can answer (issue 12 item 7), as one
prepared script for a short lease of a GPU machine (DEVELOPERS.md says how).

Reported separately:
1. torch import time in a fresh interpreter;
2. storing 1 GiB into shared memory (/dev/shm), GB/s;
3. CUDA context creation in a worker forked from a CUDA-clean zygote (the zygote
   imported torch without touching CUDA; the worker's first CUDA call pays it);
4. host-to-device copy of 1 GiB of restored tensor bytes from registered (pinned)
   shared memory, GB/s (target >= 20 GB/s on an H200), beside the same copy unpinned;
5. the dirty-region save of a 1 GiB GPU tensor changed in 1% of its 2 MiB regions:
   save time and the chunks the store had to take;
6. one torch corpus notebook end to end with every cell serverless on the real GPU
   (needs the release binaries).

Without CUDA it runs what needs none (1, 2) and says why the rest did not run:
`"gpu": false` and a `reason`. Writes bench/results/gpu.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B  # noqa: E402

PYDIR = B.REPO / "services/gpu-host/python"
TORCH_NOTEBOOK = "torch/mrdbourke_01_pytorch_workflow.ipynb"
TARGET_PINNED_GBPS = 20.0
GiB = 1 << 30


def probe(python: str) -> dict:
    """What torch in `python` sees, asked in a child (this process stays CUDA-clean)."""
    code = (
        "import json, torch\n"
        "ok = torch.cuda.is_available()\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': ok, 'devices': torch.cuda.device_count() if ok else 0,"
        " 'name': torch.cuda.get_device_name(0) if ok else None}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"torch": None, "cuda": False, "reason": f"torch does not import: {out.stderr.strip()[-300:]}"}
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if not info["cuda"]:
        info["reason"] = "torch.cuda.is_available() is False: no CUDA driver or no GPU on this machine"
    return info


def torch_import_ms(python: str, reps: int) -> dict:
    code = "import time; t = time.perf_counter(); import torch; print((time.perf_counter() - t) * 1000)"
    samples = []
    for _ in range(reps):
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        samples.append(float(out.stdout.strip().splitlines()[-1]))
    return {"median_ms": B.median(samples), "samples_ms": samples}


def shm_store_gbps(nbytes: int, reps: int) -> dict:
    """Write `nbytes` from memory into a /dev/shm file, as a worker's save does."""
    import numpy as np

    data = np.ones(nbytes // 8, dtype=np.float64)
    samples = []
    for _ in range(reps):
        with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="looseleaf-bench-") as f:
            t = time.perf_counter()
            f.write(memoryview(data))
            f.flush()
            samples.append(nbytes / (time.perf_counter() - t) / 1e9)
    return {"bytes": nbytes, "median_gbps": B.median(samples), "samples_gbps": samples}


def _hostsim():
    sys.path.insert(0, str(PYDIR / "tests"))
    sys.path.insert(0, str(PYDIR))
    from hostsim import HostSim

    return HostSim()


def _stdout(run: dict) -> str:
    return "".join(o["text"] for o in run["outputs"] if o["output_type"] == "stream" and o["name"] == "stdout")


def cuda_context_in_forked_worker(reps: int) -> dict:
    """Fork workers from a zygote that imported torch without CUDA; time each one's
    first CUDA call."""
    host = _hostsim()
    try:
        zygote = host.zygote(["torch"])
        code = (
            "import time, torch\n"
            "clean = not torch.cuda.is_initialized()\n"
            "t = time.perf_counter()\n"
            "torch.zeros(1, device='cuda'); torch.cuda.synchronize()\n"
            "print('CTX', clean, (time.perf_counter() - t) * 1000)"
        )
        samples, clean = [], True
        for _ in range(reps):
            w = zygote.fork()
            out = _stdout(w.run(code)).split()
            clean = clean and out[1] == "True"
            samples.append(float(out[2]))
            w.close()
        return {"median_ms": B.median(samples), "samples_ms": samples, "zygote_cuda_clean": clean}
    finally:
        host.close()


def pinned_h2d(python: str, nbytes: int, reps: int) -> dict:
    """Copy `nbytes` of a /dev/shm restore file to the GPU, registered (pinned) and not."""
    code = f"""
import json, mmap, os, tempfile, time, torch
n = {nbytes}
fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="looseleaf-bench-")
os.ftruncate(fd, n)
mm = mmap.mmap(fd, n)
host = torch.frombuffer(mm, dtype=torch.uint8)
host.fill_(7)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
def rate(pinned):
    out = []
    for _ in range({reps} + 1):
        torch.cuda.synchronize(); t = time.perf_counter()
        dev.copy_(host, non_blocking=pinned); torch.cuda.synchronize()
        out.append(n / (time.perf_counter() - t) / 1e9)
    return out[1:]  # the first copy warms up
unpinned = rate(False)
rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 0)
pinned = rate(True)
ok = bool((dev[:: 1 << 20] == 7).all())
torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
del host; mm.close(); os.close(fd); os.unlink(path)
print(json.dumps({{"register_rc": int(rc), "pinned_gbps": pinned, "unpinned_gbps": unpinned, "intact": ok}}))
"""
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-1000:]}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    med = B.median(r["pinned_gbps"])
    return {
        "bytes": nbytes,
        "median_pinned_gbps": med,
        "median_unpinned_gbps": B.median(r["unpinned_gbps"]),
        "target_gbps": TARGET_PINNED_GBPS,
        "target_met": med >= TARGET_PINNED_GBPS,
        **r,
    }


def dirty_region_save(nbytes: int) -> dict:
    """Save a GPU tensor, change 1% of its 2 MiB regions, save again."""
    host = _hostsim()
    try:
        zygote = host.zygote(["torch"])
        w = zygote.fork()
        w.run(f"import torch\nx = torch.ones({nbytes // 4}, dtype=torch.float32, device='cuda')")
        t = time.perf_counter()
        first = w.save()
        first_s = time.perf_counter() - t
        region = 2 << 20
        regions = nbytes // region
        changed = sorted(random.Random(7).sample(range(regions), max(1, regions // 100)))
        per = region // 4
        w.run("\n".join(f"x[{i * per}] += 1" for i in changed))
        t = time.perf_counter()
        second = w.save()
        second_s = time.perf_counter() - t
        w.close()
        return {
            "bytes": nbytes,
            "regions": regions,
            "regions_changed": len(changed),
            "first_save_s": first_s,
            "first_chunks_written": len(first["missing"]),
            "dirty_save_s": second_s,
            "dirty_chunks_written": len(second["missing"]),
        }
    finally:
        host.close()


def notebook_end_to_end(work: Path) -> dict:
    """The torch corpus notebook through `looseleaf up` on the real GPUs, every cell
    serverless."""
    if not B.LOOSELEAF.exists():
        return {"skipped": f"{B.LOOSELEAF} is not built (carry the release binaries)"}
    corpus = B.copy_corpus(work)
    cluster = B.Cluster(work / "data", virtual_gpus=None)
    try:
        cluster.wait_ready()
        (work / "out").mkdir(parents=True, exist_ok=True)
        report = B.run_notebook(corpus / TORCH_NOTEBOOK, cluster.url, work / "out")
    finally:
        cluster.stop()
    cells = report["cells"]
    gpu = [c for c in cells if c.get("device") == "gpu"]
    return {
        "notebook": TORCH_NOTEBOOK,
        "cells": len(cells),
        "errors": report["totals"]["errors"],
        "gpu_cells": len(gpu),
        "median_start_delay_ms": report["totals"]["median_start_delay_ms"],
        "hosts_slots": sorted({(c.get("host"), c.get("slot")) for c in gpu}, key=str),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="result file (default bench/results/gpu.json)")
    ap.add_argument("--bytes", type=int, default=GiB, help="size of the copy, store and save checks")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-notebook", action="store_true", help="skip the end-to-end notebook")
    args = ap.parse_args()
    started = time.monotonic()
    python = str(os.environ.get("LOOSELEAF_PYTHON", B.PYTHON))
    info = probe(python)
    B.log(f"torch {info.get('torch')}, cuda {info['cuda']}: {info.get('name') or info.get('reason')}")
    result: dict = {"bench": "gpu", "gpu": info["cuda"], "device": info, "python": python}
    if info.get("torch"):
        result["torch_import"] = torch_import_ms(python, 3)
    result["shm_store"] = shm_store_gbps(args.bytes, args.reps)
    gpu_checks = ["cuda_context", "pinned_h2d", "dirty_region_save", "notebook"]
    if not info["cuda"]:
        result["reason"] = info["reason"]
        result["skipped"] = {k: info["reason"] for k in gpu_checks}
    else:
        result["cuda_context"] = cuda_context_in_forked_worker(args.reps)
        result["pinned_h2d"] = pinned_h2d(python, args.bytes, args.reps)
        result["dirty_region_save"] = dirty_region_save(args.bytes)
        if args.no_notebook:
            result["notebook"] = {"skipped": "--no-notebook"}
        else:
            result["notebook"] = notebook_end_to_end(B.scratch("gpu"))
    result["wall_s"] = time.monotonic() - started
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        path = args.out
    else:
        path = B.write_result("gpu", result)
    B.log(f"wrote {path} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
