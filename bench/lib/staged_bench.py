"""bench/staged: staged preparation on virtual GPUs (issue 38 items 1 and 3; ADR 70,
ADR 72).

The four services run as processes of their own (benchlib.Services: one gpu-host
with two virtual GPU slots, a directory store). Everything goes through the
frontend's HTTP API, as a notebook client would.

Staged cells. A session (every cell a GPU cell, speculation on) runs a setup cell
that puts ten 200 MiB arrays of random numbers on a virtual GPU
(`looseleaf_worker.virtual_gpu`, the stand-in for GPU-resident state where no CUDA
device exists): a 2 GiB session. Then 10 cells, each reading one of the arrays,
are typed at 20 characters a second (an edit every 0.1 s, as `looseleaf run
--typing-cps` types) and run as soon as they are typed.
- `idle_slot_seconds`: GPU-slot seconds that prepared workers held while their
  cells were typed (the `idle_ms` of every prepared worker that held a slot);
  target 0: a staged preparation holds none.
- `median_start_ms`: the median start delay of the 10 (Run to the cell's first
  line), which includes copying the cell's array to its slot's device: on virtual
  GPUs a host memcpy of the same bytes (`copy`), not a real host-to-device copy.
  Target 100.

Host cache. A session without speculation saves one 200 MiB virtual GPU array,
then a cell reading it runs `REPS` times on the host that saved it (its chunk
cache holds the array), and `REPS` times on a host started fresh (an empty cache)
after the directory store's files were dropped from the page cache
(posix_fadvise DONTNEED after a sync; `store_resident_bytes_after_drop` says what
was left). Each run restores the array in a cold worker; the host's part of the
restore, laying the closure out in shared memory, is the started event's
`restore_file_ms`.
- `host_cache_speedup`: median cold `restore_file_ms` / median warm; target 5.

Writes bench/results/staged.json with those keys and the per-cell figures.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from benchlib import Services, ensure_release, log, scratch, write_result

ARRAYS = 10
ARRAY_MIB = 200
TYPING_CPS = 20.0
REPS = 5
TIMEOUT = 300.0
TARGETS = {"idle_slot_seconds": 0.0, "median_start_ms": 100.0, "host_cache_speedup": 5.0}


class Api:
    """A session through the frontend's HTTP API, with its event stream read by a
    thread into a queue."""

    def __init__(self, url: str, speculate: bool, cwd: Path):
        self.url = url
        body = {"cwd": str(cwd), "all_gpu": True, "speculate": speculate}
        self.sid = self.call("POST", "/v1/sessions", body)["session_id"]
        self.items: queue.Queue = queue.Queue()
        self.events: list[dict] = []  # every event of the session, in order
        self.stream = urllib.request.urlopen(f"{url}/v1/sessions/{self.sid}/events", timeout=TIMEOUT)
        threading.Thread(target=self._read, daemon=True).start()

    def call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            text = r.read()
        return json.loads(text) if text else None

    def _read(self) -> None:
        try:
            for raw in self.stream:
                line = raw.decode().rstrip("\n")
                if line.startswith("data:"):
                    item = json.loads(line[5:])
                    if item.get("type") == "event":
                        self.events.append(item["event"])
                    self.items.put(item)
        except (OSError, ValueError):
            pass  # the stream closed with the session

    def type_cell(self, cell: str, code: str) -> None:
        """Edits of a growing prefix, every 0.1 s, at TYPING_CPS."""
        tick = 0.1
        per_tick = max(1, round(TYPING_CPS * tick))
        start = time.monotonic()
        for n, end in enumerate(range(per_tick, len(code) + per_tick, per_tick), start=1):
            self.call("PUT", f"/v1/sessions/{self.sid}/cells/{cell}", {"code": code[: min(end, len(code))]})
            time.sleep(max(0.0, start + n * tick - time.monotonic()))

    def run(self, cell: str, code: str) -> dict:
        """Run the cell and wait until it is done: its events by kind, its Run time
        and its status."""
        exec_id = self.call("POST", f"/v1/sessions/{self.sid}/cells/{cell}/run", {"code": code})["exec_id"]
        out: dict = {"events": {}, "text": ""}
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            item = self.items.get(timeout=TIMEOUT)
            if item.get("exec_id") != exec_id:
                continue
            kind = item["type"]
            if kind == "queued":
                out["run_unix_ms"] = item["run_unix_ms"]
            elif kind == "event":
                out["events"][item["event"]["kind"]] = item
            elif kind == "output" and item["output"].get("output_type") == "stream":
                out["text"] += item["output"].get("text", "")
            elif kind == "done":
                if item["status"] != "ok":
                    raise RuntimeError(f"cell {cell} failed: {item.get('error')} {out['text']}")
                return out
        raise TimeoutError(f"cell {cell} did not finish in {TIMEOUT} s")

    def close(self) -> None:
        self.call("DELETE", f"/v1/sessions/{self.sid}")


def start_delay_ms(run: dict) -> float:
    return run["events"]["started"]["unix_ms"] - run["run_unix_ms"]


def setup_code(names: list[str]) -> str:
    lines = ["import numpy as np", "from looseleaf_worker.virtual_gpu import to_virtual_gpu"]
    n = ARRAY_MIB * 2**20 // 4
    for i, name in enumerate(names):
        lines.append(f"{name} = to_virtual_gpu(np.random.default_rng({i}).random({n}, dtype=np.float32))")
    return "\n".join(lines)


def reading_cell(i: int, name: str) -> str:
    # what a cell reading one GPU-resident array looks like; ~70 characters typed
    return f"# cell {i}: the mean of one array\nmean_{i} = float({name}.sum()) / {name}.shape[0]\nprint(mean_{i})"


def staged_cells(url: str, work: Path) -> dict:
    api = Api(url, speculate=True, cwd=work)
    names = [f"a{i}" for i in range(ARRAYS)]
    t0 = time.monotonic()
    api.run("setup", setup_code(names))
    log(f"setup cell ({ARRAYS} x {ARRAY_MIB} MiB on a virtual GPU): {time.monotonic() - t0:.1f} s")
    cells = []
    for i, name in enumerate(names):
        code = reading_cell(i, name)
        api.type_cell(f"c{i}", code)
        r = api.run(f"c{i}", code)
        started = r["events"]["started"]["event"]
        cells.append(
            {
                "cell": i,
                "start_delay_ms": start_delay_ms(r),
                "prepare": started["prepare"],
                "slot": started["slot"],
                "restored_bytes": started["restored_bytes"],
                "restore_ms": started["restore_ms"],
                "phases": started["phases"],
            }
        )
        log(f"cell {i}: start {cells[-1]['start_delay_ms']} ms ({started['prepare']})")
    # every prepared worker has ended once its cell ran, or ends as the session closes
    api.close()
    time.sleep(1.0)
    ended = [e for e in api.events if e["kind"] == "prepared_ended"]
    return {"cells": cells, "prepared_ended": ended}


def drop_page_cache(store: Path) -> int:
    """Drop the store's files from the page cache; the bytes still resident."""
    os.sync()
    files = [p for p in store.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_bytes(files)


def resident_bytes(files: list[Path]) -> int:
    if not files:
        return 0
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    return sum(int(x) for x in out.stdout.split() if x.isdigit())


def host_cache(services: Services, work: Path) -> dict:
    api = Api(services.url, speculate=False, cwd=work)
    api.run("setup", setup_code(["b"]))
    code = "print(float(b.sum()))"
    warm, cold, left = [], [], []
    for n in range(REPS):
        r = api.run(f"warm{n}", code)
        warm.append(r["events"]["started"]["event"]["phases"]["restore_file_ms"])
    for n in range(REPS):
        services.restart_host(f"host-cold-{n}")
        left.append(drop_page_cache(services.work / "store"))
        r = api.run(f"cold{n}", code)
        started = r["events"]["started"]["event"]
        assert started["host"] == f"host-cold-{n}", started["host"]
        cold.append(started["phases"]["restore_file_ms"])
    log(f"restore_file_ms warm {warm}, cold {cold}")
    api.close()
    return {
        "warm_restore_file_ms": warm,
        "cold_restore_file_ms": cold,
        "store_resident_bytes_after_drop": left,
        "restored_bytes": ARRAY_MIB * 2**20,
    }


def main() -> None:
    ensure_release()
    work = scratch("staged")
    services = Services(work, virtual_gpus=2)
    try:
        staged = staged_cells(services.url, work)
        cache = host_cache(services, work)
    finally:
        services.stop()
    cells = staged["cells"]
    idle_slot_ms = sum(e["idle_ms"] for e in staged["prepared_ended"] if e.get("slot") is not None)
    warm = statistics.median(cache["warm_restore_file_ms"])
    cold = statistics.median(cache["cold_restore_file_ms"])
    result = {
        "idle_slot_seconds": idle_slot_ms / 1000.0,
        "median_start_ms": statistics.median(c["start_delay_ms"] for c in cells),
        "host_cache_speedup": cold / warm if warm > 0 else None,
        "targets": TARGETS,
        "copy": "stand-in (host memcpy on a virtual GPU)",
        "session_bytes": ARRAYS * ARRAY_MIB * 2**20,
        "typing_cps": TYPING_CPS,
        "prepared_cells": sum(1 for c in cells if c["prepare"] != "cold"),
        "prepared_workers_ended": len(staged["prepared_ended"]),
        "cells": cells,
        "host_cache": {**cache, "warm_median_ms": warm, "cold_median_ms": cold},
        "run_id": str(uuid.uuid4()),
    }
    path = write_result("staged", result)
    log(f"wrote {path}")
    for key, target in TARGETS.items():
        log(f"{key}: {result[key]} (target {target})")


if __name__ == "__main__":
    main()
