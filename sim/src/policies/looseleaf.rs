//! `looseleaf`: the services' own decisions on the simulation's clock. The
//! planner's speculator decides, within its budget, which edited GPU cells get a
//! worker before Run (and which prepared workers to evict); each host is the
//! gpu-host's own [`HostCore`], fed the recipes, claim outcomes, preparations and
//! executions it would see, and its commands carried out here: a claim settles
//! in a simulated claims bucket after its delay (first come wins), a preparation
//! or a start takes the measured costs. Nothing here chooses a host, queues a
//! run or evicts a worker: the cores do. The GPU is released after every cell's
//! save.

use std::collections::{BTreeMap, HashMap, HashSet};

use looseleaf_gpu_host::core::{gpu_recipe, Command, HostCore, Input, Policy as HostPolicy, Target, WorkerRef};
use looseleaf_gpu_host::gpus::Gpu;
use looseleaf_gpu_host::host::claims::{Claim, ClaimKey};
use looseleaf_gpu_host::host::slots::SlotState;
use looseleaf_gpu_host::lifecycle::Lifecycle;
use looseleaf_planner::speculator::{Budget, Eviction, Ready, Speculator};
use schemas::messages::{EventKind, Prepare, PreparedOutcome, PreparedWorker, RecipeKind, RecipeV3, WorkerState};
use uuid::Uuid;

use super::looseleaf_scaling::Scaler;
use super::looseleaf_starts::{self as starts, World};
use super::secs;
use crate::cluster::SimClock;
use crate::engine::{Policy, Sim, Timer};

const PLAN: u32 = 1;
const SAVED: u32 = 3;
/// A host's claim settles (tag: the pending step).
const CLAIM: u32 = 4;
/// A host's preparation returns (tag: the pending step).
const PREPARED: u32 = 5;
/// A host's own timer fires (tag: the pending step).
const LATER: u32 = 6;

/// The planner's edit debounce before a recipe is planned.
const DEBOUNCE_S: f64 = 0.1;

/// A host's step under way, for the timer that ends it.
enum Step {
    Claim { host: usize, ticket: u64, key: ClaimKey },
    Prepared { host: usize, key: (Uuid, String), worker: WorkerRef, prepare_ms: f64 },
    Later { host: usize, input: Box<Input> },
}

/// A cell running on a host.
#[derive(Clone, Debug)]
pub(super) struct Running {
    pub(super) host: usize,
    exec: Uuid,
    worker: String,
}

/// LooseLeaf.
pub struct LooseLeaf {
    speculator: Speculator,
    lifecycle: Lifecycle,
    budget: Budget,
    /// One gpu-host core per host that is on.
    pub(super) cores: Vec<Option<HostCore<SimClock>>>,
    /// The claims bucket: key → the host that holds it.
    claims: HashMap<String, usize>,
    steps: HashMap<u64, Step>,
    next_step: u64,
    pub(super) running: Vec<Option<Running>>,
    pressed: Vec<bool>,
    /// Sessions whose GPU run was pressed and has not started.
    pub(super) unstarted: HashSet<usize>,
    /// Whether the run of each session found its worker ready at Run.
    ready_at_run: Vec<bool>,
    /// When each session's current cell began to be edited (simulated s).
    edited_at: Vec<f64>,
    /// The host whose chunk cache holds the session's latest state.
    cached_on: Vec<Option<usize>>,
    import_tail: Vec<bool>,
    by_id: HashMap<Uuid, usize>,
    workers: u64,
    /// Prepared workers that hold no slot (their state staged in host memory).
    staged: HashSet<String>,
    /// The edit-stream demand and the hosts cordoned on it.
    pub(super) scaler: Scaler,
    /// Whether hosts follow the edit-stream demand (`looseleaf_demand`) rather
    /// than NotebookOS's rule on the slots held.
    scale_on_demand: bool,
    counters: BTreeMap<&'static str, f64>,
}

impl LooseLeaf {
    /// LooseLeaf with the speculation `budget`.
    pub fn new(budget: Budget) -> Self {
        Self {
            speculator: Speculator::new(budget),
            lifecycle: Lifecycle::default(),
            budget,
            cores: vec![],
            claims: HashMap::new(),
            steps: HashMap::new(),
            next_step: 0,
            running: vec![],
            pressed: vec![],
            unstarted: HashSet::new(),
            ready_at_run: vec![],
            edited_at: vec![],
            cached_on: vec![],
            import_tail: vec![],
            by_id: HashMap::new(),
            workers: 0,
            staged: HashSet::new(),
            scaler: Scaler::default(),
            scale_on_demand: false,
            counters: BTreeMap::new(),
        }
    }

