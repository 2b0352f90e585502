//! bincode 2 (serde) on the wire; the message type and version travel in NATS
//! headers so a receiver can reject what it does not understand, or upgrade an old
//! version, before it decodes a byte of the payload.

use async_nats::HeaderMap;
use serde::{de::DeserializeOwned, Serialize};

/// Header carrying the message type name.
pub const TYPE_HEADER: &str = "ll-type";
/// Header carrying the message version.
pub const VERSION_HEADER: &str = "ll-version";
/// Largest payload we will decode: the largest message body (ADR 30); bulk bytes
/// never travel on the bus, so anything bigger is corrupt or hostile.
pub const MAX_DECODE_BYTES: usize = crate::bodies::MAX_BODY_BYTES;

/// A message that travels on the bus.
///
/// Each type names itself and its current version. `decode_version` decodes older
/// versions and upgrades them; the default accepts only the current one.
pub trait WireMessage: Serialize + DeserializeOwned + Send + 'static {
    /// Stable type name, sent in the `ll-type` header.
    const TYPE: &'static str;
    /// Current version, sent in the `ll-version` header.
    const VERSION: u16;

    /// Decode a payload that was sent as `version` of this type.
    fn decode_version(version: u16, payload: &[u8]) -> Result<Self, CodecError> {
        if version == Self::VERSION {
            decode_bincode(payload)
        } else {
            Err(CodecError::UnsupportedVersion { ty: Self::TYPE, version })
        }
    }
}

/// Why a payload could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The message had no type/version headers.
    #[error("message has no {TYPE_HEADER}/{VERSION_HEADER} headers")]
    MissingHeaders,
    /// The type header names another message type.
    #[error("expected message type {expected}, got {got}")]
    WrongType {
        /// What the receiver expected.
        expected: &'static str,
        /// What the header said.
        got: String,
    },
    /// The version header is not a version this build can read.
    #[error("{ty} version {version} is not supported")]
    UnsupportedVersion {
        /// The message type.
        ty: &'static str,
        /// The version in the header.
        version: u16,
    },
    /// The version header is not a number.
    #[error("bad version header {0:?}")]
    BadVersion(String),
    /// The payload is larger than any message we send.
    #[error("payload of {0} bytes exceeds the {MAX_DECODE_BYTES}-byte limit")]
    TooLarge(usize),
    /// The payload did not decode as the message type.
    #[error("payload does not decode: {0}")]
    Decode(String),
    /// The message could not be encoded.
    #[error("message does not encode: {0}")]
    Encode(String),
    /// The message's body (ADR 30) could not be read.
    #[error("{0}")]
    Body(String),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_DECODE_BYTES>()
}

/// Encode a value with the bus's bincode configuration.
pub fn encode_bincode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    bincode::serde::encode_to_vec(value, config()).map_err(|e| CodecError::Encode(e.to_string()))
}

/// Decode a value with the bus's bincode configuration; trailing bytes are an error.
pub fn decode_bincode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, CodecError> {
    if payload.len() > MAX_DECODE_BYTES {
        return Err(CodecError::TooLarge(payload.len()));
    }
    let (value, used) =
        bincode::serde::decode_from_slice(payload, config()).map_err(|e| CodecError::Decode(e.to_string()))?;
    if used != payload.len() {
        return Err(CodecError::Decode(format!("{} trailing bytes after the message", payload.len() - used)));
    }
    Ok(value)
}

/// Encode a message into headers (type, version) and payload.
pub fn encode<M: WireMessage>(msg: &M) -> Result<(HeaderMap, Vec<u8>), CodecError> {
    let mut headers = HeaderMap::new();
    headers.insert(TYPE_HEADER, M::TYPE);
    headers.insert(VERSION_HEADER, M::VERSION.to_string().as_str());
    Ok((headers, encode_bincode(msg)?))
}

/// Check that headers name message type `M`; returns the version they name.
pub fn check_headers<M: WireMessage>(headers: Option<&HeaderMap>) -> Result<u16, CodecError> {
    let headers = headers.ok_or(CodecError::MissingHeaders)?;
    let ty = headers.get(TYPE_HEADER).ok_or(CodecError::MissingHeaders)?.as_str();
    if ty != M::TYPE {
        return Err(CodecError::WrongType { expected: M::TYPE, got: ty.to_string() });
    }
    let version = headers.get(VERSION_HEADER).ok_or(CodecError::MissingHeaders)?.as_str();
    version.parse().map_err(|_| CodecError::BadVersion(version.to_string()))
}

/// Decode a message, checking its type header and dispatching on its version.
pub fn decode<M: WireMessage>(headers: Option<&HeaderMap>, payload: &[u8]) -> Result<M, CodecError> {
    let version = check_headers::<M>(headers)?;
    M::decode_version(version, payload)
}
