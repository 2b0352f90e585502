//! A session's stream items as it keeps them for readers, and where a reader is:
//! each item's SSE id, which the reader sends back as `Last-Event-ID` to resume
//! after it (ADR 53).
//!
//! An id names the incarnation of the session's actor that sent the item and the
//! item's number in it: a reader that resumes on the same incarnation gets exactly
//! what came after. An id also carries a [`Cursor`]: how far the reader got in the
//! session's runs, in terms every incarnation shares (execution ids, how many of
//! the followed run's events, which of its outputs, whether its Done). A frontend
//! that restarted, or adopted the session from another, emits again what it reads
//! back for the runs the session's record names (the run in flight and its events
//! and outputs so far, the queued runs); a reader resuming there with an id of an
//! earlier incarnation skips what its cursor says it saw. So a resumed stream never
//! repeats an item, and delivers the rest in the order the session emits them.
//!
//! An id is `{incarnation:x}.{n}.{queued}.{run}.{events}.{outputs}.{done}` (uuids
//! in their 32-digit form). A bare number (an id of a frontend from before this
//! format) names nothing this frontend can place: everything kept is replayed.

use std::cmp::Ordering;
use std::collections::VecDeque;

use uuid::Uuid;

use crate::api::StreamItem;

/// An item as sent to a reader: its SSE id and its JSON line.
pub type Sent = (String, String);

/// What an item is about, in the terms another incarnation of the session uses
/// for the same item when it emits it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemKey {
    /// Run `0` was accepted.
    Queued(Uuid),
    /// An event of execution `exec_id`, the `index`th (from 0) relayed for it.
    Event {
        /// The execution (nil for session-wide events).
        exec_id: Uuid,
        /// Its place among the execution's events.
        index: u64,
    },
    /// Output `seq` of execution `exec_id`.
    Output {
        /// The execution.
        exec_id: Uuid,
        /// The output's sequence number.
        seq: u64,
    },
    /// Execution `0` is done.
    Done(Uuid),
}

/// How far a reader got in the session's runs: what every incarnation of the
/// session can compare with what it emits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    /// The newest run whose Queued item came (nil: none). Runs are queued in the
    /// order of their ids (uuid v7).
    pub queued: Uuid,
    /// The run followed: the one sent (or adopted in flight) last (nil: none).
    pub run: Uuid,
    /// How many of `run`'s events came.
    pub events: u64,
    /// `run`'s outputs that came: those numbered below this.
    pub outputs: u64,
    /// Whether `run`'s Done came.
    pub done: bool,
}

impl Cursor {
    fn follows(&self, exec_id: Uuid) -> bool {
        !self.run.is_nil() && exec_id == self.run
    }

    /// Run `exec_id` is sent, or adopted in flight: it is the one followed now.
    pub fn follow(&mut self, exec_id: Uuid) {
        if self.run != exec_id {
            *self = Cursor { queued: self.queued, run: exec_id, ..Cursor::default() };
        }
    }

    /// The cursor after item `key`.
    pub fn pass(&mut self, key: &ItemKey) {
        match *key {
            ItemKey::Queued(exec_id) => self.queued = self.queued.max(exec_id),
            ItemKey::Event { exec_id, index } if self.follows(exec_id) => {
                self.events = self.events.max(index.saturating_add(1));
            }
            ItemKey::Output { exec_id, seq } if self.follows(exec_id) => {
                self.outputs = self.outputs.max(seq.saturating_add(1));
            }
            ItemKey::Done(exec_id) if self.follows(exec_id) => self.done = true,
            ItemKey::Event { .. } | ItemKey::Output { .. } | ItemKey::Done(_) => {}
        }
    }

    /// Whether a reader at this cursor saw item `key` already. `recovered`: the item
    /// is one its incarnation emitted from what it read back (the session's record,
    /// the events and outputs streams) when it started.
    pub fn saw(&self, key: &ItemKey, recovered: bool) -> bool {
        // a run before the one followed was done before that one was sent: what an
        // incarnation reads back of it again was seen (one live now is new)
        let before = |exec_id: Uuid| recovered && !self.run.is_nil() && exec_id < self.run;
        match *key {
            ItemKey::Queued(exec_id) => exec_id <= self.queued,
            ItemKey::Event { exec_id, index } => before(exec_id) || (self.follows(exec_id) && index < self.events),
            ItemKey::Output { exec_id, seq } => before(exec_id) || (self.follows(exec_id) && seq < self.outputs),
            ItemKey::Done(exec_id) => before(exec_id) || (self.follows(exec_id) && self.done),
        }
    }

