//! Garbage collection: old manifest revisions, then chunks nothing kept references.
//!
//! Safe against a save in flight: a save uploads its chunks before it commits, so
//! chunks younger than the grace period are never collected; and the newest
//! `keep_revisions` of every session are kept, so a host that read the previous
//! revision a moment ago can still fetch its chunks.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path;
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
    /// Hourly, keeping each session's newest two revisions and chunks younger than
    /// an hour.
    fn default() -> Self {
        Self { every: Duration::from_secs(3600), keep_revisions: 2, grace: Duration::from_secs(3600) }
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
        match objects.delete(&meta.location).await {
            Ok(()) => {
                done.chunks_deleted += 1;
                done.bytes_freed += meta.size;
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
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
    async fn quota_rejects_a_save_that_would_exceed_it() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let m = Manifests::new(objects.clone()).with_quota(Some(5));
        put(&objects, "c1").await;
        let err = m.commit(&commit(Uuid::now_v7(), 0, "c1")).await.unwrap_err();
        assert!(matches!(err, ManifestError::QuotaExceeded { bytes: 10, quota: 5, .. }), "{err}");
        assert!(err.to_string().contains("quota"));
    }
}
