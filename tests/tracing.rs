//! One trace per cell (issue 15, item 4; ADR 38): the four service binaries export
//! over OTLP to a receiver of the test's own, as they would to a collector. A
//! cell's spans form one tree from the request that ran it through the planner,
//! the host's bid and claim, fork, restore, run, save, the store's commit and the
//! Saved event back at the frontend; a run on a worker prepared while the cell
//! was edited links to that preparation, which is in the edit's trace.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use looseleaf_client::api::StreamItem;
use looseleaf_client::events::{Event, Prepare};
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services};
use looseleaf_test_support::otlp::{OtlpReceiver, ReceivedSpan};
use uuid::Uuid;

/// The spans of one trace, by id.
struct Trace {
    spans: HashMap<String, ReceivedSpan>,
}

impl Trace {
    fn of(all: &[ReceivedSpan], trace_id: &str) -> Self {
        Self { spans: all.iter().filter(|s| s.trace_id == trace_id).map(|s| (s.span_id.clone(), s.clone())).collect() }
    }

    fn named(&self, name: &str) -> Vec<&ReceivedSpan> {
        self.spans.values().filter(|s| s.name == name).collect()
    }

    fn one(&self, name: &str) -> anyhow::Result<&ReceivedSpan> {
        match self.named(name).as_slice() {
            [one] => Ok(one),
            many => anyhow::bail!("{} spans named {name:?} in the trace: {:?}", many.len(), self.names()),
        }
    }

    fn names(&self) -> BTreeSet<String> {
        self.spans.values().map(|s| format!("{}:{}", s.service, s.name)).collect()
    }

    /// Names of `span`'s ancestors in this trace, nearest first.
    fn ancestors(&self, span: &ReceivedSpan) -> Vec<String> {
        let mut out = Vec::new();
        let mut at = self.spans.get(&span.parent_id);
        while let Some(s) = at {
            out.push(s.name.clone());
            at = self.spans.get(&s.parent_id);
        }
        out
    }

    /// [`Trace::ancestors`] but the PRODUCER spans that sent the messages between
    /// them: the steps of the work.
    fn steps(&self, span: &ReceivedSpan) -> Vec<String> {
        let mut out = Vec::new();
        let mut at = self.spans.get(&span.parent_id);
        while let Some(s) = at {
            if s.kind != 4 {
                out.push(s.name.clone());
            }
            at = self.spans.get(&s.parent_id);
        }
        out
    }

    /// Whether `child`'s parent chain reaches a span named `ancestor`.
    fn under(&self, child: &str, ancestor: &str) -> anyhow::Result<bool> {
        Ok(self.ancestors(self.one(child)?).iter().any(|a| a == ancestor))
    }
}

fn has_all(spans: &[ReceivedSpan], trace_id: &str, names: &[&str]) -> bool {
    let got: BTreeSet<&str> = spans.iter().filter(|s| s.trace_id == trace_id).map(|s| s.name.as_str()).collect();
    names.iter().all(|n| got.contains(n))
}

/// The trace whose root `run cell` span names `exec`.
fn trace_of_exec(spans: &[ReceivedSpan], exec: Uuid) -> Option<String> {
    let exec = exec.to_string();
    spans
        .iter()
        .find(|s| s.name == "run cell" && s.attributes.get("looseleaf.exec_id") == Some(&exec))
        .map(|s| s.trace_id.clone())
}

/// What one cell's trace must hold, whatever way its worker was made.
const EVERY_RUN: &[&str] = &[
    "run cell",
    "planner.run",
    "host.recipe",
    "bid and claim",
    "execute",
    "restore",
    "worker restore",
    "imports",
    "load",
    "run",
    "save",
    "store.commit",
    "saved event",
    "frontend.event",
];

