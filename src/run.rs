//! `looseleaf run`: run a notebook's code cells in order through a frontend (embedded
//! or given), write the executed notebook and the report.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use looseleaf_client::api::{ExecStatus, StreamItem};
use schemas::messages::CellMessage;
use tokio::sync::mpsc;
use tracing::Instrument as _;
use uuid::Uuid;

use crate::cluster::{Cluster, ClusterOptions};
use crate::notebook;
use crate::outputs::NotebookOutputs;
use crate::report::{self, SessionLog, Trace};
use looseleaf_client::Frontend;

/// What `looseleaf run` was asked to do.
#[derive(Clone, Debug)]
pub struct RunRequest {
    pub notebook: PathBuf,
    pub output: PathBuf,
    pub report: PathBuf,
    pub all_gpu: bool,
    pub frontend: Option<String>,
    /// Its bearer token, if its API asks for one.
    pub token: Option<String>,
    /// Replay each cell as typed at this many characters a second (edits as the
    /// text grows, then Run); None: one edit with the whole cell, then Run.
    pub typing_cps: Option<f64>,
    /// The session's working directory on the hosts; None: the notebook's folder.
    pub cwd: Option<String>,
    /// Let the platform prepare workers while cells are edited.
    pub speculate: bool,
    /// Run every cell even after one raises; without it the run stops at the first
    /// cell that raises and fails, as nbconvert and papermill do.
    pub allow_errors: bool,
    /// Run a cell again, as a user would, up to this many times when the platform
    /// failed it (status `failed`: nothing of it was committed).
    pub retries: u32,
    /// Keep the session (and its state) after the run instead of deleting it.
    pub keep_session: bool,
}

/// `NB.ipynb` -> `NB.looseleaf.ipynb` and `NB.looseleaf.json` beside it (nbconvert
/// writes `NB.nbconvert.ipynb` the same way).
pub fn default_paths(notebook: &Path) -> (PathBuf, PathBuf) {
    let stem = notebook.file_stem().map_or_else(|| "notebook".into(), |s| s.to_string_lossy().to_string());
    (
        notebook.with_file_name(format!("{stem}.looseleaf.ipynb")),
        notebook.with_file_name(format!("{stem}.looseleaf.json")),
    )
}

/// Run the notebook, starting an embedded cluster (from `cluster`) if no frontend is
/// given. The notebook is read and checked first: one that cannot run starts nothing.
pub async fn run(req: RunRequest, cluster: ClusterOptions) -> anyhow::Result<()> {
    let mut nb = notebook::load(&req.notebook)?;
    notebook::prepare(&mut nb).with_context(|| format!("in {}", req.notebook.display()))?;
    match &req.frontend {
        Some(url) => {
            let fe = Frontend::new(url);
            let fe = match &req.token {
                Some(token) => fe.with_token(token),
                None => fe,
            };
            drive(&req, nb, &fe).await
        }
        None => {
            eprintln!("starting an embedded cluster in {}", cluster.data_dir.display());
            let mut c = Cluster::start(&cluster).await.context("while starting the embedded cluster")?;
            if let Err(e) = c.wait_ready(cluster.hosts, std::time::Duration::from_secs(180)).await {
                c.stop().await;
                return Err(e.context("while waiting for the gpu-hosts"));
            }
            let fe = Frontend::new(&c.frontend_url).with_token(&c.api_token);
            let res = drive(&req, nb, &fe).await;
            eprintln!("stopping the embedded cluster");
            c.stop().await;
            res
        }
    }
}

/// The signal that stopped a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT: Ctrl-C.
    Interrupt,
    /// SIGTERM.
    Terminate,
}

impl Stop {
    fn name(self) -> &'static str {
        match self {
            Stop::Interrupt => "SIGINT",
            Stop::Terminate => "SIGTERM",
        }
    }

    /// The status a shell gives a process this signal ended (128 + its number), so
    /// that a script sees an interrupted run as one.
    pub fn exit_code(self) -> u8 {
        match self {
            Stop::Interrupt => 130,
            Stop::Terminate => 143,
        }
    }
}

/// The error of a run a signal stopped: what it wrote is already said, so `main`
/// exits with the signal's status and prints nothing more.
#[derive(Debug)]
pub struct Interrupted(pub Stop);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", self.0.name())
    }
}

impl std::error::Error for Interrupted {}

