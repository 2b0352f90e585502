//! Sessions to replay: the base synthetic workload of `../shared/anchors/workloads.md`
//! (and its sensitivity variants), sessions derived from the NotebookOS/Adobe trace
//! statistics in the same file, and sessions recorded by `looseleaf run` (REPORT.json).
//!
//! A session is a sequence of cells. Each cell says how long after the previous
//! cell ends the user starts editing it (`gap_s`), how long they edit before Run,
//! and what it needs. Times after the first are relative, so a late start shifts
//! the rest of the session, as it would for a person waiting on a cell.

use anyhow::Context;
use serde::Serialize;
use uuid::Uuid;

use crate::dist::{Draw, LogNormal, Quantiles};

/// One cell to run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Cell {
    /// The cell's id (recorded) or its number in the session (synthetic).
    pub cell_id: String,
    /// From the end of the previous cell (or the session's opening) to the start
    /// of this cell's edit.
    pub gap_s: f64,
    /// Edit time before Run: the window speculation has.
    pub edit_s: f64,
    /// A GPU cell.
    pub gpu: bool,
    /// GPUs it needs (GPU cells).
    pub gpus: u32,
    /// How long its code runs.
    pub run_s: f64,
    /// Bytes of its state closure (what a fresh worker restores).
    pub closure_bytes: u64,
    /// The closure's variables, when known (recorded sessions).
    pub closure: Vec<String>,
    /// Bytes of the whole session's state at this cell (what a whole-session
    /// restore, a replica's upload or a snapshot moves).
    pub state_bytes: u64,
    /// Bytes its save writes.
    pub saved_bytes: u64,
    /// It imports a package its zygote lacks.
    pub import_tail: bool,
    /// Preparing its worker took this long when it was recorded (claim to ready).
    pub prepare_s: Option<f64>,
    /// When it was recorded on a prepared worker that became ready after Run:
    /// how long after its edit began that worker was ready. A replay prepares it
    /// that long, so the Run waits for its preparation as long.
    pub ready_s: Option<f64>,
    /// Its save took this long when it was recorded.
    pub save_s: Option<f64>,
}

/// One notebook session.
#[derive(Clone, Debug, Serialize)]
pub struct Session {
    /// Stable id (derived from the seed and index, or the recorded session's).
    pub id: Uuid,
    /// A name for logs (the notebook, for recorded sessions).
    pub name: String,
    /// When it opens (seconds from the start of the simulation).
    pub open_s: f64,
    /// When it closes at the latest: a cell that would start editing after this is
    /// not run.
    pub close_s: f64,
    /// Its cells, in run order.
    pub cells: Vec<Cell>,
}

/// Sessions and the parameters they were made from.
#[derive(Clone, Debug, Serialize)]
pub struct Workload {
    /// What it is (`base`, `base/edit_halved`, `trace`, `recorded`).
    pub name: String,
    /// The parameters, copied into the results.
    pub params: serde_json::Value,
    /// The sessions.
    #[serde(skip)]
    pub sessions: Vec<Session>,
}

impl Workload {
    /// GPU cells in all sessions.
    pub fn gpu_cells(&self) -> usize {
        self.sessions.iter().flat_map(|s| &s.cells).filter(|c| c.gpu).count()
    }
}

