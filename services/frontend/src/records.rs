//! Session records in JetStream KV (`{prefix}_sessions`, key = session id): what a
//! frontend needs to serve a session it did not create, or created before it
//! restarted. The record is JSON (a frontend of another version reads what it
//! knows and ignores the rest) and carries its own version.
//!
//! Written when a session is created, when a run is queued or sent, and when an
//! execution completes (the revision it left); removed when the session is deleted. A frontend asked about
//! a session it does not hold looks the record up and adopts the session.
//!
//! The record is one KV value (under the bus's message limit), so the code of the
//! queued runs it keeps inline is bounded ([`RECORD_INLINE_BYTES`]); a queued run
//! past that keeps its code and user expressions beside the record, as a body in
//! the bus's bodies bucket, and the record names the body (ADR 53).

use std::collections::{BTreeMap, VecDeque};

use async_nats::jetstream::kv;
use schemas::bodies::Bodies;
use schemas::messages::SessionOptions;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The version of [`SessionRecord`] written when nothing in it needs a newer one
/// (every frontend reads it).
pub const RECORD_VERSION: u32 = 1;

/// The version of a record with a queued run whose code is kept aside
/// ([`QueuedRun::aside`]): a frontend that knows only version 1 would take that
/// run's code for empty, so it refuses the record instead. The newest version
/// this frontend reads.
pub const ASIDE_RECORD_VERSION: u32 = 2;

/// The most code and user expressions the queued runs of a session keep in its
/// record (as JSON); a run queued past that keeps them aside. With
/// `--max-queued-runs` (1,000 by default) entries of a few hundred bytes each, the
/// record stays under the bus's 512 KiB messages.
pub const RECORD_INLINE_BYTES: usize = 128 * 1024;

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
    /// The notebook the session runs (what its kernel names it by: Jupyter's
    /// session path), so that a new kernel on the same notebook finds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notebook: Option<String>,
    /// When it was detached (unix ms): no client follows it and no frontend serves
    /// it; its state stays for a new kernel to resume, until the retention ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detached_unix_ms: Option<u64>,
}

/// A run waiting for its turn, as its session's record keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueuedRun {
    /// The execution.
    pub exec_id: Uuid,
    /// Its cell.
    pub cell_id: String,
    /// The code submitted with Run (written empty when it is kept aside).
    pub code: String,
    /// When Run was pressed (unix ms).
    pub run_unix_ms: u64,
    /// The run's client answers the cell's input requests.
    #[serde(default)]
    pub allow_stdin: bool,
    /// Jupyter's `user_expressions`, evaluated after the cell (written empty when
    /// they are kept aside).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub user_expressions: BTreeMap<String, String>,
    /// Where the code and user expressions are kept when the record has no room
    /// for them: the `ll-body` header (key, size, hash) of a body in the bodies
    /// bucket holding them as JSON ([`Aside`]). Read back by a frontend that adopts
    /// the session; deleted once the run is sent or taken out of the queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aside: Option<String>,
}

impl QueuedRun {
    /// The run as its record keeps it: without the code and user expressions it
    /// keeps aside.
    pub fn to_write(&self) -> QueuedRun {
        let (code, user_expressions) = match self.aside {
            Some(_) => (String::new(), BTreeMap::new()),
            None => (self.code.clone(), self.user_expressions.clone()),
        };
        QueuedRun {
            exec_id: self.exec_id,
            cell_id: self.cell_id.clone(),
            code,
            run_unix_ms: self.run_unix_ms,
            allow_stdin: self.allow_stdin,
            user_expressions,
            aside: self.aside.clone(),
        }
    }

    /// Bytes its code and user expressions take in the record (JSON-escaped; the
    /// reference alone when they are kept aside).
    pub fn recorded_bytes(&self) -> usize {
        match &self.aside {
            Some(header) => header.len(),
            None => inline_bytes(&self.code, &self.user_expressions),
        }
    }

    /// Whether only the record's reference to its code is here: the run was
    /// adopted from a record that keeps its code aside, and the code must be read
    /// back before the run is sent (code kept aside is never empty: short code
    /// fits the record).
    pub fn code_elsewhere(&self) -> bool {
        self.aside.is_some() && self.code.is_empty() && self.user_expressions.is_empty()
    }
}

/// Bytes `code` and `user_expressions` take in a record, JSON-escaped.
pub fn inline_bytes(code: &str, user_expressions: &BTreeMap<String, String>) -> usize {
    let code = serde_json::to_string(code).map(|j| j.len()).unwrap_or(usize::MAX);
    let asked = serde_json::to_string(user_expressions).map(|j| j.len()).unwrap_or(usize::MAX);
    code.saturating_add(asked)
}

