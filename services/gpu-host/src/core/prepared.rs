//! Workers prepared for a cell before Run (ADR 7), or kept warm after their cell
//! (ADR 9), one per (session, cell).
//!
//! The registry's [`Phase`] is what the host still has to do for the worker; the
//! worker's own state is in [`crate::lifecycle`] and follows it:
//!
//! ```text
//!  claim won ─▶ Preparing ──ok──▶ Ready ──(newer recipe)──▶ Preparing (in place) …
//!                 │  a newer recipe, a claimed run or a stop    │ run claimed, no slot free
//!                 │  that arrives meanwhile waits in the phase  ▼
//!                 │                                        AwaitingSlot ──slot──▶ used
//!                 └─▶ then: stop (ended) │ run (used) │ next (Preparing again) │ Ready
//! ```
//! Preparing is the worker's lifecycle `Preparing`; Ready and AwaitingSlot are its
//! `Ready` (speculative) or `Warm` (kept after its cell).

use std::collections::HashMap;
use std::time::Instant;

use schemas::messages::{PreparedClass, PreparedOutcome, RecipeV3};
use uuid::Uuid;

use super::{Facts, WorkerRef};

/// A prepared worker's (session, cell).
pub type PrepKey = (Uuid, String);

/// Of the idle slot-holding workers (key, class, when first ready), the one a run
/// that lacks slots stops first: warm before speculative, longest idle first. A
/// pure rule, so the simulator (issue 17) runs it too.
pub fn give_up_first<K>(idle: impl IntoIterator<Item = (K, PreparedClass, Option<Instant>)>) -> Option<K> {
    idle.into_iter()
        .min_by_key(|(_, class, first_ready)| (*class == PreparedClass::Speculative, *first_ready))
        .map(|(k, _, _)| k)
}

/// What the host still has to do for a prepared worker.
#[derive(Clone, Debug)]
pub enum Phase {
    /// Being forked (its first preparation) or brought to a newer recipe.
    Preparing {
        /// A newer recipe that arrived meanwhile: applied next, in place.
        next: Option<Box<RecipeV3>>,
        /// A run this host claimed meanwhile (its execution id; the recipe is in
        /// the run table): runs on it once prepared.
        run: Option<Uuid>,
        /// Stopped meanwhile: ends once the preparation returns.
        stop: Option<PreparedOutcome>,
    },
    /// Idle, waiting for Run.
    Ready,
    /// A run this host claimed waits with it for a slot (it was prepared without one).
    AwaitingSlot {
        /// The run (its recipe is in the run table).
        run: Uuid,
        /// The slots it needs.
        gpus: u32,
    },
}

/// One prepared worker.
#[derive(Debug)]
pub struct PreparedWorker {
    /// None while its first preparation forks it.
    pub worker: Option<WorkerRef>,
    /// The GPU slots it holds (the cell's `gpus`): only if its closure has
    /// GPU-resident state (or the host prepares every worker with its slots);
    /// others get their slots at Run.
    pub slots: Vec<u32>,
    /// The recipe revision it was (or is being) prepared for (0: kept warm).
    pub revision: u64,
    /// Speculative or warm.
    pub class: PreparedClass,
    /// When it first became ready: its idle time counts from there.
    pub first_ready: Option<Instant>,
    /// What is left to do.
    pub phase: Phase,
}

impl PreparedWorker {
    /// A worker about to be forked for an edit-derived recipe.
    pub fn speculative(slots: Vec<u32>, revision: u64) -> Self {
        Self {
            worker: None,
            slots,
            revision,
            class: PreparedClass::Speculative,
            first_ready: None,
            phase: Phase::Preparing { next: None, run: None, stop: None },
        }
    }

    /// The worker that just ran its cell, kept warm with its slots.
    pub fn warm(worker: WorkerRef, slots: Vec<u32>, now: Instant) -> Self {
        Self {
            worker: Some(worker),
            slots,
            revision: 0,
            class: PreparedClass::Warm,
            first_ready: Some(now),
            phase: Phase::Ready,
        }
    }

    /// Its worker's id (empty until forked).
    pub fn worker_id(&self) -> &str {
        self.worker.as_ref().map_or("", |w| w.id.as_str())
    }

