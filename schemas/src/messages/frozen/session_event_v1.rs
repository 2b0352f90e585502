//! Version 1 of the session event (`session-event` 1), frozen: outcomes and slot
//! reasons were strings. The events stream keeps a day of events, so a replay may
//! still meet these.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::messages::{self as live, PreparedOutcome, SessionEventV2, SlotUse};

/// What happened to a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionEventV1 {
    /// The session.
    pub session: Uuid,
    /// The execution it is about (nil for session-wide events).
    pub exec_id: Uuid,
    /// When it happened (unix ms).
    pub unix_ms: u64,
    /// What happened.
    pub kind: EventKind,
}

/// Where a cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Device {
    /// The session's CPU worker.
    Cpu,
    /// A GPU slot.
    Gpu,
}

/// How the worker that ran a cell was prepared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Prepare {
    /// While the user edited.
    Speculative,
    /// After Run.
    Cold,
    /// The session's CPU worker.
    Persistent,
    /// The worker holding unsavable variables.
    Pinned,
    /// Kept warm after the cell ran before.
    Warm,
}

/// The outcome of a cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CellStatus {
    /// Ran to the end.
    Ok,
    /// Raised, or could not run.
    Error,
}

/// Why a prepared worker exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PreparedClass {
    /// From an edit.
    Speculative,
    /// Kept after its cell ran.
    Warm,
}

/// The kinds of session events, as version 1 encodes them (each field is
/// documented on the live `EventKind`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum EventKind {
    Planned {
        cell_id: String,
        closure: Vec<String>,
        imports: Vec<String>,
        device: Device,
        device_reason: String,
        conservative: Option<String>,
        pinned: Vec<String>,
    },
    Claimed {
        host: String,
        slot: Option<u32>,
        prepare: Prepare,
    },
    Started {
        host: String,
        slot: Option<u32>,
        worker: String,
        device: Device,
        prepare: Prepare,
        execution_count: u32,
        restored_bytes: u64,
        prepare_ms: f64,
        restore_ms: f64,
        refreshed: u32,
        import_hit: bool,
        python: String,
    },
    Finished {
        status: CellStatus,
        error: Option<String>,
        execution_count: u32,
        run_ms: f64,
        outputs: u64,
        cuda_used: bool,
        faulted: Vec<String>,
    },
    Saved {
        revision: u64,
        save_ms: f64,
        saved_bytes: u64,
        chunks_written: u64,
        unsavable: Vec<String>,
        slot_released: bool,
    },
    Failed {
        error: String,
    },
    Ready {
        host: String,
        slot: Option<u32>,
        worker: String,
        pid: u32,
        cell_id: String,
        revision: u64,
        class: PreparedClass,
        prepare_ms: f64,
    },
    PreparedEnded {
        host: String,
        slot: Option<u32>,
        worker: String,
        cell_id: String,
        class: PreparedClass,
        idle_ms: f64,
        /// "used", "evicted", "evicted for a run", "superseded", "session closed"
        /// or "lost".
        outcome: String,
    },
    SlotReleased {
        host: String,
        slot: u32,
        held_ms: f64,
        /// "cell", "speculation" or "unsavable state".
        reason: String,
    },
}

impl SessionEventV1 {
    /// The same event as version 2.
    pub fn upgrade(self) -> SessionEventV2 {
        SessionEventV2 {
            session: self.session,
            exec_id: self.exec_id,
            unix_ms: self.unix_ms,
            kind: self.kind.upgrade(),
        }
    }
}

impl Device {
    fn upgrade(self) -> live::Device {
        match self {
            Device::Cpu => live::Device::Cpu,
            Device::Gpu => live::Device::Gpu,
        }
    }
}

impl Prepare {
    fn upgrade(self) -> live::Prepare {
        match self {
            Prepare::Speculative => live::Prepare::Speculative,
            Prepare::Cold => live::Prepare::Cold,
            Prepare::Persistent => live::Prepare::Persistent,
            Prepare::Pinned => live::Prepare::Pinned,
            Prepare::Warm => live::Prepare::Warm,
        }
    }
}

impl PreparedClass {
    fn upgrade(self) -> live::PreparedClass {
        match self {
            PreparedClass::Speculative => live::PreparedClass::Speculative,
            PreparedClass::Warm => live::PreparedClass::Warm,
        }
    }
}

/// A version 1 outcome; the strings were only ever these (a stranger one ended the
/// worker without a run using it, like an eviction).
fn outcome(s: &str) -> PreparedOutcome {
    match s {
        "used" => PreparedOutcome::Used,
        "superseded" => PreparedOutcome::Superseded,
        "evicted for a run" => PreparedOutcome::EvictedForRun,
        "session closed" => PreparedOutcome::SessionClosed,
        "lost" => PreparedOutcome::Lost,
        _ => PreparedOutcome::Evicted,
    }
}

/// A version 1 slot reason; anything else held the slot for a cell.
fn slot_use(s: &str) -> SlotUse {
    match s {
        "speculation" => SlotUse::Speculation,
        "unsavable state" => SlotUse::UnsavableState,
        _ => SlotUse::Cell,
    }
}

impl EventKind {
    fn upgrade(self) -> live::EventKind {
        use live::EventKind as E;
        match self {
            EventKind::Planned { cell_id, closure, imports, device, device_reason, conservative, pinned } => {
                E::Planned { cell_id, closure, imports, device: device.upgrade(), device_reason, conservative, pinned }
            }
            EventKind::Claimed { host, slot, prepare } => E::Claimed { host, slot, prepare: prepare.upgrade() },
            EventKind::Started {
                host,
                slot,
                worker,
                device,
                prepare,
                execution_count,
                restored_bytes,
                prepare_ms,
                restore_ms,
                refreshed,
                import_hit,
                python,
            } => E::Started {
                host,
                slot,
                worker,
                device: device.upgrade(),
                prepare: prepare.upgrade(),
                execution_count,
                restored_bytes,
                prepare_ms,
                restore_ms,
                refreshed,
                import_hit,
                python,
                phases: live::StartPhases::default(),
            },
            EventKind::Finished { status, error, execution_count, run_ms, outputs, cuda_used, faulted } => {
                let status = match status {
                    CellStatus::Ok => live::CellStatus::Ok,
                    CellStatus::Error => live::CellStatus::Error,
                };
                E::Finished { status, error, execution_count, run_ms, outputs, cuda_used, faulted }
            }
            EventKind::Saved { revision, save_ms, saved_bytes, chunks_written, unsavable, slot_released } => {
                E::Saved { revision, save_ms, saved_bytes, chunks_written, unsavable, slot_released }
            }
            EventKind::Failed { error } => E::Failed { error },
            EventKind::Ready { host, slot, worker, pid, cell_id, revision, class, prepare_ms } => {
                E::Ready { host, slot, worker, pid, cell_id, revision, class: class.upgrade(), prepare_ms }
            }
            EventKind::PreparedEnded { host, slot, worker, cell_id, class, idle_ms, outcome: o } => {
                E::PreparedEnded { host, slot, worker, cell_id, class: class.upgrade(), idle_ms, outcome: outcome(&o) }
            }
            EventKind::SlotReleased { host, slot, held_ms, reason } => {
                E::SlotReleased { host, slot, held_ms, reason: slot_use(&reason) }
            }
        }
    }
}
