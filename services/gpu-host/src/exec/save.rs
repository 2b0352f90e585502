//! Saving what a cell changed: the worker's save, its commit sent until the store's
//! answer is known, and the `Saved` event.

use std::time::Duration;

use schemas::checkpoint::{Delta, Manifest, SaveOrigin};
use schemas::messages::{
    ChunkPlanV2, ChunkPlannedV1, CommitV2, CommittedV1, ErrorCode, EventKind, ManifestGetV2, ManifestV2, RecipeV3,
};
use schemas::subjects::StoreVerb;
use schemas::{Bus, BusError};
use tracing::Instrument as _;
use uuid::Uuid;

use super::{ExecEnv, ExecError, Left, STORE_TIMEOUT};
use crate::worker::WorkerProc;

impl ExecEnv {
    /// Save what the cell changed into the session's next revision and send the
    /// `Saved` event. `cuda_used`: whether the cell initialised CUDA; the commit
    /// waits until `told` says the cell's `Finished` event is kept.
    pub(super) async fn save(
        &self,
        recipe: &RecipeV3,
        w: &mut WorkerProc,
        manifest: &Manifest,
        slots: &[u32],
        cuda_used: bool,
        told: tokio::sync::watch::Receiver<bool>,
    ) -> Result<Left, ExecError> {
        let (session, exec_id) = (recipe.session, recipe.exec_id);
        let base_revision = manifest.revision;
        let worker_name = w.id.clone();
        let commit = |delta, uploaded| {
            let msg = CommitV2 {
                session,
                base_revision,
                exec_id,
                host: self.host_id.clone(),
                worker: worker_name.clone(),
                cell_id: recipe.cell_id.clone(),
                delta,
                uploaded,
            };
            let (bus, mut told) = (self.bus.clone(), told.clone());
            async move {
                // the sender is dropped only once it said so
                let _ = told.wait_for(|t| *t).await;
                // an unanswered commit may be lost (with a NATS node): ask again soon
                commit_until_known(bus, msg, schemas::bus::ATTEMPT_WAIT).await
            }
        };
        // what the session would hold after the save: the store refuses a plan over
        // its quota before anything is uploaded
        let origin = SaveOrigin { exec_id, host: &self.host_id, worker: &worker_name, cell_id: &recipe.cell_id };
        let bytes_after =
            |delta: Option<&Delta>| delta.and_then(|d| manifest.apply(d, &origin).ok()).map(|m| m.stored_bytes());
        let ask_missing = |hashes, delta: Option<Delta>| {
            let bus = self.bus.clone();
            let bytes_after = bytes_after(delta.as_ref());
            async move {
                bus.request_idempotent::<_, ChunkPlannedV1>(
                    bus.subjects().store(StoreVerb::ChunkPlan),
                    &ChunkPlanV2 { session, hashes, bytes_after },
                    STORE_TIMEOUT,
                )
                .await
                .map(|p| p.missing)
            }
        };
        // chunks the base revision references are stored; the store answers for the rest
        let stored = manifest.chunks();
        let saved =
            w.save(exec_id, &self.chunks, &stored, ask_missing, commit).instrument(tracing::info_span!("save")).await?;
        schemas::metrics::metrics().saved_bytes.inc_by(saved.saved_bytes);
        self.event(
            session,
            exec_id,
            EventKind::Saved {
                revision: saved.revision,
                save_ms: saved.save_ms,
                saved_bytes: saved.saved_bytes,
                chunks_written: saved.chunks_written,
                unsavable: saved.unsavable.clone(),
                slot_released: !slots.is_empty() && (saved.unsavable.is_empty() || !cuda_used),
            },
        )
        .instrument(tracing::info_span!("saved", otel.name = "saved event"))
        .await;
        Ok(Left { unsavable: saved.unsavable, cuda_used })
    }
}

/// How long a commit whose answer never came is sent again before the save is
/// given up (the store's answer is what the run's outcome says).
const COMMIT_PATIENCE: Duration = Duration::from_secs(600);

/// How soon a commit without an answer is sent again.
const COMMIT_RETRY: Duration = Duration::from_secs(2);

/// How soon a commit nothing served is sent again (a store restarting in place).
const ABSENT_RETRY: Duration = Duration::from_millis(250);

