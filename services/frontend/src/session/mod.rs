//! One actor per session: the run queue (one cell at a time, in submission order), the
//! relay of the session's events and outputs to SSE clients, and the replay log
//! ([`crate::resume`]).
//!
//! Fed by two subscriptions made before it starts: `{prefix}.v1.session.{sid}.event`
//! and `{prefix}.v1.output.{sid}.*`. Publishes `{prefix}.v1.session.{sid}.run`. A
//! cell whose host falls silent ends with what the store committed (`watch_host`).
//! A queued run whose code the session's record has no room for keeps it in the
//! bodies bucket until it is sent (ADR 53).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::messages::{
    CellStatus, EditV1, ErrorCode, EventKind, HostStatusV2, InputReplyV1, InterruptV1, ManifestV1, OutputV1, Prepare,
    RunV2, SessionEventV2, SettleV1,
};
use schemas::subjects::StoreVerb;
use schemas::{Bus, Envelope};
use tokio::sync::mpsc;
use tracing::Instrument as _;
use uuid::Uuid;

use crate::api::{ExecStatus, Interrupted, StreamItem};
use crate::records::{InFlight, QueuedRun, Records, SessionRecord, RECORD_INLINE_BYTES};
use crate::resume::{self, Position};
use crate::Timeouts;

mod read_back;
use read_back::{event_key, output_key};

/// A record to write, and who waits until it landed.
type RecordWrite = (SessionRecord, Option<tokio::sync::oneshot::Sender<()>>);

/// How long a run waits for its in-flight record to land; if it does not, the run
/// is not sent (a frontend that adopts the session could not follow it).
pub const RECORD_WAIT: Duration = Duration::from_secs(10);

/// How soon a record write that failed is tried again.
const RECORD_RETRY: Duration = Duration::from_secs(1);

/// How soon the store is asked again what a run committed, when it did not say.
const STORE_RETRY: Duration = Duration::from_secs(2);

/// How far back a frontend that adopts a run in flight reads the streams, before
/// the run was pressed (clocks of machines differ).
const ADOPT_CLOCK_SKEW_MS: u64 = 60_000;

/// When each gpu-host's status was last heard, shared by the sessions: a host
/// running a session's cell that falls silent is lost.
#[derive(Clone, Debug)]
pub struct HostsSeen {
    heard: Arc<std::sync::Mutex<HashMap<String, Instant>>>,
    /// Since when this frontend listens (a host never heard is silent since then).
    since: Instant,
    /// When this frontend last could not hear anyone (its NATS connection was
    /// down): silence before then says nothing about a host.
    blind_at: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl Default for HostsSeen {
    fn default() -> Self {
        Self { heard: Default::default(), since: Instant::now(), blind_at: Default::default() }
    }
}

impl HostsSeen {
    /// Note every quarter second whether `client` is connected; while it is not,
    /// no host's silence counts (a NATS outage is not every host lost).
    pub async fn watch_connection(self, client: async_nats::Client) {
        loop {
            if client.connection_state() != async_nats::connection::State::Connected {
                *self.blind_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Record every status heard on `statuses` until the subscription ends.
    pub async fn follow(self, mut statuses: schemas::bus::Subscription<HostStatusV2>) {
        while let Some(item) = statuses.next().await {
            if let Ok(env) = item {
                self.heard.lock().unwrap_or_else(|e| e.into_inner()).insert(env.msg.host, Instant::now());
            }
        }
    }

    /// How long `host` has been silent: since it was last heard, or, if it never
    /// was, since this frontend started listening (a live host is heard every 2 s).
    pub fn silent_for(&self, host: &str) -> Duration {
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner()).get(host).copied();
        let blind = *self.blind_at.lock().unwrap_or_else(|e| e.into_inner());
        heard.unwrap_or(self.since).max(blind.unwrap_or(self.since)).elapsed()
    }

    /// Whether this frontend could not hear hosts within the last `window`.
    pub fn blind_within(&self, window: Duration) -> bool {
        self.blind_at.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|at| at.elapsed() < window)
    }
}

/// How long the store may take to say what a lost host's cell committed.
const STORE_TIMEOUT: Duration = Duration::from_secs(10);

/// How soon abandoning an unclaimed run is tried again when the claims bucket
/// could not be reached.
const ABANDON_RETRY: Duration = Duration::from_secs(2);

/// How often a running cell's host is checked for loss.
const HOST_CHECK: Duration = Duration::from_secs(1);

/// The execution that was sent to the planner and is not complete yet.
#[derive(Debug)]
struct Current {
    exec_id: Uuid,
    /// The host that claimed it.
    host: Option<String>,
    /// The cell's status from Finished, if it arrived.
    finished: Option<(CellStatus, Option<String>)>,
    /// How many outputs Finished announced.
    expected_outputs: Option<u64>,
    /// Output seqs received.
    outputs: HashSet<u64>,
    /// Events relayed (a host sends one again when its stream did not confirm it).
    events: HashSet<String>,
    /// Saved/Failed arrived: (status, revision after, error, unix ms).
    terminal: Option<(ExecStatus, u64, Option<String>, u64)>,
    /// Its save landed: its status is the cell's own, from Finished.
    saved: bool,
    /// What it sent is being read back from the streams (it ended with
    /// something unheard, or this frontend's NATS connection was lost meanwhile).
    reading_back: bool,
    /// How many times this frontend had connected to NATS when it last heard
    /// everything (at its start, or its last read-back): live messages sent
    /// while it reconnected since are missed.
    connects: u64,
    /// The run claim's revision last read, and since when it is that one.
    claim_seen: Option<(u64, Instant)>,
    /// Its client answers the cell's input requests.
    allow_stdin: bool,
    /// The cell waits for a line of input from its client.
    asking: bool,
}

impl Current {
    fn new(exec_id: Uuid, allow_stdin: bool, connects: u64) -> Self {
        Self {
            allow_stdin,
            asking: false,
            exec_id,
            host: None,
            finished: None,
            expected_outputs: None,
            outputs: HashSet::new(),
            events: HashSet::new(),
            terminal: None,
            saved: false,
            reading_back: false,
            connects,
            claim_seen: None,
        }
    }