/// The services' log filter: what each logs while it handles a cell.
const SERVICE_LOGS: &str =
    "warn,looseleaf_frontend=debug,looseleaf_planner=debug,looseleaf_gpu_host=debug,looseleaf_store=debug";

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_is_one_trace_from_its_request_to_its_saved_event() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint().to_string()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_string()),
        // export soon after a span ends, so the test need not wait long
        ("OTEL_BSP_SCHEDULE_DELAY", "200".to_string()),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test".to_string()),
        // each service's JSON log in a file, with what it logs inside a cell's spans
        ("LOOSELEAF_LOG_FORMAT", "json".to_string()),
        ("LOOSELEAF_LOG", SERVICE_LOGS.to_string()),
    ];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &env).await?;
    let fe = services.client();
    let cwd = tempfile::tempdir()?;
    let sid = fe.create_session(&cwd.path().display().to_string(), true, true).await?;
    let mut events = Events::open(&fe, sid).await?;

    // A cold cell, run without trace context: its trace starts at the frontend.
    let cold = fe.run(sid, "c1", "x = 41").await?.exec_id;
    let (status, error) = events.outcome(cold).await?;
    anyhow::ensure!(error.is_none(), "{status:?} {error:?}");
    let mut all = receiver
        .until(Duration::from_secs(60), "the cold cell's trace", |s| {
            trace_of_exec(s, cold).is_some_and(|t| has_all(s, &t, EVERY_RUN) && has_all(s, &t, &["fork worker"]))
        })
        .await?;
    let trace_id = trace_of_exec(&all, cold).unwrap_or_default();
    let trace = Trace::of(&all, &trace_id);
    // the request's SERVER span is the root, by the HTTP conventions
    let request = "POST /v1/sessions/{sid}/cells/{cell_id}/run";
    let root = trace.one(request)?;
    assert!(root.parent_id.is_empty(), "a run without trace context starts its own trace: {root:?}");
    assert_eq!(root.service, "looseleaf-frontend");
    assert_eq!(root.kind, 2, "{root:?}");
    for (key, value) in [
        ("http.request.method", "POST"),
        ("http.route", "/v1/sessions/{sid}/cells/{cell_id}/run"),
        ("http.response.status_code", "200"),
    ] {
        assert_eq!(root.attributes.get(key).map(String::as_str), Some(value), "{root:?}");
    }
    assert!(trace.under("run cell", request)?, "the cell's span is not under its request's");
    // a message handled is a CONSUMER span named by its subject's template
    let recipe = trace.one("host.recipe")?;
    assert_eq!(recipe.kind, 5, "{recipe:?}");
    assert_eq!(recipe.attributes.get("messaging.operation.type").map(String::as_str), Some("process"));
    assert_eq!(
        recipe.attributes.get("messaging.destination.template").map(String::as_str),
        Some("{prefix}.v1.session.{id}.recipe"),
        "{recipe:?}"
    );
    // and it was sent in a PRODUCER span of the planner's, by the same conventions
    let sent = trace.spans.get(&recipe.parent_id).ok_or_else(|| anyhow::anyhow!("host.recipe has no parent"))?;
    assert_eq!((sent.kind, sent.name.as_str()), (4, "send {prefix}.v1.session.{id}.recipe"), "{sent:?}");
    assert_eq!(sent.service, "looseleaf-planner", "{sent:?}");
    assert_eq!(sent.attributes.get("messaging.operation.type").map(String::as_str), Some("send"), "{sent:?}");
    let services_seen: BTreeSet<&str> = trace.spans.values().map(|s| s.service.as_str()).collect();
    for service in ["looseleaf-frontend", "looseleaf-planner", "looseleaf-gpu-host", "looseleaf-store"] {
        assert!(services_seen.contains(service), "{service} is missing from the trace: {:?}", trace.names());
    }
    // every span's parent is in the trace (no orphan) but the root's
    for s in trace.spans.values().filter(|s| s.span_id != root.span_id) {
        assert!(trace.spans.contains_key(&s.parent_id), "{}:{} has a parent outside the trace", s.service, s.name);
    }
    // the parents are the steps that led to each
    for (child, ancestor) in [
        ("planner.run", "run cell"),
        ("host.recipe", "planner.run"),
        ("bid and claim", "host.recipe"),
        ("execute", "host.recipe"),
        ("fork worker", "execute"),
        ("restore", "execute"),
        ("imports", "worker restore"),
        ("load", "worker restore"),
        ("run", "execute"),
        ("save", "execute"),
        ("store.commit", "save"),
        ("saved event", "execute"),
    ] {
        assert!(
            trace.under(child, ancestor)?,
            "{child} is not under {ancestor}: {:?}",
            trace.ancestors(trace.one(child)?)
        );
    }
    let saved_at_frontend = trace
        .named("frontend.event")
        .into_iter()
        .any(|e| trace.steps(e).first().map(String::as_str) == Some("saved event"));
    assert!(saved_at_frontend, "the frontend's handling of Saved is not a child of the host's 'saved event'");
    let execute = trace.one("execute")?;
    assert_eq!(execute.attributes.get("looseleaf.prepare").map(String::as_str), Some("cold"), "{execute:?}");
    // attributes are the product's own, with plain values
    let claim = trace.one("bid and claim")?;
    assert_eq!(claim.attributes.get("looseleaf.claim.outcome").map(String::as_str), Some("won"), "{claim:?}");
    let imports = trace.one("imports")?;
    let load = trace.one("load")?;
    assert!(imports.start_ns <= imports.end_ns && imports.end_ns <= load.start_ns + 1, "{imports:?} {load:?}");
    assert!(all.iter().all(|s| s.service.starts_with("looseleaf-")), "OTEL_RESOURCE_ATTRIBUTES named no service");
    // a log line written in one of the cell's spans carries that span's ids, in
    // every service, across NATS: a reader of the logs finds the trace
    for (name, service) in [
        ("looseleaf-frontend", "looseleaf-frontend"),
        ("looseleaf-planner", "looseleaf-planner"),
        ("host-0", "looseleaf-gpu-host"),
        ("looseleaf-store", "looseleaf-store"),
    ] {
        let lines = services.log_lines(name)?;
        let in_trace: Vec<&serde_json::Value> = lines.iter().filter(|l| l["trace_id"] == trace_id.as_str()).collect();
        let joined = in_trace.iter().any(|l| {
            let span = l["span_id"].as_str().and_then(|id| trace.spans.get(id));
            span.is_some_and(|s| s.service == service)
        });
        assert!(
            joined,
            "no log line of {name} joins a span of the cell's trace ({} in the trace): {:#?}",
            in_trace.len(),
            &lines[lines.len().saturating_sub(5)..]
        );
    }

    // A cell prepared while edited, run with the caller's own trace context (as
    // the kernel sends for an execute_request): its trace continues the caller's,
    // and its execution links to the preparation, in the edit's trace.
    let code = "y = x + 1\nprint(y)";
    fe.edit(sid, "c2", code).await?;
    events
        .until(|i| matches!(i, StreamItem::Event { event: Event::Ready { cell_id, .. }, .. } if cell_id == "c2"))
        .await?;
    let (caller_trace, caller_span) = (format!("{:032x}", Uuid::new_v4().as_u128()), "00f067aa0ba902b7");
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/sessions/{sid}/cells/c2/run", services.frontend))
        .header("traceparent", format!("00-{caller_trace}-{caller_span}-01"))
        .json(&serde_json::json!({ "code": code }))
        .send()
        .await?
        .error_for_status()?;
    let accepted: serde_json::Value = resp.json().await?;
    let prepared = Uuid::parse_str(accepted["exec_id"].as_str().unwrap_or_default())?;
    events.done(prepared).await?;
    let out: serde_json::Value = serde_json::from_str(&events.text(prepared))?;
    assert_eq!(out["text"], "42\n", "{out}");
    let started = events.seen.iter().find_map(|i| match i {
        StreamItem::Event { exec_id, event: Event::Started { prepare, .. }, .. } if *exec_id == prepared => {
            Some(*prepare)
        }
        _ => None,
    });
    assert_eq!(started, Some(Prepare::Speculative), "the run did not use the prepared worker");
    all = receiver
        .until(Duration::from_secs(60), "the prepared cell's trace", |s| has_all(s, &caller_trace, EVERY_RUN))
        .await?;
    let trace = Trace::of(&all, &caller_trace);
    let root = trace.one(request)?;
    assert_eq!(root.parent_id, caller_span, "the run did not continue the caller's trace");
    assert!(trace.named("fork worker").is_empty(), "a prepared run forks nothing: {:?}", trace.names());
    let execute = trace.one("execute")?;
    let [(linked_trace, linked_span)] = execute.links.as_slice() else {
        anyhow::bail!("the prepared run's execute span has links {:?}, not one", execute.links);
    };
    let linked = all.iter().find(|s| &s.trace_id == linked_trace && &s.span_id == linked_span);
    assert_eq!(linked.map(|s| s.name.as_str()), Some("prepare"), "the run links to {linked:?}");
    let linked_trace = linked_trace.clone();
    let all = receiver
        .until(Duration::from_secs(30), "the edit's trace", |s| {
            has_all(s, &linked_trace, &["cell edit", "planner.edit", "host.recipe", "bid and claim", "prepare"])
        })
        .await;
    let all = match all {
        Ok(a) => a,
        Err(e) => {
            for s in receiver.spans() {
                eprintln!("{} {} {} {}:{}", &s.trace_id[..8], s.span_id, s.parent_id, s.service, s.name);
            }
            return Err(e);
        }
    };
    let edit = Trace::of(&all, &linked_trace);
    let prepare = edit.one("prepare")?;
    assert_eq!(
        edit.steps(prepare),
        ["bid and claim", "host.recipe", "planner.edit", "cell edit", "PUT /v1/sessions/{sid}/cells/{cell_id}"],
        "the preparation is not under its edit"
    );
    Ok(())
}