    /// LooseLeaf whose hosts follow the edit-stream demand (ADR 74).
    pub fn scaling_on_demand(budget: Budget) -> Self {
        Self { scale_on_demand: true, ..Self::new(budget) }
    }

    pub(super) fn count(&mut self, what: &'static str) {
        *self.counters.entry(what).or_default() += 1.0;
    }

    /// A lifecycle step; an illegal one is counted (it would be a host bug).
    fn enter(&mut self, worker: &str, to: WorkerState) {
        if self.lifecycle.enter(worker, to).is_err() {
            self.count("lifecycle_violations");
        }
    }

    fn born(&mut self, session: Uuid) -> WorkerRef {
        self.workers += 1;
        let id = format!("w{}", self.workers);
        self.lifecycle.born(&id, 0, session);
        WorkerRef { id, pid: 0 }
    }

    fn step(&mut self, step: Step) -> u64 {
        self.next_step += 1;
        self.steps.insert(self.next_step, step);
        self.next_step
    }

    /// Give every host that is on a core, and drop the cores of hosts that are off.
    fn sync_hosts(&mut self, sim: &Sim) -> Vec<usize> {
        let mut new = vec![];
        self.cores.resize_with(sim.cluster.hosts.len(), || None);
        for (h, host) in sim.cluster.hosts.iter().enumerate() {
            match (host.is_on(), self.cores[h].is_some()) {
                (true, false) => {
                    let gpus =
                        (0..host.slots.len()).map(|index| Gpu { index, name: "simulated".into(), memory_bytes: 0 });
                    // the gpu-host's defaults: a worker is kept only for unsavable
                    // state, and prepared on its slot only when its closure is on the GPU
                    let core =
                        HostCore::new(host.name.clone(), gpus.collect(), HostPolicy::default(), sim.clock.clone());
                    self.cores[h] = Some(core);
                    new.push(h);
                }
                (false, true) => self.cores[h] = None,
                _ => {}
            }
        }
        new
    }

    /// Feed `input` to host `h`'s core and carry out what it decides.
    pub(super) fn feed(&mut self, sim: &mut Sim, h: usize, input: Input) {
        let world = World { host: h, by_id: &self.by_id, cached_on: &self.cached_on, import_tail: &self.import_tail };
        let Some(core) = self.cores.get_mut(h).and_then(Option::as_mut) else { return };
        let commands = core.on(input, &world);
        self.mirror_slots(sim, h);
        for c in commands {
            self.carry_out(sim, h, c);
        }
    }

    /// The cluster's slots of host `h` follow its core's: what the autoscaler
    /// counts and GPU-hours integrate.
    fn mirror_slots(&mut self, sim: &mut Sim, h: usize) {
        let Some(core) = self.cores[h].as_ref() else { return };
        let states: Vec<(u32, SlotState)> = core.slots().states().map(|(i, s)| (i, s.clone())).collect();
        for (i, state) in states {
            let now = sim.cluster.hosts[h].slots.state(i).cloned();
            match (now, &state) {
                (Some(n), s) if n == *s => {}
                (Some(SlotState::Free), s) => sim.cluster.hosts[h].slots.take(&[i], s.clone()),
                (Some(_), SlotState::Free) => sim.cluster.release(h, &[i]),
                (_, s) => sim.cluster.hosts[h].slots.hand_on(&[i], s.clone()),
            }
        }
    }

    /// Deliver `recipe` to every host that is on, as the planner's publish does.
    fn deliver(&mut self, sim: &mut Sim, recipe: &RecipeV3) {
        self.share_status(sim);
        // the host named as holding the cell's prepared worker, as its status says
        let named = recipe.prepared.as_ref().and_then(|p| {
            let h = sim.cluster.hosts.iter().position(|x| x.name == p.host)?;
            let free_slots = self.cores.get(h)?.as_ref()?.slots().free_count() as usize;
            Some((h, p.host.clone(), free_slots))
        });
        if let Some((named, host, free_slots)) = named {
            let others: Vec<usize> = (0..self.cores.len()).filter(|&h| h != named && self.cores[h].is_some()).collect();
            for h in others {
                self.feed(sim, h, Input::PeerStatus { host: host.clone(), free_slots });
            }
        }
        for h in 0..self.cores.len() {
            if self.cores[h].is_some() {
                self.feed(sim, h, Input::Recipe(recipe.clone()));
            }
        }
    }

