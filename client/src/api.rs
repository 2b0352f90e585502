//! The JSON of the frontend's HTTP API, shared by the server, the `looseleaf` CLI and
//! tests, plus a small parser for its Server-Sent Events stream.

use std::collections::BTreeMap;

use schemas::messages::CellMessage;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// `POST /v1/sessions` body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateSession {
    /// Working directory of the session's cells.
    #[schema(example = "/tmp")]
    pub cwd: String,
    /// Treat every code cell as a GPU cell.
    #[serde(default)]
    pub all_gpu: bool,
    /// Prepare workers while cells are edited (default true).
    #[serde(default = "yes")]
    pub speculate: bool,
    /// The notebook the session runs (a kernel names it by Jupyter's session
    /// path), so that a later kernel on the same notebook can resume it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notebook: Option<String>,
    /// Resume the caller's latest detached session of `notebook` instead of
    /// starting a fresh one, if there is one.
    #[serde(default)]
    pub resume: bool,
}

fn yes() -> bool {
    true
}

/// `POST /v1/sessions` answer (and `POST /v1/sessions/{sid}/resume`'s).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SessionCreated {
    /// The new session, or the one resumed.
    pub session_id: Uuid,
    /// What was resumed, when a detached session was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed: Option<ResumedSession>,
    /// Why a resume asked for gave a fresh session (another kernel resumed it
    /// first, ...); absent when there was nothing to resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fresh_because: Option<String>,
}

/// A detached session as it was resumed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResumedSession {
    /// When it was detached (unix ms).
    pub detached_unix_ms: Option<u64>,
    /// Its state's revision (the executions it saved).
    pub revision: u64,
    /// Variables its state holds.
    pub variables: u64,
    /// Bytes of their objects.
    pub bytes: u64,
    /// Names it lost, since they could not be saved.
    pub unsavable: Vec<String>,
}

/// One of `GET /v1/sessions`: a session of the caller's, live or detached.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SessionListed {
    /// The session.
    pub session_id: Uuid,
    /// The notebook it runs, if its client named one.
    pub notebook: Option<String>,
    /// Its working directory.
    pub cwd: String,
    /// When it was created (unix ms).
    pub created_unix_ms: u64,
    /// Its state's revision.
    pub revision: u64,
    /// When it was detached (unix ms); absent while it is attached.
    pub detached_unix_ms: Option<u64>,
}

/// `GET /v1/discards` item: a detached session of the caller's that LooseLeaf
/// discarded with its state (past its retention, or to free space), listed for
/// [`DISCARDS_KEPT_DAYS`] days after.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SessionDiscarded {
    /// The session.
    pub session_id: Uuid,
    /// The notebook it ran, if its client named one.
    pub notebook: Option<String>,
    /// When it was detached (unix ms).
    pub detached_unix_ms: Option<u64>,
    /// When it was discarded (unix ms).
    pub discarded_unix_ms: u64,
    /// Why.
    pub why: String,
}

/// How long a discarded session stays listed.
pub const DISCARDS_KEPT_DAYS: u64 = 30;

/// `POST /v1/sessions/{sid}/detach` answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SessionDetached {
    /// The session.
    pub session_id: Uuid,
    /// When it was detached (unix ms).
    pub detached_unix_ms: u64,
    /// Names its workers held that could not be saved: gone with them.
    #[serde(default)]
    pub unsavable: Vec<String>,
}

/// Body of `POST /v1/sessions/{sid}/checkout`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Checkout {
    /// The revision whose state the session goes back to (an execution's
    /// `after_revision`).
    pub revision: u64,
}

/// `POST …/undo`, `…/checkout` and `…/fork` answer: the session's state moved
/// (for a fork: the new session's first state). Only variables and the other
/// kernel state move; outputs, and files cells wrote, stay as they are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StateMoved {
    /// The session (for a fork: the new one).
    pub session_id: Uuid,
    /// The revision committed: the session's state from now on.
    pub revision: u64,
    /// The earlier revision whose state it holds (for a fork: the parent's).
    pub state_of: u64,
    /// Variables it holds.
    pub variables: u64,
    /// Bytes of their objects.
    pub bytes: u64,
    /// Names that could not be saved, so are not in it.
    pub unsavable: Vec<String>,
    /// For a fork: the session forked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<Uuid>,
}

/// Body of `PUT …/cells/{cell}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CellCode {
    /// The cell's full code.
    #[schema(example = "x = 1\nprint(x)")]
    pub code: String,
}

