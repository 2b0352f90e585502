//! GPU demand led by the edit stream (issue "Scale", item 5). Staged preparation
//! (ADR 70) holds no slot while users type, so the slots in use no longer show the
//! runs about to come: a session typing a GPU cell is a run on its way. An
//! autoscaler that waits for those runs to hold slots adds hosts a boot too late.
//!
//! The planner sees every edit and run, so it counts: the sessions typing a GPU
//! cell (and their closures' bytes), the GPU cells running, and the GPUs wanted
//! within `lead_s` (what a host takes to be added). A run holds its slots only
//! while it runs (ADR 70), so the GPUs wanted are not every typing session that
//! may press Run within the lead, but the runs that overlap. Runs arrive at the
//! typing sessions' rate `r` (each presses Run after a mean typing time) and
//! each holds its slots for `h` seconds of the lead (the mean of `min(run,
//! lead)`: run times have a long tail, so not the mean run); a share `q` of runs
//! outlast the lead. The GPUs busy by the lead's end are then the cells running
//! now that outlast it, `q running`, plus the arrivals, `A = r h`; the most over
//! the lead is at its start or its end. Two standard deviations of the arrivals
//! (Poisson: `2 sqrt(A)`) are added, so that a burst of Runs finds its slots
//! most of the time. `r`, `h` and `q` are learnt from the runs seen.
//!
//! Pure bookkeeping on the caller's clock (seconds): the planner actor publishes
//! it (gauge and subject), the simulator's `looseleaf_demand` policy scales on it.

use std::collections::HashMap;

use uuid::Uuid;

/// The typing time assumed before any run was seen (s).
const PRIOR_TYPING_S: f64 = 60.0;
/// The share of the lead a run holds its slots, and the share of runs that
/// outlast it, assumed before any run ended.
const PRIOR_LEAD_HELD: f64 = 0.5;
/// Weight of the newest run in the mean typing and run times.
const LEARN_RATE: f64 = 0.05;
/// A session typing for longer than this many mean typing times is not about to
/// run (it left): it no longer counts.
const STALE_MEANS: f64 = 10.0;

/// A session's GPU cell being typed.
#[derive(Clone, Debug)]
struct Typing {
    cell_id: String,
    gpus: u32,
    closure_bytes: u64,
    since: f64,
}

/// What the GPU pool is asked for now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuDemand {
    /// Sessions typing a GPU cell they have not run.
    pub typing_sessions: u64,
    /// The bytes of those cells' closures (what their starts will copy in).
    pub typing_closure_bytes: u64,
    /// GPUs of the cells running (from Run until their slots are given back).
    pub running_gpus: u64,
    /// GPUs wanted within the lead: the most busy at once over it (those running
    /// and the runs expected from the sessions typing), plus two standard
    /// deviations of the runs expected.
    pub wanted_gpus: f64,
}

/// The edit-stream demand.
#[derive(Debug)]
pub struct Demand {
    /// How far ahead hosts are asked for (s): boot and scaling interval.
    lead_s: f64,
    typing: HashMap<Uuid, Typing>,
    /// Running GPU cells: exec id → (GPUs, since when).
    running: HashMap<Uuid, (u32, f64)>,
    /// Mean time from a cell's first GPU edit to its Run (s).
    mean_typing_s: f64,
    /// Mean of `min(run, lead)` over the runs that ended (s).
    lead_held_s: f64,
    /// Share of the runs that ended that outlasted the lead.
    outlast_lead: f64,
}

impl Demand {
    /// Demand looked at `lead_s` ahead.
    pub fn new(lead_s: f64) -> Self {
        Self {
            lead_s,
            typing: HashMap::new(),
            running: HashMap::new(),
            mean_typing_s: PRIOR_TYPING_S,
            lead_held_s: PRIOR_LEAD_HELD * lead_s,
            outlast_lead: PRIOR_LEAD_HELD,
        }
    }

