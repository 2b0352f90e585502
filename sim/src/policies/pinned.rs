//! `pinned`: a session holds its GPUs from open to close, as a notebook server
//! with a GPU kernel does. With an idle timeout (hosted notebooks: 30, 60, 180
//! minutes), a session idle that long loses them; on its next cell it gets GPUs
//! again and replays its earlier cells first (NotebookOS's idle reclamation), and
//! that replay counts as start delay.

use std::collections::{BTreeMap, VecDeque};

use looseleaf_gpu_host::host::slots::SlotState;

use super::{session_gpus, take};
use crate::engine::{Policy, Sim, Timer};

const IDLE: u32 = 1;

/// Session-pinned GPUs.
pub struct Pinned {
    timeout_s: Option<f64>,
    hold: Vec<Option<(usize, Vec<u32>)>>,
    reclaimed: Vec<bool>,
    run_waiting: Vec<bool>,
    epoch: Vec<u64>,
    queue: VecDeque<usize>,
    reclaims: f64,
    replays: f64,
}

impl Pinned {
    /// Pinned for the session's life, or until `timeout_s` idle.
    pub fn new(timeout_s: Option<f64>) -> Self {
        Self {
            timeout_s,
            hold: vec![],
            reclaimed: vec![],
            run_waiting: vec![],
            epoch: vec![],
            queue: VecDeque::new(),
            reclaims: 0.0,
            replays: 0.0,
        }
    }

    fn ensure(&mut self, n: usize) {
        if self.hold.len() < n {
            self.hold.resize(n, None);
            self.reclaimed.resize(n, false);
            self.run_waiting.resize(n, false);
            self.epoch.resize(n, 0);
        }
    }

    /// Give session `s` its GPUs if a host has room; start its waiting cell.
    fn acquire(&mut self, sim: &mut Sim, s: usize) -> bool {
        let gpus = session_gpus(sim, s);
        let Some(host) = sim.host_with_room(gpus) else { return false };
        let worker = format!("kernel-{s}");
        let session = sim.session(s).id;
        let Some(slots) = take(sim, host, gpus, SlotState::Pinned { worker, session }) else { return false };
        self.hold[s] = Some((host, slots));
        if std::mem::take(&mut self.run_waiting[s]) {
            self.start(sim, s);
        }
        true
    }

    fn start(&mut self, sim: &mut Sim, s: usize) {
        let now = sim.now();
        if std::mem::take(&mut self.reclaimed[s]) {
            // a fresh kernel: start it, then run every earlier cell again
            self.replays += 1.0;
            let replay: f64 = sim.earlier_cells(s).iter().map(|c| c.run_s).sum();
            let boot = sim.draw.sample(&sim.costs.naive_start_ms) / 1000.0;
            sim.start(s, now + boot + replay);
        } else {
            sim.start(s, now);
        }
    }

    fn serve(&mut self, sim: &mut Sim) {
        while let Some(&s) = self.queue.front() {
            if !sim.progress[s].open && !self.run_waiting[s] {
                self.queue.pop_front();
                continue;
            }
            if !self.acquire(sim, s) {
                sim.request_hosts(1);
                return;
            }
            self.queue.pop_front();
        }
    }

    fn wait(&mut self, sim: &mut Sim, s: usize) {
        if !self.queue.contains(&s) {
            self.queue.push_back(s);
        }
        self.serve(sim);
    }

    fn release(&mut self, sim: &mut Sim, s: usize) {
        if let Some((host, slots)) = self.hold[s].take() {
            sim.cluster.release(host, &slots);
            self.serve(sim);
        }
    }
}

impl Policy for Pinned {
    fn name(&self) -> String {
        match self.timeout_s {
            None => "pinned".into(),
            Some(t) => format!("pinned_{}", (t / 60.0).round()),
        }
    }

    fn open(&mut self, sim: &mut Sim, s: usize) {
        self.ensure(sim.workload.sessions.len());
        self.wait(sim, s);
    }

    fn run(&mut self, sim: &mut Sim, s: usize) {
        self.epoch[s] += 1;
        if self.hold[s].is_some() {
            self.start(sim, s);
        } else {
            self.run_waiting[s] = true;
            self.wait(sim, s);
        }
    }

    fn finished(&mut self, sim: &mut Sim, s: usize) {
        let now = sim.now();
        sim.done(s, now);
        self.epoch[s] += 1;
        if let Some(t) = self.timeout_s {
            sim.timer(now + t, Timer { session: s, kind: IDLE, tag: self.epoch[s] });
        }
    }

    fn timer(&mut self, sim: &mut Sim, t: Timer) {
        let s = t.session;
        if t.kind == IDLE && self.epoch[s] == t.tag && self.hold[s].is_some() && sim.progress[s].open {
            self.reclaims += 1.0;
            self.reclaimed[s] = true;
            self.release(sim, s);
        }
    }

    fn close(&mut self, sim: &mut Sim, s: usize) {
        self.queue.retain(|q| *q != s);
        self.release(sim, s);
    }

    fn capacity_changed(&mut self, sim: &mut Sim) {
        self.serve(sim);
    }

    fn counters(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([("reclaims".into(), self.reclaims), ("replays".into(), self.replays)])
    }
}
