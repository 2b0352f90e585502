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


def test_a_spare_forked_while_the_host_is_quiet_serves_the_next_fork(zygote):
    zpid = zygote.proc.pid

    def new_child(known: set[int]) -> int | None:
        fresh = _children(zpid) - known
        return next(iter(fresh)) if len(fresh) == 1 else None

    known = _children(zpid)  # earlier tests' workers, and a spare if one waits
    w1 = zygote.fork()
    known |= {w1.pid}
    # once the host is quiet, one new child besides the worker waits as the spare
    spare = _wait_for(lambda: new_child(known))
    w2 = zygote.fork()
    assert w2.pid == spare, "the next fork is the spare, not a fresh fork"
    assert ok(w2.run("print(1 + 1)"))
    # a dead spare is replaced by a direct fork: the fork request does not fail
    known |= {w2.pid}
    spare = _wait_for(lambda: new_child(known))
    os.kill(spare, signal.SIGKILL)
    _wait_for(lambda: True if spare not in _children(zpid) else None)
    w3 = zygote.fork()
    assert w3.pid != spare
    assert stream_text(ok(w3.run("print('alive')"))).strip() == "alive"


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
