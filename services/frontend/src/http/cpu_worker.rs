//! What the session's CPU worker answers from its live objects: completions,
//! inspections, and comm messages (ipywidgets).

use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use schemas::bus::BusError;
use schemas::messages::{CommAnswerV2, CommV1, ErrorCode, QueryAnswerV1, QueryKind, QueryV1};
use schemas::subjects::HostVerb;

use super::errors::{bad_request, cell_code, internal, json_body, mailbox, unavailable, ApiError};
use super::state::{lookup, AppState};
use super::MAX_CELL_BYTES;
use crate::api::{ApiErrorBody, CodeAtCursor, CommAnswer, CommMessage};
use crate::auth::Caller;
use crate::session;

/// How long a completion or inspection waits for the session's CPU worker: an
/// editor asks as the user types, and nothing is better than a late answer.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// Completions at the cursor from the session's live objects (its CPU worker):
/// the content of Jupyter's `complete_reply`; no matches while no CPU cell has
/// run, or while one runs.
#[utoipa::path(post, path = "/v1/sessions/{sid}/complete", params(("sid" = uuid::Uuid, Path, description = "the session")),
    request_body = CodeAtCursor, responses((status = 200, description = "complete_reply content", content_type = "application/json")))]
pub(super) async fn complete(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
    body: Result<Json<CodeAtCursor>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    query(&state, &caller, &sid, QueryKind::Complete, json_body(body)?).await
}

/// What the name at the cursor is, from the session's live objects: the content
/// of Jupyter's `inspect_reply` (`found` false when no CPU worker knows it).
#[utoipa::path(post, path = "/v1/sessions/{sid}/inspect", params(("sid" = uuid::Uuid, Path, description = "the session")),
    request_body = CodeAtCursor, responses((status = 200, description = "inspect_reply content", content_type = "application/json")))]
pub(super) async fn inspect(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
    body: Result<Json<CodeAtCursor>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    query(&state, &caller, &sid, QueryKind::Inspect, json_body(body)?).await
}

async fn query(
    state: &AppState,
    caller: &Caller,
    sid: &str,
    kind: QueryKind,
    at: CodeAtCursor,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (sid, addr) = lookup(state, sid, caller).await?;
    let code = cell_code(at.code)?;
    if at.cursor_pos > MAX_CELL_BYTES as u64 {
        return Err(bad_request(format!("cursor_pos {} is past the largest cell ({MAX_CELL_BYTES})", at.cursor_pos)));
    }
    let cursor_pos = at.cursor_pos.min(code.chars().count() as u64);
    let nothing = match kind {
        QueryKind::Complete => serde_json::json!({
            "status": "ok", "matches": [], "cursor_start": cursor_pos, "cursor_end": cursor_pos, "metadata": {},
        }),
        QueryKind::Inspect => serde_json::json!({ "status": "ok", "found": false, "data": {}, "metadata": {} }),
    };
    let Some(host) = addr.send(session::CpuHost).await.map_err(mailbox)? else {
        return Ok(Json(nothing));
    };
    let bus = &state.shared.bus;
    let msg = QueryV1 { session: sid, kind, code, cursor_pos, detail_level: at.detail_level.min(1) };
    let subject = bus.subjects().host_command(&host, HostVerb::Query);
    match bus.request::<QueryV1, QueryAnswerV1>(subject, &msg, QUERY_TIMEOUT).await {
        Ok(answer) => match serde_json::from_str(&answer.content_json) {
            Ok(content) => Ok(Json(content)),
            Err(e) => Err(internal(format!("the CPU worker's answer is not JSON: {e}"))),
        },
        Err(e) => {
            // no worker there any more, or it runs a cell: nothing to offer now
            tracing::debug!(session = %sid, error = %e, "a query found no live objects");
            Ok(Json(nothing))
        }
    }
}

/// How long a widget's callbacks may take to handle a comm message.
const COMM_TIMEOUT: Duration = Duration::from_secs(60);

/// A client's comm message (ipywidgets), for the session's CPU worker, which
/// serves the session's comms between cells (ADR 33). `held` is false when the
/// session has no CPU worker (no comm is open there; a `comm_open` is not taken).
#[utoipa::path(post, path = "/v1/sessions/{sid}/comm", params(("sid" = uuid::Uuid, Path, description = "the session")),
    request_body = CommMessage, responses((status = 200, body = CommAnswer),
        (status = 409, description = "the session's CPU worker is running a cell", body = ApiErrorBody)))]
pub(super) async fn comm(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
    body: Result<Json<CommMessage>, JsonRejection>,
) -> Result<Json<CommAnswer>, ApiError> {
    let (sid, addr) = lookup(&state, &sid, &caller).await?;
    let msg = json_body(body)?;
    let kinds = ["comm_open", "comm_msg", "comm_close", "comm_info_request"];
    if !kinds.contains(&msg.msg_type.as_str()) {
        return Err(bad_request(format!("msg_type {:?} is not one of {}", msg.msg_type, kinds.join(", "))));
    }
    if !msg.content.is_object() || !msg.metadata.is_object() {
        return Err(bad_request("a comm message's content and metadata are JSON objects"));
    }
    let not_held = || {
        let reply = if msg.msg_type == "comm_info_request" {
            serde_json::json!({ "status": "ok", "comms": {} })
        } else {
            serde_json::json!({})
        };
        Json(CommAnswer { held: false, reply, outputs: vec![] })
    };
    let Some(host) = addr.send(session::CpuHost).await.map_err(mailbox)? else {
        return Ok(not_held());
    };
    let bus = &state.shared.bus;
    let request = CommV1 {
        session: sid,
        msg_type: msg.msg_type.clone(),
        content_json: msg.content.to_string(),
        metadata_json: msg.metadata.to_string(),
        buffers: msg.buffers.clone(),
    };
    let subject = bus.subjects().host_command(&host, HostVerb::Comm);
    match bus.request::<CommV1, CommAnswerV2>(subject, &request, COMM_TIMEOUT).await {
        Ok(answer) => {
            let reply = serde_json::from_str(&answer.reply_json)
                .map_err(|e| internal(format!("the worker's reply is not JSON: {e}")))?;
            Ok(Json(CommAnswer { held: true, reply, outputs: answer.messages }))
        }
        Err(BusError::Remote { code: ErrorCode::Conflict, message, .. }) => {
            Err(ApiError(StatusCode::CONFLICT, message))
        }
        Err(BusError::Remote { code: ErrorCode::BadRequest, message, .. }) => Err(bad_request(message)),
        Err(BusError::Remote { code: ErrorCode::NotFound, .. } | BusError::NoResponders { .. }) => Ok(not_held()),
        Err(e) => Err(unavailable(format!("the session's CPU worker did not take the comm message: {e}"))),
    }
}
