//! The HTTP API (axum): sessions, edits, runs, the SSE event stream, summaries.
//!
//! Handlers run on tokio tasks; they reach session actors through their addresses and
//! start new ones on the service's arbiter.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use actix::prelude::*;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json, Router};
use futures::StreamExt;
use schemas::bus::BusError;
use schemas::messages::{
    CommAnswerV1, CommV1, DoneV1, ErrorCode, OutputV1, QueryAnswerV1, QueryKind, QueryV1, SessionCloseV1,
    SessionDeleteV1, SessionEventV2, SessionIdleV1, SessionOptions,
};
use schemas::subjects::{HostVerb, StoreVerb};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use uuid::Uuid;

use crate::admission::Limits;
use crate::api::{
    ApiErrorBody, CellCode, CodeAtCursor, CommAnswer, CommMessage, CreateSession, Health, InputLine, Interrupted,
    RunAccepted, RunCell, SessionCreated, SessionDeleted, SessionSummary, StreamItem,
};
use crate::auth::{Caller, Tokens};
use crate::origins::Origins;
use crate::records::{SessionRecord, RECORD_VERSION};
use crate::resume::Position;
use crate::session::{self, SessionActor};

/// How often an idle event stream carries a comment: it keeps proxies from closing
/// it, and a write to a client that went away ends the stream (its session counts
/// as watched until then).
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// The largest request body (8 MiB): a larger one is refused with 413 before any
/// handler reads it (`serve::read_body_in_time`), naming its size and the limit.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// The largest cell (its code, in bytes of UTF-8): its body's limit, which binds
/// first (a cell's code is never longer than the JSON that carries it); checked
/// again on the code itself, refused with 413 naming both.
pub const MAX_CELL_BYTES: usize = MAX_BODY_BYTES;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// What session actors share (bus, timeouts, hosts, claims, records).
    pub shared: session::Shared,
    /// The arbiter session actors run on.
    pub arbiter: actix::ArbiterHandle,
    /// Sessions this frontend serves now.
    pub sessions: Arc<RwLock<HashMap<Uuid, Served>>>,
    /// Cancelled at shutdown; ends SSE streams.
    pub shutdown: CancellationToken,
    /// The API's bearer tokens (see [`crate::auth`]).
    pub tokens: Tokens,
    /// What a user may ask for (see [`crate::admission`]).
    pub limits: Limits,
    /// Host names and browser origins the API answers (see [`crate::origins`]).
    pub origins: Origins,
    /// Held from counting a user's sessions to recording a new one, so that
    /// requests at once cannot pass the per-user limit together (on this frontend).
    pub creating: Arc<tokio::sync::Mutex<()>>,
}

/// A session this frontend serves: its actor, and the user it belongs to.
#[derive(Clone)]
pub struct Served {
    addr: Addr<SessionActor>,
    owner: Option<String>,
}

impl AppState {
    fn session(&self, sid: Uuid) -> Option<Served> {
        self.sessions.read().unwrap_or_else(|e| e.into_inner()).get(&sid).cloned()
    }

    fn insert(&self, sid: Uuid, served: Served) {
        let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
        sessions.insert(sid, served);
        count_sessions(&sessions);
    }

    fn remove(&self, sid: Uuid) -> Option<Served> {
        let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
        let removed = sessions.remove(&sid);
        count_sessions(&sessions);
        removed
    }

    /// Stop serving the sessions idle for longer than `after`: their actors stop
    /// and hosts stop the workers they keep for them (`SessionIdleV1`); their state
    /// and records stay, and the next request adopts them again.
    pub async fn cull_idle(&self, after: Duration) {
        let served: Vec<(Uuid, Served)> =
            self.sessions.read().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (*k, v.clone())).collect();
        for (sid, s) in served {
            let Ok(Some(idle)) = s.addr.send(session::IdleFor).await else { continue };
            if idle < after {
                continue;
            }
            {
                let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
                // only the actor asked: a session adopted again meanwhile stays
                if !sessions.get(&sid).is_some_and(|now| now.addr == s.addr) {
                    continue;
                }
                sessions.remove(&sid);
                count_sessions(&sessions);
            }
            s.addr.do_send(session::Close { grace: Duration::ZERO });
            let bus = &self.shared.bus;
            if let Err(e) = bus.publish(bus.subjects().idle(sid), &SessionIdleV1 { session: sid }).await {
                tracing::warn!(session = %sid, error = %e, "could not tell the hosts a session was culled");
            }
            tracing::info!(session = %sid, idle = ?idle, "session culled for idleness (its state stays)");
        }
    }

    /// Every session's address (for shutdown).
    pub fn drain(&self) -> Vec<Addr<SessionActor>> {
        self.sessions.write().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, s)| s.addr).collect()
    }
}

