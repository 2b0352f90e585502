//! What a host reports: its status (GPU slots, zygotes, workers and their
//! lifecycle states) and its bids for run recipes; and the planner's evictions of
//! its prepared workers.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::frozen::HostStatusV1;
use crate::codec::WireMessage;

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

/// planner -> anyone (`demand.gpu`): the GPU demand the planner sees in the edit
/// stream, published every few seconds for autoscalers (issue "Scale", item 5;
/// `looseleaf_planner::demand`). Also the `looseleaf_gpu_demand_*` gauges.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuDemandV1 {
    /// Unix time of the count (ms).
    pub unix_ms: u64,
    /// Sessions typing a GPU cell they have not run.
    pub typing_sessions: u64,
    /// The bytes of those cells' closures.
    pub typing_closure_bytes: u64,
    /// GPUs of the cells running.
    pub running_gpus: u64,
    /// GPUs wanted within the scaling lead: running, plus the runs expected from
    /// the sessions typing, plus two standard deviations of those.
    pub wanted_gpus: f64,
}
wire!(GpuDemandV1, "gpu_demand", 1);

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
