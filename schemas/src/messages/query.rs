//! frontend -> the host keeping a session's CPU worker: completion and inspection
//! against the worker's live objects, and clients' comm messages (ipywidgets),
//! handled between cells.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::codec::WireMessage;
use crate::messages::CellMessage;

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
/// `Reply<CommAnswerV2>`; `NotFound` when the host keeps no CPU worker for the
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

/// What handling a comm message caused. (Version 1 held each message as an
/// output's JSON text; a reply is read at its own version only, so a frontend and
/// a host a version apart fail that one comm message with `UnsupportedVersion`.)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommAnswerV2 {
    /// `comm_info_reply`'s content for `comm_info_request` (else `{}`), as JSON.
    pub reply_json: String,
    /// What handling it caused, in order: comm messages to the client and what
    /// callbacks printed.
    pub messages: Vec<CellMessage>,
}
wire!(CommAnswerV2, "comm-answer", 2);
