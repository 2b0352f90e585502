"""Drive LooseLeaf kernels on the user's local cluster (ADR 65) as Jupyter does,
and print one JSON line of what was seen (tests/local_cluster.rs asserts on it):

1. ten notebooks' kernels start at once: one cluster runs, and every kernel's
   cells run on it;
2. a kernel's restart (Jupyter's: a new process) is a fresh session on the same
   cluster;
3. the cluster is killed (its whole process group) under a live kernel: that
   kernel's next cell starts it again and still sees its variables;
4. the kernel and the cluster are both killed: a new kernel on the notebook
   starts the cluster again from the same data folder and resumes the session;
5. every kernel shut down, the cluster stops by itself (LOOSELEAF_IDLE_EXIT_S).

Usage: local_cluster_probe.py KERNEL_NAME RUNTIME_DIR USER_DIR
(with JUPYTER_PATH naming where the kernel is installed, and the environment
putting the local cluster in RUNTIME_DIR and USER_DIR)
"""

import asyncio
import json
import os
import signal
import sys
import time

from jupyter_client.manager import start_new_async_kernel

TIMEOUT = 300


def address(runtime):
    try:
        with open(os.path.join(runtime, "cluster.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def clusters(user_dir):
    """The pids of `looseleaf up --local` processes whose user folder is `user_dir`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"up" in argv and b"--local" in argv and f"LOOSELEAF_USER_DIR={user_dir}".encode() in env and state != "Z":
            found.append(int(pid))
    return found


# every kernel started, killed at the end whatever happened (a kernel left
# running would hold this process's stdout open)
STARTED = []


async def gone(pid):
    """Once process `pid` is dead (a zombie counts: its parent is not this one)."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except OSError:
            return
        await asyncio.sleep(0.05)


async def start(kernel_name, notebook):
    env = {**os.environ, "JPY_SESSION_NAME": notebook}
    km, kc = await start_new_async_kernel(kernel_name=kernel_name, startup_timeout=TIMEOUT, env=env)
    STARTED.append(km)
    return km, kc


def kill_kernels():
    for km in STARTED:
        process = getattr(km.provisioner, "process", None) if km.provisioner else None
        if process is not None and process.poll() is None:
            process.kill()


async def run(kc, code):
    """Execute `code`: its reply's status, and the text it wrote (stdout and stderr)."""
    text = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            text.append(msg["content"]["evalue"])

    reply = await kc.execute_interactive(code, output_hook=hook, timeout=TIMEOUT)
    return reply["content"]["status"], "".join(text)


async def main():
    kernel_name, runtime, user_dir = sys.argv[1:4]
    seen = {}

    # 1. ten notebooks at once
    kernels = await asyncio.gather(*(start(kernel_name, f"nb-{i}.ipynb") for i in range(10)))
    seen["first_address"] = address(runtime)
    seen["clusters_with_ten"] = len(clusters(user_dir))
    ran = await asyncio.gather(*(run(kc, f"x = {i}\nprint(x * 2)") for i, (_, kc) in enumerate(kernels)))
    seen["ten_ran"] = [[status, text.strip()] for status, text in ran]

    # 2. Jupyter's restart of kernel 0: a new process, a fresh session, the same cluster
    km, kc = kernels[0]
    kc.stop_channels()
    started = time.monotonic()
    await km.restart_kernel()
    seen["restart_s"] = time.monotonic() - started
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=TIMEOUT)
    kernels[0] = (km, kc)
    seen["after_restart"] = await run(kc, "print('x' in dir())")
    seen["address_after_restart"] = address(runtime)

    for other_km, other_kc in kernels[1:]:
        other_kc.stop_channels()
        await other_km.shutdown_kernel()

    # 3. the cluster killed under a live kernel: its next cell starts it again
    await run(kc, "xs = [1, 2, 3]")
    os.killpg(seen["first_address"]["pid"], signal.SIGKILL)
    await gone(seen["first_address"]["pid"])
    seen["after_cluster_killed"] = await run(kc, "print(sum(xs))")
    seen["second_address"] = address(runtime)

    # 4. the kernel and the cluster both killed: a new kernel on the notebook resumes
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    await km.provisioner.wait()
    kc.stop_channels()
    os.killpg(seen["second_address"]["pid"], signal.SIGKILL)
    await gone(seen["second_address"]["pid"])
    km, kc = await start(kernel_name, "nb-0.ipynb")
    seen["after_both_killed"] = await run(kc, "print(sum(xs))")
    seen["third_address"] = address(runtime)

    # 5. the last kernel shut down: the cluster stops by itself
    kc.stop_channels()
    await km.shutdown_kernel()
    pid = seen["third_address"]["pid"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and clusters(user_dir):
        await asyncio.sleep(0.2)
    seen["clusters_after_idle"] = len(clusters(user_dir))
    seen["address_after_idle"] = address(runtime)
    seen["idle_exited_pid"] = pid
    print(json.dumps(seen))


try:
    asyncio.run(main())
finally:
    kill_kernels()
