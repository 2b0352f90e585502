//! What a running cell sends its client (`output.{sid}.{exec}`): a notebook
//! output, or one of the side channels Jupyter keeps apart from outputs (stdin,
//! comms, reply payloads), as one typed `CellMessage` (ADR 61); a large one
//! travels in pieces.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::codec::WireMessage;
use crate::messages::frozen::OutputV1;

/// What a running cell (or a client's comm message) sends its client. Made once
/// where the worker's frame arrives (the host), read as itself everywhere after;
/// the HTTP API writes it as JSON (`to_json`) and its client reads it back
/// (`from_json`), the only two places that look at `output_type`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CellMessage {
    /// One nbformat v4 output (stream, display_data, execute_result, error) or a
    /// Jupyter message that changes the outputs shown (update_display_data,
    /// clear_output), as its JSON object.
    Output(#[serde(with = "json_text")] Value),
    /// The cell called `input()` or `getpass()`: the run's client is asked for a
    /// line (Jupyter's stdin channel), answered with `InputReplyV1`.
    InputRequest {
        /// The prompt.
        prompt: String,
        /// A password: the client does not echo it.
        password: bool,
    },
    /// A comm message to the client (ipywidgets; ADR 33).
    Comm(CommToClient),
    /// The results of the run's `user_expressions` (name -> result, as in
    /// Jupyter's `execute_reply`), for the run's reply.
    UserExpressions(#[serde(with = "json_text")] Value),
    /// The text of `obj?`, for a Jupyter pager: the `page` payload of the run's
    /// reply.
    Pager {
        /// The mime bundle.
        #[serde(with = "json_text")]
        data: Value,
        /// The line to start at.
        start: u64,
    },
}

/// A comm message from a worker to the client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommToClient {
    /// `comm_open`, `comm_msg` or `comm_close`.
    pub msg_type: String,
    /// The Jupyter message's content.
    #[serde(with = "json_text")]
    pub content: Value,
    /// Its metadata.
    #[serde(with = "json_text")]
    pub metadata: Value,
    /// Its binary buffers, base64.
    pub buffers: Vec<String>,
}

/// Why JSON is not a cell message.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CellMessageError {
    /// Not JSON at all.
    #[error("a cell message is not JSON: {0}")]
    NotJson(String),
    /// JSON, but not an object with a string `output_type`.
    #[error("a cell message is not an object with a string output_type")]
    NoKind,
    /// An `output_type` that is neither an nbformat output nor a side channel.
    #[error("unknown output_type {0:?}")]
    UnknownKind(String),
    /// A field its kind needs is missing or of the wrong type.
    #[error("a {kind} message lacks {field:?}, or it is not a {expected}")]
    BadField {
        /// The `output_type`.
        kind: &'static str,
        /// The field.
        field: &'static str,
        /// The JSON type it needs.
        expected: &'static str,
    },
}

/// The `output_type`s of nbformat outputs and of the messages that change them.
const NOTEBOOK_OUTPUTS: [&str; 6] =
    ["stream", "display_data", "execute_result", "error", "update_display_data", "clear_output"];

impl CellMessage {
    /// A notebook output (stream, display_data, …) and not a side channel.
    pub fn output(&self) -> Option<&Value> {
        match self {
            CellMessage::Output(output) => Some(output),
            _ => None,
        }
    }

    /// The message as the HTTP API writes it: a notebook output as itself, a side
    /// channel as an object whose `output_type` names it (`input_request`,
    /// `comm`, `user_expressions`, `pager`) and that no notebook holds.
    pub fn to_json(&self) -> Value {
        match self {
            CellMessage::Output(output) => output.clone(),
            CellMessage::InputRequest { prompt, password } => {
                json!({ "output_type": "input_request", "prompt": prompt, "password": password })
            }
            CellMessage::Comm(c) => json!({
                "output_type": "comm", "msg_type": c.msg_type, "content": c.content,
                "metadata": c.metadata, "buffers": c.buffers,
            }),
            CellMessage::UserExpressions(data) => json!({ "output_type": "user_expressions", "data": data }),
            CellMessage::Pager { data, start } => json!({ "output_type": "pager", "data": data, "start": start }),
        }
    }

