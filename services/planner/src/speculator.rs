//! The prefetch speculator (DESIGN.md section 4, step 3): which edit-derived GPU
//! recipes get a prepared worker, within a budget, and which prepared workers to
//! evict when the budget is full.
//!
//! Budget: at most `prepared_per_host` prepared-but-idle workers on each host, and
//! at most `idle_seconds_per_session` of idle GPU-slot time spent by one session's
//! prepared workers per hour: spent time is forgiven at that rate, so a session
//! that edits for hours keeps speculating while one that leaves a worker idle
//! loses it (ADR 50; a lifetime budget ran out after a dozen GPU cells). Eviction under pressure goes in
//! two classes, completed warm workers before speculatively prepared ones, and
//! within a class by GreedyDual: a worker's priority is `L + value` where value is
//! the preparation time it saves and `L` (the inflation) rises to the priority of
//! each evicted worker, so old entries age out.
//!
//! Pure bookkeeping: the planner actor feeds it events and carries out what it
//! returns (publish the recipe with `speculate`, send evictions).

use std::collections::{BTreeMap, HashMap};

use schemas::messages::{PreparedClass, PreparedWorker};
use uuid::Uuid;

/// How much speculation may cost.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Prepared workers that sit idle per host.
    pub prepared_per_host: usize,
    /// Idle GPU-slot seconds one session's prepared workers may spend per hour.
    pub idle_seconds_per_session: f64,
}

impl Budget {
    /// How fast spent idle seconds are forgiven (seconds per second).
    fn refill_per_s(&self) -> f64 {
        self.idle_seconds_per_session / 3600.0
    }
}

/// A worker some host reported ready for a cell.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// Where it is.
    pub at: PreparedWorker,
    /// Warm (after a run) or speculative.
    pub class: PreparedClass,
    /// GreedyDual priority.
    pub priority: f64,
    /// When it became ready (seconds on the caller's clock).
    pub ready_at: f64,
    /// Whether it holds a GPU slot while it waits (only then does its idle time
    /// count against the session's idle GPU-second budget).
    pub holds_slot: bool,
}

/// What a Ready event says about the worker.
#[derive(Clone, Copy, Debug)]
pub struct Ready {
    /// Speculative or warm.
    pub class: PreparedClass,
    /// What preparing it took (the value of keeping it).
    pub prepare_ms: f64,
    /// Whether it holds a GPU slot while it waits.
    pub holds_slot: bool,
}

/// An eviction to send to a host.
#[derive(Clone, Debug, PartialEq)]
pub struct Eviction {
    /// The session of the evicted worker.
    pub session: Uuid,
    /// The cell it was prepared for.
    pub cell_id: String,
    /// Where it is.
    pub at: PreparedWorker,
    /// Why.
    pub reason: &'static str,
}

/// What to do with an edit-derived GPU recipe.
#[derive(Clone, Debug, PartialEq)]
pub struct Admission {
    /// Publish it for preparation.
    pub admit: bool,
    /// Evict these first.
    pub evict: Vec<Eviction>,
    /// Why not, if not.
    pub refused: Option<&'static str>,
}

type Key = (Uuid, String);

/// The speculator's state.
#[derive(Debug)]
pub struct Speculator {
    budget: Budget,
    /// Ready workers per (session, cell).
    entries: HashMap<Key, Entry>,
    /// Admitted recipes not yet reported ready (when admitted); they count against
    /// the budget so that a burst of edits cannot overshoot it.
    in_flight: HashMap<Key, f64>,
    /// Idle slot seconds spent per session by workers that ended, not yet
    /// forgiven, as of when (the caller's clock).
    spent: HashMap<Uuid, (f64, f64)>,
    /// Hosts known (from their status), so a host with room is not ignored.
    hosts: BTreeMap<String, f64>,
    /// The host preparing each admitted recipe's worker, once it said so.
    preparing_on: HashMap<Key, String>,
    inflation: f64,
}

/// An admission older than this without a Ready is forgotten (the host lost the
/// race, had no free slot, or failed).
const IN_FLIGHT_SECONDS: f64 = 30.0;

