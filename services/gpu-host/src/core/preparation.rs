//! Workers prepared before Run (ADR 7) or kept warm after their cell (ADR 9):
//! claiming a cell's preparation, updating a prepared worker in place as its
//! recipe changes, a run on it, and giving its slots up.

use std::time::Duration;

use schemas::clock::Clock;
use schemas::messages::{Device, EventKind, Prepare, PreparedClass, PreparedOutcome, RecipeV3, SlotUse, WorkerState};
use uuid::Uuid;

use super::prepared::{Phase, PrepKey, PreparedWorker};
use super::runs::RunState;
use super::{ClaimFor, Claiming, Command, Facts, HostCore, Target, WorkerRef};
use crate::host::claims::{Claim, ClaimKey};
use crate::host::slots::SlotState;

impl<C: Clock + Clone> HostCore<C> {
    /// An edit-derived recipe: prepare a worker for it if the speculator admitted
    /// it and a slot is free, or update the worker this host prepared for the cell.
    pub(super) fn on_edit_recipe(&mut self, recipe: RecipeV3, facts: &dyn Facts) {
        let key = (recipe.session, recipe.cell_id.clone());
        if recipe.device != Device::Gpu || recipe.pinned.is_some() {
            // The cell no longer runs on a fresh GPU worker (now a CPU cell, or it
            // needs the worker that holds unsavable state): the worker prepared for
            // it is cancelled. (A GPU recipe the budget did not admit keeps it: the
            // run refreshes whatever changed.)
            self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
            self.cancel_prepared(&key, recipe.revision, facts);
            return;
        }
        if !recipe.speculate || self.slots.len() < recipe.gpus.max(1) {
            return;
        }
        if recipe.prepared.as_ref().is_some_and(|p| p.host != self.host_id) {
            return; // another host holds the cell's worker and updates it
        }
        let revision_key = ClaimKey::Prepare { session: key.0, cell_id: key.1.clone(), revision: recipe.revision };
        if let Some(p) = self.prepared.get(&key) {
            if recipe.revision <= p.revision || p.run_claimed() || p.stopping() {
                return;
            }
            // This host updates the cell's worker in place. It claims the new
            // revision at once, so that a host without the worker loses that claim
            // instead of preparing a second worker for the cell (which held a slot
            // idle until evicted: found by `bench/gpu-hours`' validation, ADR 50).
            self.claim(revision_key, Duration::ZERO, ClaimFor::Revision);
            match self.prepared.get_mut(&key) {
                // superseded while preparing: applied in place next
                Some(p) if p.is_preparing() => p.queue_next(recipe),
                _ => self.start_prepare(key, recipe),
            }
            return;
        }
        if let Some(c) = self.claiming_prep.get_mut(&key) {
            // This host is claiming an earlier revision: if it wins, it applies this
            // one in place. Claiming it at once keeps hosts that are not claiming
            // the cell from preparing it a second time.
            if c.next.as_ref().is_none_or(|n| n.revision < recipe.revision) {
                c.next = Some(recipe);
                self.claim(revision_key, Duration::ZERO, ClaimFor::Revision);
            }
            return;
        }
        self.claiming_prep.insert(key.clone(), Claiming { next: None });
        let runs_before = self.runs_of(&key);
        // A one-GPU cell's preparation needs no slot: a worker forked without one
        // restores the closure's GPU-resident state into host memory (staged),
        // and the run that binds a slot copies it to the device first (ADR 70).
        // A multi-GPU cell's worker still holds its slots while prepared: waiting
        // for N slots at Run, behind one-slot runs that take each freed slot,
        // starved it for hours (`looseleaf simulate`, the trace workload).
        let needs_slot = self.policy.prepare_holds_slot || recipe.gpus > 1;
        self.claim_preparation(recipe, needs_slot, runs_before, facts);
    }

    /// Run recipes of the cell `key` seen so far.
    pub(super) fn runs_of(&self, key: &PrepKey) -> u64 {
        self.runs_of_cell.get(key).copied().unwrap_or(0)
    }

