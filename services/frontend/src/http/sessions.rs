//! Sessions: create one (or resume its notebook's detached one), list them, read
//! one's summary, detach it, resume it, move its state back (undo, checkout),
//! fork it, delete it with its state.

use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use schemas::checkpoint::Manifest;
use schemas::messages::{
    ErrorCode, ForkV1, ManifestGetV2, ManifestV2, RevertTo, SessionOptions, StateCheckV1, StateCheckedV1, StateMovedV1,
};
use schemas::subjects::StoreVerb;
use uuid::Uuid;

use super::errors::{bad_request, internal, json_body, mailbox, unavailable, ApiError};
use super::state::{delete_in_store, delete_state, lookup, start_session, AppState, Served};
use crate::api::{
    Checkout, CreateSession, ResumedSession, SessionCreated, SessionDeleted, SessionDetached, SessionDiscarded,
    SessionListed, SessionSummary, StateMoved,
};
use crate::auth::Caller;
use crate::records::SessionRecord;
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
    let _creating = within_session_limit(&state, &caller).await?;
    let mut fresh_because = None;
    if let (true, Some(notebook)) = (req.resume, &req.notebook) {
        match resume_notebook(&state, &caller, notebook).await? {
            Resume::Resumed(created) => return Ok(Json(created)),
            Resume::Fresh(why) => fresh_because = Some(why),
            Resume::Nothing => {}
        }
    }
    let sid = Uuid::now_v7();
    let options = SessionOptions { cwd: req.cwd, all_gpu: req.all_gpu, speculate: req.speculate };
    let record = SessionRecord::new(sid, options, caller.user.clone(), req.notebook.clone());
    // recorded first: a session is never served that a restarted frontend would lose
    state.shared.records.put_new(&record).await.map_err(unavailable)?;
    let addr = start_session(&state, record).await?;
    state.insert(sid, Served { addr, owner: caller.user });
    tracing::info!(session = %sid, "session created");
    Ok(Json(SessionCreated { session_id: sid, resumed: None, fresh_because }))
}

/// An error if the caller holds as many sessions as a user may; else, with a
/// limit set, the lock that keeps two creations from both passing it.
async fn within_session_limit<'a>(
    state: &'a AppState,
    caller: &Caller,
) -> Result<Option<tokio::sync::MutexGuard<'a, ()>>, ApiError> {
    let Some(limit) = state.limits.sessions_per_user else { return Ok(None) };
    let creating = state.creating.lock().await;
    let held = state.shared.records.count_owned_by(&caller.user).await.map_err(unavailable)?;
    if held >= limit {
        let who = caller.user.as_deref().unwrap_or("anonymous");
        let msg = format!("user {who} holds {held} sessions, the most allowed; delete one first");
        return Err(ApiError(StatusCode::TOO_MANY_REQUESTS, msg));
    }
    Ok(Some(creating))
}

/// What a resume by notebook found.
enum Resume {
    /// The session it attached.
    Resumed(SessionCreated),
    /// None could be resumed, and this says why: others attached them first, or
    /// the latest one's state cannot be restored.
    Fresh(String),
    /// None to resume.
    Nothing,
}

/// The records of the caller's sessions, live and detached.
async fn owned_records(state: &AppState, caller: &Caller) -> Result<Vec<SessionRecord>, ApiError> {
    let all = state.shared.records.all().await.map_err(unavailable)?;
    Ok(all.into_iter().filter(|r| r.owner == caller.user).collect())
}

