//! Requests to the store and its answers: manifests, chunk plans, commits, settling
//! a run its frontend gave up, deleting a session's state, and garbage collection.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::frozen::{ChunkPlanV1, CommitV1, ManifestGetV1, ManifestV1};
use crate::checkpoint::{Delta, Manifest};
use crate::codec::WireMessage;

/// -> store: the latest manifest of a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestGetV2 {
    /// The session.
    pub session: Uuid,
    /// A revision the asker knows is committed (a run's `after_revision`, a
    /// recipe's `manifest_revision`): a gateway that remembers this revision or a
    /// newer one answers without asking the store whether another gateway has
    /// committed a newer one since. None: always ask (ADR 12).
    pub at_least: Option<u64>,
}

wire!(ManifestGetV2, "manifest-get", 2, upgrades ManifestGetV1 from 1);

/// frontend -> store: settle a run its frontend gave up (host lost, claim
/// timeout, interrupted before it started): reply the manifest that decides its
/// outcome, its own commit at `base_revision + 1` if its save landed, else a fence
/// the store commits there so that the run can never commit later (ADR 22).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SettleV1 {
    /// The session.
    pub session: Uuid,
    /// The run.
    pub exec_id: Uuid,
    /// The revision the run was based on (its `after_revision`).
    pub base_revision: u64,
}
wire!(SettleV1, "settle", 1);

/// host -> store: which of these chunks (content hashes) does the store lack? Asked
/// during a save, so the worker places only those in shared memory. Refused
/// (quota exceeded) when the session would hold more than its quota after the
/// save: nothing is uploaded then.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkPlanV2 {
    /// The saving session (its latest revision's chunks are known to be stored).
    pub session: Uuid,
    /// Chunk hashes the host does not know to be stored.
    pub hashes: Vec<String>,
    /// The bytes the session would hold after the save (its base revision with
    /// the save's delta applied), when the host knows them.
    pub bytes_after: Option<u64>,
}
wire!(ChunkPlanV2, "chunk-plan", 2, upgrades ChunkPlanV1 from 1);

/// store ->: the chunks of a plan the store lacks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkPlannedV1 {
    /// Hashes to upload.
    pub missing: Vec<String>,
}
wire!(ChunkPlannedV1, "chunk-planned", 1);

/// store ->: a session's manifest (revision 0 and empty if it never saved).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestV2 {
    /// The manifest, with its lineage.
    pub manifest: Manifest,
}
wire!(ManifestV2, "manifest", 2, upgrades ManifestV1 from 1);

/// frontend -> store: move a session's state to an earlier revision's by
/// committing that state again as the next revision (undo, checkout): a
/// metadata operation, no chunk is copied. Refused (conflict) if the session's
/// latest revision is no longer `base_revision`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RevertV1 {
    /// The session.
    pub session: Uuid,
    /// The revision the asker holds as the session's latest.
    pub base_revision: u64,
    /// Which state.
    pub to: RevertTo,
}
wire!(RevertV1, "revert", 1);

/// Which earlier state a revert commits again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RevertTo {
    /// The state before the cell that made the latest one (again: before the one
    /// before it).
    Undo,
    /// The state revision N committed.
    Revision(u64),
}

/// frontend -> store: fork session `parent` into the new session `child`, whose
/// first revision is the parent's latest state (its chunks shared, not copied).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ForkV1 {
    /// The session forked.
    pub parent: Uuid,
    /// A revision of it the asker knows is committed.
    pub at_least: Option<u64>,
    /// The new session (it must have no state yet).
    pub child: Uuid,
}
wire!(ForkV1, "fork", 1);

/// frontend -> store: check that a session's latest state can be restored:
/// every chunk its manifest references is stored (one in the trash comes back).
/// Asked before a detached session is resumed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateCheckV1 {
    /// The session.
    pub session: Uuid,
    /// A revision the asker knows is committed.
    pub at_least: Option<u64>,
}
wire!(StateCheckV1, "state-check", 1);

/// store ->: the session's latest manifest, and the chunks it references that
/// the store no longer has.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateCheckedV1 {
    /// The latest manifest.
    pub manifest: Manifest,
    /// How many of its chunks are gone.
    pub missing_chunks: u64,
    /// One of them, to name in an error.
    pub example: Option<String>,
}
wire!(StateCheckedV1, "state-checked", 1);

/// store ->: the revision a revert or fork committed, and what it holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateMovedV1 {
    /// The revision committed (the fork's first: 1).
    pub revision: u64,
    /// The revision whose state it holds (for a fork: the parent's).
    pub state_of: u64,
    /// Live savable names.
    pub variables: u64,
    /// Bytes of their records and payloads.
    pub bytes: u64,
    /// Names that could not be saved: not in this state.
    pub unsavable: Vec<String>,
}
wire!(StateMovedV1, "state-moved", 1);

/// host -> store: commit a worker's save as revision `base_revision + 1`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommitV2 {
    /// The session.
    pub session: Uuid,
    /// The revision the worker's state was based on.
    pub base_revision: u64,
    /// The execution whose results these are.
    pub exec_id: Uuid,
    /// The host that holds the worker.
    pub host: String,
    /// The worker (kept if it holds unsavable variables).
    pub worker: String,
    /// The cell id (named in errors about unsavable variables).
    pub cell_id: String,
    /// What changed.
    pub delta: Delta,
    /// Chunks the host stored for this save (their puts succeeded). They are
    /// younger than the collector's grace period, so the gateway does not look
    /// them up again; it still checks every other chunk new to the base (ADR 12).
    pub uploaded: Vec<String>,
}

wire!(CommitV2, "commit", 2, upgrades CommitV1 from 1);

/// store -> host: the commit's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommittedV1 {
    /// The new revision.
    pub revision: u64,
    /// Versions of every name the worker holds, after the commit.
    pub versions: Vec<(String, Uuid)>,
    /// Names whose version is now this execution.
    pub changed: Vec<String>,
}
wire!(CommittedV1, "committed", 1);

/// -> store: delete a session's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionDeleteV1 {
    /// The session.
    pub session: Uuid,
}
wire!(SessionDeleteV1, "session-delete", 1);

/// -> store: collect garbage: manifest revisions older than the newest
/// `keep_revisions` of each session, then chunks no kept revision references and
/// that are older than `grace_secs` (a save in flight uploads its chunks before it
/// commits, so young chunks are left alone).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GcV1 {
    /// Revisions kept per session (at least 1).
    pub keep_revisions: u64,
    /// Chunks younger than this are never collected.
    pub grace_secs: u64,
}
wire!(GcV1, "gc", 1);

/// store ->: what a collection removed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GcDoneV1 {
    /// Old manifest revisions deleted.
    pub manifests_deleted: u64,
    /// Chunks deleted.
    pub chunks_deleted: u64,
    /// Bytes of the chunks deleted.
    pub bytes_freed: u64,
    /// Chunks still referenced (or too young).
    pub chunks_kept: u64,
}
wire!(GcDoneV1, "gc-done", 1);

/// store -> frontends: the store's volume is still low on space after garbage
/// collection; one frontend discards the oldest detached session (its chunks
/// that nothing else references are freed). Sent every few seconds while it
/// lasts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StorePressureV1 {
    /// Bytes free.
    pub free: u64,
    /// The volume's size.
    pub total: u64,
    /// The free space it collects garbage below (`--gc-free-bytes`).
    pub threshold: u64,
}
wire!(StorePressureV1, "store-pressure", 1);
