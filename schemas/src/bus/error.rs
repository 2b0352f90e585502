//! Why a bus operation failed.

use std::time::Duration;

use crate::bodies::BodyError;
use crate::codec::CodecError;
use crate::messages::ErrorCode;

/// Why a bus operation failed. Each kind is its own variant, so a caller can tell
/// a missing service (`NoResponders`) from a slow one (`TimedOut`) from a refusal
/// (`Remote`); the client's error is kept as the source.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// Could not connect to NATS.
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        /// The server URL.
        url: String,
        /// What the client said.
        source: async_nats::ConnectError,
    },
    /// A login file (credentials, NKEY seed) could not be used.
    #[error("cannot use the NATS {what} {path}: {source}")]
    LoginFile {
        /// Which file it is.
        what: &'static str,
        /// Its path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A publish failed.
    #[error("publish to {subject} failed: {source}")]
    Publish {
        /// The subject.
        subject: String,
        /// What the client said.
        source: async_nats::PublishError,
    },
    /// Nothing listens on the subject: the service that answers it is not running.
    #[error("nothing answers on {subject} (is its service running?)")]
    NoResponders {
        /// The subject.
        subject: String,
    },
    /// A responder exists but did not answer in time.
    #[error("no answer on {subject} within {timeout:?}")]
    TimedOut {
        /// The subject.
        subject: String,
        /// How long the request waited.
        timeout: Duration,
    },
    /// A request failed otherwise (the connection broke).
    #[error("request to {subject} failed: {source}")]
    Request {
        /// The subject.
        subject: String,
        /// What the client said.
        source: async_nats::RequestError,
    },
    /// A message for a stream was not acknowledged by it within the patience given.
    #[error("the stream that keeps {subject} did not take a message: {reason}")]
    Kept {
        /// The subject.
        subject: String,
        /// What the last attempt got.
        reason: String,
    },
    /// A subscribe (or a service registration) failed.
    #[error("subscribe to {subject} failed: {source}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// What the client said.
        source: async_nats::Error,
    },
    /// A message did not encode or decode.
    #[error("{subject}: {source}")]
    Codec {
        /// The subject.
        subject: String,
        /// The codec error.
        source: CodecError,
    },
    /// A message's body (ADR 30) could not be stored.
    #[error("{subject}: {source}")]
    Body {
        /// The subject.
        subject: String,
        /// What failed.
        source: BodyError,
    },
    /// The responder answered with a typed error.
    #[error("{subject} answered {code:?}: {message}")]
    Remote {
        /// The subject.
        subject: String,
        /// The error code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
}

impl BusError {
    pub(super) fn from_request(subject: String, timeout: Duration, e: async_nats::RequestError) -> Self {
        match e.kind() {
            async_nats::RequestErrorKind::NoResponders => BusError::NoResponders { subject },
            async_nats::RequestErrorKind::TimedOut => BusError::TimedOut { subject, timeout },
            _ => BusError::Request { subject, source: e },
        }
    }
}
