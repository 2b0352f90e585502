"""The worker: serves restore/run/save/committed/query/comm/shutdown over one socket.

A worker is forked from a zygote (or started directly in tests) and may serve
several cells. It tracks the version of every name it holds, so that the host
can tell it which names are stale (``restore.drop``) and so that a save lists
what it holds and what it deleted.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import os
import platform
import socket
import sys
import threading
import time
import traceback
import uuid

from IPython.core.completer import provisionalcompleter, rectify_completions
from IPython.utils.tokenutil import token_at_cursor

from . import ambient, checkpoint, comms, faults, lru, packages, protocol, quiet, staging
from .interrupt import CellInterrupts
from .localmods import LocalModules
from .routing import OutputRouting
from .shell import WorkerShell, jsonable


def _cuda_used() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def _fresh_entropy() -> None:
    """A new kernel seeds its generators from the OS. Every fork of one zygote
    would share the zygote's numpy and torch states (Python's random reseeds
    itself at fork); a session's first cell must not print another session's
    "random" numbers. Later cells get the session's states from ambient state."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.random.default_generator.seed()  # the CPU generator: CUDA stays untouched


def _stdin_not_implemented(why: str) -> BaseException:
    from IPython.core.error import StdinNotImplementedError

    return StdinNotImplementedError(why)


# How many bytes of chunks go in one save file before it is handed to the host.
SAVE_PART_BYTES = 64 << 20