/// SIGINT and SIGTERM, heard from the moment this is made (a signal while a
/// request is in flight waits here) and whatever the process inherited as
/// ignored (a job started in the background).
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            interrupt: signal(SignalKind::interrupt()).context("while listening for SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("while listening for SIGTERM")?,
        })
    }

    async fn next(&mut self) -> Stop {
        tokio::select! {
            Some(()) = self.interrupt.recv() => Stop::Interrupt,
            Some(()) = self.terminate.recv() => Stop::Terminate,
            else => std::future::pending().await,
        }
    }
}

/// How long a stopped run waits for the interrupted cell to end on the cluster
/// (its KeyboardInterrupt; a cell that ignores it is killed after the hosts'
/// grace period, 5 s by default) before it writes what it has.
const INTERRUPT_WAIT: Duration = Duration::from_secs(10);

/// Record one stream item; returns the exec id if it completed that execution.
fn absorb(item: StreamItem, traces: &mut HashMap<Uuid, Trace>, log: &mut SessionLog) -> Option<Uuid> {
    let (exec, done) = match &item {
        StreamItem::Queued { exec_id, .. } | StreamItem::Output { exec_id, .. } => (*exec_id, false),
        StreamItem::Event { exec_id, event, unix_ms } => {
            log.absorb(*unix_ms, event);
            (*exec_id, false)
        }
        StreamItem::Done { exec_id, .. } => (*exec_id, true),
    };
    if let Some(t) = traces.get_mut(&exec) {
        t.push(item);
    }
    done.then_some(exec)
}

fn progress(t: &Trace, total: usize, report: &report::CellReport) -> String {
    let placement = match (&report.host, report.slot) {
        (Some(h), Some(s)) => format!("{h}/slot {s}"),
        (Some(h), None) => format!("{h}/cpu"),
        _ => "-".into(),
    };
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0} ms"));
    let mut line = format!(
        "[{}/{}] {} {} {} start {} run {} {}",
        t.index,
        total,
        t.cell_id,
        report.device.as_deref().unwrap_or("?"),
        placement,
        ms(report.start_delay_ms.map(|d| d as f64)),
        ms(report.run_ms),
        report.status,
    );
    if let Some(e) = &report.error {
        line.push_str(&format!(": {e}"));
    }
    line
}

/// The outputs of an execution as the notebook gets them: the cell's own, plus an
/// error output for a failure outside the cell (no host, worker lost).
fn messages_of(t: &Trace) -> Vec<serde_json::Value> {
    let mut messages = t.sorted_outputs();
    if let Some((ExecStatus::Error | ExecStatus::Failed, _, Some(err))) = &t.done {
        let raised = messages.iter().any(|o| o.get("output_type").and_then(|v| v.as_str()) == Some("error"));
        if !raised {
            messages.push(notebook::error_output("LooseLeafError", err));
        }
    }
    messages
}

/// The outputs of the execution a signal stopped, as nbclient shows an
/// interrupted cell: what it sent so far, then a KeyboardInterrupt (unless the
/// worker's own came back), its evalue what the platform said of its end if it
/// said anything.
fn interrupted_messages(t: &Trace, stop: Stop) -> Vec<serde_json::Value> {
    let mut messages = t.sorted_outputs();
    let raised = messages.iter().any(|o| {
        o.get("output_type").and_then(|v| v.as_str()) == Some("error")
            && o.get("ename").and_then(|v| v.as_str()) == Some("KeyboardInterrupt")
    });
    if !raised {
        messages.push(notebook::error_output("KeyboardInterrupt", &interrupted_why(t, stop)));
    }
    messages
}

/// Why the stopped execution ended, for its error output and its report entry.
fn interrupted_why(t: &Trace, stop: Stop) -> String {
    match &t.done {
        Some((_, _, Some(err))) => err.strip_prefix("KeyboardInterrupt: ").unwrap_or(err).to_string(),
        _ => format!("looseleaf run was stopped ({}) while the cell ran", stop.name()),
    }
}

