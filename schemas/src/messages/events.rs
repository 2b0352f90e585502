//! A session's events for its clients (`session.{sid}.event`): what the planner
//! planned, what a host claimed, started, finished and saved, and how prepared
//! workers and GPU slots were used.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::frozen::SessionEventV1;
use super::recipe::Device;
use crate::codec::WireMessage;

/// How the worker that ran a cell was prepared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Prepare {
    /// Prepared while the user edited.
    Speculative,
    /// Prepared after Run.
    Cold,
    /// The session's persistent CPU worker.
    Persistent,
    /// The worker that holds unsavable variables the cell needs.
    Pinned,
    /// The worker kept warm after this cell ran before (a re-run).
    Warm,
}

impl Prepare {
    /// As reports spell it.
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

/// The outcome of a cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CellStatus {
    /// Ran to the end.
    Ok,
    /// Raised (the error output says what), or could not run.
    Error,
}

/// What happened to a session, for clients (`session.{sid}.event`). Version 2:
/// why a prepared worker ended and why a slot was held are enums (version 1 had
/// strings).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionEventV2 {
    /// The session.
    pub session: Uuid,
    /// The execution it is about (nil for session-wide events).
    pub exec_id: Uuid,
    /// When it happened (unix ms).
    pub unix_ms: u64,
    /// What happened.
    pub kind: EventKind,
}
wire!(SessionEventV2, "session-event", 2, upgrades SessionEventV1 from 1);

/// The kinds of session events.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum EventKind {
    /// The planner derived the recipe for a run (with a nil `exec_id`: for an edit,
    /// the recipe a prepared worker would follow).
    Planned {
        /// Cell id.
        cell_id: String,
        /// Closure variable names.
        closure: Vec<String>,
        /// Import closure.
        imports: Vec<String>,
        /// Device label.
        device: Device,
        /// Why.
        device_reason: String,
        /// Conservative reason, if any.
        conservative: Option<String>,
        /// Unsavable variables the cell needs, held by a pinned worker.
        pinned: Vec<String>,
    },
    /// A host won the claim and is preparing the worker.
    Claimed {
        /// Host id.
        host: String,
        /// GPU slot index, if a GPU cell.
        slot: Option<u32>,
        /// How the worker is prepared.
        prepare: Prepare,
    },
    /// The cell's first line is about to run.
    Started {
        /// Host id.
        host: String,
        /// GPU slot, if any.
        slot: Option<u32>,
        /// Worker id.
        worker: String,
        /// Device label.
        device: Device,
        /// How the worker was prepared.
        prepare: Prepare,
        /// The cell's execution count.
        execution_count: u32,
        /// Bytes restored for this cell.
        restored_bytes: u64,
        /// Preparation time on the host (claim to ready).
        prepare_ms: f64,
        /// Of that, restoring the closure: fetching its records and chunks into
        /// shared memory and loading them in the worker.
        restore_ms: f64,
        /// Closure variables restored or dropped after Run (for a prepared worker:
        /// the ones a cell that ran meanwhile changed; 0 is a clean hit).
        refreshed: u32,
        /// Whether the worker came from a zygote that had already imported the whole
        /// import closure (true for workers that lived on).
        import_hit: bool,
        /// The worker's Python version (a notebook's `language_info`).
        python: String,
        /// Where the host's part of the start delay went.
        phases: StartPhases,
    },
    /// The cell finished running (outputs are complete).
    Finished {
        /// Ok or error.
        status: CellStatus,
        /// `ename: evalue` of the error, if any.
        error: Option<String>,
        /// The cell's execution count.
        execution_count: u32,
        /// Time spent running the cell.
        run_ms: f64,
        /// How many outputs were published for the execution (clients wait for them).
        outputs: u64,
        /// Whether the cell initialised CUDA (the planner labels the cell GPU next time).
        cuda_used: bool,
        /// Names the cell reached that its closure missed (through eval/exec),
        /// brought in from the committed state while it ran; the planner restores
        /// them up front the next time the cell runs.
        faulted: Vec<String>,
    },
    /// The cell's state was committed; the slot is released.
    Saved {
        /// New manifest revision.
        revision: u64,
        /// Time spent saving.
        save_ms: f64,
        /// Bytes of all chunks written by the save.
        saved_bytes: u64,
        /// Chunks the store lacked and got.
        chunks_written: u64,
        /// Names now unsavable and held by this cell's worker.
        unsavable: Vec<String>,
        /// Whether the GPU slot (if any) was released.
        slot_released: bool,
    },
    /// The execution failed outside the cell (worker died, restore failed, …).
    Failed {
        /// What went wrong, naming what was lost.
        error: String,
    },
    /// A host prepared (or updated in place) a worker for a cell; nothing of the
    /// cell ran.
    Ready {
        /// Host id.
        host: String,
        /// GPU slot index, if any.
        slot: Option<u32>,
        /// Worker id.
        worker: String,
        /// Its process id on the host.
        pid: u32,
        /// The cell it is prepared for.
        cell_id: String,
        /// The recipe revision it matches.
        revision: u64,
        /// Speculative or warm.
        class: PreparedClass,
        /// Preparation time (what a run saves by finding it ready).
        prepare_ms: f64,
    },
    /// A prepared worker stopped being prepared: a run used it, or it was evicted
    /// or lost. `idle_ms` is the time it spent ready but unused.
    PreparedEnded {
        /// Host id.
        host: String,
        /// The GPU slot it held while waiting (None: prepared on the CPU, its
        /// idle time cost no GPU time).
        slot: Option<u32>,
        /// Worker id.
        worker: String,
        /// The cell it was prepared for.
        cell_id: String,
        /// Speculative or warm.
        class: PreparedClass,
        /// Slot time spent ready and idle.
        idle_ms: f64,
        /// Why it ended.
        outcome: PreparedOutcome,
    },
    /// A GPU slot was released (or a held worker lost); counts slot time.
    SlotReleased {
        /// Host id.
        host: String,
        /// Slot index.
        slot: u32,
        /// How long the slot was bound to the worker.
        held_ms: f64,
        /// What held the slot this long.
        reason: SlotUse,
    },
    /// A host began preparing (or updating in place) a worker for a cell's edit;
    /// `Ready` follows when it is done. Appended to version 2: a reader that does
    /// not know it drops this event alone (ADR 49).
    Preparing {
        /// Host id.
        host: String,
        /// GPU slot index, if it holds one while preparing.
        slot: Option<u32>,
        /// The cell it is prepared for.
        cell_id: String,
        /// The recipe revision it follows.
        revision: u64,
    },
}

