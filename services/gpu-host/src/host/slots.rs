//! This host's GPU slots and what holds each one. Slots are named by their GPU
//! index everywhere (what events, status and workers' `CUDA_VISIBLE_DEVICES` use).
//! Held time is read from a [`Clock`], so the simulator runs this same code.

use std::time::Instant;

use schemas::clock::{Clock, SystemClock};
use schemas::messages::SlotStatus;
use uuid::Uuid;

use crate::gpus::Gpu;

/// What holds a slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Nothing.
    Free,
    /// Reserved while this host tries to claim a run (`Some(exec)`) or the
    /// preparation of a cell (`None`).
    Claiming(Option<Uuid>),
    /// Running `exec` for `session`.
    Busy {
        /// The execution.
        exec: Uuid,
        /// Its session.
        session: Uuid,
    },
    /// Kept with a worker that holds unsavable state.
    Pinned {
        /// The worker.
        worker: String,
        /// Its session.
        session: Uuid,
    },
    /// Held by a worker prepared (or kept warm) for a cell before Run.
    Prepared {
        /// The session.
        session: Uuid,
        /// The cell.
        cell_id: String,
    },
}

struct Slot {
    gpu: Gpu,
    state: SlotState,
    /// Since when the slot is held by its current user (what `SlotReleased` counts).
    since: Instant,
}

/// The slots of this host.
pub struct Slots<C: Clock = SystemClock> {
    slots: Vec<Slot>,
    clock: C,
}

impl Slots {
    /// Every slot free, on the system clock.
    pub fn new(gpus: Vec<Gpu>) -> Self {
        Self::with_clock(gpus, SystemClock)
    }
}

impl<C: Clock> Slots<C> {
    /// Every slot free, held time read from `clock`.
    pub fn with_clock(gpus: Vec<Gpu>, clock: C) -> Self {
        let now = clock.now();
        Self { slots: gpus.into_iter().map(|gpu| Slot { gpu, state: SlotState::Free, since: now }).collect(), clock }
    }

    /// Whether this host has no GPU slots (it runs only CPU cells).
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// How many slots this host has.
    pub fn len(&self) -> u32 {
        u32::try_from(self.slots.len()).unwrap_or(u32::MAX)
    }

    /// How many slots are free.
    pub fn free_count(&self) -> u32 {
        u32::try_from(self.slots.iter().filter(|s| s.state == SlotState::Free).count()).unwrap_or(u32::MAX)
    }

    /// `n` free slots' indices (a `%%gpu N` cell's), or None if fewer are free.
    pub fn free(&self, n: u32) -> Option<Vec<u32>> {
        let free: Vec<u32> =
            self.slots.iter().filter(|s| s.state == SlotState::Free).map(|s| s.gpu.index).take(n as usize).collect();
        (free.len() == n as usize).then_some(free)
    }

    /// The share of slots that are free, 0..=1 (0 with no slots).
    pub fn free_share(&self) -> f64 {
        let free = self.slots.iter().filter(|s| s.state == SlotState::Free).count();
        free as f64 / self.slots.len().max(1) as f64
    }

    /// What holds slot `index` (None: no such slot).
    pub fn state(&self, index: u32) -> Option<&SlotState> {
        self.slots.iter().find(|s| s.gpu.index == index).map(|s| &s.state)
    }