/// An API error: a status and a JSON `{"error": ...}` body.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

fn bad_request(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
}

fn internal(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::INTERNAL_SERVER_ERROR, msg.into())
}

fn json_body<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(v)| v).map_err(|e| {
        // a body that is not the JSON we expect is a bad request; a missing content
        // type (415) and a body over the limit (413) keep their own status
        let keep = [StatusCode::UNSUPPORTED_MEDIA_TYPE, StatusCode::PAYLOAD_TOO_LARGE];
        let status = if keep.contains(&e.status()) { e.status() } else { StatusCode::BAD_REQUEST };
        ApiError(status, format!("bad request body: {}", e.body_text()))
    })
}

/// A cell's code from a request body, refused (413) over `MAX_CELL_BYTES`.
fn cell_code(code: String) -> Result<String, ApiError> {
    if code.len() > MAX_CELL_BYTES {
        let limit = crate::serve::in_mib(MAX_CELL_BYTES);
        return Err(ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the cell's code is {} bytes, over the limit of {MAX_CELL_BYTES} bytes ({limit})", code.len()),
        ));
    }
    Ok(code)
}

fn parse_sid(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|e| bad_request(format!("session id {raw:?} is not a uuid: {e}")))
}

/// The session named `raw` if it is `caller`'s: the one this frontend serves, or
/// one it adopts from its record (created by another frontend, or by this one
/// before it restarted). Another user's session is not found, as if it did not exist.
async fn lookup(state: &AppState, raw: &str, caller: &Caller) -> Result<(Uuid, Addr<SessionActor>), ApiError> {
    let sid = parse_sid(raw)?;
    let not_found = || ApiError(StatusCode::NOT_FOUND, format!("no session {sid}"));
    if let Some(served) = state.session(sid) {
        return if served.owner == caller.0 { Ok((sid, served.addr)) } else { Err(not_found()) };
    }
    let record = state
        .shared
        .records
        .get(sid)
        .await
        .map_err(|e| ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?
        .filter(|r| r.owner == caller.0)
        .ok_or_else(not_found)?;
    let owner = record.owner.clone();
    let adopted = start_session(state, record).await?;
    let mut sessions = state.sessions.write().unwrap_or_else(|e| e.into_inner());
    // two requests may adopt it at once: the first one in serves it
    if let Some(existing) = sessions.get(&sid) {
        adopted.do_send(session::Close { grace: Duration::ZERO });
        return Ok((sid, existing.addr.clone()));
    }
    sessions.insert(sid, Served { addr: adopted.clone(), owner });
    count_sessions(&sessions);
    tracing::info!(session = %sid, "session adopted from its record");
    Ok((sid, adopted))
}

/// Start the actor of the session `record` describes, with its subscriptions.
async fn start_session(state: &AppState, record: SessionRecord) -> Result<Addr<SessionActor>, ApiError> {
    let (sid, bus) = (record.session_id, &state.shared.bus);
    let s = bus.subjects().clone();
    let events = bus
        .subscribe::<SessionEventV2>(s.event(sid))
        .await
        .map_err(|e| internal(format!("cannot subscribe to the session's events: {e}")))?;
    let outputs = bus
        .subscribe::<OutputV1>(s.session_outputs(sid))
        .await
        .map_err(|e| internal(format!("cannot subscribe to the session's outputs: {e}")))?;
    let shared = state.shared.clone();
    Ok(SessionActor::start_in_arbiter(&state.arbiter, move |ctx| {
        ctx.add_stream(events.into_stream());
        ctx.add_stream(outputs.into_stream());
        SessionActor::new(record, shared)
    }))
}

/// The sessions gauge follows the sessions served.
fn count_sessions(sessions: &HashMap<Uuid, Served>) {
    schemas::metrics::metrics().sessions.set(sessions.len() as i64);
}

fn mailbox(e: MailboxError) -> ApiError {
    ApiError(StatusCode::GONE, format!("the session is closing: {e}"))
}

/// The router of the API (bodies must arrive within `body_timeout`).
pub fn router(state: AppState, body_timeout: Duration) -> Router {
    Router::new()
        .route("/", get(dashboard_page))
        .route("/v1/dashboard", get(dashboard))
        .route("/v1/health", get(health))
        .route("/v1/openapi.json", get(openapi_json))
        .route("/v1/sessions", post(create_session))
        .route("/v1/sessions/{sid}", get(summary).delete(delete_session))
        .route("/v1/sessions/{sid}/events", get(events))
        .route("/v1/sessions/{sid}/interrupt", post(interrupt))
        .route("/v1/sessions/{sid}/executions/{exec_id}/input", post(input))
        .route("/v1/sessions/{sid}/complete", post(complete))
        .route("/v1/sessions/{sid}/inspect", post(inspect))
        .route("/v1/sessions/{sid}/comm", post(comm))
        .route("/v1/sessions/{sid}/cells/{cell_id}", put(edit))
        .route("/v1/sessions/{sid}/cells/{cell_id}/run", post(run))
        .fallback(|| async { ApiError(StatusCode::NOT_FOUND, "no such route".into()) })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(move |req, next| {
            crate::serve::read_body_in_time(MAX_BODY_BYTES, body_timeout, req, next)
        }))
        .layer(axum::middleware::from_fn_with_state(state.tokens.clone(), crate::auth::require_token))
        // outermost: a request for a host not allowed, or a CORS preflight, never
        // reaches the token check
        .layer(axum::middleware::from_fn_with_state(state.origins.clone(), crate::origins::check))
        .with_state(state)
}

