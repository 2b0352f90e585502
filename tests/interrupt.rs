//! Stopping cells on a real cluster: the interrupt verb (KeyboardInterrupt in the
//! cell, the state a kernel keeps after it, queued cells aborted), a cell that
//! ignores it (killed with its children after the grace period, nothing committed,
//! its slot free), the cell timeout, an interrupt before any host claimed the run
//! (it never runs), and a CPU cell.

use std::time::Duration;

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_test_support::cluster::{bin_dir_of, Services, TestSession};
use uuid::Uuid;

/// Test-sized grace period and cell timeout.
async fn services(hosts: &[u32]) -> anyhow::Result<Services> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let env = [("LOOSELEAF_INTERRUPT_GRACE_S", "1".to_string()), ("LOOSELEAF_CELL_TIMEOUT_S", "10".to_string())];
    Services::start(&bin, hosts, &env).await
}

/// Whether process `pid` is gone (or a zombie no one reaped yet).
fn gone(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.is_empty() || stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'))
}

/// Wait until `exec` printed `marker` (its code is running, past the interrupt
/// that would stop it before its first line).
async fn printed(s: &mut TestSession, exec: Uuid, marker: &str) -> anyhow::Result<StreamItem> {
    let out = |i: &StreamItem| matches!(i, StreamItem::Output { exec_id, output, .. } if *exec_id == exec && output.to_json().to_string().contains(marker));
    s.events.until(out).await
}

fn after_revision(events: &[StreamItem], exec: Uuid) -> Option<u64> {
    events.iter().find_map(|i| match i {
        StreamItem::Done { exec_id, after_revision, .. } if *exec_id == exec => Some(*after_revision),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_gpu_cell_stops_as_in_a_kernel_and_one_that_ignores_it_is_killed() -> anyhow::Result<()> {
    let services = services(&[1]).await?;
    let mut s = services.session(true).await?;
    assert_eq!(s.run("a", "x = 1").await?.0, ExecStatus::Ok);

    // a running cell, and one queued behind it
    // it says it loops once y has changed, so that an interrupt sent at once still finds y > 0
    let loop_cell =
        "import time\ny = 0\nwhile True:\n    y += 1\n    if y == 1:\n        print('looping', flush=True)\n    time.sleep(0.01)";
    let exec = s.fe.run(s.sid, "b", loop_cell).await?.exec_id;
    let queued = s.fe.run(s.sid, "c", "print('queued cell ran')").await?.exec_id;
    printed(&mut s, exec, "looping").await?;
    let stopped = s.fe.interrupt(s.sid).await?;
    assert_eq!(stopped.interrupted, Some(exec));
    assert_eq!(stopped.aborted, vec![queued]);
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Error);
    assert!(error.as_deref().unwrap_or_default().contains("KeyboardInterrupt"), "{error:?}");
    assert!(s.events.text(exec).contains("KeyboardInterrupt"), "{}", s.events.text(exec));
    assert_eq!(s.events.outcome(queued).await?.0, ExecStatus::Aborted);
    // as in a kernel: what the cell did before the interrupt stays
    let (status, _, text) = s.run("d", "print(x, y > 0)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("1 True"), "{text}");
    assert!(!s.events.text(queued).contains("queued cell ran"));
    let committed = s.events.seen.iter().rev().find_map(|i| match i {
        StreamItem::Done { after_revision, .. } => Some(*after_revision),
        _ => None,
    });

    // a cell that ignores the interrupt, with a child process of its own; it says so
    // only once inside its `try`, so that an interrupt sent at once is ignored too
    let stubborn = "import subprocess, time\nx = 2\nchild = subprocess.Popen(['sleep', '300'])\n\
                    said = False\nwhile True:\n    try:\n        if not said:\n            \
                    print('child', child.pid, flush=True)\n            said = True\n        \
                    time.sleep(0.1)\n    except KeyboardInterrupt:\n        pass";
    let exec = s.fe.run(s.sid, "e", stubborn).await?.exec_id;
    let child = printed(&mut s, exec, "child").await?;
    let StreamItem::Output { output, .. } = child else { anyhow::bail!("no output") };
    let pid: u32 =
        output.to_json()["text"].as_str().unwrap_or_default().split_whitespace().nth(1).unwrap_or("0").parse()?;
    assert!(pid > 0 && !gone(pid), "the cell's child runs");
    s.fe.interrupt(s.sid).await?;
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("did not stop within") && error.contains("nothing it did was committed"), "{error}");
    assert_eq!(after_revision(&s.events.seen, exec), committed, "the killed cell committed nothing");
    looseleaf_test_support::wait_for(Duration::from_secs(10), || gone(pid))
        .map_err(|_| anyhow::anyhow!("the killed cell's child {pid} outlived it"))?;
    // its slot is free, and x is what was committed before it (1, not its 2)
    let (status, _, text) = s.run("f", "print(x)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains('1') && !text.contains('2'), "{text}");

    // the cell timeout (10 s here) interrupts a cell that runs on
    let (status, error, _) = s.run("g", "z = 3\nwhile True:\n    pass").await?;
    assert_eq!(status, ExecStatus::Error);
    let error = error.unwrap_or_default();
    assert!(error.contains("KeyboardInterrupt") && error.contains("cell timeout"), "{error}");
    let (status, _, text) = s.run("h", "print(z)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains('3'), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_interrupted_while_it_waits_for_a_slot_never_runs() -> anyhow::Result<()> {
    let services = services(&[1]).await?;
    // session a holds the only slot
    let mut a = services.session(true).await?;
    let busy = a.fe.run(a.sid, "a", "import time\nwhile True:\n    time.sleep(0.05)").await?.exec_id;
    a.events.started(busy).await?;

    // session b's cell waits for it, and is interrupted before any host claims it
    let mut b = services.session(true).await?;
    let marker = b.cwd.path().join("ran");
    let code = format!("open({:?}, 'w').close()", marker.display().to_string());
    let waiting = b.fe.run(b.sid, "b", &code).await?.exec_id;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopped = b.fe.interrupt(b.sid).await?;
    assert_eq!(stopped.interrupted, Some(waiting));
    let (status, error) = b.events.outcome(waiting).await?;
    assert_eq!(status, ExecStatus::Failed);
    assert!(error.unwrap_or_default().contains("interrupted before it started"));

    // the slot frees; b's interrupted cell still never runs, and b goes on
    a.fe.interrupt(a.sid).await?;
    assert_eq!(a.events.outcome(busy).await?.0, ExecStatus::Error);
    let (status, _, text) = b.run("c", "print('b goes on')").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("b goes on"), "{text}");
    assert!(!marker.exists(), "an interrupted cell ran after all");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_cpu_cell_keeps_the_session_cpu_worker_state() -> anyhow::Result<()> {
    let services = services(&[1]).await?;
    let mut s = services.session(false).await?;
    assert_eq!(s.run("a", "w = 6").await?.0, ExecStatus::Ok);
    let exec =
        s.fe.run(s.sid, "b", "import time\nv = 7\nprint('sleeping', flush=True)\ntime.sleep(300)").await?.exec_id;
    printed(&mut s, exec, "sleeping").await?;
    s.fe.interrupt(s.sid).await?;
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Error);
    assert!(error.unwrap_or_default().contains("KeyboardInterrupt"));
    let (status, error, text) = s.run("c", "print(w * v)").await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?} {text}");
    assert!(text.contains("42"), "{text}");
    // nothing to interrupt: nothing happens
    let idle = s.fe.interrupt(s.sid).await?;
    assert_eq!((idle.interrupted, idle.aborted.len()), (None, 0));
    Ok(())
}
