//! The host actor: competes for recipes (DESIGN.md section 5) and hands each won
//! recipe to an execution future ([`crate::exec`]). What it owns lives in one
//! module per concern: [`slots`] (GPU slots and what holds them), [`claims`] (the
//! one way to claim anything), [`prepared`] (workers prepared before Run),
//! [`kept`] (CPU workers and workers holding unsavable state) and [`status`].
//!
//! ```text
//!  run recipes ──▶ Host ──claim──▶ execution future ──▶ exec_done ──▶ Host
//!  edit recipes (admitted) ──▶ Host ──claim──▶ prepare future ──▶ Ready (idle)
//!  run recipe for a prepared cell ──▶ its host claims at once, runs on that worker
//!  events  ──▶ Host (drop pending recipes another host claimed)
//!  evict   ──▶ Host (stop a prepared worker)     closes ──▶ Host (stop the session's workers)
//!  tick    ──▶ status, claim renewal, reap dead prepared workers
//! ```
//!
//! A run never waits for a prepared worker of another session: when no slot is
//! free it evicts an idle one.

pub mod claims;
pub mod kept;
pub mod placement;
pub mod prepared;
pub mod slots;
mod status;

use std::collections::{HashMap, VecDeque};
use std::future::Future;

use futures::FutureExt as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::messages::{
    BidV1, CommAnswerV1, CommV1, Device, ErrorCode, EventKind, EvictV1, HostStatusV2, InputReplyV1, InterruptV1,
    Prepare, PreparedClass, PreparedOutcome, QueryAnswerV1, QueryKind, QueryV1, RecipeKind, RecipeV3, Reply,
    SessionCloseV1, SessionEventV2, SessionIdleV1, SlotUse, WorkerState, ZygoteStatus,
};
use schemas::{unix_ms, Envelope};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::exec::{ExecEnv, ExecError, Outcome, Target};
use crate::gpus::Gpu;
use crate::protocol::Frame;
use crate::worker::WorkerProc;
use claims::{Claim, ClaimKey, Claims};
use kept::{KeptWorker, KeptWorkers};
use prepared::{Phase, PrepKey, PreparedWorker, PreparedWorkers};
use slots::{SlotState, Slots};

/// How often status is published and claims renewed.
const TICK: Duration = Duration::from_secs(2);

/// A run whose recipe names another host's prepared worker: that host claims it at
/// once; the others compete only if it has not after this long (it may be gone).
const PREPARED_FALLBACK: Duration = Duration::from_secs(2);

/// How long an admitted edit recipe may wait for a slot on this host (the
/// simulator's hosts wait as long).
pub const SPEC_WAIT: Duration = Duration::from_secs(5);

/// The host actor.
pub struct Host {
    env: ExecEnv,
    claims: Claims,
    slots: Slots,
    real_gpus: bool,
    kept: KeptWorkers,
    prepared: PreparedWorkers,
    /// Run recipes this host may still claim once a slot frees.
    pending: VecDeque<RecipeV3>,
    /// Runs this host claimed that wait for a slot.
    won: VecDeque<RecipeV3>,
    /// GPU runs for a kept worker that holds no slot, waiting for free slots.
    kept_waiting: VecDeque<RecipeV3>,
    /// Prepared workers (without a slot) whose run waits for a slot.
    waiting_prepared: VecDeque<PrepKey>,
    /// Admitted edit recipes that found no free slot (the planner's eviction that
    /// makes room may arrive just after): the newest per cell, tried when a slot frees.
    spec_waiting: VecDeque<(Instant, RecipeV3)>,
    /// Run recipes seen per GPU cell: an edit recipe still being claimed when a
    /// run of its cell arrives prepares nothing (the run serves the cell).
    runs_of_cell: HashMap<PrepKey, u64>,
    /// Cells whose preparation this host is claiming, with the newest revision
    /// that arrived meanwhile (applied in place if this host wins).
    claiming_prep: HashMap<PrepKey, Option<RecipeV3>>,
    /// Prepare every worker with its slot (see `Config::prepare_holds_slot`).
    prepare_holds_slot: bool,
    /// Keep a GPU worker warm (with its slot) after its cell, for a re-run of
    /// the cell, until the planner's budget evicts it (see `Config::keep_warm`).
    keep_warm: bool,
    /// Zygotes as last seen (the cache is locked while a fork is under way).
    last_zygotes: Vec<ZygoteStatus>,
    /// Each run recipe as it arrived (a start's phases count from there, its
    /// spans continue the cell's trace); runs other hosts took are forgotten after
    /// a while.
    arrived: HashMap<Uuid, Arrival>,
    /// Other hosts as their status last said: free slots, and when it was heard.
    peers: HashMap<String, (usize, Instant)>,
    /// Executions under way (exec -> session), and their number for a stopping host
    /// to wait on.
    running: HashMap<Uuid, Uuid>,
    running_count: tokio::sync::watch::Sender<usize>,
    /// When this host started (it judges other hosts lost only after a while).
    started: Instant,
    /// CPU runs whose session's CPU worker is on another host (see `retry_cpu_runs`).
    cpu_waiting: Vec<(Instant, RecipeV3)>,
}

/// A peer not heard from for this long (three status ticks) is not competing.
const PEER_STALE: Duration = Duration::from_secs(6);

/// How long the arrival of a run recipe this host did not run is remembered.
const ARRIVAL_MEMORY: Duration = Duration::from_secs(60);

/// How long after a failed run claim (the claims bucket unreachable even after
/// waiting out an election) the host tries that run again.
const CLAIM_RETRY: Duration = Duration::from_secs(2);

/// Which worker an execution got, for what happens to it afterwards.
enum ExecKind {
    /// Forked for the cell (holding `slots`, if a GPU cell).
    Fresh { slots: Vec<u32> },
    /// A worker prepared before Run, holding GPU `slots`.
    Prepared { slots: Vec<u32> },
    /// A kept worker (the session's CPU worker, or one with unsavable state),
    /// and the GPU slots lent to it for this run (it held none before).
    Existing { worker: Arc<Mutex<WorkerProc>>, lent: Vec<u32> },
}

/// A run recipe as this host received it.
struct Arrival {
    /// When: a start's phases count from here.
    at: Instant,
    /// The span of its receipt, in the cell's trace: its claim and execution
    /// are children of it.
    span: tracing::Span,
    /// The span of the preparation whose worker runs it, if one does.
    prepared_by: Option<tracing::Span>,
}

impl Host {
    /// A host with `slots` (real GPUs or virtual ones), claiming through `claims`.
    pub fn new(
        env: ExecEnv,
        claims: Claims,
        slots: Vec<Gpu>,
        real_gpus: bool,
        prepare_holds_slot: bool,
        keep_warm: bool,
    ) -> Self {
        Self {
            env,
            claims,
            slots: Slots::new(slots),
            real_gpus,
            kept: KeptWorkers::default(),
            prepared: PreparedWorkers::default(),
            pending: VecDeque::new(),
            won: VecDeque::new(),
            kept_waiting: VecDeque::new(),
            waiting_prepared: VecDeque::new(),
            spec_waiting: VecDeque::new(),
            runs_of_cell: HashMap::new(),
            claiming_prep: HashMap::new(),
            prepare_holds_slot,
            keep_warm,
            last_zygotes: Vec::new(),
            arrived: HashMap::new(),
            peers: HashMap::new(),
            running: HashMap::new(),
            running_count: tokio::sync::watch::Sender::new(0),
            started: Instant::now(),
            cpu_waiting: Vec::new(),
        }
    }

