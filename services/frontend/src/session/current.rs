//! The state of a session's current run: the execution sent to the planner and
//! not complete yet (its host, its end, what it sent and what was heard of it).

use std::collections::HashSet;
use std::time::Instant;

use schemas::messages::CellStatus;
use uuid::Uuid;

use crate::api::ExecStatus;

/// The execution that was sent to the planner and is not complete yet.
#[derive(Debug)]
pub(super) struct Current {
    pub(super) exec_id: Uuid,
    /// The host that claimed it.
    pub(super) host: Option<String>,
    /// The cell's status from Finished, if it arrived.
    pub(super) finished: Option<(CellStatus, Option<String>)>,
    /// How many outputs Finished announced.
    pub(super) expected_outputs: Option<u64>,
    /// Output seqs received.
    pub(super) outputs: HashSet<u64>,
    /// Events relayed (a host sends one again when its stream did not confirm it).
    pub(super) events: HashSet<String>,
    /// Saved/Failed arrived: (status, revision after, error, unix ms).
    pub(super) terminal: Option<(ExecStatus, u64, Option<String>, u64)>,
    /// Its save landed: its status is the cell's own, from Finished.
    pub(super) saved: bool,
    /// What it sent is being read back from the streams (it ended with
    /// something unheard, or this frontend's NATS connection was lost meanwhile).
    pub(super) reading_back: bool,
    /// How many times this frontend had connected to NATS when it last heard
    /// everything (at its start, or its last read-back): live messages sent
    /// while it reconnected since are missed.
    pub(super) connects: u64,
    /// The run claim's revision last read, and since when it is that one.
    pub(super) claim_seen: Option<(u64, Instant)>,
    /// Its client answers the cell's input requests.
    pub(super) allow_stdin: bool,
    /// The cell waits for a line of input from its client.
    pub(super) asking: bool,
}

impl Current {
    pub(super) fn new(exec_id: Uuid, allow_stdin: bool, connects: u64) -> Self {
        Self {
            allow_stdin,
            asking: false,
            exec_id,
            host: None,
            finished: None,
            expected_outputs: None,
            outputs: HashSet::new(),
            events: HashSet::new(),
            terminal: None,
            saved: false,
            reading_back: false,
            connects,
            claim_seen: None,
        }
    }

    /// What it has not heard yet of what it sent: outputs Finished announced, or
    /// Finished itself (a saved run sent it before its save).
    pub(super) fn unheard(&self) -> bool {
        let missing = self.expected_outputs.unwrap_or(0).saturating_sub(self.outputs.len() as u64);
        missing > 0 || (self.saved && self.finished.is_none())
    }

    /// The outcome of an execution whose save was committed: the cell's own.
    pub(super) fn saved_outcome(&self) -> (ExecStatus, Option<String>) {
        match &self.finished {
            Some((CellStatus::Error, e)) => (ExecStatus::Error, e.clone()),
            _ => (ExecStatus::Ok, None),
        }
    }
}