/// The one line a stopped run ends with: which files it wrote and what the
/// notebook holds.
fn interrupted_line(
    stop: Stop,
    output: &Path,
    report: &Path,
    finished: usize,
    interrupted: Option<(usize, &str)>,
) -> String {
    let cells = if finished == 1 { "cell" } else { "cells" };
    let running = match interrupted {
        Some((index, id)) => format!(" and cell {index} ({id}) marked interrupted"),
        None => " (no cell was running)".into(),
    };
    format!(
        "interrupted ({}): wrote {} with {finished} finished {cells}{running}, and the report {}",
        stop.name(),
        output.display(),
        report.display()
    )
}

/// Write the executed notebook as it stands: every cell that ran so far, with
/// displays updated by later cells showing their last content.
fn write_notebook(
    nb: &mut serde_json::Value,
    ran: &[&Trace],
    outputs: &NotebookOutputs,
    path: &Path,
) -> anyhow::Result<()> {
    for t in ran {
        notebook::set_outputs(nb, t.index, outputs.cell(t.index), t.execution_count())?;
    }
    if let Some(python) = ran.iter().find_map(|t| t.python()) {
        notebook::set_language_info(nb, &python);
    }
    notebook::save(path, nb)
}

/// Show an output on the terminal as the cell makes it: streams as text, rich
/// outputs by their plain text (or their kind), errors with their traceback.
fn echo(output: &serde_json::Value) {
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect(),
        other => other.as_str().unwrap_or_default().to_string(),
    };
    match output.get("output_type").and_then(|v| v.as_str()) {
        Some("stream") if output["name"] == "stderr" => eprint!("{}", text(&output["text"])),
        Some("stream") => print!("{}", text(&output["text"])),
        Some("display_data" | "execute_result") => {
            let data = &output["data"];
            match data.get("text/plain") {
                Some(t) => println!("{}", text(t)),
                None => println!(
                    "[{}]",
                    data.as_object().map(|d| d.keys().cloned().collect::<Vec<_>>().join(", ")).unwrap_or_default()
                ),
            }
        }
        Some("error") => {
            let tb: Vec<String> = output["traceback"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|l| l.as_str().map(str::to_owned))
                .collect();
            eprintln!("{}", tb.join("\n"));
        }
        _ => {} // clear_output and display updates change nothing in a log
    }
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

/// How long `--retries` waits before it runs a failed cell again.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

