//! The `looseleaf` policy's autoscaler (issue "Scale", item 5; ADR 74). The
//! baselines keep NotebookOS's rule, which scales on the slots held; LooseLeaf's
//! hosts follow the planner's GPU demand led by the edit stream ([`Demand`]):
//! staged preparation holds no slot while users type, so the slots held lag the
//! runs about to come.
//!
//! Scaling in differs too. NotebookOS releases only hosts that happen to be
//! idle, and with runs spread over the hosts that have most free slots, few ever
//! are. A surplus host is cordoned instead (the gpu-host core's `Cordon`): it
//! takes no new work but still runs the cells of the workers it prepared, so no
//! preparation is lost, and it is released once it holds nothing. When the
//! demand comes back a cordoned host takes work again before any host boots.
//! Cell run times have a long tail (a cell that has run for ten minutes is
//! likely to run for many more), so the hosts cordoned are those whose oldest
//! cell is youngest.
//!
//! Here too is what every LooseLeaf run tells the hosts about room: each host's
//! free slots as its peers hear them (none while cordoned), and a request for a
//! host when a run finds room nowhere.

use looseleaf_gpu_host::core::runs::RunState;
use looseleaf_gpu_host::core::{HostCore, Input};
use looseleaf_gpu_host::host::slots::SlotState;
use looseleaf_planner::demand::Demand;
use uuid::Uuid;

use super::looseleaf::LooseLeaf;
use crate::cluster::{Power, SimClock};
use crate::engine::Sim;

/// Hosts wanted above the demand (the share kept for what the demand's two
/// standard deviations miss).
const HEADROOM: f64 = 1.05;
/// A host is cordoned only while more than this share above the demand is on,
/// so that a dip between two checks does not cordon a host the next one needs.
const CORDON_ABOVE: f64 = 1.1;
/// How far ahead the demand looks (s): a host's boot and the time to the next
/// scaling check.
pub(super) const LEAD_S: f64 = 40.0;

/// A host as the autoscaler sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct HostView {
    pub(super) index: usize,
    /// Slots in use (running, claiming, prepared on a slot, kept).
    pub(super) held: u32,
    /// Slots kept with a worker holding unsavable state: draining would lose it.
    pub(super) pinned: u32,
    /// How long its oldest running cell has run (s; 0 if none).
    pub(super) oldest_run_s: f64,
}

/// What the autoscaler does at one check.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Decision {
    /// Cordoned hosts to take work again.
    pub(super) uncordon: u32,
    /// Hosts to boot.
    pub(super) boot: u32,
    /// Hosts to cordon.
    pub(super) cordon: Vec<usize>,
}

/// Hosts (of `gpus_per_host`) for `gpus` GPUs times `share`.
fn hosts_for(gpus: f64, share: f64, gpus_per_host: u32) -> u32 {
    ((gpus * share / f64::from(gpus_per_host.max(1))).ceil() as u32).max(1)
}

/// The decision for `wanted` GPUs (the demand, never below the slots held now),
/// with `booting` hosts on their way, `cordoned` hosts that could take work
/// again, and `serving` hosts on and not cordoned. Hosts to cordon are those
/// whose oldest cell is youngest (then those holding fewest slots), none that
/// keeps unsavable state.
pub(super) fn decide(wanted: f64, gpus_per_host: u32, booting: u32, cordoned: u32, serving: &[HostView]) -> Decision {
    let held: u32 = serving.iter().map(|h| h.held).sum();
    let wanted = wanted.max(f64::from(held));
    let have = booting + serving.len() as u32;
    let target = hosts_for(wanted, HEADROOM, gpus_per_host);
    if have < target {
        let uncordon = (target - have).min(cordoned);
        return Decision { uncordon, boot: target - have - uncordon, cordon: vec![] };
    }
    let limit = hosts_for(wanted, CORDON_ABOVE, gpus_per_host);
    if booting > 0 || have <= limit {
        return Decision::default();
    }
    let mut candidates: Vec<&HostView> = serving.iter().filter(|h| h.pinned == 0).collect();
    candidates.sort_by(|a, b| {
        let by_age = a.oldest_run_s.total_cmp(&b.oldest_run_s);
        by_age.then(a.held.cmp(&b.held)).then(b.index.cmp(&a.index))
    });
    let cordon = candidates.iter().take((have - limit) as usize).map(|h| h.index).collect();
    Decision { cordon, ..Decision::default() }
}

