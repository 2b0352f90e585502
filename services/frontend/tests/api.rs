//! The frontend against a real nats-server, with the test playing planner and host.

use std::time::Duration;

use anyhow::{bail, Context};
use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::Frontend;
use looseleaf_frontend::auth::Tokens;
use looseleaf_frontend::resume::Position;
use looseleaf_frontend::{Config, Timeouts};
use looseleaf_test_support::{random_prefix, NatsServer};
use schemas::messages::{CellMessage, CellStatus, Device, EditV1, EventKind, OutputV2, Prepare, RunV3, SessionEventV2};
use schemas::Bus;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(10);

/// The frontend under test, and the one client of its API.
struct Served {
    base: String,
    client: Frontend,
    _stop: oneshot::Sender<()>,
}

async fn start_frontend(nats: &NatsServer, prefix: &str, timeouts: Timeouts) -> anyhow::Result<Served> {
    start_frontend_with(nats, prefix, |c| c.timeouts = timeouts).await
}

async fn start_frontend_with(
    nats: &NatsServer,
    prefix: &str,
    configure: impl FnOnce(&mut Config),
) -> anyhow::Result<Served> {
    let mut config = Config::new(schemas::nats::NatsOptions::url(nats.url()), prefix, "127.0.0.1:0".parse()?);
    configure(&mut config);
    fake_store(nats, prefix).await?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (bound_tx, bound_rx) = oneshot::channel();
    actix_rt::spawn(async move {
        let res = looseleaf_frontend::run_with_bound(
            config,
            async move {
                let _ = stop_rx.await;
            },
            move |addr| {
                let _ = bound_tx.send(addr);
            },
        )
        .await;
        if let Err(e) = res {
            eprintln!("frontend failed: {e:#}");
        }
    });
    let addr = tokio::time::timeout(WAIT, bound_rx).await.context("frontend did not bind")??;
    let base = format!("http://{addr}");
    Ok(Served { client: Frontend::new(&base), base, _stop: stop_tx })
}

/// Play the store for the frontend's questions: every session is empty (revision
/// 0, nothing committed). One answer per question across the test's frontends.
async fn fake_store(nats: &NatsServer, prefix: &str) -> anyhow::Result<()> {
    use schemas::messages::{
        ErrorCode, ForkV1, ManifestGetV2, ManifestV2, Reply, RevertTo, RevertV1, SettleV1, StateMovedV1,
    };
    use schemas::subjects::StoreVerb;
    let bus = Bus::connect(nats.url(), prefix, "fake-store").await?;
    let mut gets =
        bus.queue_subscribe::<ManifestGetV2>(bus.subjects().store(StoreVerb::ManifestGet), "fake-store").await?;
    let mut settles = bus.queue_subscribe::<SettleV1>(bus.subjects().store(StoreVerb::Settle), "fake-store").await?;
    let mut reverts = bus.queue_subscribe::<RevertV1>(bus.subjects().store(StoreVerb::Revert), "fake-store").await?;
    let mut forks = bus.queue_subscribe::<ForkV1>(bus.subjects().store(StoreVerb::Fork), "fake-store").await?;
    bus.flush().await?;
    // an empty session has nothing to undo and no revision to check out
    let answer = bus.clone();
    actix_rt::spawn(async move {
        while let Some(Ok(env)) = reverts.next().await {
            let (code, message) = match env.msg.to {
                RevertTo::Undo => (ErrorCode::BadRequest, "nothing to undo: no cell has saved state yet".to_string()),
                RevertTo::Revision(r) => (ErrorCode::NotFound, format!("there is no revision {r}")),
            };
            let _ = answer.respond::<Reply<StateMovedV1>>(env.reply, &Reply::Err { code, message }).await;
        }
    });
    // and its fork is as empty
    let answer = bus.clone();
    actix_rt::spawn(async move {
        while let Some(Ok(env)) = forks.next().await {
            let moved = StateMovedV1 { revision: 1, state_of: 0, variables: 0, bytes: 0, unsavable: vec![] };
            let _ = answer.respond(env.reply, &Reply::Ok(moved)).await;
        }
    });
    let answer = bus.clone();
    actix_rt::spawn(async move {
        while let Some(Ok(env)) = gets.next().await {
            let manifest = schemas::checkpoint::Manifest::empty(env.msg.session);
            let _ = answer.respond(env.reply, &Reply::Ok(ManifestV2 { manifest })).await;
        }
    });
    // a given-up run committed nothing
    actix_rt::spawn(async move {
        while let Some(Ok(env)) = settles.next().await {
            let manifest = schemas::checkpoint::Manifest::empty(env.msg.session);
            let _ = bus.respond(env.reply, &Reply::Ok(ManifestV2 { manifest })).await;
        }
    });
    Ok(())
}

async fn next_item(rx: &mut mpsc::UnboundedReceiver<StreamItem>) -> anyhow::Result<StreamItem> {
    match tokio::time::timeout(WAIT, rx.recv()).await {
        Ok(Some(item)) => Ok(item),
        Ok(None) => bail!("event stream ended"),
        Err(_) => bail!("no stream item within {WAIT:?}"),
    }
}

/// Items until (and including) the one `stop` accepts.
async fn items_until(
    rx: &mut mpsc::UnboundedReceiver<StreamItem>,
    stop: impl Fn(&StreamItem) -> bool,
) -> anyhow::Result<Vec<StreamItem>> {
    let mut seen = Vec::new();
    loop {
        let item = next_item(rx).await?;
        let done = stop(&item);
        seen.push(item);
        if done {
            return Ok(seen);
        }
    }
}

fn is_done(exec: Uuid) -> impl Fn(&StreamItem) -> bool {
    move |i| matches!(i, StreamItem::Done { exec_id, .. } if *exec_id == exec)
}

async fn event(bus: &Bus, sid: Uuid, exec: Uuid, kind: EventKind) -> anyhow::Result<()> {
    let ev = SessionEventV2 { session: sid, exec_id: exec, unix_ms: schemas::unix_ms(), kind };
    bus.publish(bus.subjects().event(sid), &ev).await?;
    bus.flush().await?;
    Ok(())
}

async fn output(bus: &Bus, sid: Uuid, exec: Uuid, seq: u64, text: &str) -> anyhow::Result<()> {
    let message = CellMessage::Output(serde_json::json!({"output_type": "stream", "name": "stdout", "text": text}));
    // in small pieces, as a host sends an output too large for one message
    for piece in OutputV2::pieces(sid, exec, seq, message, 16) {
        bus.publish(bus.subjects().output(sid, exec), &piece).await?;
    }
    bus.flush().await?;
    Ok(())
}

fn planned(cell: &str) -> EventKind {
    EventKind::Planned {
        cell_id: cell.into(),
        closure: vec![],
        imports: vec![],
        device: Device::Gpu,
        device_reason: "test".into(),
        conservative: None,
        pinned: vec![],
    }
}

fn started() -> EventKind {
    EventKind::Started {
        host: "fake".into(),
        slot: Some(0),
        worker: "w1".into(),
        device: Device::Gpu,
        prepare: Prepare::Cold,
        execution_count: 1,
        restored_bytes: 0,
        prepare_ms: 1.0,
        restore_ms: 0.5,
        refreshed: 0,
        import_hit: true,
        python: "3.11.7".into(),
        phases: schemas::messages::StartPhases::default(),
    }
}

fn finished(outputs: u64) -> EventKind {
    EventKind::Finished {
        status: CellStatus::Ok,
        error: None,
        execution_count: 1,
        run_ms: 2.0,
        outputs,
        cuda_used: false,
        faulted: vec![],
    }
}