/// The dashboard's page (ADR 47): hosts, sessions and executions, live.
async fn dashboard_page() -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // everything it needs is inline; it talks only to this frontend
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'",
            ),
        ],
        crate::dashboard::PAGE,
    )
        .into_response()
}

/// What the dashboard shows, as Server-Sent Events: a snapshot at once, then one
/// after each change (at most every 200 ms) and at least every 2 s. The caller
/// sees the sessions it owns and every gpu-host.
#[utoipa::path(get, path = "/v1/dashboard",
    responses((status = 200, content_type = "text/event-stream", description = "JSON snapshots, one per `data:` line")))]
async fn dashboard(State(state): State<AppState>, Extension(caller): Extension<Caller>) -> Response {
    let board = state.shared.dashboard.clone();
    let seen = board.subscribe();
    let stream = futures::stream::unfold((board, seen, caller, true), |(board, mut seen, caller, first)| async move {
        if !first {
            board.changes(&mut seen, DASHBOARD_EVERY).await;
            tokio::time::sleep(DASHBOARD_GATHER).await; // a burst of changes is one snapshot
        }
        let event = Event::default().data(board.snapshot(&caller).to_string());
        Some((Ok::<_, Infallible>(event), (board, seen, caller, false)))
    })
    .take_until(state.shutdown.clone().cancelled_owned());
    Sse::new(stream).keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE)).into_response()
}

/// The dashboard's stream sends a snapshot at least this often.
const DASHBOARD_EVERY: Duration = Duration::from_secs(2);

/// And at most once per this (changes within it go in one snapshot).
const DASHBOARD_GATHER: Duration = Duration::from_millis(200);

/// Whether the frontend answers (no token needed: for probes).
#[utoipa::path(get, path = "/v1/health", security(()), responses((status = 200, body = Health)))]
async fn health(State(state): State<AppState>) -> Json<Health> {
    let sessions = state.sessions.read().unwrap_or_else(|e| e.into_inner()).len();
    Json(Health { status: "ok".into(), sessions })
}

/// Create a session whose cells run in `cwd` (under the operator's root).
#[utoipa::path(post, path = "/v1/sessions", request_body = CreateSession, responses((status = 200, body = SessionCreated)))]
async fn create_session(
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

/// The cell as the user edits it: workers are prepared for it (speculation).
#[utoipa::path(put, path = "/v1/sessions/{sid}/cells/{cell_id}", params(("sid" = uuid::Uuid, Path, description = "the session"), ("cell_id" = String, Path, description = "the cell (any text)")),
    request_body = CellCode, responses((status = 202, description = "the edit was sent to the planner")))]
