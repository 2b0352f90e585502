#!/usr/bin/env python3
"""compose.yaml's topology as processes, where no Docker daemon runs (ADR 41).

    processes.py validate COMPOSE SCHEMA
        Check COMPOSE (compose.yaml, or an override file such as compose.gpu.yaml
        with its `!reset` and `!override` tags) against the Compose
        Specification's JSON schema.

    processes.py config COMPOSE
        Print COMPOSE as JSON after compose's interpolation (from the environment
        and the .env beside it), as `docker compose config --format json` would.

    processes.py up COMPOSE_DIR --work DIR --bin DIR --venv DIR
        Start every service of COMPOSE_DIR/compose.yaml as a process, each in a
        network namespace of its own (its /etc/hosts maps every service name to
        its address on one bridge), a PID namespace (nothing it starts outlives
        it) and a mount namespace with a /dev/shm of the file's `shm_size`
        (Docker's 64 MiB by default), with the command, arguments and environment
        the file gives it, after the file's own interpolation from
        COMPOSE_DIR/.env. Our image's services run as the Dockerfile's USER with
        its ENV. Paths inside a container (volumes, secrets at /run/secrets/NAME
        or their `target`, the image's own) are mapped to folders under DIR, in
        arguments and in the environment (`*_FILE` variables among them); secrets
        keep their file's owner and mode, as compose's bind mounts do (which is why
        compose ignores a file secret's `mode`, and so does this).
        A service starts once its `depends_on` conditions hold: started, healthy
        (its healthcheck passed) or completed successfully. Healthchecks run in
        the service's namespace: `looseleaf ...` with --bin's binary as the
        image's user, `wget`/`curl` of a URL and MinIO's `mc ready local` as an
        HTTP GET from there; a service whose check has not passed by the time
        Docker would call it unhealthy (start_period + retries x interval +
        timeout) fails the run, named, with the end of its log. Like
        `docker compose up --wait`, prints one JSON line once every service is
        started and every healthcheck passed, then runs until stdin closes or
        SIGTERM; a service that exits meanwhile has the end of its log printed on
        stderr at once. Then it stops the services as compose does (dependents
        first; SIGTERM, SIGKILL after the service's `stop_grace_period`, 10 s by
        default) and removes everything it made.

An image that cannot run here has a named stand-in (found by its name, without tag
or digest): LooseLeaf's image runs the binaries of --bin with the Dockerfile's ENV;
`nats` runs the venv's nats-server (through the file's entrypoint, if it has one);
MinIO runs moto, and MinIO's client job makes the bucket with one PUT (its `mc
admin` lines, the user and policy, have no stand-in: moto takes any login); the
OpenTelemetry collector and Jaeger are the caller's own OTLP receiver, which
listens on the bridge's address (the JSON's `bridge`); Prometheus runs Debian's
`prometheus` with the file's arguments. CPU, memory and process limits are not
imposed.
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
import threading
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
    "jaegertracing/jaeger": OTLP,
    "jaegertracing/all-in-one": OTLP,
    "prom/prometheus": PROMETHEUS,
}


def fail(msg: str) -> None:
    print(f"processes.py: {msg}", file=sys.stderr)
    sys.exit(1)


def yaml_load(text: str):
    """YAML as compose reads it: safe, plus the `!reset` and `!override` tags of
    override files (kept as the value they tag: what merging does with them is
    compose's business, the schema checks the value)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def tagged(loader: Loader, node: yaml.Node):
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        # the scalar's own type, as if it had no tag (`!reset null` is None)
        plain = yaml.ScalarNode(loader.resolve(yaml.ScalarNode, node.value, (True, False)), node.value)
        return loader.construct_object(plain, deep=True)

    Loader.add_constructor("!reset", tagged)
    Loader.add_constructor("!override", tagged)
    return yaml.load(text, Loader=Loader)  # a SafeLoader, with two tags more


def validate(compose: Path, schema: Path) -> None:
    import jsonschema

    doc = yaml_load(compose.read_text())
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


def load(compose_dir: Path, name: str = "compose.yaml") -> dict:
    """The file, interpolated as compose does it: the environment over the .env beside it."""
    doc = yaml_load((compose_dir / name).read_text())
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


def image_name(ref: str) -> str:
    """An image reference's name, without its digest and tag: `nats:2.11.4-alpine@sha256:…` is `nats`."""
    ref = ref.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]  # a registry's `host:port/` is not a tag
    return ref[: len(ref) - len(last)] + last.split(":", 1)[0]


DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")


def seconds(value, default: float) -> float:
    """A compose duration (`1m30s`, `10s`, `500ms`) in seconds; `default` if unset."""
    if value is None:
        return default
    text = str(value).strip()
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        fail(f"{value!r} is not a duration")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log, or why there are none."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.rstrip("\n").splitlines()[-lines:]) or "(the log is empty)"


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, "")) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def dependencies(service: dict) -> list[str]:
    deps = service.get("depends_on") or []
    return list(deps) if isinstance(deps, (list, dict)) else []


def conditions(service: dict) -> list[tuple[str, str]]:
    """(dependency, condition) for each `depends_on` entry; the list form means started."""
    deps = service.get("depends_on") or []
    if isinstance(deps, dict):
        return [(d, (spec or {}).get("condition", "service_started")) for d, spec in deps.items()]
    return [(d, "service_started") for d in deps]


class Check:
    """A service's `healthcheck`, with Docker's defaults."""

    def __init__(self, spec: dict) -> None:
        test = spec.get("test")
        self.test: list[str] = ["CMD-SHELL", test] if isinstance(test, str) else list(test or [])
        self.interval = seconds(spec.get("interval"), 30)
        self.timeout = seconds(spec.get("timeout"), 30)
        self.retries = int(spec.get("retries", 3))
        self.start_period = seconds(spec.get("start_period"), 0)
        self.disabled = bool(spec.get("disable")) or self.test[:1] == ["NONE"] or not self.test

    def deadline(self, started: float) -> float:
        """When Docker would have called the service unhealthy, had no check passed."""
        return started + self.start_period + self.retries * self.interval + self.timeout