fn saved(revision: u64) -> EventKind {
    EventKind::Saved {
        revision,
        save_ms: 1.0,
        saved_bytes: 10,
        chunks_written: 1,
        unsavable: vec![],
        slot_released: true,
    }
}

/// The next run the frontend sent, acknowledged as the planner does (a run nobody
/// acknowledges is sent again, ADR 46).
async fn next_run(bus: &Bus, runs: &mut schemas::bus::Subscription<RunV3>) -> anyhow::Result<RunV3> {
    match tokio::time::timeout(WAIT, runs.next()).await {
        Ok(Some(Ok(env))) => {
            bus.acknowledge(env.reply_to()).await;
            Ok(env.msg)
        }
        Ok(Some(Err(r))) => bail!("run did not decode: {}", r.error),
        Ok(None) => bail!("run subscription ended"),
        Err(_) => bail!("no run within {WAIT:?}"),
    }
}

#[actix_rt::test]
async fn run_queue_waits_for_saved_and_relays_outputs_before_done() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let fe = start_frontend(&nats, &prefix, Timeouts::default()).await?;
    let host = Bus::connect(nats.url(), &prefix, "fake-host").await?;
    let sid = fe.client.create_session("/tmp", true, true).await?;
    let mut runs = host.subscribe::<RunV3>(host.subjects().run(sid)).await?;
    let mut edits = host.subscribe::<EditV1>(host.subjects().edit(sid)).await?;
    // the server must know both subscriptions before the frontend publishes
    host.flush().await?;
    let mut sse = fe.client.events(sid).await?;

    // an edit is published with a per-cell sequence number
    for code in ["x = 1", "x = 2"] {
        fe.client.edit(sid, "a", code).await?;
    }
    let mut seqs = Vec::new();
    for _ in 0..2 {
        match tokio::time::timeout(WAIT, edits.next()).await {
            Ok(Some(Ok(env))) => seqs.push((env.msg.cell_id, env.msg.seq, env.msg.code)),
            other => bail!("no edit: {other:?}"),
        }
    }
    assert_eq!(seqs, vec![("a".into(), 1, "x = 1".into()), ("a".into(), 2, "x = 2".into())]);

    let first = fe.client.run(sid, "a", "x = 2").await?;
    let second = fe.client.run(sid, "b", "print(x)").await?;
    assert_eq!((first.position, second.position), (0, 1));

    let run1 = next_run(&host, &mut runs).await?;
    assert_eq!((run1.exec_id, run1.cell_id.as_str(), run1.after_revision), (first.exec_id, "a", 0));
    assert!(run1.options.all_gpu);
    assert_eq!(run1.options.cwd, "/tmp");

    // garbage on the events subject does not stop the service
    host.client().publish(host.subjects().event(sid), "not bincode".into()).await?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(schemas::codec::TYPE_HEADER, "session-event");
    headers.insert(schemas::codec::VERSION_HEADER, "1");
    host.client().publish_with_headers(host.subjects().event(sid), headers, vec![0xff; 7].into()).await?;

    event(&host, sid, first.exec_id, planned("a")).await?;
    event(&host, sid, first.exec_id, started()).await?;
    output(&host, sid, first.exec_id, 0, "hello\n").await?;
    event(&host, sid, first.exec_id, finished(1)).await?;
    // the frontend saw Finished (it relays events in order) ...
    let mut seen = items_until(&mut sse, |i| {
        matches!(i, StreamItem::Event { event: looseleaf_client::events::Event::Finished { .. }, .. })
    })
    .await?;
    assert!(matches!(seen.first(), Some(StreamItem::Queued { exec_id, .. }) if *exec_id == first.exec_id));
    // ... and still holds the second run back until Saved
    let summary = fe.client.summary(sid).await?;
    assert_eq!(summary["current"], serde_json::json!(first.exec_id));
    assert_eq!(summary["queue"], serde_json::json!([second.exec_id]));
    assert!(tokio::time::timeout(Duration::from_millis(300), runs.next()).await.is_err(), "second run sent early");

    event(&host, sid, first.exec_id, saved(7)).await?;
    seen.extend(items_until(&mut sse, is_done(first.exec_id)).await?);
    let outs: Vec<_> = seen.iter().filter(|i| matches!(i, StreamItem::Output { .. })).collect();
    assert!(
        matches!(outs.as_slice(), [StreamItem::Output { exec_id, seq: 0, output }] if *exec_id == first.exec_id && output.to_json()["text"] == "hello\n"),
        "one output expected: {seen:?}"
    );
    match seen.last() {
        Some(StreamItem::Done { status, after_revision, .. }) => {
            assert_eq!((*status, *after_revision), (ExecStatus::Ok, 7));
        }
        other => bail!("expected done, got {other:?}"),
    }

    // the second run goes out only now, with the first's revision
    let run2 = next_run(&host, &mut runs).await?;
    assert_eq!((run2.exec_id, run2.cell_id.as_str(), run2.after_revision), (second.exec_id, "b", 7));

    // an output that arrives after Saved still comes before done
    event(&host, sid, second.exec_id, planned("b")).await?;
    event(&host, sid, second.exec_id, finished(1)).await?;
    event(&host, sid, second.exec_id, saved(8)).await?;
    output(&host, sid, second.exec_id, 0, "2\n").await?;
    let seen = items_until(&mut sse, is_done(second.exec_id)).await?;
    let out = seen.iter().position(|i| matches!(i, StreamItem::Output { exec_id, .. } if *exec_id == second.exec_id));
    assert_eq!(out, Some(seen.len() - 2), "output must precede done: {seen:?}");
    assert!(matches!(seen.last(), Some(StreamItem::Done { after_revision: 8, status: ExecStatus::Ok, .. })));

    // a client that connects now gets everything replayed, output before done
    let mut late = fe.client.events(sid).await?;
    let replay = items_until(&mut late, is_done(second.exec_id)).await?;
    let first_out = replay
        .iter()
        .position(|i| matches!(i, StreamItem::Output { exec_id, .. } if *exec_id == first.exec_id))
        .context("first output replayed")?;
    let first_done = replay.iter().position(is_done(first.exec_id)).context("first done replayed")?;
    assert!(first_out < first_done);

    // delete: 200, then the session is gone
    fe.client.delete(sid).await?;
    let gone = fe.client.summary(sid).await.expect_err("deleted");
    assert_eq!(gone.status(), Some(reqwest::StatusCode::NOT_FOUND), "{gone}");
    Ok(())
}

