//! A session's events and its close: what the planner learns from them (CUDA
//! use, faulted names, prepared workers, a save's new manifest) and what it
//! forgets when the session closes.

use std::sync::Arc;

use actix::prelude::*;
use async_nats::jetstream::kv;
use schemas::bus::Rejected;
use schemas::messages::{EventKind, PreparedWorker, SessionCloseV1, SessionEventV2};
use schemas::Envelope;
use uuid::Uuid;

use super::plan::fetch_manifest;
use super::Planner;
use crate::speculator::Ready;
use crate::state;

/// Learn from a finished cell: if its worker saw CUDA used, label the cell GPU
/// next time (DESIGN.md section 4; the "what the worker reported"); names
/// its closure missed are restored up front next time.
async fn learn(
    kv: kv::Store,
    session: Uuid,
    exec_id: Uuid,
    cuda_used: bool,
    faulted: Vec<String>,
) -> Result<(), state::StateError> {
    state::modify(&kv, session, |st| {
        if let Some(cell_id) = st.running.remove(&exec_id) {
            if !faulted.is_empty() {
                st.faulted.entry(cell_id.clone()).or_default().extend(faulted.iter().cloned());
            }
            if cuda_used {
                st.cuda_cells.insert(cell_id);
            } else {
                st.cuda_cells.remove(&cell_id);
            }
        }
    })
    .await
}

impl StreamHandler<Result<Envelope<SessionEventV2>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<SessionEventV2>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let (session, exec_id) = (env.msg.session, env.msg.exec_id);
        self.event_demand(exec_id, &env.msg.kind);
        match env.msg.kind {
            EventKind::Finished { cuda_used, faulted, .. } => {
                let kv = self.kv.clone();
                ctx.spawn(
                    async move {
                        if let Err(e) = learn(kv, session, exec_id, cuda_used, faulted).await {
                            tracing::warn!(error = %e, "could not record a cell's CUDA use");
                        }
                    }
                    .into_actor(self),
                );
            }
            EventKind::Saved { revision, .. } => {
                self.pinned_runs.remove(&exec_id);
                self.refresh_manifest(session, revision, ctx)
            }
            // taken (or ended): no longer waiting for its host
            EventKind::Claimed { .. } | EventKind::Failed { .. } => {
                self.pinned_runs.remove(&exec_id);
            }
            EventKind::Preparing { host, cell_id, .. } => self.speculator.preparing(session, &cell_id, &host),
            EventKind::Ready { host, worker, cell_id, class, prepare_ms, slot, .. } => {
                let now = self.now();
                let ready = Ready { class, prepare_ms, holds_slot: slot.is_some() };
                self.speculator.ready(session, &cell_id, PreparedWorker { host, worker }, ready, now);
            }
            EventKind::PreparedEnded { worker, cell_id, idle_ms, slot, .. } => {
                let now = self.now();
                self.speculator.ended(session, &cell_id, &worker, idle_ms, slot.is_some(), now);
            }
            _ => {}
        }
    }
}

impl Planner {
    /// After a save (of `revision`), edits should see the new versions.
    fn refresh_manifest(&mut self, session: Uuid, revision: u64, ctx: &mut Context<Self>) {
        let bus = self.bus.clone();
        ctx.spawn(async move { fetch_manifest(&bus, session, Some(revision)).await }.into_actor(self).map(
            move |m, act, _| match m {
                Ok(m) => {
                    let st = act.manifests.get(&session).map(|(_, st)| st.clone()).unwrap_or_default();
                    act.manifests.insert(session, (Arc::new(m), st));
                }
                Err(e) => tracing::debug!(error = %e, "could not refresh a manifest"),
            },
        ));
    }
}

impl StreamHandler<Result<Envelope<SessionCloseV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<SessionCloseV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let session = env.msg.session;
        self.manifests.remove(&session);
        self.speculative.retain(|(s, _), _| *s != session);
        self.pending_edits.retain(|(s, _), _| *s != session);
        self.ran_code.retain(|(s, _), _| *s != session);
        self.speculator.close(session);
        self.demand.closed(session);
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
