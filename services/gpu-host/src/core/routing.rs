//! A run from arrival to execution, and what becomes of its worker and slots
//! after it: which claim it makes, what it waits for, and in what order waiting
//! runs start when slots free.

use std::time::Duration;

use schemas::clock::Clock;
use schemas::messages::{BidV1, Device, Prepare, RecipeKind, RecipeV3, SlotUse, WorkerState};
use uuid::Uuid;

use super::kept::KeptWorker;
use super::runs::{ExecKind, RunState};
use super::{
    ClaimFor, Command, Facts, HostCore, Input, Target, WorkerRef, ARRIVAL_MEMORY, CLAIM_RETRY, PREPARED_FALLBACK,
};
use crate::host::claims::{Claim, ClaimKey};
use crate::host::slots::SlotState;

impl<C: Clock + Clone> HostCore<C> {
    /// A recipe: an edit's goes to preparation; a run's is routed. `delivered`: it
    /// came from the planner (a copy of one heard before is dropped), not a retry.
    pub(super) fn on_recipe(&mut self, recipe: RecipeV3, facts: &dyn Facts, delivered: bool) {
        if self.stopping {
            return; // a stopping host takes nothing new; other hosts will
        }
        if self.cordoned && !self.holds_worker_for(&recipe) {
            return; // nor a cordoned one, but for the workers it holds
        }
        if recipe.kind != RecipeKind::Run {
            self.on_edit_recipe(recipe, facts);
            return;
        }
        let exec = recipe.exec_id;
        match self.runs.get(exec).map(|r| &r.state) {
            // sent again because no acknowledgement reached the planner (ADR 46):
            // the run claim would refuse it too, but it would wait for a slot first
            Some(_) if delivered => {
                tracing::info!(%exec, "a run's recipe heard again: taken once");
                return;
            }
            // interrupted or given up while its retry waited
            Some(RunState::Gone) => return,
            _ => {}
        }
        self.runs.arrive(recipe.clone(), self.clock.now());
        self.route(recipe, facts);
    }

    /// Whether this host holds the worker `recipe` is for: the cell's prepared
    /// worker, the worker pinned for it, or the session's CPU worker.
    fn holds_worker_for(&self, recipe: &RecipeV3) -> bool {
        let key = (recipe.session, recipe.cell_id.clone());
        self.prepared.contains(&key)
            || recipe.pinned.as_ref().is_some_and(|p| p.host == self.host_id && self.kept.get(&p.worker).is_some())
            || (recipe.device == Device::Cpu && self.kept.cpu_worker(recipe.session).is_some())
    }

    /// Where a run goes: to the worker pinned for it, the session's CPU worker, a
    /// prepared worker, or a claim for free slots.
    fn route(&mut self, recipe: RecipeV3, facts: &dyn Facts) {
        let exec = recipe.exec_id;
        if let Some(p) = &recipe.pinned {
            if p.host != self.host_id {
                self.runs.set(exec, RunState::Gone);
                return;
            }
            if self.kept.get(&p.worker).is_some() {
                self.run_kept(recipe, facts);
                return;
            }
            if !p.names.is_empty() {
                // gone: the execution fails naming the variable and its cell
                self.claim_then_execute(recipe, Target::Fresh { slots: vec![] });
                return;
            }
            // The worker that held the session's unsavable state is gone, and this
            // cell reads none of it: it runs as any other cell (ADR 51).
            let mut r = recipe;
            r.pinned = None;
            self.runs.arrive(r.clone(), self.clock.now());
            self.route(r, facts);
            return;
        }
        match recipe.device {
            Device::Cpu => self.claim_cpu(recipe),
            Device::Gpu => {
                let n = recipe.gpus.max(1);
                // a `%%gpu N` cell runs only on a host with N slots
                if self.slots.len() < n {
                    self.runs.set(exec, RunState::Gone);
                    return;
                }
                let key = (recipe.session, recipe.cell_id.clone());
                self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
                *self.runs_of_cell.entry(key.clone()).or_default() += 1;
                let now = self.clock.now();
                // A prepared worker holds no slot (ADR 70): it makes this host the
                // best place only if a slot is free here, or nowhere else. Otherwise
                // a host with room starts the run cold rather than it waiting here
                // for a slot (ADR 71).
                // (a worker prepared on its slot, `--prepare-holds-slot`, has it). With
                // no room anywhere it waits here for a slot, but not ahead of runs
                // already waiting here: a multi-GPU one starved behind such runs.
                let held = self.prepared.get(&key).map_or(0, |p| p.slots.len() as u32);
                let slot_queue =
                    |s: &RunState| matches!(s, RunState::Pending | RunState::Won | RunState::ForPrepared(_));
                let nowhere_else = !self.peers.has_room(n, now) && self.runs.waiting(slot_queue).is_empty();
                let room_here = held + self.slots.free_count() >= n || nowhere_else;
                if self.prepared.contains(&key) && room_here {
                    self.claim(ClaimKey::Run(exec), Duration::ZERO, ClaimFor::PreparedRun { key, recipe });
                    return;
                }
                let elsewhere = recipe.prepared.as_ref().filter(|p| p.host != self.host_id);
                // that host claims it at once (compete only if it has not), unless
                // it said it has no room: then compete now
                if elsewhere.is_some_and(|p| self.peers.host_has_room(&p.host, n, now) != Some(false)) {
                    let mut r = recipe;
                    r.prepared = None;
                    self.emit(Command::After { delay: PREPARED_FALLBACK, input: Box::new(Input::Retry(r)) });
                    return;
                }
                match self.slots.free(n) {
                    Some(slots) => self.claim_gpu(recipe, slots, facts),
                    None if self.can_free(n) => self.claim_then_evict(recipe, facts),
                    None => self.runs.set(exec, RunState::Pending),
                }
            }
        }
    }