    /// What it has not heard yet of what it sent: outputs Finished announced, or
    /// Finished itself (a saved run sent it before its save).
    fn unheard(&self) -> bool {
        let missing = self.expected_outputs.unwrap_or(0).saturating_sub(self.outputs.len() as u64);
        missing > 0 || (self.saved && self.finished.is_none())
    }

    /// The outcome of an execution whose save was committed: the cell's own.
    fn saved_outcome(&self) -> (ExecStatus, Option<String>) {
        match &self.finished {
            Some((CellStatus::Error, e)) => (ExecStatus::Error, e.clone()),
            _ => (ExecStatus::Ok, None),
        }
    }
}

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
    /// Runs a session may have waiting behind the running one.
    pub queued_runs: usize,
    /// What the dashboard at `/` shows (every session's stream items go there too).
    pub dashboard: crate::dashboard::Dashboard,
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
    /// most `shared.history_items`.
    log: resume::Log,
    clients: Vec<Watcher>,
    closing: bool,
    /// When a client last did something with the session, or a cell last ended.
    last_active: Instant,
    /// The host that keeps the session's CPU worker, as its last CPU cell said
    /// (completions and inspections are asked there).
    cpu_host: Option<String>,
    /// Keys of the messages replayed from the streams for an adopted run, which
    /// the live subscriptions may deliver again.
    replayed: HashSet<String>,
    /// The root span of each run this frontend accepted and has not ended: the
    /// run is sent under it, so its trace goes through planner, host and store.
    traces: HashMap<Uuid, tracing::Span>,
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
        let log = resume::Log::new(shared.history_items);
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
            last_active: Instant::now(),
            cpu_host: None,
            replayed: HashSet::new(),
            traces: HashMap::new(),
        }
    }

    /// While execution `exec_id` is current: if the host that claimed it fell
    /// silent, or stopped renewing the run's claim (hosts renew every 2 s; one
    /// restarted under the same id does not know the run), end it with what the
    /// store committed (a commit that landed before the host was lost is the
    /// cell's outcome; otherwise it failed and nothing of it was committed).
    /// Checked every second.
    fn watch_host(&mut self, exec_id: Uuid, ctx: &mut Context<Self>) {
        ctx.run_later(HOST_CHECK, move |act, ctx| {
            let Some(cur) = act.current.as_ref().filter(|c| c.exec_id == exec_id && c.terminal.is_none()) else {
                return;
            };
            let Some(host) = cur.host.clone() else { return };
            let silent = act.shared.hosts.silent_for(&host);
            if silent > act.shared.timeouts.host_lost {
                act.host_lost(exec_id, host, format!("not heard for {:.0} s", silent.as_secs_f64()), ctx);
                return;
            }
            let (claims, key) = (act.shared.claims.clone(), schemas::buckets::run_claim_key(exec_id));
            let entry = async move { claims.entry(key).await };
            ctx.spawn(entry.into_actor(act).map(move |entry, act, ctx| {
                let host_lost = act.shared.timeouts.host_lost;
                let Some(cur) = act.current.as_mut().filter(|c| c.exec_id == exec_id && c.terminal.is_none()) else {
                    return;
                };
                // a claim that is gone or not renewed stays at one revision
                let revision = match entry {
                    Ok(Some(e)) if e.operation == async_nats::jetstream::kv::Operation::Put => e.revision,
                    Ok(_) => 0,
                    Err(e) => {
                        // unobserved time says nothing about the host
                        tracing::debug!(error = %e, "could not read a run's claim");
                        cur.claim_seen = None;
                        act.watch_host(exec_id, ctx);
                        return;
                    }
                };
                let blind = act.shared.hosts.blind_within(HOST_CHECK * 2);
                let since = match cur.claim_seen {
                    Some((seen, at)) if seen == revision && !blind => at,
                    _ => {
                        cur.claim_seen = Some((revision, Instant::now()));
                        Instant::now()
                    }
                };
                if since.elapsed() > host_lost {
                    let why =
                        format!("its claim on the cell was not renewed for {:.0} s", since.elapsed().as_secs_f64());
                    act.host_lost(exec_id, host, why, ctx);
                } else {
                    act.watch_host(exec_id, ctx);
                }
            }));
        });
    }

    /// The host of the current execution is lost: it ends with what the store committed.
    fn host_lost(&mut self, exec_id: Uuid, host: String, why: String, ctx: &mut Context<Self>) {
        tracing::warn!(session = %self.sid, exec = %exec_id, %host, %why, "host lost while it ran a cell");
        let failure = move |revision| {
            format!(
                "host {host} was lost ({why}) while the cell ran; nothing the cell did was committed, the session \
                 keeps its last committed state (revision {revision})"
            )
        };
        self.settle(exec_id, Arc::new(failure), ctx);
    }

    /// End the current execution `exec_id` with what the store committed: its commit
    /// if its save landed (a host may have run it though this frontend heard
    /// nothing), else a failure, `failure(revision)`. The store settles the run: it
    /// fences the run's revision so that a host cut off while it ran can never
    /// commit it afterwards (ADR 22). A store that does not answer is asked again:
    /// never say nothing was committed without knowing.
    fn settle(&mut self, exec_id: Uuid, failure: Arc<dyn Fn(u64) -> String>, ctx: &mut Context<Self>) {
        let bus = self.shared.bus.clone();
        let req = SettleV1 { session: self.sid, exec_id, base_revision: self.stored.revision };
        let ask = async move {
            bus.request_idempotent::<_, ManifestV1>(bus.subjects().store(StoreVerb::Settle), &req, STORE_TIMEOUT).await
        };
        ctx.spawn(ask.into_actor(self).map(move |answer, act, ctx| {
            if !act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.terminal.is_none()) {
                return;
            }
            let now = schemas::unix_ms();
            match answer {
                // the save landed: that is the cell's outcome
                Ok(m) if m.manifest.exec_id == exec_id => {
                    // what the cell sent was not heard here: read it back first
                    act.end_current(ExecStatus::Ok, m.manifest.revision, None, now, true, ctx);
                    act.read_back(exec_id, ctx);
                }
                Ok(m) => {
                    let error = failure(m.manifest.revision);
                    act.complete(ctx, ExecStatus::Failed, m.manifest.revision, Some(error), now);
                }
                // deleted meanwhile: nothing commits to it any more
                Err(schemas::bus::BusError::Remote { code: ErrorCode::NotFound, message, .. }) => {
                    let revision = act.stored.revision;
                    act.complete(ctx, ExecStatus::Failed, revision, Some(format!("{}; {message}", failure(revision))), now);
                }
                Err(e) => {
                    tracing::warn!(exec = %exec_id, error = %e, "the store could not say what a run committed; asking again");
                    ctx.run_later(STORE_RETRY, move |act, ctx| act.settle(exec_id, failure, ctx));
                }
            }
        }));
    }

    fn emit(&mut self, item: &StreamItem) {
        self.shared.dashboard.observe(self.sid, item);
        let line = match serde_json::to_string(item) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a stream item");
                return;
            }
        };
        let incarnation = self.log.incarnation();
        let Some(entry) = self.log.push(item, line) else { return };
        self.clients.retain(|c| {
            // a client that resumed from another incarnation skips what it saw there
            if !c.reader.wants(entry) {
                return !c.tx.is_closed();
            }
            c.tx.send((c.reader.id(incarnation, entry), entry.line.clone())).is_ok()
        });
    }

    /// Write the session's record as it is now (`ack` hears once it landed).
    fn write_record(&mut self, ack: Option<tokio::sync::oneshot::Sender<()>>) {
        // the writer lives as long as the actor
        let _ = self.record_tx.send((self.stored.to_write(), ack));
    }

    /// Runs taken out of the queue kept their code aside under `aside`: delete it
    /// once the record without them landed (until then a frontend that adopts the
    /// session would read it back). What is not deleted expires with the bucket.
    fn forget_aside(&mut self, aside: Vec<String>) {
        let (ack_tx, ack_rx) = tokio::sync::oneshot::channel();
        self.write_record(Some(ack_tx));
        let bodies = self.shared.bodies.clone();
        tokio::spawn(async move {
            if ack_rx.await.is_ok() {
                for header in aside {
                    bodies.delete(&header).await;
                }
            }
        });
    }

    /// End queued run `exec_id` (taken out of the queue) without running it.
    fn abort(&mut self, exec_id: Uuid, reason: String) {
        self.traces.remove(&exec_id);
        let error = Some(reason);
        if let Some(r) = self.record(exec_id) {
            r.status = ExecStatus::Aborted;
            r.error = error.clone();
        }
        let after_revision = self.stored.revision;
        self.emit(&StreamItem::Done {
            exec_id,
            status: ExecStatus::Aborted,
            after_revision,
            unix_ms: schemas::unix_ms(),
            error,
        });
    }

    fn record(&mut self, exec_id: Uuid) -> Option<&mut ExecRecord> {
        self.executions.iter_mut().rev().find(|r| r.exec_id == exec_id)
    }

    /// Send the next queued run to the planner if nothing is running.
    fn start_next(&mut self, ctx: &mut Context<Self>) {
        if self.current.is_some() || self.closing {
            return;
        }
        let Some(p) = self.stored.queued.pop_front() else { return };
        // a run adopted from the record has only the reference to its code kept aside
        let read_back = p.aside.clone().filter(|_| p.code_elsewhere());
        let aside = p.aside.clone();
        let run = RunV2 {
            session: self.sid,
            exec_id: p.exec_id,
            cell_id: p.cell_id.clone(),
            code: p.code,
            run_unix_ms: p.run_unix_ms,
            after_revision: self.stored.revision,
            options: self.stored.options.clone(),
            user_expressions: p.user_expressions,
        };
        self.current = Some(Current::new(p.exec_id, p.allow_stdin, self.connects()));
        self.log.follow(p.exec_id);
        if let Some(r) = self.record(p.exec_id) {
            r.status = ExecStatus::Running;
        }
        let exec_id = p.exec_id;
        // recorded (out of the queue, in flight) before it is sent: a frontend that
        // adopts the session follows it
        self.stored.in_flight = Some(InFlight {
            exec_id,
            cell_id: p.cell_id.clone(),
            run_unix_ms: p.run_unix_ms,
            allow_stdin: p.allow_stdin,
        });
        let (ack_tx, ack_rx) = tokio::sync::oneshot::channel();
        self.write_record(Some(ack_tx));
        let (bus, bodies) = (self.shared.bus.clone(), self.shared.bodies.clone());
        let subject = bus.subjects().run(self.sid);
        tracing::info!(session = %self.sid, exec = %exec_id, cell = %p.cell_id, after_revision = self.stored.revision, "run sent");
        let span = self.traces.get(&exec_id).cloned().unwrap_or_else(tracing::Span::none);
        // a planner that is still starting gets it once it listens; past half the
        // claim timeout the user reads that no planner runs, not that no host took it
        let patience = self.shared.timeouts.claim / 2;
        let send = async move {
            if !matches!(tokio::time::timeout(RECORD_WAIT, ack_rx).await, Ok(Ok(()))) {
                let why = format!("the session's record could not be written within {RECORD_WAIT:?}");
                return Err(format!("could not send the run to the planner: {why}"));
            }
            let mut run = run;
            if let Some(header) = &read_back {
                match crate::records::read_aside(&bodies, header).await {
                    Ok(kept) => {
                        run.code = kept.code;
                        run.user_expressions = kept.user_expressions;
                    }
                    Err(e) => {
                        bodies.delete(header).await;
                        return Err(format!("the cell did not run: its code, kept for its turn, is lost ({e})"));
                    }
                }
            }
            let sent = bus.deliver(subject, &run, patience).await;
            // the record names the run in flight now: nobody reads its code back
            if let Some(header) = &aside {
                bodies.delete(header).await;
            }
            sent.map_err(|e| format!("could not send the run to the planner: {e}"))
        }
        .instrument(span);
        ctx.spawn(send.into_actor(self).map(move |res, act, ctx| {
            if let Err(e) = res {
                // the client may still deliver it after a reconnect: make sure no
                // host runs it before saying it did not run
                tracing::error!(error = %e, exec = %exec_id, "could not send the run");
                act.abandon_unclaimed(exec_id, e, ctx);
            }
        }));
        self.arm_deadlines(exec_id, ctx);
    }

    /// The current execution's deadlines: unclaimed after the claim timeout, it is
    /// abandoned; not complete after the execution deadline, it is interrupted.
    fn arm_deadlines(&mut self, exec_id: Uuid, ctx: &mut Context<Self>) {
        self.watch_connection(exec_id, ctx);
        let claim_timeout = self.shared.timeouts.claim;
        ctx.run_later(claim_timeout, move |act, ctx| {
            if act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.host.is_none() && c.terminal.is_none()) {
                tracing::warn!(exec = %exec_id, "no host claimed the run in time");
                act.abandon_unclaimed(exec_id, format!("no host took the cell within {claim_timeout:?}"), ctx);
            }
        });
        let Some(deadline) = self.shared.timeouts.execution else { return };
        ctx.run_later(deadline, move |act, ctx| {
            if act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.terminal.is_none()) {
                tracing::warn!(exec = %exec_id, "execution deadline passed; interrupting the cell");
                act.stop_current(exec_id, format!("no host ran the cell within the deadline ({deadline:?})"), ctx);
            }
        });
    }

    /// Stop the current execution `exec_id`: every host hears the interrupt (the
    /// one running it interrupts, then kills, the cell and reports its outcome); if
    /// no host claimed it, it is abandoned with `unclaimed_error`.
    fn stop_current(&mut self, exec_id: Uuid, unclaimed_error: String, ctx: &mut Context<Self>) {
        let Some(cur) = self.current.as_ref().filter(|c| c.exec_id == exec_id && c.terminal.is_none()) else {
            return;
        };
        let unclaimed = cur.host.is_none();
        let bus = self.shared.bus.clone();
        let msg = InterruptV1 { session: self.sid, exec_id };
        ctx.spawn(
            async move {
                if let Err(e) = bus.publish(bus.subjects().interrupt(msg.session), &msg).await {
                    tracing::error!(error = %e, exec = %msg.exec_id, "could not publish the interrupt");
                }
            }
            .into_actor(self),
        );
        if unclaimed {
            self.abandon_unclaimed(exec_id, unclaimed_error, ctx);
        }
    }

    /// End the current execution `exec_id` with `error`, but only once no host can
    /// ever run it: its run claim is taken here (holder `!interrupted`). If a host
    /// won the claim first, that host reports the outcome; if the claims bucket
    /// cannot be reached, this is tried again shortly (a run reported as not run
    /// must never run later).
    fn abandon_unclaimed(&mut self, exec_id: Uuid, error: String, ctx: &mut Context<Self>) {
        let (claims, key) = (self.shared.claims.clone(), schemas::buckets::run_claim_key(exec_id));
        let claim = async move {
            match claims.create(&key, schemas::buckets::INTERRUPTED_HOLDER.into()).await {
                Ok(_) => Ok(None),
                // who holds it: a host that died right after claiming never says
                // Claimed, and is watched from here like one that did
                Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
                    let holder = claims.get(&key).await.ok().flatten();
                    Ok(Some(holder.map(|h| String::from_utf8_lossy(&h).into_owned()).unwrap_or_default()))
                }
                Err(e) => Err(e),
            }
        };
        ctx.spawn(claim.into_actor(self).map(move |claimed, act, ctx| match claimed {
            // no host can start it now; one may have run it before (a claim expires
            // after CLAIM_TTL unrenewed): the store says whether it committed
            Ok(None) => {
                let error = error.clone();
                act.settle(exec_id, Arc::new(move |_| error.clone()), ctx)
            }
            // abandoned already (by this session's frontend before it restarted)
            Ok(Some(holder)) if holder == schemas::buckets::INTERRUPTED_HOLDER => {
                let error = error.clone();
                act.settle(exec_id, Arc::new(move |_| error.clone()), ctx)
            }
            Ok(Some(holder)) => {
                tracing::info!(exec = %exec_id, %holder, "a host holds the run; it reports the outcome");
                let unwatched = act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.host.is_none());
                if unwatched && !holder.is_empty() {
                    if let Some(cur) = act.current.as_mut() {
                        cur.host = Some(holder);
                    }
                    act.watch_host(exec_id, ctx);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, exec = %exec_id, "could not claim the run to abandon it; retrying");
                ctx.run_later(ABANDON_RETRY, move |act, ctx| {
                    let pending = act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.terminal.is_none());
                    if pending {
                        act.abandon_unclaimed(exec_id, error, ctx);
                    }
                });
            }
        }));
    }

    /// The current execution is complete: emit done, start the next one.
    fn complete(
        &mut self,
        ctx: &mut Context<Self>,
        status: ExecStatus,
        revision: u64,
        error: Option<String>,
        unix_ms: u64,
    ) {
        let Some(cur) = self.current.take() else { return };
        self.traces.remove(&cur.exec_id); // the cell's root span ends
        self.last_active = Instant::now();
        self.stored.revision = revision;
        self.stored.last_exec = Some(cur.exec_id);
        self.stored.in_flight = None;
        // a deleted session's record stays deleted (its cells' late ends are relayed only)
        if !self.closing {
            self.write_record(None);
        }
        if let Some(r) = self.record(cur.exec_id) {
            r.status = status;
            r.after_revision = Some(revision);
            r.error = error.clone();
        }
        self.emit(&StreamItem::Done { exec_id: cur.exec_id, status, after_revision: revision, unix_ms, error });
        self.start_next(ctx);
    }

    /// Complete the current execution if its end arrived and all it sent did.
    fn maybe_complete(&mut self, ctx: &mut Context<Self>) {
        if self.current.as_ref().is_some_and(|c| c.terminal.is_some() && !c.unheard()) {
            self.complete_current(ctx);
        }
    }

    /// Complete the current execution with its end (a saved run with the cell's
    /// own status), whatever it has not heard.
    fn complete_current(&mut self, ctx: &mut Context<Self>) {
        let Some(cur) = &self.current else { return };
        let Some((mut status, revision, mut error, unix_ms)) = cur.terminal.clone() else { return };
        if cur.saved {
            (status, error) = cur.saved_outcome();
        }
        self.complete(ctx, status, revision, error, unix_ms);
    }

    /// The current execution ended (`saved`: its save landed): it completes once
    /// all it sent arrived, or, after the output grace, with what its streams
    /// kept of it.
    fn end_current(
        &mut self,
        status: ExecStatus,
        revision: u64,
        error: Option<String>,
        unix_ms: u64,
        saved: bool,
        ctx: &mut Context<Self>,
    ) {
        let Some(cur) = self.current.as_mut() else { return };
        let exec_id = cur.exec_id;
        cur.terminal = Some((status, revision, error, unix_ms));
        cur.saved = saved;
        self.maybe_complete(ctx);
        if self.current.as_ref().is_some_and(|c| c.exec_id == exec_id) {
            ctx.run_later(self.shared.timeouts.output_grace, move |act, ctx| act.read_back(exec_id, ctx));
        }
    }

    fn on_event(&mut self, ctx: &mut Context<Self>, ev: SessionEventV2) {
        tracing::debug!(session = %self.sid, exec = %ev.exec_id, kind = ?ev.kind, "event");
        if let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == ev.exec_id) {
            if !cur.events.insert(event_key(&ev)) {
                return; // sent again, or read back, after it was relayed
            }
        }
        if let EventKind::Started { host, prepare, .. } = &ev.kind {
            if *prepare == Prepare::Persistent {
                self.cpu_host = Some(host.clone());
            }
            // Run is when the request arrived here (DESIGN.md section 10)
            let run_ms = self.record(ev.exec_id).map(|r| r.run_unix_ms);
            if let Some(run_ms) = run_ms.filter(|ms| *ms > 0) {
                let delay = &schemas::metrics::metrics().start_delay.get_or_create(&[("prepare", prepare.as_str())]);
                schemas::metrics::observe_ms(delay, ev.unix_ms.saturating_sub(run_ms) as f64);
            }
        }
        self.emit(&StreamItem::Event { exec_id: ev.exec_id, unix_ms: ev.unix_ms, event: (&ev.kind).into() });
        let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == ev.exec_id) else { return };
        // (Finished may be read back after the end: it tells the cell's status)
        let ended = cur.terminal.is_some();
        let terminal = match ev.kind {
            _ if ended && !matches!(ev.kind, EventKind::Finished { .. }) => None,
            EventKind::Claimed { host, .. } => {
                if cur.host.is_none() {
                    cur.host = Some(host);
                    let exec_id = cur.exec_id;
                    self.watch_host(exec_id, ctx);
                }
                return;
            }
            EventKind::Planned { .. } | EventKind::Started { .. } => None,
            EventKind::Finished { status, error, outputs, .. } => {
                cur.finished = Some((status, error));
                cur.expected_outputs = Some(outputs);
                None
            }
            EventKind::Saved { revision, .. } => Some((ExecStatus::Ok, revision, None, true)),
            EventKind::Failed { error } => Some((ExecStatus::Failed, self.stored.revision, Some(error), false)),
            EventKind::SlotReleased { .. }
            | EventKind::Ready { .. }
            | EventKind::Preparing { .. }
            | EventKind::PreparedEnded { .. } => None,
        };
        if let Some((status, revision, error, saved)) = terminal {
            self.end_current(status, revision, error, ev.unix_ms, saved, ctx);
        }
    }

    /// The running cell called `input()`: its client is asked if it has a stdin
    /// channel; otherwise the cell is told at once, as ipykernel tells it.
    fn on_input_request(&mut self, exec_id: Uuid, seq: u64, output: serde_json::Value) {
        let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == exec_id && c.terminal.is_none()) else {
            return; // replayed, or of a run that ended: nobody waits
        };
        if cur.allow_stdin {
            cur.asking = true;
            self.emit(&StreamItem::Output { exec_id, seq, output });
            return;
        }
        let refused = InputReplyV1 {
            session: self.sid,
            exec_id,
            value: String::new(),
            refused: Some(schemas::messages::NO_STDIN.into()),
        };
        let bus = self.shared.bus.clone();
        actix::spawn(async move {
            if let Err(e) = bus.publish(bus.subjects().input(refused.session), &refused).await {
                tracing::error!(exec = %exec_id, error = %e, "could not refuse an input request; the cell waits until interrupted");
            }
        });
    }

    fn on_output(&mut self, ctx: &mut Context<Self>, mut out: OutputV1) {
        if self.current.as_ref().is_some_and(|c| c.exec_id == out.exec_id && c.outputs.contains(&out.seq)) {
            return; // sent again, or read back, after it was relayed
        }
        if out.parts > 1 {
            // an output too large for one message: gather its pieces first
            let key = (out.exec_id, out.seq);
            let pieces = self.pieces.entry(key).or_insert_with(|| vec![None; out.parts as usize]);
            if let Some(slot) = pieces.get_mut(out.part as usize) {
                *slot = Some(std::mem::take(&mut out.output_json));
            }
            if pieces.iter().any(Option::is_none) {
                return;
            }
            out.output_json = self.pieces.remove(&key).unwrap_or_default().into_iter().flatten().collect();
        }
        match serde_json::from_str::<serde_json::Value>(&out.output_json) {
            Ok(output) if output["output_type"] == schemas::messages::INPUT_REQUEST_OUTPUT => {
                self.on_input_request(out.exec_id, out.seq, output)
            }
            Ok(output) => self.emit(&StreamItem::Output { exec_id: out.exec_id, seq: out.seq, output }),
            Err(e) => tracing::error!(exec = %out.exec_id, seq = out.seq, error = %e, "output is not JSON; dropped"),
        }
        if let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == out.exec_id) {
            cur.outputs.insert(out.seq);
            self.maybe_complete(ctx);
        }
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

