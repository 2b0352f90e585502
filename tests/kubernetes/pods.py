#!/usr/bin/env python3
"""deploy/kubernetes as processes, where no cluster runs (ADR 62).

    pods.py render KUSTOMIZATION_DIR [--json]
        Print the resources the kustomization builds, as a YAML stream (or a
        JSON list), with the part of kustomize that deploy/kubernetes uses:
        `resources` (files, and folders of a kustomization of their own),
        `secretGenerator` and `configMapGenerator` (files and literals, with
        disableNameSuffixHash), `patches` (inline JSON 6902 add, remove, replace
        and test, on a target of kind and name), `namespace` and `images`
        (newName, newTag, digest). Anything else in a kustomization.yaml is an
        error naming it, as is a patch whose target matches nothing.

    pods.py validate DIR...
        Check every YAML file under each DIR but kustomization.yaml, and every
        kustomization's built output, with `kubernetes-validate --strict` against
        Kubernetes KUBE_VERSION. Any error fails; so does any warning but the one
        for KEDA's ScaledObject, whose schema is not Kubernetes'.

    pods.py up OVERLAY_DIR --work DIR --bin DIR --venv DIR [--nodes N]
        Start the built resources as processes. Each pod gets a network namespace
        on one bridge, with an /etc/hosts of every Service (`svc`, `svc.NS`,
        `svc.NS.svc`, `svc.NS.svc.cluster.local`, pointing at a ready pod behind
        it) and of each StatefulSet pod under its governing Service
        (`pod.svc...`). Each container gets a PID namespace and a mount namespace
        with its own /dev/shm (a Memory emptyDir's sizeLimit there, else 64 MiB),
        the command, arguments and environment the manifest gives it (`$(VAR)`
        expanded as the kubelet does; values, Secret and ConfigMap keys, the pod's
        name, namespace, IP and node; envFrom), its user and groups (runAsUser,
        runAsGroup, fsGroup, or the image's USER) and capabilities (drop and add,
        on the container runtime's default set; allowPrivilegeEscalation: false
        is no_new_privs) through setpriv. Volumes are folders under DIR:
        configMap, secret and projected files with their mode (and fsGroup's
        group and group-read, as the kubelet gives them), emptyDirs (0777), a
        folder per PersistentVolumeClaim shared by every pod that mounts it, and
        a claim per pod of a volumeClaimTemplate. Container paths are mapped to
        those folders in commands and environment; a /tmp emptyDir is the
        process's TMPDIR.
        Controllers: a StatefulSet's pods are NAME-0..N-1 (one after the other
        when OrderedReady), a Deployment's NAME-xxxxx, a DaemonSet's one per node
        (node-1..N, whose nodeSelector must match the node's hostname label), a
        Job's run to completion. Readiness probes (httpGet, tcpSocket) from the
        host to the pod's address make it Ready; liveness probes restart a
        container after failureThreshold failures; an exited container restarts
        after the kubelet's back-off, as its pod's restartPolicy says.
        Prints one JSON line when every pod has started,
        `{"bridge": IP, "pods": {pod: ip}, "services": {svc: ip}}`, then reads
        commands, one a line, from stdin:
            delete POD  SIGTERM, SIGKILL after terminationGracePeriodSeconds; its
                        controller starts a replacement, and the answer is
                        `{"deleted": POD, "replacement": NEW, "ip": IP}`
            ready       `{"ready": {pod: bool}}`
        and stops every pod, removing what it made, at stdin's end or SIGTERM.
        Logs: DIR/logs/POD.CONTAINER.log.

An image that cannot run here has a named stand-in: LooseLeaf's image runs the
binaries of --bin with the Dockerfile's ENV and USER (other commands from PATH);
`nats` runs the venv's nats-server; MinIO runs moto (MinIO's own health paths,
which moto lacks, are probed as TCP connects to its port), and MinIO's client
makes the bucket its script names with one PUT. Not done: resource limits,
seccomp, a read-only root filesystem, affinity and tolerations, Service virtual
IPs (a name points at one ready pod), PodDisruptionBudgets (read, not enforced).
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "compose"))
from processes import IP, free_subnet, image_config  # noqa: E402

KUBE_VERSION = "1.37.0"
# The stand-in of each image (by name, without registry, tag or digest).
LOOSELEAF, NATS, MINIO, MINIO_CLIENT = "looseleaf", "nats", "minio/minio", "minio/mc"
BINARIES = ("looseleaf", "looseleaf-frontend", "looseleaf-gpu-host", "looseleaf-planner", "looseleaf-store")
DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
# The container runtime's capabilities when a container neither drops nor adds (containerd's).
DEFAULT_CAPS = {
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID",
    "SETUID", "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
}  # fmt: skip
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass", "IngressClass", "RuntimeClass"}  # fmt: skip


def fail(msg: str) -> None:
    print(f"pods.py: {msg}", file=sys.stderr)
    sys.exit(1)


def load_yaml(path: Path) -> list[dict]:
    import yaml

    try:
        return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    except yaml.YAMLError as e:
        fail(f"{path}: {e}")
        return []


# --- kustomize, the part of it we use ----------------------------------------------

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
KUSTOMIZATION_KEYS |= {"secretGenerator", "configMapGenerator", "generatorOptions"}


def build(root: Path) -> list[dict]:
    """The resources of the kustomization in `root`, built as kustomize builds them."""
    path = root / "kustomization.yaml"
    if not path.exists():
        fail(f"{root}: no kustomization.yaml")
    (k,) = load_yaml(path) or [{}]
    unknown = sorted(set(k) - KUSTOMIZATION_KEYS)
    if unknown:
        fail(f"{path}: {', '.join(unknown)}: not implemented here (tests/kubernetes/pods.py)")
    resources: list[dict] = []
    for entry in k.get("resources") or []:
        target = root / entry
        if target.is_dir():
            resources += build(target)
        elif target.is_file():
            resources += load_yaml(target)
        else:
            fail(f"{path}: resource {entry} is neither a file nor a folder here")
    resources += generated(root, k)
    for p in k.get("patches") or []:
        apply_patch(resources, p, path)
    if k.get("namespace"):
        set_namespace(resources, k["namespace"], path)
    for image in k.get("images") or []:
        set_image(resources, image, path)
    order = {"Namespace": 0, "ConfigMap": 1, "Secret": 1, "PersistentVolumeClaim": 2, "Service": 3}
    return sorted(resources, key=lambda r: order.get(r.get("kind"), 4))


def generated(root: Path, k: dict) -> list[dict]:
    """secretGenerator and configMapGenerator: files (`KEY=PATH` or `PATH`) and literals."""
    options = k.get("generatorOptions") or {}
    out = []
    for kind, key in (("Secret", "secretGenerator"), ("ConfigMap", "configMapGenerator")):
        for gen in k.get(key) or []:
            extra = sorted(set(gen) - {"name", "files", "literals", "type", "options"})
            if extra:
                fail(f"{root}: {key} {gen.get('name')}: {', '.join(extra)}: not implemented here")
            if not {**options, **(gen.get("options") or {})}.get("disableNameSuffixHash"):
                fail(f"{root}: {key} {gen.get('name')}: name suffix hashes are not implemented here")
            data: dict[str, bytes] = {}
            for item in gen.get("files") or []:
                name, _, file = item.rpartition("=") if "=" in item else (Path(item).name, "", item)
                source = root / file
                if not source.is_file():
                    fail(f"{root}: {key} {gen['name']}: {file} is missing (scripts/kubernetes-secrets writes it)")
                data[name] = source.read_bytes()
            for item in gen.get("literals") or []:
                name, _, value = item.partition("=")
                data[name] = value.encode()
            res = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}}
            if kind == "Secret":
                res["type"] = gen.get("type", "Opaque")
                res["data"] = {n: base64.b64encode(v).decode() for n, v in data.items()}
            else:
                res["data"] = {n: v.decode() for n, v in data.items()}
            out.append(res)
    return out


def apply_patch(resources: list[dict], patch: dict, where: Path) -> None:
    """An inline JSON 6902 patch (add, remove, replace, test) on the resources its target names."""
    import yaml

    extra = sorted(set(patch) - {"target", "patch"})
    target = patch.get("target") or {}
    extra += sorted(set(target) - {"kind", "name", "namespace", "group", "version"})
    if extra or "patch" not in patch:
        fail(f"{where}: patches: only an inline `patch` with a target of kind and name here ({extra})")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        fail(f"{where}: patches: {target}: a strategic merge patch; only JSON 6902 patches here")
    hits = [r for r in resources if matches(r, target)]
    if not hits:
        fail(f"{where}: patches: nothing matches the target {target}")
    for res in hits:
        for op in ops:
            json_patch(res, op, f"{where}: {target.get('kind')}/{target.get('name')}")


def matches(res: dict, target: dict) -> bool:
    group, _, version = res.get("apiVersion", "").rpartition("/")
    meta = res.get("metadata") or {}
    return (
        target.get("kind", res.get("kind")) == res.get("kind")
        and target.get("name", meta.get("name")) == meta.get("name")
        and target.get("namespace", meta.get("namespace")) == meta.get("namespace")
        and target.get("group", group) == group
        and target.get("version", version) == version
    )


def json_patch(doc: dict, op: dict, where: str) -> None:
    kind, path = op.get("op"), op.get("path", "")
    if kind not in ("add", "remove", "replace", "test") or not path.startswith("/"):
        fail(f"{where}: {op}: only add, remove, replace and test with a path here")
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]
    node = doc
    for part in parents:
        node = step(node, part, where, path)
    if kind == "add" and isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), op["value"])
    elif kind == "add":
        node[last] = op["value"]
    else:
        current = step(node, last, where, path)
        if kind == "test" and current != op["value"]:
            fail(f"{where}: test {path}: {current!r} is not {op['value']!r}")
        if kind == "remove":
            del node[int(last) if isinstance(node, list) else last]
        if kind == "replace":
            node[int(last) if isinstance(node, list) else last] = op["value"]


def step(node, part: str, where: str, path: str):
    try:
        return node[int(part)] if isinstance(node, list) else node[part]
    except (KeyError, IndexError, ValueError, TypeError):
        fail(f"{where}: {path}: there is no {part!r} there")


def set_namespace(resources: list[dict], namespace: str, where: Path) -> None:
    for res in resources:
        meta = res.setdefault("metadata", {})
        if res.get("kind") == "Namespace" and meta.get("name") != namespace:
            fail(f"{where}: a Namespace {meta.get('name')} in a kustomization of namespace {namespace}")
        if res.get("kind") not in CLUSTER_SCOPED:
            meta["namespace"] = namespace


def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """An image reference as (name, tag, digest): a registry's `host:port/` is no tag."""
    ref, _, digest = ref.partition("@")
    head, _, last = ref.rpartition("/")
    name, _, tag = last.partition(":")
    return (f"{head}/{name}" if head else name), tag or None, digest or None


