//! Usage (issue 40, ADR 66): what each session used, per UTC day, in JetStream KV
//! (`{prefix}_usage`, key `{day}.{session id}`), so that any frontend reports it
//! and a quota counts it across frontends.
//!
//! - GPU-seconds: the GPU-slot time the session's workers held, whatever held it
//!   (a cell, a prepared worker, unsavable state): what the kernel's badge counts
//!   as the session's GPU time, and what the pool paid for.
//! - CPU-seconds: the time its cells ran on the CPU (its persistent CPU worker).
//! - Cells: the runs that started, and how many of them on a GPU.
//!
//! A session's serving actor books what each run used when the run is done
//! (`session::meter`); each booking is a compare-and-set on the day's entry, which
//! keeps the last runs it counted, so a run booked twice (a frontend that adopts a
//! session replays its run) counts once. Every frontend keeps today's entries in
//! memory, followed through a KV watch, for the dashboard and the quotas.
//! `report` groups entries for `GET /v1/usage`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

mod report;
pub use report::{csv, report};

/// The version of [`DayUsage`] this frontend writes and reads.
pub const USAGE_VERSION: u32 = 1;

/// Runs a day's entry remembers as counted (a run is booked again only by a
/// frontend that adopts its session while it ends: the last few suffice).
const COUNTED_KEPT: usize = 32;

/// The longest span a usage report covers.
pub const MAX_REPORT_DAYS: u64 = 400;
const DAY_MS: u64 = 24 * 3600 * 1000;

/// What was used: the figures a day's entry sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spent {
    /// GPU-slot milliseconds held.
    pub gpu_ms: f64,
    /// Milliseconds cells ran on the CPU.
    pub cpu_ms: f64,
    /// Runs that started.
    pub cells: u64,
    /// Of those, runs on a GPU.
    pub gpu_cells: u64,
}

impl Spent {
    /// Nothing was used.
    pub fn is_empty(&self) -> bool {
        self.gpu_ms == 0.0 && self.cpu_ms == 0.0 && self.cells == 0
    }

    fn add(&mut self, other: &Spent) {
        self.gpu_ms += other.gpu_ms;
        self.cpu_ms += other.cpu_ms;
        self.cells += other.cells;
        self.gpu_cells += other.gpu_cells;
    }
}

/// Whose use a booking is.
#[derive(Clone, Debug, PartialEq)]
pub struct Account {
    /// The session.
    pub session_id: Uuid,
    /// Its owner (None: the open API's one user).
    pub owner: Option<String>,
    /// Its notebook, if its kernel named one.
    pub notebook: Option<String>,
}

/// What one session used on one UTC day (a KV value, JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DayUsage {
    /// The format's version.
    pub version: u32,
    /// The UTC day, `YYYY-MM-DD`.
    pub day: String,
    /// The session.
    pub session_id: Uuid,
    /// Its owner.
    pub owner: Option<String>,
    /// Its notebook.
    pub notebook: Option<String>,
    /// What it used that day.
    #[serde(flatten)]
    pub spent: Spent,
    /// The last runs counted (newest last).
    #[serde(default)]
    pub counted: VecDeque<Uuid>,
}

/// Why usage could not be read or booked.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// The bucket did not answer.
    #[error("the usage bucket: {0}")]
    Bucket(String),
    /// A day is not `YYYY-MM-DD`.
    #[error("{0:?} is not a day (YYYY-MM-DD)")]
    Day(String),
    /// Two days are no span a report covers.
    #[error("{0}")]
    Span(String),
}

/// The UTC day of `unix_ms`, `YYYY-MM-DD`.
pub fn day_of(unix_ms: u64) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(unix_ms);
    humantime::format_rfc3339_seconds(at).to_string()[..10].to_string()
}

