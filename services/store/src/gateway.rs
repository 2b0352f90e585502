//! The store gateway actor: answers manifest gets, chunk plans, commits and session deletes on
//! `{prefix}.v1.store.*` (queue group `store`, so replicas share the work).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::messages::{
    ChunkPlanV2, ChunkPlannedV1, CommitV2, CommittedV1, DoneV1, ErrorCode, ForkV1, GcDoneV1, GcV1, ManifestGetV2,
    ManifestV2, Reply, RevertV1, SessionDeleteV1, SettleV1, StateCheckV1, StateCheckedV1, StateMovedV1,
    StorePressureV1,
};
use schemas::{Bus, Envelope, WireMessage};
use tracing::Instrument;

use crate::manifests::{ManifestError, Manifests};
use crate::space::Volume;

/// Serves store requests from the bus.
pub struct Gateway {
    bus: Bus,
    manifests: Arc<Manifests>,
    gc: Option<crate::gc::Schedule>,
    volume: Option<Arc<Volume>>,
    /// Deleted sessions whose chunks are being freed now.
    freeing: Arc<AtomicUsize>,
}

impl Gateway {
    /// A gateway answering on `bus` from `manifests`, collecting garbage on `gc`'s
    /// schedule, and at once when `volume` (a local store's) runs low.
    pub fn new(
        bus: Bus,
        manifests: Arc<Manifests>,
        gc: Option<crate::gc::Schedule>,
        volume: Option<Arc<Volume>>,
    ) -> Self {
        Self { bus, manifests, gc, volume, freeing: Arc::new(AtomicUsize::new(0)) }
    }
}

/// Collect whenever the volume is below its threshold (checked every few seconds,
/// and at once when a save was refused for space). One collection at a time. If
/// it is still below after collecting, the frontends hear so: one discards the
/// oldest detached session (ADR 63), and the next round collects what it freed.
/// Not while a deleted session's chunks are still being freed (`freeing`): what
/// that frees is not free yet, and another discard would be one too many.
async fn collect_under_pressure(
    bus: Bus,
    manifests: Arc<Manifests>,
    volume: Arc<Volume>,
    schedule: crate::gc::Schedule,
    freeing: Arc<AtomicUsize>,
) {
    loop {
        volume.woken_or_due().await;
        let Some(space) = volume.pressed() else { continue };
        tracing::warn!(free = space.free, total = space.total, "the store is low on space; collecting garbage now");
        match crate::gc::collect(&manifests, schedule.keep_revisions, schedule.grace).await {
            Ok(done) => tracing::info!(?done, "garbage collection for space"),
            Err(e) => tracing::warn!(error = %e, "garbage collection for space failed"),
        }
        let Some(space) = volume.pressed() else { continue };
        if freeing.load(Ordering::SeqCst) > 0 {
            continue;
        }
        let pressure =
            StorePressureV1 { free: space.free, total: space.total, threshold: volume.threshold(space.total) };
        tracing::warn!(
            free = space.free,
            "still low on space after collecting: asking for the oldest detached session to be discarded"
        );
        if let Err(e) = bus.publish(bus.subjects().store_pressure(), &pressure).await {
            tracing::warn!(error = %e, "could not tell the frontends the store is low on space");
        }
    }
}

impl Actor for Gateway {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(volume) = self.volume.clone() {
            let schedule = self.gc.unwrap_or_default();
            let pressure = collect_under_pressure(
                self.bus.clone(),
                self.manifests.clone(),
                volume,
                schedule,
                self.freeing.clone(),
            );
            ctx.spawn(pressure.into_actor(self));
        }
        let Some(schedule) = self.gc else { return };
        ctx.run_interval(schedule.every, move |act, ctx| {
            let manifests = act.manifests.clone();
            let collect = async move {
                match crate::gc::collect(&manifests, schedule.keep_revisions, schedule.grace).await {
                    Ok(done) => tracing::info!(?done, "scheduled garbage collection"),
                    Err(e) => tracing::warn!(error = %e, "scheduled garbage collection failed"),
                }
            };
            ctx.spawn(collect.into_actor(act));
        });
    }
}

