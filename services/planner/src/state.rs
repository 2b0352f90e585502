//! What the planner remembers about a session, kept in the JetStream KV bucket
//! `{prefix}_planner` (key = session id) so that a restarted or second planner
//! loses nothing: for each name, what the cell that last wrote it told us (its
//! function/class summary, and whether it was moved to a GPU).
//!
//! Names and versions themselves come from the store's manifest, the authority on
//! what is live.

use std::collections::BTreeMap;

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::analysis::DefSummary;

/// What the planner learned about a name from the cell that last wrote it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NameMeta {
    /// The execution that wrote it.
    pub exec_id: Uuid,
    /// Its function/class summary, if the cell defined it.
    pub def: Option<DefSummary>,
    /// Whether a GPU cell wrote or moved it (it lives on a GPU).
    pub on_gpu: bool,
}

/// A session's planner state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionState {
    /// Per-name metadata.
    pub names: BTreeMap<String, NameMeta>,
    /// Per-cell recipe revision and the hash of its last published recipe.
    pub recipes: BTreeMap<String, (u64, u64)>,
}

/// Why the state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// KV failed.
    #[error("planner state for session {session}: {reason}")]
    Kv {
        /// Session.
        session: Uuid,
        /// What failed.
        reason: String,
    },
}

/// Load a session's state (empty if none). A corrupt entry is logged and replaced:
/// the state only refines closures, the manifest stays the authority.
pub async fn load(kv: &kv::Store, session: Uuid) -> Result<SessionState, StateError> {
    match kv.get(session.to_string()).await {
        Ok(Some(bytes)) => match serde_json::from_slice(&bytes) {
            Ok(s) => Ok(s),
            Err(e) => {
                tracing::error!(%session, error = %e, "corrupt planner state; starting afresh");
                Ok(SessionState::default())
            }
        },
        Ok(None) => Ok(SessionState::default()),
        Err(e) => Err(StateError::Kv { session, reason: e.to_string() }),
    }
}

/// Store a session's state.
pub async fn save(kv: &kv::Store, session: Uuid, state: &SessionState) -> Result<(), StateError> {
    let bytes = serde_json::to_vec(state).map_err(|e| StateError::Kv { session, reason: e.to_string() })?;
    kv.put(session.to_string(), bytes.into())
        .await
        .map(|_| ())
        .map_err(|e| StateError::Kv { session, reason: e.to_string() })
}

/// Forget a session.
pub async fn delete(kv: &kv::Store, session: Uuid) -> Result<(), StateError> {
    kv.delete(session.to_string()).await.map_err(|e| StateError::Kv { session, reason: e.to_string() })
}