    /// How long to wait before claiming `recipe`, and the score it comes from: a
    /// better-placed host waits less (DESIGN.md section 5; the rule is
    /// [`placement::claim_delay`]). Random jitter up to `MAX_JITTER` breaks ties.
    ///
    /// The delay only lets a better-placed host win; with no other host that has a
    /// free slot (as their status says) nobody could, and this host claims at once.
    /// (Stale status only costs placement: the KV create still picks one host.)
    fn claim_delay(&self, recipe: &RecipeV3) -> (Duration, f64) {
        let (zygote, cached) = self.env.placement(recipe);
        let standing = placement::Standing {
            free_share: self.slots.free_share(),
            zygote,
            cached,
            competitor_has_room: self.competitor_has_room(recipe.gpus.max(1)),
        };
        let jitter = Duration::from_micros((Uuid::new_v4().as_u128() % placement::MAX_JITTER.as_micros()) as u64);
        placement::claim_delay(standing, jitter)
    }

    /// The hosts alive as far as this one knows: itself, and every other one whose
    /// status was heard lately; None until this host has listened long enough to
    /// have heard every live one.
    fn live_hosts(&self) -> Option<std::collections::HashSet<String>> {
        if self.started.elapsed() < PEER_STALE {
            return None;
        }
        let peers = self.peers.iter().filter(|(_, (_, seen))| seen.elapsed() < PEER_STALE).map(|(h, _)| h.clone());
        Some(peers.chain(std::iter::once(self.env.host_id.clone())).collect())
    }

    /// Whether another live host has `n` free slots.
    fn competitor_has_room(&self, n: u32) -> bool {
        self.peers.values().any(|(free, seen)| *free >= n as usize && seen.elapsed() < PEER_STALE)
    }

    /// Claim `key` after `delay`, then continue in the actor with how it settled.
    fn claim(
        &mut self,
        key: ClaimKey,
        delay: Duration,
        ctx: &mut Context<Self>,
        then: impl FnOnce(&mut Self, Claim, &mut Context<Self>) + 'static,
    ) {
        let claims = self.claims.clone();
        // only a CPU worker's claim can be taken over from a lost host
        let live = if matches!(key, ClaimKey::Cpu(_)) { self.live_hosts() } else { None };
        let kind = key.kind();
        // a run's bid and claim are part of its cell's trace
        let parent = match &key {
            ClaimKey::Run(exec) => self.arrived.get(exec).map(|a| a.span.clone()),
            _ => None,
        };
        let span = tracing::info_span!(parent: parent.as_ref().unwrap_or(&tracing::Span::current()), "claim",
            otel.name = "bid and claim", claim = ?key, bid.delay_ms = delay.as_secs_f64() * 1000.0,
            outcome = tracing::field::Empty);
        let recorded = span.clone();
        let fut = tracing::Instrument::instrument(async move { claims.claim(key, delay, live).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |c, act, ctx| {
            recorded.record("outcome", tracing::field::debug(&c));
            schemas::metrics::metrics().claims.get_or_create(&[("claim", kind), ("outcome", c.as_str())]).inc();
            let _entered = recorded.enter(); // what the claim leads to (prepare, execute) follows it
            then(act, c, ctx)
        }));
    }

    /// Run `fut` in the background (publishing, stopping workers): its failures
    /// are its own to log.
    fn background(&mut self, fut: impl Future<Output = ()> + 'static, ctx: &mut Context<Self>) {
        ctx.spawn(fut.into_actor(self));
    }

    /// Say how this host scored itself for a run and whether it won.
    fn publish_bid(&mut self, exec_id: Uuid, score: f64, delay: Duration, won: bool, ctx: &mut Context<Self>) {
        let bus = self.env.bus.clone();
        let bid = BidV1 { exec_id, host: self.env.host_id.clone(), score, delay_ms: delay.as_secs_f64() * 1000.0, won };
        self.background(
            async move {
                if let Err(e) = bus.publish(bus.subjects().host_bid(&bid.host), &bid).await {
                    tracing::debug!(error = %e, "could not publish a bid");
                }
            },
            ctx,
        );
    }

    fn session_event(&mut self, session: Uuid, kind: EventKind, ctx: &mut Context<Self>) {
        let ev = SessionEventV2 { session, exec_id: Uuid::nil(), unix_ms: unix_ms(), kind };
        let bus = self.env.bus.clone();
        self.background(
            async move {
                if let Err(e) = bus.publish_kept(bus.subjects().event(session), &ev, schemas::bus::KEPT_PATIENCE).await
                {
                    tracing::error!(error = %e, "could not publish a session event");
                }
            },
            ctx,
        );
    }

    /// Move a worker this host holds (idle, so its id is known) to `to`.
    fn enter(&self, worker: &str, to: WorkerState) {
        self.env.lifecycle.advance(worker, to);
    }

    /// Free `slots` held by `session` for `held`, counting each one's time (a
    /// `%%gpu N` cell holds N slots, and uses N times the slot time).
    fn release_slots(&mut self, slots: &[u32], session: Uuid, held: SlotUse, ctx: &mut Context<Self>) {
        for &index in slots {
            let Some(held_ms) = self.slots.release(index) else { continue };
            schemas::metrics::metrics()
                .slot_seconds
                .get_or_create(&[("use", schemas::metrics::slot_use(held))])
                .inc_by(held_ms / 1000.0);
            let kind = EventKind::SlotReleased { host: self.env.host_id.clone(), slot: index, held_ms, reason: held };
            self.session_event(session, kind, ctx);
        }
    }

    /// Stop a worker process; it is Evicted from now on, so the status published
    /// next no longer lists it.
    fn stop_worker(&mut self, worker: Arc<Mutex<WorkerProc>>, ctx: &mut Context<Self>) {
        self.enter(&worker_id(&worker), WorkerState::Evicted);
        self.background(stop(worker), ctx);
    }

    // ---------------------------------------------------------------- routing

