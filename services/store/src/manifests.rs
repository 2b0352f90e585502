//! Session manifests over `object_store`: find the latest revision, commit the next
//! one with a create-only put (atomic on every backend), delete a session; undo,
//! checkout and fork are in [`lineage`].
//!
//! Two writers racing for revision N+1 cannot both win: the loser's create fails with
//! `AlreadyExists` and it gets a conflict. A crash before the create leaves revision N
//! as the session's state.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, PutMode, PutOptions};
use schemas::checkpoint::{self, Manifest, SaveOrigin};
use schemas::messages::{CommitV2, CommittedV1};
use uuid::Uuid;

use crate::signing::{self, ManifestKey};

/// Why a manifest operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The object store failed.
    #[error("object store: {0}")]
    Storage(#[from] object_store::Error),
    /// A stored manifest does not verify under the platform's key: restore never
    /// loads it (the bucket was written by something other than this platform).
    #[error("manifest {key} was refused: {reason}")]
    Unverified {
        /// Its key.
        key: String,
        /// Why.
        reason: crate::signing::Unverified,
    },
    /// A stored manifest is not valid JSON of the format.
    #[error("manifest {key} is corrupt: {reason}")]
    Corrupt {
        /// Its key.
        key: String,
        /// Why.
        reason: String,
    },
    /// The session was deleted: nothing commits to it any more.
    #[error("session {session} was deleted; nothing is saved to it any more")]
    Deleted {
        /// Session.
        session: Uuid,
    },
    /// The commit was based on an older revision than the latest.
    #[error("session {session}: commit based on revision {base} but revision {latest} is committed")]
    Stale {
        /// Session.
        session: Uuid,
        /// The commit's base.
        base: u64,
        /// The latest revision.
        latest: u64,
    },
    /// Another writer created the same revision first.
    #[error("session {session}: revision {revision} was committed by another writer")]
    Lost {
        /// Session.
        session: Uuid,
        /// The contested revision.
        revision: u64,
    },
    /// The delta is inconsistent.
    #[error("session {session}: {source}")]
    BadDelta {
        /// Session.
        session: Uuid,
        /// What is wrong.
        source: checkpoint::DeltaError,
    },
    /// The session would hold more bytes than its quota.
    #[error("session {session}: this save would make the session hold {bytes} bytes, over its quota of {quota} bytes; delete variables or raise the quota")]
    QuotaExceeded {
        /// Session.
        session: Uuid,
        /// Bytes after the save.
        bytes: u64,
        /// The quota.
        quota: u64,
    },
    /// The store's volume has no room for this save (ADR 54).
    #[error("session {session}: the store {store} is full: {free} bytes free of {total}, and this save adds about {needed}; delete variables or sessions (a deleted session's chunks are freed within a minute), or free space on that volume")]
    StoreFull {
        /// Session.
        session: Uuid,
        /// The store's directory.
        store: String,
        /// Bytes free.
        free: u64,
        /// The volume's size.
        total: u64,
        /// What the save adds.
        needed: u64,
    },
    /// A revision the asker knows was committed is not in the store.
    #[error("session {session}: revision {revision} was committed but the store's latest is {latest} (the session was deleted, or the store lost it)")]
    RevisionMissing {
        /// Session.
        session: Uuid,
        /// The revision the asker knew of.
        revision: u64,
        /// The latest revision in the store.
        latest: u64,
    },
    /// Undo asked of a state with no earlier one.
    #[error("session {session}: nothing to undo: {why}")]
    NothingToUndo {
        /// Session.
        session: Uuid,
        /// Why there is no earlier state.
        why: String,
    },
    /// A revert asked for a revision the store does not hold.
    #[error("session {session}: there is no revision {revision}; it holds {held}")]
    NoRevision {
        /// Session.
        session: Uuid,
        /// The revision asked for.
        revision: u64,
        /// The revisions it holds (older ones were collected).
        held: String,
    },
    /// A fork's new session already has state.
    #[error("session {child} already exists; a fork needs a new session")]
    ForkExists {
        /// The would-be fork.
        child: Uuid,
    },
    /// The save references chunks the store does not have.
    #[error("session {session}: the save references {count} chunk(s) missing from the store, e.g. {example}")]
    MissingChunks {
        /// Session.
        session: Uuid,
        /// How many.
        count: usize,
        /// One of them.
        example: String,
    },
}

