//! The planner actor: for every run, derive the recipe against the session's
//! committed manifest and publish it to all hosts (naming the worker prepared for
//! the cell, if any); for edits, debounced per cell, publish an edit-derived recipe
//! when it changed, marked for preparation if the speculator admits it. Each run is
//! planned in its own future; a session's runs arrive one at a time (the frontend's
//! run queue).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use async_nats::jetstream::kv;
use schemas::bus::Rejected;
use schemas::checkpoint::Manifest;
use schemas::messages::{
    Device, EditV1, EventKind, EvictV1, HostStatusV2, ManifestGetV2, ManifestV1, PinnedWorker, PreparedWorker,
    RecipeKind, RecipeV3, RunV2, SessionCloseV1, SessionEventV2, SessionOptions,
};
use schemas::subjects::HostVerb;
use schemas::subjects::StoreVerb;
use schemas::{unix_ms, Bus, BusError, Envelope};
use tracing::Instrument;
use uuid::Uuid;

use crate::analysis;
use crate::recipe::{derive, Derived};
use crate::speculator::{Budget, Eviction, Ready, Speculator};
use crate::state;

/// How long a run's recipe waits for a gpu-host to listen (hosts still starting),
/// within the frontend's default claim timeout (60 s).
pub const RECIPE_PATIENCE: Duration = Duration::from_secs(30);

/// How long a planner remembers a run it heard: longer than the frontend keeps
/// sending one nobody acknowledged (`RunV2`'s patience, half the claim timeout).
const RUN_MEMORY: Duration = Duration::from_secs(300);

/// How long a run pinned to a worker is watched for its host's loss (the
/// frontend's claim deadline: a run not claimed by then has failed anyway).
const PINNED_MEMORY: Duration = Duration::from_secs(60);

/// How often the speculator's idle budget is enforced.
const BUDGET_TICK: Duration = Duration::from_secs(1);

/// The planner actor.
pub struct Planner {
    bus: Bus,
    kv: kv::Store,
    /// Latest manifest and planner state seen per session, for edits (runs always
    /// fetch both; a save refreshes the manifest).
    manifests: HashMap<Uuid, (Arc<Manifest>, Arc<state::SessionState>)>,
    /// Per (session, cell): recipe revision and fingerprint of the last speculative
    /// recipe; no fingerprint once the cell ran (its prepared worker, if any, is used
    /// or ended, so the next edit prepares again even with the same closure).
    speculative: HashMap<(Uuid, String), (u64, Option<u64>)>,
    /// The newest edit per (session, cell) waiting for its debounce timer.
    pending_edits: HashMap<(Uuid, String), (EditV1, tracing::Span)>,
    /// The code hash of each cell's latest run, until an edit changes its text: an
    /// edit of that same text (sent before Run, heard after it) prepares nothing.
    ran_code: HashMap<(Uuid, String), u64>,
    debounce: Duration,
    speculator: Speculator,
    clock: Instant,
    /// Runs sent to the worker that holds their unsavable variables, not claimed
    /// yet: exec -> (session, that worker).
    /// Forgotten after `PINNED_MEMORY` (with several planners another one may hear
    /// the Claimed event).
    pinned_runs: HashMap<Uuid, (Uuid, PinnedWorker, Instant)>,
    /// A host not heard for this long is lost (see `fail_runs_pinned_to_lost_hosts`).
    host_lost: Duration,
    /// Each host's GPU slots, as its status last said, and when that was heard.
    host_slots: HashMap<String, (u32, Instant)>,
    /// Each host's last status: when it was made and the workers it listed.
    host_workers: HashMap<String, (u64, HashSet<String>)>,
    /// Runs heard lately: a run the frontend sent again (its acknowledgement was
    /// lost) is planned once (ADR 46). Forgotten after `RUN_MEMORY`.
    heard_runs: HashMap<Uuid, Instant>,
}

impl Planner {
    /// A planner on `bus`, with session state in `kv`; edits of a cell are planned
    /// at most once per `debounce`; speculation stays within `budget`.
    pub fn new(bus: Bus, kv: kv::Store, debounce: Duration, budget: Budget) -> Self {
        Self {
            bus,
            kv,
            manifests: HashMap::new(),
            speculative: HashMap::new(),
            pending_edits: HashMap::new(),
            ran_code: HashMap::new(),
            debounce,
            speculator: Speculator::new(budget),
            clock: Instant::now(),
            pinned_runs: HashMap::new(),
            host_lost: Duration::from_secs(10),
            host_slots: HashMap::new(),
            host_workers: HashMap::new(),
            heard_runs: HashMap::new(),
        }
    }

