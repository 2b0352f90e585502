//! Deleting a session while its cell runs: the cell stops and its GPU slot is free
//! at once, and nothing the cell would have saved brings the session back. A
//! session whose working directory is gone fails its cells saying so, without
//! delaying any other session's. A session culled for idleness loses its workers,
//! not its state.

use std::time::Duration;

use anyhow::Context as _;
use looseleaf_client::api::StreamItem;
use looseleaf_client::events::Event;
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services, TestSession};
use schemas::messages::{ManifestGetV2, ManifestV2};
use schemas::subjects::StoreVerb;
use schemas::Bus;

#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_session_stops_its_running_cell_and_frees_its_slot() -> anyhow::Result<()> {
    // one host with one slot: the next session's cell can only run once it is free
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    let fe = services.client();
    let dir = tempfile::tempdir()?;
    let cwd = dir.path().display().to_string();
    let sid = fe.create_session(&cwd, true, false).await?;
    let mut events = Events::open(&fe, sid).await?;
    let exec = fe.run(sid, "a", "import time\nx = 1\ntime.sleep(120)").await?.exec_id;
    events
        .until(|i| matches!(i, StreamItem::Event { exec_id, event: Event::Started { .. }, .. } if *exec_id == exec))
        .await?;
    fe.delete(sid).await?;

    let other = fe.create_session(&cwd, true, false).await?;
    let mut other_events = Events::open(&fe, other).await?;
    let started = std::time::Instant::now();
    let exec = fe.run(other, "b", "print('free')").await?.exec_id;
    other_events.done(exec).await?;
    assert!(other_events.text(exec).contains("free"), "{}", other_events.text(exec));
    assert!(started.elapsed() < Duration::from_secs(60), "the slot was freed after {:?}", started.elapsed());

    // the deleted session stays deleted
    let bus = Bus::connect(services.nats.url(), &services.prefix, "delete-test").await?;
    let get = ManifestGetV2 { session: sid, at_least: None };
    let m: ManifestV2 =
        bus.request(bus.subjects().store(StoreVerb::ManifestGet), &get, Duration::from_secs(10)).await?;
    assert_eq!(m.manifest.revision, 0, "nothing was committed to the deleted session");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_whose_directory_is_gone_fails_at_once_and_delays_no_one() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    let fe = services.client();
    let gone = tempfile::tempdir()?;
    let missing = gone.path().join("removed");
    let bad = fe.create_session(&missing.display().to_string(), true, false).await?;
    let mut bad_events = Events::open(&fe, bad).await?;
    let started = std::time::Instant::now();
    let exec = fe.run(bad, "a", "print(1)").await?.exec_id;
    let (status, error) = bad_events.outcome(exec).await?;
    assert_eq!(status, looseleaf_client::api::ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("working directory") && error.contains("removed"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(30), "the failure took {:?}", started.elapsed());

    let good = tempfile::tempdir()?;
    let sid = fe.create_session(&good.path().display().to_string(), true, false).await?;
    let mut events = Events::open(&fe, sid).await?;
    let exec = fe.run(sid, "a", "print('fine')").await?.exec_id;
    assert!(events.done(exec).await?.contains("fine"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_culled_session_stops_its_cpu_worker_and_reopens_with_its_state() -> anyhow::Result<()> {
    let env = [("LOOSELEAF_DETACH_UNWATCHED_S", "1".to_string())];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &env).await?;
    let mut s = services.session(false).await?;
    let exec = s.fe.run(s.sid, "a", "a = 41").await?.exec_id;
    assert_eq!(s.events.outcome(exec).await?.0, looseleaf_client::api::ExecStatus::Ok);
    let worker_of = |events: &Events, exec| {
        events.seen.iter().find_map(|i| match i {
            StreamItem::Event { exec_id, event: Event::Started { worker, .. }, .. } if *exec_id == exec => {
                Some(worker.clone())
            }
            _ => None,
        })
    };
    let first = worker_of(&s.events, exec).context("no start")?;
    // nobody watches it now: it is culled after a second of idleness
    let TestSession { fe, sid, cwd: _cwd, events } = s;
    drop(events);
    // the frontend sees the client gone at its next keep-alive (5 s), then the cull
    tokio::time::sleep(Duration::from_secs(8)).await;

    let mut events = Events::open(&fe, sid).await?;
    let exec = fe.run(sid, "b", "print(a + 1)").await?.exec_id;
    assert!(events.done(exec).await?.contains("42"), "its state stays: {}", events.text(exec));
    let second = worker_of(&events, exec).context("no start")?;
    assert_ne!(first, second, "the culled session's CPU worker was stopped; a fresh one restored its state");
    Ok(())
}