    /// Read the HTTP API's JSON of a message (`to_json`'s) back.
    pub fn from_json(mut v: Value) -> Result<CellMessage, CellMessageError> {
        let kind = v.get("output_type").and_then(Value::as_str).ok_or(CellMessageError::NoKind)?.to_owned();
        if NOTEBOOK_OUTPUTS.contains(&kind.as_str()) {
            return Ok(CellMessage::Output(v));
        }
        let start = v.get("start").and_then(Value::as_u64).unwrap_or(0);
        let mut take = |kind: &'static str, field: &'static str, expected: &'static str| {
            let value = v.get_mut(field).map(Value::take).unwrap_or(Value::Null);
            let ok = match expected {
                "object" => value.is_object(),
                "string" => value.is_string(),
                "boolean" => value.is_boolean(),
                "array of strings" => value.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
                _ => value.is_u64(),
            };
            ok.then_some(value).ok_or(CellMessageError::BadField { kind, field, expected })
        };
        let text = |v: Value| v.as_str().unwrap_or_default().to_owned();
        Ok(match kind.as_str() {
            "input_request" => CellMessage::InputRequest {
                prompt: text(take("input_request", "prompt", "string")?),
                password: take("input_request", "password", "boolean")?.as_bool().unwrap_or_default(),
            },
            "comm" => CellMessage::Comm(CommToClient {
                msg_type: text(take("comm", "msg_type", "string")?),
                content: take("comm", "content", "object")?,
                metadata: take("comm", "metadata", "object")?,
                buffers: take("comm", "buffers", "array of strings")?
                    .as_array()
                    .map(|a| a.iter().map(|b| text(b.clone())).collect())
                    .unwrap_or_default(),
            }),
            "user_expressions" => CellMessage::UserExpressions(take("user_expressions", "data", "object")?),
            "pager" => CellMessage::Pager { data: take("pager", "data", "object")?, start },
            _ => return Err(CellMessageError::UnknownKind(kind)),
        })
    }

    /// Read the JSON text of a message (its pieces joined).
    pub fn from_json_text(text: &str) -> Result<CellMessage, CellMessageError> {
        let v = serde_json::from_str(text).map_err(|e| CellMessageError::NotJson(e.to_string()))?;
        CellMessage::from_json(v)
    }
}

/// A `Value` on the wire as its JSON text (bincode has no self-describing values).
mod json_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use serde_json::Value;

    pub fn serialize<S: Serializer>(v: &Value, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        let text = String::deserialize(d)?;
        serde_json::from_str(&text).map_err(serde::de::Error::custom)
    }
}

/// A `CellMessage` field of the HTTP API's JSON, written as `to_json` writes it:
/// `#[serde(with = "schemas::messages::cell_message_json")]`.
pub mod cell_message_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use serde_json::Value;

    use super::CellMessage;

    /// Write `m` as the HTTP API does.
    pub fn serialize<S: Serializer>(m: &CellMessage, s: S) -> Result<S::Ok, S::Error> {
        match m {
            // as itself, not a copy: an output may be megabytes
            CellMessage::Output(output) => output.serialize(s),
            _ => m.to_json().serialize(s),
        }
    }

    /// Read it back.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<CellMessage, D::Error> {
        CellMessage::from_json(Value::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A list of `CellMessage`s in the HTTP API's JSON (`cell_message_json`, each).
pub mod cell_messages_json {
    use serde::{Deserialize, Deserializer, Serializer};
    use serde_json::Value;

    use super::CellMessage;

    /// Write each as the HTTP API does.
    pub fn serialize<S: Serializer>(ms: &[CellMessage], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(ms.iter().map(CellMessage::to_json))
    }

    /// Read them back.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<CellMessage>, D::Error> {
        Vec::<Value>::deserialize(d)?
            .into_iter()
            .map(|v| CellMessage::from_json(v).map_err(serde::de::Error::custom))
            .collect()
    }
}

/// worker's host -> frontend: one thing a running cell sends its client
/// (`output.{sid}.{exec}`), whole or one piece of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputV2 {
    /// The session.
    pub session: Uuid,
    /// The execution.
    pub exec_id: Uuid,
    /// Order within the execution.
    pub seq: u64,
    /// The message.
    pub body: OutputBody,
}
wire!(OutputV2, "output", 2, upgrades OutputV1 from 1);

/// A message whole, or one piece of one too large for a bus message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum OutputBody {
    /// The whole message.
    Whole(CellMessage),
    /// Piece `part` (0-based) of `parts`: the pieces' texts, joined in order, are
    /// the message's JSON (`CellMessage::to_json`).
    Piece {
        /// This piece's place.
        part: u32,
        /// How many pieces.
        parts: u32,
        /// Its text.
        text: String,
    },
}

/// Largest JSON of a message that travels whole; a larger one is cut into pieces
/// of at most this many bytes: under the bus's inline limit (ADR 30), so outputs
/// stay in the outputs stream itself, never as bodies.
pub const OUTPUT_PART_BYTES: usize = 192 * 1024;

/// The most pieces a message has: a worker's frame holds at most 64 MiB, whose
/// JSON (escaped) fits in fewer. A reader drops a piece that claims more.
pub const MAX_OUTPUT_PIECES: u32 = 1024;

impl OutputV2 {
    /// The messages that carry `message`: itself, or pieces of its JSON of at most
    /// `max` bytes cut at character boundaries.
    pub fn pieces(session: Uuid, exec_id: Uuid, seq: u64, message: CellMessage, max: usize) -> Vec<OutputV2> {
        let json = match &message {
            // as itself, not a copy: an output may be megabytes
            CellMessage::Output(output) => output.to_string(),
            _ => message.to_json().to_string(),
        };
        if json.len() <= max {
            return vec![OutputV2 { session, exec_id, seq, body: OutputBody::Whole(message) }];
        }
        let mut cuts = Vec::new();
        let mut start = 0;
        while start < json.len() {
            let mut end = (start + max.max(4)).min(json.len());
            while !json.is_char_boundary(end) {
                end -= 1;
            }
            cuts.push(json[start..end].to_string());
            start = end;
        }
        let parts = cuts.len() as u32;
        cuts.into_iter()
            .enumerate()
            .map(|(i, text)| OutputV2 {
                session,
                exec_id,
                seq,
                body: OutputBody::Piece { part: i as u32, parts, text },
            })
            .collect()
    }
}
