//! Edit-time speculation through the four services (issue 6): workers prepared
//! from edits, updated in place, refreshed at Run, never running the cell; the
//! budget and eviction order with more typing sessions than slots.

use std::time::Duration;

use looseleaf_client::api::StreamItem;
use looseleaf_client::events::{Event, Prepare, PreparedClass, PreparedOutcome};
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services, WAIT};
use schemas::messages::{HostStatusV2, WorkerState, WorkerStatus};
use schemas::Bus;
use uuid::Uuid;

fn services_bin() -> std::path::PathBuf {
    bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"))
}

/// Wait for a Ready of `cell` at `revision` or later; returns (worker, revision).
async fn ready(events: &mut Events, cell: &str, revision: u64) -> anyhow::Result<(String, u64)> {
    let item = events
        .until(|i| matches!(i, StreamItem::Event { event: Event::Ready { cell_id, revision: r, .. }, .. } if cell_id == cell && *r >= revision))
        .await?;
    match item {
        StreamItem::Event { event: Event::Ready { worker, revision, .. }, .. } => Ok((worker, revision)),
        _ => unreachable!("matched above"),
    }
}

/// The Started event of `exec` seen so far: (prepare, refreshed, worker).
fn started(events: &Events, exec: Uuid) -> Option<(Prepare, u32, String)> {
    events.seen.iter().find_map(|i| match i {
        StreamItem::Event { exec_id, event: Event::Started { prepare, refreshed, worker, .. }, .. }
            if *exec_id == exec =>
        {
            Some((*prepare, *refreshed, worker.clone()))
        }
        _ => None,
    })
}

/// Outcomes of the PreparedEnded events seen for `cell`.
fn ended(events: &Events, cell: &str) -> Vec<PreparedOutcome> {
    events
        .seen
        .iter()
        .filter_map(|i| match i {
            StreamItem::Event { event: Event::PreparedEnded { cell_id, outcome, .. }, .. } if cell_id == cell => {
                Some(*outcome)
            }
            _ => None,
        })
        .collect()
}

/// Wait until a host reports a worker of `sid` for which `pred` holds.
async fn worker_where(
    services: &Services,
    sid: Uuid,
    pred: impl Fn(&WorkerStatus) -> bool,
) -> anyhow::Result<WorkerStatus> {
    let bus = Bus::connect(services.nats.url(), &services.prefix, "lifecycle-test").await?;
    let mut statuses = bus.subscribe::<HostStatusV2>(bus.subjects().all_host_status()).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let Ok(Some(item)) = tokio::time::timeout_at(deadline, statuses.next()).await else {
            anyhow::bail!("no host reported the worker of session {sid} that the test waits for");
        };
        if let Some(w) = item.ok().and_then(|env| env.msg.workers.into_iter().find(|w| w.session == sid && pred(w))) {
            return Ok(w);
        }
    }
}

/// Wait until a host status no longer lists `worker` (it was stopped).
async fn worker_gone(services: &Services, worker: &str) -> anyhow::Result<()> {
    let bus = Bus::connect(services.nats.url(), &services.prefix, "lifecycle-test").await?;
    let mut statuses = bus.subscribe::<HostStatusV2>(bus.subjects().all_host_status()).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, statuses.next()).await {
            Ok(Some(Ok(env))) if env.msg.workers.iter().all(|w| w.id != worker) => return Ok(()),
            Ok(Some(_)) => {}
            _ => anyhow::bail!("worker {worker} is still listed by its host"),
        }
    }
}

fn sigkill(pid: u32) -> anyhow::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)?;
    Ok(())
}

