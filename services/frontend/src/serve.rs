//! The HTTP server: HTTP/1.1 connections with a deadline for a request's headers
//! and one for its body, so that a client that sends slowly (or not at all) cannot
//! hold connections and tasks forever. axum's own `serve` sets no timeouts.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use http_body_util::BodyExt as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How long a client may take to send a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpTimeouts {
    /// A request's headers must arrive within this once it begins.
    pub header: Duration,
    /// A request's body (a cell's code, at most `MAX_BODY_BYTES`) must arrive within this.
    pub body: Duration,
}

impl Default for HttpTimeouts {
    fn default() -> Self {
        Self { header: Duration::from_secs(30), body: Duration::from_secs(60) }
    }
}

/// Serve `app` on `listener` until `stop` is cancelled; then each connection
/// finishes the request it is in (event streams end on `stop` themselves).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    header_timeout: Duration,
    stop: CancellationToken,
) -> std::io::Result<()> {
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // a full fd table or a connection reset before accept: not fatal
                Err(e) => {
                    tracing::warn!(error = %e, "could not accept an HTTP connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = stop.cancelled() => return Ok(()),
        };
        let service = TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service).with_upgrades();
            tokio::pin!(conn);
            let result = tokio::select! {
                r = conn.as_mut() => r,
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
}

/// Middleware: read the request's body within `timeout` (408 otherwise) and at
/// most `limit` bytes (413), before any handler sees it.
pub async fn read_body_in_time(limit: usize, timeout: Duration, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, limit);
    let bytes = match tokio::time::timeout(timeout, limited.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => {
            let (status, what) = if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                (StatusCode::PAYLOAD_TOO_LARGE, format!("request body over the limit of {limit} bytes"))
            } else {
                (StatusCode::BAD_REQUEST, format!("could not read the request body: {e}"))
            };
            return (status, Json(serde_json::json!({ "error": what }))).into_response();
        }
        Err(_) => {
            let what = format!("the request body did not arrive within {:?}", timeout);
            return (StatusCode::REQUEST_TIMEOUT, Json(serde_json::json!({ "error": what }))).into_response();
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}