/// Attach and serve the caller's latest detached session of `notebook`.
async fn resume_notebook(state: &AppState, caller: &Caller, notebook: &str) -> Result<Resume, ApiError> {
    let of_notebook = |r: &SessionRecord| r.notebook.as_deref() == Some(notebook);
    // a kernel that died (killed, crashed, its machine asleep) left its session
    // attached with nobody following it: the notebook's next kernel takes it
    // over now, rather than after the unwatched-session detacher's wait
    let attached: Vec<Uuid> = owned_records(state, caller)
        .await?
        .into_iter()
        .filter(|r| of_notebook(r) && r.detached_unix_ms.is_none())
        .map(|r| r.session_id)
        .collect();
    for sid in attached {
        if state.detach_abandoned(sid).await {
            tracing::info!(session = %sid, notebook, "session of a kernel that is gone detached, to be resumed");
        }
    }
    let records: Vec<SessionRecord> = owned_records(state, caller).await?.into_iter().filter(of_notebook).collect();
    if records.is_empty() {
        return discarded_since(state, caller, notebook).await;
    }
    let open: Vec<String> =
        records.iter().filter(|r| r.detached_unix_ms.is_none()).map(|r| r.session_id.to_string()).collect();
    let mut candidates: Vec<SessionRecord> = records.into_iter().filter(|r| r.detached_unix_ms.is_some()).collect();
    if candidates.is_empty() {
        // every session of the notebook is in use by a kernel that still follows it
        let why = format!("this notebook's session ({}) is open in another kernel", open.join(", "));
        return Ok(Resume::Fresh(why));
    }
    candidates.sort_by_key(|r| std::cmp::Reverse(r.detached_unix_ms));
    for candidate in &candidates {
        match attach_and_serve(state, caller, candidate.session_id).await? {
            Attached::Served(created) => return Ok(Resume::Resumed(created)),
            Attached::Taken => {}
            // the notebook's latest state cannot be restored: said, and a fresh
            // session rather than an older one the user did not ask for
            Attached::Broken(why) => return Ok(Resume::Fresh(why)),
        }
    }
    let taken = candidates.iter().map(|r| r.session_id.to_string()).collect::<Vec<_>>().join(", ");
    Ok(Resume::Fresh(format!("another kernel resumed this notebook's detached session ({taken}) first")))
}

/// With no session of `notebook` left, the latest discard of one, if LooseLeaf
/// discarded it (the user is told why the state is gone).
async fn discarded_since(state: &AppState, caller: &Caller, notebook: &str) -> Result<Resume, ApiError> {
    let discards = owned_discards(state, caller).await?;
    let latest =
        discards.into_iter().filter(|d| d.notebook.as_deref() == Some(notebook)).max_by_key(|d| d.discarded_unix_ms);
    Ok(match latest {
        Some(d) => {
            let when =
                humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(d.discarded_unix_ms));
            Resume::Fresh(format!("this notebook's session {} was discarded at {when}: {}", d.session_id, d.why))
        }
        None => Resume::Nothing,
    })
}

/// What attaching a detached session came to.
enum Attached {
    /// Attached, served here.
    Served(SessionCreated),
    /// It was not detached (any more): another client attached it first.
    Taken,
    /// Its saved state cannot be restored (chunks are gone): it stays detached,
    /// and this says why.
    Broken(String),
}

/// Attach detached session `sid` (checked against its record's revision: one of
/// two at once wins) and serve it, once the store found its state whole.
async fn attach_and_serve(state: &AppState, caller: &Caller, sid: Uuid) -> Result<Attached, ApiError> {
    let record = state.shared.records.get(sid).await.map_err(unavailable)?;
    let Some(record) = record.filter(|r| r.detached_unix_ms.is_some()) else { return Ok(Attached::Taken) };
    let manifest = match check_state(state, &record).await {
        Ok(manifest) => manifest,
        Err(why) => return Ok(Attached::Broken(why)),
    };
    let Some((record, detached)) = state.shared.records.attach(sid).await.map_err(unavailable)? else {
        return Ok(Attached::Taken);
    };
    let resumed = described(&record, Some(detached), manifest.as_ref());
    let addr = start_session(state, record).await?;
    state.insert(sid, Served { addr, owner: caller.user.clone() });
    tracing::info!(session = %sid, "detached session resumed");
    Ok(Attached::Served(SessionCreated { session_id: sid, resumed: Some(resumed), fresh_because: None }))
}

