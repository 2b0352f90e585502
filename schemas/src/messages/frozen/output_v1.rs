//! Version 1 of a cell's output (`output` 1), frozen: every message an nbformat
//! output's JSON text, side channels among them by `output_type`.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::messages::{OutputBody, OutputV2};

/// worker's host -> frontend: one cell output (`output.{sid}.{exec}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputV1 {
    /// The session.
    pub session: Uuid,
    /// The execution.
    pub exec_id: Uuid,
    /// Order within the execution.
    pub seq: u64,
    /// One output's JSON, or piece `part` of it.
    pub output_json: String,
    /// This piece (0-based).
    pub part: u32,
    /// How many pieces the output has (1 for most).
    pub parts: u32,
}

impl OutputV1 {
    /// The same output as version 2: its text is a piece of a message's JSON (the
    /// one piece of most), which the reader joins and reads as version 2's.
    pub fn upgrade(self) -> OutputV2 {
        let body = OutputBody::Piece { part: self.part, parts: self.parts, text: self.output_json };
        OutputV2 { session: self.session, exec_id: self.exec_id, seq: self.seq, body }
    }
}
