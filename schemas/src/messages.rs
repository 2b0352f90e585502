//! The current messages, one per arrow in DESIGN.md section 3.
//!
//! Each struct is frozen once shipped: a change is a new `…V2` struct, a new
//! `VERSION`, and an upgrade from the old one in `decode_version`. The old version
//! then moves to [`frozen`], in a file of its own that holds copies of every type it
//! encodes (never a live type, whose edits would silently change its bytes), and a
//! golden-bytes test pins its encoding. Never use serde's `skip_serializing_if`
//! here: bincode cannot skip fields.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::checkpoint::{Delta, Manifest};
use crate::codec::WireMessage;

pub mod frozen;
pub use frozen::{ChunkPlanV1, CommitV1, HostStatusV1, ManifestGetV1, RecipeV1, RecipeV2, RunV1, SessionEventV1};

macro_rules! wire {
    ($ty:ty, $name:literal, $version:literal) => {
        impl WireMessage for $ty {
            const TYPE: &'static str = $name;
            const VERSION: u16 = $version;
        }
    };
    // The current version, which also reads a frozen older one through its `upgrade`.
    ($ty:ty, $name:literal, $version:literal, upgrades $old:ident from $old_version:literal) => {
        impl WireMessage for $ty {
            const TYPE: &'static str = $name;
            const VERSION: u16 = $version;

            fn decode_version(version: u16, payload: &[u8]) -> Result<Self, crate::codec::CodecError> {
                match version {
                    $version => crate::codec::decode_bincode(payload),
                    $old_version => crate::codec::decode_bincode::<$old>(payload).map($old::upgrade),
                    _ => Err(crate::codec::CodecError::UnsupportedVersion { ty: Self::TYPE, version }),
                }
            }
        }
    };
    // Two versions back: the oldest upgrades to the older, which upgrades to the current.
    ($ty:ty, $name:literal, $version:literal, upgrades $old:ident from $old_version:literal,
     $older:ident from $older_version:literal) => {
        impl WireMessage for $ty {
            const TYPE: &'static str = $name;
            const VERSION: u16 = $version;

            fn decode_version(version: u16, payload: &[u8]) -> Result<Self, crate::codec::CodecError> {
                match version {
                    $version => crate::codec::decode_bincode(payload),
                    $old_version => crate::codec::decode_bincode::<$old>(payload).map($old::upgrade),
                    $older_version => crate::codec::decode_bincode::<$older>(payload).map(|m| m.upgrade().upgrade()),
                    _ => Err(crate::codec::CodecError::UnsupportedVersion { ty: Self::TYPE, version }),
                }
            }
        }
    };
}

/// Where a cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// On the session's persistent CPU worker.
    Cpu,
    /// On a freshly prepared worker bound to one GPU slot.
    Gpu,
}

impl Device {
    /// "cpu" or "gpu", as reports spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }
}

/// frontend -> planner: the code of a cell changed (`session.{sid}.edit`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EditV1 {
    /// The session.
    pub session: Uuid,
    /// The notebook's id for the cell.
    pub cell_id: String,
    /// The cell's full code after the edit.
    pub code: String,
    /// Per-cell edit sequence number; older edits are dropped.
    pub seq: u64,
    /// The session's options (device labelling and speculation follow them).
    pub options: SessionOptions,
}
wire!(EditV1, "edit", 1);

/// Session options a run carries, so every service sees the same ones.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionOptions {
    /// Working directory of the session's cells (the notebook's folder).
    pub cwd: String,
    /// Treat every code cell as a GPU cell.
    pub all_gpu: bool,
    /// Prepare workers while cells are edited (DESIGN.md section 4, step 3).
    pub speculate: bool,
}

