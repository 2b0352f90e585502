//! `looseleaf`: the planner's speculator decides, within its budget, which edited
//! GPU cells get a worker before Run (and which prepared workers to evict); hosts
//! claim work by the gpu-host's claim-delay rule; slots are the gpu-host's
//! [`Slots`](looseleaf_gpu_host::host::slots::Slots); workers move through the
//! gpu-host's lifecycle table. All of it is the services' own code: this file
//! only feeds it events on the simulation's clock and charges the measured
//! costs. The GPU is released after every cell's save.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use looseleaf_gpu_host::host::placement::{claim_delay, Standing, MAX_JITTER};
use looseleaf_gpu_host::host::prepared::give_up_first;
use looseleaf_gpu_host::host::slots::SlotState;
use looseleaf_gpu_host::host::SPEC_WAIT;
use looseleaf_gpu_host::lifecycle::Lifecycle;
use looseleaf_planner::speculator::{Budget, Eviction, Ready, Speculator};
use schemas::clock::Clock;
use schemas::messages::{PreparedClass, PreparedWorker, WorkerState};
use uuid::Uuid;

use super::{busy, secs, take};
use crate::engine::{Policy, Sim, Timer};

const PLAN: u32 = 1;
const READY: u32 = 2;
const SAVED: u32 = 3;

/// The planner's edit debounce before a recipe is planned.
const DEBOUNCE_S: f64 = 0.1;

/// A worker prepared (or being prepared) for a session's cell.
#[derive(Clone, Debug)]
struct Prep {
    cell: usize,
    host: usize,
    slots: Vec<u32>,
    worker: String,
    n: u64,
    ready_at: Option<f64>,
    prepare_s: f64,
    run_pressed: bool,
}

/// A worker running or saving a cell.
#[derive(Clone, Debug)]
struct Running {
    host: usize,
    slots: Vec<u32>,
    worker: String,
}

/// LooseLeaf.
pub struct LooseLeaf {
    speculator: Speculator,
    lifecycle: Lifecycle,
    budget: Budget,
    prep: Vec<Option<Prep>>,
    running: Vec<Option<Running>>,
    pressed: Vec<bool>,
    waiting: VecDeque<usize>,
    /// Admitted preparations waiting for a slot: (since, session, cell).
    spec_waiting: VecDeque<(f64, usize, usize)>,
    /// The host whose chunk cache holds the session's latest state.
    cached_on: Vec<Option<usize>>,
    by_id: HashMap<Uuid, usize>,
    workers: u64,
    counters: BTreeMap<&'static str, f64>,
}

impl LooseLeaf {
    /// LooseLeaf with the speculation `budget`.
    pub fn new(budget: Budget) -> Self {
        Self {
            speculator: Speculator::new(budget),
            lifecycle: Lifecycle::default(),
            budget,
            prep: vec![],
            running: vec![],
            pressed: vec![],
            waiting: VecDeque::new(),
            spec_waiting: VecDeque::new(),
            cached_on: vec![],
            by_id: HashMap::new(),
            workers: 0,
            counters: BTreeMap::new(),
        }
    }

    fn count(&mut self, what: &'static str) {
        *self.counters.entry(what).or_default() += 1.0;
    }

    /// A lifecycle step; an illegal one is counted (it would be a host bug).
    fn enter(&mut self, worker: &str, to: WorkerState) {
        if self.lifecycle.enter(worker, to).is_err() {
            self.count("lifecycle_violations");
        }
    }

    fn born(&mut self, sim: &Sim, s: usize) -> (String, u64) {
        self.workers += 1;
        let worker = format!("w{}", self.workers);
        self.lifecycle.born(&worker, 0, sim.session(s).id);
        (worker, self.workers)
    }

