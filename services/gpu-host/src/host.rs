//! The host actor: owns this host's GPU slots, the sessions' persistent CPU workers,
//! the workers kept for unsavable state and the workers prepared before Run;
//! competes for recipes (DESIGN.md section 5) and hands each won recipe to an
//! execution future ([`crate::exec`]).
//!
//! ```text
//!  run recipes ──▶ Host ──claim (KV create)──▶ execution future ──▶ ExecDone ──▶ Host
//!  edit recipes (admitted) ──▶ Host ──claim──▶ prepare future ──▶ Ready (idle, slot held)
//!  run recipe for a prepared cell ──▶ its host claims at once, runs on that worker
//!  events  ──▶ Host (drop pending recipes another host claimed)
//!  evict   ──▶ Host (stop a prepared worker)     closes ──▶ Host (stop the session's workers)
//!  tick    ──▶ status, claim renewal
//! ```
//!
//! A prepared worker's life: preparing ─▶ ready ─(newer recipe)▶ preparing (updated
//! in place) … ─▶ used by the run, or evicted (planner budget, a run needing the
//! slot, session closed), or lost (it died). A run never waits for a prepared
//! worker of another session: when no slot is free it evicts an idle one.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use async_nats::jetstream::kv;
use schemas::buckets;
use schemas::bus::Rejected;
use schemas::messages::{
    BidV1, Device, EventKind, EvictV1, HostStatusV2, Prepare, PreparedClass, RecipeKind, RecipeV1, SessionCloseV1,
    SessionEventV1, SlotStatus, WorkerState, ZygoteStatus,
};
use schemas::{unix_ms, Envelope};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::exec::{ExecEnv, Outcome, Target};
use crate::gpus::Gpu;
use crate::worker::WorkerProc;

/// How often status is published and claims renewed.
const TICK: Duration = Duration::from_secs(2);

/// A run whose recipe names another host's prepared worker: that host claims it at
/// once; the others compete only if it has not after this long (it may be gone).
const PREPARED_FALLBACK: Duration = Duration::from_secs(2);

/// How long an admitted edit recipe may wait for a slot on this host.
const SPEC_WAIT: Duration = Duration::from_secs(5);

enum SlotState {
    Free,
    /// Reserved while this host tries to claim `exec`.
    Claiming(Uuid),
    /// Running `exec` for `session`.
    Busy {
        exec: Uuid,
        session: Uuid,
    },
    /// Kept with a worker that holds unsavable state.
    Pinned {
        worker: String,
        session: Uuid,
    },
    /// Held by a worker prepared (or being prepared) for a cell before Run.
    Prepared {
        session: Uuid,
        cell_id: String,
    },
}

struct Slot {
    gpu: Gpu,
    state: SlotState,
    since: Instant,
}

/// A worker kept after its cell: the session's CPU worker, or one holding
/// unsavable variables.
struct Kept {
    worker: Arc<Mutex<WorkerProc>>,
    session: Uuid,
    slot: Option<u32>,
    persistent: bool,
}

/// A worker prepared for a cell before Run.
struct Prep {
    /// None while its first preparation forks it.
    worker: Option<Arc<Mutex<WorkerProc>>>,
    worker_id: String,
    /// The GPU slot (index) it holds: only if its closure has GPU-resident state;
    /// others get a slot at Run.
    slot: Option<u32>,
    /// The recipe revision it was (or is being) prepared for.
    revision: u64,
    class: PreparedClass,
    /// Idle since (None until first ready).
    ready_since: Option<Instant>,
    preparing: bool,
    /// A newer recipe that arrived while preparing: applied next, in place.
    next: Option<RecipeV1>,
    /// The run (already claimed by this host) that arrived while preparing.
    run: Option<RecipeV1>,
    /// Evicted while preparing: stop once the preparation ends.
    evict: Option<&'static str>,
}

type PrepKey = (Uuid, String);

/// The host actor.
pub struct Host {
    env: ExecEnv,
    claims: kv::Store,
    slots: Vec<Slot>,
    real_gpus: bool,
    kept: HashMap<String, Kept>,
    cpu: HashMap<Uuid, String>,
    pending: VecDeque<RecipeV1>,
    /// Runs this host claimed that wait for a slot.
    won: VecDeque<RecipeV1>,
    /// Prepared workers (without a slot) whose run waits for a slot.
    waiting_prepared: VecDeque<PrepKey>,
    /// Workers prepared before Run, per (session, cell).
    prepared: HashMap<PrepKey, Prep>,
    /// Admitted edit recipes that found no free slot (the planner's eviction that
    /// makes room may arrive just after): the newest per cell, tried when a slot frees.
    spec_waiting: VecDeque<(Instant, RecipeV1)>,
    /// Prepare every worker with its slot (see `Config::prepare_holds_slot`).
    prepare_holds_slot: bool,
    /// Keep a GPU worker warm (with its slot) after its cell, for a re-run of
    /// the cell, until the planner's budget evicts it (see `Config::keep_warm`).
    keep_warm: bool,
    /// Zygotes as last seen (the cache is locked while a fork is under way).
    last_zygotes: Vec<ZygoteStatus>,
}