/// Body of `POST …/cells/{cell}/run`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunCell {
    /// The cell's full code.
    #[schema(example = "name = input('name? ')")]
    pub code: String,
    /// The client answers the cell's `input()` and `getpass()`: each arrives as an
    /// output `{"output_type": "input_request", "prompt", "password"}` and is
    /// answered with `POST …/executions/{exec}/input`. Without it (default), the
    /// cell gets StdinNotImplementedError, as from ipykernel for a client without
    /// a stdin channel.
    #[serde(default)]
    pub allow_stdin: bool,
    /// Jupyter's `user_expressions`: name -> expression, evaluated in the cell's
    /// namespace after it succeeds; the results arrive as an output
    /// `{"output_type": "user_expressions", "data": {name: result}}` (each result
    /// as in Jupyter's `execute_reply`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub user_expressions: BTreeMap<String, String>,
}

/// Body of `POST /v1/sessions/{sid}/complete` and `…/inspect`: code being edited
/// and the cursor in it. The answer is the content of Jupyter's `complete_reply`
/// or `inspect_reply`, from the session's live objects.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CodeAtCursor {
    /// The code.
    #[schema(example = "df.gro")]
    pub code: String,
    /// The cursor, in characters (Unicode code points) from the start (a cell
    /// holds at most 8 MiB).
    #[schema(maximum = 8388608)]
    pub cursor_pos: u64,
    /// Inspection only: 0 (the docstring) or 1 (the source too).
    #[serde(default)]
    pub detail_level: u8,
}

/// Body of `POST /v1/sessions/{sid}/comm`: a client's comm message (Jupyter's
/// `comm_open`, `comm_msg`, `comm_close` or `comm_info_request`; ipywidgets),
/// for the session's CPU worker, which serves the session's comms (ADR 33).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CommMessage {
    /// The Jupyter message type.
    #[schema(example = "comm_msg")]
    pub msg_type: String,
    /// Its content.
    #[schema(value_type = Object)]
    pub content: serde_json::Value,
    /// Its metadata.
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    /// Its binary buffers, base64.
    #[serde(default)]
    pub buffers: Vec<String>,
}

fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}

/// What a comm message caused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CommAnswer {
    /// Whether a CPU worker of the session took it (false: the session has no
    /// idle CPU worker, so no comm is open there).
    pub held: bool,
    /// `comm_info_reply`'s content for `comm_info_request`, else `{}`.
    #[schema(value_type = Object)]
    pub reply: serde_json::Value,
    /// What handling it caused, in order: comm messages to the client
    /// (`output_type` "comm", with `msg_type`, `content`, `metadata` and base64
    /// `buffers`) and what callbacks printed (notebook outputs), each a cell
    /// message as in the event stream.
    #[schema(value_type = Vec<Object>)]
    #[serde(with = "schemas::messages::cell_messages_json")]
    pub outputs: Vec<CellMessage>,
}

/// Body of `POST /v1/sessions/{sid}/executions/{exec}/input`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InputLine {
    /// What the user typed, without the newline.
    #[schema(example = "Ada")]
    pub value: String,
}

/// `POST …/cells/{cell}/run` answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunAccepted {
    /// The execution.
    pub exec_id: Uuid,
    /// Executions ahead of this one (0: it is sent to the planner now).
    pub position: usize,
}

/// Outcome of an execution as the frontend reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecStatus {
    /// Waiting behind another execution.
    Queued,
    /// Sent to the planner, not complete yet.
    Running,
    /// Ran to the end.
    Ok,
    /// The cell raised (what it did before is committed, as a kernel keeps it).
    Error,
    /// The platform could not run or save it (no host took it, its host was lost,
    /// it was killed, its save failed): nothing it did was committed, and running
    /// it again is safe.
    Failed,
    /// Never sent to run: the session was interrupted while it waited in the queue.
    Aborted,
}

impl ExecStatus {
    /// The status as its JSON names it (also a metric's label).
    pub fn as_str(self) -> &'static str {
        match self {
            ExecStatus::Queued => "queued",
            ExecStatus::Running => "running",
            ExecStatus::Ok => "ok",
            ExecStatus::Error => "error",
            ExecStatus::Failed => "failed",
            ExecStatus::Aborted => "aborted",
        }
    }
}

/// What `POST /v1/sessions/{sid}/interrupt` stopped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Interrupted {
    /// The execution that was running (it ends with a KeyboardInterrupt, or is
    /// killed if it ignores it), if any.
    pub interrupted: Option<Uuid>,
    /// Queued executions that will not run (each ends with status `aborted`).
    pub aborted: Vec<Uuid>,
}

/// `GET /v1/health` answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Health {
    /// Always `ok` when it answers.
    pub status: String,
    /// Sessions this frontend serves now.
    pub sessions: usize,
}

/// What every error answer holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApiErrorBody {
    /// What was wrong, naming it.
    pub error: String,
}

/// `GET /v1/sessions/{sid}` answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SessionSummary {
    /// The session.
    pub session_id: Uuid,
    /// Its working directory.
    pub cwd: String,
    /// Every code cell is a GPU cell.
    pub all_gpu: bool,
    /// The manifest revision its last completed execution left.
    pub revision: u64,
    /// The execution running now.
    pub current: Option<Uuid>,
    /// Executions waiting, in order.
    pub queue: Vec<Uuid>,
    /// The executions this frontend has seen, oldest first.
    pub executions: Vec<ExecutionSummary>,
}

