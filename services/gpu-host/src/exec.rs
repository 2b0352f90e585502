//! One cell execution on a host, from claim to save (DESIGN.md section 4, steps
//! 3-5): get a worker (fork, or the session's persistent/pinned one), bring it to
//! the committed state, restore the closure, run, save, and report each step as a
//! session event.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use schemas::checkpoint::{Delta, Manifest, SaveOrigin};
use schemas::messages::{
    CellStatus, ChunkPlanV2, ChunkPlannedV1, CommitV2, CommittedV1, Device, ErrorCode, EventKind, ManifestGetV2,
    ManifestV1, OutputV1, Prepare, RecipeV3, SessionEventV2, StartPhases, WorkerState, OUTPUT_PART_BYTES,
};
use schemas::subjects::StoreVerb;
use schemas::{unix_ms, Bus, BusError};
use tokio::sync::Mutex;
use tracing::Instrument as _;
use uuid::Uuid;

use crate::chunks::{ChunkError, Chunks};
use crate::import_cache::ImportCache;
use crate::protocol::{Frame, VarRestore};
use crate::socket::Listener;
use crate::worker::{CellToRun, RunEvent, RunLimits, WorkerError, WorkerProc};
use crate::zygotes::{Zygote, ZygoteError};

/// How long store requests may take.
const STORE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why an execution or a preparation failed outside the cell. What it says is
/// what the user reads in the `Failed` event ([`ExecEnv::execute`] sends it).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// No zygote could be started to fork from.
    #[error("could not start a worker: no zygote: {0}")]
    NoZygote(#[source] ZygoteError),
    /// The zygote could not fork the worker (twice, with a fresh zygote between).
    #[error("could not start a worker: {0}")]
    Fork(#[source] ZygoteError),
    /// The session's working directory cannot be entered.
    #[error("the session's working directory {cwd:?} cannot be used: {source}")]
    Cwd {
        /// The directory.
        cwd: String,
        /// Why.
        source: std::io::Error,
    },
    /// The session's workers cannot get a uid of their own.
    #[error("could not start a worker: {0}")]
    SessionUid(#[from] crate::session_uids::UidError),
    /// The session's package layer could not be made its uid's.
    #[error("could not prepare the session's package layer {path}: {source}")]
    PackageLayer {
        /// The layer.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The worker's limits could not be applied.
    #[error("could not start a worker within its limits: {0}")]
    Limits(#[source] crate::cgroups::CgroupError),
    /// The worker went past its memory limit and the kernel killed it.
    #[error(
        "the cell used more memory than a worker may ({} MiB) and was killed; nothing it did was committed, \
         the session keeps its last committed state",
        .limit_bytes >> 20
    )]
    MemoryLimit {
        /// The limit.
        limit_bytes: u64,
    },
    /// The zygote chosen for the worker went away twice.
    #[error("could not start a worker: the zygote chosen for it went away")]
    ZygoteGone,
    /// The session's manifest could not be read.
    #[error("could not read the session's manifest: {0}")]
    Manifest(#[source] BusError),
    /// The cell needs a variable that lived only in a worker that is gone.
    #[error(
        "variable '{name}' could not be saved ({reason}) and lived only in worker {worker} on host {host} \
         (defined by cell {cell_id}); that worker is gone, so this cell cannot run"
    )]
    UnsavableGone {
        /// The variable.
        name: String,
        /// Why it could not be saved.
        reason: String,
        /// The worker that held it.
        worker: String,
        /// Its host.
        host: String,
        /// The cell that defined it.
        cell_id: String,
    },
    /// The closure's records and chunks could not be laid out for the worker.
    #[error("could not restore the cell's state: {0}")]
    RestoreFile(#[source] ChunkError),
    /// The worker could not load some of the closure.
    #[error("restoring the cell's state failed: {}", .0.join("; "))]
    Restore(Vec<String>),
    /// The worker died or hung: nothing it did was committed.
    #[error("{0}; the worker was lost, the session's committed state is intact")]
    WorkerLost(#[source] WorkerError),
    /// The worker refused a step, or the store refused its save.
    #[error(transparent)]
    Worker(WorkerError),
    /// The host is stopping (SIGTERM): the cell was stopped before it was saved.
    #[error(
        "host {host} stopped while the cell ran (it was shut down); nothing the cell did was committed, \
         the session keeps its last committed state"
    )]
    HostStopping {
        /// The host.
        host: String,
    },
    /// The user interrupted the cell before it started here: it never ran.
    #[error("{}", schemas::messages::INTERRUPTED_BEFORE_START)]
    Interrupted,
    /// The cell ignored the user's interrupt and was killed.
    #[error(
        "the cell did not stop within {grace:?} of the interrupt and was killed with every process it started; \
         nothing it did was committed, the session keeps its last committed state"
    )]
    KilledAfterInterrupt {
        /// How long it could have taken to stop.
        grace: Duration,
    },
    /// The prepared worker died before the cell started and no fresh one could start.
    #[error("the prepared worker was lost and no fresh one could start: {0}")]
    PreparedLost(#[source] Box<ExecError>),
}

impl From<WorkerError> for ExecError {
    fn from(e: WorkerError) -> Self {
        match e {
            WorkerError::Conn { .. } | WorkerError::CellTimeout { .. } => ExecError::WorkerLost(e),
            _ => ExecError::Worker(e),
        }
    }
}