    /// Compete for a GPU run, holding free `slots` meanwhile.
    fn claim_gpu(&mut self, recipe: RecipeV3, slots: Vec<u32>, facts: &dyn Facts) {
        // scored before the slots are reserved: free slots are what this host offers
        let (delay, score) = self.claim_delay(&recipe, facts);
        self.slots.take(&slots, SlotState::Claiming(Some(recipe.exec_id)));
        self.runs.set(recipe.exec_id, RunState::Routing);
        self.claim(ClaimKey::Run(recipe.exec_id), delay, ClaimFor::GpuRun { recipe, slots, score, delay });
    }

    pub(super) fn gpu_run_claimed(
        &mut self,
        recipe: RecipeV3,
        slots: Vec<u32>,
        score: f64,
        delay: Duration,
        claim: Claim,
        facts: &dyn Facts,
    ) {
        self.bid(&recipe, score, delay, claim == Claim::Won);
        if claim == Claim::Won {
            self.slots.hand_on(&slots, SlotState::Busy { exec: recipe.exec_id, session: recipe.session });
            self.execute(recipe, Target::Fresh { slots }, None);
        } else {
            self.slots.unreserve(&slots);
            self.not_won(recipe, claim);
            self.try_pending(facts);
        }
        self.emit(Command::PublishStatus);
    }

    /// Too few slots free, but idle prepared workers could give theirs up: claim
    /// first (with the delay of a full host), evict only if this host won.
    fn claim_then_evict(&mut self, recipe: RecipeV3, facts: &dyn Facts) {
        let (delay, score) = self.claim_delay(&recipe, facts);
        self.runs.set(recipe.exec_id, RunState::Routing);
        self.claim(ClaimKey::Run(recipe.exec_id), delay, ClaimFor::GpuRunEvicting { recipe, score, delay });
    }

    pub(super) fn evicting_run_claimed(&mut self, recipe: RecipeV3, score: f64, delay: Duration, claim: Claim) {
        self.bid(&recipe, score, delay, claim == Claim::Won);
        match claim {
            Claim::Won => self.run_won(recipe),
            other => self.not_won(recipe, other),
        }
    }

    /// A CPU run: on the session's CPU worker if this host keeps it; else claim
    /// the worker (a session's CPU cells all run on one host).
    pub(super) fn claim_cpu(&mut self, recipe: RecipeV3) {
        if let Some(k) = self.kept.cpu_worker(recipe.session) {
            let target = Target::Existing { worker: k.worker.id.clone(), prepare: Prepare::Persistent, slots: vec![] };
            self.claim_then_execute(recipe, target);
            return;
        }
        self.runs.set(recipe.exec_id, RunState::Routing);
        // mine already when the session's CPU worker died and this host restarts it
        self.claim(ClaimKey::Cpu(recipe.session), Duration::ZERO, ClaimFor::CpuWorker { recipe });
    }