    /// What a reader that was at `self` knows once it also got an item at `other`
    /// (of another incarnation: it knows the most of both).
    pub fn merge(self, other: Cursor) -> Cursor {
        let mut merged = match self.run.cmp(&other.run) {
            Ordering::Greater => self,
            Ordering::Less => other,
            Ordering::Equal => Cursor {
                events: self.events.max(other.events),
                outputs: self.outputs.max(other.outputs),
                done: self.done || other.done,
                ..self
            },
        };
        merged.queued = self.queued.max(other.queued);
        merged
    }
}

/// An item's place in the stream: its SSE id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// The incarnation of the session's actor that sent it (None: an id of the
    /// older, numeric format).
    pub incarnation: Option<u64>,
    /// Its number in that incarnation (from 1).
    pub n: u64,
    /// How far a reader that got it is.
    pub cursor: Cursor,
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(incarnation) = self.incarnation else { return write!(f, "{}", self.n) };
        let c = &self.cursor;
        write!(
            f,
            "{incarnation:x}.{}.{}.{}.{}.{}.{}",
            self.n,
            c.queued.simple(),
            c.run.simple(),
            c.events,
            c.outputs,
            u8::from(c.done)
        )
    }
}

impl Position {
    /// Read an id this stream sent (None: not one).
    pub fn parse(id: &str) -> Option<Position> {
        let id = id.trim();
        if let Ok(n) = id.parse::<u64>() {
            return Some(Position { incarnation: None, n, cursor: Cursor::default() });
        }
        let parts: Vec<&str> = id.split('.').collect();
        let [incarnation, n, queued, run, events, outputs, done] = parts.as_slice() else { return None };
        let done = match *done {
            "0" => false,
            "1" => true,
            _ => return None,
        };
        let cursor = Cursor {
            queued: Uuid::parse_str(queued).ok()?,
            run: Uuid::parse_str(run).ok()?,
            events: events.parse().ok()?,
            outputs: outputs.parse().ok()?,
            done,
        };
        Some(Position { incarnation: Some(u64::from_str_radix(incarnation, 16).ok()?), n: n.parse().ok()?, cursor })
    }
}

/// One item as the session keeps it for readers that connect or reconnect later.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Its number in this incarnation (from 1).
    pub n: u64,
    /// What it is about.
    pub key: ItemKey,
    /// Emitted from what this incarnation read back when it started.
    pub recovered: bool,
    /// The cursor after it.
    pub cursor: Cursor,
    /// Its JSON.
    pub line: String,
}

/// A reader of the stream: what it saw before it attached, as its `Last-Event-ID`
/// says.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reader {
    /// It saw this incarnation's items up to this number.
    after: u64,
    /// How far it got, in any incarnation.
    seen: Cursor,
}

impl Reader {
    /// Whether the reader is to get `entry`.
    pub fn wants(&self, entry: &Entry) -> bool {
        entry.n > self.after && !self.seen.saw(&entry.key, entry.recovered)
    }

    /// `entry`'s id for this reader (of incarnation `incarnation`).
    pub fn id(&self, incarnation: u64, entry: &Entry) -> String {
        Position { incarnation: Some(incarnation), n: entry.n, cursor: self.seen.merge(entry.cursor) }.to_string()
    }
}

/// Executions whose events are counted (each event's index): the runs of the last
/// while, enough for what one incarnation emits again of another.
const COUNTED_EXECUTIONS: usize = 64;

/// The items one incarnation of a session's actor emitted: the newest `capacity`.
#[derive(Debug)]
pub struct Log {
    incarnation: u64,
    entries: VecDeque<Entry>,
    capacity: usize,
    /// The most bytes of lines kept, and those kept now.
    max_bytes: usize,
    bytes: usize,
    next_n: u64,
    cursor: Cursor,
    /// Events relayed so far per execution, the newest executions last.
    event_counts: VecDeque<(Uuid, u64)>,
    recovering: bool,
}