/// The demand the policy feeds as the planner would, and the hosts it cordoned.
pub(super) struct Scaler {
    pub(super) demand: Demand,
    /// Hosts cordoned, in the order they were: released once they hold nothing.
    pub(super) cordoned: Vec<usize>,
}

impl Default for Scaler {
    fn default() -> Self {
        Self { demand: Demand::new(LEAD_S), cordoned: vec![] }
    }
}

impl LooseLeaf {
    /// Tell every other host how many slots the best of them has free (all a
    /// host's claim delay asks of its peers).
    pub(super) fn share_status(&mut self, sim: &mut Sim) {
        let free: Vec<(usize, usize)> =
            (0..self.cores.len()).filter_map(|h| self.cores[h].as_ref().map(|c| (h, self.free_slots(h, c)))).collect();
        for &(h, _) in &free {
            let best_other = free.iter().filter(|(o, _)| *o != h).map(|(_, f)| *f).max();
            if let Some(free_slots) = best_other {
                self.feed(sim, h, Input::PeerStatus { host: "others".into(), free_slots });
            }
        }
    }

    /// How long the oldest cell running on host `h` has run (s; 0 if none).
    pub(super) fn oldest_run_s(&self, sim: &Sim, h: usize) -> f64 {
        let runs = self.running.iter().enumerate().filter(|(_, r)| r.as_ref().is_some_and(|r| r.host == h));
        runs.map(|(s, _)| sim.now() - sim.progress[s].run_at).fold(0.0, f64::max)
    }

    /// The free slots host `h` offers new work: none while it is cordoned.
    pub(super) fn free_slots(&self, h: usize, core: &HostCore<SimClock>) -> usize {
        if self.scaler.cordoned.contains(&h) {
            0
        } else {
            core.slots().free_count() as usize
        }
    }

    /// Runs that no host is claiming, running or holding: ask the autoscaler for
    /// a host (it runs one operation at a time and refuses the rest), on every
    /// change, as a full cluster's waiting runs would have it scale out.
    pub(super) fn ask_for_room(&mut self, sim: &mut Sim) {
        let held = |state: Option<&RunState>| {
            matches!(
                state,
                Some(
                    RunState::Routing
                        | RunState::Won
                        | RunState::OnPreparing(_)
                        | RunState::ForPrepared(_)
                        | RunState::Running { .. }
                )
            )
        };
        let waiting = self.unstarted.iter().any(|&s| {
            let exec = Uuid::from_u128(((s as u128) << 32) | sim.progress[s].cell as u128);
            !self.cores.iter().flatten().any(|c| held(c.run_state(exec)))
        });
        if waiting {
            sim.request_hosts(1);
        }
    }