    fn carry_out(&mut self, sim: &mut Sim, h: usize, c: Command) {
        let now = sim.now();
        match c {
            Command::Claim { ticket, key, delay, .. } => {
                let tag = self.step(Step::Claim { host: h, ticket, key });
                sim.timer(now + delay.as_secs_f64(), Timer { session: h, kind: CLAIM, tag });
            }
            Command::Release { key } => {
                self.claims.remove(&key.key());
            }
            Command::Event { session, kind, .. } => self.on_event(sim, session, kind),
            Command::Prepare { key, worker, slots, .. } => {
                let Some(&s) = self.by_id.get(&key.0) else { return };
                let (worker, prepare_s) = match worker {
                    // updated in place: the refresh of what changed
                    Some(id) => {
                        self.enter(&id, WorkerState::Preparing);
                        (WorkerRef { id, pid: 0 }, starts::hit_s(sim))
                    }
                    // staged: the closure restored into host memory, no slot, no CUDA
                    None if slots.is_empty() => {
                        self.count("prepared");
                        let w = self.born(key.0);
                        self.staged.insert(w.id.clone());
                        // a recorded cell: ready when the real worker was, counted
                        // from the edit's start (a later preparation waits less)
                        let ready = sim.cell(s).ready_s.map(|r| (self.edited_at[s] + r - now).max(0.0));
                        (w, ready.unwrap_or_else(|| starts::restore_s(sim, s)))
                    }
                    // on its slots (a multi-GPU cell): put on the GPU as it is prepared
                    None => {
                        self.count("prepared");
                        (self.born(key.0), starts::prepare_s(sim, s))
                    }
                };
                let tag = self.step(Step::Prepared { host: h, key, worker, prepare_ms: prepare_s * 1000.0 });
                sim.timer(now + prepare_s, Timer { session: h, kind: PREPARED, tag });
            }
            Command::Execute { recipe, target, .. } => self.execute(sim, h, recipe, target),
            Command::Enter { worker, state } => self.enter(&worker, state),
            Command::After { delay, input } => {
                let tag = self.step(Step::Later { host: h, input });
                sim.timer(now + delay.as_secs_f64(), Timer { session: h, kind: LATER, tag });
            }
            // an evicted or superseded staged worker is not staged any more
            Command::StopWorker { worker } => {
                self.staged.remove(&worker);
            }
            // no process, no bus, no uid to act on in a simulation
            Command::Renew { .. }
            | Command::Bid(_)
            | Command::Interrupt { .. }
            | Command::KillCells { .. }
            | Command::ReleaseUid { .. }
            | Command::PublishStatus => {}
        }
    }

    /// A host's session event: what the planner's speculator learns from it.
    fn on_event(&mut self, sim: &mut Sim, session: Uuid, kind: EventKind) {
        let now = sim.now();
        match kind {
            EventKind::Preparing { host, cell_id, .. } => self.speculator.preparing(session, &cell_id, &host),
            EventKind::Ready { host, worker, cell_id, class, prepare_ms, slot, .. } => {
                let at = PreparedWorker { host, worker: worker.clone() };
                self.enter(&worker, WorkerState::Ready);
                let ready = Ready { class, prepare_ms, holds_slot: slot.is_some() };
                self.speculator.ready(session, &cell_id, at, ready, now);
            }
            EventKind::PreparedEnded { worker, cell_id, idle_ms, outcome, slot, .. } => {
                match outcome {
                    PreparedOutcome::Evicted => self.count("evicted"),
                    PreparedOutcome::EvictedForRun => self.count("evicted_for_run"),
                    _ => {}
                }
                self.speculator.ended(session, &cell_id, &worker, idle_ms, slot.is_some(), now);
            }
            _ => {}
        }
    }

