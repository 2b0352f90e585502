"""bench/checkpoint: LooseLeaf's incremental save and closure-only restore against
dill's whole-session save/load and Kishu's checkout, and save/restore throughput
against a plain memory copy, on the local-directory and S3 backends (issue 4).

One run, every baseline measured in it:
1. baselines (bench/lib/checkpoint_baselines.py, fresh processes): dill.dump_session
   of the 1 GiB session after the 1% change (time, bytes), dill.load_session of it,
   Kishu's checkout of the same state, memcpy bandwidth;
2. per backend (`local`: a directory in the bench's scratch space on this machine's
   disk; `local_tmpfs`: the same local-directory backend with its directory in
   /dev/shm, so that the figures show LooseLeaf's own path apart from the disk;
   `s3`: a local moto server), `looseleaf up
   --store-url ...` and one generated notebook run with `looseleaf run --all-gpu`, so
   every cell runs on a fresh GPU worker that restores only its closure:
   - `make`: 100 float64 arrays of 10 MiB (1 GiB), saved in full (save throughput);
   - `change`: `aNNN += 1.0`, one array = 1% of the bytes (incremental save);
   - `restore one`: `rNNN = float(aNNN.sum())`, a worker that restores one 10 MiB
     variable (restore time: the host fetching chunks into shared memory plus the
     worker loading them, the report's `restore_ms`);
   - `restore all`: a cell reading all 100 arrays, five times (restore throughput,
     the median).
Writes bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B  # noqa: E402

LIB = Path(__file__).resolve().parent
TARGETS = {
    "incremental_bytes_ratio_vs_dill": 20.0,
    "incremental_speedup_vs_dill": 10.0,
    "restore_one_speedup_vs_dill": 50.0,
    "restore_one_speedup_vs_kishu": 1.0,
    "save_vs_memcpy": 0.3,
    "restore_vs_memcpy": 0.3,
}


def notebook(path: Path, arrays: int, array_bytes: int, changes: int, restores: int, restore_alls: int = 5) -> dict:
    """Write the bench notebook; returns {role: [code cell index, ...]}."""
    elems = array_bytes // 8
    names = [f"a{i:03d}" for i in range(arrays)]
    cells, roles = [], {"make": [], "change": [], "restore_one": [], "restore_all": []}

    def add(role: str, src: str) -> None:
        roles[role].append(len(cells))
        cells.append(src)

    add(
        "make",
        "import numpy as np\n"
        + "\n".join(f"{n} = np.random.default_rng({i}).random({elems})" for i, n in enumerate(names)),
    )
    for k in range(changes):
        add("change", f"{names[(arrays // 2 + k) % arrays]} += 1.0")
    for k in range(restores):
        n = names[(k * 7 + 3) % arrays]
        add("restore_one", f"r{n} = float({n}.sum())")
    for _ in range(restore_alls):
        add("restore_all", "total = sum(float(x.sum()) for x in (" + ", ".join(names) + ",))")
    nb = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [
            {"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [], "source": src}
            for i, src in enumerate(cells)
        ],
    }
    path.write_text(json.dumps(nb, indent=1))
    return roles


def baselines(work: Path, args) -> dict:
    B.log("baselines: dill dump/load_session, Kishu checkout, memcpy")
    out = subprocess.run(
        [
            str(B.PYTHON),
            str(LIB / "checkpoint_baselines.py"),
            "--work",
            str(work),
            "--arrays",
            str(args.arrays),
            "--array-bytes",
            str(args.array_bytes),
            "--reps",
            str(args.baseline_reps),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=B.REPO,
    )
    sys.stderr.write(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_backend(name: str, work: Path, args, store_url: str | None, env: dict | None) -> dict:
    B.log(f"{name}: looseleaf up --store-url {store_url or '<data dir>/store'}")
    cluster = B.Cluster(work / "data", virtual_gpus=2, store_url=store_url, env=env)
    try:
        cluster.wait_ready()
        nb = work / "checkpoint.ipynb"
        roles = notebook(nb, args.arrays, args.array_bytes, args.changes, args.restores)
        B.log(f"{name}: running {sum(len(v) for v in roles.values())} cells")
        report = B.run_notebook(nb, cluster.url, work, all_gpu=True, timeout=900)
    finally:
        cluster.stop()
    cells = report["cells"]
    bad = [c for c in cells if c["status"] != "ok"]
    if bad:
        raise RuntimeError(f"{name}: cells failed: {[(c['cell_id'], c['error']) for c in bad]}")
    pick = {role: [cells[i] for i in idx] for role, idx in roles.items()}
    fields = (
        "cell_id",
        "prepare",
        "start_delay_ms",
        "prepare_ms",
        "restore_ms",
        "restored_bytes",
        "save_ms",
        "saved_bytes",
        "chunks_written",
    )
    return {role: [{k: c.get(k) for k in fields} for c in cs] for role, cs in pick.items()}


def directory_write_bytes_per_s(d: Path, total: int = 1 << 30, piece: int = 2 << 20) -> float:
    """What the local-directory backend can do at best on this disk: write `total`
    bytes as 2 MiB files (as chunks are stored), as a rate."""
    d.mkdir(parents=True, exist_ok=True)
    data = os.urandom(piece)
    t = time.perf_counter()
    for i in range(total // piece):
        (d / f"probe-{i}").write_bytes(data)
    rate = total / (time.perf_counter() - t)
    shutil.rmtree(d)
    return rate


FIRST_TOUCH = """
import time
import numpy as np
kept, rates = [], []
for _ in range(3):
    t = time.perf_counter()
    kept.append(np.ones(1 << 27))  # 1 GiB, kept: memory a store holds on to
    rates.append((1 << 30) / (time.perf_counter() - t))
