//! One live worker process and the conversations the host has with it: restore,
//! run, save. Each step has a deadline; a worker that dies shows up as a closed
//! socket, one that hangs as a timeout, and either fails the step with a clear error.
//! The save's protocol is in `worker_save.rs`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use schemas::messages::{CellMessage, WorkerState};
use uuid::Uuid;

use crate::chunks::ChunkError;
use crate::lifecycle::Lifecycle;
use crate::protocol::{Conn, ConnError, ErrorInfo, Frame};
use crate::worker_save::remove_save_files;
use crate::zygotes::Forked;

pub use crate::worker_save::Saved;

/// Deadline for a restore or a save step.
pub const STEP: Duration = Duration::from_secs(600);

/// Why a step with a worker failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The conversation broke: the worker died, hung or sent garbage.
    #[error("worker {worker} (pid {pid}) {step}: {source}")]
    Conn {
        /// Worker id.
        worker: String,
        /// Its pid.
        pid: u32,
        /// What the host was doing.
        step: &'static str,
        /// What broke.
        source: ConnError,
    },
    /// The worker answered with an error or an unexpected message.
    #[error("worker {worker} {step}: {message}")]
    Protocol {
        /// Worker id.
        worker: String,
        /// What the host was doing.
        step: &'static str,
        /// What it said.
        message: String,
    },
    /// Moving chunks failed.
    #[error("{0}")]
    Chunks(#[from] ChunkError),
    /// The store refused the commit.
    #[error("commit failed: {0}")]
    Commit(#[source] schemas::BusError),
    /// The store could not say which chunks it lacks.
    #[error("chunk plan failed: {0}")]
    Plan(#[source] schemas::BusError),
    /// The cell ran past the cell timeout, ignored the interrupt that followed and
    /// was killed with its process group.
    #[error(
        "the cell ran past the cell timeout ({timeout:?}) and did not stop within {grace:?} of the interrupt \
         that followed; it was killed with every process it started"
    )]
    CellTimeout {
        /// The cell timeout.
        timeout: Duration,
        /// How long it could have taken to stop.
        grace: Duration,
    },
}

/// How long a cell may run: past `timeout` it is interrupted (SIGINT), and killed
/// `grace` later if it has not ended.
#[derive(Clone, Copy, Debug)]
pub struct RunLimits {
    /// The cell timeout (None: a cell may run as long as it likes, as in Jupyter).
    pub timeout: Option<Duration>,
    /// How long a cell may ignore an interrupt.
    pub grace: Duration,
}

/// The cell a worker runs: its id, code and Jupyter's `user_expressions`
/// (evaluated after it if it succeeds).
#[derive(Clone, Copy, Debug)]
pub struct CellToRun<'a> {
    /// The cell's id.
    pub cell_id: &'a str,
    /// Its code.
    pub code: &'a str,
    /// name -> expression.
    pub user_expressions: &'a BTreeMap<String, String>,
}

/// What a finished cell reported.
#[derive(Debug)]
pub struct Finished {
    /// "ok" or "error".
    pub status: String,
    /// The error output's fields.
    pub error: Option<ErrorInfo>,
    /// Execution count.
    pub execution_count: u32,
    /// Run time.
    pub run_ms: f64,
    /// Whether the cell touched CUDA.
    pub cuda_used: bool,
    /// Outputs forwarded.
    pub outputs: u64,
    /// Names the cell reached that its closure missed, brought in while it ran.
    pub faulted: Vec<String>,
    /// It ran past the cell timeout and stopped on the interrupt that followed.
    pub timed_out: bool,
}

/// What a worker's restore did.
#[derive(Debug)]
pub struct WorkerRestored {
    /// Bytes read.
    pub bytes: u64,
    /// Time the worker spent.
    pub ms: f64,
    /// Of that, importing the import closure.
    pub imports_ms: f64,
    /// Of that, copying staged GPU-resident tensors to the slot's devices.
    pub stage_in_ms: f64,
    /// The bytes that copy moved.
    pub staged_in_bytes: u64,
    /// What failed, by name (`import M` for an import).
    pub errors: BTreeMap<String, String>,
}