impl StreamHandler<Result<Envelope<OutputV1>, Rejected>> for SessionActor {
    fn handle(&mut self, item: Result<Envelope<OutputV1>, Rejected>, ctx: &mut Self::Context) {
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

/// Assign the next edit sequence number of a cell; the caller publishes the edit.
#[derive(Message)]
#[rtype(result = "EditV1")]
pub struct Edit {
    /// The cell.
    pub cell_id: String,
    /// Its full code.
    pub code: String,
}

impl Handler<Edit> for SessionActor {
    type Result = MessageResult<Edit>;

    fn handle(&mut self, msg: Edit, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let seq = self.edit_seq.entry(msg.cell_id.clone()).or_insert(0);
        *seq += 1;
        MessageResult(EditV1 {
            session: self.sid,
            cell_id: msg.cell_id,
            code: msg.code,
            seq: *seq,
            options: self.stored.options.clone(),
        })
    }
}

/// Queue a run: it is accepted, or handed back to have its code put aside first
/// (see [`RunAnswer`]); or the queue takes no more.
#[derive(Message)]
#[rtype(result = "Result<RunAnswer, QueueFull>")]
pub struct Run {
    /// The cell.
    pub cell_id: String,
    /// The code submitted with Run.
    pub code: String,
    /// When the request was received (unix ms).
    pub run_unix_ms: u64,
    /// The client answers the cell's input requests.
    pub allow_stdin: bool,
    /// Jupyter's `user_expressions`, evaluated after the cell.
    pub user_expressions: BTreeMap<String, String>,
    /// The root span of the cell's trace; it ends with the execution.
    pub span: tracing::Span,
    /// Where the code and user expressions were put aside
    /// ([`crate::records::put_aside`]), when the session's record had no room for
    /// them: the record names them by this.
    pub aside: Option<String>,
}

/// What became of a run handed to its session.
pub enum RunAnswer {
    /// Queued (or sent at once): its execution, its place in the queue, and a
    /// receiver that hears once the run is in the session's record (answer the
    /// client only then: a run accepted is never lost with this frontend).
    Accepted {
        /// The execution.
        exec_id: Uuid,
        /// How many runs are before it (the running one included).
        position: usize,
        /// Hears once the record holding the run landed.
        recorded: tokio::sync::oneshot::Receiver<()>,
    },
    /// It waits behind another and the session's record has no room for its code:
    /// put the code aside ([`crate::records::put_aside`]) and hand it again with
    /// `aside` set. Nothing was queued.
    PutAside(Box<Run>),
}

/// Why a run was not queued.
#[derive(Debug, thiserror::Error)]
pub enum QueueFull {
    /// As many runs wait as allowed.
    #[error("the session has {0} runs queued, the most allowed; wait or interrupt")]
    Runs(usize),
}

impl Handler<Run> for SessionActor {
    type Result = MessageResult<Run>;

    fn handle(&mut self, msg: Run, ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let queued = &self.stored.queued;
        if queued.len() >= self.shared.queued_runs {
            return MessageResult(Err(QueueFull::Runs(queued.len())));
        }
        // a run that starts at once is not kept with its code; one that waits is,
        // in the record while there is room and aside past that
        let waits = self.current.is_some() || self.closing || !queued.is_empty();
        if waits && msg.aside.is_none() {
            let held = queued.iter().map(QueuedRun::recorded_bytes).sum::<usize>();
            let this = crate::records::inline_bytes(&msg.code, &msg.user_expressions);
            if held.saturating_add(this) > RECORD_INLINE_BYTES {
                return MessageResult(Ok(RunAnswer::PutAside(Box::new(msg))));
            }
        }
        let exec_id = Uuid::now_v7();
        msg.span.record("exec", tracing::field::display(exec_id));
        self.traces.insert(exec_id, msg.span);
        let position = queued.len() + usize::from(self.current.is_some());
        self.executions.push(ExecRecord {
            exec_id,
            cell_id: msg.cell_id.clone(),
            run_unix_ms: msg.run_unix_ms,
            status: ExecStatus::Queued,
            after_revision: None,
            error: None,
        });
        self.emit(&StreamItem::Queued { exec_id, cell_id: msg.cell_id.clone(), run_unix_ms: msg.run_unix_ms });
        self.stored.queued.push_back(QueuedRun {
            exec_id,
            cell_id: msg.cell_id,
            code: msg.code,
            run_unix_ms: msg.run_unix_ms,
            allow_stdin: msg.allow_stdin,
            user_expressions: msg.user_expressions,
            aside: msg.aside,
        });
        // (sent at once, code put aside is deleted once the run is in flight)
        self.start_next(ctx);
        let (ack_tx, ack_rx) = tokio::sync::oneshot::channel();
        self.write_record(Some(ack_tx));
        MessageResult(Ok(RunAnswer::Accepted { exec_id, position, recorded: ack_rx }))
    }
}

/// Take back run `exec_id` if it still waits for its turn: its acceptance could
/// not be recorded, and its client is told it was not accepted. It ends aborted.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Withdraw {
    /// The run.
    pub exec_id: Uuid,
    /// Why.
    pub reason: String,
}

impl Handler<Withdraw> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: Withdraw, _ctx: &mut Self::Context) {
        let Some(at) = self.stored.queued.iter().position(|q| q.exec_id == msg.exec_id) else { return };
        let aside = self.stored.queued.remove(at).and_then(|q| q.aside);
        self.abort(msg.exec_id, msg.reason);
        match aside {
            Some(header) => self.forget_aside(vec![header]),
            None => self.write_record(None),
        }
    }
}