    /// The host that wins the claim for session `s`'s current cell: each host
    /// with room waits its claim delay (the gpu-host's rule); the shortest wins.
    fn claim(&self, sim: &mut Sim, s: usize) -> Option<(usize, f64)> {
        let cell = sim.cell(s);
        let with_room: Vec<usize> = (0..sim.cluster.hosts.len())
            .filter(|h| sim.cluster.hosts[*h].is_on() && sim.cluster.hosts[*h].slots.free_count() >= cell.gpus)
            .collect();
        let mut best: Option<(usize, f64)> = None;
        for &h in &with_room {
            let standing = Standing {
                free_share: sim.cluster.hosts[h].slots.free_share(),
                // every host runs the same zygotes; a cell with an import tail
                // matches half of its import closure
                zygote: if cell.import_tail { 0.5 } else { 1.0 },
                cached: if self.cached_on[s] == Some(h) { 1.0 } else { 0.0 },
                competitor_has_room: with_room.len() > 1,
            };
            let jitter = Duration::from_secs_f64(sim.draw.unit() * MAX_JITTER.as_secs_f64());
            let (delay, _) = claim_delay(standing, jitter);
            let d = delay.as_secs_f64();
            if best.is_none_or(|(_, b)| d < b) {
                best = Some((h, d));
            }
        }
        best
    }

    /// Fork from a zygote, import the tail, restore the closure, put it on the GPU
    /// (a recorded cell: what preparing it took when it was recorded).
    fn prepare_s(&self, sim: &mut Sim, s: usize) -> f64 {
        let c = sim.costs;
        let cell = sim.cell(s);
        if let Some(t) = cell.prepare_s {
            return t + c.cuda_init_s + secs(cell.closure_bytes, c.host_to_gpu_bytes_per_s);
        }
        let mut t = sim.draw.sample(&c.cold_start_ms) / 1000.0 + c.cuda_init_s;
        if cell.import_tail {
            t += sim.draw.sample(&c.import_tail_ms) / 1000.0;
        }
        t + secs(cell.closure_bytes, c.restore_bytes_per_s) + secs(cell.closure_bytes, c.host_to_gpu_bytes_per_s)
    }

    fn hit_s(&self, sim: &mut Sim) -> f64 {
        sim.draw.sample(&sim.costs.hit_start_ms) / 1000.0
    }

    /// The speculator evicts a prepared worker: its host stops it.
    fn evict(&mut self, sim: &mut Sim, e: Eviction) {
        let Some(&s) = self.by_id.get(&e.session) else { return };
        let Some(p) = self.prep[s].take_if(|p| p.worker == e.at.worker) else { return };
        self.count("evicted");
        let idle_ms = p.ready_at.map_or(0.0, |r| (sim.now() - r) * 1000.0);
        self.speculator.ended(e.session, &e.cell_id, &p.worker, idle_ms, true, sim.now());
        self.enter(&p.worker, WorkerState::Evicted);
        sim.cluster.release(p.host, &p.slots);
        self.serve(sim);
    }

    /// Plan session `s`'s edited GPU cell and prepare it if the speculator admits it.
    fn plan(&mut self, sim: &mut Sim, s: usize) {
        let now = sim.now();
        let id = sim.session(s).id;
        let cell_id = sim.cell(s).cell_id.clone();
        let admission = self.speculator.admit(id, &cell_id, now);
        for e in admission.evict {
            self.evict(sim, e);
        }
        if !admission.admit {
            self.count(match admission.refused {
                Some(r) if r.contains("idle") => "refused_idle_budget",
                _ => "refused_prepared_budget",
            });
            return;
        }
        if self.prep[s].as_ref().is_some_and(|p| p.cell == sim.progress[s].cell) {
            return; // its host updates it in place
        }
        if !self.prepare(sim, s) {
            // the host keeps the admitted recipe a while for a slot to free
            self.count("waited_for_room_to_prepare");
            self.spec_waiting.retain(|(_, q, _)| *q != s);
            self.spec_waiting.push_back((now, s, sim.progress[s].cell));
        }
    }

