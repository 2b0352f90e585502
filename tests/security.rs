//! Secure by default (ADR 52): `looseleaf up --users` with two users and default
//! flags runs each session's workers as a uid of its own, so an attacker's cell
//! finds nothing that grants anything (service secrets, the users file, the
//! bus), cannot read the victim's live worker, and draws its own random numbers;
//! and the bounds `up` sets (memory, processes, cell time) each fail a cell that
//! passes them, naming the bound, while the session goes on. Unprivileged, such a
//! cluster refuses to start and names the opt-out.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::Context as _;
use looseleaf_client::api::ExecStatus;
use looseleaf_client::Frontend;
use looseleaf_test_support::cluster::{Events, TestSession};
use looseleaf_test_support::LocalCluster;

const ALICE: &str = "alice-0123456789abcdef0123456789";
const MALLORY: &str = "mallory-0123456789abcdef01234567";

fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

/// A users file of alice and mallory, owner-only.
fn users_file(dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("users");
    std::fs::write(&path, format!("alice {ALICE}\nmallory {MALLORY}\n"))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(path)
}

/// A session of `token`'s user in a folder its uid may use (a deployment gives each
/// user their own).
async fn session(url: &str, token: &str, all_gpu: bool) -> anyhow::Result<TestSession> {
    let fe = Frontend::new(url).with_token(token);
    let cwd = tempfile::tempdir()?;
    std::fs::set_permissions(cwd.path(), std::fs::Permissions::from_mode(0o777))?;
    let sid = fe.create_session(&cwd.path().display().to_string(), all_gpu, false).await?;
    let events = Events::open(&fe, sid).await?;
    Ok(TestSession { fe, cwd, sid, events })
}