#[actix_rt::test]
async fn prepared_workers_never_run_the_cell_and_follow_the_session() -> anyhow::Result<()> {
    let services = Services::start(&services_bin(), &[2], &[]).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), false, true).await?;
    let mut events = Events::open(&fe, sid).await?;

    // a large variable makes preparation take a while
    let r = fe.run(sid, "c0", "%%cpu\nimport numpy as np\nbig = np.ones(25_000_000)\nx = 1").await?;
    events.done(r.exec_id).await?;

    // A variable redefined by a CPU cell between preparation and Run is refreshed.
    fe.edit(sid, "c1", "%%gpu\nprint('x is', x)").await?;
    let (w1, _) = ready(&mut events, "c1", 1).await?;
    let r2 = fe.run(sid, "c2", "%%cpu\nx = 2").await?;
    events.done(r2.exec_id).await?;
    let r1 = fe.run(sid, "c1", "%%gpu\nprint('x is', x)").await?;
    let out = events.done(r1.exec_id).await?;
    assert!(out.contains("x is 2"), "{out}");
    let (prepare, refreshed, worker) = started(&events, r1.exec_id).expect("c1 started");
    assert_eq!((prepare, worker.as_str()), (Prepare::Speculative, w1.as_str()));
    assert!(refreshed >= 1, "x changed after preparation, so Run refreshed it");

    // Preparation never executes the cell: prepared again and again while its text
    // changes, a cell that appends a line leaves exactly one.
    // (each step changes the closure, so each gives a new recipe)
    let base = "%%gpu\nwith open('appended.txt', 'a') as f:\n    f.write('one line\\n')";
    let cell = format!("{base}\nprint(x + 1)");
    let mut revision = 0;
    for text in
        [base.to_string(), format!("{base}\nprint(x, big.shape)"), format!("{base}\nprint(big.size)"), cell.clone()]
    {
        fe.edit(sid, "c3", &text).await?;
        revision = ready(&mut events, "c3", revision + 1).await?.1;
    }
    assert_eq!(revision, 4, "the prepared worker followed every edit");
    assert!(!cwd.path().join("appended.txt").exists(), "preparation ran the cell");
    let r3 = fe.run(sid, "c3", &cell).await?;
    let out = events.done(r3.exec_id).await?;
    assert!(out.contains('3'), "{out}");
    assert_eq!(started(&events, r3.exec_id).map(|s| s.0), Some(Prepare::Speculative));
    assert_eq!(std::fs::read_to_string(cwd.path().join("appended.txt"))?, "one line\n");

    // A recipe that changes while its worker prepares: the same worker is updated in
    // place to the newer recipe, and the run finds it clean.
    fe.edit(sid, "c4", "%%gpu\ns = big.sum()").await?;
    tokio::time::sleep(Duration::from_millis(150)).await; // past the planner's debounce
    fe.edit(sid, "c4", "%%gpu\ns = big.sum() + x\nprint(s)").await?;
    let (first, _) = ready(&mut events, "c4", 1).await?;
    let (last, rev) = ready(&mut events, "c4", 2).await?;
    assert_eq!(first, last, "updated in place, not forked again");
    assert_eq!(rev, 2);
    let r4 = fe.run(sid, "c4", "%%gpu\ns = big.sum() + x\nprint(s)").await?;
    let out = events.done(r4.exec_id).await?;
    assert!(out.contains("25000002"), "{out}");
    let (prepare, refreshed, worker) = started(&events, r4.exec_id).expect("c4 started");
    assert_eq!((prepare, refreshed, worker), (Prepare::Speculative, 0, last));
    assert_eq!(ended(&events, "c4"), [PreparedOutcome::Used]);
    // no closure here has GPU-resident state: every worker was prepared without a
    // GPU slot, so typing cost no GPU time
    let slots: Vec<Option<u32>> = events
        .seen
        .iter()
        .filter_map(|i| match i {
            StreamItem::Event { event: Event::Ready { slot, .. }, .. } => Some(*slot),
            _ => None,
        })
        .collect();
    assert!(slots.len() >= 7 && slots.iter().all(Option::is_none), "{slots:?}");
    Ok(())
}

