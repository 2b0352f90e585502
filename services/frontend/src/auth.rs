//! Who is calling the HTTP API: bearer tokens, one or more per user, from a file
//! the operator writes (`--tokens-file`). Each session belongs to the user who
//! created it; another user's session is answered 404, as if it did not exist.
//!
//! With a JupyterHub (`--jupyterhub-api-url`, [`crate::hub`]), a token the file
//! does not name is asked of the Hub, and a Hub user needs no LooseLeaf token.
//!
//! Without a tokens file or a Hub the API is open (every caller is the same anonymous user):
//! that is for a frontend bound to the loopback interface on a developer's machine
//! (`looseleaf up`), never for one other machines can reach (docs/security.md).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::hub::{Hub, HubError};

/// Tokens shorter than this are refused (they could be guessed).
const MIN_TOKEN_CHARS: usize = 16;

/// The caller: a user named in the tokens file or by the Hub, or anonymous on an
/// open API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// Who (None: the open API's one anonymous user).
    pub user: Option<String>,
    /// Sees every user's usage and sessions on the dashboard: the tokens file's
    /// `admin` role, the Hub's admins, and the open API's one user (who owns every
    /// session there is).
    pub admin: bool,
}

impl Caller {
    /// A named user who is not an admin.
    pub fn user(name: &str) -> Self {
        Self { user: Some(name.to_string()), admin: false }
    }
}

/// Why a tokens file was refused.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    /// It could not be read.
    #[error("cannot read the tokens file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not `USER TOKEN`, or its token is too short or used twice.
    #[error("tokens file line {line}: {reason}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// No token at all: every request would be refused.
    #[error("the tokens file names no token")]
    Empty,
}

/// The API's tokens, and the Hub asked of the others (neither: the API is open).
#[derive(Clone, Debug, Default)]
pub struct Tokens {
    table: Option<Arc<Table>>,
    hub: Option<Arc<Hub>>,
}

/// Who each token names, and which users are admins.
#[derive(Debug, Default)]
struct Table {
    users: HashMap<String, String>,
    admins: std::collections::BTreeSet<String>,
}

impl Tokens {
    /// An open API: no token asked.
    pub fn open() -> Self {
        Self::default()
    }

    /// These tokens, and a Hub's users besides.
    pub fn with_hub(self, hub: Hub) -> Self {
        Self { hub: Some(Arc::new(hub)), ..self }
    }

    /// The Hub, if its users are served.
    pub fn hub(&self) -> Option<&Arc<Hub>> {
        self.hub.as_ref()
    }

    /// Tokens from a file of `USER TOKEN` lines, or `USER TOKEN admin` for a user
    /// who sees every user's usage and sessions on the dashboard (blank lines and
    /// `#` comments allowed).
    pub fn load(path: &Path) -> Result<Self, TokensError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TokensError::Read { path: path.display().to_string(), source })?;
        Self::parse(&text)
    }

    /// Tokens from the text of a tokens file.
    pub fn parse(text: &str) -> Result<Self, TokensError> {
        let mut table = Table::default();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |reason: &str| TokensError::Line { line: i + 1, reason: reason.to_string() };
            let mut words = line.split_whitespace();
            let (Some(user), Some(token), role, None) = (words.next(), words.next(), words.next(), words.next()) else {
                return Err(bad("expected `USER TOKEN` or `USER TOKEN admin`"));
            };
            match role {
                None => {}
                Some("admin") => {
                    table.admins.insert(user.to_string());
                }
                Some(other) => return Err(bad(&format!("unknown role {other:?} (the one role is `admin`)"))),
            }
            if token.chars().count() < MIN_TOKEN_CHARS {
                return Err(bad(&format!("the token is shorter than {MIN_TOKEN_CHARS} characters")));
            }
            if table.users.insert(token.to_string(), user.to_string()).is_some() {
                return Err(bad("the token is used twice"));
            }
        }
        if table.users.is_empty() {
            return Err(TokensError::Empty);
        }
        Ok(Self { table: Some(Arc::new(table)), hub: None })
    }

    /// The users the tokens name (none for an open API).
    pub fn users(&self) -> std::collections::BTreeSet<&str> {
        self.table.iter().flat_map(|t| t.users.values()).map(String::as_str).collect()
    }

    /// Whether the tokens file names the user `name`.
    fn names(&self, name: &str) -> bool {
        self.table.as_ref().is_some_and(|t| t.users.values().any(|u| u == name))
    }

    /// Whether the API asks for a token.
    pub fn required(&self) -> bool {
        self.table.is_some() || self.hub.is_some()
    }

    /// The user the tokens file names for `given`, if any.
    fn named(&self, given: &str) -> Option<Caller> {
        let tokens = self.table.as_ref()?;
        // every token is compared, in time that does not depend on where they differ
        let mut found = None;
        for (token, user) in tokens.users.iter() {
            if same(token.as_bytes(), given.as_bytes()) {
                found = Some(user.clone());
            }
        }
        found.map(|user| Caller { admin: tokens.admins.contains(&user), user: Some(user) })
    }

    /// The caller an `Authorization` header names (`Bearer TOKEN`, or `token
    /// TOKEN` as JupyterHub's clients send), or why it is refused.
    pub async fn caller(&self, authorization: Option<&str>) -> Result<Caller, Refusal> {
        if !self.required() {
            return Ok(Caller { user: None, admin: true });
        }
        let given = authorization
            .and_then(|h| h.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer") || scheme.eq_ignore_ascii_case("token"))
            .map(|(_, token)| token.trim())
            .filter(|token| !token.is_empty())
            .ok_or(Refusal::Unauthorized("this API needs a bearer token (Authorization: Bearer TOKEN)".into()))?;
        if let Some(caller) = self.named(given) {
            return Ok(caller);
        }
        let Some(hub) = &self.hub else { return Err(Refusal::Unauthorized("the bearer token is not valid".into())) };
        match hub.user_for_token(given).await {
            // a Hub name that is a tokens-file user's would own that user's sessions
            Ok(user) if self.names(&user.name) => Err(Refusal::Forbidden(format!(
                "the JupyterHub user {:?} has the name of a user of this frontend's tokens file; \
                 sessions are not shared between them",
                user.name
            ))),
            Ok(user) => Ok(Caller { user: Some(user.name), admin: user.admin }),
            Err(e @ HubError::NoAccess { .. }) => Err(Refusal::Forbidden(e.to_string())),
            Err(e @ HubError::Down { .. }) => Err(Refusal::Unavailable(e.to_string())),
            Err(e @ (HubError::Invalid | HubError::Refused { .. })) => Err(Refusal::Unauthorized(e.to_string())),
        }
    }
}

