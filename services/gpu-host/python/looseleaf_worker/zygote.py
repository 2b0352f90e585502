"""A zygote: a process that has imported packages once and forks workers.

    python -m looseleaf_worker.zygote --socket HOST_SOCK --id ZID --packages numpy,pandas

CUDA must never be initialised in a zygote (a forked child cannot use a CUDA
context it inherited). After each import a probe checks that; a package that
breaks it is recorded as cuda_unsafe and the zygote re-executes itself (same
pid, fresh interpreter) without that package, so the host sees one process and
one hello that lists the unsafe package. Clean packages pay for one import
only; the rare unsafe one costs a restart.

The zygote never creates threads (fork safety) and ignores SIGCHLD so that the
kernel reaps its children.

Nothing outlives the host's process. The host starts a zygote with a
parent-death signal, and gives it its lifeline as stdin: the read end of a pipe
whose write end only the host's process holds, so that it reads EOF once that
process is gone, however it ended. Every process a zygote forks inherits it. A
worker watches it from a thread and then kills its process group (its cell and
what the cell started); a child zygote serves the host's connection and leaves
when that closes. A worker cannot simply die with its parent: its parent is a
zygote, which may go before it (an evicted child zygote), and a parent-death
signal is cleared when a worker drops to a session uid.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import time

from . import protocol

# Spares each zygote keeps waiting. Two, so that cells run back to back (a
# notebook run top to bottom) find one ready while the next is still being made.
SPARES = 2
# The next spare is forked this long after a fork is served, unless another fork
# request comes first. Forking copies the zygote's page tables (~5-10 ms of CPU);
# done at once, it competes for the CPU with the worker just handed out, whose
# cell is starting (its restore and first line land within ~10 ms).
SPARE_AFTER_S = 0.01
# Write ends of the waiting spares' pipes: a child closes them (see _fork).
_spare_pipes: set[int] = set()
# Names the fd of the host's lifeline (the host passes 0, its stdin); read once
# at start and removed from the environment, so workers and cells never see it.
LIFELINE_ENV = "LOOSELEAF_HOST_LIFELINE"
# The host's lifeline (see the module's doc), once adopted; None: started by
# something other than a host (the tests' simulated one): nothing to watch.
_lifeline: int | None = None


def _adopt_lifeline() -> None:
    """Take the host's lifeline from the fd ``LOOSELEAF_HOST_LIFELINE`` names, on
    an fd of its own that programs a cell runs do not inherit. When it was stdin,
    stdin becomes /dev/null again: a cell (or a program it runs) that reads stdin
    must see its end, not wait on the host."""
    global _lifeline
    value = os.environ.pop(LIFELINE_ENV, None)
    if value is None:
        return
    try:
        fd = int(value)
        if fd == 0:
            _lifeline = os.dup(0)  # not inheritable, as every fd Python makes
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
        else:  # given again across _reexec_without
            os.set_inheritable(fd, False)
            _lifeline = fd
    except (ValueError, OSError) as e:
        _log(f"no lifeline from the host ({LIFELINE_ENV}={value!r}): {e}")


def _host_gone() -> bool:
    """Whether the host's process has exited (its lifeline reads EOF; nobody ever
    writes to it, so readable means closed)."""
    if _lifeline is None:
        return False
    try:
        ready, _, _ = select.select([_lifeline], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(ready)


def _die_with_host() -> None:
    """In a spare or worker: a thread that kills this process's group (the worker
    leads it: the cell and the programs it started) once the host's process is
    gone, though a cell runs and nothing reads the host's socket."""
    if _lifeline is None:
        return
    fd = _lifeline

    def watch() -> None:
        try:
            while os.read(fd, 64):
                pass  # nobody writes to it: only its end comes
        except OSError as e:
            # a cell closed it: this worker no longer notices the host going
            _log(f"stopped watching the host: {e}")
            return
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os._exit(1)

    # the thread takes no signal (it keeps the mask it starts with): every one
    # goes to the cell's thread, as an interrupt must, to wake a sleep
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=watch, name="looseleaf-host-lifeline", daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def default_probe() -> bool:
    """True when this process has touched CUDA."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return True
        except Exception:  # noqa: BLE001
            pass
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                    return True
            except OSError:
                continue
    except OSError:
        pass
    return False


def load_probe():
    spec = os.environ.get("LOOSELEAF_CUDA_PROBE")
    if not spec:
        return default_probe
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _output_before_fork(message: dict) -> None:
    output = message.get("output")
    _log(f"output before any worker: {(output.get('text') or output) if output is not None else message}")


def _log(msg: str) -> None:
    os.write(2, f"looseleaf zygote: {msg}\n".encode())


def import_packages(packages: list[str], probe) -> tuple[list[str], float, dict[str, str], str | None]:
    """Import in order; returns (imported, total ms, errors, first cuda-unsafe)."""
    imported, errors, total = [], {}, 0.0
    for pkg in packages:
        t0 = time.perf_counter()
        try:
            importlib.import_module(pkg)
        except BaseException as e:  # noqa: BLE001 - skip and report
            errors[pkg] = f"{type(e).__name__}: {e}"
            _log(f"skipping {pkg}: {errors[pkg]}")
            continue
        total += (time.perf_counter() - t0) * 1000
        if probe():
            return imported, total, errors, pkg
        imported.append(pkg)
    return imported, total, errors, None


def _reexec_without(args, unsafe: str) -> None:
    _log(f"package {unsafe!r} initialises CUDA; restarting without it")
    argv = [
        sys.executable,
        "-m",
        "looseleaf_worker.zygote",
        "--socket",
        args.socket,
        "--id",
        args.id,
        "--packages",
        ",".join(p for p in args.packages if p != unsafe),
        "--cuda-unsafe",
        ",".join(args.cuda_unsafe + [unsafe]),
        "--cgroups",
        args.cgroups,
    ]
    if _lifeline is not None:  # the new image adopts it again
        os.set_inheritable(_lifeline, True)
        os.environ[LIFELINE_ENV] = str(_lifeline)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _fork() -> int:
    """``os.fork`` with the zygote's objects frozen first: the collector in the
    child never walks them, so it neither writes to their pages (each write
    copies a page the child shared) nor spends a full collection's time on a
    heap of imported libraries (Python's gc docs: disable early in the parent,
    freeze before fork, enable in the child)."""
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        # a spare sees EOF once the zygote is gone only if no other process
        # (another spare, a worker, a child zygote) holds its pipe open
        for fd in _spare_pipes:
            try:
                os.close(fd)
            except OSError:
                pass
        _spare_pipes.clear()
    return pid


class Spare:
    """One child forked ahead of need. Forking a zygote that imported torch costs
    ~10 ms of page-table copying; a spare pays it before Run. The spare is generic
    (no session, no device, no cwd) until ``fork`` hands it its parameters through
    a pipe, and it touches nothing (CUDA least of all) before that."""

    def __init__(self, conn: socket.socket, zygote_id: str):
        r, w = os.pipe()
        try:
            pid = _fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:
            os.close(w)
            _become_worker(conn, zygote_id, lambda: _read_params(r))
        os.close(r)
        self.pid, self.pipe = pid, w
        _spare_pipes.add(w)
        _enter_cgroups(pid)

    def hand(self, msg: dict) -> bool:
        """Give the spare its worker parameters; False if it is gone."""
        body = json.dumps(msg).encode()
        try:
            os.write(self.pipe, struct.pack(">I", len(body)) + body)
            return True
        except OSError:
            return False
        finally:
            _spare_pipes.discard(self.pipe)
            os.close(self.pipe)


# The cgroups each spare goes in (the host's `--cgroups`; empty: none): for each
# limited hierarchy, its parent and the files that set the limits.
_spare_cgroups: list[dict] = []


def _enter_cgroups(pid: int) -> None:
    """Put spare ``pid`` in cgroups of its own, ``PARENT/spare-PID``, while nobody
    waits for it: moving a process between cgroups waits for an RCU grace period
    (~10 ms). The host adopts them when it hands the spare out (ADR 52); on any
    failure it moves the worker itself then."""
    for entry in _spare_cgroups:
        path = os.path.join(entry["dir"], f"spare-{pid}")
        try:
            # a new one only: one left by an earlier process of this pid may hold
            # that process's orphans and counters
            os.mkdir(path)
            for name, value, required in entry["files"]:
                try:
                    with open(os.path.join(path, name), "w") as f:
                        f.write(str(value))
                except OSError:
                    if required:
                        raise
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError as e:
            _log(f"could not put spare {pid} in {path}: {e}")
            return


def _keep_freed_memory() -> None:
    """As the Rust services do (schemas/src/allocator.rs, ADR 69): buffers up to
    16 MiB come from glibc's heap and up to 64 MiB of its free top is kept, so a
    cell's large output is not faulted in page by page again on every cell (each
    copy of a megabyte cost 1 ms more). Inherited by every worker through fork."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    mallopt(m_mmap_threshold, 16 << 20)
    mallopt(m_trim_threshold, 64 << 20)


