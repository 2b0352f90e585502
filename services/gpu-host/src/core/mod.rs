//! The gpu-host's decisions, without I/O (ADR 56): which recipes this host
//! claims, which slot a run or a preparation takes, what waits and in what order,
//! and what becomes of a worker after its cell. [`HostCore::on`] takes one
//! [`Input`] (a recipe, a settled claim, a finished execution, a tick) and returns
//! the [`Command`]s it decided; the host actor ([`crate::host`]) turns NATS, KV
//! and worker results into inputs and carries the commands out, and the
//! simulator (`sim`) drives this same core on its own clock.
//!
//! Nothing here awaits, locks, or talks to NATS or a process: time comes from a
//! [`Clock`], what only the outside world knows (is a worker alive, how well
//! placed is this host for a recipe) from [`Facts`].
//!
//! | file | concern |
//! |---|---|
//! | `mod.rs` | inputs, commands, the core's state |
//! | [`runs`] | the run table: each run recipe heard and the state it is in |
//! | `routing.rs` | a run from arrival to execution, and what follows it |
//! | `preparation.rs` | workers prepared before Run, and their slots |
//! | `sessions.rs` | close, idle, interrupt, claim renewal, ticks |
//! | [`prepared`] | the prepared workers' table and phases |
//! | [`kept`] | workers kept after their cell (CPU, unsavable state) |
//! | [`peers`] | other hosts as their status said |

pub mod kept;
pub mod peers;
mod preparation;
pub mod prepared;
mod routing;
pub mod runs;
mod sessions;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use schemas::clock::{Clock, SystemClock};
use schemas::messages::{
    BidV1, Device, EventKind, Prepare, PreparedClass, RecipeKind, RecipeV3, SessionOptions, SlotUse, WorkerState,
};
use uuid::Uuid;

use crate::gpus::Gpu;
use crate::host::claims::{Claim, ClaimKey};
use crate::host::slots::Slots;
use kept::KeptWorkers;
use peers::Peers;
use prepared::{PrepKey, PreparedWorkers};
use runs::Runs;

/// A worker's id (as the lifecycle table and events name it).
pub type WorkerId = String;

/// Names one claim, preparation read or other step the core waits on, so that
/// its answer finds what it was for.
pub type Ticket = u64;

/// How long an admitted edit recipe may wait for a slot on this host.
pub const SPEC_WAIT: Duration = Duration::from_secs(5);

/// A run whose recipe names another host's prepared worker: that host claims it at
/// once; the others compete only if it has not after this long (it may be gone).
pub const PREPARED_FALLBACK: Duration = Duration::from_secs(2);

/// How long after a failed run claim (the claims bucket unreachable) the host
/// tries that run again.
pub const CLAIM_RETRY: Duration = Duration::from_secs(2);

/// How long the arrival of a run recipe this host did not run is remembered.
pub const ARRIVAL_MEMORY: Duration = Duration::from_secs(60);

/// A worker as the core knows it: its id and process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerRef {
    /// Its id.
    pub id: WorkerId,
    /// Its process id.
    pub pid: u32,
}

/// The recipe of a GPU cell (`gpus` slots) with nothing else known of it, as
/// admitted for preparation: what the simulator sends its hosts, and what tests
/// start from.
pub fn gpu_recipe(session: Uuid, cell_id: &str, kind: RecipeKind, exec_id: Uuid, gpus: u32) -> RecipeV3 {
    RecipeV3 {
        session,
        cell_id: cell_id.into(),
        kind,
        exec_id,
        revision: 1,
        code: String::new(),
        code_hash: 0,
        closure: vec![],
        imports: vec![],
        device: Device::Gpu,
        gpus,
        device_reason: String::new(),
        conservative: None,
        pinned: None,
        manifest_revision: 0,
        run_unix_ms: 0,
        options: SessionOptions { speculate: true, ..SessionOptions::default() },
        prepared: None,
        speculate: true,
        user_expressions: Default::default(),
    }
}

/// What only the world outside the core knows.
pub trait Facts {
    /// Whether worker `id`'s process is still alive.
    fn alive(&self, worker: &str) -> bool;
    /// How much of `recipe`'s import closure this host's zygotes hold, and how
    /// much of its closure's bytes its chunk cache holds (each 0..=1).
    fn placement(&self, recipe: &RecipeV3) -> (f64, f64);
}

