//! Faults that heal, through the Jupyter kernel (ADR 31) as Jupyter clients use
//! it: the kernel's embedded nats-server is killed and the kernel starts it again
//! (same port, same JetStream store), so the next cell runs with no restart of the
//! kernel and sees what was committed before; a fault the kernel cannot heal (its
//! nats-server frozen) makes the cell an honest `error` reply, with the matching
//! `error` message, that never runs later; and once the server runs again, so do
//! the cells.

use crate::kernel::{install_as, python};

/// Drives the kernel with jupyter_client and prints one JSON line of what it saw:
/// each cell's reply and iopub messages, whether a new nats-server replaced the
/// killed one. The nats-servers are the kernel's children (from /proc).
const DRIVER: &str = r#"
import json
import os
import signal
import socket
import sys
import time

from jupyter_client.manager import start_new_kernel

TIMEOUT = 120


def run(kc, code):
    """Execute `code`: its reply's content and [msg_type, content] on iopub."""
    msg_id = kc.execute(code)
    outputs = []
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        if msg["msg_type"] != "status":
            outputs.append([msg["msg_type"], msg["content"]])
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            return {"reply": reply["content"], "outputs": outputs}


def nats_servers(parent):
    """The pids of the nats-servers `parent` started that still run."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        state, ppid = stat[stat.rfind(")") + 1 :].split()[:2]
        if comm == "nats-server" and int(ppid) == parent and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def listens(pid):
    """Whether the nats-server `pid` answers on its port (its `-p` argument)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode().split("\0")
        port = int(args[args.index("-p") + 1])
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.settimeout(2)
            return conn.recv(5) == b"INFO "
    except (OSError, ValueError, IndexError):
        return False


def state(pid):
    """The state letter of process `pid` in /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 1 :].split()[0]


def poll(what, timeout=60):
    """What `what()` returns once it is truthy, or None after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.1)
    return None


seen = {}
km, kc = start_new_kernel(kernel_name=sys.argv[1], startup_timeout=TIMEOUT)
try:
    kernel = km.provisioner.process.pid
    seen["before"] = run(kc, "x = 41\nprint('committed')")
    first = nats_servers(kernel)
    seen["servers"] = len(first)
    if len(first) == 1:
        os.kill(first[0], signal.SIGKILL)
        again = poll(lambda: [p for p in nats_servers(kernel) if p != first[0] and listens(p)])
        seen["restarted"] = again is not None
        seen["after_kill"] = run(kc, "print(x + 1)")
        if again:
            # a fault the kernel cannot heal: its nats-server frozen
            os.kill(again[0], signal.SIGSTOP)
            # stopped before the cell is sent (a thread in a syscall, an fsync
            # say, stops only when it returns): a cell the frozen server already
            # accepted would wait for it instead of failing
            poll(lambda: state(again[0]) == "T", timeout=10)
            try:
                seen["frozen"] = run(kc, "y = x + 1")
            finally:
                os.kill(again[0], signal.SIGCONT)
            seen["thawed"] = run(kc, "print(x + 1)\ntry:\n    y\nexcept NameError:\n    print('y was never set')")
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=False)  # a shutdown_request: the kernel stops its cluster
print(json.dumps(seen))
"#;

/// The text a cell printed on stdout.
fn stdout(run: &serde_json::Value) -> String {
    let outputs = run["outputs"].as_array().map(Vec::as_slice).unwrap_or_default();
    outputs
        .iter()
        .filter(|o| o[0] == "stream" && o[1]["name"] == "stdout")
        .filter_map(|o| o[1]["text"].as_str())
        .collect()
}

#[test]
fn a_kernel_heals_its_lost_nats_server_and_says_when_its_cluster_cannot_run_a_cell() -> anyhow::Result<()> {
    let prefix = tempfile::tempdir()?;
    // every cell serverless: each restores what it reads from the committed state
    install_as(prefix.path(), &["--name", "looseleaf-faults", "--all-gpu"])?;
    let work = tempfile::tempdir()?;
    let out = python(prefix.path())
        .args(["-c", DRIVER, "looseleaf-faults"])
        .current_dir(work.path())
        // a cluster of the kernel's own: its nats-server is the kernel's child
        .env("LOOSELEAF_OWN_CLUSTER", "true")
        // LOOSELEAF_TEST_LOG (e.g. "info") turns up the kernel's log to debug it
        .env("LOOSELEAF_LOG", std::env::var("LOOSELEAF_TEST_LOG").unwrap_or_else(|_| "warn".into()))
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "the kernel fault driver failed:\n{stderr}");
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())
        .map_err(|e| anyhow::anyhow!("the driver printed no JSON ({e}):\n{stderr}"))?;
    assert_eq!(seen["before"]["reply"]["status"], "ok", "{seen}");
    assert_eq!(seen["servers"], 1, "the kernel runs one nats-server of its own: {seen}");

    // killed: the kernel starts it again, and the next cell runs with what was committed
    assert_eq!(seen["restarted"], true, "the killed nats-server was not started again: {seen}\n{stderr}");
    assert_eq!(seen["after_kill"]["reply"]["status"], "ok", "{seen}\n{stderr}");
    assert_eq!(stdout(&seen["after_kill"]), "42\n", "{seen}");

    // frozen: the kernel cannot heal it, and the cell's reply says so
    let frozen = &seen["frozen"];
    let reply = &frozen["reply"];
    assert_eq!(reply["status"], "error", "a cell the cluster could not run replied {reply}");
    assert_eq!(reply["ename"], "LooseLeafError", "{reply}");
    assert!(reply["evalue"].as_str().is_some_and(|e| e.contains("not accepted")), "{reply}");
    assert!(reply["traceback"].as_array().is_some_and(|t| !t.is_empty()), "no traceback: {reply}");
    let errors: Vec<&serde_json::Value> =
        frozen["outputs"].as_array().into_iter().flatten().filter(|o| o[0] == "error").collect();
    assert_eq!(errors.len(), 1, "one error message on iopub: {frozen}");
    assert_eq!(errors[0][1]["ename"], reply["ename"], "{frozen}");
    assert_eq!(errors[0][1]["evalue"], reply["evalue"], "{frozen}");

    // thawed: the cells run again, and the one that failed never ran
    let thawed = &seen["thawed"];
    assert_eq!(thawed["reply"]["status"], "ok", "{thawed}\n{stderr}");
    assert_eq!(stdout(thawed), "42\ny was never set\n", "{thawed}");
    Ok(())
}
