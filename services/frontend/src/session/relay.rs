//! The relay of stream items to SSE clients: each item kept in the replay log
//! and sent to the clients attached, which get what they did not see first.

use std::time::Instant;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::SessionActor;
use crate::api::StreamItem;
use crate::resume::{self, Position};

/// An SSE client of the session: where it resumed from, and its channel.
pub(super) struct Watcher {
    reader: resume::Reader,
    pub(super) tx: mpsc::UnboundedSender<resume::Sent>,
}

impl SessionActor {
    pub(super) fn emit(&mut self, item: &StreamItem) {
        match serde_json::to_string(item) {
            Ok(line) => self.emit_line(item, line),
            Err(e) => tracing::error!(error = %e, "cannot encode a stream item"),
        }
    }

    /// Emit `item` as `line`, its JSON (written already: see
    /// `StreamItem::output_line`).
    pub(super) fn emit_line(&mut self, item: &StreamItem, line: String) {
        self.shared.dashboard.observe(self.sid, item);
        self.meter(item);
        let incarnation = self.log.incarnation();
        let Some(entry) = self.log.push(item, line) else { return };
        self.clients.retain(|c| {
            // a client that resumed from another incarnation skips what it saw there
            if !c.reader.wants(entry) {
                return !c.tx.is_closed();
            }
            c.tx.send((c.reader.id(incarnation, entry), entry.line.clone())).is_ok()
        });
    }
}

/// Attach an SSE client: the items kept that it did not see (after `last`, the
/// last id it saw; all kept if None), then a channel of the items to come. Each
/// item is (SSE id, JSON line); see [`crate::resume`].
#[derive(Message)]
#[rtype(result = "(Vec<resume::Sent>, mpsc::UnboundedReceiver<resume::Sent>)")]
pub struct Attach {
    /// The last id the client saw (`Last-Event-ID`).
    pub last: Option<Position>,
}

impl Handler<Attach> for SessionActor {
    type Result = MessageResult<Attach>;

    fn handle(&mut self, msg: Attach, _ctx: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = self.log.reader(msg.last);
        if !self.closing {
            self.clients.push(Watcher { reader, tx });
        }
        MessageResult((self.log.replay(&reader), rx))
    }
}
