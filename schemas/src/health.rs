//! `/healthz` and `/readyz` for probes (ADR 37): every service serves them on
//! `--health-listen` (the frontend on its API address too). `/healthz` says the
//! process answers. `/readyz` asks what the service needs to do its work: NATS
//! answering a round trip within [`CHECK_TIMEOUT`] (a frozen server fails it,
//! where a connected-looking socket would not), then each check the service adds (its
//! buckets, its zygote). 200 with every check's result, or 503 naming the failed.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};

use crate::Bus;

/// Longest one readiness check may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// A readiness check: Ok, or why the service cannot work.
pub type Check = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// Make a [`Check`] from an async closure.
pub fn check<F, Fut>(f: F) -> Check
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    Arc::new(move || Box::pin(f()))
}

/// What `/readyz` asks, by name.
#[derive(Clone)]
pub struct Readiness {
    checks: Vec<(&'static str, Check)>,
}

impl Readiness {
    /// NATS answers a round trip of `bus`'s (a request nobody serves: the server's
    /// "no responders" is the answer); then the checks added.
    pub fn new(bus: &Bus) -> Self {
        let bus = bus.clone();
        let nats = check(move || {
            let bus = bus.clone();
            async move { bus.flush().await.map_err(|e| format!("NATS does not answer: {e}")) }
        });
        Self { checks: vec![("nats", nats)] }
    }

    /// Also ask `check`, reported as `name`.
    pub fn with(mut self, name: &'static str, check: Check) -> Self {
        self.checks.push((name, check));
        self
    }

    /// Every check's result, and whether all passed.
    pub async fn ask(&self) -> (bool, serde_json::Map<String, serde_json::Value>) {
        let mut results = serde_json::Map::new();
        let mut ready = true;
        for (name, check) in &self.checks {
            let result = match tokio::time::timeout(CHECK_TIMEOUT, check()).await {
                Ok(result) => result,
                Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
            };
            ready &= result.is_ok();
            results.insert((*name).into(), result.err().unwrap_or_else(|| "ok".into()).into());
        }
        (ready, results)
    }
}

/// A check that the JetStream key-value bucket `name` answers.
pub fn bucket(bus: &Bus, name: String) -> Check {
    let js = bus.jetstream();
    check(move || {
        let (js, name) = (js.clone(), name.clone());
        async move { js.get_key_value(&name).await.map(|_| ()).map_err(|e| format!("bucket {name}: {e}")) }
    })
}

/// The `/healthz`, `/readyz` and `/metrics` routes.
pub fn router(readiness: Readiness) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/metrics",
            get(|headers: axum::http::HeaderMap| async move {
                // OpenMetrics for a scraper that asks for it (Prometheus does
                // first); the text format 0.0.4 for any other, as client
                // libraries answer
                let accept = headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
                let m = crate::metrics::metrics();
                if accept.contains("application/openmetrics-text") {
                    ([(axum::http::header::CONTENT_TYPE, crate::metrics::OPENMETRICS_CONTENT_TYPE)], m.encode())
                } else {
                    ([(axum::http::header::CONTENT_TYPE, crate::metrics::TEXT_004_CONTENT_TYPE)], m.encode_text_004())
                }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let readiness = readiness.clone();
                async move {
                    let (ready, checks) = readiness.ask().await;
                    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
                    (status, Json(serde_json::json!({ "ready": ready, "checks": checks })))
                }
            }),
        )
}

/// Serve the routes on `listen` until the process ends; returns the bound address.
pub async fn serve(listen: SocketAddr, readiness: Readiness) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(readiness)).await {
            tracing::warn!(error = %e, "the health endpoint stopped");
        }
    });
    tracing::info!(%bound, "serving /healthz, /readyz and /metrics");
    Ok(bound)
}