/// Where a cell's start went on its host, from the run recipe's arrival to the
/// cell's first line (what bench/cold-start breaks the start delay into). Zero for a
/// step that did not happen (a prepared or kept worker forks nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StartPhases {
    /// Recipe received to claim won: the placement delay and the KV create.
    pub claim_ms: f64,
    /// Forking the worker from a zygote, to its hello (waiting for the zygote too).
    pub fork_ms: f64,
    /// Reading the session's manifest from the store: what the read took beyond
    /// the fork it overlaps (0 when it was read while the worker forked).
    pub manifest_ms: f64,
    /// Laying the closure's records and chunks out in shared memory.
    pub restore_file_ms: f64,
    /// In the worker: importing the import closure (the tail the zygote lacked).
    pub imports_ms: f64,
    /// In the worker: the rest of the restore (loading the closure, ambient state).
    pub load_ms: f64,
    /// Restore done to the worker's `started`: the run request and the worker
    /// getting to the cell.
    pub setup_ms: f64,
}

/// Why a prepared worker exists: prepared from an edit, or kept after its cell ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PreparedClass {
    /// Prepared speculatively from an edit.
    Speculative,
    /// Kept warm after running its cell (a re-run of the cell may use it).
    Warm,
}

/// Why a prepared worker stopped being prepared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PreparedOutcome {
    /// A run used it.
    Used,
    /// A newer recipe of its cell needs no prepared worker (a CPU cell, or one that
    /// must run where unsavable state lives).
    Superseded,
    /// The planner's budget stopped it.
    Evicted,
    /// A run on this host needed its slot.
    EvictedForRun,
    /// Its session was closed.
    SessionClosed,
    /// Its process died, or its preparation failed.
    Lost,
}

impl PreparedOutcome {
    /// As logs and reports spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            PreparedOutcome::Used => "used",
            PreparedOutcome::Superseded => "superseded",
            PreparedOutcome::Evicted => "evicted",
            PreparedOutcome::EvictedForRun => "evicted for a run",
            PreparedOutcome::SessionClosed => "session closed",
            PreparedOutcome::Lost => "lost",
        }
    }
}

/// What held a GPU slot (the time a `SlotReleased` counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SlotUse {
    /// A cell's execution (restore, run, save).
    Cell,
    /// A worker prepared or kept warm before a run.
    Speculation,
    /// A worker kept for variables that could not be saved.
    UnsavableState,
}

impl SlotUse {
    /// As logs and reports spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            SlotUse::Cell => "cell",
            SlotUse::Speculation => "speculation",
            SlotUse::UnsavableState => "unsavable state",
        }
    }
}
