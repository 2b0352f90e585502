//! One actor per session: the run queue (one cell at a time, in submission order), the
//! relay of the session's events and outputs to SSE clients, and the replay log
//! ([`crate::resume`]).
//!
//! Fed by two subscriptions made before it starts: `{prefix}.v1.session.{sid}.event`
//! and `{prefix}.v1.output.{sid}.*`. Publishes `{prefix}.v1.session.{sid}.run`. A
//! cell whose host falls silent ends with what the store committed (`watch_host`).
//! A queued run whose code the session's record has no room for keeps it in the
//! bodies bucket until it is sent (ADR 53).
//!
//! Laid out by concern: the actor, its record writer and its subscriptions here;
//! `hosts` (when each gpu-host was last heard), `current` (the state of the run in
//! flight), `queue` (run admission, the queue, interrupts), `settle` (how the
//! current run ends: deadlines, host loss, the store's word, completion), `events`
//! (the run's events and outputs), `relay` (stream items to SSE clients),
//! `requests` (the handlers' other questions) and `read_back` (what the streams
//! kept).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::messages::{OutputV2, SessionEventV2};
use schemas::{Bus, Envelope};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::api::{ExecStatus, StreamItem};
use crate::records::{Records, SessionRecord};
use crate::resume;
use crate::Timeouts;

mod current;
mod events;
mod hosts;
mod meter;
mod queue;
mod read_back;
mod relay;
mod requests;
mod settle;

use current::Current;
pub use hosts::HostsSeen;
pub use queue::{Interrupt, QueueFull, Run, RunAnswer, Withdraw};
use read_back::{event_key, output_key};
pub use relay::Attach;
use relay::Watcher;
pub use requests::{
    Close, CountRuns, CpuHost, Detach, Detached, Edit, FreeIdleWorkers, IdleFor, Input, Refused, Revert, RunCounts,
    Summary,
};
pub(crate) use settle::claim_holder;

/// A record to write, and who waits until it landed.
type RecordWrite = (SessionRecord, Option<tokio::sync::oneshot::Sender<()>>);

/// How long a run waits for its in-flight record to land; if it does not, the run
/// is not sent (a frontend that adopts the session could not follow it).
pub const RECORD_WAIT: Duration = Duration::from_secs(10);

/// How long the frontend waits for the store's answer (settling a run, moving
/// or forking a session's state, deleting it).
pub(crate) const STORE_WAIT: Duration = Duration::from_secs(10);

/// How soon a record write that failed is tried again.
const RECORD_RETRY: Duration = Duration::from_secs(1);

/// What the summary shows for one execution.
type ExecRecord = crate::api::ExecutionSummary;

/// What every session actor of a frontend shares.
#[derive(Clone)]
pub struct Shared {
    /// The service's bus.
    pub bus: Bus,
    /// Run-queue deadlines.
    pub timeouts: Timeouts,
    /// When each gpu-host was last heard.
    pub hosts: HostsSeen,
    /// The run claims (an interrupt before any host claimed the run claims it).
    pub claims: async_nats::jetstream::kv::Store,
    /// Session records (any frontend serves any session).
    pub records: Records,
    /// The bus's bodies bucket, where a queued run keeps its code when the
    /// session's record has no room for it.
    pub bodies: schemas::bodies::Bodies,
    /// Stream items each session keeps for clients that connect or reconnect later.
    pub history_items: usize,
    /// The most bytes of those items each session keeps.
    pub history_bytes: usize,
    /// Runs a session may have waiting behind the running one.
    pub queued_runs: usize,
    /// What the dashboard at `/` shows (every session's stream items go there too).
    pub dashboard: crate::dashboard::Dashboard,
    /// Where what each session used is booked.
    pub usage: crate::usage::Ledger,
    /// The users' quotas.
    pub quotas: crate::quota::Quotas,
}

/// The per-session actor.
pub struct SessionActor {
    sid: Uuid,
    shared: Shared,
    /// What outlives this actor (options, owner, the revision the last completed
    /// execution left), as written to the session's record.
    stored: SessionRecord,
    /// The record's writer: the latest record is written, in order.
    record_tx: mpsc::UnboundedSender<RecordWrite>,
    current: Option<Current>,
    /// Pieces of outputs too large for one message, per (execution, seq).
    pieces: HashMap<(Uuid, u64), Vec<Option<String>>>,
    edit_seq: HashMap<String, u64>,
    executions: Vec<ExecRecord>,
    /// The newest stream items, for clients that connect or reconnect later: at
    /// most `shared.history_items` and `shared.history_bytes`.
    log: resume::Log,
    clients: Vec<Watcher>,
    closing: bool,
    /// A revert (undo, checkout) waits for the store: no run is sent meanwhile.
    reverting: bool,
    /// When a client last did something with the session, or a cell last ended.
    last_active: Instant,
    /// When its workers were last given back for idleness (`--idle-cull-s`).
    workers_freed_at: Option<Instant>,
    /// The host that keeps the session's CPU worker, as its last CPU cell said
    /// (completions and inspections are asked there).
    cpu_host: Option<String>,
    /// Keys of the messages replayed from the streams for an adopted run, which
    /// the live subscriptions may deliver again.
    replayed: HashSet<String>,
    /// The root span of each run this frontend accepted and has not ended: the
    /// run is sent under it, so its trace goes through planner, host and store.
    traces: HashMap<Uuid, tracing::Span>,
    /// What its runs used, until they are booked.
    meter: meter::Meter,
}

