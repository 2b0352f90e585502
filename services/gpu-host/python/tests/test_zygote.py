import os
import signal
import time

from helpers import ok, stream_text


def test_hello_lists_packages(zygote):
    h = zygote.hello
    assert h["role"] == "zygote" and h["id"] == zygote.id
    assert h["packages"] == ["numpy", "pandas"]
    assert h["cuda_unsafe"] == []
    assert h["pid"] == zygote.proc.pid
    assert h["import_ms"] > 0


def test_fork_gives_worker_with_env_and_cwd(host, zygote, tmp_path):
    w = zygote.fork(env={"LL_TEST_VAR": "hello-env"}, cwd=str(tmp_path))
    assert w.hello["role"] == "worker" and w.hello["id"] == w.id
    assert w.hello["zygote_id"] == zygote.id
    assert w.hello["pid"] == w.pid != zygote.proc.pid
    r = ok(
        w.run(
            "import os, sys\nprint(os.environ['LL_TEST_VAR'], os.getcwd(), os.getsid(0) == os.getpid(),"
            " 'numpy' in sys.modules)"
        )
    )
    assert stream_text(r).split() == ["hello-env", str(tmp_path), "True", "True"]
    # the zygote is unaffected by the child's env
    w2 = zygote.fork()
    assert stream_text(w2.run("import os; print(os.environ.get('LL_TEST_VAR'))")).strip() == "None"


def _children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


def _wait_for(pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := pred()) is not None:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_spares_wait_ready_and_serve_forks_and_a_dead_one_is_not_used(host):
    from looseleaf_worker.zygote import SPARES

    z = host.zygote(["numpy"])
    zpid = z.proc.pid
    workers: set[int] = set()

    def spares_when_ready() -> set[int] | None:
        waiting = _children(zpid) - workers
        return waiting if len(waiting) == SPARES else None

    spares = _wait_for(spares_when_ready)
    w1 = z.fork()
    assert w1.pid in spares, "a waiting spare served the fork"
    workers.add(w1.pid)
    # back to back: the other spare serves the next one at once
    w2 = z.fork()
    assert w2.pid in spares - {w1.pid}
    workers.add(w2.pid)
    assert stream_text(ok(w2.run("print(1 + 1)"))).strip() == "2"
    # once the host is quiet, the zygote makes them again; dead spares are skipped
    spares = _wait_for(spares_when_ready)
    for pid in spares:
        os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: True if not (_children(zpid) & spares) else None)
    w3 = z.fork()
    assert w3.pid not in spares
    assert stream_text(ok(w3.run("print('alive')"))).strip() == "alive"
    z.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_waiting_spares_leave_with_their_zygote_though_a_child_zygote_stays(host):
    from hostsim import Conn
    from looseleaf_worker.zygote import SPARES

    z = host.zygote(["numpy"])
    spares = _wait_for(lambda: s if len(s := _children(z.proc.pid)) == SPARES else None)
    # a child zygote forked while the spares wait must not keep their pipes open
    os.unlink(os.path.join(host.dir, f"z-{z.id}.sock"))
    lsock = host.listener(f"z-{z.id}")
    z.conn.send({"type": "spawn_zygote", "zygote_id": "z-child-2", "packages": ["json"]})
    sock, _ = lsock.accept()
    lsock.close()
    child = Conn(sock, host.received)
    child_pid = child.expect("hello")["pid"]
    z.proc.kill()  # no shutdown: each spare must see its pipe close
    z.proc.wait()
    _wait_for(lambda: True if all(_gone(p) for p in spares) else None)
    assert not _gone(child_pid), "the child zygote serves on"
    child.send({"type": "shutdown"})
    _wait_for(lambda: True if _gone(child_pid) else None)
    sock.close()
    z.conn.sock.close()
    z.stderr.close()


def test_subprocesses_work_in_worker(zygote):
    # the zygote ignores SIGCHLD; a worker must not, or return codes break
    w = zygote.fork()
    r = ok(w.run("import subprocess\nprint(subprocess.run(['sh', '-c', 'exit 3']).returncode)"))
    assert stream_text(r).strip() == "3"


def test_cuda_probe_marks_package_unsafe(host):
    z = host.zygote(["json", "ll_fake_cuda", "ll_fake_broken", "csv"], env={"LOOSELEAF_CUDA_PROBE": "ll_probe:probe"})
    h = z.hello
    assert h["cuda_unsafe"] == ["ll_fake_cuda"]
    assert h["packages"] == ["json", "csv"]
    assert "ll_fake_broken" in h["import_errors"]
    assert h["pid"] == z.proc.pid  # restarted in place, same process
    assert "initialises CUDA" in z.log_text()
    w = z.fork()
    r = ok(w.run("import sys; print('ll_fake_cuda' in sys.modules, 'csv' in sys.modules)"))
    assert stream_text(r).split() == ["False", "True"]
    z.close()
    assert z.proc.returncode == 0


def test_default_probe_is_clean_without_cuda():
    from looseleaf_worker import zygote as zmod

    assert zmod.default_probe() is False  # no CUDA context and no /dev/nvidia* fds here


def test_protocol_file_override(tmp_path):
    import json
    import subprocess
    import sys

    from hostsim import PYDIR

    contract = json.loads((PYDIR / "looseleaf_worker" / "worker-protocol.json").read_text())
    contract["max_frame_bytes"] = 1234
    f = tmp_path / "p.json"
    f.write_text(json.dumps(contract))
    out = subprocess.run(
        [sys.executable, "-c", "from looseleaf_worker import protocol; print(protocol.MAX_FRAME_BYTES)"],
        cwd=str(PYDIR),
        env={**os.environ, "LOOSELEAF_PROTOCOL_FILE": str(f)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "1234"


def test_child_zygote_adds_tail_packages_and_forks_workers(host, zygote):
    """spawn_zygote forks a child of the base that imports more packages, says
    hello as a zygote of its own, and forks workers that have them imported."""
    import os

    from hostsim import Conn, Zygote

    path = os.path.join(host.dir, f"z-{zygote.id}.sock")
    os.unlink(path)  # the base's listener was closed after its hello; listen again
    lsock = host.listener(f"z-{zygote.id}")
    zygote.conn.send({"type": "spawn_zygote", "zygote_id": "z-child", "packages": ["json", "csv"]})
    s, _ = lsock.accept()
    lsock.close()
    s.settimeout(60)
    child = Zygote.__new__(Zygote)
    child.host, child.id, child.conn = host, "z-child", Conn(s, host.received)
    child.stderr = zygote.stderr
    hello = child.conn.expect("hello")
    assert hello["id"] == "z-child" and hello["pid"] != zygote.hello["pid"]
    assert "json" in hello["packages"] and "csv" in hello["packages"]
    assert "sys" in hello["stdlib"]
    w = child.fork()
    r = w.run("import sys\nprint('csv' in sys.modules)")
    assert r["outputs"][0]["text"].strip() == "True"
    child.conn.send({"type": "shutdown"})