/// Something that happened, for the core to decide on.
#[derive(Debug)]
pub enum Input {
    /// A recipe delivered to this host (a run's, or an edit's). A run recipe
    /// heard before is dropped (the planner sends again what was not
    /// acknowledged).
    Recipe(RecipeV3),
    /// A run recipe routed again (after a failed claim, or after waiting for
    /// another host's prepared worker): not a copy.
    Retry(RecipeV3),
    /// How a [`Command::Claim`] settled.
    Claimed { ticket: Ticket, claim: Claim },
    /// A [`Command::Prepare`] ended: the worker, ready, and how long it took; or
    /// why it failed (the worker was killed).
    Prepared { key: PrepKey, result: Result<(WorkerRef, f64), String> },
    /// A [`Command::Execute`] ended: the worker if it is still usable, the names
    /// it holds that could not be saved, whether it initialised CUDA.
    Executed { exec_id: Uuid, worker: Option<WorkerRef>, unsavable: Vec<String>, cuda_used: bool },
    /// Another host claimed run `exec_id`: it no longer waits here.
    ClaimedElsewhere { exec_id: Uuid },
    /// Another host's status: its free slots.
    PeerStatus { host: String, free_slots: usize },
    /// The planner (budget) or the session asks to stop a prepared worker.
    Evict { worker: WorkerId },
    /// The session was deleted.
    SessionClosed { session: Uuid },
    /// The session was culled for idleness: its workers stop, its state stays.
    SessionIdle { session: Uuid },
    /// The user interrupted a run.
    Interrupt { session: Uuid, exec_id: Uuid },
    /// Claims this host held and lost (found when renewing them).
    ClaimsLost(Vec<ClaimKey>),
    /// The periodic tick: reap dead prepared workers, retry, renew.
    Tick,
    /// The host is stopping: it takes nothing new, and ends the prepared
    /// workers no run has claimed.
    Stopping,
    /// The stopping host's executions ended: stop every worker it keeps.
    Stopped,
    /// An autoscaler cordons the host (true), to release it once it holds
    /// nothing: it takes no new work but runs the cells of the workers it holds
    /// (prepared, kept, a session's CPU worker), so no prepared worker is lost.
    /// Uncordoned (false), it takes work again: cheaper than booting a host.
    Cordon(bool),
}

/// Where an execution runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A new worker forked for the cell (holding `slots`, if a GPU cell).
    Fresh { slots: Vec<u32> },
    /// A worker that lives on: prepared, kept warm, the session's CPU worker, or
    /// one pinned for unsavable state.
    Existing { worker: WorkerId, prepare: Prepare, slots: Vec<u32> },
}

/// What the core decided: the shell carries these out in order.
#[derive(Debug)]
pub enum Command {
    /// Claim `key` after `delay`; answer with [`Input::Claimed`]. `live`: the hosts
    /// alive as far as this one knows, for a CPU claim held by a lost host.
    Claim { ticket: Ticket, key: ClaimKey, delay: Duration, live: Option<HashSet<String>> },
    /// Give up a claim (a session's CPU worker was stopped).
    Release { key: ClaimKey },
    /// Renew these claims; answer with [`Input::ClaimsLost`] for any lost.
    Renew { keys: Vec<ClaimKey> },
    /// Say how this host scored itself for a run and whether it won.
    Bid(BidV1),
    /// Publish a session event (`exec_id` nil for a session's own events).
    Event { session: Uuid, exec_id: Uuid, kind: EventKind },
    /// Fork (or, given `worker`, update in place) the worker prepared for `key`;
    /// answer with [`Input::Prepared`].
    Prepare { key: PrepKey, recipe: RecipeV3, slots: Vec<u32>, worker: Option<WorkerId> },
    /// Execute `recipe` on `target` (`prepared`: the preparation whose worker
    /// runs it); answer with [`Input::Executed`].
    Execute { recipe: RecipeV3, target: Target, prepared: Option<PrepKey> },
    /// Move a worker to a lifecycle state.
    Enter { worker: WorkerId, state: WorkerState },
    /// Stop a worker process.
    StopWorker { worker: WorkerId },
    /// The user interrupted `exec_id`: SIGINT it if it runs, and it never starts.
    Interrupt { exec_id: Uuid },
    /// Kill the session's cells that are preparing or running (it was deleted).
    KillCells { session: Uuid },
    /// The session's workers are stopped: its uid may serve another session.
    ReleaseUid { session: Uuid },
    /// Feed `input` back after `delay`.
    After { delay: Duration, input: Box<Input> },
    /// Publish this host's status (something changed).
    PublishStatus,
}