impl Log {
    /// An empty log of a new incarnation (a random number) that keeps `capacity`
    /// items of at most `max_bytes` in all (the newest is kept whatever its size).
    pub fn new(capacity: usize, max_bytes: usize) -> Self {
        Self {
            incarnation: Uuid::new_v4().as_u64_pair().0,
            entries: VecDeque::new(),
            capacity: capacity.max(1),
            max_bytes,
            bytes: 0,
            next_n: 1,
            cursor: Cursor::default(),
            event_counts: VecDeque::new(),
            recovering: false,
        }
    }

    /// This incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Whether the items emitted from now on are emitted again from what this
    /// incarnation read back (true while it starts), or new.
    pub fn recovering(&mut self, on: bool) {
        self.recovering = on;
    }

    /// Run `exec_id` is sent, or adopted in flight.
    pub fn follow(&mut self, exec_id: Uuid) {
        self.cursor.follow(exec_id);
    }

    fn event_index(&mut self, exec_id: Uuid) -> u64 {
        if let Some((_, count)) = self.event_counts.iter_mut().find(|(e, _)| *e == exec_id) {
            *count += 1;
            return *count - 1;
        }
        if self.event_counts.len() >= COUNTED_EXECUTIONS {
            self.event_counts.pop_front();
        }
        self.event_counts.push_back((exec_id, 1));
        0
    }

    /// Keep `item` (its JSON `line`); the entry kept, to send to the readers.
    pub fn push(&mut self, item: &StreamItem, line: String) -> Option<&Entry> {
        let key = match item {
            StreamItem::Queued { exec_id, .. } => ItemKey::Queued(*exec_id),
            StreamItem::Event { exec_id, .. } => {
                ItemKey::Event { exec_id: *exec_id, index: self.event_index(*exec_id) }
            }
            StreamItem::Output { exec_id, seq, .. } => ItemKey::Output { exec_id: *exec_id, seq: *seq },
            StreamItem::Done { exec_id, .. } => ItemKey::Done(*exec_id),
        };
        self.cursor.pass(&key);
        let n = self.next_n;
        self.next_n += 1;
        self.bytes += line.len();
        self.entries.push_back(Entry { n, key, recovered: self.recovering, cursor: self.cursor, line });
        // bounded in items and bytes: a reader that reconnects after more than
        // this misses the oldest
        while self.entries.len() > self.capacity || (self.bytes > self.max_bytes && self.entries.len() > 1) {
            if let Some(old) = self.entries.pop_front() {
                self.bytes -= old.line.len();
            }
        }
        self.entries.back()
    }

    /// A reader that last saw `last` (its `Last-Event-ID`; None: a new reader).
    pub fn reader(&self, last: Option<Position>) -> Reader {
        let Some(last) = last else { return Reader::default() };
        // a number of this incarnation is exact; another incarnation's is not ours
        let ours = last.incarnation == Some(self.incarnation) && last.n < self.next_n;
        Reader { after: if ours { last.n } else { 0 }, seen: last.cursor }
    }

