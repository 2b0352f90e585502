//! The dashboard's login through JupyterHub's OAuth (ADR 67): `/hub/login` sends
//! the browser to the Hub's authorize endpoint with a fresh `state` and PKCE's
//! challenge (the state and the verifier kept in a cookie, so any frontend can
//! check the callback); `/hub/oauth_callback` checks the state, trades the code
//! and the verifier for the user's token and hands the token to the dashboard in
//! the address's fragment (never sent to a server), as `#token=` does for a
//! LooseLeaf token.

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::errors::ApiError;
use super::AppState;
use crate::hub::{percent_encoded, HubError};

/// The cookie that carries the login's `state` between the two steps.
const STATE_COOKIE: &str = "looseleaf-oauth-state";

fn no_hub() -> ApiError {
    ApiError(StatusCode::NOT_FOUND, "this frontend serves no JupyterHub (--jupyterhub-api-url)".into())
}

/// The request's Host, for the callback's default address.
fn host(headers: &HeaderMap) -> String {
    headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("localhost").to_string()
}

/// The cookie's attributes: `Secure` where browsers come back over https.
fn cookie_attributes(callback: &str) -> &'static str {
    if callback.starts_with("https:") {
        "Path=/hub; HttpOnly; Secure; SameSite=Lax"
    } else {
        "Path=/hub; HttpOnly; SameSite=Lax"
    }
}

/// `GET /hub/login`: to the Hub's authorize endpoint.
pub(super) async fn login(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    let hub = state.tokens.hub().ok_or_else(no_hub)?;
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    // PKCE's verifier: 64 characters of fresh entropy
    let verifier = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
    let callback = hub.callback_url(&host(&headers));
    let to = hub.authorize_url(&callback, &nonce, &verifier);
    let cookie = format!("{STATE_COOKIE}={nonce}.{verifier}; {}; Max-Age=600", cookie_attributes(&callback));
    Ok((StatusCode::FOUND, [(header::LOCATION, to), (header::SET_COOKIE, cookie)]).into_response())
}

/// The Hub's answer to the authorize request.
#[derive(Debug, Deserialize)]
pub(super) struct Callback {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
}

/// `GET /hub/oauth_callback`: the code traded for the user's token, which goes to
/// the dashboard.
pub(super) async fn callback(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(answer): Query<Callback>,
) -> Result<Response, ApiError> {
    let hub = state.tokens.hub().ok_or_else(no_hub)?;
    if let Some(error) = answer.error {
        return Err(ApiError(StatusCode::FORBIDDEN, format!("JupyterHub refused the login: {error}")));
    }
    let (Some(code), Some(given)) = (answer.code, answer.state) else {
        return Err(ApiError(StatusCode::BAD_REQUEST, "the login's callback needs `code` and `state`".into()));
    };
    // the login this browser started: its state, and PKCE's verifier
    let kept = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(STATE_COOKIE)?.strip_prefix('=')?.split_once('.'))
        .find(|(nonce, _)| *nonce == given);
    let Some((_, verifier)) = kept else {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "the login's state does not match this browser's (start again at /hub/login)".into(),
        ));
    };
    let callback = hub.callback_url(&host(&headers));
    let token = hub.exchange(&code, &callback, verifier).await.map_err(|e| match &e {
        HubError::Down { .. } => ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        // the code expired or was used: the user logs in again
        HubError::Refused { error, .. } if error == "invalid_grant" => {
            ApiError(StatusCode::FORBIDDEN, format!("{e}; log in again at /hub/login"))
        }
        // this service's client id, secret or redirect URI is not the Hub's
        _ => ApiError(
            StatusCode::BAD_GATEWAY,
            format!("{e}: check --jupyterhub-token-file, --jupyterhub-service and the service's oauth_redirect_uri"),
        ),
    })?;
    let clear = format!("{STATE_COOKIE}=; {}; Max-Age=0", cookie_attributes(&callback));
    let to = format!("/#token={}", percent_encoded(&token));
    let headers = [(header::LOCATION, to), (header::SET_COOKIE, clear), (header::CACHE_CONTROL, "no-store".into())];
    Ok((StatusCode::FOUND, headers).into_response())
}