/// Events during a run, as they happen.
pub enum RunEvent {
    /// First line about to run.
    Started {
        /// When.
        unix_ms: u64,
        /// Execution count.
        execution_count: u32,
        /// The worker's Python version.
        python: String,
    },
    /// What the cell sends its client.
    Message(CellMessage),
}

/// A worker process bound to one session.
pub struct WorkerProc {
    /// Worker id.
    pub id: String,
    /// Pid.
    pub pid: u32,
    /// The session it serves.
    pub session: Uuid,
    /// Names it holds, at the versions it holds them.
    pub held: BTreeMap<String, Uuid>,
    /// Manifest revision its state corresponds to.
    pub revision: u64,
    /// The modules its restores imported without an error.
    pub imported: std::collections::BTreeSet<String>,
    /// Cells it was asked to run (a worker that never ran one can be replaced
    /// without the user noticing).
    pub runs: u32,
    conn: Conn,
    pub(crate) broken: bool,
    lifecycle: Lifecycle,
    killed: AtomicBool,
    /// Its cgroups, when workers are limited.
    cgroup: Option<crate::cgroups::WorkerCgroup>,
    /// The uid it runs as, when sessions have their own (restore files are its).
    pub uid: Option<u32>,
}

impl WorkerProc {
    /// Whether its state is the session's at `revision` with `imports` imported,
    /// so that a restore to that revision would change nothing: it ran a cell, and
    /// saved or restored that revision since (a worker never carries state it did
    /// not commit, ADR 22).
    pub fn is_at(&self, revision: u64, imports: &[String]) -> bool {
        self.runs > 0 && self.revision == revision && imports.iter().all(|m| self.imported.contains(m))
    }

    /// A freshly forked worker for `session`, Preparing in `lifecycle`.
    pub fn new(forked: Forked, session: Uuid, lifecycle: Lifecycle) -> Self {
        lifecycle.born(&forked.id, forked.pid, session);
        Self {
            id: forked.id,
            pid: forked.pid,
            session,
            held: BTreeMap::new(),
            revision: 0,
            imported: std::collections::BTreeSet::new(),
            runs: 0,
            conn: forked.conn,
            broken: false,
            lifecycle,
            killed: AtomicBool::new(false),
            cgroup: None,
            uid: None,
        }
    }

    /// Keep the worker's cgroups (removed with it).
    pub fn set_cgroup(&mut self, cgroup: crate::cgroups::WorkerCgroup) {
        self.cgroup = Some(cgroup);
    }

    /// The memory limit, if the kernel killed the worker (or a process of its) for it.
    pub fn memory_exceeded(&self) -> Option<u64> {
        self.cgroup.as_ref().and_then(|c| c.memory_exceeded())
    }

    /// The process limit, if a fork in the worker was refused for it.
    pub fn pids_exceeded(&self) -> Option<u64> {
        self.cgroup.as_ref().and_then(|c| c.pids_exceeded())
    }

    /// Move to `to` in the lifecycle (see [`Lifecycle::advance`]).
    pub fn enter(&self, to: WorkerState) {
        self.lifecycle.advance(&self.id, to);
    }

