//! How the current run ends: its deadlines (unclaimed, too long), a lost host,
//! abandoning a run no host took, the store's word on what it committed, and
//! completion once its end and all it sent arrived.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use schemas::messages::{ErrorCode, InterruptV1, ManifestV2, SettleV1};
use schemas::subjects::{HostVerb, StoreVerb};
use uuid::Uuid;

use super::current::{Ended, RunState};
use super::SessionActor;
use crate::api::{ExecStatus, StreamItem};

/// How soon the store is asked again what a run committed, when it did not say.
const STORE_RETRY: Duration = Duration::from_secs(2);

/// How soon abandoning an unclaimed run is tried again when the claims bucket
/// could not be reached.
const ABANDON_RETRY: Duration = Duration::from_secs(2);

/// How often a running cell's host is checked for loss.
pub(super) const HOST_CHECK: Duration = Duration::from_secs(1);

impl SessionActor {
    /// Run `f` after `delay` unless the current run completes first: the current
    /// run's timer `what` (it replaces, and cancels, the run's earlier timer of
    /// that name: each watch sets itself again when it fires). One set with no
    /// run current is a plain `ctx.run_later`.
    pub(super) fn run_later_for<F>(&mut self, what: &'static str, delay: Duration, ctx: &mut Context<Self>, f: F)
    where
        F: FnOnce(&mut Self, &mut Context<Self>) + 'static,
    {
        let handle = ctx.run_later(delay, f);
        if let Some(earlier) = self.current.as_mut().and_then(|cur| cur.timers.insert(what, handle)) {
            ctx.cancel_future(earlier);
        }
    }

    /// While execution `exec_id` is current: if the host that claimed it fell
    /// silent, or stopped renewing the run's claim (hosts renew every 2 s; one
    /// restarted under the same id does not know the run), end it with what the
    /// store committed (a commit that landed before the host was lost is the
    /// cell's outcome; otherwise it failed and nothing of it was committed).
    /// Checked every second.
    pub(super) fn watch_host(&mut self, exec_id: Uuid, ctx: &mut Context<Self>) {
        self.run_later_for("host check", HOST_CHECK, ctx, move |act, ctx| {
            let Some(cur) = act.current.as_ref().filter(|c| c.exec_id == exec_id && c.ended().is_none()) else {
                return;
            };
            let Some(host) = cur.host().map(str::to_string) else { return };
            let silent = act.shared.hosts.silent_for(&host);
            if silent > act.shared.timeouts.host_lost {
                act.host_lost(exec_id, host, format!("not heard for {:.0} s", silent.as_secs_f64()), ctx);
                return;
            }
            let (claims, key) = (act.shared.claims.clone(), schemas::buckets::run_claim_key(exec_id));
            let entry = async move { claims.entry(key).await };
            ctx.spawn(entry.into_actor(act).map(move |entry, act, ctx| {
                let host_lost = act.shared.timeouts.host_lost;
                let state = act.current.as_mut().filter(|c| c.exec_id == exec_id).map(|c| &mut c.state);
                let Some(RunState::Claimed { claim_seen, .. }) = state else {
                    return; // ended meanwhile
                };
                // a claim that is gone or not renewed stays at one revision
                let revision = match entry {
                    Ok(Some(e)) if e.operation == async_nats::jetstream::kv::Operation::Put => e.revision,
                    Ok(_) => 0,
                    Err(e) => {
                        // unobserved time says nothing about the host
                        tracing::debug!(error = %e, "could not read a run's claim");
                        *claim_seen = None;
                        act.watch_host(exec_id, ctx);
                        return;
                    }
                };
                let blind = act.shared.hosts.blind_within(HOST_CHECK * 2);
                let since = match *claim_seen {
                    Some((seen, at)) if seen == revision && !blind => at,
                    _ => {
                        *claim_seen = Some((revision, Instant::now()));
                        Instant::now()
                    }
                };
                if since.elapsed() > host_lost {
                    let why =
                        format!("its claim on the cell was not renewed for {:.0} s", since.elapsed().as_secs_f64());
                    act.host_lost(exec_id, host, why, ctx);
                } else {
                    act.watch_host(exec_id, ctx);
                }
            }));
        });
    }

    /// The host of the current execution is lost: it ends with what the store committed.
    fn host_lost(&mut self, exec_id: Uuid, host: String, why: String, ctx: &mut Context<Self>) {
        tracing::warn!(session = %self.sid, exec = %exec_id, %host, %why, "host lost while it ran a cell");
        let failure = move |revision| {
            format!(
                "host {host} was lost ({why}) while the cell ran; nothing the cell did was committed, the session \
                 keeps its last committed state (revision {revision})"
            )
        };
        self.settle(exec_id, Arc::new(failure), ctx);
    }

    /// End the current execution `exec_id` with what the store committed: its commit
    /// if its save landed (a host may have run it though this frontend heard
    /// nothing), else a failure, `failure(revision)`. The store settles the run: it
    /// fences the run's revision so that a host cut off while it ran can never
    /// commit it afterwards (ADR 22). A store that does not answer is asked again:
    /// never say nothing was committed without knowing.
    fn settle(&mut self, exec_id: Uuid, failure: Arc<dyn Fn(u64) -> String>, ctx: &mut Context<Self>) {
        let bus = self.shared.bus.clone();
        let req = SettleV1 { session: self.sid, exec_id, base_revision: self.stored.revision };
        let ask = async move {
            bus.request_idempotent::<_, ManifestV2>(bus.subjects().store(StoreVerb::Settle), &req, super::STORE_WAIT)
                .await
        };
        ctx.spawn(ask.into_actor(self).map(move |answer, act, ctx| {
            if !act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.ended().is_none()) {
                return;
            }
            let now = schemas::unix_ms();
            match answer {
                // the save landed: that is the cell's outcome
                Ok(m) if m.manifest.exec_id == exec_id => {
                    // what the cell sent was not heard here: read it back first
                    act.end_current(ExecStatus::Ok, m.manifest.revision, None, now, true, ctx);
                    act.read_back(exec_id, ctx);
                }
                Ok(m) => {
                    let error = failure(m.manifest.revision);
                    act.complete(ctx, ExecStatus::Failed, m.manifest.revision, Some(error), now);
                }
                // deleted meanwhile: nothing commits to it any more
                Err(schemas::bus::BusError::Remote { code: ErrorCode::NotFound, message, .. }) => {
                    let revision = act.stored.revision;
                    act.complete(ctx, ExecStatus::Failed, revision, Some(format!("{}; {message}", failure(revision))), now);
                }
                Err(e) => {
                    tracing::warn!(exec = %exec_id, error = %e, "the store could not say what a run committed; asking again");
                    ctx.run_later(STORE_RETRY, move |act, ctx| act.settle(exec_id, failure, ctx));
                }
            }
        }));
    }

