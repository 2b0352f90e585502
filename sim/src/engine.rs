//! The discrete-event driver: sessions open, users edit and press Run, cells run
//! and finish, hosts boot and stop, and a [`Policy`] decides where and when each
//! cell starts. Time is simulated seconds on a [`SimClock`]; nothing sleeps.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap};

use serde::Serialize;

use crate::cluster::{Autoscaler, Cluster, Power, SimClock};
use crate::costs::Costs;
use crate::dist::{quantile, Draw};
use crate::workload::{Cell, Session, Workload};

/// Where a policy's own timers say what they are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timer {
    /// The session it concerns.
    pub session: usize,
    /// The policy's kind of timer.
    pub kind: u32,
    /// The policy's tag (e.g. which cell or epoch it was set for).
    pub tag: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ev {
    Open(usize),
    Edit(usize),
    Run(usize),
    Start(usize),
    Finished(usize),
    Close(usize),
    Policy(Timer),
    Scale,
    OpDone,
    Sample,
}

#[derive(Debug)]
struct Timed {
    at: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Timed {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Timed {
    fn cmp(&self, other: &Self) -> Ordering {
        self.at.total_cmp(&other.at).then(self.seq.cmp(&other.seq))
    }
}

/// Where a session is.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// The cell being edited, waiting or running (index into the session's cells).
    pub cell: usize,
    /// When its Run was pressed.
    pub run_at: f64,
    /// When the previous cell ended.
    pub prev_end: f64,
    /// Open and not yet closed.
    pub open: bool,
    /// Its current cell has started running.
    pub started: bool,
}

/// One cell as replayed (kept when asked, for recorded sessions).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Replayed {
    /// The session's name.
    pub session: String,
    /// The cell.
    pub cell_id: String,
    /// `gpu` or `cpu`.
    pub device: String,
    /// Its closure's variables.
    pub closure: Vec<String>,
    /// Run to first line.
    pub start_delay_ms: f64,
}

/// A provisioning or placement rule under comparison.
pub trait Policy {
    /// Its name in the results.
    fn name(&self) -> String;
    /// A session opened.
    fn open(&mut self, _sim: &mut Sim, _s: usize) {}
    /// The user started editing the session's current cell.
    fn edit(&mut self, _sim: &mut Sim, _s: usize) {}
    /// Run was pressed: start the cell with [`Sim::start`], now or later.
    fn run(&mut self, sim: &mut Sim, s: usize);
    /// The cell's code finished: let the session go on with [`Sim::done`].
    fn finished(&mut self, sim: &mut Sim, s: usize) {
        let now = sim.now();
        sim.done(s, now);
    }
    /// The session closed.
    fn close(&mut self, _sim: &mut Sim, _s: usize) {}
    /// A timer the policy set.
    fn timer(&mut self, _sim: &mut Sim, _t: Timer) {}
    /// Hosts came on or went off: work waiting for a slot may go on.
    fn capacity_changed(&mut self, _sim: &mut Sim) {}
    /// Every autoscaler interval, before it decides.
    fn tick(&mut self, _sim: &mut Sim) {}
    /// Scale the cluster at the autoscaler's interval; false leaves it to
    /// NotebookOS's rule, which the baselines keep.
    fn scale(&mut self, _sim: &mut Sim) -> bool {
        false
    }
    /// Whether an idle host may be released (its slots are all free).
    fn releasable(&self, _sim: &Sim, _host: usize) -> bool {
        true
    }
    /// Counters worth reporting.
    fn counters(&self) -> BTreeMap<String, f64> {
        BTreeMap::new()
    }
}

/// The simulation a policy acts on.
pub struct Sim<'w> {
    /// The clock.
    pub clock: SimClock,
    /// The hosts.
    pub cluster: Cluster,
    /// The sessions.
    pub workload: &'w Workload,
    /// Step costs.
    pub costs: &'w Costs,
    /// Random draws (seeded).
    pub draw: Draw,
    /// Each session's progress.
    pub progress: Vec<Progress>,
    queue: BinaryHeap<Reverse<Timed>>,
    seq: u64,
    metrics: Metrics,
    scale_ticks: u32,
}