    /// Stop the worker prepared for `key` because recipe `revision` superseded it,
    /// unless a run already claimed it.
    fn cancel_prepared(&mut self, key: &PrepKey, revision: u64, facts: &dyn Facts) {
        match self.prepared.get_mut(key) {
            Some(p) if p.run_claimed() || (p.class == PreparedClass::Speculative && revision <= p.revision) => {}
            Some(p) if p.is_preparing() => p.stop_when_prepared(PreparedOutcome::Superseded),
            Some(_) => self.end_prepared(key, PreparedOutcome::Superseded, facts),
            None => {}
        }
    }

    /// Claim the preparation of `recipe` (exactly one host prepares a revision),
    /// holding a free slot meanwhile if the preparation needs one. `runs_before`:
    /// the cell's runs seen when the recipe arrived; a run since then supersedes it
    /// (its worker would idle on a slot for a cell that already ran).
    fn claim_preparation(&mut self, recipe: RecipeV3, needs_slot: bool, runs_before: u64, facts: &dyn Facts) {
        let key = (recipe.session, recipe.cell_id.clone());
        if self.runs_of(&key) != runs_before {
            self.claiming_prep.remove(&key);
            return;
        }
        if self.prepared.contains(&key) {
            self.claiming_prep.remove(&key);
            return self.on_edit_recipe(recipe, facts); // one got prepared meanwhile: update it
        }
        let slots = if needs_slot {
            let Some(slots) = self.slots.free(recipe.gpus.max(1)) else {
                // the newest revision waits for a slot
                let recipe = self.claiming_prep.remove(&key).and_then(|c| c.next).unwrap_or(recipe);
                self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
                self.spec_waiting.push((self.clock.now(), recipe));
                return;
            };
            self.slots.take(&slots, SlotState::Claiming(None));
            slots
        } else {
            vec![]
        };
        let (delay, _) = self.claim_delay(&recipe, facts);
        let claim_key =
            ClaimKey::Prepare { session: recipe.session, cell_id: recipe.cell_id.clone(), revision: recipe.revision };
        self.claim(claim_key, delay, ClaimFor::Preparation { recipe, slots, runs_before });
    }

    pub(super) fn preparation_claimed(
        &mut self,
        recipe: RecipeV3,
        slots: Vec<u32>,
        runs_before: u64,
        claim: Claim,
        facts: &dyn Facts,
    ) {
        let key = (recipe.session, recipe.cell_id.clone());
        let next = self.claiming_prep.remove(&key).and_then(|c| c.next);
        let ran = self.runs_of(&key) != runs_before;
        if claim != Claim::Won || self.prepared.contains(&key) || ran {
            self.slots.unreserve(&slots);
            if claim == Claim::Won && !ran {
                // an older revision of the cell got a worker meanwhile: update that one
                self.on_edit_recipe(next.unwrap_or(recipe), facts);
            }
            self.try_pending(facts);
            return;
        }
        self.slots.take(&slots, SlotState::Prepared { session: key.0, cell_id: key.1.clone() });
        self.prepared.insert(key.clone(), PreparedWorker::speculative(slots, recipe.revision));
        self.start_prepare(key, recipe);
        if let Some(next) = next {
            self.on_edit_recipe(next, facts); // arrived while claiming: applied in place next
        }
        self.emit(Command::PublishStatus);
    }

    /// Fork (or update in place) the prepared worker of `key` for `recipe`.
    fn start_prepare(&mut self, key: PrepKey, recipe: RecipeV3) {
        let Some(p) = self.prepared.get_mut(&key) else { return };
        p.begin(recipe.revision);
        let (worker, slots) = (p.worker.as_ref().map(|w| w.id.clone()), p.slots.clone());
        let ev = EventKind::Preparing {
            host: self.host_id.clone(),
            slot: slots.first().copied(),
            cell_id: key.1.clone(),
            revision: recipe.revision,
        };
        self.event(key.0, ev);
        self.emit(Command::Prepare { key, recipe, slots, worker });
    }

