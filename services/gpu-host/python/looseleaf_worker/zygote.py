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
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
import time

from . import protocol


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
    argv = [sys.executable, "-m", "looseleaf_worker.zygote", "--socket", args.socket,
            "--id", args.id, "--packages",
            ",".join(p for p in args.packages if p != unsafe),
            "--cuda-unsafe", ",".join(args.cuda_unsafe + [unsafe])]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _fork_worker(conn: socket.socket, msg: dict, zygote_id: str) -> None:
    wid = msg["worker_id"]
    try:
        pid = os.fork()
    except OSError as e:
        protocol.send(conn, {"type": "fork_failed", "worker_id": wid, "error": str(e)})
        return
    if pid:
        protocol.send(conn, {"type": "forked", "worker_id": wid, "pid": pid})
        return
    # child: never return into the zygote loop
    code = 0
    try:
        conn.close()
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # cells need waitpid
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(msg["socket"])
        from . import worker
        worker.main(sock, wid, zygote_id)
    except BaseException as e:  # noqa: BLE001
        _log(f"worker {wid} failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        os._exit(code)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="looseleaf_worker.zygote")
    ap.add_argument("--socket", required=True, help="host's Unix socket to connect to")
    ap.add_argument("--id", required=True, help="this zygote's id")
    ap.add_argument("--packages", default="", help="comma-separated packages to import")
    ap.add_argument("--cuda-unsafe", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.packages = [p for p in args.packages.split(",") if p]
    args.cuda_unsafe = [p for p in args.cuda_unsafe.split(",") if p]

    probe = load_probe()
    # The runtime itself (IPython, cloudpickle) is imported once here too.
    from . import worker  # noqa: F401
    if probe():
        _log("CUDA is initialised before any package import; refusing to serve")
        return 3
    imported, ms, errors, unsafe = import_packages(args.packages, probe)
    if unsafe is not None:
        _reexec_without(args, unsafe)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(args.socket)
    hello = {"type": "hello", "role": "zygote", "id": args.id, "pid": os.getpid(),
             "packages": imported, "import_ms": ms, "cuda_unsafe": args.cuda_unsafe}
    if errors:
        hello["import_errors"] = errors
    protocol.send(conn, hello)
    while True:
        try:
            msg = protocol.recv(conn)
        except protocol.ProtocolError as e:
            _log(f"bad frame from host: {e}")
            return 2
        if msg is None or msg["type"] == "shutdown":
            return 0
        if msg["type"] == "fork":
            _fork_worker(conn, msg, args.id)
        else:
            protocol.send(conn, {"type": "error",
                                 "message": f"a zygote does not handle {msg['type']}"})


if __name__ == "__main__":
    sys.exit(main())