/// Inside one process that runs every component (`looseleaf up`), each span leaves
/// under its component's `service.name`, with the version and an instance id;
/// `looseleaf run` adds a span for the notebook that each cell's trace links to;
/// and spans still held when `run` exits and `up` stops on SIGINT leave first
/// (the batch delay here is longer than the test).
#[tokio::test(flavor = "multi_thread")]
async fn one_process_exports_each_component_and_a_run_links_its_cells() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint().to_string()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_string()),
        ("OTEL_BSP_SCHEDULE_DELAY", "600000".to_string()),
    ];
    let looseleaf = std::path::Path::new(env!("CARGO_BIN_EXE_looseleaf"));
    let up = looseleaf_test_support::LocalCluster::start_with_env(looseleaf, 1, &[], &env)?;
    let dir = tempfile::tempdir()?;
    let notebook = dir.path().join("two.ipynb");
    let cell = |src: &str| serde_json::json!({"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": null});
    let nb = serde_json::json!({"cells": [cell("a = 20"), cell("b = a + 22\nprint(b)")], "metadata": {}, "nbformat": 4, "nbformat_minor": 4});
    std::fs::write(&notebook, nb.to_string())?;
    let run = std::process::Command::new(looseleaf)
        .args(["run", "--all-gpu", "--frontend", &up.url()])
        .arg(&notebook)
        .env("LOOSELEAF_TOKEN", up.token())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::null())
        .output()?;
    anyhow::ensure!(run.status.success(), "looseleaf run: {}", String::from_utf8_lossy(&run.stderr));

    // `run` has exited: what it held left with it
    let spans = receiver
        .until(Duration::from_secs(30), "the run's spans", |s| {
            s.iter().filter(|x| x.name == "notebook cell").count() == 2
        })
        .await?;
    let notebook_span =
        spans.iter().find(|s| s.name == "run notebook").ok_or_else(|| anyhow::anyhow!("no notebook span"))?;
    assert_eq!(notebook_span.service, "looseleaf-run", "{notebook_span:?}");
    let cells: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.name == "notebook cell").collect();
    let traces: BTreeSet<&str> = cells.iter().map(|c| c.trace_id.as_str()).collect();
    assert_eq!(traces.len(), 2, "each cell is a trace of its own: {cells:?}");
    for c in &cells {
        assert!(c.parent_id.is_empty(), "{c:?}");
        assert_eq!(c.links, [(notebook_span.trace_id.clone(), notebook_span.span_id.clone())], "{c:?}");
    }

    // `up` stops on SIGINT: every component's spans of each cell's trace leave then
    drop(up);
    let components = ["looseleaf-frontend", "looseleaf-planner", "looseleaf-gpu-host", "looseleaf-store"];
    let all = receiver
        .until(Duration::from_secs(30), "every component's spans of both cells", |s| {
            traces.iter().all(|t| components.iter().all(|c| s.iter().any(|x| x.trace_id == *t && x.service == *c)))
        })
        .await?;
    for c in &cells {
        let trace = Trace::of(&all, &c.trace_id);
        let request = trace.one("POST /v1/sessions/{sid}/cells/{cell_id}/run")?;
        assert_eq!(request.parent_id, c.span_id, "the run request is not the cell span's child");
        assert_eq!(request.service, "looseleaf-frontend");
        for (name, service) in [
            ("planner.run", "looseleaf-planner"),
            ("execute", "looseleaf-gpu-host"),
            ("store.commit", "looseleaf-store"),
        ] {
            assert_eq!(trace.one(name)?.service, service, "{name}");
        }
    }
    let process: BTreeSet<&str> =
        all.iter().filter_map(|s| s.resource.get("service.version").map(String::as_str)).collect();
    assert_eq!(process, BTreeSet::from([env!("CARGO_PKG_VERSION")]), "every span names the version");
    let instances: BTreeSet<(&str, &str)> = all
        .iter()
        .filter_map(|s| Some((s.service.as_str(), s.resource.get("service.instance.id")?.as_str())))
        .collect();
    let per_service: BTreeSet<&str> = instances.iter().map(|(s, _)| *s).collect();
    assert_eq!(instances.len(), per_service.len(), "one instance id per component: {instances:?}");
    Ok(())
}