/// The base synthetic workload's parameters (workloads.md, "The base synthetic
/// workload"). They are the anchor's, not ours to tune; variants change one each.
#[derive(Clone, Debug, Serialize)]
pub struct Synthetic {
    /// Concurrent sessions.
    pub sessions: usize,
    /// Sessions open at a uniform time in this first window.
    pub open_window_s: f64,
    /// How long each session lasts.
    pub session_s: f64,
    /// Active periods: exponential with this mean.
    pub active_mean_s: f64,
    /// Away periods: exponential with this mean.
    pub away_mean_s: f64,
    /// Edit time before Run.
    pub edit_s: LogNormal,
    /// Think gap after a cell: at least this ...
    pub think_min_s: f64,
    /// ... plus an exponential with this mean.
    pub think_exp_mean_s: f64,
    /// The share of runs that are GPU cells.
    pub gpu_share: f64,
    /// GPU-cell run time.
    pub gpu_run_s: LogNormal,
    /// CPU-cell run time.
    pub cpu_run_s: LogNormal,
    /// GPU cells' state closures, bytes.
    pub closure_bytes: LogNormal,
    /// The share of GPU cells whose imports reach outside the zygote.
    pub import_tail_share: f64,
    /// GPUs per GPU cell.
    pub gpus_per_cell: u32,
    /// No closure or session state is larger than one GPU's memory (NotebookOS's
    /// default host: 40 GB per GPU); the log-normal's tail would otherwise draw
    /// terabytes.
    pub max_state_bytes: f64,
    /// The seed.
    pub seed: u64,
}

impl Synthetic {
    /// The anchor's base workload with `sessions` sessions.
    pub fn base(sessions: usize, seed: u64) -> Self {
        Self {
            sessions,
            open_window_s: 30.0 * 60.0,
            session_s: 8.0 * 3600.0,
            active_mean_s: 45.0 * 60.0,
            away_mean_s: 40.0 * 60.0,
            edit_s: LogNormal { median: 9.5, p90: 40.0 },
            think_min_s: 60.0,
            think_exp_mean_s: 120.0,
            gpu_share: 0.2,
            gpu_run_s: LogNormal { median: 8.0, p90: 90.0 },
            cpu_run_s: LogNormal { median: 0.5, p90: 5.0 },
            closure_bytes: LogNormal { median: 50e6, p90: 1.5e9 },
            import_tail_share: 0.5,
            gpus_per_cell: 1,
            max_state_bytes: 40e9,
            seed,
        }
    }

    /// The sensitivity variants the anchor names, by name.
    pub fn variant(self, name: &str) -> anyhow::Result<Self> {
        Ok(match name {
            "edit_halved" => Self { edit_s: self.edit_s.scaled(0.5), ..self },
            "gpu_share_40" => Self { gpu_share: 0.4, ..self },
            "away_10min" => Self { away_mean_s: 600.0, ..self },
            "closures_10x" => Self { closure_bytes: self.closure_bytes.scaled(10.0), ..self },
            other => anyhow::bail!("no workload variant {other:?} (known: {})", VARIANTS.join(", ")),
        })
    }

    /// Generate the sessions.
    pub fn generate(&self, name: &str) -> Workload {
        let mut d = Draw::new(self.seed);
        let sessions = (0..self.sessions).map(|i| self.session(i, &mut d)).collect();
        Workload { name: name.to_string(), params: serde_json::to_value(self).unwrap_or_default(), sessions }
    }

    fn session(&self, index: usize, d: &mut Draw) -> Session {
        let open_s = d.uniform(0.0, self.open_window_s);
        let mut cells = Vec::new();
        // nominal times from the session's opening; the replay keeps the gaps
        let (mut t, mut prev_end, mut active_end) = (0.0, 0.0, d.exp(self.active_mean_s));
        let mut state_bytes = 0u64;
        while t < self.session_s {
            let edit_s = d.lognormal(self.edit_s);
            let gpu = d.chance(self.gpu_share);
            let (run_s, closure_bytes, import_tail) = if gpu {
                let closure = d.lognormal(self.closure_bytes).min(self.max_state_bytes) as u64;
                (d.lognormal(self.gpu_run_s), closure, d.chance(self.import_tail_share))
            } else {
                (d.lognormal(self.cpu_run_s), 0, false)
            };
            // the whole session's state: at least its largest closure so far. Only
            // that much is known; counting no more favours the baselines that move
            // whole sessions (naive, NotebookOS, snapshots).
            state_bytes = state_bytes.max(closure_bytes);
            cells.push(Cell {
                cell_id: format!("c{}", cells.len()),
                gap_s: t - prev_end,
                edit_s,
                gpu,
                gpus: if gpu { self.gpus_per_cell } else { 0 },
                run_s,
                closure_bytes,
                closure: vec![],
                state_bytes,
                saved_bytes: closure_bytes,
                import_tail,
                prepare_s: None,
                ready_s: None,
                save_s: None,
            });
            prev_end = t + edit_s + run_s;
            let mut next = prev_end + self.think_min_s + d.exp(self.think_exp_mean_s);
            if next > active_end {
                // the user leaves when the active period ends, and comes back
                next = next.max(active_end + d.exp(self.away_mean_s));
                active_end = next + d.exp(self.active_mean_s);
            }
            t = next;
        }
        Session {
            id: Uuid::from_u128(((self.seed as u128) << 64) | index as u128),
            name: format!("session-{index}"),
            open_s,
            close_s: open_s + self.session_s,
            cells,
        }
    }
}

