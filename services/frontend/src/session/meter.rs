//! What the session's runs use, booked in the usage ledger ([`crate::usage`]):
//! each run's GPU-slot time, CPU time and start are gathered from its events and
//! booked once it is done; a slot held outside any run (a prepared worker, state
//! that cannot be saved) or released after its run was booked is booked at once.
//! And whether the owner's quota ([`crate::quota`]) lets a run have a GPU.

use std::collections::{HashMap, HashSet, VecDeque};

use tokio::sync::mpsc;

use looseleaf_client::events::{Device, Event};
use uuid::Uuid;

use super::SessionActor;
use crate::api::{ExecStatus, StreamItem};
use crate::quota;
use crate::usage::{day_of, Account, Spent};

/// Runs booked lately, whose late slot releases are booked on their own.
const BOOKED_KEPT: usize = 16;

/// What the session's runs used that is not booked yet.
pub(super) struct Meter {
    /// The session's booker ([`booker`]).
    booker: mpsc::UnboundedSender<Booking>,
    /// Per run not done: what it used so far, and whether it ran on a GPU.
    pending: HashMap<Uuid, (Spent, bool)>,
    booked: VecDeque<Uuid>,
    /// Runs sent with a GPU refused, until they are done (one that ends failed
    /// without starting was refused: counted per user).
    refused: HashSet<Uuid>,
    /// Runs this actor marked as running on a GPU, until planned on the CPU or done.
    marked: HashSet<Uuid>,
    /// Slot releases of no run booked lately (host, slot, when): one the bus
    /// delivers again is not booked twice.
    released: VecDeque<(String, u32, u64)>,
}

impl Meter {
    /// A meter that books through `booker`.
    pub(super) fn new(booker: mpsc::UnboundedSender<Booking>) -> Self {
        Self {
            booker,
            pending: HashMap::new(),
            booked: VecDeque::new(),
            refused: HashSet::new(),
            marked: HashSet::new(),
            released: VecDeque::new(),
        }
    }
}

impl SessionActor {
    /// Gather what `item` says the session used; book a run once it is done.
    pub(super) fn meter(&mut self, item: &StreamItem) {
        let (exec_id, unix_ms) = match item {
            StreamItem::Event { exec_id, unix_ms, .. } | StreamItem::Done { exec_id, unix_ms, .. } => {
                (*exec_id, *unix_ms)
            }
            StreamItem::Queued { .. } | StreamItem::Output { .. } => return,
        };
        match item {
            StreamItem::Event { event: Event::Planned { device: Device::Cpu, .. }, .. } if !exec_id.is_nil() => {
                self.unmark(exec_id);
            }
            StreamItem::Event { event: Event::Started { device, .. }, .. } => {
                let (spent, gpu) = self.meter.pending.entry(exec_id).or_default();
                spent.cells = 1;
                *gpu = *device == Device::Gpu;
                spent.gpu_cells = u64::from(*gpu);
            }
            StreamItem::Event { event: Event::Finished { run_ms, .. }, .. } => {
                if let Some((spent, false)) = self.meter.pending.get_mut(&exec_id) {
                    spent.cpu_ms = *run_ms;
                }
            }
            StreamItem::Event { event: Event::SlotReleased { host, slot, held_ms, .. }, .. } => {
                let held = Spent { gpu_ms: *held_ms, ..Spent::default() };
                let release = (host.clone(), *slot, unix_ms);
                if self.meter.released.contains(&release) {
                    return; // delivered again
                }
                self.meter.released.push_back(release);
                while self.meter.released.len() > BOOKED_KEPT {
                    self.meter.released.pop_front();
                }
                if exec_id.is_nil() || self.meter.booked.contains(&exec_id) {
                    self.book(unix_ms, held, None);
                } else {
                    self.meter.pending.entry(exec_id).or_default().0.gpu_ms += held_ms;
                }
            }
            StreamItem::Done { status, .. } => {
                self.unmark(exec_id);
                let started = self.meter.pending.get(&exec_id).is_some_and(|(spent, _)| spent.cells > 0);
                if self.meter.refused.remove(&exec_id) && *status == ExecStatus::Failed && !started {
                    let user = schemas::metrics::user_label(self.stored.owner.as_deref());
                    schemas::metrics::metrics().user_quota_refusals.get_or_create(&user).inc();
                }
                let Some((spent, _)) = self.meter.pending.remove(&exec_id) else { return };
                // an aborted run never started; a slot it held still counts
                let spent = if *status == ExecStatus::Aborted {
                    Spent { gpu_ms: spent.gpu_ms, ..Spent::default() }
                } else {
                    spent
                };
                self.meter.booked.push_back(exec_id);
                while self.meter.booked.len() > BOOKED_KEPT {
                    self.meter.booked.pop_front();
                }
                self.book(unix_ms, spent, Some(exec_id));
            }
            _ => {}
        }
    }