    fn on_recipe(&mut self, recipe: RecipeV3, ctx: &mut Context<Self>) {
        if self.env.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return; // a stopping host takes nothing new; other hosts will
        }
        if recipe.kind != RecipeKind::Run {
            self.on_edit_recipe(recipe, ctx);
            return;
        }
        // the recipe's span (entered by the handler) continues the cell's trace
        self.arrived.entry(recipe.exec_id).or_insert_with(|| Arrival {
            at: Instant::now(),
            span: tracing::Span::current(),
            prepared_by: None,
        });
        if let Some(p) = &recipe.pinned {
            if p.host != self.env.host_id {
                return;
            }
            if self.kept.get(&p.worker).is_some() {
                self.run_kept(recipe, ctx);
                return;
            }
            if !p.names.is_empty() {
                // gone: the execution fails naming the variable and its cell
                self.claim_run_then_exec(recipe, Target::Fresh { slots: vec![] }, ctx);
                return;
            }
            // The worker that held the session's unsavable state is gone, and this
            // cell reads none of it: it runs as any other cell (ADR 51).
            let mut r = recipe;
            r.pinned = None;
            self.on_recipe(r, ctx);
            return;
        }
        match recipe.device {
            Device::Cpu => self.claim_cpu(recipe, ctx),
            Device::Gpu => {
                // a `%%gpu N` cell runs only on a host with N slots
                if self.slots.len() < recipe.gpus.max(1) {
                    return;
                }
                let key = (recipe.session, recipe.cell_id.clone());
                self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
                *self.runs_of_cell.entry(key.clone()).or_default() += 1;
                if self.prepared.contains(&key) {
                    self.claim_prepared_run(key, recipe, ctx);
                    return;
                }
                if let Some(p) = &recipe.prepared {
                    if p.host != self.env.host_id {
                        let mut r = recipe;
                        r.prepared = None;
                        ctx.run_later(PREPARED_FALLBACK, move |act, ctx| act.on_recipe(r, ctx));
                        return;
                    }
                }
                match self.slots.free(recipe.gpus.max(1)) {
                    Some(slots) => self.claim_gpu(recipe, slots, ctx),
                    None if self.can_free(recipe.gpus.max(1)) => self.claim_then_evict(recipe, ctx),
                    None => self.pending.push_back(recipe),
                }
            }
        }
    }

    // ---------------------------------------------------------------- runs

    fn claim_gpu(&mut self, recipe: RecipeV3, slots: Vec<u32>, ctx: &mut Context<Self>) {
        // scored before the slots are reserved: free slots are what this host offers
        let (delay, score) = self.claim_delay(&recipe);
        self.slots.take(&slots, SlotState::Claiming(Some(recipe.exec_id)));
        self.claim(ClaimKey::Run(recipe.exec_id), delay, ctx, move |act, claim, ctx| {
            act.publish_bid(recipe.exec_id, score, delay, claim == Claim::Won, ctx);
            if claim == Claim::Won {
                act.slots.hand_on(&slots, SlotState::Busy { exec: recipe.exec_id, session: recipe.session });
                act.spawn_exec(recipe, Target::Fresh { slots }, ctx);
            } else {
                act.slots.unreserve(&slots);
                if claim == Claim::Failed {
                    act.retry_failed_claim(recipe, ctx);
                }
                act.try_pending(ctx);
            }
            act.publish_status(ctx);
        });
    }

    /// Too few slots free, but idle prepared workers could give theirs up: claim first
    /// (with the longest delay, as a full host), evict only if this host won.
    fn claim_then_evict(&mut self, recipe: RecipeV3, ctx: &mut Context<Self>) {
        let (delay, score) = self.claim_delay(&recipe);
        self.claim(ClaimKey::Run(recipe.exec_id), delay, ctx, move |act, claim, ctx| {
            act.publish_bid(recipe.exec_id, score, delay, claim == Claim::Won, ctx);
            match claim {
                Claim::Won => act.run_won(recipe, ctx),
                Claim::Failed => act.retry_failed_claim(recipe, ctx),
                Claim::Lost | Claim::Mine => {}
            }
        });
    }

    fn claim_cpu(&mut self, recipe: RecipeV3, ctx: &mut Context<Self>) {
        if let Some(k) = self.kept.cpu_worker(recipe.session) {
            let target = Target::Existing { worker: k.worker.clone(), prepare: Prepare::Persistent, slots: vec![] };
            self.claim_run_then_exec(recipe, target, ctx);
            return;
        }
        // mine already when the session's CPU worker died and this host restarts it
        self.claim(ClaimKey::Cpu(recipe.session), Duration::ZERO, ctx, move |act, claim, ctx| {
            match claim {
                Claim::Won | Claim::Mine => act.claim_run_then_exec(recipe, Target::Fresh { slots: vec![] }, ctx),
                // the session's CPU worker lives on another host; should that host
                // be lost before it claims the run, this one takes over (on a tick)
                Claim::Lost => act.cpu_waiting.push((Instant::now(), recipe)),
                Claim::Failed => act.retry_failed_claim(recipe, ctx),
            }
        });
    }

    /// A run for a kept worker of this host (the session's CPU worker, or the one
    /// holding its unsavable state). A GPU cell on a kept worker that holds no
    /// slot (it never used CUDA) is lent free slots for the run, or waits for them.
    fn run_kept(&mut self, recipe: RecipeV3, ctx: &mut Context<Self>) {
        let Some(worker_key) = recipe.pinned.as_ref().map(|p| p.worker.clone()) else { return };
        if self.kept.get(&worker_key).is_none() {
            // gone while the run waited for a slot: routed as a run for a lost worker
            self.on_recipe(recipe, ctx);
            return;
        }
        let Some(k) = self.kept.get(&worker_key) else { return };
        let prepare = if k.persistent { Prepare::Persistent } else { Prepare::Pinned };
        let worker = k.worker.clone();
        if recipe.device != Device::Gpu || !k.slots.is_empty() {
            let target = Target::Existing { worker, prepare, slots: k.slots.clone() };
            self.claim_run_then_exec(recipe, target, ctx);
            return;
        }
        let Some(slots) = self.slots.free(recipe.gpus.max(1)) else {
            self.kept_waiting.push_back(recipe);
            return;
        };
        self.slots.take(&slots, SlotState::Claiming(Some(recipe.exec_id)));
        self.claim(ClaimKey::Run(recipe.exec_id), Duration::ZERO, ctx, move |act, claim, ctx| match claim {
            Claim::Won => {
                act.slots.hand_on(&slots, SlotState::Busy { exec: recipe.exec_id, session: recipe.session });
                act.spawn_exec(recipe, Target::Existing { worker, prepare, slots }, ctx);
            }
            other => {
                act.slots.unreserve(&slots);
                if other == Claim::Failed {
                    act.retry_failed_claim(recipe, ctx);
                }
                act.try_pending(ctx);
            }
        });
    }

    /// A run that needs no competition (on the session's CPU worker, or on the
    /// worker pinned for its state) still claims its run key like every other run:
    /// nothing starts an execution twice, and one the user interrupted before any
    /// host claimed it (the frontend claims it then) never starts.
    fn claim_run_then_exec(&mut self, recipe: RecipeV3, target: Target, ctx: &mut Context<Self>) {
        self.claim(ClaimKey::Run(recipe.exec_id), Duration::ZERO, ctx, move |act, claim, ctx| match claim {
            Claim::Won => act.spawn_exec(recipe, target, ctx),
            Claim::Failed => act.retry_failed_claim(recipe, ctx),
            Claim::Lost | Claim::Mine => {
                tracing::info!(exec = %recipe.exec_id, "run not claimed (taken, or interrupted before it started)");
            }
        });
    }

    /// CPU runs another host's worker should have taken: those still unclaimed once
    /// that host is lost are claimed again (the claim takes the lost host's over).
    fn retry_cpu_runs(&mut self, ctx: &mut Context<Self>) {
        self.cpu_waiting.retain(|(at, _)| at.elapsed() < ARRIVAL_MEMORY);
        let Some(live) = self.live_hosts() else { return };
        let holders_lost = self.peers.keys().any(|h| !live.contains(h));
        if !holders_lost {
            return;
        }
        for (_, recipe) in std::mem::take(&mut self.cpu_waiting) {
            self.claim_cpu(recipe, ctx);
        }
    }

    /// A run whose claim failed: the claims bucket could not be reached, so nobody
    /// is known to hold it, and it is no other host's to run. Route it again
    /// shortly, for as long as this host remembers its arrival (past that, the
    /// frontend has given up on it and holds its claim).
    fn retry_failed_claim(&mut self, recipe: RecipeV3, ctx: &mut Context<Self>) {
        let exec = recipe.exec_id;
        if self.arrived.get(&exec).is_none_or(|a| a.at.elapsed() >= ARRIVAL_MEMORY) {
            tracing::warn!(%exec, "gave up a run whose claim kept failing");
            return;
        }
        tracing::warn!(%exec, "could not claim the run; trying again in {CLAIM_RETRY:?}");
        ctx.run_later(CLAIM_RETRY, move |act, ctx| act.on_recipe(recipe, ctx));
    }

    /// A run this host claimed without a prepared worker: free slots, or idle
    /// prepared workers' slots, or wait for them.
    fn run_won(&mut self, recipe: RecipeV3, ctx: &mut Context<Self>) {
        match self.take_slots(recipe.gpus.max(1), ctx) {
            Some(slots) => {
                self.slots.take(&slots, SlotState::Busy { exec: recipe.exec_id, session: recipe.session });
                self.spawn_exec(recipe, Target::Fresh { slots }, ctx);
            }
            None => self.won.push_back(recipe),
        }
        self.publish_status(ctx);
    }

    fn spawn_exec(&mut self, recipe: RecipeV3, target: Target, ctx: &mut Context<Self>) {
        let env = self.env.clone();
        let kind = match &target {
            Target::Fresh { slots } => ExecKind::Fresh { slots: slots.clone() },
            Target::Existing { prepare: Prepare::Speculative | Prepare::Warm, slots, .. } if !slots.is_empty() => {
                ExecKind::Prepared { slots: slots.clone() }
            }
            Target::Existing { worker, slots, .. } => {
                // slots the kept worker holds stay its own; others were lent for the run
                let holds = self.kept.get(&worker_id(worker)).is_some_and(|k| !k.slots.is_empty());
                ExecKind::Existing { worker: worker.clone(), lent: if holds { vec![] } else { slots.clone() } }
            }
        };
        let (device, session, cell_id) = (recipe.device, recipe.session, recipe.cell_id.clone());
        if device == Device::Gpu && recipe.options.speculate && matches!(kind, ExecKind::Fresh { .. }) {
            schemas::metrics::metrics().speculation_misses.inc();
        }
        let arrival = self.arrived.remove(&recipe.exec_id);
        let exec_id = recipe.exec_id;
        self.running.insert(exec_id, session);
        self.running_count.send_replace(self.running.len());
        let parent = arrival.as_ref().map_or_else(tracing::Span::current, |a| a.span.clone());
        let span = tracing::info_span!(parent: &parent, "execute", exec = %recipe.exec_id, %session,
            cell = %recipe.cell_id, prepare = tracing::field::Empty);
        if let Some(prepared_by) = arrival.as_ref().and_then(|a| a.prepared_by.as_ref()) {
            schemas::telemetry::link(&span, prepared_by); // the edit-time preparation this run used
        }
        let arrived = arrival.map(|a| a.at);
        let fut = tracing::Instrument::instrument(async move { env.execute(recipe, target, arrived).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |outcome, act, ctx| {
            act.running.remove(&exec_id);
            act.running_count.send_replace(act.running.len());
            act.exec_done(session, &cell_id, device, kind, outcome, ctx);
        }));
    }

    /// After an execution: keep, warm or stop its worker, and free or keep its slot.
    fn exec_done(
        &mut self,
        session: Uuid,
        cell_id: &str,
        device: Device,
        kind: ExecKind,
        outcome: Outcome,
        ctx: &mut Context<Self>,
    ) {
        match kind {
            // a prepared worker ends like a fresh one: its slot goes free, stays
            // pinned for unsavable state, or stays with the worker kept warm
            ExecKind::Fresh { slots } | ExecKind::Prepared { slots } if !slots.is_empty() => match outcome.worker {
                Some(worker) if !outcome.unsavable.is_empty() => {
                    let id = worker_id(&worker);
                    tracing::info!(worker = %id, unsavable = ?outcome.unsavable, cuda = outcome.cuda_used,
                        "keeping the worker for unsavable state");
                    self.enter(&id, WorkerState::Kept);
                    // a slot stays with the worker only while it holds GPU memory
                    let slots = if outcome.cuda_used {
                        self.slots.hand_on(&slots, SlotState::Pinned { worker: id.clone(), session });
                        slots
                    } else {
                        self.release_slots(&slots, session, SlotUse::Cell, ctx);
                        vec![]
                    };
                    self.kept.keep(id, KeptWorker { worker, session, slots, persistent: false });
                }
                Some(worker) if self.keep_warm && !self.prepared.contains(&(session, cell_id.to_string())) => {
                    self.keep_warm_worker(session, cell_id, worker, slots, ctx);
                }
                worker => {
                    if let Some(w) = worker {
                        self.stop_worker(w, ctx);
                    }
                    self.release_slots(&slots, session, SlotUse::Cell, ctx);
                }
            },
            ExecKind::Fresh { .. } | ExecKind::Prepared { .. } => {
                if let Some(worker) = outcome.worker {
                    let id = worker_id(&worker);
                    let persistent = device == Device::Cpu;
                    if persistent || !outcome.unsavable.is_empty() {
                        self.enter(&id, WorkerState::Kept);
                        self.kept.keep(id, KeptWorker { worker, session, slots: vec![], persistent });
                    } else {
                        self.stop_worker(worker, ctx);
                    }
                }
            }
            ExecKind::Existing { worker, lent } => {
                let id = worker_id(&worker);
                match outcome.worker {
                    // lost: forget it; cells needing its unsavable state now fail clearly
                    None => {
                        self.forget_kept(&id, None, ctx);
                        self.release_slots(&lent, session, SlotUse::Cell, ctx);
                    }
                    Some(w) => {
                        self.enter(&id, WorkerState::Kept);
                        let persistent = self.kept.get(&id).is_some_and(|k| k.persistent);
                        if !persistent && outcome.unsavable.is_empty() {
                            // nothing left that only this worker has
                            self.forget_kept(&id, Some(w), ctx);
                            self.release_slots(&lent, session, SlotUse::Cell, ctx);
                        } else if outcome.cuda_used && !lent.is_empty() {
                            // it initialised CUDA on the lent slots: its GPU memory stays
                            self.slots.hand_on(&lent, SlotState::Pinned { worker: id.clone(), session });
                            self.kept.hold_slots(&id, lent);
                        } else {
                            self.release_slots(&lent, session, SlotUse::Cell, ctx);
                        }
                    }
                }
            }
        }
        self.try_pending(ctx);
        self.publish_status(ctx);
    }

    /// Stop keeping worker `id` (stopping `running` if it still runs) and free its slot.
    fn forget_kept(&mut self, id: &str, running: Option<Arc<Mutex<WorkerProc>>>, ctx: &mut Context<Self>) {
        let Some(k) = self.kept.remove(id) else { return };
        if let Some(w) = running {
            self.stop_worker(w, ctx);
        }
        self.release_slots(&k.slots, k.session, SlotUse::UnsavableState, ctx);
    }

    /// Start the runs that wait for slots: prepared workers' runs first, then runs
    /// this host claimed, then runs it may still claim, then preparations. Each
    /// queue goes in order: a `%%gpu N` run at its head waits for N free slots
    /// rather than be overtaken for ever by one-slot runs.
    fn try_pending(&mut self, ctx: &mut Context<Self>) {
        // runs for kept workers first: the session has nowhere else to run them
        while self.kept_waiting.front().is_some_and(|r| self.slots.free_count() >= r.gpus.max(1)) {
            let Some(recipe) = self.kept_waiting.pop_front() else { break };
            self.run_kept(recipe, ctx);
        }
        while let Some(key) = self.waiting_prepared.front().cloned() {
            let needs = self.prepared.get(&key).and_then(PreparedWorker::awaiting_gpus);
            if needs.is_some_and(|n| self.slots.free_count() < n) {
                break;
            }
            self.waiting_prepared.pop_front();
            if let Some(run) = self.prepared.get_mut(&key).and_then(PreparedWorker::take_awaiting_run) {
                self.run_prepared(key, run, ctx);
            }
        }
        while self.won.front().is_some_and(|r| self.slots.free_count() >= r.gpus.max(1)) {
            let Some(recipe) = self.won.pop_front() else { break };
            self.run_won(recipe, ctx);
        }
        while let Some(slots) = self.pending.front().and_then(|r| self.slots.free(r.gpus.max(1))) {
            let Some(recipe) = self.pending.pop_front() else { break };
            self.claim_gpu(recipe, slots, ctx);
        }
        // then preparations that waited briefly for slots; older ones are stale
        self.spec_waiting.retain(|(at, _)| at.elapsed() < SPEC_WAIT);
        while self.spec_waiting.front().is_some_and(|(_, r)| self.slots.free_count() >= r.gpus.max(1)) {
            let Some((_, recipe)) = self.spec_waiting.pop_front() else { break };
            self.on_edit_recipe(recipe, ctx);
        }
    }

    // ---------------------------------------------------------------- preparation

    /// An edit-derived recipe: prepare a worker for it if the speculator admitted
    /// it and a slot is free, or update the worker this host prepared for the cell.
    fn on_edit_recipe(&mut self, recipe: RecipeV3, ctx: &mut Context<Self>) {
        let key = (recipe.session, recipe.cell_id.clone());
        if recipe.device != Device::Gpu || recipe.pinned.is_some() {
            // The cell no longer runs on a fresh GPU worker (now a CPU cell, or it
            // needs the worker that holds unsavable state): the worker prepared for
            // it is cancelled. (A GPU recipe the budget did not admit keeps it: the
            // run refreshes whatever changed.)
            self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
            self.cancel_prepared(&key, recipe.revision, ctx);
            return;
        }
        if !recipe.speculate || self.slots.len() < recipe.gpus.max(1) {
            return;
        }
        if recipe.prepared.as_ref().is_some_and(|p| p.host != self.env.host_id) {
            return; // another host holds the cell's worker and updates it
        }
        if let Some(p) = self.prepared.get(&key) {
            if recipe.revision <= p.revision || p.run_claimed() || p.stopping() {
                return;
            }
            // This host updates the cell's worker in place. It claims the new
            // revision at once, so that a host without the worker loses that claim
            // instead of preparing a second worker for the cell (which held a slot
            // idle until evicted: found by `bench/gpu-hours`' validation, ADR 50).
            let claim_key = ClaimKey::Prepare { session: key.0, cell_id: key.1.clone(), revision: recipe.revision };
            self.claim(claim_key, Duration::ZERO, ctx, |_, _, _| {});
            match self.prepared.get_mut(&key) {
                // superseded while preparing: applied in place next
                Some(p) if p.is_preparing() => p.queue_next(recipe),
                _ => self.start_prepare(key, recipe, ctx),
            }
            return;
        }
        // Does the closure hold GPU-resident state? Only then does preparation need
        // the slot; otherwise the worker is prepared on the CPU and gets a slot at
        // Run, so typing time costs no GPU time.
        if let Some(next) = self.claiming_prep.get_mut(&key) {
            // This host is claiming an earlier revision: if it wins, it applies this
            // one in place. Claiming it at once keeps hosts that are not claiming
            // the cell from preparing it a second time.
            if next.as_ref().is_none_or(|n| n.revision < recipe.revision) {
                let claim_key = ClaimKey::Prepare { session: key.0, cell_id: key.1.clone(), revision: recipe.revision };
                *next = Some(recipe);
                self.claim(claim_key, Duration::ZERO, ctx, |_, _, _| {});
            }
            return;
        }
        self.claiming_prep.insert(key.clone(), None);
        let runs_before = self.runs(&key);
        let env = self.env.clone();
        let r = recipe.clone();
        let always = self.prepare_holds_slot;
        let fut = async move {
            if always {
                return true;
            }
            match env.manifest(r.session, r.manifest_revision).await {
                Ok(m) => closure_on_gpu(&m, &r),
                Err(e) => {
                    tracing::warn!(session = %r.session, error = %e, "preparing on a slot: closure devices unknown");
                    true
                }
            }
        };
        let span = tracing::Span::current(); // the preparation stays in its edit's trace
        let fut = tracing::Instrument::instrument(fut, span.clone());
        ctx.spawn(fut.into_actor(self).map(move |needs_slot, act, ctx| {
            let _entered = span.enter();
            act.claim_preparation(recipe, needs_slot, runs_before, ctx)
        }));
    }

    /// Run recipes of the cell `key` seen so far.
    fn runs(&self, key: &PrepKey) -> u64 {
        self.runs_of_cell.get(key).copied().unwrap_or(0)
    }

    /// Stop the worker prepared for `key` because recipe `revision` superseded it,
    /// unless a run already claimed it.
    fn cancel_prepared(&mut self, key: &PrepKey, revision: u64, ctx: &mut Context<Self>) {
        match self.prepared.get_mut(key) {
            Some(p) if p.run_claimed() || (p.class == PreparedClass::Speculative && revision <= p.revision) => {}
            Some(p) if p.is_preparing() => p.stop_when_prepared(PreparedOutcome::Superseded),
            Some(_) => self.end_prepared(key, PreparedOutcome::Superseded, ctx),
            None => {}
        }
    }

    /// Claim the preparation of `recipe` (exactly one host prepares a revision),
    /// holding a free slot meanwhile if the preparation needs one. `runs_before`:
    /// the cell's runs seen when the recipe arrived; a run since then supersedes it
    /// (its worker would idle on a slot for a cell that already ran).
    fn claim_preparation(&mut self, recipe: RecipeV3, needs_slot: bool, runs_before: u64, ctx: &mut Context<Self>) {
        let key = (recipe.session, recipe.cell_id.clone());
        if self.runs(&key) != runs_before {
            self.claiming_prep.remove(&key);
            return;
        }
        if self.prepared.contains(&key) {
            self.claiming_prep.remove(&key);
            return self.on_edit_recipe(recipe, ctx); // one got prepared meanwhile: update it
        }
        let slots = if needs_slot {
            let Some(slots) = self.slots.free(recipe.gpus.max(1)) else {
                // the newest revision waits for a slot
                let recipe = self.claiming_prep.remove(&key).flatten().unwrap_or(recipe);
                self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
                self.spec_waiting.push_back((Instant::now(), recipe));
                return;
            };
            self.slots.take(&slots, SlotState::Claiming(None));
            slots
        } else {
            vec![]
        };
        let (delay, _) = self.claim_delay(&recipe);
        let claim_key =
            ClaimKey::Prepare { session: recipe.session, cell_id: recipe.cell_id.clone(), revision: recipe.revision };
        self.claim(claim_key, delay, ctx, move |act, claim, ctx| {
            let next = act.claiming_prep.remove(&key).flatten();
            let ran = act.runs(&key) != runs_before;
            if claim != Claim::Won || act.prepared.contains(&key) || ran {
                act.slots.unreserve(&slots);
                if claim == Claim::Won && !ran {
                    // an older revision of the cell got a worker meanwhile: update that one
                    act.on_edit_recipe(next.unwrap_or(recipe), ctx);
                }
                act.try_pending(ctx);
                return;
            }
            act.slots.take(&slots, SlotState::Prepared { session: key.0, cell_id: key.1.clone() });
            act.prepared.insert(key.clone(), PreparedWorker::speculative(slots, recipe.revision));
            act.start_prepare(key.clone(), recipe, ctx);
            if let Some(next) = next {
                act.on_edit_recipe(next, ctx); // arrived while claiming: applied in place next
            }
            act.publish_status(ctx);
        });
    }

    /// Fork (or update in place) the prepared worker of `key` for `recipe`.
    fn start_prepare(&mut self, key: PrepKey, recipe: RecipeV3, ctx: &mut Context<Self>) {
        let Some(p) = self.prepared.get_mut(&key) else { return };
        p.begin(recipe.revision);
        let (env, existing, slots) = (self.env.clone(), p.worker.clone(), p.slots.clone());
        let ev = EventKind::Preparing {
            host: self.env.host_id.clone(),
            slot: slots.first().copied(),
            cell_id: key.1.clone(),
            revision: recipe.revision,
        };
        let span = tracing::info_span!("prepare", session = %key.0, cell = %key.1, revision = recipe.revision);
        p.span = span.clone();
        self.session_event(key.0, ev, ctx);
        let fut = tracing::Instrument::instrument(async move { env.prepare(&recipe, &slots, existing).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| act.prepare_done(key, res, ctx)));
    }

    fn prepare_done(
        &mut self,
        key: PrepKey,
        res: Result<(Arc<Mutex<WorkerProc>>, f64), ExecError>,
        ctx: &mut Context<Self>,
    ) {
        let Some(p) = self.prepared.get_mut(&key) else {
            if let Ok((w, _)) = res {
                self.stop_worker(w, ctx);
            }
            return;
        };
        let (next, run, stop) = p.prepared();
        let (w, prepare_ms) = match res {
            Ok(ok) => ok,
            Err(e) => {
                tracing::warn!(session = %key.0, cell = %key.1, error = %e, "preparation failed");
                p.worker = None; // a broken worker was killed by prepare
                self.end_prepared(&key, PreparedOutcome::Lost, ctx);
                if let Some(run) = run {
                    self.run_won(run, ctx); // claimed already: run it cold
                }
                return;
            }
        };
        p.worker_id = worker_id(&w);
        let pid = w.try_lock().map(|w| w.pid).unwrap_or(0);
        p.worker = Some(w);
        p.first_ready.get_or_insert_with(Instant::now);
        if let Some(why) = stop {
            self.end_prepared(&key, why, ctx);
            return;
        }
        if let Some(run) = run {
            self.run_prepared(key, run, ctx);
            return;
        }
        let ev = EventKind::Ready {
            host: self.env.host_id.clone(),
            slot: p.slots.first().copied(),
            worker: p.worker_id.clone(),
            pid,
            cell_id: key.1.clone(),
            revision: p.revision,
            class: p.class,
            prepare_ms,
        };
        self.session_event(key.0, ev, ctx);
        if let Some(next) = next {
            self.start_prepare(key, next, ctx);
        }
        self.publish_status(ctx);
    }

    /// A run for a cell this host prepared: claim it at once (no delay: the
    /// prepared worker makes this host the best place).
    fn claim_prepared_run(&mut self, key: PrepKey, recipe: RecipeV3, ctx: &mut Context<Self>) {
        self.claim(ClaimKey::Run(recipe.exec_id), Duration::ZERO, ctx, move |act, claim, ctx| {
            match claim {
                Claim::Won => {}
                Claim::Failed => return act.retry_failed_claim(recipe, ctx),
                Claim::Lost | Claim::Mine => return, // another host runs it; the planner's budget evicts ours
            }
            match act.prepared.get_mut(&key) {
                Some(p) if p.is_preparing() => p.queue_run(recipe),
                Some(_) => act.run_prepared(key, recipe, ctx),
                None => act.run_won(recipe, ctx),
            }
        });
    }

    /// Run a claimed recipe on the worker prepared for its cell, binding a slot
    /// now if it was prepared without one.
    fn run_prepared(&mut self, key: PrepKey, recipe: RecipeV3, ctx: &mut Context<Self>) {
        let Some(mut p) = self.prepared.remove(&key) else { return self.run_won(recipe, ctx) };
        let alive = p.worker.as_ref().is_some_and(|w| w.try_lock().is_ok_and(|w| crate::process::is_alive(w.pid)));
        let Some(worker) = p.worker.clone().filter(|_| alive) else {
            // it died while waiting: the run goes to a fresh worker, nothing is lost
            self.prepared.insert(key.clone(), p);
            self.end_prepared(&key, PreparedOutcome::Lost, ctx);
            return self.run_won(recipe, ctx);
        };
        let busy = SlotState::Busy { exec: recipe.exec_id, session: recipe.session };
        let slots = if p.slots.is_empty() {
            match self.take_slots(recipe.gpus.max(1), ctx) {
                Some(slots) => {
                    self.slots.take(&slots, busy);
                    slots
                }
                None => {
                    // every slot runs a cell: wait for them with the worker
                    p.phase = Phase::AwaitingSlot { run: Box::new(recipe) };
                    self.prepared.insert(key.clone(), p);
                    self.waiting_prepared.push_back(key);
                    return;
                }
            }
        } else {
            self.slots.hand_on(&p.slots, busy);
            p.slots.clone()
        };
        self.prepared_ended(key, &p, PreparedOutcome::Used, ctx);
        if let Some(a) = self.arrived.get_mut(&recipe.exec_id) {
            a.prepared_by = Some(p.span.clone());
        }
        let prepare = if p.class == PreparedClass::Warm { Prepare::Warm } else { Prepare::Speculative };
        self.spawn_exec(recipe, Target::Existing { worker, prepare, slots }, ctx);
    }

    /// Keep the worker that just ran `cell_id` warm, with its slots (it may hold a
    /// CUDA context): a re-run of the cell finds it ready. The slot time of the cell
    /// ends here; waiting counts as the warm worker's idle time.
    fn keep_warm_worker(
        &mut self,
        session: Uuid,
        cell_id: &str,
        worker: Arc<Mutex<WorkerProc>>,
        slots: Vec<u32>,
        ctx: &mut Context<Self>,
    ) {
        self.release_slots(&slots, session, SlotUse::Cell, ctx);
        self.slots.take(&slots, SlotState::Prepared { session, cell_id: cell_id.to_string() });
        let worker_id = worker_id(&worker);
        self.enter(&worker_id, WorkerState::Warm);
        let pid = worker.try_lock().map(|w| w.pid).unwrap_or(0);
        let first = slots.first().copied();
        self.prepared.insert((session, cell_id.to_string()), PreparedWorker::warm(worker, worker_id.clone(), slots));
        let ev = EventKind::Ready {
            host: self.env.host_id.clone(),
            slot: first,
            worker: worker_id,
            pid,
            cell_id: cell_id.to_string(),
            revision: 0,
            class: PreparedClass::Warm,
            prepare_ms: 0.0,
        };
        self.session_event(session, ev, ctx);
    }

    /// Whether `n` slots are free, or would be once idle prepared workers gave
    /// theirs up.
    fn can_free(&self, n: u32) -> bool {
        self.slots.free_count() + self.prepared.idle_slots() >= n
    }

    /// `n` free slots for a run this host holds, stopping idle prepared workers
    /// for theirs if too few are free (none is stopped unless that makes enough).
    /// The caller takes them at once.
    fn take_slots(&mut self, n: u32, ctx: &mut Context<Self>) -> Option<Vec<u32>> {
        if !self.can_free(n) {
            return None;
        }
        while self.slots.free_count() < n {
            let key = self.prepared.to_give_up()?;
            // not `end_prepared`: the freed slots must not go to another queued run
            self.remove_prepared(&key, PreparedOutcome::EvictedForRun, ctx);
        }
        self.slots.free(n)
    }

    /// Stop a prepared worker and free its slots; `outcome` says why.
    fn end_prepared(&mut self, key: &PrepKey, outcome: PreparedOutcome, ctx: &mut Context<Self>) {
        self.remove_prepared(key, outcome, ctx);
        self.try_pending(ctx);
        self.publish_status(ctx);
    }

    /// `end_prepared` without handing the freed slots on.
    fn remove_prepared(&mut self, key: &PrepKey, outcome: PreparedOutcome, ctx: &mut Context<Self>) {
        let Some(p) = self.prepared.remove(key) else { return };
        if let Some(w) = p.worker.clone() {
            self.stop_worker(w, ctx);
        }
        self.release_slots(&p.slots, key.0, SlotUse::Speculation, ctx);
        self.prepared_ended(key.clone(), &p, outcome, ctx);
    }

    fn prepared_ended(&mut self, key: PrepKey, p: &PreparedWorker, outcome: PreparedOutcome, ctx: &mut Context<Self>) {
        let idle_ms = p.idle_ms();
        tracing::info!(session = %key.0, cell = %key.1, worker = %p.worker_id, idle_ms, outcome = outcome.as_str(),
            "prepared worker ended");
        schemas::metrics::metrics()
            .prepared_ended
            .get_or_create(&[("outcome", schemas::metrics::prepared_outcome(outcome))])
            .inc();
        let ev = EventKind::PreparedEnded {
            host: self.env.host_id.clone(),
            slot: p.slots.first().copied(),
            worker: p.worker_id.clone(),
            cell_id: key.1,
            class: p.class,
            idle_ms,
            outcome,
        };
        self.session_event(key.0, ev, ctx);
    }

    /// Prepared workers whose process died while waiting free their slot.
    fn reap_lost_prepared(&mut self, ctx: &mut Context<Self>) {
        for key in self.prepared.dead() {
            tracing::warn!(session = %key.0, cell = %key.1, "a prepared worker died while waiting");
            self.end_prepared(&key, PreparedOutcome::Lost, ctx);
        }
    }

    /// The planner (budget) or the session asks to stop a prepared worker.
    fn evict(&mut self, msg: EvictV1, ctx: &mut Context<Self>) {
        let Some(key) = self.prepared.by_worker(&msg.worker) else { return };
        match self.prepared.get_mut(&key) {
            Some(p) if p.run_claimed() => {} // a run claimed it: too late
            Some(p) if p.is_preparing() => p.stop_when_prepared(PreparedOutcome::Evicted),
            Some(_) => self.end_prepared(&key, PreparedOutcome::Evicted, ctx),
            None => {}
        }
    }

    // ---------------------------------------------------------------- sessions

    fn close_session(&mut self, session: Uuid, ctx: &mut Context<Self>) {
        // a deleted session's cells stop now: their slots are free at once (and the
        // store refuses what a save under way would commit)
        for w in self.env.lifecycle.snapshot() {
            if w.session == session && matches!(w.state, WorkerState::Preparing | WorkerState::Running) {
                tracing::info!(worker = %w.id, %session, "stopping a cell of a deleted session");
                crate::process::kill(w.pid);
            }
        }
        self.pending.retain(|r| r.session != session);
        self.spec_waiting.retain(|(_, r)| r.session != session);
        self.runs_of_cell.retain(|(s, _), _| *s != session);
        self.claiming_prep.retain(|(s, _), _| *s != session);
        for key in self.prepared.of_session(session) {
            match self.prepared.get_mut(&key) {
                Some(p) if p.is_preparing() => p.stop_when_prepared(PreparedOutcome::SessionClosed),
                Some(_) => self.end_prepared(&key, PreparedOutcome::SessionClosed, ctx),
                None => {}
            }
        }
        self.stop_kept(session, ctx);
    }

    /// Stop the workers this host keeps for `session` (its CPU worker, workers
    /// holding unsavable state), free their slots and give up its CPU claim: on a
    /// delete, or when the session is culled for idleness (its committed state
    /// stays; its next cell starts a fresh worker).
    fn stop_kept(&mut self, session: Uuid, ctx: &mut Context<Self>) {
        self.kept_waiting.retain(|r| r.session != session);
        for k in self.kept.remove_session(session) {
            self.stop_worker(k.worker, ctx);
            self.release_slots(&k.slots, session, SlotUse::UnsavableState, ctx);
        }
        let claims = self.claims.clone();
        self.background(async move { claims.release(ClaimKey::Cpu(session)).await }, ctx);
        // its workers are stopped: its uid may serve another session (ADR 29)
        if let Some(uids) = &self.env.session_uids {
            uids.release(session);
        }
        self.publish_status(ctx);
    }

    /// The user interrupted `exec`: a run waiting here never starts (one this host
    /// claimed fails now); one that runs gets SIGINT, and is killed after the grace
    /// period if it ignores it (see [`crate::interrupts`]).
    fn interrupt(&mut self, msg: InterruptV1, ctx: &mut Context<Self>) {
        let exec = msg.exec_id;
        self.env.interrupts.ask(exec);
        self.pending.retain(|r| r.exec_id != exec);
        self.cpu_waiting.retain(|(_, r)| r.exec_id != exec);
        if let Some(i) = self.won.iter().position(|r| r.exec_id == exec) {
            self.won.remove(i);
            let error = crate::exec::ExecError::Interrupted.to_string();
            let ev = SessionEventV2 {
                session: msg.session,
                exec_id: exec,
                unix_ms: unix_ms(),
                kind: EventKind::Failed { error },
            };
            let bus = self.env.bus.clone();
            self.background(
                async move {
                    if let Err(e) =
                        bus.publish_kept(bus.subjects().event(ev.session), &ev, schemas::bus::KEPT_PATIENCE).await
                    {
                        tracing::error!(error = %e, "could not publish a session event");
                    }
                },
                ctx,
            );
        }
    }

    fn renew_claims(&mut self, ctx: &mut Context<Self>) {
        // every run this host holds, running, waiting for a slot or for a prepared
        // worker: an expired run claim could be taken again (by a host, or by an
        // interrupt), and the frontend takes a claim not renewed for a lost host
        let runs = self.running.keys().copied().chain(self.won.iter().map(|r| r.exec_id));
        let runs = runs.chain(self.prepared.claimed_runs()).collect::<std::collections::BTreeSet<_>>();
        let keys: Vec<ClaimKey> =
            self.kept.cpu_sessions().map(ClaimKey::Cpu).chain(runs.into_iter().map(ClaimKey::Run)).collect();
        let claims = self.claims.clone();
        let renewal = async move { claims.renew(keys).await };
        ctx.spawn(renewal.into_actor(self).map(|lost, act, ctx| {
            for key in lost {
                if let ClaimKey::Cpu(session) = key {
                    // another host took this host for lost and runs the session's CPU
                    // cells now: this worker must not run any more of them
                    tracing::warn!(%session, "another host took over this session's CPU worker");
                    if let Some(w) = act.kept.cpu_worker(session).map(|k| k.worker.clone()) {
                        act.forget_kept(&worker_id(&w), Some(w), ctx);
                    }
                }
            }
        }));
    }

    /// Stop every worker this host keeps or prepared (shutdown); resolves once
    /// they are all stopped.
    pub fn stop_all(&mut self) -> impl Future<Output = ()> + 'static {
        let workers: Vec<_> =
            self.kept.drain().map(|k| k.worker).chain(self.prepared.drain().filter_map(|p| p.worker)).collect();
        for w in &workers {
            self.enter(&worker_id(w), WorkerState::Evicted);
        }
        futures::future::join_all(workers.into_iter().map(stop)).map(|_| ())
    }
}

