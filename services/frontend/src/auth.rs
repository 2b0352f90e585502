//! Who is calling the HTTP API: bearer tokens, one or more per user, from a file
//! the operator writes (`--tokens-file`). Each session belongs to the user who
//! created it; another user's session is answered 404, as if it did not exist.
//!
//! Without a tokens file the API is open (every caller is the same anonymous user):
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

/// Tokens shorter than this are refused (they could be guessed).
const MIN_TOKEN_CHARS: usize = 16;

/// The caller: a user named in the tokens file, or anonymous on an open API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller(pub Option<String>);

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

/// The API's tokens (None: the API is open).
#[derive(Clone, Debug, Default)]
pub struct Tokens(Option<Arc<Table>>);

/// Who each token names, and which users are admins.
#[derive(Debug, Default)]
struct Table {
    users: HashMap<String, String>,
    admins: std::collections::BTreeSet<String>,
}

impl Tokens {
    /// An open API: no token asked.
    pub fn open() -> Self {
        Self(None)
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
        Ok(Self(Some(Arc::new(table))))
    }

    /// The users the tokens name (none for an open API).
    pub fn users(&self) -> std::collections::BTreeSet<&str> {
        self.0.iter().flat_map(|t| t.users.values()).map(String::as_str).collect()
    }

    /// Whether `caller` is an admin: one a tokens file names so, or the open
    /// API's one user (who owns every session there is).
    pub fn is_admin(&self, caller: &Caller) -> bool {
        match (&self.0, &caller.0) {
            (None, _) => true,
            (Some(t), Some(user)) => t.admins.contains(user),
            (Some(_), None) => false,
        }
    }

    /// Whether the API asks for a token.
    pub fn required(&self) -> bool {
        self.0.is_some()
    }

    /// The caller an `Authorization` header names, or why it is refused.
    pub fn caller(&self, authorization: Option<&str>) -> Result<Caller, &'static str> {
        let Some(tokens) = &self.0 else { return Ok(Caller(None)) };
        let given = authorization
            .and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer ")))
            .map(str::trim)
            .ok_or("this API needs a bearer token (Authorization: Bearer TOKEN)")?;
        // every token is compared, in time that does not depend on where they differ
        let mut found = None;
        for (token, user) in tokens.users.iter() {
            if same(token.as_bytes(), given.as_bytes()) {
                found = Some(user.clone());
            }
        }
        found.map(|u| Caller(Some(u))).ok_or("the bearer token is not valid")
    }
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Middleware: every route but `/v1/health`, `/v1/openapi.json` and the dashboard's
/// page `/` (no data: it asks `/v1/dashboard` with the token) needs a valid token
/// when tokens are configured; the caller goes into the request's extensions.
pub async fn require_token(State(tokens): State<Tokens>, mut req: Request, next: Next) -> Response {
    if matches!(req.uri().path(), "/v1/health" | "/v1/openapi.json" | "/") {
        return next.run(req).await;
    }
    let header = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match tokens.caller(header) {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Err(why) => {
            let body = Json(serde_json::json!({ "error": why }));
            (StatusCode::UNAUTHORIZED, [(header::WWW_AUTHENTICATE, "Bearer")], body).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_their_users_and_bad_files_say_which_line() {
        let t = Tokens::parse("# operators\nalice aaaaaaaaaaaaaaaaaaaa\n\nbob bbbbbbbbbbbbbbbbbbbb\n").unwrap();
        assert!(t.required());
        assert_eq!(t.caller(Some("Bearer aaaaaaaaaaaaaaaaaaaa")), Ok(Caller(Some("alice".into()))));
        assert_eq!(t.caller(Some("Bearer bbbbbbbbbbbbbbbbbbbb")), Ok(Caller(Some("bob".into()))));
        assert!(t.caller(Some("Bearer aaaaaaaaaaaaaaaaaaab")).is_err());
        assert!(t.caller(Some("aaaaaaaaaaaaaaaaaaaa")).is_err(), "not a bearer header");
        assert!(t.caller(None).is_err());
        assert_eq!(Tokens::open().caller(None), Ok(Caller(None)));

        let err = Tokens::parse("alice short\n").unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("shorter"), "{err}");
        let err = Tokens::parse("a xxxxxxxxxxxxxxxxxxxx\nb xxxxxxxxxxxxxxxxxxxx\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("twice"), "{err}");
        assert!(Tokens::parse("alice\n").unwrap_err().to_string().contains("USER TOKEN"));
        let err = Tokens::parse("alice aaaaaaaaaaaaaaaaaaaa root\n").unwrap_err().to_string();
        assert!(err.contains("unknown role \"root\""), "{err}");
        let t = Tokens::parse("alice aaaaaaaaaaaaaaaaaaaa admin\nbob bbbbbbbbbbbbbbbbbbbb\n").unwrap();
        assert!(t.is_admin(&Caller(Some("alice".into()))) && !t.is_admin(&Caller(Some("bob".into()))));
        assert!(Tokens::open().is_admin(&Caller(None)), "the open API's one user owns everything");
        assert!(matches!(Tokens::parse("# nothing\n"), Err(TokensError::Empty)));
    }
}
