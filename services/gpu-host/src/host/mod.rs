//! The host actor: a thin shell around the host's decisions ([`crate::core`],
//! ADR 56). It turns what arrives over NATS, KV claims settling and worker
//! results into [`Input`]s, hands each to [`HostCore::on`], and carries out the
//! [`Command`]s that come back ([`commands`]): claims, preparations and
//! executions ([`crate::exec`]) as futures whose results are inputs again.
//!
//! ```text
//!  recipes, statuses, evictions, closes ──▶ handlers ──▶ Input ──▶ HostCore ──▶ Commands
//!                                                          ▲                      │
//!  claims settled, closures read, prepared, executed ──────┴──── futures ◀───────┘
//! ```
//!
//! What only the shell holds: the worker processes the core names by id, the
//! spans that continue each cell's trace, and the NATS and KV clients.

pub mod claims;
mod commands;
mod cpu_worker;
mod handlers;
pub mod placement;
pub mod slots;
mod status;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::FutureExt as _;
use schemas::messages::{RecipeV3, WorkerState, ZygoteStatus};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::core::prepared::PrepKey;
use crate::core::{Command, Facts, HostCore, Input, Policy, ARRIVAL_MEMORY};
use crate::exec::ExecEnv;
use crate::gpus::Gpu;
use crate::worker::WorkerProc;
use claims::Claims;
pub use handlers::RunClaimed;

pub use crate::core::SPEC_WAIT;

/// How often status is published and claims renewed.
const TICK: Duration = Duration::from_secs(2);

/// The host actor.
pub struct Host {
    env: ExecEnv,
    claims: Claims,
    real_gpus: bool,
    core: HostCore,
    /// The worker processes the core names by id (prepared, kept, or running).
    workers: HashMap<String, Arc<Mutex<WorkerProc>>>,
    /// Each run recipe as it arrived: a start's phases count from there, its
    /// spans continue the cell's trace.
    arrived: HashMap<Uuid, Arrival>,
    /// The span of each cell's latest preparation: the run it serves links to it.
    prepare_spans: HashMap<PrepKey, tracing::Span>,
    /// Zygotes as last seen (the cache is locked while a fork is under way).
    last_zygotes: Vec<ZygoteStatus>,
    /// Executions under way, for a stopping host to wait on.
    running_count: tokio::sync::watch::Sender<usize>,
}

/// A run recipe as this host received it.
struct Arrival {
    /// When: a start's phases count from here.
    at: Instant,
    /// The span of its receipt, in the cell's trace: its claim and execution
    /// are children of it.
    span: tracing::Span,
}

/// What the core asks of the world, answered from the shell's workers and the
/// host's zygotes and chunk cache.
struct World<'a> {
    env: &'a ExecEnv,
    workers: &'a HashMap<String, Arc<Mutex<WorkerProc>>>,
}

impl Facts for World<'_> {
    fn alive(&self, worker: &str) -> bool {
        match self.workers.get(worker).map(|w| w.try_lock()) {
            Some(Ok(w)) => crate::process::is_alive(w.pid),
            Some(Err(_)) => true, // in use: an execution or preparation holds it
            None => false,
        }
    }

    fn placement(&self, recipe: &RecipeV3) -> (f64, f64) {
        self.env.placement(recipe)
    }
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
        let policy = Policy { prepare_holds_slot, keep_warm };
        let core = HostCore::new(env.host_id.clone(), slots, policy, schemas::clock::SystemClock);
        Self {
            env,
            claims,
            real_gpus,
            core,
            workers: HashMap::new(),
            arrived: HashMap::new(),
            prepare_spans: HashMap::new(),
            last_zygotes: Vec::new(),
            running_count: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Decide on `input` and carry out what was decided.
    fn drive(&mut self, input: Input, ctx: &mut Context<Self>) {
        let world = World { env: &self.env, workers: &self.workers };
        let commands = self.core.on(input, &world);
        // status is published once per input, with what it left
        let mut publish = false;
        for command in commands {
            match command {
                Command::PublishStatus => publish = true,
                command => self.carry_out(command, ctx),
            }
        }
        if publish {
            self.publish_status(ctx);
        }
        self.running_count.send_replace(self.core.running());
    }

    /// Run `fut` in the background (publishing, stopping workers): its failures
    /// are its own to log.
    fn background(&mut self, fut: impl std::future::Future<Output = ()> + 'static, ctx: &mut Context<Self>) {
        ctx.spawn(fut.into_actor(self));
    }

    /// Keep the handle of a worker the core now names.
    fn hold(&mut self, worker: &Arc<Mutex<WorkerProc>>) -> Option<crate::core::WorkerRef> {
        let (id, pid) = worker.try_lock().map(|w| (w.id.clone(), w.pid)).ok()?;
        self.workers.insert(id.clone(), worker.clone());
        Some(crate::core::WorkerRef { id, pid })
    }
}

impl Actor for Host {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(TICK, |act, ctx| {
            act.arrived.retain(|_, a| a.at.elapsed() < ARRIVAL_MEMORY);
            if let Some(cgroups) = &act.env.cgroups {
                cgroups.sweep();
            }
            act.drive(Input::Tick, ctx);
        });
        self.carry_out(Command::PublishStatus, ctx);
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

    fn handle(&mut self, _: Stop, ctx: &mut Self::Context) -> Self::Result {
        self.env.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        self.drive(Input::Stopping, ctx);
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
        Box::pin(executions_ended.into_actor(self).then(|(), act, _ctx| {
            // every worker left stops now, and the answer waits for them all
            let world = World { env: &act.env, workers: &act.workers };
            let mut stops = Vec::new();
            for command in act.core.on(Input::Stopped, &world) {
                match command {
                    Command::StopWorker { worker } => stops.extend(act.workers.remove(&worker)),
                    Command::Enter { worker, state } => act.env.lifecycle.advance(&worker, state),
                    _ => {}
                }
            }
            futures::future::join_all(stops.into_iter().map(commands::stop)).map(|_| ()).into_actor(act)
        }))
    }
}
