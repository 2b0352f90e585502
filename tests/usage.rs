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

/// Run `code` as a GPU cell of `s`'s session; its outcome, and whether any host claimed it.
async fn gpu_cell(
    fe: &Frontend,
    sid: Uuid,
    events: &mut Events,
    code: &str,
) -> anyhow::Result<(ExecStatus, String, bool)> {
    let exec = fe.run(sid, "g", code).await?.exec_id;
    let (status, error) = events.outcome(exec).await?;
    let claimed = events
        .seen
        .iter()
        .any(|i| matches!(i, StreamItem::Event { exec_id, event: Event::Claimed { .. }, .. } if *exec_id == exec));
    Ok((status, error.unwrap_or_default(), claimed))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_cell_over_its_users_quota_fails_before_it_takes_a_slot_and_cpu_cells_still_run() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("alice {ALICE}\nbob {BOB}\n"))?;
    let quotas = dir.path().join("quotas");
    std::fs::write(
        &quotas,
        "*  gpu_seconds_per_day=3600\nalice gpu_seconds_per_day=0.001\nbob concurrent_gpu_cells=1\n",
    )?;
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));

    // a malformed quota file stops the frontend at its start, naming the line
    let refused = std::process::Command::new(bin.join("looseleaf-frontend"))
        .args(["--quota-file", &dir.path().join("tokens").display().to_string()])
        .env("LOOSELEAF_NATS_URL", "nats://127.0.0.1:1")
        .output()?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("quota file line 1"), "{stderr}");

    let env = [
        ("LOOSELEAF_TOKENS_FILE", tokens.display().to_string()),
        ("LOOSELEAF_INSECURE_SHARED_WORKERS", "true".to_string()),
        ("LOOSELEAF_QUOTA_FILE", quotas.display().to_string()),
    ];
    let services = Services::start(&bin, &[1], &env).await?;
    let (alice, bob) = (services.client().with_token(ALICE), services.client().with_token(BOB));

    // alice's first GPU cell runs; it uses up her day, so the next one fails
    // before any host claims it, saying what was used, the limit and the reset
    let cwd = tempfile::tempdir()?;
    let gpu = alice.create_session(&cwd.path().display().to_string(), true, false).await?;
    let mut gpu_events = Events::open(&alice, gpu).await?;
    let (status, error, _) = gpu_cell(&alice, gpu, &mut gpu_events, "x = 1").await?;
    assert_eq!(status, ExecStatus::Ok, "{error}");
    report_when(&alice, UsageBy::User, |r| r.rows.iter().any(|row| row.gpu_seconds > 0.0)).await?;
    let (status, error, claimed) = gpu_cell(&alice, gpu, &mut gpu_events, "y = 2").await?;
    assert_eq!(status, ExecStatus::Failed, "{error}");
    assert!(
        error.starts_with("GPU quota reached: alice used") && error.contains("of 0.001 GPU-seconds today"),
        "{error}"
    );
    assert!(error.contains("resets at ") && error.contains("CPU cells still run"), "{error}");
    assert!(!claimed, "a refused cell takes no slot");
    // her CPU cells still run
    let cpu = alice.create_session(&cwd.path().display().to_string(), false, false).await?;
    let mut cpu_events = Events::open(&alice, cpu).await?;
    let exec = alice.run(cpu, "c", "z = 40 + 2").await?.exec_id;
    assert_eq!(cpu_events.outcome(exec).await?.0, ExecStatus::Ok);

    // bob may run one GPU cell at once: a second one, while the first runs, is refused
    let (b1, b2) = (
        bob.create_session(&cwd.path().display().to_string(), true, false).await?,
        bob.create_session(&cwd.path().display().to_string(), true, false).await?,
    );
    let (mut b1_events, mut b2_events) = (Events::open(&bob, b1).await?, Events::open(&bob, b2).await?);
    let long = bob.run(b1, "long", "import time; time.sleep(3)").await?.exec_id;
    b1_events.started(long).await?;
    let (status, error, claimed) = gpu_cell(&bob, b2, &mut b2_events, "w = 1").await?;
    assert_eq!(status, ExecStatus::Failed, "{error}");
    assert!(error.contains("bob runs 1 GPU cells at once, and may run 1") && !claimed, "{error}");
    assert_eq!(b1_events.outcome(long).await?.0, ExecStatus::Ok);
    let (status, error, _) = gpu_cell(&bob, b2, &mut b2_events, "w = 1").await?;
    assert_eq!(status, ExecStatus::Ok, "once the first ended: {error}");

    // a changed file takes effect; a malformed change leaves the quotas as they were
    std::fs::write(&quotas, "alice gpu_seconds_per_day=1000\n")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, error, _) = gpu_cell(&alice, gpu, &mut gpu_events, "y = 2").await?;
        if status == ExecStatus::Ok {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the raised quota never took effect: {error}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    std::fs::write(&quotas, "alice gpu_seconds_per_day=0.001 cells=5\n")?;
    tokio::time::sleep(looseleaf_frontend::quota::RELOAD_EVERY * 2).await;
    let (status, error, _) = gpu_cell(&alice, gpu, &mut gpu_events, "y = 3").await?;
    assert_eq!(status, ExecStatus::Ok, "a malformed file was taken: {error}");
    Ok(())
}