async fn drive(req: &RunRequest, mut nb: serde_json::Value, fe: &Frontend) -> anyhow::Result<()> {
    // from here on a signal is heard: one while the session opens stops the run at its first cell
    let mut signals = Signals::new()?;
    let started = Instant::now();
    let started_at = std::time::SystemTime::now();
    let abs = req.notebook.canonicalize().with_context(|| format!("while resolving {}", req.notebook.display()))?;
    let cwd = match &req.cwd {
        Some(cwd) => cwd.clone(),
        None => abs.parent().map(|p| p.display().to_string()).unwrap_or_else(|| "/".into()),
    };
    let cells = notebook::code_cells(&nb);
    let total = nb.get("cells").and_then(|c| c.as_array()).map_or(0, Vec::len);
    // one span for the notebook; each cell's run is a trace of its own (ADR 38)
    // that links to it
    let notebook_span = tracing::info_span!("run notebook", looseleaf.notebook = %abs.display());
    let opening = async {
        let sid = fe.create_session(&cwd, req.all_gpu, req.speculate).await?;
        anyhow::Ok((sid, fe.events(sid).await?))
    }
    .instrument(notebook_span.clone());
    // (a frontend that does not answer must not keep Ctrl-C from stopping the run)
    let (sid, mut rx) = tokio::select! {
        opened = opening => opened?,
        stop = signals.next() => {
            eprintln!("interrupted ({}) before any cell ran: wrote nothing", stop.name());
            return Err(Interrupted(stop).into());
        }
    };
    let mut traces: HashMap<Uuid, Trace> = HashMap::new();
    let mut order = Vec::new();
    let mut log = SessionLog::default();
    let mut prev_done = None;
    let mut outputs = NotebookOutputs::default();
    let mut raised: Option<String> = None;
    // the execution of the cell in progress (running, or failed and about to run
    // again): the one a signal interrupts
    let mut current: Option<Uuid> = None;
    // cells that ran to their end, in `outputs`
    let mut finished = 0usize;
    // a bar over the cells on a terminal; in a log, one line per cell instead
    let bar = indicatif::ProgressBar::new(cells.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} cells {elapsed_precise} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let body = async {
        for cell in &cells {
            bar.set_message(cell.cell_id.clone());
            match req.typing_cps {
                Some(cps) => type_cell(fe, sid, &cell.cell_id, &cell.source, cps).await?,
                None => fe.edit(sid, &cell.cell_id, &cell.source).await?,
            }
            let mut attempt = 0;
            let exec_id = loop {
                let cell_span = tracing::info_span!(parent: None, "notebook cell",
                    looseleaf.cell_id = %cell.cell_id, looseleaf.cell_index = cell.index, looseleaf.attempt = attempt);
                schemas::telemetry::link(&cell_span, &notebook_span);
                let accepted = fe.run(sid, &cell.cell_id, &cell.source).instrument(cell_span.clone()).await?;
                let trace = Trace {
                    index: cell.index,
                    cell_id: cell.cell_id.clone(),
                    exec_id: accepted.exec_id,
                    ..Default::default()
                };
                traces.insert(accepted.exec_id, trace);
                order.push(accepted.exec_id);
                current = Some(accepted.exec_id);
                loop {
                    let Some(item) = rx.recv().await else { bail!("the frontend's event stream ended") };
                    if let StreamItem::Output { exec_id, output: CellMessage::Output(output), .. } = &item {
                        if *exec_id == accepted.exec_id {
                            bar.suspend(|| echo(output));
                        }
                    }
                    if absorb(item, &mut traces, &mut log) == Some(accepted.exec_id) {
                        break;
                    }
                }
                let failed =
                    traces.get(&accepted.exec_id).and_then(|t| t.done.as_ref()).filter(|d| d.0 == ExecStatus::Failed);
                match failed {
                    Some((_, _, error)) if attempt < req.retries => {
                        attempt += 1;
                        let why = error.as_deref().unwrap_or("the platform failed it");
                        bar.suspend(|| {
                            eprintln!(
                                "cell {} failed ({why}); running it again ({attempt}/{})",
                                cell.cell_id, req.retries
                            )
                        });
                        // (not running meanwhile: a signal now interrupts no cell)
                        current = None;
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                    _ => break accepted.exec_id,
                }
            };
            let Some(t) = traces.get(&exec_id) else { continue };
            let r = report::CellReport::from_trace(t, prev_done);
            prev_done = r.done_unix_ms.or(prev_done);
            let line = progress(t, total, &r);
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
            bar.inc(1);
            // the notebook so far: a crash later leaves these cells
            outputs.apply(t.index, messages_of(t));
            current = None;
            finished += 1;
            let ran: Vec<&Trace> = order.iter().filter_map(|e| traces.get(e)).collect();
            write_notebook(&mut nb, &ran, &outputs, &req.output)?;
            if r.status != "ok" && !req.allow_errors {
                raised = Some(format!("cell {} ({}) raised {}", t.index, t.cell_id, r.error.unwrap_or_default()));
                break;
            }
        }
        Ok::<(), anyhow::Error>(())
    };
    // a signal stops the cells where they are: what they sent so far is in
    // `traces`, and what they send next waits in `rx`
    let (res, stopped) = tokio::select! {
        res = body => (res, None),
        stop = signals.next() => (Ok(()), Some(stop)),
    };
    bar.finish_and_clear();
    if stopped.is_some() {
        stop_running(fe, sid, current, &mut rx, &mut traces, &mut log, &mut signals).await;
    }
    let cleanup = async {
        if req.keep_session {
            eprintln!("kept session {sid}");
        } else if let Err(e) = fe.delete(sid).await {
            tracing::warn!(error = format!("{e:#}"), "could not delete the session");
        }
        drain(&mut rx, &mut traces, &mut log).await;
    };
    if stopped.is_some() {
        // stopping already: another signal ends the waiting for the session's end
        tokio::select! {
            () = cleanup => {}
            _ = signals.next() => eprintln!("not waiting for the session {sid} to be deleted"),
        }
    } else {
        cleanup.await;
    }
    res?;

    let ordered: Vec<Trace> = order.iter().filter_map(|e| traces.get(e).cloned()).collect();
    if let Some(stop) = stopped {
        if ordered.is_empty() {
            eprintln!("interrupted ({}) before any cell ran: wrote nothing", stop.name());
            return Err(Interrupted(stop).into());
        }
        // the cell the signal caught, unless it ended by itself meanwhile
        let interrupted = match current.and_then(|e| traces.get(&e)) {
            Some(t) if ended_by_itself(t) => {
                outputs.apply(t.index, messages_of(t));
                finished += 1;
                None
            }
            Some(t) => {
                outputs.apply(t.index, interrupted_messages(t, stop));
                Some(t)
            }
            None => None,
        };
        write_notebook(&mut nb, &ordered.iter().collect::<Vec<_>>(), &outputs, &req.output)?;
        let mut report = report::build(
            &req.notebook.display().to_string(),
            &ordered,
            &log,
            started.elapsed().as_secs_f64(),
            started_at,
        );
        report.session_id = Some(sid);
        if let Some(t) = interrupted {
            mark_interrupted(&mut report, t, stop);
        }
        report::write(&report, &req.report)?;
        let caught = interrupted.map(|t| (t.index, t.cell_id.as_str()));
        eprintln!("{}", interrupted_line(stop, &req.output, &req.report, finished, caught));
        return Err(Interrupted(stop).into());
    }
    write_notebook(&mut nb, &ordered.iter().collect::<Vec<_>>(), &outputs, &req.output)?;
    let mut report =
        report::build(&req.notebook.display().to_string(), &ordered, &log, started.elapsed().as_secs_f64(), started_at);
    report.session_id = Some(sid);
    report::write(&report, &req.report)?;
    let t = &report.totals;
    eprintln!(
        "{} cells: {} ok, {} errors ({} gpu, {} cpu); gpu-slot {:.1} s (pinned {:.1} s); median start delay {}; wall {:.1} s",
        t.cells,
        t.ok,
        t.errors,
        t.gpu_cells,
        t.cpu_cells,
        t.gpu_slot_seconds,
        t.pinned_seconds,
        t.median_start_delay_ms.map_or("-".into(), |d| format!("{d:.0} ms")),
        t.wall_seconds,
    );
    eprintln!("wrote {} and {}", req.output.display(), req.report.display());
    match raised {
        Some(why) => bail!("{why}; the notebook stops there (--allow-errors runs every cell)"),
        None => Ok(()),
    }
}

/// Whether the execution a signal caught came to its own end before the
/// interrupt reached it: it ran to the end, or raised something of its own.
fn ended_by_itself(t: &Trace) -> bool {
    match &t.done {
        Some((ExecStatus::Ok, ..)) => true,
        Some((ExecStatus::Error, ..)) => t.outputs.iter().any(|(_, o)| {
            o.get("output_type").and_then(|v| v.as_str()) == Some("error")
                && o.get("ename").and_then(|v| v.as_str()) != Some("KeyboardInterrupt")
        }),
        _ => false,
    }
}

/// The report entry of the interrupted execution: one that never said how it
/// ended raised the KeyboardInterrupt its notebook cell shows; one that did
/// keeps what the platform said.
fn mark_interrupted(report: &mut report::Report, t: &Trace, stop: Stop) {
    let Some(cell) = report.cells.iter_mut().find(|c| c.exec_id == t.exec_id) else { return };
    if t.done.is_none() {
        cell.status = "error".into();
        cell.error = Some(format!("KeyboardInterrupt: {}", interrupted_why(t, stop)));
    }
}

/// After a signal: interrupt the session's running cell on the cluster (also a
/// run sent but not yet answered) and take what it still sends until it ends
/// (its KeyboardInterrupt), for [`INTERRUPT_WAIT`] at most or until a second signal.
async fn stop_running(
    fe: &Frontend,
    sid: Uuid,
    running: Option<Uuid>,
    rx: &mut mpsc::UnboundedReceiver<StreamItem>,
    traces: &mut HashMap<Uuid, Trace>,
    log: &mut SessionLog,
    signals: &mut Signals,
) {
    let ended = |traces: &HashMap<Uuid, Trace>| running.and_then(|e| traces.get(&e)).is_none_or(|t| t.done.is_some());
    let wait = async {
        if let Err(e) = fe.interrupt(sid).await {
            tracing::warn!(error = format!("{e:#}"), "could not interrupt the running cell");
            return;
        }
        while !ended(&*traces) {
            let Some(item) = rx.recv().await else { return };
            if let StreamItem::Output { exec_id, output: CellMessage::Output(output), .. } = &item {
                if Some(*exec_id) == running {
                    echo(output);
                }
            }
            absorb(item, traces, log);
        }
    };
    tokio::select! {
        () = wait => {}
        () = tokio::time::sleep(INTERRUPT_WAIT) => {
            tracing::warn!("the interrupted cell did not end within {INTERRUPT_WAIT:?}; writing what it sent so far");
        }
        _ = signals.next() => {}
    }
}

/// After the delete, take the late events (slot releases at close) until the
/// stream ends, for a few seconds at most.
async fn drain(rx: &mut mpsc::UnboundedReceiver<StreamItem>, traces: &mut HashMap<Uuid, Trace>, log: &mut SessionLog) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while let Ok(Some(item)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        absorb(item, traces, log);
    }
}