async fn edit(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((sid, cell_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Json<CellCode>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    // the preparation this edit starts is linked from the run it prepares
    let span = tracing::info_span!("edit", otel.name = "cell edit", session = %sid, cell = %cell_id);
    continue_http_trace(&span, &headers);
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

/// Continue the trace a request's `traceparent` header names (a kernel's
/// execute_request, a caller's own trace), if it has one.
fn continue_http_trace(span: &tracing::Span, headers: &HeaderMap) {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    schemas::telemetry::continue_http_trace(span, header("traceparent"), header("tracestate"));
}

/// The most a run's `user_expressions` may hold (names and expressions): they
/// travel in the run, the recipe and the session's record.
const MAX_USER_EXPRESSION_BYTES: usize = 64 * 1024;

/// Run the cell; answered once the run is recorded (it outlives this frontend).
#[utoipa::path(post, path = "/v1/sessions/{sid}/cells/{cell_id}/run", params(("sid" = uuid::Uuid, Path, description = "the session"), ("cell_id" = String, Path, description = "the cell (any text)")),
    request_body = RunCell, responses((status = 200, body = RunAccepted)))]
async fn run(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((sid, cell_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Json<RunCell>, JsonRejection>,
) -> Result<Json<RunAccepted>, ApiError> {
    // Run is the moment the request arrived (DESIGN.md section 10)
    let run_unix_ms = schemas::unix_ms();
    // the root of the cell's one trace (under the caller's, if it sent one); it
    // ends when the execution does
    let span = tracing::info_span!("cell", otel.name = "run cell", session = %sid, cell = %cell_id,
        exec = tracing::field::Empty);
    continue_http_trace(&span, &headers);
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
async fn interrupt(
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
async fn input(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((sid, exec_id)): Path<(String, String)>,
    body: Result<Json<InputLine>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let (sid, addr) = lookup(&state, &sid, &caller).await?;
    let exec_id =
        Uuid::parse_str(&exec_id).map_err(|e| bad_request(format!("execution id {exec_id:?} is not a uuid: {e}")))?;
    let value = json_body(body)?.value;
    let reply = addr
        .send(session::Input { exec_id, value })
        .await
        .map_err(mailbox)?
        .map_err(|why| ApiError(StatusCode::CONFLICT, why))?;
    let bus = &state.shared.bus;
    bus.publish(bus.subjects().input(sid), &reply)
        .await
        .map_err(|e| internal(format!("could not send the answer to the cell: {e}")))?;
    Ok(StatusCode::ACCEPTED)
}

/// How long a completion or inspection waits for the session's CPU worker: an
/// editor asks as the user types, and nothing is better than a late answer.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// Completions at the cursor from the session's live objects (its CPU worker):
/// the content of Jupyter's `complete_reply`; no matches while no CPU cell has
/// run, or while one runs.
#[utoipa::path(post, path = "/v1/sessions/{sid}/complete", params(("sid" = uuid::Uuid, Path, description = "the session")),
    request_body = CodeAtCursor, responses((status = 200, description = "complete_reply content", content_type = "application/json")))]
async fn complete(
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
async fn inspect(
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
async fn comm(
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
    match bus.request::<CommV1, CommAnswerV1>(subject, &request, COMM_TIMEOUT).await {
        Ok(answer) => {
            let parse = |text: &str| serde_json::from_str::<serde_json::Value>(text);
            let reply =
                parse(&answer.reply_json).map_err(|e| internal(format!("the worker's reply is not JSON: {e}")))?;
            let outputs = answer
                .outputs_json
                .iter()
                .map(|o| parse(o))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| internal(format!("an output of the comm message is not JSON: {e}")))?;
            Ok(Json(CommAnswer { held: true, reply, outputs }))
        }
        Err(BusError::Remote { code: ErrorCode::Conflict, message, .. }) => {
            Err(ApiError(StatusCode::CONFLICT, message))
        }
        Err(BusError::Remote { code: ErrorCode::BadRequest, message, .. }) => Err(bad_request(message)),
        Err(BusError::Remote { code: ErrorCode::NotFound, .. } | BusError::NoResponders { .. }) => Ok(not_held()),
        Err(e) => Err(unavailable(format!("the session's CPU worker did not take the comm message: {e}"))),
    }
}

/// The session's revision, current run, queue and executions.
#[utoipa::path(get, path = "/v1/sessions/{sid}", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = SessionSummary)))]
async fn summary(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
) -> Result<Json<SessionSummary>, ApiError> {
    let (_sid, addr) = lookup(&state, &sid, &caller).await?;
    Ok(Json(addr.send(session::Summary).await.map_err(mailbox)?))
}

/// The session's event stream (Server-Sent Events, one `StreamItem` per `data:`
/// line; `Last-Event-ID` resumes after the item with that id, with no item twice,
/// also on a frontend that restarted or adopted the session meanwhile).
#[utoipa::path(get, path = "/v1/sessions/{sid}/events",
    params(("sid" = uuid::Uuid, Path, description = "the session"), ("Last-Event-ID" = Option<String>, Header, description = "the id of the last item seen")),
    responses((status = 200, content_type = "text/event-stream", body = StreamItem)))]
async fn events(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (_sid, addr) = lookup(&state, &sid, &caller).await?;
    // a client that reconnects says the last id it saw: it gets only what came after
    // and it did not see
    let last = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(Position::parse)
                .ok_or_else(|| bad_request("Last-Event-ID must be the id of an event of this stream"))?,
        ),
    };
    let (replay, rx) = addr.send(session::Attach { last }).await.map_err(mailbox)?;
    let live = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
    let stream = futures::stream::iter(replay)
        .chain(live)
        .map(|(id, line)| Ok::<_, Infallible>(Event::default().id(id).data(line)))
        .take_until(state.shutdown.clone().cancelled_owned());
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE)).into_response())
}