/// The sensitivity variants of the base workload.
pub const VARIANTS: [&str; 4] = ["edit_halved", "gpu_share_40", "away_10min", "closures_10x"];

/// Sessions from the NotebookOS/Adobe trace statistics (workloads.md, its table):
/// arrivals at the trace's inter-arrival times, each job a session that edits
/// one cell (the base edit time) and runs it with the job's GPUs and duration.
/// The trace has no session ids, so each job is a new session of its own.
#[derive(Clone, Debug, Serialize)]
pub struct Trace {
    /// Hours of arrivals to replay.
    pub hours: f64,
    /// Job duration quantiles, minutes.
    pub duration_min: Quantiles,
    /// Inter-arrival quantiles, minutes.
    pub interarrival_min: Quantiles,
    /// Jobs of at most 5 minutes: shares of 1, 4 and 8 GPUs.
    pub gpus_short: [f64; 3],
    /// Longer jobs: shares of 1, 4 and 8 GPUs.
    pub gpus_long: [f64; 3],
    /// A job's VRAM is GPUs x this x U(0, 1) (NotebookOS's generator): what its
    /// cell leaves to save. Its session is new, so the cell restores nothing.
    pub vram_per_gpu_bytes: f64,
    /// Jobs longer than this are cut (the trace's p99 is 17 hours).
    pub max_run_s: f64,
    /// Edit time before Run.
    pub edit_s: LogNormal,
    /// The seed.
    pub seed: u64,
}

impl Trace {
    /// The anchor's statistics. GPU shares by duration: 76% of 1-5 minute jobs use
    /// 1 GPU and about 47% of longer jobs use 8; the rest is split so that the
    /// overall shares are the table's (1: 49.2%, 4: 20.0%, 8: 30.7%), taking half
    /// the jobs as short (the median duration is 5 minutes).
    pub fn adobe(seed: u64) -> Self {
        let (one, eight) = (0.492, 0.307);
        let long_one = (one - 0.5 * 0.76) / 0.5;
        let short_eight = (eight - 0.5 * 0.47) / 0.5;
        Self {
            hours: 8.0,
            duration_min: Quantiles {
                points: vec![
                    (0.0, 1.0),
                    (0.10, 3.0),
                    (0.25, 3.0),
                    (0.50, 5.0),
                    (0.75, 11.0),
                    (0.90, 32.0),
                    (0.95, 95.0),
                    (0.99, 1021.0),
                    (1.0, 26458.0),
                ],
                log: true,
            },
            interarrival_min: Quantiles {
                points: vec![(0.0, 0.0), (0.289, 0.0), (0.50, 1.0), (0.90, 3.0), (0.99, 7.0), (1.0, 20.0)],
                log: false,
            },
            gpus_short: [0.76, 1.0 - 0.76 - short_eight, short_eight],
            gpus_long: [long_one, 1.0 - long_one - 0.47, 0.47],
            vram_per_gpu_bytes: 4e9,
            max_run_s: 8.0 * 3600.0,
            edit_s: LogNormal { median: 9.5, p90: 40.0 },
            seed,
        }
    }