class Worker(OutputRouting):
    def __init__(self):
        """What every worker sets up before it knows its session: a spare does
        this while it waits to be handed out (~2 ms off each cold start), so
        nothing here may depend on the session, its slot or its uid (``attach``)."""
        self.sock: socket.socket | None = None
        self.id = "?"
        self.exec_id: str | None = None
        self.versions: dict[str, str] = {}  # names held -> store version
        self.oid_of: dict[int, tuple] = {}  # id(obj) -> (oid, obj), kept alive
        self.save_seq = 0
        # the save of the cell that just finished, built before the host asks
        # (exec_id, names, result, ms it took); any other message drops it
        self._presaved: tuple[str, list[str], checkpoint.SaveResult, float] | None = None
        # made by the zygote before the fork when there is one (it costs ~15 ms)
        self.shell = WorkerShell.instance(emit=self._emit_message)
        self.shell.bind(self._emit_message)
        # As ipykernel does: the working directory is first on the path, so
        # modules beside the notebook import (zygotes leave it off).
        if "" not in sys.path:
            sys.path.insert(0, "")
        _fresh_entropy()
        # As ipykernel: input() and getpass() ask the run's client for a line
        builtins.input = self.input
        getpass.getpass = self.getpass
        lru.install()  # memoised notebook functions keep their caches across cells
        # after the shell: its own env/warnings setup is not a cell's doing
        self.base = ambient.Baseline(self.shell)
        self.local = LocalModules(self.base.path)
        self.local.install()
        self.faulted: list[str] = []  # names brought in while the cell runs
        self._not_in_session: set[str] = set()
        faults.install(self.shell.user_ns, self.fault_in)
        self.interrupts = CellInterrupts()
        self.interrupts.install()
        self._setup_routing()
        self._rehearse_restore()

    def _rehearse_restore(self) -> None:
        """Apply this worker's own ambient state to itself: a no-op, run before
        the worker is handed out, that pays the restore path's first-use costs
        (pages first written after the fork, lazily built objects) off the cold
        start's path."""
        try:
            st = ambient.loads(ambient.dumps(self.shell, self.base))
            ambient.apply(self.shell, st, self.base)
        except Exception as e:  # noqa: BLE001 - a rehearsal: the real restore reports
            quiet.log(f"looseleaf worker: restore rehearsal failed: {type(e).__name__}: {e}")

    def attach(self, sock: socket.socket, worker_id: str) -> None:
        """Become the worker the host asked for, its parameters applied (env,
        cwd, uid): talk on ``sock``, install into the session's package layer."""
        self.sock, self.id = sock, worker_id
        before = list(sys.path)
        packages.activate(os.environ.get("LOOSELEAF_PACKAGE_LAYER"))
        # the handed parameters and the layer are the baseline, not a cell's doing
        self.base.note_env()
        self.local.add_library([p for p in sys.path if p not in before])

    # ------------------------------------------------------------- transport
    def send(self, msg: dict) -> None:
        with self._send_lock:  # threads send outputs too: one frame at a time
            protocol.send(self.sock, msg)

    def expect(self, mtype: str) -> dict:
        msg = protocol.recv(self.sock)
        if msg is None:
            raise EOFError("host closed the socket")
        if msg["type"] != mtype:
            raise protocol.ProtocolError(f"expected {mtype}, got {msg['type']}")
        return msg

    # ------------------------------------------------------------- main loop
    def serve(self) -> None:
        handlers = {
            "restore": self.on_restore,
            "run": self.on_run,
            "save": self.on_save,
            "committed": self.on_committed,
            "query": self.on_query,
            "comm": self.on_comm,
        }
        while True:
            try:
                msg = protocol.recv(self.sock)
            except protocol.ProtocolError as e:
                self.send({"type": "error", "message": f"bad frame: {e}"})
                return  # the stream is out of step; the host restarts us
            if msg is None or msg["type"] == "shutdown":
                return
            if msg["type"] != "save":
                # a query or comm may run code that changes what a save holds
                self._presaved = None
            handler = handlers.get(msg["type"])
            try:
                if handler is None:
                    raise protocol.ProtocolError(f"a worker does not handle {msg['type']}")
                handler(msg)
            except (EOFError, BrokenPipeError, ConnectionError):
                return
            except BaseException as e:  # noqa: BLE001 - keep serving
                self._end()
                self.send(
                    {
                        "type": "error",
                        "message": f"{msg['type']}: {type(e).__name__}: {e}\n" + traceback.format_exc(limit=8),
                    }
                )

    def user_names(self) -> list[str]:
        ns, hidden = self.shell.user_ns, self.shell.user_ns_hidden
        return sorted(n for n, v in list(ns.items()) if checkpoint.is_user_name(n, v, hidden))

    # ------------------------------------------------------------- handlers
    def on_restore(self, msg: dict) -> None:
        t0 = time.perf_counter()
        # The devices of the worker's GPU slot, which a worker prepared before Run
        # gets at Run. CUDA is untouched until the cell runs (zygotes are
        # CUDA-clean), so the device list still takes effect; the baseline follows,
        # so the slot never becomes part of the session's ambient state.
        os.environ.update(msg["env"])
        self.base.adopt_env(msg["env"])
        ns = self.shell.user_ns
        for name in msg["drop"]:
            ns.pop(name, None)
            self.versions.pop(name, None)
        errors: dict[str, str] = {}
        nbytes = 0
        st = None
        if msg["ambient"] is not None and msg["shm_path"]:
            off, n = msg["ambient"]
            with open(msg["shm_path"], "rb") as f:
                f.seek(off)
                blob = f.read(n)
            nbytes += n
            try:
                st = ambient.loads(blob)
                # imports may need the working directory and the session's modules
                ambient.apply_paths(st)
            except BaseException as e:  # noqa: BLE001
                errors["ambient"] = f"{type(e).__name__}: {e}"
        with quiet.own_warnings():
            t_imports = time.perf_counter()
            self.local.unshadow(msg["imports"])
            for mod in msg["imports"]:
                try:
                    __import__(mod)
                except BaseException as e:  # noqa: BLE001
                    errors[f"import {mod}"] = f"{type(e).__name__}: {e}"
            imports_ms = (time.perf_counter() - t_imports) * 1000
            n, errs = checkpoint.restore(ns, msg["shm_path"], msg["variables"], msg["objects"], self.oid_of)
        nbytes += n
        errors.update(errs)
        for name, spec in msg["variables"].items():
            if name not in errs:
                self.versions[name] = spec["version"]
        if st is not None:
            try:
                ambient.apply(self.shell, st, self.base)
            except BaseException as e:  # noqa: BLE001
                errors["ambient"] = f"{type(e).__name__}: {e}"
        staged_in_bytes, stage_in_ms = self._stage_in(errors)
        self._sync_displayhook()
        self.shell.flush_streams()  # whatever the restore printed goes to the log
        self.send(
            {
                "type": "restored",
                "ok": not errors,
                "restored_bytes": nbytes,
                "ms": (time.perf_counter() - t0) * 1000,
                "imports_ms": imports_ms,
                "stage_in_ms": stage_in_ms,
                "staged_in_bytes": staged_in_bytes,
                "errors": errors,
            }
        )

    @staticmethod
    def _stage_in(errors: dict[str, str]) -> tuple[int, float]:
        """The restore at Run on a worker prepared without a slot: its staged
        GPU-resident tensors go to the slot's devices now (ADR 70; on virtual
        slots, a stand-in copy: ADR 72)."""
        if not (staging.devices_visible() and staging.pending()):
            return 0, 0.0
        try:
            return staging.stage_in()
        except BaseException as e:  # noqa: BLE001 (the run fails, naming it)
            errors["stage_in"] = f"{type(e).__name__}: {e}"
            return 0, 0.0

    def _sync_displayhook(self) -> None:
        # The displayhook keeps its own copies of _, __, ___ and rotates them: they
        # are the names restored, and the session's others are faulted in when a
        # result rotates them (a cell's closure brings only the names it reads).
        def fault_in(name: str) -> bool:
            # not the cell's own reads: kept out of the names its next run restores
            n = len(self.faulted)
            found = self.fault_in(name)
            del self.faulted[n:]
            return found

        self.shell.sync_output_history(fault_in, set(self.versions))

    def fault_in(self, name: str) -> bool:
        """A name the running cell (or a thread, while a cell runs) reached that
        this worker lacks (its closure missed it): ask the host for it from the
        session's committed state."""
        if self.exec_id is None or self._parent != self.exec_id or name in self._not_in_session:
            return False
        main = threading.current_thread() is threading.main_thread()
        if main:
            self.shell.flush_streams()
        # the exchange and the bookkeeping of what arrived must not be cut short
        with self.interrupts.shield() if main else contextlib.nullcontext(), self._exchange:
            if self.exec_id is None or self._parent != self.exec_id:
                return False  # the cell ended meanwhile: the host asks no more
            self.send({"type": "fault", "exec_id": self.exec_id, "names": [name]})
            msg = self.expect("faulted")
            with quiet.own_warnings():
                _, errs = checkpoint.restore(
                    self.shell.user_ns, msg["shm_path"], msg["variables"], msg["objects"], self.oid_of
                )
            for n, spec in msg["variables"].items():
                if n not in errs:
                    self.versions[n] = spec["version"]
                    self.faulted.append(n)
        if name not in self.shell.user_ns:
            self._not_in_session.add(name)  # not the session's: a NameError, asked once
            return False
        return True

    def input(self, prompt: object = "") -> str:
        """``input()`` in a cell: the run's client is asked for a line (the
        frontend refuses for a client without a stdin channel, as ipykernel does)."""
        return self._ask_client(str(prompt), password=False, what="raw_input")

    def getpass(self, prompt: str = "Password: ", stream: object = None) -> str:
        """``getpass.getpass()`` in a cell: as ``input()``, not echoed."""
        return self._ask_client(str(prompt), password=True, what="getpass")

    def _ask_client(self, prompt: str, password: bool, what: str) -> str:
        if self.exec_id is None:
            raise _stdin_not_implemented(f"{what} was called outside a cell; no one can answer it.")
        self.shell.flush_streams()  # what the cell printed before it asked comes first
        # the exchange is shielded: an interrupt meanwhile is answered by the host
        # (the reply says so) and raised when the exchange is complete
        with self.interrupts.shield(), self._exchange:
            self.send({"type": "input_request", "exec_id": self.exec_id, "prompt": prompt, "password": password})
            reply = self.expect("input_reply")
            if reply.get("interrupted"):
                self.interrupts.pending = True
        if reply.get("refused") is not None:
            raise _stdin_not_implemented(f"{what} was called, but {reply['refused']}")
        return reply["value"]

    def on_comm(self, msg: dict) -> None:
        """A client's comm message (a widget's value changed in the browser),
        handled as ipykernel's shell handles it; what it causes is the answer
        (after the comm messages made since the last request)."""
        self._begin(f"comm-{uuid.uuid4().hex}", collect=True)
        try:
            reply = comms.handle(msg["msg_type"], msg["content"], msg["metadata"], msg["buffers"])
            self.shell.flush_streams()
        finally:
            messages = self._end()
        self.send({"type": "comm_answer", "reply": reply, "messages": messages})

    def on_query(self, msg: dict) -> None:
        """Complete or inspect code against this worker's live objects, as
        ipykernel answers complete_request and inspect_request."""
        code, pos = msg["code"], max(0, min(msg["cursor_pos"], len(msg["code"])))
        if msg["kind"] == "complete":
            # IPython's completer (jedi on the live namespace), as ipykernel uses it
            with provisionalcompleter():
                found = list(rectify_completions(code, self.shell.Completer.completions(code, pos)))
            start, end = (found[0].start, found[0].end) if found else (pos, pos)
            types = [
                {"start": c.start, "end": c.end, "text": c.text, "type": c.type, "signature": c.signature}
                for c in found
            ]
            content = {
                "status": "ok",
                "matches": [c.text for c in found],
                "cursor_start": start,
                "cursor_end": end,
                "metadata": {"_jupyter_types_experimental": types},
            }
        else:
            name = token_at_cursor(code, pos)
            content = {"status": "ok", "found": False, "data": {}, "metadata": {}}
            try:
                content["data"] = self.shell.object_inspect_mime(name, detail_level=msg["detail_level"])
                content["data"].pop("text/html", None)  # as ipykernel without the HTML pager
                content["found"] = True
            except KeyError:
                pass
        self.send({"type": "query_answer", "content": content})

    def on_run(self, msg: dict) -> None:
        with self.interrupts.run():
            self._run(msg)

    def _run(self, msg: dict) -> None:
        self.faulted, self._not_in_session = [], set()
        # text a thread left unflushed between cells is not this cell's: the log
        self.shell.flush_streams()
        self.exec_id = msg["exec_id"]
        count = self.shell.execution_count
        self.send(
            {
                "type": "started",
                "exec_id": self.exec_id,
                "unix_ms": int(time.time() * 1000),
                "execution_count": count,
                "python": platform.python_version(),
            }
        )
        self._begin(self.exec_id, collect=False)
        t0 = time.perf_counter()
        try:
            with self.interrupts.cell():
                _, err = self.shell.run(msg["code"])
                if not err and msg.get("user_expressions"):
                    # as ipykernel: after a cell that succeeded, in its namespace
                    # (a name the closure missed is brought in, as for eval)
                    results = self._user_expressions(msg["user_expressions"])
                    self._emit_message({"user_expressions": {"data": jsonable(results)}})
        except KeyboardInterrupt:
            # interrupted before the cell's code started, or in IPython's own code
            # around it: shown as a kernel shows any interrupt
            self.shell.last_error = None
            self.shell.showtraceback()
            err = self.shell.last_error or {"ename": "KeyboardInterrupt", "evalue": "", "traceback": []}
        finally:
            run_ms = (time.perf_counter() - t0) * 1000
            exec_id = self.exec_id
            self._end()  # a thread's output after this is no output of this cell
        fin = {
            "type": "finished",
            "exec_id": exec_id,
            "status": "error" if err else "ok",
            "execution_count": count,
            "run_ms": run_ms,
            "cuda_used": _cuda_used(),
        }
        if err:
            fin["error"] = err
        if self.faulted:
            fin["faulted"] = self.faulted
        self.send(fin)
        # the host asks for the save at once: build it while the host handles
        # `finished`, off the cell's path to Done
        self._presaved = None
        try:
            self._presaved = (exec_id, *self._build_save())
        except BaseException:  # noqa: BLE001 - built again when asked, and reported then
            self._presaved = None

    def _user_expressions(self, asked: dict[str, str]) -> dict[str, dict]:
        """IPython's ``user_expressions``, with a name the cell's closure missed
        brought in from the session (IPython's own eval would not ask)."""
        shell, out = self.shell, {}
        for key, expr in asked.items():
            try:
                value = shell._format_user_obj(faults.evaluate(expr, shell.user_ns, self.fault_in))
            except BaseException:  # noqa: BLE001 - as IPython: the expression's error is its result
                value = shell._user_obj_error()
            out[key] = value
        return out

    def _build_save(self) -> tuple[list[str], checkpoint.SaveResult, float]:
        """The user's names, and the delta and chunks saving them makes, with the
        milliseconds it took."""
        t0 = time.perf_counter()
        names = self.user_names()
        blob = ambient.dumps(self.shell, self.base)  # reads the user's warning filters
        with quiet.own_warnings():
            res = checkpoint.build_delta(self.shell.user_ns, names, self.oid_of, set(self.versions), blob)
        self.shell.flush_streams()  # a __reduce__ that printed: the log
        return names, res, (time.perf_counter() - t0) * 1000

    def on_save(self, msg: dict) -> None:
        t0 = time.perf_counter()
        exec_id = msg["exec_id"]
        presaved, self._presaved = self._presaved, None
        if presaved is not None and presaved[0] == exec_id:
            _, names, res, built_ms = presaved
        else:
            names, res, built_ms = self._build_save()
        t0 -= built_ms / 1000  # save_ms counts building it, wherever it happened
        # the delta too: the store refuses a save over the session's quota before any upload
        self.send({"type": "save_plan", "exec_id": exec_id, "chunks": list(res.chunks), "delta": res.delta})
        missing = self.expect("save_missing")["missing"]
        path, regions = self._place_chunks(exec_id, res.chunks, missing)
        self.send(
            {
                "type": "save_ready",
                "exec_id": exec_id,
                "shm_path": path,
                "chunks": regions,
                "delta": res.delta,
                "save_ms": (time.perf_counter() - t0) * 1000,
            }
        )
        com = self.expect("committed")
        self.oid_of = res.oid_objects
        # names that could not be saved stay held (this worker has them)
        self._apply_commit(com, set(names))

    def _place_chunks(self, exec_id: str, chunks: dict, missing: list[str]) -> tuple[str | None, dict]:
        """Copy the missing chunks into shared-memory files for the host. Every
        SAVE_PART_BYTES a file is closed and handed over in a save_part, so the host
        uploads it while the next is written; the last file goes with save_ready.
        Returns (that last file or None, its regions)."""
        path, fd, regions, off = None, -1, {}, 0
        try:
            for h in dict.fromkeys(missing):
                piece = chunks.get(h)
                if piece is None:
                    raise protocol.ProtocolError(f"host asked for unknown chunk {h}")
                if fd < 0:
                    self.save_seq += 1
                    path = f"/dev/shm/looseleaf-save-{self.id}-{os.getpid()}-{self.save_seq}"
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view) :]
                regions[h] = [off, len(piece)]
                off += len(piece)
                if off >= SAVE_PART_BYTES:
                    os.close(fd)
                    fd = -1
                    self.send({"type": "save_part", "exec_id": exec_id, "shm_path": path, "chunks": regions})
                    path, regions, off = None, {}, 0
        except BaseException:
            # a file not yet handed over is ours to remove: a full /dev/shm must not
            # stay full because a save failed
            if path is not None:
                os.unlink(path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        return path, regions

    def on_committed(self, msg: dict) -> None:
        self._apply_commit(msg, None)

    def _apply_commit(self, msg: dict, names: set[str] | None) -> None:
        if not msg["ok"]:
            return
        if names is not None:
            self.versions = {n: v for n, v in self.versions.items() if n in names}
        self.versions.update(msg["versions"])


def main(sock: socket.socket, worker_id: str, zygote_id: str | None = None, ready: Worker | None = None) -> None:
    """Say hello on ``sock`` and serve; ``ready``: the worker a spare set up
    before it was handed out."""
    hello = {"type": "hello", "role": "worker", "id": worker_id, "pid": os.getpid()}
    if zygote_id is not None:
        hello["zygote_id"] = zygote_id
    protocol.send(sock, hello)
    worker = ready if ready is not None else Worker()
    worker.attach(sock, worker_id)
    worker.serve()


if __name__ == "__main__":  # direct start: python -m looseleaf_worker.worker SOCK ID
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    main(s, sys.argv[2])
