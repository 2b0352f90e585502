"""Helpers shared by the benchmarks under bench/: paths, the release build, a
scratch copy of the corpus, a local LooseLeaf cluster, notebook runs, statistics.

Only the standard library; every bench runs with the repository's .venv python.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
WORK = BENCH / "work"  # gitignored scratch space
RESULTS = BENCH / "results"
RELEASE = REPO / "target" / "release"
LOOSELEAF = RELEASE / "looseleaf"
PYTHON = REPO / ".venv" / "bin" / "python"
# Corpus notebooks that run whole under --all-gpu and are typed by the speculation
# and GPU-hours benches.
TYPED_NOTEBOOKS = [
    "kishu_nbexec_test_case_1.ipynb",
    "kishu_numpy.ipynb",
    "kishu_simple.ipynb",
    "pdsh_02.02-The-Basics-Of-NumPy-Arrays.ipynb",
    "pdsh_03.02-Data-Indexing-and-Selection.ipynb",
    "pdsh_03.03-Operations-in-Pandas.ipynb",
]
# LOOSELEAF_CORPUS: a copy elsewhere (a GPU machine has no ../shared; DEVELOPERS.md)
CORPUS = Path(os.environ.get("LOOSELEAF_CORPUS", REPO / ".." / "shared" / "corpus")).resolve()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_release() -> None:
    """Build the release binaries once if any is missing."""
    bins = ["looseleaf", "looseleaf-frontend", "looseleaf-planner", "looseleaf-gpu-host", "looseleaf-store"]
    if all((RELEASE / b).exists() for b in bins):
        return
    log("release binaries missing: cargo build --release --workspace --bins")
    subprocess.run(["cargo", "build", "--release", "--workspace", "--bins"], cwd=REPO, check=True)


def scratch(name: str) -> Path:
    """A fresh scratch folder bench/work/NAME."""
    d = WORK / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def copy_corpus(dest: Path) -> Path:
    """Copy the corpus (read-only in shared/) to DEST/corpus, writable."""
    out = dest / "corpus"
    shutil.copytree(CORPUS, out)
    for root, dirs, files in os.walk(out):
        for n in dirs + files:
            p = Path(root) / n
            p.chmod(p.stat().st_mode | 0o200)
    return out


def code_cells(nb_path: Path) -> list[tuple[int, str]]:
    """(index among all cells, source) of the code cells `looseleaf run` executes:
    code cells whose source is not blank (src/notebook.rs)."""
    nb = json.loads(nb_path.read_text())
    out = []
    for i, c in enumerate(nb.get("cells", [])):
        if c.get("cell_type") != "code":
            continue
        src = c.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        if src.strip():
            out.append((i, src))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """`looseleaf up` in the background, stopped with SIGINT (its Ctrl-C path)."""

    def __init__(
        self, data_dir: Path, virtual_gpus: int | None = 2, store_url: str | None = None, env: dict | None = None
    ):
        self.port = free_port()
        self.data_dir = data_dir
        self.log_path = data_dir.parent / "up.log"
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        # None: the host probes the machine's real GPUs
        gpus = ["--virtual-gpus", str(virtual_gpus)] if virtual_gpus is not None else []
        args = [
            str(LOOSELEAF),
            "up",
            *gpus,
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
        ]
        if store_url:
            args += ["--store-url", store_url]
        self.proc = subprocess.Popen(
            args, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.nats_url = None

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until `up` says the hosts are ready (it prints that after their first status)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text()
            m = re.search(r"LooseLeaf is up: frontend (\S+) \(NATS (\S+)\)", text)
            if m:
                self.url, self.nats_url = m.group(1), m.group(2)
                # the API's bearer token, for `looseleaf run --frontend` (see run_notebook)
                API_TOKENS[self.url] = (self.data_dir / "api-token").read_text().strip()
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"looseleaf up exited ({self.proc.returncode}):\n{text}")
            time.sleep(0.2)
        raise TimeoutError(f"looseleaf up not ready after {timeout} s:\n{self.log_path.read_text()}")

    def descendants(self) -> list[int]:
        """Pids of every process under `looseleaf up` (from /proc ppid links)."""
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.proc.pid]
        while todo:
            p = todo.pop()
            for c in children.get(p, []):
                out.append(c)
                todo.append(c)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Services:
    """The four services as processes of their own around a nats-server of this
    bench's (as the whole-cluster tests start them), so one can be killed: a
    store, `planners` planners (the first holds the lease, ADR 60), one gpu-host
    with `virtual_gpus` slots, and a frontend without API tokens."""

    def __init__(self, work: Path, planners: int = 1, virtual_gpus: int = 2):
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self._log = open(work / "services.log", "w")
        self.procs: dict[str, subprocess.Popen] = {}
        nats_port = free_port()
        self._start(
            "nats",
            [
                str(REPO / ".venv" / "bin" / "nats-server"),
                "-a",
                "127.0.0.1",
                "-p",
                str(nats_port),
                "-js",
                "-sd",
                str(work / "jetstream"),
            ],
        )
        key = work / "manifest-key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        self.env = {
            **os.environ,
            "LOOSELEAF_NATS_URL": f"nats://127.0.0.1:{nats_port}",
            "LOOSELEAF_PREFIX": "bench",
            "LOOSELEAF_STORE_URL": str(work / "store"),
            "LOOSELEAF_PYTHON": str(PYTHON),
            "LOOSELEAF_LOG": os.environ.get("LOOSELEAF_LOG", "warn"),
            "LOOSELEAF_MANIFEST_KEY_FILE": str(key),
        }
        wait_port(nats_port)
        self._start("store", [str(RELEASE / "looseleaf-store")], self.env)
        for i in range(planners):
            self._start(f"planner-{i}", [str(RELEASE / "looseleaf-planner")], self.env)
            time.sleep(1.0)  # the first one started holds the lease
        self.virtual_gpus = virtual_gpus
        self._start_host("host-0")
        port = free_port()
        self._start("frontend", [str(RELEASE / "looseleaf-frontend"), "--listen", f"127.0.0.1:{port}"], self.env)
        self.url = f"http://127.0.0.1:{port}"
        wait_port(port)
        self._wait_zygote()

    def _start_host(self, host_id: str) -> None:
        args = [
            str(RELEASE / "looseleaf-gpu-host"),
            "--host-id",
            host_id,
            "--virtual-gpus",
            str(self.virtual_gpus),
            "--runtime-dir",
            str(self.work / host_id),
        ]
        self._start(host_id, args, self.env)

    def restart_host(self, host_id: str) -> None:
        """Stop every gpu-host (SIGTERM) and start one named `host_id`: a host with
        nothing cached, nothing prepared. Returns once its zygote is ready."""
        for name, p in self.procs.items():
            if name.startswith("host") and p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
        self._start_host(host_id)
        self._wait_zygote(host=host_id)

    def _wait_zygote(self, timeout: float = 180.0, host: str | None = None) -> None:
        """Until the dashboard's snapshot shows a host (`host`, if named) with a
        ready zygote."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.url}/v1/dashboard", timeout=10) as stream:
                for raw in stream:
                    line = raw.decode().strip()
                    if line.startswith("data:"):
                        snapshot = json.loads(line[5:])
                        hosts = [h for h in snapshot.get("hosts", []) if host in (None, h.get("host"))]
                        if any(h.get("zygotes") for h in hosts):
                            return
                    if time.monotonic() > deadline:
                        break
        raise TimeoutError(f"no host had a ready zygote after {timeout} s (see {self.work}/services.log)")

    def _start(self, name: str, args: list[str], env: dict | None = None) -> None:
        self.procs[name] = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def kill(self, name: str) -> None:
        """SIGKILL service `name` (`planner-0`, `host-0`, ...) and reap it."""
        p = self.procs[name]
        p.kill()
        p.wait()

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._log.close()