/// The session's latest manifest, once the store found every chunk it references
/// (None: the store did not answer, so the resume goes on unchecked); why not,
/// if chunks are gone.
async fn check_state(state: &AppState, record: &SessionRecord) -> Result<Option<Manifest>, String> {
    let sid = record.session_id;
    let bus = &state.shared.bus;
    let ask = StateCheckV1 { session: sid, at_least: Some(record.revision) };
    match bus.request::<_, StateCheckedV1>(bus.subjects().store(StoreVerb::Check), &ask, CHECK_WAIT).await {
        Ok(StateCheckedV1 { missing_chunks: 0, manifest, .. }) => Ok(Some(manifest)),
        Ok(StateCheckedV1 { missing_chunks, example, manifest }) => {
            let of = manifest.chunks().len();
            let example = example.unwrap_or_default();
            tracing::error!(session = %sid, missing_chunks, of, %example, "a detached session's state is incomplete");
            Err(format!(
                "session {sid}'s saved state (revision {}) cannot be restored: {missing_chunks} of its {of} chunks \
                 are gone from the store (one is {example}); it stays detached, and `looseleaf sessions discard \
                 {sid}` removes it",
                manifest.revision
            ))
        }
        // the store answered: its manifests cannot be read
        Err(schemas::BusError::Remote { message, .. }) => {
            tracing::error!(session = %sid, error = %message, "a detached session's state cannot be read");
            Err(format!(
                "session {sid}'s saved state cannot be restored: {message}; it stays detached, and `looseleaf \
                 sessions discard {sid}` removes it"
            ))
        }
        Err(e) => {
            tracing::warn!(session = %sid, error = %e, "could not check a resumed session's state; resuming it unchecked");
            Ok(None)
        }
    }
}

/// What a resumed session holds, from its latest manifest (its revision alone
/// without one).
fn described(record: &SessionRecord, detached_unix_ms: Option<u64>, manifest: Option<&Manifest>) -> ResumedSession {
    let mut resumed =
        ResumedSession { detached_unix_ms, revision: record.revision, variables: 0, bytes: 0, unsavable: Vec::new() };
    if let Some(manifest) = manifest {
        resumed.revision = manifest.revision;
        resumed.variables = manifest.variables.len() as u64;
        resumed.bytes = manifest.objects.values().map(|o| o.bytes()).sum();
        resumed.unsavable = manifest.unsavable.keys().cloned().collect();
    }
    resumed
}

/// What a session holds now, from its latest manifest (see [`described`]).
async fn describe(state: &AppState, record: &SessionRecord, detached_unix_ms: Option<u64>) -> ResumedSession {
    let bus = &state.shared.bus;
    let ask = ManifestGetV2 { session: record.session_id, at_least: Some(record.revision) };
    match bus.request::<_, ManifestV2>(bus.subjects().store(StoreVerb::ManifestGet), &ask, MANIFEST_WAIT).await {
        Ok(ManifestV2 { manifest }) => described(record, detached_unix_ms, Some(&manifest)),
        Err(e) => {
            tracing::warn!(session = %record.session_id, error = %e, "could not read a session's manifest");
            described(record, detached_unix_ms, None)
        }
    }
}

/// How long a detach waits for the session's manifest (only to describe it).
const MANIFEST_WAIT: Duration = Duration::from_secs(5);

/// How long a resume waits for the store's check of the session's chunks (one
/// lookup each: a large session on S3 takes a while).
const CHECK_WAIT: Duration = Duration::from_secs(30);

