//! Completions, inspections and comm messages answered by a session's CPU
//! worker (ADR 33), between its cells.

use std::sync::Arc;

use schemas::messages::{CommAnswerV2, CommV1, ErrorCode, QueryAnswerV1, QueryKind, QueryV1, Reply};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::protocol::Frame;
use crate::worker::WorkerProc;

/// The session's CPU worker if it is idle: `NotFound` when this host keeps none
/// (or lost it), `Conflict` while it runs a cell (a kernel asks between cells;
/// an editor typing meanwhile gets nothing rather than a wait).
fn idle_cpu_worker(
    worker: &Option<Arc<Mutex<WorkerProc>>>,
    session: Uuid,
) -> Result<tokio::sync::MutexGuard<'_, WorkerProc>, (ErrorCode, String)> {
    let Some(worker) = worker else {
        return Err((ErrorCode::NotFound, format!("this host keeps no CPU worker for session {session}")));
    };
    let Ok(w) = worker.try_lock() else {
        return Err((ErrorCode::Conflict, "the session's CPU worker is running a cell".into()));
    };
    if w.is_broken() {
        return Err((ErrorCode::NotFound, "the session's CPU worker was lost".into()));
    }
    Ok(w)
}

/// A completion or inspection answered by the session's CPU worker.
pub(super) async fn query_cpu_worker(worker: Option<Arc<Mutex<WorkerProc>>>, q: QueryV1) -> Reply<QueryAnswerV1> {
    let mut w = match idle_cpu_worker(&worker, q.session) {
        Ok(w) => w,
        Err((code, message)) => return Reply::Err { code, message },
    };
    let kind = match q.kind {
        QueryKind::Complete => "complete",
        QueryKind::Inspect => "inspect",
    };
    let frame =
        Frame::Query { kind: kind.into(), code: q.code, cursor_pos: q.cursor_pos, detail_level: q.detail_level };
    match w.query(frame).await {
        Ok(content) => Reply::Ok(QueryAnswerV1 { content_json: content.to_string() }),
        Err(e) => {
            Reply::Err { code: ErrorCode::Internal, message: format!("the session's CPU worker could not answer: {e}") }
        }
    }
}

/// A client's comm message handled by the session's CPU worker (ADR 33).
pub(super) async fn comm_cpu_worker(worker: Option<Arc<Mutex<WorkerProc>>>, c: CommV1) -> Reply<CommAnswerV2> {
    let json = |what: &str, text: &str| {
        serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .filter(serde_json::Value::is_object)
            .ok_or_else(|| format!("the comm message's {what} is not a JSON object"))
    };
    let (content, metadata) = match (json("content", &c.content_json), json("metadata", &c.metadata_json)) {
        (Ok(content), Ok(metadata)) => (content, metadata),
        (Err(message), _) | (_, Err(message)) => return Reply::Err { code: ErrorCode::BadRequest, message },
    };
    let mut w = match idle_cpu_worker(&worker, c.session) {
        Ok(w) => w,
        Err((code, message)) => return Reply::Err { code, message },
    };
    let frame = Frame::Comm { msg_type: c.msg_type, content, metadata, buffers: c.buffers };
    match w.comm(frame).await {
        Ok((reply, messages)) => Reply::Ok(CommAnswerV2 { reply_json: reply.to_string(), messages }),
        Err(e) => Reply::Err {
            code: ErrorCode::Internal,
            message: format!("the session's CPU worker could not take the comm message: {e}"),
        },
    }
}