#[actix_rt::test]
async fn bad_input_gets_4xx_with_a_json_error() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let fe = start_frontend(&nats, &prefix, Timeouts::default()).await?;
    let http = reqwest::Client::new();
    let base = &fe.base;

    let resp = http
        .post(format!("{base}/v1/sessions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await?;
    assert_eq!(resp.status(), reqwest::StatusCode::BAD_REQUEST);
    let body: serde_json::Value = resp.json().await?;
    assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()), "{body}");

    let unknown = Uuid::now_v7();
    for resp in [
        http.put(format!("{base}/v1/sessions/{unknown}/cells/a")).json(&serde_json::json!({"code": ""})).send().await?,
        http.post(format!("{base}/v1/sessions/{unknown}/cells/a/run"))
            .json(&serde_json::json!({"code": ""}))
            .send()
            .await?,
        http.get(format!("{base}/v1/sessions/{unknown}/events")).send().await?,
        http.delete(format!("{base}/v1/sessions/{unknown}")).send().await?,
    ] {
        assert_eq!(resp.status(), reqwest::StatusCode::NOT_FOUND);
        let body: serde_json::Value = resp.json().await?;
        assert!(body["error"].as_str().is_some_and(|e| e.contains(&unknown.to_string())), "{body}");
    }

    let resp = http.get(format!("{base}/v1/sessions/not-a-uuid")).send().await?;
    assert_eq!(resp.status(), reqwest::StatusCode::BAD_REQUEST);
    let body: serde_json::Value = resp.json().await?;
    assert!(body["error"].as_str().is_some_and(|e| e.contains("not-a-uuid")), "{body}");

    // a known session with a malformed body
    let sid = fe.client.create_session("/tmp", true, true).await?;
    let resp = http
        .post(format!("{base}/v1/sessions/{sid}/cells/a/run"))
        .header("content-type", "application/json")
        .body("[1,")
        .send()
        .await?;
    assert_eq!(resp.status(), reqwest::StatusCode::BAD_REQUEST);

    // a body over the limit (8 MiB, as docs/security.md says) is refused as too
    // large, naming its size and the limit
    assert_eq!(looseleaf_frontend::http::MAX_BODY_BYTES, 8 << 20);
    let huge = serde_json::json!({ "code": "x".repeat(looseleaf_frontend::http::MAX_BODY_BYTES + 1) }).to_string();
    let resp = http
        .post(format!("{base}/v1/sessions/{sid}/cells/a/run"))
        .header("content-type", "application/json")
        .body(huge.clone())
        .send()
        .await?;
    assert_eq!(resp.status(), reqwest::StatusCode::PAYLOAD_TOO_LARGE);
    let body: serde_json::Value = resp.json().await?;
    let error = body["error"].as_str().unwrap_or_default();
    assert!(error.contains(&format!("is {} bytes, over the limit of 8388608 bytes (8 MiB)", huge.len())), "{body}");

    // so is a cell past the largest (the body's limit binds first); one of 3 MiB
    // (over what one bus message carries) reaches the planner whole, as a message
    // body (ADR 30)
    let max = looseleaf_frontend::http::MAX_CELL_BYTES;
    assert!(max <= looseleaf_frontend::http::MAX_BODY_BYTES);
    let over = fe.client.run(sid, "a", &"x".repeat(max + 1)).await.expect_err("a cell over the limit ran");
    assert_eq!(over.status(), Some(reqwest::StatusCode::PAYLOAD_TOO_LARGE), "{over}");
    assert!(over.to_string().contains("over the limit of 8388608 bytes"), "{over}");
    let bus = Bus::connect(nats.url(), &prefix, "fake-planner").await?;
    let mut runs = bus.subscribe::<RunV3>(bus.subjects().run(sid)).await?;
    bus.flush().await?;
    let big = format!("x = '{}'\n", "y".repeat(3 << 20));
    fe.client.run(sid, "a", &big).await?;
    assert_eq!(next_run(&bus, &mut runs).await?.code, big);

    let health: serde_json::Value = http.get(format!("{base}/v1/health")).send().await?.json().await?;
    assert_eq!(health["status"], "ok");
    Ok(())
}

/// A frontend whose runs must be claimed within 300 ms, one session of it, and a
/// bus to play the other services on.
struct ShortClaims {
    nats: NatsServer,
    prefix: String,
    fe: Served,
    sid: Uuid,
    bus: Bus,
}

async fn short_claims() -> anyhow::Result<ShortClaims> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let timeouts = Timeouts { claim: Duration::from_millis(300), ..Timeouts::default() };
    let fe = start_frontend(&nats, &prefix, timeouts).await?;
    let sid = fe.client.create_session("/tmp", true, true).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    Ok(ShortClaims { nats, prefix, fe, sid, bus })
}

#[actix_rt::test]
async fn a_run_no_host_takes_fails_and_the_queue_moves_on() -> anyhow::Result<()> {
    let ShortClaims { nats: _nats, prefix, fe, sid, bus } = short_claims().await?;
    let mut runs = bus.subscribe::<RunV3>(bus.subjects().run(sid)).await?;
    // the server must know the subscription before the first run is published
    bus.flush().await?;
    let mut sse = fe.client.events(sid).await?;
    let a = fe.client.run(sid, "a", "1").await?;
    let b = fe.client.run(sid, "b", "2").await?;
    let seen = items_until(&mut sse, is_done(a.exec_id)).await?;
    match seen.last() {
        Some(StreamItem::Done { status: ExecStatus::Failed, error: Some(e), after_revision: 0, .. }) => {
            assert!(e.contains("no host took the cell"), "{e}");
        }
        other => bail!("expected a failed done, got {other:?}"),
    }
    assert_eq!(next_run(&bus, &mut runs).await?.exec_id, a.exec_id);
    // the frontend holds the run's claim: no host can start it after it was failed
    let claims = schemas::buckets::claims(&bus.jetstream(), &prefix, 1).await?;
    let holder = claims.get(schemas::buckets::run_claim_key(a.exec_id)).await?;
    assert_eq!(holder.as_deref(), Some(schemas::buckets::INTERRUPTED_HOLDER.as_bytes()));
    assert_eq!(next_run(&bus, &mut runs).await?.exec_id, b.exec_id);
    // a Failed event also completes an execution, leaving the revision unchanged
    event(&bus, sid, b.exec_id, planned("b")).await?;
    event(&bus, sid, b.exec_id, EventKind::Failed { error: "worker died".into() }).await?;
    let seen = items_until(&mut sse, is_done(b.exec_id)).await?;
    assert!(matches!(seen.last(), Some(StreamItem::Done { status: ExecStatus::Failed, after_revision: 0, .. })));
    Ok(())
}

/// A host that claimed the run and died before it said so (no Claimed event) is
/// watched like one that did: once it is silent for the host-lost time the run
/// ends with what the store committed, instead of waiting forever.
#[actix_rt::test]
async fn a_run_whose_host_died_right_after_claiming_it_ends() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let timeouts =
        Timeouts { claim: Duration::from_millis(300), host_lost: Duration::from_millis(800), ..Timeouts::default() };
    let fe = start_frontend(&nats, &prefix, timeouts).await?;
    let sid = fe.client.create_session("/tmp", true, true).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let claims = schemas::buckets::claims(&bus.jetstream(), &prefix, 1).await?;
    let mut sse = fe.client.events(sid).await?;
    let a = fe.client.run(sid, "a", "1").await?;
    claims.create(schemas::buckets::run_claim_key(a.exec_id), "host-gone".into()).await?;
    let seen = items_until(&mut sse, is_done(a.exec_id)).await?;
    match seen.last() {
        Some(StreamItem::Done { status: ExecStatus::Failed, error: Some(e), .. }) => {
            assert!(e.contains("host host-gone was lost"), "{e}");
        }
        other => bail!("expected the run to fail with its host lost, got {other:?}"),
    }
    Ok(())
}

#[actix_rt::test]
async fn a_run_a_host_claimed_is_never_failed_by_the_claim_timeout() -> anyhow::Result<()> {
    let ShortClaims { nats: _nats, prefix, fe, sid, bus } = short_claims().await?;
    let claims = schemas::buckets::claims(&bus.jetstream(), &prefix, 1).await?;
    let mut sse = fe.client.events(sid).await?;
    let a = fe.client.run(sid, "a", "1").await?;
    // a host won the run, and its Claimed event is late: the cell may be running
    claims.create(schemas::buckets::run_claim_key(a.exec_id), "host-x".into()).await?;
    tokio::time::sleep(Duration::from_millis(900)).await;
    event(&bus, sid, a.exec_id, EventKind::Failed { error: "the host's own outcome".into() }).await?;
    let seen = items_until(&mut sse, is_done(a.exec_id)).await?;
    match seen.last() {
        Some(StreamItem::Done { status: ExecStatus::Failed, error: Some(e), .. }) => {
            assert_eq!(e, "the host's own outcome", "the frontend did not wait for the host");
        }
        other => bail!("expected the host's outcome, got {other:?}"),
    }
    Ok(())
}

