//! Session records in JetStream KV (`{prefix}_sessions`, key = session id): what a
//! frontend needs to serve a session it did not create, or created before it
//! restarted. The record is JSON (a frontend of another version reads what it
//! knows and ignores the rest) and carries its own version.
//!
//! Written when a session is created, when a run is queued or sent, and when an
//! execution completes (the revision it left); removed when the session is deleted. A frontend asked about
//! a session it does not hold looks the record up and adopts the session.

use std::collections::{BTreeMap, VecDeque};

use async_nats::jetstream::kv;
use schemas::messages::SessionOptions;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The version of [`SessionRecord`] this frontend writes.
pub const RECORD_VERSION: u32 = 1;

/// What outlives the frontend that serves a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// The record's format version.
    pub version: u32,
    /// The session.
    pub session_id: Uuid,
    /// Its options (working directory, placement, speculation).
    pub options: SessionOptions,
    /// When it was created (unix ms).
    pub created_unix_ms: u64,
    /// The manifest revision its last completed execution left.
    pub revision: u64,
    /// Its last completed execution.
    pub last_exec: Option<Uuid>,
    /// The user it belongs to (None: made on an API without tokens).
    #[serde(default)]
    pub owner: Option<String>,
    /// The run sent to the planner and not complete yet: a frontend that adopts the
    /// session follows it to its outcome (written before the run is sent).
    #[serde(default)]
    pub in_flight: Option<InFlight>,
    /// Runs accepted and waiting behind the one in flight, in order: a frontend
    /// that adopts the session runs them (each is in the record before its run
    /// request is answered).
    #[serde(default)]
    pub queued: VecDeque<QueuedRun>,
}

/// A run waiting for its turn, as its session's record keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueuedRun {
    /// The execution.
    pub exec_id: Uuid,
    /// Its cell.
    pub cell_id: String,
    /// The code submitted with Run.
    pub code: String,
    /// When Run was pressed (unix ms).
    pub run_unix_ms: u64,
    /// The run's client answers the cell's input requests.
    #[serde(default)]
    pub allow_stdin: bool,
    /// Jupyter's `user_expressions`, evaluated after the cell.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub user_expressions: BTreeMap<String, String>,
}

/// A run in flight, as its session's record keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    /// The execution.
    pub exec_id: Uuid,
    /// Its cell.
    pub cell_id: String,
    /// When Run was pressed (unix ms).
    pub run_unix_ms: u64,
    /// The run's client answers the cell's input requests.
    #[serde(default)]
    pub allow_stdin: bool,
}

/// Why a record could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The bucket could not be reached.
    #[error("session records: {0}")]
    Bucket(String),
    /// The record is not one this frontend can read.
    #[error("the record of session {session} cannot be read: {reason}")]
    Corrupt {
        /// The session.
        session: Uuid,
        /// Why.
        reason: String,
    },
}

/// The session records bucket.
#[derive(Clone)]
pub struct Records {
    kv: kv::Store,
}

impl Records {
    /// Records in `kv`.
    pub fn new(kv: kv::Store) -> Self {
        Self { kv }
    }

    /// Write (or overwrite) a session's record.
    pub async fn put(&self, record: &SessionRecord) -> Result<(), RecordError> {
        let bytes = serde_json::to_vec(record).map_err(|e| RecordError::Bucket(e.to_string()))?;
        self.kv
            .put(record.session_id.to_string(), bytes.into())
            .await
            .map_err(|e| RecordError::Bucket(e.to_string()))?;
        Ok(())
    }

    /// Write a new session's record, trying again while the bucket does not answer
    /// for as long as a NATS cluster takes to elect its new leader (ADR 35): a put
    /// is idempotent, and a session is not created without its record.
    pub async fn put_new(&self, record: &SessionRecord) -> Result<(), RecordError> {
        let mut retry = schemas::buckets::ElectionRetry::new();
        loop {
            match self.put(record).await {
                Err(e) => match retry.next_wait() {
                    Some(wait) => {
                        tracing::info!(session = %record.session_id, error = %e,
                            "session records unavailable; trying again in {wait:?}");
                        tokio::time::sleep(wait).await;
                    }
                    None => return Err(e),
                },
                Ok(()) => return Ok(()),
            }
        }
    }

    /// A session's record, if it has one.
    pub async fn get(&self, session: Uuid) -> Result<Option<SessionRecord>, RecordError> {
        let Some(bytes) = self.kv.get(session.to_string()).await.map_err(|e| RecordError::Bucket(e.to_string()))?
        else {
            return Ok(None);
        };
        let record: SessionRecord =
            serde_json::from_slice(&bytes).map_err(|e| RecordError::Corrupt { session, reason: e.to_string() })?;
        if record.version > RECORD_VERSION || record.session_id != session {
            let reason = format!("version {} for session {}", record.version, record.session_id);
            return Err(RecordError::Corrupt { session, reason });
        }
        Ok(Some(record))
    }

    /// How many sessions `owner` holds (every record is read: sessions are created
    /// rarely, and only a frontend with a per-user limit asks).
    pub async fn count_owned_by(&self, owner: &Option<String>) -> Result<usize, RecordError> {
        use futures::TryStreamExt as _;
        let keys: Vec<String> = self
            .kv
            .keys()
            .await
            .map_err(|e| RecordError::Bucket(e.to_string()))?
            .try_collect()
            .await
            .map_err(|e| RecordError::Bucket(e.to_string()))?;
        let mut held = 0;
        for key in keys {
            let Ok(session) = Uuid::parse_str(&key) else { continue };
            match self.get(session).await {
                Ok(Some(r)) if &r.owner == owner => held += 1,
                // another user's, gone meanwhile, or unreadable here (whose it is unknown)
                Ok(_) | Err(RecordError::Corrupt { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(held)
    }

    /// Remove a session's record (the session is deleted).
    pub async fn remove(&self, session: Uuid) -> Result<(), RecordError> {
        self.kv.delete(session.to_string()).await.map_err(|e| RecordError::Bucket(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use looseleaf_test_support::NatsServer;

    use super::*;

    fn record() -> SessionRecord {
        SessionRecord {
            version: RECORD_VERSION,
            session_id: Uuid::new_v4(),
            options: schemas::messages::SessionOptions { cwd: "/tmp".into(), all_gpu: false, speculate: true },
            created_unix_ms: 1,
            revision: 0,
            last_exec: None,
            owner: None,
            in_flight: None,
            queued: Default::default(),
        }
    }

    /// A NATS that stops answering for a while (as a cluster does while it elects a
    /// bucket's leader): a plain put fails, a new session's record still lands.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_new_record_waits_through_an_election() -> anyhow::Result<()> {
        let nats = NatsServer::start()?;
        let client = async_nats::ConnectOptions::new()
            .request_timeout(Some(Duration::from_millis(500)))
            .connect(nats.url())
            .await?;
        let js = async_nats::jetstream::new(client);
        let records = Records::new(schemas::buckets::sessions(&js, "rec", 1).await?);
        nats.pause(true)?;
        let early = record();
        let failed = records.put(&early).await;
        assert!(failed.is_err(), "a put to a frozen server answered: {failed:?}");
        let waiting = record();
        let put = tokio::spawn({
            let (records, waiting) = (records.clone(), waiting.clone());
            async move { records.put_new(&waiting).await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        nats.pause(false)?;
        put.await??;
        assert_eq!(records.get(waiting.session_id).await?, Some(waiting));
        Ok(())
    }
}