    /// A preparation returned: the worker is ready (or lost), and whatever waited
    /// for it (a run, a newer recipe, a stop) goes on.
    pub(super) fn prepare_done(&mut self, key: PrepKey, result: Result<(WorkerRef, f64), String>, facts: &dyn Facts) {
        let now = self.clock.now();
        let Some(p) = self.prepared.get_mut(&key) else {
            if let Ok((w, _)) = result {
                self.stop_worker(&w.id);
            }
            return;
        };
        let (next, run, stop) = p.prepared();
        let run = run.and_then(|exec| self.runs.get(exec).map(|r| r.recipe.clone()));
        let (w, prepare_ms) = match result {
            Ok(ok) => ok,
            Err(e) => {
                tracing::warn!(session = %key.0, cell = %key.1, error = %e, "preparation failed");
                if let Some(p) = self.prepared.get_mut(&key) {
                    p.worker = None; // a broken worker was killed by prepare
                }
                self.end_prepared(&key, PreparedOutcome::Lost, facts);
                if let Some(run) = run {
                    self.run_won(run); // claimed already: run it cold
                }
                return;
            }
        };
        let Some(p) = self.prepared.get_mut(&key) else { return };
        p.worker = Some(w.clone());
        p.first_ready.get_or_insert(now);
        if let Some(why) = stop {
            self.end_prepared(&key, why, facts);
            return;
        }
        // Ready even when a run waited for it: what the preparation cost, and
        // on which worker, is the session's record of it either way
        let ev = EventKind::Ready {
            host: self.host_id.clone(),
            slot: p.slots.first().copied(),
            worker: w.id,
            pid: w.pid,
            cell_id: key.1.clone(),
            revision: p.revision,
            class: p.class,
            prepare_ms,
        };
        self.event(key.0, ev);
        if let Some(run) = run {
            self.run_prepared(key, run, facts);
            return;
        }
        if let Some(next) = next {
            self.start_prepare(key, next);
        }
        self.emit(Command::PublishStatus);
    }

    /// The run claim for a cell this host prepared settled.
    pub(super) fn prepared_run_claimed(&mut self, key: PrepKey, recipe: RecipeV3, claim: Claim, facts: &dyn Facts) {
        if claim != Claim::Won {
            // another host runs it (the planner's budget evicts ours), or retried
            return self.not_won(recipe, claim);
        }
        match self.prepared.get_mut(&key) {
            Some(p) if p.is_preparing() => {
                p.queue_run(recipe.exec_id);
                self.runs.set(recipe.exec_id, RunState::OnPreparing(key));
            }
            Some(_) => self.run_prepared(key, recipe, facts),
            None => self.run_won(recipe),
        }
    }

    /// Run a claimed recipe on the worker prepared for its cell, binding a slot
    /// now if it was prepared without one.
    pub(super) fn run_prepared(&mut self, key: PrepKey, recipe: RecipeV3, facts: &dyn Facts) {
        let Some(mut p) = self.prepared.remove(&key) else { return self.run_won(recipe) };
        let alive = p.worker.as_ref().is_some_and(|w| facts.alive(&w.id));
        let Some(worker) = p.worker.clone().filter(|_| alive) else {
            // it died while waiting: the run goes to a fresh worker, nothing is lost
            self.prepared.insert(key.clone(), p);
            self.end_prepared(&key, PreparedOutcome::Lost, facts);
            return self.run_won(recipe);
        };
        let busy = SlotState::Busy { exec: recipe.exec_id, session: recipe.session };
        let slots = if p.slots.is_empty() {
            match self.take_slots(recipe.gpus.max(1)) {
                Some(slots) => {
                    self.slots.take(&slots, busy);
                    slots
                }
                None => {
                    // every slot runs a cell: wait for them with the worker
                    p.phase = Phase::AwaitingSlot { run: recipe.exec_id, gpus: recipe.gpus.max(1) };
                    self.prepared.insert(key.clone(), p);
                    self.runs.set(recipe.exec_id, RunState::ForPrepared(key));
                    return;
                }
            }
        } else {
            self.slots.hand_on(&p.slots, busy);
            p.slots.clone()
        };
        self.prepared_ended(key.clone(), &p, PreparedOutcome::Used);
        let prepare = if p.class == PreparedClass::Warm { Prepare::Warm } else { Prepare::Speculative };
        self.execute(recipe, Target::Existing { worker: worker.id, prepare, slots }, Some(key));
    }