/// Whether any object the closure of `recipe` reaches lives on a GPU.
fn closure_on_gpu(m: &schemas::checkpoint::Manifest, recipe: &RecipeV3) -> bool {
    let roots = recipe.closure.iter().filter_map(|v| m.variables.get(&v.name).and_then(|e| e.oid.as_deref()));
    m.reachable(roots).iter().any(|oid| m.objects.get(oid).is_some_and(|o| o.on_gpu))
}

/// Stop a worker: politely if nothing else holds it, else kill it now.
async fn stop(worker: Arc<Mutex<WorkerProc>>) {
    match Arc::try_unwrap(worker) {
        Ok(m) => m.into_inner().stop().await,
        Err(shared) => shared.lock().await.kill_now(),
    }
}

fn worker_id(worker: &Arc<Mutex<WorkerProc>>) -> String {
    // the lock is free once an execution returned its worker
    worker.try_lock().map(|w| w.id.clone()).unwrap_or_default()
}

impl Actor for Host {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(TICK, |act, ctx| {
            act.arrived.retain(|_, a| a.at.elapsed() < ARRIVAL_MEMORY);
            act.retry_cpu_runs(ctx);
            act.reap_lost_prepared(ctx);
            if let Some(cgroups) = &act.env.cgroups {
                cgroups.sweep();
            }
            act.publish_status(ctx);
            act.renew_claims(ctx);
        });
        self.publish_status(ctx);
    }
}

