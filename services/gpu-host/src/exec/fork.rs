//! Getting a fresh worker: forking one from the deepest zygote that fits the import
//! closure, inside its session's uid and limits, and growing the zygote tree.

use std::sync::atomic::Ordering;

use uuid::Uuid;

use super::{ExecEnv, ExecError};
use crate::import_cache::ImportCache;
use crate::worker::WorkerProc;
use crate::zygotes::{Zygote, ZygoteError};

impl ExecEnv {
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
}
