//! What arrives over NATS, as inputs to the core: recipes, other hosts' status
//! and run claims (from the claims bucket), closes, idleness, interrupts and evictions; and what the core has
//! no part in (queries and comms to a CPU worker, input replies).

use std::time::Instant;

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::messages::{
    CommAnswerV2, CommV1, EvictV1, HostStatusV2, InputReplyV1, InterruptV1, QueryAnswerV1, QueryV1, RecipeKind,
    RecipeV3, SessionCloseV1, SessionIdleV1,
};
use schemas::Envelope;

use super::cpu_worker::{comm_cpu_worker, query_cpu_worker};
use super::{Arrival, Host};
use crate::core::Input;

impl StreamHandler<Result<Envelope<RecipeV3>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<RecipeV3>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let _span = env.span("host.recipe").entered();
        // the planner delivers runs' recipes (Bus::deliver): say this host heard it
        // (unless it is stopping and will not take it)
        if !self.env.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            let (bus, reply) = (self.env.bus.clone(), env.reply_to());
            self.background(async move { bus.acknowledge(reply).await }, ctx);
        }
        let exec = env.msg.exec_id;
        if env.msg.kind == RecipeKind::Run && !self.core.heard(exec) {
            // the recipe's span (entered above) continues the cell's trace
            self.arrived.insert(exec, Arrival { at: Instant::now(), span: tracing::Span::current() });
        }
        self.drive(Input::Recipe(env.msg), ctx);
    }
}

/// A run claim made (or renewed) in the claims bucket: `holder` is a host's id,
/// or the frontend's mark of a run it abandoned.
pub struct RunClaimed {
    /// The execution.
    pub exec_id: uuid::Uuid,
    /// Who holds it.
    pub holder: String,
}

impl StreamHandler<RunClaimed> for Host {
    fn handle(&mut self, item: RunClaimed, ctx: &mut Self::Context) {
        if item.holder != self.env.host_id && self.core.heard(item.exec_id) {
            self.drive(Input::ClaimedElsewhere { exec_id: item.exec_id }, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<HostStatusV2>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<HostStatusV2>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let status = env.msg;
        if status.host != self.env.host_id {
            // a slot an idle prepared worker holds serves a run there (it is given
            // up for one, or its worker runs it): room, as a free one is
            let room = |s: &&schemas::messages::SlotStatus| match s.held_for.as_deref() {
                None => true,
                Some(why) => why.starts_with("prepared for cell"),
            };
            let free_slots = status.slots.iter().filter(room).count();
            self.drive(Input::PeerStatus { host: status.host, free_slots }, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<SessionCloseV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<SessionCloseV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            self.drive(Input::SessionClosed { session: env.msg.session }, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<SessionIdleV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<SessionIdleV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            tracing::info!(session = %env.msg.session, "session culled for idleness; stopping its kept workers");
            self.drive(Input::SessionIdle { session: env.msg.session }, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<InterruptV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<InterruptV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            self.drive(Input::Interrupt { session: env.msg.session, exec_id: env.msg.exec_id }, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<EvictV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<EvictV1>, Rejected>, ctx: &mut Self::Context) {
        if let Ok(env) = item {
            tracing::debug!(worker = %env.msg.worker, reason = %env.msg.reason, "eviction asked");
            self.drive(Input::Evict { worker: env.msg.worker }, ctx);
        }
    }
}

impl StreamHandler<Result<Envelope<QueryV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<QueryV1>, Rejected>, _ctx: &mut Self::Context) {
        let bus = self.env.bus.clone();
        let env = match item {
            Ok(env) => env,
            Err(rejected) => {
                actix::spawn(async move { rejected.answer::<QueryAnswerV1>(&bus).await });
                return;
            }
        };
        let worker = self.core.cpu_worker(env.msg.session).and_then(|id| self.workers.get(id).cloned());
        let to = env.reply_to();
        actix::spawn(async move {
            let reply = query_cpu_worker(worker, env.msg).await;
            if let Err(e) = bus.respond(to, &reply).await {
                tracing::warn!(error = %e, "could not answer a query");
            }
        });
    }
}

impl StreamHandler<Result<Envelope<CommV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<CommV1>, Rejected>, _ctx: &mut Self::Context) {
        let bus = self.env.bus.clone();
        let env = match item {
            Ok(env) => env,
            Err(rejected) => {
                actix::spawn(async move { rejected.answer::<CommAnswerV2>(&bus).await });
                return;
            }
        };
        let worker = self.core.cpu_worker(env.msg.session).and_then(|id| self.workers.get(id).cloned());
        let to = env.reply_to();
        actix::spawn(async move {
            let reply = comm_cpu_worker(worker, env.msg).await;
            if let Err(e) = bus.respond(to, &reply).await {
                tracing::warn!(error = %e, "could not answer a comm message");
            }
        });
    }
}

impl StreamHandler<Result<Envelope<InputReplyV1>, Rejected>> for Host {
    fn handle(&mut self, item: Result<Envelope<InputReplyV1>, Rejected>, _ctx: &mut Self::Context) {
        if let Ok(env) = item {
            self.env.inputs.deliver(env.msg);
        }
    }
}
