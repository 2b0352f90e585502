//! What a session reads back from the events and outputs streams (ADR 55): a
//! run it adopts from a frontend that went away (its record names it in
//! flight), and a run whose messages it may have missed (its NATS connection
//! was lost meanwhile, or the run ended with outputs or Finished unheard). The
//! hosts' messages are kept by those streams (`Bus::send_kept`); a copy heard
//! live and read back is relayed once.

use actix::prelude::*;
use schemas::messages::{OutputBody, OutputV2, SessionEventV2};
use schemas::Bus;
use uuid::Uuid;

use super::current::Current;
use super::settle::HOST_CHECK;
use super::{ExecRecord, SessionActor};
use crate::api::{ExecStatus, StreamItem};
use crate::records::InFlight;

/// How far back a frontend that adopts a run in flight reads the streams, before
/// the run was pressed (clocks of machines differ).
const ADOPT_CLOCK_SKEW_MS: u64 = 60_000;

impl SessionActor {
    /// While `exec_id` is current, read back what it sent whenever this
    /// frontend's NATS connection was lost meanwhile.
    pub(super) fn watch_connection(&mut self, exec_id: Uuid, ctx: &mut Context<Self>) {
        self.run_later_for("connection check", HOST_CHECK, ctx, move |act, ctx| {
            if act.current.as_ref().is_some_and(|c| c.exec_id == exec_id) {
                act.read_back_if_reconnected(exec_id, ctx);
                act.watch_connection(exec_id, ctx);
            }
        });
    }

    /// How many times this frontend has connected to NATS.
    pub(super) fn connects(&self) -> u64 {
        self.shared.bus.client().statistics().connects.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Read back what the current execution `exec_id` sent if this frontend
    /// reconnected to NATS since it last heard everything.
    fn read_back_if_reconnected(&mut self, exec_id: Uuid, ctx: &mut Context<Self>) {
        let connects = self.connects();
        let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == exec_id && connects > c.connects) else {
            return;
        };
        cur.connects = connects;
        self.read_back(exec_id, ctx);
    }

    /// Read back from the streams what the current execution `exec_id` sent and
    /// this frontend did not hear (NATS, or its connection, restarted
    /// meanwhile; a host sends nothing twice on its own), then complete it with
    /// what there is if it ended.
    pub(super) fn read_back(&mut self, exec_id: Uuid, ctx: &mut Context<Self>) {
        let since = self.record(exec_id).map_or(0, |r| r.run_unix_ms).saturating_sub(ADOPT_CLOCK_SKEW_MS);
        let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == exec_id && !c.reading_back) else { return };
        cur.reading_back = true;
        let read = read_streams(self.shared.bus.clone(), self.sid, exec_id, since);
        ctx.spawn(read.into_actor(self).map(move |(events, outputs), act, ctx| {
            let Some(cur) = act.current.as_mut().filter(|c| c.exec_id == exec_id) else { return };
            cur.reading_back = false;
            // events first: Finished says how many outputs to expect
            for ev in events.unwrap_or_else(|e| warn_unread("events", exec_id, e)) {
                match ev {
                    Ok(ev) if ev.exec_id == exec_id => act.on_event(ctx, ev),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "a read-back event does not decode; skipped"),
                }
            }
            for out in outputs.unwrap_or_else(|e| warn_unread("outputs", exec_id, e)) {
                match out {
                    Ok(out) => act.on_output(ctx, out),
                    Err(e) => tracing::warn!(error = %e, "a read-back output does not decode; skipped"),
                }
            }
            if let Some(c) = act.current.as_ref().filter(|c| c.exec_id == exec_id && c.ended().is_some()) {
                if c.unheard() {
                    tracing::warn!(
                        exec = %exec_id,
                        expected = c.finished.as_ref().map_or(0, |f| f.outputs),
                        received = c.outputs.len(),
                        finished = c.finished.is_some(),
                        "what the execution sent is missing from its streams too; completing with what arrived"
                    );
                }
                act.complete_current(ctx);
            }
        }));
    }

    /// The session's record names a run in flight (its frontend went away while
    /// it ran): it is current here at once (nothing else is sent before it ends),
    /// and what it did so far is read back from the events and outputs streams
    /// before anything else is handled (the live subscriptions wait meanwhile, and
    /// what both deliver is relayed once). Then it ends as any run does: by its
    /// outcome event, host loss, or the claim timeout if no host ever took it.
    pub(super) fn adopt_in_flight(&mut self, run: InFlight, ctx: &mut Context<Self>) {
        let exec_id = run.exec_id;
        tracing::info!(session = %self.sid, exec = %exec_id, "adopting the run in flight from the session's record");
        self.executions.push(ExecRecord {
            exec_id,
            cell_id: run.cell_id.clone(),
            run_unix_ms: run.run_unix_ms,
            status: ExecStatus::Running,
            after_revision: None,
            error: None,
        });
        self.emit(&StreamItem::Queued { exec_id, cell_id: run.cell_id, run_unix_ms: run.run_unix_ms });
        self.current = Some(Current::new(exec_id, run.allow_stdin, self.connects()));
        self.log.follow(exec_id);
        let sid = self.sid;
        let since = run.run_unix_ms.saturating_sub(ADOPT_CLOCK_SKEW_MS);
        let read = read_streams(self.shared.bus.clone(), sid, exec_id, since);
        ctx.wait(read.into_actor(self).map(move |(events, outputs), act, ctx| {
            // outputs first: an execution that ends without Finished (its worker
            // lost) completes on its outcome event, and outputs after Done are dropped
            match outputs {
                Ok(msgs) => {
                    for m in msgs {
                        match m {
                            Ok(out) => {
                                act.replayed.insert(output_key(&out));
                                act.on_output(ctx, out);
                            }
                            Err(e) => tracing::warn!(error = %e, "a replayed output does not decode; skipped"),
                        }
                    }
                }
                Err(e) => tracing::warn!(session = %sid, error = %e, "could not replay the adopted run's outputs"),
            }
            match events {
                Ok(msgs) => {
                    for m in msgs {
                        match m {
                            Ok(ev) if ev.exec_id == exec_id => {
                                act.replayed.insert(event_key(&ev));
                                act.on_event(ctx, ev);
                            }
                            Ok(_) => {}
                            Err(e) => tracing::warn!(error = %e, "a replayed event does not decode; skipped"),
                        }
                    }
                }
                Err(e) => tracing::warn!(session = %sid, error = %e, "could not replay the adopted run's events"),
            }
            act.log.recovering(false);
            if act.current.as_ref().is_some_and(|c| c.exec_id == exec_id) {
                act.arm_deadlines(exec_id, ctx);
            }
        }));
    }

    /// Whether the live subscription delivers what the adoption replay already
    /// did (both can, for messages published around the adoption).
    pub(super) fn replayed_already(&mut self, key: impl FnOnce() -> String) -> bool {
        !self.replayed.is_empty() && self.replayed.remove(&key())
    }
}