/// What every execution on this host shares.
#[derive(Clone)]
pub struct ExecEnv {
    /// The bus.
    pub bus: Bus,
    /// This host.
    pub host_id: String,
    /// The byte path.
    pub chunks: Chunks,
    /// Where zygotes and workers connect.
    pub listener: Listener,
    /// The zygote tree (the base is restarted when it dies).
    pub zygotes: Arc<Mutex<ImportCache>>,
    /// How long a cell may run, and ignore the interrupt that follows.
    pub limits: RunLimits,
    /// Per-worker limits (None: unlimited).
    pub cgroups: Option<crate::cgroups::Cgroups>,
    /// Cells the user interrupted, and the runs under way (for the signals).
    pub interrupts: crate::interrupts::Interrupts,
    /// Runs of this host waiting for their client's input.
    pub inputs: crate::input::Inputs,
    /// Whether slots are real GPUs (then workers see only their device).
    pub real_gpus: bool,
    /// The last manifest read per session (for placement scores; never for restores).
    pub recent_manifests: Arc<std::sync::Mutex<HashMap<Uuid, Arc<Manifest>>>>,
    /// Workers forked so far.
    pub forks: Arc<AtomicU64>,
    /// Every live worker's state.
    pub lifecycle: crate::lifecycle::Lifecycle,
    /// Sessions' package layers (`DIR/<session>`).
    pub package_layers: std::path::PathBuf,
    /// Set when the host is stopping: a worker lost from then on was stopped with
    /// the host, and its execution fails saying so.
    pub stopping: Arc<std::sync::atomic::AtomicBool>,
    /// Each session's workers' uid, when they run as one of their own (ADR 29).
    pub session_uids: Option<Arc<crate::session_uids::SessionUids>>,
}

/// Sessions whose last manifest a host remembers for scoring.
const RECENT_MANIFESTS: usize = 256;

/// Which worker runs the cell.
pub enum Target {
    /// A new worker forked for this cell (holding `slots`, if a GPU cell).
    Fresh {
        /// The GPU slots (the cell's `gpus`; none for a CPU cell).
        slots: Vec<u32>,
    },
    /// A worker that lives on: the session's CPU worker, or a pinned one.
    Existing {
        /// The worker.
        worker: Arc<Mutex<WorkerProc>>,
        /// Persistent or pinned.
        prepare: Prepare,
        /// Its GPU slots, if it holds any.
        slots: Vec<u32>,
    },
}

/// How an execution ended, for the host actor's bookkeeping.
pub struct Outcome {
    /// The worker, if it is still usable (the host decides to keep or stop it).
    pub worker: Option<Arc<Mutex<WorkerProc>>>,
    /// Names it holds that could not be saved (keep it for them).
    pub unsavable: Vec<String>,
    /// Whether the worker has initialised CUDA (it then holds GPU memory, and a
    /// kept worker keeps its slot; one that never did holds none: ADR 51).
    pub cuda_used: bool,
}

/// What a finished execution leaves in its worker.
struct Left {
    unsavable: Vec<String>,
    cuda_used: bool,
}

impl ExecEnv {
    async fn event(&self, session: Uuid, exec_id: Uuid, kind: EventKind) {
        let ev = SessionEventV2 { session, exec_id, unix_ms: unix_ms(), kind };
        if let Err(e) =
            self.bus.publish_kept(self.bus.subjects().event(session), &ev, schemas::bus::KEPT_PATIENCE).await
        {
            tracing::error!(error = %e, %session, "could not publish a session event");
        }
    }

