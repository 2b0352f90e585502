//! Serverless containers that take a GPU on demand:
//! - `naive`: a GPU per GPU cell, released after it; every GPU cell starts a fresh
//!   interpreter, imports everything and restores the whole session, and saves the
//!   whole session after (cold start measured by `bench/cold-start`'s naive
//!   baseline, state moved at the measured checkpoint rates).
//! - `modal`: a container (with its GPU) per session, kept warm 10 minutes after
//!   its last cell; after that the next cell first recomputes the session's
//!   earlier cells.
//! - `snapshot`: the same, restoring a whole-process GPU snapshot instead (the
//!   cited GCR or CRIU median restore time).

use std::collections::{BTreeMap, VecDeque};

use super::{busy, secs, session_gpus, take};
use crate::engine::{Policy, Sim, Timer};

const IDLE: u32 = 1;
const SAVED: u32 = 2;

/// What a snapshot restore costs.
#[derive(Clone, Copy, Debug)]
pub enum Snapshot {
    /// The GCR median.
    Gcr,
    /// The CRIU median.
    Criu,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Naive,
    Modal,
    Snapshot(Snapshot),
}

/// On-demand GPU containers.
pub struct Containers {
    kind: Kind,
    keep_warm_s: f64,
    hold: Vec<Option<(usize, Vec<u32>)>>,
    started_once: Vec<bool>,
    run_waiting: Vec<bool>,
    epoch: Vec<u64>,
    queue: VecDeque<usize>,
    warm_starts: f64,
    recoveries: f64,
}

impl Containers {
    fn new(kind: Kind, keep_warm_s: f64) -> Self {
        Self {
            kind,
            keep_warm_s,
            hold: vec![],
            started_once: vec![],
            run_waiting: vec![],
            epoch: vec![],
            queue: VecDeque::new(),
            warm_starts: 0.0,
            recoveries: 0.0,
        }
    }

    /// Naive serverless.
    pub fn naive() -> Self {
        Self::new(Kind::Naive, 0.0)
    }

    /// Modal-style: warm 10 minutes, then recompute.
    pub fn modal() -> Self {
        Self::new(Kind::Modal, 600.0)
    }

    /// Modal-style with a snapshot restore instead of recomputing.
    pub fn snapshot(how: Snapshot) -> Self {
        Self::new(Kind::Snapshot(how), 600.0)
    }

    fn ensure(&mut self, n: usize) {
        if self.hold.len() < n {
            self.hold.resize(n, None);
            self.started_once.resize(n, false);
            self.run_waiting.resize(n, false);
            self.epoch.resize(n, 0);
        }
    }

    /// Whether the cell needs a GPU container (naive: GPU cells only; the others
    /// run every cell of the session in its container).
    fn needs_gpu(&self, sim: &Sim, s: usize) -> bool {
        matches!(self.kind, Kind::Modal | Kind::Snapshot(_)) || sim.cell(s).gpu
    }

    /// What starting a cold container costs before the cell's first line.
    fn cold_start_s(&mut self, sim: &mut Sim, s: usize) -> f64 {
        let c = sim.costs;
        let boot = sim.draw.sample(&c.naive_start_ms) / 1000.0 + c.cuda_init_s;
        let cell = sim.cell(s);
        match self.kind {
            Kind::Naive => {
                boot + secs(cell.state_bytes, c.restore_bytes_per_s) + secs(cell.state_bytes, c.host_to_gpu_bytes_per_s)
            }
            _ if !std::mem::replace(&mut self.started_once[s], true) => boot,
            Kind::Modal => {
                self.recoveries += 1.0;
                boot + sim.earlier_cells(s).iter().map(|c| c.run_s).sum::<f64>()
            }
            Kind::Snapshot(how) => {
                self.recoveries += 1.0;
                match how {
                    Snapshot::Gcr => c.snapshot_gcr_s,
                    Snapshot::Criu => c.snapshot_criu_s,
                }
            }
        }
    }

    fn acquire(&mut self, sim: &mut Sim, s: usize) -> bool {
        let gpus = if matches!(self.kind, Kind::Naive) { sim.cell(s).gpus.max(1) } else { session_gpus(sim, s) };
        let Some(host) = sim.host_with_room(gpus) else { return false };
        let state = busy(sim, s);
        let Some(slots) = take(sim, host, gpus, state) else { return false };
        self.hold[s] = Some((host, slots));
        let cold = self.cold_start_s(sim, s);
        let now = sim.now();
        sim.start(s, now + cold);
        true
    }

    fn serve(&mut self, sim: &mut Sim) {
        while let Some(&s) = self.queue.front() {
            if !self.run_waiting[s] {
                self.queue.pop_front();
                continue;
            }
            if !self.acquire(sim, s) {
                sim.request_hosts(1);
                return;
            }
            self.run_waiting[s] = false;
            self.queue.pop_front();
        }
    }

    fn release(&mut self, sim: &mut Sim, s: usize) {
        if let Some((host, slots)) = self.hold[s].take() {
            sim.cluster.release(host, &slots);
            self.serve(sim);
        }
    }
}

impl Policy for Containers {
    fn name(&self) -> String {
        match self.kind {
            Kind::Naive => "naive".into(),
            Kind::Modal => "modal".into(),
            Kind::Snapshot(Snapshot::Gcr) => "snapshot".into(),
            Kind::Snapshot(Snapshot::Criu) => "snapshot_criu".into(),
        }
    }

    fn open(&mut self, sim: &mut Sim, _s: usize) {
        self.ensure(sim.workload.sessions.len());
    }

    fn run(&mut self, sim: &mut Sim, s: usize) {
        self.epoch[s] += 1;
        let now = sim.now();
        if !self.needs_gpu(sim, s) {
            sim.start(s, now);
        } else if self.hold[s].is_some() {
            self.warm_starts += 1.0;
            sim.start(s, now);
        } else {
            self.run_waiting[s] = true;
            self.queue.push_back(s);
            self.serve(sim);
        }
    }

    fn finished(&mut self, sim: &mut Sim, s: usize) {
        let now = sim.now();
        self.epoch[s] += 1;
        match self.kind {
            Kind::Naive if self.hold[s].is_some() => {
                // the whole session is saved before the GPU is given back
                let save = secs(sim.cell(s).state_bytes, sim.costs.save_bytes_per_s);
                sim.timer(now + save, Timer { session: s, kind: SAVED, tag: self.epoch[s] });
                sim.done(s, now + save);
            }
            Kind::Naive => sim.done(s, now),
            _ => {
                sim.done(s, now);
                sim.timer(now + self.keep_warm_s, Timer { session: s, kind: IDLE, tag: self.epoch[s] });
            }
        }
    }

    fn timer(&mut self, sim: &mut Sim, t: Timer) {
        match t.kind {
            SAVED => self.release(sim, t.session),
            IDLE if self.epoch[t.session] == t.tag => self.release(sim, t.session),
            _ => {}
        }
    }

    fn close(&mut self, sim: &mut Sim, s: usize) {
        self.run_waiting[s] = false;
        self.release(sim, s);
    }

    fn capacity_changed(&mut self, sim: &mut Sim) {
        self.serve(sim);
    }

    fn counters(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([("warm_starts".into(), self.warm_starts), ("recoveries".into(), self.recoveries)])
    }
}
