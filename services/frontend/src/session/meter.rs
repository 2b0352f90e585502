//! What the session's runs use, booked in the usage ledger ([`crate::usage`]):
//! each run's GPU-slot time, CPU time and start are gathered from its events and
//! booked once it is done; a slot held outside any run (a prepared worker, state
//! that cannot be saved) or released after its run was booked is booked at once.

use std::collections::{HashMap, VecDeque};

use looseleaf_client::events::{Device, Event};
use uuid::Uuid;

use super::SessionActor;
use crate::api::{ExecStatus, StreamItem};
use crate::usage::{day_of, Account, Spent};

/// Runs booked lately, whose late slot releases are booked on their own.
const BOOKED_KEPT: usize = 16;

/// What the session's runs used that is not booked yet.
#[derive(Default)]
pub(super) struct Meter {
    /// Per run not done: what it used so far, and whether it ran on a GPU.
    pending: HashMap<Uuid, (Spent, bool)>,
    booked: VecDeque<Uuid>,
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
            StreamItem::Event { event: Event::SlotReleased { held_ms, .. }, .. } => {
                let held = Spent { gpu_ms: *held_ms, ..Spent::default() };
                if exec_id.is_nil() || self.meter.booked.contains(&exec_id) {
                    self.book(unix_ms, held, None);
                } else {
                    self.meter.pending.entry(exec_id).or_default().0.gpu_ms += held_ms;
                }
            }
            StreamItem::Done { status, .. } => {
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

    /// Book what every run not done used so far (the actor stops).
    pub(super) fn meter_flush(&mut self) {
        for (exec_id, (spent, _)) in std::mem::take(&mut self.meter.pending) {
            self.book(schemas::unix_ms(), spent, Some(exec_id));
        }
    }

    fn book(&self, unix_ms: u64, spent: Spent, run: Option<Uuid>) {
        if spent.is_empty() {
            return;
        }
        let account =
            Account { session_id: self.sid, owner: self.stored.owner.clone(), notebook: self.stored.notebook.clone() };
        let m = schemas::metrics::metrics();
        let user = schemas::metrics::user_label(account.owner.as_deref());
        m.user_gpu_seconds.get_or_create(&user).inc_by(spent.gpu_ms / 1000.0);
        m.user_cpu_seconds.get_or_create(&user).inc_by(spent.cpu_ms / 1000.0);
        m.user_cells.get_or_create(&user).inc_by(spent.cells);
        let ledger = self.shared.usage.clone();
        let day = day_of(unix_ms);
        tokio::spawn(async move {
            if let Err(e) = ledger.book(&account, &day, spent, run).await {
                tracing::error!(session = %account.session_id, ?spent, error = %e, "usage not booked");
            }
        });
    }
}