    /// Each slot's index and what holds it.
    pub fn states(&self) -> impl Iterator<Item = (u32, &SlotState)> + '_ {
        self.slots.iter().map(|s| (s.gpu.index, &s.state))
    }

    fn get(&mut self, index: u32) -> Option<&mut Slot> {
        self.slots.iter_mut().find(|s| s.gpu.index == index)
    }

    /// Take `slots` for a new holder: their held time starts now.
    pub fn take(&mut self, slots: &[u32], state: SlotState) {
        let now = self.clock.now();
        for index in slots {
            if let Some(s) = self.get(*index) {
                s.state = state.clone();
                s.since = now;
            }
        }
    }

    /// Hand `slots` on to the next step of the same holder (a claimed run starts,
    /// a prepared worker runs its cell): their held time goes on.
    pub fn hand_on(&mut self, slots: &[u32], state: SlotState) {
        for index in slots {
            if let Some(s) = self.get(*index) {
                s.state = state.clone();
            }
        }
    }

    /// Free slot `index` and say how long it was held (ms); None if it does not exist.
    pub fn release(&mut self, index: u32) -> Option<f64> {
        let now = self.clock.now();
        let s = self.get(index)?;
        s.state = SlotState::Free;
        Some(now.saturating_duration_since(s.since).as_secs_f64() * 1000.0)
    }

    /// Give up a reservation of `slots` without counting it as held (a claim lost).
    pub fn unreserve(&mut self, slots: &[u32]) {
        for index in slots {
            if let Some(s) = self.get(*index) {
                s.state = SlotState::Free;
            }
        }
    }

    /// How many slots are in each state, as metrics spell them.
    pub fn occupancy(&self) -> [(&'static str, i64); 5] {
        let mut counts = [("free", 0), ("claiming", 0), ("busy", 0), ("pinned", 0), ("prepared", 0)];
        for s in &self.slots {
            let i = match s.state {
                SlotState::Free => 0,
                SlotState::Claiming(_) => 1,
                SlotState::Busy { .. } => 2,
                SlotState::Pinned { .. } => 3,
                SlotState::Prepared { .. } => 4,
            };
            counts[i].1 += 1;
        }
        counts
    }

    /// Each slot for host status; `preparing(session, cell)` says whether a
    /// prepared worker is still being prepared.
    pub fn status(&self, preparing: impl Fn(Uuid, &str) -> bool) -> Vec<SlotStatus> {
        self.slots
            .iter()
            .map(|s| {
                let (exec_id, session, held_for) = match &s.state {
                    SlotState::Free => (None, None, None),
                    SlotState::Claiming(e) => (*e, None, Some("claiming".to_string())),
                    SlotState::Busy { exec, session } => (Some(*exec), Some(*session), Some("cell".to_string())),
                    SlotState::Pinned { session, worker } => {
                        (None, Some(*session), Some(format!("unsavable state in {worker}")))
                    }
                    SlotState::Prepared { session, cell_id } => {
                        // peers read "prepared for cell" as room (host/handlers.rs)
                        let what = if preparing(*session, cell_id) { "preparing" } else { "prepared" };
                        (None, Some(*session), Some(format!("{what} for cell {cell_id}")))
                    }
                };
                SlotStatus {
                    index: s.gpu.index,
                    name: s.gpu.name.clone(),
                    memory_bytes: s.gpu.memory_bytes,
                    exec_id,
                    session,
                    held_for,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(n: u32) -> Slots {
        Slots::new((0..n).map(|index| Gpu { index, name: "virtual".into(), memory_bytes: 0 }).collect())
    }

    #[test]
    fn slots_are_taken_and_released_by_index() {
        let mut s = slots(2);
        assert_eq!((s.free(1), s.free_share()), (Some(vec![0]), 1.0));
        let (exec, session) = (Uuid::now_v7(), Uuid::now_v7());
        s.take(&[0], SlotState::Claiming(Some(exec)));
        assert_eq!((s.free(1), s.free_share()), (Some(vec![1]), 0.5));
        s.hand_on(&[0], SlotState::Busy { exec, session });
        assert_eq!(s.free(1), Some(vec![1]));
        s.take(&[1], SlotState::Prepared { session, cell_id: "c".into() });
        assert_eq!(s.free(1), None);
        let st = s.status(|_, cell| cell == "c");
        assert_eq!(st[0].held_for.as_deref(), Some("cell"));
        assert_eq!(st[1].held_for.as_deref(), Some("preparing for cell c"));
        assert!(s.release(0).is_some_and(|ms| ms >= 0.0));
        assert_eq!(s.free(1), Some(vec![0]));
        assert_eq!(s.release(7), None, "no such slot");
    }

    #[test]
    fn a_multi_gpu_cell_takes_its_slots_together_or_none() {
        let mut s = slots(4);
        let (exec, session) = (Uuid::now_v7(), Uuid::now_v7());
        assert_eq!(s.free(5), None, "more than the host has");
        s.take(&[1], SlotState::Prepared { session, cell_id: "c".into() });
        assert_eq!(s.free(3), Some(vec![0, 2, 3]), "the free ones, whichever they are");
        s.take(&[0, 2, 3], SlotState::Busy { exec, session });
        assert_eq!((s.free_count(), s.free(1)), (0, None));
        let st = s.status(|_, _| false);
        assert_eq!(st.iter().filter(|x| x.exec_id == Some(exec)).count(), 3, "each slot names the run");
        s.unreserve(&[0, 2]);
        assert_eq!((s.free_count(), s.free(2)), (2, Some(vec![0, 2])));
        assert_eq!(s.free(3), None);
    }
}
