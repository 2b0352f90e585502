//! What every handler shares, and the sessions this frontend serves: found by id
//! for their owner, adopted from their records, culled when idle.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use actix::prelude::*;
use axum::http::StatusCode;
use schemas::messages::{
    DoneV1, OutputV2, SessionCloseV1, SessionDeleteV1, SessionEventV2, SessionIdleV1, StorePressureV1,
};
use schemas::subjects::StoreVerb;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::errors::{internal, parse_sid, ApiError};
use crate::admission::Limits;
use crate::api::{SessionDiscarded, DISCARDS_KEPT_DAYS};
use crate::auth::{Caller, Tokens};
use crate::origins::Origins;
use crate::records::{self, SessionRecord};
use crate::session::{self, SessionActor};

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
    pub(super) addr: Addr<SessionActor>,
    pub(super) owner: Option<String>,
}

impl AppState {
    fn session(&self, sid: Uuid) -> Option<Served> {
        self.sessions.read().unwrap_or_else(|e| e.into_inner()).get(&sid).cloned()
    }

    pub(super) fn insert(&self, sid: Uuid, served: Served) {
        let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
        sessions.insert(sid, served);
        count_sessions(&sessions);
    }

    /// Every session this frontend serves now.
    fn served(&self) -> Vec<(Uuid, Served)> {
        self.sessions.read().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (*k, v.clone())).collect()
    }

    pub(super) fn remove(&self, sid: Uuid) -> Option<Served> {
        let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
        let removed = sessions.remove(&sid);
        count_sessions(&sessions);
        removed
    }

    /// Detach the sessions nobody has watched or used for longer than `after`
    /// (their kernel is gone, or a script stopped): see [`AppState::detach`].
    pub async fn detach_unwatched(&self, after: Duration) {
        for (sid, s) in self.served() {
            let Ok(Some(idle)) = s.addr.send(session::IdleFor).await else { continue };
            if idle < after {
                continue;
            }
            if self.detach(sid, &s, true).await.is_some() {
                tracing::info!(session = %sid, idle = ?idle, "session detached: idle with no client (its state stays)");
            }
        }
    }

    /// Detach session `sid` if this frontend serves it and nobody follows it or
    /// runs anything in it (its client is gone); whether it did.
    pub(super) async fn detach_abandoned(&self, sid: Uuid) -> bool {
        let Some(served) = self.session(sid) else { return false };
        if !matches!(served.addr.send(session::IdleFor).await, Ok(Some(_))) {
            return false;
        }
        self.detach(sid, &served, true).await.is_some()
    }

    /// Stop the workers the hosts keep for every session idle (nothing running
    /// or queued, no request) for longer than `after`, watched or not: once per
    /// idle spell. The session stays attached; its next cell restores its
    /// closure into a new worker.
    pub async fn cull_idle_workers(&self, after: Duration) {
        for (sid, s) in self.served() {
            let Ok(Some(idle)) = s.addr.send(session::FreeIdleWorkers { after }).await else { continue };
            let bus = &self.shared.bus;
            match bus.publish(bus.subjects().idle(sid), &SessionIdleV1 { session: sid }).await {
                Ok(()) => tracing::info!(session = %sid, idle = ?idle, "idle session's workers given back"),
                Err(e) => tracing::warn!(session = %sid, error = %e, "could not tell the hosts a session is idle"),
            }
        }
    }

    /// Detach session `sid` (served by `served`): its record is marked detached,
    /// this frontend stops serving it, and the hosts stop the workers they keep
    /// for it (`SessionIdleV1`); its state and record stay, for a new kernel on
    /// the same notebook to resume or any request of its owner to attach again.
    /// With `only_if_idle` (the culler), not if a run or a client came since it
    /// looked. None if it was not detached.
    pub async fn detach(&self, sid: Uuid, served: &Served, only_if_idle: bool) -> Option<u64> {
        let serving = |sessions: &HashMap<Uuid, Served>| sessions.get(&sid).is_some_and(|s| s.addr == served.addr);
        // only the actor asked: a session adopted again meanwhile stays
        if !serving(&self.sessions.read().unwrap_or_else(|e| e.into_inner())) {
            return None;
        }
        // marked first, then no longer served: a request meanwhile finds the
        // actor (which is closing), never the record unmarked beside a live actor
        let detached = served.addr.send(session::Detach { only_if_idle }).await.ok()??;
        // landed or not, the record's writer keeps trying while NATS is away
        let _ = tokio::time::timeout(DETACH_RECORD_WAIT, detached.landed).await;
        {
            let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
            if serving(&sessions) {
                sessions.remove(&sid);
                count_sessions(&sessions);
            }
        }
        served.addr.do_send(session::Close { grace: Duration::ZERO });
        // a run still going keeps its worker until it ends
        if !detached.busy {
            let bus = &self.shared.bus;
            if let Err(e) = bus.publish(bus.subjects().idle(sid), &SessionIdleV1 { session: sid }).await {
                tracing::warn!(session = %sid, error = %e, "could not tell the hosts a session was detached");
            }
        }
        Some(detached.unix_ms)
    }

    /// Delete every session detached for longer than `retention`, with its state
    /// (the store frees its chunks); each is logged.
    pub async fn sweep_detached(&self, retention: Duration) {
        let Some(records) = self.detached_records("find the expired detached ones").await else { return };
        let now = schemas::unix_ms();
        for r in records {
            if r.detached_unix_ms.is_some_and(|since| now.saturating_sub(since) >= retention.as_millis() as u64) {
                self.discard_detached(&r, "past its retention").await;
            }
        }
    }

    /// The store is still low on space after collecting: discard the session
    /// detached longest ago, with its state (the store frees the chunks nothing
    /// else references). One per word from the store, which says again once
    /// what it freed is free and it is still low. Answers the session discarded.
    pub async fn discard_for_space(&self, pressure: &StorePressureV1) -> Option<Uuid> {
        let mut detached = self.detached_records("discard one for space").await?;
        detached.sort_by_key(|r| r.detached_unix_ms);
        let why = format!("the store is low on space ({} bytes free, under {})", pressure.free, pressure.threshold);
        for r in detached {
            match self.discard_detached(&r, &why).await {
                Discard::Done => return Some(r.session_id),
                Discard::Resumed => continue,
                Discard::Failed => return None,
            }
        }
        tracing::warn!(free = pressure.free, "the store is low on space and no detached session is left to discard");
        None
    }

    /// The records of every detached session (None, logged, if they could not
    /// be listed: `to` says what for).
    async fn detached_records(&self, to: &str) -> Option<Vec<SessionRecord>> {
        match self.shared.records.all().await {
            Ok(records) => Some(records.into_iter().filter(|r| r.detached_unix_ms.is_some()).collect()),
            Err(e) => {
                tracing::warn!(error = %e, "could not list sessions to {to}");
                None
            }
        }
    }

    /// Delete detached session `r` with its state, logged with `why` and whose it
    /// was. Taken first with the checked update a resume uses, so one resumed
    /// meanwhile stays; one that could not be deleted is detached again.
    async fn discard_detached(&self, r: &SessionRecord, why: &str) -> Discard {
        let sid = r.session_id;
        let taken = match self.shared.records.attach(sid).await {
            Ok(Some((taken, _))) => taken,
            Ok(None) => return Discard::Resumed,
            Err(e) => {
                tracing::warn!(session = %sid, error = %e, "could not take a detached session to discard it");
                return Discard::Failed;
            }
        };
        match delete_state(self, sid).await {
            Ok(store_error) => {
                tracing::warn!(session = %sid, notebook = ?r.notebook, owner = ?r.owner,
                    detached_unix_ms = ?r.detached_unix_ms, ?store_error, "detached session discarded: {why}");
                // listed for its owner, and said to the next kernel on its notebook
                let listed = SessionDiscarded {
                    session_id: sid,
                    notebook: r.notebook.clone(),
                    detached_unix_ms: r.detached_unix_ms,
                    discarded_unix_ms: schemas::unix_ms(),
                    why: why.to_string(),
                };
                let discard = records::Discarded { owner: r.owner.clone(), listed };
                if let Err(e) = self.shared.records.put_discard(&discard).await {
                    tracing::warn!(session = %sid, error = %e, "a discarded session could not be listed");
                }
                let kept = Duration::from_secs(DISCARDS_KEPT_DAYS * 24 * 3600).as_millis() as u64;
                if let Err(e) = self.shared.records.forget_discards(schemas::unix_ms().saturating_sub(kept)).await {
                    tracing::warn!(error = %e, "could not forget old discards");
                }
                Discard::Done
            }
            Err(e) => {
                tracing::warn!(session = %sid, error = %e, "could not discard a detached session ({why})");
                // detached again, as it was: nothing serves it
                let mut back = taken;
                back.detached_unix_ms = r.detached_unix_ms;
                if let Err(e) = self.shared.records.put(&back).await {
                    tracing::warn!(session = %sid, error = %e, "a session taken to discard stays attached");
                }
                Discard::Failed
            }
        }
    }

    /// Set the `looseleaf_runs` gauge from every served session's runs.
    pub async fn count_runs(&self) {
        let mut total = session::RunCounts::default();
        for (_, s) in self.served() {
            if let Ok(counts) = s.addr.send(session::CountRuns).await {
                total += counts;
            }
        }
        let runs = &schemas::metrics::metrics().runs;
        runs.get_or_create(&[("state", "queued")]).set(total.queued as i64);
        runs.get_or_create(&[("state", "unclaimed")]).set(total.unclaimed as i64);
        runs.get_or_create(&[("state", "running")]).set(total.running as i64);
    }

    /// Every session's address (for shutdown).
    pub fn drain(&self) -> Vec<Addr<SessionActor>> {
        self.sessions.write().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, s)| s.addr).collect()
    }
}