/// frontend -> planner: run a cell now (`session.{sid}.run`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunV2 {
    /// The session.
    pub session: Uuid,
    /// This execution.
    pub exec_id: Uuid,
    /// The notebook's id for the cell.
    pub cell_id: String,
    /// The code submitted with Run.
    pub code: String,
    /// When the frontend received Run (unix ms).
    pub run_unix_ms: u64,
    /// Manifest revision committed by the session's previous cell; the planner
    /// resolves the closure against at least this revision.
    pub after_revision: u64,
    /// Session options.
    pub options: SessionOptions,
    /// Jupyter's `user_expressions`: name -> expression, evaluated after the cell
    /// if it succeeds, in its namespace; the results are an output of the cell.
    pub user_expressions: BTreeMap<String, String>,
}
wire!(RunV2, "run", 2, upgrades RunV1 from 1);

/// Why a recipe was published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecipeKind {
    /// Derived from an edit; hosts may prepare a worker for it.
    Speculative,
    /// Derived from Run; exactly one host must run it.
    Run,
}

/// One variable of a state closure, at the version the cell needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClosureVar {
    /// The variable's name.
    pub name: String,
    /// The execution that last defined it.
    pub version: Uuid,
}

/// A worker that holds variables which cannot be saved; cells needing them run there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedWorker {
    /// The host that keeps the worker.
    pub host: String,
    /// The worker's id on that host.
    pub worker: String,
    /// The unsavable names the cell needs from it.
    pub names: Vec<String>,
}

/// A worker a host prepared for a cell before Run; a run recipe names it so that
/// its host runs the cell there and the other hosts stand back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedWorker {
    /// The host that holds it.
    pub host: String,
    /// The worker's id on that host.
    pub worker: String,
}

/// Why a prepared worker exists: prepared from an edit, or kept after its cell ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PreparedClass {
    /// Prepared speculatively from an edit.
    Speculative,
    /// Kept warm after running its cell (a re-run of the cell may use it).
    Warm,
}

/// planner -> all hosts: what a cell needs (`session.{sid}.recipe`). Version 3:
/// a GPU cell may ask for several slots (`gpus`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecipeV3 {
    /// The session.
    pub session: Uuid,
    /// The cell.
    pub cell_id: String,
    /// Speculative (from an edit) or run.
    pub kind: RecipeKind,
    /// For a run recipe, the execution; for a speculative one, nil.
    pub exec_id: Uuid,
    /// Per-cell recipe revision (increases whenever the recipe changes).
    pub revision: u64,
    /// The code (run recipes execute it; preparation never does).
    pub code: String,
    /// Hash of the code the recipe was derived from.
    pub code_hash: u64,
    /// The state closure, with versions.
    pub closure: Vec<ClosureVar>,
    /// The import closure: modules to import before restoring.
    pub imports: Vec<String>,
    /// Where the cell runs.
    pub device: Device,
    /// The GPU slots the cell needs, all on one host: 1 for a GPU cell unless its
    /// `%%gpu N` asks for more; 0 for a CPU cell.
    pub gpus: u32,
    /// Why that device.
    pub device_reason: String,
    /// Set when the closure is the whole namespace, with the reason.
    pub conservative: Option<String>,
    /// Set when the cell needs unsavable variables held by one worker.
    pub pinned: Option<PinnedWorker>,
    /// Manifest revision the closure was resolved against.
    pub manifest_revision: u64,
    /// When the frontend received Run (unix ms; 0 for speculative).
    pub run_unix_ms: u64,
    /// Session options.
    pub options: SessionOptions,
    /// For a run: the worker prepared for this cell, if the planner knows of one.
    pub prepared: Option<PreparedWorker>,
    /// For an edit-derived recipe: the speculator admitted it, so a host may prepare
    /// a worker (or update the one it prepared) for it.
    pub speculate: bool,
    /// For a run: the run's `user_expressions` (see `RunV2`).
    pub user_expressions: BTreeMap<String, String>,
}
wire!(RecipeV3, "recipe", 3, upgrades RecipeV2 from 2, RecipeV1 from 1);

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