    pub(super) fn cpu_worker_claimed(&mut self, recipe: RecipeV3, claim: Claim) {
        match claim {
            Claim::Won | Claim::Mine => self.claim_then_execute(recipe, Target::Fresh { slots: vec![] }),
            // the session's CPU worker lives on another host; should that host be
            // lost before it claims the run, this one takes over (on a tick)
            Claim::Lost => self.runs.set(recipe.exec_id, RunState::ForCpuHost),
            Claim::Failed => self.retry_failed_claim(recipe),
        }
    }

    /// A run for a kept worker of this host (the session's CPU worker, or the one
    /// holding its unsavable state). A GPU cell on a kept worker that holds no
    /// slot (it never used CUDA) is lent free slots for the run, or waits for them.
    pub(super) fn run_kept(&mut self, recipe: RecipeV3, facts: &dyn Facts) {
        let Some(id) = recipe.pinned.as_ref().map(|p| p.worker.clone()) else { return };
        let Some(k) = self.kept.get(&id) else {
            // gone while the run waited for a slot: routed as a run for a lost worker
            self.route(recipe, facts);
            return;
        };
        let prepare = if k.persistent { Prepare::Persistent } else { Prepare::Pinned };
        if recipe.device != Device::Gpu || !k.slots.is_empty() {
            let target = Target::Existing { worker: id, prepare, slots: k.slots.clone() };
            self.claim_then_execute(recipe, target);
            return;
        }
        let Some(slots) = self.slots.free(recipe.gpus.max(1)) else {
            self.runs.set(recipe.exec_id, RunState::ForKept);
            return;
        };
        self.slots.take(&slots, SlotState::Claiming(Some(recipe.exec_id)));
        self.runs.set(recipe.exec_id, RunState::Routing);
        let then = ClaimFor::KeptRun { recipe: recipe.clone(), worker: id, prepare, slots };
        self.claim(ClaimKey::Run(recipe.exec_id), Duration::ZERO, then);
    }

    pub(super) fn kept_run_claimed(
        &mut self,
        recipe: RecipeV3,
        worker: String,
        prepare: Prepare,
        slots: Vec<u32>,
        claim: Claim,
        facts: &dyn Facts,
    ) {
        if claim == Claim::Won {
            self.slots.hand_on(&slots, SlotState::Busy { exec: recipe.exec_id, session: recipe.session });
            self.execute(recipe, Target::Existing { worker, prepare, slots }, None);
            return;
        }
        self.slots.unreserve(&slots);
        self.not_won(recipe, claim);
        self.try_pending(facts);
    }

    /// A run that needs no competition (on the session's CPU worker, or on the
    /// worker pinned for its state) still claims its run key like every other run:
    /// nothing starts an execution twice, and one the user interrupted before any
    /// host claimed it (the frontend claims it then) never starts.
    fn claim_then_execute(&mut self, recipe: RecipeV3, target: Target) {
        self.runs.set(recipe.exec_id, RunState::Routing);
        self.claim(ClaimKey::Run(recipe.exec_id), Duration::ZERO, ClaimFor::Run { recipe, target });
    }

    pub(super) fn run_claimed(&mut self, recipe: RecipeV3, target: Target, claim: Claim) {
        match claim {
            Claim::Won => self.execute(recipe, target, None),
            other => {
                if other != Claim::Failed {
                    tracing::info!(exec = %recipe.exec_id, "run not claimed (taken, or interrupted before it started)");
                }
                self.not_won(recipe, other);
            }
        }
    }

    /// A run this host did not win: another host's (or the interrupt's), or, if
    /// the claim failed, routed again shortly.
    pub(super) fn not_won(&mut self, recipe: RecipeV3, claim: Claim) {
        if claim == Claim::Failed {
            self.retry_failed_claim(recipe);
        } else {
            self.runs.set(recipe.exec_id, RunState::Gone);
        }
    }

    /// A run whose claim failed: the claims bucket could not be reached, so nobody
    /// is known to hold it, and it is no other host's to run. Route it again
    /// shortly, for as long as this host remembers its arrival (past that, the
    /// frontend has given up on it and holds its claim).
    fn retry_failed_claim(&mut self, recipe: RecipeV3) {
        let exec = recipe.exec_id;
        let now = self.clock.now();
        let fresh = self.runs.get(exec).is_some_and(|r| now.saturating_duration_since(r.arrived) < ARRIVAL_MEMORY);
        if !fresh {
            tracing::warn!(%exec, "gave up a run whose claim kept failing");
            self.runs.set(exec, RunState::Gone);
            return;
        }
        tracing::warn!(%exec, "could not claim the run; trying again in {CLAIM_RETRY:?}");
        self.runs.set(exec, RunState::Routing);
        self.emit(Command::After { delay: CLAIM_RETRY, input: Box::new(Input::Retry(recipe)) });
    }

