//! Workers kept between cells: each session's persistent CPU worker, and workers
//! that hold variables which could not be saved (cells needing them run there).

use std::collections::HashMap;

use uuid::Uuid;

/// One kept worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptWorker {
    /// The process.
    pub worker: super::WorkerRef,
    /// Its session.
    pub session: Uuid,
    /// The GPU slots it keeps: only while it holds GPU memory (ADR 51).
    pub slots: Vec<u32>,
    /// The session's CPU worker (kept for the session's life).
    pub persistent: bool,
}

/// Kept workers by id, and which one is each session's CPU worker.
#[derive(Debug, Default)]
pub struct KeptWorkers {
    by_id: HashMap<String, KeptWorker>,
    cpu: HashMap<Uuid, String>,
}

impl KeptWorkers {
    /// The kept worker with this id.
    pub fn get(&self, id: &str) -> Option<&KeptWorker> {
        self.by_id.get(id)
    }

    /// The session's CPU worker.
    pub fn cpu_worker(&self, session: Uuid) -> Option<&KeptWorker> {
        self.cpu.get(&session).and_then(|id| self.by_id.get(id))
    }

    /// Keep a worker (a persistent one becomes its session's CPU worker).
    pub fn keep(&mut self, id: String, kept: KeptWorker) {
        if kept.persistent {
            self.cpu.insert(kept.session, id.clone());
        }
        self.by_id.insert(id, kept);
    }

    /// A kept worker now holds these GPU slots (it used CUDA on them).
    pub fn hold_slots(&mut self, id: &str, slots: Vec<u32>) {
        if let Some(k) = self.by_id.get_mut(id) {
            k.slots = slots;
        }
    }

    /// Stop keeping a worker.
    pub fn remove(&mut self, id: &str) -> Option<KeptWorker> {
        self.cpu.retain(|_, w| w != id);
        self.by_id.remove(id)
    }

    /// Stop keeping every worker of a session.
    pub fn remove_session(&mut self, session: Uuid) -> Vec<KeptWorker> {
        self.cpu.remove(&session);
        let ids: Vec<String> =
            self.by_id.iter().filter(|(_, k)| k.session == session).map(|(id, _)| id.clone()).collect();
        ids.iter().filter_map(|id| self.by_id.remove(id)).collect()
    }

    /// Whether it keeps no worker.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Sessions whose CPU worker lives here.
    pub fn cpu_sessions(&self) -> impl Iterator<Item = Uuid> + '_ {
        self.cpu.keys().copied()
    }

    /// Every kept worker (shutdown).
    pub fn drain(&mut self) -> impl Iterator<Item = KeptWorker> + '_ {
        self.cpu.clear();
        self.by_id.drain().map(|(_, k)| k)
    }
}
