//! The worker lifecycle as an explicit state machine (DESIGN.md section 7).
//!
//! ```text
//!              ┌──────────── newer recipe (update in place) ───────────┐
//!              ▼                                                      │
//!  fork ─▶ Preparing ──▶ Ready ──(Run: refresh)──▶ Preparing ──▶ Running ──▶ Saving ─┬▶ Warm ─(re-run / edit)─▶ Preparing
//!              │                                      ▲                          └▶ Kept ─(next cell)───▶ Preparing
//!              └──────────── (a cold run) ────────────┘
//!  a step that fails without breaking the worker: Preparing | Running ──▶ Warm | Kept
//!  any live state ──▶ Evicted (stopped by the host) | Lost (died or hung, killed)
//! ```
//!
//! Every worker enters its states through [`Lifecycle::enter`], which refuses a
//! transition the table does not allow (logged: it is a host bug, not a user's).
//! The registry is what host status reports, so operators and tests see each
//! worker's state and how long it has been there.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use schemas::messages::{WorkerState, WorkerStatus};
use uuid::Uuid;

/// Whether a worker in `from` may go to `to` (staying put is always allowed).
pub fn allowed(from: WorkerState, to: WorkerState) -> bool {
    use WorkerState::*;
    if from == to {
        return !is_terminal(from);
    }
    match from {
        // a step that fails without breaking the worker leaves it idle (Warm, Kept)
        Preparing => matches!(to, Ready | Running | Warm | Kept | Evicted | Lost),
        // a prepared or kept worker is brought up to date (Preparing) before its cell
        Ready | Warm | Kept => matches!(to, Preparing | Evicted | Lost),
        Running => matches!(to, Saving | Warm | Kept | Evicted | Lost),
        Saving => matches!(to, Warm | Kept | Evicted | Lost),
        Evicted | Lost => false,
    }
}

/// Whether a worker in `state` is gone.
pub fn is_terminal(state: WorkerState) -> bool {
    matches!(state, WorkerState::Evicted | WorkerState::Lost)
}

/// A transition the table refuses.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("worker {worker}: {from:?} -> {to:?} is not a lifecycle transition")]
pub struct IllegalTransition {
    /// Worker id.
    pub worker: String,
    /// Where it was (None: unknown or already gone).
    pub from: Option<WorkerState>,
    /// Where it was asked to go.
    pub to: WorkerState,
}

struct Entry {
    pid: u32,
    session: Uuid,
    state: WorkerState,
    since: Instant,
}

/// This host's live workers and their states.
#[derive(Clone, Default)]
pub struct Lifecycle(Arc<Mutex<BTreeMap<String, Entry>>>);

impl Lifecycle {
    /// A new worker, freshly forked: Preparing.
    pub fn born(&self, worker: &str, pid: u32, session: Uuid) {
        let entry = Entry { pid, session, state: WorkerState::Preparing, since: Instant::now() };
        self.lock().insert(worker.to_string(), entry);
    }

    /// Move `worker` to `to` if the table allows it. A terminal state forgets it.
    pub fn enter(&self, worker: &str, to: WorkerState) -> Result<(), IllegalTransition> {
        let mut map = self.lock();
        let from = map.get(worker).map(|e| e.state);
        let illegal = || IllegalTransition { worker: worker.to_string(), from, to };
        let Some(e) = map.get_mut(worker) else { return Err(illegal()) };
        if e.state == to {
            return Ok(());
        }
        if !allowed(e.state, to) {
            return Err(illegal());
        }
        e.state = to;
        e.since = Instant::now();
        if is_terminal(to) {
            map.remove(worker);
        }
        Ok(())
    }

    /// `enter`, logging what the table refuses: a move from a known state is a host
    /// bug; a worker that already ended (the host stopped it while a step was in
    /// flight, or it was lost) simply stays ended.
    pub fn advance(&self, worker: &str, to: WorkerState) {
        match self.enter(worker, to) {
            Ok(()) => {}
            Err(e) if e.from.is_some() => tracing::error!(error = %e, "worker lifecycle"),
            Err(e) if !is_terminal(to) => tracing::debug!(error = %e, "worker already ended"),
            Err(_) => {}
        }
    }

    /// The state of `worker` (None once it is gone).
    pub fn state(&self, worker: &str) -> Option<WorkerState> {
        self.lock().get(worker).map(|e| e.state)
    }

    /// Every live worker, for host status.
    pub fn snapshot(&self) -> Vec<WorkerStatus> {
        self.lock()
            .iter()
            .map(|(id, e)| WorkerStatus {
                id: id.clone(),
                pid: e.pid,
                session: e.session,
                state: e.state,
                for_ms: e.since.elapsed().as_millis() as u64,
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        // a poisoned registry only means a panic elsewhere; the map itself is intact
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use WorkerState::*;

    const ALL: [WorkerState; 8] = [Preparing, Ready, Running, Saving, Warm, Kept, Evicted, Lost];

    #[test]
    fn every_live_state_can_end_and_nothing_leaves_an_end() {
        for s in ALL {
            if is_terminal(s) {
                assert!(ALL.iter().all(|&t| !allowed(s, t)), "{s:?} is terminal");
            } else {
                assert!(allowed(s, Evicted) && allowed(s, Lost), "{s:?} must be able to end");
            }
        }
    }

    #[test]
    fn a_cell_only_runs_after_preparation_and_saving_only_follows_running() {
        for s in ALL {
            assert_eq!(allowed(s, Running), s == Preparing || s == Running, "{s:?} -> Running");
            assert_eq!(allowed(s, Saving), s == Running || s == Saving, "{s:?} -> Saving");
        }
        // idle workers are brought up to date before their next cell
        for s in [Ready, Warm, Kept] {
            assert!(allowed(s, Preparing) && !allowed(s, Running));
        }
        assert!(!allowed(Ready, Warm) && !allowed(Preparing, Saving) && !allowed(Saving, Running));
    }

    #[test]
    fn the_registry_follows_a_worker_through_its_life() {
        let l = Lifecycle::default();
        let sid = Uuid::now_v7();
        l.born("w", 42, sid);
        for s in [Ready, Preparing, Running, Saving, Warm, Preparing, Running, Saving, Kept] {
            l.enter("w", s).unwrap();
            assert_eq!(l.state("w"), Some(s));
        }
        let err = l.enter("w", Saving).unwrap_err();
        assert_eq!(err, IllegalTransition { worker: "w".into(), from: Some(Kept), to: Saving });
        assert_eq!(l.state("w"), Some(Kept), "a refused transition changes nothing");
        let snap = l.snapshot();
        assert_eq!((snap.len(), snap[0].pid, snap[0].session, snap[0].state), (1, 42, sid, Kept));
        l.enter("w", Lost).unwrap();
        assert_eq!(l.state("w"), None);
        assert!(l.snapshot().is_empty());
        assert!(l.enter("w", Preparing).is_err(), "a lost worker does not come back");
    }
}