    /// Whether a step failed in a way that leaves the worker unusable.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    fn conn_err(&mut self, step: &'static str, source: ConnError) -> WorkerError {
        self.broken = true;
        self.enter(WorkerState::Lost); // died or hung: the caller kills it
        WorkerError::Conn { worker: self.id.clone(), pid: self.pid, step, source }
    }

    pub(crate) fn unexpected(&mut self, step: &'static str, frame: Frame) -> WorkerError {
        self.broken = !matches!(frame, Frame::Error { .. });
        let message = match frame {
            Frame::Error { message } => message,
            other => format!("unexpected {} message", other.kind()),
        };
        WorkerError::Protocol { worker: self.id.clone(), step, message }
    }

    pub(crate) async fn send(&mut self, step: &'static str, frame: &Frame) -> Result<(), WorkerError> {
        match self.conn.send(frame).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.conn_err(step, e)),
        }
    }

    pub(crate) async fn recv(&mut self, step: &'static str, timeout: Duration) -> Result<Frame, WorkerError> {
        match self.conn.recv(timeout).await {
            Ok(f) => Ok(f),
            Err(e) => Err(self.conn_err(step, e)),
        }
    }

    /// Send a restore and wait for `restored`; returns (bytes, ms, errors).
    pub async fn restore(&mut self, frame: Frame) -> Result<WorkerRestored, WorkerError> {
        self.enter(WorkerState::Preparing);
        self.send("restoring", &frame).await?;
        match self.recv("restoring", STEP).await? {
            Frame::Restored { restored_bytes, ms, imports_ms, stage_in_ms, staged_in_bytes, errors, .. } => {
                Ok(WorkerRestored { bytes: restored_bytes, ms, imports_ms, stage_in_ms, staged_in_bytes, errors })
            }
            other => Err(self.unexpected("restoring", other)),
        }
    }

    /// Run a cell, reporting start and outputs through `on_event` as they come. A
    /// name the cell reaches that the worker lacks (a read its closure missed) is
    /// answered by `on_fault`, which returns the `Faulted` frame to send back; a
    /// cell's `input()` by `on_input` (prompt, password), which returns the
    /// `InputReply` frame.
    #[allow(clippy::too_many_arguments)] // the run's parts and its three callbacks
    pub async fn run<FF, FFut, FI, FIFut>(
        &mut self,
        exec_id: Uuid,
        cell: CellToRun<'_>,
        limits: RunLimits,
        mut on_event: impl FnMut(RunEvent),
        mut on_fault: FF,
        mut on_input: FI,
    ) -> Result<Finished, WorkerError>
    where
        FF: FnMut(Vec<String>) -> FFut,
        FFut: std::future::Future<Output = Frame>,
        FI: FnMut(String, bool) -> FIFut,
        FIFut: std::future::Future<Output = Frame>,
    {
        let exec = exec_id.to_string();
        self.runs += 1;
        self.enter(WorkerState::Running);
        let run = Frame::Run {
            exec_id: exec.clone(),
            cell_id: cell.cell_id.into(),
            code: cell.code.into(),
            user_expressions: cell.user_expressions.clone(),
        };
        self.send("running", &run).await?;
        // The timeout is enforced by signals, never by abandoning a read halfway
        // through a frame: the worker ends the cell, or dies and closes its socket.
        let watchdog = Watchdog::start(self.pid, limits);
        let mut outputs = 0u64;
        loop {
            // (without a timeout, a read waits for the frame or the socket's close)
            let frame = match limits.timeout {
                Some(t) => self.conn.recv(t.saturating_add(limits.grace).saturating_add(STEP)).await,
                None => self.conn.recv_forever().await,
            };
            let frame = match frame {
                Ok(f) => f,
                Err(_) if watchdog.killed() => {
                    self.broken = true;
                    self.enter(WorkerState::Lost);
                    let timeout = limits.timeout.unwrap_or_default();
                    return Err(WorkerError::CellTimeout { timeout, grace: limits.grace });
                }
                Err(e) => return Err(self.conn_err("running", e)),
            };
            match frame {
                Frame::Started { unix_ms, execution_count, python, .. } => {
                    on_event(RunEvent::Started { unix_ms, execution_count, python })
                }
                Frame::CellMessage { message, exec_id } if exec_id == exec => {
                    outputs += 1;
                    on_event(RunEvent::Message(message.into()));
                }
                Frame::Fault { names, exec_id } if exec_id == exec => {
                    let reply = on_fault(names).await;
                    self.send("answering a fault", &reply).await?;
                }
                Frame::InputRequest { prompt, password, exec_id } if exec_id == exec => {
                    outputs += 1; // the client is asked through an output message
                                  // a cell past its timeout stops waiting as if interrupted (the
                                  // watchdog's SIGINT then raises in the cell)
                    let answer = on_input(prompt, password);
                    tokio::pin!(answer);
                    let reply = loop {
                        tokio::select! {
                            reply = &mut answer => break reply,
                            _ = tokio::time::sleep(WATCHDOG_POLL) => if watchdog.interrupted() {
                                break Frame::InputReply { exec_id, value: String::new(), refused: None, interrupted: true };
                            }
                        }
                    };
                    self.send("answering an input request", &reply).await?;
                }
                Frame::Finished { status, error, execution_count, run_ms, cuda_used, faulted, .. } => {
                    let timed_out = watchdog.interrupted();
                    return Ok(Finished {
                        status,
                        error,
                        execution_count,
                        run_ms,
                        cuda_used,
                        outputs,
                        faulted,
                        timed_out,
                    });
                }
                other => return Err(self.unexpected("running", other)),
            }
        }
    }

    /// Complete or inspect code against the worker's live objects (between cells).
    pub async fn query(&mut self, query: Frame) -> Result<serde_json::Value, WorkerError> {
        self.send("querying", &query).await?;
        match self.recv("querying", STEP).await? {
            Frame::QueryAnswer { content } => Ok(content),
            other => Err(self.unexpected("querying", other)),
        }
    }

    /// A client's comm message, handled by the worker between cells: returns
    /// (the reply content, the outputs it caused).
    pub async fn comm(&mut self, comm: Frame) -> Result<(serde_json::Value, Vec<CellMessage>), WorkerError> {
        self.send("passing a comm message", &comm).await?;
        match self.recv("passing a comm message", STEP).await? {
            Frame::CommAnswer { reply, messages } => Ok((reply, messages.into_iter().map(CellMessage::from).collect())),
            other => Err(self.unexpected("passing a comm message", other)),
        }
    }

    /// Stop the worker: ask politely, then make sure.
    pub async fn stop(mut self) {
        self.enter(WorkerState::Evicted);
        let _ = tokio::time::timeout(Duration::from_secs(2), self.conn.send(&Frame::Shutdown {})).await;
        self.kill_now();
    }

    /// Kill the process now (a hung, broken or superseded worker).
    pub fn kill_now(&self) {
        self.enter(WorkerState::Evicted);
        if !self.killed.swap(true, Ordering::Relaxed) {
            crate::process::kill(self.pid);
        }
    }
}

