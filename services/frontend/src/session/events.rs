//! The current run's events and outputs as they arrive: relayed once each (an
//! output in pieces gathered first), input requests asked of the client or
//! refused, and the run ended by its outcome event.

use actix::prelude::*;
use schemas::messages::{
    CellMessage, CellMessageError, EventKind, InputReplyV1, OutputBody, OutputV2, Prepare, SessionEventV2,
    MAX_OUTPUT_PIECES,
};
use schemas::subjects::HostVerb;
use uuid::Uuid;

use super::current::Finished;
use super::read_back::event_key;
use super::SessionActor;
use crate::api::{ExecStatus, StreamItem};

impl SessionActor {
    pub(super) fn on_event(&mut self, ctx: &mut Context<Self>, ev: SessionEventV2) {
        tracing::debug!(session = %self.sid, exec = %ev.exec_id, kind = ?ev.kind, "event");
        if let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == ev.exec_id) {
            if !cur.events.insert(event_key(&ev)) {
                return; // sent again, or read back, after it was relayed
            }
        }
        if let EventKind::Started { host, prepare, .. } = &ev.kind {
            if *prepare == Prepare::Persistent {
                self.cpu_host = Some(host.clone());
            }
            // Run is when the request arrived here (DESIGN.md section 10)
            let run_ms = self.record(ev.exec_id).map(|r| r.run_unix_ms);
            if let Some(run_ms) = run_ms.filter(|ms| *ms > 0) {
                let delay = &schemas::metrics::metrics().start_delay.get_or_create(&[("prepare", prepare.as_str())]);
                schemas::metrics::observe_ms(delay, ev.unix_ms.saturating_sub(run_ms) as f64);
            }
        }
        self.emit(&StreamItem::Event { exec_id: ev.exec_id, unix_ms: ev.unix_ms, event: (&ev.kind).into() });
        let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == ev.exec_id) else { return };
        // (Finished may be read back after the end: it tells the cell's status)
        let ended = cur.ended().is_some();
        let terminal = match ev.kind {
            _ if ended && !matches!(ev.kind, EventKind::Finished { .. }) => None,
            EventKind::Claimed { host, .. } => {
                if cur.claimed_by(host) {
                    let exec_id = cur.exec_id;
                    self.watch_host(exec_id, ctx);
                }
                return;
            }
            EventKind::Planned { .. } | EventKind::Started { .. } => None,
            EventKind::Finished { status, error, outputs, .. } => {
                cur.finished = Some(Finished { status, error, outputs });
                None
            }
            EventKind::Saved { revision, .. } => Some((ExecStatus::Ok, revision, None, true)),
            EventKind::Failed { error } => Some((ExecStatus::Failed, self.stored.revision, Some(error), false)),
            EventKind::SlotReleased { .. }
            | EventKind::Ready { .. }
            | EventKind::Preparing { .. }
            | EventKind::PreparedEnded { .. } => None,
        };
        if let Some((status, revision, error, saved)) = terminal {
            self.end_current(status, revision, error, ev.unix_ms, saved, ctx);
        }
    }

    /// The running cell called `input()`: its client is asked if it has a stdin
    /// channel; otherwise the cell is told at once, as ipykernel tells it.
    fn on_input_request(&mut self, exec_id: Uuid, seq: u64, output: CellMessage) {
        let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == exec_id && c.ended().is_none()) else {
            return; // replayed, or of a run that ended: nobody waits
        };
        if cur.allow_stdin {
            cur.asking = true;
            self.emit(&StreamItem::Output { exec_id, seq, output });
            return;
        }
        let refused = InputReplyV1 {
            session: self.sid,
            exec_id,
            value: String::new(),
            refused: Some(schemas::messages::NO_STDIN.into()),
        };
        let known = cur.host().map(str::to_string);
        let (bus, claims) = (self.shared.bus.clone(), self.shared.claims.clone());
        actix::spawn(async move {
            // the host that runs the cell asked: it holds the run's claim
            let host = match known {
                Some(host) => Some(host),
                None => super::settle::claim_holder(&claims, exec_id).await,
            };
            let Some(host) = host else {
                tracing::error!(exec = %exec_id, "no host holds the run that asked for input; the cell waits until interrupted");
                return;
            };
            let subject = bus.subjects().host_command(&host, HostVerb::Input);
            if let Err(e) = bus.publish(subject, &refused).await {
                tracing::error!(exec = %exec_id, error = %e, "could not refuse an input request; the cell waits until interrupted");
            }
        });
    }

    pub(super) fn on_output(&mut self, ctx: &mut Context<Self>, out: OutputV2) {
        if self.current.as_ref().is_some_and(|c| c.exec_id == out.exec_id && c.outputs.contains(&out.seq)) {
            return; // sent again, or read back, after it was relayed
        }
        // a gathered message's JSON text, which is its item's `output` as it stands
        let mut gathered = None;
        let message = match out.body {
            OutputBody::Whole(message) => Ok(message),
            OutputBody::Piece { part, parts, .. } if part >= parts || parts > MAX_OUTPUT_PIECES => {
                Err(CellMessageError::NotJson(format!("piece {part} of {parts}: no message has so many")))
            }
            OutputBody::Piece { part, parts, text } => {
                // a message too large for one bus message: gather its pieces first
                let key = (out.exec_id, out.seq);
                let pieces = self.pieces.entry(key).or_insert_with(|| vec![None; parts as usize]);
                if let Some(slot) = pieces.get_mut(part as usize) {
                    *slot = Some(text);
                }
                if pieces.iter().any(Option::is_none) {
                    return;
                }
                let text: String = self.pieces.remove(&key).unwrap_or_default().into_iter().flatten().collect();
                let message = CellMessage::from_json_text(&text);
                gathered = Some(text);
                message
            }
        };
        match message {
            Ok(ask @ CellMessage::InputRequest { .. }) => self.on_input_request(out.exec_id, out.seq, ask),
            Ok(output) => {
                let item = StreamItem::Output { exec_id: out.exec_id, seq: out.seq, output };
                match gathered {
                    // parsed above, so whole JSON: not written out again (a
                    // megabyte's escaping, for a large output)
                    Some(text) => self.emit_line(&item, StreamItem::output_line(out.exec_id, out.seq, &text)),
                    None => self.emit(&item),
                }
            }
            Err(e) => tracing::error!(exec = %out.exec_id, seq = out.seq, error = %e, "a cell message was dropped"),
        }
        if let Some(cur) = self.current.as_mut().filter(|c| c.exec_id == out.exec_id) {
            cur.outputs.insert(out.seq);
            self.maybe_complete(ctx);
        }
    }
}
