//! frontend -> hosts: a session's life (closed, idle) and its executions
//! (interrupts, the answers to a running cell's `input()`).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::codec::WireMessage;

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

/// Why a cell's `input()` gets no answer when its run's client has no stdin
/// channel (ipykernel's words, after "raw_input was called, but ").
pub const NO_STDIN: &str = "this frontend does not support input requests.";