    /// The most GPU slots one live host has; None until a host was heard (a
    /// planner just started cannot tell yet).
    fn largest_host(&self) -> Option<u32> {
        self.host_slots.values().filter(|(_, seen)| seen.elapsed() < self.host_lost).map(|(n, _)| *n).max()
    }

    /// The workers each live host (heard within `host_lost`) listed last, and when.
    fn live_hosts(&self) -> LiveHosts {
        let live = |h: &String| self.host_slots.get(h).is_some_and(|(_, seen)| seen.elapsed() < self.host_lost);
        LiveHosts(self.host_workers.iter().filter(|(h, _)| live(h)).map(|(h, w)| (h.clone(), w.clone())).collect())
    }

    /// Take a host not heard for `host_lost` for lost.
    pub fn with_host_lost(mut self, host_lost: Duration) -> Self {
        self.host_lost = host_lost;
        self
    }

    /// A run that must go to the worker holding its unsavable variables cannot run
    /// once that worker's host is lost: it fails at once, naming them, instead of
    /// waiting for a claim no host will make.
    fn fail_runs_pinned_to_lost_hosts(&mut self, ctx: &mut Context<Self>) {
        let now = self.now();
        let limit = self.host_lost.as_secs_f64();
        self.pinned_runs.retain(|_, (_, _, at)| at.elapsed() < PINNED_MEMORY);
        let lost: Vec<Uuid> = self
            .pinned_runs
            .iter()
            .filter(|(_, (_, p, _))| self.speculator.host_silent_for(&p.host, now) > limit)
            .map(|(exec, _)| *exec)
            .collect();
        for exec_id in lost {
            let Some((session, p, _)) = self.pinned_runs.remove(&exec_id) else { continue };
            let silent = self.speculator.host_silent_for(&p.host, now);
            let error = if p.names.is_empty() {
                format!(
                    "this cell was sent to worker {} on host {}, which held the session's unsavable variables, and \
                     that host is lost (not heard for {silent:.0} s): run the cell again",
                    p.worker, p.host
                )
            } else {
                format!(
                    "variables {} could not be saved and lived only in worker {} on host {}, which is lost (not \
                     heard for {silent:.0} s); they are gone, so this cell cannot run: run the cells that define them \
                     again",
                    p.names.join(", "),
                    p.worker,
                    p.host
                )
            };
            tracing::warn!(%session, exec = %exec_id, host = %p.host, "a run's unsavable state was on a lost host");
            let ev = SessionEventV2 { session, exec_id, unix_ms: unix_ms(), kind: EventKind::Failed { error } };
            let bus = self.bus.clone();
            ctx.spawn(
                async move {
                    if let Err(e) =
                        bus.publish_kept(bus.subjects().event(session), &ev, schemas::bus::KEPT_PATIENCE).await
                    {
                        tracing::error!(error = %e, "could not fail a run pinned to a lost host");
                    }
                }
                .into_actor(self),
            );
        }
    }

    fn now(&self) -> f64 {
        self.clock.elapsed().as_secs_f64()
    }

    fn send_evictions(&mut self, evictions: Vec<Eviction>, ctx: &mut Context<Self>) {
        for e in evictions {
            tracing::info!(session = %e.session, cell = %e.cell_id, host = %e.at.host, worker = %e.at.worker, reason = e.reason, "evicting a prepared worker");
            let bus = self.bus.clone();
            let msg = EvictV1 { session: e.session, worker: e.at.worker.clone(), reason: e.reason.to_string() };
            let subject = bus.subjects().host_command(&e.at.host, HostVerb::Evict);
            ctx.spawn(
                async move {
                    if let Err(err) = bus.publish(subject, &msg).await {
                        tracing::warn!(error = %err, "could not send an eviction");
                    }
                }
                .into_actor(self),
            );
        }
    }