    /// Prepare session `s`'s current cell on the host that wins its claim; false
    /// if no host has room.
    fn prepare(&mut self, sim: &mut Sim, s: usize) -> bool {
        let now = sim.now();
        let id = sim.session(s).id;
        let cell_id = sim.cell(s).cell_id.clone();
        let Some((host, delay)) = self.claim(sim, s) else { return false };
        let session = id;
        let gpus = sim.cell(s).gpus;
        let Some(slots) = take(sim, host, gpus, SlotState::Prepared { session, cell_id }) else { return false };
        let (worker, n) = self.born(sim, s);
        let prepare_s = self.prepare_s(sim, s);
        self.prep[s] = Some(Prep {
            cell: sim.progress[s].cell,
            host,
            slots,
            worker,
            n,
            ready_at: None,
            prepare_s,
            run_pressed: false,
        });
        self.count("prepared");
        sim.timer(now + delay + prepare_s, Timer { session: s, kind: READY, tag: n });
        true
    }

    fn ready(&mut self, sim: &mut Sim, s: usize, n: u64) {
        let Some(p) = self.prep[s].as_mut().filter(|p| p.n == n) else { return };
        let now = sim.now();
        p.ready_at = Some(now);
        let (worker, host, run_pressed, prepare_ms) = (p.worker.clone(), p.host, p.run_pressed, p.prepare_s * 1000.0);
        self.enter(&worker, WorkerState::Ready);
        let id = sim.session(s).id;
        let cell_id = sim.cell(s).cell_id.clone();
        let at = PreparedWorker { host: sim.cluster.hosts[host].name.clone(), worker };
        if run_pressed {
            // Run came while it prepared: it runs at once
            self.count("hits_while_preparing");
            self.start_prepared(sim, s, "over_1s_run_while_preparing");
        } else {
            let ready = Ready { class: PreparedClass::Speculative, prepare_ms, holds_slot: true };
            self.speculator.ready(id, &cell_id, at, ready, now);
        }
    }

    /// Start the cell at `at`; a start over 1 s after Run is counted under `late`,
    /// so the results say why cells were slow.
    fn start(&mut self, sim: &mut Sim, s: usize, at: f64, late: &'static str) {
        if at - sim.progress[s].run_at > 1.0 {
            self.count(late);
        }
        sim.start(s, at);
    }

    /// Run on the prepared worker.
    fn start_prepared(&mut self, sim: &mut Sim, s: usize, late: &'static str) {
        let Some(p) = self.prep[s].take() else { return };
        let now = sim.now();
        let idle_ms = p.ready_at.map_or(0.0, |r| (now - r) * 1000.0);
        let id = sim.session(s).id;
        let cell_id = sim.cell(s).cell_id.clone();
        self.speculator.ended(id, &cell_id, &p.worker, idle_ms, true, now);
        // the run refreshes the closure (nothing changed), then runs
        self.enter(&p.worker, WorkerState::Preparing);
        self.enter(&p.worker, WorkerState::Running);
        let state = busy(sim, s);
        sim.cluster.hosts[p.host].slots.hand_on(&p.slots, state);
        let hit = self.hit_s(sim);
        self.start(sim, s, now + hit, late);
        self.running[s] = Some(Running { host: p.host, slots: p.slots, worker: p.worker });
    }

