//! A session's lineage: undo and checkout commit an earlier revision's state
//! again, fork copies the latest state into a new session (ADR 64). Each writes
//! one manifest; no chunk is copied.

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::ObjectStore as _;
use schemas::checkpoint::{self, ForkPoint, Manifest};
use schemas::messages::RevertTo;
use uuid::Uuid;

use super::{ManifestError, Manifests};

impl Manifests {
    /// Commit revision `to`'s state again as the session's next revision (undo,
    /// checkout): the manifest is copied, no chunk. `base` is the revision the
    /// asker holds as the latest; if another was committed since, the revert is
    /// stale. The new revision keeps the copied state's parent, so that undo
    /// again steps further back. Answers the new revision and the one whose state
    /// it holds.
    pub async fn revert(&self, session: Uuid, base: u64, to: RevertTo) -> Result<(Arc<Manifest>, u64), ManifestError> {
        if self.is_deleted(session).await? {
            return Err(ManifestError::Deleted { session });
        }
        let latest = self.latest(session).await?;
        if latest.revision != base {
            return Err(ManifestError::Stale { session, base, latest: latest.revision });
        }
        let target = match to {
            RevertTo::Undo => match (latest.parent, latest.forked_from) {
                _ if latest.revision == 0 => {
                    return Err(ManifestError::NothingToUndo { session, why: "no cell has saved state yet".into() })
                }
                (Some(parent), _) => parent,
                (None, Some(from)) => {
                    let why = format!(
                        "this state is where the session was forked from session {} (revision {})",
                        from.session, from.revision
                    );
                    return Err(ManifestError::NothingToUndo { session, why });
                }
                // the state before any cell, or a manifest from before lineage was kept
                (None, None) => {
                    let why = "no earlier state of this session is known (its cells ran before undo existed, \
                        or none has saved state)"
                        .into();
                    return Err(ManifestError::NothingToUndo { session, why });
                }
            },
            RevertTo::Revision(r) => r,
        };
        let state = if target == 0 && latest.forked_from.is_none() {
            Manifest::empty(session)
        } else if target > latest.revision {
            return Err(self.no_revision(session, target).await);
        } else {
            match self.read(session, target).await? {
                Some(m) => m,
                None => return Err(self.no_revision(session, target).await),
            }
        };
        let mut next = state;
        next.revision = latest.revision + 1;
        next.exec_id = Uuid::nil();
        // `parent` and `forked_from` stay the copied state's. Its chunks must all
        // be stored (the collector may have taken an old revision's meanwhile)
        self.ensure_stored(session, &latest, next.chunks().iter().collect()).await?;
        if self.is_deleted(session).await? {
            return Err(ManifestError::Deleted { session });
        }
        Ok((self.put_next(session, next).await?, target))
    }

    /// Fork `parent` into the new session `child`: its revision 1 is the parent's
    /// latest state (`at_least`: a revision the asker knows is committed), and
    /// both reference the same chunks. Names that could not be saved live only in
    /// the parent's workers: the fork has none of them (answered beside it).
    pub async fn fork(
        &self,
        parent: Uuid,
        at_least: Option<u64>,
        child: Uuid,
    ) -> Result<(Arc<Manifest>, Vec<String>), ManifestError> {
        if self.is_deleted(parent).await? {
            return Err(ManifestError::Deleted { session: parent });
        }
        if self.is_deleted(child).await? || self.latest(child).await?.revision != 0 {
            return Err(ManifestError::ForkExists { child });
        }
        let from = self.latest_from(parent, at_least).await?;
        let mut first = (*from).clone();
        first.session = child;
        first.revision = 1;
        first.exec_id = Uuid::nil();
        first.parent = None;
        first.forked_from = Some(ForkPoint { session: parent, revision: from.revision });
        // never routed to the parent's workers, which hold them
        let lost: Vec<String> = std::mem::take(&mut first.unsavable).into_keys().collect();
        let first = self.put_next(child, first).await.map_err(|e| match e {
            ManifestError::Lost { .. } => ManifestError::ForkExists { child },
            e => e,
        })?;
        Ok((first, lost))
    }

    /// The error for a revision the session does not hold, naming those it does.
    async fn no_revision(&self, session: Uuid, revision: u64) -> ManifestError {
        let prefix = Path::from(checkpoint::manifests_dir(session).as_str());
        let held: Vec<u64> = match self.objects.list(Some(&prefix)).try_collect::<Vec<_>>().await {
            Ok(keys) => keys.iter().filter_map(|m| checkpoint::revision_of_key(m.location.as_ref())).collect(),
            Err(e) => {
                let held = format!("revisions the store could not list ({e})");
                return ManifestError::NoRevision { session, revision, held };
            }
        };
        let held = match (held.iter().min(), held.iter().max()) {
            (Some(lo), Some(hi)) if lo == hi => format!("only revision {lo}"),
            (Some(lo), Some(hi)) if *lo > 1 => format!("revisions {lo} to {hi} (older ones were collected)"),
            (Some(lo), Some(hi)) => format!("revisions {lo} to {hi}"),
            _ => "no revisions".to_string(),
        };
        ManifestError::NoRevision { session, revision, held }
    }
}
