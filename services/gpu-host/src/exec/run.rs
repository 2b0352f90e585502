//! Running the cell: the `drive` step that takes a worker from the restore through
//! the run, with its outputs and events forwarded to its clients as they come, to
//! the `Finished` event and the save.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use schemas::checkpoint::Manifest;
use schemas::messages::{
    CellMessage, CellStatus, EventKind, OutputV2, Prepare, RecipeV3, SessionEventV2, StartPhases, OUTPUT_PART_BYTES,
};
use schemas::{Bus, BusError};
use tracing::Instrument as _;

use super::restore::held_records;
use super::{ExecEnv, ExecError, Left, Start};
use crate::protocol::Frame;
use crate::worker::{CellToRun, Finished, RunEvent, WorkerError, WorkerProc};

impl ExecEnv {
    /// One run on `w`, in its steps: restore the closure, run the cell with its
    /// outputs forwarded, send its `Finished` event, save.
    pub(super) async fn drive(&self, recipe: &RecipeV3, w: &mut WorkerProc, start: Start) -> Result<Left, ExecError> {
        let Start { slots, prepare, claimed_at, import_hit, mut phases, manifest } = start;
        // a host that began stopping while this worker forked starts nothing new
        self.not_stopping()?;
        let restore_started = Instant::now();
        let (manifest, restored) = self.restore_for_run(recipe, w, &slots, prepare, manifest).await?;
        let restored_at = Instant::now();
        phases.manifest_ms += restored.manifest_ms;
        phases.restore_file_ms = restored.file_ms;
        phases.imports_ms = restored.imports_ms;
        phases.load_ms = restored.load_ms;
        let starting = Starting {
            slot: slots.first().copied(),
            prepare,
            import_hit,
            phases,
            restored_at,
            restored_bytes: restored.bytes,
            refreshed: restored.refreshed,
            prepare_ms: claimed_at.elapsed().as_secs_f64() * 1000.0,
            restore_ms: restore_started.elapsed().as_secs_f64() * 1000.0,
        };
        let (finished, forwarder) = self.run_forwarded(recipe, w, &manifest, starting).await?;
        let finished_kind = self.finished_kind(recipe, w, &manifest, &finished);
        // The save starts while the stream confirms the last outputs and the
        // Finished event; its commit waits for both, so that a run's Finished is
        // kept before its state is committed (a frontend that reads back a lost
        // host's run finds how the cell ended beside what it saved).
        let (told_tx, told) = tokio::sync::watch::channel(false);
        let tell = async {
            forwarded(forwarder).await;
            self.event(recipe.session, recipe.exec_id, finished_kind).await;
            let _ = told_tx.send(true);
        };
        let (saved, ()) = tokio::join!(self.save(recipe, w, &manifest, &slots, finished.cuda_used, told), tell);
        saved
    }