    /// Plan the newest edit of a cell once its debounce timer fires.
    fn plan_edit(&mut self, key: (Uuid, String), ctx: &mut Context<Self>) {
        let Some((edit, span)) = self.pending_edits.remove(&key) else { return };
        let _entered = span.enter(); // the preparation continues the newest edit's trace
        let (manifest, st) = self
            .manifests
            .get(&edit.session)
            .cloned()
            .unwrap_or_else(|| (Arc::new(Manifest::empty(edit.session)), Arc::new(state::SessionState::default())));
        let analysis = analysis::analyze(&edit.code);
        // What the last run knew (function summaries included); edits change nothing stored.
        let d = derive(&analysis, &edit.code, &manifest, &st, edit.options.all_gpu, Uuid::nil(), &edit.cell_id);
        let fp = d.fingerprint();
        let revision = match self.speculative.get(&key) {
            Some((_, old)) if *old == Some(fp) => return,
            Some((rev, _)) => rev + 1,
            None => 1,
        };
        self.speculative.insert(key, (revision, Some(fp)));
        let speculate = if d.device == Device::Gpu && edit.options.speculate && d.pinned.is_none() {
            let now = self.now();
            let admission = self.speculator.admit(edit.session, &edit.cell_id, now);
            if let Some(why) = admission.refused {
                tracing::debug!(session = %edit.session, cell = %edit.cell_id, why, "not preparing");
            }
            self.send_evictions(admission.evict, ctx);
            admission.admit
        } else {
            false
        };
        let target = For {
            session: edit.session,
            cell_id: edit.cell_id,
            kind: RecipeKind::Speculative,
            exec_id: Uuid::nil(),
            code: edit.code,
            run_unix_ms: 0,
            options: edit.options,
            user_expressions: BTreeMap::new(),
        };
        let planned = planned(target.session, Uuid::nil(), &target.cell_id, &d);
        // the host that holds the cell's worker updates it; others leave the recipe
        let holder = self.speculator.held_on(target.session, &target.cell_id);
        let at = holder.map(|host| PreparedWorker { host, worker: String::new() });
        let mut r = recipe(target, revision, manifest.revision, &d, at);
        r.speculate = speculate;
        let bus = self.bus.clone();
        ctx.spawn(
            async move {
                // for the cell's badge (informational: a lost one costs nothing)
                if let Err(e) = bus.publish(bus.subjects().event(r.session), &planned).await {
                    tracing::debug!(error = %e, "could not publish an edit's plan");
                }
                if let Err(e) = bus.publish(bus.subjects().recipe(r.session), &r).await {
                    tracing::warn!(error = %e, "could not publish a speculative recipe");
                }
            }
            .instrument(span.clone())
            .into_actor(self),
        );
    }

    /// After a save (of `revision`), edits should see the new versions.
    fn refresh_manifest(&mut self, session: Uuid, revision: u64, ctx: &mut Context<Self>) {
        let bus = self.bus.clone();
        ctx.spawn(async move { fetch_manifest(&bus, session, Some(revision)).await }.into_actor(self).map(
            move |m, act, _| match m {
                Ok(m) => {
                    let st = act.manifests.get(&session).map(|(_, st)| st.clone()).unwrap_or_default();
                    act.manifests.insert(session, (Arc::new(m), st));
                }
                Err(e) => tracing::debug!(error = %e, "could not refresh a manifest"),
            },
        ));
    }
}

impl Actor for Planner {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(BUDGET_TICK, |act, ctx| {
            let now = act.now();
            let over = act.speculator.over_budget(now);
            act.send_evictions(over, ctx);
            act.fail_runs_pinned_to_lost_hosts(ctx);
        });
    }
}

fn code_hash(code: &str) -> u64 {
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
}

/// The session's latest manifest; `at_least`: a revision known to be committed.
async fn fetch_manifest(bus: &Bus, session: Uuid, at_least: Option<u64>) -> Result<Manifest, PlanError> {
    let get = ManifestGetV2 { session, at_least };
    bus.request_idempotent::<_, ManifestV1>(bus.subjects().store(StoreVerb::ManifestGet), &get, Duration::from_secs(30))
        .await
        .map(|m| m.manifest)
        .map_err(PlanError::Manifest)
}

/// What a recipe is for: the cell, the execution (nil while editing) and the code.
struct For {
    session: Uuid,
    cell_id: String,
    kind: RecipeKind,
    exec_id: Uuid,
    code: String,
    run_unix_ms: u64,
    options: SessionOptions,
    /// A run's `user_expressions`: their names need not be in the closure (the
    /// worker brings in what they read, as for `eval`).
    user_expressions: BTreeMap<String, String>,
}

