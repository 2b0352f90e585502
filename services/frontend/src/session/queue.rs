//! Run admission and the run queue: runs accepted (code kept in the record, or
//! put aside when it has no room), withdrawn or aborted, and the next one sent
//! to the planner once nothing runs; interrupts abort the queue.

use std::collections::BTreeMap;
use std::time::Instant;

use actix::prelude::*;
use schemas::messages::RunV3;
use tracing::Instrument as _;
use uuid::Uuid;

use super::current::Current;
use super::{ExecRecord, SessionActor, RECORD_WAIT};
use crate::api::{ExecStatus, Interrupted, StreamItem};
use crate::records::{InFlight, QueuedRun, RECORD_INLINE_BYTES};

impl SessionActor {
    /// Runs taken out of the queue kept their code aside under `aside`: delete it
    /// once the record without them landed (until then a frontend that adopts the
    /// session would read it back). What is not deleted expires with the bucket.
    fn forget_aside(&mut self, aside: Vec<String>) {
        let (ack_tx, ack_rx) = tokio::sync::oneshot::channel();
        self.write_record(Some(ack_tx));
        let bodies = self.shared.bodies.clone();
        tokio::spawn(async move {
            if ack_rx.await.is_ok() {
                for header in aside {
                    bodies.delete(&header).await;
                }
            }
        });
    }

    /// End queued run `exec_id` (taken out of the queue) without running it.
    fn abort(&mut self, exec_id: Uuid, reason: String) {
        self.traces.remove(&exec_id);
        schemas::metrics::metrics().cells.get_or_create(&[("status", ExecStatus::Aborted.as_str())]).inc();
        let error = Some(reason);
        if let Some(r) = self.record(exec_id) {
            r.status = ExecStatus::Aborted;
            r.error = error.clone();
        }
        let after_revision = self.stored.revision;
        self.emit(&StreamItem::Done {
            exec_id,
            status: ExecStatus::Aborted,
            after_revision,
            unix_ms: schemas::unix_ms(),
            error,
        });
    }

    /// Send the next queued run to the planner if nothing is running.
    pub(super) fn start_next(&mut self, ctx: &mut Context<Self>) {
        if self.current.is_some() || self.closing || self.reverting {
            return;
        }
        let Some(p) = self.stored.queued.pop_front() else { return };
        // a run adopted from the record has only the reference to its code kept aside
        let read_back = p.aside.clone().filter(|_| p.code_elsewhere());
        let aside = p.aside.clone();
        let run = RunV3 {
            session: self.sid,
            exec_id: p.exec_id,
            cell_id: p.cell_id.clone(),
            code: p.code,
            run_unix_ms: p.run_unix_ms,
            after_revision: self.stored.revision,
            options: self.stored.options.clone(),
            user_expressions: p.user_expressions,
            gpu_refused: self.gpu_refusal(p.exec_id),
        };
        self.current = Some(Current::new(p.exec_id, p.allow_stdin, self.connects()));
        self.log.follow(p.exec_id);
        if let Some(r) = self.record(p.exec_id) {
            r.status = ExecStatus::Running;
        }
        let exec_id = p.exec_id;
        // recorded (out of the queue, in flight) before it is sent: a frontend that
        // adopts the session follows it
        self.stored.in_flight = Some(InFlight {
            exec_id,
            cell_id: p.cell_id.clone(),
            run_unix_ms: p.run_unix_ms,
            allow_stdin: p.allow_stdin,
        });
        let (ack_tx, ack_rx) = tokio::sync::oneshot::channel();
        self.write_record(Some(ack_tx));
        let (bus, bodies) = (self.shared.bus.clone(), self.shared.bodies.clone());
        let subject = bus.subjects().run(self.sid);
        tracing::info!(session = %self.sid, exec = %exec_id, cell = %p.cell_id, after_revision = self.stored.revision, "run sent");
        let span = self.traces.get(&exec_id).cloned().unwrap_or_else(tracing::Span::none);
        // a planner that is still starting gets it once it listens; past half the
        // claim timeout the user reads that no planner runs, not that no host took it
        let patience = self.shared.timeouts.claim / 2;
        let send = async move {
            if !matches!(tokio::time::timeout(RECORD_WAIT, ack_rx).await, Ok(Ok(()))) {
                let why = format!("the session's record could not be written within {RECORD_WAIT:?}");
                return Err(format!("could not send the run to the planner: {why}"));
            }
            let mut run = run;
            if let Some(header) = &read_back {
                match crate::records::read_aside(&bodies, header).await {
                    Ok(kept) => {
                        run.code = kept.code;
                        run.user_expressions = kept.user_expressions;
                    }
                    Err(e) => {
                        bodies.delete(header).await;
                        return Err(format!("the cell did not run: its code, kept for its turn, is lost ({e})"));
                    }
                }
            }
            let sent = bus.deliver(subject, &run, patience).await;
            // the record names the run in flight now: nobody reads its code back
            if let Some(header) = &aside {
                bodies.delete(header).await;
            }
            sent.map_err(|e| format!("could not send the run to the planner: {e}"))
        }
        .instrument(span);
        ctx.spawn(send.into_actor(self).map(move |res, act, ctx| {
            if let Err(e) = res {
                // the client may still deliver it after a reconnect: make sure no
                // host runs it before saying it did not run
                tracing::error!(error = %e, exec = %exec_id, "could not send the run");
                act.abandon_unclaimed(exec_id, e, ctx);
            }
        }));
        self.arm_deadlines(exec_id, ctx);
    }
}

