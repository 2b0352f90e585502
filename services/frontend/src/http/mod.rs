//! The HTTP API (axum): sessions, edits, runs, the SSE event stream, summaries.
//!
//! Handlers run on tokio tasks; they reach session actors through their addresses and
//! start new ones on the service's arbiter.
//!
//! Laid out by concern: `state` (what handlers share, and the sessions served),
//! `errors` (the API's error answers), `sessions`, `runs` (edits, runs, interrupts
//! and input), `cpu_worker` (what the session's CPU worker answers), `streams`
//! (Server-Sent Events), `usage` (what was used), `hub_login` (the dashboard's
//! JupyterHub login) and `openapi` (health and the API's description).

use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::{get, post, put};
use axum::Router;

mod cpu_worker;
mod errors;
mod hub_login;
mod openapi;
mod runs;
mod sessions;
mod state;
mod streams;
mod usage;

use cpu_worker::{comm, complete, inspect};
pub use errors::ApiError;
pub use openapi::ApiDoc;
use openapi::{health, openapi_json};
use runs::{edit, input, interrupt, run};
use sessions::{
    checkout_session, create_session, delete_session, detach_session, fork_session, list_discards, list_sessions,
    resume_session, summary, undo_session,
};
pub use state::{AppState, Served};
use streams::{dashboard, dashboard_page, events};

/// The largest request body (8 MiB): a larger one is refused with 413 before any
/// handler reads it (`serve::read_body_in_time`), naming its size and the limit.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// The largest cell (its code, in bytes of UTF-8): its body's limit, which binds
/// first (a cell's code is never longer than the JSON that carries it); checked
/// again on the code itself, refused with 413 naming both.
pub const MAX_CELL_BYTES: usize = MAX_BODY_BYTES;

/// The router of the API (bodies must arrive within `body_timeout`).
pub fn router(state: AppState, body_timeout: Duration) -> Router {
    Router::new()
        .route("/", get(dashboard_page))
        .route("/v1/dashboard", get(dashboard))
        .route("/hub/login", get(hub_login::login))
        .route("/hub/oauth_callback", get(hub_login::callback))
        .route("/v1/health", get(health))
        .route("/v1/openapi.json", get(openapi_json))
        .route("/v1/sessions", post(create_session).get(list_sessions))
        .route("/v1/discards", get(list_discards))
        .route("/v1/usage", get(usage::usage))
        .route("/v1/sessions/{sid}", get(summary).delete(delete_session))
        .route("/v1/sessions/{sid}/detach", post(detach_session))
        .route("/v1/sessions/{sid}/resume", post(resume_session))
        .route("/v1/sessions/{sid}/undo", post(undo_session))
        .route("/v1/sessions/{sid}/checkout", post(checkout_session))
        .route("/v1/sessions/{sid}/fork", post(fork_session))
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
        // outside every other layer: refused requests are counted too
        .layer(axum::middleware::from_fn(record_request))
        .with_state(state)
}

/// The SERVER span of a request, continuing the trace its `traceparent` names.
fn request_span(req: &axum::extract::Request, method: &str, route: &str) -> tracing::Span {
    let span = tracing::info_span!("request", otel.name = %format!("{method} {route}"), otel.kind = "server",
        http.request.method = %method, http.route = %route, url.path = %req.uri().path(),
        http.response.status_code = tracing::field::Empty);
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    schemas::telemetry::continue_http_trace(&span, header("traceparent"), header("tracestate"));
    span
}

/// Serve a request in a SERVER span that continues the caller's trace (its
/// `traceparent`, as a kernel's execute_request sends), and count it and its time
/// by method, route template and status (OpenTelemetry's HTTP conventions; the
/// template, never the path, bounds the labels and names the span).
async fn record_request(req: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use tracing::Instrument as _;
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    // any token is a method in HTTP: the others are one label value, as
    // OpenTelemetry's conventions say, so a client cannot make series without end
    let method = match req.method().as_str() {
        m @ ("GET" | "HEAD" | "POST" | "PUT" | "DELETE" | "CONNECT" | "OPTIONS" | "TRACE" | "PATCH") => m.to_string(),
        _ => "_OTHER".to_string(),
    };
    let span = request_span(&req, &method, &route);
    let started = std::time::Instant::now();
    let response = next.run(req).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    let labels = [
        ("http_request_method", method),
        ("http_route", route),
        ("http_response_status_code", response.status().as_u16().to_string()),
    ];
    let histogram = schemas::metrics::metrics().http_requests.get_or_create(&labels);
    histogram.observe(started.elapsed().as_secs_f64());
    response
}
