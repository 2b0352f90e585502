//! A gpu-host lost mid-cell (killed, or stopped with SIGTERM) on a real cluster:
//! the cell ends within seconds with one outcome saying what happened, the session
//! keeps its last committed state, and the next cell runs on the other host; a lost
//! host's CPU worker claim does not block the session's next CPU cell.

use std::time::Duration;

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services};
use nix::sys::signal::Signal;
use schemas::messages::EventKind;
use uuid::Uuid;

/// The frontend takes a host for lost after this long without its status.
const HOST_LOST_S: &str = "3";

async fn services() -> anyhow::Result<Services> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    Services::start(&bin, &[1, 1], &[("LOOSELEAF_HOST_LOST_S", HOST_LOST_S.to_string())]).await
}

/// A session (every cell a GPU cell if `all_gpu`, no speculation) in a folder of
/// its own, and its event stream.
async fn session(
    services: &Services,
    all_gpu: bool,
) -> anyhow::Result<(looseleaf_client::Frontend, tempfile::TempDir, Uuid, Events)> {
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), all_gpu, false).await?;
    let events = Events::open(&fe, sid).await?;
    Ok((fe, cwd, sid, events))
}

/// The host (index in `host-{i}`) that claimed `exec`.
async fn claimed_by(events: &mut Events, exec: Uuid) -> anyhow::Result<usize> {
    let item = events
        .until(|i| matches!(i, StreamItem::Event { exec_id, kind: EventKind::Claimed { .. }, .. } if *exec_id == exec))
        .await?;
    let StreamItem::Event { kind: EventKind::Claimed { host, .. }, .. } = item else { anyhow::bail!("not claimed") };
    Ok(host.trim_start_matches("host-").parse()?)
}

/// Start a cell that changes `x` and then sleeps; returns it once it runs, with
/// the index of its host.
async fn long_cell_running(
    fe: &looseleaf_client::Frontend,
    events: &mut Events,
    sid: Uuid,
) -> anyhow::Result<(Uuid, usize)> {
    let exec = fe.run(sid, "b", "import time\nx = 0\ntime.sleep(120)").await?.exec_id;
    let host = claimed_by(events, exec).await?;
    events
        .until(|i| matches!(i, StreamItem::Event { exec_id, kind: EventKind::Started { .. }, .. } if *exec_id == exec))
        .await?;
    Ok((exec, host))
}

/// The Done item of `exec`: (status, error).
async fn done(events: &mut Events, exec: Uuid) -> anyhow::Result<(ExecStatus, Option<String>)> {
    match events.until(|i| matches!(i, StreamItem::Done { exec_id, .. } if *exec_id == exec)).await? {
        StreamItem::Done { status, error, .. } => Ok((status, error)),
        _ => anyhow::bail!("not done"),
    }
}

/// Run `code` as cell `cell` and wait for its outcome; its outputs' text.
async fn run(
    fe: &looseleaf_client::Frontend,
    events: &mut Events,
    sid: Uuid,
    cell: &str,
    code: &str,
) -> anyhow::Result<(ExecStatus, String)> {
    let exec = fe.run(sid, cell, code).await?.exec_id;
    let (status, _) = done(events, exec).await?;
    Ok((status, events.text(exec)))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_killed_mid_cell_fails_the_cell_and_the_session_goes_on() -> anyhow::Result<()> {
    let mut services = services().await?;
    let (fe, _cwd, sid, mut events) = session(&services, true).await?;
    let (status, _) = run(&fe, &mut events, sid, "a", "x = 41").await?;
    assert_eq!(status, ExecStatus::Ok);

    let (exec, host) = long_cell_running(&fe, &mut events, sid).await?;
    services.signal_host(host, Signal::SIGKILL)?;
    let started = std::time::Instant::now();
    let (status, error) = done(&mut events, exec).await?;
    assert_eq!(status, ExecStatus::Error);
    let error = error.unwrap_or_default();
    assert!(error.contains(&format!("host-{host}")) && error.contains("lost"), "{error}");
    assert!(error.contains("nothing the cell did was committed"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(60), "noticed after {:?}", started.elapsed());

    // the session keeps its last committed state (x = 41, not the lost cell's 0)
    // and the next cell runs on the other host
    let exec = fe.run(sid, "c", "print(x + 1)").await?.exec_id;
    let other = claimed_by(&mut events, exec).await?;
    assert_ne!(other, host);
    assert_eq!(done(&mut events, exec).await?.0, ExecStatus::Ok);
    assert!(events.text(exec).contains("42"), "{}", events.text(exec));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_stopped_mid_cell_says_so_and_the_session_goes_on() -> anyhow::Result<()> {
    let mut services = services().await?;
    let (fe, _cwd, sid, mut events) = session(&services, true).await?;
    assert_eq!(run(&fe, &mut events, sid, "a", "x = 41").await?.0, ExecStatus::Ok);

    let (exec, host) = long_cell_running(&fe, &mut events, sid).await?;
    services.signal_host(host, Signal::SIGTERM)?;
    let (status, error) = done(&mut events, exec).await?;
    assert_eq!(status, ExecStatus::Error);
    let error = error.unwrap_or_default();
    assert!(error.contains(&format!("host-{host} stopped")), "{error}");
    // it exits on its own once its cells are ended
    assert!(services.wait_host(host)?.success(), "a stopped host exits cleanly");

    let (status, text) = run(&fe, &mut events, sid, "c", "print(x + 1)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("42"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_hosts_cpu_worker_does_not_block_the_next_cpu_cell() -> anyhow::Result<()> {
    let mut services = services().await?;
    // not --all-gpu: plain cells run on the session's CPU worker
    let (fe, _cwd, sid, mut events) = session(&services, false).await?;
    let exec = fe.run(sid, "a", "y = 5").await?.exec_id;
    let host = claimed_by(&mut events, exec).await?;
    assert_eq!(done(&mut events, exec).await?.0, ExecStatus::Ok);
    services.signal_host(host, Signal::SIGKILL)?;

    // the other host takes the CPU worker's claim over once it no longer hears the
    // lost one, and restores y from the committed state
    let exec = fe.run(sid, "b", "print(y * 2)").await?.exec_id;
    let other = claimed_by(&mut events, exec).await?;
    assert_ne!(other, host);
    assert_eq!(done(&mut events, exec).await?.0, ExecStatus::Ok);
    assert!(events.text(exec).contains("10"), "{}", events.text(exec));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_needing_unsavable_state_of_a_lost_host_fails_at_once_naming_it() -> anyhow::Result<()> {
    let mut services = services().await?;
    let (fe, _cwd, sid, mut events) = session(&services, false).await?;
    // a generator cannot be saved: it lives only in the session's CPU worker
    let exec = fe.run(sid, "a", "g = (i for i in range(3))\nk = 7").await?.exec_id;
    let host = claimed_by(&mut events, exec).await?;
    assert_eq!(done(&mut events, exec).await?.0, ExecStatus::Ok);
    services.signal_host(host, Signal::SIGKILL)?;

    let started = std::time::Instant::now();
    let exec = fe.run(sid, "b", "print(next(g))").await?.exec_id;
    let (status, error) = done(&mut events, exec).await?;
    assert_eq!(status, ExecStatus::Error);
    let error = error.unwrap_or_default();
    assert!(error.contains("variables g") && error.contains("is lost"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(45), "failed after {:?}, not at once", started.elapsed());

    // what was saved is still there, on the other host
    let (status, text) = run(&fe, &mut events, sid, "c", "print(k * 6)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("42"), "{text}");
    Ok(())
}