/// Why a request's caller is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No token, or one nobody knows (401).
    Unauthorized(String),
    /// A Hub user whose token may not use this service (403).
    Forbidden(String),
    /// The Hub that would say who it is did not answer (503).
    Unavailable(String),
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Middleware: every route but `/v1/health`, `/v1/openapi.json`, the dashboard's
/// page `/` (no data: it asks `/v1/dashboard` with the token) and the Hub login's
/// two steps needs a valid token when tokens or a Hub are configured; the caller
/// goes into the request's extensions. A refusal says, where a Hub is served, where
/// a browser logs in (`login`).
pub async fn require_token(State(tokens): State<Tokens>, mut req: Request, next: Next) -> Response {
    if matches!(req.uri().path(), "/v1/health" | "/v1/openapi.json" | "/" | "/hub/login" | "/hub/oauth_callback") {
        return next.run(req).await;
    }
    let header = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let (status, why, challenge) = match tokens.caller(header).await {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            return next.run(req).await;
        }
        Err(Refusal::Unauthorized(why)) => (StatusCode::UNAUTHORIZED, why, Some("Bearer")),
        Err(Refusal::Forbidden(why)) => (StatusCode::FORBIDDEN, why, Some("Bearer error=\"insufficient_scope\"")),
        Err(Refusal::Unavailable(why)) => (StatusCode::SERVICE_UNAVAILABLE, why, None),
    };
    let mut body = serde_json::json!({ "error": why });
    if tokens.hub().is_some() && status == StatusCode::UNAUTHORIZED {
        body["login"] = "/hub/login".into();
    }
    let mut response = (status, Json(body)).into_response();
    if let Some(challenge) = challenge {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static(challenge));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tokens_name_their_users_and_bad_files_say_which_line() {
        let t = Tokens::parse("# operators\nalice aaaaaaaaaaaaaaaaaaaa\n\nbob bbbbbbbbbbbbbbbbbbbb\n").unwrap();
        assert!(t.required());
        assert_eq!(t.caller(Some("Bearer aaaaaaaaaaaaaaaaaaaa")).await, Ok(Caller::user("alice")));
        assert_eq!(t.caller(Some("bearer bbbbbbbbbbbbbbbbbbbb")).await, Ok(Caller::user("bob")));
        assert_eq!(t.caller(Some("token bbbbbbbbbbbbbbbbbbbb")).await, Ok(Caller::user("bob")), "as Hub clients send");
        assert!(matches!(t.caller(Some("Bearer aaaaaaaaaaaaaaaaaaab")).await, Err(Refusal::Unauthorized(_))));
        assert!(t.caller(Some("aaaaaaaaaaaaaaaaaaaa")).await.is_err(), "not a bearer header");
        assert!(t.caller(Some("Basic aaaaaaaaaaaaaaaaaaaa")).await.is_err(), "not a bearer header");
        assert!(t.caller(None).await.is_err());
        assert_eq!(Tokens::open().caller(None).await, Ok(Caller { user: None, admin: true }));

        let err = Tokens::parse("alice short\n").unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("shorter"), "{err}");
        let err = Tokens::parse("a xxxxxxxxxxxxxxxxxxxx\nb xxxxxxxxxxxxxxxxxxxx\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("twice"), "{err}");
        assert!(Tokens::parse("alice\n").unwrap_err().to_string().contains("USER TOKEN"));
        let err = Tokens::parse("alice aaaaaaaaaaaaaaaaaaaa root\n").unwrap_err().to_string();
        assert!(err.contains("unknown role \"root\""), "{err}");
        let t = Tokens::parse("alice aaaaaaaaaaaaaaaaaaaa admin\nbob bbbbbbbbbbbbbbbbbbbb\n").unwrap();
        assert_eq!(t.caller(Some("Bearer aaaaaaaaaaaaaaaaaaaa")).await.map(|c| c.admin), Ok(true));
        assert_eq!(t.caller(Some("Bearer bbbbbbbbbbbbbbbbbbbb")).await.map(|c| c.admin), Ok(false));
        assert!(matches!(Tokens::parse("# nothing\n"), Err(TokensError::Empty)));
    }
}