impl StreamHandler<Result<Envelope<RecipeV3>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<RecipeV3>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            let _span = env.span("host.recipe").entered();
            // the planner delivers runs' recipes (Bus::deliver): say this host heard it
            // (unless it is stopping and will not take it)
            if !self.env.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                let (bus, reply) = (self.env.bus.clone(), env.reply_to());
                self.background(async move { bus.acknowledge(reply).await }, ctx);
            }
            // sent again because no acknowledgement reached the planner (ADR 46):
            // the run claim would refuse it too, but it would wait for a slot first
            let exec = env.msg.exec_id;
            if env.msg.kind == RecipeKind::Run && (self.arrived.contains_key(&exec) || self.running.contains_key(&exec))
            {
                tracing::info!(%exec, "a run's recipe heard again: taken once");
                return;
            }
            self.on_recipe(env.msg, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<SessionEventV2>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<SessionEventV2>, Rejected>, _ctx: &mut Self::Context) {
        if let Ok(env) = item {
            if let EventKind::Claimed { host, .. } = &env.msg.kind {
                if *host != self.env.host_id {
                    let exec = env.msg.exec_id;
                    self.pending.retain(|r| r.exec_id != exec);
                    self.cpu_waiting.retain(|(_, r)| r.exec_id != exec);
                }
            }
        }
    }
}

