//! A run reaches a host whatever else is away for a while, and runs once:
//! - services start in any order (compose starts them together; a restarted planner
//!   or host comes back while users work): a run sent while no planner listens, and
//!   its recipe while no gpu-host listens, wait for them instead of being dropped
//!   (`Bus::deliver`);
//! - a claims bucket that cannot be reached for longer than a leader election is not
//!   read as "another host holds it": the host tries the run again;
//! - a run or recipe lost in transit (with a NATS node, or a receiver that died
//!   holding it) is sent again until acknowledged, and a copy heard twice is
//!   planned and run once (ADR 46);
//! - what a cell prints and how it ends, sent while the frontend was cut off from
//!   NATS, reaches the client: hosts publish it to streams that confirm they keep
//!   it, and the frontend reads it back when it reconnects (ADR 55).

use std::time::Duration;

use nix::sys::signal::Signal;

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::Event;
use looseleaf_test_support::cluster::{bin_dir_of, Services, TestSession};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread")]
async fn a_run_sent_before_the_planner_and_hosts_listen_runs_once_they_do() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    services.kill("looseleaf-planner")?;
    services.kill("host-0")?;

    let exec = s.fe.run(s.sid, "a", "x = 6 * 7\nprint(x)").await?.exec_id;
    // the frontend sends at once; these gaps make it send while nothing listens,
    // then the planner send the recipe while no host does
    tokio::time::sleep(Duration::from_secs(2)).await;
    services.restart("looseleaf-planner")?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    services.restart("host-0")?;

    ran_once(&mut s, exec).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_claims_bucket_is_away_past_an_election_runs_once_it_is_back() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    let js = async_nats::jetstream::new(async_nats::connect(services.nats.url()).await?);
    js.delete_key_value(schemas::buckets::claims_bucket(&services.prefix)).await?;

    let exec = s.fe.run(s.sid, "a", "x = 6 * 7\nprint(x)").await?.exec_id;
    // longer than a claim retries through an election, so the host's claim fails
    tokio::time::sleep(schemas::buckets::LEADER_ELECTION + Duration::from_secs(3)).await;
    schemas::buckets::claims(&js, &services.prefix, 1).await?;
    ran_once(&mut s, exec).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_lost_with_the_planner_that_held_it_is_sent_again() -> anyhow::Result<()> {
    lost_with("looseleaf-planner").await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recipe_lost_with_the_host_that_held_it_is_sent_again() -> anyhow::Result<()> {
    lost_with("host-0").await
}

/// A run sent while `service` is frozen (it still listens: the message reaches it
/// and is never acknowledged), which then dies with it and comes back: the run
/// is sent again and runs once.
async fn lost_with(service: &str) -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    services.signal(service, Signal::SIGSTOP)?;
    let exec = s.fe.run(s.sid, "a", "x = 6 * 7\nprint(x)").await?.exec_id;
    tokio::time::sleep(Duration::from_secs(1)).await;
    services.restart(service)?;
    ran_once(&mut s, exec).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_heard_twice_is_planned_and_run_once() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    // frozen past two acknowledgement waits, each service then reads every copy
    // sent to it meanwhile
    services.signal("looseleaf-planner", Signal::SIGSTOP)?;
    let exec = s.fe.run(s.sid, "a", "x = 6 * 7\nprint(x)").await?.exec_id;
    tokio::time::sleep(schemas::bus::ACK_WAIT * 2 + Duration::from_millis(500)).await;
    services.signal("host-0", Signal::SIGSTOP)?;
    services.signal("looseleaf-planner", Signal::SIGCONT)?;
    tokio::time::sleep(schemas::bus::ACK_WAIT * 2 + Duration::from_millis(500)).await;
    services.signal("host-0", Signal::SIGCONT)?;
    ran_once(&mut s, exec).await?;
    let planned = s
        .events
        .seen
        .iter()
        .filter(|i| matches!(i, StreamItem::Event { exec_id, event: Event::Planned { .. }, .. } if *exec_id == exec))
        .count();
    assert_eq!(planned, 1, "the run was planned {planned} times");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn what_a_cell_sends_while_the_frontend_reconnects_is_read_back() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    let code = "print('before', flush=True)\nimport time\ntime.sleep(4)\nprint('after')\nraise ValueError('late')";
    let exec = s.fe.run(s.sid, "a", code).await?.exec_id;
    s.events.until(|i| matches!(i, StreamItem::Output { exec_id, .. } if *exec_id == exec)).await?;
    // NATS restarts while the frontend is frozen: its connection is gone, so it
    // hears nothing of the cell's end live (the host has reconnected by then)
    services.signal("looseleaf-frontend", Signal::SIGSTOP)?;
    services.nats.restart()?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    services.signal("looseleaf-frontend", Signal::SIGCONT)?;

    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Error, "the cell's own status, from its Finished event: {error:?}");
    assert!(error.as_deref().unwrap_or_default().contains("late"), "{error:?}");
    let text = s.events.text(exec);
    assert!(text.contains("before") && text.contains("after"), "outputs: {text}");
    assert_eq!(text.matches(r#""text":"after\n""#).count(), 1, "an output relayed twice: {text}");
    Ok(())
}

/// `exec` (a cell printing 42) ran once, and well.
async fn ran_once(s: &mut TestSession, exec: Uuid) -> anyhow::Result<()> {
    let (status, error) = s.events.outcome(exec).await?;
    assert_eq!(status, ExecStatus::Ok, "the cell failed: {error:?}");
    assert!(s.events.text(exec).contains("42"), "outputs: {}", s.events.text(exec));
    let claims = s
        .events
        .seen
        .iter()
        .filter(|i| matches!(i, StreamItem::Event { exec_id, event: Event::Claimed { .. }, .. } if *exec_id == exec))
        .count();
    assert_eq!(claims, 1, "the run was claimed {claims} times");
    Ok(())
}

/// With the save overlapping the stream's confirmation of what the cell printed
/// (ADR 69), a cell printing megabytes and then raising still ends in order: its
/// Finished event before its Saved, every output before its Done, with its own
/// error and all it printed. (The commit's wait for Finished is not observable
/// here: the frontend relays events in the order they reach it either way.)
#[tokio::test(flavor = "multi_thread")]
async fn a_cell_is_finished_before_it_is_saved_whatever_it_printed() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    let code =
        "x = 1\nfor i in range(3):\n    print(str(i) * 1_000_000, flush=True)\nraise ValueError('after the output')";
    for cell in ["a", "b"] {
        let exec = s.fe.run(s.sid, cell, code).await?.exec_id;
        let (status, error) = s.events.outcome(exec).await?;
        assert_eq!(status, ExecStatus::Error, "{error:?}");
        assert!(error.as_deref().unwrap_or_default().contains("after the output"), "{error:?}");
        let position = |want: fn(&Event) -> bool| {
            s.events
                .seen
                .iter()
                .position(|i| matches!(i, StreamItem::Event { exec_id, event, .. } if *exec_id == exec && want(event)))
        };
        let finished = position(|e| matches!(e, Event::Finished { .. })).expect("no Finished event");
        let saved = position(|e| matches!(e, Event::Saved { .. })).expect("no Saved event");
        assert!(finished < saved, "Saved (item {saved}) came before Finished (item {finished})");
        let last_output = s
            .events
            .seen
            .iter()
            .rposition(|i| matches!(i, StreamItem::Output { exec_id, .. } if *exec_id == exec))
            .expect("no output");
        let done = s
            .events
            .seen
            .iter()
            .position(|i| matches!(i, StreamItem::Done { exec_id, .. } if *exec_id == exec))
            .expect("no Done");
        assert!(last_output < done, "an output (item {last_output}) came after Done (item {done})");
        let text = s.events.text(exec);
        for digit in ["0", "1", "2"] {
            assert!(text.contains(&digit.repeat(1_000_000)), "the line of {digit}s is missing or cut");
        }
    }
    Ok(())
}