def wait_port(port: int, timeout: float = 60.0) -> None:
    """Until something listens on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


# The bearer token of each frontend a Cluster started, by URL.
API_TOKENS: dict[str, str] = {}


def run_notebook(
    nb: Path, frontend: str, out_dir: Path, all_gpu: bool = True, timeout: float = 300, extra: list[str] | None = None
) -> dict:
    """`looseleaf run NB --all-gpu --frontend URL [EXTRA...]`; returns the report."""
    stem = nb.stem
    report = out_dir / f"{stem}.report.json"
    # corpus notebooks raise on purpose: every cell runs, as in the reference kernel
    args = [
        str(LOOSELEAF),
        "run",
        "--allow-errors",
        str(nb),
        "--output",
        str(out_dir / f"{stem}.out.ipynb"),
        "--report",
        str(report),
        "--frontend",
        frontend,
    ]
    if all_gpu:
        args.append("--all-gpu")
    args += extra or []
    with open(out_dir / f"{stem}.run.log", "w") as logf:
        env = {**os.environ, "LOOSELEAF_TOKEN": API_TOKENS.get(frontend, "")}
        subprocess.run(args, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, check=True, timeout=timeout, env=env)
    return json.loads(report.read_text())


def proc_memory(pid: int) -> dict:
    """VmRSS and Pss of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss_bytes"] = int(line.split()[1]) * 1024
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["pss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def stop_local_cluster(runtime: Path) -> None:
    """Stop the local cluster (ADR 65) whose runtime folder is `runtime`, if one runs."""
    try:
        pid = json.loads((runtime / "cluster.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)


def median(xs):
    return statistics.median(xs) if xs else None


def percentile(xs, q: float):
    if not xs:
        return None
    v = sorted(xs)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


class S3Server:
    """A local S3 server (moto, from the venv) with one bucket; stop() ends it."""

    def __init__(self, log_dir: Path):
        import urllib.request

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = "looseleaf-bench"
        self._log = open(log_dir / "moto.log", "w")
        self.proc = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # moto accepts unsigned requests: one PUT makes the bucket
        req = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT", data=b"")
        urllib.request.urlopen(req, timeout=10).close()

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"

    def env(self) -> dict:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
        }

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on loopback that counts what it is sent (a
    collector's stand-in: it takes the protobuf and answers 200)."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                receiver.requests += 1
                receiver.bytes += n
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()

    def env(self) -> dict:
        """The variables that make the services export their spans here."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
