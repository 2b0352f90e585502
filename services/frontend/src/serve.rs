//! The HTTP server: HTTP/1.1 connections with a deadline for a request's headers
//! and one for its body, so that a client that sends slowly (or not at all) cannot
//! hold connections and tasks forever. axum's own `serve` sets no timeouts.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
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

/// A body over the limit is still read to its end (and dropped) if it ends within
/// this many bytes and the body deadline: its client, done sending, then reads the
/// 413. A longer one, or one whose client waits for `100 Continue` to send it, is
/// answered at once (and its connection closed).
pub const DISCARD_AT_MOST: u64 = 64 << 20;

/// `bytes` in MiB, for messages.
pub fn in_mib(bytes: usize) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
    }
}

fn error(status: StatusCode, what: String) -> Response {
    (status, Json(serde_json::json!({ "error": what }))).into_response()
}

/// 413 for a body of `size` bytes (if known) over `limit`.
fn too_large(limit: usize, size: Option<u64>) -> Response {
    let what = match size {
        Some(size) => format!("the request body is {size} bytes, over the limit of {limit} bytes ({})", in_mib(limit)),
        None => format!("the request body is over the limit of {limit} bytes ({})", in_mib(limit)),
    };
    error(StatusCode::PAYLOAD_TOO_LARGE, what)
}

/// Middleware: read the request's body within `timeout` (408 otherwise) and at
/// most `limit` bytes (413, whether its length was declared or it came in chunks),
/// before any handler sees it.
pub async fn read_body_in_time(limit: usize, timeout: Duration, req: Request, next: Next) -> Response {
    let deadline = tokio::time::Instant::now() + timeout;
    let (parts, mut body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(size) = declared.filter(|&size| size > limit as u64) {
        let waits =
            parts.headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if waits || size > DISCARD_AT_MOST {
            return too_large(limit, Some(size));
        }
    }
    let mut bytes: Vec<u8> = Vec::with_capacity(declared.map_or(0, |size| size.min(limit as u64) as usize));
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) => return error(StatusCode::BAD_REQUEST, format!("could not read the request body: {e}")),
            Err(_) => {
                let what = format!("the request body did not arrive within {timeout:?}");
                return error(StatusCode::REQUEST_TIMEOUT, what);
            }
        };
        // (trailers are not data)
        let Ok(data) = frame.into_data() else { continue };
        if bytes.len().saturating_add(data.len()) > limit {
            let read = (bytes.len() + data.len()) as u64;
            drop(bytes);
            let size = discard(&mut body, read, deadline).await;
            return too_large(limit, size.or(declared));
        }
        bytes.extend_from_slice(&data);
    }
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// Read and drop the rest of a body over the limit, of which `read` bytes came:
/// its whole size if it ends within [`DISCARD_AT_MOST`] bytes and `deadline`.
async fn discard(body: &mut Body, mut read: u64, deadline: tokio::time::Instant) -> Option<u64> {
    while read <= DISCARD_AT_MOST {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(None) => return Some(read),
            Ok(Some(Ok(frame))) => read += frame.data_ref().map_or(0, |data| data.len() as u64),
            Ok(Some(Err(_))) | Err(_) => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use axum::routing::post;

    use super::*;

    /// A server whose one route answers the length of the body it got, behind the
    /// middleware with `limit`.
    async fn served(limit: usize) -> (String, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new()
            .route("/", post(|body: axum::body::Bytes| async move { body.len().to_string() }))
            .layer(axum::middleware::from_fn(move |req, next| {
                read_body_in_time(limit, Duration::from_secs(10), req, next)
            }));
        let stop = CancellationToken::new();
        tokio::spawn(serve(listener, app, Duration::from_secs(10), stop.clone()));
        (base, stop)
    }

    async fn send(base: &str, body: reqwest::Body) -> (u16, String) {
        let resp = reqwest::Client::new().post(base).body(body).send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    /// `pieces` pieces of `size` bytes, no length declared (chunked).
    fn chunked(pieces: usize, size: usize) -> reqwest::Body {
        let chunks = (0..pieces).map(move |_| Ok::<_, std::io::Error>(vec![b'x'; size]));
        reqwest::Body::wrap_stream(futures::stream::iter(chunks))
    }

    #[tokio::test]
    async fn bodies_over_the_limit_are_refused_naming_size_and_limit_declared_or_chunked() {
        let limit = 1 << 20;
        let (base, _stop) = served(limit).await;
        assert_eq!(send(&base, vec![b'x'; limit].into()).await, (200, limit.to_string()));
        assert_eq!(send(&base, chunked(16, limit / 16)).await, (200, limit.to_string()));

        for (body, size) in [(reqwest::Body::from(vec![b'x'; limit + 1]), limit + 1), (chunked(48, 64 << 10), 3 << 20)]
        {
            let (status, text) = send(&base, body).await;
            assert_eq!(status, 413, "{text}");
            let named = format!("is {size} bytes, over the limit of {limit} bytes (1 MiB)");
            assert!(text.contains(&named), "{text}");
        }
    }

    #[test]
    fn sizes_read_in_mib() {
        assert_eq!(in_mib(8 << 20), "8 MiB");
        assert_eq!(in_mib(3 << 19), "1.5 MiB");
    }
}