pub(super) fn event_key(ev: &SessionEventV2) -> String {
    format!("{ev:?}")
}

pub(super) fn output_key(out: &OutputV2) -> String {
    let part = match &out.body {
        OutputBody::Whole(_) => 0,
        OutputBody::Piece { part, .. } => *part,
    };
    format!("output {} {} {part}", out.exec_id, out.seq)
}

/// Everything the events and outputs streams keep of execution `exec_id` of
/// session `sid` since `since` (unix ms), decoded, in order (events of the
/// session's other executions too).
async fn read_streams(
    bus: Bus,
    sid: Uuid,
    exec_id: Uuid,
    since: u64,
) -> (StreamRead<SessionEventV2>, StreamRead<OutputV2>) {
    let (js, s) = (bus.jetstream(), bus.subjects());
    let events = schemas::buckets::replay(&js, &s.events_stream(), &s.event(sid), since).await;
    let outputs = schemas::buckets::replay(&js, &s.outputs_stream(), &s.output(sid, exec_id), since).await;
    // decoded here: a message with a body (ADR 30) is fetched first
    let events = match events {
        Ok(msgs) => Ok(decode_all::<SessionEventV2>(&bus, &msgs).await),
        Err(e) => Err(e),
    };
    let outputs = match outputs {
        Ok(msgs) => Ok(decode_all::<OutputV2>(&bus, &msgs).await),
        Err(e) => Err(e),
    };
    (events, outputs)
}

/// Decode replayed stream messages, in order.
async fn decode_all<M: schemas::WireMessage>(
    bus: &Bus,
    msgs: &[async_nats::jetstream::Message],
) -> Vec<Result<M, schemas::CodecError>> {
    let mut decoded = Vec::with_capacity(msgs.len());
    for m in msgs {
        decoded.push(bus.decode::<M>(m.headers.as_ref(), &m.payload).await);
    }
    decoded
}

/// Nothing, after logging that `what` of `exec_id` could not be read back.
fn warn_unread<T>(what: &str, exec_id: Uuid, e: schemas::buckets::BucketError) -> Vec<T> {
    tracing::warn!(exec = %exec_id, error = %e, "could not read back the {what} of an execution");
    Vec::new()
}

/// What [`read_streams`] read of one stream.
type StreamRead<M> = Result<Vec<Result<M, schemas::CodecError>>, schemas::buckets::BucketError>;