# an HTTP probe from inside a namespace: exit 0 on 2xx (or on any answer with `any`)
PROBE = """
import sys, urllib.error, urllib.request
url, timeout, accept = sys.argv[1], float(sys.argv[2]), sys.argv[3]
try:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        sys.exit(0 if 200 <= r.status < 300 else f"{url} answered {r.status}")
except urllib.error.HTTPError as e:
    sys.exit(0 if accept == "any" else f"{url} answered {e.code}")
except OSError as e:
    sys.exit(f"{url}: {e}")
"""
# how often a healthcheck is tried here (Docker tries every start_interval, then
# interval: sooner only finds a service healthy sooner)
PROBE_EVERY = 0.5


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
        self.index = {name: i for i, name in enumerate(self.services, start=2)}
        # what each started service runs as, for its healthcheck: (env, user)
        self.runs_as: dict[str, tuple[dict[str, str], str | None]] = {}
        self.checks = {
            name: check
            for name, service in self.services.items()
            if not (check := Check(service.get("healthcheck") or {})).disabled
        }
        self.started_at: dict[str, float] = {}
        self.healthy: set[str] = set()
        self.completed: set[str] = set()
        self.next_probe: dict[str, float] = {}
        self.last_failure: dict[str, str] = {}
        self.reported: set[str] = set()
        self.reporting = threading.Lock()
        self.watching = threading.Event()

    # names of network things are at most 15 characters
    def ns(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def ip(self, *args: str) -> None:
        done = subprocess.run([IP, *args], capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def stand_in(self, name: str) -> str:
        image = image_name(self.services[name].get("image") or "")
        if image not in IMAGES:
            fail(f"service {name}: no stand-in for image {image!r}")
        return IMAGES[image]

    def network(self) -> None:
        self.ip("link", "add", f"{self.tag}br", "type", "bridge")
        self.links.append(f"{self.tag}br")
        self.ip("addr", "add", f"{self.bridge}/24", "dev", f"{self.tag}br")
        self.ip("link", "set", f"{self.tag}br", "up")
        hosts = ["127.0.0.1 localhost"]
        for name, i in self.index.items():
            # the collector and Jaeger are the caller's receiver, on the bridge
            self.ips[name] = self.bridge if self.stand_in(name) == OTLP else f"{self.subnet}.{i}"
            hosts.append(f"{self.ips[name]} {name}")
        for name, i in self.index.items():
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
                if not host.exists():
                    # Docker would mount an empty folder there
                    fail(f"service {name}: the volume's source {source} does not exist")
            else:  # a named volume
                host = self.work / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            out.append((target, str(host)))
        for secret in service.get("secrets") or []:
            key = secret if isinstance(secret, str) else secret["source"]
            target = key if isinstance(secret, str) else secret.get("target") or key
            if isinstance(secret, dict) and {"uid", "gid", "mode"} & secret.keys():
                print(f"processes.py: {name}: a file secret's uid, gid and mode are ignored", file=sys.stderr)
            spec = (self.doc.get("secrets") or {}).get(key) or fail(f"service {name}: no secret {key}")
            if "file" not in spec:
                fail(f"secret {key}: only a `file` secret has a stand-in")
            # compose bind-mounts the file itself: its owner and mode count (a `mode`
            # of the service's is ignored), its folder's do not
            source = (self.dir / spec["file"]).resolve()
            if not source.is_file():
                fail(f"service {name}: secret {key}'s file {spec['file']} is missing (scripts/compose-secrets)")
            copy = self.work / "secrets" / name / key
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy)
            owner = source.stat()
            os.chown(copy, owner.st_uid, owner.st_gid)
            out.append((target if target.startswith("/") else f"/run/secrets/{target}", str(copy)))
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
            text = re.sub(r"(?<![\w./-])" + re.escape(inside) + r"(?=$|[/:,\s;\"'])", here, text)
        return text

    def command(self, name: str, kind: str) -> list[str]:
        service = self.services[name]
        args = as_list(service.get("command"))
        if kind == LOOSELEAF:
            return [str(self.bin / args[0]), *args[1:]]
        if kind == NATS:
            # the file's entrypoint, if any, finds `nats-server` on PATH: the venv's
            entrypoint = as_list(service.get("entrypoint"))
            return [*entrypoint, *args] if entrypoint else [str(self.venv / "bin/nats-server"), *args]
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
        self.runs_as[name] = (env, user)
        if user:
            # what the image's USER owns there: its COPY --chown folders, and the
            # named volumes mounted on them (a new volume takes its folder's owner)
            uid, _, gid = user.partition(":")
            for _, here in mounts:
                if Path(here).is_dir() and (here.startswith(str(self.work / name)) or "/volumes/" in here):
                    os.chown(here, int(uid), int(gid or uid))
            argv = as_user(user, argv)
        # a PID namespace, so that nothing the service starts outlives it, and the
        # /dev/shm its container would have
        shm = shm_bytes(service.get("shm_size"))
        inner = f"mount -t tmpfs -o size={shm},mode=1777 shm /dev/shm && exec {shlex.join(argv)}"
        wrapped = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", inner]
        log = open(self.log(name), "wb")  # noqa: SIM115 (the process keeps it)
        self.procs[name] = subprocess.Popen(
            [IP, "netns", "exec", ns, *wrapped],
            env=env,
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started_at[name] = time.monotonic()

    def log(self, name: str) -> Path:
        return self.work / f"{name}.log"

    def make_bucket(self, name: str) -> None:
        """MinIO's client job: `mc mb local/BUCKET` against the S3 server it names."""
        self.mounts(name)  # its secrets and files are there
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

    # --- healthchecks and depends_on -------------------------------------------------

    def probe(self, name: str, check: Check) -> tuple[bool, str]:
        """Run the service's healthcheck once, in its namespace: (passed, why not)."""
        kind, (form, *argv) = self.stand_in(name), check.test
        ns = self.ns(self.index[name])
        if form not in ("CMD", "CMD-SHELL"):
            fail(f"service {name}: healthcheck test {check.test!r} is not CMD, CMD-SHELL or NONE")
        if form == "CMD-SHELL":
            argv = shlex.split(argv[0]) if argv else []
        program = Path(argv[0]).name if argv else ""
        if kind == LOOSELEAF and program.startswith("looseleaf"):
            env, user = self.runs_as[name]
            command = [str(self.bin / program), *argv[1:]]
            command = as_user(user, command) if user else command
        elif program in ("wget", "curl"):
            url = next((a for a in argv if a.startswith(("http://", "https://"))), None)
            if url is None:
                fail(f"service {name}: healthcheck {check.test!r} names no URL")
            # curl without --fail passes on any answer
            fails = program == "wget" or any(a == "--fail" or re.fullmatch(r"-[a-zA-Z]*f[a-zA-Z]*", a) for a in argv)
            env, command = {}, [sys.executable, "-c", PROBE, str(url), str(check.timeout), "2xx" if fails else "any"]
        elif kind == MINIO and argv[1:2] == ["ready"]:
            # `mc ready local`: mc's own `local` alias is http://localhost:9000
            url = "http://127.0.0.1:9000/minio/health/live"
            env, command = {}, [sys.executable, "-c", PROBE, url, str(check.timeout), "any"]
        else:
            fail(f"service {name}: no stand-in for healthcheck {check.test!r}")
            return False, ""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
        try:
            done = subprocess.run(
                [IP, "netns", "exec", ns, *command], env=env, capture_output=True, text=True, timeout=check.timeout
            )
        except subprocess.TimeoutExpired:
            return False, f"{shlex.join(argv)} took longer than {check.timeout:g} s"
        # its message on one line (an error's causes with it, no backtrace)
        said = (done.stderr or done.stdout).split("Stack backtrace:")[0]
        why = " ".join(line.strip() for line in said.splitlines() if line.strip())[:400]
        return done.returncode == 0, why or f"{shlex.join(argv)} exited {done.returncode}"

    def poll_health(self) -> None:
        """Try the due healthchecks of started services not healthy yet."""
        for name, check in self.checks.items():
            if name not in self.started_at or name in self.healthy:
                continue
            if time.monotonic() < self.next_probe.get(name, 0):
                continue
            passed, why = self.probe(name, check)
            if passed:
                self.healthy.add(name)
                continue
            self.last_failure[name] = why
            if time.monotonic() > check.deadline(self.started_at[name]):
                self.report(name, f"is unhealthy: its healthcheck never passed (last: {why})")
                fail(f"service {name} never became healthy: {why}")
            self.next_probe[name] = time.monotonic() + min(PROBE_EVERY, check.interval)

    def satisfied(self, name: str, dep: str, condition: str) -> bool:
        if dep not in self.services:
            fail(f"{name} depends on {dep}, which is not a service")
        if condition == "service_started":
            return dep in self.started_at or dep in self.completed
        if condition == "service_completed_successfully":
            return dep in self.completed
        if condition == "service_healthy":
            if dep not in self.checks:
                fail(f"{name} waits for {dep} to be healthy, and {dep} has no healthcheck")
            return dep in self.healthy
        fail(f"{name}: depends_on condition {condition!r} has no stand-in")
        return False

    def launch(self, name: str) -> None:
        kind = self.stand_in(name)
        if kind == OTLP:
            # the caller's receiver, there all along
            self.started_at[name] = time.monotonic()
            self.healthy.add(name)
        elif kind == MINIO_CLIENT:
            self.make_bucket(name)
            self.completed.add(name)
        else:
            self.start(name, self.ns(self.index[name]))

    def up(self) -> None:
        self.network()
        pending = start_order(self.services)
        while True:
            for name in list(pending):
                if all(self.satisfied(name, dep, cond) for dep, cond in conditions(self.services[name])):
                    pending.remove(name)
                    self.launch(name)
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    self.report(name, f"exited {proc.returncode} while the topology was starting")
                    fail(f"service {name} exited {proc.returncode} before every service was up")
            self.poll_health()
            if not pending and all(name in self.healthy for name in self.checks):
                break
            time.sleep(0.1)
        print(json.dumps({"bridge": self.bridge, "services": self.ips}), flush=True)

    # --- while it runs, and after -----------------------------------------------------

    def report(self, name: str, what: str) -> None:
        """Say on stderr, once, what became of a service, with the end of its log."""
        with self.reporting:
            if name in self.reported:
                return
            self.reported.add(name)
            print(f"processes.py: {name} {what}; the end of {self.log(name)}:", file=sys.stderr)
            print(tail(self.log(name)), file=sys.stderr, flush=True)

    def watch(self) -> threading.Thread:
        """Report each service that exits while the topology runs, as it does."""

        def run() -> None:
            while not self.watching.wait(0.5):
                for name, proc in list(self.procs.items()):
                    if proc.poll() is not None:
                        self.report(name, f"exited {proc.returncode} while the topology ran")

        self.watching.clear()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.procs.items() if p.poll() is not None]

    def report_dead(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                self.report(name, f"exited {proc.returncode}")

    def down(self) -> None:
        # a second SIGTERM must not stop the clean-up halfway
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.watching.set()
        # as compose stops them: a service before what it depends on, each given its
        # stop_grace_period between SIGTERM and SIGKILL
        running = [n for n in reversed(start_order(self.services)) if n in self.procs]
        while running:
            wave = [n for n in running if not any(n in dependencies(self.services[m]) for m in running)]
            wave = wave or running
            stopped_at = time.monotonic()
            for name in wave:
                signal_group(self.procs[name], signal.SIGTERM)
            for name in wave:
                grace = seconds(self.services[name].get("stop_grace_period"), 10)
                proc = self.procs[name]
                try:
                    proc.wait(timeout=max(0.1, stopped_at + grace - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"processes.py: {name} outlived its {grace:g} s grace: SIGKILL", file=sys.stderr)
                    signal_group(proc, signal.SIGKILL)
                    proc.wait()
            running = [n for n in running if n not in wave]
        for ns in self.namespaces:
            subprocess.run([IP, "netns", "delete", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for link in self.links:
            subprocess.run([IP, "link", "delete", link], capture_output=True)


def as_user(user: str, argv: list[str]) -> list[str]:
    """`argv` run as the image's USER (`uid[:gid]`)."""
    uid, _, gid = user.partition(":")
    return ["setpriv", f"--reuid={uid}", f"--regid={gid or uid}", "--clear-groups", "--", *argv]


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def up(args: argparse.Namespace) -> None:
    if os.geteuid() != 0 or not IP:
        fail("network namespaces need root and iproute2's `ip`")
    topology = Topology(args.compose_dir.resolve(), args.work.resolve(), args.bin.resolve(), args.venv.resolve())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        topology.up()
        topology.watch()
        sys.stdin.read()  # until the caller closes it (or dies)
    finally:
        topology.watching.set()
        dead = topology.dead()
        if dead:
            print(f"processes.py: exited before the end: {', '.join(dead)}", file=sys.stderr)
            topology.report_dead()
        topology.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate")
    v.add_argument("compose", type=Path)
    v.add_argument("schema", type=Path)
    c = sub.add_parser("config")
    c.add_argument("compose", type=Path)
    u = sub.add_parser("up")
    u.add_argument("compose_dir", type=Path)
    u.add_argument("--work", type=Path, required=True)
    u.add_argument("--bin", type=Path, required=True)
    u.add_argument("--venv", type=Path, required=True)
    args = parser.parse_args()
    if args.cmd == "validate":
        validate(args.compose, args.schema)
    elif args.cmd == "config":
        print(json.dumps(load(args.compose.parent, args.compose.name), indent=1))
    else:
        up(args)


if __name__ == "__main__":
    main()