/// Stop the session's cells and delete it with its state.
#[utoipa::path(delete, path = "/v1/sessions/{sid}", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = SessionDeleted)))]
async fn delete_session(
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

/// The API's OpenAPI description, derived from the handlers and the client
/// crate's types (`docs/api.md` explains it in words).
#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "LooseLeaf frontend API", version = "1", description = "Sessions, edits, runs and their event stream"),
    paths(health, openapi_json, create_session, summary, delete_session, edit, run, interrupt, input, complete, inspect, comm, events, dashboard),
    components(schemas(ApiErrorBody)),
    modifiers(&Errors),
    security(("bearer" = []))
)]
pub struct ApiDoc;

/// Every error an operation may answer, with the JSON body all errors share, and
/// the bearer scheme.
struct Errors;

impl utoipa::Modify for Errors {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{security, ContentBuilder, Ref, ResponseBuilder};
        let components = api.components.get_or_insert_with(Default::default);
        let bearer = security::HttpBuilder::new().scheme(security::HttpAuthScheme::Bearer).build();
        components.add_security_scheme("bearer", security::SecurityScheme::Http(bearer));
        let errors = [
            ("400", "the request is malformed (the message names what)"),
            ("401", "no token, or not a token of this API"),
            ("403", "a browser origin not allowed"),
            ("404", "no such session (or another user's)"),
            ("408", "the body did not arrive in time"),
            ("410", "the session is closing"),
            ("413", "the body is larger than the limit"),
            ("415", "the body is not JSON"),
            ("421", "a Host this API does not answer"),
            ("429", "a limit (sessions per user, queued runs) is reached"),
            ("500", "the frontend could not do it (it says why)"),
            ("503", "a service it needs did not answer in time"),
        ];
        for item in api.paths.paths.values_mut() {
            let operations = [&mut item.get, &mut item.put, &mut item.post, &mut item.delete];
            for op in operations.into_iter().flatten() {
                for (code, why) in errors {
                    let body = ContentBuilder::new().schema(Some(Ref::from_schema_name("ApiErrorBody"))).build();
                    let response = ResponseBuilder::new().description(why).content("application/json", body).build();
                    op.responses.responses.entry(code.to_string()).or_insert(response.into());
                }
            }
        }
    }
}

/// This API's OpenAPI description (no token needed).
#[utoipa::path(get, path = "/v1/openapi.json", security(()), responses((status = 200, description = "OpenAPI 3.1", content_type = "application/json")))]
async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    use utoipa::OpenApi as _;
    Json(ApiDoc::openapi())
}
