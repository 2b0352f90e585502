//! JupyterHub users (ADR 67): the frontend as a Hub service, so a Hub user needs
//! no LooseLeaf token.
//!
//! - A bearer token the tokens file does not name is asked of the Hub, as
//!   jupyterhub's own `HubAuth.user_for_token` does: `GET {api}/user` with the
//!   token, whose answer also says whether the user is one of the Hub's admins.
//!   The token must name a user and carry this service's access scope
//!   (`access:services!service=NAME`): a single-user server's
//!   `$JUPYTERHUB_API_TOKEN` does once the Hub's `Spawner.server_token_scopes`
//!   names it, and the Hub's OAuth gives it to the dashboard's login.
//! - Answers are kept for [`CACHE_FOR`], refusals too, so that a kernel's
//!   requests do not each cost a Hub call, keyed by the token's SHA-256. While the
//!   Hub does not answer (a restart), a user it named within [`GRACE_WHILE_DOWN`]
//!   is still taken; anyone else is refused with 503.
//! - The dashboard's login is the Hub's OAuth (authorization code with PKCE):
//!   `/hub/login` sends the browser to the Hub, `/hub/oauth_callback` trades the
//!   code for a token (`POST {api}/oauth2/token`) and hands it to the page.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use base64::Engine as _;
use reqwest::{StatusCode, Url};
use sha2::{Digest as _, Sha256};

/// How long the Hub's answer for a token is kept (HubAuth keeps it 5 minutes;
/// shorter, so a revoked token or a user no longer admin stops sooner).
pub const CACHE_FOR: Duration = Duration::from_secs(60);

/// While the Hub does not answer, how long a user it named is still taken (its
/// restarts and upgrades are meant to leave users' servers running).
pub const GRACE_WHILE_DOWN: Duration = Duration::from_secs(600);

/// The most tokens whose answers are kept; past it the stale ones go, then the
/// refusals, then all.
const CACHE_ENTRIES: usize = 10_000;

/// How long one Hub call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the Hub is and who this service is to it.
#[derive(Clone)]
pub struct HubConfig {
    /// The Hub's API, as services reach it (`$JUPYTERHUB_API_URL`,
    /// `http://127.0.0.1:8081/hub/api`).
    pub api_url: String,
    /// The Hub as browsers reach it, with its `base_url` (`https://hub.example.org/`),
    /// for the OAuth login.
    pub public_url: String,
    /// This service's name in the Hub's `c.JupyterHub.services`.
    pub service: String,
    /// This service's API token there.
    pub token: String,
    /// The OAuth redirect URI registered for the service (its `oauth_redirect_uri`):
    /// this frontend's `/hub/oauth_callback` as browsers reach it. None: built from
    /// the request's Host.
    pub callback_url: Option<String>,
}

impl std::fmt::Debug for HubConfig {
    // never the service's token
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubConfig").field("api_url", &self.api_url).field("service", &self.service).finish()
    }
}

/// The Hub's base as the API URL gives it: the URL without its trailing
/// `hub/api` (the Hub's `base_url` kept).
pub fn base_of(api_url: &str) -> anyhow::Result<String> {
    let mut url = Url::parse(api_url).map_err(|e| anyhow::anyhow!("--jupyterhub-api-url {api_url:?}: {e}"))?;
    let path = url.path().trim_end_matches('/');
    let base = path.strip_suffix("/hub/api").unwrap_or(path).to_string();
    url.set_path(&format!("{base}/"));
    Ok(url.to_string())
}

/// A Hub user, as the Hub identified them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubUser {
    /// Their Hub name: the owner of their sessions.
    pub name: String,
    /// One of the Hub's admins.
    pub admin: bool,
}

