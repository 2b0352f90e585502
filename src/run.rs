//! `looseleaf run`: run a notebook's code cells in order through a frontend (embedded
//! or given), write the executed notebook and the report.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use looseleaf_client::api::{ExecStatus, StreamItem};
use schemas::messages::CellMessage;
use tokio::sync::mpsc;
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
            until_interrupted(drive(&req, nb, &fe), &req.output).await
        }
        None => {
            eprintln!("starting an embedded cluster in {}", cluster.data_dir.display());
            let mut c = Cluster::start(&cluster).await.context("while starting the embedded cluster")?;
            if let Err(e) = c.wait_ready(cluster.hosts, std::time::Duration::from_secs(180)).await {
                c.stop().await;
                return Err(e.context("while waiting for the gpu-hosts"));
            }
            let fe = Frontend::new(&c.frontend_url).with_token(&c.api_token);
            let res = until_interrupted(drive(&req, nb, &fe), &req.output).await;
            eprintln!("stopping the embedded cluster");
            c.stop().await;
            res
        }
    }
}

/// `work`, unless Ctrl-C (or SIGTERM) comes first: then the run ends with an error
/// and `output` keeps the cells that finished. Whatever the process inherited as
/// ignored (a job started in the background), the signal is heard.
async fn until_interrupted(
    work: impl std::future::Future<Output = anyhow::Result<()>>,
    output: &std::path::Path,
) -> anyhow::Result<()> {
    tokio::select! {
        res = work => res,
        () = schemas::telemetry::shutdown_signal() => {
            Err(anyhow::anyhow!("interrupted; {} holds the cells that finished", output.display()))
        }
    }
}

/// Record one stream item; returns the exec id if it completed that execution.
fn absorb(item: StreamItem, traces: &mut HashMap<Uuid, Trace>, log: &mut SessionLog) -> Option<Uuid> {
    let (exec, done) = match &item {
        StreamItem::Queued { exec_id, .. } | StreamItem::Output { exec_id, .. } => (*exec_id, false),
        StreamItem::Event { exec_id, event, .. } => {
            log.absorb(event);
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
    let started = Instant::now();
    let started_at = std::time::SystemTime::now();
    let abs = req.notebook.canonicalize().with_context(|| format!("while resolving {}", req.notebook.display()))?;
    let cwd = match &req.cwd {
        Some(cwd) => cwd.clone(),
        None => abs.parent().map(|p| p.display().to_string()).unwrap_or_else(|| "/".into()),
    };
    let cells = notebook::code_cells(&nb);
    let total = nb.get("cells").and_then(|c| c.as_array()).map_or(0, Vec::len);
    let sid = fe.create_session(&cwd, req.all_gpu, req.speculate).await?;
    let mut rx = fe.events(sid).await?;
    let mut traces: HashMap<Uuid, Trace> = HashMap::new();
    let mut order = Vec::new();
    let mut log = SessionLog::default();
    let mut prev_done = None;
    let mut outputs = NotebookOutputs::default();
    let mut raised: Option<String> = None;
    // a bar over the cells on a terminal; in a log, one line per cell instead
    let bar = indicatif::ProgressBar::new(cells.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} cells {elapsed_precise} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let res: anyhow::Result<()> = async {
        for cell in &cells {
            bar.set_message(cell.cell_id.clone());
            match req.typing_cps {
                Some(cps) => type_cell(fe, sid, &cell.cell_id, &cell.source, cps).await?,
                None => fe.edit(sid, &cell.cell_id, &cell.source).await?,
            }
            let mut attempt = 0;
            let exec_id = loop {
                let accepted = fe.run(sid, &cell.cell_id, &cell.source).await?;
                let trace = Trace {
                    index: cell.index,
                    cell_id: cell.cell_id.clone(),
                    exec_id: accepted.exec_id,
                    ..Default::default()
                };
                traces.insert(accepted.exec_id, trace);
                order.push(accepted.exec_id);
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
            // the notebook so far: a crash or Ctrl-C later leaves these cells
            outputs.apply(t.index, messages_of(t));
            let ran: Vec<&Trace> = order.iter().filter_map(|e| traces.get(e)).collect();
            write_notebook(&mut nb, &ran, &outputs, &req.output)?;
            if r.status != "ok" && !req.allow_errors {
                raised = Some(format!("cell {} ({}) raised {}", t.index, t.cell_id, r.error.unwrap_or_default()));
                break;
            }
        }
        Ok(())
    }
    .await;
    bar.finish_and_clear();
    if req.keep_session {
        eprintln!("kept session {sid}");
    } else if let Err(e) = fe.delete(sid).await {
        tracing::warn!(error = format!("{e:#}"), "could not delete the session");
    }
    drain(&mut rx, &mut traces, &mut log).await;
    res?;

    let ordered: Vec<Trace> = order.iter().filter_map(|e| traces.get(e).cloned()).collect();
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
