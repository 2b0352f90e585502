//! The per-cell report of `looseleaf run` (DESIGN.md section 10): what each cell
//! needed, where and how it ran, how long it waited, and the session's totals.

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::{CellStatus, Event, PreparedClass, PreparedOutcome, SlotUse, StartPhases};
use schemas::messages::CellMessage;
use serde::Serialize;
use uuid::Uuid;

/// Everything the event stream said about one execution.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Notebook cell index.
    pub index: usize,
    /// The cell id.
    pub cell_id: String,
    /// The execution.
    pub exec_id: Uuid,
    /// When the frontend received Run.
    pub run_unix_ms: u64,
    /// Session events of this execution, in order: (unix ms, kind).
    pub events: Vec<(u64, Event)>,
    /// Notebook outputs, in arrival order: (seq, output).
    pub outputs: Vec<(u64, serde_json::Value)>,
    /// The done item: (status, unix ms, error).
    pub done: Option<(ExecStatus, u64, Option<String>)>,
}

impl Trace {
    /// Record one stream item of this execution.
    pub fn push(&mut self, item: StreamItem) {
        match item {
            StreamItem::Queued { run_unix_ms, .. } => self.run_unix_ms = run_unix_ms,
            StreamItem::Event { unix_ms, event, .. } => self.events.push((unix_ms, event)),
            // the notebook holds outputs only: `looseleaf run` has no stdin, comms or pager
            StreamItem::Output { seq, output: CellMessage::Output(output), .. } => self.outputs.push((seq, output)),
            StreamItem::Output { .. } => {}
            StreamItem::Done { status, unix_ms, error, .. } => self.done = Some((status, unix_ms, error)),
        }
    }

    /// The Python version of the worker that ran the cell.
    pub fn python(&self) -> Option<String> {
        self.events.iter().find_map(|(_, k)| match k {
            Event::Started { python, .. } if !python.is_empty() => Some(python.clone()),
            _ => None,
        })
    }

    /// The cell's execution count (Finished, else Started).
    pub fn execution_count(&self) -> Option<u32> {
        let mut count = None;
        for (_, k) in &self.events {
            match k {
                Event::Finished { execution_count, .. } => return Some(*execution_count),
                Event::Started { execution_count, .. } => count = Some(*execution_count),
                _ => {}
            }
        }
        count
    }

    /// Outputs ordered by seq.
    pub fn sorted_outputs(&self) -> Vec<serde_json::Value> {
        let mut outs = self.outputs.clone();
        outs.sort_by_key(|(seq, _)| *seq);
        outs.into_iter().map(|(_, o)| o).collect()
    }
}

/// One code cell of the report.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CellReport {
    pub index: usize,
    pub exec_id: Uuid,
    pub cell_id: String,
    pub device: Option<String>,
    pub host: Option<String>,
    pub slot: Option<u32>,
    pub worker: Option<String>,
    pub closure: Vec<String>,
    pub imports: Vec<String>,
    pub conservative: bool,
    pub conservative_reason: Option<String>,
    /// Names the cell reached that its closure missed, brought in while it ran
    /// (the worker's safety net); the next run restores them up front.
    pub faulted: Vec<String>,
    pub pinned: Vec<String>,
    pub prepare: Option<String>,
    pub start_delay_ms: Option<u64>,
    pub run_ms: Option<f64>,
    pub save_ms: Option<f64>,
    pub restored_bytes: Option<u64>,
    /// Host time from claim to a ready worker (fork, imports, restore).
    pub prepare_ms: Option<f64>,
    /// Of that, fetching and loading the closure.
    pub restore_ms: Option<f64>,
    /// Where the host's part of the start delay went.
    pub phases: Option<StartPhases>,
    /// Closure variables restored or dropped after Run (0 on a prepared worker:
    /// a clean speculation hit).
    pub refreshed: Option<u32>,
    /// The worker's zygote had already imported the whole import closure.
    pub import_cache_hit: Option<bool>,
    pub saved_bytes: Option<u64>,
    pub chunks_written: Option<u64>,
    pub slot_released: Option<bool>,
    pub status: String,
    pub error: Option<String>,
    /// When Run was pressed (unix ms, the frontend's clock).
    pub run_unix_ms: Option<u64>,
    /// When the cell completed (unix ms), for the next cell's start delay.
    pub done_unix_ms: Option<u64>,
    /// When the prepared worker it ran on was last ready (unix ms), if it ran on
    /// one: a Run before that waited for its preparation (`looseleaf simulate
    /// --recorded` replays when it was ready).
    pub prepared_unix_ms: Option<u64>,
}