/// Why the Hub did not give a user.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HubError {
    /// The Hub knows no such token, or it expired (401).
    #[error(
        "the token is not valid (the tokens file does not name it, and JupyterHub does not know it or it expired)"
    )]
    Invalid,
    /// A valid token without this service's access scope (403).
    #[error("the JupyterHub token of {user} lacks the scope {scope} (the Hub's Spawner.server_token_scopes, and its users' scopes, must grant it)")]
    NoAccess {
        /// Whose token.
        user: String,
        /// The scope it lacks.
        scope: String,
    },
    /// The Hub refused the login's code trade (`error` as OAuth names it).
    #[error("JupyterHub refused the login's code: {error} ({description})")]
    Refused {
        /// OAuth's error code (`invalid_grant`, `invalid_client`, ...).
        error: String,
        /// What the Hub said of it.
        description: String,
    },
    /// The Hub could not be asked (503).
    #[error("JupyterHub at {url} did not answer: {why}")]
    Down {
        /// The API asked.
        url: String,
        /// What went wrong.
        why: String,
    },
}

/// The Hub's answer for one token, and when it came.
#[derive(Debug)]
struct Answer {
    at: Instant,
    user: Result<HubUser, HubError>,
}

impl Answer {
    /// Worth keeping: a refusal for [`CACHE_FOR`], a user for [`GRACE_WHILE_DOWN`].
    fn kept(&self) -> bool {
        self.at.elapsed() < if self.user.is_ok() { GRACE_WHILE_DOWN } else { CACHE_FOR }
    }
}

/// The Hub, and its recent answers.
pub struct Hub {
    config: HubConfig,
    /// The Hub's OAuth authorize endpoint, as browsers reach it.
    authorize: Url,
    http: reqwest::Client,
    cache: std::sync::Mutex<HashMap<[u8; 32], Answer>>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").field("config", &self.config).finish_non_exhaustive()
    }
}

/// `s` as one component of a URL (RFC 3986's unreserved characters kept).
pub fn percent_encoded(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// PKCE's S256 challenge of `verifier` (RFC 7636).
pub fn pkce_challenge(verifier: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()))
}

impl Hub {
    /// A Hub client; refuses URLs that do not parse and a token no header can carry.
    pub fn new(mut config: HubConfig) -> anyhow::Result<Self> {
        for (flag, url) in [("--jupyterhub-api-url", &mut config.api_url), ("--jupyterhub-url", &mut config.public_url)]
        {
            let parsed = Url::parse(url).map_err(|e| anyhow::anyhow!("{flag} {url:?}: {e}"))?;
            anyhow::ensure!(matches!(parsed.scheme(), "http" | "https"), "{flag} {url:?}: not an http(s) URL");
            *url = url.trim_end_matches('/').to_string();
        }
        config.token = config.token.trim().to_string();
        anyhow::ensure!(!config.token.is_empty(), "the JupyterHub service token is empty");
        anyhow::ensure!(
            reqwest::header::HeaderValue::from_str(&format!("token {}", config.token)).is_ok(),
            "the JupyterHub service token has characters no HTTP header can carry"
        );
        anyhow::ensure!(!config.service.is_empty(), "--jupyterhub-service is empty");
        let authorize = Url::parse(&format!("{}/hub/api/oauth2/authorize", config.public_url))?;
        let http = reqwest::Client::builder().timeout(CALL_TIMEOUT).build()?;
        Ok(Self { config, authorize, http, cache: Default::default() })
    }

    /// The scope a token needs to use this service.
    pub fn access_scope(&self) -> String {
        format!("access:services!service={}", self.config.service)
    }