/// worker's host -> frontend: one cell output (`output.{sid}.{exec}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputV1 {
    /// The session.
    pub session: Uuid,
    /// The execution.
    pub exec_id: Uuid,
    /// Order within the execution.
    pub seq: u64,
    /// One nbformat v4 output, as JSON (or piece `part` of it).
    pub output_json: String,
    /// An output larger than one message piece (`OUTPUT_PART_BYTES`) travels as
    /// `parts` pieces of its JSON text, in order; this is piece `part` (0-based).
    pub part: u32,
    /// How many pieces the output has (1 for most).
    pub parts: u32,
}
wire!(OutputV1, "output", 1);

/// Largest piece of an output's JSON per message: under the bus's inline limit
/// (ADR 30), so outputs stay in the outputs stream itself, never as bodies.
pub const OUTPUT_PART_BYTES: usize = 192 * 1024;

impl OutputV1 {
    /// The messages that carry one output: one, or pieces of at most `max` bytes
    /// cut at character boundaries.
    pub fn pieces(session: Uuid, exec_id: Uuid, seq: u64, json: String, max: usize) -> Vec<OutputV1> {
        if json.len() <= max {
            return vec![OutputV1 { session, exec_id, seq, output_json: json, part: 0, parts: 1 }];
        }
        let mut cuts = Vec::new();
        let mut start = 0;
        while start < json.len() {
            let mut end = (start + max.max(4)).min(json.len());
            while !json.is_char_boundary(end) {
                end -= 1;
            }
            cuts.push(json[start..end].to_string());
            start = end;
        }
        let parts = cuts.len() as u32;
        cuts.into_iter()
            .enumerate()
            .map(|(i, piece)| OutputV1 { session, exec_id, seq, output_json: piece, part: i as u32, parts })
            .collect()
    }
}

/// frontend -> everyone: the session was deleted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionCloseV1 {
    /// The session.
    pub session: Uuid,
}
wire!(SessionCloseV1, "session-close", 1);

/// frontend -> hosts: the session was idle long enough to be culled. Its state
/// stays in the store and the session can be reopened; hosts stop the workers they
/// keep for it (its CPU worker, workers holding unsavable state) and free their slots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionIdleV1 {
    /// The session.
    pub session: Uuid,
}
wire!(SessionIdleV1, "session-idle", 1);

/// What a run interrupted before it started ends with, whoever ends it (the
/// frontend, when no host had claimed it; the host that had).
pub const INTERRUPTED_BEFORE_START: &str = "KeyboardInterrupt: the cell was interrupted before it started; nothing \
     of it ran, the session keeps its last committed state";

/// frontend -> hosts: stop execution `exec_id` of the session (the user pressed
/// interrupt). The host running it sends SIGINT to the worker's process group and
/// kills the group if the cell has not ended after its grace period; a host that
/// has not started the cell never starts it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InterruptV1 {
    /// The session.
    pub session: Uuid,
    /// The execution to stop.
    pub exec_id: Uuid,
}
wire!(InterruptV1, "interrupt", 1);

/// frontend -> hosts: the answer to a running cell's `input()` or `getpass()`
/// (`session.{sid}.input`). The host running execution `exec_id` hands it to the
/// worker waiting on it; other hosts drop it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InputReplyV1 {
    /// The session.
    pub session: Uuid,
    /// The execution whose cell asked.
    pub exec_id: Uuid,
    /// What the user typed (without the newline).
    pub value: String,
    /// Set when no one can answer (the run's client has no stdin channel): the
    /// cell gets StdinNotImplementedError with this text, as in a kernel.
    pub refused: Option<String>,
}
wire!(InputReplyV1, "input-reply", 1);

/// The `output_type` of the output that asks a run's client for a line of input
/// (`{"output_type", "prompt", "password"}`; a Jupyter stdin request, never a
/// notebook output): the host makes it, the frontend and the kernel read it.
pub const INPUT_REQUEST_OUTPUT: &str = "input_request";