/// The attacker's cell: everything it can get at, as JSON. `needle_hex` is the
/// victim's secret (hex, so the attacker's own code never holds its bytes).
fn attack(needle_hex: &str, data_dir: &Path) -> String {
    let data_dir = data_dir.display();
    format!(
        r#"
import json, os, re, socket
secretish = re.compile(r"token|key|cred|secret|passw|nats|users", re.I)
found = {{"read": [], "listed": [], "memory": [], "nats": None, "store_write": None}}
me = os.getpid()
named = set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        args = open(f"/proc/{{pid}}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    # the paths this cluster's processes name (another test's cluster of one user
    # on this machine runs its cells as root, and its folders are its own affair)
    if not any(a.startswith(b"{data_dir}") for a in args):
        continue
    for a in args:
        a = a.decode(errors="replace")
        for part in [a] + a.split("=")[1:]:
            if part.startswith("/"):
                named.add(part)
def try_read(p):
    if os.access(p, os.X_OK):
        return  # a program (nats-server): named so, but no secret
    try:
        open(p, "rb").read(4096)
        found["read"].append(p)
    except OSError:
        pass
for p in sorted(named):
    if os.path.isdir(p):
        try:
            names = os.listdir(p)
            found["listed"].append(p)
        except OSError:
            names = []
        for n in names:
            q = os.path.join(p, n)
            if secretish.search(n) and os.path.isfile(q):
                try_read(q)
    elif secretish.search(os.path.basename(p)) and os.path.isfile(p):
        try_read(p)
    if os.path.isdir(p) and os.path.isfile(os.path.join(p, "manifest-key")):
        for n in ("manifest-key", "api-token", "nats-url"):
            try_read(os.path.join(p, n))
        try:
            open(os.path.join(p, "store", "forged"), "wb").write(b"x")
            found["store_write"] = True
        except OSError:
            found["store_write"] = False
needle = bytes.fromhex("{needle_hex}")
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == me:
        continue
    try:
        maps = open(f"/proc/{{pid}}/maps").read().splitlines()
        mem = open(f"/proc/{{pid}}/mem", "rb")
    except OSError:
        continue
    for line in maps:
        span, perms = line.split()[:2]
        if not perms.startswith("r"):
            continue
        lo, hi = (int(x, 16) for x in span.split("-"))
        try:
            mem.seek(lo)
            if needle in mem.read(min(hi - lo, 64 << 20)):
                found["memory"].append(pid)
                break
        except (OSError, ValueError, OverflowError):
            continue
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        args = open(f"/proc/{{pid}}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    # the cluster's own bus (its store under the data dir), not another test's
    ours = any(a.startswith(b"{data_dir}") for a in args)
    if args and args[0].endswith(b"nats-server") and b"-p" in args and ours:
        port = int(args[args.index(b"-p") + 1])
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.recv(4096)
        s.sendall(b'CONNECT {{"verbose":false,"pedantic":false}}\r\nPING\r\n')
        reply = b""
        try:
            while b"PONG" not in reply and b"-ERR" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except OSError:
            pass
        found["nats"] = reply.decode(errors="replace").strip()
print("FOUND", json.dumps(found))
"#
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_of_two_users_keeps_each_ones_work_from_the_other() -> anyhow::Result<()> {
    let bin = Path::new(env!("CARGO_BIN_EXE_looseleaf"));
    let dir = tempfile::tempdir()?;
    let users = users_file(dir.path())?;
    if !is_root() {
        eprintln!("not root: session uids are not tested here (the refusal is, below)");
        return Ok(());
    }
    let users_arg = users.display().to_string();
    let up = LocalCluster::start_with(bin, 1, &["--users", &users_arg])?;
    let url = up.url();

    // the victim holds a secret in her live CPU worker (never printed)
    let secret_hex = hex(&format!("s3cret-{}", uuid::Uuid::new_v4().simple()));
    let mut alice = session(&url, ALICE, false).await?;
    let code = format!("import os\nsecret = bytes.fromhex('{secret_hex}')\nprint('uid', os.getuid())");
    let (status, error, text) = alice.run("a", &format!("%%cpu\n{code}")).await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?} {text}");
    let (status, error, text) = alice.run("a2", "print(len(secret))").await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?} {text}");

    let mut mallory = session(&url, MALLORY, false).await?;
    let (status, error, text) = mallory.run("m", &format!("%%cpu\n{}", attack(&secret_hex, up.data_dir()))).await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?} {text}");
    let found = printed(&text);
    let found = found.lines().find_map(|l| l.strip_prefix("FOUND "));
    let found = found.ok_or_else(|| anyhow::anyhow!("the attack printed nothing: {text}"))?;
    let found: serde_json::Value = serde_json::from_str(found).with_context(|| format!("the attack printed {text}"))?;
    // the attack looked where it should: the data directory and the users file
    // are on `up`'s command line
    assert_eq!(found["read"], serde_json::json!([]), "a cell read service secrets: {found}");
    assert_eq!(found["memory"], serde_json::json!([]), "a cell read the victim's live worker: {found}");
    assert_eq!(found["store_write"], false, "a cell reached the store directory: {found}");
    let nats = found["nats"].as_str().unwrap_or_default();
    assert!(nats.contains("-ERR"), "the bus let a cell in without credentials: {nats}");

    // mallory's own token does not reach alice's session
    let as_mallory = Frontend::new(&url).with_token(MALLORY);
    assert!(as_mallory.run(alice.sid, "x", "print(secret)").await.is_err(), "mallory ran code in alice's session");

    // and each session draws its own random numbers
    let draw = "%%cpu\nimport numpy as np, random\nprint('draw', np.random.rand(), random.random())";
    let (_, _, a) = alice.run("d", draw).await?;
    let (_, _, m) = mallory.run("d", draw).await?;
    let pick = |t: &str| printed(t).lines().find(|l| l.starts_with("draw")).map(str::to_string);
    assert!(pick(&a).is_some() && pick(&a) != pick(&m), "the same draws: {a} / {m}");
    // while alice's session goes on
    let (status, _, text) = alice.run("a3", "print(len(secret))").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("39"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_past_each_bound_fails_naming_it_and_the_session_goes_on() -> anyhow::Result<()> {
    let bin = Path::new(env!("CARGO_BIN_EXE_looseleaf"));
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let limited = is_root() && cgroups.lines().any(|l| l.contains(":memory:") || l.starts_with("0::"));
    let memory = (600u64 << 20).to_string();
    let up = LocalCluster::start_with(
        bin,
        1,
        &["--worker-memory-bytes", &memory, "--worker-pids", "64", "--cell-timeout-s", "3"],
    )?;
    let fe = Frontend::new(&up.url()).with_token(up.token());
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), true, false).await?;
    let events = Events::open(&fe, sid).await?;
    let mut s = TestSession { fe, cwd, sid, events };
    assert_eq!(s.run("a", "x = 41").await?.0, ExecStatus::Ok);

    // a cell that only spins is stopped by the cell timeout
    let (status, error, _) = s.run("spin", "while True:\n    pass").await?;
    assert_ne!(status, ExecStatus::Ok);
    let error = error.unwrap_or_default();
    assert!(error.contains("cell timeout of 3s"), "{error}");
    let (status, error, text) = s.run("b", "print(x + 1)").await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?}");
    assert!(text.contains("42"), "{text}");

    if !limited {
        eprintln!("no cgroups to limit workers here: memory and processes are not tested");
        return Ok(());
    }
    let (status, error, _) = s.run("mem", "import numpy as np\nbig = np.ones(2 << 30, dtype=np.uint8)").await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("more memory than a worker may (600 MiB)"), "{error}");
    let fork_bomb = "import subprocess\ndef spawn():\n    kids = []\n    for _ in range(200):\n        \
                     kids.append(subprocess.Popen(['sleep', '30']))\nspawn()";
    let (status, error, _) = s.run("pids", fork_bomb).await?;
    assert_eq!(status, ExecStatus::Error);
    assert!(error.unwrap_or_default().contains("limit of 64 processes"));
    let (status, error, text) = s.run("c", "print('still here', x)").await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?}");
    assert!(text.contains("still here 41"), "{text}");
    Ok(())
}