    /// Generate the sessions.
    pub fn generate(&self) -> Workload {
        let mut d = Draw::new(self.seed);
        let mut sessions = Vec::new();
        let mut t = 0.0;
        while t < self.hours * 3600.0 {
            let minutes = d.quantiles(&self.duration_min);
            let shares = if minutes <= 5.0 { self.gpus_short } else { self.gpus_long };
            let u = d.unit();
            let gpus = if u < shares[0] {
                1
            } else if u < shares[0] + shares[1] {
                4
            } else {
                8
            };
            // a job's session is new: its one cell restores nothing and leaves its VRAM
            let vram_bytes = (gpus as f64 * self.vram_per_gpu_bytes * d.unit()) as u64;
            let edit_s = d.lognormal(self.edit_s);
            let run_s = (minutes * 60.0).min(self.max_run_s);
            let index = sessions.len();
            sessions.push(Session {
                id: Uuid::from_u128(((self.seed as u128) << 64) | (1 << 63) | index as u128),
                name: format!("job-{index}"),
                open_s: t,
                close_s: t + edit_s + run_s + 6.0,
                cells: vec![Cell {
                    cell_id: "c0".into(),
                    gap_s: 0.0,
                    edit_s,
                    gpu: true,
                    gpus,
                    run_s,
                    closure_bytes: 0,
                    closure: vec![],
                    state_bytes: 0,
                    saved_bytes: vram_bytes,
                    import_tail: false,
                    prepare_s: None,
                    ready_s: None,
                    save_s: None,
                }],
            });
            t += 60.0 * d.quantiles(&self.interarrival_min);
        }
        Workload { name: "trace".into(), params: serde_json::to_value(self).unwrap_or_default(), sessions }
    }
}

/// A session recorded by `looseleaf run --typing-cps` (its REPORT.json): its cells
/// in order with their device, closure, run and save sizes, and the time the user
/// (the typing replay) took before each Run. `open_s` is the report's start
/// relative to `epoch_ms` (unix ms), so several reports replay together.
pub fn recorded(report: &serde_json::Value, epoch_ms: u64) -> anyhow::Result<Session> {
    let cells_json = report.get("cells").and_then(|c| c.as_array()).context("the report has no `cells` list")?;
    let name = report.get("notebook").and_then(|n| n.as_str()).unwrap_or("recorded").to_string();
    let started_ms = started_unix_ms(report)?;
    let id = report
        .get("session_id")
        .and_then(|s| s.as_str())
        .and_then(|s| Uuid::parse_str(s).ok())
        .unwrap_or_else(|| Uuid::from_u128(started_ms as u128));
    let mut cells = Vec::new();
    let mut prev_done = started_ms;
    let mut state_bytes = 0u64;
    let mut end_ms = started_ms;
    for (i, c) in cells_json.iter().enumerate() {
        let field = |k: &str| c.get(k).filter(|v| !v.is_null());
        let num = |k: &str| field(k).and_then(|v| v.as_f64());
        let cell_id = field("cell_id").and_then(|v| v.as_str()).unwrap_or_default().to_string();
        let device =
            field("device").and_then(|v| v.as_str()).with_context(|| format!("cell {i} ({cell_id}) has no device"))?;
        let run_ms = num("run_unix_ms").with_context(|| format!("cell {i} ({cell_id}) has no run_unix_ms"))?;
        let done_ms = num("done_unix_ms").unwrap_or(run_ms);
        let gpu = device != "cpu";
        let restored = num("restored_bytes").unwrap_or(0.0) as u64;
        let saved = num("saved_bytes").unwrap_or(0.0) as u64;
        state_bytes += saved;
        cells.push(Cell {
            cell_id,
            gap_s: 0.0,
            edit_s: ((run_ms - prev_done as f64) / 1000.0).max(0.0),
            gpu,
            gpus: if gpu { 1 } else { 0 },
            run_s: num("run_ms").unwrap_or(0.0) / 1000.0,
            closure_bytes: restored,
            closure: field("closure")
                .and_then(|v| v.as_array())
                .map(|a| a.iter().filter_map(|n| n.as_str().map(String::from)).collect())
                .unwrap_or_default(),
            state_bytes,
            saved_bytes: saved,
            import_tail: field("import_cache_hit").and_then(|v| v.as_bool()) == Some(false),
            prepare_s: num("prepare_ms").map(|ms| ms / 1000.0),
            // only a Run that waited for its worker: one ready before Run is
            // prepared in the replay as long as the host's preparation took
            ready_s: num("prepared_unix_ms").filter(|ready| *ready > run_ms).map(|ready| ready_s(ready, prev_done)),
            save_s: num("save_ms").map(|ms| ms / 1000.0),
        });
        prev_done = done_ms as u64;
        end_ms = end_ms.max(done_ms as u64);
    }
    Ok(Session {
        id,
        name,
        open_s: started_ms.saturating_sub(epoch_ms) as f64 / 1000.0,
        close_s: end_ms.saturating_sub(epoch_ms) as f64 / 1000.0,
        cells,
    })
}

