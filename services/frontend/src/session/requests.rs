//! What HTTP handlers ask of a session besides runs: an edit's sequence number,
//! an answer to `input()`, its CPU host, how long it has been idle, its
//! summary, where its runs are, its detaching, reverting its state (undo,
//! checkout), and its close.

use std::time::{Duration, Instant};

use actix::prelude::*;
use schemas::messages::{EditV1, InputReplyV1, RevertTo, RevertV1, SessionCloseV1, StateMovedV1};
use schemas::subjects::StoreVerb;
use uuid::Uuid;

use super::current::RunState;
use super::SessionActor;

/// Assign the next edit sequence number of a cell; the caller publishes the edit.
#[derive(Message)]
#[rtype(result = "EditV1")]
pub struct Edit {
    /// The cell.
    pub cell_id: String,
    /// Its full code.
    pub code: String,
}

impl Handler<Edit> for SessionActor {
    type Result = MessageResult<Edit>;

    fn handle(&mut self, msg: Edit, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let seq = self.edit_seq.entry(msg.cell_id.clone()).or_insert(0);
        *seq += 1;
        let seq = *seq;
        let mut options = self.stored.options.clone();
        options.speculate &= !self.gpu_day_used_up();
        MessageResult(EditV1 { session: self.sid, cell_id: msg.cell_id, code: msg.code, seq, options })
    }
}

/// The user's answer to the running cell's input request.
#[derive(Message)]
#[rtype(result = "Result<(InputReplyV1, Option<String>), String>")]
pub struct Input {
    /// The execution that asked.
    pub exec_id: Uuid,
    /// What the user typed.
    pub value: String,
}

impl Handler<Input> for SessionActor {
    /// The reply, and the host that claimed the run if this frontend heard which.
    type Result = Result<(InputReplyV1, Option<String>), String>;

    fn handle(&mut self, msg: Input, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        match self.current.as_mut() {
            Some(cur) if cur.exec_id == msg.exec_id && cur.asking && cur.ended().is_none() => {
                cur.asking = false;
                let reply = InputReplyV1 { session: self.sid, exec_id: msg.exec_id, value: msg.value, refused: None };
                Ok((reply, cur.host().map(str::to_string)))
            }
            _ => Err(format!("execution {} of this session is not waiting for input", msg.exec_id)),
        }
    }
}

/// The host that keeps the session's CPU worker, if a CPU cell ran.
#[derive(Message)]
#[rtype(result = "Option<String>")]
pub struct CpuHost;

impl Handler<CpuHost> for SessionActor {
    type Result = Option<String>;

    fn handle(&mut self, _msg: CpuHost, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        self.cpu_host.clone()
    }
}

/// How long the session has been idle: nothing running or queued, no client
/// watching its events, no request; None while it is not idle.
#[derive(Message)]
#[rtype(result = "Option<Duration>")]
pub struct IdleFor;

impl Handler<IdleFor> for SessionActor {
    type Result = Option<Duration>;

    fn handle(&mut self, _msg: IdleFor, _ctx: &mut Self::Context) -> Self::Result {
        // as Jupyter's culler by default: a session someone watches is not idle
        self.clients.retain(|c| !c.tx.is_closed());
        let busy = self.current.is_some() || !self.stored.queued.is_empty() || !self.clients.is_empty();
        (!busy).then(|| self.last_active.elapsed())
    }
}

/// Whether the session's workers should be given back now: it has been idle
/// (nothing running or queued, no request; clients may watch) for `after`, and
/// they were not given back since it was last active. Answers how long it was
/// idle, and counts them as given back.
#[derive(Message)]
#[rtype(result = "Option<Duration>")]
pub struct FreeIdleWorkers {
    /// How long idle.
    pub after: Duration,
}

impl Handler<FreeIdleWorkers> for SessionActor {
    type Result = Option<Duration>;

    fn handle(&mut self, msg: FreeIdleWorkers, _ctx: &mut Self::Context) -> Self::Result {
        let busy = self.current.is_some() || !self.stored.queued.is_empty() || self.closing;
        let idle = self.last_active.elapsed();
        let freed_since = self.workers_freed_at.is_some_and(|at| at >= self.last_active);
        if busy || idle < msg.after || freed_since {
            return None;
        }
        self.workers_freed_at = Some(Instant::now());
        Some(idle)
    }
}

/// The session's summary.
#[derive(Message)]
#[rtype(result = "crate::api::SessionSummary")]
pub struct Summary;

impl Handler<Summary> for SessionActor {
    type Result = MessageResult<Summary>;

    fn handle(&mut self, _msg: Summary, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        MessageResult(crate::api::SessionSummary {
            session_id: self.sid,
            cwd: self.stored.options.cwd.clone(),
            all_gpu: self.stored.options.all_gpu,
            revision: self.stored.revision,
            current: self.current.as_ref().map(|c| c.exec_id),
            queue: self.stored.queued.iter().map(|p| p.exec_id).collect(),
            executions: self.executions.clone(),
        })
    }
}

/// Where this session's runs are, for the `looseleaf_runs` gauge: the demand on
/// GPU hosts an autoscaler reads.
#[derive(Message)]
#[rtype(result = "RunCounts")]
pub struct CountRuns;

/// A session's runs by where they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunCounts {
    /// Accepted, behind another run of the session.
    pub queued: u64,
    /// Sent, and no host holds it yet: demand not met.
    pub unclaimed: u64,
    /// A host holds it (running, or saving its state).
    pub running: u64,
}