/// Why a cell's `input()` gets no answer when its run's client has no stdin
/// channel (ipykernel's words, after "raw_input was called, but ").
pub const NO_STDIN: &str = "this frontend does not support input requests.";

/// One GPU slot as a host reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotStatus {
    /// Slot index on the host.
    pub index: u32,
    /// Device name ("virtual" for CPU-backed slots).
    pub name: String,
    /// Device memory in bytes (0 if virtual).
    pub memory_bytes: u64,
    /// The execution holding the slot, if any.
    pub exec_id: Option<Uuid>,
    /// The session holding the slot, if any.
    pub session: Option<Uuid>,
    /// Why the slot is held ("cell", "unsavable state").
    pub held_for: Option<String>,
}

/// One zygote of the host's import cache.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ZygoteStatus {
    /// Zygote id.
    pub id: String,
    /// Packages it imported.
    pub packages: Vec<String>,
    /// Packages found to initialise CUDA, never imported in a zygote.
    pub cuda_unsafe: Vec<String>,
    /// Process id.
    pub pid: u32,
}

/// Where a worker process is in its life on a host (DESIGN.md section 7). The
/// allowed transitions are the gpu-host's `lifecycle` table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WorkerState {
    /// Forked, or being brought to the session's state (restore, imports).
    Preparing,
    /// Prepared before Run, waiting for it.
    Ready,
    /// Running a cell.
    Running,
    /// Saving what the cell changed.
    Saving,
    /// Kept after its cell (with its slot) for a re-run of the cell.
    Warm,
    /// Kept after its cell between cells: the session's CPU worker, or one holding
    /// unsavable state.
    Kept,
    /// Stopped by the host (end, budget, superseded, session closed).
    Evicted,
    /// Died or hung; killed.
    Lost,
}

/// One live worker process of a host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Worker id.
    pub id: String,
    /// Process id.
    pub pid: u32,
    /// The session it serves.
    pub session: Uuid,
    /// Where it is.
    pub state: WorkerState,
    /// How long it has been there.
    pub for_ms: u64,
}

/// host -> anyone: a host's state (`host.{hid}.status`), on every change and
/// periodically. Version 2: every live worker with its lifecycle state (version 1
/// had only their count).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostStatusV2 {
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
    /// Live worker processes and their states.
    pub workers: Vec<WorkerStatus>,
    /// Bytes in the host's chunk cache.
    pub cache_bytes: u64,
    /// Workers forked from zygotes since the host started.
    pub forks: u64,
    /// When (unix ms).
    pub unix_ms: u64,
}

wire!(HostStatusV2, "host-status", 2, upgrades HostStatusV1 from 1);

/// host -> anyone (`host.{hid}.bid`): a host's score for a run recipe it tried to
/// claim (DESIGN.md section 5), published once the claim settled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BidV1 {
    /// The run.
    pub exec_id: Uuid,
    /// Host id.
    pub host: String,
    /// Its score, 0..=1: free slots 1/2, zygote match 1/4, cached closure bytes 1/4.
    pub score: f64,
    /// The delay it waited before claiming.
    pub delay_ms: f64,
    /// Whether its claim won.
    pub won: bool,
}
wire!(BidV1, "bid", 1);

/// planner -> host (`host.{hid}.evict`): stop a prepared worker that is not
/// running a cell, and free its slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvictV1 {
    /// The session.
    pub session: Uuid,
    /// The prepared worker.
    pub worker: String,
    /// Why (for logs).
    pub reason: String,
}
wire!(EvictV1, "evict", 1);

/// What a query asks of a session's live objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueryKind {
    /// Completions at the cursor (Jupyter's `complete_request`).
    Complete,
    /// What the name at the cursor is (Jupyter's `inspect_request`).
    Inspect,
}