impl StreamHandler<Result<Envelope<HostStatusV2>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<HostStatusV2>, Rejected>, _ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let status = env.msg;
        if status.host != self.env.host_id {
            let free = status.slots.iter().filter(|s| s.held_for.is_none()).count();
            self.peers.insert(status.host, (free, Instant::now()));
        }
    }
}

impl StreamHandler<Result<Envelope<SessionCloseV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<SessionCloseV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            self.close_session(env.msg.session, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<SessionIdleV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<SessionIdleV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            tracing::info!(session = %env.msg.session, "session culled for idleness; stopping its kept workers");
            self.stop_kept(env.msg.session, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<InterruptV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<InterruptV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            self.interrupt(env.msg, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<QueryV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<QueryV1>, Rejected>, _ctx: &mut Self::Context) {
        let bus = self.env.bus.clone();
        let env = match item {
            Ok(env) => env,
            Err(rejected) => {
                actix::spawn(async move { rejected.answer::<QueryAnswerV1>(&bus).await });
                return;
            }
        };
        let worker = self.kept.cpu_worker(env.msg.session).map(|k| k.worker.clone());
        let to = env.reply_to();
        actix::spawn(async move {
            let reply = query_cpu_worker(worker, env.msg).await;
            if let Err(e) = bus.respond(to, &reply).await {
                tracing::warn!(error = %e, "could not answer a query");
            }
        });
    }
}

impl StreamHandler<Result<Envelope<CommV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<CommV1>, Rejected>, _ctx: &mut Self::Context) {
        let bus = self.env.bus.clone();
        let env = match item {
            Ok(env) => env,
            Err(rejected) => {
                actix::spawn(async move { rejected.answer::<CommAnswerV1>(&bus).await });
                return;
            }
        };
        let worker = self.kept.cpu_worker(env.msg.session).map(|k| k.worker.clone());
        let to = env.reply_to();
        actix::spawn(async move {
            let reply = comm_cpu_worker(worker, env.msg).await;
            if let Err(e) = bus.respond(to, &reply).await {
                tracing::warn!(error = %e, "could not answer a comm message");
            }
        });
    }
}