    /// Free slots on a host for a run by stopping idle prepared workers there, as
    /// a gpu-host does when the run's claim finds too few free (the host's own
    /// `give_up_first` order). Whether any host could.
    fn evict_for_run(&mut self, sim: &mut Sim, gpus: u32) -> bool {
        let base = sim.clock.now() - std::time::Duration::from_secs_f64(sim.now());
        let idle_on = |me: &Self, h: usize| -> Vec<usize> {
            (0..me.prep.len())
                .filter(|q| me.prep[*q].as_ref().is_some_and(|p| p.host == h && p.ready_at.is_some()))
                .collect()
        };
        let Some(host) = (0..sim.cluster.hosts.len()).find(|&h| {
            let free = sim.cluster.hosts[h].slots.free_count();
            let idle: usize =
                idle_on(self, h).iter().filter_map(|q| self.prep[*q].as_ref()).map(|p| p.slots.len()).sum();
            sim.cluster.hosts[h].is_on() && free + idle as u32 >= gpus
        }) else {
            return false;
        };
        while sim.cluster.hosts[host].slots.free_count() < gpus {
            let idle = idle_on(self, host).into_iter().filter_map(|q| {
                let p = self.prep[q].as_ref()?;
                let ready = base + std::time::Duration::from_secs_f64(p.ready_at?);
                Some((q, PreparedClass::Speculative, Some(ready)))
            });
            let Some(q) = give_up_first(idle) else { return false };
            let Some(p) = self.prep[q].take() else { return false };
            self.count("evicted_for_run");
            let id = sim.session(q).id;
            let cell_id = sim.session(q).cells[p.cell].cell_id.clone();
            let idle_ms = p.ready_at.map_or(0.0, |r| (sim.now() - r) * 1000.0);
            self.speculator.ended(id, &cell_id, &p.worker, idle_ms, true, sim.now());
            self.enter(&p.worker, WorkerState::Evicted);
            sim.cluster.release(p.host, &p.slots);
        }
        true
    }

    /// A run with no prepared worker: claimed and prepared cold, or it waits for a slot.
    fn start_cold(&mut self, sim: &mut Sim, s: usize) -> bool {
        if sim.host_with_room(sim.cell(s).gpus).is_none() && !self.evict_for_run(sim, sim.cell(s).gpus) {
            return false;
        }
        let Some((host, delay)) = self.claim(sim, s) else { return false };
        let state = busy(sim, s);
        let Some(slots) = take(sim, host, sim.cell(s).gpus, state) else { return false };
        let (worker, _) = self.born(sim, s);
        self.enter(&worker, WorkerState::Running);
        let prepare = self.prepare_s(sim, s);
        let now = sim.now();
        let late = if sim.progress[s].run_at < now { "over_1s_waited_for_a_slot" } else { "over_1s_cold" };
        self.start(sim, s, now + delay + prepare, late);
        self.running[s] = Some(Running { host, slots, worker });
        true
    }

    fn serve(&mut self, sim: &mut Sim) {
        while let Some(&s) = self.waiting.front() {
            if !sim.progress[s].open || sim.progress[s].started {
                self.waiting.pop_front();
                continue;
            }
            if !self.start_cold(sim, s) {
                sim.request_hosts(1);
                return;
            }
            self.waiting.pop_front();
        }
        // then preparations that waited for a slot; older ones are stale
        let now = sim.now();
        let prep = &self.prep;
        self.spec_waiting.retain(|(at, s, cell)| {
            let current = sim.progress[*s].cell == *cell && !sim.progress[*s].started && sim.progress[*s].open;
            now - at < SPEC_WAIT.as_secs_f64() && current && prep[*s].as_ref().is_none_or(|p| p.cell != *cell)
        });
        while let Some(&(_, s, _)) = self.spec_waiting.front() {
            if sim.host_with_room(sim.cell(s).gpus).is_none() || !self.prepare(sim, s) {
                return;
            }
            self.spec_waiting.pop_front();
        }
    }
}

impl Policy for LooseLeaf {
    fn name(&self) -> String {
        "looseleaf".into()
    }

    fn open(&mut self, sim: &mut Sim, s: usize) {
        let n = sim.workload.sessions.len();
        if self.prep.len() < n {
            self.prep.resize(n, None);
            self.running.resize(n, None);
            self.pressed.resize(n, false);
            self.cached_on.resize(n, None);
        }
        self.by_id.insert(sim.session(s).id, s);
    }