    /// `session` edits GPU cell `cell_id` (of `gpus` and a closure of
    /// `closure_bytes`). Its typing counts from its first edit.
    pub fn typing(&mut self, session: Uuid, cell_id: &str, gpus: u32, closure_bytes: u64, now: f64) {
        let since = match self.typing.get(&session) {
            Some(t) if t.cell_id == cell_id => t.since,
            _ => now,
        };
        self.typing.insert(session, Typing { cell_id: cell_id.to_string(), gpus: gpus.max(1), closure_bytes, since });
    }

    /// `session`'s cell `cell_id` is no longer a GPU cell.
    pub fn not_typing(&mut self, session: Uuid, cell_id: &str) {
        if self.typing.get(&session).is_some_and(|t| t.cell_id == cell_id) {
            self.typing.remove(&session);
        }
    }

    /// `session` ran cell `cell_id` as `exec`: if it was typing it as a GPU cell,
    /// the typing ends (teaching the mean typing time) and the run is demand from
    /// now on, waiting for its slots or not.
    pub fn ran(&mut self, session: Uuid, cell_id: &str, exec: Uuid, now: f64) {
        let Some(t) = self.typing.remove(&session) else { return };
        if t.cell_id != cell_id {
            self.typing.insert(session, t); // another cell ran; this one is still typed
            return;
        }
        self.mean_typing_s += LEARN_RATE * ((now - t.since).max(0.0) - self.mean_typing_s);
        self.running.insert(exec, (t.gpus, now));
    }

    /// A host bound `gpus` slots to run `exec` (a GPU run not typed as one is
    /// demand from here).
    pub fn running(&mut self, exec: Uuid, gpus: u32, now: f64) {
        self.running.entry(exec).or_insert((gpus.max(1), now));
    }

    /// Run `exec` gave its slots back (saved, failed or lost): the time it was
    /// demand teaches how much of the lead a run holds.
    pub fn ended(&mut self, exec: Uuid, now: f64) {
        if let Some((_, since)) = self.running.remove(&exec) {
            let ran = (now - since).max(0.0);
            self.lead_held_s += LEARN_RATE * (ran.min(self.lead_s) - self.lead_held_s);
            let outlasted = if ran > self.lead_s { 1.0 } else { 0.0 };
            self.outlast_lead += LEARN_RATE * (outlasted - self.outlast_lead);
        }
    }

    /// `session` closed.
    pub fn closed(&mut self, session: Uuid) {
        self.typing.remove(&session);
    }

    /// The mean typing time learnt so far (s).
    pub fn mean_typing_s(&self) -> f64 {
        self.mean_typing_s
    }

    /// The seconds of the lead a run holds its slots, learnt so far.
    pub fn lead_held_s(&self) -> f64 {
        self.lead_held_s
    }

