//! Server-Sent Event streams: a session's events (resumed after `Last-Event-ID`)
//! and the dashboard's snapshots, with the dashboard's page.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::StreamExt;

use super::errors::{bad_request, mailbox, ApiError};
use super::state::{lookup, AppState};
use crate::api::StreamItem;
use crate::auth::Caller;
use crate::resume::Position;
use crate::session;

/// How often an idle event stream carries a comment: it keeps proxies from closing
/// it, and a write to a client that went away ends the stream (its session counts
/// as watched until then).
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// The dashboard's page (ADR 47): hosts, sessions and executions, live.
pub(super) async fn dashboard_page() -> Response {
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
/// sees the sessions it owns (an admin every user's), every gpu-host, and what
/// each user it may see used today.
#[utoipa::path(get, path = "/v1/dashboard",
    responses((status = 200, content_type = "text/event-stream", description = "JSON snapshots, one per `data:` line")))]
pub(super) async fn dashboard(State(state): State<AppState>, Extension(caller): Extension<Caller>) -> Response {
    let board = state.shared.dashboard.clone();
    let seen = board.subscribe();
    let admin = caller.admin;
    let ledger = state.shared.usage.clone();
    let stream = futures::stream::unfold((board, seen, true), move |(board, mut seen, first)| {
        let (caller, ledger) = (caller.clone(), ledger.clone());
        async move {
            if !first {
                board.changes(&mut seen, DASHBOARD_EVERY).await;
                tokio::time::sleep(DASHBOARD_GATHER).await; // a burst of changes is one snapshot
            }
            let mut snapshot = board.snapshot(&caller, admin);
            snapshot["usage_today"] = usage_today(&ledger, &caller, admin);
            let event = Event::default().data(snapshot.to_string());
            Some((Ok::<_, Infallible>(event), (board, seen, false)))
        }
    })
    .take_until(state.shutdown.clone().cancelled_owned());
    Sse::new(stream).keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE)).into_response()
}

/// Today's (UTC) usage per user, as this frontend heard it: every user's for an
/// admin, the caller's own for others.
fn usage_today(ledger: &crate::usage::Ledger, caller: &Caller, admin: bool) -> serde_json::Value {
    let today = crate::usage::day_of(schemas::unix_ms());
    let rows: Vec<serde_json::Value> = ledger
        .recent_by_user(&today)
        .into_iter()
        .filter(|(user, _)| admin || *user == caller.user)
        .map(|(user, spent)| {
            serde_json::json!({
                "user": user,
                "gpu_seconds": spent.gpu_ms / 1000.0,
                "cpu_seconds": spent.cpu_ms / 1000.0,
                "cells": spent.cells,
                "gpu_cells": spent.gpu_cells,
            })
        })
        .collect();
    serde_json::Value::Array(rows)
}

/// The dashboard's stream sends a snapshot at least this often.
const DASHBOARD_EVERY: Duration = Duration::from_secs(2);

/// And at most once per this (changes within it go in one snapshot).
const DASHBOARD_GATHER: Duration = Duration::from_millis(200);

/// The session's event stream (Server-Sent Events, one `StreamItem` per `data:`
/// line; `Last-Event-ID` resumes after the item with that id, with no item twice,
/// also on a frontend that restarted or adopted the session meanwhile).
#[utoipa::path(get, path = "/v1/sessions/{sid}/events",
    params(("sid" = uuid::Uuid, Path, description = "the session"), ("Last-Event-ID" = Option<String>, Header, description = "the id of the last item seen")),
    responses((status = 200, content_type = "text/event-stream", body = StreamItem)))]
pub(super) async fn events(
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
