//! The host actor: owns this host's GPU slots, the sessions' persistent CPU workers
//! and the workers kept for unsavable state; competes for recipes (DESIGN.md
//! section 5) and hands each won recipe to an execution future ([`crate::exec`]).
//!
//! ```text
//!  recipes ──▶ Host ──claim (KV create)──▶ execution future ──▶ ExecDone ──▶ Host
//!  events  ──▶ Host (drop pending recipes another host claimed)
//!  closes  ──▶ Host (stop the session's workers)      tick ──▶ status, claim renewal
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use async_nats::jetstream::kv;
use schemas::buckets;
use schemas::bus::Rejected;
use schemas::messages::{
    Device, EventKind, HostStatusV1, Prepare, RecipeKind, RecipeV1, SessionCloseV1, SessionEventV1, SlotStatus,
    ZygoteStatus,
};
use schemas::{unix_ms, Envelope};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::exec::{ExecEnv, Outcome, Target};
use crate::gpus::Gpu;
use crate::worker::WorkerProc;

/// How often status is published and claims renewed.
const TICK: Duration = Duration::from_secs(2);

enum SlotState {
    Free,
    /// Reserved while this host tries to claim `exec`.
    Claiming(Uuid),
    /// Running `exec` for `session`.
    Busy { exec: Uuid, session: Uuid },
    /// Kept with a worker that holds unsavable state.
    Pinned { worker: String, session: Uuid },
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

/// The host actor.
pub struct Host {
    env: ExecEnv,
    claims: kv::Store,
    slots: Vec<Slot>,
    real_gpus: bool,
    kept: HashMap<String, Kept>,
    cpu: HashMap<Uuid, String>,
    pending: VecDeque<RecipeV1>,
    /// Zygotes as last seen (the cache is locked while a fork is under way).
    last_zygotes: Vec<ZygoteStatus>,
}

impl Host {
    /// A host with `slots` (real GPUs or virtual ones), claiming through `claims`.
    pub fn new(env: ExecEnv, claims: kv::Store, slots: Vec<Gpu>, real_gpus: bool) -> Self {
        let slots = slots.into_iter().map(|gpu| Slot { gpu, state: SlotState::Free, since: Instant::now() }).collect();
        Self { env, claims, slots, real_gpus, kept: HashMap::new(), cpu: HashMap::new(), pending: VecDeque::new(), last_zygotes: Vec::new() }
    }

    fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(|s| matches!(s.state, SlotState::Free))
    }

    /// Shorter for a better-placed host: more free slots, less load.
    fn claim_delay(&self) -> Duration {
        let total = self.slots.len().max(1) as u64;
        let free = self.slots.iter().filter(|s| matches!(s.state, SlotState::Free)).count() as u64;
        let jitter = (Uuid::new_v4().as_u128() % 3000) as u64;
        Duration::from_micros(2_000 + 10_000 * (total - free) / total + jitter)
    }

    fn status(&self) -> HostStatusV1 {
        let slots = self
            .slots
            .iter()
            .map(|s| {
                let (exec_id, session, held_for) = match &s.state {
                    SlotState::Free => (None, None, None),
                    SlotState::Claiming(e) => (Some(*e), None, Some("claiming".to_string())),
                    SlotState::Busy { exec, session } => (Some(*exec), Some(*session), Some("cell".to_string())),
                    SlotState::Pinned { session, worker } => (None, Some(*session), Some(format!("unsavable state in {worker}"))),
                };
                SlotStatus { index: s.gpu.index, name: s.gpu.name.clone(), memory_bytes: s.gpu.memory_bytes, exec_id, session, held_for }
            })
            .collect();
        let zygotes = match self.env.zygotes.try_lock() {
            Ok(cache) => cache
                .zygotes()
                .map(|z| ZygoteStatus { id: z.id.clone(), packages: z.packages.clone(), cuda_unsafe: z.cuda_unsafe.clone(), pid: z.pid })
                .collect(),
            Err(_) => self.last_zygotes.clone(),
        };
        HostStatusV1 {
            host: self.env.host_id.clone(),
            slots,
            real_gpus: self.real_gpus,
            zygotes,
            cpu_sessions: self.cpu.keys().copied().collect(),
            workers: (self.kept.len() + self.slots.iter().filter(|s| matches!(s.state, SlotState::Busy { .. })).count()) as u32,
            cache_bytes: self.env.chunks.cached_bytes(),
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
            return; // preparation while editing comes with the speculator
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
                match self.free_slot() {
                    Some(i) => self.claim_gpu(recipe, i, ctx),
                    None => self.pending.push_back(recipe),
                }
            }
        }
    }

    fn claim_gpu(&mut self, recipe: RecipeV1, slot: usize, ctx: &mut Context<Self>) {
        self.slots[slot].state = SlotState::Claiming(recipe.exec_id);
        self.slots[slot].since = Instant::now();
        let delay = self.claim_delay();
        let claims = self.claims.clone();
        let key = buckets::run_claim_key(recipe.exec_id);
        let me = self.env.host_id.clone();
        let fut = async move {
            tokio::time::sleep(delay).await;
            claims.create(key, me.into_bytes().into()).await
        };
        ctx.spawn(fut.into_actor(self).map(move |won, act, ctx| {
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
            Target::Existing { worker, .. } => ExecKind::Existing { worker: worker.clone() },
        };
        let device = recipe.device;
        let session = recipe.session;
        let span = tracing::info_span!("execute", exec = %recipe.exec_id, %session, cell = %recipe.cell_id);
        let fut = tracing::Instrument::instrument(async move { env.execute(recipe, target).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |outcome, act, ctx| {
            act.exec_done(session, device, kind, outcome, ctx);
        }));
    }

    fn exec_done(&mut self, session: Uuid, device: Device, kind: ExecKind, outcome: Outcome, ctx: &mut Context<Self>) {
        match kind {
            ExecKind::Fresh { slot: Some(index) } => {
                let pos = self.slots.iter().position(|s| s.gpu.index == index);
                match (outcome.worker, pos) {
                    (Some(worker), Some(pos)) if !outcome.unsavable.is_empty() => {
                        let id = worker_id(&worker);
                        tracing::info!(worker = %id, unsavable = ?outcome.unsavable, "keeping the worker for unsavable state");
                        self.slots[pos].state = SlotState::Pinned { worker: id.clone(), session };
                        self.kept.insert(id, Kept { worker, session, slot: Some(index), persistent: false });
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
            kind: EventKind::SlotReleased { host: self.env.host_id.clone(), slot: index, held_ms, reason: reason.to_string() },
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
        while let Some(slot) = self.free_slot() {
            let Some(recipe) = self.pending.pop_front() else { break };
            self.claim_gpu(recipe, slot, ctx);
        }
    }

    fn close_session(&mut self, session: Uuid, ctx: &mut Context<Self>) {
        self.pending.retain(|r| r.session != session);
        self.cpu.remove(&session);
        let ids: Vec<String> = self.kept.iter().filter(|(_, k)| k.session == session).map(|(id, _)| id.clone()).collect();
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
    }
}

enum ExecKind {
    Fresh { slot: Option<u32> },
    Existing { worker: Arc<Mutex<WorkerProc>> },
}

fn worker_id(worker: &Arc<Mutex<WorkerProc>>) -> String {
    // the lock is free once an execution returned its worker
    worker.try_lock().map(|w| w.id.clone()).unwrap_or_default()
}

fn stop_worker(worker: Arc<Mutex<WorkerProc>>, ctx: &mut Context<Host>, host: &Host) {
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
