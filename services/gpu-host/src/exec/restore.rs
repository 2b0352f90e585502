//! Bringing a worker to the session's committed state: restore the closure's
//! entries and restore files (at Run and while preparing), and bring in names a
//! running cell reached that its closure missed (fault frames).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use schemas::checkpoint::Manifest;
use schemas::messages::{Prepare, RecipeV3, WorkerState};
use tokio::sync::Mutex;
use tracing::Instrument as _;
use uuid::Uuid;

use super::{ExecEnv, ExecError};
use crate::protocol::{Frame, VarRestore};
use crate::worker::WorkerProc;

impl ExecEnv {
    /// Bring `w` to the closure for a run, with the devices of `slots` where the
    /// worker was not started on them.
    pub(super) async fn restore_for_run(
        &self,
        recipe: &RecipeV3,
        w: &mut WorkerProc,
        slots: &[u32],
        prepare: Prepare,
        manifest: Option<Manifest>,
    ) -> Result<(Manifest, Restored), ExecError> {
        // a worker prepared before Run may have been prepared without its slots,
        // and a kept worker that never used CUDA is lent its slots for this run
        let lent = matches!(prepare, Prepare::Pinned | Prepare::Persistent) && !slots.is_empty();
        let env = if matches!(prepare, Prepare::Speculative | Prepare::Warm) || lent {
            self.device_env(slots)
        } else {
            BTreeMap::new()
        };
        self.restore_closure(recipe, w, env, manifest).instrument(tracing::info_span!("restore")).await
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
        if restore.is_empty() && env.is_empty() && w.is_at(manifest.revision, &recipe.imports) {
            // the session's persistent worker between its cells: nothing to bring
            // in, and its ambient state is the revision's already (ADR 69). It was
            // brought up to date all the same (a kept worker's next cell follows
            // Preparing: Kept -> Running is no transition)
            w.enter(WorkerState::Preparing);
            let manifest_ms = got_manifest.as_secs_f64() * 1000.0;
            let unchanged =
                Restored { bytes: 0, refreshed: 0, manifest_ms, file_ms: 0.0, imports_ms: 0.0, load_ms: 0.0 };
            return Ok((manifest, unchanged));
        }
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
        if let Some(p) = file.path.clone() {
            // freeing a gigabyte of shared memory takes a while: not on the host's
            // thread; awaited, as the worker's next restore file takes its name
            let _ = crate::chunks::off_thread(move || std::fs::remove_file(p)).await;
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
            // the copy of staged tensors to the devices ends the restore
            let loaded = end.checked_sub(ms(restored.stage_in_ms)).unwrap_or(end).max(imported);
            schemas::telemetry::timed_child("load", imported, loaded);
            if restored.staged_in_bytes > 0 {
                schemas::telemetry::timed_child("stage_in", loaded, end);
                tracing::info!(worker = %w.id, bytes = restored.staged_in_bytes, ms = restored.stage_in_ms,
                    "staged GPU state copied to the slot");
            }
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
        let failed_import = |m: &String| restored.errors.contains_key(&format!("import {m}"));
        w.imported.extend(recipe.imports.iter().filter(|m| !failed_import(m)).cloned());
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

    /// The answer to a worker's fault: those of `names` the committed state has, with
    /// the records (and payloads) the worker does not hold yet in a restore file.
    /// A name the session does not have is left out: the cell sees it undefined, as
    /// in a kernel.
    pub(super) async fn fault_frame(
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
}

/// The records reachable from the names a worker holds (at the manifest's versions).
pub(super) fn held_records<'a>(manifest: &Manifest, names: impl Iterator<Item = &'a str>) -> BTreeSet<String> {
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

/// What a restore did, and how long each part took (ms).
pub(super) struct Restored {
    pub(super) bytes: u64,
    /// Names restored or dropped (for a prepared worker at Run: the refresh).
    pub(super) refreshed: u32,
    pub(super) manifest_ms: f64,
    pub(super) file_ms: f64,
    pub(super) imports_ms: f64,
    pub(super) load_ms: f64,
}

struct RestorePlan {
    drop: Vec<String>,
    variables: BTreeMap<String, VarRestore>,
    objects: Vec<(String, String)>,
}

impl RestorePlan {
    /// Nothing to drop or bring in.
    fn is_empty(&self) -> bool {
        self.drop.is_empty() && self.variables.is_empty() && self.objects.is_empty()
    }
}