/// An SSE client of the session: where it resumed from, and its channel.
struct Watcher {
    reader: resume::Reader,
    tx: mpsc::UnboundedSender<resume::Sent>,
}

/// Attach an SSE client: the items kept that it did not see (after `last`, the
/// last id it saw; all kept if None), then a channel of the items to come. Each
/// item is (SSE id, JSON line); see [`crate::resume`].
#[derive(Message)]
#[rtype(result = "(Vec<resume::Sent>, mpsc::UnboundedReceiver<resume::Sent>)")]
pub struct Attach {
    /// The last id the client saw (`Last-Event-ID`).
    pub last: Option<Position>,
}

impl Handler<Attach> for SessionActor {
    type Result = MessageResult<Attach>;

    fn handle(&mut self, msg: Attach, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = self.log.reader(msg.last);
        if !self.closing {
            self.clients.push(Watcher { reader, tx });
        }
        MessageResult((self.log.replay(&reader), rx))
    }
}

/// Interrupt the session: abort the queued runs and stop the current one.
#[derive(Message)]
#[rtype(result = "Interrupted")]
pub struct Interrupt;

impl Handler<Interrupt> for SessionActor {
    type Result = MessageResult<Interrupt>;

    fn handle(&mut self, _msg: Interrupt, ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let (mut aborted, mut aside) = (Vec::new(), Vec::new());
        for p in std::mem::take(&mut self.stored.queued) {
            self.abort(p.exec_id, "aborted: the session was interrupted before this cell's turn".to_string());
            aborted.push(p.exec_id);
            aside.extend(p.aside);
        }
        if !aborted.is_empty() && !self.closing {
            self.forget_aside(aside);
        }
        let Some(exec_id) = self.current.as_ref().filter(|c| c.terminal.is_none()).map(|c| c.exec_id) else {
            return MessageResult(Interrupted { interrupted: None, aborted });
        };
        tracing::info!(session = %self.sid, exec = %exec_id, "interrupt");
        self.stop_current(exec_id, schemas::messages::INTERRUPTED_BEFORE_START.to_string(), ctx);
        MessageResult(Interrupted { interrupted: Some(exec_id), aborted })
    }
}

