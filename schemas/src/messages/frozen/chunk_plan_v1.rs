//! Version 1 of the chunk plan (`chunk-plan` 1), frozen.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::messages::ChunkPlanV2;

/// host -> store: which of these chunks does the store lack (no size named).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkPlanV1 {
    /// The saving session.
    pub session: Uuid,
    /// Chunk hashes the host does not know to be stored.
    pub hashes: Vec<String>,
}

impl ChunkPlanV1 {
    /// The same question as version 2, naming no size: the quota is checked at commit.
    pub fn upgrade(self) -> ChunkPlanV2 {
        ChunkPlanV2 { session: self.session, hashes: self.hashes, bytes_after: None }
    }
}
