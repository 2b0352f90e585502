//! Which hosts and browser origins may use the API.
//!
//! - **Host allow-list**: a request whose `Host` header is not allowed is refused
//!   (403). This stops DNS rebinding: a web page whose name the attacker points at
//!   127.0.0.1 would otherwise reach a frontend on the user's loopback interface.
//!   A frontend on a loopback address allows only loopback names by default.
//! - **CORS**: browsers may read answers only for origins the operator lists
//!   (`--cors-origin`); preflight requests from other origins are refused. Without
//!   the list no CORS headers are sent at all, so other pages cannot read the API.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// Host names a frontend on a loopback address answers by default.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// What the API allows.
#[derive(Clone, Debug, Default)]
pub struct Origins {
    /// Host names (without port, lower case) the API answers; None: any.
    pub hosts: Option<Arc<Vec<String>>>,
    /// Browser origins (`scheme://host[:port]`) that may read answers.
    pub cors: Arc<Vec<String>>,
}

impl Origins {
    /// Allow `hosts` (any if empty, unless `listen` is a loopback address: then the
    /// loopback names) and the browser origins `cors`.
    pub fn new(listen: SocketAddr, hosts: &[String], cors: &[String]) -> Self {
        let hosts = if !hosts.is_empty() {
            Some(hosts.iter().map(|h| h.trim().to_ascii_lowercase()).collect())
        } else if listen.ip().is_loopback() {
            Some(LOOPBACK_NAMES.map(String::from).to_vec())
        } else {
            None
        };
        let cors = cors.iter().map(|o| o.trim().trim_end_matches('/').to_string()).collect();
        Self { hosts: hosts.map(Arc::new), cors: Arc::new(cors) }
    }

    /// Allow everything (tests of other things).
    pub fn any() -> Self {
        Self::default()
    }

    fn host_allowed(&self, host: Option<&str>) -> bool {
        let Some(allowed) = &self.hosts else { return true };
        let Some(host) = host else { return false };
        let name = host_name(host).to_ascii_lowercase();
        allowed.contains(&name)
    }

    fn cors_allowed(&self, origin: &str) -> bool {
        self.cors.iter().any(|o| o == origin)
    }
}

/// `host` without its port (`[::1]:8470` -> `[::1]`, `a.b:80` -> `a.b`).
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return host.find(']').map_or(host, |end| &host[..=end]);
    }
    host.rsplit_once(':').map_or(host, |(name, _)| name)
}

fn refuse(status: StatusCode, what: String) -> Response {
    (status, Json(serde_json::json!({ "error": what }))).into_response()
}

/// Middleware: the Host allow-list, then CORS (preflights answered here, before
/// the token check: browsers send no credentials with them).
pub async fn check(State(origins): State<Origins>, req: Request, next: Next) -> Response {
    let host = req.headers().get(header::HOST).and_then(|h| h.to_str().ok()).map(str::to_string);
    if !origins.host_allowed(host.as_deref()) {
        let shown = host.unwrap_or_else(|| "(none)".into());
        return refuse(
            StatusCode::FORBIDDEN,
            format!("Host header {shown:?} is not allowed (the frontend's --allowed-host)"),
        );
    }
    let origin = req.headers().get(header::ORIGIN).and_then(|o| o.to_str().ok()).map(str::to_string);
    let allowed = origin.as_deref().filter(|o| origins.cors_allowed(o)).map(str::to_string);
    let preflight =
        req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let Some(origin) = allowed else {
            let shown = origin.unwrap_or_else(|| "(none)".into());
            return refuse(
                StatusCode::FORBIDDEN,
                format!("origin {shown:?} is not allowed (the frontend's --cors-origin)"),
            );
        };
        let mut resp = StatusCode::NO_CONTENT.into_response();
        let h = resp.headers_mut();
        add_allow_origin(h, &origin);
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, PUT, DELETE"));
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type, last-event-id"),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        return resp;
    }
    let mut resp = next.run(req).await;
    if let Some(origin) = allowed {
        add_allow_origin(resp.headers_mut(), &origin);
    }
    resp
}

fn add_allow_origin(h: &mut axum::http::HeaderMap, origin: &str) {
    if let Ok(v) = HeaderValue::from_str(origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    h.append(header::VARY, HeaderValue::from_static("origin"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 8470))
    }

    #[test]
    fn a_loopback_frontend_answers_only_loopback_names_by_default() {
        let o = Origins::new(loopback(), &[], &[]);
        assert!(o.host_allowed(Some("localhost:8470")));
        assert!(o.host_allowed(Some("127.0.0.1:8470")));
        assert!(o.host_allowed(Some("[::1]:8470")));
        assert!(!o.host_allowed(Some("evil.example:8470")), "DNS rebinding name");
        assert!(!o.host_allowed(None));
    }

    #[test]
    fn listed_hosts_replace_the_default_and_any_host_without_a_list_elsewhere() {
        let o = Origins::new(loopback(), &["Notebooks.Example.org".into()], &[]);
        assert!(o.host_allowed(Some("notebooks.example.org")));
        assert!(!o.host_allowed(Some("localhost:8470")));
        let everywhere = Origins::new(SocketAddr::from(([0, 0, 0, 0], 8470)), &[], &[]);
        assert!(everywhere.host_allowed(Some("anything:1")));
    }

    #[test]
    fn host_names_lose_their_port() {
        assert_eq!(host_name("a.b:80"), "a.b");
        assert_eq!(host_name("a.b"), "a.b");
        assert_eq!(host_name("[::1]:80"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
    }
}