#[actix_rt::test]
async fn a_restarted_frontend_serves_every_session_from_its_record() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let first = start_frontend(&nats, &prefix, Timeouts::default()).await?;
    let cwd = tempfile::tempdir()?;
    let sid = first.client.create_session(&cwd.path().display().to_string(), true, false).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let mut runs = bus.subscribe::<RunV3>(bus.subjects().run(sid)).await?;
    bus.flush().await?;
    let mut sse = first.client.events(sid).await?;
    let a = first.client.run(sid, "a", "x = 1").await?;
    assert_eq!(next_run(&bus, &mut runs).await?.after_revision, 0);
    event(&bus, sid, a.exec_id, saved(3)).await?;
    items_until(&mut sse, is_done(a.exec_id)).await?;
    // the record is written behind the run queue: wait until it says revision 3
    let records =
        looseleaf_frontend::records::Records::new(schemas::buckets::sessions(&bus.jetstream(), &prefix, 1).await?);
    looseleaf_test_support::wait_for_async(WAIT, || {
        let records = records.clone();
        async move { records.get(sid).await.ok().flatten().is_some_and(|r| r.revision == 3) }
    })
    .await?;
    drop(first); // the frontend stops

    // another frontend (or the same one restarted) serves the session as it was
    let second = start_frontend(&nats, &prefix, Timeouts::default()).await?;
    let summary = second.client.summary(sid).await?;
    assert_eq!(summary["revision"], 3, "{summary}");
    assert_eq!(summary["cwd"], cwd.path().display().to_string(), "{summary}");
    let b = second.client.run(sid, "b", "print(x)").await?;
    let run = next_run(&bus, &mut runs).await?;
    assert_eq!((run.exec_id, run.after_revision), (b.exec_id, 3));
    assert_eq!(run.options.cwd, cwd.path().display().to_string());

    // deleted: gone for every frontend
    second.client.delete(sid).await?;
    let third = start_frontend(&nats, &prefix, Timeouts::default()).await?;
    let err = third.client.summary(sid).await.expect_err("a deleted session");
    assert_eq!(err.status(), Some(reqwest::StatusCode::NOT_FOUND), "{err}");
    assert!(records.get(sid).await?.is_none());
    Ok(())
}

/// The text of every stdout output among `items`, in order.
fn printed(items: &[StreamItem]) -> Vec<String> {
    items
        .iter()
        .filter_map(|i| match i {
            StreamItem::Output { output, .. } => output.to_json()["text"].as_str().map(str::to_string),
            _ => None,
        })
        .collect()
}

#[actix_rt::test]
async fn a_run_in_flight_survives_a_frontend_restart_with_every_output_once() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    // both on one port, as a frontend restarted in place
    let listen: std::net::SocketAddr = format!("127.0.0.1:{}", looseleaf_test_support::free_port()?).parse()?;
    let first = start_frontend_with(&nats, &prefix, |c| c.listen = listen).await?;
    let sid = first.client.create_session("/tmp", true, false).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let mut runs = bus.subscribe::<RunV3>(bus.subjects().run(sid)).await?;
    bus.flush().await?;
    // a client watching from before the restart: its reader reconnects and resumes
    let mut watching = first.client.events(sid).await?;
    let a = first.client.run(sid, "a", "print(1); print(2); print(3)").await?;
    next_run(&bus, &mut runs).await?;
    let claimed = EventKind::Claimed { host: "fake".into(), slot: Some(0), prepare: Prepare::Cold };
    event(&bus, sid, a.exec_id, claimed).await?;
    event(&bus, sid, a.exec_id, started()).await?;
    output(&bus, sid, a.exec_id, 0, "before ").await?;
    drop(first); // the frontend goes away mid-cell

    // the cell goes on while no frontend listens
    output(&bus, sid, a.exec_id, 1, "while-gone ").await?;
    event(&bus, sid, a.exec_id, finished(3)).await?;
    let second = start_frontend_with(&nats, &prefix, |c| c.listen = listen).await?;
    let summary = second.client.summary(sid).await?;
    assert_eq!(summary["current"], a.exec_id.to_string(), "the run in flight is adopted: {summary}");
    let mut sse = second.client.events(sid).await?;
    output(&bus, sid, a.exec_id, 2, "after").await?;
    event(&bus, sid, a.exec_id, saved(1)).await?;
    let items = items_until(&mut sse, is_done(a.exec_id)).await?;
    assert_eq!(printed(&items), ["before ", "while-gone ", "after"], "each output once, in order");
    assert!(matches!(items.last(), Some(StreamItem::Done { status: ExecStatus::Ok, after_revision: 1, .. })));
    let resumed = items_until(&mut watching, is_done(a.exec_id)).await?;
    assert_eq!(printed(&resumed), ["before ", "while-gone ", "after"], "the resumed reader: each output once");
    let queued = resumed.iter().filter(|i| matches!(i, StreamItem::Queued { .. })).count();
    assert_eq!(queued, 1, "{resumed:?}");

    // the queue moves on from the revision the adopted run left
    let b = second.client.run(sid, "b", "2").await?;
    let run = next_run(&bus, &mut runs).await?;
    assert_eq!((run.exec_id, run.after_revision), (b.exec_id, 1));
    Ok(())
}

/// Runs accepted behind the one in flight are in the session's record before the
/// client hears of them: a frontend restarted meanwhile runs them, in order, from
/// the revision the run in flight left.
#[actix_rt::test]
async fn runs_queued_behind_the_one_in_flight_survive_a_frontend_restart() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let listen: std::net::SocketAddr = format!("127.0.0.1:{}", looseleaf_test_support::free_port()?).parse()?;
    let first = start_frontend_with(&nats, &prefix, |c| c.listen = listen).await?;
    let sid = first.client.create_session("/tmp", true, false).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let mut runs = bus.subscribe::<RunV3>(bus.subjects().run(sid)).await?;
    bus.flush().await?;
    let a = first.client.run(sid, "a", "x = 1").await?;
    next_run(&bus, &mut runs).await?;
    event(&bus, sid, a.exec_id, EventKind::Claimed { host: "fake".into(), slot: Some(0), prepare: Prepare::Cold })
        .await?;
    let b = first.client.run(sid, "b", "y = x + 1").await?;
    let c = first.client.run(sid, "c", "print(y)").await?;
    assert_eq!((b.position, c.position), (1, 2));
    drop(first); // the frontend goes away with two runs queued

    event(&bus, sid, a.exec_id, started()).await?;
    event(&bus, sid, a.exec_id, finished(0)).await?;
    let second = start_frontend_with(&nats, &prefix, |c| c.listen = listen).await?;
    let summary = second.client.summary(sid).await?;
    assert_eq!(summary["queue"], serde_json::json!([b.exec_id, c.exec_id]), "{summary}");
    let mut sse = second.client.events(sid).await?;
    event(&bus, sid, a.exec_id, saved(1)).await?;
    items_until(&mut sse, is_done(a.exec_id)).await?;

    // the queued runs go on, in order, each from the revision the one before left
    let run = next_run(&bus, &mut runs).await?;
    assert_eq!((run.exec_id, run.code.as_str(), run.after_revision), (b.exec_id, "y = x + 1", 1));
    event(&bus, sid, b.exec_id, EventKind::Claimed { host: "fake".into(), slot: Some(0), prepare: Prepare::Cold })
        .await?;
    event(&bus, sid, b.exec_id, started()).await?;
    event(&bus, sid, b.exec_id, finished(0)).await?;
    event(&bus, sid, b.exec_id, saved(2)).await?;
    let run = next_run(&bus, &mut runs).await?;
    assert_eq!((run.exec_id, run.after_revision), (c.exec_id, 2));
    Ok(())
}