/// The user's answer to the running cell's input request.
#[derive(Message)]
#[rtype(result = "Result<InputReplyV1, String>")]
pub struct Input {
    /// The execution that asked.
    pub exec_id: Uuid,
    /// What the user typed.
    pub value: String,
}

impl Handler<Input> for SessionActor {
    type Result = Result<InputReplyV1, String>;

    fn handle(&mut self, msg: Input, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        match self.current.as_mut() {
            Some(cur) if cur.exec_id == msg.exec_id && cur.asking && cur.terminal.is_none() => {
                cur.asking = false;
                Ok(InputReplyV1 { session: self.sid, exec_id: msg.exec_id, value: msg.value, refused: None })
            }
            _ => Err(format!("execution {} of this session is not waiting for input", msg.exec_id)),
        }
    }
}

/// The host that keeps the session's CPU worker, if a CPU cell ran.
#[derive(Message)]
#[rtype(result = "Option<String>")]
pub struct CpuHost;

impl Handler<CpuHost> for SessionActor {
    type Result = Option<String>;

    fn handle(&mut self, _msg: CpuHost, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        self.cpu_host.clone()
    }
}

/// How long the session has been idle: nothing running or queued, no client
/// watching its events, no request; None while it is not idle.
#[derive(Message)]
#[rtype(result = "Option<Duration>")]
pub struct IdleFor;

