//! The state of a session's current run: the execution sent to the planner and
//! not complete yet (its host, its end, what it sent and what was heard of it).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use actix::SpawnHandle;
use schemas::messages::CellStatus;
use uuid::Uuid;

use crate::api::ExecStatus;

/// Where the current run is, from its send to the planner to its end.
#[derive(Debug)]
pub(super) enum RunState {
    /// No host is known to hold it.
    Unclaimed,
    /// `host` holds it: the run claim's revision last read, and since when it is
    /// that one (a host that stops renewing it is lost).
    Claimed { host: String, claim_seen: Option<(u64, Instant)> },
    /// Saved or failed, or settled through the store: it completes once all it
    /// sent arrived (or was read back).
    Ended(Ended),
}

/// How the current run ended.
#[derive(Clone, Debug)]
pub(super) struct Ended {
    pub(super) status: ExecStatus,
    /// The session's revision after it.
    pub(super) revision: u64,
    pub(super) error: Option<String>,
    pub(super) unix_ms: u64,
    /// Its save landed: its status is the cell's own, from Finished.
    pub(super) saved: bool,
}

/// What the cell's Finished event said.
#[derive(Clone, Debug)]
pub(super) struct Finished {
    pub(super) status: CellStatus,
    pub(super) error: Option<String>,
    /// How many outputs it sent.
    pub(super) outputs: u64,
}

/// The execution that was sent to the planner and is not complete yet.
#[derive(Debug)]
pub(super) struct Current {
    pub(super) exec_id: Uuid,
    /// Where it is.
    pub(super) state: RunState,
    /// The cell's Finished event, if it arrived (it may after the end: read back).
    pub(super) finished: Option<Finished>,
    /// Output seqs received.
    pub(super) outputs: HashSet<u64>,
    /// Events relayed (a host sends one again when its stream did not confirm it).
    pub(super) events: HashSet<String>,
    /// What it sent is being read back from the streams (it ended with
    /// something unheard, or this frontend's NATS connection was lost meanwhile).
    pub(super) reading_back: bool,
    /// How many times this frontend had connected to NATS when it last heard
    /// everything (at its start, or its last read-back): live messages sent
    /// while it reconnected since are missed.
    pub(super) connects: u64,
    /// Its client answers the cell's input requests.
    pub(super) allow_stdin: bool,
    /// The cell waits for a line of input from its client.
    pub(super) asking: bool,
    /// Its deadlines and watches (`SessionActor::run_later_for`), cancelled when
    /// it completes: an actor polls every pending timer on each message, and a
    /// 60 s claim deadline left behind by each of thousands of quick cells made
    /// every event of the next cell slower.
    pub(super) timers: HashMap<&'static str, SpawnHandle>,
}

impl Current {
    pub(super) fn new(exec_id: Uuid, allow_stdin: bool, connects: u64) -> Self {
        Self {
            allow_stdin,
            asking: false,
            exec_id,
            state: RunState::Unclaimed,
            finished: None,
            outputs: HashSet::new(),
            events: HashSet::new(),
            reading_back: false,
            connects,
            timers: HashMap::new(),
        }
    }

    /// How it ended, if it has.
    pub(super) fn ended(&self) -> Option<&Ended> {
        match &self.state {
            RunState::Ended(e) => Some(e),
            _ => None,
        }
    }

    /// The host that holds it, while one does and it has not ended.
    pub(super) fn host(&self) -> Option<&str> {
        match &self.state {
            RunState::Claimed { host, .. } => Some(host),
            _ => None,
        }
    }

    /// `host` holds it: true if that is news (it was unclaimed).
    pub(super) fn claimed_by(&mut self, host: String) -> bool {
        if !matches!(self.state, RunState::Unclaimed) {
            return false;
        }
        self.state = RunState::Claimed { host, claim_seen: None };
        true
    }

    /// What it has not heard yet of what it sent: outputs Finished announced, or
    /// Finished itself (a saved run sent it before its save).
    pub(super) fn unheard(&self) -> bool {
        let announced = self.finished.as_ref().map_or(0, |f| f.outputs);
        let missing = announced.saturating_sub(self.outputs.len() as u64);
        missing > 0 || (self.ended().is_some_and(|e| e.saved) && self.finished.is_none())
    }

    /// The outcome of an execution whose save was committed: the cell's own.
    pub(super) fn saved_outcome(&self) -> (ExecStatus, Option<String>) {
        match &self.finished {
            Some(Finished { status: CellStatus::Error, error, .. }) => (ExecStatus::Error, error.clone()),
            _ => (ExecStatus::Ok, None),
        }
    }
}