def _read_params(fd: int) -> dict:
    with os.fdopen(fd, "rb") as f:
        head = f.read(4)
        if len(head) < 4:
            raise EOFError("zygote went away before handing parameters")
        (n,) = struct.unpack(">I", head)
        return json.loads(f.read(n))


def _become_worker(conn: socket.socket, zygote_id: str, params) -> None:
    """In a forked child: wait for parameters, then serve as a worker; never
    returns into the zygote loop."""
    code = 0
    wid = "?"
    try:
        gc.enable()  # a worker collects its own garbage (the zygote's is frozen)
        conn.close()
        os.setsid()
        _die_with_host()  # a thread: this process is no zygote, it never forks one
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # cells need waitpid
        # an interrupt reaches cells only (the worker's own handler, see interrupt.py)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from . import worker

        ready = worker.Worker()  # a spare: set up while it waits, before Run
        msg = params()
        wid = msg["worker_id"]
        os.environ.update(msg["env"])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(msg["socket"])
        uid = msg.get("uid")
        if uid is not None:
            _become_session_user(uid)
        os.chdir(msg["cwd"])
        worker.main(sock, wid, zygote_id, ready)
    except BaseException as e:  # noqa: BLE001
        if not isinstance(e, EOFError):
            _log(f"worker {wid} failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        os._exit(code)


def _become_session_user(uid: int) -> None:
    """Drop to the session's own uid (gid = uid, no supplementary groups), once
    connected to the host: from here the cell can reach only what that uid can
    (ADR 29). Its home and temporary directory are its own (0700), as a user's
    would be, so another session's uid finds nothing of it there (ADR 52). The
    umask stays the host's: files a cell writes in its working directory must
    stay readable to the session's next workers, which may have another uid."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    base = tempfile.gettempdir()
    for var, name in (("HOME", "home"), ("TMPDIR", "tmp")):
        path = os.path.join(base, f"looseleaf-{name}-{uid}")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.stat(path)
            if st.st_uid == uid and st.st_mode & 0o077 == 0:
                os.environ[var] = path
        except OSError:
            pass  # one it cannot make: it keeps the host's (read-only to it)
    tempfile.tempdir = None  # the zygote's cached choice; the next use reads TMPDIR


def _fork_worker(conn: socket.socket, msg: dict, zygote_id: str, spares: list[Spare]) -> None:
    """Serve one ``fork``: hand it to the oldest live spare (the likeliest to be
    set up), else fork now. Spares used or found dead leave ``spares``."""
    wid = msg["worker_id"]
    while spares:
        spare = spares.pop(0)
        if spare.hand(msg):
            protocol.send(conn, {"type": "forked", "worker_id": wid, "pid": spare.pid})
            return
    try:
        pid = _fork()
    except OSError as e:
        protocol.send(conn, {"type": "fork_failed", "worker_id": wid, "error": str(e)})
        return
    if pid == 0:
        _become_worker(conn, zygote_id, lambda: msg)
    protocol.send(conn, {"type": "forked", "worker_id": wid, "pid": pid})


def _new_spare(conn: socket.socket, zygote_id: str) -> Spare | None:
    try:
        return Spare(conn, zygote_id)
    except OSError as e:
        _log(f"could not fork a spare: {e}")
        return None


def _quiet_for(conn: socket.socket, seconds: float) -> bool:
    """Whether nothing arrives from the host within ``seconds``."""
    ready, _, _ = select.select([conn], [], [], seconds)
    return not ready


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="looseleaf_worker.zygote")
    ap.add_argument("--socket", required=True, help="host's Unix socket to connect to")
    ap.add_argument("--id", required=True, help="this zygote's id")
    ap.add_argument("--packages", default="", help="comma-separated packages to import")
    ap.add_argument("--cuda-unsafe", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cgroups", default="[]", help="JSON: the cgroups each spare goes in")
    args = ap.parse_args(argv)
    _adopt_lifeline()
    _keep_freed_memory()
    _spare_cgroups[:] = json.loads(args.cgroups)
    args.packages = [p for p in args.packages.split(",") if p]
    args.cuda_unsafe = [p for p in args.cuda_unsafe.split(",") if p]
    # no collections while importing: they would leave freed holes in pages the
    # workers share (see _fork); the imports' objects live as long as the zygote
    gc.disable()

    # `python -m` put the directory we started in first on the path. A zygote
    # imports libraries only, never a module that happens to lie there (the
    # user's own modules import in workers, which put the session's working
    # directory first, as ipykernel does).
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    probe = load_probe()
    # The runtime itself (IPython, cloudpickle) is imported once here too.
    from . import worker  # noqa: F401

    if probe():
        _log("CUDA is initialised before any package import; refusing to serve")
        return 3
    imported, ms, errors, unsafe = import_packages(args.packages, probe)
    if unsafe is not None:
        _reexec_without(args, unsafe)

    # Build the IPython shell once here, so every worker forks with it ready.
    # (Its history is in memory: no saving thread, so the zygote stays thread-free.)
    from .shell import WorkerShell

    WorkerShell.instance(emit=_output_before_fork)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    return serve(args.socket, args.id, imported, ms, args.cuda_unsafe, errors)


def serve(
    sock_path: str, zid: str, packages: list[str], import_ms: float, cuda_unsafe: list[str], errors: dict[str, str]
) -> int:
    """Say hello to the host and serve forks until shutdown."""
    if _host_gone():  # it died while we imported (a child zygote's tail)
        _log("the host is gone; not serving")
        return 0
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    hello = {
        "type": "hello",
        "role": "zygote",
        "id": zid,
        "pid": os.getpid(),
        "packages": packages,
        "import_ms": import_ms,
        "cuda_unsafe": cuda_unsafe,
        "stdlib": sorted(sys.stdlib_module_names),
        "loaded": sorted({m.split(".")[0] for m in sys.modules if not m.startswith("_")}),
    }
    if errors:
        hello["import_errors"] = errors
    protocol.send(conn, hello)
    spares: list[Spare] = []
    spare_wait = 0.0  # the first spares are forked at once
    while True:
        if len(spares) < SPARES and _quiet_for(conn, spare_wait):
            spare = _new_spare(conn, zid)
            if spare is not None:
                spares.append(spare)
            # a fork that failed (memory, process limits) is not retried in a tight loop
            spare_wait = SPARE_AFTER_S if spare is not None else min(max(spare_wait, SPARE_AFTER_S) * 2, 5.0)
            continue
        try:
            msg = protocol.recv(conn)
        except protocol.ProtocolError as e:
            _log(f"bad frame from host: {e}")
            return 2
        if msg is None or msg["type"] == "shutdown":
            return 0
        if msg["type"] == "fork":
            _fork_worker(conn, msg, zid, spares)
            spare_wait = SPARE_AFTER_S  # the next spare forks once the host is quiet
        elif msg["type"] == "spawn_zygote":
            _spawn_child(conn, msg, sock_path, packages, cuda_unsafe)
        else:
            protocol.send(conn, {"type": "error", "message": f"a zygote does not handle {msg['type']}"})


def _spawn_child(conn: socket.socket, msg: dict, sock_path: str, packages: list[str], cuda_unsafe: list[str]) -> None:
    """Fork a child zygote that adds tail packages to ours (DESIGN.md section 7).
    It introduces itself to the host with its own hello; a tail package that
    initialises CUDA is reported and the child keeps serving only if none did."""
    try:
        pid = _fork()
    except OSError as e:
        _log(f"could not fork child zygote {msg['zygote_id']}: {e}")
        return
    if pid:
        return
    code = 0
    try:
        conn.close()
        os.setsid()
        probe = load_probe()
        tail = [p for p in msg["packages"] if p not in packages and p not in cuda_unsafe]
        imported, ms, errors, unsafe = import_packages(tail, probe)
        if unsafe is not None:
            # this process touched CUDA: say so and leave; never fork from it
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(sock_path)
            protocol.send(
                c,
                {
                    "type": "hello",
                    "role": "zygote",
                    "id": msg["zygote_id"],
                    "pid": os.getpid(),
                    "packages": [],
                    "import_ms": ms,
                    "cuda_unsafe": cuda_unsafe + [unsafe],
                },
            )
            c.close()
            code = 3
        else:
            code = serve(sock_path, msg["zygote_id"], packages + imported, ms, cuda_unsafe, errors)
    except BaseException as e:  # noqa: BLE001
        _log(f"child zygote {msg['zygote_id']} failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