impl CellReport {
    /// The report of one execution; `prev_done_unix_ms` is when the session's
    /// previous cell completed.
    pub fn from_trace(t: &Trace, prev_done_unix_ms: Option<u64>) -> Self {
        let mut r = CellReport {
            index: t.index,
            exec_id: t.exec_id,
            cell_id: t.cell_id.clone(),
            run_unix_ms: (t.run_unix_ms > 0).then_some(t.run_unix_ms),
            ..Default::default()
        };
        let mut cell_error = None;
        for (unix_ms, kind) in &t.events {
            match kind {
                Event::Planned { closure, imports, device, conservative, pinned, .. } => {
                    r.closure = closure.clone();
                    r.imports = imports.clone();
                    r.device = Some(device.as_str().into());
                    r.conservative = conservative.is_some();
                    r.conservative_reason = conservative.clone();
                    r.pinned = pinned.clone();
                }
                Event::Claimed { host, slot, prepare } => {
                    r.host = Some(host.clone());
                    r.slot = *slot;
                    r.prepare = Some(prepare.as_str().into());
                }
                Event::Started {
                    host,
                    slot,
                    worker,
                    device,
                    prepare,
                    restored_bytes,
                    import_hit,
                    prepare_ms,
                    restore_ms,
                    refreshed,
                    phases,
                    ..
                } => {
                    r.phases = Some(*phases);
                    r.import_cache_hit = Some(*import_hit);
                    r.prepare_ms = Some(*prepare_ms);
                    r.restore_ms = Some(*restore_ms);
                    r.refreshed = Some(*refreshed);
                    r.host = Some(host.clone());
                    r.slot = *slot;
                    r.worker = Some(worker.clone());
                    r.device = Some(device.as_str().into());
                    r.prepare = Some(prepare.as_str().into());
                    r.restored_bytes = Some(*restored_bytes);
                    let from = prev_done_unix_ms.map_or(t.run_unix_ms, |p| p.max(t.run_unix_ms));
                    r.start_delay_ms = Some(unix_ms.saturating_sub(from));
                }
                Event::Finished { status, error, run_ms, faulted, .. } => {
                    r.run_ms = Some(*run_ms);
                    r.faulted = faulted.clone();
                    if *status == CellStatus::Error {
                        cell_error = Some(error.clone().unwrap_or_else(|| "the cell raised".into()));
                    }
                }
                Event::Saved { save_ms, saved_bytes, chunks_written, slot_released, .. } => {
                    r.save_ms = Some(*save_ms);
                    r.saved_bytes = Some(*saved_bytes);
                    r.chunks_written = Some(*chunks_written);
                    r.slot_released = Some(*slot_released);
                }
                Event::Failed { error } => cell_error = Some(error.clone()),
                Event::SlotReleased { .. }
                | Event::Ready { .. }
                | Event::Preparing { .. }
                | Event::PreparedEnded { .. }
                | Event::Other => {}
            }
        }
        let (status, done_ms, done_error) = match &t.done {
            Some((s, ms, e)) => (*s, Some(*ms), e.clone()),
            None => (ExecStatus::Failed, None, Some("the execution never completed".into())),
        };
        r.done_unix_ms = done_ms;
        r.error = cell_error.or(done_error);
        r.status = match status {
            ExecStatus::Ok if r.error.is_none() => "ok",
            ExecStatus::Failed => "failed",
            _ => "error",
        }
        .into();
        r
    }
}