fn error_reply<T>(e: &ManifestError) -> Reply<T> {
    let code = match e {
        ManifestError::Stale { .. } | ManifestError::Lost { .. } => ErrorCode::Conflict,
        ManifestError::Deleted { .. } | ManifestError::NoRevision { .. } => ErrorCode::NotFound,
        ManifestError::NothingToUndo { .. } => ErrorCode::BadRequest,
        ManifestError::ForkExists { .. } => ErrorCode::Conflict,
        ManifestError::BadDelta { .. } | ManifestError::MissingChunks { .. } => ErrorCode::BadRequest,
        ManifestError::QuotaExceeded { .. } | ManifestError::StoreFull { .. } => ErrorCode::QuotaExceeded,
        ManifestError::Storage(_)
        | ManifestError::Corrupt { .. }
        | ManifestError::Unverified { .. }
        | ManifestError::RevisionMissing { .. } => ErrorCode::Storage,
    };
    Reply::Err { code, message: e.to_string() }
}

/// Handle one decoded request on the actor's context, replying with the envelope.
fn serve<Req, Resp, F, Fut>(
    gw: &Gateway,
    ctx: &mut Context<Gateway>,
    item: Result<Envelope<Req>, Rejected>,
    name: &'static str,
    f: F,
) where
    Req: WireMessage,
    Resp: WireMessage,
    F: FnOnce(Arc<Manifests>, Req) -> Fut + 'static,
    Fut: std::future::Future<Output = Result<Resp, ManifestError>> + 'static,
{
    let bus = gw.bus.clone();
    match item {
        Err(rejected) => {
            ctx.spawn(async move { rejected.answer::<Resp>(&bus).await }.into_actor(gw));
        }
        Ok(env) => {
            let span = env.span(name);
            let to = env.reply_to();
            let manifests = gw.manifests.clone();
            let fut = async move {
                let reply = match f(manifests, env.msg).await {
                    Ok(v) => Reply::Ok(v),
                    Err(e) => {
                        tracing::warn!(error = %e, "store request failed");
                        error_reply(&e)
                    }
                };
                if let Err(e) = bus.respond(to, &reply).await {
                    tracing::error!(error = %e, "could not send store reply");
                }
            };
            ctx.spawn(fut.instrument(span).into_actor(gw));
        }
    }
}

impl StreamHandler<Result<Envelope<ManifestGetV2>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<ManifestGetV2>, Rejected>, ctx: &mut Self::Context) {
        serve(self, ctx, item, "store.manifest.get", |m, req: ManifestGetV2| async move {
            Ok(ManifestV2 { manifest: (*m.latest_from(req.session, req.at_least).await?).clone() })
        });
    }
}

impl StreamHandler<Result<Envelope<StateCheckV1>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<StateCheckV1>, Rejected>, ctx: &mut Self::Context) {
        serve(self, ctx, item, "store.check", |m, req: StateCheckV1| async move {
            let (latest, missing) = m.check(req.session, req.at_least).await?;
            if let Some(example) = missing.first() {
                tracing::warn!(session = %req.session, missing = missing.len(), %example,
                    "a session's saved state is incomplete: chunks are gone from the store");
            }
            Ok(StateCheckedV1 {
                manifest: (*latest).clone(),
                missing_chunks: missing.len() as u64,
                example: missing.first().cloned(),
            })
        });
    }
}

impl StreamHandler<Result<Envelope<ChunkPlanV2>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<ChunkPlanV2>, Rejected>, ctx: &mut Self::Context) {
        let volume = self.volume.clone();
        serve(self, ctx, item, "store.chunk.plan", |m, req: ChunkPlanV2| async move {
            // over the quota, or more than the volume has room for: refused before a
            // byte is uploaded
            m.within_quota(req.session, req.bytes_after)?;
            if let (Some(volume), Some(after)) = (volume, req.bytes_after) {
                let before = m.latest(req.session).await?.stored_bytes();
                volume.admit(req.session, after.saturating_sub(before))?;
            }
            Ok(ChunkPlannedV1 { missing: m.missing_chunks(req.session, &req.hashes).await? })
        });
    }
}