/// The session's CPU worker if it is idle: `NotFound` when this host keeps none
/// (or lost it), `Conflict` while it runs a cell (a kernel asks between cells;
/// an editor typing meanwhile gets nothing rather than a wait).
fn idle_cpu_worker(
    worker: &Option<Arc<Mutex<WorkerProc>>>,
    session: Uuid,
) -> Result<tokio::sync::MutexGuard<'_, WorkerProc>, (ErrorCode, String)> {
    let Some(worker) = worker else {
        return Err((ErrorCode::NotFound, format!("this host keeps no CPU worker for session {session}")));
    };
    let Ok(w) = worker.try_lock() else {
        return Err((ErrorCode::Conflict, "the session's CPU worker is running a cell".into()));
    };
    if w.is_broken() {
        return Err((ErrorCode::NotFound, "the session's CPU worker was lost".into()));
    }
    Ok(w)
}

/// A completion or inspection answered by the session's CPU worker.
async fn query_cpu_worker(worker: Option<Arc<Mutex<WorkerProc>>>, q: QueryV1) -> Reply<QueryAnswerV1> {
    let mut w = match idle_cpu_worker(&worker, q.session) {
        Ok(w) => w,
        Err((code, message)) => return Reply::Err { code, message },
    };
    let kind = match q.kind {
        QueryKind::Complete => "complete",
        QueryKind::Inspect => "inspect",
    };
    let frame =
        Frame::Query { kind: kind.into(), code: q.code, cursor_pos: q.cursor_pos, detail_level: q.detail_level };
    match w.query(frame).await {
        Ok(content) => Reply::Ok(QueryAnswerV1 { content_json: content.to_string() }),
        Err(e) => {
            Reply::Err { code: ErrorCode::Internal, message: format!("the session's CPU worker could not answer: {e}") }
        }
    }
}