/// The first millisecond of `day` (`YYYY-MM-DD`), or why it is not a day.
pub fn day_start_ms(day: &str) -> Result<u64, UsageError> {
    let bad = || UsageError::Day(day.to_string());
    if day.len() != 10 {
        return Err(bad());
    }
    let at = humantime::parse_rfc3339(&format!("{day}T00:00:00Z")).map_err(|_| bad())?;
    let ms = at.duration_since(UNIX_EPOCH).map_err(|_| bad())?.as_millis();
    u64::try_from(ms).map_err(|_| bad())
}

/// When the UTC day after `unix_ms`'s begins (a daily quota resets then).
pub fn next_day_ms(unix_ms: u64) -> u64 {
    (unix_ms / DAY_MS + 1) * DAY_MS
}

/// The days from `from` to `to`, both included, or why they are no such span.
pub fn days_between(from: &str, to: &str) -> Result<Vec<String>, UsageError> {
    let (start, end) = (day_start_ms(from)?, day_start_ms(to)?);
    if start > end {
        return Err(UsageError::Span(format!("the report's first day {from} is after its last {to}")));
    }
    if (end - start) / DAY_MS >= MAX_REPORT_DAYS {
        return Err(UsageError::Span(format!("{from} to {to} spans more than {MAX_REPORT_DAYS} days")));
    }
    Ok((start / DAY_MS..=end / DAY_MS).map(|d| day_of(d * DAY_MS)).collect())
}

fn key(day: &str, session: Uuid) -> String {
    format!("{day}.{session}")
}

/// The usage bucket, and today's entries as this frontend last heard them.
#[derive(Clone)]
pub struct Ledger {
    kv: kv::Store,
    /// Entries of the current UTC day (and the day before, until it is a day
    /// old), by key: every frontend's bookings, through a watch.
    recent: Arc<Mutex<HashMap<String, (u64, DayUsage)>>>,
    /// The runs that hold, or may take, a GPU, by execution: every frontend's,
    /// through the same watch (a quota on GPU cells at once counts them).
    running: Arc<Mutex<HashMap<Uuid, Running>>>,
}

/// A run sent while its user has a limit on GPU cells at once, until it is
/// planned on the CPU or done (a KV value, JSON, under `running.{exec_id}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Running {
    /// Its session's owner.
    pub owner: Option<String>,
    /// Its session.
    pub session_id: Uuid,
    /// When it was marked (unix ms): a mark older than [`MARK_STALE`] no longer
    /// counts, should its end never be heard.
    #[serde(default)]
    pub since_unix_ms: u64,
}

/// A running mark this old no longer counts: a GPU cell that ran a day is ended,
/// or its end was lost (a frontend that died before it could clear the mark).
pub const MARK_STALE: Duration = Duration::from_secs(24 * 3600);

/// The key prefix of running marks (no day starts so).
const RUNNING_KEY: &str = "running.";
/// How soon a usage watch that ended is opened again.
const WATCH_AGAIN: Duration = Duration::from_secs(1);

impl Ledger {
    /// The ledger in `kv`, with today's entries read and followed from now on.
    pub async fn open(kv: kv::Store) -> Result<Self, UsageError> {
        let ledger = Self { kv, recent: Default::default(), running: Default::default() };
        let bucket = |e: &dyn std::fmt::Display| UsageError::Bucket(e.to_string());
        // watch first, then read: a booking between the two is heard either way
        let watch = ledger.kv.watch_all().await.map_err(|e| bucket(&e))?;
        for (revision, usage) in ledger.entries(&[day_of(schemas::unix_ms())]).await? {
            ledger.heard(revision, usage);
        }
        ledger.read_running().await?;
        tokio::spawn(ledger.clone().follow(watch));
        Ok(ledger)
    }

