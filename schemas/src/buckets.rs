//! JetStream key-value buckets and streams, configured in one place.

use std::time::Duration;

use async_nats::jetstream::context::{CreateKeyValueError, CreateStreamError, KeyValueError};
use async_nats::jetstream::{self, kv, stream};

/// A bucket or stream that could not be opened or created.
#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    /// Neither getting nor creating the bucket worked.
    #[error("bucket {bucket}: create failed ({create}), get failed ({source})")]
    Bucket {
        /// The bucket.
        bucket: String,
        /// Why creating it failed.
        create: CreateKeyValueError,
        /// Why getting it (after the create failed) failed.
        source: KeyValueError,
    },
    /// The events stream could not be got or created.
    #[error("stream {stream}: {source}")]
    Stream {
        /// The stream.
        stream: String,
        /// What JetStream said.
        source: CreateStreamError,
    },
    /// A stream could not be read back.
    #[error("replaying {subject} from stream {stream}: {reason}")]
    Replay {
        /// The stream.
        stream: String,
        /// The subject asked for.
        subject: String,
        /// What went wrong.
        reason: String,
    },
}

/// How long a bucket operation that got no answer is tried again: enough for a NATS
/// cluster to elect a bucket's new leader after losing a node (ADR 35).
pub const LEADER_ELECTION: Duration = Duration::from_secs(20);

/// The waits between tries of a bucket operation while its leader is elected:
/// 250 ms doubling to 2 s, for up to [`LEADER_ELECTION`] in all.
pub struct ElectionRetry {
    deadline: tokio::time::Instant,
    backoff: Duration,
}

impl ElectionRetry {
    /// A schedule starting now.
    pub fn new() -> Self {
        Self { deadline: tokio::time::Instant::now() + LEADER_ELECTION, backoff: Duration::from_millis(250) }
    }

    /// How long to wait before the next try, or None once the election has taken
    /// too long (the caller reports the failure).
    pub fn next_wait(&mut self) -> Option<Duration> {
        let wait = self.backoff;
        if tokio::time::Instant::now() + wait > self.deadline {
            return None;
        }
        self.backoff = (wait * 2).min(Duration::from_secs(2));
        Some(wait)
    }
}

impl Default for ElectionRetry {
    fn default() -> Self {
        Self::new()
    }
}

/// Open a bucket or stream, trying again while JetStream has no leader to answer
/// (a cluster just started, or electing after losing a node: requests time out or
/// JetStream is "unavailable") for up to [`LEADER_ELECTION`]. A service started
/// beside its NATS cluster would otherwise exit at once and wait for its restart.
async fn through_election<T, E, F, Fut>(open: F) -> Result<T, E>
where
    E: std::fmt::Display,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut retry = ElectionRetry::new();
    loop {
        let error = match open().await {
            Ok(opened) => return Ok(opened),
            Err(e) => e,
        };
        let text = error.to_string().to_ascii_lowercase();
        let electing = ["timed out", "unavailable", "no responders"].iter().any(|s| text.contains(s));
        match retry.next_wait() {
            Some(wait) if electing => {
                tracing::warn!(error = %error, "JetStream is not answering yet; trying again in {wait:?}");
                tokio::time::sleep(wait).await;
            }
            _ => return Err(error),
        }
    }
}

/// How long a claim lives without renewal; a dead host's claims expire after this.
pub const CLAIM_TTL: Duration = Duration::from_secs(30);

/// Bucket of claims: key `run-{exec}` or `cpu-{session}`, value = host id.
/// Hosts claim with an atomic create; exactly one create succeeds.
pub fn claims_bucket(prefix: &str) -> String {
    format!("{}_claims", sanitize(prefix))
}

/// Bucket of planner state: key = session id, value = the session's definition
/// history, so a restarted or second planner loses nothing.
pub fn planner_bucket(prefix: &str) -> String {
    format!("{}_planner", sanitize(prefix))
}