print(sorted(rates)[1])
"""


def kept_memory_bytes_per_s() -> float:
    """How fast this machine hands out memory that stays in use (3 GiB touched and
    kept, in a fresh process; the median of three 1 GiB steps). On a VM whose
    hypervisor backs guest memory on first touch this is far below memcpy into
    recycled memory, and it bounds whatever must keep new bytes: page cache, tmpfs,
    an in-memory S3 server."""
    out = subprocess.run([str(B.PYTHON), "-c", FIRST_TOUCH], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


def s3_server_bytes_per_s(
    endpoint: str, bucket: str, total: int = 256 << 20, piece: int = 2 << 20, parallel: int = 16
) -> dict:
    """What the S3 server itself can do: PUT then GET `total` bytes as 2 MiB objects
    over `parallel` keep-alive connections (the host's parallelism), unsigned (the
    local server accepts that), as rates. A ceiling for any client of this server."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    u = urlparse(endpoint)
    data = os.urandom(piece)
    keys = [f"/{bucket}/probe/{i}" for i in range(total // piece)]

    def run(method: str) -> float:
        def worker(ks):
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
            for k in ks:
                c.request(method, k, body=data if method == "PUT" else None)
                c.getresponse().read()
            c.close()

        groups = [keys[i::parallel] for i in range(parallel)]
        t = time.perf_counter()
        with ThreadPoolExecutor(parallel) as ex:
            list(ex.map(worker, groups))
        return total / (time.perf_counter() - t)

    put = run("PUT")
    get = run("GET")
    run("DELETE")
    return {"put_bytes_per_s": put, "get_bytes_per_s": get, "parallel": parallel, "bytes": total}


def figures(raw: dict, base: dict) -> dict:
    med = B.median
    # The plain memory copy: a copy of the same bytes into new memory (a.copy()),
    # as a save to new chunks and a restore into a new worker must at least make;
    # the ratio to raw bandwidth (a pre-faulted destination) is reported beside it.
    memcpy = base["memcpy_fresh_bytes_per_s"]["median"]
    memcpy_warm = base["memcpy_bytes_per_s"]["median"]
    kishu = base.get("kishu_checkout_s", {}).get("median")
    change_bytes = med([c["saved_bytes"] for c in raw["change"]])
    change_s = med([c["save_ms"] for c in raw["change"]]) / 1000
    one_s = med([c["restore_ms"] for c in raw["restore_one"]]) / 1000
    make = raw["make"][0]
    save_bps = make["saved_bytes"] / (make["save_ms"] / 1000)
    restore_bps = med([c["restored_bytes"] / (c["restore_ms"] / 1000) for c in raw["restore_all"]])
    out = {
        "incremental_bytes_ratio_vs_dill": base["dill_full_save_bytes"] / change_bytes,
        "incremental_speedup_vs_dill": base["dill_full_save_s"]["median"] / change_s,
        "restore_one_speedup_vs_dill": base["dill_load_session_s"]["median"] / one_s,
        "restore_one_speedup_vs_kishu": kishu / one_s if kishu else None,
        "save_vs_memcpy": save_bps / memcpy,
        "restore_vs_memcpy": restore_bps / memcpy,
        "raw": {
            "incremental_saved_bytes_median": change_bytes,
            "incremental_save_s_median": change_s,
            "restore_one_s_median": one_s,
            "restore_one_bytes_median": med([c["restored_bytes"] for c in raw["restore_one"]]),
            "restore_one_start_delay_ms_median": med([c["start_delay_ms"] for c in raw["restore_one"]]),
            "full_save_bytes": make["saved_bytes"],
            "full_save_s": make["save_ms"] / 1000,
            "save_bytes_per_s": save_bps,
            "restore_all_bytes_per_s": restore_bps,
            "memcpy_fresh_bytes_per_s": memcpy,
            "memcpy_warm_bytes_per_s": memcpy_warm,
            "kept_memory_bytes_per_s": base.get("kept_memory_bytes_per_s"),
            "save_vs_memcpy_warm": save_bps / memcpy_warm,
            "restore_vs_memcpy_warm": restore_bps / memcpy_warm,
            "cells": raw,
        },
    }
    out["met"] = {k: (out[k] is not None and out[k] >= t) for k, t in TARGETS.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arrays", type=int, default=100)
    ap.add_argument("--array-bytes", type=int, default=(1 << 30) // 100)
    ap.add_argument("--changes", type=int, default=7, help="incremental-save cells")
    ap.add_argument("--restores", type=int, default=7, help="restore-one cells")
    ap.add_argument("--baseline-reps", type=int, default=3)
    ap.add_argument("--backends", default="local,local_tmpfs,s3")
    args = ap.parse_args()
    B.ensure_release()
    work = B.scratch("checkpoint")
    base = baselines(work / "baselines", args)
    base["kept_memory_bytes_per_s"] = kept_memory_bytes_per_s()
    B.log(f"memory handed out and kept: {base['kept_memory_bytes_per_s'] / 1e9:.2f} GB/s")
    result = {
        "bench": "checkpoint",
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "session": {
            "arrays": args.arrays,
            "array_bytes": args.array_bytes,
            "total_bytes": args.arrays * args.array_bytes,
            "change": "one array (1% of the bytes): aNNN += 1.0",
        },
        "targets": TARGETS,
        "baselines": base,
    }
    for name in args.backends.split(","):
        d = work / name
        d.mkdir(parents=True)
        if name in ("local", "local_tmpfs"):
            # local_tmpfs: the store directory in memory, where the disk cannot bound it
            store = Path(f"/dev/shm/looseleaf-bench-{os.getpid()}") / "store" if name == "local_tmpfs" else d / "store"
            try:
                raw = run_backend(name, d, args, f"file://{store}", None)
                # the local backend cannot save faster than its directory takes 2 MiB files
                write_rate = directory_write_bytes_per_s(store.parent / "write-probe")
            finally:
                if name == "local_tmpfs":
                    shutil.rmtree(store.parent, ignore_errors=True)
        elif name == "s3":
            s3 = B.S3Server(d)
            try:
                raw = run_backend(name, d, args, s3.url, s3.env())
                server = s3_server_bytes_per_s(s3.endpoint, s3.bucket)
            finally:
                s3.stop()
            write_rate = None
        else:
            raise SystemExit(f"unknown backend {name!r}: use local, local_tmpfs and/or s3")
        result[name] = figures(raw, base)
        result[name]["store"] = {
            "local": f"directory on this machine's disk ({d})",
            "local_tmpfs": "directory in /dev/shm (memory)",
            "s3": "local moto server (in memory)",
        }[name]
        result[name]["raw"]["store_dir_write_bytes_per_s"] = write_rate
        if name == "s3":
            # the S3 server cannot take or give bytes faster than this
            r = result[name]["raw"]
            r["s3_server"] = server
            r["save_vs_s3_server_put"] = r["save_bytes_per_s"] / server["put_bytes_per_s"]
            r["restore_vs_s3_server_get"] = r["restore_all_bytes_per_s"] / server["get_bytes_per_s"]
        if write_rate:
            # the local backend cannot save faster than this disk takes 2 MiB files
            result[name]["raw"]["save_vs_store_dir_write"] = result[name]["raw"]["save_bytes_per_s"] / write_rate
        B.log(f"{name}: " + ", ".join(f"{k}={result[name][k]:.3g}" for k in TARGETS if result[name][k] is not None))
    path = B.write_result("checkpoint", result)
    B.log(f"wrote {path}")


if __name__ == "__main__":
    main()
