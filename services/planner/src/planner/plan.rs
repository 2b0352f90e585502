//! Planning one run: derive its recipe against the session's committed manifest,
//! publish its `Planned` event and deliver the recipe to the hosts; and the
//! recipe and event builders that edits' speculative recipes share.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use schemas::checkpoint::Manifest;
use schemas::messages::{
    Device, EventKind, ManifestGetV2, ManifestV2, PinnedWorker, PreparedWorker, RecipeKind, RecipeV3, RunV3,
    SessionEventV2, SessionOptions,
};
use schemas::subjects::StoreVerb;
use schemas::{unix_ms, Bus, BusError};
use uuid::Uuid;

use super::hosts::LiveHosts;
use crate::analysis;
use crate::recipe::{derive, Derived};
use crate::state;

/// How long a run's recipe waits for a gpu-host to listen (hosts still starting),
/// within the frontend's default claim timeout (60 s).
pub const RECIPE_PATIENCE: Duration = Duration::from_secs(30);

pub(super) fn code_hash(code: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    code.hash(&mut h);
    h.finish()
}

/// Why a run could not be planned. What it says is what the user reads in the
/// `Failed` event (sent in one place, the run handler).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The session's manifest could not be read.
    #[error("planner could not read the session's state: {0}")]
    Manifest(#[source] BusError),
    /// The planner's own state for the session could not be read or written.
    #[error(transparent)]
    State(#[from] state::StateError),
    /// The planned event or the recipe could not be published.
    #[error("planner could not publish the recipe: {0}")]
    Publish(#[source] BusError),
    /// No gpu-host listened for the recipe within [`RECIPE_PATIENCE`].
    #[error("no gpu-host is running to take the cell: {0}")]
    NoHost(#[source] BusError),
    /// The cell asks (`%%gpu N`) for more GPUs than any live host has.
    #[error(
        "the cell asks for {asked} GPUs on one host (%%gpu {asked}), but the largest running gpu-host has {largest}"
    )]
    TooFewGpus {
        /// GPUs asked for.
        asked: u32,
        /// The most slots one live host has.
        largest: u32,
    },
    /// The cell is a GPU cell and its user's GPU quota is used up (the
    /// frontend's words, with what was used, the limit and when it resets).
    #[error("{0}")]
    GpuRefused(String),
}

/// The session's latest manifest; `at_least`: a revision known to be committed.
pub(super) async fn fetch_manifest(bus: &Bus, session: Uuid, at_least: Option<u64>) -> Result<Manifest, PlanError> {
    let get = ManifestGetV2 { session, at_least };
    bus.request_idempotent::<_, ManifestV2>(bus.subjects().store(StoreVerb::ManifestGet), &get, Duration::from_secs(30))
        .await
        .map(|m| m.manifest)
        .map_err(PlanError::Manifest)
}

/// What a recipe is for: the cell, the execution (nil while editing) and the code.
pub(super) struct For {
    pub(super) session: Uuid,
    pub(super) cell_id: String,
    pub(super) kind: RecipeKind,
    pub(super) exec_id: Uuid,
    pub(super) code: String,
    pub(super) run_unix_ms: u64,
    pub(super) options: SessionOptions,
    /// A run's `user_expressions`: their names need not be in the closure (the
    /// worker brings in what they read, as for `eval`).
    pub(super) user_expressions: BTreeMap<String, String>,
}

pub(super) fn recipe(
    f: For,
    revision: u64,
    manifest_revision: u64,
    d: &Derived,
    prepared: Option<PreparedWorker>,
) -> RecipeV3 {
    RecipeV3 {
        session: f.session,
        cell_id: f.cell_id,
        kind: f.kind,
        exec_id: f.exec_id,
        revision,
        code_hash: code_hash(&f.code),
        code: f.code,
        closure: d.closure.clone(),
        imports: d.imports.clone(),
        device: d.device,
        gpus: d.gpus,
        device_reason: d.device_reason.clone(),
        conservative: d.conservative.clone(),
        pinned: d.pinned.clone(),
        manifest_revision,
        run_unix_ms: f.run_unix_ms,
        options: f.options,
        prepared,
        speculate: false,
        user_expressions: f.user_expressions,
    }
}

/// The `Planned` event of `d`: for a run, or (nil `exec_id`) for an edit, so that
/// a client can show where the cell will run before Run.
pub(super) fn planned(session: Uuid, exec_id: Uuid, cell_id: &str, d: &Derived) -> SessionEventV2 {
    SessionEventV2 {
        session,
        exec_id,
        unix_ms: unix_ms(),
        kind: EventKind::Planned {
            cell_id: cell_id.to_string(),
            closure: d.closure.iter().map(|v| v.name.clone()).collect(),
            imports: d.imports.clone(),
            device: d.device,
            device_reason: d.device_reason.clone(),
            conservative: d.conservative.clone(),
            pinned: d.pinned.as_ref().map(|p| p.names.clone()).unwrap_or_default(),
        },
    }
}

pub(super) async fn plan_run(
    bus: Bus,
    kv: kv::Store,
    run: RunV3,
    prepared: Option<PreparedWorker>,
    cached: Option<Arc<Manifest>>,
    largest_host: Option<u32>,
    live_hosts: LiveHosts,
) -> Result<(Arc<Manifest>, state::SessionState, Option<PinnedWorker>), PlanError> {
    let analysis = analysis::analyze(&run.code);
    // The manifest refreshed after the session's last save is the one the run
    // follows (runs of a session are sequential) and saves a round trip to the
    // store; otherwise ask (the gateway never answers older than `after_revision`).
    let manifest = match cached.filter(|m| m.revision == run.after_revision) {
        Some(m) => m,
        None => Arc::new(fetch_manifest(&bus, run.session, Some(run.after_revision)).await?),
    };
    let cell_id = run.cell_id.clone();
    let refused = run.gpu_refused.is_some();
    let (d, revision, st) = state::modify(&kv, run.session, |st| {
        let mut d = derive(&analysis, &run.code, &manifest, st, run.options.all_gpu, run.exec_id, &cell_id);
        // a cell that reads no unsavable state is not sent to a worker that is gone
        if d.pinned.as_ref().is_some_and(|p| p.names.is_empty() && !live_hosts.may_keep(p, &manifest)) {
            d.pinned = None;
        }
        // refused a GPU: it never runs, so the session's state learns nothing of it
        if refused && d.device == Device::Gpu {
            return (d, 0, st.clone());
        }
        let revision = st.recipes.get(&cell_id).map(|r| r.0 + 1).unwrap_or(1);
        st.recipes.insert(cell_id.clone(), (revision, d.fingerprint()));
        st.learn(&d.writes);
        st.running.insert(run.exec_id, cell_id.clone());
        st.submodules.extend(analysis.imports.iter().filter(|m| m.contains('.') && !m.starts_with('.')).cloned());
        for name in &analysis.deletes {
            st.names.remove(name);
        }
        (d, revision, st.clone())
    })
    .await?;

    let planned = planned(run.session, run.exec_id, &run.cell_id, &d);
    bus.publish(bus.subjects().event(run.session), &planned).await.map_err(PlanError::Publish)?;
    // over quota: no slot is taken (a CPU cell runs as ever)
    if let Some(why) = run.gpu_refused.filter(|_| d.device == Device::Gpu) {
        return Err(PlanError::GpuRefused(why));
    }
    // no host would ever claim it: say so now rather than at the claim timeout
    if let Some(largest) = largest_host.filter(|largest| d.gpus > 1 && d.gpus > *largest) {
        return Err(PlanError::TooFewGpus { asked: d.gpus, largest });
    }
    let target = For {
        session: run.session,
        cell_id: run.cell_id,
        kind: RecipeKind::Run,
        exec_id: run.exec_id,
        code: run.code,
        run_unix_ms: run.run_unix_ms,
        options: run.options,
        user_expressions: run.user_expressions,
    };
    let r = recipe(target, revision, manifest.revision, &d, prepared);
    // hosts that are still starting get it once they listen
    bus.deliver(bus.subjects().recipe(run.session), &r, RECIPE_PATIENCE).await.map_err(PlanError::NoHost)?;
    Ok((manifest, st, d.pinned))
}