impl Drop for WorkerProc {
    /// A worker nobody holds any more cannot be talked to: end it rather than leak it,
    /// and remove any save file it was writing when it ended (no one else will).
    fn drop(&mut self) {
        self.kill_now();
        remove_save_files(&self.id);
    }
}

/// Enforces a run's cell timeout: SIGINT to the worker's group at the timeout,
/// SIGKILL a grace period later; stops when dropped (the run ended).
/// How often a run waiting for its client's input checks the watchdog.
const WATCHDOG_POLL: Duration = Duration::from_millis(100);

struct Watchdog {
    /// 0: quiet, 1: interrupted, 2: killed.
    fired: Arc<AtomicU8>,
    task: tokio::task::JoinHandle<()>,
}

impl Watchdog {
    fn start(pid: u32, limits: RunLimits) -> Self {
        let fired = Arc::new(AtomicU8::new(0));
        let f = fired.clone();
        let task = tokio::spawn(async move {
            let Some(timeout) = limits.timeout else { return };
            tokio::time::sleep(timeout).await;
            tracing::warn!(pid, timeout = ?limits.timeout, "a cell ran past the cell timeout; interrupting it");
            f.store(1, Ordering::SeqCst);
            crate::process::interrupt(pid);
            tokio::time::sleep(limits.grace).await;
            f.store(2, Ordering::SeqCst);
            crate::process::kill(pid);
        });
        Self { fired, task }
    }

    fn interrupted(&self) -> bool {
        self.fired.load(Ordering::SeqCst) >= 1
    }

    fn killed(&self) -> bool {
        self.fired.load(Ordering::SeqCst) >= 2
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.task.abort();
    }
}