impl std::ops::AddAssign for RunCounts {
    fn add_assign(&mut self, other: Self) {
        self.queued += other.queued;
        self.unclaimed += other.unclaimed;
        self.running += other.running;
    }
}

impl Handler<CountRuns> for SessionActor {
    type Result = MessageResult<CountRuns>;

    fn handle(&mut self, _msg: CountRuns, _ctx: &mut Self::Context) -> Self::Result {
        let mut counts = RunCounts { queued: self.stored.queued.len() as u64, ..RunCounts::default() };
        match self.current.as_ref().map(|c| &c.state) {
            Some(RunState::Unclaimed) => counts.unclaimed = 1,
            Some(RunState::Claimed { .. }) => counts.running = 1,
            Some(RunState::Ended(_)) | None => {}
        }
        MessageResult(counts)
    }
}

/// Detach the session (its client is gone, its kernel shut down or it idled
/// unwatched): its record is written marked detached now. A run in flight or
/// queued goes on (the frontend that adopts the session follows it). The caller
/// closes the actor once the record landed.
#[derive(Message)]
#[rtype(result = "Option<Detached>")]
pub struct Detach {
    /// Only if it is still idle and unwatched (the culler's detach: a run or a
    /// client may have come since it looked); None if not. None too while an
    /// undo or checkout waits for the store.
    pub only_if_idle: bool,
}

/// What [`Detach`] did.
#[derive(Debug)]
pub struct Detached {
    /// When (unix ms).
    pub unix_ms: u64,
    /// A run was in flight or queued.
    pub busy: bool,
    /// Hears once the record marked detached landed.
    pub landed: tokio::sync::oneshot::Receiver<()>,
}

impl Handler<Detach> for SessionActor {
    type Result = MessageResult<Detach>;

    fn handle(&mut self, msg: Detach, _ctx: &mut Self::Context) -> Self::Result {
        self.clients.retain(|c| !c.tx.is_closed());
        let busy = self.current.is_some() || !self.stored.queued.is_empty();
        // an undo or checkout under way lands first (its revision goes in the record)
        if self.reverting || (msg.only_if_idle && (busy || !self.clients.is_empty())) {
            return MessageResult(None);
        }
        let unix_ms = schemas::unix_ms();
        self.stored.detached_unix_ms = Some(unix_ms);
        let (tx, landed) = tokio::sync::oneshot::channel();
        self.write_record(Some(tx));
        MessageResult(Some(Detached { unix_ms, busy, landed }))
    }
}

/// Move the session's state to an earlier revision's (undo, checkout) while
/// nothing of it runs: a run sent meanwhile waits until the store answered.
/// Once moved, every worker holding the state it left is stopped (the hosts and
/// the planner hear the session's close); its next cell restores the new state.
#[derive(Message)]
#[rtype(result = "Result<StateMovedV1, Refused>")]
pub struct Revert {
    /// Which state.
    pub to: RevertTo,
}

/// Why a [`Revert`] did not happen.
#[derive(Debug)]
pub enum Refused {
    /// A cell runs or waits, or another revert is under way: try after it.
    Busy(String),
    /// The store refused it, or did not answer.
    Store(schemas::BusError),
}

impl Handler<Revert> for SessionActor {
    type Result = ResponseActFuture<Self, Result<StateMovedV1, Refused>>;

    fn handle(&mut self, msg: Revert, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let busy = if self.closing {
            Some("the session is closing")
        } else if self.reverting {
            Some("another undo or checkout of this session is under way")
        } else if self.current.is_some() || !self.stored.queued.is_empty() {
            Some("a cell of this session is running or queued; try again once it ends")
        } else {
            None
        };
        if let Some(why) = busy {
            return Box::pin(actix::fut::ready(Err(Refused::Busy(why.into()))));
        }
        self.reverting = true;
        let (bus, sid) = (self.shared.bus.clone(), self.sid);
        let ask = RevertV1 { session: sid, base_revision: self.stored.revision, to: msg.to };
        let asked = async move {
            let answer =
                bus.request::<_, StateMovedV1>(bus.subjects().store(StoreVerb::Revert), &ask, super::STORE_WAIT).await;
            // the workers' state is not the session's any more (or may not be: a
            // revert that went unanswered may have landed): they stop before any
            // run held meanwhile is sent
            if !matches!(answer, Err(schemas::BusError::Remote { .. })) {
                let closed = async {
                    bus.publish(bus.subjects().close(sid), &SessionCloseV1 { session: sid }).await?;
                    bus.flush().await
                };
                if let Err(e) = closed.await {
                    tracing::warn!(session = %sid, error = %e, "could not stop the workers of a reverted session");
                }
            }
            answer
        };
        Box::pin(asked.into_actor(self).map(|answer, act, ctx| {
            act.reverting = false;
            match &answer {
                // a session being deleted keeps no record
                Ok(moved) if !act.closing => {
                    act.stored.revision = moved.revision;
                    act.write_record(None);
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(session = %act.sid, error = %e, "the session's state did not move"),
            }
            act.start_next(ctx);
            answer.map_err(Refused::Store)
        }))
    }
}

/// The session is being deleted: stop running, relay late events for `grace`
/// (slot releases at close), then end every client stream and stop.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Close {
    /// How long to keep relaying.
    pub grace: Duration,
}

impl Handler<Close> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: Close, ctx: &mut Self::Context) {
        self.closing = true;
        self.stored.queued.clear();
        ctx.run_later(msg.grace, |act, ctx| {
            act.clients.clear();
            ctx.stop();
        });
    }
}
