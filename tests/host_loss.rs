//! A gpu-host lost mid-cell (killed, or stopped with SIGTERM) on a real cluster:
//! the cell ends within seconds with one outcome saying what happened, the session
//! keeps its last committed state, and the next cell runs on the other host; a lost
//! host's CPU worker claim does not block the session's next CPU cell.

use std::time::Duration;

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::Event;
use looseleaf_test_support::cluster::{bin_dir_of, Services, TestSession};
use nix::sys::signal::Signal;
use uuid::Uuid;

/// The frontend takes a host for lost after this long without its status.
const HOST_LOST_S: &str = "3";

async fn services() -> anyhow::Result<Services> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    Services::start(&bin, &[1, 1], &[("LOOSELEAF_HOST_LOST_S", HOST_LOST_S.to_string())]).await
}

/// Start a cell that changes `x` and then sleeps; returns it once it runs, with
/// the index of its host.
async fn long_cell_running(s: &mut TestSession) -> anyhow::Result<(Uuid, usize)> {
    let exec = s.fe.run(s.sid, "b", "import time\nx = 0\ntime.sleep(120)").await?.exec_id;
    let host = s.events.claimed_by(exec).await?;
    s.events.started(exec).await?;
    Ok((exec, host))
}

/// Run `code` (it must succeed), then kill the host that ran it; its index.
async fn run_then_kill_its_host(services: &mut Services, s: &mut TestSession, code: &str) -> anyhow::Result<usize> {
    let exec = s.fe.run(s.sid, "a", code).await?.exec_id;
    let host = s.events.claimed_by(exec).await?;
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    services.signal_host(host, Signal::SIGKILL)?;
    Ok(host)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_killed_mid_cell_fails_the_cell_and_the_session_goes_on() -> anyhow::Result<()> {
    let mut services = services().await?;
    let mut s = services.session(true).await?;
    assert_eq!(s.run("a", "x = 41").await?.0, ExecStatus::Ok);

    let (exec, host) = long_cell_running(&mut s).await?;
    services.signal_host(host, Signal::SIGKILL)?;
    let started = std::time::Instant::now();
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains(&format!("host-{host}")) && error.contains("lost"), "{error}");
    assert!(error.contains("nothing the cell did was committed"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(60), "noticed after {:?}", started.elapsed());

    // the session keeps its last committed state (x = 41, not the lost cell's 0)
    // and the next cell runs on the other host
    let exec = s.fe.run(s.sid, "c", "print(x + 1)").await?.exec_id;
    let other = s.events.claimed_by(exec).await?;
    assert_ne!(other, host);
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    assert!(s.events.text(exec).contains("42"), "{}", s.events.text(exec));
    Ok(())
}

/// A host killed and started again at once under the same id is heard again
/// before it could be taken for silent; the new one does not know the cell, and
/// does not renew its claim: that ends the cell.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_restarted_under_its_id_mid_cell_fails_the_cell() -> anyhow::Result<()> {
    let mut services = services().await?;
    let mut s = services.session(true).await?;
    assert_eq!(s.run("a", "x = 41").await?.0, ExecStatus::Ok);

    let (exec, host) = long_cell_running(&mut s).await?;
    services.restart(&format!("host-{host}"))?;
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("claim on the cell was not renewed"), "{error}");
    let (status, _, text) = s.run("c", "print(x + 1)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("42"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_stopped_mid_cell_says_so_and_the_session_goes_on() -> anyhow::Result<()> {
    let mut services = services().await?;
    let mut s = services.session(true).await?;
    assert_eq!(s.run("a", "x = 41").await?.0, ExecStatus::Ok);

    let (exec, host) = long_cell_running(&mut s).await?;
    services.signal_host(host, Signal::SIGTERM)?;
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains(&format!("host-{host} stopped")), "{error}");
    // it exits on its own once its cells are ended
    assert!(services.wait_host(host)?.success(), "a stopped host exits cleanly");

    let (status, _, text) = s.run("c", "print(x + 1)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("42"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_hosts_cpu_worker_does_not_block_the_next_cpu_cell() -> anyhow::Result<()> {
    let mut services = services().await?;
    // not --all-gpu: plain cells run on the session's CPU worker
    let mut s = services.session(false).await?;
    let host = run_then_kill_its_host(&mut services, &mut s, "y = 5").await?;

    // the other host takes the CPU worker's claim over once it no longer hears the
    // lost one, and restores y from the committed state
    let exec = s.fe.run(s.sid, "b", "print(y * 2)").await?.exec_id;
    let other = s.events.claimed_by(exec).await?;
    assert_ne!(other, host);
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    assert!(s.events.text(exec).contains("10"), "{}", s.events.text(exec));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_needing_unsavable_state_of_a_lost_host_fails_at_once_naming_it() -> anyhow::Result<()> {
    let mut services = services().await?;
    let mut s = services.session(false).await?;
    // a generator cannot be saved: it lives only in the session's CPU worker
    run_then_kill_its_host(&mut services, &mut s, "g = (i for i in range(3))\nk = 7").await?;

    let started = std::time::Instant::now();
    let exec = s.fe.run(s.sid, "b", "print(next(g))").await?.exec_id;
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("variables g") && error.contains("is lost"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(45), "failed after {:?}, not at once", started.elapsed());

    // what was saved is still there, on the other host
    let (status, _, text) = s.run("c", "print(k * 6)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("42"), "{text}");
    Ok(())
}

/// A host cut off (stopped, not dead) while its cell runs is taken for lost and
/// the run reported failed; when it comes back and its cell finishes, its commit
/// is refused (the store fenced the run's revision when the frontend settled it),
/// so what the user was told stays what was committed.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_cut_off_mid_cell_cannot_commit_after_the_run_was_reported_failed() -> anyhow::Result<()> {
    let mut services = services().await?;
    let mut s = services.session(true).await?;
    assert_eq!(s.run("a", "x = 41").await?.0, ExecStatus::Ok);

    let exec = s.fe.run(s.sid, "b", "import time\nx = 0\ntime.sleep(8)\nprint('finished')").await?.exec_id;
    let host = s.events.claimed_by(exec).await?;
    s.events.started(exec).await?;
    services.signal_host(host, Signal::SIGSTOP)?;
    let (status, error) = s.events.outcome(exec).await?;
    services.signal_host(host, Signal::SIGCONT)?;
    assert_eq!(status, ExecStatus::Failed, "{error:?}");
    assert!(error.unwrap_or_default().contains("lost"));

    // the host wakes, its cell ends, and its save is refused: it says so
    let late = s
        .events
        .until(|i| {
            matches!(i, StreamItem::Event { exec_id, event: Event::Saved { .. } | Event::Failed { .. }, .. }
                if *exec_id == exec)
        })
        .await?;
    assert!(
        matches!(&late, StreamItem::Event { event: Event::Failed { .. }, .. }),
        "the late save must be refused: {late:?}"
    );
    let (status, _, text) = s.run("c", "print(x + 1)").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("42"), "the session keeps what was committed before the lost run: {text}");
    Ok(())
}