fn recipe(f: For, revision: u64, manifest_revision: u64, d: &Derived, prepared: Option<PreparedWorker>) -> RecipeV3 {
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
fn planned(session: Uuid, exec_id: Uuid, cell_id: &str, d: &Derived) -> SessionEventV2 {
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

/// The workers live hosts listed in their last status, and when they said so.
struct LiveHosts(HashMap<String, (u64, HashSet<String>)>);

impl LiveHosts {
    /// Whether the worker a cell is pinned to may still hold the session's
    /// unsavable state: its host is live, and it listed the worker, or its last
    /// status predates the execution that made the state (give or take 2 s of
    /// clock difference between machines).
    fn may_keep(&self, p: &PinnedWorker, manifest: &Manifest) -> bool {
        let Some((at, workers)) = self.0.get(&p.host) else { return false };
        let made_ms = manifest
            .unsavable
            .values()
            .filter(|u| u.worker == p.worker)
            .filter_map(|u| u.version.get_timestamp())
            .map(|t| t.to_unix().0 * 1000)
            .max();
        workers.contains(&p.worker) || made_ms.is_none_or(|made| *at < made + 2000)
    }
}

async fn plan_run(
    bus: Bus,
    kv: kv::Store,
    run: RunV2,
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
    let (d, revision, st) = state::modify(&kv, run.session, |st| {
        let mut d = derive(&analysis, &run.code, &manifest, st, run.options.all_gpu, run.exec_id, &cell_id);
        // a cell that reads no unsavable state is not sent to a worker that is gone
        if d.pinned.as_ref().is_some_and(|p| p.names.is_empty() && !live_hosts.may_keep(p, &manifest)) {
            d.pinned = None;
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

impl StreamHandler<Result<Envelope<RunV2>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<RunV2>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let span = env.span("planner.run");
        // the frontend delivers runs (Bus::deliver): say it was heard
        let (acks, reply) = (self.bus.clone(), env.reply_to());
        ctx.spawn(async move { acks.acknowledge(reply).await }.into_actor(self));
        let (bus, kv, run) = (self.bus.clone(), self.kv.clone(), env.msg);
        let (session, exec_id) = (run.session, run.exec_id);
        self.heard_runs.retain(|_, at| at.elapsed() < RUN_MEMORY);
        if self.heard_runs.insert(exec_id, Instant::now()).is_some() {
            tracing::info!(%session, exec = %exec_id, "a run heard again (sent again unacknowledged): planned once");
            return;
        }
        // Run supersedes the cell's pending edit; its prepared worker (if any) runs it.
        self.pending_edits.remove(&(session, run.cell_id.clone()));
        self.ran_code.insert((session, run.cell_id.clone()), code_hash(&run.code));
        if let Some((_, fp)) = self.speculative.get_mut(&(session, run.cell_id.clone())) {
            *fp = None;
        }
        let prepared = if run.options.speculate { self.speculator.for_run(session, &run.cell_id) } else { None };
        let cached = self.manifests.get(&session).map(|(m, _)| m.clone());
        let largest_host = self.largest_host();
        let live_hosts = self.live_hosts();
        let fut = async move {
            let result = plan_run(bus.clone(), kv, run, prepared, cached, largest_host, live_hosts).await;
            if let Err(error) = &result {
                tracing::error!(%session, %error, "could not plan a run");
                let ev = SessionEventV2 {
                    session,
                    exec_id,
                    unix_ms: unix_ms(),
                    kind: EventKind::Failed { error: error.to_string() },
                };
                if let Err(e) = bus.publish_kept(bus.subjects().event(session), &ev, schemas::bus::KEPT_PATIENCE).await
                {
                    tracing::error!(error = %e, "could not report a planning failure");
                }
            }
            result.ok()
        }
        .instrument(span);
        ctx.spawn(fut.into_actor(self).map(move |planned, act, _| {
            if let Some((m, st, pinned)) = planned {
                act.manifests.insert(session, (m, Arc::new(st)));
                if let Some(p) = pinned {
                    act.pinned_runs.insert(exec_id, (session, p, Instant::now()));
                }
            }
        }));
    }
}

impl StreamHandler<Result<Envelope<EditV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<EditV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let span = env.span("planner.edit");
        let edit = env.msg;
        let key = (edit.session, edit.cell_id.clone());
        if self.pending_edits.get(&key).is_some_and(|(p, _)| p.seq > edit.seq) {
            return; // arrived out of order
        }
        // A blank cell needs no worker (an editor may send one as a cell is added).
        if edit.code.trim().is_empty() {
            return;
        }
        // The text that just ran (an editor's last edit, sent as Run was pressed):
        // a worker prepared for it would wait for a second Run no one asked for.
        match self.ran_code.get(&key) {
            Some(ran) if *ran == code_hash(&edit.code) => return,
            Some(_) => {
                self.ran_code.remove(&key);
            }
            None => {}
        }
        // Trailing-edge debounce: the first edit starts the timer, later ones replace
        // the text it will plan, so typing yields a recipe at most once per interval.
        if self.pending_edits.insert(key.clone(), (edit, span)).is_none() {
            ctx.run_later(self.debounce, move |act, ctx| act.plan_edit(key, ctx));
        }
    }
}

/// Learn from a finished cell: if its worker saw CUDA used, label the cell GPU
/// next time (DESIGN.md section 4; the "what the worker reported"); names
/// its closure missed are restored up front next time.
async fn learn(
    kv: kv::Store,
    session: Uuid,
    exec_id: Uuid,
    cuda_used: bool,
    faulted: Vec<String>,
) -> Result<(), state::StateError> {
    state::modify(&kv, session, |st| {
        if let Some(cell_id) = st.running.remove(&exec_id) {
            if !faulted.is_empty() {
                st.faulted.entry(cell_id.clone()).or_default().extend(faulted.iter().cloned());
            }
            if cuda_used {
                st.cuda_cells.insert(cell_id);
            } else {
                st.cuda_cells.remove(&cell_id);
            }
        }
    })
    .await
}

impl StreamHandler<Result<Envelope<SessionEventV2>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<SessionEventV2>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let (session, exec_id) = (env.msg.session, env.msg.exec_id);
        match env.msg.kind {
            EventKind::Finished { cuda_used, faulted, .. } => {
                let kv = self.kv.clone();
                ctx.spawn(
                    async move {
                        if let Err(e) = learn(kv, session, exec_id, cuda_used, faulted).await {
                            tracing::warn!(error = %e, "could not record a cell's CUDA use");
                        }
                    }
                    .into_actor(self),
                );
            }
            EventKind::Saved { revision, .. } => {
                self.pinned_runs.remove(&exec_id);
                self.refresh_manifest(session, revision, ctx)
            }
            // taken (or ended): no longer waiting for its host
            EventKind::Claimed { .. } | EventKind::Failed { .. } => {
                self.pinned_runs.remove(&exec_id);
            }
            EventKind::Preparing { host, cell_id, .. } => self.speculator.preparing(session, &cell_id, &host),
            EventKind::Ready { host, worker, cell_id, class, prepare_ms, slot, .. } => {
                let now = self.now();
                let ready = Ready { class, prepare_ms, holds_slot: slot.is_some() };
                self.speculator.ready(session, &cell_id, PreparedWorker { host, worker }, ready, now);
            }
            EventKind::PreparedEnded { worker, cell_id, idle_ms, slot, .. } => {
                let now = self.now();
                self.speculator.ended(session, &cell_id, &worker, idle_ms, slot.is_some(), now);
            }
            _ => {}
        }
    }
}

impl StreamHandler<Result<Envelope<HostStatusV2>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<HostStatusV2>, Rejected>, _ctx: &mut Self::Context) {
        if let Ok(env) = item {
            let now = self.now();
            self.speculator.host_seen(&env.msg.host, now);
            let slots = u32::try_from(env.msg.slots.len()).unwrap_or(u32::MAX);
            let workers = env.msg.workers.iter().map(|w| w.id.clone()).collect();
            self.host_workers.insert(env.msg.host.clone(), (env.msg.unix_ms, workers));
            self.host_slots.insert(env.msg.host, (slots, Instant::now()));
        }
    }
}

impl StreamHandler<Result<Envelope<SessionCloseV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<SessionCloseV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let session = env.msg.session;
        self.manifests.remove(&session);
        self.speculative.retain(|(s, _), _| *s != session);
        self.pending_edits.retain(|(s, _), _| *s != session);
        self.ran_code.retain(|(s, _), _| *s != session);
        self.speculator.close(session);
        let kv = self.kv.clone();
        ctx.spawn(
            async move {
                if let Err(e) = state::delete(&kv, session).await {
                    tracing::warn!(error = %e, "could not forget a session");
                }
            }
            .into_actor(self),
        );
    }
}