/// A queued run's code and user expressions, kept beside its session's record
/// (JSON in a body of the bodies bucket).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Aside {
    /// The code submitted with Run.
    pub code: String,
    /// Jupyter's `user_expressions`.
    #[serde(default)]
    pub user_expressions: BTreeMap<String, String>,
}

/// [`Aside`], borrowed, to write.
#[derive(Serialize)]
struct AsideRef<'a> {
    code: &'a str,
    user_expressions: &'a BTreeMap<String, String>,
}

/// Keep a queued run's code and user expressions aside, in `bodies`; returns what
/// its record names them by ([`QueuedRun::aside`]).
pub async fn put_aside(
    bodies: &Bodies,
    code: &str,
    user_expressions: &BTreeMap<String, String>,
) -> Result<String, RecordError> {
    let json =
        serde_json::to_vec(&AsideRef { code, user_expressions }).map_err(|e| RecordError::Aside(e.to_string()))?;
    let body = bodies.put(&json).await.map_err(|e| RecordError::Aside(e.to_string()))?;
    Ok(body.header())
}

/// Read back what [`put_aside`] kept (checked against the size and hash `header` names).
pub async fn read_aside(bodies: &Bodies, header: &str) -> Result<Aside, RecordError> {
    let json = bodies.get(header).await.map_err(|e| RecordError::Aside(e.to_string()))?;
    serde_json::from_slice(&json).map_err(|e| RecordError::Aside(format!("not a queued run's code: {e}")))
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
    /// A queued run's code kept beside the record could not be stored or read back.
    #[error("a queued cell's code kept beside the session's record: {0}")]
    Aside(String),
}

impl SessionRecord {
    /// The record of a new session of `owner`'s, created now, whose state is at
    /// `revision` (0: nothing saved yet).
    pub fn new(session_id: Uuid, options: SessionOptions, owner: Option<String>, notebook: Option<String>) -> Self {
        SessionRecord {
            version: RECORD_VERSION,
            session_id,
            options,
            created_unix_ms: schemas::unix_ms(),
            revision: 0,
            last_exec: None,
            owner,
            in_flight: None,
            queued: VecDeque::new(),
            notebook,
            detached_unix_ms: None,
        }
    }

    /// The record as it is written: queued runs without the code they keep aside,
    /// and the oldest version that reads it right.
    pub fn to_write(&self) -> SessionRecord {
        let queued: VecDeque<QueuedRun> = self.queued.iter().map(QueuedRun::to_write).collect();
        let aside = queued.iter().any(|q| q.aside.is_some());
        SessionRecord {
            version: if aside { ASIDE_RECORD_VERSION } else { RECORD_VERSION },
            session_id: self.session_id,
            options: self.options.clone(),
            created_unix_ms: self.created_unix_ms,
            revision: self.revision,
            last_exec: self.last_exec,
            owner: self.owner.clone(),
            in_flight: self.in_flight.clone(),
            queued,
            notebook: self.notebook.clone(),
            detached_unix_ms: self.detached_unix_ms,
        }
    }
}

/// What is listed of a detached session the frontend discarded: for its owner
/// (`GET /v1/discards`), and for the next kernel on its notebook.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Discarded {
    /// Whose it was.
    pub owner: Option<String>,
    /// What its owner is told.
    #[serde(flatten)]
    pub listed: crate::api::SessionDiscarded,
}