#[actix_rt::test]
async fn with_tokens_only_a_sessions_owner_reaches_it() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let (alice, bob) = ("alice-token-0123456789", "bob-token-0123456789ab");
    let tokens = Tokens::parse(&format!("alice {alice}\nbob {bob}\n"))?;
    let fe = start_frontend_with(&nats, &prefix, |c| c.tokens = tokens.clone()).await?;
    let anonymous = fe.client.clone();
    let as_alice = fe.client.clone().with_token(alice);
    let as_bob = fe.client.clone().with_token(bob);

    // no token, or a wrong one: 401, nothing made
    let err = anonymous.create_session("/tmp", true, false).await.expect_err("no token");
    assert_eq!(err.status(), Some(reqwest::StatusCode::UNAUTHORIZED), "{err}");
    let wrong = fe.client.clone().with_token("not-a-token-at-all-000");
    let err = wrong.create_session("/tmp", true, false).await.expect_err("a wrong token");
    assert_eq!(err.status(), Some(reqwest::StatusCode::UNAUTHORIZED), "{err}");
    // health needs none (probes)
    let health = reqwest::get(format!("{}/v1/health", fe.base)).await?;
    assert_eq!(health.status(), reqwest::StatusCode::OK);

    let sid = as_alice.create_session("/tmp", true, false).await?;
    assert_eq!(as_alice.summary(sid).await?["session_id"], sid.to_string());
    // bob cannot see, run in, interrupt or delete alice's session: it does not exist for him
    let not_found = Some(reqwest::StatusCode::NOT_FOUND);
    assert_eq!(as_bob.summary(sid).await.expect_err("bob reads").status(), not_found);
    assert_eq!(as_bob.run(sid, "a", "1").await.expect_err("bob runs").status(), not_found);
    assert_eq!(as_bob.interrupt(sid).await.expect_err("bob interrupts").status(), not_found);
    assert_eq!(as_bob.delete(sid).await.expect_err("bob deletes").status(), not_found);
    assert_eq!(anonymous.summary(sid).await.expect_err("no token").status(), Some(reqwest::StatusCode::UNAUTHORIZED));

    // nor through another frontend that adopts it from its record
    drop(fe);
    let other = start_frontend_with(&nats, &prefix, |c| c.tokens = tokens).await?;
    let as_bob = other.client.clone().with_token(bob);
    assert_eq!(as_bob.summary(sid).await.expect_err("bob reads").status(), not_found);
    let as_alice = other.client.clone().with_token(alice);
    assert_eq!(as_alice.summary(sid).await?["session_id"], sid.to_string());
    Ok(())
}

/// The (id, data) of the first `n` events of `sid`'s SSE stream, asked with
/// `Last-Event-ID: last` if given.
async fn sse_events(base: &str, sid: Uuid, last: Option<&str>, n: usize) -> anyhow::Result<Vec<(String, String)>> {
    use futures::StreamExt;
    let mut req = reqwest::Client::new().get(format!("{base}/v1/sessions/{sid}/events"));
    if let Some(last) = last {
        req = req.header("Last-Event-ID", last);
    }
    let resp = req.send().await?.error_for_status()?;
    let mut body = resp.bytes_stream();
    let (mut text, mut events) = (String::new(), Vec::new());
    while events.len() < n {
        let chunk = tokio::time::timeout(WAIT, body.next()).await?.context("the stream ended")??;
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = text.find("\n\n") {
            let block: String = text.drain(..end + 2).collect();
            let field = |name: &str| block.lines().find_map(|l| l.strip_prefix(name)).map(str::to_string);
            if let (Some(id), Some(data)) = (field("id: "), field("data: ")) {
                events.push((id, data));
            }
        }
    }
    Ok(events)
}

#[actix_rt::test]
async fn a_reconnecting_client_gets_what_came_after_its_last_event_and_history_is_bounded() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let fe = start_frontend_with(&nats, &prefix, |c| c.history_items = 4).await?;
    let sid = fe.client.create_session("/tmp", true, false).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let a = fe.client.run(sid, "a", "1").await?;
    fe.client.run(sid, "b", "2").await?;
    fe.client.run(sid, "c", "3").await?;
    event(&bus, sid, a.exec_id, saved(1)).await?; // an event, then a's done: 5 items
    let mut sse = fe.client.events(sid).await?;
    items_until(&mut sse, is_done(a.exec_id)).await?;

    // only the newest 4 are kept; their numbers go on counting
    let all = sse_events(&fe.base, sid, None, 4).await?;
    let first = Position::parse(&all[0].0).context("an id of the stream")?.n - 1; // the first item's (dropped)
    let numbers = |events: &[(String, String)]| {
        events.iter().map(|(id, _)| Position::parse(id).map(|p| p.n - first)).collect::<Option<Vec<u64>>>()
    };
    assert_eq!(numbers(&all[..]), Some(vec![1, 2, 3, 4]));
    // after the third: the fourth and fifth, nothing repeated
    let rest = sse_events(&fe.base, sid, Some(all[1].0.as_str()), 2).await?;
    assert_eq!(numbers(&rest[..]), Some(vec![3, 4]));
    assert_eq!(rest, all[2..].to_vec());
    assert!(rest[1].1.contains("\"done\""), "{}", rest[1].1);
    // a Last-Event-ID that is not one of ours
    let resp = reqwest::Client::new()
        .get(format!("{}/v1/sessions/{sid}/events", fe.base))
        .header("Last-Event-ID", "yesterday")
        .send()
        .await?;
    assert_eq!(resp.status(), reqwest::StatusCode::BAD_REQUEST);
    Ok(())
}

#[actix_rt::test]
async fn an_idle_session_is_culled_and_reopens_while_a_watched_one_stays() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let fe = start_frontend_with(&nats, &prefix, |c| c.detach_unwatched = Some(Duration::from_millis(400))).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let mut idles = bus.subscribe::<schemas::messages::SessionIdleV1>(bus.subjects().all_idles()).await?;
    bus.flush().await?;
    let idle = fe.client.create_session("/tmp/idle", true, false).await?;
    let watched = fe.client.create_session("/tmp/watched", true, false).await?;
    let _watching = fe.client.events(watched).await?;

    let culled = tokio::time::timeout(WAIT, idles.next()).await?.context("no cull")?;
    assert_eq!(culled.map_err(|e| anyhow::anyhow!("{e:?}"))?.msg.session, idle);
    let health: serde_json::Value = reqwest::get(format!("{}/v1/health", fe.base)).await?.json().await?;
    assert_eq!(health["sessions"], 1, "only the watched session is served: {health}");
    // nothing else is culled while its events are watched
    assert!(
        tokio::time::timeout(Duration::from_millis(1500), idles.next()).await.is_err(),
        "the watched one was culled"
    );
    // the culled session reopens from its record
    assert_eq!(fe.client.summary(idle).await?["cwd"], "/tmp/idle");
    Ok(())
}