    /// What `reader` gets of the items kept, in order.
    pub fn replay(&self, reader: &Reader) -> Vec<Sent> {
        self.entries
            .iter()
            .filter(|e| reader.wants(e))
            .map(|e| (reader.id(self.incarnation, e), e.line.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use looseleaf_client::events::{Event, Prepare};

    use super::*;
    use crate::api::ExecStatus;

    fn queued(exec_id: Uuid) -> StreamItem {
        StreamItem::Queued { exec_id, cell_id: "c".into(), run_unix_ms: 1 }
    }

    fn event(exec_id: Uuid, host: &str) -> StreamItem {
        let event = Event::Claimed { host: host.into(), slot: None, prepare: Prepare::Cold };
        StreamItem::Event { exec_id, unix_ms: 1, event }
    }

    fn output(exec_id: Uuid, seq: u64) -> StreamItem {
        StreamItem::Output {
            exec_id,
            seq,
            output: schemas::messages::CellMessage::Output(serde_json::json!({ "text": format!("{exec_id} {seq}") })),
        }
    }

    fn done(exec_id: Uuid) -> StreamItem {
        StreamItem::Done { exec_id, status: ExecStatus::Ok, after_revision: 1, unix_ms: 1, error: None }
    }

    fn push(log: &mut Log, item: &StreamItem) -> String {
        let line = serde_json::to_string(item).unwrap();
        log.push(item, line.clone());
        line
    }

    /// Everything a reader gets from `log` after `last`, as (id, line).
    fn resume(log: &Log, last: Option<&str>) -> Vec<Sent> {
        let last = last.map(|id| Position::parse(id).unwrap());
        log.replay(&log.reader(last))
    }

    #[test]
    fn ids_read_back_as_they_were_written() {
        let cursor = Cursor { queued: Uuid::now_v7(), run: Uuid::now_v7(), events: 3, outputs: 7, done: true };
        let at = Position { incarnation: Some(0xdead_beef), n: 42, cursor };
        let id = at.to_string();
        assert_eq!(Position::parse(&id), Some(at));
        assert!(!id.contains(['\n', '\r', '\0', ' ']), "{id}");
        // the older numeric ids are still read (they place nothing)
        assert_eq!(Position::parse("17"), Some(Position { incarnation: None, n: 17, cursor: Cursor::default() }));
        for bad in ["", "yesterday", "1.2", "x.1.0.0.0.0.0", &format!("{id}.1"), &id.replace(".1", ".2")] {
            assert_eq!(Position::parse(bad), None, "{bad}");
        }
    }

    /// Within one incarnation a reader gets exactly what came after its last id,
    /// however the items interleave.
    #[test]
    fn a_reader_of_the_same_incarnation_resumes_exactly_after_its_last_item() {
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let mut log = Log::new(100, usize::MAX);
        push(&mut log, &queued(a));
        log.follow(a);
        let items = [event(a, "h"), output(a, 0), queued(b), event(a, "h"), output(a, 1), done(a)];
        let lines: Vec<String> = items.iter().map(|i| push(&mut log, i)).collect();
        let all = resume(&log, None);
        assert_eq!(all.len(), 7);
        for cut in 0..all.len() {
            let rest = resume(&log, Some(all[cut].0.as_str()));
            assert_eq!(rest, all[cut + 1..].to_vec(), "after item {cut}");
        }
        assert_eq!(all[1..].iter().map(|s| s.1.clone()).collect::<Vec<_>>(), lines);
    }

    /// A frontend restarts while a run is in flight and another is queued: the new
    /// incarnation emits again what it reads back (queued runs first, then the
    /// run's outputs, then its events: another order than the first saw). A reader
    /// with an id of the first incarnation gets each item it did not see, once,
    /// and none it saw, wherever it stopped.
    #[test]
    fn a_reader_of_an_earlier_incarnation_gets_no_item_twice() {
        let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let mut first = Log::new(100, usize::MAX);
        push(&mut first, &queued(a));
        first.follow(a);
        for item in [event(a, "e0"), output(a, 0), queued(b), event(a, "e1"), output(a, 1)] {
            push(&mut first, &item);
        }
        let seen_first = resume(&first, None);

        let mut second = Log::new(100, usize::MAX);
        second.recovering(true);
        push(&mut second, &queued(a));
        second.follow(a);
        push(&mut second, &queued(b));
        // read back: every output so far, then every event (one came while no frontend listened)
        for item in [output(a, 0), output(a, 1), output(a, 2), event(a, "e0"), event(a, "e1"), event(a, "e2")] {
            push(&mut second, &item);
        }
        second.recovering(false);
        for item in [output(a, 3), done(a), queued(c)] {
            push(&mut second, &item);
        }
        second.follow(b);
        let everything = resume(&second, None);

        for cut in 0..seen_first.len() {
            let got = resume(&second, Some(seen_first[cut].0.as_str()));
            let lines: Vec<&str> = got.iter().map(|s| s.1.as_str()).collect();
            // what it saw of the first, then what it got of the second: each item once
            let mut all: Vec<&str> = seen_first[..=cut].iter().map(|s| s.1.as_str()).collect();
            all.extend(&lines);
            let mut unique = all.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), all.len(), "after item {cut} of the first: {lines:#?}");
            // ... and nothing is missing
            for (_, line) in &everything {
                assert!(all.contains(&line.as_str()), "after item {cut}: {line} is missing");
            }
            // the second's items come in its order
            let order: Vec<usize> =
                lines.iter().map(|l| everything.iter().position(|(_, e)| e == l).unwrap()).collect();
            assert!(order.windows(2).all(|w| w[0] < w[1]), "after item {cut}: {order:?}");
            // resuming again from the last of them, on the second: nothing more
            if let Some((last, _)) = got.last() {
                assert!(resume(&second, Some(last.as_str())).is_empty(), "after item {cut}, then {last}");
                // nor on a third incarnation that reads back the same run
                let mut third = Log::new(100, usize::MAX);
                third.recovering(true);
                push(&mut third, &queued(a));
                third.follow(a);
                for item in [output(a, 0), output(a, 1), output(a, 2), output(a, 3), event(a, "e0")] {
                    push(&mut third, &item);
                }
                let again = resume(&third, Some(last.as_str()));
                assert!(again.is_empty(), "a third incarnation after item {cut}: {again:#?}");
            }
        }
    }

    /// A run the record still names in flight although its Done came (the frontend
    /// went away before the record said so): what is read back of it again was
    /// seen by a reader that followed the next run.
    #[test]
    fn what_is_read_back_of_a_run_before_the_one_followed_was_seen() {
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let reader = Cursor { queued: b, run: b, events: 1, outputs: 0, done: false };
        for key in [ItemKey::Output { exec_id: a, seq: 9 }, ItemKey::Event { exec_id: a, index: 9 }, ItemKey::Done(a)] {
            assert!(reader.saw(&key, true), "{key:?}");
            // one that comes live is new (a slot released late)
            assert!(!reader.saw(&key, false), "{key:?}");
        }
        assert!(reader.saw(&ItemKey::Event { exec_id: b, index: 0 }, false));
        assert!(!reader.saw(&ItemKey::Event { exec_id: b, index: 1 }, false));
        // session-wide events (nil) are never taken for a run's
        let fresh = Cursor::default();
        assert!(!fresh.saw(&ItemKey::Event { exec_id: Uuid::nil(), index: 0 }, true));
    }

    #[test]
    fn the_log_keeps_the_newest_items_and_numbers_go_on() {
        let a = Uuid::now_v7();
        let mut log = Log::new(2, usize::MAX);
        for seq in 0..5 {
            push(&mut log, &output(a, seq));
        }
        let kept = resume(&log, None);
        let numbers: Vec<u64> = kept.iter().map(|(id, _)| Position::parse(id).unwrap().n).collect();
        assert_eq!(numbers, [4, 5]);
        // an id from before the kept ones: what is kept
        assert_eq!(resume(&log, Some(kept[0].0.as_str())).len(), 1);
        // a number of this incarnation not reached yet is not ours: everything kept
        let ahead = Position { n: 99, ..Position::parse(&kept[1].0).unwrap() };
        assert_eq!(resume(&log, Some(ahead.to_string().as_str())).len(), 2);
    }

    #[test]
    fn the_log_keeps_at_most_its_bytes_and_always_the_newest_item() {
        let a = Uuid::now_v7();
        let one = push(&mut Log::new(100, usize::MAX), &output(a, 0)).len();
        // room for two lines of this size
        let mut log = Log::new(100, 2 * one + one / 2);
        for seq in 0..5 {
            push(&mut log, &output(a, seq));
        }
        let numbers: Vec<u64> = resume(&log, None).iter().map(|(id, _)| Position::parse(id).unwrap().n).collect();
        assert_eq!(numbers, [4, 5]);
        // one line larger than the whole bound is kept alone
        let mut tiny = Log::new(100, 1);
        push(&mut tiny, &output(a, 0));
        push(&mut tiny, &output(a, 1));
        assert_eq!(resume(&tiny, None).len(), 1);
    }
}
