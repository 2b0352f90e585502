//! No orphans: a process that is killed outright (SIGKILL: nothing of it runs
//! after) leaves none of the processes it started behind, as /proc shows them.
//! A gpu-host leaves no zygote, spare or worker, not even a worker busy in a cell
//! (which reads nothing from its host meanwhile), nor what that cell started; a
//! `looseleaf up` (the embedded cluster a kernel runs too) leaves neither those
//! nor its nats-server, which it starts in a process group of its own.

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _};
use looseleaf_client::api::ExecStatus;
use looseleaf_client::Frontend;
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services, TestSession};
use looseleaf_test_support::{wait_for, LocalCluster};
use nix::sys::signal::Signal;

/// How long what a killed process started may take to go.
const GONE_WITHIN: Duration = Duration::from_secs(10);

/// A cell that starts a program and then runs on: its worker is busy, and the
/// program is the worker's child.
const BUSY_CELL: &str = "import subprocess, time\nsubprocess.Popen(['sleep', '600'])\ntime.sleep(600)";

/// A process as /proc/PID/stat shows it.
#[derive(Clone, Debug)]
struct Proc {
    comm: String,
    /// `R`, `S`, ...; `Z`: it exited, and its parent has not reaped it yet.
    state: char,
    ppid: u32,
    /// When it started (clock ticks after boot): tells a reused pid apart.
    start: u64,
}

fn stat(pid: u32) -> Option<Proc> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Proc {
        comm,
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        // field 22 of stat(5); `rest` starts at field 3
        start: fields.get(19)?.parse().ok()?,
    })
}

/// Whether `pid` is still the process `was` and has not exited.
fn still_running(pid: u32, was: &Proc) -> bool {
    stat(pid).is_some_and(|now| now.start == was.start && !matches!(now.state, 'Z' | 'X'))
}

/// Every running process below `root` (its children, theirs, ...), by pid.
fn running_below(root: u32) -> anyhow::Result<HashMap<u32, Proc>> {
    let mut children: HashMap<u32, Vec<(u32, Proc)>> = HashMap::new();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(pid) = entry?.file_name().to_string_lossy().parse::<u32>() else { continue };
        if let Some(p) = stat(pid) {
            children.entry(p.ppid).or_default().push((pid, p));
        }
    }
    let mut found = HashMap::new();
    let mut todo = vec![root];
    while let Some(parent) = todo.pop() {
        for (pid, p) in children.remove(&parent).unwrap_or_default() {
            todo.push(pid);
            if p.state != 'Z' {
                found.insert(pid, p);
            }
        }
    }
    Ok(found)
}

/// The processes below `root` once the busy cell's program runs there.
fn below_with_the_cells_program(root: u32) -> anyhow::Result<HashMap<u32, Proc>> {
    wait_for(Duration::from_secs(60), || {
        running_below(root).is_ok_and(|below| below.values().any(|p| p.comm == "sleep"))
    })
    .context("the cell's program never ran")?;
    running_below(root)
}

/// SIGKILL `pid`; returns those of `below` still running [`GONE_WITHIN`] after,
/// once killed too (so that a failing test leaves nothing behind either).
fn kill_and_see_who_stays(pid: u32, below: &HashMap<u32, Proc>) -> anyhow::Result<Vec<(u32, Proc)>> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL)?;
    // the bound is all that is timed: none of them may still run by then
    let _ = wait_for(GONE_WITHIN, || !below.iter().any(|(&child, p)| still_running(child, p)));
    let stayed: Vec<(u32, Proc)> =
        below.iter().filter(|&(&child, p)| still_running(child, p)).map(|(&child, p)| (child, p.clone())).collect();
    for (child, _) in &stayed {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*child as i32), Signal::SIGKILL);
    }
    Ok(stayed)
}

/// The pid of this process's child that was given `arg` on its command line.
fn child_given(arg: &Path) -> anyhow::Result<u32> {
    let me = std::process::id();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(pid) = entry?.file_name().to_string_lossy().parse::<u32>() else { continue };
        if stat(pid).is_none_or(|p| p.ppid != me) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        if cmdline.split(|&b| b == 0).any(|a| a == arg.as_os_str().as_bytes()) {
            return Ok(pid);
        }
    }
    bail!("no child of this process was given {}", arg.display())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_killed_outright_leaves_no_zygote_or_worker_behind() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    assert_eq!(s.run("a", "x = 1").await?.0, ExecStatus::Ok);
    let exec = s.fe.run(s.sid, "b", BUSY_CELL).await?.exec_id;
    s.events.started(exec).await?;

    let host = services.pid("host-0").context("host-0 is not running")?;
    let below = below_with_the_cells_program(host)?;
    // the zygote, the busy worker and its cell's program at least (spares too)
    assert!(below.len() >= 3, "{below:?}");
    let stayed = kill_and_see_who_stays(host, &below)?;
    assert!(stayed.is_empty(), "still running {GONE_WITHIN:?} after their host was killed: {stayed:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn looseleaf_up_killed_outright_leaves_no_process_it_started_behind() -> anyhow::Result<()> {
    let up = LocalCluster::start(Path::new(env!("CARGO_BIN_EXE_looseleaf")), 1)?;
    let pid = child_given(up.data_dir())?;
    let fe = Frontend::new(&up.url()).with_token(up.token());
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), false, false).await?;
    let events = Events::open(&fe, sid).await?;
    let mut s = TestSession { fe, cwd, sid, events };
    let exec = s.fe.run(s.sid, "a", BUSY_CELL).await?.exec_id;
    s.events.started(exec).await?;

    let below = below_with_the_cells_program(pid)?;
    // its nats-server (a process group of its own) and the embedded host's
    // zygote, busy worker and the cell's program at least
    assert!(below.values().any(|p| p.comm == "nats-server"), "{below:?}");
    assert!(below.len() >= 4, "{below:?}");
    let stayed = kill_and_see_who_stays(pid, &below)?;
    assert!(stayed.is_empty(), "still running {GONE_WITHIN:?} after `looseleaf up` was killed: {stayed:?}");
    // (dropping `up` reaps it)
    Ok(())
}
