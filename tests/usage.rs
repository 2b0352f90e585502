//! Usage (issue 40, ADR 66): two users run GPU and CPU cells on one cluster; what
//! `GET /v1/usage` books for each session equals what the session's own events
//! reported (the GPU-slot time its slots were held, the time its CPU cells ran,
//! its runs); each user reads only their own, an admin every user's, and the
//! report comes as CSV too. Bad questions are refused naming what is wrong.

use std::collections::HashMap;
use std::time::Duration;

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::{Device, Event};
use looseleaf_client::usage::{UsageBy, UsageReport};
use looseleaf_client::Frontend;
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services};
use uuid::Uuid;

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";
const ROOT: &str = "root-token-0123456789a";

/// What a session's events reported: GPU-slot seconds, CPU seconds, runs started, GPU runs.
fn reported(seen: &[StreamItem]) -> (f64, f64, u64, u64) {
    let mut device: HashMap<Uuid, Device> = HashMap::new();
    let (mut gpu_ms, mut cpu_ms, mut cells, mut gpu_cells) = (0.0, 0.0, 0, 0);
    for item in seen {
        let StreamItem::Event { exec_id, event, .. } = item else { continue };
        match event {
            Event::Started { device: d, .. } => {
                device.insert(*exec_id, *d);
                cells += 1;
                gpu_cells += u64::from(*d == Device::Gpu);
            }
            Event::Finished { run_ms, .. } if device.get(exec_id) == Some(&Device::Cpu) => cpu_ms += run_ms,
            Event::SlotReleased { held_ms, .. } => gpu_ms += held_ms,
            _ => {}
        }
    }
    (gpu_ms / 1000.0, cpu_ms / 1000.0, cells, gpu_cells)
}

/// Run `cells` in a new session of `fe` and return it with its events, once
/// every GPU cell's slot was released.
async fn run_session(fe: &Frontend, all_gpu: bool, cells: &[&str]) -> anyhow::Result<(Uuid, Events)> {
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), all_gpu, false).await?;
    let mut events = Events::open(fe, sid).await?;
    for (i, code) in cells.iter().enumerate() {
        let exec = fe.run(sid, &format!("c{i}"), code).await?.exec_id;
        let (status, error) = events.outcome(exec).await?;
        assert_eq!(status, ExecStatus::Ok, "{error:?}");
        // a GPU cell's slot is released as the session's (no run's) once it is done
        let released = |i: &StreamItem| matches!(i, StreamItem::Event { event: Event::SlotReleased { .. }, .. });
        while all_gpu && events.seen.iter().filter(|i| released(i)).count() <= i {
            events.until(released).await?;
        }
    }
    Ok((sid, events))
}

/// The usage report once `check` holds for it (bookings land a moment after a run ends).
async fn report_when(fe: &Frontend, by: UsageBy, check: impl Fn(&UsageReport) -> bool) -> anyhow::Result<UsageReport> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let report = fe.usage(by, None, None, None).await?;
        if check(&report) {
            return Ok(report);
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the usage never matched: {report:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn usage_is_booked_per_session_and_user_and_each_user_reads_their_own() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("alice {ALICE}\nbob {BOB}\nroot {ROOT} admin\n"))?;
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let env = [
        ("LOOSELEAF_TOKENS_FILE", tokens.display().to_string()),
        ("LOOSELEAF_INSECURE_SHARED_WORKERS", "true".to_string()),
    ];
    let services = Services::start(&bin, &[1], &env).await?;
    let (alice, bob, root) =
        (services.client().with_token(ALICE), services.client().with_token(BOB), services.client().with_token(ROOT));

    let (alice_gpu, alice_gpu_events) = run_session(&alice, true, &["x = 6 * 7", "y = x + 1"]).await?;
    let (alice_cpu, alice_cpu_events) = run_session(&alice, false, &["import time; time.sleep(0.3)"]).await?;
    let (bob_gpu, bob_events) = run_session(&bob, true, &["z = sum(range(10**6))"]).await?;

    // each session's row equals what its events reported
    let expected: Vec<(Uuid, (f64, f64, u64, u64))> = vec![
        (alice_gpu, reported(&alice_gpu_events.seen)),
        (alice_cpu, reported(&alice_cpu_events.seen)),
        (bob_gpu, reported(&bob_events.seen)),
    ];
    assert!(expected[0].1 .0 > 0.0 && expected[0].1 .3 == 2, "alice's GPU cells held a slot: {expected:?}");
    assert!(expected[1].1 .1 >= 0.3 && expected[1].1 .3 == 0, "alice's CPU cell ran 0.3 s: {expected:?}");
    let matches = |r: &UsageReport, sid: Uuid, want: (f64, f64, u64, u64)| {
        r.rows.iter().any(|row| {
            row.session_id == Some(sid)
                && (row.gpu_seconds - want.0).abs() < 1e-6
                && (row.cpu_seconds - want.1).abs() < 1e-6
                && (row.cells, row.gpu_cells) == (want.2, want.3)
        })
    };
    let all =
        report_when(&root, UsageBy::Session, |r| expected.iter().all(|(sid, want)| matches(r, *sid, *want))).await?;
    assert_eq!(all.rows.len(), 3, "the admin reads every user's sessions: {all:#?}");

    // a user reads their own, and no one else's
    let mine = alice.usage(UsageBy::Session, None, None, None).await?;
    let sessions: Vec<_> = mine.rows.iter().filter_map(|r| r.session_id).collect();
    assert!(
        sessions.contains(&alice_gpu) && sessions.contains(&alice_cpu) && !sessions.contains(&bob_gpu),
        "{mine:#?}"
    );
    let refused = bob.usage(UsageBy::User, None, None, Some("alice")).await.unwrap_err().to_string();
    assert!(refused.contains("403") && refused.contains("only an admin"), "{refused}");
    let by_user = root.usage(UsageBy::User, None, None, None).await?;
    let alice_row = by_user.rows.iter().find(|r| r.user.as_deref() == Some("alice")).expect("alice's row");
    let alice_sum = expected[0].1 .0 + expected[1].1 .0;
    assert!((alice_row.gpu_seconds - alice_sum).abs() < 1e-6 && alice_row.cells == 3, "{by_user:#?}");
    let only_bob = root.usage(UsageBy::Day, None, None, Some("bob")).await?;
    assert_eq!(only_bob.rows.len(), 1, "{only_bob:#?}");
    assert_eq!(only_bob.rows[0].user.as_deref(), Some("bob"));

    // CSV, and questions that are not
    let http = reqwest::Client::new();
    let get = |query: &str| http.get(format!("{}/v1/usage?{query}", services.frontend)).bearer_auth(ROOT).send();
    let csv = get("by=user&format=csv").await?;
    assert_eq!(csv.headers()["content-type"], "text/csv; charset=utf-8");
    let text = csv.text().await?;
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("user,gpu_seconds,cpu_seconds,cells,gpu_cells"));
    assert!(lines.any(|l| l.starts_with("bob,") && l.ends_with(",1,1")), "{text}");
    for (query, says) in [
        ("from=yesterday", "not a day"),
        ("from=2026-12-02&to=2026-12-01", "after"),
        ("by=month", "usage query"),
        ("format=xml", "json and csv"),
    ] {
        let answer = get(query).await?;
        assert_eq!(answer.status(), 400, "{query}");
        let body = answer.text().await?;
        assert!(body.contains(says), "{query}: {body}");
    }
    Ok(())
}