/// frontend -> the host keeping a session's CPU worker (`host.{hid}.query`):
/// complete or inspect code against the worker's live objects. Answered with
/// `Reply<QueryAnswerV1>`; `NotFound` when the host keeps no CPU worker for the
/// session, `Conflict` while that worker runs a cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueryV1 {
    /// The session.
    pub session: Uuid,
    /// Completion or inspection.
    pub kind: QueryKind,
    /// The code the user is editing.
    pub code: String,
    /// The cursor, in characters (Unicode code points) from the code's start.
    pub cursor_pos: u64,
    /// For inspection: 0 (the docstring) or 1 (the source too).
    pub detail_level: u8,
}
wire!(QueryV1, "query", 1);

/// The worker's answer to a query: the content of Jupyter's `complete_reply` or
/// `inspect_reply`, as JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueryAnswerV1 {
    /// The reply content.
    pub content_json: String,
}
wire!(QueryAnswerV1, "query-answer", 1);

/// frontend -> the host keeping a session's CPU worker (`host.{hid}.comm`): a
/// client's comm message (ipywidgets: a value changed in the browser), which
/// that worker handles between cells (ADR 33). Answered with
/// `Reply<CommAnswerV1>`; `NotFound` when the host keeps no CPU worker for the
/// session, `Conflict` while that worker runs a cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommV1 {
    /// The session.
    pub session: Uuid,
    /// `comm_open`, `comm_msg`, `comm_close` or `comm_info_request`.
    pub msg_type: String,
    /// The Jupyter message's content, as JSON.
    pub content_json: String,
    /// Its metadata, as JSON.
    pub metadata_json: String,
    /// Its binary buffers, base64 (as the worker takes them).
    pub buffers: Vec<String>,
}
wire!(CommV1, "comm", 1);

/// What handling a comm message caused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommAnswerV1 {
    /// `comm_info_reply`'s content for `comm_info_request` (else `{}`), as JSON.
    pub reply_json: String,
    /// Comm messages to the client and what callbacks printed: worker outputs
    /// (`COMM_OUTPUT` and stream), each as JSON.
    pub outputs_json: Vec<String>,
}
wire!(CommAnswerV1, "comm-answer", 1);

/// The `output_type` of the results of a run's `user_expressions` (`data`:
/// name -> result as in Jupyter's `execute_reply`): for the run's client, never
/// a notebook output.
pub const USER_EXPRESSIONS_OUTPUT: &str = "user_expressions";

/// The `output_type` of a comm message to the client among a worker's outputs
/// (`msg_type`, `content`, `metadata`, base64 `buffers`): relayed as that
/// Jupyter message, never a notebook output (ADR 33).
pub const COMM_OUTPUT: &str = "comm";

/// A typed error in a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The request did not decode or was invalid.
    BadRequest,
    /// The thing asked for does not exist.
    NotFound,
    /// Someone else committed first (optimistic concurrency).
    Conflict,
    /// A quota would be exceeded.
    QuotaExceeded,
    /// Storage failed.
    Storage,
    /// Anything else.
    Internal,
}

/// The one reply envelope for request/reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply<T> {
    /// Success.
    Ok(T),
    /// A typed error.
    Err {
        /// What kind of error.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

impl<T: WireMessage> WireMessage for Reply<T> {
    const TYPE: &'static str = "reply";
    const VERSION: u16 = T::VERSION;
}

/// -> store: the latest manifest of a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestGetV2 {
    /// The session.
    pub session: Uuid,
    /// A revision the asker knows is committed (a run's `after_revision`, a
    /// recipe's `manifest_revision`): a gateway that remembers this revision or a
    /// newer one answers without asking the store whether another gateway has
    /// committed a newer one since. None: always ask (ADR 12).
    pub at_least: Option<u64>,
}

wire!(ManifestGetV2, "manifest-get", 2, upgrades ManifestGetV1 from 1);