    /// The autoscaler's check: hosts for the demand (those cordoned first, then
    /// booted), or the surplus cordoned. A fixed cluster is left as it is.
    pub(super) fn scale_cluster(&mut self, sim: &mut Sim) -> bool {
        if sim.cluster.autoscaler.fixed {
            return false;
        }
        self.release_cordoned(sim);
        let wanted = self.scaler.demand.at(sim.now()).wanted_gpus;
        let hosts = &sim.cluster.hosts;
        let booting = hosts.iter().filter(|h| matches!(h.power, Power::Booting { .. })).count() as u32;
        let serving: Vec<HostView> = (0..hosts.len())
            .filter(|h| hosts[*h].is_on() && !self.scaler.cordoned.contains(h))
            .map(|index| {
                let slots = &hosts[index].slots;
                let pinned = slots.states().filter(|(_, s)| matches!(s, SlotState::Pinned { .. })).count() as u32;
                HostView { index, held: hosts[index].held(), pinned, oldest_run_s: self.oldest_run_s(sim, index) }
            })
            .collect();
        let gpus_per_host = sim.cluster.autoscaler.gpus_per_host;
        let cordoned = self.scaler.cordoned.len() as u32;
        let decision = decide(wanted, gpus_per_host, booting, cordoned, &serving);
        // the latest cordoned holds most: it takes work again first
        for _ in 0..decision.uncordon {
            let Some(h) = self.scaler.cordoned.pop() else { break };
            self.count("hosts_uncordoned");
            self.feed(sim, h, Input::Cordon(false));
        }
        if decision.boot > 0 {
            sim.request_hosts(decision.boot);
        }
        for h in decision.cordon {
            self.scaler.cordoned.push(h);
            self.count("hosts_cordoned");
            self.feed(sim, h, Input::Cordon(true));
        }
        self.release_cordoned(sim);
        true
    }

    /// Release the cordoned hosts that hold nothing any more (one scaling
    /// operation at a time: those left wait for the next change).
    pub(super) fn release_cordoned(&mut self, sim: &mut Sim) {
        if sim.cluster.op_until.is_some() {
            return;
        }
        let done: Vec<usize> = self
            .scaler
            .cordoned
            .iter()
            .copied()
            .filter(|&h| self.cores.get(h).and_then(Option::as_ref).is_none_or(|c| c.holds_nothing()))
            .collect();
        if done.is_empty() {
            return;
        }
        for &h in &done {
            self.feed(sim, h, Input::Stopping);
            self.feed(sim, h, Input::Stopped);
            self.scaler.cordoned.retain(|c| *c != h);
        }
        sim.release_hosts(&done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(index: usize, held: u32) -> HostView {
        HostView { index, held, pinned: 0, oldest_run_s: 0.0 }
    }

    #[test]
    fn hosts_boot_for_the_demand_before_its_slots_are_held() {
        // 20 GPUs wanted, 2 held, one 8-GPU host on: two more (21 GPUs with headroom)
        assert_eq!(decide(20.0, 8, 0, 0, &[view(0, 2)]), Decision { boot: 2, ..Decision::default() });
        // those booting count
        assert_eq!(decide(20.0, 8, 2, 0, &[view(0, 2)]), Decision::default());
        // the slots held count when the demand says less
        assert_eq!(decide(0.0, 8, 0, 0, &[view(0, 8)]).boot, 1);
    }

    #[test]
    fn the_emptiest_hosts_are_cordoned_once_the_surplus_is_past_the_margin() {
        let hosts = [view(0, 3), view(1, 0), view(2, 1), view(3, 5)];
        // 9 GPUs held, 12 wanted: 2 hosts within the headroom, 2 past the margin
        assert_eq!(decide(12.0, 8, 0, 0, &hosts).cordon, vec![1, 2]);
        // within the margin nothing drains
        assert_eq!(decide(26.0, 8, 0, 0, &hosts), Decision::default());
        // nor while a host boots (the demand is rising)
        assert_eq!(decide(12.0, 8, 1, 0, &hosts), Decision::default());
    }

    #[test]
    fn a_host_whose_cells_started_lately_is_cordoned_before_one_running_a_long_cell() {
        let long = HostView { oldest_run_s: 600.0, ..view(0, 1) };
        let busy = HostView { oldest_run_s: 20.0, ..view(1, 3) };
        let hosts = [long, busy, HostView { oldest_run_s: 300.0, ..view(2, 5) }];
        assert_eq!(decide(1.0, 8, 0, 0, &hosts).cordon, vec![1]);
    }

    #[test]
    fn a_host_keeping_unsavable_state_is_not_cordoned() {
        let hosts = [view(0, 2), HostView { pinned: 1, ..view(1, 1) }, view(2, 4)];
        // 7 held: one host would do; the emptiest, host 1, keeps state
        assert_eq!(decide(1.0, 8, 0, 0, &hosts).cordon, vec![0, 2]);
    }
}