#[actix_rt::test]
async fn a_watched_session_idle_past_the_cull_gives_back_its_workers_once_and_stays() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let fe = start_frontend_with(&nats, &prefix, |c| {
        c.detach_unwatched = None;
        c.idle_cull = Some(Duration::from_millis(400));
    })
    .await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let mut idles = bus.subscribe::<schemas::messages::SessionIdleV1>(bus.subjects().all_idles()).await?;
    bus.flush().await?;
    let watched = fe.client.create_session("/tmp/watched", true, false).await?;
    let _watching = fe.client.events(watched).await?;

    let culled = tokio::time::timeout(WAIT, idles.next()).await?.context("no cull")?;
    assert_eq!(culled.map_err(|e| anyhow::anyhow!("{e:?}"))?.msg.session, watched);
    // once per idle spell: not again while it stays idle
    assert!(tokio::time::timeout(Duration::from_millis(1500), idles.next()).await.is_err(), "culled twice");
    let health: serde_json::Value = reqwest::get(format!("{}/v1/health", fe.base)).await?.json().await?;
    assert_eq!(health["sessions"], 1, "it is still served: {health}");
    // activity starts a new spell, which ends in a cull of its own
    fe.client.summary(watched).await?;
    let again = tokio::time::timeout(WAIT, idles.next()).await?.context("no second cull")?;
    assert_eq!(again.map_err(|e| anyhow::anyhow!("{e:?}"))?.msg.session, watched);
    Ok(())
}

#[actix_rt::test]
async fn working_directories_sessions_and_queues_are_bounded() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let root = tempfile::tempdir()?;
    let (alice, bob) = ("alice-token-0123456789", "bob-token-0123456789ab");
    let tokens = Tokens::parse(&format!("alice {alice}\nbob {bob}\n"))?;
    let root_path = root.path().to_path_buf();
    let fe = start_frontend_with(&nats, &prefix, |c| {
        c.tokens = tokens;
        c.limits = looseleaf_frontend::admission::Limits {
            cwd_root: Some(root_path),
            sessions_per_user: Some(2),
            queued_runs: 1,
        };
    })
    .await?;
    let as_alice = fe.client.clone().with_token(alice);
    let as_bob = fe.client.clone().with_token(bob);
    let inside = root.path().join("alice").display().to_string();

    // a working directory outside the root: 400 naming it
    let err = as_alice.create_session("/etc", true, false).await.expect_err("outside the root");
    assert_eq!(err.status(), Some(reqwest::StatusCode::BAD_REQUEST), "{err}");
    assert!(format!("{err:#}").contains("--cwd-root"), "{err:#}");

    // two sessions each; a third is 429 for alice, bob is not affected
    let first = as_alice.create_session(&inside, true, false).await?;
    as_alice.create_session(&inside, true, false).await?;
    let err = as_alice.create_session(&inside, true, false).await.expect_err("a third session");
    assert_eq!(err.status(), Some(reqwest::StatusCode::TOO_MANY_REQUESTS), "{err}");
    as_bob.create_session(&inside, true, false).await?;
    // deleting one frees a place
    as_alice.delete(first).await?;
    let sid = as_alice.create_session(&inside, true, false).await?;

    // one run waits for a host, one more may queue behind it, the next is 429
    as_alice.run(sid, "a", "1").await?;
    as_alice.run(sid, "b", "2").await?;
    let err = as_alice.run(sid, "c", "3").await.expect_err("a full queue");
    assert_eq!(err.status(), Some(reqwest::StatusCode::TOO_MANY_REQUESTS), "{err}");
    Ok(())
}

/// Send `raw` on a fresh connection to `base` and read what comes back until the
/// server closes it (or 10 s pass).
async fn raw_exchange(base: &str, raw: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(raw.as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, conn.read_to_end(&mut answer)).await.context("the server kept the connection")??;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

#[actix_rt::test]
async fn slow_clients_are_cut_off_and_only_allowed_hosts_and_origins_are_answered() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let short = Duration::from_millis(500);
    let fe = start_frontend_with(&nats, &prefix, |c| {
        c.http_timeouts = looseleaf_frontend::serve::HttpTimeouts { header: short, body: short };
        c.origins = Some(looseleaf_frontend::origins::Origins::new(
            std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            &[],
            &["https://lab.example.org".into()],
        ));
    })
    .await?;

    // headers that never end: the connection is closed, not held
    let answer = raw_exchange(&fe.base, "GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n").await?;
    assert!(!answer.contains("200 OK"), "{answer}");
    // a body shorter than its Content-Length: 408 once the body timeout passes
    let partial = "POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                   Content-Length: 100\r\nConnection: close\r\n\r\n{\"cwd\":";
    let answer = raw_exchange(&fe.base, partial).await?;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    // a name that is not the loopback's (DNS rebinding): 403
    let client = reqwest::Client::new();
    let health = format!("{}/v1/health", fe.base);
    let resp = client.get(&health).header("Host", "evil.example:80").send().await?;
    assert_eq!(resp.status(), reqwest::StatusCode::FORBIDDEN);
    assert!(resp.text().await?.contains("evil.example"));
    assert_eq!(client.get(&health).send().await?.status(), reqwest::StatusCode::OK);

    // CORS: the listed origin may read and gets its preflight; another may not
    let resp = client.get(&health).header("Origin", "https://lab.example.org").send().await?;
    assert_eq!(resp.headers()["access-control-allow-origin"], "https://lab.example.org");
    let resp = client.get(&health).header("Origin", "https://evil.example").send().await?;
    assert!(!resp.headers().contains_key("access-control-allow-origin"));
    let preflight = |origin: &'static str| {
        client
            .request(reqwest::Method::OPTIONS, format!("{}/v1/sessions", fe.base))
            .header("Origin", origin)
            .header("Access-Control-Request-Method", "POST")
            .header("Access-Control-Request-Headers", "authorization, content-type")
            .send()
    };
    let ok = preflight("https://lab.example.org").await?;
    assert_eq!(ok.status(), reqwest::StatusCode::NO_CONTENT);
    assert!(ok.headers()["access-control-allow-headers"].to_str()?.contains("authorization"));
    assert_eq!(preflight("https://evil.example").await?.status(), reqwest::StatusCode::FORBIDDEN);
    Ok(())
}

/// The API's OpenAPI description holds for what the frontend really answers:
/// schemathesis generates valid and invalid requests for every operation (the
/// event stream aside: it never ends) and checks that none is a server error,
/// every status, content type and body is the described one, and invalid input
/// is refused.
#[actix_rt::test]
async fn the_api_answers_as_its_openapi_description_says() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let token = "schemathesis-token-0123456789";
    let tokens = Tokens::parse(&format!("fuzzer {token}\n"))?;
    let fe = start_frontend_with(&nats, &prefix, |c| c.tokens = tokens).await?;
    let described: serde_json::Value = reqwest::get(format!("{}/v1/openapi.json", fe.base)).await?.json().await?;
    assert!(described["paths"]["/v1/sessions/{sid}/cells/{cell_id}/run"]["post"].is_object(), "{described}");

    // requests name a session that exists (or one the stateful phase created)
    let sid = fe.client.clone().with_token(token).create_session("/tmp", true, false).await?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(&config, format!("[parameters]\nsid = \"{sid}\"\n"))?;
    let bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/schemathesis");
    let url = format!("{}/v1/openapi.json", fe.base);
    let auth = format!("Authorization: Bearer {token}");
    let run = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&bin)
            .arg("--config-file")
            .arg(&config)
            .args(["run", &url, "-H", &auth, "--exclude-path", "/v1/sessions/{sid}/events"])
            // endless streams: no answer ever ends
            .args(["--exclude-path", "/v1/dashboard"])
            .args(["--checks", "not_a_server_error,status_code_conformance,content_type_conformance"])
            .args(["--checks", "response_schema_conformance,negative_data_rejection"])
            .args(["--max-examples", "25", "--seed", "1", "--workers", "1", "--request-timeout", "20"])
            .args(["--no-color", "--generation-database", "none"])
            .output()
    })
    .await?
    .with_context(|| "schemathesis (run scripts/setup)".to_string())?;
    let out = String::from_utf8_lossy(&run.stdout);
    eprintln!("{out}");
    assert!(run.status.success(), "schemathesis found failures:\n{out}\n{}", String::from_utf8_lossy(&run.stderr));
    Ok(())
}

