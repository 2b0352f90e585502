//! The API's errors: a status and a JSON `{"error": ...}` body, and the helpers
//! that turn a bad request body, a bad id or a failed call into one.

use actix::MailboxError;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use uuid::Uuid;

use super::MAX_CELL_BYTES;

/// An API error: a status and a JSON `{"error": ...}` body.
#[derive(Debug)]
pub struct ApiError(pub(super) StatusCode, pub(super) String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

pub(super) fn bad_request(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

pub(super) fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
}

pub(super) fn internal(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::INTERNAL_SERVER_ERROR, msg.into())
}

pub(super) fn json_body<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(v)| v).map_err(|e| {
        // a body that is not the JSON we expect is a bad request; a missing content
        // type (415) and a body over the limit (413) keep their own status
        let keep = [StatusCode::UNSUPPORTED_MEDIA_TYPE, StatusCode::PAYLOAD_TOO_LARGE];
        let status = if keep.contains(&e.status()) { e.status() } else { StatusCode::BAD_REQUEST };
        ApiError(status, format!("bad request body: {}", e.body_text()))
    })
}

/// A cell's code from a request body, refused (413) over `MAX_CELL_BYTES`.
pub(super) fn cell_code(code: String) -> Result<String, ApiError> {
    if code.len() > MAX_CELL_BYTES {
        let limit = crate::serve::in_mib(MAX_CELL_BYTES);
        return Err(ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the cell's code is {} bytes, over the limit of {MAX_CELL_BYTES} bytes ({limit})", code.len()),
        ));
    }
    Ok(code)
}

pub(super) fn parse_sid(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|e| bad_request(format!("session id {raw:?} is not a uuid: {e}")))
}

pub(super) fn mailbox(e: MailboxError) -> ApiError {
    ApiError(StatusCode::GONE, format!("the session is closing: {e}"))
}
