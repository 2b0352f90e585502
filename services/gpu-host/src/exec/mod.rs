//! One cell execution on a host, from claim to save (DESIGN.md section 4, steps
//! 3-5): get a worker (fork, or the session's persistent/pinned one), bring it to
//! the committed state, restore the closure, run, save, and report each step as a
//! session event.
//!
//! One file per concern: this one holds what every execution shares ([`ExecEnv`]),
//! which worker runs a cell ([`Target`]), how an execution ended ([`Outcome`]) and
//! the run's admission (`execute`, `run_on`); `error.rs` why one failed
//! ([`ExecError`]); `fork.rs` getting a fresh worker from the zygotes; `restore.rs`
//! bringing a worker to the closure (restore entries and files, fault frames,
//! preparing); `run.rs` the `drive` step (restore, run with outputs forwarded,
//! `Finished`); `save.rs` the save and its commit.

mod error;
mod fork;
mod restore;
mod run;
mod save;

pub use error::ExecError;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use schemas::checkpoint::Manifest;
use schemas::messages::{Device, EventKind, ManifestGetV2, ManifestV2, Prepare, RecipeV3, SessionEventV2, StartPhases};
use schemas::subjects::StoreVerb;
use schemas::{unix_ms, Bus};
use tokio::sync::Mutex;
use tracing::Instrument as _;
use uuid::Uuid;

use crate::chunks::Chunks;
use crate::import_cache::ImportCache;
use crate::socket::Listener;
use crate::worker::{RunLimits, WorkerProc};

/// How long store requests may take.
const STORE_TIMEOUT: Duration = Duration::from_secs(30);

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
            .request_idempotent::<_, ManifestV2>(subject, &get, STORE_TIMEOUT)
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

    /// The devices a worker on `slots` may see (none for CPU work): real slots
    /// through CUDA, virtual ones through the stand-in device's variable (ADR 72).
    /// Both are always set, so a worker that moves between kinds forgets the other.
    fn device_env(&self, slots: &[u32]) -> BTreeMap<String, String> {
        device_env(self.real_gpus, slots)
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
        tracing::Span::current().record("looseleaf.prepare", prepare.as_str());
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
}

/// The variables naming a worker's devices on `slots` (see `Exec::device_env`).
fn device_env(real_gpus: bool, slots: &[u32]) -> BTreeMap<String, String> {
    let devices = slots.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let (cuda, virtual_gpus) = if real_gpus { (devices, String::new()) } else { (String::new(), devices) };
    BTreeMap::from([
        ("CUDA_VISIBLE_DEVICES".to_string(), cuda),
        ("LOOSELEAF_VIRTUAL_DEVICES".to_string(), virtual_gpus),
    ])
}

#[cfg(test)]
mod tests {
    use super::device_env;

    #[test]
    fn real_slots_are_cuda_devices_and_virtual_ones_the_stand_in_devices() {
        let real = device_env(true, &[1, 3]);
        assert_eq!((real["CUDA_VISIBLE_DEVICES"].as_str(), real["LOOSELEAF_VIRTUAL_DEVICES"].as_str()), ("1,3", ""));
        let virtual_slots = device_env(false, &[0]);
        assert_eq!(
            (virtual_slots["CUDA_VISIBLE_DEVICES"].as_str(), virtual_slots["LOOSELEAF_VIRTUAL_DEVICES"].as_str()),
            ("", "0")
        );
        let cpu = device_env(false, &[]);
        assert!(cpu.values().all(String::is_empty), "CPU work sees no device");
    }
}