def set_image(resources: list[dict], image: dict, where: Path) -> None:
    if set(image) - {"name", "newName", "newTag", "digest"}:
        fail(f"{where}: images: {image}: only name, newName, newTag and digest here")
    for spec in pod_specs(resources):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            name, tag, digest = split_image(c.get("image", ""))
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            digest = image.get("digest", digest if "newTag" not in image else None)
            c["image"] = name + (f"@{digest}" if digest else f":{tag}" if tag else "")


def pod_specs(resources: list[dict]):
    for res in resources:
        template = (res.get("spec") or {}).get("template") or {}
        if "spec" in template:
            yield template["spec"]


def render(args: argparse.Namespace) -> None:
    import yaml

    resources = build(args.dir.resolve())
    print(json.dumps(resources) if args.json else yaml.safe_dump_all(resources, sort_keys=False), end="")


# --- validate ------------------------------------------------------------------------


def validate(args: argparse.Namespace) -> None:
    import yaml

    tool = Path(sys.executable).parent / "kubernetes-validate"
    files, built = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for root in args.dirs:
            for path in sorted(root.rglob("*.y*ml")):
                if path.name == "kustomization.yaml":
                    out = Path(tmp) / f"{len(built)}-{path.parent.name}.yaml"
                    out.write_text(yaml.safe_dump_all(build(path.parent), sort_keys=False))
                    built.append(out)
                    print(f"{out.name}: built from {path.parent}")
                else:
                    files.append(path)
        done = subprocess.run(
            [str(tool), "--strict", "-k", KUBE_VERSION, *map(str, files + built)], capture_output=True, text=True
        )
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.strip() and not line.startswith("INFO") and "kind ScaledObject with api version keda.sh/" not in line
    ]
    for line in problems:
        print(line, file=sys.stderr)
    if done.returncode != 0 or problems:
        fail(f"kubernetes-validate --strict -k {KUBE_VERSION}: {len(problems)} problem(s)")
    print(f"{len(files)} files and {len(built)} builds valid against Kubernetes {KUBE_VERSION}")