/// What deleting a session removed.
#[derive(Debug, Default)]
pub struct Deleted {
    /// Its manifests.
    pub manifests: usize,
    /// The chunks they referenced (some may be shared with other sessions).
    pub chunks: BTreeSet<String>,
}

/// Manifests of every session, with a cache of each session's latest revision.
pub struct Manifests {
    objects: Arc<dyn ObjectStore>,
    latest: Mutex<HashMap<Uuid, Arc<Manifest>>>,
    quota_bytes: Option<u64>,
    key: Option<ManifestKey>,
}

impl Manifests {
    /// Manifests in `objects`.
    pub fn new(objects: Arc<dyn ObjectStore>) -> Self {
        Self { objects, latest: Mutex::new(HashMap::new()), quota_bytes: None, key: None }
    }

    /// Sign every manifest committed from now on with `key`, and load only
    /// manifests that verify under it (None: unsigned, nothing verified).
    pub fn with_key(mut self, key: Option<ManifestKey>) -> Self {
        self.key = key;
        self
    }

    /// Parse the manifest stored at `key`, checking its MAC.
    pub fn open(&self, key: &str, bytes: &[u8]) -> Result<signing::Opened, ManifestError> {
        signing::open(bytes, self.key.as_ref())
            .map_err(|e| ManifestError::Corrupt { key: key.to_string(), reason: e.to_string() })
    }

    /// Limit each session's state to `bytes` (records, payloads and ambient state).
    pub fn with_quota(mut self, bytes: Option<u64>) -> Self {
        self.quota_bytes = bytes;
        self
    }

    /// The store these manifests live in.
    pub fn objects(&self) -> &Arc<dyn ObjectStore> {
        &self.objects
    }

    fn cached(&self, session: Uuid) -> Option<Arc<Manifest>> {
        self.latest.lock().ok().and_then(|m| m.get(&session).cloned())
    }

    fn remember(&self, manifest: Arc<Manifest>) {
        if let Ok(mut m) = self.latest.lock() {
            m.insert(manifest.session, manifest);
        }
    }