    /// Run the cell on `w` (restored to `manifest`), forwarding its outputs and its
    /// `Started` event to its clients as they come, bringing in the names it reaches
    /// that its closure missed, and asking its client for its `input()`.
    async fn run_forwarded(
        &self,
        recipe: &RecipeV3,
        w: &mut WorkerProc,
        manifest: &Manifest,
        starting: Starting,
    ) -> Result<(Finished, tokio::task::JoinHandle<()>), ExecError> {
        let Starting {
            slot,
            prepare,
            import_hit,
            phases,
            restored_at,
            restored_bytes,
            refreshed,
            prepare_ms,
            restore_ms,
        } = starting;
        let (session, exec_id) = (recipe.session, recipe.exec_id);
        // Outputs stream to clients while the cell runs, in order, through one
        // forwarding task.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Pending>();
        let forwarder = spawn_forwarder(self.bus.clone(), rx);
        // outputs are numbered in order, whether the cell printed them or asked for input
        let seq = AtomicU64::new(0);
        let host = self.host_id.clone();
        let worker_id = w.id.clone();
        let device = recipe.device;
        // A name the closure missed comes from the same committed state the closure
        // was restored from (DESIGN section 6's safety net); records the worker
        // holds are not sent again.
        let held_oids = std::sync::Mutex::new(held_records(manifest, w.held.keys().map(String::as_str)));
        let fault_files = std::sync::Mutex::new(Vec::new());
        let owner = w.uid;
        let on_fault =
            |names: Vec<String>| self.fault_frame(manifest, &held_oids, &fault_files, names, &worker_id, owner);
        // nor runs a cell whose restore it was still waiting for, or that the user
        // interrupted meanwhile
        self.not_stopping()?;
        self.not_interrupted(exec_id)?;
        let (interrupts, pid) = (self.interrupts.clone(), w.pid);
        // a cell's input(): the wait is registered before its client is asked
        let on_input = |prompt: String, password: bool| {
            let wait = self.inputs.expect(exec_id);
            let seq = seq.fetch_add(1, Ordering::SeqCst) + 1;
            let message = CellMessage::InputRequest { prompt, password };
            let asked = tx.send(Pending::Message { session, exec_id, seq, message });
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
                                    slot,
                                    worker: worker_id.clone(),
                                    device,
                                    prepare,
                                    execution_count,
                                    restored_bytes,
                                    prepare_ms,
                                    restore_ms,
                                    refreshed,
                                    import_hit,
                                    python,
                                    phases,
                                },
                            })
                        }
                        RunEvent::Message(message) => {
                            Pending::Message { session, exec_id, seq: seq.fetch_add(1, Ordering::SeqCst) + 1, message }
                        }
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
        let killed = self.interrupts.ended(exec_id);
        match finished {
            // the caller waits for the last outputs to be kept (its save meanwhile)
            Ok(finished) => Ok((finished, forwarder)),
            Err(e) => {
                forwarded(forwarder).await;
                match e {
                    WorkerError::Conn { .. } if killed => {
                        Err(ExecError::KilledAfterInterrupt { grace: self.interrupts.grace() })
                    }
                    other => Err(ExecError::from(other)),
                }
            }
        }
    }

    /// Take the names the cell brought in while it ran as held by `w`, and say how
    /// the cell ended (its `Finished` event).
    fn finished_kind(
        &self,
        recipe: &RecipeV3,
        w: &mut WorkerProc,
        manifest: &Manifest,
        finished: &Finished,
    ) -> EventKind {
        let (session, exec_id) = (recipe.session, recipe.exec_id);
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
        EventKind::Finished {
            status,
            error,
            execution_count: finished.execution_count,
            run_ms: finished.run_ms,
            outputs: finished.outputs,
            cuda_used: finished.cuda_used,
            faulted: finished.faulted.clone(),
        }
    }
}

/// Wait for a cell's forwarder: every output and event it was given is kept.
async fn forwarded(forwarder: tokio::task::JoinHandle<()>) {
    if let Err(e) = forwarder.await {
        tracing::error!(error = %e, "output forwarder failed");
    }
}

/// How many outputs and events a cell's forwarder keeps waiting for their stream.
const KEPT_WINDOW: usize = 64;

/// Start the task that forwards a running cell's outputs and events (sent on `rx`)
/// in order; it ends when every sender is dropped and all it sent is kept.
fn spawn_forwarder(bus: Bus, mut rx: tokio::sync::mpsc::UnboundedReceiver<Pending>) -> tokio::task::JoinHandle<()> {
    // outputs and events carry the cell's trace
    tokio::spawn(
        async move {
            // several wait for their stream at once, so that the round trips overlap
            let mut unconfirmed = std::collections::VecDeque::new();
            while let Some(p) = rx.recv().await {
                match p {
                    Pending::Event(ev) => {
                        unconfirmed.push_back(bus.send_kept(bus.subjects().event(ev.session), &ev).await)
                    }
                    Pending::Message { session, exec_id, seq, message } => {
                        let subject = bus.subjects().output(session, exec_id);
                        for piece in OutputV2::pieces(session, exec_id, seq, message, OUTPUT_PART_BYTES) {
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
    )
}

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
    Message { session: uuid::Uuid, exec_id: uuid::Uuid, seq: u64, message: CellMessage },
}

/// What a cell's `Started` event says that is known before the cell starts.
struct Starting {
    /// The cell's first GPU slot (events name that one).
    slot: Option<u32>,
    /// How the worker was prepared.
    prepare: Prepare,
    /// The worker's zygote had imported the whole import closure.
    import_hit: bool,
    /// The phases measured before the worker was ready (`setup_ms` is measured at
    /// the start).
    phases: StartPhases,
    /// When the restore ended.
    restored_at: Instant,
    /// Bytes the restore read.
    restored_bytes: u64,
    /// Names restored or dropped.
    refreshed: u32,
    /// From the claim to the end of the restore (ms).
    prepare_ms: f64,
    /// The restore (ms).
    restore_ms: f64,
}

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