    /// A run this host claimed without a prepared worker: free slots, or idle
    /// prepared workers' slots, or wait for them.
    pub(super) fn run_won(&mut self, recipe: RecipeV3) {
        match self.take_slots(recipe.gpus.max(1)) {
            Some(slots) => {
                self.slots.take(&slots, SlotState::Busy { exec: recipe.exec_id, session: recipe.session });
                self.execute(recipe, Target::Fresh { slots }, None);
            }
            None => self.runs.set(recipe.exec_id, RunState::Won),
        }
        self.emit(Command::PublishStatus);
    }

    fn bid(&mut self, recipe: &RecipeV3, score: f64, delay: Duration, won: bool) {
        let bid = BidV1 {
            exec_id: recipe.exec_id,
            host: self.host_id.clone(),
            score,
            delay_ms: delay.as_secs_f64() * 1000.0,
            won,
        };
        self.emit(Command::Bid(bid));
    }

    /// Execute a claimed run on `target`.
    pub(super) fn execute(&mut self, recipe: RecipeV3, target: Target, prepared: Option<super::PrepKey>) {
        let kind = match &target {
            Target::Fresh { slots } => ExecKind::Fresh { slots: slots.clone() },
            Target::Existing { prepare: Prepare::Speculative | Prepare::Warm, slots, .. } if !slots.is_empty() => {
                ExecKind::Prepared { slots: slots.clone() }
            }
            Target::Existing { worker, slots, .. } => {
                // slots the kept worker holds stay its own; others were lent for the run
                let holds = self.kept.get(worker).is_some_and(|k| !k.slots.is_empty());
                ExecKind::Existing { worker: worker.clone(), lent: if holds { vec![] } else { slots.clone() } }
            }
        };
        if recipe.device == Device::Gpu && recipe.options.speculate && matches!(kind, ExecKind::Fresh { .. }) {
            schemas::metrics::metrics().speculation_misses.inc();
        }
        self.runs.set(recipe.exec_id, RunState::Running { kind, device: recipe.device });
        self.emit(Command::Execute { recipe, target, prepared });
    }

    /// After an execution: keep, warm or stop its worker, and free or keep its slots.
    pub(super) fn executed(
        &mut self,
        exec: Uuid,
        worker: Option<WorkerRef>,
        unsavable: Vec<String>,
        cuda_used: bool,
        facts: &dyn Facts,
    ) {
        let Some(run) = self.runs.remove(exec) else { return };
        let RunState::Running { kind, device } = run.state else { return };
        let (session, cell_id) = (run.recipe.session, run.recipe.cell_id);
        match kind {
            // a prepared worker ends like a fresh one: its slot goes free, stays
            // pinned for unsavable state, or stays with the worker kept warm
            ExecKind::Fresh { slots } | ExecKind::Prepared { slots } if !slots.is_empty() => match worker {
                Some(w) if !unsavable.is_empty() => {
                    tracing::info!(worker = %w.id, ?unsavable, cuda = cuda_used, "keeping the worker for unsavable state");
                    self.enter(&w.id, WorkerState::Kept);
                    // a slot stays with the worker only while it holds GPU memory
                    let slots = if cuda_used {
                        self.slots.hand_on(&slots, SlotState::Pinned { worker: w.id.clone(), session });
                        slots
                    } else {
                        self.release_slots(&slots, session, SlotUse::Cell);
                        vec![]
                    };
                    self.kept.keep(w.id.clone(), KeptWorker { worker: w, session, slots, persistent: false });
                }
                Some(w) if self.policy.keep_warm && !self.prepared.contains(&(session, cell_id.clone())) => {
                    self.keep_warm_worker(session, &cell_id, w, slots);
                }
                worker => {
                    if let Some(w) = worker {
                        self.stop_worker(&w.id);
                    }
                    self.release_slots(&slots, session, SlotUse::Cell);
                }
            },
            ExecKind::Fresh { .. } | ExecKind::Prepared { .. } => {
                if let Some(w) = worker {
                    let persistent = device == Device::Cpu;
                    if persistent || !unsavable.is_empty() {
                        self.enter(&w.id, WorkerState::Kept);
                        self.kept.keep(w.id.clone(), KeptWorker { worker: w, session, slots: vec![], persistent });
                    } else {
                        self.stop_worker(&w.id);
                    }
                }
            }
            ExecKind::Existing { worker: id, lent } => match worker {
                // lost: forget it; cells needing its unsavable state now fail clearly
                None => {
                    self.forget_kept(&id, false);
                    self.release_slots(&lent, session, SlotUse::Cell);
                }
                Some(_) => {
                    self.enter(&id, WorkerState::Kept);
                    let persistent = self.kept.get(&id).is_some_and(|k| k.persistent);
                    if !persistent && unsavable.is_empty() {
                        // nothing left that only this worker has
                        self.forget_kept(&id, true);
                        self.release_slots(&lent, session, SlotUse::Cell);
                    } else if cuda_used && !lent.is_empty() {
                        // it initialised CUDA on the lent slots: its GPU memory stays
                        self.slots.hand_on(&lent, SlotState::Pinned { worker: id.clone(), session });
                        self.kept.hold_slots(&id, lent);
                    } else {
                        self.release_slots(&lent, session, SlotUse::Cell);
                    }
                }
            },
        }
        self.try_pending(facts);
        self.emit(Command::PublishStatus);
    }

