//! Carrying out what the core decided: each [`Command`] becomes a publish, a KV
//! claim, a lifecycle step, or a future (claim, closure read, preparation,
//! execution) whose result goes back to the core as an [`Input`].

use std::sync::Arc;

use actix::prelude::*;
use schemas::messages::{SessionEventV2, WorkerState};
use schemas::unix_ms;
use tokio::sync::Mutex;

use super::Host;
use crate::core::{Command, Input, Target};
use crate::host::claims::ClaimKey;
use crate::worker::WorkerProc;

impl Host {
    /// Carry out one command.
    pub(super) fn carry_out(&mut self, command: Command, ctx: &mut Context<Self>) {
        match command {
            Command::Claim { ticket, key, delay, live } => self.claim(ticket, key, delay, live, ctx),
            Command::Release { key } => {
                let claims = self.claims.clone();
                self.background(async move { claims.release(key).await }, ctx);
            }
            Command::Renew { keys } => {
                let claims = self.claims.clone();
                let renewal = async move { claims.renew(keys).await };
                ctx.spawn(renewal.into_actor(self).map(|lost, act, ctx| {
                    if !lost.is_empty() {
                        act.drive(Input::ClaimsLost(lost), ctx);
                    }
                }));
            }
            Command::Bid(bid) => {
                let bus = self.env.bus.clone();
                self.background(
                    async move {
                        if let Err(e) = bus.publish(bus.subjects().host_bid(&bid.host), &bid).await {
                            tracing::debug!(error = %e, "could not publish a bid");
                        }
                    },
                    ctx,
                );
            }
            Command::Event { session, exec_id, kind } => {
                let ev = SessionEventV2 { session, exec_id, unix_ms: unix_ms(), kind };
                let bus = self.env.bus.clone();
                let publish = async move {
                    let subject = bus.subjects().event(session);
                    if let Err(e) = bus.publish_kept(subject, &ev, schemas::bus::KEPT_PATIENCE).await {
                        tracing::error!(error = %e, "could not publish a session event");
                    }
                };
                self.background(publish, ctx);
            }
            Command::Prepare { key, recipe, slots, worker } => {
                let existing = worker.as_ref().and_then(|id| self.workers.get(id).cloned());
                let span = tracing::info_span!("prepare", looseleaf.session_id = %key.0, looseleaf.cell_id = %key.1,
                    looseleaf.revision = recipe.revision);
                self.prepare_spans.insert(key.clone(), span.clone());
                let env = self.env.clone();
                let prepare = async move { env.prepare(&recipe, &slots, existing).await };
                let prepare = tracing::Instrument::instrument(prepare, span);
                ctx.spawn(prepare.into_actor(self).map(move |res, act, ctx| {
                    let result = match res {
                        Ok((w, prepare_ms)) => match act.hold(&w) {
                            Some(w) => Ok((w, prepare_ms)),
                            None => Err("the prepared worker could not be read".to_string()),
                        },
                        Err(e) => {
                            // a broken worker was killed by prepare
                            if let Some(id) = &worker {
                                act.workers.remove(id);
                            }
                            Err(e.to_string())
                        }
                    };
                    act.drive(Input::Prepared { key, result }, ctx);
                }));
            }
            Command::Execute { recipe, target, prepared } => self.execute(recipe, target, prepared, ctx),
            Command::Enter { worker, state } => self.env.lifecycle.advance(&worker, state),
            Command::StopWorker { worker } => {
                if let Some(w) = self.workers.remove(&worker) {
                    self.background(stop(w), ctx);
                }
            }
            Command::Interrupt { exec_id } => self.env.interrupts.ask(exec_id),
            Command::KillCells { session } => {
                for w in self.env.lifecycle.snapshot() {
                    if w.session == session && matches!(w.state, WorkerState::Preparing | WorkerState::Running) {
                        tracing::info!(worker = %w.id, %session, "stopping a cell of a deleted session");
                        crate::process::kill(w.pid);
                    }
                }
            }
            Command::ReleaseUid { session } => {
                if let Some(uids) = &self.env.session_uids {
                    uids.release(session);
                }
            }
            Command::After { delay, input } => {
                ctx.run_later(delay, move |act, ctx| act.drive(*input, ctx));
            }
            Command::PublishStatus => self.publish_status(ctx),
        }
    }