# --- what a pod's containers run ----------------------------------------------------


def quantity(value) -> int:
    """A Kubernetes quantity (`8Gi`, `500M`, `64Mi`, a number) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTE]i?|k)?", str(value).strip())
    if not m:
        fail(f"{value!r} is not a quantity")
    scale = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "E": 1e18}
    unit = m.group(2) or ""
    factor = 1024 ** ("KMGTE".index(unit[0]) + 1) if unit.endswith("i") else scale.get(unit, 1)
    return int(float(m.group(1)) * factor)


def stand_in(image: str) -> str:
    name = split_image(image)[0]
    name = re.sub(r"^([\w-]+\.[\w.-]+(:\d+)?|localhost(:\d+)?)/", "", name)  # a registry
    name = name.removeprefix("library/")
    if name.rsplit("/", 1)[-1] == LOOSELEAF:
        return LOOSELEAF
    if name in (NATS, MINIO, MINIO_CLIENT):
        return name
    fail(f"no stand-in for image {image!r}")
    return ""


EXPANSION = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` as the kubelet expands it in commands, arguments and env values:
    a variable it does not know stays as written, `$$` is `$`."""
    return EXPANSION.sub(lambda m: "$" if m.group() == "$$" else env.get(m.group(1), m.group()), text)


def mapped(text: str, mounts: list[tuple[str, str]]) -> str:
    """Container paths in `text` as the folders here that stand for them (in one pass:
    a folder here may lie under a container path, such as /tmp)."""
    if not mounts:
        return text
    here = dict(mounts)
    inside = "|".join(re.escape(p) for p in sorted(here, key=len, reverse=True))
    return re.sub(rf"(?<![\w./-])({inside})(?=$|[/:,\s\"'])", lambda m: here[m.group(1)], text)


def bucket_url(script: str) -> str:
    """MinIO's client job: the URL of the bucket its `mc mb ... ALIAS/BUCKET` makes."""
    made = re.search(r"mc mb\b.*?\b(\w+)/([\w.-]+)", script) or fail("the mc job makes no bucket (`mc mb`)")
    alias, bucket = made.groups()
    server = re.search(rf"MC_HOST_{alias}=\"?https?://(?:[^@\n]*@)?([\w.-]+):(\d+)", script) or re.search(
        rf"mc alias set {alias} https?://([\w.-]+):(\d+)", script
    )
    if not server:
        fail(f"the mc job names no server for alias {alias}")
    return f"http://{server.group(1)}:{server.group(2)}/{bucket}"


def make_bucket(args: argparse.Namespace) -> None:
    """The stand-in of MinIO's client, run in its pod: PUT the bucket until the server answers."""
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(args.url, method="PUT"), timeout=2)
            print(f"made {args.url}")
            return
        except OSError as e:
            if time.monotonic() > deadline:
                fail(f"could not make the bucket at {args.url}: {e}")
            time.sleep(0.5)


@dataclass
class Container:
    """One container of a pod: its process, restarts and probe results."""

    name: str
    spec: dict
    init: bool = False
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    stopping_since: float | None = None
    succeeded: bool = False
    ready: bool = False
    live_failures: int = 0
    ready_failures: int = 0
    next_probe: dict = field(default_factory=dict)
    probing: dict = field(default_factory=dict)


@dataclass
class Pod:
    name: str
    owner: tuple[str, str]
    spec: dict
    labels: dict
    node: str
    index: int
    ip: str
    subdomain: str | None = None
    claims: dict = field(default_factory=dict)
    containers: list[Container] = field(default_factory=list)
    terminating_since: float | None = None
    created: float = field(default_factory=time.monotonic)

    def ready(self) -> bool:
        main = [c for c in self.containers if not c.init]
        return self.terminating_since is None and all(c.ready for c in main)

    def grace(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))


POD_KEYS = {"containers", "initContainers", "volumes", "securityContext", "restartPolicy", "nodeSelector",
            "terminationGracePeriodSeconds", "automountServiceAccountToken", "enableServiceLinks", "affinity",
            "tolerations", "serviceAccountName"}  # fmt: skip
CONTAINER_KEYS = {"name", "image", "command", "args", "env", "envFrom", "ports", "readinessProbe", "livenessProbe",
                  "resources", "securityContext", "volumeMounts", "workingDir", "imagePullPolicy"}  # fmt: skip


