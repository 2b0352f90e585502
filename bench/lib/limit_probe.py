"""The floor under a cold start on this machine: how long a fork of a process that
imported the base zygote's packages takes, and the memory-copy bandwidth that
restoring closure bytes can at best reach.

    python limit_probe.py [--packages IPython,numpy,pandas,torch] [--forks 30]

Prints one JSON object: fork samples (ms, fork to the child's first write read by
the parent), memcpy samples (seconds for a 256 MiB numpy copy) and the best bandwidth.
"""
import argparse
import importlib
import json
import os
import time


def fork_samples(n: int) -> list[float]:
    out = []
    for _ in range(n):
        r, w = os.pipe()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"x")
            os._exit(0)
        os.read(r, 1)
        out.append((time.perf_counter() - t0) * 1000)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    return out


def memcpy_samples(nbytes: int, reps: int) -> list[float]:
    import numpy as np
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # written once so its pages exist
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packages", default="IPython,numpy,pandas,torch")
    ap.add_argument("--forks", type=int, default=30)
    ap.add_argument("--memcpy-mib", type=int, default=256)
    ap.add_argument("--memcpy-reps", type=int, default=5)
    args = ap.parse_args()
    imported = []
    for p in [p for p in args.packages.split(",") if p]:
        try:
            importlib.import_module(p)
            imported.append(p)
        except Exception:
            pass
    rss_kib = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    forks = fork_samples(args.forks)
    nbytes = args.memcpy_mib << 20
    copies = memcpy_samples(nbytes, args.memcpy_reps)
    print(json.dumps({
        "parent_packages": imported,
        "parent_rss_bytes": rss_kib * 1024,
        "fork_ms_samples": forks,
        "memcpy_bytes": nbytes,
        "memcpy_s_samples": copies,
        "memcpy_bytes_per_s": nbytes / min(copies),
    }))


if __name__ == "__main__":
    main()