    fn edit(&mut self, sim: &mut Sim, s: usize) {
        self.pressed[s] = false;
        if sim.cell(s).gpu {
            let at = sim.now() + DEBOUNCE_S;
            sim.timer(at, Timer { session: s, kind: PLAN, tag: sim.progress[s].cell as u64 });
        }
    }

    fn run(&mut self, sim: &mut Sim, s: usize) {
        self.pressed[s] = true;
        let now = sim.now();
        if !sim.cell(s).gpu {
            // the session's CPU worker, no GPU
            sim.start(s, now);
            return;
        }
        let id = sim.session(s).id;
        let cell_id = sim.cell(s).cell_id.clone();
        // the planner asks for the cell's prepared worker (and its admission, if
        // still in flight, stops holding budget)
        let _ = self.speculator.for_run(id, &cell_id);
        let cell = sim.progress[s].cell;
        match self.prep[s].as_mut().filter(|p| p.cell == cell) {
            Some(p) if p.ready_at.is_some() => {
                self.count("hits");
                self.start_prepared(sim, s, "over_1s_hit");
            }
            Some(p) => p.run_pressed = true,
            None => {
                self.count("cold");
                if !self.start_cold(sim, s) {
                    self.count("waited_for_a_slot");
                    self.waiting.push_back(s);
                    sim.request_hosts(1);
                }
            }
        }
    }

    fn finished(&mut self, sim: &mut Sim, s: usize) {
        let now = sim.now();
        let Some(r) = self.running[s].as_ref() else {
            sim.done(s, now);
            return;
        };
        let worker = r.worker.clone();
        self.enter(&worker, WorkerState::Saving);
        let cell = sim.cell(s);
        let save = cell.save_s.unwrap_or_else(|| secs(cell.saved_bytes, sim.costs.save_bytes_per_s));
        sim.timer(now + save, Timer { session: s, kind: SAVED, tag: 0 });
        sim.done(s, now + save);
    }

    fn timer(&mut self, sim: &mut Sim, t: Timer) {
        let s = t.session;
        match t.kind {
            PLAN if sim.progress[s].cell as u64 == t.tag && !self.pressed[s] && sim.progress[s].open => {
                self.plan(sim, s)
            }
            READY => self.ready(sim, s, t.tag),
            SAVED => {
                if let Some(r) = self.running[s].take() {
                    // the slot is free; no warm worker is kept with it
                    self.enter(&r.worker, WorkerState::Warm);
                    self.enter(&r.worker, WorkerState::Evicted);
                    sim.cluster.release(r.host, &r.slots);
                    self.cached_on[s] = Some(r.host);
                    self.serve(sim);
                }
            }
            _ => {}
        }
    }

    fn close(&mut self, sim: &mut Sim, s: usize) {
        let id = sim.session(s).id;
        if let Some(p) = self.prep[s].take() {
            self.enter(&p.worker, WorkerState::Evicted);
            sim.cluster.release(p.host, &p.slots);
        }
        self.speculator.close(id);
        self.serve(sim);
    }

    fn capacity_changed(&mut self, sim: &mut Sim) {
        self.serve(sim);
    }

    fn tick(&mut self, sim: &mut Sim) {
        let now = sim.now();
        for h in 0..sim.cluster.hosts.len() {
            if sim.cluster.hosts[h].is_on() {
                let name = sim.cluster.hosts[h].name.clone();
                self.speculator.host_seen(&name, now);
            }
        }
        for e in self.speculator.over_budget(now) {
            self.evict(sim, e);
        }
    }

    fn counters(&self) -> BTreeMap<String, f64> {
        let mut c: BTreeMap<String, f64> = self.counters.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        c.insert("prepared_per_host".into(), self.budget.prepared_per_host as f64);
        c.insert("idle_seconds_per_session".into(), self.budget.idle_seconds_per_session);
        c
    }
}