impl SessionActor {
    /// The actor of the session `record` describes (a new one, or one adopted from
    /// its record); add its two subscriptions as streams when starting it.
    pub fn new(record: SessionRecord, shared: Shared) -> Self {
        let (record_tx, mut rx) = mpsc::unbounded_channel::<RecordWrite>();
        let records = shared.records.clone();
        // one writer per session: records land in order, only the latest of those
        // waiting is written, a failed write is tried again until it lands or a
        // newer record replaces it, and those waiting hear once it landed
        tokio::spawn(async move {
            while let Some((mut latest, ack)) = rx.recv().await {
                let mut acks: Vec<_> = ack.into_iter().collect();
                loop {
                    while let Ok((newer, ack)) = rx.try_recv() {
                        latest = newer;
                        acks.extend(ack);
                    }
                    match records.put(&latest).await {
                        Ok(()) => break,
                        Err(e) => {
                            tracing::warn!(session = %latest.session_id, error = %e, "could not update the session's record; trying again");
                            tokio::time::sleep(RECORD_RETRY).await;
                        }
                    }
                }
                for ack in acks {
                    let _ = ack.send(());
                }
            }
        });
        let log = resume::Log::new(shared.history_items, shared.history_bytes);
        let account = crate::usage::Account {
            session_id: record.session_id,
            owner: record.owner.clone(),
            notebook: record.notebook.clone(),
        };
        let booker = meter::booker(shared.usage.clone(), account);
        shared.dashboard.opened(record.session_id, record.owner.clone());
        Self {
            sid: record.session_id,
            stored: record,
            shared,
            record_tx,
            current: None,
            pieces: HashMap::new(),
            edit_seq: HashMap::new(),
            executions: Vec::new(),
            log,
            clients: Vec::new(),
            closing: false,
            reverting: false,
            last_active: Instant::now(),
            workers_freed_at: None,
            cpu_host: None,
            replayed: HashSet::new(),
            traces: HashMap::new(),
            meter: meter::Meter::new(booker),
        }
    }

    /// Write the session's record as it is now (`ack` hears once it landed).
    fn write_record(&mut self, ack: Option<tokio::sync::oneshot::Sender<()>>) {
        // the writer lives as long as the actor
        let _ = self.record_tx.send((self.stored.to_write(), ack));
    }

    fn record(&mut self, exec_id: Uuid) -> Option<&mut ExecRecord> {
        self.executions.iter_mut().rev().find(|r| r.exec_id == exec_id)
    }
}

impl Actor for SessionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // what is emitted until the record's runs are read back, a client resuming
        // from an earlier incarnation may have seen (`resume`)
        self.log.recovering(true);
        let adopting = self.stored.in_flight.is_some();
        if let Some(run) = self.stored.in_flight.clone() {
            self.adopt_in_flight(run, ctx);
        }
        // runs accepted by the frontend that served the session before, in order
        for q in self.stored.queued.clone() {
            self.executions.push(ExecRecord {
                exec_id: q.exec_id,
                cell_id: q.cell_id.clone(),
                run_unix_ms: q.run_unix_ms,
                status: ExecStatus::Queued,
                after_revision: None,
                error: None,
            });
            self.emit(&StreamItem::Queued { exec_id: q.exec_id, cell_id: q.cell_id, run_unix_ms: q.run_unix_ms });
        }
        self.start_next(ctx);
        // (an adopted run in flight ends recovery once its streams are read back)
        if !adopting {
            self.log.recovering(false);
        }
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        self.meter_flush();
        self.shared.dashboard.closed(self.sid);
    }
}

impl StreamHandler<Result<Envelope<SessionEventV2>, Rejected>> for SessionActor {
    fn handle(&mut self, item: Result<Envelope<SessionEventV2>, Rejected>, ctx: &mut Self::Context) {
        // a rejected message was already logged by the bus; keep serving
        if let Ok(env) = item {
            if env.msg.session != self.sid {
                tracing::error!(subject = %env.subject, "event names another session; dropped");
                return;
            }
            let _entered = env.span("frontend.event").entered();
            if self.replayed_already(|| event_key(&env.msg)) {
                return;
            }
            self.on_event(ctx, env.msg);
        }
    }

    fn finished(&mut self, _ctx: &mut Self::Context) {
        tracing::warn!(session = %self.sid, "event subscription ended");
    }
}

impl StreamHandler<Result<Envelope<OutputV2>, Rejected>> for SessionActor {
    fn handle(&mut self, item: Result<Envelope<OutputV2>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            if env.msg.session != self.sid {
                tracing::error!(subject = %env.subject, "output names another session; dropped");
                return;
            }
            if self.replayed_already(|| output_key(&env.msg)) {
                return;
            }
            self.on_output(ctx, env.msg);
        }
    }

    fn finished(&mut self, _ctx: &mut Self::Context) {
        tracing::warn!(session = %self.sid, "output subscription ended");
    }
}
