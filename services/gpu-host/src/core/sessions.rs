//! What happens outside one run: a session deleted or culled for idleness, an
//! interrupt, claims lost to another host, the periodic tick, and stopping.

use std::collections::BTreeSet;

use schemas::clock::Clock;
use schemas::messages::{EventKind, PreparedOutcome, SlotUse};
use uuid::Uuid;

use super::runs::RunState;
use super::{Command, Facts, HostCore, ARRIVAL_MEMORY};
use crate::host::claims::ClaimKey;

impl<C: Clock + Clone> HostCore<C> {
    /// The session was deleted: its cells stop now, their slots are free at once
    /// (and the store refuses what a save under way would commit).
    pub(super) fn close_session(&mut self, session: Uuid, facts: &dyn Facts) {
        self.emit(Command::KillCells { session });
        for exec in self.runs.in_state(|s| *s == RunState::Pending) {
            if self.runs.get(exec).is_some_and(|r| r.recipe.session == session) {
                self.runs.set(exec, RunState::Gone);
            }
        }
        self.spec_waiting.retain(|(_, r)| r.session != session);
        self.runs_of_cell.retain(|(s, _), _| *s != session);
        self.claiming_prep.retain(|(s, _), _| *s != session);
        for key in self.prepared.of_session(session) {
            match self.prepared.get_mut(&key) {
                Some(p) if p.is_preparing() => p.stop_when_prepared(PreparedOutcome::SessionClosed),
                Some(_) => self.end_prepared(&key, PreparedOutcome::SessionClosed, facts),
                None => {}
            }
        }
        self.stop_kept(session);
    }

    /// Stop the workers this host keeps for `session` (its CPU worker, workers
    /// holding unsavable state), free their slots and give up its CPU claim: on a
    /// delete, or when the session is culled for idleness (its committed state
    /// stays; its next cell starts a fresh worker).
    pub(super) fn stop_kept(&mut self, session: Uuid) {
        for exec in self.runs.in_state(|s| *s == RunState::ForKept) {
            if self.runs.get(exec).is_some_and(|r| r.recipe.session == session) {
                self.runs.set(exec, RunState::Gone);
            }
        }
        for k in self.kept.remove_session(session) {
            self.stop_worker(&k.worker.id);
            self.release_slots(&k.slots, session, SlotUse::UnsavableState);
        }
        self.emit(Command::Release { key: ClaimKey::Cpu(session) });
        // its workers are stopped: its uid may serve another session (ADR 29)
        self.emit(Command::ReleaseUid { session });
        self.emit(Command::PublishStatus);
    }

    /// The user interrupted `exec`: a run waiting here never starts (one this host
    /// claimed fails now); one that runs gets SIGINT, and is killed after the grace
    /// period if it ignores it (the shell's interrupts).
    pub(super) fn interrupt(&mut self, session: Uuid, exec: Uuid) {
        self.emit(Command::Interrupt { exec_id: exec });
        match self.runs.get(exec).map(|r| r.state.clone()) {
            Some(RunState::Pending | RunState::ForCpuHost) => self.runs.set(exec, RunState::Gone),
            Some(RunState::Won) => {
                self.runs.set(exec, RunState::Gone);
                let error = schemas::messages::INTERRUPTED_BEFORE_START.to_string();
                self.emit(Command::Event { session, exec_id: exec, kind: EventKind::Failed { error } });
            }
            _ => {}
        }
    }

    /// Another host claimed `exec`: if it waits here unclaimed, it goes.
    pub(super) fn claimed_elsewhere(&mut self, exec: Uuid) {
        if self.runs.get(exec).is_some_and(|r| matches!(r.state, RunState::Pending | RunState::ForCpuHost)) {
            self.runs.set(exec, RunState::Gone);
        }
    }

    /// Claims this host held and lost when renewing them.
    pub(super) fn claims_lost(&mut self, keys: Vec<ClaimKey>) {
        for key in keys {
            if let ClaimKey::Cpu(session) = key {
                // another host took this host for lost and runs the session's CPU
                // cells now: this worker must not run any more of them
                tracing::warn!(%session, "another host took over this session's CPU worker");
                if let Some(id) = self.kept.cpu_worker(session).map(|k| k.worker.id.clone()) {
                    self.forget_kept(&id, true);
                }
            }
        }
    }

    /// The periodic tick: forget old arrivals, claim CPU runs whose worker's host
    /// was lost, end prepared workers that died, publish status, renew claims.
    pub(super) fn tick(&mut self, facts: &dyn Facts) {
        let now = self.clock.now();
        if let Some(before) = now.checked_sub(ARRIVAL_MEMORY) {
            self.runs.forget_older(before);
        }
        // CPU runs another host's worker should have taken: those still unclaimed
        // once that host is lost are claimed again (the claim takes it over)
        if self.peers.any_lost(now) {
            for exec in self.runs.waiting(|s| *s == RunState::ForCpuHost) {
                if let Some(recipe) = self.runs.get(exec).map(|r| r.recipe.clone()) {
                    self.claim_cpu(recipe);
                }
            }
        }
        for key in self.prepared.dead(facts) {
            tracing::warn!(session = %key.0, cell = %key.1, "a prepared worker died while waiting");
            self.end_prepared(&key, PreparedOutcome::Lost, facts);
        }
        self.emit(Command::PublishStatus);
        // every run this host holds, running, waiting for a slot or for a prepared
        // worker: an expired run claim could be taken again (by a host, or by an
        // interrupt), and the frontend takes a claim not renewed for a lost host
        let runs: BTreeSet<Uuid> = self.runs.in_state(RunState::held).into_iter().collect();
        let keys = self.kept.cpu_sessions().map(ClaimKey::Cpu).chain(runs.into_iter().map(ClaimKey::Run)).collect();
        self.emit(Command::Renew { keys });
    }

    /// The host is stopping (drained by its autoscaler, or shut down): it takes
    /// nothing new, so its prepared workers' runs would be refused here. It ends
    /// those no run has claimed now, and the planner, told, sends their runs to
    /// another host at once rather than after `PREPARED_FALLBACK`.
    pub(super) fn begin_stopping(&mut self, facts: &dyn Facts) {
        self.stopping = true;
        for key in self.prepared.keys() {
            self.evict_prepared(&key, facts);
        }
    }

    /// The host's executions ended: stop every worker it keeps or prepared.
    pub(super) fn stopped(&mut self) {
        self.stopping = true;
        let kept: Vec<String> = self.kept.drain().map(|k| k.worker.id).collect();
        let prepared: Vec<String> = self.prepared.drain().filter_map(|p| p.worker.map(|w| w.id)).collect();
        for id in kept.iter().chain(&prepared) {
            self.stop_worker(id);
        }
    }
}
