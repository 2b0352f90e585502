//! Planner replicas (ADR 60): two planners, one holding the lease and planning,
//! the other standing by. The active one killed while the user types and then
//! runs: no run is lost, no cell gets a second prepared worker, and the cells
//! typed after the standby took over still start on prepared workers.

use std::time::Duration;

use futures::StreamExt;
use looseleaf_client::api::StreamItem;
use looseleaf_client::events::{Event, Prepare};
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services};
use uuid::Uuid;

/// How a run started: whether on a prepared worker, and which.
fn started(events: &Events, exec: Uuid) -> Option<(Prepare, String)> {
    events.seen.iter().find_map(|i| match i {
        StreamItem::Event { exec_id, event: Event::Started { prepare, worker, .. }, .. } if *exec_id == exec => {
            Some((*prepare, worker.clone()))
        }
        _ => None,
    })
}

/// The distinct workers prepared for `cell` (its Ready events).
fn prepared_workers(events: &Events, cell: &str) -> std::collections::BTreeSet<String> {
    events
        .seen
        .iter()
        .filter_map(|i| match i {
            StreamItem::Event { event: Event::Ready { cell_id, worker, .. }, .. } if cell_id == cell => {
                Some(worker.clone())
            }
            _ => None,
        })
        .collect()
}

/// (planner instances that answer `$SRV.INFO`, those with the `run` endpoint).
async fn planners(services: &Services) -> anyhow::Result<(usize, usize)> {
    let client = async_nats::connect(services.nats.url()).await?;
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await?;
    client.publish_with_reply("$SRV.INFO.looseleaf-planner", inbox, "".into()).await?;
    client.flush().await?;
    let (mut instances, mut serving) = (0, 0);
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(1), replies.next()).await {
        let info: serde_json::Value = serde_json::from_slice(&m.payload)?;
        instances += 1;
        if info["endpoints"].as_array().is_some_and(|e| e.iter().any(|e| e["name"] == "run")) {
            serving += 1;
        }
    }
    Ok((instances, serving))
}

async fn ready(events: &mut Events, cell: &str) -> anyhow::Result<()> {
    events
        .until(|i| matches!(i, StreamItem::Event { event: Event::Ready { cell_id, .. }, .. } if cell_id == cell))
        .await?;
    Ok(())
}

#[actix_rt::test]
async fn a_standby_planner_takes_over_and_loses_no_run_or_preparation() -> anyhow::Result<()> {
    let mut services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[2], &[]).await?;
    // the first planner holds the lease (it started before the hosts were ready)
    services.start_another("looseleaf-planner-standby", "looseleaf-planner")?;
    // both run; only the holder serves runs (and hears edits)
    let mut seen = (0, 0);
    for _ in 0..30 {
        seen = planners(&services).await?;
        if seen.0 == 2 {
            break;
        }
    }
    assert_eq!(seen, (2, 1), "(planners, planners serving runs)");
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), false, true).await?;
    let mut events = Events::open(&fe, sid).await?;

    let r0 = fe.run(sid, "c0", "%%cpu\nx = 41").await?;
    events.done(r0.exec_id).await?;
    fe.edit(sid, "c1", "%%gpu\nprint(x + 1)").await?;
    ready(&mut events, "c1").await?;

    // the active planner dies while the user types; the run is sent before the
    // standby took over (it takes the lease once it has been silent for 4 s)
    services.kill("looseleaf-planner")?;
    fe.edit(sid, "c1", "%%gpu\nprint(x + 1)  # the answer").await?;
    let r1 = fe.run(sid, "c1", "%%gpu\nprint(x + 1)  # the answer").await?;
    let out = events.done(r1.exec_id).await?;
    assert!(out.contains("42"), "the run sent while no planner planned ran: {out}");

    // the next cells, typed after the takeover, start on workers prepared for them
    for (cell, code, want) in [("c2", "%%gpu\nprint(x + 2)", "43"), ("c3", "%%gpu\ny = x * 2\nprint(y)", "82")] {
        fe.edit(sid, cell, code).await?;
        ready(&mut events, cell).await?;
        let r = fe.run(sid, cell, code).await?;
        let out = events.done(r.exec_id).await?;
        assert!(out.contains(want), "{cell}: {out}");
        let (prepare, worker) = started(&events, r.exec_id).expect("the run started");
        assert_eq!(prepare, Prepare::Speculative, "{cell} ran on worker {worker}, not the one prepared for it");
    }
    assert_eq!(planners(&services).await?, (1, 1), "the standby took over");
    // one prepared worker per cell: the new planner did not prepare a cell twice
    for cell in ["c1", "c2", "c3"] {
        let workers = prepared_workers(&events, cell);
        assert_eq!(workers.len(), 1, "{cell} was prepared on {workers:?}");
    }
    Ok(())
}