/// The caller's sessions, live and detached (newest first).
#[utoipa::path(get, path = "/v1/sessions", responses((status = 200, body = Vec<SessionListed>)))]
pub(super) async fn list_sessions(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<SessionListed>>, ApiError> {
    let mut listed: Vec<SessionListed> = owned_records(&state, &caller)
        .await?
        .into_iter()
        .map(|r| SessionListed {
            session_id: r.session_id,
            notebook: r.notebook,
            cwd: r.options.cwd,
            created_unix_ms: r.created_unix_ms,
            revision: r.revision,
            detached_unix_ms: r.detached_unix_ms,
        })
        .collect();
    listed.sort_by_key(|s| std::cmp::Reverse(s.created_unix_ms));
    Ok(Json(listed))
}

/// The caller's detached sessions LooseLeaf discarded with their state (past
/// their retention, or to free space) in the last 30 days, newest first, and why.
#[utoipa::path(get, path = "/v1/discards", responses((status = 200, body = Vec<SessionDiscarded>)))]
pub(super) async fn list_discards(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<SessionDiscarded>>, ApiError> {
    let mut listed: Vec<SessionDiscarded> = owned_discards(&state, &caller).await?;
    listed.sort_by_key(|d| std::cmp::Reverse(d.discarded_unix_ms));
    Ok(Json(listed))
}

async fn owned_discards(state: &AppState, caller: &Caller) -> Result<Vec<SessionDiscarded>, ApiError> {
    let all = state.shared.records.discards().await.map_err(unavailable)?;
    Ok(all.into_iter().filter(|d| d.owner == caller.user).map(|d| d.listed).collect())
}

/// Detach the session: its workers and slots are freed now, its state stays for
/// a later kernel on its notebook to resume (a kernel's shutdown does this). The
/// answer names what could not be saved, so is gone.
#[utoipa::path(post, path = "/v1/sessions/{sid}/detach", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = SessionDetached)))]
pub(super) async fn detach_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
) -> Result<Json<SessionDetached>, ApiError> {
    let (sid, addr) = lookup(&state, &sid, &caller).await?;
    let served = Served { addr, owner: caller.user.clone() };
    let detached_unix_ms = state.detach(sid, &served, false).await.ok_or_else(|| {
        ApiError(StatusCode::CONFLICT, format!("session {sid} is being detached or deleted, or its state moved"))
    })?;
    // what its workers held that no later kernel gets back
    let record = state.shared.records.get(sid).await.ok().flatten();
    let unsavable = match record {
        Some(record) => describe(&state, &record, None).await.unsavable,
        None => Vec::new(),
    };
    tracing::info!(session = %sid, ?unsavable, "session detached by its client");
    Ok(Json(SessionDetached { session_id: sid, detached_unix_ms, unsavable }))
}

/// Resume a detached session by id (a 409 when it is attached already).
#[utoipa::path(post, path = "/v1/sessions/{sid}/resume", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = SessionCreated)))]
pub(super) async fn resume_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(raw): Path<String>,
) -> Result<Json<SessionCreated>, ApiError> {
    let sid = super::errors::parse_sid(&raw)?;
    let record = state.shared.records.get(sid).await.map_err(unavailable)?.filter(|r| r.owner == caller.user);
    let Some(record) = record else { return Err(ApiError(StatusCode::NOT_FOUND, format!("no session {sid}"))) };
    if record.detached_unix_ms.is_none() {
        return Err(ApiError(StatusCode::CONFLICT, format!("session {sid} is not detached: it is in use")));
    }
    match attach_and_serve(&state, &caller, sid).await? {
        Attached::Served(created) => Ok(Json(created)),
        Attached::Taken => {
            Err(ApiError(StatusCode::CONFLICT, format!("session {sid} was resumed by another client first")))
        }
        Attached::Broken(why) => Err(ApiError(StatusCode::GONE, why)),
    }
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
    let store_error = delete_state(&state, sid).await.map_err(internal)?;
    tracing::info!(session = %sid, "session deleted");
    Ok(Json(SessionDeleted { session_id: sid, deleted: true, store_error }))
}

/// Move the session's state back to before its last cell (again: before the one
/// before it). Outputs, and files cells wrote, stay as they are.
#[utoipa::path(post, path = "/v1/sessions/{sid}/undo", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = StateMoved)))]
pub(super) async fn undo_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
) -> Result<Json<StateMoved>, ApiError> {
    revert(&state, &caller, &sid, RevertTo::Undo).await.map(Json)
}

/// Move the session's state to what revision `revision` holds (an execution's
/// `after_revision`); the revisions after it stay, so a later checkout may
/// return to them.
#[utoipa::path(post, path = "/v1/sessions/{sid}/checkout", params(("sid" = uuid::Uuid, Path, description = "the session")), request_body = Checkout, responses((status = 200, body = StateMoved)))]
pub(super) async fn checkout_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(sid): Path<String>,
    body: Result<Json<Checkout>, JsonRejection>,
) -> Result<Json<StateMoved>, ApiError> {
    let req = json_body(body)?;
    revert(&state, &caller, &sid, RevertTo::Revision(req.revision)).await.map(Json)
}