    /// The user a Hub token names, from the cache or the Hub.
    pub async fn user_for_token(&self, token: &str) -> Result<HubUser, HubError> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let lately = {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(&key) {
                Some(a) if a.at.elapsed() < CACHE_FOR => return a.user.clone(),
                Some(Answer { at, user: Ok(user) }) => Some((*at, user.clone())),
                _ => None,
            }
        };
        let user = self.identify(token).await;
        if let Err(down @ HubError::Down { .. }) = &user {
            // a Hub restarting: who it named lately is still who they are
            if let Some((at, user)) = lately.filter(|(at, _)| at.elapsed() < GRACE_WHILE_DOWN) {
                tracing::warn!(user = %user.name, named_s_ago = at.elapsed().as_secs(), error = %down,
                    "JupyterHub does not answer; taking the user it named lately");
                return Ok(user);
            }
            return Err(down.clone());
        }
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, a| a.kept());
        }
        if cache.len() >= CACHE_ENTRIES {
            // many unknown tokens: they go before the users
            cache.retain(|_, a| a.user.is_ok());
        }
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(key, Answer { at: Instant::now(), user: user.clone() });
        user
    }

    fn down(&self, why: impl std::fmt::Display) -> HubError {
        HubError::Down { url: self.config.api_url.clone(), why: why.to_string() }
    }

    fn api(&self, segments: &[&str]) -> Result<Url, HubError> {
        let mut url = Url::parse(&self.config.api_url).map_err(|e| self.down(e))?;
        url.path_segments_mut().map_err(|()| self.down("the API URL cannot take a path"))?.extend(segments);
        Ok(url)
    }

    /// `GET {api}/user` with the token.
    async fn identify(&self, token: &str) -> Result<HubUser, HubError> {
        let reply = self
            .http
            .get(self.api(&["user"])?)
            .header("Authorization", format!("token {token}"))
            .send()
            .await
            .map_err(|e| self.down(e))?;
        let model: serde_json::Value = match reply.status() {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => return Err(HubError::Invalid),
            // the Hub answers 403 to a token it does not know: 404 is the wrong URL
            StatusCode::NOT_FOUND => {
                return Err(self.down("no such route (--jupyterhub-api-url must be the Hub's API, ending in /hub/api)"))
            }
            s if s.is_success() => reply.json().await.map_err(|e| self.down(format!("its answer: {e}")))?,
            s => return Err(self.down(format!("HTTP {s}"))),
        };
        let name = model["name"].as_str().unwrap_or_default().to_string();
        // a service's token names no user
        if model["kind"] != "user" || name.is_empty() {
            return Err(HubError::Invalid);
        }
        let scope = self.access_scope();
        let scopes: Vec<&str> = model["scopes"].as_array().into_iter().flatten().filter_map(|s| s.as_str()).collect();
        if !scopes.iter().any(|s| *s == scope || *s == "access:services") {
            return Err(HubError::NoAccess { user: name, scope });
        }
        // the identify model's `admin` (the Hub adds `read:users:name` of the
        // token's own user for this route)
        let admin = model["admin"].as_bool().unwrap_or(false);
        Ok(HubUser { name, admin })
    }

    /// This service's OAuth client id (the Hub's default for a service).
    fn client_id(&self) -> String {
        format!("service-{}", self.config.service)
    }

    /// The redirect URI: the flag's, else this frontend's callback at `host`.
    pub fn callback_url(&self, host: &str) -> String {
        self.config.callback_url.clone().unwrap_or_else(|| format!("http://{host}/hub/oauth_callback"))
    }

    /// Where the browser logs in: the Hub's authorize endpoint for this service,
    /// with PKCE's challenge of the login's verifier.
    pub fn authorize_url(&self, callback: &str, state: &str, verifier: &str) -> String {
        let mut url = self.authorize.clone();
        url.query_pairs_mut()
            .append_pair("client_id", &self.client_id())
            .append_pair("redirect_uri", callback)
            .append_pair("response_type", "code")
            .append_pair("state", state)
            .append_pair("code_challenge", &pkce_challenge(verifier))
            .append_pair("code_challenge_method", "S256");
        url.to_string()
    }

    /// Trade an OAuth code for the user's token (`POST {api}/oauth2/token`).
    pub async fn exchange(&self, code: &str, callback: &str, verifier: &str) -> Result<String, HubError> {
        let form = [
            ("client_id", self.client_id()),
            ("client_secret", self.config.token.clone()),
            ("grant_type", "authorization_code".to_string()),
            ("code", code.to_string()),
            ("redirect_uri", callback.to_string()),
            ("code_verifier", verifier.to_string()),
        ];
        let reply =
            self.http.post(self.api(&["oauth2", "token"])?).form(&form).send().await.map_err(|e| self.down(e))?;
        let status = reply.status();
        if status.is_server_error() {
            return Err(self.down(format!("HTTP {status}")));
        }
        let body: serde_json::Value = reply.json().await.unwrap_or_default();
        match body["access_token"].as_str() {
            Some(token) if status.is_success() => Ok(token.to_string()),
            _ => Err(HubError::Refused {
                error: body["error"].as_str().unwrap_or("no token in its answer").to_string(),
                description: body["error_description"].as_str().unwrap_or(status.as_str()).to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    fn hub() -> Hub {
        Hub::new(HubConfig {
            api_url: "http://127.0.0.1:8081/hub/api/".into(),
            public_url: "https://hub.example.org/jupyter/".into(),
            service: "looseleaf".into(),
            token: "service-secret\n".into(),
            callback_url: None,
        })
        .unwrap()
    }

    #[test]
    fn the_login_goes_to_the_hubs_authorize_endpoint_for_this_service() {
        let hub = hub();
        let callback = hub.callback_url("lab.example.org:8470");
        assert_eq!(callback, "http://lab.example.org:8470/hub/oauth_callback");
        let url = Url::parse(&hub.authorize_url(&callback, "s1", "v1")).unwrap();
        assert_eq!(url.path(), "/jupyter/hub/api/oauth2/authorize", "under the Hub's base_url");
        let q: HashMap<_, _> = url.query_pairs().collect();
        assert_eq!(q["client_id"], "service-looseleaf");
        assert_eq!(q["redirect_uri"], callback);
        assert_eq!((q["response_type"].as_ref(), q["state"].as_ref()), ("code", "s1"));
        assert_eq!(
            (q["code_challenge"].as_ref(), q["code_challenge_method"].as_ref()),
            (pkce_challenge("v1").as_str(), "S256")
        );
        assert_eq!(hub.access_scope(), "access:services!service=looseleaf");
        assert_eq!(hub.api(&["users", "a b/c"]).unwrap().path(), "/hub/api/users/a%20b%2Fc", "a name is one segment");
        assert_eq!(hub.config.token, "service-secret", "the token file's newline is not the token's");
        assert!(!format!("{hub:?}").contains("service-secret"), "Debug shows no secret");
        // RFC 7636's own example
        assert_eq!(
            pkce_challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
            "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
        );
        assert_eq!(percent_encoded("a+b/c~"), "a%2Bb%2Fc~");
        assert_eq!(base_of("http://hub:8081/jupyter/hub/api/").unwrap(), "http://hub:8081/jupyter/");
        assert_eq!(base_of("http://hub:8081/hub/api").unwrap(), "http://hub:8081/");
    }

    #[test]
    fn bad_configs_are_refused_naming_the_flag() {
        let mut c = hub().config.clone();
        c.api_url = "hub:8081".into();
        assert!(Hub::new(c).unwrap_err().to_string().contains("--jupyterhub-api-url"));
        let mut c = hub().config.clone();
        c.token = " ".into();
        assert!(Hub::new(c).unwrap_err().to_string().contains("token is empty"));
        let mut c = hub().config.clone();
        c.token = "a\u{7}b".into();
        assert!(Hub::new(c).unwrap_err().to_string().contains("no HTTP header"));
    }

    /// A stand-in for the Hub's identify route, counting its calls.
    async fn stand_in_hub() -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
        use axum::http::HeaderMap;
        use axum::routing::get;
        use serde_json::json;
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let app = axum::Router::new().route(
            "/hub/api/user",
            get(move |h: HeaderMap| async move {
                counted.fetch_add(1, Ordering::SeqCst);
                let user = |name: &str, scope: &str, admin: bool| {
                    json!({"kind": "user", "name": name, "admin": admin, "scopes": [scope]})
                };
                let auth = h.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                let (status, body) = match auth.as_str() {
                    "token alice-t" => (200, user("alice", "access:services!service=looseleaf", false)),
                    "token root-t" => (200, user("root", "access:services", true)),
                    "token carol-t" => (200, user("carol", "users:activity!user=carol", false)),
                    "token svc-t" => (200, json!({"kind": "service", "name": "other", "scopes": ["access:services"]})),
                    "token broken-t" => (502, json!({})),
                    _ => (403, json!({"status": 403})),
                };
                (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), axum::Json(body))
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hub/api", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (url, calls, server)
    }

    #[tokio::test]
    async fn the_hub_names_users_with_the_access_scope_and_its_answers_are_kept() {
        let (api_url, calls, server) = stand_in_hub().await;
        let hub = Hub::new(HubConfig { api_url: api_url.clone(), ..hub().config.clone() }).unwrap();
        assert_eq!(hub.user_for_token("alice-t").await, Ok(HubUser { name: "alice".into(), admin: false }));
        assert_eq!(hub.user_for_token("root-t").await, Ok(HubUser { name: "root".into(), admin: true }));
        let no_scope = hub.user_for_token("carol-t").await.unwrap_err();
        assert!(matches!(&no_scope, HubError::NoAccess { user, .. } if user == "carol"), "{no_scope}");
        assert!(no_scope.to_string().contains("access:services!service=looseleaf"), "{no_scope}");
        assert_eq!(hub.user_for_token("svc-t").await, Err(HubError::Invalid), "a service's token names no user");
        assert_eq!(hub.user_for_token("nobody-t").await, Err(HubError::Invalid));
        assert!(matches!(hub.user_for_token("broken-t").await, Err(HubError::Down { .. })), "a 5xx is the Hub down");
        let asked = calls.load(Ordering::SeqCst);
        assert_eq!(asked, 6);
        // answers and refusals are kept; the Hub down is asked again
        assert_eq!(hub.user_for_token("alice-t").await.map(|u| u.name), Ok("alice".to_string()));
        assert_eq!(hub.user_for_token("nobody-t").await, Err(HubError::Invalid));
        assert!(hub.user_for_token("broken-t").await.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), asked + 1);

        // a wrong API URL is the Hub down, naming what to fix; not a bad token
        let wrong = Hub::new(HubConfig { api_url: format!("{api_url}/v2"), ..hub.config.clone() }).unwrap();
        let err = wrong.user_for_token("alice-t").await.unwrap_err();
        assert!(matches!(err, HubError::Down { .. }) && err.to_string().contains("/hub/api"), "{err}");

        // the Hub gone: alice, named a while ago, is still alice for a grace
        // period; root, named longer ago than that, is refused
        server.abort();
        let _ = server.await;
        let ago = |d: Duration| Instant::now().checked_sub(d).unwrap_or_else(Instant::now);
        {
            let mut cache = hub.cache.lock().unwrap();
            for a in cache.values_mut() {
                let root = a.user.as_ref().is_ok_and(|u| u.name == "root");
                a.at = ago(if root { GRACE_WHILE_DOWN + CACHE_FOR } else { CACHE_FOR * 2 });
            }
        }
        assert_eq!(hub.user_for_token("alice-t").await.map(|u| u.name), Ok("alice".to_string()));
        assert!(matches!(hub.user_for_token("root-t").await, Err(HubError::Down { .. })));
        assert!(matches!(hub.user_for_token("nobody-t").await, Err(HubError::Down { .. })), "refusals get no grace");
    }

    #[tokio::test]
    async fn a_hub_that_does_not_answer_is_down_and_not_cached() {
        // a port nothing listens on
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut c = hub().config.clone();
        c.api_url = format!("http://127.0.0.1:{port}/hub/api");
        let hub = Hub::new(c).unwrap();
        let err = hub.user_for_token("t").await.unwrap_err();
        assert!(matches!(err, HubError::Down { .. }), "{err}");
        assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");
        assert!(hub.cache.lock().unwrap().is_empty());
    }
}
