//! The planner actor: for every run, derive the recipe against the session's
//! committed manifest and publish it to all hosts; for every edit, publish a
//! speculative recipe when it changed. Each message is handled in its own future;
//! a session's runs arrive one at a time (the frontend's run queue).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use async_nats::jetstream::kv;
use schemas::bus::Rejected;
use schemas::checkpoint::Manifest;
use schemas::messages::{
    EditV1, EventKind, ManifestGetV1, ManifestV1, RecipeKind, RecipeV1, RunV1, SessionCloseV1, SessionEventV1,
    SessionOptions,
};
use schemas::subjects::StoreVerb;
use schemas::{unix_ms, Bus, Envelope};
use tracing::Instrument;
use uuid::Uuid;

use crate::analysis;
use crate::recipe::{derive, Derived};
use crate::state;

/// The planner actor.
pub struct Planner {
    bus: Bus,
    kv: kv::Store,
    /// Latest manifest and planner state seen per session, for edits (runs always
    /// fetch both).
    manifests: HashMap<Uuid, (Arc<Manifest>, Arc<state::SessionState>)>,
    /// Per (session, cell): recipe revision and fingerprint of the last speculative recipe.
    speculative: HashMap<(Uuid, String), (u64, u64)>,
}

impl Planner {
    /// A planner on `bus`, with session state in `kv`.
    pub fn new(bus: Bus, kv: kv::Store) -> Self {
        Self { bus, kv, manifests: HashMap::new(), speculative: HashMap::new() }
    }
}

impl Actor for Planner {
    type Context = Context<Self>;
}

fn code_hash(code: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    code.hash(&mut h);
    h.finish()
}

async fn fetch_manifest(bus: &Bus, session: Uuid) -> Result<Manifest, String> {
    bus.request::<_, ManifestV1>(bus.subjects().store(StoreVerb::ManifestGet), &ManifestGetV1 { session }, Duration::from_secs(30))
        .await
        .map(|m| m.manifest)
        .map_err(|e| format!("planner could not read the session's state: {e}"))
}

/// What a recipe is for: the cell, the execution (nil while editing) and the code.
struct For {
    session: Uuid,
    cell_id: String,
    kind: RecipeKind,
    exec_id: Uuid,
    code: String,
    run_unix_ms: u64,
    options: SessionOptions,
}

fn recipe(f: For, revision: u64, manifest_revision: u64, d: &Derived) -> RecipeV1 {
    RecipeV1 {
        session: f.session,
        cell_id: f.cell_id,
        kind: f.kind,
        exec_id: f.exec_id,
        revision,
        code_hash: code_hash(&f.code),
        code: f.code,
        closure: d.closure.clone(),
        imports: d.imports.clone(),
        device: d.device,
        device_reason: d.device_reason.clone(),
        conservative: d.conservative.clone(),
        pinned: d.pinned.clone(),
        manifest_revision,
        run_unix_ms: f.run_unix_ms,
        options: f.options,
    }
}

async fn plan_run(bus: Bus, kv: kv::Store, run: RunV1) -> Result<(Manifest, state::SessionState), String> {
    let analysis = analysis::analyze(&run.code);
    let manifest = fetch_manifest(&bus, run.session).await?;
    if manifest.revision < run.after_revision {
        tracing::warn!(session = %run.session, have = manifest.revision, want = run.after_revision, "manifest older than the run expects");
    }
    let cell_id = run.cell_id.clone();
    let (d, revision, st) = state::modify(&kv, run.session, |st| {
        let d = derive(&analysis, &run.code, &manifest, st, run.options.all_gpu, run.exec_id, &cell_id);
        let revision = st.recipes.get(&cell_id).map(|r| r.0 + 1).unwrap_or(1);
        st.recipes.insert(cell_id.clone(), (revision, d.fingerprint()));
        st.names.extend(d.writes.clone());
        st.running.insert(run.exec_id, cell_id.clone());
        for name in &analysis.deletes {
            st.names.remove(name);
        }
        (d, revision, st.clone())
    })
    .await
    .map_err(|e| e.to_string())?;

    let planned = SessionEventV1 {
        session: run.session,
        exec_id: run.exec_id,
        unix_ms: unix_ms(),
        kind: EventKind::Planned {
            cell_id: run.cell_id.clone(),
            closure: d.closure.iter().map(|v| v.name.clone()).collect(),
            imports: d.imports.clone(),
            device: d.device,
            device_reason: d.device_reason.clone(),
            conservative: d.conservative.clone(),
            pinned: d.pinned.as_ref().map(|p| p.names.clone()).unwrap_or_default(),
        },
    };
    bus.publish(bus.subjects().event(run.session), &planned).await.map_err(|e| e.to_string())?;
    let target = For {
        session: run.session,
        cell_id: run.cell_id,
        kind: RecipeKind::Run,
        exec_id: run.exec_id,
        code: run.code,
        run_unix_ms: run.run_unix_ms,
        options: run.options,
    };
    let r = recipe(target, revision, manifest.revision, &d);
    bus.publish(bus.subjects().recipe(run.session), &r).await.map_err(|e| e.to_string())?;
    Ok((manifest, st))
}