#[derive(Default)]
struct Metrics {
    start_delays_ms: Vec<f64>,
    completion_overheads_ms: Vec<f64>,
    busy_gpu_seconds: f64,
    busy_now: u32,
    occupancy: Vec<[f64; 4]>,
    cells: Vec<Replayed>,
    keep_cells: bool,
    cells_run: usize,
}

impl<'w> Sim<'w> {
    /// Now, in simulated seconds.
    pub fn now(&self) -> f64 {
        self.clock.seconds()
    }

    /// Session `s`.
    pub fn session(&self, s: usize) -> &'w Session {
        &self.workload.sessions[s]
    }

    /// Session `s`'s current cell.
    pub fn cell(&self, s: usize) -> &'w Cell {
        &self.workload.sessions[s].cells[self.progress[s].cell]
    }

    /// The cells of session `s` before its current one.
    pub fn earlier_cells(&self, s: usize) -> &'w [Cell] {
        &self.workload.sessions[s].cells[..self.progress[s].cell]
    }

    fn push(&mut self, at: f64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Timed { at: at.max(self.now()), seq: self.seq, ev }));
    }

    /// Start session `s`'s current cell at `at`.
    pub fn start(&mut self, s: usize, at: f64) {
        self.push(at, Ev::Start(s));
    }

    /// Session `s` may go on at `at` (its cell is complete for the user).
    pub fn done(&mut self, s: usize, at: f64) {
        let cell = self.cell(s);
        let p = &self.progress[s];
        if cell.gpu && p.started {
            // against a pinned run of the same cell: started at Run (or once the
            // previous cell ended), ended its run time later
            let pinned_end = p.run_at.max(p.prev_end) + cell.run_s;
            self.metrics.completion_overheads_ms.push(((at - pinned_end) * 1000.0).max(0.0));
        }
        let p = &mut self.progress[s];
        p.prev_end = at;
        let session = &self.workload.sessions[s];
        let next = p.cell + 1;
        match session.cells.get(next) {
            Some(c) if at + c.gap_s < session.close_s => {
                p.cell = next;
                p.started = false;
                self.push(at + c.gap_s, Ev::Edit(s));
            }
            // no next cell fits: the session stays open until it closes
            _ => self.push(at.max(session.close_s), Ev::Close(s)),
        }
    }

    /// Call the policy back at `at`.
    pub fn timer(&mut self, at: f64, t: Timer) {
        self.push(at, Ev::Policy(t));
    }

    /// Ask for `n` more hosts now (one operation; none while another is in flight).
    pub fn request_hosts(&mut self, n: u32) {
        let (mean, std) = self.cluster.autoscaler.boot_s;
        let draw = &mut self.draw;
        if let Some(at) = self.cluster.scale_out(n, || draw.normal_at_least(mean, std, 1.0)) {
            self.push(at, Ev::OpDone);
        }
    }

    /// Release `hosts` now (one operation); false while another is in flight.
    pub fn release_hosts(&mut self, hosts: &[usize]) -> bool {
        let (mean, std) = self.cluster.autoscaler.stop_s;
        let draw = &mut self.draw;
        match self.cluster.scale_in(hosts, || draw.normal_at_least(mean, std, 0.5)) {
            Some(at) => {
                self.push(at, Ev::OpDone);
                true
            }
            None => false,
        }
    }

    /// A host that is on with `gpus` free slots, the one with the most free first.
    pub fn host_with_room(&self, gpus: u32) -> Option<usize> {
        self.cluster
            .hosts
            .iter()
            .enumerate()
            .filter(|(_, h)| h.is_on() && h.slots.free_count() >= gpus)
            .max_by_key(|(i, h)| (h.slots.free_count(), std::cmp::Reverse(*i)))
            .map(|(i, _)| i)
    }
}

