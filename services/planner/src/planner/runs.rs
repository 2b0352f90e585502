//! Runs as they are heard: acknowledged, planned once however often they are
//! sent, each in its own future; a run that cannot be planned fails with the reason.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::messages::{EventKind, RunV3, SessionEventV2};
use schemas::{unix_ms, Envelope};
use tracing::Instrument;

use super::plan::{code_hash, plan_run};
use super::Planner;

/// How long a planner remembers a run it heard: longer than the frontend keeps
/// sending one nobody acknowledged (`RunV3`'s patience, half the claim timeout).
const RUN_MEMORY: Duration = Duration::from_secs(300);

impl StreamHandler<Result<Envelope<RunV3>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<RunV3>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let span = env.span("planner.run");
        // what is logged while the run is handled joins its trace
        let _entered = span.clone().entered();
        // the frontend delivers runs (Bus::deliver): say it was heard
        let (acks, reply) = (self.bus.clone(), env.reply_to());
        ctx.spawn(async move { acks.acknowledge(reply).await }.into_actor(self));
        let (bus, kv, run) = (self.bus.clone(), self.kv.clone(), env.msg);
        let (session, exec_id) = (run.session, run.exec_id);
        self.heard_runs.retain(|_, at| at.elapsed() < RUN_MEMORY);
        if self.heard_runs.insert(exec_id, Instant::now()).is_some() {
            tracing::info!(%session, exec = %exec_id, "a run heard again (sent again unacknowledged): planned once");
            return;
        }
        // Run supersedes the cell's pending edit; its prepared worker (if any) runs it.
        self.pending_edits.remove(&(session, run.cell_id.clone()));
        let now = self.now();
        self.demand.ran(session, &run.cell_id, exec_id, now);
        self.ran_code.insert((session, run.cell_id.clone()), code_hash(&run.code));
        if let Some((_, fp)) = self.speculative.get_mut(&(session, run.cell_id.clone())) {
            *fp = None;
        }
        let prepared = if run.options.speculate { self.speculator.for_run(session, &run.cell_id) } else { None };
        let cached = self.manifests.get(&session).map(|(m, _)| m.clone());
        let largest_host = self.largest_host();
        let live_hosts = self.live_hosts();
        let fut = async move {
            let result = plan_run(bus.clone(), kv, run, prepared, cached, largest_host, live_hosts).await;
            if result.is_ok() {
                tracing::debug!(%session, exec = %exec_id, "planned");
            }
            if let Err(error) = &result {
                if matches!(error, super::plan::PlanError::GpuRefused(_)) {
                    tracing::info!(%session, %error, "a GPU cell refused for its user's quota");
                } else {
                    tracing::error!(%session, %error, "could not plan a run");
                }
                let ev = SessionEventV2 {
                    session,
                    exec_id,
                    unix_ms: unix_ms(),
                    kind: EventKind::Failed { error: error.to_string() },
                };
                if let Err(e) = bus.publish_kept(bus.subjects().event(session), &ev, schemas::bus::KEPT_PATIENCE).await
                {
                    tracing::error!(error = %e, "could not report a planning failure");
                }
            }
            result.ok()
        }
        .instrument(span);
        ctx.spawn(fut.into_actor(self).map(move |planned, act, _| {
            if let Some((m, st, pinned)) = planned {
                act.manifests.insert(session, (m, Arc::new(st)));
                if let Some(p) = pinned {
                    act.pinned_runs.insert(exec_id, (session, p, Instant::now()));
                }
            }
        }));
    }
}
