//! A session's event stream as the client reads it: Server-Sent Events split into
//! events ([`SseParser`]), and each [`StreamItem`] delivered once across
//! reconnections ([`read_items`], [`StreamPosition`]).

use crate::api::StreamItem;
use uuid::Uuid;

/// One Server-Sent Event: its id (if it had one) and its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The `id` field.
    pub id: Option<String>,
    /// The `data` lines, joined with `\n`.
    pub data: String,
}

/// Splits a Server-Sent Events byte stream into events.
///
/// Feed it chunks as they arrive; it returns every complete event (multi-line data
/// joined with `\n`). Comments (`:` lines, keep-alives) and other fields are ignored.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    id: Option<String>,
    data: Vec<String>,
}

impl SseParser {
    /// An empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add bytes; returns each event they completed.
    pub fn push_events(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        // what the buffer held has no line end (each push takes every whole
        // line), so only the new bytes are searched: a megabyte's line arriving
        // in many chunks is not searched again with each
        let mut search = self.buf.len();
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        let mut start = 0;
        // memchr and a strict UTF-8 check first: a cell's megabyte of output is
        // one data line, and a byte-at-a-time scan and a lossy decode of it were
        // a fifth of the kernel's time per output
        while let Some(offset) = memchr::memchr(b'\n', &self.buf[search..]) {
            let end = search + offset;
            let raw = &self.buf[start..end];
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            let line = match std::str::from_utf8(raw) {
                Ok(text) => std::borrow::Cow::Borrowed(text),
                Err(_) => String::from_utf8_lossy(raw),
            };
            (start, search) = (end + 1, end + 1);
            let field =
                |name: &str| line.strip_prefix(name).map(|rest| rest.strip_prefix(' ').unwrap_or(rest).to_string());
            if line.is_empty() {
                if !self.data.is_empty() {
                    let data =
                        if self.data.len() == 1 { self.data.pop().unwrap_or_default() } else { self.data.join("\n") };
                    events.push(SseEvent { id: self.id.take(), data });
                    self.data.clear();
                }
            } else if let Some(data) = field("data:") {
                self.data.push(data);
            } else if let Some(id) = field("id:") {
                self.id = Some(id);
            }
        }
        self.buf.drain(..start);
        events
    }

    /// Add bytes; returns the data of each event they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.push_events(bytes).into_iter().map(|e| e.data).collect()
    }
}

/// Where a reader of a session's event stream is, across reconnections: the last
/// event id seen, and a hash of every item delivered, so that items a frontend
/// replays after a reconnection (all of them, if it adopted the session from
/// another frontend) reach the caller once.
#[derive(Debug, Default)]
pub struct StreamPosition {
    /// The last event id seen (sent as `Last-Event-ID` when reconnecting).
    pub last_id: Option<String>,
    delivered: std::collections::HashSet<u64>,
    /// Outputs delivered, by (execution, seq): a frontend that adopted the session
    /// replays them.
    outputs: std::collections::HashSet<(Uuid, u64)>,
    /// Executions whose Done was delivered: one outcome each, even if a frontend
    /// that adopted a run decided it again in other words.
    done: std::collections::HashSet<Uuid>,
}

impl StreamPosition {
    fn first_time(&mut self, item: &StreamItem, data: &str) -> bool {
        use std::hash::{Hash as _, Hasher as _};
        match item {
            StreamItem::Output { exec_id, seq, .. } => self.outputs.insert((*exec_id, *seq)),
            StreamItem::Done { exec_id, .. } => self.done.insert(*exec_id),
            _ => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                data.hash(&mut h);
                self.delivered.insert(h.finish())
            }
        }
    }
}

/// A stream that carries nothing, not even a keep-alive (sent every 5 s), for this
/// long is taken for broken (a frontend's machine gone without closing it).
pub const STREAM_SILENCE: std::time::Duration = std::time::Duration::from_secs(15);