impl Host {
    /// A host with `slots` (real GPUs or virtual ones), claiming through `claims`.
    pub fn new(
        env: ExecEnv,
        claims: kv::Store,
        slots: Vec<Gpu>,
        real_gpus: bool,
        prepare_holds_slot: bool,
        keep_warm: bool,
    ) -> Self {
        let slots = slots.into_iter().map(|gpu| Slot { gpu, state: SlotState::Free, since: Instant::now() }).collect();
        Self {
            env,
            claims,
            slots,
            real_gpus,
            kept: HashMap::new(),
            cpu: HashMap::new(),
            pending: VecDeque::new(),
            won: VecDeque::new(),
            waiting_prepared: VecDeque::new(),
            prepared: HashMap::new(),
            spec_waiting: VecDeque::new(),
            prepare_holds_slot,
            keep_warm,
            last_zygotes: Vec::new(),
        }
    }

    fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(|s| matches!(s.state, SlotState::Free))
    }

    /// How long to wait before claiming `recipe`, and the score it comes from: a
    /// better-placed host waits less (DESIGN.md section 5). The score weighs free
    /// slots (half), the zygote match (a quarter: the tail imported already) and
    /// the closure's bytes in this host's chunk cache (a quarter); up to 3 ms of
    /// jitter breaks ties.
    fn claim_delay(&self, recipe: &RecipeV1) -> (Duration, f64) {
        let total = self.slots.len().max(1) as f64;
        let free = self.slots.iter().filter(|s| matches!(s.state, SlotState::Free)).count() as f64;
        let (zygote, cached) = self.env.placement(recipe);
        let score = 0.5 * free / total + 0.25 * zygote + 0.25 * cached;
        let jitter = (Uuid::new_v4().as_u128() % 3000) as u64;
        (Duration::from_micros(2_000 + (12_000.0 * (1.0 - score)) as u64 + jitter), score)
    }

    /// Say how this host scored itself for a run and whether it won.
    fn publish_bid(&self, exec_id: Uuid, score: f64, delay: Duration, won: bool, ctx: &mut Context<Self>) {
        let bus = self.env.bus.clone();
        let bid = BidV1 { exec_id, host: self.env.host_id.clone(), score, delay_ms: delay.as_secs_f64() * 1000.0, won };
        ctx.spawn(
            async move {
                if let Err(e) = bus.publish(bus.subjects().host_bid(&bid.host), &bid).await {
                    tracing::debug!(error = %e, "could not publish a bid");
                }
            }
            .into_actor(self),
        );
    }

    fn status(&self) -> HostStatusV2 {
        let slots = self
            .slots
            .iter()
            .map(|s| {
                let (exec_id, session, held_for) = match &s.state {
                    SlotState::Free => (None, None, None),
                    SlotState::Claiming(e) => (Some(*e), None, Some("claiming".to_string())),
                    SlotState::Busy { exec, session } => (Some(*exec), Some(*session), Some("cell".to_string())),
                    SlotState::Pinned { session, worker } => {
                        (None, Some(*session), Some(format!("unsavable state in {worker}")))
                    }
                    SlotState::Prepared { session, cell_id } => {
                        let preparing = self.prepared.get(&(*session, cell_id.clone())).is_some_and(|p| p.preparing);
                        let what = if preparing { "preparing" } else { "prepared" };
                        (None, Some(*session), Some(format!("{what} for cell {cell_id}")))
                    }
                };
                SlotStatus {
                    index: s.gpu.index,
                    name: s.gpu.name.clone(),
                    memory_bytes: s.gpu.memory_bytes,
                    exec_id,
                    session,
                    held_for,
                }
            })
            .collect();
        let zygotes = match self.env.zygotes.try_lock() {
            Ok(cache) => cache
                .zygotes()
                .map(|z| ZygoteStatus {
                    id: z.id.clone(),
                    packages: z.packages.clone(),
                    cuda_unsafe: z.cuda_unsafe.clone(),
                    pid: z.pid,
                })
                .collect(),
            Err(_) => self.last_zygotes.clone(),
        };
        HostStatusV2 {
            host: self.env.host_id.clone(),
            slots,
            real_gpus: self.real_gpus,
            zygotes,
            cpu_sessions: self.cpu.keys().copied().collect(),
            workers: self.env.lifecycle.snapshot(),
            cache_bytes: self.env.chunks.cached_bytes(),
            forks: self.env.forks.load(std::sync::atomic::Ordering::Relaxed),
            unix_ms: unix_ms(),
        }
    }

    fn publish_status(&mut self, ctx: &mut Context<Self>) {
        let bus = self.env.bus.clone();
        let status = self.status();
        self.last_zygotes = status.zygotes.clone();
        ctx.spawn(
            async move {
                if let Err(e) = bus.publish(bus.subjects().host_status(&status.host), &status).await {
                    tracing::warn!(error = %e, "could not publish host status");
                }
            }
            .into_actor(self),
        );
    }

    fn on_recipe(&mut self, recipe: RecipeV1, ctx: &mut Context<Self>) {
        if recipe.kind != RecipeKind::Run {
            self.on_edit_recipe(recipe, ctx);
            return;
        }
        if let Some(p) = &recipe.pinned {
            if p.host != self.env.host_id {
                return;
            }
            let target = match self.kept.get(&p.worker) {
                Some(k) => Target::Existing {
                    worker: k.worker.clone(),
                    prepare: if k.persistent { Prepare::Persistent } else { Prepare::Pinned },
                    slot: k.slot,
                },
                // gone: the execution fails naming the variable and its cell
                None => Target::Fresh { slot: None },
            };
            self.spawn_exec(recipe, target, ctx);
            return;
        }
        match recipe.device {
            Device::Cpu => self.claim_cpu(recipe, ctx),
            Device::Gpu => {
                if self.slots.is_empty() {
                    return;
                }
                let key = (recipe.session, recipe.cell_id.clone());
                self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
                if self.prepared.contains_key(&key) {
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
                match self.free_slot() {
                    Some(i) => self.claim_gpu(recipe, i, ctx),
                    None if self.idle_prepared().is_some() => self.claim_then_evict(recipe, ctx),
                    None => self.pending.push_back(recipe),
                }
            }
        }
    }

    // ---------------------------------------------------------------- preparation

    /// An edit-derived recipe: prepare a worker for it if the speculator admitted
    /// it and a slot is free, or update the worker this host prepared for the cell.
    fn on_edit_recipe(&mut self, recipe: RecipeV1, ctx: &mut Context<Self>) {
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
        if !recipe.speculate || self.slots.is_empty() {
            return;
        }
        if let Some(p) = self.prepared.get_mut(&key) {
            if recipe.revision <= p.revision || p.run.is_some() || p.evict.is_some() {
                return;
            }
            if p.preparing {
                p.next = Some(recipe); // superseded while preparing: applied in place next
            } else {
                self.start_prepare(key, recipe, ctx);
            }
            return;
        }
        // Does the closure hold GPU-resident state? Only then does preparation need
        // the slot; otherwise the worker is prepared on the CPU and gets a slot at
        // Run, so typing time costs no GPU time.
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
                    tracing::warn!(session = %r.session, error = %e, "preparing on a slot: the closure's devices are unknown");
                    true
                }
            }
        };
        ctx.spawn(fut.into_actor(self).map(move |needs_slot, act, ctx| act.claim_preparation(recipe, needs_slot, ctx)));
    }

    /// Stop the worker prepared for `key` because recipe `revision` superseded it,
    /// unless a run already claimed it.
    fn cancel_prepared(&mut self, key: &PrepKey, revision: u64, ctx: &mut Context<Self>) {
        match self.prepared.get_mut(key) {
            Some(p) if p.run.is_some() || (p.class == PreparedClass::Speculative && revision <= p.revision) => {}
            Some(p) if p.preparing => {
                p.next = None;
                p.evict = Some("superseded");
            }
            Some(_) => self.end_prepared(key, "superseded", ctx),
            None => {}
        }
    }

    /// Claim the preparation of `recipe` (exactly one host prepares a revision),
    /// holding a free slot meanwhile if the preparation needs one.
    fn claim_preparation(&mut self, recipe: RecipeV1, needs_slot: bool, ctx: &mut Context<Self>) {
        let key = (recipe.session, recipe.cell_id.clone());
        if self.prepared.contains_key(&key) {
            return self.on_edit_recipe(recipe, ctx); // one got prepared meanwhile: update it
        }
        let pos = if needs_slot {
            let Some(pos) = self.free_slot() else {
                self.spec_waiting.retain(|(_, r)| (r.session, &r.cell_id) != (key.0, &key.1));
                self.spec_waiting.push_back((Instant::now(), recipe));
                return;
            };
            self.slots[pos].state = SlotState::Claiming(Uuid::nil());
            self.slots[pos].since = Instant::now();
            Some(pos)
        } else {
            None
        };
        let (delay, _) = self.claim_delay(&recipe);
        let claims = self.claims.clone();
        let claim = buckets::prepare_claim_key(recipe.session, &recipe.cell_id, recipe.revision);
        let me = self.env.host_id.clone();
        let fut = async move {
            tokio::time::sleep(delay).await;
            claims.create(claim, me.into_bytes().into()).await
        };
        ctx.spawn(fut.into_actor(self).map(move |won, act, ctx| {
            if won.is_err() || act.prepared.contains_key(&key) {
                if let Some(pos) = pos {
                    act.slots[pos].state = SlotState::Free;
                }
                if won.is_ok() {
                    // an older revision of the cell got a worker meanwhile: update that one
                    act.on_edit_recipe(recipe, ctx);
                }
                act.try_pending(ctx);
                return;
            }
            if let Some(pos) = pos {
                act.slots[pos].state = SlotState::Prepared { session: key.0, cell_id: key.1.clone() };
                act.slots[pos].since = Instant::now();
            }
            let prep = Prep {
                worker: None,
                worker_id: String::new(),
                slot: pos.map(|pos| act.slots[pos].gpu.index),
                revision: recipe.revision,
                class: PreparedClass::Speculative,
                ready_since: None,
                preparing: true,
                next: None,
                run: None,
                evict: None,
            };
            act.prepared.insert(key.clone(), prep);
            act.start_prepare(key, recipe, ctx);
            act.publish_status(ctx);
        }));
    }

    /// Fork (or update in place) the prepared worker of `key` for `recipe`.
    fn start_prepare(&mut self, key: PrepKey, recipe: RecipeV1, ctx: &mut Context<Self>) {
        let Some(p) = self.prepared.get_mut(&key) else { return };
        p.preparing = true;
        p.revision = recipe.revision;
        p.class = PreparedClass::Speculative; // a warm worker now prepared for an edit
        let (env, existing, slot) = (self.env.clone(), p.worker.clone(), p.slot);
        let span = tracing::info_span!("prepare", session = %key.0, cell = %key.1, revision = recipe.revision);
        let fut = tracing::Instrument::instrument(async move { env.prepare(&recipe, slot, existing).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| act.prepare_done(key, res, ctx)));
    }

    fn prepare_done(
        &mut self,
        key: PrepKey,
        res: Result<(Arc<Mutex<WorkerProc>>, f64), String>,
        ctx: &mut Context<Self>,
    ) {
        let Some(p) = self.prepared.get_mut(&key) else {
            if let Ok((w, _)) = res {
                stop_worker(w, ctx, self);
            }
            return;
        };
        p.preparing = false;
        let (pid, prepare_ms) = match res {
            Ok((w, ms)) => {
                p.worker_id = worker_id(&w);
                let pid = w.try_lock().map(|w| w.pid).unwrap_or(0);
                p.worker = Some(w);
                p.ready_since.get_or_insert_with(Instant::now);
                (pid, ms)
            }
            Err(e) => {
                tracing::warn!(session = %key.0, cell = %key.1, error = %e, "preparation failed");
                let run = p.run.take();
                p.worker = None; // a broken worker was killed by prepare
                self.end_prepared(&key, "lost", ctx);
                if let Some(run) = run {
                    self.run_won(run, ctx); // claimed already: run it cold
                }
                return;
            }
        };
        if let Some(why) = p.evict {
            self.end_prepared(&key, why, ctx);
            return;
        }
        if let Some(run) = p.run.take() {
            self.run_prepared(key, run, ctx);
            return;
        }
        let ev = EventKind::Ready {
            host: self.env.host_id.clone(),
            slot: p.slot,
            worker: p.worker_id.clone(),
            pid,
            cell_id: key.1.clone(),
            revision: p.revision,
            class: p.class,
            prepare_ms,
        };
        let next = p.next.take();
        self.session_event(key.0, ev, ctx);
        if let Some(next) = next {
            self.start_prepare(key, next, ctx);
        }
        self.publish_status(ctx);
    }

    /// A run for a cell this host prepared: claim it at once (no delay: the
    /// prepared worker makes this host the best place).
    fn claim_prepared_run(&mut self, key: PrepKey, recipe: RecipeV1, ctx: &mut Context<Self>) {
        let claims = self.claims.clone();
        let claim = buckets::run_claim_key(recipe.exec_id);
        let me = self.env.host_id.clone();
        let fut = async move { claims.create(claim, me.into_bytes().into()).await };
        ctx.spawn(fut.into_actor(self).map(move |won, act, ctx| {
            if won.is_err() {
                return; // another host runs it; the planner's budget evicts ours
            }
            match act.prepared.get_mut(&key) {
                Some(p) if p.preparing => {
                    p.next = None;
                    p.run = Some(recipe);
                }
                Some(_) => act.run_prepared(key, recipe, ctx),
                None => act.run_won(recipe, ctx),
            }
        }));
    }

    /// Run a claimed recipe on the worker prepared for its cell, binding a slot
    /// now if it was prepared without one.
    fn run_prepared(&mut self, key: PrepKey, recipe: RecipeV1, ctx: &mut Context<Self>) {
        let Some(mut p) = self.prepared.remove(&key) else { return self.run_won(recipe, ctx) };
        let alive = p.worker.as_ref().is_some_and(|w| w.try_lock().is_ok_and(|w| crate::process::is_alive(w.pid)));
        let Some(worker) = p.worker.clone().filter(|_| alive) else {
            // it died while waiting: the run goes to a fresh worker, nothing is lost
            self.prepared.insert(key.clone(), p);
            self.end_prepared(&key, "lost", ctx);
            return self.run_won(recipe, ctx);
        };
        let pos = match p.slot {
            Some(index) => self.slots.iter().position(|s| s.gpu.index == index),
            None => self.free_slot().or_else(|| self.evict_for_slot(ctx)),
        };
        let Some(pos) = pos else {
            // every slot runs a cell: wait for one with the worker
            p.run = Some(recipe);
            self.prepared.insert(key.clone(), p);
            self.waiting_prepared.push_back(key);
            return;
        };
        if p.slot.is_none() {
            self.slots[pos].since = Instant::now();
        }
        self.slots[pos].state = SlotState::Busy { exec: recipe.exec_id, session: recipe.session };
        let index = self.slots[pos].gpu.index;
        let idle_ms = p.ready_since.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1000.0);
        self.prepared_ended(key, &p, idle_ms, "used", ctx);
        let prepare = if p.class == PreparedClass::Warm { Prepare::Warm } else { Prepare::Speculative };
        let target = Target::Existing { worker, prepare, slot: Some(index) };
        self.spawn_exec(recipe, target, ctx);
    }

    /// Keep the worker that just ran `cell_id` warm, with its slot (it may hold a
    /// CUDA context): a re-run of the cell finds it ready. The slot time of the cell
    /// ends here; waiting counts as the warm worker's idle time.
    fn keep_warm_worker(
        &mut self,
        session: Uuid,
        cell_id: &str,
        worker: Arc<Mutex<WorkerProc>>,
        pos: usize,
        ctx: &mut Context<Self>,
    ) {
        self.release_slot(pos, session, "cell", ctx);
        let index = self.slots[pos].gpu.index;
        self.slots[pos].state = SlotState::Prepared { session, cell_id: cell_id.to_string() };
        self.slots[pos].since = Instant::now();
        let worker_id = worker_id(&worker);
        self.enter(&worker_id, WorkerState::Warm);
        let pid = worker.try_lock().map(|w| w.pid).unwrap_or(0);
        let key = (session, cell_id.to_string());
        let prep = Prep {
            worker: Some(worker),
            worker_id: worker_id.clone(),
            slot: Some(index),
            revision: 0,
            class: PreparedClass::Warm,
            ready_since: Some(Instant::now()),
            preparing: false,
            next: None,
            run: None,
            evict: None,
        };
        self.prepared.insert(key, prep);
        let ev = EventKind::Ready {
            host: self.env.host_id.clone(),
            slot: Some(index),
            worker: worker_id,
            pid,
            cell_id: cell_id.to_string(),
            revision: 0,
            class: PreparedClass::Warm,
            prepare_ms: 0.0,
        };
        self.session_event(session, ev, ctx);
    }

    /// Free a slot by stopping an idle prepared worker that holds one.
    fn evict_for_slot(&mut self, ctx: &mut Context<Self>) -> Option<usize> {
        let key = self.idle_prepared()?;
        let slot = self.prepared.get(&key)?.slot?;
        self.end_prepared(&key, "evicted for a run", ctx);
        self.slots.iter().position(|s| s.gpu.index == slot)
    }

    /// A run this host claimed without a prepared worker: a free slot, or an idle
    /// prepared worker's slot, or wait for one.
    fn run_won(&mut self, recipe: RecipeV1, ctx: &mut Context<Self>) {
        let pos = self.free_slot().or_else(|| self.evict_for_slot(ctx));
        match pos {
            Some(pos) => {
                self.slots[pos].state = SlotState::Busy { exec: recipe.exec_id, session: recipe.session };
                self.slots[pos].since = Instant::now();
                let index = self.slots[pos].gpu.index;
                self.spawn_exec(recipe, Target::Fresh { slot: Some(index) }, ctx);
            }
            None => self.won.push_back(recipe),
        }
        self.publish_status(ctx);
    }

    /// No slot free, but an idle prepared worker could give one up: claim first
    /// (with the longest delay, as a full host), evict only if this host won.
    fn claim_then_evict(&mut self, recipe: RecipeV1, ctx: &mut Context<Self>) {
        let (delay, score) = self.claim_delay(&recipe);
        let claims = self.claims.clone();
        let claim = buckets::run_claim_key(recipe.exec_id);
        let me = self.env.host_id.clone();
        let fut = async move {
            tokio::time::sleep(delay).await;
            claims.create(claim, me.into_bytes().into()).await
        };
        ctx.spawn(fut.into_actor(self).map(move |won, act, ctx| {
            act.publish_bid(recipe.exec_id, score, delay, won.is_ok(), ctx);
            if won.is_ok() {
                act.run_won(recipe, ctx);
            }
        }));
    }

    /// The slot-holding prepared worker to give up first for a run: ready (not
    /// preparing, no run waiting), warm before speculative, longest idle first.
    fn idle_prepared(&self) -> Option<PrepKey> {
        self.prepared
            .iter()
            .filter(|(_, p)| !p.preparing && p.run.is_none() && p.worker.is_some() && p.slot.is_some())
            .min_by_key(|(_, p)| (p.class == PreparedClass::Speculative, p.ready_since))
            .map(|(k, _)| k.clone())
    }

    /// Stop a prepared worker and free its slot; `outcome` says why.
    fn end_prepared(&mut self, key: &PrepKey, outcome: &str, ctx: &mut Context<Self>) {
        let Some(p) = self.prepared.remove(key) else { return };
        let idle_ms = p.ready_since.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1000.0);
        if let Some(w) = p.worker.clone() {
            stop_worker(w, ctx, self);
        }
        if let Some(pos) = p.slot.and_then(|index| self.slots.iter().position(|s| s.gpu.index == index)) {
            self.release_slot(pos, key.0, "speculation", ctx);
        }
        self.prepared_ended(key.clone(), &p, idle_ms, outcome, ctx);
        self.try_pending(ctx);
        self.publish_status(ctx);
    }

    fn prepared_ended(&mut self, key: PrepKey, p: &Prep, idle_ms: f64, outcome: &str, ctx: &mut Context<Self>) {
        tracing::info!(session = %key.0, cell = %key.1, worker = %p.worker_id, idle_ms, outcome, "prepared worker ended");
        let ev = EventKind::PreparedEnded {
            host: self.env.host_id.clone(),
            slot: p.slot,
            worker: p.worker_id.clone(),
            cell_id: key.1,
            class: p.class,
            idle_ms,
            outcome: outcome.to_string(),
        };
        self.session_event(key.0, ev, ctx);
    }

    /// Prepared workers whose process died while waiting free their slot.
    fn reap_lost_prepared(&mut self, ctx: &mut Context<Self>) {
        let lost: Vec<PrepKey> = self
            .prepared
            .iter()
            .filter(|(_, p)| !p.preparing && p.run.is_none())
            .filter(|(_, p)| {
                p.worker.as_ref().is_some_and(|w| w.try_lock().is_ok_and(|w| !crate::process::is_alive(w.pid)))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in lost {
            tracing::warn!(session = %key.0, cell = %key.1, "a prepared worker died while waiting");
            self.end_prepared(&key, "lost", ctx);
        }
    }

    /// The planner (budget) or the session asks to stop a prepared worker.
    fn evict(&mut self, msg: EvictV1, ctx: &mut Context<Self>) {
        let key = self.prepared.iter().find(|(_, p)| p.worker_id == msg.worker).map(|(k, _)| k.clone());
        let Some(key) = key else { return };
        match self.prepared.get_mut(&key) {
            Some(p) if p.run.is_some() => {} // a run claimed it: too late
            Some(p) if p.preparing => p.evict = Some("evicted"),
            Some(_) => self.end_prepared(&key, "evicted", ctx),
            None => {}
        }
    }

    /// Move a worker this host holds (idle, so its id is known) to `to`.
    fn enter(&self, worker: &str, to: WorkerState) {
        self.env.lifecycle.advance(worker, to);
    }

    fn session_event(&mut self, session: Uuid, kind: EventKind, ctx: &mut Context<Self>) {
        let ev = SessionEventV1 { session, exec_id: Uuid::nil(), unix_ms: unix_ms(), kind };
        let bus = self.env.bus.clone();
        ctx.spawn(
            async move {
                if let Err(e) = bus.publish(bus.subjects().event(session), &ev).await {
                    tracing::error!(error = %e, "could not publish a session event");
                }
            }
            .into_actor(self),
        );
    }

    fn claim_gpu(&mut self, recipe: RecipeV1, slot: usize, ctx: &mut Context<Self>) {
        // scored before the slot is reserved: a free slot is what this host offers
        let (delay, score) = self.claim_delay(&recipe);
        self.slots[slot].state = SlotState::Claiming(recipe.exec_id);
        self.slots[slot].since = Instant::now();
        let claims = self.claims.clone();
        let key = buckets::run_claim_key(recipe.exec_id);
        let me = self.env.host_id.clone();
        let fut = async move {
            tokio::time::sleep(delay).await;
            claims.create(key, me.into_bytes().into()).await
        };
        ctx.spawn(fut.into_actor(self).map(move |won, act, ctx| {
            act.publish_bid(recipe.exec_id, score, delay, won.is_ok(), ctx);
            match won {
                Ok(_) => {
                    act.slots[slot].state = SlotState::Busy { exec: recipe.exec_id, session: recipe.session };
                    act.spawn_exec(recipe, Target::Fresh { slot: Some(act.slots[slot].gpu.index) }, ctx);
                }
                Err(e) => {
                    if e.kind() != kv::CreateErrorKind::AlreadyExists {
                        tracing::warn!(error = %e, "claim failed");
                    }
                    act.slots[slot].state = SlotState::Free;
                    act.try_pending(ctx);
                }
            }
            act.publish_status(ctx);
        }));
    }

    fn claim_cpu(&mut self, recipe: RecipeV1, ctx: &mut Context<Self>) {
        if let Some(wid) = self.cpu.get(&recipe.session).cloned() {
            if let Some(k) = self.kept.get(&wid) {
                let target = Target::Existing { worker: k.worker.clone(), prepare: Prepare::Persistent, slot: None };
                self.spawn_exec(recipe, target, ctx);
                return;
            }
        }
        let claims = self.claims.clone();
        let key = buckets::cpu_claim_key(recipe.session);
        let me = self.env.host_id.clone();
        let fut = async move {
            match claims.create(&key, me.clone().into_bytes().into()).await {
                Ok(_) => true,
                // mine already (e.g. the worker died and this host restarts it)
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    matches!(claims.get(&key).await, Ok(Some(v)) if v.as_ref() == me.as_bytes())
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cpu claim failed");
                    false
                }
            }
        };
        ctx.spawn(fut.into_actor(self).map(move |mine, act, ctx| {
            if mine {
                act.spawn_exec(recipe, Target::Fresh { slot: None }, ctx);
            }
        }));
    }

    fn spawn_exec(&mut self, recipe: RecipeV1, target: Target, ctx: &mut Context<Self>) {
        let env = self.env.clone();
        let kind = match &target {
            Target::Fresh { slot } => ExecKind::Fresh { slot: *slot },
            Target::Existing { prepare: Prepare::Speculative | Prepare::Warm, slot: Some(slot), .. } => {
                ExecKind::Prepared { slot: *slot }
            }
            Target::Existing { worker, .. } => ExecKind::Existing { worker: worker.clone() },
        };
        let device = recipe.device;
        let session = recipe.session;
        let cell_id = recipe.cell_id.clone();
        let span = tracing::info_span!("execute", exec = %recipe.exec_id, %session, cell = %recipe.cell_id);
        let fut = tracing::Instrument::instrument(async move { env.execute(recipe, target).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |outcome, act, ctx| {
            act.exec_done(session, &cell_id, device, kind, outcome, ctx);
        }));
    }

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
            // a prepared worker ends like a fresh one: its slot goes free or stays
            // pinned for unsavable state
            ExecKind::Fresh { slot: Some(index) } | ExecKind::Prepared { slot: index } => {
                let pos = self.slots.iter().position(|s| s.gpu.index == index);
                match (outcome.worker, pos) {
                    (Some(worker), Some(pos)) if !outcome.unsavable.is_empty() => {
                        let id = worker_id(&worker);
                        tracing::info!(worker = %id, unsavable = ?outcome.unsavable, "keeping the worker for unsavable state");
                        self.enter(&id, WorkerState::Kept);
                        self.slots[pos].state = SlotState::Pinned { worker: id.clone(), session };
                        self.kept.insert(id, Kept { worker, session, slot: Some(index), persistent: false });
                    }
                    (Some(worker), Some(pos))
                        if self.keep_warm && !self.prepared.contains_key(&(session, cell_id.to_string())) =>
                    {
                        self.keep_warm_worker(session, cell_id, worker, pos, ctx);
                    }
                    (worker, pos) => {
                        if let Some(w) = worker {
                            stop_worker(w, ctx, self);
                        }
                        if let Some(pos) = pos {
                            self.release_slot(pos, session, "cell", ctx);
                        }
                    }
                }
            }
            ExecKind::Fresh { slot: None } => {
                if let Some(worker) = outcome.worker {
                    let id = worker_id(&worker);
                    let persistent = device == Device::Cpu;
                    if persistent {
                        self.cpu.insert(session, id.clone());
                    }
                    if persistent || !outcome.unsavable.is_empty() {
                        self.enter(&id, WorkerState::Kept);
                        self.kept.insert(id, Kept { worker, session, slot: None, persistent });
                    } else {
                        stop_worker(worker, ctx, self);
                    }
                }
            }
            ExecKind::Existing { worker } => {
                let id = worker_id(&worker);
                match outcome.worker {
                    None => {
                        // lost: forget it; cells needing its unsavable state now fail clearly
                        if let Some(k) = self.kept.remove(&id) {
                            self.cpu.retain(|_, w| *w != id);
                            if let Some(index) = k.slot {
                                if let Some(pos) = self.slots.iter().position(|s| s.gpu.index == index) {
                                    self.release_slot(pos, k.session, "unsavable state", ctx);
                                }
                            }
                        }
                    }
                    Some(w) => {
                        let persistent = self.kept.get(&id).is_some_and(|k| k.persistent);
                        self.enter(&id, WorkerState::Kept);
                        if !persistent && outcome.unsavable.is_empty() {
                            // nothing left that only this worker has
                            if let Some(k) = self.kept.remove(&id) {
                                stop_worker(w, ctx, self);
                                if let Some(index) = k.slot {
                                    if let Some(pos) = self.slots.iter().position(|s| s.gpu.index == index) {
                                        self.release_slot(pos, k.session, "unsavable state", ctx);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        self.try_pending(ctx);
        self.publish_status(ctx);
    }

    fn release_slot(&mut self, pos: usize, session: Uuid, reason: &str, ctx: &mut Context<Self>) {
        let held_ms = self.slots[pos].since.elapsed().as_secs_f64() * 1000.0;
        let index = self.slots[pos].gpu.index;
        self.slots[pos].state = SlotState::Free;
        let ev = SessionEventV1 {
            session,
            exec_id: Uuid::nil(),
            unix_ms: unix_ms(),
            kind: EventKind::SlotReleased {
                host: self.env.host_id.clone(),
                slot: index,
                held_ms,
                reason: reason.to_string(),
            },
        };
        let bus = self.env.bus.clone();
        ctx.spawn(
            async move {
                if let Err(e) = bus.publish(bus.subjects().event(session), &ev).await {
                    tracing::error!(error = %e, "could not publish slot release");
                }
            }
            .into_actor(self),
        );
    }

    fn try_pending(&mut self, ctx: &mut Context<Self>) {
        while self.free_slot().is_some() {
            let Some(key) = self.waiting_prepared.pop_front() else { break };
            let run = self.prepared.get_mut(&key).and_then(|p| p.run.take());
            if let Some(run) = run {
                self.run_prepared(key, run, ctx);
            }
        }
        while self.free_slot().is_some() {
            let Some(recipe) = self.won.pop_front() else { break };
            self.run_won(recipe, ctx);
        }
        while let Some(slot) = self.free_slot() {
            let Some(recipe) = self.pending.pop_front() else { break };
            self.claim_gpu(recipe, slot, ctx);
        }
        // then preparations that waited briefly for a slot; older ones are stale
        self.spec_waiting.retain(|(at, _)| at.elapsed() < SPEC_WAIT);
        while self.free_slot().is_some() {
            let Some((_, recipe)) = self.spec_waiting.pop_front() else { break };
            self.on_edit_recipe(recipe, ctx);
        }
    }

    fn close_session(&mut self, session: Uuid, ctx: &mut Context<Self>) {
        self.pending.retain(|r| r.session != session);
        self.spec_waiting.retain(|(_, r)| r.session != session);
        let preps: Vec<PrepKey> = self.prepared.keys().filter(|(s, _)| *s == session).cloned().collect();
        for key in preps {
            match self.prepared.get_mut(&key) {
                Some(p) if p.preparing => p.evict = Some("session closed"),
                Some(_) => self.end_prepared(&key, "session closed", ctx),
                None => {}
            }
        }
        self.cpu.remove(&session);
        let ids: Vec<String> =
            self.kept.iter().filter(|(_, k)| k.session == session).map(|(id, _)| id.clone()).collect();
        for id in ids {
            if let Some(k) = self.kept.remove(&id) {
                stop_worker(k.worker, ctx, self);
                if let Some(index) = k.slot {
                    if let Some(pos) = self.slots.iter().position(|s| s.gpu.index == index) {
                        self.release_slot(pos, session, "unsavable state", ctx);
                    }
                }
            }
        }
        let claims = self.claims.clone();
        ctx.spawn(
            async move {
                if let Err(e) = claims.delete(buckets::cpu_claim_key(session)).await {
                    tracing::debug!(error = %e, "cpu claim delete");
                }
            }
            .into_actor(self),
        );
        self.publish_status(ctx);
    }

    fn renew_claims(&self, ctx: &mut Context<Self>) {
        let claims = self.claims.clone();
        let me = self.env.host_id.clone();
        let keys: Vec<String> = self.cpu.keys().map(|s| buckets::cpu_claim_key(*s)).collect();
        let runs: Vec<String> = self
            .slots
            .iter()
            .filter_map(|s| match s.state {
                SlotState::Busy { exec, .. } => Some(buckets::run_claim_key(exec)),
                _ => None,
            })
            .collect();
        ctx.spawn(
            async move {
                for key in keys.into_iter().chain(runs) {
                    if let Err(e) = claims.put(&key, me.clone().into_bytes().into()).await {
                        tracing::warn!(error = %e, %key, "could not renew a claim");
                    }
                }
            }
            .into_actor(self),
        );
    }

    /// Stop every worker this host keeps (shutdown).
    pub fn stop_all(&mut self, ctx: &mut Context<Self>) {
        let kept: Vec<Kept> = self.kept.drain().map(|(_, k)| k).collect();
        for k in kept {
            stop_worker(k.worker, ctx, self);
        }
        let preps: Vec<Prep> = self.prepared.drain().map(|(_, p)| p).collect();
        for w in preps.into_iter().filter_map(|p| p.worker) {
            stop_worker(w, ctx, self);
        }
    }
}

/// Whether any object the closure of `recipe` reaches lives on a GPU.
fn closure_on_gpu(m: &schemas::checkpoint::Manifest, recipe: &RecipeV1) -> bool {
    let roots = recipe.closure.iter().filter_map(|v| m.variables.get(&v.name).and_then(|e| e.oid.as_deref()));
    m.reachable(roots).iter().any(|oid| m.objects.get(oid).is_some_and(|o| o.on_gpu))
}

enum ExecKind {
    Fresh {
        slot: Option<u32>,
    },
    /// A worker prepared before Run, holding GPU slot `slot`.
    Prepared {
        slot: u32,
    },
    Existing {
        worker: Arc<Mutex<WorkerProc>>,
    },
}

fn worker_id(worker: &Arc<Mutex<WorkerProc>>) -> String {
    // the lock is free once an execution returned its worker
    worker.try_lock().map(|w| w.id.clone()).unwrap_or_default()
}

fn stop_worker(worker: Arc<Mutex<WorkerProc>>, ctx: &mut Context<Host>, host: &Host) {
    // Evicted from now on, so the status published next no longer lists it; the
    // process itself is stopped below.
    host.enter(&worker_id(&worker), WorkerState::Evicted);
    ctx.spawn(
        async move {
            match Arc::try_unwrap(worker) {
                Ok(m) => m.into_inner().stop().await,
                Err(shared) => shared.lock().await.kill_now(),
            }
        }
        .into_actor(host),
    );
}

impl Actor for Host {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(TICK, |act, ctx| {
            act.reap_lost_prepared(ctx);
            act.publish_status(ctx);
            act.renew_claims(ctx);
        });
        self.publish_status(ctx);
    }
}

impl StreamHandler<Result<Envelope<RecipeV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<RecipeV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            let _span = env.span("host.recipe").entered();
            self.on_recipe(env.msg, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<SessionEventV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<SessionEventV1>, Rejected>, _ctx: &mut Self::Context) {
        if let Ok(env) = item {
            if let EventKind::Claimed { host, .. } = &env.msg.kind {
                if *host != self.env.host_id {
                    let exec = env.msg.exec_id;
                    self.pending.retain(|r| r.exec_id != exec);
                }
            }
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

impl StreamHandler<Result<Envelope<EvictV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<EvictV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            tracing::debug!(worker = %env.msg.worker, reason = %env.msg.reason, "eviction asked");
            self.evict(env.msg, ctx);
        }
    }
}

/// Stop the host: stop every kept worker.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Stop;

impl Handler<Stop> for Host {
    type Result = ();

    fn handle(&mut self, _: Stop, ctx: &mut Self::Context) {
        self.stop_all(ctx);
    }
}
