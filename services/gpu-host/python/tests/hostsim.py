"""A tiny fake gpu-host for tests: the host side of the worker protocol.

It listens on Unix sockets, starts a real zygote process, forks real workers,
keeps a content-addressed chunk dict as the "store", merges save deltas into a
manifest with versions (a name keeps its version while its object graph's bytes
do not change), and writes restore files into /dev/shm like the Rust host.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import xxhash
from looseleaf_worker import protocol

PYDIR = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
TIMEOUT = 90
INTERRUPT = object()  # an answer to an input request: the user interrupts instead


class HostError(Exception):
    pass


class Conn:
    """One socket to a zygote or worker; records every message it receives."""

    def __init__(self, sock: socket.socket, log: list):
        self.sock = sock
        self.log = log

    def send(self, msg: dict) -> None:
        protocol.send(self.sock, msg)

    def recv(self) -> dict:
        msg = protocol.recv(self.sock)
        if msg is None:
            raise HostError("peer closed the socket")
        self.log.append(msg)
        return msg

    def expect(self, mtype: str) -> dict:
        msg = self.recv()
        if msg["type"] != mtype:
            raise HostError(f"expected {mtype}, got {msg}")
        return msg


class Zygote:
    def __init__(self, host: HostSim, zid: str, packages: list[str], env: dict | None):
        self.host = host
        self.id = zid
        lsock = host.listener(f"z-{zid}")
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join([str(PYDIR), str(TESTS / "fakepkgs")])
        full_env.update(env or {})
        self.stderr = open(Path(host.dir) / f"zygote-{zid}.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "looseleaf_worker.zygote",
                "--socket",
                lsock.getsockname(),
                "--id",
                zid,
                "--packages",
                ",".join(packages),
            ],
            cwd=str(PYDIR),
            env=full_env,
            stdout=self.stderr,
            stderr=self.stderr,
        )
        try:
            s, _ = lsock.accept()
        except TimeoutError:
            raise HostError(f"zygote did not connect; log: {self.log_text()}") from None
        finally:
            lsock.close()
        s.settimeout(TIMEOUT)
        self.conn = Conn(s, host.received)
        self.hello = self.conn.expect("hello")

    def log_text(self) -> str:
        self.stderr.flush()
        return (Path(self.host.dir) / f"zygote-{self.id}.log").read_text(errors="replace")

    def fork(self, env: dict | None = None, cwd: str | None = None) -> Worker:
        wid = f"w{next(self.host.seq)}"
        lsock = self.host.listener(wid)
        self.conn.send(
            {
                "type": "fork",
                "worker_id": wid,
                "env": env or {},
                "cwd": cwd or self.host.dir,
                "socket": lsock.getsockname(),
            }
        )
        forked = self.conn.recv()
        if forked["type"] != "forked":
            raise HostError(f"fork failed: {forked}")
        try:
            s, _ = lsock.accept()
        except TimeoutError:
            raise HostError(f"worker did not connect; log: {self.log_text()}") from None
        finally:
            lsock.close()
        s.settimeout(TIMEOUT)
        w = Worker(self.host, wid, Conn(s, self.host.received), forked["pid"])
        w.hello = w.conn.expect("hello")
        self.host.workers.append(w)
        return w

    def close(self) -> None:
        try:
            self.conn.send({"type": "shutdown"})
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.sock.close()
        self.stderr.close()


class Worker:
    def __init__(self, host: HostSim, wid: str, conn: Conn, pid: int):
        self.host, self.id, self.conn, self.pid = host, wid, conn, pid
        self.hello: dict = {}
        self.last_exec: str | None = None  # the last run's: the host saves under it

    def run(
        self,
        code: str,
        interrupt_after: float | None = None,
        answers: list | None = None,
        user_expressions: dict | None = None,
    ) -> dict:
        """Run a cell; with ``interrupt_after``, SIGINT the worker's process group
        that many seconds after it started (as the Rust host interrupts).
        ``answers`` answer the cell's input requests in turn: a string is what the
        user typed, ``INTERRUPT`` interrupts the cell while it waits; with none
        left, the request is refused as for a client without a stdin channel."""
        answers = list(answers or [])
        exec_id = self.last_exec = uuid.uuid4().hex
        run = {"type": "run", "exec_id": exec_id, "cell_id": "c", "code": code}
        if user_expressions:
            run["user_expressions"] = user_expressions
        self.conn.send(run)
        started = self.conn.expect("started")
        if interrupt_after is not None:
            threading.Timer(interrupt_after, os.killpg, (os.getpgid(self.pid), signal.SIGINT)).start()
        messages, faults, files, sent, inputs = [], [], [], set(), []
        while True:
            msg = self.conn.recv()
            if msg["type"] == "cell_message":
                assert msg["exec_id"] == exec_id, msg
                messages.append(msg["message"])
            elif msg["type"] == "fault":
                # as the Rust host: those of the names the committed state has
                faults.append(msg["names"])
                reply = self.host.restore_msg([n for n in msg["names"] if n in self.host.manifest], False, skip=sent)
                sent.update(reply["objects"])
                if os.path.getsize(reply["shm_path"]) == 0:
                    os.unlink(reply["shm_path"])
                    reply["shm_path"] = None
                else:
                    files.append(reply["shm_path"])
                self.conn.send(
                    {
                        "type": "faulted",
                        "shm_path": reply["shm_path"],
                        "variables": reply["variables"],
                        "objects": reply["objects"],
                    }
                )
            elif msg["type"] == "input_request":
                inputs.append(msg)
                reply = {"type": "input_reply", "exec_id": exec_id, "value": "", "interrupted": False}
                if not answers:
                    reply["refused"] = "this frontend does not support input requests."
                elif answers[0] is INTERRUPT:
                    answers.pop(0)
                    os.killpg(os.getpgid(self.pid), signal.SIGINT)  # as the Rust host: signal, then answer
                    reply["interrupted"] = True
                else:
                    reply["value"] = answers.pop(0)
                self.conn.send(reply)
            elif msg["type"] == "finished":
                for f in files:
                    os.unlink(f)
                return {
                    "started": started,
                    "messages": messages,  # every CellMessage, in order
                    "outputs": [m["output"] for m in messages if "output" in m],  # the notebook outputs
                    "finished": msg,
                    "exec_id": exec_id,
                    "faults": faults,
                    "inputs": inputs,
                }
            else:
                raise HostError(f"unexpected during run: {msg}")

    def query(self, kind: str, code: str, cursor_pos: int | None = None, detail_level: int = 0) -> dict:
        """Complete or inspect ``code`` (at its end unless ``cursor_pos``) between cells."""
        pos = len(code) if cursor_pos is None else cursor_pos
        msg = {"type": "query", "kind": kind, "code": code, "cursor_pos": pos, "detail_level": detail_level}
        self.conn.send(msg)
        return self.conn.expect("query_answer")["content"]

    def comm(self, msg_type: str, content: dict, metadata: dict | None = None, buffers: list | None = None) -> dict:
        """A client's comm message between cells; the worker's answer."""
        msg = {"type": "comm", "msg_type": msg_type, "content": content, "metadata": metadata or {}}
        msg["buffers"] = buffers or []
        self.conn.send(msg)
        return self.conn.expect("comm_answer")

    def save(self) -> dict:
        # as the Rust host: a run's save goes under its exec id (the worker may
        # have built it already)
        exec_id = self.last_exec or uuid.uuid4().hex
        self.last_exec = None
        self.conn.send({"type": "save", "exec_id": exec_id})
        plan = self.conn.expect("save_plan")
        missing = [h for h in dict.fromkeys(plan["chunks"]) if h not in self.host.store]
        self.conn.send({"type": "save_missing", "exec_id": exec_id, "missing": missing})
        parts = []
        while (msg := self.conn.recv())["type"] == "save_part":
            self.host.take_chunks(msg)
            parts.append(msg)
        if msg["type"] != "save_ready":
            raise HostError(f"unexpected during save: {msg}")
        ready = msg
        committed = self.host.commit(exec_id, ready)
        self.conn.send(committed)
        return {"plan": plan, "missing": missing, "parts": parts, "ready": ready, "committed": committed}

    def restore(
        self,
        names: list[str],
        drop: list[str] | None = None,
        imports: list[str] | None = None,
        ambient: bool = True,
        env: dict[str, str] | None = None,
        held: list[str] | None = None,
    ) -> dict:
        # as the Rust host: records reachable from names the worker holds at their
        # current version are not sent again
        skip = set(self.host.closure(held)) if held else None
        msg = self.host.restore_msg(names, ambient, skip=skip)
        msg["drop"] = drop or []
        msg["imports"] = imports or []
        msg["env"] = env or {}
        self.conn.send(msg)
        try:
            return self.conn.expect("restored")
        finally:
            if msg["shm_path"]:
                os.unlink(msg["shm_path"])

    def close(self) -> None:
        try:
            self.conn.send({"type": "shutdown"})
        except OSError:
            pass
        self.conn.sock.close()


class HostSim:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="llh", dir="/tmp")  # short: sun_path limit
        self.seq = itertools.count(1)
        self.received: list[dict] = []
        self.store: dict[str, bytes] = {}
        self.objects: dict[str, dict] = {}
        self.manifest: dict[str, dict] = {}  # name -> {oid, module, version, sig}
        self.unsavable: dict[str, str] = {}
        self.ambient: dict | None = None
        self.revision = 0
        self.workers: list[Worker] = []
        self.zygotes: list[Zygote] = []

    def listener(self, name: str) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.path.join(self.dir, name + ".sock"))
        s.listen(1)
        s.settimeout(TIMEOUT)
        return s

    def zygote(self, packages: list[str], env: dict | None = None) -> Zygote:
        z = Zygote(self, f"z{next(self.seq)}", packages, env)
        self.zygotes.append(z)
        return z

    # ---------------------------------------------------------------- store
    def blob(self, b: dict) -> bytes:
        data = b"".join(self.store[h] for h in b["chunks"])
        assert len(data) == b["len"], "blob length does not match its chunks"
        return data

    def _sig(self, oid: str, seen: set) -> str:
        """The content of everything reachable from ``oid`` (iterative: a figure's
        reference cycle is thousands of records deep)."""
        parts, stack = [], [oid]
        while stack:
            o_id = stack.pop()
            if o_id in seen:
                continue
            seen.add(o_id)
            o = self.objects[o_id]
            parts.append(
                o_id
                + ":"
                + ",".join(o["record"]["chunks"])
                + ";"
                + ";".join(",".join(p["chunks"]) for p in o["payloads"])
            )
            stack.extend(o["refs"])
        return xxhash.xxh3_128_hexdigest("|".join(sorted(parts)).encode())

    def take_chunks(self, msg: dict) -> None:
        """Store the chunks of a save_part or save_ready file, verified, and delete it."""
        if not msg["shm_path"]:
            return
        with open(msg["shm_path"], "rb") as f:
            data = f.read()
        for h, (off, n) in msg["chunks"].items():
            piece = data[off : off + n]
            if xxhash.xxh3_128_hexdigest(piece) != h:
                raise HostError(f"chunk {h} does not match its hash")
            self.store[h] = piece
        os.unlink(msg["shm_path"])

    def commit(self, exec_id: str, ready: dict) -> dict:
        self.take_chunks(ready)
        delta = ready["delta"]
        for oid, o in delta["objects"].items():
            for h in o["record"]["chunks"] + [c for p in o["payloads"] for c in p["chunks"]]:
                if h not in self.store:
                    raise HostError(f"delta names chunk {h} the store lacks")
            self.objects[oid] = o
        self.revision += 1
        versions = {}
        for name, var in delta["variables"].items():
            sig = var["module"] if var["oid"] is None else "oid:" + var["oid"] + self._sig(var["oid"], set())
            old = self.manifest.get(name)
            version = old["version"] if old and old["sig"] == sig else f"v{self.revision}"
            self.manifest[name] = {"oid": var["oid"], "module": var["module"], "version": version, "sig": sig}
            versions[name] = version
        for name in delta["deleted"]:
            self.manifest.pop(name, None)
        # a save through one alias changes every name bound to that oid
        for name, m in self.manifest.items():
            if m["oid"] and name not in delta["variables"] and m["oid"] in self.objects:
                sig = "oid:" + m["oid"] + self._sig(m["oid"], set())
                if sig != m["sig"]:
                    m["sig"], m["version"] = sig, f"v{self.revision}"
        self.unsavable.update(delta["unsavable"])
        if delta["ambient"] is not None:
            self.ambient = delta["ambient"]
        return {"type": "committed", "exec_id": exec_id, "ok": True, "revision": self.revision, "versions": versions}

    def closure(self, names: list[str]) -> list[str]:
        todo = [self.manifest[n]["oid"] for n in names if self.manifest[n]["oid"]]
        out: list[str] = []
        while todo:
            oid = todo.pop()
            if oid in out:
                continue
            out.append(oid)
            todo.extend(self.objects[oid]["refs"])
        return out

    def restore_msg(self, names: list[str], ambient: bool, skip: set | None = None) -> dict:
        path = f"/dev/shm/looseleaf-restore-test-{uuid.uuid4().hex}"
        objects, off = {}, 0
        with open(path, "wb") as f:

            def put(data: bytes):
                nonlocal off
                f.write(data)
                region = [off, len(data)]
                off += len(data)
                return region

            for oid in self.closure(names):
                if skip and oid in skip:
                    continue  # the worker holds it (a fault during the same run)
                o = self.objects[oid]
                objects[oid] = {
                    "record": put(self.blob(o["record"])),
                    "payloads": [put(self.blob(p)) for p in o["payloads"]],
                }
            amb = put(self.blob(self.ambient)) if ambient and self.ambient else None
        variables = {n: {k: self.manifest[n][k] for k in ("oid", "version", "module")} for n in names}
        return {"type": "restore", "shm_path": path, "variables": variables, "objects": objects, "ambient": amb}

    def close(self) -> None:
        for w in self.workers:
            w.close()
        for z in self.zygotes:
            z.close()
        shutil.rmtree(self.dir, ignore_errors=True)