/// Key of the planner lease in the planner bucket (session states there are keyed
/// by uuid): its value names the one planner that plans (ADR 60).
pub const PLANNER_LEASE_KEY: &str = "planner-lease";

/// Object store bucket of message bodies too large for one message (ADR 30).
pub fn bodies_bucket(prefix: &str) -> String {
    format!("{}_bodies", sanitize(prefix))
}

/// The holder a frontend writes into a run's claim when the run is interrupted
/// before any host claimed it: no host can claim (and start) it afterwards.
pub const INTERRUPTED_HOLDER: &str = "!interrupted";

/// Key of a run claim.
pub fn run_claim_key(exec: uuid::Uuid) -> String {
    format!("run-{exec}")
}

/// Key of the claim to prepare a worker for one revision of a cell's edit-derived
/// recipe (exactly one host prepares it).
pub fn prepare_claim_key(session: uuid::Uuid, cell_id: &str, revision: u64) -> String {
    // KV keys allow [-/_=.a-zA-Z0-9]; cell ids are arbitrary text
    let cell: String =
        cell_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    format!("prep-{session}-{cell}-{:x}-{revision}", xxhash_rust::xxh3::xxh3_64(cell_id.as_bytes()))
}

/// Key of a session's persistent CPU worker claim.
pub fn cpu_claim_key(session: uuid::Uuid) -> String {
    format!("cpu-{session}")
}

fn sanitize(prefix: &str) -> String {
    prefix.replace(['.', '*', '>', ' '], "_")
}

/// Get or create the claims bucket (with `replicas` copies on a cluster; an
/// existing bucket is used as it is).
pub async fn claims(js: &jetstream::Context, prefix: &str, replicas: usize) -> Result<kv::Store, BucketError> {
    ensure_bucket(
        js,
        kv::Config {
            bucket: claims_bucket(prefix),
            history: 1,
            max_age: CLAIM_TTL,
            num_replicas: replicas,
            ..Default::default()
        },
    )
    .await
}

/// Bucket of session records: key = session id, value = the frontend's record of
/// the session (JSON, see the frontend's `records`), so that any frontend, or one
/// restarted, serves every session.
pub fn sessions_bucket(prefix: &str) -> String {
    format!("{}_sessions", sanitize(prefix))
}

/// Get or create the session records bucket.
pub async fn sessions(js: &jetstream::Context, prefix: &str, replicas: usize) -> Result<kv::Store, BucketError> {
    let config =
        kv::Config { bucket: sessions_bucket(prefix), history: 1, num_replicas: replicas, ..Default::default() };
    ensure_bucket(js, config).await
}

/// Bucket of usage (issue 40): key = `{day}.{session id}` (the UTC day as
/// `YYYY-MM-DD`), value = what the session used that day (JSON, see the frontend's
/// `usage`). Kept [`USAGE_KEPT`] after its last write.
pub fn usage_bucket(prefix: &str) -> String {
    format!("{}_usage", sanitize(prefix))
}

/// How long a day's usage of a session is kept: 400 days, a year's reports and
/// more.
pub const USAGE_KEPT: Duration = Duration::from_secs(400 * 24 * 3600);

/// Get or create the usage bucket.
pub async fn usage(js: &jetstream::Context, prefix: &str, replicas: usize) -> Result<kv::Store, BucketError> {
    let config = kv::Config {
        bucket: usage_bucket(prefix),
        history: 1,
        max_age: USAGE_KEPT,
        num_replicas: replicas,
        ..Default::default()
    };
    ensure_bucket(js, config).await
}

/// Get or create the planner bucket.
pub async fn planner(js: &jetstream::Context, prefix: &str, replicas: usize) -> Result<kv::Store, BucketError> {
    let config =
        kv::Config { bucket: planner_bucket(prefix), history: 1, num_replicas: replicas, ..Default::default() };
    ensure_bucket(js, config).await
}