/// The next dashboard snapshot of `stream` (Server-Sent Events) that `wanted` accepts.
async fn dashboard_until<B: AsRef<[u8]>>(
    stream: &mut (impl futures::Stream<Item = reqwest::Result<B>> + Unpin),
    text: &mut String,
    wanted: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    use futures::StreamExt;
    loop {
        while let Some(end) = text.find("\n\n") {
            let block: String = text.drain(..end + 2).collect();
            if let Some(data) = block.lines().find_map(|l| l.strip_prefix("data: ")) {
                let snapshot: serde_json::Value = serde_json::from_str(data)?;
                if wanted(&snapshot) {
                    return Ok(snapshot);
                }
            }
        }
        let chunk = tokio::time::timeout(WAIT, stream.next()).await?.context("the stream ended")??;
        text.push_str(&String::from_utf8_lossy(chunk.as_ref()));
    }
}

#[actix_rt::test]
async fn the_dashboard_page_needs_no_token_and_its_live_data_shows_each_user_their_own() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let (alice, bob) = ("alice-token-0123456789", "bob-token-0123456789ab");
    let tokens = Tokens::parse(&format!("alice {alice}\nbob {bob}\n"))?;
    let fe = start_frontend_with(&nats, &prefix, |c| c.tokens = tokens).await?;
    let http = reqwest::Client::new();

    // the page holds no data: anyone gets it; the data needs a token
    let page = http.get(format!("{}/", fe.base)).send().await?;
    assert_eq!(page.status(), reqwest::StatusCode::OK);
    assert!(page.headers()["content-type"].to_str()?.starts_with("text/html"));
    assert!(page.text().await?.contains("/v1/dashboard"));
    let data = http.get(format!("{}/v1/dashboard", fe.base)).send().await?;
    assert_eq!(data.status(), reqwest::StatusCode::UNAUTHORIZED);

    // a host's status shows with its slots
    let host = Bus::connect(nats.url(), &prefix, "fake-host").await?;
    let status = schemas::messages::HostStatusV2 {
        host: "host-x".into(),
        slots: vec![schemas::messages::SlotStatus {
            index: 0,
            name: "virtual".into(),
            memory_bytes: 0,
            exec_id: None,
            session: None,
            held_for: None,
        }],
        real_gpus: false,
        zygotes: vec![],
        cpu_sessions: vec![],
        workers: vec![],
        cache_bytes: 0,
        forks: 0,
        unix_ms: schemas::unix_ms(),
    };
    host.publish(host.subjects().host_status("host-x"), &status).await?;
    host.flush().await?;

    let as_alice = fe.client.clone().with_token(alice);
    let sid = as_alice.create_session("/tmp", true, false).await?;
    let mut runs = host.subscribe::<RunV3>(host.subjects().run(sid)).await?;
    host.flush().await?;
    let watch = |token: &str| http.get(format!("{}/v1/dashboard", fe.base)).bearer_auth(token).send();
    let mut alices = watch(alice).await?.error_for_status()?.bytes_stream();
    let mut text = String::new();
    let first = dashboard_until(&mut alices, &mut text, |s| s["hosts"][0]["host"] == "host-x").await?;
    assert_eq!(first["hosts"][0]["slots"][0]["busy"], false, "{first}");
    assert_eq!(first["sessions"][0]["session_id"], sid.to_string(), "{first}");

    // a run, as a planner and host carry it out: the open stream follows it
    let exec = as_alice.run(sid, "a", "x = 1").await?.exec_id;
    next_run(&host, &mut runs).await?;
    event(&host, sid, exec, planned("a")).await?;
    let claimed = EventKind::Claimed { host: "fake".into(), slot: Some(0), prepare: Prepare::Speculative };
    event(&host, sid, exec, claimed).await?;
    event(&host, sid, exec, started()).await?;
    event(&host, sid, exec, finished(0)).await?;
    event(&host, sid, exec, saved(1)).await?;
    let done = dashboard_until(&mut alices, &mut text, |s| s["executions"][0]["status"] == "ok").await?;
    let e = &done["executions"][0];
    assert_eq!((e["exec_id"].as_str(), e["cell_id"].as_str()), (Some(exec.to_string().as_str()), Some("a")), "{done}");
    assert_eq!((e["device"].as_str(), e["host"].as_str(), e["slot"].as_u64()), (Some("gpu"), Some("fake"), Some(0)));
    assert_eq!(e["prepare"], "cold", "Started says how the worker was prepared: {done}");
    assert!(e["start_delay_ms"].is_u64(), "{done}");
    assert_eq!(done["sessions"][0]["gpu_runs"], 1, "{done}");
    assert!(done["gpu_slot_seconds"].as_f64().is_some_and(|s| s >= 0.0), "{done}");

    // bob sees the host, not alice's session or its run
    let mut bobs = watch(bob).await?.error_for_status()?.bytes_stream();
    let mut text = String::new();
    let seen = dashboard_until(&mut bobs, &mut text, |_| true).await?;
    assert_eq!(seen["hosts"][0]["host"], "host-x", "{seen}");
    assert_eq!(seen["sessions"], serde_json::json!([]), "{seen}");
    assert_eq!(seen["executions"], serde_json::json!([]), "{seen}");
    Ok(())
}

/// The (id, data) of `sid`'s SSE stream from its start (or after `last`), until
/// and with the item `stop` accepts.
async fn sse_until(
    base: &str,
    sid: Uuid,
    last: Option<&str>,
    stop: impl Fn(&StreamItem) -> bool,
) -> anyhow::Result<Vec<(String, String)>> {
    use futures::StreamExt;
    let mut req = reqwest::Client::new().get(format!("{base}/v1/sessions/{sid}/events"));
    if let Some(last) = last {
        req = req.header("Last-Event-ID", last);
    }
    let mut body = req.send().await?.error_for_status()?.bytes_stream();
    let (mut parser, mut events) = (looseleaf_client::stream::SseParser::new(), Vec::new());
    loop {
        let chunk = tokio::time::timeout(WAIT, body.next()).await?.context("the stream ended")??;
        for event in parser.push_events(&chunk) {
            let item: StreamItem = serde_json::from_str(&event.data)?;
            events.push((event.id.context("an item without an id")?, event.data));
            if stop(&item) {
                return Ok(events);
            }
        }
    }
}