/// The session named `raw` if it is `caller`'s: the one this frontend serves, or
/// one it adopts from its record (created by another frontend, or by this one
/// before it restarted). Another user's session is not found, as if it did not exist.
pub(super) async fn lookup(
    state: &AppState,
    raw: &str,
    caller: &Caller,
) -> Result<(Uuid, Addr<SessionActor>), ApiError> {
    let sid = parse_sid(raw)?;
    let not_found = || ApiError(StatusCode::NOT_FOUND, format!("no session {sid}"));
    if let Some(served) = state.session(sid) {
        return if served.owner == caller.user { Ok((sid, served.addr)) } else { Err(not_found()) };
    }
    let unavailable = |e: crate::records::RecordError| ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
    let mut record = state
        .shared
        .records
        .get(sid)
        .await
        .map_err(unavailable)?
        .filter(|r| r.owner == caller.user)
        .ok_or_else(not_found)?;
    // a request of its owner attaches a detached session again (unless another
    // attached it first: then it is adopted as it is now)
    if record.detached_unix_ms.is_some() {
        record = match state.shared.records.attach(sid).await.map_err(unavailable)? {
            Some((attached, _)) => attached,
            None => state.shared.records.get(sid).await.map_err(unavailable)?.ok_or_else(not_found)?,
        };
    }
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
pub(super) async fn start_session(state: &AppState, record: SessionRecord) -> Result<Addr<SessionActor>, ApiError> {
    let (sid, bus) = (record.session_id, &state.shared.bus);
    let s = bus.subjects().clone();
    let events = bus
        .subscribe::<SessionEventV2>(s.event(sid))
        .await
        .map_err(|e| internal(format!("cannot subscribe to the session's events: {e}")))?;
    let outputs = bus
        .subscribe::<OutputV2>(s.session_outputs(sid))
        .await
        .map_err(|e| internal(format!("cannot subscribe to the session's outputs: {e}")))?;
    let shared = state.shared.clone();
    Ok(SessionActor::start_in_arbiter(&state.arbiter, move |ctx| {
        ctx.add_stream(events.into_stream());
        ctx.add_stream(outputs.into_stream());
        SessionActor::new(record, shared)
    }))
}

/// How long a detach waits for its record to land before it closes the actor.
const DETACH_RECORD_WAIT: Duration = Duration::from_secs(10);

/// What discarding a detached session came to.
enum Discard {
    /// It is gone, with its state.
    Done,
    /// Someone resumed it first: it stays.
    Resumed,
    /// It could not be taken or deleted (logged).
    Failed,
}

/// Delete session `sid`'s record and its state in the store (its actor, if any,
/// is the caller's to close): the store's error, if it could not delete the state.
pub(super) async fn delete_state(state: &AppState, sid: Uuid) -> Result<Option<String>, String> {
    let bus = &state.shared.bus;
    bus.publish(bus.subjects().close(sid), &SessionCloseV1 { session: sid })
        .await
        .map_err(|e| format!("could not publish the close: {e}"))?;
    state.shared.records.remove(sid).await.map_err(|e| format!("could not remove the session's record: {e}"))?;
    Ok(match delete_in_store(state, sid).await {
        Ok(()) => None,
        Err(e) => {
            tracing::warn!(session = %sid, error = %e, "store did not delete the session's state");
            Some(e.to_string())
        }
    })
}

/// Ask the store to delete session `sid`'s state (it frees the chunks no other
/// session holds).
pub(super) async fn delete_in_store(state: &AppState, sid: Uuid) -> Result<(), schemas::BusError> {
    let bus = &state.shared.bus;
    let delete = SessionDeleteV1 { session: sid };
    bus.request::<_, DoneV1>(bus.subjects().store(StoreVerb::SessionDelete), &delete, session::STORE_WAIT).await?;
    Ok(())
}

/// The sessions gauge follows the sessions served.
fn count_sessions(sessions: &HashMap<Uuid, Served>) {
    schemas::metrics::metrics().sessions.set(sessions.len() as i64);
}
