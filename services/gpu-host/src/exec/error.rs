//! Why an execution or a preparation failed outside the cell: [`ExecError`], the
//! text the user reads in the `Failed` event, and its conversion from a worker's error.

use std::time::Duration;

use schemas::BusError;

use crate::chunks::ChunkError;
use crate::worker::WorkerError;
use crate::zygotes::ZygoteError;

/// Why an execution or a preparation failed outside the cell. What it says is
/// what the user reads in the `Failed` event ([`ExecEnv::execute`](super::ExecEnv::execute) sends it).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// No zygote could be started to fork from.
    #[error("could not start a worker: no zygote: {0}")]
    NoZygote(#[source] ZygoteError),
    /// The zygote could not fork the worker (twice, with a fresh zygote between).
    #[error("could not start a worker: {0}")]
    Fork(#[source] ZygoteError),
    /// The session's working directory cannot be entered.
    #[error("the session's working directory {cwd:?} cannot be used: {source}")]
    Cwd {
        /// The directory.
        cwd: String,
        /// Why.
        source: std::io::Error,
    },
    /// The session's workers cannot get a uid of their own.
    #[error("could not start a worker: {0}")]
    SessionUid(#[from] crate::session_uids::UidError),
    /// The session's package layer could not be made its uid's.
    #[error("could not prepare the session's package layer {path}: {source}")]
    PackageLayer {
        /// The layer.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The worker's limits could not be applied.
    #[error("could not start a worker within its limits: {0}")]
    Limits(#[source] crate::cgroups::CgroupError),
    /// The worker went past its memory limit and the kernel killed it.
    #[error(
        "the cell used more memory than a worker may ({} MiB) and was killed; nothing it did was committed, \
         the session keeps its last committed state",
        .limit_bytes >> 20
    )]
    MemoryLimit {
        /// The limit.
        limit_bytes: u64,
    },
    /// The zygote chosen for the worker went away twice.
    #[error("could not start a worker: the zygote chosen for it went away")]
    ZygoteGone,
    /// The session's manifest could not be read.
    #[error("could not read the session's manifest: {0}")]
    Manifest(#[source] BusError),
    /// The cell needs a variable that lived only in a worker that is gone.
    #[error(
        "variable '{name}' could not be saved ({reason}) and lived only in worker {worker} on host {host} \
         (defined by cell {cell_id}); that worker is gone, so this cell cannot run"
    )]
    UnsavableGone {
        /// The variable.
        name: String,
        /// Why it could not be saved.
        reason: String,
        /// The worker that held it.
        worker: String,
        /// Its host.
        host: String,
        /// The cell that defined it.
        cell_id: String,
    },
    /// The closure's records and chunks could not be laid out for the worker.
    #[error("could not restore the cell's state: {0}")]
    RestoreFile(#[source] ChunkError),
    /// The worker could not load some of the closure.
    #[error("restoring the cell's state failed: {}", .0.join("; "))]
    Restore(Vec<String>),
    /// The worker died or hung: nothing it did was committed.
    #[error("{0}; the worker was lost, the session's committed state is intact")]
    WorkerLost(#[source] WorkerError),
    /// The worker refused a step, or the store refused its save.
    #[error(transparent)]
    Worker(WorkerError),
    /// The host is stopping (SIGTERM): the cell was stopped before it was saved.
    #[error(
        "host {host} stopped while the cell ran (it was shut down); nothing the cell did was committed, \
         the session keeps its last committed state"
    )]
    HostStopping {
        /// The host.
        host: String,
    },
    /// The user interrupted the cell before it started here: it never ran.
    #[error("{}", schemas::messages::INTERRUPTED_BEFORE_START)]
    Interrupted,
    /// The cell ignored the user's interrupt and was killed.
    #[error(
        "the cell did not stop within {grace:?} of the interrupt and was killed with every process it started; \
         nothing it did was committed, the session keeps its last committed state"
    )]
    KilledAfterInterrupt {
        /// How long it could have taken to stop.
        grace: Duration,
    },
    /// The prepared worker died before the cell started and no fresh one could start.
    #[error("the prepared worker was lost and no fresh one could start: {0}")]
    PreparedLost(#[source] Box<ExecError>),
}

impl From<WorkerError> for ExecError {
    fn from(e: WorkerError) -> Self {
        match e {
            WorkerError::Conn { .. } | WorkerError::CellTimeout { .. } => ExecError::WorkerLost(e),
            _ => ExecError::Worker(e),
        }
    }
}