/// How the host prepares and keeps workers.
#[derive(Clone, Copy, Debug, Default)]
pub struct Policy {
    /// Prepare every worker on its slot. By default none is: a closure's
    /// GPU-resident state is staged in host memory while the user types and
    /// copied to the device at Run (ADR 70); this stands in for the old rule in
    /// tests and the simulator's validation.
    pub prepare_holds_slot: bool,
    /// Keep a GPU worker warm (with its slot) after its cell, for a re-run.
    pub keep_warm: bool,
}

/// A preparation this host is claiming: the newest revision that arrived
/// meanwhile (applied in place if this host wins).
#[derive(Debug)]
struct Claiming {
    next: Option<RecipeV3>,
}

/// What a claim in flight was for: what happens once it settles.
#[derive(Debug)]
enum ClaimFor {
    /// A GPU run on free `slots` reserved meanwhile.
    GpuRun { recipe: RecipeV3, slots: Vec<u32>, score: f64, delay: Duration },
    /// A GPU run that needs idle prepared workers' slots: evicted only if won.
    GpuRunEvicting { recipe: RecipeV3, score: f64, delay: Duration },
    /// The session's CPU worker.
    CpuWorker { recipe: RecipeV3 },
    /// A run on a kept worker that holds no slot, with `slots` lent for it.
    KeptRun { recipe: RecipeV3, worker: WorkerId, prepare: Prepare, slots: Vec<u32> },
    /// A run that needs no competition: executed on `target` if won.
    Run { recipe: RecipeV3, target: Target },
    /// The preparation of `recipe` (holding `slots` meanwhile, if it needs one).
    Preparation { recipe: RecipeV3, slots: Vec<u32>, runs_before: u64 },
    /// A run for a cell this host prepared.
    PreparedRun { key: PrepKey, recipe: RecipeV3 },
    /// A newer revision of a cell this host prepares or claims: claimed only so
    /// that no other host prepares it too.
    Revision,
}

/// The gpu-host's decisions.
pub struct HostCore<C: Clock + Clone = SystemClock> {
    host_id: String,
    clock: C,
    policy: Policy,
    slots: Slots<C>,
    runs: Runs,
    prepared: PreparedWorkers,
    kept: KeptWorkers,
    peers: Peers,
    /// Admitted edit recipes that found no free slot: the newest per cell, with
    /// when it arrived, tried when a slot frees (for [`SPEC_WAIT`]).
    spec_waiting: Vec<(Instant, RecipeV3)>,
    /// Run recipes seen per GPU cell: an edit recipe still being claimed when a
    /// run of its cell arrives prepares nothing (the run serves the cell).
    runs_of_cell: HashMap<PrepKey, u64>,
    /// Cells whose preparation this host is claiming.
    claiming_prep: HashMap<PrepKey, Claiming>,
    /// What each claim in flight was for.
    claims: HashMap<Ticket, (ClaimKey, ClaimFor)>,
    next_ticket: Ticket,
    /// A small deterministic generator for claim jitter (ties between hosts).
    jitter_state: u64,
    stopping: bool,
    /// Cordoned: it takes work only for the workers it holds (ADR 74).
    cordoned: bool,
    commands: Vec<Command>,
}

