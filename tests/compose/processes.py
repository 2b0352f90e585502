#!/usr/bin/env python3
"""compose.yaml's topology as processes, where no Docker daemon runs (ADR 40).

    processes.py validate COMPOSE SCHEMA
        Check COMPOSE against the Compose Specification's JSON schema.

    processes.py up COMPOSE_DIR --work DIR --bin DIR --venv DIR
        Start every service of COMPOSE_DIR/compose.yaml as a process, each in a
        network namespace of its own (its /etc/hosts maps every service name to
        its address on one bridge), a PID namespace (nothing it starts outlives
        it) and a mount namespace with a /dev/shm of the file's `shm_size`
        (Docker's 64 MiB by default), with the command, arguments and environment
        the file gives it, after the file's own interpolation from
        COMPOSE_DIR/.env. Our image's services run as the Dockerfile's USER with
        its ENV. Paths inside a container (volumes, secrets, the image's own) are
        mapped to folders under DIR; secrets keep their file's mode, as compose's
        bind mounts do. Prints one JSON line when all are started, then runs until
        stdin closes or SIGTERM, and removes everything it made.

An image that cannot run here has a named stand-in: LooseLeaf's image runs the
binaries of --bin with the Dockerfile's ENV; `nats` runs the venv's nats-server;
MinIO runs moto, and MinIO's client job makes the bucket with one PUT; the
OpenTelemetry collector and Jaeger are the caller's own OTLP receiver, which
listens on the bridge's address (the JSON's `bridge`); Prometheus runs Debian's
`prometheus` with the file's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# The stand-in of each image (by name, before the tag) that the file uses.
LOOSELEAF, NATS, MINIO, MINIO_CLIENT, OTLP, PROMETHEUS = (
    "looseleaf",
    "nats",
    "minio/minio",
    "minio/mc",
    "otlp",
    "prom/prometheus",
)
# iproute2, wherever this machine keeps it (often outside a service's PATH)
IP = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin") or ""

IMAGES = {
    "looseleaf": LOOSELEAF,
    "nats": NATS,
    "minio/minio": MINIO,
    "minio/mc": MINIO_CLIENT,
    "otel/opentelemetry-collector": OTLP,
    "jaegertracing/all-in-one": OTLP,
    "prom/prometheus": PROMETHEUS,
}


def fail(msg: str) -> None:
    print(f"processes.py: {msg}", file=sys.stderr)
    sys.exit(1)


def validate(compose: Path, schema: Path) -> None:
    import jsonschema
    import yaml

    doc = yaml.safe_load(compose.read_text())
    spec = json.loads(schema.read_text())
    errors = sorted(jsonschema.Draft201909Validator(spec).iter_errors(doc), key=lambda e: list(e.path))
    for e in errors:
        print(f"{compose}: {'/'.join(map(str, e.path)) or '(top)'}: {e.message}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(f"{compose}: valid against {schema.name}")


# --- interpolation, as compose does it on every string after parsing -------------

VAR = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value, env: dict[str, str]):
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        got = env.get(name)
        unset = got is None or (op is not None and op.startswith(":") and got == "")
        if op in (":-", "-"):
            return interpolate(arg, env) if unset else got
        if op in (":?", "?"):
            if unset:
                fail(f"{name} is not set: {arg}")
            return got
        return got or ""

    # a `${` (not escaped as `$${`) that VAR does not read is a form we do not implement
    for m in re.finditer(r"\$+\{", value):
        dollars = len(m.group()) - 1
        if dollars % 2 == 1 and not VAR.match(value, m.end() - 2):
            fail(f"unsupported interpolation in {value!r}")
    return VAR.sub(sub, value)


def dotenv(path: Path) -> dict[str, str]:
    env = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                env[k.strip()] = v.strip().strip("'\"")
    return env


def load(compose_dir: Path) -> dict:
    import yaml

    doc = yaml.safe_load((compose_dir / "compose.yaml").read_text())
    env = {**dotenv(compose_dir / ".env"), **os.environ}
    return interpolate(doc, env)


# --- what each service runs -----------------------------------------------------


def image_config(dockerfile: Path) -> tuple[dict[str, str], str | None]:
    """The ENV and USER of the Dockerfile's last stage (LooseLeaf's runtime image)."""
    env: dict[str, str] = {}
    user = None
    for line in dockerfile.read_text().splitlines():
        if line.startswith("FROM "):
            env, user = {}, None
        elif line.startswith("ENV "):
            for pair in line[4:].split():
                k, _, v = pair.partition("=")
                env[k] = v
        elif line.startswith("USER "):
            user = line.split()[1]
    return env, user


def shm_bytes(size: str | int | None) -> str:
    """compose's `shm_size` ("8gb", "64m", bytes) as a tmpfs size; Docker's default 64 MiB."""
    if size is None:
        return "64m"
    m = re.fullmatch(r"(\d+)\s*([bkmg]?)b?", str(size).strip().lower())
    if not m:
        fail(f"shm_size {size!r} is not a size")
    return m.group(1) + (m.group(2) if m.group(2) != "b" else "")


def as_list(command) -> list[str]:
    if command is None:
        return []
    return command if isinstance(command, list) else command.split()


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, "")) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def dependencies(service: dict) -> list[str]:
    deps = service.get("depends_on") or []
    return list(deps) if isinstance(deps, (list, dict)) else []


def start_order(services: dict) -> list[str]:
    order: list[str] = []

    def visit(name: str, seen: tuple) -> None:
        if name in order:
            return
        if name in seen:
            fail(f"depends_on cycle through {name}")
        for dep in dependencies(services[name]):
            if dep not in services:
                fail(f"{name} depends on {dep}, which is not a service")
            visit(dep, seen + (name,))
        order.append(name)

    for name in services:
        visit(name, ())
    return order


def free_subnet() -> str:
    """A 10.x.y.0/24 that no route of this machine covers."""
    routes = subprocess.run([IP, "-4", "route"], capture_output=True, text=True).stdout
    for _ in range(50):
        subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        if f"{subnet}." not in routes and not re.search(r"^10\.0\.0\.0/8|^default via 10\.", routes, re.M):
            return subnet
    fail("no free 10.x.y.0/24 subnet for the bridge")
    return ""


class Topology:
    """The bridge, the namespaces and the processes; torn down by `down`."""

    def __init__(self, compose_dir: Path, work: Path, bin_dir: Path, venv: Path) -> None:
        self.dir, self.work, self.bin, self.venv = compose_dir, work, bin_dir, venv
        self.doc = load(compose_dir)
        self.services: dict = self.doc.get("services") or {}
        self.tag = "llc" + secrets.token_hex(2)
        self.subnet = free_subnet()
        self.bridge = f"{self.subnet}.1"
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.ips: dict[str, str] = {}

    # names of network things are at most 15 characters
    def ns(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def ip(self, *args: str) -> None:
        done = subprocess.run([IP, *args], capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def stand_in(self, name: str) -> str:
        image = (self.services[name].get("image") or "").rsplit(":", 1)[0]
        if image not in IMAGES:
            fail(f"service {name}: no stand-in for image {image!r}")
        return IMAGES[image]

    def network(self) -> None:
        self.ip("link", "add", f"{self.tag}br", "type", "bridge")
        self.links.append(f"{self.tag}br")
        self.ip("addr", "add", f"{self.bridge}/24", "dev", f"{self.tag}br")
        self.ip("link", "set", f"{self.tag}br", "up")
        hosts = ["127.0.0.1 localhost"]
        for i, name in enumerate(self.services, start=2):
            # the collector and Jaeger are the caller's receiver, on the bridge
            self.ips[name] = self.bridge if self.stand_in(name) == OTLP else f"{self.subnet}.{i}"
            hosts.append(f"{self.ips[name]} {name}")
        for i, name in enumerate(self.services, start=2):
            if self.ips[name] == self.bridge:
                continue
            ns, host_end, ns_end = self.ns(i), f"{self.tag}h{i}", f"{self.tag}c{i}"
            self.ip("netns", "add", ns)
            self.namespaces.append(ns)
            self.ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            self.links.append(host_end)
            self.ip("link", "set", ns_end, "netns", ns)
            self.ip("link", "set", host_end, "master", f"{self.tag}br", "up")
            self.ip("-n", ns, "addr", "add", f"{self.ips[name]}/24", "dev", ns_end)
            self.ip("-n", ns, "link", "set", ns_end, "up")
            self.ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(hosts + [f"{self.ips[name]} {name}"]) + "\n")
            (etc / "hostname").write_text(name + "\n")

    def mounts(self, name: str) -> list[tuple[str, str]]:
        """(path in the container, path here) for the service's volumes and secrets."""
        service, out = self.services[name], []
        for volume in service.get("volumes") or []:
            source, target = (
                (volume.split(":")[:2]) if isinstance(volume, str) else (volume["source"], volume["target"])
            )
            if source.startswith((".", "/")):
                host = (self.dir / source).resolve()
            else:  # a named volume
                host = self.work / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            out.append((target, str(host)))
        for secret in service.get("secrets") or []:
            key = secret if isinstance(secret, str) else secret["source"]
            spec = (self.doc.get("secrets") or {}).get(key) or fail(f"service {name}: no secret {key}")
            # compose bind-mounts the file itself: its mode counts, its folder's does not
            source = (self.dir / spec["file"]).resolve()
            copy = self.work / "secrets" / name / key
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy)
            out.append((f"/run/secrets/{key}", str(copy)))
        if self.stand_in(name) == LOOSELEAF:
            for inside in ("/run/looseleaf", "/home/looseleaf"):
                here = self.work / name / inside.strip("/").replace("/", "-")
                here.mkdir(parents=True, exist_ok=True)
                out.append((inside, str(here)))
            out.append(("/opt/looseleaf/venv", str(self.venv)))
        return sorted(out, key=lambda m: -len(m[0]))

    @staticmethod
    def mapped(text: str, mounts: list[tuple[str, str]]) -> str:
        for inside, here in mounts:
            text = re.sub(r"(?<![\w./-])" + re.escape(inside) + r"(?=$|[/:,\s])", here, text)
        return text

    def command(self, name: str, kind: str) -> list[str]:
        service = self.services[name]
        args = as_list(service.get("command"))
        if kind == LOOSELEAF:
            return [str(self.bin / args[0]), *args[1:]]
        if kind == NATS:
            return [str(self.venv / "bin/nats-server"), *args]
        if kind == MINIO:
            address = args[args.index("--address") + 1] if "--address" in args else ":9000"
            return [str(self.venv / "bin/moto_server"), "-H", "0.0.0.0", "-p", address.rsplit(":", 1)[1]]
        if kind == PROMETHEUS:
            return [shutil.which("prometheus") or fail("Debian's prometheus is not installed (scripts/setup)"), *args]
        fail(f"service {name}: nothing to run for {kind}")
        return []

    def start(self, name: str, ns: str) -> None:
        kind, service = self.stand_in(name), self.services[name]
        mounts = self.mounts(name)
        home = self.work / name
        home.mkdir(parents=True, exist_ok=True)
        env = {"PATH": f"{self.venv}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "HOSTNAME": name}
        user = None
        if kind == LOOSELEAF:
            image_env, user = image_config(self.dir / "Dockerfile")
            env.update(image_env)
        env.update(env_of(service))
        env = {k: self.mapped(v, mounts) for k, v in env.items()}
        argv = [self.mapped(a, mounts) for a in self.command(name, kind)]
        if user:
            # what the image's USER owns there: its COPY --chown folders, and the
            # named volumes mounted on them (a new volume takes its folder's owner)
            uid, _, gid = user.partition(":")
            for _, here in mounts:
                if Path(here).is_dir() and (here.startswith(str(self.work / name)) or "/volumes/" in here):
                    os.chown(here, int(uid), int(gid or uid))
            argv = ["setpriv", f"--reuid={uid}", f"--regid={gid or uid}", "--clear-groups", "--", *argv]
        # a PID namespace, so that nothing the service starts outlives it, and the
        # /dev/shm its container would have
        shm = shm_bytes(service.get("shm_size"))
        inner = f"mount -t tmpfs -o size={shm},mode=1777 shm /dev/shm && exec {shlex.join(argv)}"
        wrapped = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", inner]
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 (the process keeps it)
        self.procs[name] = subprocess.Popen(
            [IP, "netns", "exec", ns, *wrapped],
            env=env,
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def make_bucket(self, name: str) -> None:
        """MinIO's client job: `mc mb local/BUCKET` against the S3 server it names."""
        script = " ".join(as_list(self.services[name].get("command")))
        bucket = re.search(r"mc mb\b.*?\blocal/([\w.-]+)", script) or fail(f"{name}: no `mc mb local/BUCKET`")
        server = re.search(r"mc alias set local (http://[\w.-]+:\d+)", script) or fail(f"{name}: no alias URL")
        host, port = server.group(1)[len("http://") :].split(":")
        url = f"http://{self.ips[host]}:{port}/{bucket.group(1)}"
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=2)
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    fail(f"{name}: could not make the bucket at {url}: {e}")
                time.sleep(0.2)

    def up(self) -> None:
        self.network()
        index = {name: i for i, name in enumerate(self.services, start=2)}
        for name in start_order(self.services):
            kind = self.stand_in(name)
            if kind == OTLP:
                continue
            if kind == MINIO_CLIENT:
                self.make_bucket(name)
                continue
            self.start(name, self.ns(index[name]))
        print(json.dumps({"bridge": self.bridge, "services": self.ips}), flush=True)

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.procs.items() if p.poll() is not None]

    def down(self) -> None:
        # a second SIGTERM must not stop the clean-up halfway
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in self.namespaces:
            subprocess.run([IP, "netns", "delete", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for link in self.links:
            subprocess.run([IP, "link", "delete", link], capture_output=True)


def up(args: argparse.Namespace) -> None:
    if os.geteuid() != 0 or not IP:
        fail("network namespaces need root and iproute2's `ip`")
    topology = Topology(args.compose_dir.resolve(), args.work.resolve(), args.bin.resolve(), args.venv.resolve())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        topology.up()
        sys.stdin.read()  # until the caller closes it (or dies)
    finally:
        dead = topology.dead()
        if dead:
            print(f"processes.py: exited before the end: {', '.join(dead)}", file=sys.stderr)
        topology.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate")
    v.add_argument("compose", type=Path)
    v.add_argument("schema", type=Path)
    u = sub.add_parser("up")
    u.add_argument("compose_dir", type=Path)
    u.add_argument("--work", type=Path, required=True)
    u.add_argument("--bin", type=Path, required=True)
    u.add_argument("--venv", type=Path, required=True)
    args = parser.parse_args()
    if args.cmd == "validate":
        validate(args.compose, args.schema)
    else:
        up(args)


if __name__ == "__main__":
    main()
