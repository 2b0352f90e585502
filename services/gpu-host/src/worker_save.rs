//! The save protocol with a worker: the worker plans its save, the host asks the
//! store what it lacks, uploads the worker's save files as they arrive, commits
//! and tells the worker the versions; and the removal of the save files a worker
//! leaves behind.

use std::collections::BTreeMap;
use std::path::PathBuf;

use schemas::checkpoint::Delta;
use schemas::messages::WorkerState;
use uuid::Uuid;

use crate::chunks::{ChunkError, Chunks};
use crate::protocol::{Frame, Region};
use crate::worker::{WorkerError, WorkerProc, STEP};

/// A save that writes at most this much (most cells': the ambient state and a
/// few small variables) uploads every chunk its session's revision does not
/// reference, without asking the store which it lacks: that round trip was a
/// fifth of a quick cell's time.
pub const UNASKED_SAVE_BYTES: u64 = 256 << 10;

/// What a save did.
#[derive(Debug)]
pub struct Saved {
    /// New revision.
    pub revision: u64,
    /// Worker + upload time.
    pub save_ms: f64,
    /// Bytes uploaded.
    pub saved_bytes: u64,
    /// Chunks uploaded.
    pub chunks_written: u64,
    /// Names the worker could not save (it keeps them).
    pub unsavable: Vec<String>,
}