impl Speculator {
    /// A speculator with `budget`.
    pub fn new(budget: Budget) -> Self {
        Self {
            budget,
            entries: HashMap::new(),
            in_flight: HashMap::new(),
            spent: HashMap::new(),
            hosts: BTreeMap::new(),
            preparing_on: HashMap::new(),
            inflation: 0.0,
        }
    }

    /// A host reported its status.
    pub fn host_seen(&mut self, host: &str, now: f64) {
        self.hosts.insert(host.to_string(), now);
    }

    /// Seconds `host` has been silent at `now`: since its last status, or since the
    /// planner started (`now` 0) if it was never heard.
    pub fn host_silent_for(&self, host: &str, now: f64) -> f64 {
        now - self.hosts.get(host).copied().unwrap_or(0.0)
    }

    /// Idle seconds `session` has spent and not yet been forgiven, counting
    /// workers still waiting.
    pub fn idle_seconds(&self, session: Uuid, now: f64) -> f64 {
        let live: f64 = self
            .entries
            .iter()
            .filter(|((s, _), e)| *s == session && e.holds_slot)
            .map(|(_, e)| (now - e.ready_at).max(0.0))
            .sum();
        self.spent_at(session, now) + live
    }

    /// What `session`'s ended workers spent, less what the refill forgave by `now`.
    fn spent_at(&self, session: Uuid, now: f64) -> f64 {
        self.spent
            .get(&session)
            .map_or(0.0, |(amount, at)| (amount - (now - at).max(0.0) * self.budget.refill_per_s()).max(0.0))
    }

    /// Should the edit-derived GPU recipe of (`session`, `cell_id`) be prepared?
    pub fn admit(&mut self, session: Uuid, cell_id: &str, now: f64) -> Admission {
        let key = (session, cell_id.to_string());
        self.in_flight.retain(|_, at| now - *at < IN_FLIGHT_SECONDS);
        if self.entries.contains_key(&key) || self.in_flight.contains_key(&key) {
            // its host updates the worker in place
            return Admission { admit: true, evict: vec![], refused: None };
        }
        if self.idle_seconds(session, now) >= self.budget.idle_seconds_per_session {
            return Admission {
                admit: false,
                evict: vec![],
                refused: Some("the session's idle GPU-second budget is spent"),
            };
        }
        let mut evict = Vec::new();
        if self.entries.len() + self.in_flight.len() >= self.capacity() {
            match (self.victim(), self.left_behind(session, cell_id)) {
                (Some(v), _) => evict.push(self.evict(v, "a newer recipe needs the slot")),
                // A session edits one cell at a time: its admission for a cell the
                // user left (still preparing, or never prepared by its host) yields
                // to the cell edited now. That worker, if it becomes ready, is
                // evicted in turn like any other.
                (None, Some(left)) => {
                    self.in_flight.remove(&left);
                }
                (None, None) => {
                    return Admission { admit: false, evict, refused: Some("every prepared slot is in flight") };
                }
            }
        }
        self.in_flight.insert(key, now);
        Admission { admit: true, evict, refused: None }
    }

    /// The oldest admission in flight of `session` for a cell other than `cell_id`.
    fn left_behind(&self, session: Uuid, cell_id: &str) -> Option<Key> {
        self.in_flight
            .iter()
            .filter(|((s, c), _)| *s == session && c != cell_id)
            .min_by(|a, b| a.1.total_cmp(b.1))
            .map(|(k, _)| k.clone())
    }

    fn capacity(&self) -> usize {
        self.budget.prepared_per_host * self.hosts.len().max(1)
    }

    /// The entry to evict first: warm before speculative, then lowest priority.
    fn victim(&self) -> Option<Key> {
        let rank = |c: PreparedClass| match c {
            PreparedClass::Warm => 0,
            PreparedClass::Speculative => 1,
        };
        self.entries
            .iter()
            .min_by(|(_, a), (_, b)| rank(a.class).cmp(&rank(b.class)).then(a.priority.total_cmp(&b.priority)))
            .map(|(k, _)| k.clone())
    }

