//! Version 1 of the host status (`host-status` 1), frozen.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::messages::{self as live, HostStatusV2};

/// host -> anyone: a host's state, with only a count of its workers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostStatusV1 {
    /// Host id.
    pub host: String,
    /// GPU slots.
    pub slots: Vec<SlotStatus>,
    /// Whether the slots are real GPUs found with cudarc.
    pub real_gpus: bool,
    /// Zygotes.
    pub zygotes: Vec<ZygoteStatus>,
    /// Sessions whose persistent CPU worker lives here.
    pub cpu_sessions: Vec<Uuid>,
    /// Live worker processes.
    pub workers: u32,
    /// Bytes in the host's chunk cache.
    pub cache_bytes: u64,
    /// Workers forked from zygotes since the host started.
    pub forks: u64,
    /// When (unix ms).
    pub unix_ms: u64,
}

/// One GPU slot, as version 1 encodes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotStatus {
    /// Slot index on the host.
    pub index: u32,
    /// Device name.
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// The execution holding the slot.
    pub exec_id: Option<Uuid>,
    /// The session holding the slot.
    pub session: Option<Uuid>,
    /// Why the slot is held.
    pub held_for: Option<String>,
}

/// One zygote, as version 1 encodes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ZygoteStatus {
    /// Zygote id.
    pub id: String,
    /// Packages it imported.
    pub packages: Vec<String>,
    /// Packages found to initialise CUDA.
    pub cuda_unsafe: Vec<String>,
    /// Process id.
    pub pid: u32,
}

impl HostStatusV1 {
    /// The same status as version 2; a version 1 host named no worker states.
    pub fn upgrade(self) -> HostStatusV2 {
        HostStatusV2 {
            host: self.host,
            slots: self
                .slots
                .into_iter()
                .map(|s| live::SlotStatus {
                    index: s.index,
                    name: s.name,
                    memory_bytes: s.memory_bytes,
                    exec_id: s.exec_id,
                    session: s.session,
                    held_for: s.held_for,
                })
                .collect(),
            real_gpus: self.real_gpus,
            zygotes: self
                .zygotes
                .into_iter()
                .map(|z| live::ZygoteStatus { id: z.id, packages: z.packages, cuda_unsafe: z.cuda_unsafe, pid: z.pid })
                .collect(),
            cpu_sessions: self.cpu_sessions,
            workers: Vec::new(),
            cache_bytes: self.cache_bytes,
            forks: self.forks,
            unix_ms: self.unix_ms,
        }
    }
}