#[actix_rt::test]
async fn more_typing_sessions_than_slots_stay_within_the_budget() -> anyhow::Result<()> {
    // one host with one slot; a budget of one prepared worker per
    // host; prepared workers hold the slot (as those with GPU-resident state do)
    let services = Services::start(
        &services_bin(),
        &[1],
        &[("LOOSELEAF_PREPARE_HOLDS_SLOT", "true".into()), ("LOOSELEAF_PREPARED_PER_HOST", "1".into())],
    )
    .await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let mut sessions = Vec::new();
    for name in ["a", "b", "c"] {
        let sid = fe.create_session(&cwd.path().display().to_string(), true, true).await?;
        let events = Events::open(&fe, sid).await?;
        sessions.push((name, sid, events));
    }
    // each session types its cell in turn; each new one takes the only prepared slot
    for (name, sid, events) in sessions.iter_mut() {
        fe.edit(*sid, "c", &format!("print('{name}')")).await?;
        ready(events, "c", 1).await?;
    }
    // the older sessions' workers were evicted, oldest first, by the planner's budget
    for (_, _, events) in sessions.iter_mut().take(2) {
        events.until(|i| matches!(i, StreamItem::Event { event: Event::PreparedEnded { .. }, .. })).await?;
        assert_eq!(ended(events, "c"), [PreparedOutcome::Evicted]);
    }
    // a run of another session does not wait for c's prepared worker: it takes the slot
    let (_, sid_a, events_a) = &mut sessions[0];
    let run = fe.run(*sid_a, "other", "print('ran')").await?;
    let out = events_a.done(run.exec_id).await?;
    assert!(out.contains("ran"), "{out}");
    assert_eq!(started(events_a, run.exec_id).map(|s| s.0), Some(Prepare::Cold));
    let (_, _, events_c) = &mut sessions[2];
    events_c.until(|i| matches!(i, StreamItem::Event { event: Event::PreparedEnded { .. }, .. })).await?;
    assert_eq!(ended(events_c, "c"), [PreparedOutcome::EvictedForRun]);
    Ok(())
}

#[actix_rt::test]
async fn a_prepared_worker_that_dies_costs_the_run_nothing() -> anyhow::Result<()> {
    let services = Services::start(&services_bin(), &[1], &[]).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), true, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    let r = fe.run(sid, "c0", "x = 40").await?;
    events.done(r.exec_id).await?;
    fe.edit(sid, "c1", "print(x + 2)").await?;
    let item = events
        .until(|i| matches!(i, StreamItem::Event { event: Event::Ready { cell_id, .. }, .. } if cell_id == "c1"))
        .await?;
    let StreamItem::Event { event: Event::Ready { pid, .. }, .. } = item else { unreachable!("matched above") };
    assert!(pid > 1);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)?;
    let r1 = fe.run(sid, "c1", "print(x + 2)").await?;
    let out = events.done(r1.exec_id).await?;
    assert!(out.contains("42"), "{out}");
    assert_eq!(started(&events, r1.exec_id).map(|s| s.0), Some(Prepare::Cold));
    // noticed while it waited ("lost"), or when the run tried it ("used", then the
    // run went to a fresh worker before the cell started)
    let outcome = ended(&events, "c1");
    assert!(outcome == [PreparedOutcome::Lost] || outcome == [PreparedOutcome::Used], "{outcome:?}");
    Ok(())
}

#[actix_rt::test]
async fn warm_workers_serve_a_rerun_and_are_evicted_before_speculative_ones() -> anyhow::Result<()> {
    // one host, two slots, GPU workers kept warm after their cell; the planner's
    // a budget of one prepared worker per host
    let services = Services::start(
        &services_bin(),
        &[2],
        &[("LOOSELEAF_KEEP_WARM", "true".into()), ("LOOSELEAF_PREPARED_PER_HOST", "1".into())],
    )
    .await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), true, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    let warm_ready = |i: &StreamItem| matches!(i, StreamItem::Event { event: Event::Ready { cell_id, class: PreparedClass::Warm, .. }, .. } if cell_id == "a");
    let code = "n = globals().get('n', 0) + 1\nprint('run', n)";
    let r1 = fe.run(sid, "a", code).await?;
    assert!(events.done(r1.exec_id).await?.contains("run 1"));
    events.until(warm_ready).await?;
    // a re-run of the cell finds its worker warm, brought to the committed state
    let r2 = fe.run(sid, "a", code).await?;
    assert!(events.done(r2.exec_id).await?.contains("run 2"));
    let (prepare, _, _) = started(&events, r2.exec_id).expect("a started again");
    assert_eq!(prepare, Prepare::Warm);
    events.until(warm_ready).await?;
    // typing another cell needs the only prepared place: the warm worker goes first
    fe.edit(sid, "b", "print('b', n)").await?;
    ready(&mut events, "b", 1).await?;
    let outcomes = ended(&events, "a");
    assert_eq!(outcomes.last(), Some(&PreparedOutcome::Evicted), "{outcomes:?}");
    Ok(())
}