impl WorkerProc {
    /// Save: plan, upload what the store lacks, commit through `commit`, tell the
    /// worker the versions. `ask_missing` gets the hashes this host does not know to
    /// be stored and returns those the store lacks (the gateway's chunk plan);
    /// `commit` gets the delta and the chunks uploaded for it, and returns
    /// (revision, versions).
    pub async fn save<P, PFut, F, Fut>(
        &mut self,
        exec_id: Uuid,
        chunks: &Chunks,
        stored: &std::collections::BTreeSet<String>,
        ask_missing: P,
        commit: F,
    ) -> Result<Saved, WorkerError>
    where
        P: FnOnce(Vec<String>, Option<Delta>) -> PFut,
        PFut: std::future::Future<Output = Result<Vec<String>, schemas::BusError>>,
        F: FnOnce(Delta, Vec<String>) -> Fut,
        Fut: std::future::Future<Output = Result<(u64, Vec<(String, Uuid)>), schemas::BusError>>,
    {
        let started = std::time::Instant::now();
        let exec = exec_id.to_string();
        self.enter(WorkerState::Saving);
        self.send("saving", &Frame::Save { exec_id: exec.clone() }).await?;
        let (plan, planned_delta) = match self.recv("saving", STEP).await? {
            Frame::SavePlan { chunks, delta, .. } => (chunks, delta),
            other => return Err(self.unexpected("saving", other)),
        };
        let planned = started.elapsed();
        let unknown = Chunks::unknown(&plan, stored);
        let small = planned_delta.as_ref().is_some_and(|d| d.written_bytes() <= UNASKED_SAVE_BYTES);
        let missing = if unknown.is_empty() {
            Vec::new()
        } else if small {
            // uploading a few KiB again costs less than asking: the commit still
            // checks the quota, and the store admits a save this small while the
            // volume has room for it (ADR 54)
            unknown
        } else {
            match ask_missing(unknown.clone(), planned_delta).await {
                Ok(m) => m,
                Err(e) => {
                    // the worker waits mid-save for an answer it will not get
                    self.broken = true;
                    return Err(WorkerError::Plan(e));
                }
            }
        };
        let checked = started.elapsed();
        self.send("saving", &Frame::SaveMissing { exec_id: exec.clone(), missing }).await?;
        // Upload each save file as it arrives, while the worker writes the next.
        let mut parts: Vec<(PathBuf, tokio::task::JoinHandle<Result<u64, ChunkError>>)> = Vec::new();
        let mut uploaded: Vec<String> = Vec::new();
        let mut upload_part = |path: PathBuf, regions: BTreeMap<String, Region>| {
            uploaded.extend(regions.keys().cloned());
            let chunks = chunks.clone();
            let file = path.clone();
            parts.push((path, tokio::spawn(async move { chunks.upload(&file, &regions).await })));
        };
        let received = loop {
            match self.recv("saving", STEP).await {
                Ok(Frame::SavePart { shm_path, chunks, .. }) => upload_part(PathBuf::from(shm_path), chunks),
                Ok(Frame::SaveReady { shm_path, chunks, delta, .. }) => {
                    if let Some(p) = shm_path {
                        upload_part(PathBuf::from(p), chunks);
                    }
                    break Ok(delta);
                }
                Ok(other) => break Err(self.unexpected("saving", other)),
                Err(e) => break Err(e),
            }
        };
        let mut upload: Result<u64, ChunkError> = Ok(0);
        for (path, task) in parts {
            let done = task.await.unwrap_or_else(|e| {
                Err(ChunkError::Shm { path: path.display().to_string(), source: std::io::Error::other(e) })
            });
            let _ = std::fs::remove_file(&path); // upload unlinks it, unless it failed first
            upload = match (upload, done) {
                (Ok(total), Ok(n)) => Ok(total + n),
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
        }
        let delta = received?;
        let saved_bytes = match upload {
            Ok(n) => n,
            Err(e) => {
                // what the worker holds is no revision now (a CPU worker must not
                // carry uncommitted variables into the session's next cell)
                self.broken = true;
                let _ = self
                    .send(
                        "saving",
                        &Frame::Committed {
                            exec_id: exec,
                            ok: false,
                            revision: 0,
                            versions: BTreeMap::new(),
                            error: Some(e.to_string()),
                        },
                    )
                    .await;
                return Err(e.into());
            }
        };
        let unsavable: Vec<String> = delta.unsavable.keys().cloned().collect();
        let chunks_written = uploaded.len() as u64;
        let upload_done = started.elapsed();
        let result = commit(delta, uploaded).await;
        tracing::debug!(worker = %self.id, ?planned, ?checked, uploaded = ?upload_done, committed = ?started.elapsed(), chunks = chunks_written, "save phases");
        match result {
            Ok((revision, versions)) => {
                let frame = Frame::Committed {
                    exec_id: exec,
                    ok: true,
                    revision,
                    versions: versions.iter().map(|(n, v)| (n.clone(), v.to_string())).collect(),
                    error: None,
                };
                // the revision landed: the run saved, whatever becomes of the worker.
                // One that cannot hear it is lost (its state would be no revision
                // it knows) and killed by the caller, but the save stands.
                if let Err(e) = self.send("saving", &frame).await {
                    tracing::warn!(worker = %self.id, error = %e, revision, "the save landed but the worker was lost before it heard");
                }
                self.held = versions.into_iter().collect();
                self.revision = revision;
                Ok(Saved {
                    revision,
                    save_ms: started.elapsed().as_secs_f64() * 1000.0,
                    saved_bytes,
                    chunks_written,
                    unsavable,
                })
            }
            Err(e) => {
                let frame = Frame::Committed {
                    exec_id: exec,
                    ok: false,
                    revision: 0,
                    versions: BTreeMap::new(),
                    error: Some(e.to_string()),
                };
                let _ = self.send("saving", &frame).await;
                // the worker's state no longer matches any revision
                self.broken = true;
                Err(WorkerError::Commit(e))
            }
        }
    }
}

/// Where workers write save files (`looseleaf-save-{worker}-{pid}-{n}`).
const SAVE_DIR: &str = "/dev/shm";

pub(crate) fn remove_save_files(worker: &str) {
    let prefix = format!("looseleaf-save-{worker}-");
    let Ok(entries) = std::fs::read_dir(SAVE_DIR) else { return };
    for e in entries.flatten() {
        if e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