    async fn read(&self, session: Uuid, revision: u64) -> Result<Option<Manifest>, ManifestError> {
        let key = checkpoint::manifest_key(session, revision);
        let bytes = match self.objects.get(&Path::from(key.as_str())).await {
            Ok(r) => r.bytes().await?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let manifest = match self.open(&key, &bytes)? {
            signing::Opened::Verified(m) => m,
            signing::Opened::Unverified(_, reason) => return Err(ManifestError::Unverified { key, reason }),
        };
        if manifest.revision != revision || manifest.session != session {
            return Err(ManifestError::Corrupt { key, reason: "revision or session does not match its key".into() });
        }
        Ok(Some(manifest))
    }

    /// The session's latest manifest, given that revision `at_least` is committed:
    /// the one remembered here when it is that new (no request to the store), else
    /// `latest`. Another gateway may have committed later revisions; whoever names
    /// `at_least` knows of none (a session's cells commit one after another).
    pub async fn latest_from(&self, session: Uuid, at_least: Option<u64>) -> Result<Arc<Manifest>, ManifestError> {
        let known = at_least.unwrap_or(0);
        if let Some(m) = self.cached(session).filter(|m| at_least.is_some() && m.revision >= known) {
            return Ok(m);
        }
        let m = self.latest(session).await?;
        // never answer with older state than the asker knows exists
        if m.revision < known {
            return Err(ManifestError::RevisionMissing { session, revision: known, latest: m.revision });
        }
        Ok(m)
    }

    /// The session's latest manifest (an empty revision 0 if it never saved).
    pub async fn latest(&self, session: Uuid) -> Result<Arc<Manifest>, ManifestError> {
        // Start from the cached revision, or the highest listed one, then step forward
        // past revisions other gateways committed meanwhile.
        let mut current = match self.cached(session) {
            Some(m) => m,
            None => {
                let prefix = Path::from(checkpoint::manifests_dir(session).as_str());
                let keys: Vec<_> = self.objects.list(Some(&prefix)).try_collect().await?;
                // only keys of the format count: a stray object must not look like the top
                let top = keys
                    .iter()
                    .filter_map(|m| checkpoint::revision_of_key(m.location.as_ref()).map(|r| (r, m.location.as_ref())))
                    .filter(|(r, key)| checkpoint::manifest_key(session, *r) == *key)
                    .map(|(r, _)| r)
                    .max();
                match top {
                    Some(rev) => Arc::new(self.read(session, rev).await?.unwrap_or_else(|| Manifest::empty(session))),
                    None => Arc::new(Manifest::empty(session)),
                }
            }
        };
        while let Some(next) = self.read(session, current.revision + 1).await? {
            current = Arc::new(next);
        }
        self.remember(current.clone());
        Ok(current)
    }

    /// Commit a worker's save as the next revision.
    pub async fn commit(&self, commit: &CommitV2) -> Result<CommittedV1, ManifestError> {
        let session = commit.session;
        // The revision this gateway committed or read last is the base when the
        // commit names it: if another gateway created the next revision meanwhile,
        // the create-only put below fails, so no probe for it is needed first.
        let base = match self.cached(session) {
            Some(m) if m.revision == commit.base_revision => m,
            _ => self.latest(session).await?,
        };
        if base.revision != commit.base_revision {
            return Err(ManifestError::Stale { session, base: commit.base_revision, latest: base.revision });
        }
        let origin = SaveOrigin {
            exec_id: commit.exec_id,
            host: &commit.host,
            worker: &commit.worker,
            cell_id: &commit.cell_id,
        };
        let next = base.apply(&commit.delta, &origin).map_err(|source| ManifestError::BadDelta { session, source })?;
        self.within_quota(session, Some(next.stored_bytes()))?;
        self.check_chunks(commit, &base).await?;
        // last, just before the put: a delete may have come in while this ran
        if self.is_deleted(session).await? {
            return Err(ManifestError::Deleted { session });
        }

        let next = self.put_next(session, next).await?;
        let names = commit.delta.variables.keys().chain(commit.delta.unsavable.keys());
        let versions = names
            .filter_map(|n| {
                let v = next.variables.get(n).map(|v| v.version).or_else(|| next.unsavable.get(n).map(|u| u.version));
                v.map(|v| (n.clone(), v))
            })
            .collect();
        let changed = next
            .variables
            .iter()
            .filter(|(_, v)| v.version == commit.exec_id)
            .map(|(n, _)| n.clone())
            .chain(next.unsavable.iter().filter(|(_, u)| u.version == commit.exec_id).map(|(n, _)| n.clone()))
            .collect();
        Ok(CommittedV1 { revision: next.revision, versions, changed })
    }

    /// Every chunk a commit's objects reference must already be in the store, so a
    /// manifest never points at bytes that are not there. Chunks the host stored for
    /// this save are taken at its word: they are too young for the collector.
    async fn check_chunks(&self, commit: &CommitV2, base: &Manifest) -> Result<(), ManifestError> {
        let uploaded: HashSet<&String> = commit.uploaded.iter().collect();
        let mut wanted: Vec<&String> = commit.delta.objects.values().flat_map(|o| o.chunks()).collect();
        if let Some(a) = &commit.delta.ambient {
            wanted.extend(a.chunks.iter());
        }
        wanted.retain(|h| !uploaded.contains(h));
        self.ensure_stored(commit.session, base, wanted).await
    }

    /// An error unless every chunk of `wanted` is stored (those `base` references
    /// are); one a deleted session's freeing holds in the trash comes back (ADR 54).
    async fn ensure_stored(&self, session: Uuid, base: &Manifest, wanted: Vec<&String>) -> Result<(), ManifestError> {
        let mut missing = self.missing_in(base, wanted).await?;
        let mut back = Vec::new();
        for hash in &missing {
            if crate::gc::untrash(&self.objects, hash).await? {
                back.push(hash.clone());
            }
        }
        missing.retain(|h| !back.contains(h));
        match missing.first() {
            None => Ok(()),
            Some(example) => {
                Err(ManifestError::MissingChunks { session, count: missing.len(), example: example.clone() })
            }
        }
    }

    /// The session's latest manifest (at least revision `at_least`), and the
    /// chunks it references that are gone: every one is looked up, none taken
    /// on trust (a resume asks, after the session lay detached for days); one in
    /// the trash comes back.
    pub async fn check(
        &self,
        session: Uuid,
        at_least: Option<u64>,
    ) -> Result<(Arc<Manifest>, Vec<String>), ManifestError> {
        let latest = self.latest_from(session, at_least).await?;
        let mut missing = self.missing_in(&Manifest::empty(session), latest.chunks().iter().collect()).await?;
        let mut back = Vec::new();
        for hash in &missing {
            if crate::gc::untrash(&self.objects, hash).await? {
                back.push(hash.clone());
            }
        }
        missing.retain(|h| !back.contains(h));
        Ok((latest, missing))
    }

    /// Which of `hashes` the store lacks (a save's chunk plan). Chunks of the
    /// session's latest revision are known to be stored; the rest are looked up.
    pub async fn missing_chunks(&self, session: Uuid, hashes: &[String]) -> Result<Vec<String>, ManifestError> {
        // the revision remembered here may lag another gateway's commits; that only
        // makes the plan ask for more (the commit's own check is authoritative)
        let base = match self.cached(session) {
            Some(m) => m,
            None => self.latest(session).await?,
        };
        self.missing_in(&base, hashes.iter().collect()).await
    }

    /// Which of `wanted` are not stored. Chunks `base` references are there already
    /// (checked when it was committed, and the collector keeps what a live
    /// revision references), so only the others cost a request each.
    async fn missing_in(&self, base: &Manifest, mut wanted: Vec<&String>) -> Result<Vec<String>, ManifestError> {
        let known: HashSet<&String> = base
            .objects
            .values()
            .flat_map(|o| o.chunks())
            .chain(base.ambient.iter().flat_map(|a| a.chunks.iter()))
            .collect();
        wanted.retain(|h| !known.contains(h));
        wanted.sort();
        wanted.dedup();
        let objects = self.objects.clone();
        let mut missing: Vec<String> = futures::stream::iter(wanted)
            .map(|hash| {
                let objects = objects.clone();
                async move {
                    match objects.head(&Path::from(checkpoint::chunk_key(hash).as_str())).await {
                        Ok(_) => Ok(None),
                        Err(object_store::Error::NotFound { .. }) => Ok(Some(hash.clone())),
                        Err(e) => Err(e),
                    }
                }
            })
            .buffer_unordered(32)
            .try_filter_map(|m| async move { Ok(m) })
            .try_collect()
            .await?;
        missing.sort(); // answers arrive in any order
        Ok(missing)
    }

    /// Settle run `exec_id`, based on revision `base`, that its frontend gave up (its
    /// host was lost, or no host took it): the manifest that decides its outcome.
    /// If its save landed at `base + 1`, that commit; else revision `base + 1` is
    /// taken here by a fence (the base's state again, under the nil execution), so
    /// a host cut off while it ran can never commit it later: its commit on `base`
    /// finds the revision taken (ADR 22). Idempotent: asking again answers the same.
    pub async fn settle(&self, session: Uuid, exec_id: Uuid, base: u64) -> Result<Arc<Manifest>, ManifestError> {
        // a deleted session's manifests are gone: say so, not that a revision is missing
        if self.is_deleted(session).await? {
            return Err(ManifestError::Deleted { session });
        }
        let latest = self.latest(session).await?;
        if latest.revision < base {
            return Err(ManifestError::RevisionMissing { session, revision: base, latest: latest.revision });
        }
        if latest.revision == base {
            let mut fence = (*latest).clone();
            fence.revision = base + 1;
            fence.exec_id = Uuid::nil();
            match self.put_next(session, fence).await {
                Ok(fence) => {
                    tracing::info!(%session, exec = %exec_id, revision = fence.revision, "run given up: revision fenced");
                    return Ok(fence);
                }
                // the run's commit (or an earlier settle) took it first
                Err(ManifestError::Lost { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        match self.read(session, base + 1).await? {
            Some(next) if next.exec_id == exec_id => Ok(Arc::new(next)),
            // another execution or a fence holds base + 1: this run never commits
            _ => self.latest(session).await,
        }
    }

    /// Store `next` as the session's next revision (create-only: a writer that
    /// took that revision first wins).
    async fn put_next(&self, session: Uuid, next: Manifest) -> Result<Arc<Manifest>, ManifestError> {
        let key = checkpoint::manifest_key(session, next.revision);
        let body = signing::seal(&next, self.key.as_ref())
            .map_err(|e| ManifestError::Corrupt { key: key.clone(), reason: e.to_string() })?;
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        match self.objects.put_opts(&Path::from(key.as_str()), body.into(), opts).await {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => {
                return Err(ManifestError::Lost { session, revision: next.revision })
            }
            Err(e) => return Err(e.into()),
        }
        let next = Arc::new(next);
        self.remember(next.clone());
        Ok(next)
    }

    /// An error if a session holding `bytes` (None: not known) is over its quota.
    pub fn within_quota(&self, session: Uuid, bytes: Option<u64>) -> Result<(), ManifestError> {
        match (self.quota_bytes, bytes) {
            (Some(quota), Some(bytes)) if bytes > quota => Err(ManifestError::QuotaExceeded { session, bytes, quota }),
            _ => Ok(()),
        }
    }

    /// Delete every manifest of a session; answers how many, and the chunks they
    /// referenced (for [`crate::gc::free_deleted`]: those no other session holds
    /// are freed at once, not after the collector's grace).
    pub async fn delete(&self, session: Uuid) -> Result<Deleted, ManifestError> {
        // the tombstone first: from now on no commit (of a cell still saving, or
        // through another gateway) brings the session back
        let tombstone = Path::from(checkpoint::tombstone_key(session).as_str());
        self.objects.put(&tombstone, Vec::<u8>::new().into()).await?;
        let prefix = Path::from(checkpoint::manifests_dir(session).as_str());
        let keys: Vec<_> = self.objects.list(Some(&prefix)).try_collect().await?;
        let mut chunks = BTreeSet::new();
        for meta in &keys {
            // read before it goes; one unreadable manifest leaves its chunks to the collector
            match self.chunks_of(&meta.location).await {
                Ok(c) => chunks.extend(c),
                Err(e) => {
                    tracing::warn!(manifest = %meta.location, error = %e, "a deleted session's manifest was unreadable")
                }
            }
            match self.objects.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if let Ok(mut m) = self.latest.lock() {
            m.remove(&session);
        }
        Ok(Deleted { manifests: keys.len(), chunks })
    }
}

impl Manifests {
    /// The chunks the manifest stored at `at` references, verified or not (for
    /// keeping or freeing chunks: never for loading it).
    pub async fn chunks_of(&self, at: &Path) -> Result<BTreeSet<String>, ManifestError> {
        let bytes = self.objects.get(at).await?.bytes().await?;
        match self.open(at.as_ref(), &bytes)? {
            signing::Opened::Verified(m) | signing::Opened::Unverified(m, _) => Ok(m.chunks()),
        }
    }

    /// Whether `session` was deleted (its tombstone exists).
    async fn is_deleted(&self, session: Uuid) -> Result<bool, ManifestError> {
        match self.objects.head(&Path::from(checkpoint::tombstone_key(session).as_str())).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

mod lineage;
#[cfg(test)]
mod tests;