    /// An error if the host is stopping (SIGTERM): a cell not yet started must not
    /// start.
    fn not_stopping(&self) -> Result<(), ExecError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(ExecError::HostStopping { host: self.host_id.clone() });
        }
        Ok(())
    }

    /// An error if the user interrupted the execution before it started here.
    fn not_interrupted(&self, exec_id: Uuid) -> Result<(), ExecError> {
        if self.interrupts.asked(exec_id) {
            return Err(ExecError::Interrupted);
        }
        Ok(())
    }

    /// The session's latest committed manifest, given that revision `at_least` is
    /// committed (the recipe's `manifest_revision`).
    pub async fn manifest(&self, session: Uuid, at_least: u64) -> Result<Manifest, ExecError> {
        let subject = self.bus.subjects().store(StoreVerb::ManifestGet);
        let get = ManifestGetV2 { session, at_least: Some(at_least) };
        let manifest = self
            .bus
            .request_idempotent::<_, ManifestV1>(subject, &get, STORE_TIMEOUT)
            .await
            .map(|m| m.manifest)
            .map_err(ExecError::Manifest)?;
        if let Ok(mut recent) = self.recent_manifests.lock() {
            if recent.len() >= RECENT_MANIFESTS && !recent.contains_key(&session) {
                recent.clear(); // crude bound; scores only lose a hint
            }
            recent.insert(session, Arc::new(manifest.clone()));
        }
        Ok(manifest)
    }

    /// How well placed this host is for `recipe`, each in 0..=1: how much of its
    /// import tail the best zygote has imported, and how much of its closure's
    /// bytes the chunk cache holds (from the session's last manifest seen here;
    /// 0 if none).
    pub fn placement(&self, recipe: &RecipeV3) -> (f64, f64) {
        let coverage = self.zygotes.try_lock().map(|z| z.coverage(&recipe.imports)).unwrap_or(0.0);
        let manifest = self.recent_manifests.lock().ok().and_then(|r| r.get(&recipe.session).cloned());
        let Some(m) = manifest else { return (coverage, 0.0) };
        let roots = recipe.closure.iter().filter_map(|v| m.variables.get(&v.name).and_then(|e| e.oid.as_deref()));
        let (mut total, mut cached) = (0u64, 0u64);
        for oid in m.reachable(roots) {
            let Some(obj) = m.objects.get(&oid) else { continue };
            let blobs = std::iter::once((&obj.record.chunks, obj.record.len))
                .chain(obj.payloads.iter().map(|p| (&p.chunks, p.len)));
            for (chunks, len) in blobs {
                let mut left = len;
                for h in chunks {
                    let n = left.min(schemas::checkpoint::CHUNK_BYTES as u64);
                    left -= n;
                    total += n;
                    if self.chunks.is_cached(h) {
                        cached += n;
                    }
                }
            }
        }
        (coverage, if total == 0 { 1.0 } else { cached as f64 / total as f64 })
    }

    /// The devices a worker on `slots` may see (none for CPU work and virtual slots).
    fn device_env(&self, slots: &[u32]) -> BTreeMap<String, String> {
        let devices = match self.real_gpus {
            true => slots.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            false => String::new(),
        };
        BTreeMap::from([("CUDA_VISIBLE_DEVICES".to_string(), devices)])
    }

    /// Fork a worker from the deepest zygote that fits the import closure, starting
    /// (or restarting) the base zygote if needed, and build a child zygote in the
    /// background when a tail keeps being asked for.
    pub async fn fork(
        &self,
        session: Uuid,
        slots: &[u32],
        cwd: &str,
        imports: &[String],
    ) -> Result<(WorkerProc, bool), ExecError> {
        let mut env = self.device_env(slots);
        env.insert("LOOSELEAF_SESSION".to_string(), session.to_string());
        // installs from a cell go to the session's own layer (a pip target)
        let layer = self.package_layers.join(session.to_string());
        env.insert("LOOSELEAF_PACKAGE_LAYER".to_string(), layer.display().to_string());
        let worker_id = format!("w{}", Uuid::now_v7().simple());
        if let Err(e) = std::fs::read_dir(cwd) {
            return Err(ExecError::Cwd { cwd: cwd.to_string(), source: e });
        }
        let uid = match &self.session_uids {
            Some(uids) => {
                let uid = uids.of(session)?;
                // pip installs from its cells land in its layer: its uid owns it
                let own = |path: &std::path::Path| {
                    std::fs::create_dir_all(path)?;
                    std::os::unix::fs::chown(path, Some(uid), Some(uid))
                };
                own(&layer).map_err(|source| ExecError::PackageLayer { path: layer.display().to_string(), source })?;
                Some(uid)
            }
            None => None,
        };
        let mut cache = self.zygotes.lock().await;
        for attempt in 0..2 {
            let base_id = format!("z-{}-{}", self.host_id, Uuid::now_v7().simple());
            cache.ensure_base(&self.listener, &base_id).await.map_err(ExecError::NoZygote)?;
            let tail = cache.tail(imports);
            let choice = cache.choose(&tail);
            let hit = choice.covered;
            if let Some(tail) = choice.spawn.clone() {
                self.spawn_child_zygote(&mut cache, tail).await;
            }
            let Some(z) = cache.zygote(&choice) else { continue };
            match z.fork(&self.listener, &worker_id, env.clone(), cwd, uid).await {
                Ok(forked) => {
                    self.forks.fetch_add(1, Ordering::Relaxed);
                    let pid = forked.pid;
                    let mut worker = WorkerProc::new(forked, session, self.lifecycle.clone());
                    worker.uid = uid;
                    if let Some(cgroups) = &self.cgroups {
                        // a worker the limits cannot hold does not run (dropped: killed)
                        worker.set_cgroup(cgroups.attach(&worker_id, pid).map_err(ExecError::Limits)?);
                    }
                    return Ok((worker, hit));
                }
                // the worker's own failure, not the zygote's: no retry
                Err(e @ ZygoteError::WorkerExited { .. }) => return Err(ExecError::Fork(e)),
                Err(e) if attempt == 0 => {
                    tracing::warn!(error = %e, zygote = %z.id, "zygote failed to fork; dropping it");
                    if choice.is_base() {
                        cache.drop_base();
                    } else {
                        cache.drop_child(&choice);
                    }
                }
                Err(e) => return Err(ExecError::Fork(e)),
            }
        }
        Err(ExecError::ZygoteGone)
    }

    /// Ask the base zygote for a child with `tail` imported; its hello is awaited in
    /// the background so this fork does not wait for the tail's imports.
    async fn spawn_child_zygote(&self, cache: &mut ImportCache, tail: std::collections::BTreeSet<String>) {
        let id = format!("z-{}-{}", self.host_id, Uuid::now_v7().simple());
        let modules = cache.modules_of(&tail);
        let Some(base) = cache.base() else { return };
        match base.spawn_child(&self.listener, &id, modules).await {
            Ok(rx) => {
                let (listener, zygotes) = (self.listener.clone(), self.zygotes.clone());
                let modules = cache.modules_of(&tail);
                tokio::spawn(async move {
                    match Zygote::child_ready(&listener, &id, rx).await {
                        Ok(z) => zygotes.lock().await.add_child(tail, modules, z),
                        Err(e) => {
                            tracing::warn!(error = %e, ?tail, "child zygote not ready");
                            zygotes.lock().await.child_failed(&tail);
                        }
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not ask for a child zygote");
                cache.child_failed(&tail);
            }
        }
    }

    /// Run one recipe to the end. Never panics; every failure becomes a `Failed` event.
    /// `arrived`: when this host received the run recipe (the start's phases count
    /// from there).
    pub async fn execute(&self, recipe: RecipeV3, target: Target, arrived: Option<Instant>) -> Outcome {
        let (session, exec_id) = (recipe.session, recipe.exec_id);
        let claimed_at = Instant::now();
        let phases = StartPhases {
            claim_ms: arrived.map_or(0.0, |a| claimed_at.duration_since(a).as_secs_f64() * 1000.0),
            ..StartPhases::default()
        };
        let (slots, prepare) = match &target {
            // a fresh worker for a CPU cell becomes the session's persistent one
            Target::Fresh { slots } if slots.is_empty() && recipe.device == Device::Cpu && recipe.pinned.is_none() => {
                (vec![], Prepare::Persistent)
            }
            Target::Fresh { slots } => (slots.clone(), Prepare::Cold),
            Target::Existing { prepare, slots, .. } => (slots.clone(), *prepare),
        };
        tracing::Span::current().record("prepare", tracing::field::debug(prepare));
        // events name a cell's first slot; host status lists all it holds
        let slot = slots.first().copied();
        self.event(session, exec_id, EventKind::Claimed { host: self.host_id.clone(), slot, prepare }).await;
        let (worker, result) = self.run_on(&recipe, target, slots, prepare, claimed_at, phases).await;
        match result {
            Ok(Left { unsavable, cuda_used }) => Outcome { worker, unsavable, cuda_used },
            // the one place an execution's failure reaches the session
            Err(e) => {
                let stopped = self.stopping.load(Ordering::SeqCst) && matches!(e, ExecError::WorkerLost(_));
                let e = if stopped { ExecError::HostStopping { host: self.host_id.clone() } } else { e };
                self.event(session, exec_id, EventKind::Failed { error: e.to_string() }).await;
                Outcome { worker, unsavable: vec![], cuda_used: false }
            }
        }
    }

    /// Get the worker, bring it to the closure, run and save. Returns the worker if
    /// it is still usable (a broken one is killed here).
    async fn run_on(
        &self,
        recipe: &RecipeV3,
        target: Target,
        slots: Vec<u32>,
        prepare: Prepare,
        claimed_at: Instant,
        mut phases: StartPhases,
    ) -> (Option<Arc<Mutex<WorkerProc>>>, Result<Left, ExecError>) {
        let forking = Instant::now();
        let mut manifest = None;
        let (mut worker, import_hit) = match target {
            Target::Fresh { .. } => {
                // The manifest is read while the worker forks (off the critical
                // path); when the read takes longer, the wait is the manifest's phase.
                let fork = async {
                    let forked = self
                        .fork(recipe.session, &slots, &recipe.options.cwd, &recipe.imports)
                        .instrument(tracing::info_span!("fork", otel.name = "fork worker"))
                        .await;
                    (forked, forking.elapsed())
                };
                let read = async {
                    let read = self
                        .manifest(recipe.session, recipe.manifest_revision)
                        .instrument(tracing::info_span!("manifest", otel.name = "read manifest"))
                        .await;
                    (read, forking.elapsed())
                };
                let ((forked, forked_after), (read, read_after)) = tokio::join!(fork, read);
                manifest = read.ok(); // a failed read is retried, and reported, by the restore
                match forked {
                    Ok((w, hit)) => {
                        phases.fork_ms = forked_after.as_secs_f64() * 1000.0;
                        phases.manifest_ms = read_after.saturating_sub(forked_after).as_secs_f64() * 1000.0;
                        (Arc::new(Mutex::new(w)), hit)
                    }
                    Err(e) => return (None, Err(e)),
                }
            }
            Target::Existing { worker, .. } => (worker, true),
        };
        let mut w = worker.lock().await;
        let runs_before = w.runs;
        let start = Start { slots: slots.clone(), prepare, claimed_at, import_hit, phases, manifest };
        let mut result = self.drive(recipe, &mut w, start).await;
        if matches!(prepare, Prepare::Speculative | Prepare::Warm) && w.is_broken() && w.runs == runs_before {
            // The prepared (or warm) worker died before the cell started: the run
            // goes to a fresh worker on the same slot; the user sees a cold start.
            tracing::warn!(exec = %recipe.exec_id, worker = %w.id, error = ?result.as_ref().err(),
                "prepared worker lost before Run; starting cold");
            w.kill_now();
            drop(w);
            let forking = Instant::now();
            let fork = self.fork(recipe.session, &slots, &recipe.options.cwd, &recipe.imports);
            match fork.instrument(tracing::info_span!("fork", otel.name = "fork worker")).await {
                Ok((fresh, hit)) => {
                    phases.fork_ms = forking.elapsed().as_secs_f64() * 1000.0;
                    worker = Arc::new(Mutex::new(fresh));
                    w = worker.lock().await;
                    let start =
                        Start { slots, prepare: Prepare::Cold, claimed_at, import_hit: hit, phases, manifest: None };
                    result = self.drive(recipe, &mut w, start).await;
                }
                Err(e) => {
                    w = worker.lock().await;
                    result = Err(ExecError::PreparedLost(Box::new(e)));
                }
            }
        }
        let broken = w.is_broken();
        if let (true, Some(limit_bytes), Err(ExecError::WorkerLost(_))) = (broken, w.memory_exceeded(), &result) {
            result = Err(ExecError::MemoryLimit { limit_bytes });
        }
        drop(w);
        if broken {
            // a worker lost after its save landed still returns the run's Ok
            worker.lock().await.kill_now();
            return (None, result);
        }
        (Some(worker), result)
    }

    async fn drive(&self, recipe: &RecipeV3, w: &mut WorkerProc, start: Start) -> Result<Left, ExecError> {
        let Start { slots, prepare, claimed_at, import_hit, mut phases, manifest } = start;
        // a host that began stopping while this worker forked starts nothing new
        self.not_stopping()?;
        let (session, exec_id) = (recipe.session, recipe.exec_id);
        let restore_started = Instant::now();
        // a worker prepared before Run may have been prepared without its slots,
        // and a kept worker that never used CUDA is lent its slots for this run
        let lent = matches!(prepare, Prepare::Pinned | Prepare::Persistent) && !slots.is_empty();
        let env = if matches!(prepare, Prepare::Speculative | Prepare::Warm) || lent {
            self.device_env(&slots)
        } else {
            BTreeMap::new()
        };
        let (manifest, restored) =
            self.restore_closure(recipe, w, env, manifest).instrument(tracing::info_span!("restore")).await?;
        let restored_at = Instant::now();
        let restored_bytes = restored.bytes;
        phases.manifest_ms += restored.manifest_ms;
        phases.restore_file_ms = restored.file_ms;
        phases.imports_ms = restored.imports_ms;
        phases.load_ms = restored.load_ms;

        let prepare_ms = claimed_at.elapsed().as_secs_f64() * 1000.0;
        let restore_ms = restore_started.elapsed().as_secs_f64() * 1000.0;
        // Outputs stream to clients while the cell runs, in order, through one
        // forwarding task.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Pending>();
        let bus = self.bus.clone();
        let forwarder = tokio::spawn(
            async move {
                // several wait for their stream at once, so that the round trips overlap
                let mut unconfirmed = std::collections::VecDeque::new();
                while let Some(p) = rx.recv().await {
                    match p {
                        Pending::Event(ev) => {
                            unconfirmed.push_back(bus.send_kept(bus.subjects().event(ev.session), &ev).await)
                        }
                        Pending::Output(out) => {
                            let subject = bus.subjects().output(out.session, out.exec_id);
                            for piece in
                                OutputV1::pieces(out.session, out.exec_id, out.seq, out.output_json, OUTPUT_PART_BYTES)
                            {
                                unconfirmed.push_back(bus.send_kept(subject.clone(), &piece).await);
                            }
                        }
                    }
                    while unconfirmed.len() > KEPT_WINDOW {
                        if let Some(sent) = unconfirmed.pop_front() {
                            confirm_kept(&bus, sent).await;
                        }
                    }
                }
                for sent in unconfirmed {
                    confirm_kept(&bus, sent).await;
                }
            }
            .instrument(tracing::Span::current()),
        ); // outputs and events carry the cell's trace
           // outputs are numbered in order, whether the cell printed them or asked for input
        let seq = AtomicU64::new(0);
        let host = self.host_id.clone();
        let worker_id = w.id.clone();
        let device = recipe.device;
        // A name the closure missed comes from the same committed state the closure
        // was restored from (DESIGN section 6's safety net); records the worker
        // holds are not sent again.
        let held_oids = std::sync::Mutex::new(held_records(&manifest, w.held.keys().map(String::as_str)));
        let fault_files = std::sync::Mutex::new(Vec::new());
        let owner = w.uid;
        let on_fault =
            |names: Vec<String>| self.fault_frame(&manifest, &held_oids, &fault_files, names, &worker_id, owner);
        // nor runs a cell whose restore it was still waiting for, or that the user
        // interrupted meanwhile
        self.not_stopping()?;
        self.not_interrupted(exec_id)?;
        let (interrupts, pid) = (self.interrupts.clone(), w.pid);
        // a cell's input(): the wait is registered before its client is asked
        let on_input = |prompt: String, password: bool| {
            let wait = self.inputs.expect(exec_id);
            let output = serde_json::json!({ "output_type": schemas::messages::INPUT_REQUEST_OUTPUT, "prompt": prompt, "password": password });
            let seq = seq.fetch_add(1, Ordering::SeqCst) + 1;
            let asked = tx.send(Pending::Output(OutputV1 {
                session,
                exec_id,
                seq,
                output_json: output.to_string(),
                part: 0,
                parts: 1,
            }));
            let interrupts = &self.interrupts;
            async move {
                if asked.is_err() {
                    return Frame::InputReply {
                        exec_id: exec_id.to_string(),
                        value: String::new(),
                        refused: Some("the host could not ask the cell's client.".into()),
                        interrupted: false,
                    };
                }
                wait.answer(interrupts).await
            }
        };
        let finished = w
            .run(
                exec_id,
                CellToRun { cell_id: &recipe.cell_id, code: &recipe.code, user_expressions: &recipe.user_expressions },
                self.limits,
                |ev| {
                    let p = match ev {
                        RunEvent::Started { unix_ms, execution_count, python } => {
                            // from now on the worker takes SIGINT as the cell's
                            interrupts.started(exec_id, pid);
                            let phases =
                                StartPhases { setup_ms: restored_at.elapsed().as_secs_f64() * 1000.0, ..phases };
                            record_start(&phases, restored_bytes);
                            Pending::Event(SessionEventV2 {
                                session,
                                exec_id,
                                unix_ms,
                                kind: EventKind::Started {
                                    host: host.clone(),
                                    slot: slots.first().copied(),
                                    worker: worker_id.clone(),
                                    device,
                                    prepare,
                                    execution_count,
                                    restored_bytes,
                                    prepare_ms,
                                    restore_ms,
                                    refreshed: restored.refreshed,
                                    import_hit,
                                    python,
                                    phases,
                                },
                            })
                        }
                        RunEvent::Output(output) => Pending::Output(OutputV1 {
                            session,
                            exec_id,
                            seq: seq.fetch_add(1, Ordering::SeqCst) + 1,
                            output_json: output.to_string(),
                            part: 0,
                            parts: 1,
                        }),
                    };
                    // the receiver lives until we drop tx below
                    let _ = tx.send(p);
                },
                on_fault,
                on_input,
            )
            .instrument(tracing::info_span!("run"))
            .await;
        drop(tx);
        for path in fault_files.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let _ = std::fs::remove_file(path);
        }
        if let Err(e) = forwarder.await {
            tracing::error!(error = %e, "output forwarder failed");
        }
        let killed = self.interrupts.ended(exec_id);
        let finished = match finished {
            Err(WorkerError::Conn { .. }) if killed => {
                return Err(ExecError::KilledAfterInterrupt { grace: self.interrupts.grace() })
            }
            other => other?,
        };
        for name in &finished.faulted {
            if let Some(v) = manifest.variables.get(name) {
                w.held.insert(name.clone(), v.version);
            }
        }
        if !finished.faulted.is_empty() {
            tracing::info!(%session, %exec_id, cell = %recipe.cell_id, names = ?finished.faulted, "the closure missed names the cell read; brought them in");
        }
        let mut error = finished.error.as_ref().map(|e| format!("{}: {}", e.ename, e.evalue));
        if let (Some(e), Some(limit)) = (&mut error, w.pids_exceeded()) {
            e.push_str(&format!(" (the worker reached its limit of {limit} processes and threads)"));
        }
        if finished.timed_out {
            let timeout = self.limits.timeout.unwrap_or_default();
            error = Some(format!("{} (the cell ran past the cell timeout of {timeout:?})", error.unwrap_or_default()));
        }
        let status = if finished.status == "ok" { CellStatus::Ok } else { CellStatus::Error };
        self.event(
            session,
            exec_id,
            EventKind::Finished {
                status,
                error,
                execution_count: finished.execution_count,
                run_ms: finished.run_ms,
                outputs: finished.outputs,
                cuda_used: finished.cuda_used,
                faulted: finished.faulted.clone(),
            },
        )
        .await;

        let base_revision = manifest.revision;
        let worker_name = w.id.clone();
        let commit = |delta, uploaded| {
            let msg = CommitV2 {
                session,
                base_revision,
                exec_id,
                host: self.host_id.clone(),
                worker: worker_name.clone(),
                cell_id: recipe.cell_id.clone(),
                delta,
                uploaded,
            };
            // an unanswered commit may be lost (with a NATS node): ask again soon
            commit_until_known(self.bus.clone(), msg, schemas::bus::ATTEMPT_WAIT)
        };
        // what the session would hold after the save: the store refuses a plan over
        // its quota before anything is uploaded
        let origin = SaveOrigin { exec_id, host: &self.host_id, worker: &worker_name, cell_id: &recipe.cell_id };
        let bytes_after =
            |delta: Option<&Delta>| delta.and_then(|d| manifest.apply(d, &origin).ok()).map(|m| m.stored_bytes());
        let ask_missing = |hashes, delta: Option<Delta>| {
            let bus = self.bus.clone();
            let bytes_after = bytes_after(delta.as_ref());
            async move {
                bus.request_idempotent::<_, ChunkPlannedV1>(
                    bus.subjects().store(StoreVerb::ChunkPlan),
                    &ChunkPlanV2 { session, hashes, bytes_after },
                    STORE_TIMEOUT,
                )
                .await
                .map(|p| p.missing)
            }
        };
        // chunks the base revision references are stored; the store answers for the rest
        let stored = manifest.chunks();
        let saved =
            w.save(exec_id, &self.chunks, &stored, ask_missing, commit).instrument(tracing::info_span!("save")).await?;
        schemas::metrics::metrics().saved_bytes.inc_by(saved.saved_bytes);
        self.event(
            session,
            exec_id,
            EventKind::Saved {
                revision: saved.revision,
                save_ms: saved.save_ms,
                saved_bytes: saved.saved_bytes,
                chunks_written: saved.chunks_written,
                unsavable: saved.unsavable.clone(),
                slot_released: !slots.is_empty() && (saved.unsavable.is_empty() || !finished.cuda_used),
            },
        )
        .instrument(tracing::info_span!("saved", otel.name = "saved event"))
        .await;
        Ok(Left { unsavable: saved.unsavable, cuda_used: finished.cuda_used })
    }

    /// The answer to a worker's fault: those of `names` the committed state has, with
    /// the records (and payloads) the worker does not hold yet in a restore file.
    /// A name the session does not have is left out: the cell sees it undefined, as
    /// in a kernel.
    async fn fault_frame(
        &self,
        manifest: &Manifest,
        held_oids: &std::sync::Mutex<BTreeSet<String>>,
        files: &std::sync::Mutex<Vec<std::path::PathBuf>>,
        names: Vec<String>,
        worker: &str,
        owner: Option<u32>,
    ) -> Frame {
        let (variables, objects) = {
            let mut held = held_oids.lock().unwrap_or_else(|e| e.into_inner());
            restore_entries(manifest, names, &mut held)
        };
        // a file of its own (a cell may fault several times, and the files are
        // deleted when it ends), without the ambient state the worker has already
        let name = format!("{worker}-fault-{}", Uuid::new_v4().simple());
        match self.chunks.write_restore_file(manifest, &objects, &name, owner, false).await {
            Ok(file) => {
                if let Some(p) = &file.path {
                    files.lock().unwrap_or_else(|e| e.into_inner()).push(p.clone());
                }
                Frame::Faulted {
                    shm_path: file.path.map(|p| p.display().to_string()),
                    variables,
                    objects: file.objects,
                }
            }
            Err(e) => {
                // the cell goes on without them (NameError), and says why in the log
                tracing::warn!(worker, error = %e, "could not bring in names a cell reached");
                Frame::Faulted { shm_path: None, variables: BTreeMap::new(), objects: BTreeMap::new() }
            }
        }
    }

    /// Bring `w` to the session's committed state for `recipe`: drop names that are
    /// stale, restore the closure's missing or changed variables, import the import
    /// closure. Nothing of the cell runs. Used at Run and while preparing.
    async fn restore_closure(
        &self,
        recipe: &RecipeV3,
        w: &mut WorkerProc,
        env: BTreeMap<String, String>,
        read: Option<Manifest>,
    ) -> Result<(Manifest, Restored), ExecError> {
        let started = Instant::now();
        let manifest = match read {
            Some(m) => m,
            None => {
                let read = self.manifest(recipe.session, recipe.manifest_revision);
                read.instrument(tracing::info_span!("manifest", otel.name = "read manifest")).await?
            }
        };
        let got_manifest = started.elapsed();
        let restore = self.plan_restore(recipe, w, &manifest)?;
        let file = self
            .chunks
            .write_restore_file(&manifest, &restore.objects, &w.id, w.uid, true)
            .instrument(tracing::info_span!("restore_file", otel.name = "write restore file"))
            .await
            .map_err(ExecError::RestoreFile)?;
        let wrote_file = started.elapsed();
        let frame = Frame::Restore {
            shm_path: file.path.as_ref().map(|p| p.display().to_string()),
            variables: restore.variables.clone(),
            objects: file.objects.clone(),
            ambient: file.ambient,
            imports: recipe.imports.clone(),
            drop: restore.drop.clone(),
            env,
        };
        let worker_span = tracing::info_span!("worker_restore", otel.name = "worker restore");
        let restored = w.restore(frame).instrument(worker_span.clone()).await;
        if let Some(p) = &file.path {
            let _ = std::fs::remove_file(p);
        }
        let restored = restored?;
        let (bytes, worker_ms) = (restored.bytes, restored.ms);
        {
            // the worker imports, then loads; it reports how long each took
            let _entered = worker_span.enter();
            let end = std::time::SystemTime::now();
            let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1000.0);
            let began = end.checked_sub(ms(worker_ms)).unwrap_or(end);
            let imported = began + ms(restored.imports_ms.min(worker_ms));
            schemas::telemetry::timed_child("imports", began, imported);
            schemas::telemetry::timed_child("load", imported, end);
        }
        tracing::debug!(worker = %w.id, ?got_manifest, ?wrote_file, worker_ms, restored = ?started.elapsed(), bytes,
            "restore phases");
        let fatal: Vec<String> = restored
            .errors
            .iter()
            .filter(|(k, _)| !k.starts_with("import "))
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        if !fatal.is_empty() {
            return Err(ExecError::Restore(fatal));
        }
        for name in &restore.drop {
            w.held.remove(name);
        }
        for (name, var) in &restore.variables {
            if let Ok(v) = Uuid::parse_str(&var.version) {
                w.held.insert(name.clone(), v);
            }
        }
        w.revision = manifest.revision;
        let refreshed = (restore.variables.len() + restore.drop.len()) as u32;
        let timing = Restored {
            bytes,
            refreshed,
            manifest_ms: got_manifest.as_secs_f64() * 1000.0,
            file_ms: (wrote_file - got_manifest).as_secs_f64() * 1000.0,
            imports_ms: restored.imports_ms,
            load_ms: (worker_ms - restored.imports_ms).max(0.0),
        };
        Ok((manifest, timing))
    }

    /// Prepare a worker for an edit-derived recipe: fork one into `slots` (or take
    /// `existing`, updating it in place) and restore the closure. The cell does not
    /// run. On failure the worker (if any) is returned only if still usable.
    pub async fn prepare(
        &self,
        recipe: &RecipeV3,
        slots: &[u32],
        existing: Option<Arc<Mutex<WorkerProc>>>,
    ) -> Result<(Arc<Mutex<WorkerProc>>, f64), ExecError> {
        let started = Instant::now();
        let worker = match existing {
            Some(w) => w,
            None => {
                let (w, _hit) = self.fork(recipe.session, slots, &recipe.options.cwd, &recipe.imports).await?;
                Arc::new(Mutex::new(w))
            }
        };
        let mut w = worker.lock().await;
        let result = self.restore_closure(recipe, &mut w, self.device_env(slots), None).await;
        let broken = w.is_broken();
        if result.is_ok() {
            w.enter(WorkerState::Ready);
        }
        drop(w);
        match result {
            Ok(_) => Ok((worker, started.elapsed().as_secs_f64() * 1000.0)),
            Err(e) => {
                if broken {
                    worker.lock().await.kill_now();
                }
                Err(e)
            }
        }
    }

    /// Which names to drop (stale), which to restore, and which records to send.
    fn plan_restore(&self, recipe: &RecipeV3, w: &WorkerProc, manifest: &Manifest) -> Result<RestorePlan, ExecError> {
        let mut drop = Vec::new();
        let mut current: BTreeSet<&str> = BTreeSet::new();
        for (name, held) in &w.held {
            let up_to_date = match (manifest.variables.get(name), manifest.unsavable.get(name)) {
                (Some(v), _) => v.version == *held,
                (None, Some(u)) => u.worker == w.id,
                (None, None) => false,
            };
            if up_to_date {
                current.insert(name);
            } else {
                drop.push(name.clone());
            }
        }
        let mut wanted = Vec::new();
        for var in &recipe.closure {
            if current.contains(var.name.as_str()) {
                continue;
            }
            if let Some(u) = manifest.unsavable.get(&var.name) {
                return Err(ExecError::UnsavableGone {
                    name: var.name.clone(),
                    reason: u.reason.clone(),
                    worker: u.worker.clone(),
                    host: u.host.clone(),
                    cell_id: u.cell_id.clone(),
                });
            }
            wanted.push(var.name.clone());
        }
        // Records the worker already holds at their current version are not sent again.
        let mut held_oids = held_records(manifest, current.iter().copied());
        let (variables, objects) = restore_entries(manifest, wanted, &mut held_oids);
        Ok(RestorePlan { drop, variables, objects })
    }
}

