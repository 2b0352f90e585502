//! The run table: every run recipe this host heard, and the one state it is in.
//! What the actor once kept as five queues and two maps (pending, won, waiting
//! for a kept worker's slot, waiting for a prepared worker's slot, waiting on a
//! CPU worker's host, arrived, running) is one entry per run, and the waiting
//! ones keep the order they started waiting in.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use schemas::messages::{Device, RecipeV3};
use uuid::Uuid;

use super::prepared::PrepKey;
use super::WorkerId;

/// Which worker an execution got, for what happens to it afterwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecKind {
    /// Forked for the cell (holding `slots`, if a GPU cell).
    Fresh { slots: Vec<u32> },
    /// A worker prepared before Run, holding GPU `slots`.
    Prepared { slots: Vec<u32> },
    /// A kept worker (the session's CPU worker, or one with unsavable state),
    /// and the GPU slots lent to it for this run (it held none before).
    Existing { worker: WorkerId, lent: Vec<u32> },
}

/// Where a run stands on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunState {
    /// Heard, and being routed: its claim (or the wait for another host's
    /// prepared worker) is under way.
    Routing,
    /// Waits for a free slot before this host competes for it.
    Pending,
    /// Claimed by this host; waits for slots.
    Won,
    /// Waits for slots to lend the kept worker it must run on.
    ForKept,
    /// Claimed; runs on the worker prepared for its cell once its preparation
    /// returns.
    OnPreparing(PrepKey),
    /// Claimed; waits with the worker prepared for its cell for a slot.
    ForPrepared(PrepKey),
    /// Its session's CPU worker lives on another host: claimed here should that
    /// host be lost before it takes the run.
    ForCpuHost,
    /// Executing here.
    Running { kind: ExecKind, device: Device },
    /// Taken by another host, interrupted or given up: remembered only so that a
    /// copy of its recipe is dropped.
    Gone,
}

impl RunState {
    /// Whether this host holds the run: running it, or claimed and waiting for a
    /// slot or a prepared worker (its claim is renewed; a draining host waits).
    pub fn held(&self) -> bool {
        matches!(self, RunState::Running { .. } | RunState::Won | RunState::OnPreparing(_) | RunState::ForPrepared(_))
    }

    /// Whether the run waits in the queue.
    pub fn waits(&self) -> bool {
        matches!(
            self,
            RunState::Pending | RunState::Won | RunState::ForKept | RunState::ForPrepared(_) | RunState::ForCpuHost
        )
    }
}

/// One run recipe as this host holds it.
#[derive(Clone, Debug)]
pub struct Run {
    /// The recipe.
    pub recipe: RecipeV3,
    /// When it arrived.
    pub arrived: Instant,
    /// Where it stands.
    pub state: RunState,
}

/// Every run this host heard, by execution; the waiting ones in order.
#[derive(Debug, Default)]
pub struct Runs {
    runs: HashMap<Uuid, Run>,
    /// Waiting runs in the order they started waiting.
    queue: VecDeque<Uuid>,
}

impl Runs {
    /// Whether run `exec` was heard (and not forgotten).
    pub fn contains(&self, exec: Uuid) -> bool {
        self.runs.contains_key(&exec)
    }

    /// Run `exec`.
    pub fn get(&self, exec: Uuid) -> Option<&Run> {
        self.runs.get(&exec)
    }

    /// Note a run recipe as it arrives (Routing); a run already known keeps its
    /// arrival and takes the newer recipe.
    pub fn arrive(&mut self, recipe: RecipeV3, now: Instant) {
        let exec = recipe.exec_id;
        match self.runs.get_mut(&exec) {
            Some(r) => {
                r.recipe = recipe;
                self.set(exec, RunState::Routing);
            }
            None => {
                self.runs.insert(exec, Run { recipe, arrived: now, state: RunState::Routing });
            }
        }
    }

    /// Move run `exec` to `state` (a waiting state puts it at the queue's back).
    pub fn set(&mut self, exec: Uuid, state: RunState) {
        let Some(r) = self.runs.get_mut(&exec) else { return };
        let was_waiting = r.state.waits();
        let waits = state.waits();
        r.state = state;
        if was_waiting {
            self.queue.retain(|e| *e != exec);
        }
        if waits {
            self.queue.push_back(exec);
        }
    }

    /// The waiting runs in a state `matches` accepts, in queue order.
    pub fn waiting(&self, matches: impl Fn(&RunState) -> bool) -> Vec<Uuid> {
        self.queue.iter().filter(|e| self.runs.get(e).is_some_and(|r| matches(&r.state))).copied().collect()
    }

    /// The runs in a state `matches` accepts (any order).
    pub fn in_state(&self, matches: impl Fn(&RunState) -> bool) -> Vec<Uuid> {
        self.runs.iter().filter(|(_, r)| matches(&r.state)).map(|(e, _)| *e).collect()
    }

    /// How many executions are under way.
    pub fn running(&self) -> usize {
        self.runs.values().filter(|r| matches!(r.state, RunState::Running { .. })).count()
    }

    /// Forget what ended and is older than `before` (copies of its recipe would
    /// have come by then), and whatever waits for another host's CPU worker since
    /// then (the frontend has given up on it). Runs this host holds stay.
    pub fn forget_older(&mut self, before: Instant) {
        let old: Vec<Uuid> = self
            .runs
            .iter()
            .filter(|(_, r)| r.arrived < before && matches!(r.state, RunState::Gone | RunState::ForCpuHost))
            .map(|(e, _)| *e)
            .collect();
        for exec in old {
            self.runs.remove(&exec);
            self.queue.retain(|e| *e != exec);
        }
    }

    /// Forget run `exec` now (it executed: a copy would find its claim taken).
    pub fn remove(&mut self, exec: Uuid) -> Option<Run> {
        self.queue.retain(|e| *e != exec);
        self.runs.remove(&exec)
    }
}