/// What one policy did with one workload.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// The policy.
    pub policy: String,
    /// Host-hours provisioned x GPUs per host.
    pub gpu_hours: f64,
    /// GPU-hours slots were held (by runs, prepared or kept workers, pinned sessions).
    pub held_gpu_hours: f64,
    /// GPU-hours bound to running GPU cells.
    pub busy_gpu_hours: f64,
    /// GPU cells started.
    pub gpu_cells: usize,
    /// Cells run.
    pub cells: usize,
    /// Of the GPU cells, the share started within 1 s of Run.
    pub within_1s: f64,
    /// Median start delay of GPU cells.
    pub p50_start_ms: f64,
    /// 99th percentile.
    pub p99_start_ms: f64,
    /// Largest.
    pub max_start_ms: f64,
    /// GPU cells' completion overhead: each one's end against a pinned run of the
    /// same cell (started at Run, done its run time later), median.
    pub p50_completion_overhead_ms: f64,
    /// 99th percentile of the same.
    pub p99_completion_overhead_ms: f64,
    /// When the last session closed (simulated s).
    pub end_s: f64,
    /// Wall time the simulation took.
    pub wall_s: f64,
    /// The policy's own counters.
    pub counters: BTreeMap<String, f64>,
    /// GPU cells' start delays, sorted (for the CDF).
    #[serde(skip)]
    pub start_delays_ms: Vec<f64>,
    /// Every minute: [t s, provisioned GPUs, held slots, busy GPUs].
    #[serde(skip)]
    pub occupancy: Vec<[f64; 4]>,
    /// Each cell, when kept.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replayed: Vec<Replayed>,
}