    fn evict(&mut self, key: Key, reason: &'static str) -> Eviction {
        let (session, cell_id) = key.clone();
        // the caller checked it is there
        let e = self.entries.remove(&key).unwrap_or_else(|| Entry {
            at: PreparedWorker { host: String::new(), worker: String::new() },
            class: PreparedClass::Speculative,
            priority: self.inflation,
            ready_at: 0.0,
            holds_slot: false,
        });
        self.inflation = self.inflation.max(e.priority);
        Eviction { session, cell_id, at: e.at, reason }
    }

    /// A host began preparing the worker of (`session`, `cell_id`).
    pub fn preparing(&mut self, session: Uuid, cell_id: &str, host: &str) {
        self.preparing_on.insert((session, cell_id.to_string()), host.to_string());
    }

    /// The host that holds (or prepares) the cell's worker: newer recipes of the
    /// cell go to it, so no other host prepares a second worker for the cell.
    pub fn held_on(&self, session: Uuid, cell_id: &str) -> Option<String> {
        let key = (session, cell_id.to_string());
        match self.entries.get(&key) {
            Some(e) => Some(e.at.host.clone()),
            None if self.in_flight.contains_key(&key) => self.preparing_on.get(&key).cloned(),
            None => None,
        }
    }

    /// A host reports a prepared (or updated) worker.
    pub fn ready(&mut self, session: Uuid, cell_id: &str, at: PreparedWorker, ready: Ready, now: f64) {
        let Ready { class, prepare_ms, holds_slot } = ready;
        let key = (session, cell_id.to_string());
        self.in_flight.remove(&key);
        let ready_at = match self.entries.get(&key) {
            // updated in place: still the same idle stretch
            Some(e) if e.at == at => e.ready_at,
            _ => now,
        };
        self.entries.insert(key, Entry { at, class, priority: self.inflation + prepare_ms, ready_at, holds_slot });
    }

    /// A prepared worker ended (used, evicted, lost) at `now` after `idle_ms` idle,
    /// holding a GPU slot meanwhile or not.
    pub fn ended(&mut self, session: Uuid, cell_id: &str, worker: &str, idle_ms: f64, held_slot: bool, now: f64) {
        let key = (session, cell_id.to_string());
        // a run may take a worker before it ever reported ready
        self.in_flight.remove(&key);
        self.preparing_on.remove(&key);
        if self.entries.get(&key).is_some_and(|e| e.at.worker == worker) {
            self.entries.remove(&key);
        }
        if held_slot {
            let spent = self.spent_at(session, now) + idle_ms / 1000.0;
            self.spent.insert(session, (spent, now));
        }
    }

    /// The cell runs: its prepared worker, if one is ready. An admission still in
    /// flight no longer holds budget (the host either hands that worker to the run
    /// or never prepares it).
    pub fn for_run(&mut self, session: Uuid, cell_id: &str) -> Option<PreparedWorker> {
        let key = (session, cell_id.to_string());
        self.in_flight.remove(&key);
        self.entries.get(&key).map(|e| e.at.clone())
    }

    /// Sessions over their idle budget lose their waiting workers.
    pub fn over_budget(&mut self, now: f64) -> Vec<Eviction> {
        let sessions: Vec<Uuid> = self.entries.keys().map(|(s, _)| *s).collect();
        let mut out = Vec::new();
        for s in sessions {
            if self.idle_seconds(s, now) >= self.budget.idle_seconds_per_session {
                let keys: Vec<Key> = self.entries.keys().filter(|(k, _)| *k == s).cloned().collect();
                for k in keys {
                    out.push(self.evict(k, "the session's idle GPU-second budget is spent"));
                }
            }
        }
        out
    }