    /// A core started a run: the cell starts after what its start costs.
    fn execute(&mut self, sim: &mut Sim, h: usize, recipe: RecipeV3, target: Target) {
        let now = sim.now();
        let s = (recipe.exec_id.as_u128() >> 32) as usize;
        self.unstarted.remove(&s);
        let (worker, at, late) = match target {
            Target::Existing { worker, prepare: Prepare::Speculative | Prepare::Warm, .. } => {
                self.enter(&worker, WorkerState::Preparing); // the run refreshes the closure
                let late = if self.ready_at_run[s] {
                    self.count("hits");
                    "over_1s_hit"
                } else {
                    self.count("hits_while_preparing");
                    "over_1s_run_while_preparing"
                };
                // prepared without a slot: its staged state goes to the device now
                let stage_in = if self.staged.remove(&worker) { starts::stage_in_s(sim, s) } else { 0.0 };
                (worker, now + starts::hit_s(sim) + stage_in, late)
            }
            Target::Existing { worker, .. } => (worker, now + starts::hit_s(sim), "over_1s_hit"),
            Target::Fresh { .. } => {
                self.count("cold");
                let w = self.born(recipe.session);
                let waited = now - sim.progress[s].run_at > 0.1;
                let late = if waited { "over_1s_waited_for_a_slot" } else { "over_1s_cold" };
                (w.id, now + starts::prepare_s(sim, s), late)
            }
        };
        self.enter(&worker, WorkerState::Running);
        if at - sim.progress[s].run_at > 1.0 {
            self.count(late);
        }
        sim.start(s, at);
        self.scaler.demand.running(recipe.exec_id, recipe.gpus, now);
        self.running[s] = Some(Running { host: h, exec: recipe.exec_id, worker });
    }

    /// The recipe of session `s`'s current cell.
    fn recipe(&self, sim: &Sim, s: usize, kind: RecipeKind) -> RecipeV3 {
        let cell = sim.cell(s);
        let exec_id = match kind {
            RecipeKind::Run => Uuid::from_u128(((s as u128) << 32) | sim.progress[s].cell as u128),
            _ => Uuid::nil(),
        };
        gpu_recipe(sim.session(s).id, &cell.cell_id, kind, exec_id, cell.gpus.max(1))
    }

    /// One of this policy's timers: a plan, a save, a claim settling, a
    /// preparation returning, or a host's own timer.
    fn on_timer(&mut self, sim: &mut Sim, t: Timer) {
        let s = t.session;
        match t.kind {
            PLAN if sim.progress[s].cell as u64 == t.tag && !self.pressed[s] && sim.progress[s].open => {
                self.plan(sim, s)
            }
            SAVED => {
                if let Some(r) = self.running[s].take() {
                    self.cached_on[s] = Some(r.host);
                    let worker = Some(WorkerRef { id: r.worker, pid: 0 });
                    let input = Input::Executed { exec_id: r.exec, worker, unsavable: vec![], cuda_used: true };
                    self.feed(sim, r.host, input);
                    self.scaler.demand.ended(r.exec, sim.now());
                    self.release_cordoned(sim);
                }
            }
            CLAIM => {
                let Some(Step::Claim { host, ticket, key }) = self.steps.remove(&t.tag) else { return };
                // the claims bucket: the first create wins
                let claim = match self.claims.get(&key.key()) {
                    None => {
                        self.claims.insert(key.key(), host);
                        Claim::Won
                    }
                    Some(&holder) if holder == host && matches!(key, ClaimKey::Cpu(_)) => Claim::Mine,
                    Some(_) => Claim::Lost,
                };
                self.feed(sim, host, Input::Claimed { ticket, claim });
            }
            PREPARED => {
                let Some(Step::Prepared { host, key, worker, prepare_ms }) = self.steps.remove(&t.tag) else { return };
                self.feed(sim, host, Input::Prepared { key, result: Ok((worker, prepare_ms)) });
            }
            LATER => {
                let Some(Step::Later { host, input }) = self.steps.remove(&t.tag) else { return };
                self.feed(sim, host, *input);
            }
            _ => {}
        }
    }

    /// The speculator evicts a prepared worker: its host stops it.
    fn evict(&mut self, sim: &mut Sim, e: Eviction) {
        let Some(h) = sim.cluster.hosts.iter().position(|x| x.name == e.at.host) else { return };
        self.feed(sim, h, Input::Evict { worker: e.at.worker });
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
        let mut recipe = self.recipe(sim, s, RecipeKind::Speculative);
        recipe.prepared =
            self.speculator.held_on(id, &cell_id).map(|host| PreparedWorker { host, worker: String::new() });
        self.deliver(sim, &recipe);
    }
}

impl Policy for LooseLeaf {
    fn name(&self) -> String {
        if self.scale_on_demand { "looseleaf_demand" } else { "looseleaf" }.into()
    }

    fn open(&mut self, sim: &mut Sim, s: usize) {
        let n = sim.workload.sessions.len();
        if self.running.len() < n {
            self.running.resize(n, None);
            self.pressed.resize(n, false);
            self.ready_at_run.resize(n, false);
            self.edited_at.resize(n, 0.0);
            self.cached_on.resize(n, None);
            self.import_tail.resize(n, false);
        }
        self.by_id.insert(sim.session(s).id, s);
        self.sync_hosts(sim);
    }