/// A reader that resumes with `Last-Event-ID` on a frontend restarted meanwhile
/// (which reads the run in flight and the queued run back and emits them again)
/// gets every item it did not see, once, and none it saw, wherever it stopped.
#[actix_rt::test]
async fn a_stream_resumed_across_a_frontend_restart_repeats_no_item() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let listen: std::net::SocketAddr = format!("127.0.0.1:{}", looseleaf_test_support::free_port()?).parse()?;
    let first = start_frontend_with(&nats, &prefix, |c| c.listen = listen).await?;
    let sid = first.client.create_session("/tmp", true, false).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let mut runs = bus.subscribe::<RunV3>(bus.subjects().run(sid)).await?;
    bus.flush().await?;
    let a = first.client.run(sid, "a", "print(1); print(2); print(3)").await?;
    next_run(&bus, &mut runs).await?;
    let claimed = EventKind::Claimed { host: "fake".into(), slot: Some(0), prepare: Prepare::Cold };
    event(&bus, sid, a.exec_id, claimed).await?;
    event(&bus, sid, a.exec_id, started()).await?;
    output(&bus, sid, a.exec_id, 0, "one ").await?;
    let b = first.client.run(sid, "b", "2").await?;
    // what a reader saw of the first frontend: queued a, claimed, started, one, queued b
    let seen = sse_events(&first.base, sid, None, 5).await?;
    drop(first); // the frontend goes away mid-cell

    output(&bus, sid, a.exec_id, 1, "two ").await?;
    event(&bus, sid, a.exec_id, finished(3)).await?;
    let second = start_frontend_with(&nats, &prefix, |c| c.listen = listen).await?;
    assert_eq!(second.client.summary(sid).await?["current"], a.exec_id.to_string(), "adopted");
    output(&bus, sid, a.exec_id, 2, "three").await?;
    event(&bus, sid, a.exec_id, saved(1)).await?;
    let everything = sse_until(&second.base, sid, None, is_done(a.exec_id)).await?;
    let printed_in = |lines: &[&str]| -> anyhow::Result<Vec<String>> {
        let items = lines.iter().map(|l| serde_json::from_str(l)).collect::<Result<Vec<StreamItem>, _>>()?;
        Ok(printed(&items))
    };

    let mut last_id = None;
    for cut in 0..seen.len() {
        let got = sse_until(&second.base, sid, Some(seen[cut].0.as_str()), is_done(a.exec_id)).await?;
        let mut lines: Vec<&str> = seen[..=cut].iter().map(|(_, data)| data.as_str()).collect();
        lines.extend(got.iter().map(|(_, data)| data.as_str()));
        let mut unique = lines.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), lines.len(), "resumed after item {cut}, an item came twice: {got:#?}");
        for (_, data) in &everything {
            assert!(lines.contains(&data.as_str()), "resumed after item {cut}, {data} is missing");
        }
        assert_eq!(printed_in(&lines[..])?, ["one ", "two ", "three"], "resumed after item {cut}");
        // what came after, in the order the second frontend emits it
        let at: Vec<usize> = got.iter().filter_map(|(_, d)| everything.iter().position(|(_, e)| e == d)).collect();
        assert_eq!(at.len(), got.len());
        assert!(at.windows(2).all(|w| w[0] < w[1]), "resumed after item {cut}: {at:?}");
        last_id = got.last().map(|(id, _)| id.clone());
    }
    // resuming from the last of them on the same frontend: only what comes next
    let run = next_run(&bus, &mut runs).await?;
    assert_eq!(run.exec_id, b.exec_id);
    let claimed = EventKind::Claimed { host: "fake".into(), slot: Some(0), prepare: Prepare::Cold };
    event(&bus, sid, b.exec_id, claimed).await?;
    let last = last_id.context("items came after the restart")?;
    let next = sse_events(&second.base, sid, Some(last.as_str()), 1).await?;
    assert!(next[0].1.contains("\"claimed\"") && next[0].1.contains(&b.exec_id.to_string()), "{next:?}");
    Ok(())
}

/// Cells too large for the session's record, queued behind a running one, are
/// accepted: their code is kept aside and the record names it. Each is sent whole
/// when its turn comes, also by a frontend restarted meanwhile, and its code kept
/// aside is deleted then (or when the run is aborted). The queue's length is
/// still bounded (429).
#[actix_rt::test]
async fn large_cells_queued_behind_a_running_one_are_kept_aside_and_run_whole() -> anyhow::Result<()> {
    use looseleaf_frontend::records::{read_aside, Records, ASIDE_RECORD_VERSION};
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let listen: std::net::SocketAddr = format!("127.0.0.1:{}", looseleaf_test_support::free_port()?).parse()?;
    let configure = move |c: &mut Config| {
        c.listen = listen;
        c.limits.queued_runs = 2;
    };
    let first = start_frontend_with(&nats, &prefix, configure).await?;
    let sid = first.client.create_session("/tmp", true, false).await?;
    let bus = Bus::connect(nats.url(), &prefix, "fake").await?;
    let mut runs = bus.subscribe::<RunV3>(bus.subjects().run(sid)).await?;
    bus.flush().await?;
    let records = Records::new(schemas::buckets::sessions(&bus.jetstream(), &prefix, 1).await?);
    let bodies = schemas::bodies::Bodies::new(bus.client().clone(), &prefix, 1);
    let big = |c: &str| format!("s = '{}'\nprint(len(s))", c.repeat(1_500_000));

    let a = first.client.run(sid, "a", "x = 1").await?;
    next_run(&bus, &mut runs).await?;
    let (b_code, c_code) = (big("b"), big("c"));
    let b = first.client.run(sid, "b", &b_code).await?;
    let c = first.client.run(sid, "c", &c_code).await?;
    assert_eq!((b.position, c.position), (1, 2));
    let err = first.client.run(sid, "d", "3").await.expect_err("a third queued run");
    assert_eq!(err.status(), Some(reqwest::StatusCode::TOO_MANY_REQUESTS), "{err}");
    // the record names where their code is, and holds none of it
    let record = records.get(sid).await?.context("the session's record")?;
    assert_eq!(record.version, ASIDE_RECORD_VERSION);
    assert!(record.queued.iter().all(|q| q.code.is_empty()), "{:?}", record.queued.len());
    let kept = record.queued.iter().map(|q| q.aside.clone()).collect::<Option<Vec<String>>>().context("aside")?;
    assert_eq!(read_aside(&bodies, &kept[0]).await?.code, b_code);
    drop(first); // the frontend goes away with both queued

    let second = start_frontend_with(&nats, &prefix, configure).await?;
    let summary = second.client.summary(sid).await?;
    assert_eq!(summary["queue"], serde_json::json!([b.exec_id, c.exec_id]), "{summary}");
    event(&bus, sid, a.exec_id, saved(1)).await?;
    let run = next_run(&bus, &mut runs).await?;
    assert_eq!(run.exec_id, b.exec_id);
    assert!(run.code == b_code, "b's code read back whole ({} bytes)", run.code.len());
    // sent: its code kept aside is deleted (c's stays until its turn)
    let gone = |header: String| {
        let bodies = bodies.clone();
        move || {
            let (bodies, header) = (bodies.clone(), header.clone());
            async move { read_aside(&bodies, &header).await.is_err() }
        }
    };
    looseleaf_test_support::wait_for_async(WAIT, gone(kept[0].clone())).await?;
    assert_eq!(read_aside(&bodies, &kept[1]).await?.code, c_code);
    event(&bus, sid, b.exec_id, saved(2)).await?;
    let run = next_run(&bus, &mut runs).await?;
    assert_eq!((run.exec_id, run.after_revision), (c.exec_id, 2));
    assert!(run.code == c_code, "c's code read back whole ({} bytes)", run.code.len());
    looseleaf_test_support::wait_for_async(WAIT, gone(kept[1].clone())).await?;

    // one queued here and aborted by an interrupt: its code kept aside is deleted
    let d = second.client.run(sid, "d", &big("d")).await?;
    assert_eq!(d.position, 1);
    let record = records.get(sid).await?.context("the session's record")?;
    let header = record.queued.front().and_then(|q| q.aside.clone()).context("d's code kept aside")?;
    assert!(!gone(header.clone())().await, "d's code is kept");
    let interrupted = second.client.interrupt(sid).await?;
    assert_eq!(interrupted.aborted, [d.exec_id]);
    looseleaf_test_support::wait_for_async(WAIT, gone(header)).await?;
    Ok(())
}
