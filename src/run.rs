//! `looseleaf run`: run a notebook's code cells in order through a frontend (embedded
//! or given), write the executed notebook and the report.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use looseleaf_frontend::api::{ExecStatus, StreamItem};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::client::Frontend;
use crate::cluster::{Cluster, ClusterOptions};
use crate::notebook;
use crate::outputs::NotebookOutputs;
use crate::report::{self, SessionLog, Trace};

/// What `looseleaf run` was asked to do.
#[derive(Clone, Debug)]
pub struct RunRequest {
    pub notebook: PathBuf,
    pub output: PathBuf,
    pub report: PathBuf,
    pub all_gpu: bool,
    pub frontend: Option<String>,
    /// Replay each cell as typed at this many characters a second (edits as the
    /// text grows, then Run); None: one edit with the whole cell, then Run.
    pub typing_cps: Option<f64>,
    /// Let the platform prepare workers while cells are edited.
    pub speculate: bool,
}

/// Run the notebook, starting an embedded cluster (from `cluster`) if no frontend is given.
pub async fn run(req: RunRequest, cluster: ClusterOptions) -> anyhow::Result<()> {
    match &req.frontend {
        Some(url) => drive(&req, &Frontend::new(url)).await,
        None => {
            eprintln!("starting an embedded cluster in {}", cluster.data_dir.display());
            let c = Cluster::start(&cluster).await.context("while starting the embedded cluster")?;
            if let Err(e) = c.wait_ready(cluster.hosts, std::time::Duration::from_secs(180)).await {
                c.stop().await;
                return Err(e.context("while waiting for the gpu-hosts"));
            }
            let fe = Frontend::new(&c.frontend_url);
            let res = tokio::select! {
                res = drive(&req, &fe) => res,
                () = schemas::telemetry::shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
            };
            eprintln!("stopping the embedded cluster");
            c.stop().await;
            res
        }
    }
}

/// Record one stream item; returns the exec id if it completed that execution.
fn absorb(item: StreamItem, traces: &mut HashMap<Uuid, Trace>, log: &mut SessionLog) -> Option<Uuid> {
    let (exec, done) = match &item {
        StreamItem::Queued { exec_id, .. } | StreamItem::Output { exec_id, .. } => (*exec_id, false),
        StreamItem::Event { exec_id, kind, .. } => {
            log.absorb(kind);
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

async fn drive(req: &RunRequest, fe: &Frontend) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut nb = notebook::load(&req.notebook)?;
    let abs = req.notebook.canonicalize().with_context(|| format!("while resolving {}", req.notebook.display()))?;
    let cwd = abs.parent().map(|p| p.display().to_string()).unwrap_or_else(|| "/".into());
    let cells = notebook::code_cells(&nb);
    let total = nb.get("cells").and_then(|c| c.as_array()).map_or(0, Vec::len);
    let sid = fe.create_session(&cwd, req.all_gpu, req.speculate).await?;
    let mut rx = fe.events(sid).await?;
    let mut traces: HashMap<Uuid, Trace> = HashMap::new();
    let mut order = Vec::new();
    let mut log = SessionLog::default();
    let mut prev_done = None;
    let res: anyhow::Result<()> = async {
        for cell in &cells {
            match req.typing_cps {
                Some(cps) => type_cell(fe, sid, &cell.cell_id, &cell.source, cps).await?,
                None => fe.edit(sid, &cell.cell_id, &cell.source).await?,
            }
            let accepted = fe.run(sid, &cell.cell_id, &cell.source).await?;
            traces.insert(
                accepted.exec_id,
                Trace { index: cell.index, cell_id: cell.cell_id.clone(), exec_id: accepted.exec_id, ..Default::default() },
            );
            order.push(accepted.exec_id);
            loop {
                let Some(item) = rx.recv().await else { bail!("the frontend's event stream ended") };
                if absorb(item, &mut traces, &mut log) == Some(accepted.exec_id) {
                    break;
                }
            }
            if let Some(t) = traces.get(&accepted.exec_id) {
                let r = report::CellReport::from_trace(t, prev_done);
                prev_done = r.done_unix_ms.or(prev_done);
                eprintln!("{}", progress(t, total, &r));
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = fe.delete(sid).await {
        tracing::warn!(error = format!("{e:#}"), "could not delete the session");
    }
    drain(&mut rx, &mut traces, &mut log).await;
    res?;

    let ordered: Vec<Trace> = order.iter().filter_map(|e| traces.get(e).cloned()).collect();
    let mut outputs = NotebookOutputs::default();
    for t in &ordered {
        let mut messages = t.sorted_outputs();
        if let Some((ExecStatus::Error, _, Some(err))) = &t.done {
            let raised = messages.iter().any(|o| o.get("output_type").and_then(|v| v.as_str()) == Some("error"));
            if !raised {
                messages.push(notebook::error_output("LooseLeafError", err));
            }
        }
        outputs.apply(t.index, messages);
    }
    // after every cell ran: a display updated later shows its last content
    for t in &ordered {
        notebook::set_outputs(&mut nb, t.index, outputs.take(t.index), t.execution_count())?;
    }
    notebook::save(&req.output, &nb)?;
    let report = report::build(&req.notebook.display().to_string(), &ordered, &log, started.elapsed().as_secs_f64());
    let json = serde_json::to_string_pretty(&report).context("while encoding the report")?;
    std::fs::write(&req.report, json + "\n").with_context(|| format!("while writing {}", req.report.display()))?;
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
    Ok(())
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