/// The records reachable from the names a worker holds (at the manifest's versions).
fn held_records<'a>(manifest: &Manifest, names: impl Iterator<Item = &'a str>) -> BTreeSet<String> {
    manifest.reachable(names.filter_map(|n| manifest.variables.get(n).and_then(|v| v.oid.as_deref())))
}

/// What restoring `names` takes: each name the manifest has, at its version, and
/// the records reachable from them that are not in `held`. `held` grows by what is
/// sent, so a record shared by several names (or asked for again) goes once. A name
/// the manifest lacks is left out: the cell sees it undefined, as in a kernel.
fn restore_entries(
    manifest: &Manifest,
    names: Vec<String>,
    held: &mut BTreeSet<String>,
) -> (BTreeMap<String, VarRestore>, Vec<(String, String)>) {
    let mut variables = BTreeMap::new();
    let mut objects = Vec::new();
    for name in names {
        let Some(entry) = manifest.variables.get(&name) else { continue };
        if let Some(oid) = &entry.oid {
            for o in manifest.reachable([oid.as_str()]) {
                if held.insert(o.clone()) {
                    objects.push((o, name.clone()));
                }
            }
        }
        variables.insert(
            name,
            VarRestore { oid: entry.oid.clone(), version: entry.version.to_string(), module: entry.module.clone() },
        );
    }
    (variables, objects)
}