/// A client's comm message handled by the session's CPU worker (ADR 33).
async fn comm_cpu_worker(worker: Option<Arc<Mutex<WorkerProc>>>, c: CommV1) -> Reply<CommAnswerV1> {
    let json = |what: &str, text: &str| {
        serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .filter(serde_json::Value::is_object)
            .ok_or_else(|| format!("the comm message's {what} is not a JSON object"))
    };
    let (content, metadata) = match (json("content", &c.content_json), json("metadata", &c.metadata_json)) {
        (Ok(content), Ok(metadata)) => (content, metadata),
        (Err(message), _) | (_, Err(message)) => return Reply::Err { code: ErrorCode::BadRequest, message },
    };
    let mut w = match idle_cpu_worker(&worker, c.session) {
        Ok(w) => w,
        Err((code, message)) => return Reply::Err { code, message },
    };
    let frame = Frame::Comm { msg_type: c.msg_type, content, metadata, buffers: c.buffers };
    match w.comm(frame).await {
        Ok((reply, outputs)) => Reply::Ok(CommAnswerV1 {
            reply_json: reply.to_string(),
            outputs_json: outputs.iter().map(ToString::to_string).collect(),
        }),
        Err(e) => Reply::Err {
            code: ErrorCode::Internal,
            message: format!("the session's CPU worker could not take the comm message: {e}"),
        },
    }
}

impl StreamHandler<Result<Envelope<InputReplyV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<InputReplyV1>, Rejected>, _ctx: &mut Self::Context) {
        if let Ok(env) = item {
            self.env.inputs.deliver(env.msg);
        }
    }
}

impl StreamHandler<Result<Envelope<EvictV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<EvictV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            tracing::debug!(worker = %env.msg.worker, reason = %env.msg.reason, "eviction asked");
            self.evict(env.msg, ctx);
        }
    }
}

/// Stop the host (SIGTERM): take nothing new; end the cells still preparing or
/// running (each fails saying the host stopped: nothing of it was committed); let
/// saves under way finish (what they commit is reported as saved); then stop every
/// worker left. Answered once all that is done.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Stop;

impl Handler<Stop> for Host {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: Stop, _ctx: &mut Self::Context) -> Self::Result {
        self.env.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        for w in self.env.lifecycle.snapshot() {
            if matches!(w.state, WorkerState::Preparing | WorkerState::Running) {
                tracing::info!(worker = %w.id, session = %w.session, "stopping a cell with the host");
                crate::process::kill(w.pid);
            }
        }
        let mut running = self.running_count.subscribe();
        let executions_ended = async move {
            let _ = running.wait_for(|n| *n == 0).await;
        };
        Box::pin(executions_ended.into_actor(self).then(|(), act, _ctx| act.stop_all().into_actor(act)))
    }
}