impl<C: Clock + Clone> HostCore<C> {
    /// A host named `host_id` with GPU `slots`, on `clock`.
    pub fn new(host_id: impl Into<String>, slots: Vec<Gpu>, policy: Policy, clock: C) -> Self {
        let host_id = host_id.into();
        let started = clock.now();
        // seeded from the host's name: hosts break ties differently, and a run is
        // reproducible (the simulator's results are)
        let seed =
            host_id.bytes().fold(0x9E37_79B9_7F4A_7C15_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3));
        Self {
            slots: Slots::with_clock(slots, clock.clone()),
            peers: Peers::new(started),
            clock,
            host_id,
            policy,
            runs: Runs::default(),
            prepared: PreparedWorkers::default(),
            kept: KeptWorkers::default(),
            spec_waiting: Vec::new(),
            runs_of_cell: HashMap::new(),
            claiming_prep: HashMap::new(),
            claims: HashMap::new(),
            next_ticket: 1,
            jitter_state: seed | 1,
            stopping: false,
            cordoned: false,
            commands: Vec::new(),
        }
    }

    /// Decide on `input`; the commands to carry out, in order.
    pub fn on(&mut self, input: Input, facts: &dyn Facts) -> Vec<Command> {
        match input {
            Input::Recipe(recipe) => self.on_recipe(recipe, facts, true),
            Input::Retry(recipe) => self.on_recipe(recipe, facts, false),
            Input::Claimed { ticket, claim } => self.claimed(ticket, claim, facts),
            Input::Prepared { key, result } => self.prepare_done(key, result, facts),
            Input::Executed { exec_id, worker, unsavable, cuda_used } => {
                self.executed(exec_id, worker, unsavable, cuda_used, facts)
            }
            Input::ClaimedElsewhere { exec_id } => self.claimed_elsewhere(exec_id),
            Input::PeerStatus { host, free_slots } => self.peers.heard(host, free_slots, self.clock.now()),
            Input::Evict { worker } => self.evict(&worker, facts),
            Input::SessionClosed { session } => self.close_session(session, facts),
            Input::SessionIdle { session } => self.stop_kept(session),
            Input::Interrupt { session, exec_id } => self.interrupt(session, exec_id),
            Input::ClaimsLost(keys) => self.claims_lost(keys),
            Input::Tick => self.tick(facts),
            Input::Stopping => self.begin_stopping(facts),
            Input::Stopped => self.stopped(),
            Input::Cordon(on) => self.cordoned = on,
        }
        std::mem::take(&mut self.commands)
    }

    // ------------------------------------------------------------ what it holds

    /// This host's id.
    pub fn host_id(&self) -> &str {
        &self.host_id
    }

    /// The slots and what holds each.
    pub fn slots(&self) -> &Slots<C> {
        &self.slots
    }

    /// Sessions whose CPU worker this host keeps.
    pub fn cpu_sessions(&self) -> Vec<Uuid> {
        self.kept.cpu_sessions().collect()
    }

    /// The id of `session`'s CPU worker, if this host keeps it.
    pub fn cpu_worker(&self, session: Uuid) -> Option<&str> {
        self.kept.cpu_worker(session).map(|k| k.worker.id.as_str())
    }

    /// Whether the worker prepared for `session`'s `cell_id` is still preparing.
    pub fn is_preparing(&self, session: Uuid, cell_id: &str) -> bool {
        self.prepared.is_preparing(session, cell_id)
    }

    /// Whether a run recipe `exec_id` was heard (and not yet forgotten).
    pub fn heard(&self, exec_id: Uuid) -> bool {
        self.runs.contains(exec_id)
    }

    /// How many executions are under way.
    pub fn running(&self) -> usize {
        self.runs.running()
    }

    /// How many runs this host holds: running, or claimed and waiting for a slot
    /// or a prepared worker (what a draining host waits for before it stops).
    pub fn runs_held(&self) -> usize {
        self.runs.in_state(runs::RunState::held).len()
    }

    /// Whether it holds nothing: no run, no prepared or kept worker (a cordoned
    /// host is released then).
    pub fn holds_nothing(&self) -> bool {
        self.runs_held() == 0 && self.prepared.keys().is_empty() && self.kept.is_empty()
    }

    /// The worker prepared for a cell (its id, empty while first forked), its
    /// class and its phase.
    pub fn prepared_worker(&self, key: &PrepKey) -> Option<(&str, PreparedClass, &prepared::Phase)> {
        self.prepared.get(key).map(|p| (p.worker_id(), p.class, &p.phase))
    }

    /// Where run `exec` stands on this host.
    pub fn run_state(&self, exec: Uuid) -> Option<&runs::RunState> {
        self.runs.get(exec).map(|r| &r.state)
    }

    /// Whether this host keeps worker `id` (CPU worker, or unsavable state).
    pub fn keeps(&self, id: &str) -> bool {
        self.kept.get(id).is_some()
    }

    // ------------------------------------------------------------ helpers

    fn emit(&mut self, c: Command) {
        self.commands.push(c);
    }

    fn ticket(&mut self) -> Ticket {
        let t = self.next_ticket;
        self.next_ticket += 1;
        t
    }

    /// Jitter up to `max`: xorshift64, deterministic per host.
    fn jitter(&mut self, max: Duration) -> Duration {
        let mut x = self.jitter_state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.jitter_state = x;
        let us = max.as_micros().max(1) as u64;
        Duration::from_micros(x % us)
    }

    /// Claim `key` after `delay`; `then` says what follows once it settles.
    fn claim(&mut self, key: ClaimKey, delay: Duration, then: ClaimFor) {
        let ticket = self.ticket();
        // only a CPU worker's claim can be taken over from a lost host
        let live = match key {
            ClaimKey::Cpu(_) => self.peers.live(&self.host_id, self.clock.now()),
            _ => None,
        };
        self.claims.insert(ticket, (key.clone(), then));
        self.emit(Command::Claim { ticket, key, delay, live });
    }

    /// How long to wait before claiming `recipe`, and the score it comes from
    /// ([`crate::host::placement::claim_delay`]): a better-placed host waits less.
    /// With no other host that has room, nobody could do better: at once.
    fn claim_delay(&mut self, recipe: &RecipeV3, facts: &dyn Facts) -> (Duration, f64) {
        use crate::host::placement::{claim_delay, Standing, MAX_JITTER};
        let (zygote, cached) = facts.placement(recipe);
        let standing = Standing {
            free_share: self.slots.free_share(),
            zygote,
            cached,
            competitor_has_room: self.peers.has_room(recipe.gpus.max(1), self.clock.now()),
        };
        let jitter = self.jitter(MAX_JITTER);
        claim_delay(standing, jitter)
    }

    fn event(&mut self, session: Uuid, kind: EventKind) {
        self.emit(Command::Event { session, exec_id: Uuid::nil(), kind });
    }

    fn enter(&mut self, worker: &str, state: WorkerState) {
        self.emit(Command::Enter { worker: worker.to_string(), state });
    }

    fn stop_worker(&mut self, worker: &str) {
        self.enter(worker, WorkerState::Evicted);
        self.emit(Command::StopWorker { worker: worker.to_string() });
    }

    /// Free `slots` held by `session` for `held`, counting each one's time (a
    /// `%%gpu N` cell holds N slots, and uses N times the slot time).
    fn release_slots(&mut self, slots: &[u32], session: Uuid, held: SlotUse) {
        for &slot in slots {
            let Some(held_ms) = self.slots.release(slot) else { continue };
            schemas::metrics::metrics()
                .slot_seconds
                .get_or_create(&[("use", schemas::metrics::slot_use(held))])
                .inc_by(held_ms / 1000.0);
            let kind = EventKind::SlotReleased { host: self.host_id.clone(), slot, held_ms, reason: held };
            self.event(session, kind);
        }
    }

    /// The settled claim `ticket`: on to what it was for.
    fn claimed(&mut self, ticket: Ticket, claim: Claim, facts: &dyn Facts) {
        let Some((_, then)) = self.claims.remove(&ticket) else { return };
        match then {
            ClaimFor::GpuRun { recipe, slots, score, delay } => {
                self.gpu_run_claimed(recipe, slots, score, delay, claim, facts)
            }
            ClaimFor::GpuRunEvicting { recipe, score, delay } => self.evicting_run_claimed(recipe, score, delay, claim),
            ClaimFor::CpuWorker { recipe } => self.cpu_worker_claimed(recipe, claim),
            ClaimFor::KeptRun { recipe, worker, prepare, slots } => {
                self.kept_run_claimed(recipe, worker, prepare, slots, claim, facts)
            }
            ClaimFor::Run { recipe, target } => self.run_claimed(recipe, target, claim),
            ClaimFor::Preparation { recipe, slots, runs_before } => {
                self.preparation_claimed(recipe, slots, runs_before, claim, facts)
            }
            ClaimFor::PreparedRun { key, recipe } => self.prepared_run_claimed(key, recipe, claim, facts),
            ClaimFor::Revision => {}
        }
    }
}