    fn edit(&mut self, sim: &mut Sim, s: usize) {
        self.pressed[s] = false;
        self.edited_at[s] = sim.now();
        self.import_tail[s] = sim.cell(s).import_tail;
        let (id, cell) = (sim.session(s).id, sim.cell(s));
        if cell.gpu {
            self.scaler.demand.typing(id, &cell.cell_id, cell.gpus, cell.closure_bytes, sim.now());
        } else {
            self.scaler.demand.not_typing(id, &cell.cell_id);
        }
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
        self.import_tail[s] = sim.cell(s).import_tail;
        let id = sim.session(s).id;
        let cell_id = sim.cell(s).cell_id.clone();
        // the planner asks for the cell's prepared worker (and its admission, if
        // still in flight, stops holding budget)
        let mut recipe = self.recipe(sim, s, RecipeKind::Run);
        self.scaler.demand.ran(id, &cell_id, recipe.exec_id, now);
        recipe.prepared = self.speculator.for_run(id, &cell_id);
        self.ready_at_run[s] = recipe.prepared.is_some();
        self.unstarted.insert(s);
        self.deliver(sim, &recipe);
        let claimed = self
            .steps
            .values()
            .any(|st| matches!(st, Step::Claim { key: ClaimKey::Run(e), .. } if *e == recipe.exec_id));
        if self.unstarted.contains(&s) && !claimed && recipe.prepared.is_none() {
            self.count("waited_for_a_slot");
            self.ask_for_room(sim);
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
        self.on_timer(sim, t);
        if !self.unstarted.is_empty() {
            self.ask_for_room(sim);
        }
    }

    fn close(&mut self, sim: &mut Sim, s: usize) {
        let id = sim.session(s).id;
        self.unstarted.remove(&s);
        for h in 0..self.cores.len() {
            if self.cores[h].is_some() {
                self.feed(sim, h, Input::SessionClosed { session: id });
            }
        }
        self.speculator.close(id);
        self.scaler.demand.closed(id);
    }

    fn capacity_changed(&mut self, sim: &mut Sim) {
        // hosts that came on hear the runs still waiting (the planner's
        // deliveries go to every host subscribed)
        let new = self.sync_hosts(sim);
        let mut waiting: Vec<usize> = self.unstarted.iter().copied().collect();
        waiting.sort_unstable();
        for h in new {
            for &s in &waiting {
                if sim.progress[s].open && !sim.progress[s].started {
                    let mut recipe = self.recipe(sim, s, RecipeKind::Run);
                    recipe.prepared = None;
                    self.feed(sim, h, Input::Recipe(recipe));
                }
            }
        }
    }

    fn tick(&mut self, sim: &mut Sim) {
        let now = sim.now();
        self.sync_hosts(sim);
        for h in 0..sim.cluster.hosts.len() {
            if sim.cluster.hosts[h].is_on() {
                let name = sim.cluster.hosts[h].name.clone();
                self.speculator.host_seen(&name, now);
            }
        }
        for e in self.speculator.over_budget(now) {
            self.evict(sim, e);
        }
        // runs still waiting with no room anywhere: ask for a host (one scaling
        // operation at a time; the engine refuses the rest)
        let room = (0..self.cores.len()).any(|h| self.cores[h].as_ref().is_some_and(|c| self.free_slots(h, c) > 0));
        if !self.unstarted.is_empty() && !room {
            sim.request_hosts(1);
        }
        for h in 0..self.cores.len() {
            if self.cores[h].is_some() {
                self.feed(sim, h, Input::Tick);
            }
        }
    }

    fn scale(&mut self, sim: &mut Sim) -> bool {
        self.scale_on_demand && self.scale_cluster(sim)
    }

    fn releasable(&self, _sim: &Sim, host: usize) -> bool {
        // a host whose core holds nothing on a slot (the engine checks the slots)
        self.cores.get(host).and_then(Option::as_ref).is_none_or(|c| c.running() == 0)
    }

    fn counters(&self) -> BTreeMap<String, f64> {
        let mut c: BTreeMap<String, f64> = self.counters.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        c.insert("prepared_per_host".into(), self.budget.prepared_per_host as f64);
        c.insert("idle_seconds_per_session".into(), self.budget.idle_seconds_per_session);
        c
    }
}