    /// The actor stops: book what runs not done used so far, except the run in
    /// flight (the frontend that adopts the session books it whole), and clear
    /// its marks (a mark nobody clears would count against its user for good).
    pub(super) fn meter_flush(&mut self) {
        let in_flight = self.stored.in_flight.as_ref().map(|f| f.exec_id);
        for (exec_id, (spent, _)) in std::mem::take(&mut self.meter.pending) {
            if Some(exec_id) != in_flight {
                self.book(schemas::unix_ms(), spent, Some(exec_id));
            }
        }
        for exec_id in std::mem::take(&mut self.meter.marked) {
            self.shared.usage.unmark_running(exec_id);
        }
    }

    fn unmark(&mut self, exec_id: Uuid) {
        if self.meter.marked.remove(&exec_id) {
            self.shared.usage.unmark_running(exec_id);
        }
    }

    /// Why run `exec_id`, about to be sent, may not have a GPU (its owner's
    /// quota), if so; otherwise, where the owner's GPU cells at once are limited,
    /// the run counts as one until it is planned on the CPU or done.
    pub(super) fn gpu_refusal(&mut self, exec_id: Uuid) -> Option<String> {
        let owner = &self.stored.owner;
        let limit = self.shared.quotas.current().limit_of(owner.as_deref());
        if limit == quota::Limit::default() {
            return None; // no quota: nothing to count (every run passes here)
        }
        let usage = &self.shared.usage;
        let running = usage.running_gpu_cells(owner, self.sid);
        let refused =
            quota::gpu_refusal(limit, owner.as_deref(), &usage.used_today(owner), running, schemas::unix_ms());
        if refused.is_some() {
            self.meter.refused.insert(exec_id);
        } else if limit.concurrent_gpu_cells.is_some() {
            usage.mark_running(self.sid, owner.clone(), exec_id);
            self.meter.marked.insert(exec_id);
        }
        refused
    }

    /// Whether the owner's GPU-seconds of the day are used up (then no worker is
    /// prepared for an edit: it could hold a slot).
    pub(super) fn gpu_day_used_up(&self) -> bool {
        let owner = &self.stored.owner;
        let limit = self.shared.quotas.current().limit_of(owner.as_deref());
        if limit.gpu_seconds_per_day.is_none() {
            return false; // every edit passes here
        }
        let day_only = quota::Limit { concurrent_gpu_cells: None, ..limit };
        let used = self.shared.usage.used_today(owner);
        quota::gpu_refusal(day_only, owner.as_deref(), &used, 0, schemas::unix_ms()).is_some()
    }

    fn book(&self, unix_ms: u64, spent: Spent, run: Option<Uuid>) {
        if spent.is_empty() {
            return;
        }
        // the booker lives as long as the actor
        let _ = self.meter.booker.send((day_of(unix_ms), run, spent));
    }
}

/// A run's (or a slot's) use to book: its day, its run, what it used.
pub(super) type Booking = (String, Option<Uuid>, Spent);

/// What a run (None: a slot outside any run) used.
type RunSpent = (Option<Uuid>, Spent);

/// How long the booker gathers bookings into one write: a burst of short cells
/// is one compare-and-set, not one per cell.
const BOOKING_GATHER: std::time::Duration = std::time::Duration::from_secs(1);

/// The session's booker: what its runs used goes to the ledger, gathered, in
/// order, once per [`BOOKING_GATHER`] at most; what is queued when the actor
/// stops is still booked.
pub(super) fn booker(ledger: crate::usage::Ledger, account: Account) -> mpsc::UnboundedSender<Booking> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Booking>();
    tokio::spawn(async move {
        while let Some(first) = rx.recv().await {
            tokio::time::sleep(BOOKING_GATHER).await;
            // (a day's items; a burst around midnight spans two)
            let mut days: Vec<(String, Vec<RunSpent>)> = Vec::new();
            for (day, run, spent) in std::iter::once(first).chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                match days.iter_mut().find(|(d, _)| *d == day) {
                    Some((_, items)) => items.push((run, spent)),
                    None => days.push((day, vec![(run, spent)])),
                }
            }
            for (day, items) in days {
                match ledger.book(&account, &day, &items).await {
                    // counted here once it is in the ledger (a run booked already is not)
                    Ok(added) => {
                        let m = schemas::metrics::metrics();
                        let user = schemas::metrics::user_label(account.owner.as_deref());
                        m.user_gpu_seconds.get_or_create(&user).inc_by(added.gpu_ms / 1000.0);
                        m.user_cpu_seconds.get_or_create(&user).inc_by(added.cpu_ms / 1000.0);
                        m.user_cells.get_or_create(&user).inc_by(added.cells);
                    }
                    Err(e) => {
                        tracing::error!(session = %account.session_id, ?items, error = %e, "usage not booked")
                    }
                }
            }
        }
    });
    tx
}