/// Read one connection's event stream (the body of `GET …/events`, as byte
/// chunks), sending each item not delivered before to `tx` and noting where it
/// is in `pos`. Returns true if the receiver went away (stop), false if the stream
/// ended or broke (the caller may reconnect). An item that does not parse is
/// logged and skipped.
pub async fn read_items<B, E>(
    mut body: impl futures::Stream<Item = Result<B, E>> + Unpin,
    tx: &tokio::sync::mpsc::UnboundedSender<StreamItem>,
    pos: &mut StreamPosition,
) -> bool
where
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    use futures::StreamExt as _;
    let mut parser = SseParser::new();
    loop {
        // a reader nobody reads from any more lets go of the connection at once
        // (the frontend counts a session with a connected client as watched)
        let chunk = tokio::select! {
            chunk = tokio::time::timeout(STREAM_SILENCE, body.next()) => chunk,
            () = tx.closed() => return true,
        };
        let chunk = match chunk {
            Err(_) => {
                tracing::warn!("event stream silent for {STREAM_SILENCE:?}; reconnecting");
                return false;
            }
            Ok(chunk) => chunk,
        };
        let chunk = match chunk {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "event stream broke");
                return false;
            }
            None => return false,
        };
        for event in parser.push_events(chunk.as_ref()) {
            if event.id.is_some() {
                pos.last_id = event.id;
            }
            match serde_json::from_str::<StreamItem>(&event.data) {
                Ok(item) => {
                    if !pos.first_time(&item, &event.data) {
                        continue;
                    }
                    if tx.send(item).is_err() {
                        return true;
                    }
                }
                Err(e) => tracing::warn!(error = %e, data = %event.data, "unreadable stream item"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_splits_events_across_chunks() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\n: keep-alive\n\ndata: x\r\ndata: y\n\n"), vec!["{\"a\":1}", "x\ny"]);
        let events = p.push_events(b"id: 7\ndata: a\n\ndata: b\n\n");
        assert_eq!(events[0], SseEvent { id: Some("7".into()), data: "a".into() });
        assert_eq!(events[1], SseEvent { id: None, data: "b".into() });
        // a long line in small chunks, its end split from its `\r`, then the next
        let line = "x".repeat(100_000);
        let stream = format!("id: 8\ndata: {line}\r\n\r\ndata: after\n\n");
        let mut got = Vec::new();
        for chunk in stream.as_bytes().chunks(997) {
            got.extend(p.push_events(chunk));
        }
        assert_eq!(
            got,
            vec![SseEvent { id: Some("8".into()), data: line }, SseEvent { id: None, data: "after".into() }]
        );
        // a line that is not UTF-8 is read as lossily as before
        assert_eq!(p.push(b"data: a\xffb\n\n"), vec!["a\u{FFFD}b"]);
    }

    /// A frontend that adopted a session replays what the client saw, and may
    /// decide an outcome again in other words: each output and each Done once.
    #[tokio::test]
    async fn replayed_items_reach_the_caller_once() {
        let exec = Uuid::now_v7();
        let out = |text: &str| {
            format!("data: {{\"type\":\"output\",\"exec_id\":\"{exec}\",\"seq\":0,\"output\":{{\"output_type\":\"stream\",\"name\":\"stdout\",\"text\":\"{text}\"}}}}\n\n")
        };
        let done = |e: &str| {
            format!("data: {{\"type\":\"done\",\"exec_id\":\"{exec}\",\"status\":\"failed\",\"after_revision\":1,\"unix_ms\":5,\"error\":\"{e}\"}}\n\n")
        };
        let chunks: Vec<Result<Vec<u8>, String>> =
            [out("a"), done("lost"), out("a"), done("lost (again, in other words)")].map(|c| Ok(c.into_bytes())).into();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut pos = StreamPosition::default();
        assert!(!read_items(futures::stream::iter(chunks), &tx, &mut pos).await, "the stream ended");
        drop(tx);
        let mut got = Vec::new();
        while let Some(item) = rx.recv().await {
            got.push(item);
        }
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(matches!(&got[1], StreamItem::Done { error: Some(e), .. } if e == "lost"));
    }
}
