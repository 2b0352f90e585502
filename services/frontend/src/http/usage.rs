//! `GET /v1/usage`: what was used (GPU-seconds, CPU-seconds, cells) per user,
//! notebook, session or UTC day, as JSON or CSV. A user reads their own; an admin
//! (the tokens file's `admin` role) every user's, or one user's with `user=`.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;

use super::errors::{bad_request, unavailable, ApiError};
use super::state::AppState;
use crate::auth::Caller;
use crate::usage::{self, day_of, day_start_ms, days_between};
use looseleaf_client::usage::{UsageBy, UsageReport};

/// Days a report covers when `from` is not given: the 30 days up to `to`.
const DEFAULT_DAYS: u64 = 30;

/// What a usage report asks for.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct UsageQuery {
    /// `user` (default), `notebook`, `session` or `day`.
    by: Option<UsageBy>,
    /// The first UTC day, `YYYY-MM-DD` (default: 29 days before `to`).
    from: Option<String>,
    /// The last UTC day (default: today).
    to: Option<String>,
    /// Only this user's (an admin's question; a user may name themselves).
    user: Option<String>,
    /// `json` (default) or `csv`.
    format: Option<String>,
}

/// What was used from `from` to `to`, grouped `by`: the caller's own, or an
/// admin's every user's.
#[utoipa::path(get, path = "/v1/usage", params(UsageQuery), responses(
    (status = 200, body = UsageReport, description = "JSON; with `format=csv`, the rows as text/csv"),
))]
pub(super) async fn usage(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    query: Result<Query<UsageQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| bad_request(format!("usage query: {}", e.body_text())))?;
    let by = q.by.unwrap_or_default();
    let csv = match q.format.as_deref() {
        None | Some("json") => false,
        Some("csv") => true,
        Some(other) => return Err(bad_request(format!("usage format {other:?}: the formats are json and csv"))),
    };
    let to = q.to.unwrap_or_else(|| day_of(schemas::unix_ms()));
    let from = match q.from {
        Some(from) => from,
        None => {
            let start = day_start_ms(&to).map_err(|e| bad_request(format!("to: {e}")))?;
            day_of(start.saturating_sub((DEFAULT_DAYS - 1) * 24 * 3600 * 1000))
        }
    };
    let days = days_between(&from, &to).map_err(|e| bad_request(e.to_string()))?;
    let admin = caller.admin;
    let only = match q.user {
        Some(user) if admin || caller.user.as_deref() == Some(user.as_str()) => Some(Some(user)),
        Some(user) => {
            return Err(ApiError(StatusCode::FORBIDDEN, format!("only an admin reads another user's usage ({user:?})")))
        }
        None if admin => None,
        None => Some(caller.user.clone()),
    };
    let mut entries = state.shared.usage.days(&days).await.map_err(unavailable)?;
    if let Some(owner) = &only {
        entries.retain(|u| &u.owner == owner);
    }
    let rows = usage::report(&entries, by);
    if csv {
        let body = usage::csv(&rows, by);
        return Ok(([(header::CONTENT_TYPE, "text/csv; charset=utf-8")], body).into_response());
    }
    Ok(Json(UsageReport { from, to, by, rows }).into_response())
}