    /// Claim `key` after `delay`, then tell the core how it settled.
    fn claim(
        &mut self,
        ticket: crate::core::Ticket,
        key: ClaimKey,
        delay: std::time::Duration,
        live: Option<std::collections::HashSet<String>>,
        ctx: &mut Context<Self>,
    ) {
        let claims = self.claims.clone();
        let kind = key.kind();
        // a run's bid and claim are part of its cell's trace
        let parent = match &key {
            ClaimKey::Run(exec) => self.arrived.get(exec).map(|a| a.span.clone()),
            _ => None,
        };
        let span = tracing::info_span!(parent: parent.as_ref().unwrap_or(&tracing::Span::current()), "claim",
            otel.name = "bid and claim", looseleaf.claim = kind, looseleaf.bid.delay_ms = delay.as_secs_f64() * 1000.0,
            looseleaf.claim.outcome = tracing::field::Empty);
        let recorded = span.clone();
        let fut = tracing::Instrument::instrument(async move { claims.claim(key, delay, live).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |claim, act, ctx| {
            recorded.record("looseleaf.claim.outcome", claim.as_str());
            schemas::metrics::metrics().claims.get_or_create(&[("claim", kind), ("outcome", claim.as_str())]).inc();
            let _entered = recorded.enter(); // what the claim leads to (prepare, execute) follows it
            act.drive(Input::Claimed { ticket, claim }, ctx);
        }));
    }

    /// Execute `recipe` on `target`, then tell the core how it ended.
    fn execute(
        &mut self,
        recipe: schemas::messages::RecipeV3,
        target: Target,
        prepared: Option<crate::core::prepared::PrepKey>,
        ctx: &mut Context<Self>,
    ) {
        let exec_id = recipe.exec_id;
        let (target, on) = match target {
            Target::Fresh { slots } => (crate::exec::Target::Fresh { slots }, None),
            Target::Existing { worker, prepare, slots } => match self.workers.get(&worker) {
                Some(w) => (crate::exec::Target::Existing { worker: w.clone(), prepare, slots }, Some(worker)),
                None => {
                    // the core named a worker the shell does not hold: a bug, not a user's doing
                    tracing::error!(%worker, exec = %exec_id, "no such worker; the run starts a fresh one");
                    (crate::exec::Target::Fresh { slots }, None)
                }
            },
        };
        let arrival = self.arrived.remove(&exec_id);
        let parent = arrival.as_ref().map_or_else(tracing::Span::current, |a| a.span.clone());
        let span = tracing::info_span!(parent: &parent, "execute", looseleaf.exec_id = %exec_id,
            looseleaf.session_id = %recipe.session, looseleaf.cell_id = %recipe.cell_id,
            looseleaf.prepare = tracing::field::Empty);
        if let Some(prepared_by) = prepared.and_then(|key| self.prepare_spans.remove(&key)) {
            schemas::telemetry::link(&span, &prepared_by); // the edit-time preparation this run used
        }
        let arrived = arrival.map(|a| a.at);
        let env = self.env.clone();
        let fut = tracing::Instrument::instrument(async move { env.execute(recipe, target, arrived).await }, span);
        ctx.spawn(fut.into_actor(self).map(move |outcome, act, ctx| {
            if let Some(id) = &on {
                act.workers.remove(id); // held again below if it is still usable
            }
            let worker = outcome.worker.as_ref().and_then(|w| act.hold(w));
            let input = Input::Executed { exec_id, worker, unsavable: outcome.unsavable, cuda_used: outcome.cuda_used };
            act.drive(input, ctx);
        }));
    }
}

/// Stop a worker: politely if nothing else holds it, else kill it now.
pub(super) async fn stop(worker: Arc<Mutex<WorkerProc>>) {
    match Arc::try_unwrap(worker) {
        Ok(m) => m.into_inner().stop().await,
        Err(shared) => shared.lock().await.kill_now(),
    }
}