impl StreamHandler<Result<Envelope<CommitV2>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<CommitV2>, Rejected>, ctx: &mut Self::Context) {
        serve(self, ctx, item, "store.commit", |m, req: CommitV2| async move {
            let result = m.commit(&req).await;
            let counted = match &result {
                Ok(_) => "committed",
                Err(ManifestError::Stale { .. } | ManifestError::Lost { .. }) => "conflict",
                Err(_) => "refused",
            };
            schemas::metrics::metrics().commits.get_or_create(&[("result", counted)]).inc();
            let done: CommittedV1 = result?;
            tracing::info!(session = %req.session, revision = done.revision, changed = done.changed.len(), "committed");
            Ok(done)
        });
    }
}

impl StreamHandler<Result<Envelope<GcV1>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<GcV1>, Rejected>, ctx: &mut Self::Context) {
        serve(self, ctx, item, "store.gc", |m, req: GcV1| async move {
            let done: GcDoneV1 =
                crate::gc::collect(&m, req.keep_revisions, std::time::Duration::from_secs(req.grace_secs)).await?;
            tracing::info!(?done, "garbage collected");
            Ok(done)
        });
    }
}

/// What a revert or fork committed, as its reply says.
fn moved(m: &schemas::checkpoint::Manifest, state_of: u64) -> StateMovedV1 {
    StateMovedV1 {
        revision: m.revision,
        state_of,
        variables: m.variables.len() as u64,
        bytes: m.stored_bytes(),
        unsavable: m.unsavable.keys().cloned().collect(),
    }
}

impl StreamHandler<Result<Envelope<RevertV1>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<RevertV1>, Rejected>, ctx: &mut Self::Context) {
        serve(self, ctx, item, "store.revert", |m, req: RevertV1| async move {
            let (next, state_of) = m.revert(req.session, req.base_revision, req.to).await?;
            tracing::info!(session = %req.session, to = ?req.to, revision = next.revision, state_of, "session state reverted");
            Ok(moved(&next, state_of))
        });
    }
}

impl StreamHandler<Result<Envelope<ForkV1>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<ForkV1>, Rejected>, ctx: &mut Self::Context) {
        serve(self, ctx, item, "store.fork", |m, req: ForkV1| async move {
            let (first, lost) = m.fork(req.parent, req.at_least, req.child).await?;
            let state_of = first.forked_from.map_or(0, |f| f.revision);
            tracing::info!(parent = %req.parent, child = %req.child, state_of, "session forked");
            Ok(StateMovedV1 { unsavable: lost, ..moved(&first, state_of) })
        });
    }
}

impl StreamHandler<Result<Envelope<SettleV1>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<SettleV1>, Rejected>, ctx: &mut Self::Context) {
        serve(self, ctx, item, "store.settle", |m, req: SettleV1| async move {
            Ok(ManifestV2 { manifest: (*m.settle(req.session, req.exec_id, req.base_revision).await?).clone() })
        });
    }
}

impl StreamHandler<Result<Envelope<SessionDeleteV1>, Rejected>> for Gateway {
    fn handle(&mut self, item: Result<Envelope<SessionDeleteV1>, Rejected>, ctx: &mut Self::Context) {
        let freeing = self.freeing.clone();
        serve(self, ctx, item, "store.session.delete", |m, req: SessionDeleteV1| async move {
            let deleted = m.delete(req.session).await?;
            tracing::info!(session = %req.session, manifests = deleted.manifests, "session deleted");
            // its chunks no other session holds are freed now, not after the grace
            let session = req.session;
            freeing.fetch_add(1, Ordering::SeqCst);
            actix::spawn(async move {
                match crate::gc::free_deleted(&m, deleted.chunks).await {
                    Ok(done) => tracing::info!(%session, ?done, "a deleted session's chunks freed"),
                    Err(e) => {
                        tracing::warn!(%session, error = %e, "a deleted session's chunks were not freed; the collector will")
                    }
                }
                freeing.fetch_sub(1, Ordering::SeqCst);
            });
            Ok(DoneV1 {})
        });
    }
}