    /// Keep today's entries and the running marks as every frontend writes them;
    /// a watch that ends (its connection gone for good) is opened again, and what
    /// changed meanwhile read again.
    async fn follow(self, mut watch: kv::Watch) {
        use futures::StreamExt as _;
        loop {
            while let Some(item) = watch.next().await {
                match item {
                    Ok(entry) if entry.key.starts_with(RUNNING_KEY) => self.heard_running(&entry),
                    Ok(entry) if entry.operation == kv::Operation::Put => {
                        match serde_json::from_slice::<DayUsage>(&entry.value) {
                            Ok(usage) => self.heard(entry.revision, usage),
                            Err(e) => tracing::warn!(key = %entry.key, error = %e, "an unreadable usage entry"),
                        }
                    }
                    // an operator deleted a day's entry (forgave it)
                    Ok(entry) => {
                        self.lock().remove(&entry.key);
                    }
                    // opened again rather than polled on: async-nats 0.51's ordered
                    // consumer panics when polled after its connection's state
                    // watcher is gone (as the claims' watch does, ADR 57)
                    Err(e) => {
                        tracing::debug!(error = %e, "the usage watch broke; opening it again");
                        break;
                    }
                }
            }
            tracing::debug!("the usage watch ended; opening it again");
            loop {
                tokio::time::sleep(WATCH_AGAIN).await;
                match self.kv.watch_all().await {
                    Ok(again) => {
                        watch = again;
                        break;
                    }
                    Err(e) => tracing::debug!(error = %e, "the usage watch cannot be opened yet"),
                }
            }
            match self.entries(&[day_of(schemas::unix_ms())]).await {
                Ok(entries) => {
                    for (revision, usage) in entries {
                        self.heard(revision, usage);
                    }
                }
                // the watch brings what is written from now on; what was written
                // while it was down counts once each entry is written again
                Err(e) => tracing::warn!(error = %e, "today's usage could not be read again; \
                    the dashboard and quotas may miss what was booked while the watch was down"),
            }
            self.running.lock().unwrap_or_else(|e| e.into_inner()).clear();
            if let Err(e) = self.read_running().await {
                tracing::warn!(error = %e, "the running GPU cells could not be read again")
            }
        }
    }

    fn heard(&self, revision: u64, usage: DayUsage) {
        let today = day_of(schemas::unix_ms());
        let yesterday = day_of(schemas::unix_ms().saturating_sub(DAY_MS));
        let mut recent = self.lock();
        recent.retain(|_, (_, u)| u.day == today || u.day == yesterday);
        if usage.day == today || usage.day == yesterday {
            let key = key(&usage.day, usage.session_id);
            // the watch may deliver a write after a newer one was read or booked here
            if recent.get(&key).is_none_or(|(known, _)| *known < revision) {
                recent.insert(key, (revision, usage));
            }
        }
    }

    fn heard_running(&self, entry: &kv::Entry) {
        let Some(exec_id) = entry.key.strip_prefix(RUNNING_KEY).and_then(|s| Uuid::parse_str(s).ok()) else { return };
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        match serde_json::from_slice::<Running>(&entry.value) {
            Ok(mark) if entry.operation == kv::Operation::Put => {
                running.insert(exec_id, mark);
            }
            _ => {
                running.remove(&exec_id);
            }
        }
    }

    async fn read_running(&self) -> Result<(), UsageError> {
        use futures::TryStreamExt as _;
        let bucket = |e: &dyn std::fmt::Display| UsageError::Bucket(e.to_string());
        let keys: Vec<String> =
            self.kv.keys().await.map_err(|e| bucket(&e))?.try_collect().await.map_err(|e| bucket(&e))?;
        for key in keys.into_iter().filter(|k| k.starts_with(RUNNING_KEY)) {
            if let Some(entry) = self.kv.entry(&key).await.map_err(|e| bucket(&e))? {
                self.heard_running(&entry);
            }
        }
        Ok(())
    }

    /// Mark `session`'s run `exec_id` as one that may hold a GPU (here at once,
    /// and for every frontend through the bucket).
    pub fn mark_running(&self, session: Uuid, owner: Option<String>, exec_id: Uuid) {
        let mark = Running { owner, session_id: session, since_unix_ms: schemas::unix_ms() };
        self.running.lock().unwrap_or_else(|e| e.into_inner()).insert(exec_id, mark.clone());
        let kv = self.kv.clone();
        tokio::spawn(async move {
            let Ok(bytes) = serde_json::to_vec(&mark) else { return };
            if let Err(e) = kv.put(format!("{RUNNING_KEY}{exec_id}"), bytes.into()).await {
                tracing::warn!(%session, error = %e, "a running GPU cell is not marked for other frontends");
            }
        });
    }