/// The report's totals.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Totals {
    pub cells: usize,
    pub ok: usize,
    pub errors: usize,
    pub gpu_cells: usize,
    pub cpu_cells: usize,
    /// Sum of every SlotReleased of the session (any reason), in seconds.
    pub gpu_slot_seconds: f64,
    /// The part of it held for unsavable state.
    pub pinned_seconds: f64,
    pub wall_seconds: f64,
    pub median_start_delay_ms: Option<f64>,
    pub speculation: Speculation,
}

/// What speculation did for the session.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Speculation {
    /// Ready events: workers prepared or updated in place.
    pub ready_events: u64,
    /// Cells that ran on a prepared worker.
    pub prepared_cells: usize,
    /// Of those, the ones that needed no refresh at Run.
    pub clean_hits: usize,
    /// clean_hits / GPU cells.
    pub hit_rate: Option<f64>,
    /// Prepared workers that ended unused (evicted, lost, session closed).
    pub unused: usize,
    /// GPU-slot seconds speculative workers spent ready but idle (used or not);
    /// workers prepared on the CPU (no GPU-resident closure) hold no slot and add 0.
    pub speculative_idle_slot_seconds: f64,
    /// Seconds speculative workers spent ready but idle, with or without a slot.
    pub speculative_idle_worker_seconds: f64,
    /// GPU-slot seconds workers kept warm after their cell spent idle.
    pub warm_idle_slot_seconds: f64,
}

/// Session-wide events of a run, besides each execution's own.
#[derive(Clone, Debug, Default)]
pub struct SessionLog {
    /// Every SlotReleased: (`held_ms`, `reason`).
    pub slot_releases: Vec<(f64, SlotUse)>,
    /// Every PreparedEnded: (class, `idle_ms`, outcome, whether it held a slot).
    pub prepared_ended: Vec<(PreparedClass, f64, PreparedOutcome, bool)>,
    /// Ready events seen.
    pub ready: u64,
    /// When each worker was ready (unix ms of its Ready events, in order).
    pub ready_at: std::collections::HashMap<String, Vec<u64>>,
}

impl SessionLog {
    /// Record a session event (those of executions go to their traces).
    pub fn absorb(&mut self, unix_ms: u64, kind: &Event) {
        match kind {
            Event::SlotReleased { held_ms, reason, .. } => self.slot_releases.push((*held_ms, *reason)),
            Event::PreparedEnded { class, idle_ms, outcome, slot, .. } => {
                self.prepared_ended.push((*class, *idle_ms, *outcome, slot.is_some()));
            }
            Event::Ready { worker, .. } => {
                self.ready += 1;
                self.ready_at.entry(worker.clone()).or_default().push(unix_ms);
            }
            _ => {}
        }
    }
}

/// The version of the report's layout (`docs/report.schema.json` describes it).
pub const REPORT_VERSION: u32 = 1;

/// The URL that names the JSON Schema of this layout: the `$id` of
/// `docs/report.schema.json`, one per layout version, so that a report says what
/// it is without a copy of its schema beside it.
pub fn schema_url() -> String {
    format!("https://looseleaf.dev/schemas/report/v{REPORT_VERSION}.json")
}

/// REPORT.json.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// The URL of its JSON Schema ([`schema_url`]).
    #[serde(rename = "$schema")]
    pub schema: String,
    pub report_version: u32,
    /// The LooseLeaf that ran the notebook.
    pub looseleaf_version: String,
    /// When the run started (UTC, RFC 3339).
    pub started_at: String,
    pub notebook: String,
    /// The session the notebook ran in.
    pub session_id: Option<Uuid>,
    pub cells: Vec<CellReport>,
    pub totals: Totals,
}

/// Write the report (it names its schema by URL: nothing is written beside it).
pub fn write(report: &Report, path: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let json = serde_json::to_string_pretty(report).context("while encoding the report")?;
    std::fs::write(path, json + "\n").with_context(|| format!("while writing {}", path.display()))
}

/// A time as RFC 3339 in UTC, to the second (`2026-11-30T09:08:27Z`).
pub fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Median of a list (mean of the middle two for even lengths); None if empty.
pub fn median(values: &[u64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_unstable();
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2] as f64),
        _ => Some((v[n / 2 - 1] + v[n / 2]) as f64 / 2.0),
    }
}