/// Queue a run: it is accepted, or handed back to have its code put aside first
/// (see [`RunAnswer`]); or the queue takes no more.
#[derive(Message)]
#[rtype(result = "Result<RunAnswer, QueueFull>")]
pub struct Run {
    /// The cell.
    pub cell_id: String,
    /// The code submitted with Run.
    pub code: String,
    /// When the request was received (unix ms).
    pub run_unix_ms: u64,
    /// The client answers the cell's input requests.
    pub allow_stdin: bool,
    /// Jupyter's `user_expressions`, evaluated after the cell.
    pub user_expressions: BTreeMap<String, String>,
    /// The root span of the cell's trace; it ends with the execution.
    pub span: tracing::Span,
    /// Where the code and user expressions were put aside
    /// ([`crate::records::put_aside`]), when the session's record had no room for
    /// them: the record names them by this.
    pub aside: Option<String>,
}

/// What became of a run handed to its session.
pub enum RunAnswer {
    /// Queued (or sent at once): its execution, its place in the queue, and a
    /// receiver that hears once the run is in the session's record (answer the
    /// client only then: a run accepted is never lost with this frontend).
    Accepted {
        /// The execution.
        exec_id: Uuid,
        /// How many runs are before it (the running one included).
        position: usize,
        /// Hears once the record holding the run landed.
        recorded: tokio::sync::oneshot::Receiver<()>,
    },
    /// It waits behind another and the session's record has no room for its code:
    /// put the code aside ([`crate::records::put_aside`]) and hand it again with
    /// `aside` set. Nothing was queued.
    PutAside(Box<Run>),
}

/// Why a run was not queued.
#[derive(Debug, thiserror::Error)]
pub enum QueueFull {
    /// As many runs wait as allowed.
    #[error("the session has {0} runs queued, the most allowed; wait or interrupt")]
    Runs(usize),
}

impl Handler<Run> for SessionActor {
    type Result = MessageResult<Run>;

    fn handle(&mut self, msg: Run, ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let queued = &self.stored.queued;
        if queued.len() >= self.shared.queued_runs {
            return MessageResult(Err(QueueFull::Runs(queued.len())));
        }
        // a run that starts at once is not kept with its code; one that waits is,
        // in the record while there is room and aside past that
        let waits = self.current.is_some() || self.closing || !queued.is_empty();
        if waits && msg.aside.is_none() {
            let held = queued.iter().map(QueuedRun::recorded_bytes).sum::<usize>();
            let this = crate::records::inline_bytes(&msg.code, &msg.user_expressions);
            if held.saturating_add(this) > RECORD_INLINE_BYTES {
                return MessageResult(Ok(RunAnswer::PutAside(Box::new(msg))));
            }
        }
        let exec_id = Uuid::now_v7();
        msg.span.record("looseleaf.exec_id", tracing::field::display(exec_id));
        self.traces.insert(exec_id, msg.span);
        let position = queued.len() + usize::from(self.current.is_some());
        self.executions.push(ExecRecord {
            exec_id,
            cell_id: msg.cell_id.clone(),
            run_unix_ms: msg.run_unix_ms,
            status: ExecStatus::Queued,
            after_revision: None,
            error: None,
        });
        self.emit(&StreamItem::Queued { exec_id, cell_id: msg.cell_id.clone(), run_unix_ms: msg.run_unix_ms });
        self.stored.queued.push_back(QueuedRun {
            exec_id,
            cell_id: msg.cell_id,
            code: msg.code,
            run_unix_ms: msg.run_unix_ms,
            allow_stdin: msg.allow_stdin,
            user_expressions: msg.user_expressions,
            aside: msg.aside,
        });
        // (sent at once, code put aside is deleted once the run is in flight)
        self.start_next(ctx);
        let (ack_tx, ack_rx) = tokio::sync::oneshot::channel();
        self.write_record(Some(ack_tx));
        MessageResult(Ok(RunAnswer::Accepted { exec_id, position, recorded: ack_rx }))
    }
}

/// Take back run `exec_id` if it still waits for its turn: its acceptance could
/// not be recorded, and its client is told it was not accepted. It ends aborted.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Withdraw {
    /// The run.
    pub exec_id: Uuid,
    /// Why.
    pub reason: String,
}

impl Handler<Withdraw> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: Withdraw, _ctx: &mut Self::Context) {
        let Some(at) = self.stored.queued.iter().position(|q| q.exec_id == msg.exec_id) else { return };
        let aside = self.stored.queued.remove(at).and_then(|q| q.aside);
        self.abort(msg.exec_id, msg.reason);
        match aside {
            Some(header) => self.forget_aside(vec![header]),
            None => self.write_record(None),
        }
    }
}

/// Interrupt the session: abort the queued runs and stop the current one.
#[derive(Message)]
#[rtype(result = "Interrupted")]
pub struct Interrupt;

impl Handler<Interrupt> for SessionActor {
    type Result = MessageResult<Interrupt>;

    fn handle(&mut self, _msg: Interrupt, ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let (mut aborted, mut aside) = (Vec::new(), Vec::new());
        for p in std::mem::take(&mut self.stored.queued) {
            self.abort(p.exec_id, "aborted: the session was interrupted before this cell's turn".to_string());
            aborted.push(p.exec_id);
            aside.extend(p.aside);
        }
        if !aborted.is_empty() && !self.closing {
            self.forget_aside(aside);
        }
        let Some(exec_id) = self.current.as_ref().filter(|c| c.ended().is_none()).map(|c| c.exec_id) else {
            return MessageResult(Interrupted { interrupted: None, aborted });
        };
        tracing::info!(session = %self.sid, exec = %exec_id, "interrupt");
        self.stop_current(exec_id, schemas::messages::INTERRUPTED_BEFORE_START.to_string(), ctx);
        MessageResult(Interrupted { interrupted: Some(exec_id), aborted })
    }
}