/// When the recorded run started (unix ms), from its `started_at` (RFC 3339).
pub fn started_unix_ms(report: &serde_json::Value) -> anyhow::Result<u64> {
    let at = report.get("started_at").and_then(|s| s.as_str()).context("the report has no `started_at`")?;
    let t = humantime::parse_rfc3339_weak(at).with_context(|| format!("started_at {at:?} is not RFC 3339"))?;
    Ok(t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0))
}

/// Recorded sessions, replayed together from the earliest start.
pub fn recorded_workload(reports: &[(String, serde_json::Value)]) -> anyhow::Result<Workload> {
    let mut epoch = u64::MAX;
    for (path, r) in reports {
        epoch = epoch.min(started_unix_ms(r).with_context(|| format!("in {path}"))?);
    }
    let sessions = reports
        .iter()
        .map(|(path, r)| recorded(r, epoch).with_context(|| format!("in {path}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let files: Vec<&str> = reports.iter().map(|(p, _)| p.as_str()).collect();
    Ok(Workload { name: "recorded".into(), params: serde_json::json!({ "reports": files }), sessions })
}

/// How long after its edit began (`edit_start_ms`, the previous cell's end) a
/// recorded cell's prepared worker was last ready (`ready_unix_ms`).
fn ready_s(ready_unix_ms: f64, edit_start_ms: u64) -> f64 {
    ((ready_unix_ms - edit_start_ms as f64) / 1000.0).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::quantile;

    #[test]
    fn the_base_workload_follows_the_anchor() {
        let w = Synthetic::base(48, 11).generate("base");
        assert_eq!(w.sessions.len(), 48);
        let cells: Vec<&Cell> = w.sessions.iter().flat_map(|s| &s.cells).collect();
        let gpu_share = cells.iter().filter(|c| c.gpu).count() as f64 / cells.len() as f64;
        assert!((gpu_share - 0.2).abs() < 0.03, "GPU share {gpu_share}");
        let mut edits: Vec<f64> = cells.iter().map(|c| c.edit_s).collect();
        edits.sort_by(f64::total_cmp);
        assert!((quantile(&edits, 0.5) - 9.5).abs() < 1.0, "edit median {}", quantile(&edits, 0.5));
        // after the first cell every gap is at least the 60 s think time
        assert!(w.sessions.iter().all(|s| s.cells.iter().skip(1).all(|c| c.gap_s >= 60.0)));
        for s in &w.sessions {
            assert!(s.open_s >= 0.0 && s.open_s < 1800.0);
            assert!((s.close_s - s.open_s - 8.0 * 3600.0).abs() < 1e-6);
        }
        // away periods exist: some gaps are far above the think time
        assert!(cells.iter().any(|c| c.gap_s > 20.0 * 60.0));
    }

    #[test]
    fn variants_change_one_parameter_and_unknown_ones_are_named() {
        let base = Synthetic::base(24, 1);
        assert_eq!(base.clone().variant("gpu_share_40").map(|v| v.gpu_share).ok(), Some(0.4));
        assert_eq!(base.clone().variant("edit_halved").map(|v| v.edit_s.median).ok(), Some(4.75));
        let err = base.variant("faster").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("faster") && err.contains("edit_halved"), "{err}");
    }

    #[test]
    fn the_trace_workload_matches_its_statistics() {
        let t = Trace { hours: 200.0, ..Trace::adobe(5) };
        let w = t.generate();
        let jobs = w.sessions.len() as f64;
        // 42.9 arrivals an hour
        assert!((jobs / 200.0 - 42.9).abs() < 4.0, "{} an hour", jobs / 200.0);
        let share = |g: u32| w.sessions.iter().filter(|s| s.cells[0].gpus == g).count() as f64 / jobs;
        assert!((share(1) - 0.492).abs() < 0.03 && (share(8) - 0.307).abs() < 0.03, "{} {}", share(1), share(8));
    }

    #[test]
    fn a_recorded_preparation_ends_when_the_real_one_was_ready() {
        // typed from 10 s (the previous cell's end), ready at 19 s: 9 s after
        assert_eq!(ready_s(19_000.0, 10_000), 9.0);
        // ready before the previous cell ended (kept warm): as good as at once
        assert_eq!(ready_s(9_000.0, 10_000), 0.0);
    }

    #[test]
    fn a_report_becomes_a_session_with_its_cells_devices_and_closures() {
        let report = serde_json::json!({
            "notebook": "nb.ipynb", "started_at": "2025-12-01T10:00:00Z",
            "cells": [
                {"cell_id": "a", "device": "cpu", "closure": [], "run_ms": 100.0, "run_unix_ms": 1764583202000u64,
                 "done_unix_ms": 1764583202200u64, "saved_bytes": 10},
                {"cell_id": "b", "device": "gpu", "closure": ["x", "y"], "run_ms": 900.0, "restored_bytes": 2048,
                 "import_cache_hit": false, "run_unix_ms": 1764583205200u64, "done_unix_ms": 1764583206200u64,
                 "prepared_unix_ms": 1764583205700u64}
            ]
        });
        let s = recorded(&report, 1764583200000).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(s.open_s, 0.0);
        let ids: Vec<&str> = s.cells.iter().map(|c| c.cell_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!((s.cells[0].gpu, s.cells[1].gpu), (false, true));
        assert_eq!(s.cells[1].closure, ["x", "y"]);
        assert_eq!((s.cells[1].closure_bytes, s.cells[1].import_tail), (2048, true));
        // edit time: from the previous cell's end to this Run
        assert!((s.cells[1].edit_s - 3.0).abs() < 1e-9 && (s.cells[0].edit_s - 2.0).abs() < 1e-9);
        // its worker was ready 0.5 s after Run, 3.5 s after the previous cell
        // ended (a cold one has none)
        assert_eq!((s.cells[0].ready_s, s.cells[1].ready_s), (None, Some(3.5)));
        let mut early = report.clone();
        early["cells"][1]["prepared_unix_ms"] = serde_json::json!(1764583204200u64);
        let s = recorded(&early, 1764583200000).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(s.cells[1].ready_s, None, "ready before Run: nothing to wait for");
        let bad = serde_json::json!({"started_at": "2026-12-01T10:00:00Z", "cells": [{"cell_id": "z"}]});
        let err = recorded(&bad, 0).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("cell 0 (z) has no device"), "{err}");
    }
}