/// Replay `workload` under `policy`.
pub fn simulate(
    policy: &mut dyn Policy,
    workload: &Workload,
    costs: &Costs,
    autoscaler: Autoscaler,
    seed: u64,
    keep_cells: bool,
) -> Outcome {
    let wall = std::time::Instant::now();
    let clock = SimClock::new();
    let interval = autoscaler.interval_s;
    let mut sim = Sim {
        cluster: Cluster::new(autoscaler, clock.clone()),
        clock,
        workload,
        costs,
        draw: Draw::new(seed),
        progress: vec![Progress::default(); workload.sessions.len()],
        queue: BinaryHeap::new(),
        seq: 0,
        metrics: Metrics { keep_cells, ..Default::default() },
        scale_ticks: 0,
    };
    for (s, session) in workload.sessions.iter().enumerate() {
        sim.push(session.open_s, Ev::Open(s));
    }
    sim.push(interval, Ev::Scale);
    sim.push(0.0, Ev::Sample);
    let mut open = workload.sessions.len();
    while open > 0 {
        let Some(Reverse(Timed { at, ev, .. })) = sim.queue.pop() else { break };
        sim.clock.set(at);
        match ev {
            Ev::Open(s) => {
                sim.progress[s].open = true;
                policy.open(&mut sim, s);
                match sim.session(s).cells.first() {
                    Some(c) => sim.push(at + c.gap_s, Ev::Edit(s)),
                    None => sim.push(at, Ev::Close(s)),
                }
            }
            Ev::Edit(s) => {
                policy.edit(&mut sim, s);
                let edit = sim.cell(s).edit_s;
                sim.push(at + edit, Ev::Run(s));
            }
            Ev::Run(s) => {
                sim.progress[s].run_at = at;
                policy.run(&mut sim, s);
            }
            Ev::Start(s) => {
                if sim.progress[s].started {
                    continue; // a policy started it twice: the first counts
                }
                sim.progress[s].started = true;
                let cell = sim.cell(s);
                let p = &sim.progress[s];
                let delay_ms = (at - p.run_at.max(p.prev_end)).max(0.0) * 1000.0;
                sim.metrics.cells_run += 1;
                if cell.gpu {
                    sim.metrics.start_delays_ms.push(delay_ms);
                    sim.metrics.busy_gpu_seconds += cell.run_s * cell.gpus as f64;
                    sim.metrics.busy_now += cell.gpus;
                }
                if sim.metrics.keep_cells {
                    sim.metrics.cells.push(Replayed {
                        session: sim.session(s).name.clone(),
                        cell_id: cell.cell_id.clone(),
                        device: if cell.gpu { "gpu" } else { "cpu" }.into(),
                        closure: cell.closure.clone(),
                        start_delay_ms: delay_ms,
                    });
                }
                sim.push(at + cell.run_s, Ev::Finished(s));
            }
            Ev::Finished(s) => {
                let cell = sim.cell(s);
                if cell.gpu {
                    sim.metrics.busy_now -= cell.gpus;
                }
                policy.finished(&mut sim, s);
            }
            Ev::Close(s) => {
                if sim.progress[s].open {
                    sim.progress[s].open = false;
                    open -= 1;
                    policy.close(&mut sim, s);
                }
            }
            Ev::Policy(t) => policy.timer(&mut sim, t),
            Ev::Scale => {
                sim.scale_ticks += 1;
                policy.tick(&mut sim);
                if !policy.scale(&mut sim) {
                    autoscale(policy, &mut sim);
                }
                sim.push(at + interval, Ev::Scale);
            }
            Ev::OpDone => {
                sim.cluster.op_done();
                policy.capacity_changed(&mut sim);
            }
            Ev::Sample => {
                let gpus = (sim.cluster.provisioned() * sim.cluster.autoscaler.gpus_per_host) as f64;
                let row = [at, gpus, sim.cluster.held_now() as f64, sim.metrics.busy_now as f64];
                sim.metrics.occupancy.push(row);
                sim.push(at + 60.0, Ev::Sample);
            }
        }
    }
    // what is still held counts until the end
    for h in 0..sim.cluster.hosts.len() {
        let held: Vec<u32> = sim.cluster.hosts[h]
            .slots
            .status(|_, _| false)
            .iter()
            .filter(|s| s.held_for.is_some())
            .map(|s| s.index)
            .collect();
        sim.cluster.release(h, &held);
    }
    let gpus_per_host = sim.cluster.autoscaler.gpus_per_host as f64;
    let mut delays = std::mem::take(&mut sim.metrics.start_delays_ms);
    delays.sort_by(f64::total_cmp);
    let within = delays.iter().filter(|d| **d <= 1000.0).count();
    let mut overheads = std::mem::take(&mut sim.metrics.completion_overheads_ms);
    overheads.sort_by(f64::total_cmp);
    Outcome {
        policy: policy.name(),
        gpu_hours: sim.cluster.host_seconds() * gpus_per_host / 3600.0,
        held_gpu_hours: sim.cluster.released_slot_seconds / 3600.0,
        busy_gpu_hours: sim.metrics.busy_gpu_seconds / 3600.0,
        gpu_cells: delays.len(),
        cells: sim.metrics.cells_run,
        within_1s: if delays.is_empty() { 1.0 } else { within as f64 / delays.len() as f64 },
        p50_start_ms: quantile(&delays, 0.5),
        p99_start_ms: quantile(&delays, 0.99),
        max_start_ms: delays.last().copied().unwrap_or(0.0),
        p50_completion_overhead_ms: quantile(&overheads, 0.5),
        p99_completion_overhead_ms: quantile(&overheads, 0.99),
        end_s: sim.now(),
        wall_s: wall.elapsed().as_secs_f64(),
        counters: policy.counters(),
        start_delays_ms: delays,
        occupancy: std::mem::take(&mut sim.metrics.occupancy),
        replayed: std::mem::take(&mut sim.metrics.cells),
    }
}

/// NotebookOS's autoscaler check (notebookos-policies.md, "Autoscaling"): once it
/// has its ratio samples, scale out to the target in one operation, or release
/// fully idle hosts down to the limit, at most `scale_in_per_op` at a time.
fn autoscale(policy: &mut dyn Policy, sim: &mut Sim) {
    let a = &sim.cluster.autoscaler;
    if a.fixed || sim.scale_ticks < a.samples_before_first || sim.cluster.op_until.is_some() {
        return;
    }
    let load = sim.cluster.load();
    let hosts = sim.cluster.on_or_booting();
    let target = a.scale_out_target(load);
    if hosts < target {
        sim.request_hosts(target - hosts);
        return;
    }
    let limit = a.scale_in_limit(load);
    if hosts <= limit {
        return;
    }
    let n = (hosts - limit).min(a.scale_in_per_op) as usize;
    let idle: Vec<usize> = (0..sim.cluster.hosts.len())
        .rev()
        .filter(|&h| {
            let host = &sim.cluster.hosts[h];
            host.power == Power::On && host.held() == 0 && policy.releasable(sim, h)
        })
        .take(n)
        .collect();
    sim.release_hosts(&idle);
}