    /// Whether a preparation is under way.
    pub fn is_preparing(&self) -> bool {
        matches!(self.phase, Phase::Preparing { .. })
    }

    /// Whether a run already claimed it (too late to stop or update it).
    pub fn run_claimed(&self) -> bool {
        matches!(self.phase, Phase::Preparing { run: Some(_), .. } | Phase::AwaitingSlot { .. })
    }

    /// Whether it ends once its preparation returns.
    pub fn stopping(&self) -> bool {
        matches!(self.phase, Phase::Preparing { stop: Some(_), .. })
    }

    /// Ready and holding a slot that a run could have instead.
    pub fn idle_on_slot(&self) -> bool {
        matches!(self.phase, Phase::Ready) && self.worker.is_some() && !self.slots.is_empty()
    }

    /// Milliseconds it spent ready and unused, up to `now`.
    pub fn idle_ms(&self, now: Instant) -> f64 {
        self.first_ready.map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64() * 1000.0)
    }

    /// Begin (again) preparing it for `revision` of its cell's edit-derived recipe.
    pub fn begin(&mut self, revision: u64) {
        self.phase = Phase::Preparing { next: None, run: None, stop: None };
        self.revision = revision;
        self.class = PreparedClass::Speculative; // a warm worker now prepared for an edit
    }

    /// While preparing: apply `recipe` next, in place.
    pub fn queue_next(&mut self, recipe: RecipeV3) {
        if let Phase::Preparing { next, .. } = &mut self.phase {
            *next = Some(Box::new(recipe));
        }
    }

    /// While preparing: run `exec` on it once prepared (nothing newer applies).
    pub fn queue_run(&mut self, exec: Uuid) {
        if let Phase::Preparing { next, run, .. } = &mut self.phase {
            *next = None;
            *run = Some(exec);
        }
    }

    /// While preparing: end it once prepared, for `why`.
    pub fn stop_when_prepared(&mut self, why: PreparedOutcome) {
        if let Phase::Preparing { next, stop, .. } = &mut self.phase {
            *next = None;
            *stop = Some(why);
        }
    }

    /// The preparation returned: what was waiting for it, and the phase is Ready.
    pub fn prepared(&mut self) -> (Option<RecipeV3>, Option<Uuid>, Option<PreparedOutcome>) {
        match std::mem::replace(&mut self.phase, Phase::Ready) {
            Phase::Preparing { next, run, stop } => (next.map(|r| *r), run, stop),
            Phase::Ready | Phase::AwaitingSlot { .. } => (None, None, None),
        }
    }

    /// The slots the run waiting with it needs, if one waits.
    pub fn awaiting_gpus(&self) -> Option<u32> {
        match &self.phase {
            Phase::AwaitingSlot { gpus, .. } => Some(*gpus),
            _ => None,
        }
    }

    /// The run waiting for a slot, if any (the phase goes back to Ready).
    pub fn take_awaiting_run(&mut self) -> Option<Uuid> {
        match std::mem::replace(&mut self.phase, Phase::Ready) {
            Phase::AwaitingSlot { run, .. } => Some(run),
            other => {
                self.phase = other;
                None
            }
        }
    }
}

/// Prepared workers by (session, cell).
#[derive(Debug, Default)]
pub struct PreparedWorkers(HashMap<PrepKey, PreparedWorker>);

impl PreparedWorkers {
    /// The worker prepared for `key`.
    pub fn get(&self, key: &PrepKey) -> Option<&PreparedWorker> {
        self.0.get(key)
    }

    /// The worker prepared for `key`, to change its phase.
    pub fn get_mut(&mut self, key: &PrepKey) -> Option<&mut PreparedWorker> {
        self.0.get_mut(key)
    }

    /// Whether a worker is prepared (or being prepared) for `key`.
    pub fn contains(&self, key: &PrepKey) -> bool {
        self.0.contains_key(key)
    }

    /// Register a prepared worker.
    pub fn insert(&mut self, key: PrepKey, p: PreparedWorker) {
        self.0.insert(key, p);
    }

