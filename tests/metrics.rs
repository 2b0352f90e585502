//! `/metrics` on every service (issue 15, item 5; ADR 39): the four binaries with
//! `--health-listen`, a session that runs a cold cell and a prepared one, then a
//! NATS restart; each service's families say what happened.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::Event;
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services};
use looseleaf_test_support::{free_port, random_prefix, NatsServer};
use schemas::nats::NatsOptions;

/// A scrape: `name{labels}` -> value.
type Scrape = BTreeMap<String, f64>;

async fn scrape(address: &str) -> anyhow::Result<Scrape> {
    // as Prometheus asks
    let accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let resp = reqwest::Client::new()
        .get(format!("http://{address}/metrics"))
        .header("accept", accept)
        .send()
        .await?
        .error_for_status()?;
    let kind = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    anyhow::ensure!(kind.starts_with("application/openmetrics-text"), "content type {kind}");
    let text = resp.text().await?;
    anyhow::ensure!(text.ends_with("# EOF\n"), "{text}");
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect())
}

fn value(s: &Scrape, key: &str) -> f64 {
    s.get(key).copied().unwrap_or(0.0)
}

/// Scrape `address` until `done` holds (metrics are updated as events happen).
async fn until(address: &str, what: &str, done: impl Fn(&Scrape) -> bool) -> anyhow::Result<Scrape> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = scrape(address).await?;
        if done(&s) {
            return Ok(s);
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "{address}: never {what}: {s:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What `promtool check metrics` says of `text` (its lint findings; empty when it
/// finds nothing).
fn promtool_check(text: &str) -> anyhow::Result<String> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("promtool (Debian's prometheus, installed by scripts/setup-tests): {e}"))?;
    child.stdin.take().ok_or_else(|| anyhow::anyhow!("promtool's stdin"))?.write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    Ok(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// `$SRV.STATS` of service `name` (one instance runs): its endpoints by name.
async fn srv_stats(client: &async_nats::Client, name: &str) -> anyhow::Result<BTreeMap<String, serde_json::Value>> {
    let reply = client.request(format!("$SRV.STATS.{name}"), "".into()).await?;
    let stats: serde_json::Value = serde_json::from_slice(&reply.payload)?;
    let endpoints = stats["endpoints"].as_array().cloned().unwrap_or_default();
    Ok(endpoints.into_iter().map(|e| (e["name"].as_str().unwrap_or_default().to_string(), e)).collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn every_service_exports_what_happened() -> anyhow::Result<()> {
    let mut listen = HashMap::new();
    for name in ["looseleaf-store", "looseleaf-planner", "host-0", "looseleaf-frontend"] {
        listen.insert(name.to_string(), format!("127.0.0.1:{}", free_port()?));
    }
    let nats = NatsServer::start()?;
    let url = nats.url().to_string();
    let addresses = listen.clone();
    let per_service = Box::new(move |name: &str| {
        addresses.get(name).map(|a| vec![("LOOSELEAF_HEALTH_LISTEN".to_string(), a.clone())]).unwrap_or_default()
    });
    let env = [("LOOSELEAF_NATS_URL", url.clone())];
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services =
        Services::start_on(&bin, &[1], &env, nats, NatsOptions::url(&url), random_prefix(), per_service).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), true, true).await?;
    let mut events = Events::open(&fe, sid).await?;
    // a cold start (Run with no edit before it), then a cell prepared while edited
    let cold = fe.run(sid, "c1", "x = list(range(1000))").await?.exec_id;
    anyhow::ensure!(events.outcome(cold).await?.1.is_none(), "the cold cell failed");
    fe.edit(sid, "c2", "y = len(x)").await?;
    events
        .until(|i| matches!(i, StreamItem::Event { event: Event::Ready { cell_id, .. }, .. } if cell_id == "c2"))
        .await?;
    let prepared = fe.run(sid, "c2", "y = len(x)").await?.exec_id;
    anyhow::ensure!(events.outcome(prepared).await?.1.is_none(), "the prepared cell failed");

    let frontend = until(&listen["looseleaf-frontend"], "two start delays", |s| {
        value(s, r#"looseleaf_start_delay_seconds_count{prepare="cold"}"#) >= 1.0
            && value(s, r#"looseleaf_start_delay_seconds_count{prepare="speculative"}"#) >= 1.0
    })
    .await?;
    assert_eq!(value(&frontend, "looseleaf_sessions"), 1.0);
    assert_eq!(value(&frontend, r#"looseleaf_cells_total{status="ok"}"#), 2.0, "{frontend:#?}");
    // "within 1 s" is a bucket of its own
    let within_1s = value(&frontend, r#"looseleaf_start_delay_seconds_bucket{le="1.0",prepare="speculative"}"#);
    assert!(within_1s >= 1.0, "{frontend:#?}");
    let runs = r#"http_server_request_duration_seconds_count{http_request_method="POST",http_route="/v1/sessions/{sid}/cells/{cell_id}/run",http_response_status_code="200"}"#;
    assert_eq!(value(&frontend, runs), 2.0, "{frontend:#?}");
    assert_eq!(value(&frontend, &format!(r#"looseleaf_build_info{{version="{}"}}"#, env!("CARGO_PKG_VERSION"))), 1.0);
    assert!(value(&frontend, "process_resident_memory_bytes") > 0.0, "{frontend:#?}");
    // a scraper that does not ask for OpenMetrics gets the text format 0.0.4,
    // which promtool finds nothing to say of
    let plain = reqwest::get(format!("http://{}/metrics", listen["looseleaf-frontend"])).await?;
    let kind = plain.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");
    let text = plain.text().await?;
    assert!(!text.contains("# EOF") && text.contains("# TYPE looseleaf_cells_total counter"), "{text}");
    assert_eq!(promtool_check(&text)?, "", "promtool check metrics on the frontend's /metrics");
    let host = until(&listen["host-0"], "the runs' slot time", |s| {
        value(s, r#"looseleaf_gpu_slot_seconds_total{use="cell"}"#) > 0.0
            && value(s, r#"looseleaf_gpu_slots{state="busy"}"#) == 0.0
    })
    .await?;
    for key in [
        r#"looseleaf_start_phase_seconds_count{phase="fork"}"#,
        r#"looseleaf_start_phase_seconds_count{phase="imports"}"#,
        r#"looseleaf_prepared_workers_ended_total{outcome="used"}"#,
        r#"looseleaf_claims_total{claim="prepare",outcome="won"}"#,
        "looseleaf_speculation_misses_total",
        "looseleaf_restored_bytes_total",
        "looseleaf_saved_bytes_total",
    ] {
        assert!(value(&host, key) >= 1.0, "{key} is {} in {host:#?}", value(&host, key));
    }
    assert_eq!(value(&host, r#"looseleaf_claims_total{claim="run",outcome="won"}"#), 2.0, "{host:#?}");
    let lookups = value(&host, r#"looseleaf_chunk_cache_lookups_total{result="hit"}"#)
        + value(&host, r#"looseleaf_chunk_cache_lookups_total{result="miss"}"#);
    assert!(lookups >= 1.0, "restoring x looked up no chunk: {host:#?}");
    let store = scrape(&listen["looseleaf-store"]).await?;
    assert_eq!(value(&store, r#"looseleaf_commits_total{result="committed"}"#), 2.0, "{store:#?}");
    assert_eq!(value(&store, r#"looseleaf_commits_total{result="conflict"}"#), 0.0, "{store:#?}");

    // `$SRV` lists each service's request endpoints with real stats; a request
    // that does not decode is answered with an error, counted as one
    let srv = async_nats::connect(&url).await?;
    let garbage = schemas::subjects::Subjects::new(&services.prefix).store(schemas::subjects::StoreVerb::ManifestGet);
    srv.request(garbage, "not a request".into()).await?;
    let store = srv_stats(&srv, "looseleaf-store").await?;
    assert_eq!(store["commit"]["num_requests"], 2, "{store:#?}");
    assert_eq!(store["commit"]["data"]["errors"], 0, "{store:#?}");
    assert_eq!(store["commit"]["queue_group"], "store", "{store:#?}");
    assert_eq!(store["manifest-get"]["data"]["errors"], 1, "{store:#?}");
    assert!(store["manifest-get"]["num_requests"].as_u64() >= Some(2), "{store:#?}");
    // saves this small upload what their revision lacks without asking the
    // store which of it it has (tests/limits.rs: a large one asks)
    assert_eq!(store["chunk-plan"]["num_requests"], 0, "{store:#?}");
    for verb in ["chunk-plan", "session-delete", "gc", "settle"] {
        assert!(store.contains_key(verb), "no {verb} endpoint: {store:#?}");
    }
    let planner = srv_stats(&srv, "looseleaf-planner").await?;
    assert_eq!(planner["run"]["num_requests"], 2, "{planner:#?}");
    let host = srv_stats(&srv, "looseleaf-gpu-host").await?;
    // edits' recipes are plain publishes (nothing to answer): only the two runs count
    assert_eq!(host["recipe"]["num_requests"], 2, "{host:#?}");
    assert!(host.contains_key("query") && host.contains_key("comm"), "{host:#?}");

    // a cell that raises is counted an error, not ok (though its state is saved)
    let raised = fe.run(sid, "c3", "1 / 0").await?.exec_id;
    anyhow::ensure!(events.outcome(raised).await?.0 == ExecStatus::Error, "1 / 0 did not end as an error");
    let frontend = until(&listen["looseleaf-frontend"], "the error counted", |s| {
        value(s, r#"looseleaf_cells_total{status="error"}"#) >= 1.0
    })
    .await?;
    assert_eq!(value(&frontend, r#"looseleaf_cells_total{status="ok"}"#), 2.0, "{frontend:#?}");

    // the runs gauge: a long cell running with another queued behind it, then none
    let long = fe.run(sid, "c4", "import time\ntime.sleep(6)").await?.exec_id;
    let behind = fe.run(sid, "c5", "z = 1").await?.exec_id;
    let busy = until(&listen["looseleaf-frontend"], "a run running and one queued", |s| {
        value(s, r#"looseleaf_runs{state="running"}"#) == 1.0 && value(s, r#"looseleaf_runs{state="queued"}"#) == 1.0
    })
    .await?;
    assert_eq!(value(&busy, r#"looseleaf_runs{state="unclaimed"}"#), 0.0, "{busy:#?}");
    anyhow::ensure!(events.outcome(long).await?.1.is_none(), "the long cell failed");
    anyhow::ensure!(events.outcome(behind).await?.1.is_none(), "the queued cell failed");
    until(&listen["looseleaf-frontend"], "no runs left", |s| {
        ["queued", "unclaimed", "running"].iter().all(|k| value(s, &format!(r#"looseleaf_runs{{state="{k}"}}"#)) == 0.0)
    })
    .await?;

    // NATS goes away and comes back: every service counts its reconnection
    services.nats.restart()?;
    for (name, address) in &listen {
        until(address, &format!("{name} reconnected"), |s| value(s, "looseleaf_nats_reconnects_total") >= 1.0).await?;
    }
    Ok(())
}
