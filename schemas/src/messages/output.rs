//! A cell's outputs (`output.{sid}.{exec}`), cut into pieces when large, and the
//! `output_type`s among a worker's outputs that are never notebook outputs.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::codec::WireMessage;

/// worker's host -> frontend: one cell output (`output.{sid}.{exec}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputV1 {
    /// The session.
    pub session: Uuid,
    /// The execution.
    pub exec_id: Uuid,
    /// Order within the execution.
    pub seq: u64,
    /// One nbformat v4 output, as JSON (or piece `part` of it).
    pub output_json: String,
    /// An output larger than one message piece (`OUTPUT_PART_BYTES`) travels as
    /// `parts` pieces of its JSON text, in order; this is piece `part` (0-based).
    pub part: u32,
    /// How many pieces the output has (1 for most).
    pub parts: u32,
}
wire!(OutputV1, "output", 1);

/// Largest piece of an output's JSON per message: under the bus's inline limit
/// (ADR 30), so outputs stay in the outputs stream itself, never as bodies.
pub const OUTPUT_PART_BYTES: usize = 192 * 1024;

impl OutputV1 {
    /// The messages that carry one output: one, or pieces of at most `max` bytes
    /// cut at character boundaries.
    pub fn pieces(session: Uuid, exec_id: Uuid, seq: u64, json: String, max: usize) -> Vec<OutputV1> {
        if json.len() <= max {
            return vec![OutputV1 { session, exec_id, seq, output_json: json, part: 0, parts: 1 }];
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
            .map(|(i, piece)| OutputV1 { session, exec_id, seq, output_json: piece, part: i as u32, parts })
            .collect()
    }
}

/// The `output_type` of the output that asks a run's client for a line of input
/// (`{"output_type", "prompt", "password"}`; a Jupyter stdin request, never a
/// notebook output): the host makes it, the frontend and the kernel read it.
pub const INPUT_REQUEST_OUTPUT: &str = "input_request";

/// The `output_type` of the results of a run's `user_expressions` (`data`:
/// name -> result as in Jupyter's `execute_reply`): for the run's client, never
/// a notebook output.
pub const USER_EXPRESSIONS_OUTPUT: &str = "user_expressions";

/// The `output_type` of a comm message to the client among a worker's outputs
/// (`msg_type`, `content`, `metadata`, base64 `buffers`): relayed as that
/// Jupyter message, never a notebook output (ADR 33).
pub const COMM_OUTPUT: &str = "comm";