/// Send a cell's code as a person typing it at `cps` characters a second would:
/// an edit with the text so far every tick (at least 100 ms), the whole text last.
async fn type_cell(fe: &Frontend, sid: Uuid, cell: &str, code: &str, cps: f64) -> anyhow::Result<()> {
    let ends: Vec<usize> = code.char_indices().map(|(i, _)| i).skip(1).chain([code.len()]).collect();
    let tick = Duration::from_secs_f64((1.0 / cps).max(0.1));
    let per_tick = ((cps * tick.as_secs_f64()).round() as usize).max(1);
    let start = tokio::time::Instant::now();
    let mut typed = 0;
    let mut ticks = 0u32;
    while typed < ends.len() {
        typed = (typed + per_tick).min(ends.len());
        fe.edit(sid, cell, &code[..ends[typed - 1]]).await?;
        ticks += 1;
        tokio::time::sleep_until(start + tick * ticks).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use looseleaf_client::events::{CellStatus, Device, Event, Prepare, StartPhases};
    use serde_json::{json, Value};

    use super::*;

    fn started(count: u32) -> (u64, Event) {
        let event = Event::Started {
            host: "host-0".into(),
            slot: None,
            worker: "w".into(),
            device: Device::Cpu,
            prepare: Prepare::Cold,
            execution_count: count,
            restored_bytes: 0,
            prepare_ms: 1.0,
            restore_ms: 0.0,
            refreshed: 0,
            import_hit: true,
            python: "3.11.7".into(),
            phases: StartPhases::default(),
        };
        (u64::from(count) * 100, event)
    }

    fn finished(count: u32, status: CellStatus, error: Option<&str>) -> (u64, Event) {
        let event = Event::Finished {
            faulted: vec![],
            status,
            error: error.map(str::to_owned),
            execution_count: count,
            run_ms: 1.0,
            outputs: 1,
            cuda_used: false,
        };
        (u64::from(count) * 100 + 50, event)
    }

    fn stream(text: &str) -> Value {
        json!({"output_type": "stream", "name": "stdout", "text": text})
    }

    fn trace(index: usize, outputs: Vec<Value>) -> Trace {
        Trace {
            index,
            cell_id: format!("c{index}"),
            exec_id: Uuid::now_v7(),
            run_unix_ms: 1,
            outputs: (1..).zip(outputs).collect(),
            ..Default::default()
        }
    }

    /// A markdown cell, then three code cells (indexes 1, 2, 3).
    fn three_cells() -> Value {
        let code = |id: &str| json!({"cell_type": "code", "id": id, "metadata": {}, "source": "x", "outputs": [], "execution_count": null});
        json!({
            "cells": [{"cell_type": "markdown", "id": "md", "metadata": {}, "source": "# nb"}, code("c1"), code("c2"), code("c3")],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
        })
    }

    /// Ctrl-C in the second of three cells: the first is written as it finished,
    /// the second with what it printed and a KeyboardInterrupt after it, with its
    /// count; the third is untouched.
    #[test]
    fn the_interrupted_cell_is_written_with_its_outputs_so_far_and_a_keyboard_interrupt() {
        let mut done = trace(1, vec![stream("one\n")]);
        done.events = vec![started(1), finished(1, CellStatus::Ok, None)];
        done.done = Some((ExecStatus::Ok, 200, None));
        // outputs arrive out of order: the notebook has them by seq
        let mut running = trace(2, vec![]);
        running.outputs = vec![(2, stream("working\n")), (1, stream("started\n"))];
        running.events = vec![started(2)];
        assert!(ended_by_itself(&done) && !ended_by_itself(&running));

        let mut outputs = NotebookOutputs::default();
        outputs.apply(done.index, messages_of(&done));
        outputs.apply(running.index, interrupted_messages(&running, Stop::Interrupt));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.ipynb");
        let mut nb = three_cells();
        write_notebook(&mut nb, &[&done, &running], &outputs, &path).unwrap();

        let back = notebook::load(&path).unwrap();
        let cells = &back["cells"];
        assert_eq!(cells[1]["outputs"], json!([stream("one\n")]), "the finished cell is intact");
        assert_eq!(cells[1]["execution_count"], 1);
        let outs = cells[2]["outputs"].as_array().unwrap();
        assert_eq!(outs[..2], [stream("started\n"), stream("working\n")]);
        assert_eq!(outs.len(), 3, "{outs:?}");
        assert_eq!((&outs[2]["output_type"], &outs[2]["ename"]), (&json!("error"), &json!("KeyboardInterrupt")));
        assert!(outs[2]["evalue"].as_str().is_some_and(|v| v.contains("SIGINT")), "{}", outs[2]);
        assert_eq!(cells[2]["execution_count"], 2, "the count known from its start");
        assert_eq!(cells[3]["outputs"], json!([]));
        assert_eq!(cells[3]["execution_count"], Value::Null);
        assert_eq!(back["metadata"]["language_info"]["version"], "3.11.7");
    }

    /// The worker's own KeyboardInterrupt (with its traceback) is the cell's last
    /// output: none is added after it. A cell the interrupt found already raising
    /// its own error ended by itself; one killed for ignoring it says so.
    #[test]
    fn a_keyboard_interrupt_is_added_only_where_none_came_back() {
        let raised = json!({"output_type": "error", "ename": "KeyboardInterrupt", "evalue": "", "traceback": ["tb"]});
        let mut t = trace(1, vec![stream("a\n"), raised.clone()]);
        t.done = Some((ExecStatus::Error, 9, Some("KeyboardInterrupt: ".into())));
        assert!(!ended_by_itself(&t));
        assert_eq!(interrupted_messages(&t, Stop::Interrupt), vec![stream("a\n"), raised]);

        let own = json!({"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": []});
        let mut t = trace(1, vec![own]);
        t.done = Some((ExecStatus::Error, 9, Some("ZeroDivisionError: division by zero".into())));
        assert!(ended_by_itself(&t));

        let mut t = trace(1, vec![stream("a\n")]);
        t.done = Some((ExecStatus::Failed, 9, Some("killed: it ignored the interrupt".into())));
        assert!(!ended_by_itself(&t));
        let messages = interrupted_messages(&t, Stop::Terminate);
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[1], notebook::error_output("KeyboardInterrupt", "killed: it ignored the interrupt"));
    }

    #[test]
    fn the_report_and_the_last_line_say_what_the_interrupt_left() {
        let mut done = trace(1, vec![]);
        done.done = Some((ExecStatus::Ok, 200, None));
        let running = trace(2, vec![]);
        let mut report =
            report::build("nb.ipynb", &[done, running.clone()], &SessionLog::default(), 1.0, std::time::UNIX_EPOCH);
        mark_interrupted(&mut report, &running, Stop::Interrupt);
        assert_eq!(report.cells[0].status, "ok");
        assert_eq!(report.cells[1].status, "error");
        assert!(
            report.cells[1].error.as_deref().is_some_and(|e| e.starts_with("KeyboardInterrupt: ")),
            "{:?}",
            report.cells[1]
        );
        assert_eq!((report.totals.ok, report.totals.errors), (1, 1));

        let (out, rep) = (Path::new("nb.looseleaf.ipynb"), Path::new("nb.looseleaf.json"));
        assert_eq!(
            interrupted_line(Stop::Interrupt, out, rep, 1, Some((2, "c2"))),
            "interrupted (SIGINT): wrote nb.looseleaf.ipynb with 1 finished cell and cell 2 (c2) marked interrupted, \
             and the report nb.looseleaf.json"
        );
        assert_eq!(
            interrupted_line(Stop::Interrupt, out, rep, 3, None),
            "interrupted (SIGINT): wrote nb.looseleaf.ipynb with 3 finished cells (no cell was running), \
             and the report nb.looseleaf.json"
        );
        assert_eq!((Stop::Interrupt.exit_code(), Stop::Terminate.exit_code()), (130, 143));
    }
}