/// One execution in a session's summary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExecutionSummary {
    /// The execution.
    pub exec_id: Uuid,
    /// Its cell.
    pub cell_id: String,
    /// When Run was pressed (unix ms).
    pub run_unix_ms: u64,
    /// Where it stands.
    pub status: ExecStatus,
    /// The revision it left, once complete.
    pub after_revision: Option<u64>,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

/// `DELETE /v1/sessions/{sid}` answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SessionDeleted {
    /// The session.
    pub session_id: Uuid,
    /// Always true: it is no longer served and its record is gone.
    pub deleted: bool,
    /// Why the store did not delete its state, if it did not (the collector
    /// removes it later).
    pub store_error: Option<String>,
}

/// One `data:` line of `GET /v1/sessions/{sid}/events`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamItem {
    /// A run was accepted and queued.
    Queued {
        /// The execution.
        exec_id: Uuid,
        /// The cell.
        cell_id: String,
        /// When the frontend received Run (unix ms).
        run_unix_ms: u64,
    },
    /// A session event from the planner or a host.
    Event {
        /// The execution (nil for session-wide events).
        exec_id: Uuid,
        /// When it happened (unix ms).
        unix_ms: u64,
        /// What happened (`crate::events`: the public JSON, not the bus's).
        event: crate::events::Event,
    },
    /// What an execution sends its client: an nbformat v4 output, or a side
    /// channel that no notebook holds, its `output_type` one of `input_request`
    /// (`prompt`, `password`), `comm` (`msg_type`, `content`, `metadata`,
    /// `buffers`), `user_expressions` (`data`) or `pager` (`data`, `start`).
    Output {
        /// The execution.
        exec_id: Uuid,
        /// Order within the execution.
        seq: u64,
        /// The message.
        #[schema(value_type = Object)]
        #[serde(with = "schemas::messages::cell_message_json")]
        output: CellMessage,
    },
    /// The execution is complete: its state is saved (or it failed) and every output
    /// was delivered before this item.
    Done {
        /// The execution.
        exec_id: Uuid,
        /// Ok or error.
        status: ExecStatus,
        /// The session's manifest revision after it.
        after_revision: u64,
        /// When it completed (unix ms of its Saved/Failed event, or the frontend's clock).
        unix_ms: u64,
        /// What went wrong, if anything.
        error: Option<String>,
    },
}

impl StreamItem {
    /// The JSON of an `Output` item whose message is `message_json`, the HTTP
    /// API's JSON of it (`CellMessage::to_json`, as a host's pieces carry it):
    /// what `serde_json::to_string` writes for the item, without writing a large
    /// output's JSON again. `message_json` must be one JSON value.
    pub fn output_line(exec_id: Uuid, seq: u64, message_json: &str) -> String {
        format!(r#"{{"type":"output","exec_id":"{exec_id}","seq":{seq},"output":{message_json}}}"#)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line written from a message's JSON text is the one serde writes for
    /// the item (the host's pieces carry `to_json`'s text).
    #[test]
    fn an_output_line_from_its_json_text_is_what_serde_writes() {
        let exec_id = Uuid::now_v7();
        let messages = [
            CellMessage::Output(serde_json::json!({
                "output_type": "stream", "name": "stdout", "text": "x\u{e9}\"\n\u{1}".repeat(3)
            })),
            CellMessage::Output(serde_json::json!({
                "output_type": "execute_result", "execution_count": 3, "metadata": {},
                "data": {"text/plain": "1.5e300", "application/json": {"a": [1.25, -0.0, 1e300]}}
            })),
            CellMessage::InputRequest { prompt: "name?".into(), password: false },
        ];
        for (seq, output) in messages.into_iter().enumerate() {
            let text = output.to_json().to_string();
            let item = StreamItem::Output { exec_id, seq: seq as u64, output };
            assert_eq!(StreamItem::output_line(exec_id, seq as u64, &text), serde_json::to_string(&item).unwrap());
        }
    }

    #[test]
    fn stream_items_round_trip_through_json() {
        let item = StreamItem::Event {
            exec_id: Uuid::now_v7(),
            unix_ms: 5,
            event: crate::events::Event::Failed { error: "boom".into() },
        };
        let json = serde_json::to_string(&item).unwrap_or_default();
        assert!(json.contains("\"type\":\"event\""));
        let back: StreamItem = serde_json::from_str(&json).unwrap_or(StreamItem::Queued {
            exec_id: Uuid::nil(),
            cell_id: String::new(),
            run_unix_ms: 0,
        });
        assert_eq!(back, item);
    }
}