    /// Keep the worker that just ran `cell_id` warm, with its slots (it may hold a
    /// CUDA context): a re-run of the cell finds it ready. The slot time of the cell
    /// ends here; waiting counts as the warm worker's idle time.
    pub(super) fn keep_warm_worker(&mut self, session: Uuid, cell_id: &str, worker: WorkerRef, slots: Vec<u32>) {
        self.release_slots(&slots, session, SlotUse::Cell);
        self.slots.take(&slots, SlotState::Prepared { session, cell_id: cell_id.to_string() });
        self.enter(&worker.id, WorkerState::Warm);
        let first = slots.first().copied();
        let now = self.clock.now();
        self.prepared.insert((session, cell_id.to_string()), PreparedWorker::warm(worker.clone(), slots, now));
        let ev = EventKind::Ready {
            host: self.host_id.clone(),
            slot: first,
            worker: worker.id,
            pid: worker.pid,
            cell_id: cell_id.to_string(),
            revision: 0,
            class: PreparedClass::Warm,
            prepare_ms: 0.0,
        };
        self.event(session, ev);
    }

    /// Whether `n` slots are free, or would be once idle prepared workers gave
    /// theirs up.
    pub(super) fn can_free(&self, n: u32) -> bool {
        self.slots.free_count() + self.prepared.idle_slots() >= n
    }

    /// `n` free slots for a run this host holds, stopping idle prepared workers
    /// for theirs if too few are free (none is stopped unless that makes enough).
    /// The caller takes them at once.
    pub(super) fn take_slots(&mut self, n: u32) -> Option<Vec<u32>> {
        if !self.can_free(n) {
            return None;
        }
        while self.slots.free_count() < n {
            let key = self.prepared.to_give_up()?;
            // not `end_prepared`: the freed slots must not go to another queued run
            self.remove_prepared(&key, PreparedOutcome::EvictedForRun);
        }
        self.slots.free(n)
    }

    /// Stop a prepared worker and free its slots; `outcome` says why.
    pub(super) fn end_prepared(&mut self, key: &PrepKey, outcome: PreparedOutcome, facts: &dyn Facts) {
        self.remove_prepared(key, outcome);
        self.try_pending(facts);
        self.emit(Command::PublishStatus);
    }

    /// `end_prepared` without handing the freed slots on.
    fn remove_prepared(&mut self, key: &PrepKey, outcome: PreparedOutcome) {
        let Some(p) = self.prepared.remove(key) else { return };
        if let Some(w) = &p.worker {
            self.stop_worker(&w.id);
        }
        self.release_slots(&p.slots, key.0, SlotUse::Speculation);
        self.prepared_ended(key.clone(), &p, outcome);
    }

    fn prepared_ended(&mut self, key: PrepKey, p: &PreparedWorker, outcome: PreparedOutcome) {
        let idle_ms = p.idle_ms(self.clock.now());
        tracing::info!(session = %key.0, cell = %key.1, worker = %p.worker_id(), idle_ms, outcome = outcome.as_str(),
            "prepared worker ended");
        schemas::metrics::metrics()
            .prepared_ended
            .get_or_create(&[("outcome", schemas::metrics::prepared_outcome(outcome))])
            .inc();
        let ev = EventKind::PreparedEnded {
            host: self.host_id.clone(),
            slot: p.slots.first().copied(),
            worker: p.worker_id().to_string(),
            cell_id: key.1,
            class: p.class,
            idle_ms,
            outcome,
        };
        self.event(key.0, ev);
    }

    /// The planner (budget) or the session asks to stop a prepared worker.
    pub(super) fn evict(&mut self, worker: &str, facts: &dyn Facts) {
        let Some(key) = self.prepared.by_worker(worker) else { return };
        self.evict_prepared(&key, facts);
    }

    /// End the worker prepared for `key` unless a run has claimed it (a worker
    /// still preparing ends once prepared).
    pub(super) fn evict_prepared(&mut self, key: &PrepKey, facts: &dyn Facts) {
        let key = key.clone();
        match self.prepared.get_mut(&key) {
            Some(p) if p.run_claimed() => {} // a run claimed it: too late
            Some(p) if p.is_preparing() => p.stop_when_prepared(PreparedOutcome::Evicted),
            Some(_) => self.end_prepared(&key, PreparedOutcome::Evicted, facts),
            None => {}
        }
    }
}