    /// Stop keeping worker `id` (stopping its process if `stop`) and free its slots.
    pub(super) fn forget_kept(&mut self, id: &str, stop: bool) {
        let Some(k) = self.kept.remove(id) else { return };
        if stop {
            self.stop_worker(id);
        }
        self.release_slots(&k.slots, k.session, SlotUse::UnsavableState);
    }

    /// Start the runs that wait for slots: runs for kept workers first (the
    /// session has nowhere else to run them), then prepared workers' runs, then
    /// runs this host claimed, then runs it may still claim, then preparations.
    /// Each kind goes in order: a `%%gpu N` run at its head waits for N free
    /// slots rather than be overtaken for ever by one-slot runs.
    pub(super) fn try_pending(&mut self, facts: &dyn Facts) {
        for exec in self.runs.waiting(|s| *s == RunState::ForKept) {
            let Some(recipe) = self.waiting_recipe(exec, |s| *s == RunState::ForKept) else { continue };
            if self.slots.free_count() < recipe.gpus.max(1) {
                break;
            }
            self.runs.set(exec, RunState::Routing);
            self.run_kept(recipe, facts);
        }
        for exec in self.runs.waiting(|s| matches!(s, RunState::ForPrepared(_))) {
            let Some(RunState::ForPrepared(key)) = self.runs.get(exec).map(|r| r.state.clone()) else { continue };
            let needs = self.prepared.get(&key).and_then(|p| p.awaiting_gpus());
            if needs.is_some_and(|n| self.slots.free_count() < n) {
                break;
            }
            let Some(recipe) = self.runs.get(exec).map(|r| r.recipe.clone()) else { continue };
            self.runs.set(exec, RunState::Routing);
            match self.prepared.get_mut(&key).and_then(|p| p.take_awaiting_run()) {
                Some(_) => self.run_prepared(key, recipe, facts),
                // its worker ended meanwhile (its session closed): nothing to run on
                None => self.runs.set(exec, RunState::Gone),
            }
        }
        for exec in self.runs.waiting(|s| *s == RunState::Won) {
            let Some(recipe) = self.waiting_recipe(exec, |s| *s == RunState::Won) else { continue };
            if self.slots.free_count() < recipe.gpus.max(1) {
                break;
            }
            self.runs.set(exec, RunState::Routing);
            self.run_won(recipe);
        }
        for exec in self.runs.waiting(|s| *s == RunState::Pending) {
            let Some(recipe) = self.waiting_recipe(exec, |s| *s == RunState::Pending) else { continue };
            let Some(slots) = self.slots.free(recipe.gpus.max(1)) else { break };
            self.claim_gpu(recipe, slots, facts);
        }
        // then preparations that waited briefly for slots; older ones are stale
        let now = self.clock.now();
        self.spec_waiting.retain(|(at, _)| now.saturating_duration_since(*at) < super::SPEC_WAIT);
        while self.spec_waiting.first().is_some_and(|(_, r)| self.slots.free_count() >= r.gpus.max(1)) {
            let (_, recipe) = self.spec_waiting.remove(0);
            self.on_edit_recipe(recipe, facts);
        }
    }

    /// The recipe of waiting run `exec`, if it is still in a state `state` accepts.
    fn waiting_recipe(&self, exec: Uuid, state: impl Fn(&RunState) -> bool) -> Option<RecipeV3> {
        self.runs.get(exec).filter(|r| state(&r.state)).map(|r| r.recipe.clone())
    }
}