/// Commit `msg` and learn for sure whether it landed: a commit without an answer
/// (store restarting, object store stalled) may land later, so reporting it failed
/// would tell the user something other than what was committed. It is sent again
/// (a create-only put of revision base + 1: at most one copy lands) until an answer
/// comes; a conflict then means a copy landed if the session's latest revision is
/// this execution's.
async fn commit_until_known(
    bus: Bus,
    msg: CommitV2,
    answer_within: Duration,
) -> Result<(u64, Vec<(String, Uuid)>), BusError> {
    let subject = bus.subjects().store(StoreVerb::Commit);
    let started = tokio::time::Instant::now();
    let deadline = started + COMMIT_PATIENCE;
    let mut unanswered = false;
    loop {
        match bus.request::<_, CommittedV1>(subject.clone(), &msg, answer_within).await {
            Ok(c) => return Ok((c.revision, c.versions)),
            Err(BusError::Remote { code: ErrorCode::Conflict, .. }) if unanswered => {
                return landed_copy(&bus, &msg, STORE_TIMEOUT).await;
            }
            // no copy reached a store yet: nothing landed, and a store that stays
            // down fails the save within seconds
            Err(e @ BusError::NoResponders { .. }) if !unanswered => {
                if tokio::time::Instant::now() >= started + schemas::bus::ABSENT_PATIENCE {
                    return Err(e);
                }
                tokio::time::sleep(ABSENT_RETRY).await;
            }
            // a copy may have landed: only the store can say
            Err(e @ (BusError::TimedOut { .. } | BusError::NoResponders { .. }))
                if tokio::time::Instant::now() < deadline =>
            {
                tracing::warn!(exec = %msg.exec_id, error = %e, "a commit got no answer; sending it again");
                unanswered = true;
                tokio::time::sleep(COMMIT_RETRY).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// After a commit that got no answer and a copy of it that conflicted: the
/// commit's result if the session's latest revision is its execution's, else the
/// conflict.
async fn landed_copy(
    bus: &Bus,
    msg: &CommitV2,
    answer_within: Duration,
) -> Result<(u64, Vec<(String, Uuid)>), BusError> {
    let get = ManifestGetV2 { session: msg.session, at_least: None };
    let subject = bus.subjects().store(StoreVerb::ManifestGet);
    let m = bus.request_idempotent::<_, ManifestV2>(subject, &get, answer_within).await?;
    let m = m.manifest;
    if m.exec_id != msg.exec_id {
        return Err(BusError::Remote {
            subject: bus.subjects().store(StoreVerb::Commit),
            code: ErrorCode::Conflict,
            message: format!("revision {} was committed by another execution", m.revision),
        });
    }
    let names = msg.delta.variables.keys().chain(msg.delta.unsavable.keys());
    let versions = names
        .filter_map(|n| {
            let v = m.variables.get(n).map(|v| v.version).or_else(|| m.unsavable.get(n).map(|u| u.version));
            v.map(|v| (n.clone(), v))
        })
        .collect();
    Ok((m.revision, versions))
}

#[cfg(test)]
mod commit_tests {
    use super::*;
    use looseleaf_test_support::{random_prefix, NatsServer};
    use schemas::checkpoint::{Delta, DeltaVar, VarEntry};
    use schemas::messages::Reply;

    /// The store commits the first copy but its answer is lost (it stalled past the
    /// deadline); the second copy conflicts: the save is the first copy's, not a
    /// failure (which would tell the user nothing was committed).
    #[actix_rt::test]
    async fn a_commit_whose_answer_was_lost_is_found_committed() -> anyhow::Result<()> {
        let nats = NatsServer::start()?;
        let prefix = random_prefix();
        let store = Bus::connect(nats.url(), &prefix, "fake-store").await?;
        let host = Bus::connect(nats.url(), &prefix, "host").await?;
        let (session, exec) = (Uuid::now_v7(), Uuid::now_v7());
        let mut commits = store.subscribe::<CommitV2>(store.subjects().store(StoreVerb::Commit)).await?;
        let mut gets = store.subscribe::<ManifestGetV2>(store.subjects().store(StoreVerb::ManifestGet)).await?;
        store.flush().await?;
        let fake = async move {
            // the first copy: committed, answer never sent
            let _first = commits.next().await;
            let second = commits.next().await.and_then(Result::ok);
            let conflict: Reply<CommittedV1> =
                Reply::Err { code: ErrorCode::Conflict, message: "revision 1 exists".into() };
            store.respond(second.and_then(|e| e.reply), &conflict).await.ok();
            let get = gets.next().await.and_then(Result::ok);
            let mut manifest = Manifest::empty(session);
            (manifest.revision, manifest.exec_id) = (1, exec);
            manifest.variables.insert(
                "x".into(),
                VarEntry { version: exec, oid: Some("o".into()), module: None, global_reads: vec![] },
            );
            store.respond(get.and_then(|e| e.reply), &Reply::Ok(ManifestV2 { manifest })).await.ok();
            store.flush().await.ok(); // the fake ends here: what it sent must leave first
        };
        actix_rt::spawn(fake);
        let mut delta = Delta::default();
        delta.variables.insert("x".into(), DeltaVar { oid: Some("o".into()), module: None, global_reads: vec![] });
        let msg = CommitV2 {
            session,
            base_revision: 0,
            exec_id: exec,
            host: "h".into(),
            worker: "w".into(),
            cell_id: "c".into(),
            delta,
            uploaded: vec![],
        };
        let (revision, versions) = commit_until_known(host, msg, Duration::from_millis(300)).await?;
        assert_eq!(revision, 1);
        assert_eq!(versions, vec![("x".to_string(), exec)]);
        Ok(())
    }
}