async fn revert(state: &AppState, caller: &Caller, raw: &str, to: RevertTo) -> Result<StateMoved, ApiError> {
    let (sid, addr) = lookup(state, raw, caller).await?;
    let moved = match addr.send(session::Revert { to }).await.map_err(mailbox)? {
        Ok(moved) => moved,
        Err(session::Refused::Busy(why)) => return Err(ApiError(StatusCode::CONFLICT, why)),
        Err(session::Refused::Store(e)) => return Err(store_refused(e)),
    };
    tracing::info!(session = %sid, ?to, revision = moved.revision, state_of = moved.state_of, "session state moved");
    Ok(state_moved(sid, moved, None))
}

/// Fork the session: a new session of the caller's whose state is this one's
/// now, sharing its chunks (nothing is copied). Names that could not be saved
/// are not in it. The fork starts detached: resuming it, or any request on it,
/// attaches it.
#[utoipa::path(post, path = "/v1/sessions/{sid}/fork", params(("sid" = uuid::Uuid, Path, description = "the session")), responses((status = 200, body = StateMoved)))]
pub(super) async fn fork_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(raw): Path<String>,
) -> Result<Json<StateMoved>, ApiError> {
    let (sid, addr) = lookup(&state, &raw, &caller).await?;
    let _creating = within_session_limit(&state, &caller).await?;
    let revision = addr.send(session::Summary).await.map_err(mailbox)?.revision;
    let parent = state.shared.records.get(sid).await.map_err(unavailable)?;
    let parent = parent.ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no session {sid}")))?;
    let child = Uuid::now_v7();
    let bus = &state.shared.bus;
    let ask = ForkV1 { parent: sid, at_least: Some(revision), child };
    let moved =
        match bus.request::<_, StateMovedV1>(bus.subjects().store(StoreVerb::Fork), &ask, session::STORE_WAIT).await {
            Ok(moved) => moved,
            Err(e) => {
                // unanswered, it may have landed: no manifest is left without a record
                if !matches!(e, schemas::BusError::Remote { .. }) {
                    discard_fork(&state, child).await;
                }
                return Err(store_refused(e));
            }
        };
    // a fork is opened by its id (a kernel on the notebook resumes the original),
    // and starts detached: nothing follows it yet, any request of its owner attaches it
    let mut record = SessionRecord::new(child, parent.options.clone(), caller.user.clone(), None);
    record.revision = moved.revision;
    record.detached_unix_ms = Some(record.created_unix_ms);
    if let Err(e) = state.shared.records.put_new(&record).await {
        // no record, no session: its manifest goes too
        discard_fork(&state, child).await;
        return Err(unavailable(e));
    }
    tracing::info!(parent = %sid, session = %child, state_of = moved.state_of, "session forked");
    Ok(Json(state_moved(child, moved, Some(sid))))
}

/// Delete a fork's state in the store: it has no record (the fork failed).
async fn discard_fork(state: &AppState, child: Uuid) {
    if let Err(e) = delete_in_store(state, child).await {
        tracing::warn!(session = %child, error = %e, "a fork without a record kept its manifest");
    }
}

fn state_moved(session_id: Uuid, m: StateMovedV1, forked_from: Option<Uuid>) -> StateMoved {
    StateMoved {
        session_id,
        revision: m.revision,
        state_of: m.state_of,
        variables: m.variables,
        bytes: m.bytes,
        unsavable: m.unsavable,
        forked_from,
    }
}

/// The API's answer to a store that refused or did not answer: a revision that
/// is not there is 404; nothing to undo, or a state that changed meanwhile, 409.
fn store_refused(e: schemas::BusError) -> ApiError {
    match e {
        schemas::BusError::Remote { code: ErrorCode::NotFound, message, .. } => {
            ApiError(StatusCode::NOT_FOUND, message)
        }
        schemas::BusError::Remote { code: ErrorCode::BadRequest | ErrorCode::Conflict, message, .. } => {
            ApiError(StatusCode::CONFLICT, message)
        }
        e => unavailable(format!("the store: {e}")),
    }
}
