//! A session's cells: edits (speculation), runs (answered once recorded; code
//! put aside when the record has no room), interrupts, and answers to `input()`.

use actix::Addr;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use tracing::Instrument as _;
use uuid::Uuid;

use super::errors::{bad_request, cell_code, internal, json_body, mailbox, unavailable, ApiError};
use super::state::{lookup, AppState};
use crate::api::{ApiErrorBody, CellCode, InputLine, Interrupted, RunAccepted, RunCell};
use crate::auth::Caller;
use crate::session::{self, SessionActor};

/// The cell as the user edits it: workers are prepared for it (speculation).
#[utoipa::path(put, path = "/v1/sessions/{sid}/cells/{cell_id}", params(("sid" = uuid::Uuid, Path, description = "the session"), ("cell_id" = String, Path, description = "the cell (any text)")),
    request_body = CellCode, responses((status = 202, description = "the edit was sent to the planner")))]
pub(super) async fn edit(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((sid, cell_id)): Path<(String, String)>,
    body: Result<Json<CellCode>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    // the preparation this edit starts is linked from the run it prepares
    // (a child of the request's span, which continues the caller's trace)
    let span = tracing::info_span!("edit", otel.name = "cell edit", looseleaf.session_id = %sid,
        looseleaf.cell_id = %cell_id);
    async move {
        let (sid, addr) = lookup(&state, &sid, &caller).await?;
        let code = cell_code(json_body(body)?.code)?;
        let msg = addr.send(session::Edit { cell_id, code }).await.map_err(mailbox)?;
        state
            .shared
            .bus
            .publish(state.shared.bus.subjects().edit(sid), &msg)
            .await
            .map_err(|e| internal(format!("could not publish the edit: {e}")))?;
        Ok(StatusCode::ACCEPTED)
    }
    .instrument(span)
    .await
}

/// The most a run's `user_expressions` may hold (names and expressions): they
/// travel in the run, the recipe and the session's record.
const MAX_USER_EXPRESSION_BYTES: usize = 64 * 1024;

/// Run the cell; answered once the run is recorded (it outlives this frontend).
#[utoipa::path(post, path = "/v1/sessions/{sid}/cells/{cell_id}/run", params(("sid" = uuid::Uuid, Path, description = "the session"), ("cell_id" = String, Path, description = "the cell (any text)")),
    request_body = RunCell, responses((status = 200, body = RunAccepted)))]
pub(super) async fn run(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((sid, cell_id)): Path<(String, String)>,
    body: Result<Json<RunCell>, JsonRejection>,
) -> Result<Json<RunAccepted>, ApiError> {
    // Run is the moment the request arrived (DESIGN.md section 10)
    let run_unix_ms = schemas::unix_ms();
    // the cell's one trace, under the request's span (which continues the
    // caller's trace, if it sent one); it ends when the execution does
    let span = tracing::info_span!("cell", otel.name = "run cell", looseleaf.session_id = %sid,
        looseleaf.cell_id = %cell_id, looseleaf.exec_id = tracing::field::Empty);
    let (_sid, addr) = lookup(&state, &sid, &caller).await?;
    let RunCell { code, allow_stdin, user_expressions } = json_body(body)?;
    let code = cell_code(code)?;
    let asked: usize = user_expressions.iter().map(|(k, v)| k.len() + v.len()).sum();
    if asked > MAX_USER_EXPRESSION_BYTES {
        return Err(ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("user_expressions hold {asked} bytes; at most {MAX_USER_EXPRESSION_BYTES} are taken"),
        ));
    }
    let run = session::Run { cell_id, code, run_unix_ms, allow_stdin, user_expressions, span, aside: None };
    let (exec_id, position, recorded) = queue_run(&state, &addr, run).await?;
    // answered once the run is in the session's record: no frontend loses it now
    if !matches!(tokio::time::timeout(session::RECORD_WAIT, recorded).await, Ok(Ok(()))) {
        let reason = format!("the session's record could not be written within {:?}", session::RECORD_WAIT);
        addr.do_send(session::Withdraw { exec_id, reason: format!("aborted: {reason}") });
        return Err(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{reason}: the run was not accepted; try again"),
        ));
    }
    Ok(Json(RunAccepted { exec_id, position }))
}

