//! The HTTP API as documented, through faults that heal (issue "Faults that heal"):
//! - a body over 8 MiB is refused with 413 (docs/security.md), with its length
//!   declared or sent in chunks, and the largest cell under it runs;
//! - a cell queued behind a running one is accepted at any size an idle session
//!   takes, and runs with its whole code, also after a frontend restart (ADR 53);
//! - an event stream resumed with `Last-Event-ID` repeats no item and keeps their
//!   order, on the same frontend and on one restarted meanwhile (ADR 53).
//!
//! The stream is read raw here, as a browser's `EventSource` reads it: the client
//! crate's reader drops repeated items itself, which would hide a repeat.

use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::stream::SseParser;
use looseleaf_test_support::cluster::{bin_dir_of, Services, WAIT};
use uuid::Uuid;

/// The body limit docs/security.md promises.
const BODY_LIMIT: usize = 8 << 20;

#[tokio::test(flavor = "multi_thread")]
async fn bodies_over_8_mib_are_refused_with_413_and_the_largest_cell_under_runs() -> anyhow::Result<()> {
    assert_eq!(looseleaf_frontend::http::MAX_BODY_BYTES, BODY_LIMIT);
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    let url = format!("{}/v1/sessions/{}/cells/big/run", services.frontend, s.sid);
    let http = reqwest::Client::new();

    // 9 MB and 20 MB, their length declared
    for size in [9_000_000, 20_000_000] {
        let body = serde_json::json!({ "code": format!("s = '{}'", "y".repeat(size)) }).to_string();
        let length = body.len();
        let resp = http.post(&url).header("content-type", "application/json").body(body).send().await?;
        assert_eq!(resp.status(), reqwest::StatusCode::PAYLOAD_TOO_LARGE, "a body of {length} bytes");
        let answer: serde_json::Value = resp.json().await?;
        let error = answer["error"].as_str().unwrap_or_default();
        let named = format!("is {length} bytes, over the limit of {BODY_LIMIT} bytes (8 MiB)");
        assert!(error.contains(&named), "{answer}");
    }
    // 20 MiB in chunks, no length declared
    let chunks = (0..20).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1 << 20]));
    let resp = http
        .post(&url)
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await?;
    assert_eq!(resp.status(), reqwest::StatusCode::PAYLOAD_TOO_LARGE);
    let answer: serde_json::Value = resp.json().await?;
    assert!(answer["error"].as_str().unwrap_or_default().contains("over the limit of 8388608 bytes"), "{answer}");
    // none of them ran
    let summary = s.fe.summary(s.sid).await?;
    assert_eq!(summary["executions"], serde_json::json!([]), "{summary}");

    // a cell just under the limit (with the JSON around it) is accepted and runs
    let n = BODY_LIMIT - (64 << 10);
    let (status, error, text) = s.run("fits", &format!("s = '{}'\nprint(len(s))", "y".repeat(n))).await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?}");
    assert!(text.contains(&n.to_string()), "{text}");
    Ok(())
}