/// frontend -> store: settle a run its frontend gave up (host lost, claim
/// timeout, interrupted before it started): reply the manifest that decides its
/// outcome, its own commit at `base_revision + 1` if its save landed, else a fence
/// the store commits there so that the run can never commit later (ADR 22).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SettleV1 {
    /// The session.
    pub session: Uuid,
    /// The run.
    pub exec_id: Uuid,
    /// The revision the run was based on (its `after_revision`).
    pub base_revision: u64,
}
wire!(SettleV1, "settle", 1);

/// host -> store: which of these chunks (content hashes) does the store lack? Asked
/// during a save, so the worker places only those in shared memory. Refused
/// (quota exceeded) when the session would hold more than its quota after the
/// save: nothing is uploaded then.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkPlanV2 {
    /// The saving session (its latest revision's chunks are known to be stored).
    pub session: Uuid,
    /// Chunk hashes the host does not know to be stored.
    pub hashes: Vec<String>,
    /// The bytes the session would hold after the save (its base revision with
    /// the save's delta applied), when the host knows them.
    pub bytes_after: Option<u64>,
}
wire!(ChunkPlanV2, "chunk-plan", 2, upgrades ChunkPlanV1 from 1);

/// store ->: the chunks of a plan the store lacks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkPlannedV1 {
    /// Hashes to upload.
    pub missing: Vec<String>,
}
wire!(ChunkPlannedV1, "chunk-planned", 1);

/// store ->: a session's manifest (revision 0 and empty if it never saved).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestV1 {
    /// The manifest.
    pub manifest: Manifest,
}
wire!(ManifestV1, "manifest", 1);

/// host -> store: commit a worker's save as revision `base_revision + 1`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommitV2 {
    /// The session.
    pub session: Uuid,
    /// The revision the worker's state was based on.
    pub base_revision: u64,
    /// The execution whose results these are.
    pub exec_id: Uuid,
    /// The host that holds the worker.
    pub host: String,
    /// The worker (kept if it holds unsavable variables).
    pub worker: String,
    /// The cell id (named in errors about unsavable variables).
    pub cell_id: String,
    /// What changed.
    pub delta: Delta,
    /// Chunks the host stored for this save (their puts succeeded). They are
    /// younger than the collector's grace period, so the gateway does not look
    /// them up again; it still checks every other chunk new to the base (ADR 12).
    pub uploaded: Vec<String>,
}

wire!(CommitV2, "commit", 2, upgrades CommitV1 from 1);

/// store -> host: the commit's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommittedV1 {
    /// The new revision.
    pub revision: u64,
    /// Versions of every name the worker holds, after the commit.
    pub versions: Vec<(String, Uuid)>,
    /// Names whose version is now this execution.
    pub changed: Vec<String>,
}
wire!(CommittedV1, "committed", 1);

/// -> store: delete a session's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionDeleteV1 {
    /// The session.
    pub session: Uuid,
}
wire!(SessionDeleteV1, "session-delete", 1);

/// -> store: collect garbage: manifest revisions older than the newest
/// `keep_revisions` of each session, then chunks no kept revision references and
/// that are older than `grace_secs` (a save in flight uploads its chunks before it
/// commits, so young chunks are left alone).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GcV1 {
    /// Revisions kept per session (at least 1).
    pub keep_revisions: u64,
    /// Chunks younger than this are never collected.
    pub grace_secs: u64,
}
wire!(GcV1, "gc", 1);

/// store ->: what a collection removed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GcDoneV1 {
    /// Old manifest revisions deleted.
    pub manifests_deleted: u64,
    /// Chunks deleted.
    pub chunks_deleted: u64,
    /// Bytes of the chunks deleted.
    pub bytes_freed: u64,
    /// Chunks still referenced (or too young).
    pub chunks_kept: u64,
}
wire!(GcDoneV1, "gc-done", 1);

/// An empty successful reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DoneV1 {}
wire!(DoneV1, "done", 1);

#[cfg(test)]
mod tests;
