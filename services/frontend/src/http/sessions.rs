//! Sessions: create one, read its summary, delete it with its state.

use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use schemas::messages::{DoneV1, SessionCloseV1, SessionDeleteV1, SessionOptions};
use schemas::subjects::StoreVerb;
use uuid::Uuid;

use super::errors::{bad_request, internal, json_body, mailbox, unavailable, ApiError};
use super::state::{lookup, start_session, AppState, Served};
use crate::api::{CreateSession, SessionCreated, SessionDeleted, SessionSummary};
use crate::auth::Caller;
use crate::records::{SessionRecord, RECORD_VERSION};
use crate::session;

/// Create a session whose cells run in `cwd` (under the operator's root).
#[utoipa::path(post, path = "/v1/sessions", request_body = CreateSession, responses((status = 200, body = SessionCreated)))]
pub(super) async fn create_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Json<CreateSession>, JsonRejection>,
) -> Result<Json<SessionCreated>, ApiError> {
    let req = json_body(body)?;
    state.limits.check_cwd(&req.cwd).map_err(bad_request)?;
    let _creating = match state.limits.sessions_per_user {
        Some(_) => Some(state.creating.lock().await),
        None => None,
    };
    if let Some(limit) = state.limits.sessions_per_user {
        let held = state.shared.records.count_owned_by(&caller.0).await.map_err(unavailable)?;
        if held >= limit {
            let who = caller.0.as_deref().unwrap_or("anonymous");
            let msg = format!("user {who} holds {held} sessions, the most allowed; delete one first");
            return Err(ApiError(StatusCode::TOO_MANY_REQUESTS, msg));
        }
    }
    let sid = Uuid::now_v7();
    let record = SessionRecord {
        version: RECORD_VERSION,
        session_id: sid,
        options: SessionOptions { cwd: req.cwd, all_gpu: req.all_gpu, speculate: req.speculate },
        created_unix_ms: schemas::unix_ms(),
        revision: 0,
        last_exec: None,
        owner: caller.0.clone(),
        in_flight: None,
        queued: Default::default(),
    };
    // recorded first: a session is never served that a restarted frontend would lose
    state.shared.records.put_new(&record).await.map_err(unavailable)?;
    let addr = start_session(&state, record).await?;
    state.insert(sid, Served { addr, owner: caller.0 });
    tracing::info!(session = %sid, "session created");
    Ok(Json(SessionCreated { session_id: sid }))
}

/// The session's revision, current run, queue and executions.
#[utoipa::path(get, path = "/v1/sessions/{sid}", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = SessionSummary)))]
pub(super) async fn summary(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
) -> Result<Json<SessionSummary>, ApiError> {
    let (_sid, addr) = lookup(&state, &sid, &caller).await?;
    Ok(Json(addr.send(session::Summary).await.map_err(mailbox)?))
}

/// Stop the session's cells and delete it with its state.
#[utoipa::path(delete, path = "/v1/sessions/{sid}", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = SessionDeleted)))]
pub(super) async fn delete_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
) -> Result<Json<SessionDeleted>, ApiError> {
    let (sid, addr) = lookup(&state, &sid, &caller).await?;
    state.remove(sid);
    addr.do_send(session::Close { grace: state.shared.timeouts.close_grace });
    let s = state.shared.bus.subjects().clone();
    state
        .shared
        .bus
        .publish(s.close(sid), &SessionCloseV1 { session: sid })
        .await
        .map_err(|e| internal(format!("could not publish the close: {e}")))?;
    state
        .shared
        .records
        .remove(sid)
        .await
        .map_err(|e| internal(format!("could not remove the session's record: {e}")))?;
    let store = state
        .shared
        .bus
        .request::<SessionDeleteV1, DoneV1>(
            s.store(StoreVerb::SessionDelete),
            &SessionDeleteV1 { session: sid },
            Duration::from_secs(10),
        )
        .await;
    let store_error = match store {
        Ok(DoneV1 {}) => None,
        Err(e) => {
            tracing::warn!(session = %sid, error = %e, "store did not delete the session's state");
            Some(e.to_string())
        }
    };
    tracing::info!(session = %sid, "session deleted");
    Ok(Json(SessionDeleted { session_id: sid, deleted: true, store_error }))
}
