//! Garbage collection: old manifest revisions, then chunks nothing kept references.
//!
//! Safe against a save in flight: a save uploads its chunks before it commits, so
//! chunks younger than the grace period are never collected; and the newest
//! `keep_revisions` of every session are kept, so a host that read the previous
//! revision a moment ago can still fetch its chunks.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::ObjectStore;
use schemas::checkpoint;
use schemas::messages::GcDoneV1;

use crate::manifests::{ManifestError, Manifests};
use crate::signing::Opened;

/// When the store collects by itself (every replica does; a collection is safe to
/// run twice at once: deleting what is gone is fine).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// How often.
    pub every: Duration,
    /// Revisions kept per session.
    pub keep_revisions: u64,
    /// Chunks younger than this are kept (a save uploads before it commits).
    pub grace: Duration,
}

impl Default for Schedule {
    /// Hourly, keeping each session's newest 20 revisions (how far back undo and
    /// checkout reach) and chunks younger than an hour.
    fn default() -> Self {
        Self { every: Duration::from_secs(3600), keep_revisions: 20, grace: Duration::from_secs(3600) }
    }
}

/// Collect garbage in the store behind `manifests`.
pub async fn collect(manifests: &Manifests, keep_revisions: u64, grace: Duration) -> Result<GcDoneV1, ManifestError> {
    let objects = manifests.objects();
    let keep = keep_revisions.max(1) as usize;
    let mut done = GcDoneV1::default();
    let mut referenced: BTreeSet<String> = BTreeSet::new();

    let sessions = objects.list_with_delimiter(Some(&Path::from("sessions"))).await?;
    for dir in sessions.common_prefixes {
        let manifests_dir = dir.child("manifests");
        let mut keys: Vec<(u64, Path)> = objects
            .list(Some(&manifests_dir))
            .try_filter_map(
                |m| async move { Ok(checkpoint::revision_of_key(m.location.as_ref()).map(|r| (r, m.location))) },
            )
            .try_collect()
            .await?;
        keys.sort_by_key(|k| std::cmp::Reverse(k.0));
        let mut kept = 0;
        for (revision, key) in &keys {
            if kept < keep {
                let bytes = objects.get(key).await?.bytes().await?;
                let opened = match manifests.open(key.as_ref(), &bytes) {
                    Ok(o) => o,
                    // one unreadable object must not stop collection everywhere
                    Err(e) => {
                        tracing::warn!(manifest = %key, error = %e, "garbage collection skips an unreadable manifest");
                        continue;
                    }
                };
                match opened {
                    // a real revision of this session, under its own key
                    Opened::Verified(m)
                        if checkpoint::manifest_key(m.session, m.revision) == key.as_ref()
                            && m.revision == *revision =>
                    {
                        kept += 1;
                        referenced.extend(m.chunks());
                    }
                    // verified but moved (a copy under another key): not a revision to keep
                    Opened::Verified(m) => {
                        tracing::warn!(manifest = %key, "garbage collection skips a manifest stored under another key");
                        referenced.extend(m.chunks());
                    }
                    // Not ours (forged, or an old key): neither a revision to keep nor
                    // one to delete, or a forger could push real revisions out. Its
                    // chunks stay: keeping is always safe.
                    Opened::Unverified(m, why) => {
                        tracing::warn!(manifest = %key, %why, "garbage collection skips a manifest that does not verify");
                        referenced.extend(m.chunks());
                    }
                }
            } else {
                match objects.delete(key).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => done.manifests_deleted += 1,
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }

    let cutoff = chrono_cutoff(grace);
    let chunks: Vec<object_store::ObjectMeta> = objects.list(Some(&Path::from("chunks"))).try_collect().await?;
    for meta in chunks {
        let hash = meta.location.filename().unwrap_or_default().to_string();
        let young = meta.last_modified.timestamp_millis() > cutoff;
        if referenced.contains(&hash) || young {
            done.chunks_kept += 1;
            continue;
        }
        delete_chunk(objects, &meta.location, meta.size, &mut done).await?;
    }
    // a chunk a crashed free_deleted left in the trash (one still running moved
    // its chunks moments ago): back if referenced, else gone
    let in_trash: Vec<object_store::ObjectMeta> = objects.list(Some(&Path::from("trash"))).try_collect().await?;
    let stale = schemas::unix_ms() as i64 - 10 * SETTLE.as_millis() as i64;
    for meta in in_trash {
        let Some((moved, hash)) = parse_trash_key(&meta.location) else { continue };
        if moved >= stale {
            continue;
        }
        if referenced.contains(&hash) {
            objects.rename(&meta.location, &Path::from(checkpoint::chunk_key(&hash).as_str())).await?;
        } else {
            delete_chunk(objects, &meta.location, meta.size, &mut done).await?;
        }
    }
    Ok(done)
}

/// Delete a chunk (or a trashed one) of `size` bytes, counting it in `done`; one
/// already gone is not counted.
async fn delete_chunk(
    objects: &Arc<dyn ObjectStore>,
    at: &Path,
    size: u64,
    done: &mut GcDoneV1,
) -> Result<(), ManifestError> {
    match objects.delete(at).await {
        Ok(()) => {
            done.chunks_deleted += 1;
            done.bytes_freed += size;
            Ok(())
        }
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Where a chunk waits while [`free_deleted`] makes sure no commit took it up
/// (under the unix ms it was moved: a move keeps a file's modification time).
fn trash_key(moved_ms: i64, hash: &str) -> Path {
    Path::from(format!("{}/{moved_ms}", trash_dir(hash)))
}

/// The trash folder of one chunk.
fn trash_dir(hash: &str) -> String {
    format!("trash/{hash}")
}

/// When a trash key's chunk was moved there, and its hash.
fn parse_trash_key(key: &Path) -> Option<(i64, String)> {
    let mut parts = key.as_ref().split('/').skip(1);
    let hash = parts.next()?.to_string();
    Some((parts.next()?.parse().ok()?, hash))
}

/// Put chunk `hash` back from the trash, if it is there: a commit that needs it
/// came while [`free_deleted`] held it. Answers whether it is back.
pub async fn untrash(objects: &Arc<dyn ObjectStore>, hash: &str) -> Result<bool, ManifestError> {
    let dir = Path::from(trash_dir(hash));
    let Some(meta) = objects.list(Some(&dir)).try_next().await? else { return Ok(false) };
    match objects.rename(&meta.location, &Path::from(checkpoint::chunk_key(hash).as_str())).await {
        Ok(()) => Ok(true),
        // another commit put it back first, or the collector took it just now
        Err(object_store::Error::NotFound { .. }) => {
            Ok(objects.head(&Path::from(checkpoint::chunk_key(hash).as_str())).await.is_ok())
        }
        Err(e) => Err(e.into()),
    }
}

/// A deleted session's chunk younger than this is not freed yet: another session's
/// save (which uploads before it commits) may be about to commit the same bytes.
pub const IN_FLIGHT: Duration = Duration::from_secs(20);

/// How long a chunk stays in the trash before the re-check: a save that found it
/// stored just before it moved commits by then (and its commit puts it back).
pub const SETTLE: Duration = Duration::from_secs(15);

/// Free the chunks of a deleted session (`candidates`: those its manifests
/// referenced) that no other manifest references, within a minute rather than
/// after the collector's grace (ADR 54). Chunks are content-addressed, so another
/// session may hold or be saving the same bytes; each chunk to free is moved to
/// the trash first, and after [`SETTLE`] every manifest written meanwhile is read:
/// a chunk one of them references goes back, the rest are deleted. A commit that
/// checks a chunk while it is in the trash is refused (missing chunks), never
/// committed pointing at nothing. A chunk left in the trash by a crash is put back
/// or deleted by [`collect`].
pub async fn free_deleted(manifests: &Manifests, candidates: BTreeSet<String>) -> Result<GcDoneV1, ManifestError> {
    free_deleted_after(manifests, candidates, IN_FLIGHT, SETTLE).await
}

/// [`free_deleted`] with its waits given (tests).
async fn free_deleted_after(
    manifests: &Manifests,
    mut candidates: BTreeSet<String>,
    in_flight: Duration,
    settle: Duration,
) -> Result<GcDoneV1, ManifestError> {
    let objects = manifests.objects();
    let mut done = GcDoneV1::default();
    // two rounds at most: a chunk too young in the first is old enough a round later
    for round in 0..2 {
        let started = schemas::unix_ms() as i64;
        let referenced = references(manifests, None).await?;
        let mut trashed: Vec<(String, u64)> = Vec::new();
        let mut young = BTreeSet::new();
        for hash in candidates.iter().filter(|h| !referenced.contains(*h)) {
            let key = Path::from(checkpoint::chunk_key(hash).as_str());
            let meta = match objects.head(&key).await {
                Ok(m) => m,
                Err(object_store::Error::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            if meta.last_modified.timestamp_millis() > started - in_flight.as_millis() as i64 {
                young.insert(hash.clone());
                continue;
            }
            match objects.rename(&key, &trash_key(started, hash)).await {
                Ok(()) => trashed.push((hash.clone(), meta.size)),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if !trashed.is_empty() {
            tokio::time::sleep(settle).await;
            // a second past the start: clocks of the store and this gateway differ a little
            let late = references(manifests, Some(started - 1000)).await?;
            for (hash, size) in trashed {
                if late.contains(&hash) {
                    let back = Path::from(checkpoint::chunk_key(&hash).as_str());
                    objects.rename(&trash_key(started, &hash), &back).await?;
                    done.chunks_kept += 1;
                    continue;
                }
                delete_chunk(objects, &trash_key(started, &hash), size, &mut done).await?;
            }
        }
        if young.is_empty() || round == 1 {
            done.chunks_kept += young.len() as u64;
            break;
        }
        candidates = young;
        // those young at the start are old enough once the in-flight time has
        // passed since it (a second more for the clocks)
        let since_start = Duration::from_millis((schemas::unix_ms() as i64 - started).max(0) as u64);
        tokio::time::sleep((in_flight + Duration::from_secs(1)).saturating_sub(since_start)).await;
    }
    Ok(done)
}

/// Every chunk any manifest references (of every revision, verified or not: keeping
/// is always safe), or only manifests written at or after unix ms `since`.
async fn references(manifests: &Manifests, since: Option<i64>) -> Result<BTreeSet<String>, ManifestError> {
    let objects = manifests.objects();
    let mut referenced = BTreeSet::new();
    let metas: Vec<object_store::ObjectMeta> = objects.list(Some(&Path::from("sessions"))).try_collect().await?;
    for meta in metas {
        if checkpoint::revision_of_key(meta.location.as_ref()).is_none() {
            continue; // a tombstone
        }
        if since.is_some_and(|t| meta.last_modified.timestamp_millis() < t) {
            continue;
        }
        match manifests.chunks_of(&meta.location).await {
            Ok(chunks) => referenced.extend(chunks),
            // deleted since the listing: it references nothing now
            Err(ManifestError::Storage(object_store::Error::NotFound { .. })) => {}
            // unreadable: what it references is unknown, so nothing may go
            Err(e) => return Err(e),
        }
    }
    Ok(referenced)
}

/// The unix-ms instant before which a chunk is old enough to collect.
fn chrono_cutoff(grace: Duration) -> i64 {
    schemas::unix_ms() as i64 - grace.as_millis() as i64
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use object_store::memory::InMemory;
    use object_store::ObjectStore;
    use schemas::checkpoint::{chunk_key, Blob, Delta, DeltaVar, ObjectEntry};
    use schemas::messages::CommitV2;
    use uuid::Uuid;

    use super::*;

    async fn put(objects: &Arc<dyn ObjectStore>, hash: &str) {
        objects.put(&Path::from(chunk_key(hash).as_str()), vec![7u8; 10].into()).await.unwrap();
    }

    fn commit(session: Uuid, base: u64, chunk: &str) -> CommitV2 {
        let mut delta = Delta::default();
        delta.objects.insert(
            "o".into(),
            ObjectEntry { record: Blob { len: 10, chunks: vec![chunk.into()] }, ..Default::default() },
        );
        delta.variables.insert("x".into(), DeltaVar { oid: Some("o".into()), module: None, global_reads: vec![] });
        CommitV2 {
            session,
            base_revision: base,
            exec_id: Uuid::now_v7(),
            host: "h".into(),
            worker: "w".into(),
            cell_id: "c".into(),
            delta,
            uploaded: vec![],
        }
    }

    #[tokio::test]
    async fn collects_old_revisions_and_their_chunks_but_not_young_or_live_ones() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let m = Manifests::new(objects.clone());
        let sid = Uuid::now_v7();
        for (i, c) in ["c1", "c2", "c3"].iter().enumerate() {
            put(&objects, c).await;
            m.commit(&commit(sid, i as u64, c)).await.unwrap();
        }
        put(&objects, "orphan").await;

        // grace covers everything: only old manifests go
        let young = collect(&m, 2, Duration::from_secs(3600)).await.unwrap();
        assert_eq!((young.manifests_deleted, young.chunks_deleted), (1, 0));

        // no grace: c1 (only in the deleted revision) and the orphan go; c2, c3 stay
        let old = collect(&m, 2, Duration::ZERO).await.unwrap();
        assert_eq!(old.chunks_deleted, 2);
        for (c, present) in [("c1", false), ("orphan", false), ("c2", true), ("c3", true)] {
            let found = objects.head(&Path::from(chunk_key(c).as_str())).await.is_ok();
            assert_eq!(found, present, "{c}");
        }
        assert_eq!(m.latest(sid).await.unwrap().revision, 3);
    }

    #[tokio::test]
    async fn a_deleted_sessions_own_chunks_are_freed_and_shared_ones_stay() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let m = Manifests::new(objects.clone());
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        for c in ["own", "shared"] {
            put(&objects, c).await;
        }
        m.commit(&commit(a, 0, "own")).await.unwrap();
        m.commit(&commit(a, 1, "shared")).await.unwrap();
        m.commit(&commit(b, 0, "shared")).await.unwrap();
        let deleted = m.delete(a).await.unwrap();
        assert_eq!(deleted.chunks, BTreeSet::from(["own".to_string(), "shared".to_string()]));

        let done = free_deleted_after(&m, deleted.chunks, Duration::ZERO, Duration::from_millis(10)).await.unwrap();
        assert_eq!((done.chunks_deleted, done.bytes_freed), (1, 10));
        assert!(objects.head(&Path::from(chunk_key("own").as_str())).await.is_err());
        assert!(objects.head(&Path::from(chunk_key("shared").as_str())).await.is_ok());
        let trash: Vec<_> = objects.list(Some(&Path::from("trash"))).try_collect().await.unwrap();
        assert!(trash.is_empty(), "{trash:?}");
    }

    #[tokio::test]
    async fn a_fork_keeps_its_parents_chunks_after_the_parent_is_discarded() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let m = Manifests::new(objects.clone());
        let (parent, child) = (Uuid::now_v7(), Uuid::now_v7());
        for c in ["before-fork", "at-fork", "after-fork", "fork-own"] {
            put(&objects, c).await;
        }
        m.commit(&commit(parent, 0, "before-fork")).await.unwrap();
        m.commit(&commit(parent, 1, "at-fork")).await.unwrap();
        m.fork(parent, Some(2), child).await.unwrap();
        m.commit(&commit(parent, 2, "after-fork")).await.unwrap();
        m.commit(&commit(child, 1, "fork-own")).await.unwrap();

        let deleted = m.delete(parent).await.unwrap();
        let done = free_deleted_after(&m, deleted.chunks, Duration::ZERO, Duration::from_millis(10)).await.unwrap();
        // only what the fork never referenced goes; the fork's latest state still loads
        assert_eq!(done.chunks_deleted, 2);
        for (c, present) in [("before-fork", false), ("after-fork", false), ("at-fork", true), ("fork-own", true)] {
            let found = objects.head(&Path::from(chunk_key(c).as_str())).await.is_ok();
            assert_eq!(found, present, "{c}");
        }
        // and the collector keeps the fork's revisions' chunks too
        let swept = collect(&m, 20, Duration::ZERO).await.unwrap();
        assert_eq!(swept.chunks_deleted, 0);
        assert!(objects.head(&Path::from(chunk_key("at-fork").as_str())).await.is_ok());
    }

    #[tokio::test]
    async fn a_chunk_left_in_the_trash_goes_back_if_a_manifest_needs_it() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let m = Manifests::new(objects.clone());
        let sid = Uuid::now_v7();
        put(&objects, "needed").await;
        m.commit(&commit(sid, 0, "needed")).await.unwrap();
        // a free_deleted that crashed between its move and its re-check, long ago
        let at = Path::from(chunk_key("needed").as_str());
        objects.rename(&at, &trash_key(1, "needed")).await.unwrap();
        objects.put(&trash_key(1, "unneeded"), vec![1u8; 3].into()).await.unwrap();

        let done = collect(&m, 2, Duration::from_secs(3600)).await.unwrap();
        assert!(objects.head(&at).await.is_ok(), "the referenced chunk is back");
        assert_eq!(done.chunks_deleted, 1);
        assert!(objects.head(&trash_key(1, "unneeded")).await.is_err());
    }

    #[tokio::test]
    async fn quota_rejects_a_save_that_would_exceed_it() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let m = Manifests::new(objects.clone()).with_quota(Some(5));
        put(&objects, "c1").await;
        let err = m.commit(&commit(Uuid::now_v7(), 0, "c1")).await.unwrap_err();
        assert!(matches!(err, ManifestError::QuotaExceeded { bytes: 10, quota: 5, .. }), "{err}");
        assert!(err.to_string().contains("quota"));
    }
}