    /// `session`'s run `exec_id` holds no GPU any more (planned on the CPU, or done).
    pub fn unmark_running(&self, exec_id: Uuid) {
        if self.running.lock().unwrap_or_else(|e| e.into_inner()).remove(&exec_id).is_none() {
            return;
        }
        let kv = self.kv.clone();
        tokio::spawn(async move {
            let mut retry = schemas::buckets::ElectionRetry::new();
            loop {
                match kv.delete(format!("{RUNNING_KEY}{exec_id}")).await {
                    Ok(()) => return,
                    Err(e) => match retry.next_wait() {
                        Some(wait) => tokio::time::sleep(wait).await,
                        None => {
                            tracing::warn!(exec = %exec_id, error = %e, "a GPU cell's end is not marked for other frontends");
                            return;
                        }
                    },
                }
            }
        });
    }

    /// How many runs of `owner` may hold a GPU, other than `session`'s (a
    /// session runs one cell at a time).
    pub fn running_gpu_cells(&self, owner: &Option<String>, session: Uuid) -> usize {
        let fresh = schemas::unix_ms().saturating_sub(MARK_STALE.as_millis() as u64);
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.values().filter(|m| m.session_id != session && &m.owner == owner && m.since_unix_ms >= fresh).count()
    }

    /// What `owner` used today (UTC), as this frontend heard it.
    pub fn used_today(&self, owner: &Option<String>) -> Spent {
        let today = day_of(schemas::unix_ms());
        let mut used = Spent::default();
        for (_, u) in self.lock().values().filter(|(_, u)| u.day == today && &u.owner == owner) {
            used.add(&u.spent);
        }
        used
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, DayUsage)>> {
        self.recent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What each user used on `day` (today or yesterday), as this frontend heard it.
    pub fn recent_by_user(&self, day: &str) -> BTreeMap<Option<String>, Spent> {
        let mut by_user: BTreeMap<Option<String>, Spent> = BTreeMap::new();
        for (_, u) in self.lock().values().filter(|(_, u)| u.day == day) {
            by_user.entry(u.owner.clone()).or_default().add(&u.spent);
        }
        by_user
    }

    /// Book what `account`'s session used on `day`, in one write: each item is
    /// what a run used (None: a slot held outside any run), a run counted once
    /// however often it is booked. Returns what was added. Tried again while the
    /// bucket elects a leader, and against a concurrent booking of the same day
    /// and session.
    pub async fn book(
        &self,
        account: &Account,
        day: &str,
        items: &[(Option<Uuid>, Spent)],
    ) -> Result<Spent, UsageError> {
        let bucket = |e: &dyn std::fmt::Display| UsageError::Bucket(e.to_string());
        let key = key(day, account.session_id);
        let mut retry = schemas::buckets::ElectionRetry::new();
        loop {
            let attempt = async {
                let entry = self.kv.entry(key.clone()).await.map_err(|e| bucket(&e))?;
                let (mut usage, revision) = match entry.filter(|e| e.operation == kv::Operation::Put) {
                    Some(e) => {
                        (serde_json::from_slice::<DayUsage>(&e.value).map_err(|e| bucket(&e))?, Some(e.revision))
                    }
                    None => (
                        DayUsage {
                            version: USAGE_VERSION,
                            day: day.to_string(),
                            session_id: account.session_id,
                            owner: account.owner.clone(),
                            notebook: account.notebook.clone(),
                            spent: Spent::default(),
                            counted: VecDeque::new(),
                        },
                        None,
                    ),
                };
                let mut added = Spent::default();
                for (run, spent) in items {
                    if let Some(run) = run {
                        if usage.counted.contains(run) {
                            continue; // booked already
                        }
                        usage.counted.push_back(*run);
                    }
                    added.add(spent);
                }
                while usage.counted.len() > COUNTED_KEPT {
                    usage.counted.pop_front();
                }
                if added.is_empty() {
                    return Ok(Some(added));
                }
                usage.spent.add(&added);
                if usage.notebook.is_none() {
                    usage.notebook = account.notebook.clone();
                }
                let bytes = serde_json::to_vec(&usage).map_err(|e| bucket(&e))?;
                let written = match revision {
                    Some(revision) => self
                        .kv
                        .update(&key, bytes.into(), revision)
                        .await
                        .map_err(|e| (e.kind() == kv::UpdateErrorKind::WrongLastRevision, e.to_string())),
                    None => self
                        .kv
                        .create(&key, bytes.into())
                        .await
                        .map_err(|e| (e.kind() == kv::CreateErrorKind::AlreadyExists, e.to_string())),
                };
                match written {
                    Ok(revision) => {
                        self.heard(revision, usage);
                        Ok(Some(added))
                    }
                    Err((true, _)) => Ok(None), // another booking landed first: read it again
                    Err((false, e)) => Err(UsageError::Bucket(e)),
                }
            };
            match attempt.await {
                Ok(Some(booked)) => return Ok(booked),
                Ok(None) => continue,
                Err(e) => match retry.next_wait() {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => return Err(e),
                },
            }
        }
    }

    /// Every session's entries of `days` (one listing of the bucket's keys;
    /// unreadable ones logged and left out).
    pub async fn days(&self, days: &[String]) -> Result<Vec<DayUsage>, UsageError> {
        Ok(self.entries(days).await?.into_iter().map(|(_, u)| u).collect())
    }

    async fn entries(&self, days: &[String]) -> Result<Vec<(u64, DayUsage)>, UsageError> {
        use futures::TryStreamExt as _;
        let bucket = |e: &dyn std::fmt::Display| UsageError::Bucket(e.to_string());
        let wanted: std::collections::HashSet<&str> = days.iter().map(String::as_str).collect();
        let keys: Vec<String> =
            self.kv.keys().await.map_err(|e| bucket(&e))?.try_collect().await.map_err(|e| bucket(&e))?;
        let mut entries = Vec::new();
        for key in keys.into_iter().filter(|k| k.split_once('.').is_some_and(|(d, _)| wanted.contains(d))) {
            let Some(entry) = self.kv.entry(&key).await.map_err(|e| bucket(&e))? else { continue };
            if entry.operation != kv::Operation::Put {
                continue;
            }
            match serde_json::from_slice::<DayUsage>(&entry.value) {
                Ok(u) => entries.push((entry.revision, u)),
                Err(e) => tracing::warn!(%key, error = %e, "an unreadable usage entry"),
            }
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_are_utc_and_spans_are_checked() {
        assert_eq!(day_of(0), "1970-01-01");
        assert_eq!(day_of(DAY_MS - 1), "1970-01-01");
        assert_eq!(day_of(DAY_MS), "1970-01-02");
        let start = day_start_ms("2026-12-06").unwrap();
        assert_eq!(day_of(start), "2026-12-06");
        assert_eq!(next_day_ms(start + 5), start + DAY_MS);
        assert_eq!(
            days_between("2026-11-29", "2026-12-02").unwrap(),
            ["2026-11-29", "2026-11-30", "2026-12-01", "2026-12-02"]
        );
        assert!(days_between("2026-12-02", "2026-12-01").unwrap_err().to_string().contains("after"));
        assert!(days_between("2024-01-01", "2026-01-01").unwrap_err().to_string().contains("400 days"));
        for bad in ["2026-13-01", "yesterday", "2026-1-1", "2026-12-06T00"] {
            assert!(day_start_ms(bad).unwrap_err().to_string().contains("YYYY-MM-DD"), "{bad}");
        }
    }
}