#[actix_rt::test]
async fn a_worker_killed_while_preparing_fails_nothing() -> anyhow::Result<()> {
    let services = Services::start(&services_bin(), &[1], &[]).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), true, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    // restoring `slow` takes a while (its state setter sleeps): a worker prepared
    // for a cell that needs it stays in Preparing long enough to be killed there
    let slow = "import time\nclass Slow:\n    def __setstate__(self, state):\n        time.sleep(6)\n        self.__dict__.update(state)\nslow = Slow()\nslow.v = 41\nx = 1";
    let r = fe.run(sid, "c0", slow).await?;
    events.done(r.exec_id).await?;

    let code = "print(slow.v + x)";
    fe.edit(sid, "c1", code).await?;
    let preparing = worker_where(&services, sid, |w| w.state == WorkerState::Preparing).await?;
    sigkill(preparing.pid)?;
    events.until(|i| matches!(i, StreamItem::Event { event: Event::PreparedEnded { .. }, .. })).await?;
    assert_eq!(ended(&events, "c1"), [PreparedOutcome::Lost]);
    assert!(events
        .seen
        .iter()
        .all(|i| !matches!(i, StreamItem::Event { event: Event::Ready { cell_id, .. }, .. } if cell_id == "c1")));

    // the run starts cold on a fresh worker; the committed state is intact
    let r1 = fe.run(sid, "c1", code).await?;
    let out = events.done(r1.exec_id).await?;
    assert!(out.contains("42"), "{out}");
    let (prepare, _, worker) = started(&events, r1.exec_id).expect("c1 started");
    assert_eq!(prepare, Prepare::Cold);
    assert_ne!(worker, preparing.id);
    // and the next cell runs
    let r2 = fe.run(sid, "c2", "print(x * 7)").await?;
    assert!(events.done(r2.exec_id).await?.contains('7'));
    Ok(())
}

#[actix_rt::test]
async fn a_warm_worker_killed_while_waiting_costs_the_rerun_nothing() -> anyhow::Result<()> {
    let services = Services::start(&services_bin(), &[1], &[("LOOSELEAF_KEEP_WARM", "true".into())]).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), true, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    let code = "n = globals().get('n', 0) + 1\nprint('run', n)";
    let r1 = fe.run(sid, "a", code).await?;
    assert!(events.done(r1.exec_id).await?.contains("run 1"));
    let item = events
        .until(|i| matches!(i, StreamItem::Event { event: Event::Ready { class: PreparedClass::Warm, .. }, .. }))
        .await?;
    let StreamItem::Event { event: Event::Ready { worker, .. }, .. } = item else { unreachable!("matched above") };
    let warm = worker_where(&services, sid, |w| w.id == worker).await?;
    assert_eq!(warm.state, WorkerState::Warm);
    sigkill(warm.pid)?;

    // the re-run finds the committed state (n = 1) on a fresh worker, on the slot
    // the dead worker held
    let r2 = fe.run(sid, "a", code).await?;
    let out = events.done(r2.exec_id).await?;
    assert!(out.contains("run 2"), "{out}");
    let (prepare, _, worker) = started(&events, r2.exec_id).expect("a started again");
    assert_eq!(prepare, Prepare::Cold);
    assert_ne!(worker, warm.id);
    // noticed while it waited ("lost"), or when the run tried it ("used", then a
    // fresh worker before the cell started)
    let outcome = ended(&events, "a");
    assert!(outcome == [PreparedOutcome::Lost] || outcome == [PreparedOutcome::Used], "{outcome:?}");
    // the new worker is warm in its turn: the lifecycle went on
    let next = worker_where(&services, sid, |w| w.state == WorkerState::Warm).await?;
    assert_eq!(next.id, worker);
    Ok(())
}

#[actix_rt::test]
async fn a_cell_that_stops_being_a_gpu_cell_cancels_its_prepared_worker() -> anyhow::Result<()> {
    let services = Services::start(&services_bin(), &[1], &[]).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), false, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    let r = fe.run(sid, "c0", "x = 20").await?;
    events.done(r.exec_id).await?;
    fe.edit(sid, "c1", "%%gpu\nprint(x + 1)").await?;
    let (worker, _) = ready(&mut events, "c1", 1).await?;
    // the user turns it into a CPU cell: the GPU worker prepared for it is of no use
    fe.edit(sid, "c1", "%%cpu\nprint(x * 2)").await?;
    events.until(|i| matches!(i, StreamItem::Event { event: Event::PreparedEnded { .. }, .. })).await?;
    assert_eq!(ended(&events, "c1"), [PreparedOutcome::Superseded]);
    worker_gone(&services, &worker).await?;
    let r1 = fe.run(sid, "c1", "%%cpu\nprint(x * 2)").await?;
    assert!(events.done(r1.exec_id).await?.contains("40"));
    Ok(())
}

