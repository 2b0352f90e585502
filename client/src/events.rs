//! The public JSON of a session's events, as `GET /v1/sessions/{sid}/events`
//! serves them inside `{"type": "event", ...}` items: snake_case names and values,
//! documented here, and mapped from the bus messages in one place
//! ([`Event::from`]). The bus types may change between versions; these change
//! only additively within `/v1` (new fields, new kinds), so clients ignore what
//! they do not know (ADR 28).

use schemas::messages as bus;
use serde::{Deserialize, Serialize};

/// The version of this JSON within `/v1`, raised when something is added.
pub const EVENTS_VERSION: u32 = 2;

/// What happened to an execution (or to a prepared worker of the session).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// The planner derived the recipe for a run (with a nil `exec_id`: for an edit,
    /// the recipe a prepared worker would follow).
    Planned {
        /// The cell.
        cell_id: String,
        /// The variables the cell needs (its closure).
        closure: Vec<String>,
        /// The modules it needs imported.
        imports: Vec<String>,
        /// Where it runs.
        device: Device,
        /// Why there.
        device_reason: String,
        /// Why the closure is the whole namespace, if it is.
        conservative: Option<String>,
        /// Unsavable variables it needs, held by a pinned worker.
        pinned: Vec<String>,
    },
    /// A host took the run and prepares its worker.
    Claimed {
        /// The host.
        host: String,
        /// Its GPU slot, if a GPU cell.
        slot: Option<u32>,
        /// How the worker is prepared.
        prepare: Prepare,
    },
    /// The cell's first line is about to run.
    Started {
        /// The host.
        host: String,
        /// The GPU slot, if any.
        slot: Option<u32>,
        /// The worker.
        worker: String,
        /// Where it runs.
        device: Device,
        /// How the worker was prepared.
        prepare: Prepare,
        /// The cell's execution count.
        execution_count: u32,
        /// Bytes restored for it.
        restored_bytes: u64,
        /// Host time from claim to a ready worker.
        prepare_ms: f64,
        /// Of that, restoring the closure.
        restore_ms: f64,
        /// Closure variables restored after Run (0 on a prepared worker: a clean hit).
        refreshed: u32,
        /// The worker's zygote had imported the whole import closure.
        import_hit: bool,
        /// The worker's Python version.
        python: String,
        /// Where the host's part of the start delay went.
        phases: StartPhases,
    },
    /// The cell finished running; its outputs are complete.
    Finished {
        /// Ok or error.
        status: CellStatus,
        /// `ename: evalue` of its error, if any.
        error: Option<String>,
        /// The cell's execution count.
        execution_count: u32,
        /// Time spent running it.
        run_ms: f64,
        /// How many outputs it published.
        outputs: u64,
        /// Whether it initialised CUDA.
        cuda_used: bool,
        /// Names it reached that its closure missed (brought in while it ran).
        faulted: Vec<String>,
    },
    /// What the cell changed was committed.
    Saved {
        /// The session's new revision.
        revision: u64,
        /// Time spent saving.
        save_ms: f64,
        /// Bytes of the chunks written.
        saved_bytes: u64,
        /// Chunks the store lacked and got.
        chunks_written: u64,
        /// Names that could not be saved, held by this cell's worker.
        unsavable: Vec<String>,
        /// Whether its GPU slot (if any) was released.
        slot_released: bool,
    },
    /// The execution failed outside the cell (its worker died, its restore or
    /// save failed); nothing of it was committed.
    Failed {
        /// What went wrong.
        error: String,
    },
    /// A worker was prepared for a cell (nothing of the cell ran).
    Ready {
        /// The host.
        host: String,
        /// The GPU slot it holds, if any.
        slot: Option<u32>,
        /// The worker.
        worker: String,
        /// Its process id on the host.
        pid: u32,
        /// The cell it is prepared for.
        cell_id: String,
        /// The recipe revision it matches.
        revision: u64,
        /// Speculative or warm.
        class: PreparedClass,
        /// Preparation time.
        prepare_ms: f64,
    },
    /// A prepared worker stopped being prepared.
    PreparedEnded {
        /// The host.
        host: String,
        /// The GPU slot it held while waiting (None: prepared on the CPU).
        slot: Option<u32>,
        /// The worker.
        worker: String,
        /// The cell it was prepared for.
        cell_id: String,
        /// Speculative or warm.
        class: PreparedClass,
        /// Time it spent ready and unused.
        idle_ms: f64,
        /// Why it ended.
        outcome: PreparedOutcome,
    },
    /// A GPU slot was released.
    SlotReleased {
        /// The host.
        host: String,
        /// The slot.
        slot: u32,
        /// How long it was held.
        held_ms: f64,
        /// What held it.
        reason: SlotUse,
    },
    /// A host began preparing a worker for a cell's edit (`ready` follows).
    Preparing {
        /// The host.
        host: String,
        /// Its GPU slot, if it holds one while preparing.
        slot: Option<u32>,
        /// The cell.
        cell_id: String,
        /// The recipe revision it follows.
        revision: u64,
    },
    /// A kind this client does not know (a newer frontend's): skip it.
    #[serde(other)]
    Other,
}