/// The key prefix of discards in the records bucket.
const DISCARD_KEY: &str = "discarded.";

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

    /// Write (or overwrite) a session's record (as [`SessionRecord::to_write`] says).
    pub async fn put(&self, record: &SessionRecord) -> Result<(), RecordError> {
        let bytes = serde_json::to_vec(&record.to_write()).map_err(|e| RecordError::Bucket(e.to_string()))?;
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
        if record.version > ASIDE_RECORD_VERSION || record.session_id != session {
            let reason = format!("version {} for session {}", record.version, record.session_id);
            return Err(RecordError::Corrupt { session, reason });
        }
        Ok(Some(record))
    }

    /// How many sessions `owner` holds (every record is read: sessions are created
    /// rarely, and only a frontend with a per-user limit asks).
    pub async fn count_owned_by(&self, owner: &Option<String>) -> Result<usize, RecordError> {
        Ok(self.all().await?.iter().filter(|r| &r.owner == owner).count())
    }

    /// Every record this frontend can read (one read each: listing sessions and
    /// the retention sweep are rare); unreadable ones are left out.
    pub async fn all(&self) -> Result<Vec<SessionRecord>, RecordError> {
        use futures::TryStreamExt as _;
        let keys: Vec<String> = self
            .kv
            .keys()
            .await
            .map_err(|e| RecordError::Bucket(e.to_string()))?
            .try_collect()
            .await
            .map_err(|e| RecordError::Bucket(e.to_string()))?;
        let mut records = Vec::new();
        for key in keys {
            let Ok(session) = Uuid::parse_str(&key) else { continue };
            match self.get(session).await {
                Ok(Some(r)) => records.push(r),
                // gone meanwhile, or unreadable here (whose it is unknown)
                Ok(None) | Err(RecordError::Corrupt { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(records)
    }

    /// Attach a detached session: its record, no longer marked detached, and when
    /// it was detached, if this call attached it; None when it is not detached
    /// (any more) or another frontend or kernel attached it first (the write is
    /// checked against the revision read: one of two at once wins).
    pub async fn attach(&self, session: Uuid) -> Result<Option<(SessionRecord, u64)>, RecordError> {
        let bucket = |e: &dyn std::fmt::Display| RecordError::Bucket(e.to_string());
        let Some(entry) = self.kv.entry(session.to_string()).await.map_err(|e| bucket(&e))? else {
            return Ok(None);
        };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let mut record: SessionRecord = serde_json::from_slice(&entry.value)
            .map_err(|e| RecordError::Corrupt { session, reason: e.to_string() })?;
        let Some(detached) = record.detached_unix_ms.take() else { return Ok(None) };
        let bytes = serde_json::to_vec(&record.to_write()).map_err(|e| bucket(&e))?;
        match self.kv.update(session.to_string(), bytes.into(), entry.revision).await {
            Ok(_) => Ok(Some((record, detached))),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(bucket(&e)),
        }
    }

    /// Mark detached every session whose record says attached, as of now: for
    /// the only frontend of these records at its start, whose sessions nothing
    /// serves any more (the user's local cluster, stopped with sessions open).
    /// Each write is checked against the revision read. Returns the sessions
    /// marked.
    pub async fn detach_orphans(&self) -> Result<Vec<Uuid>, RecordError> {
        let bucket = |e: &dyn std::fmt::Display| RecordError::Bucket(e.to_string());
        let mut marked = Vec::new();
        for record in self.all().await? {
            let session = record.session_id;
            if record.detached_unix_ms.is_some() {
                continue;
            }
            let Some(entry) = self.kv.entry(session.to_string()).await.map_err(|e| bucket(&e))? else { continue };
            if entry.operation != kv::Operation::Put {
                continue;
            }
            let mut record: SessionRecord = serde_json::from_slice(&entry.value)
                .map_err(|e| RecordError::Corrupt { session, reason: e.to_string() })?;
            record.detached_unix_ms = Some(schemas::unix_ms());
            let bytes = serde_json::to_vec(&record.to_write()).map_err(|e| bucket(&e))?;
            match self.kv.update(session.to_string(), bytes.into(), entry.revision).await {
                Ok(_) => marked.push(session),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {}
                Err(e) => return Err(bucket(&e)),
            }
        }
        Ok(marked)
    }

    /// Keep what is listed of a detached session discarded (its own record is
    /// gone): under `discarded.{id}` in the same bucket, which [`Records::all`]
    /// leaves out.
    pub async fn put_discard(&self, discard: &Discarded) -> Result<(), RecordError> {
        let bytes = serde_json::to_vec(discard).map_err(|e| RecordError::Bucket(e.to_string()))?;
        let key = format!("{DISCARD_KEY}{}", discard.listed.session_id);
        self.kv.put(key, bytes.into()).await.map_err(|e| RecordError::Bucket(e.to_string()))?;
        Ok(())
    }

    /// Every discard listed (unreadable ones left out).
    pub async fn discards(&self) -> Result<Vec<Discarded>, RecordError> {
        use futures::TryStreamExt as _;
        let bucket = |e: &dyn std::fmt::Display| RecordError::Bucket(e.to_string());
        let keys: Vec<String> =
            self.kv.keys().await.map_err(|e| bucket(&e))?.try_collect().await.map_err(|e| bucket(&e))?;
        let mut discards = Vec::new();
        for key in keys.into_iter().filter(|k| k.starts_with(DISCARD_KEY)) {
            if let Some(bytes) = self.kv.get(&key).await.map_err(|e| bucket(&e))? {
                match serde_json::from_slice::<Discarded>(&bytes) {
                    Ok(d) => discards.push(d),
                    Err(e) => tracing::warn!(%key, error = %e, "an unreadable discard listing"),
                }
            }
        }
        Ok(discards)
    }

    /// Stop listing the discards older than `before` (unix ms).
    pub async fn forget_discards(&self, before: u64) -> Result<usize, RecordError> {
        let mut forgotten = 0;
        for d in self.discards().await? {
            if d.listed.discarded_unix_ms < before {
                let key = format!("{DISCARD_KEY}{}", d.listed.session_id);
                self.kv.purge(key).await.map_err(|e| RecordError::Bucket(e.to_string()))?;
                forgotten += 1;
            }
        }
        Ok(forgotten)
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
            notebook: None,
            detached_unix_ms: None,
        }
    }

    fn queued(code: &str, aside: Option<&str>) -> QueuedRun {
        QueuedRun {
            exec_id: Uuid::now_v7(),
            cell_id: "c".into(),
            code: code.into(),
            run_unix_ms: 2,
            allow_stdin: false,
            user_expressions: [("x".to_string(), "1".to_string())].into(),
            aside: aside.map(str::to_string),
        }
    }

    /// A record of before queued code could be kept aside reads as one whose queued
    /// runs keep their code inline; one with code aside is written without it, as a
    /// version a frontend that knows only version 1 refuses (it would run empty code).
    #[test]
    fn records_with_code_aside_are_a_new_version_and_old_ones_still_read() {
        let old = serde_json::json!({
            "version": 1, "session_id": Uuid::now_v7(),
            "options": { "cwd": "/tmp", "all_gpu": false, "speculate": true },
            "created_unix_ms": 1, "revision": 0, "last_exec": null,
            "queued": [{ "exec_id": Uuid::now_v7(), "cell_id": "c", "code": "x = 1", "run_unix_ms": 2 }],
        });
        let read: SessionRecord = serde_json::from_value(old).unwrap();
        assert_eq!(read.queued[0].aside, None);
        assert_eq!(read.queued[0].code, "x = 1");
        assert!(!read.queued[0].code_elsewhere());

        let mut r = record();
        r.queued.push_back(queued("x = 1", None));
        let written = r.to_write();
        assert_eq!(written, r, "nothing aside: written as it is, version 1");
        let json = serde_json::to_string(&written).unwrap();
        assert!(!json.contains("aside"), "{json}");

        let big = "y".repeat(1 << 20);
        r.queued.push_back(queued(&big, Some("k 3 0")));
        let written = r.to_write();
        assert_eq!(written.version, ASIDE_RECORD_VERSION);
        assert_eq!(written.queued[0], r.queued[0]);
        let aside = &written.queued[1];
        assert!(aside.code.is_empty() && aside.user_expressions.is_empty(), "{aside:?}");
        assert_eq!(aside.aside.as_deref(), Some("k 3 0"));
        assert!(aside.code_elsewhere(), "adopted from this record, its code is read back");
        assert!(!r.queued[1].code_elsewhere(), "accepted here, its code is in memory");
        assert!(serde_json::to_vec(&written).unwrap().len() < 1024);
        assert_eq!(r.queued[1].recorded_bytes(), "k 3 0".len());
    }

    /// Code kept aside reads back whole, checked; once deleted it is gone.
    #[tokio::test(flavor = "multi_thread")]
    async fn code_kept_aside_reads_back() -> anyhow::Result<()> {
        let nats = NatsServer::start()?;
        let bodies = Bodies::new(async_nats::connect(nats.url()).await?, "rec-aside", 1);
        let code = format!("x = '{}'\nprint(len(x))", "é\"\n".repeat(500_000));
        let asked: BTreeMap<String, String> = [("n".to_string(), "len(x)".to_string())].into();
        let header = put_aside(&bodies, &code, &asked).await?;
        assert!(header.len() < 100, "{header}");
        let back = read_aside(&bodies, &header).await?;
        assert_eq!(back, Aside { code, user_expressions: asked });
        bodies.delete(&header).await;
        let gone = read_aside(&bodies, &header).await;
        assert!(matches!(gone, Err(RecordError::Aside(_))), "{gone:?}");
        Ok(())
    }

    /// A detached session is attached once: of two attaching at once one gets the
    /// record (unmarked), the other nothing; an attached one is not attached again.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_detached_session_is_attached_once() -> anyhow::Result<()> {
        let nats = NatsServer::start()?;
        let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await?);
        let records = Records::new(schemas::buckets::sessions(&js, "rec-attach", 1).await?);
        let mut detached = record();
        detached.notebook = Some("a.ipynb".into());
        detached.detached_unix_ms = Some(5);
        records.put(&detached).await?;
        let sid = detached.session_id;
        let (a, b) = tokio::join!(records.attach(sid), records.attach(sid));
        let won: Vec<(SessionRecord, u64)> = [a?, b?].into_iter().flatten().collect();
        assert_eq!(won.len(), 1, "{won:?}");
        assert_eq!((won[0].0.detached_unix_ms, won[0].1), (None, 5));
        assert_eq!(won[0].0.notebook.as_deref(), Some("a.ipynb"));
        assert_eq!(records.get(sid).await?.and_then(|r| r.detached_unix_ms), None);
        assert_eq!(records.attach(sid).await?, None, "attached already");
        assert_eq!(records.attach(Uuid::now_v7()).await?, None, "no such session");
        Ok(())
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