/// Whether `item` is the plan of an edit of `cell` (a `planned` with a nil exec id).
fn edit_planned(item: &StreamItem, cell: &str) -> bool {
    matches!(item, StreamItem::Event { exec_id, event: Event::Planned { cell_id, .. }, .. }
        if exec_id.is_nil() && cell_id == cell)
}

#[actix_rt::test]
async fn each_edit_plan_is_told_and_the_text_that_ran_prepares_nothing_more() -> anyhow::Result<()> {
    let services = Services::start(&services_bin(), &[1], &[]).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), false, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    let r = fe.run(sid, "c0", "x = 20\ny = 1").await?;
    events.done(r.exec_id).await?;

    // an edit's plan reaches the session's clients (a badge shows it before Run),
    // and so does the host's start of its preparation
    let code = "%%gpu\nprint(x + 1)";
    fe.edit(sid, "c1", code).await?;
    let plan = events.until(|i| edit_planned(i, "c1")).await?;
    let StreamItem::Event { event: Event::Planned { closure, device, .. }, .. } = plan else { unreachable!() };
    assert_eq!((closure, device), (vec!["x".to_string()], looseleaf_client::events::Device::Gpu));
    events
        .until(|i| matches!(i, StreamItem::Event { event: Event::Preparing { cell_id, .. }, .. } if cell_id == "c1"))
        .await?;
    ready(&mut events, "c1", 1).await?;
    // the user goes on typing: half-typed text that does not parse is not planned
    // (its conservative closure is the whole namespace); the worker prepared for
    // the last text that parsed stays, and Run on the finished text uses it
    let typing = events.seen.len();
    fe.edit(sid, "c1", "%%gpu\nprint(x + 1) if").await?;
    tokio::time::sleep(Duration::from_millis(300)).await; // past the planner's debounce
    fe.edit(sid, "c3", "%%gpu\nprint(y)").await?;
    events.until(|i| edit_planned(i, "c3")).await?;
    let half_typed = &events.seen[typing..];
    assert!(!half_typed.iter().any(|i| edit_planned(i, "c1")), "{half_typed:?}");
    let r1 = fe.run(sid, "c1", code).await?;
    events.done(r1.exec_id).await?;
    let (prepare, refreshed, _) = started(&events, r1.exec_id).expect("c1 started");
    assert_eq!((prepare, refreshed), (Prepare::Speculative, 0));
    let after_run = events.seen.len();

    // the editor's last edit of that text, heard after Run: nothing is planned or
    // prepared for it (the edit of another cell, planned after it, is the barrier)
    fe.edit(sid, "c1", code).await?;
    tokio::time::sleep(Duration::from_millis(300)).await; // past the planner's debounce
    fe.edit(sid, "c2", "%%gpu\nprint(x + 2)").await?;
    events.until(|i| edit_planned(i, "c2")).await?;
    let late = &events.seen[after_run..];
    assert!(!late.iter().any(|i| edit_planned(i, "c1")), "{late:?}");
    assert!(
        !late
            .iter()
            .any(|i| matches!(i, StreamItem::Event { event: Event::Preparing { cell_id, .. }, .. } if cell_id == "c1")),
        "{late:?}"
    );

    // a text that needs other state is planned again (one with the same closure
    // keeps the prepared worker, and brings no new plan)
    fe.edit(sid, "c1", "%%gpu\nprint(x + y)").await?;
    events.until(|i| edit_planned(i, "c1")).await?;
    Ok(())
}