/// How many outputs and events a cell's forwarder keeps waiting for their stream.
const KEPT_WINDOW: usize = 64;

/// Wait until the stream keeps a message the forwarder sent.
async fn confirm_kept(bus: &Bus, sent: Result<schemas::bus::Kept, BusError>) {
    let kept = match sent {
        Ok(k) => k.confirmed(bus, schemas::bus::KEPT_PATIENCE).await,
        Err(e) => Err(e),
    };
    if let Err(e) = kept {
        tracing::error!(error = %e, "could not forward a cell event");
    }
}

enum Pending {
    Event(SessionEventV2),
    Output(OutputV1),
}

/// How a cell's start went so far, for its `Started` event.
struct Start {
    /// The GPU slots.
    slots: Vec<u32>,
    /// How the worker was prepared.
    prepare: Prepare,
    /// When this host won the claim.
    claimed_at: Instant,
    /// The worker's zygote had imported the whole import closure.
    import_hit: bool,
    /// The phases measured before the worker was ready.
    phases: StartPhases,
    /// The session's manifest, if it was read while the worker forked.
    manifest: Option<Manifest>,
}

/// What a restore did, and how long each part took (ms).
/// A start's phases and restored bytes, in the metrics.
fn record_start(phases: &StartPhases, restored_bytes: u64) {
    let m = schemas::metrics::metrics();
    let StartPhases { claim_ms, fork_ms, manifest_ms, restore_file_ms, imports_ms, load_ms, setup_ms } = *phases;
    for (phase, ms) in [
        ("claim", claim_ms),
        ("fork", fork_ms),
        ("manifest", manifest_ms),
        ("restore_file", restore_file_ms),
        ("imports", imports_ms),
        ("load", load_ms),
        ("setup", setup_ms),
    ] {
        schemas::metrics::observe_ms(&m.start_phase.get_or_create(&[("phase", phase)]), ms);
    }
    m.restored_bytes.inc_by(restored_bytes);
}