impl Handler<IdleFor> for SessionActor {
    type Result = Option<Duration>;

    fn handle(&mut self, _msg: IdleFor, _ctx: &mut Self::Context) -> Self::Result {
        // as Jupyter's culler by default: a session someone watches is not idle
        self.clients.retain(|c| !c.tx.is_closed());
        let busy = self.current.is_some() || !self.stored.queued.is_empty() || !self.clients.is_empty();
        (!busy).then(|| self.last_active.elapsed())
    }
}

/// The session's summary.
#[derive(Message)]
#[rtype(result = "crate::api::SessionSummary")]
pub struct Summary;

impl Handler<Summary> for SessionActor {
    type Result = MessageResult<Summary>;

    fn handle(&mut self, _msg: Summary, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        MessageResult(crate::api::SessionSummary {
            session_id: self.sid,
            cwd: self.stored.options.cwd.clone(),
            all_gpu: self.stored.options.all_gpu,
            revision: self.stored.revision,
            current: self.current.as_ref().map(|c| c.exec_id),
            queue: self.stored.queued.iter().map(|p| p.exec_id).collect(),
            executions: self.executions.clone(),
        })
    }
}

/// The session is being deleted: stop running, relay late events for `grace`
/// (slot releases at close), then end every client stream and stop.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Close {
    /// How long to keep relaying.
    pub grace: Duration,
}

impl Handler<Close> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: Close, ctx: &mut Self::Context) {
        self.closing = true;
        self.stored.queued.clear();
        ctx.run_later(msg.grace, |act, ctx| {
            act.clients.clear();
            ctx.stop();
        });
    }
}