/// A cell that prints `first` and then waits until file `gate` exists.
fn gated(gate: &std::path::Path, first: &str, then: &str) -> String {
    format!(
        "import os, time\nprint({first:?}, flush=True)\nwhile not os.path.exists({:?}):\n    time.sleep(0.05)\n\
         print({then:?}, flush=True)",
        gate.display().to_string()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_cell_queued_behind_a_running_one_is_accepted_and_runs_also_after_a_frontend_restart(
) -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    let n = 1_500_000;
    let big = |name: &str| format!("s = '{}'\nprint({name:?}, len(s))", "y".repeat(n));

    for restart in [false, true] {
        let gate = s.cwd.path().join(format!("gate-{restart}"));
        let running = s.fe.run(s.sid, "wait", &gated(&gate, "waiting", "let go")).await?.exec_id;
        s.events.started(running).await?;
        // queued behind the running cell, over what the session's record keeps
        let name = format!("big-{restart}");
        let queued = s.fe.run(s.sid, &name, &big(name.as_str())).await?;
        assert_eq!(queued.position, 1, "it waits behind the running cell");
        if restart {
            services.restart("looseleaf-frontend")?;
        }
        std::fs::write(&gate, "")?;
        let (status, error) = s.events.outcome(running).await?;
        assert_eq!(status, ExecStatus::Ok, "{error:?}");
        let (status, error) = s.events.outcome(queued.exec_id).await?;
        assert_eq!(status, ExecStatus::Ok, "restart {restart}: {error:?}");
        let text = s.events.text(queued.exec_id);
        assert!(text.contains(&format!("{name} {n}")), "restart {restart}: {text}");
    }
    Ok(())
}

/// `sid`'s event stream read raw from its start (or after `last`), until and with
/// the item `stop` accepts: each item's SSE id and data.
async fn read_until(
    base: &str,
    sid: Uuid,
    last: Option<&str>,
    stop: impl Fn(&StreamItem) -> bool,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut req = reqwest::Client::new().get(format!("{base}/v1/sessions/{sid}/events"));
    if let Some(last) = last {
        req = req.header("Last-Event-ID", last);
    }
    let mut body = req.send().await?.error_for_status()?.bytes_stream();
    let (mut parser, mut items) = (SseParser::new(), Vec::new());
    loop {
        let chunk =
            tokio::time::timeout(WAIT, body.next()).await.context("no event")?.context("the stream ended")??;
        for event in parser.push_events(&chunk) {
            let item: StreamItem = serde_json::from_str(&event.data)?;
            items.push((event.id.context("an item without an id")?, event.data));
            if stop(&item) {
                return Ok(items);
            }
        }
    }
}

fn printed(exec: Uuid, what: &'static str) -> impl Fn(&StreamItem) -> bool {
    move |i| {
        matches!(i, StreamItem::Output { exec_id, output, .. }
            if *exec_id == exec && output.to_json()["text"].as_str().is_some_and(|t| t.contains(what)))
    }
}

fn done(exec: Uuid) -> impl Fn(&StreamItem) -> bool {
    move |i| matches!(i, StreamItem::Done { exec_id, .. } if *exec_id == exec)
}

/// The data of the items about `exec` among `items`.
fn about(exec: Uuid, items: &[(String, String)]) -> anyhow::Result<Vec<&str>> {
    let mut of = Vec::new();
    for (_, data) in items {
        let exec_id = match serde_json::from_str::<StreamItem>(data)? {
            StreamItem::Queued { exec_id, .. }
            | StreamItem::Event { exec_id, .. }
            | StreamItem::Output { exec_id, .. }
            | StreamItem::Done { exec_id, .. } => exec_id,
        };
        if exec_id == exec {
            of.push(data.as_str());
        }
    }
    Ok(of)
}

/// What a reader that saw `before` and then resumed and got `after` got of `exec`:
/// no item twice, its outputs' text in order.
fn assert_once(exec: Uuid, before: &[(String, String)], after: &[(String, String)]) -> anyhow::Result<String> {
    let mut all = about(exec, before)?;
    all.extend(about(exec, after)?);
    let mut unique = all.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), all.len(), "an item came twice: {all:#?}");
    let queued = all.iter().filter(|d| d.contains("\"type\":\"queued\"")).count();
    let done = all.iter().filter(|d| d.contains("\"type\":\"done\"")).count();
    assert_eq!((queued, done), (1, 1), "{all:#?}");
    let mut text = String::new();
    for data in &all {
        if let StreamItem::Output { output, .. } = serde_json::from_str::<StreamItem>(data)? {
            text.push_str(output.to_json()["text"].as_str().unwrap_or_default());
        }
    }
    Ok(text)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_event_stream_repeats_no_item_also_after_a_frontend_restart() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[]).await?;
    let base = services.frontend.clone();

    // on the same frontend: what the resumed reader gets is exactly what a reader
    // from the start gets after the last item the first saw
    let s = services.session(false).await?;
    let gate = s.cwd.path().join("gate-same");
    let exec = s.fe.run(s.sid, "a", &gated(&gate, "one", "two")).await?.exec_id;
    let before = read_until(&base, s.sid, None, printed(exec, "one")).await?;
    std::fs::write(&gate, "")?;
    let last = before.last().map(|(id, _)| id.clone()).context("items")?;
    let after = read_until(&base, s.sid, Some(last.as_str()), done(exec)).await?;
    let whole = read_until(&base, s.sid, None, done(exec)).await?;
    let data = |items: &[(String, String)]| items.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>();
    assert_eq!(
        [data(&before[..]), data(&after[..])].concat(),
        data(&whole[..]),
        "resumed: nothing twice, nothing missing"
    );
    assert_eq!(assert_once(exec, &before, &after)?, "one\ntwo\n");

    // across a frontend restart while the cell runs: the restarted frontend reads
    // the run back and emits it again; the resumed reader gets what it did not see
    let s = services.session(false).await?;
    let gate = s.cwd.path().join("gate-restart");
    let exec = s.fe.run(s.sid, "a", &gated(&gate, "one", "two")).await?.exec_id;
    let before = read_until(&base, s.sid, None, printed(exec, "one")).await?;
    services.restart("looseleaf-frontend")?;
    let health = format!("{base}/v1/health");
    looseleaf_test_support::wait_for_async(Duration::from_secs(60), || {
        let health = health.clone();
        async move { reqwest::get(&health).await.is_ok_and(|r| r.status().is_success()) }
    })
    .await?;
    std::fs::write(&gate, "")?;
    let last = before.last().map(|(id, _)| id.clone()).context("items")?;
    let after = read_until(&base, s.sid, Some(last.as_str()), done(exec)).await?;
    assert_eq!(assert_once(exec, &before, &after)?, "one\ntwo\n");
    let outcome = after.last().map(|(_, d)| serde_json::from_str::<StreamItem>(d)).transpose()?;
    assert!(matches!(outcome, Some(StreamItem::Done { status: ExecStatus::Ok, .. })), "{outcome:?}");
    Ok(())
}