struct Restored {
    bytes: u64,
    /// Names restored or dropped (for a prepared worker at Run: the refresh).
    refreshed: u32,
    manifest_ms: f64,
    file_ms: f64,
    imports_ms: f64,
    load_ms: f64,
}

struct RestorePlan {
    drop: Vec<String>,
    variables: BTreeMap<String, VarRestore>,
    objects: Vec<(String, String)>,
}

/// How long a commit whose answer never came is sent again before the save is
/// given up (the store's answer is what the run's outcome says).
const COMMIT_PATIENCE: Duration = Duration::from_secs(600);

/// How soon a commit without an answer is sent again.
const COMMIT_RETRY: Duration = Duration::from_secs(2);

/// How soon a commit nothing served is sent again (a store restarting in place).
const ABSENT_RETRY: Duration = Duration::from_millis(250);

/// Commit `msg` and learn for sure whether it landed: a commit without an answer
/// (store restarting, object store stalled) may land later, so reporting it failed
/// would tell the user something other than what was committed. It is sent again
/// (a create-only put of revision base + 1: at most one copy lands) until an answer
/// comes; a conflict then means a copy landed if the session's latest revision is
/// this execution's.
async fn commit_until_known(
    bus: Bus,
    msg: CommitV2,
    answer_within: Duration,
) -> Result<(u64, Vec<(String, Uuid)>), BusError> {
    let subject = bus.subjects().store(StoreVerb::Commit);
    let started = tokio::time::Instant::now();
    let deadline = started + COMMIT_PATIENCE;
    let mut unanswered = false;
    loop {
        match bus.request::<_, CommittedV1>(subject.clone(), &msg, answer_within).await {
            Ok(c) => return Ok((c.revision, c.versions)),
            Err(BusError::Remote { code: ErrorCode::Conflict, .. }) if unanswered => {
                return landed_copy(&bus, &msg, STORE_TIMEOUT).await;
            }
            // no copy reached a store yet: nothing landed, and a store that stays
            // down fails the save within seconds
            Err(e @ BusError::NoResponders { .. }) if !unanswered => {
                if tokio::time::Instant::now() >= started + schemas::bus::ABSENT_PATIENCE {
                    return Err(e);
                }
                tokio::time::sleep(ABSENT_RETRY).await;
            }
            // a copy may have landed: only the store can say
            Err(e @ (BusError::TimedOut { .. } | BusError::NoResponders { .. }))
                if tokio::time::Instant::now() < deadline =>
            {
                tracing::warn!(exec = %msg.exec_id, error = %e, "a commit got no answer; sending it again");
                unanswered = true;
                tokio::time::sleep(COMMIT_RETRY).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// After a commit that got no answer and a copy of it that conflicted: the
/// commit's result if the session's latest revision is its execution's, else the
/// conflict.
async fn landed_copy(
    bus: &Bus,
    msg: &CommitV2,
    answer_within: Duration,
) -> Result<(u64, Vec<(String, Uuid)>), BusError> {
    let get = ManifestGetV2 { session: msg.session, at_least: None };
    let subject = bus.subjects().store(StoreVerb::ManifestGet);
    let m = bus.request_idempotent::<_, ManifestV1>(subject, &get, answer_within).await?;
    let m = m.manifest;
    if m.exec_id != msg.exec_id {
        return Err(BusError::Remote {
            subject: bus.subjects().store(StoreVerb::Commit),
            code: ErrorCode::Conflict,
            message: format!("revision {} was committed by another execution", m.revision),
        });
    }
    let names = msg.delta.variables.keys().chain(msg.delta.unsavable.keys());
    let versions = names
        .filter_map(|n| {
            let v = m.variables.get(n).map(|v| v.version).or_else(|| m.unsavable.get(n).map(|u| u.version));
            v.map(|v| (n.clone(), v))
        })
        .collect();
    Ok((m.revision, versions))
}

#[cfg(test)]
mod commit_tests {
    use super::*;
    use looseleaf_test_support::{random_prefix, NatsServer};
    use schemas::checkpoint::{Delta, DeltaVar, VarEntry};
    use schemas::messages::Reply;

    /// The store commits the first copy but its answer is lost (it stalled past the
    /// deadline); the second copy conflicts: the save is the first copy's, not a
    /// failure (which would tell the user nothing was committed).
    #[actix_rt::test]
    async fn a_commit_whose_answer_was_lost_is_found_committed() -> anyhow::Result<()> {
        let nats = NatsServer::start()?;
        let prefix = random_prefix();
        let store = Bus::connect(nats.url(), &prefix, "fake-store").await?;
        let host = Bus::connect(nats.url(), &prefix, "host").await?;
        let (session, exec) = (Uuid::now_v7(), Uuid::now_v7());
        let mut commits = store.subscribe::<CommitV2>(store.subjects().store(StoreVerb::Commit)).await?;
        let mut gets = store.subscribe::<ManifestGetV2>(store.subjects().store(StoreVerb::ManifestGet)).await?;
        store.flush().await?;
        let fake = async move {
            // the first copy: committed, answer never sent
            let _first = commits.next().await;
            let second = commits.next().await.and_then(Result::ok);
            let conflict: Reply<CommittedV1> =
                Reply::Err { code: ErrorCode::Conflict, message: "revision 1 exists".into() };
            store.respond(second.and_then(|e| e.reply), &conflict).await.ok();
            let get = gets.next().await.and_then(Result::ok);
            let mut manifest = Manifest::empty(session);
            (manifest.revision, manifest.exec_id) = (1, exec);
            manifest.variables.insert(
                "x".into(),
                VarEntry { version: exec, oid: Some("o".into()), module: None, global_reads: vec![] },
            );
            store.respond(get.and_then(|e| e.reply), &Reply::Ok(ManifestV1 { manifest })).await.ok();
            store.flush().await.ok(); // the fake ends here: what it sent must leave first
        };
        actix_rt::spawn(fake);
        let mut delta = Delta::default();
        delta.variables.insert("x".into(), DeltaVar { oid: Some("o".into()), module: None, global_reads: vec![] });
        let msg = CommitV2 {
            session,
            base_revision: 0,
            exec_id: exec,
            host: "h".into(),
            worker: "w".into(),
            cell_id: "c".into(),
            delta,
            uploaded: vec![],
        };
        let (revision, versions) = commit_until_known(host, msg, Duration::from_millis(300)).await?;
        assert_eq!(revision, 1);
        assert_eq!(versions, vec![("x".to_string(), exec)]);
        Ok(())
    }
}