impl StreamHandler<Result<Envelope<RunV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<RunV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let span = env.span("planner.run");
        let (bus, kv, run) = (self.bus.clone(), self.kv.clone(), env.msg);
        let (session, exec_id) = (run.session, run.exec_id);
        let fut = async move {
            let result = plan_run(bus.clone(), kv, run).await;
            if let Err(error) = &result {
                tracing::error!(%session, %error, "could not plan a run");
                let ev = SessionEventV1 { session, exec_id, unix_ms: unix_ms(), kind: EventKind::Failed { error: error.clone() } };
                if let Err(e) = bus.publish(bus.subjects().event(session), &ev).await {
                    tracing::error!(error = %e, "could not report a planning failure");
                }
            }
            result.ok()
        }
        .instrument(span);
        ctx.spawn(fut.into_actor(self).map(move |planned, act, _| {
            if let Some((m, st)) = planned {
                act.manifests.insert(session, (Arc::new(m), Arc::new(st)));
            }
        }));
    }
}

impl StreamHandler<Result<Envelope<EditV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<EditV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let edit = env.msg;
        let (manifest, st) = self
            .manifests
            .get(&edit.session)
            .cloned()
            .unwrap_or_else(|| (Arc::new(Manifest::empty(edit.session)), Arc::new(state::SessionState::default())));
        let analysis = analysis::analyze(&edit.code);
        // What the last run knew (function summaries included); edits change nothing stored.
        let d = derive(&analysis, &edit.code, &manifest, &st, false, Uuid::nil(), &edit.cell_id);
        let key = (edit.session, edit.cell_id.clone());
        let fp = d.fingerprint();
        let revision = match self.speculative.get(&key) {
            Some((_, old)) if *old == fp => return,
            Some((rev, _)) => rev + 1,
            None => 1,
        };
        self.speculative.insert(key, (revision, fp));
        let target = For {
            session: edit.session,
            cell_id: edit.cell_id,
            kind: RecipeKind::Speculative,
            exec_id: Uuid::nil(),
            code: edit.code,
            run_unix_ms: 0,
            options: SessionOptions { cwd: String::new(), all_gpu: false },
        };
        let r = recipe(target, revision, manifest.revision, &d);
        let bus = self.bus.clone();
        ctx.spawn(
            async move {
                if let Err(e) = bus.publish(bus.subjects().recipe(r.session), &r).await {
                    tracing::warn!(error = %e, "could not publish a speculative recipe");
                }
            }
            .into_actor(self),
        );
    }
}

/// Learn from a finished cell: if its worker saw CUDA used, label the cell GPU
/// next time (DESIGN.md section 4; the "what the worker reported").
async fn learn(kv: kv::Store, session: Uuid, exec_id: Uuid, cuda_used: bool) -> Result<(), state::StateError> {
    state::modify(&kv, session, |st| {
        if let Some(cell_id) = st.running.remove(&exec_id) {
            if cuda_used {
                st.cuda_cells.insert(cell_id);
            } else {
                st.cuda_cells.remove(&cell_id);
            }
        }
    })
    .await
}

impl StreamHandler<Result<Envelope<SessionEventV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<SessionEventV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let EventKind::Finished { cuda_used, .. } = env.msg.kind else { return };
        let (kv, session, exec_id) = (self.kv.clone(), env.msg.session, env.msg.exec_id);
        ctx.spawn(
            async move {
                if let Err(e) = learn(kv, session, exec_id, cuda_used).await {
                    tracing::warn!(error = %e, "could not record a cell's CUDA use");
                }
            }
            .into_actor(self),
        );
    }
}

impl StreamHandler<Result<Envelope<SessionCloseV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<SessionCloseV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let session = env.msg.session;
        self.manifests.remove(&session);
        self.speculative.retain(|(s, _), _| *s != session);
        let kv = self.kv.clone();
        ctx.spawn(
            async move {
                if let Err(e) = state::delete(&kv, session).await {
                    tracing::warn!(error = %e, "could not forget a session");
                }
            }
            .into_actor(self),
        );
    }
}