/// Hand `run` to its session. One that must wait while the session's record has
/// no room for its code has its code put aside first (a body in the bodies
/// bucket, ADR 53) and is handed again; the body is deleted if it is not taken.
async fn queue_run(
    state: &AppState,
    addr: &Addr<SessionActor>,
    run: session::Run,
) -> Result<(Uuid, usize, tokio::sync::oneshot::Receiver<()>), ApiError> {
    let full = |why: session::QueueFull| ApiError(StatusCode::TOO_MANY_REQUESTS, why.to_string());
    let mut run = match addr.send(run).await.map_err(mailbox)? {
        Ok(session::RunAnswer::Accepted { exec_id, position, recorded }) => return Ok((exec_id, position, recorded)),
        Ok(session::RunAnswer::PutAside(run)) => *run,
        Err(why) => return Err(full(why)),
    };
    let bodies = &state.shared.bodies;
    let header = crate::records::put_aside(bodies, &run.code, &run.user_expressions)
        .await
        .map_err(|e| unavailable(format!("the cell's code could not be kept for its turn: {e}")))?;
    run.aside = Some(header.clone());
    let refused = match addr.send(run).await {
        Ok(Ok(session::RunAnswer::Accepted { exec_id, position, recorded })) => {
            return Ok((exec_id, position, recorded))
        }
        Ok(Ok(session::RunAnswer::PutAside(_))) => internal("the session did not take a run whose code was put aside"),
        Ok(Err(why)) => full(why),
        Err(e) => mailbox(e),
    };
    bodies.delete(&header).await;
    Err(refused)
}

/// Interrupt the running cell and abort the queued ones.
#[utoipa::path(post, path = "/v1/sessions/{sid}/interrupt", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = Interrupted)))]
pub(super) async fn interrupt(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
) -> Result<Json<Interrupted>, ApiError> {
    let (_sid, addr) = lookup(&state, &sid, &caller).await?;
    Ok(Json(addr.send(session::Interrupt).await.map_err(mailbox)?))
}

/// Answer the running cell's `input()` or `getpass()` (a run made with
/// `allow_stdin` that asked, through an `input_request` output).
#[utoipa::path(post, path = "/v1/sessions/{sid}/executions/{exec_id}/input",
    params(("sid" = uuid::Uuid, Path, description = "the session"), ("exec_id" = uuid::Uuid, Path, description = "the execution that asked")),
    request_body = InputLine, responses((status = 202, description = "the answer was sent to the cell"), (status = 409, description = "that execution is not waiting for input", body = ApiErrorBody)))]
pub(super) async fn input(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((sid, exec_id)): Path<(String, String)>,
    body: Result<Json<InputLine>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let (sid, addr) = lookup(&state, &sid, &caller).await?;
    let exec_id =
        Uuid::parse_str(&exec_id).map_err(|e| bad_request(format!("execution id {exec_id:?} is not a uuid: {e}")))?;
    let value = json_body(body)?.value;
    let (reply, host) = addr
        .send(session::Input { exec_id, value })
        .await
        .map_err(mailbox)?
        .map_err(|why| ApiError(StatusCode::CONFLICT, why))?;
    // only the host that runs the cell hears the answer (ADR 57)
    let host = match host {
        Some(host) => host,
        None => session::claim_holder(&state.shared.claims, exec_id).await.ok_or_else(|| {
            ApiError(StatusCode::CONFLICT, format!("no host holds execution {exec_id} of session {sid}"))
        })?,
    };
    let bus = &state.shared.bus;
    bus.publish(bus.subjects().host_command(&host, schemas::subjects::HostVerb::Input), &reply)
        .await
        .map_err(|e| internal(format!("could not send the answer to the cell: {e}")))?;
    Ok(StatusCode::ACCEPTED)
}