class Cluster:
    """The bridge, the pods and their controllers; torn down by `down`."""

    def __init__(self, resources: list[dict], work: Path, bin_dir: Path, venv: Path, nodes: int) -> None:
        self.work, self.bin, self.venv = work, bin_dir, venv
        self.nodes = [f"node-{i}" for i in range(1, nodes + 1)]
        self.by_kind: dict[str, dict[str, dict]] = {}
        for res in resources:
            self.by_kind.setdefault(res["kind"], {})[res["metadata"]["name"]] = res
        self.tag = "llk" + secrets.token_hex(2)
        self.subnet = free_subnet()
        self.bridge = f"{self.subnet}.1"
        self.pods: dict[str, Pod] = {}
        self.next_index = 2
        self.links: list[str] = []
        self.hosts_text = ""
        self.hosts_current: set[str] = set()  # the pods whose /etc/hosts is hosts_text
        self.image_env, image_user = image_config(DOCKERFILE)
        self.image_user = image_user or "0"
        self.probes = ThreadPoolExecutor(max_workers=16)
        self.commands: queue.Queue[str | None] = queue.Queue()
        for kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            for res in self.by_kind.get(kind, {}).values():
                self.check_pod_spec(res)

    def check_pod_spec(self, res: dict) -> None:
        spec, what = res["spec"]["template"]["spec"], f"{res['kind']} {res['metadata']['name']}"
        unknown = sorted(set(spec) - POD_KEYS)
        if unknown:
            fail(f"{what}: {', '.join(unknown)}: not implemented here")
        if spec.get("enableServiceLinks") is not False:
            fail(f"{what}: service links are not implemented here: set enableServiceLinks: false")
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            unknown = sorted(set(c) - CONTAINER_KEYS)
            if unknown:
                fail(f"{what}: container {c['name']}: {', '.join(unknown)}: not implemented here")
            stand_in(c["image"])

    # --- the network ---------------------------------------------------------------

    def ip(self, *args: str) -> None:
        done = subprocess.run([IP, *args], capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def network(self) -> None:
        self.ip("link", "add", f"{self.tag}br", "type", "bridge")
        self.links.append(f"{self.tag}br")
        self.ip("addr", "add", f"{self.bridge}/24", "dev", f"{self.tag}br")
        self.ip("link", "set", f"{self.tag}br", "up")

    def attach(self, pod: Pod) -> None:
        ns, host_end, ns_end = f"{self.tag}-{pod.index}", f"{self.tag}h{pod.index}", f"{self.tag}c{pod.index}"
        self.ip("netns", "add", ns)
        self.ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        self.links.append(host_end)
        self.ip("link", "set", ns_end, "netns", ns)
        self.ip("link", "set", host_end, "master", f"{self.tag}br", "up")
        self.ip("-n", ns, "addr", "add", f"{pod.ip}/24", "dev", ns_end)
        self.ip("-n", ns, "link", "set", ns_end, "up")
        self.ip("-n", ns, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hostname").write_text(pod.name + "\n")
        (etc / "hosts").write_text("")

    def detach(self, pod: Pod) -> None:
        self.hosts_current.discard(pod.name)
        ns = f"{self.tag}-{pod.index}"
        subprocess.run([IP, "netns", "delete", ns], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        subprocess.run([IP, "link", "delete", f"{self.tag}h{pod.index}"], capture_output=True)

    def endpoints(self, service: dict) -> list[Pod]:
        selector = service["spec"].get("selector") or {}
        any_state = service["spec"].get("publishNotReadyAddresses", False)
        live = [p for p in self.pods.values() if p.terminating_since is None]
        chosen = [p for p in live if selector.items() <= p.labels.items() and (any_state or p.ready())]
        return sorted(chosen, key=lambda p: p.created)

    def service_ips(self) -> dict[str, str]:
        out = {}
        for name, service in self.by_kind.get("Service", {}).items():
            pods = self.endpoints(service)
            if pods:
                out[name] = pods[0].ip
        return out

    @staticmethod
    def names(name: str, namespace: str) -> str:
        return " ".join(
            [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]
        )

    def write_hosts(self) -> None:
        """Every pod's /etc/hosts, rewritten in place (the pods keep it open by inode) when it changes."""
        lines = ["127.0.0.1 localhost"]
        for name, ip in self.service_ips().items():
            namespace = self.by_kind["Service"][name]["metadata"].get("namespace", "default")
            lines.append(f"{ip} {self.names(name, namespace)}")
        for pod in self.pods.values():
            if pod.subdomain and pod.terminating_since is None:
                namespace = self.namespace(pod)
                lines.append(f"{pod.ip} {self.names(f'{pod.name}.{pod.subdomain}', namespace)}")
        text = "\n".join(lines) + "\n"
        if text != self.hosts_text:
            self.hosts_text, self.hosts_current = text, set()
        for pod in self.pods.values():
            if pod.name not in self.hosts_current:
                with open(Path("/etc/netns") / f"{self.tag}-{pod.index}" / "hosts", "r+") as f:
                    f.truncate(0)
                    f.write(text + f"{pod.ip} {pod.name}\n")
                self.hosts_current.add(pod.name)

    def namespace(self, pod: Pod) -> str:
        kind, name = pod.owner
        return self.by_kind[kind][name]["metadata"].get("namespace", "default")

    # --- volumes -------------------------------------------------------------------

    def source(self, kind: str, name: str, pod: Pod) -> dict[str, bytes]:
        res = self.by_kind.get(kind, {}).get(name) or fail(f"pod {pod.name}: no {kind} {name}")
        data = {k: base64.b64decode(v) for k, v in (res.get("data") or {}).items()} if kind == "Secret" else {}
        if kind == "ConfigMap":
            data = {k: v.encode() for k, v in (res.get("data") or {}).items()}
        data.update({k: v.encode() for k, v in (res.get("stringData") or {}).items()})
        return data

    def write_files(self, folder: Path, files: list[tuple[str, bytes, int]], fs_group: int | None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o755)
        for path, data, mode in files:
            target = folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            if fs_group is not None:  # the kubelet gives the files to fsGroup, readable by it
                os.chown(target, 0, fs_group)
                mode |= 0o440
            os.chmod(target, mode)

    def projected(self, volume: dict, pod: Pod) -> list[tuple[str, bytes, int]]:
        """The files of a configMap, secret or projected volume: (path, bytes, mode)."""
        kind = next(k for k in ("configMap", "secret", "projected") if k in volume)
        spec = volume[kind]
        sources = spec["sources"] if kind == "projected" else [{kind: spec}]
        default = spec.get("defaultMode", 0o644)
        files = []
        for src in sources:
            (what, ref), *_ = src.items()
            if what not in ("configMap", "secret"):
                fail(f"pod {pod.name}: projected {what}: not implemented here")
            data = self.source("Secret" if what == "secret" else "ConfigMap", ref.get("name") or ref["secretName"], pod)
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    fail(f"pod {pod.name}: {what} {ref.get('name') or ref.get('secretName')} has no key {item['key']}")
                files.append((item["path"], data[item["key"]], item.get("mode", ref.get("defaultMode", default))))
        return files

    def volumes(self, pod: Pod) -> dict[str, tuple[Path, dict]]:
        """Each volume of the pod as (the folder here, its spec)."""
        security = pod.spec.get("securityContext") or {}
        fs_group = security.get("fsGroup")
        out = {}
        for volume in pod.spec.get("volumes") or []:
            name = volume["name"]
            folder = self.work / "pods" / pod.name / "volumes" / name
            if {"configMap", "secret", "projected"} & set(volume):
                self.write_files(folder, self.projected(volume, pod), fs_group)
            elif "emptyDir" in volume:
                folder.mkdir(parents=True, exist_ok=True)
                os.chmod(folder, 0o777)
            elif "persistentVolumeClaim" in volume:
                folder = self.claim(volume["persistentVolumeClaim"]["claimName"], fs_group)
            else:
                fail(f"pod {pod.name}: volume {name}: {', '.join(set(volume) - {'name'})}: not implemented here")
            out[name] = (folder, volume)
        for template, claim in pod.claims.items():
            out[template] = (self.claim(claim, fs_group), {"persistentVolumeClaim": {"claimName": claim}})
        return out

    def claim(self, name: str, fs_group: int | None) -> Path:
        """A PersistentVolumeClaim's folder, shared by every pod that mounts it."""
        folder = self.work / "volumes" / name
        folder.mkdir(parents=True, exist_ok=True)
        if fs_group is not None:  # the kubelet makes the volume's root the group's
            os.chown(folder, os.stat(folder).st_uid, fs_group)
            os.chmod(folder, 0o2775)
        return folder

    # --- containers -----------------------------------------------------------------

    def user(self, pod: Pod, c: dict, kind: str) -> tuple[int, int, list[int]]:
        security = {**(pod.spec.get("securityContext") or {}), **(c.get("securityContext") or {})}
        image_uid, _, image_gid = (self.image_user if kind == LOOSELEAF else "0").partition(":")
        uid = int(security.get("runAsUser", image_uid))
        # without runAsGroup: the image's group for the image's user, else root's
        # (the images here have no /etc/passwd entry for another uid)
        gid = int(security.get("runAsGroup", 0 if "runAsUser" in security else image_gid or 0))
        if security.get("runAsNonRoot") and uid == 0:
            fail(f"pod {pod.name}: container {c['name']} has runAsNonRoot and would run as root")
        pod_security = pod.spec.get("securityContext") or {}
        groups = [g for g in [pod_security.get("fsGroup"), *pod_security.get("supplementalGroups", [])] if g]
        return uid, gid, groups

    def privileges(self, pod: Pod, c: dict, kind: str) -> list[str]:
        """setpriv's arguments for the container's user, groups and capabilities."""
        security = c.get("securityContext") or {}
        if security.get("privileged"):
            fail(f"pod {pod.name}: privileged containers are not implemented here")
        caps = security.get("capabilities") or {}
        dropped = {x.upper() for x in caps.get("drop") or []}
        kept = set() if "ALL" in dropped else DEFAULT_CAPS - dropped
        kept |= {x.upper() for x in caps.get("add") or []}
        uid, gid, groups = self.user(pod, c, kind)
        argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}"]
        argv += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
        argv += ["--inh-caps=-all", "--ambient-caps=-all"]
        argv += ["--bounding-set=" + ",".join(["-all", *sorted(f"+{x.lower()}" for x in kept)])]
        if security.get("allowPrivilegeEscalation") is False:
            argv.append("--no-new-privs")
        return [*argv, "--"]

    def mounts(self, pod: Pod, c: dict, volumes: dict, kind: str) -> list[tuple[str, str]]:
        """(path in the container, path here), longest first."""
        out = []
        for m in c.get("volumeMounts") or []:
            if m["name"] not in volumes:
                fail(f"pod {pod.name}: container {c['name']} mounts {m['name']}, which is no volume of the pod")
            if m["mountPath"] == "/dev/shm":
                continue
            here = volumes[m["name"]][0] / m.get("subPath", "")
            out.append((m["mountPath"].rstrip("/"), str(here)))
        if kind == LOOSELEAF:
            # the image's own folders, its user's (COPY --chown), where no volume covers them
            for inside in ("/run/looseleaf", "/home/looseleaf", "/notebooks", "/packages"):
                if not any(p == inside for p, _ in out):
                    here = self.work / "pods" / pod.name / "image" / c["name"] / inside.strip("/").replace("/", "-")
                    here.mkdir(parents=True, exist_ok=True)
                    os.chown(here, 10001, 10001)
                    out.append((inside, str(here)))
            out.append(("/opt/looseleaf/venv", str(self.venv)))
        return sorted(out, key=lambda m: -len(m[0]))

    def shm_size(self, c: dict, volumes: dict) -> int:
        for m in c.get("volumeMounts") or []:
            if m["mountPath"] == "/dev/shm":
                empty = volumes[m["name"]][1].get("emptyDir") or {}
                if empty.get("medium") != "Memory":
                    fail(f"a /dev/shm that is no Memory emptyDir ({m['name']}) is not implemented here")
                return quantity(empty.get("sizeLimit", "64Mi"))
        return 64 * 1024 * 1024

    def environment(self, pod: Pod, c: dict, kind: str) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME": pod.name}
        if kind == LOOSELEAF:
            env.update(self.image_env)
        for source in c.get("envFrom") or []:
            (what, ref), *_ = ((k, v) for k, v in source.items() if k != "prefix")
            data = self.source("Secret" if what == "secretRef" else "ConfigMap", ref["name"], pod)
            env.update({source.get("prefix", "") + k: v.decode() for k, v in data.items()})
        fields = {"metadata.name": pod.name, "metadata.namespace": self.namespace(pod)}
        fields |= {"status.podIP": pod.ip, "spec.nodeName": pod.node}
        for var in c.get("env") or []:
            ref = var.get("valueFrom")
            if ref is None:
                env[var["name"]] = expand(str(var.get("value", "")), env)
            elif "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                env[var["name"]] = fields.get(path) or fail(f"pod {pod.name}: fieldRef {path}: not implemented here")
            elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
                what = "secretKeyRef" if "secretKeyRef" in ref else "configMapKeyRef"
                key = ref[what]
                data = self.source("Secret" if what == "secretKeyRef" else "ConfigMap", key["name"], pod)
                env[var["name"]] = data[key["key"]].decode()
            else:
                fail(f"pod {pod.name}: env {var['name']}: {', '.join(ref)}: not implemented here")
        return env

    def command(self, pod: Pod, c: dict, kind: str, env: dict[str, str], mounts: list[tuple[str, str]]) -> list[str]:
        """The container's command and arguments, their container paths mapped to
        the folders here, run by its image's stand-in. (The stand-in's own paths
        are not mapped: a checkout under /tmp is not the pod's /tmp volume.)"""
        argv = [mapped(expand(a, env), mounts) for a in (c.get("command") or []) + (c.get("args") or [])]
        if kind == MINIO:
            address = argv[argv.index("--address") + 1] if "--address" in argv else ":9000"
            # moto, stopping on SIGTERM as MinIO does (a PID 1 without a handler ignores it)
            moto = "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0));"
            moto += " from moto.server import main; main()"
            return [str(self.venv / "bin/python"), "-c", moto, "-H", "0.0.0.0", "-p", address.rsplit(":", 1)[1]]
        if kind == MINIO_CLIENT:
            url = bucket_url(" ".join(argv))  # its host resolved in the pod, by its /etc/hosts
            return [sys.executable, str(Path(__file__).resolve()), "make-bucket", url]
        if not argv:
            fail(f"pod {pod.name}: container {c['name']} has no command (the image's own is not implemented here)")
        program = argv[0].rsplit("/", 1)[-1]
        if kind == LOOSELEAF and program in BINARIES:
            return [str(self.bin / program), *argv[1:]]
        if kind == NATS and program == "nats-server":
            return [str(self.venv / "bin/nats-server"), *argv[1:]]
        return [shutil.which(argv[0], path=env["PATH"]) or fail(f"pod {pod.name}: no {argv[0]} here"), *argv[1:]]

    def start(self, pod: Pod, container: Container) -> None:
        c = container.spec
        kind = stand_in(c["image"])
        volumes = self.volumes(pod)
        mounts = self.mounts(pod, c, volumes, kind)
        env = self.environment(pod, c, kind)
        argv = self.command(pod, c, kind, env, mounts)
        env = {k: mapped(v, mounts) for k, v in env.items()}
        tmp = dict(mounts).get("/tmp")
        if tmp and "TMPDIR" not in env:
            env["TMPDIR"] = tmp
        cwd = Path(mapped(c.get("workingDir", ""), mounts) or self.work / "pods" / pod.name)
        inner = f"mount -t tmpfs -o size={self.shm_size(c, volumes)},mode=1777 shm /dev/shm && exec "
        inner += shlex.join(self.privileges(pod, c, kind) + argv)
        wrapped = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", inner]
        log = self.work / "logs" / f"{pod.name}.{c['name']}.log"
        with open(log, "ab") as out:
            out.write(f"--- start {time.strftime('%H:%M:%S')}: {shlex.join(argv)}\n".encode())
            out.flush()
            container.proc = subprocess.Popen(
                [IP, "netns", "exec", f"{self.tag}-{pod.index}", *wrapped],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        container.started_at = time.monotonic()
        container.stopping_since = None
        container.live_failures = container.ready_failures = 0
        container.ready = False
        container.next_probe = {}

    # --- probes ---------------------------------------------------------------------

    def probe_once(self, pod: Pod, c: dict, probe: dict) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe and not (stand_in(c["image"]) == MINIO and "/minio/" in probe["httpGet"]["path"]):
            get = probe["httpGet"]
            url = f"http://{pod.ip}:{self.port(c, get['port'])}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as answer:
                    return 200 <= answer.status < 400
            except OSError:
                return False
        way = probe.get("tcpSocket") or probe.get("httpGet")
        if way is None:
            fail(f"pod {pod.name}: {', '.join(probe)}: only httpGet and tcpSocket probes here")
        try:
            socket.create_connection((pod.ip, self.port(c, way["port"])), timeout=timeout).close()
            return True
        except OSError:
            return False

    @staticmethod
    def port(c: dict, port) -> int:
        if isinstance(port, int):
            return port
        for p in c.get("ports") or []:
            if p.get("name") == port:
                return p["containerPort"]
        fail(f"container {c['name']} has no port named {port}")
        return 0

    def probe(self, pod: Pod, container: Container, which: str, now: float) -> None:
        """Start the container's `which` probe when it is due; count what the last one found."""
        probe = container.spec.get(which)
        if probe is None:
            if which == "readinessProbe":
                container.ready = True
            return
        running: Future | None = container.probing.get(which)
        if running is not None and running.done():
            ok = running.result()
            del container.probing[which]
            threshold = int(probe.get("failureThreshold", 3))
            if which == "readinessProbe":
                container.ready_failures = 0 if ok else container.ready_failures + 1
                container.ready = ok or (container.ready and container.ready_failures < threshold)
            else:
                container.live_failures = 0 if ok else container.live_failures + 1
                if container.live_failures >= threshold:
                    self.say(f"{pod.name}: {container.name} failed its liveness probe {threshold} times; restarting")
                    self.stop(container)
        if which in container.probing:
            return
        due = container.next_probe.get(which, container.started_at + float(probe.get("initialDelaySeconds", 0)))
        if now >= due:
            container.next_probe[which] = now + float(probe.get("periodSeconds", 10))
            container.probing[which] = self.probes.submit(self.probe_once, pod, container.spec, probe)

    # --- the kubelet's and the controllers' loop ----------------------------------------

    def say(self, text: str) -> None:
        print(f"pods.py: {text}", file=sys.stderr, flush=True)

    @staticmethod
    def stop(container: Container) -> None:
        if container.proc and container.proc.poll() is None and container.stopping_since is None:
            os.killpg(container.proc.pid, signal.SIGTERM)
            container.stopping_since = time.monotonic()
            container.next_start = 0.0

    def step_container(self, pod: Pod, container: Container, now: float) -> None:
        proc, policy = container.proc, pod.spec.get("restartPolicy", "Always")
        if proc is None or container.succeeded:
            if proc is None and now >= container.next_start:
                self.start(pod, container)
            return
        code = proc.poll()
        if code is None:
            if container.stopping_since is not None and now - container.stopping_since > pod.grace():
                os.killpg(proc.pid, signal.SIGKILL)
            elif container.stopping_since is None and not container.init:
                self.probe(pod, container, "readinessProbe", now)
                self.probe(pod, container, "livenessProbe", now)
            return
        container.ready = False
        if code == 0 and (container.init or policy != "Always"):
            container.succeeded = True
            return
        if policy == "Never":
            fail(f"pod {pod.name}: container {container.name} exited {code} (restartPolicy Never)")
        # the kubelet's back-off: 10 s, doubling to 5 min, forgotten after 10 min of running
        if now - container.started_at > 600:
            container.restarts = 0
        delay = min(300.0, 10.0 * 2**container.restarts) if container.stopping_since is None else 0.0
        container.restarts += 1
        container.next_start = now + delay
        container.proc = None
        self.say(f"{pod.name}: {container.name} exited {code}; starting it again in {delay:.0f} s")

    def step_pod(self, pod: Pod, now: float) -> None:
        if pod.terminating_since is not None:
            for c in pod.containers:
                if c.proc and c.proc.poll() is None:
                    self.stop(c)
                    if now - pod.terminating_since > pod.grace():
                        os.killpg(c.proc.pid, signal.SIGKILL)
            if all(c.proc is None or c.proc.poll() is not None for c in pod.containers):
                self.detach(pod)
                del self.pods[pod.name]
            return
        for c in pod.containers:
            if c.init and not c.succeeded:
                self.step_container(pod, c, now)
                return
        for c in pod.containers:
            if not c.init:
                self.step_container(pod, c, now)

    def new_pod(self, owner: dict, name: str, node: str, extra: dict | None = None) -> Pod:
        if self.next_index > 254:
            fail("more than 252 pods on one bridge")
        template = copy.deepcopy(owner["spec"]["template"])
        pod = Pod(
            name=name,
            owner=(owner["kind"], owner["metadata"]["name"]),
            spec=template["spec"],
            labels=(template.get("metadata") or {}).get("labels") or {},
            node=node,
            index=self.next_index,
            ip=f"{self.subnet}.{self.next_index}",
            **(extra or {}),
        )
        self.next_index += 1
        pod.containers = [Container(c["name"], c, init=True) for c in pod.spec.get("initContainers") or []]
        pod.containers += [Container(c["name"], c) for c in pod.spec["containers"]]
        self.pods[name] = pod
        self.attach(pod)
        self.say(f"{name}: created at {pod.ip} on {node}")
        return pod

    def owned(self, res: dict, include_terminating: bool = False) -> list[Pod]:
        owner = (res["kind"], res["metadata"]["name"])
        return [p for p in self.pods.values() if p.owner == owner and (include_terminating or not p.terminating_since)]

    def reconcile(self) -> None:
        """What the controllers do: the pods each one lacks, created."""
        for res in self.by_kind.get("StatefulSet", {}).values():
            name, spec = res["metadata"]["name"], res["spec"]
            for i in range(int(spec.get("replicas", 1))):
                if f"{name}-{i}" in self.pods:
                    continue
                earlier = [self.pods.get(f"{name}-{j}") for j in range(i)]
                parallel = spec.get("podManagementPolicy", "OrderedReady") == "Parallel"
                if parallel or all(p and p.ready() for p in earlier):
                    templates = [t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or []]
                    claims = {t: f"{t}-{name}-{i}" for t in templates}
                    extra = {"subdomain": spec.get("serviceName"), "claims": claims}
                    self.new_pod(res, f"{name}-{i}", self.nodes[i % len(self.nodes)], extra)
        for res in self.by_kind.get("Deployment", {}).values():
            for _ in range(int(res["spec"].get("replicas", 1)) - len(self.owned(res))):
                name = f"{res['metadata']['name']}-{secrets.token_hex(3)[:5]}"
                self.new_pod(res, name, self.nodes[len(self.pods) % len(self.nodes)])
        for res in self.by_kind.get("DaemonSet", {}).values():
            selector = res["spec"]["template"]["spec"].get("nodeSelector") or {}
            for node in self.nodes:
                if selector.items() <= {"kubernetes.io/hostname": node}.items():
                    if not any(p.node == node for p in self.owned(res)):
                        self.new_pod(res, f"{res['metadata']['name']}-{secrets.token_hex(3)[:5]}", node)
        for res in self.by_kind.get("Job", {}).values():
            if not self.owned(res, include_terminating=True) and not res.get("_done"):
                res["_done"] = True  # one pod; its restartPolicy restarts it in place
                self.new_pod(res, f"{res['metadata']['name']}-{secrets.token_hex(3)[:5]}", self.nodes[0])

    def advance(self) -> None:
        """One round of the controllers and the kubelet."""
        self.reconcile()
        self.write_hosts()  # a new pod's, before its containers start
        now = time.monotonic()
        for pod in list(self.pods.values()):
            self.step_pod(pod, now)
        self.write_hosts()

    def tick(self) -> None:
        self.advance()
        for line in iter(self.command_nowait, None):
            self.answer(line)

    def command_nowait(self) -> str | None:
        try:
            line = self.commands.get_nowait()
        except queue.Empty:
            return None
        if line is None:
            raise EOFError
        return line

    def answer(self, line: str) -> None:
        words = line.split()
        if words == ["ready"]:
            self.emit({"ready": {name: pod.ready() for name, pod in sorted(self.pods.items())}})
        elif len(words) == 2 and words[0] == "delete":
            self.emit(self.delete(words[1]))
        else:
            self.emit({"error": f"unknown command {line!r} (delete POD, ready)"})

    def delete(self, name: str) -> dict:
        """SIGTERM the pod's containers, and wait for its controller's replacement."""
        pod = self.pods.get(name)
        if pod is None or pod.terminating_since is not None:
            return {"error": f"no pod {name}"}
        pod.terminating_since = time.monotonic()
        self.say(f"{name}: deleted; its containers have {pod.grace():.0f} s to stop")
        before = set(self.pods)
        deadline = time.monotonic() + pod.grace() + 30
        while time.monotonic() < deadline:
            self.advance()
            fresh = [p for p in self.pods.values() if p.owner == pod.owner and p.name not in before]
            if self.pods.get(name) not in (None, pod):  # a StatefulSet's pod comes back by its name
                fresh.append(self.pods[name])
            if fresh:
                return {"deleted": name, "replacement": fresh[0].name, "ip": fresh[0].ip}
            time.sleep(0.1)
        return {"error": f"{name}: no replacement within {pod.grace() + 30:.0f} s"}

    @staticmethod
    def emit(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    def started(self) -> bool:
        return all(c.started_at for p in self.pods.values() for c in p.containers if not c.init)

    def up(self) -> None:
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.network()
        deadline = time.monotonic() + 120
        self.advance()
        while not self.started():
            time.sleep(0.1)
            self.advance()
            if time.monotonic() > deadline:
                fail("not every pod started within 120 s (see the logs)")
            time.sleep(0.1)
        pods = {name: pod.ip for name, pod in sorted(self.pods.items())}
        self.emit({"bridge": self.bridge, "pods": pods, "services": self.first_pods()})

    def first_pods(self) -> dict[str, str]:
        """Each Service's address: its first ready pod's, else its first pod's."""
        out = {}
        for name, service in self.by_kind.get("Service", {}).items():
            selector = service["spec"].get("selector") or {}
            pods = sorted(
                (p for p in self.pods.values() if selector.items() <= p.labels.items()),
                key=lambda p: (not p.ready(), p.created),
            )
            if pods:
                out[name] = pods[0].ip
        return out

    def run(self) -> None:
        def read() -> None:
            for line in sys.stdin:
                if line.strip():
                    self.commands.put(line.strip())
            self.commands.put(None)

        threading.Thread(target=read, daemon=True).start()
        try:
            while True:
                self.tick()
                time.sleep(0.1)
        except EOFError:
            return

    def down(self) -> None:
        # a second SIGTERM must not stop the clean-up halfway
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        now = time.monotonic()
        for pod in self.pods.values():
            if pod.terminating_since is None:
                pod.terminating_since = now
        while self.pods:
            for pod in list(self.pods.values()):
                self.step_pod(pod, time.monotonic())
            time.sleep(0.1)
        self.probes.shutdown(wait=False, cancel_futures=True)
        for link in self.links:
            subprocess.run([IP, "link", "delete", link], capture_output=True)


def up(args: argparse.Namespace) -> None:
    if os.geteuid() != 0 or not IP:
        fail("network namespaces need root and iproute2's `ip`")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(build(args.dir.resolve()), work, args.bin.resolve(), args.venv.resolve(), args.nodes)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster.up()
        cluster.run()
    finally:
        cluster.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("dir", type=Path)
    r.add_argument("--json", action="store_true", help="a JSON list instead of a YAML stream")
    sub.add_parser("validate").add_argument("dirs", type=Path, nargs="+")
    u = sub.add_parser("up")
    u.add_argument("dir", type=Path)
    u.add_argument("--work", type=Path, required=True)
    u.add_argument("--bin", type=Path, required=True)
    u.add_argument("--venv", type=Path, required=True)
    u.add_argument("--nodes", type=int, default=1)
    sub.add_parser("make-bucket").add_argument("url")
    args = parser.parse_args()
    {"render": render, "validate": validate, "up": up, "make-bucket": make_bucket}[args.cmd](args)


if __name__ == "__main__":
    main()