#[actix_rt::test]
async fn a_cell_edited_again_keeps_one_prepared_worker_on_one_host() -> anyhow::Result<()> {
    // two hosts of one slot, prepared workers holding it: the host that holds the
    // cell's worker updates it in place, and the other host must not prepare a
    // second one for the new revision (it held its slot idle until evicted)
    let services =
        Services::start(&services_bin(), &[1, 1], &[("LOOSELEAF_PREPARE_HOLDS_SLOT", "true".into())]).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), false, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    let r = fe.run(sid, "c0", "%%cpu\nx = 1\ny = 2").await?;
    events.done(r.exec_id).await?;
    let mut revision = 0;
    for text in ["%%gpu\nprint(x)", "%%gpu\nprint(x, y)", "%%gpu\nprint(y)"] {
        fe.edit(sid, "c1", text).await?;
        revision = ready(&mut events, "c1", revision + 1).await?.1;
    }
    // give a second host time to claim and prepare, were it going to
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r1 = fe.run(sid, "c1", "%%gpu\nprint(y)").await?;
    events.done(r1.exec_id).await?;
    let (prepare, refreshed, _) = started(&events, r1.exec_id).expect("c1 started");
    assert_eq!((prepare, refreshed), (Prepare::Speculative, 0));
    let hosts: std::collections::BTreeSet<String> = events
        .seen
        .iter()
        .filter_map(|i| match i {
            StreamItem::Event { event: Event::Preparing { host, cell_id, .. }, .. } if cell_id == "c1" => {
                Some(host.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(hosts.len(), 1, "one host prepares the cell: {hosts:?}");
    // the one worker was used; none was left to idle on a slot
    assert_eq!(ended(&events, "c1"), [PreparedOutcome::Used]);
    Ok(())
}

/// Wait for a published GPU demand for which `pred` holds.
async fn demand_where(
    demand: &mut schemas::bus::Subscription<schemas::messages::GpuDemandV1>,
    what: &str,
    pred: impl Fn(&schemas::messages::GpuDemandV1) -> bool,
) -> anyhow::Result<schemas::messages::GpuDemandV1> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, demand.next()).await {
            Ok(Some(Ok(env))) if pred(&env.msg) => return Ok(env.msg),
            Ok(Some(_)) => {}
            _ => anyhow::bail!("the planner published no GPU demand where {what}"),
        }
    }
}

#[actix_rt::test]
async fn the_gpu_demand_counts_a_typed_gpu_cell_until_it_runs_and_its_run_until_its_slot_is_free() -> anyhow::Result<()>
{
    let services = Services::start(&services_bin(), &[1], &[]).await?;
    let bus = Bus::connect(services.nats.url(), &services.prefix, "demand-test").await?;
    let mut demand = bus.subscribe::<schemas::messages::GpuDemandV1>(bus.subjects().gpu_demand()).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), false, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    let r = fe.run(sid, "c0", "%%cpu\nimport numpy as np\nbig = np.ones(1_000_000)").await?;
    events.done(r.exec_id).await?;
    demand_where(&mut demand, "nothing is typed or runs", |d| d.typing_sessions == 0 && d.running_gpus == 0).await?;

    // typing a GPU cell that reads 8 MB: a run on its way, with its closure's bytes
    fe.edit(sid, "c1", "%%gpu\nprint(big.sum())").await?;
    let typed = demand_where(&mut demand, "one session types", |d| d.typing_sessions == 1).await?;
    assert!(typed.typing_closure_bytes >= 8_000_000, "{typed:?}");
    assert!(typed.wanted_gpus > 0.0 && typed.wanted_gpus <= 1.0 + 1e-9, "{typed:?}");
    // typing a CPU cell instead: no GPU demand
    fe.edit(sid, "c1", "%%cpu\nprint(big.sum())").await?;
    demand_where(&mut demand, "the cell became a CPU cell", |d| d.typing_sessions == 0).await?;

    // a GPU cell that runs a while: demand while it runs, none once its slot is free
    fe.edit(sid, "c2", "%%gpu\nimport time\ntime.sleep(3)\nprint(big.size)").await?;
    demand_where(&mut demand, "c2 is typed", |d| d.typing_sessions == 1).await?;
    let r2 = fe.run(sid, "c2", "%%gpu\nimport time\ntime.sleep(3)\nprint(big.size)").await?;
    let running = demand_where(&mut demand, "c2 runs", |d| d.running_gpus == 1).await?;
    assert_eq!(running.typing_sessions, 0, "Run ends the typing");
    assert!(running.wanted_gpus >= 1.0, "{running:?}");
    events.done(r2.exec_id).await?;
    demand_where(&mut demand, "c2's slot is free", |d| d.running_gpus == 0 && d.wanted_gpus == 0.0).await?;
    Ok(())
}