#[test]
fn a_shared_cluster_refuses_what_would_expose_its_users() -> anyhow::Result<()> {
    let bin = Path::new(env!("CARGO_BIN_EXE_looseleaf"));
    let dir = tempfile::tempdir()?;
    let users = users_file(dir.path())?;
    let up = |users: &Path, as_nobody: bool, extra: &[&str]| -> anyhow::Result<std::process::Output> {
        let data = dir.path().join("data");
        let mut cmd = if as_nobody {
            let mut c = Command::new("setpriv");
            c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"]).arg(bin);
            c
        } else {
            Command::new(bin)
        };
        cmd.args(["up", "--virtual-gpus", "1", "--port", "0", "--data-dir"])
            .arg(&data)
            .arg("--users")
            .arg(users)
            .args(extra)
            .stdin(Stdio::null());
        Ok(cmd.output()?)
    };
    // a users file others can read is refused, naming the fix
    std::fs::set_permissions(&users, std::fs::Permissions::from_mode(0o644))?;
    let out = up(&users, false, &[])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("chmod 600"), "{err}");
    std::fs::set_permissions(&users, std::fs::Permissions::from_mode(0o600))?;

    // unprivileged, two users cannot have uids of their own: refused, naming the opt-out
    if is_root() && Command::new("setpriv").arg("--version").output().is_ok() {
        std::os::unix::fs::chown(&users, Some(65534), Some(65534))?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let out = up(&users, true, &[])?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("--insecure-shared-workers") && err.contains("not root"), "{err}");
    }
    Ok(())
}

/// What a cell printed (its outputs are JSON lines; streams carry `text`).
fn printed(outputs: &str) -> String {
    outputs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|o| o["text"].as_str().map(str::to_string))
        .collect()
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}