    /// The current execution's deadlines: unclaimed after the claim timeout, it is
    /// abandoned; not complete after the execution deadline, it is interrupted.
    pub(super) fn arm_deadlines(&mut self, exec_id: Uuid, ctx: &mut Context<Self>) {
        self.watch_connection(exec_id, ctx);
        let claim_timeout = self.shared.timeouts.claim;
        self.run_later_for("claim deadline", claim_timeout, ctx, move |act, ctx| {
            if act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && matches!(c.state, RunState::Unclaimed)) {
                tracing::warn!(exec = %exec_id, "no host claimed the run in time");
                act.abandon_unclaimed(exec_id, format!("no host took the cell within {claim_timeout:?}"), ctx);
            }
        });
        let Some(deadline) = self.shared.timeouts.execution else { return };
        self.run_later_for("execution deadline", deadline, ctx, move |act, ctx| {
            if act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.ended().is_none()) {
                tracing::warn!(exec = %exec_id, "execution deadline passed; interrupting the cell");
                act.stop_current(exec_id, format!("no host ran the cell within the deadline ({deadline:?})"), ctx);
            }
        });
    }

    /// Stop the current execution `exec_id`: the host that claimed it hears the
    /// interrupt (it interrupts, then kills, the cell and reports its outcome); if
    /// no host is known to hold it, it is abandoned with `unclaimed_error`, and a
    /// host found holding it meanwhile is interrupted (ADR 57).
    pub(super) fn stop_current(&mut self, exec_id: Uuid, unclaimed_error: String, ctx: &mut Context<Self>) {
        let Some(cur) = self.current.as_ref().filter(|c| c.exec_id == exec_id && c.ended().is_none()) else {
            return;
        };
        match cur.host().map(str::to_string) {
            Some(host) => self.interrupt_host(host, exec_id, ctx),
            None => self.abandon(exec_id, unclaimed_error, true, ctx),
        }
    }

    /// Interrupt `exec_id` on `host`, the one that claimed it: no other host runs it.
    fn interrupt_host(&mut self, host: String, exec_id: Uuid, ctx: &mut Context<Self>) {
        let bus = self.shared.bus.clone();
        let msg = InterruptV1 { session: self.sid, exec_id };
        ctx.spawn(
            async move {
                let subject = bus.subjects().host_command(&host, HostVerb::Interrupt);
                if let Err(e) = bus.publish(subject, &msg).await {
                    tracing::error!(error = %e, exec = %msg.exec_id, %host, "could not publish the interrupt");
                }
            }
            .into_actor(self),
        );
    }

    /// End the current execution `exec_id` with `error`, but only once no host can
    /// ever run it: its run claim is taken here (holder `!interrupted`). If a host
    /// won the claim first, that host reports the outcome; if the claims bucket
    /// cannot be reached, this is tried again shortly (a run reported as not run
    /// must never run later).
    pub(super) fn abandon_unclaimed(&mut self, exec_id: Uuid, error: String, ctx: &mut Context<Self>) {
        self.abandon(exec_id, error, false, ctx);
    }

    /// `abandon_unclaimed`, interrupting the host found holding the run if
    /// `interrupt_holder` (the user stopped it).
    fn abandon(&mut self, exec_id: Uuid, error: String, interrupt_holder: bool, ctx: &mut Context<Self>) {
        let (claims, key) = (self.shared.claims.clone(), schemas::buckets::run_claim_key(exec_id));
        let claim = async move {
            match claims.create(&key, schemas::buckets::INTERRUPTED_HOLDER.into()).await {
                Ok(_) => Ok(None),
                // who holds it: a host that died right after claiming never says
                // Claimed, and is watched from here like one that did
                Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
                    let holder = claims.get(&key).await.ok().flatten();
                    Ok(Some(holder.map(|h| String::from_utf8_lossy(&h).into_owned()).unwrap_or_default()))
                }
                Err(e) => Err(e),
            }
        };
        ctx.spawn(claim.into_actor(self).map(move |claimed, act, ctx| match claimed {
            // no host can start it now; one may have run it before (a claim expires
            // after CLAIM_TTL unrenewed): the store says whether it committed
            Ok(None) => {
                let error = error.clone();
                act.settle(exec_id, Arc::new(move |_| error.clone()), ctx)
            }
            // abandoned already (by this session's frontend before it restarted)
            Ok(Some(holder)) if holder == schemas::buckets::INTERRUPTED_HOLDER => {
                let error = error.clone();
                act.settle(exec_id, Arc::new(move |_| error.clone()), ctx)
            }
            Ok(Some(holder)) => {
                tracing::info!(exec = %exec_id, %holder, "a host holds the run; it reports the outcome");
                if interrupt_holder && !holder.is_empty() {
                    act.interrupt_host(holder.clone(), exec_id, ctx);
                }
                let current = act.current.as_mut().filter(|c| c.exec_id == exec_id);
                if !holder.is_empty() && current.is_some_and(|c| c.claimed_by(holder)) {
                    act.watch_host(exec_id, ctx);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, exec = %exec_id, "could not claim the run to abandon it; retrying");
                ctx.run_later(ABANDON_RETRY, move |act, ctx| {
                    let pending = act.current.as_ref().is_some_and(|c| c.exec_id == exec_id && c.ended().is_none());
                    if pending {
                        act.abandon(exec_id, error, interrupt_holder, ctx);
                    }
                });
            }
        }));
    }

    /// The current execution is complete: emit done, start the next one.
    fn complete(
        &mut self,
        ctx: &mut Context<Self>,
        status: ExecStatus,
        revision: u64,
        error: Option<String>,
        unix_ms: u64,
    ) {
        let Some(cur) = self.current.take() else { return };
        for timer in cur.timers.values() {
            ctx.cancel_future(*timer);
        }
        // counted here, where its outcome is final (a cell that raised ends Saved)
        schemas::metrics::metrics().cells.get_or_create(&[("status", status.as_str())]).inc();
        self.traces.remove(&cur.exec_id); // the cell's root span ends
        self.last_active = Instant::now();
        self.stored.revision = revision;
        self.stored.last_exec = Some(cur.exec_id);
        self.stored.in_flight = None;
        // a deleted session's record stays deleted (its cells' late ends are relayed only)
        if !self.closing {
            self.write_record(None);
        }
        if let Some(r) = self.record(cur.exec_id) {
            r.status = status;
            r.after_revision = Some(revision);
            r.error = error.clone();
        }
        self.emit(&StreamItem::Done { exec_id: cur.exec_id, status, after_revision: revision, unix_ms, error });
        self.start_next(ctx);
    }

    /// Complete the current execution if its end arrived and all it sent did.
    pub(super) fn maybe_complete(&mut self, ctx: &mut Context<Self>) {
        if self.current.as_ref().is_some_and(|c| c.ended().is_some() && !c.unheard()) {
            self.complete_current(ctx);
        }
    }

    /// Complete the current execution with its end (a saved run with the cell's
    /// own status), whatever it has not heard.
    pub(super) fn complete_current(&mut self, ctx: &mut Context<Self>) {
        let Some(cur) = &self.current else { return };
        let Some(Ended { mut status, revision, mut error, unix_ms, saved }) = cur.ended().cloned() else { return };
        if saved {
            (status, error) = cur.saved_outcome();
        }
        self.complete(ctx, status, revision, error, unix_ms);
    }

    /// The current execution ended (`saved`: its save landed): it completes once
    /// all it sent arrived, or, after the output grace, with what its streams
    /// kept of it.
    pub(super) fn end_current(
        &mut self,
        status: ExecStatus,
        revision: u64,
        error: Option<String>,
        unix_ms: u64,
        saved: bool,
        ctx: &mut Context<Self>,
    ) {
        let Some(cur) = self.current.as_mut() else { return };
        let exec_id = cur.exec_id;
        cur.state = RunState::Ended(Ended { status, revision, error, unix_ms, saved });
        self.maybe_complete(ctx);
        if self.current.as_ref().is_some_and(|c| c.exec_id == exec_id) {
            let grace = self.shared.timeouts.output_grace;
            self.run_later_for("output grace", grace, ctx, move |act, ctx| act.read_back(exec_id, ctx));
        }
    }
}

/// The host holding run `exec_id`'s claim, if a host does (not the frontend's
/// mark of an abandoned run): where what concerns only that run goes (ADR 57).
pub(crate) async fn claim_holder(claims: &async_nats::jetstream::kv::Store, exec_id: Uuid) -> Option<String> {
    let holder = claims.get(schemas::buckets::run_claim_key(exec_id)).await.ok().flatten()?;
    let holder = String::from_utf8_lossy(&holder).into_owned();
    (holder != schemas::buckets::INTERRUPTED_HOLDER && !holder.is_empty()).then_some(holder)
}