    /// Forget a closed session.
    pub fn close(&mut self, session: Uuid) {
        self.preparing_on.retain(|(s, _), _| *s != session);
        self.entries.retain(|(s, _), _| *s != session);
        self.in_flight.retain(|(s, _), _| *s != session);
        self.spent.remove(&session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(host: &str, worker: &str) -> PreparedWorker {
        PreparedWorker { host: host.into(), worker: worker.into() }
    }

    fn budget(per_host: usize, idle: f64) -> Budget {
        Budget { prepared_per_host: per_host, idle_seconds_per_session: idle }
    }

    #[test]
    fn warm_workers_go_before_speculative_ones_then_lowest_priority() {
        let mut s = Speculator::new(budget(3, 1e9));
        s.host_seen("h", 0.0);
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        for cell in ["c1", "c2", "c3"] {
            assert!(s.admit(a, cell, 0.0).admit);
        }
        s.ready(
            a,
            "c1",
            at("h", "w1"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 50.0, holds_slot: true },
            0.0,
        );
        s.ready(
            a,
            "c2",
            at("h", "w2"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 900.0, holds_slot: true },
            0.0,
        );
        s.ready(
            a,
            "c3",
            at("h", "w3"),
            Ready { class: PreparedClass::Warm, prepare_ms: 2000.0, holds_slot: true },
            0.0,
        );
        // full: the warm worker goes first although it saves the most
        let first = s.admit(b, "x", 1.0);
        assert!(first.admit);
        assert_eq!(first.evict.len(), 1);
        assert_eq!(first.evict[0].at.worker, "w3");
        s.ready(
            b,
            "x",
            at("h", "w4"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 10.0, holds_slot: true },
            1.0,
        );
        // then the speculative one with the lowest priority (50 < 900; the new one
        // starts at the inflation 2000 + 10)
        let second = s.admit(b, "y", 2.0);
        assert_eq!(second.evict[0].at.worker, "w1");
        assert!(s.for_run(a, "c1").is_none() && s.for_run(a, "c2").is_some());
    }

    #[test]
    fn inflation_ages_old_entries() {
        let mut s = Speculator::new(budget(1, 1e9));
        s.host_seen("h", 0.0);
        let sid = Uuid::now_v7();
        s.admit(sid, "old", 0.0);
        s.ready(
            sid,
            "old",
            at("h", "w1"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 500.0, holds_slot: true },
            0.0,
        );
        // evicting it raises L to 500, so a cheap newcomer outranks an older worker
        // that was worth more when it was prepared
        let adm = s.admit(sid, "new", 1.0);
        assert_eq!(adm.evict[0].at.worker, "w1");
        s.ready(
            sid,
            "new",
            at("h", "w2"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 1.0, holds_slot: true },
            1.0,
        );
        assert_eq!(s.entries[&(sid, "new".to_string())].priority, 501.0);
    }

    #[test]
    fn an_updated_recipe_needs_no_new_slot() {
        let mut s = Speculator::new(budget(1, 1e9));
        s.host_seen("h", 0.0);
        let sid = Uuid::now_v7();
        assert!(s.admit(sid, "c", 0.0).admit);
        s.ready(
            sid,
            "c",
            at("h", "w1"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 5.0, holds_slot: true },
            0.0,
        );
        let again = s.admit(sid, "c", 1.0);
        assert!(again.admit && again.evict.is_empty());
    }

    #[test]
    fn the_idle_budget_bounds_a_session() {
        let mut s = Speculator::new(budget(4, 10.0));
        s.host_seen("h", 0.0);
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        s.admit(a, "c1", 0.0);
        s.ready(
            a,
            "c1",
            at("h", "w1"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 5.0, holds_slot: true },
            0.0,
        );
        // 6 s idle: still within 10
        assert!(s.over_budget(6.0).is_empty());
        assert!(s.admit(a, "c2", 6.0).admit);
        s.ready(
            a,
            "c2",
            at("h", "w2"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 5.0, holds_slot: true },
            6.0,
        );
        // at 9 s: 9 + 3 = 12 idle seconds: both of a's workers go, b is untouched
        s.admit(b, "c1", 8.0);
        s.ready(
            b,
            "c1",
            at("h", "w3"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 5.0, holds_slot: true },
            8.0,
        );
        let ev = s.over_budget(9.0);
        let mut workers: Vec<&str> = ev.iter().map(|e| e.at.worker.as_str()).collect();
        workers.sort();
        assert_eq!(workers, ["w1", "w2"]);
        assert!(s.for_run(b, "c1").is_some());
        // the spent time stays counted: a gets nothing more
        s.ended(a, "c1", "w1", 9000.0, true, 9.0);
        s.ended(a, "c2", "w2", 3000.0, true, 9.0);
        let refused = s.admit(a, "c3", 9.5);
        assert!(!refused.admit && refused.refused.is_some());
        // the budget is per hour: 12 s spent against 10 s an hour is forgiven
        // down to below 10 s after 0.2 h (720 s), not before
        assert!(!s.admit(a, "c3", 9.0 + 600.0).admit);
        assert!((s.idle_seconds(a, 9.0 + 720.0) - 10.0).abs() < 1e-9);
        assert!(s.admit(a, "c3", 9.0 + 800.0).admit);
        assert!(s.idle_seconds(a, 9.0 + 3600.0 * 2.0).abs() < 1e-9, "never below zero");
    }

    #[test]
    fn capacity_grows_with_hosts_and_in_flight_counts() {
        let mut s = Speculator::new(budget(1, 1e9));
        let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        s.host_seen("h1", 0.0);
        s.host_seen("h2", 0.0);
        assert!(s.admit(a, "c1", 0.0).admit);
        assert!(s.admit(b, "c1", 0.0).admit);
        // both slots of the budget are in flight for other sessions, and nothing is
        // ready to evict
        let third = s.admit(c, "c1", 0.0);
        assert!(!third.admit);
        // an admission that never became ready is forgotten after a while
        assert!(s.admit(c, "c1", IN_FLIGHT_SECONDS + 1.0).admit);
    }

    #[test]
    fn a_sessions_admission_for_a_cell_it_left_yields_to_the_cell_it_edits() {
        let mut s = Speculator::new(budget(1, 1e9));
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        s.host_seen("h1", 0.0);
        assert!(s.admit(a, "c1", 0.0).admit);
        // the user moved on to c2 while c1's worker prepares: c2 is admitted
        let next = s.admit(a, "c2", 1.0);
        assert!(next.admit && next.evict.is_empty(), "{next:?}");
        // another session's admission in flight does not yield
        assert!(!s.admit(b, "c1", 2.0).admit);
        // c1, ready after all, is an entry like any other: evicted for the next cell
        s.ready(
            a,
            "c1",
            at("h1", "w1"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 5.0, holds_slot: false },
            3.0,
        );
        let third = s.admit(a, "c3", 4.0);
        assert!(third.admit);
        assert_eq!(third.evict.iter().map(|e| e.at.worker.as_str()).collect::<Vec<_>>(), ["w1"]);
    }

    #[test]
    fn a_run_releases_an_admission_that_never_became_ready() {
        let mut s = Speculator::new(budget(1, 1e9));
        s.host_seen("h", 0.0);
        let sid = Uuid::now_v7();
        assert!(s.admit(sid, "a", 0.0).admit);
        // the run came before the worker was ready: nothing to hand over
        assert_eq!(s.for_run(sid, "a"), None);
        // the next cell is not refused for a budget the first no longer uses
        assert!(s.admit(sid, "b", 1.0).admit);
        // a worker used before it reported ready frees its admission too
        s.ended(sid, "b", "w", 0.0, false, 0.0);
        assert!(s.admit(sid, "c", 2.0).admit);
    }

    #[test]
    fn workers_prepared_without_a_slot_cost_no_idle_budget() {
        let mut s = Speculator::new(budget(4, 1.0));
        s.host_seen("h", 0.0);
        let sid = Uuid::now_v7();
        s.admit(sid, "c", 0.0);
        s.ready(
            sid,
            "c",
            at("h", "w"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 5.0, holds_slot: false },
            0.0,
        );
        assert!(s.over_budget(100.0).is_empty());
        s.ended(sid, "c", "w", 100_000.0, false, 100.0);
        assert!(s.admit(sid, "d", 100.0).admit);
    }

    #[test]
    fn a_used_worker_leaves_and_counts_its_idle_time() {
        let mut s = Speculator::new(budget(2, 100.0));
        s.host_seen("h", 0.0);
        let sid = Uuid::now_v7();
        s.admit(sid, "c", 0.0);
        s.ready(
            sid,
            "c",
            at("h", "w"),
            Ready { class: PreparedClass::Speculative, prepare_ms: 5.0, holds_slot: true },
            0.0,
        );
        assert_eq!(s.for_run(sid, "c"), Some(at("h", "w")));
        s.ended(sid, "c", "w", 4000.0, true, 10.0);
        assert!(s.for_run(sid, "c").is_none());
        assert!((s.idle_seconds(sid, 10.0) - 4.0).abs() < 1e-9);
    }
}