    /// Forget a prepared worker (it runs its cell, or ends).
    pub fn remove(&mut self, key: &PrepKey) -> Option<PreparedWorker> {
        self.0.remove(key)
    }

    /// The prepared worker with this id.
    pub fn by_worker(&self, worker: &str) -> Option<PrepKey> {
        self.0.iter().find(|(_, p)| p.worker_id() == worker).map(|(k, _)| k.clone())
    }

    /// Every prepared worker's key, in a stable order.
    pub fn keys(&self) -> Vec<PrepKey> {
        let mut keys: Vec<PrepKey> = self.0.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// The session's prepared workers.
    pub fn of_session(&self, session: Uuid) -> Vec<PrepKey> {
        self.0.keys().filter(|(s, _)| *s == session).cloned().collect()
    }

    /// The slot-holding worker to give up first for a run: ready, warm before
    /// speculative, longest idle first.
    pub fn to_give_up(&self) -> Option<PrepKey> {
        give_up_first(self.0.iter().filter(|(_, p)| p.idle_on_slot()).map(|(k, p)| (k.clone(), p.class, p.first_ready)))
    }

    /// The slots idle prepared workers hold: what giving them all up would free.
    pub fn idle_slots(&self) -> u32 {
        let n: usize = self.0.values().filter(|p| p.idle_on_slot()).map(|p| p.slots.len()).sum();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Ready workers whose process is gone.
    pub fn dead(&self, facts: &dyn Facts) -> Vec<PrepKey> {
        self.0
            .iter()
            .filter(|(_, p)| matches!(p.phase, Phase::Ready))
            .filter(|(_, p)| p.worker.as_ref().is_some_and(|w| !facts.alive(&w.id)))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Whether the worker prepared for (session, cell) is being prepared (status).
    pub fn is_preparing(&self, session: Uuid, cell_id: &str) -> bool {
        self.0.get(&(session, cell_id.to_string())).is_some_and(PreparedWorker::is_preparing)
    }

    /// Every prepared worker (shutdown).
    pub fn drain(&mut self) -> impl Iterator<Item = PreparedWorker> + '_ {
        self.0.drain().map(|(_, p)| p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::messages::RecipeKind;

    fn recipe(revision: u64) -> RecipeV3 {
        let r = crate::core::gpu_recipe(Uuid::nil(), "c", RecipeKind::Speculative, Uuid::nil(), 1);
        RecipeV3 { revision, ..r }
    }

    #[test]
    fn what_arrives_while_preparing_waits_in_the_phase() {
        let mut p = PreparedWorker::speculative(vec![0], 1);
        assert!(p.is_preparing() && !p.run_claimed() && !p.stopping());
        p.queue_next(recipe(2));
        p.queue_run(Uuid::from_u128(3));
        assert!(p.run_claimed(), "a claimed run cannot be stopped or updated");
        let (next, run, stop) = p.prepared();
        assert!(next.is_none(), "a run replaces any newer edit recipe");
        assert_eq!(run, Some(Uuid::from_u128(3)));
        assert!(stop.is_none() && !p.is_preparing());

        let mut p = PreparedWorker::speculative(vec![], 1);
        p.queue_next(recipe(2));
        p.stop_when_prepared(PreparedOutcome::Evicted);
        assert!(p.stopping());
        assert!(matches!(p.prepared(), (None, None, Some(PreparedOutcome::Evicted))));
    }

    #[test]
    fn a_run_waiting_for_a_slot_is_taken_once_and_only_ready_slot_holders_are_given_up() {
        let mut p = PreparedWorker::speculative(vec![], 1);
        let _ = p.prepared();
        assert!(!p.idle_on_slot(), "no worker and no slot");
        p.phase = Phase::AwaitingSlot { run: Uuid::from_u128(4), gpus: 1 };
        assert!(p.run_claimed());
        assert_eq!(p.awaiting_gpus(), Some(1));
        assert_eq!(p.take_awaiting_run(), Some(Uuid::from_u128(4)));
        assert!(p.take_awaiting_run().is_none());
        assert!(matches!(p.phase, Phase::Ready));
        p.begin(5);
        assert!(p.is_preparing() && p.revision == 5 && p.class == PreparedClass::Speculative);
    }
}
