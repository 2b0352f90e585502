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
    /// Cells whose worker reported CUDA use the last time they ran.
    #[serde(default)]
    pub cuda_cells: std::collections::BTreeSet<String>,
    /// The cell of each execution planned, until it finishes.
    #[serde(default)]
    pub running: BTreeMap<Uuid, String>,
    /// Submodules the session's cells imported by dotted name (`import a.b`): in
    /// the original kernel `a.b` is then an attribute of `a`, so a worker that
    /// restores the module `a` imports them too.
    #[serde(default)]
    pub submodules: std::collections::BTreeSet<String>,
    /// Per cell, names its runs reached that the closure missed (the worker's
    /// safety net brought them in): restored up front the next time it runs.
    #[serde(default)]
    pub faulted: BTreeMap<String, std::collections::BTreeSet<String>>,
}

impl SessionState {
    /// Learn what a cell's run wrote. Only what the manifest cannot tell is kept
    /// (a def or class summary, a value moved to a GPU); a name rebound to a plain
    /// value forgets its old metadata. So the state grows with the session's
    /// functions, classes and GPU values, not with its number of variables: a
    /// session of 50,000 plain variables keeps none here (ADR 30).
    pub fn learn(&mut self, writes: &BTreeMap<String, NameMeta>) {
        for (name, meta) in writes {
            if meta.def.is_some() || meta.on_gpu {
                self.names.insert(name.clone(), meta.clone());
            } else {
                self.names.remove(name);
            }
        }
    }
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
    /// The stored state does not decode. It is left as it is (a reset would
    /// forget which cells define which names, and the next closures would be
    /// wrong); deleting the session clears it.
    #[error("planner state for session {session} is corrupt ({source}); delete the session to start it afresh")]
    Corrupt {
        /// Session.
        session: Uuid,
        /// Why it does not decode.
        source: serde_json::Error,
    },
}

/// Change a session's state with `f`, atomically: a revision-checked update that
/// retries when another planner (or another handler of this one) wrote meanwhile,
/// and, for up to `buckets::LEADER_ELECTION`, when the bucket did not answer (its leader
/// was lost). A corrupt state is the answer at once.
pub async fn modify<T>(
    kv: &kv::Store,
    session: Uuid,
    mut f: impl FnMut(&mut SessionState) -> T,
) -> Result<T, StateError> {
    let mut retry = schemas::buckets::ElectionRetry::new();
    loop {
        match modify_once(kv, session, &mut f).await {
            Err(StateError::Kv { reason, .. }) => match retry.next_wait() {
                Some(wait) => {
                    tracing::info!(%session, error = %reason, "planner state unavailable; trying again in {wait:?}");
                    tokio::time::sleep(wait).await;
                }
                None => return Err(StateError::Kv { session, reason }),
            },
            done => return done,
        }
    }
}

async fn modify_once<T>(
    kv: &kv::Store,
    session: Uuid,
    f: &mut impl FnMut(&mut SessionState) -> T,
) -> Result<T, StateError> {
    let key = session.to_string();
    let kv_err = |reason: String| StateError::Kv { session, reason };
    for _ in 0..16 {
        let entry = kv.entry(key.clone()).await.map_err(|e| kv_err(e.to_string()))?;
        let (mut state, revision) = match &entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let state =
                    serde_json::from_slice(&e.value).map_err(|source| StateError::Corrupt { session, source })?;
                (state, Some(e.revision))
            }
            Some(e) => (SessionState::default(), Some(e.revision)),
            None => (SessionState::default(), None),
        };
        let out = f(&mut state);
        let bytes = serde_json::to_vec(&state).map_err(|e| kv_err(e.to_string()))?;
        let size = bytes.len();
        // Only a write that lost a race is retried; any other failure (a state larger
        // than the KV store takes, say) is the answer, with the size that caused it.
        let written = match revision {
            Some(r) => kv.update(key.clone(), bytes.into(), r).await.map(|_| ()).map_err(|e| {
                let raced = e.kind() == kv::UpdateErrorKind::WrongLastRevision;
                (raced, e.to_string())
            }),
            None => kv.create(key.clone(), bytes.into()).await.map(|_| ()).map_err(|e| {
                let raced = e.kind() == kv::CreateErrorKind::AlreadyExists;
                (raced, e.to_string())
            }),
        };
        match written {
            Ok(()) => return Ok(out),
            Err((true, e)) => tracing::debug!(%session, error = %e, "planner state changed meanwhile; retrying"),
            Err((false, e)) => return Err(kv_err(format!("could not write {size} bytes of state: {e}"))),
        }
    }
    Err(kv_err("too many concurrent updates".into()))
}

/// Forget a session.
pub async fn delete(kv: &kv::Store, session: Uuid) -> Result<(), StateError> {
    kv.delete(session.to_string()).await.map_err(|e| StateError::Kv { session, reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis;

    #[test]
    fn plain_variables_leave_no_planner_state_and_a_rebound_def_is_forgotten() {
        let code: String = (0..50_000).map(|i| format!("v{i} = {i}\n")).collect();
        let writes = |code: &str| -> BTreeMap<String, NameMeta> {
            let a = analysis::analyze(code);
            a.writes
                .iter()
                .map(|n| (n.clone(), NameMeta { def: a.defs.get(n).cloned(), ..Default::default() }))
                .collect()
        };
        let mut state = SessionState::default();
        state.learn(&writes(&code));
        assert!(state.names.is_empty(), "{} names kept", state.names.len());
        assert!(serde_json::to_vec(&state).unwrap().len() < 1024);

        state.learn(&writes("def f(x):\n    return x + v1\n"));
        assert!(state.names["f"].def.is_some());
        state.learn(&writes("f = 3\n"));
        assert!(!state.names.contains_key("f"), "a rebound name kept its def");
    }
}