    /// The demand at `now`; sessions typing for too long are forgotten.
    pub fn at(&mut self, now: f64) -> GpuDemand {
        let stale = STALE_MEANS * self.mean_typing_s;
        self.typing.retain(|_, t| now - t.since < stale);
        let typed: f64 = self.typing.values().map(|t| f64::from(t.gpus)).sum();
        let running_gpus: u64 = self.running.values().map(|&(g, _)| u64::from(g)).sum();
        let running = running_gpus as f64;
        let arrivals = typed / self.mean_typing_s.max(1e-3) * self.lead_held_s;
        let busy = running.max(running * self.outlast_lead + arrivals) + 2.0 * arrivals.sqrt();
        // never more than every typing session running at once besides those running
        let wanted_gpus = busy.min(running + typed);
        GpuDemand {
            typing_sessions: self.typing.len() as u64,
            typing_closure_bytes: self.typing.values().map(|t| t.closure_bytes).sum(),
            running_gpus,
            wanted_gpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    #[test]
    fn running_cells_count_until_they_end_and_typing_sessions_by_their_chance_to_run() {
        let mut d = Demand::new(30.0);
        d.running(s(100), 2, 0.0);
        assert_eq!(d.at(0.0).wanted_gpus, 2.0, "no one typing: what runs");
        d.typing(s(2), "b", 1, 1_000, 0.0);
        d.typing(s(3), "c", 1, 2_000, 0.0);
        let g = d.at(1.0);
        assert_eq!((g.typing_sessions, g.typing_closure_bytes, g.running_gpus), (2, 3_000, 2));
        // runs arrive at 2 / 60 s and each holds its slot half the 30 s lead: 0.5
        // GPUs; the most busy is now (2 running), plus two standard deviations
        let arrivals: f64 = 2.0 / 60.0 * 15.0;
        assert!((g.wanted_gpus - (2.0 + 2.0 * arrivals.sqrt())).abs() < 1e-9, "{}", g.wanted_gpus);
        // with many typing, the expectation and its spread: far fewer GPUs than
        // sessions typing, as each run gives its slot back
        for n in 10..210 {
            d.typing(s(n), "x", 1, 0, 1.0);
        }
        let g = d.at(1.0);
        // half the cells running now outlast the lead
        let arrivals: f64 = 202.0 / 60.0 * 15.0;
        let want = 2.0 * 0.5 + arrivals + 2.0 * arrivals.sqrt();
        assert!((g.wanted_gpus - want).abs() < 1e-9, "{} vs {want}", g.wanted_gpus);
        assert!(g.wanted_gpus < 100.0);
        d.ended(s(100), 20.0);
        assert_eq!(d.at(1.0).running_gpus, 0);
        assert!((d.lead_held_s() - (15.0 + 0.05 * 5.0)).abs() < 1e-9, "it held 20 s of the 30");
        // a run outlasting the lead holds all of it
        d.running(s(101), 1, 0.0);
        d.ended(s(101), 500.0);
        assert!((d.lead_held_s() - (15.25 + 0.05 * 14.75)).abs() < 1e-9);
    }

    #[test]
    fn a_run_ends_its_sessions_typing_and_teaches_the_mean_typing_time() {
        let mut d = Demand::new(30.0);
        d.typing(s(1), "a", 1, 0, 0.0);
        d.typing(s(1), "a", 3, 0, 50.0); // more keystrokes: typing since the first
        d.ran(s(1), "other", s(8), 100.0);
        assert_eq!(d.at(100.0).typing_sessions, 1, "another cell ran: a is still typed");
        d.ran(s(1), "a", s(9), 160.0);
        assert!((d.mean_typing_s() - (60.0 + 0.05 * 100.0)).abs() < 1e-9);
        let g = d.at(160.0);
        assert_eq!((g.typing_sessions, g.running_gpus), (0, 3), "the run is demand before its slots");
        d.running(s(9), 1, 161.0);
        assert_eq!(d.at(160.0).running_gpus, 3, "a host binding its slots adds nothing");
        // a session moving to another cell types that one from its first edit
        d.typing(s(2), "x", 1, 0, 0.0);
        d.typing(s(2), "y", 1, 0, 100.0);
        d.ran(s(2), "y", s(10), 100.0);
        assert!((d.mean_typing_s() - 65.0 * 0.95).abs() < 1e-9, "typed y for 0 s");
    }

    #[test]
    fn a_cell_that_became_a_cpu_cell_or_a_closed_or_stale_session_is_not_demand() {
        let mut d = Demand::new(30.0);
        d.typing(s(1), "a", 1, 0, 0.0);
        d.not_typing(s(1), "other");
        assert_eq!(d.at(0.0).typing_sessions, 1, "another cell: still typing a");
        d.not_typing(s(1), "a");
        d.typing(s(2), "b", 1, 0, 0.0);
        d.closed(s(2));
        d.typing(s(3), "c", 1, 0, 0.0);
        assert_eq!(d.at(0.0).typing_sessions, 1);
        assert_eq!(d.at(600.0).typing_sessions, 0, "typing 10 mean typing times: gone");
    }
}