/// Where a cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The session's persistent CPU worker.
    Cpu,
    /// A worker bound to one GPU slot for the cell.
    Gpu,
}

/// How the worker that runs a cell was prepared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Prepare {
    /// While the user edited.
    Speculative,
    /// After Run.
    Cold,
    /// The session's persistent CPU worker.
    Persistent,
    /// The worker holding unsavable variables the cell needs.
    Pinned,
    /// Kept warm after the cell ran before.
    Warm,
}

/// The cell's own outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CellStatus {
    /// Ran to the end.
    Ok,
    /// Raised.
    Error,
}

/// Why a prepared worker existed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PreparedClass {
    /// Prepared from an edit.
    Speculative,
    /// Kept after its cell ran.
    Warm,
}

/// Why a prepared worker ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PreparedOutcome {
    /// A run used it.
    Used,
    /// A newer edit's worker replaced it.
    Superseded,
    /// Evicted (budget, idle).
    Evicted,
    /// Evicted to free a slot for a run.
    EvictedForRun,
    /// Its session closed.
    SessionClosed,
    /// It died.
    Lost,
}

/// What held a GPU slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SlotUse {
    /// A cell ran.
    Cell,
    /// A worker prepared speculatively.
    Speculation,
    /// A worker holding unsavable state.
    UnsavableState,
}

/// Where a cell's start went on its host (ms; 0 for a step that did not happen).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StartPhases {
    /// Recipe received to claim won.
    pub claim_ms: f64,
    /// Forking the worker from a zygote.
    pub fork_ms: f64,
    /// Reading the session's manifest.
    pub manifest_ms: f64,
    /// Laying the closure out in shared memory.
    pub restore_file_ms: f64,
    /// Importing what the zygote lacked.
    pub imports_ms: f64,
    /// Loading the closure in the worker.
    pub load_ms: f64,
    /// The rest of the worker's setup.
    pub setup_ms: f64,
}

impl From<&bus::EventKind> for Event {
    fn from(kind: &bus::EventKind) -> Self {
        use bus::EventKind as K;
        match kind.clone() {
            K::Planned { cell_id, closure, imports, device, device_reason, conservative, pinned } => {
                Event::Planned { cell_id, closure, imports, device: device.into(), device_reason, conservative, pinned }
            }
            K::Claimed { host, slot, prepare } => Event::Claimed { host, slot, prepare: prepare.into() },
            K::Started {
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
                phases,
            } => Event::Started {
                host,
                slot,
                worker,
                device: device.into(),
                prepare: prepare.into(),
                execution_count,
                restored_bytes,
                prepare_ms,
                restore_ms,
                refreshed,
                import_hit,
                python,
                phases: phases.into(),
            },
            K::Finished { status, error, execution_count, run_ms, outputs, cuda_used, faulted } => {
                Event::Finished { status: status.into(), error, execution_count, run_ms, outputs, cuda_used, faulted }
            }
            K::Saved { revision, save_ms, saved_bytes, chunks_written, unsavable, slot_released } => {
                Event::Saved { revision, save_ms, saved_bytes, chunks_written, unsavable, slot_released }
            }
            K::Failed { error } => Event::Failed { error },
            K::Ready { host, slot, worker, pid, cell_id, revision, class, prepare_ms } => {
                Event::Ready { host, slot, worker, pid, cell_id, revision, class: class.into(), prepare_ms }
            }
            K::PreparedEnded { host, slot, worker, cell_id, class, idle_ms, outcome } => Event::PreparedEnded {
                host,
                slot,
                worker,
                cell_id,
                class: class.into(),
                idle_ms,
                outcome: outcome.into(),
            },
            K::SlotReleased { host, slot, held_ms, reason } => {
                Event::SlotReleased { host, slot, held_ms, reason: reason.into() }
            }
            K::Preparing { host, slot, cell_id, revision } => Event::Preparing { host, slot, cell_id, revision },
        }
    }
}

impl From<bus::Device> for Device {
    fn from(d: bus::Device) -> Self {
        match d {
            bus::Device::Cpu => Device::Cpu,
            bus::Device::Gpu => Device::Gpu,
        }
    }
}