async fn ensure_bucket(js: &jetstream::Context, config: kv::Config) -> Result<kv::Store, BucketError> {
    through_election(|| ensure_bucket_once(js, config.clone())).await
}

async fn ensure_bucket_once(js: &jetstream::Context, config: kv::Config) -> Result<kv::Store, BucketError> {
    let name = config.bucket.clone();
    match js.get_key_value(&name).await {
        Ok(store) => Ok(store),
        Err(_) => match js.create_key_value(config).await {
            Ok(store) => Ok(store),
            // another service created it between our get and create
            Err(create_err) => js.get_key_value(&name).await.map_err(|source| BucketError::Bucket {
                bucket: name,
                create: create_err,
                source,
            }),
        },
    }
}

/// Outputs the outputs stream keeps per execution, and in all (oldest go first).
pub const OUTPUTS_PER_EXEC: i64 = 10_000;
/// Bytes the outputs stream keeps in all (oldest go first).
pub const OUTPUTS_BYTES: i64 = 1 << 30;

/// Get or create the stream that keeps cells' outputs for a day, bounded per
/// execution and in bytes: a frontend that adopts a session with a cell in flight
/// replays what that cell printed before it took over.
pub async fn outputs_stream(
    js: &jetstream::Context,
    subjects: &crate::Subjects,
    replicas: usize,
) -> Result<stream::Stream, BucketError> {
    through_election(|| {
        js.get_or_create_stream(stream::Config {
            name: subjects.outputs_stream(),
            subjects: vec![subjects.all_outputs()],
            max_age: Duration::from_secs(24 * 3600),
            max_messages_per_subject: OUTPUTS_PER_EXEC,
            max_bytes: OUTPUTS_BYTES,
            num_replicas: replicas,
            ..Default::default()
        })
    })
    .await
    .map_err(|source| BucketError::Stream { stream: subjects.outputs_stream(), source })
}

/// Every message `stream` holds on `subject` published since `since_unix_ms`, in
/// order (an ordered consumer, read until nothing is pending).
pub async fn replay(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
    since_unix_ms: u64,
) -> Result<Vec<jetstream::Message>, BucketError> {
    use futures::StreamExt as _;
    let fail = |reason: String| BucketError::Replay { stream: stream.into(), subject: subject.into(), reason };
    let start_time =
        async_nats::datetime::from_nanos(i128::from(since_unix_ms) * 1_000_000).map_err(|e| fail(e.to_string()))?;
    let handle = js.get_stream(stream).await.map_err(|e| fail(e.to_string()))?;
    let mut consumer = handle
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: subject.into(),
            deliver_policy: jetstream::consumer::DeliverPolicy::ByStartTime { start_time },
            ..Default::default()
        })
        .await
        .map_err(|e| fail(e.to_string()))?;
    let pending = consumer.info().await.map_err(|e| fail(e.to_string()))?.num_pending;
    let mut out = Vec::new();
    if pending == 0 {
        return Ok(out);
    }
    let mut messages = consumer.messages().await.map_err(|e| fail(e.to_string()))?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(5), messages.next()).await;
        let msg = match next {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(fail(e.to_string())),
            Ok(None) => return Ok(out),
            Err(_) => return Err(fail(format!("stalled after {} messages", out.len()))),
        };
        let left = msg.info().map(|i| i.pending).unwrap_or(0);
        out.push(msg);
        if left == 0 {
            return Ok(out);
        }
    }
}

/// Get or create the stream that keeps session events for replay.
pub async fn events_stream(
    js: &jetstream::Context,
    subjects: &crate::Subjects,
    replicas: usize,
) -> Result<stream::Stream, BucketError> {
    through_election(|| {
        js.get_or_create_stream(stream::Config {
            name: subjects.events_stream(),
            subjects: vec![subjects.all_events()],
            max_age: Duration::from_secs(24 * 3600),
            num_replicas: replicas,
            ..Default::default()
        })
    })
    .await
    .map_err(|source| BucketError::Stream { stream: subjects.events_stream(), source })
}