/// Build the report from the executions in order and every SlotReleased of the session
/// (`held_ms`, `reason`).
pub fn build(
    notebook: &str,
    traces: &[Trace],
    log: &SessionLog,
    wall_seconds: f64,
    started_at: std::time::SystemTime,
) -> Report {
    let slot_releases = &log.slot_releases;
    let mut cells = Vec::with_capacity(traces.len());
    let mut prev_done = None;
    for t in traces {
        let mut cell = CellReport::from_trace(t, prev_done);
        prev_done = cell.done_unix_ms.or(prev_done);
        if matches!(cell.prepare.as_deref(), Some("speculative" | "warm")) {
            // its last Ready before the cell started (a worker kept warm after it
            // is ready again later)
            let started = t.events.iter().find_map(|(at, e)| matches!(e, Event::Started { .. }).then_some(*at));
            let readies = cell.worker.as_ref().and_then(|w| log.ready_at.get(w));
            cell.prepared_unix_ms = readies
                .zip(started)
                .and_then(|(times, started)| times.iter().rev().find(|at| **at <= started).copied());
        }
        cells.push(cell);
    }
    let delays: Vec<u64> = cells.iter().filter_map(|c| c.start_delay_ms).collect();
    let totals = Totals {
        cells: cells.len(),
        ok: cells.iter().filter(|c| c.status == "ok").count(),
        errors: cells.iter().filter(|c| c.status != "ok").count(),
        gpu_cells: cells.iter().filter(|c| c.device.as_deref() == Some("gpu")).count(),
        cpu_cells: cells.iter().filter(|c| c.device.as_deref() == Some("cpu")).count(),
        // fold from +0.0: an empty f64 sum is -0.0, which prints as "-0.0 s"
        gpu_slot_seconds: slot_releases.iter().map(|(ms, _)| ms / 1000.0).fold(0.0, |a, b| a + b),
        pinned_seconds: slot_releases
            .iter()
            .filter(|(_, why)| *why == SlotUse::UnsavableState)
            .map(|(ms, _)| ms / 1000.0)
            .fold(0.0, |a, b| a + b),
        wall_seconds,
        median_start_delay_ms: median(&delays),
        speculation: speculation(&cells, log),
    };
    Report {
        schema: schema_url(),
        report_version: REPORT_VERSION,
        looseleaf_version: env!("CARGO_PKG_VERSION").into(),
        started_at: rfc3339(started_at),
        notebook: notebook.to_string(),
        session_id: None,
        cells,
        totals,
    }
}

fn speculation(cells: &[CellReport], log: &SessionLog) -> Speculation {
    let gpu_cells = cells.iter().filter(|c| c.device.as_deref() == Some("gpu")).count();
    let prepared: Vec<&CellReport> = cells.iter().filter(|c| c.prepare.as_deref() == Some("speculative")).collect();
    let clean_hits = prepared.iter().filter(|c| c.refreshed == Some(0)).count();
    let idle = |class: PreparedClass, slot_only: bool| {
        log.prepared_ended
            .iter()
            .filter(|(c, _, _, held)| *c == class && (*held || !slot_only))
            .map(|(_, ms, _, _)| ms / 1000.0)
            .fold(0.0, |a, b| a + b)
    };
    Speculation {
        ready_events: log.ready,
        prepared_cells: prepared.len(),
        clean_hits,
        hit_rate: (gpu_cells > 0).then(|| clean_hits as f64 / gpu_cells as f64),
        unused: log.prepared_ended.iter().filter(|(_, _, o, _)| *o != PreparedOutcome::Used).count(),
        speculative_idle_slot_seconds: idle(PreparedClass::Speculative, true),
        speculative_idle_worker_seconds: idle(PreparedClass::Speculative, false),
        warm_idle_slot_seconds: idle(PreparedClass::Warm, true),
    }
}

#[cfg(test)]
#[path = "report_tests.rs"]
mod tests;