impl From<bus::Prepare> for Prepare {
    fn from(p: bus::Prepare) -> Self {
        match p {
            bus::Prepare::Speculative => Prepare::Speculative,
            bus::Prepare::Cold => Prepare::Cold,
            bus::Prepare::Persistent => Prepare::Persistent,
            bus::Prepare::Pinned => Prepare::Pinned,
            bus::Prepare::Warm => Prepare::Warm,
        }
    }
}

impl From<bus::CellStatus> for CellStatus {
    fn from(s: bus::CellStatus) -> Self {
        match s {
            bus::CellStatus::Ok => CellStatus::Ok,
            bus::CellStatus::Error => CellStatus::Error,
        }
    }
}

impl From<bus::PreparedClass> for PreparedClass {
    fn from(c: bus::PreparedClass) -> Self {
        match c {
            bus::PreparedClass::Speculative => PreparedClass::Speculative,
            bus::PreparedClass::Warm => PreparedClass::Warm,
        }
    }
}

impl From<bus::PreparedOutcome> for PreparedOutcome {
    fn from(o: bus::PreparedOutcome) -> Self {
        match o {
            bus::PreparedOutcome::Used => PreparedOutcome::Used,
            bus::PreparedOutcome::Superseded => PreparedOutcome::Superseded,
            bus::PreparedOutcome::Evicted => PreparedOutcome::Evicted,
            bus::PreparedOutcome::EvictedForRun => PreparedOutcome::EvictedForRun,
            bus::PreparedOutcome::SessionClosed => PreparedOutcome::SessionClosed,
            bus::PreparedOutcome::Lost => PreparedOutcome::Lost,
        }
    }
}

impl From<bus::SlotUse> for SlotUse {
    fn from(u: bus::SlotUse) -> Self {
        match u {
            bus::SlotUse::Cell => SlotUse::Cell,
            bus::SlotUse::Speculation => SlotUse::Speculation,
            bus::SlotUse::UnsavableState => SlotUse::UnsavableState,
        }
    }
}

impl From<bus::StartPhases> for StartPhases {
    fn from(p: bus::StartPhases) -> Self {
        let bus::StartPhases { claim_ms, fork_ms, manifest_ms, restore_file_ms, imports_ms, load_ms, setup_ms } = p;
        StartPhases { claim_ms, fork_ms, manifest_ms, restore_file_ms, imports_ms, load_ms, setup_ms }
    }
}

impl Prepare {
    /// As reports spell it (the JSON value).
    pub fn as_str(self) -> &'static str {
        match self {
            Prepare::Speculative => "speculative",
            Prepare::Cold => "cold",
            Prepare::Persistent => "persistent",
            Prepare::Pinned => "pinned",
            Prepare::Warm => "warm",
        }
    }
}

impl Device {
    /// As reports spell it (the JSON value).
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documented shape: snake_case kinds and values, nothing of the bus's
    /// Rust names. A change here breaks clients: add, never rename.
    #[test]
    fn events_serialize_as_documented() {
        let claimed = Event::from(&bus::EventKind::Claimed {
            host: "host-0".into(),
            slot: Some(1),
            prepare: bus::Prepare::Speculative,
        });
        assert_eq!(
            serde_json::to_value(&claimed).unwrap(),
            serde_json::json!({"kind": "claimed", "host": "host-0", "slot": 1, "prepare": "speculative"})
        );
        let ended = Event::from(&bus::EventKind::PreparedEnded {
            host: "h".into(),
            slot: None,
            worker: "w".into(),
            cell_id: "c".into(),
            class: bus::PreparedClass::Warm,
            idle_ms: 2.5,
            outcome: bus::PreparedOutcome::EvictedForRun,
        });
        let json = serde_json::to_value(&ended).unwrap();
        assert_eq!(json["kind"], "prepared_ended");
        assert_eq!((json["class"].as_str(), json["outcome"].as_str()), (Some("warm"), Some("evicted_for_run")));
        let finished = Event::from(&bus::EventKind::Finished {
            status: bus::CellStatus::Error,
            error: Some("ValueError: x".into()),
            execution_count: 3,
            run_ms: 1.0,
            outputs: 2,
            cuda_used: false,
            faulted: vec![],
        });
        let json = serde_json::to_value(&finished).unwrap();
        assert_eq!((json["kind"].as_str(), json["status"].as_str()), (Some("finished"), Some("error")));
        // and reads back
        assert_eq!(serde_json::from_value::<Event>(json).unwrap(), finished);
    }
}
