//! The policies compared (issue 17): session-pinned GPUs (with and without idle
//! timeouts), NotebookOS, naive serverless, Modal-style containers (recompute or
//! snapshot restore after idle shutdown) and LooseLeaf itself.

pub mod containers;
pub mod looseleaf;
mod looseleaf_scaling;
mod looseleaf_starts;
pub mod notebookos;
pub mod pinned;

use looseleaf_gpu_host::host::slots::SlotState;
use uuid::Uuid;

use crate::engine::{Policy, Sim};

/// Take `gpus` free slots of `host` for `state`; None if it has too few.
pub(crate) fn take(sim: &mut Sim, host: usize, gpus: u32, state: SlotState) -> Option<Vec<u32>> {
    let slots = sim.cluster.hosts[host].slots.free(gpus)?;
    sim.cluster.hosts[host].slots.take(&slots, state);
    Some(slots)
}

/// The slot state of a cell run by session `s`.
pub(crate) fn busy(sim: &Sim, s: usize) -> SlotState {
    let session = sim.session(s).id;
    SlotState::Busy { exec: Uuid::from_u128(((s as u128) << 32) | sim.progress[s].cell as u128), session }
}

/// GPUs a session needs at most (what a pinned session or a container holds).
pub(crate) fn session_gpus(sim: &Sim, s: usize) -> u32 {
    sim.session(s).cells.iter().map(|c| c.gpus).max().unwrap_or(1).max(1)
}

/// Seconds for `bytes` at `per_s` bytes a second.
pub(crate) fn secs(bytes: u64, per_s: f64) -> f64 {
    if per_s > 0.0 {
        bytes as f64 / per_s
    } else {
        0.0
    }
}

/// Every policy in one run, by their result names.
pub fn all(budget: looseleaf_planner::speculator::Budget) -> Vec<Box<dyn Policy>> {
    vec![
        Box::new(pinned::Pinned::new(None)),
        Box::new(pinned::Pinned::new(Some(30.0 * 60.0))),
        Box::new(pinned::Pinned::new(Some(60.0 * 60.0))),
        Box::new(pinned::Pinned::new(Some(180.0 * 60.0))),
        Box::new(notebookos::NotebookOs::new()),
        Box::new(containers::Containers::naive()),
        Box::new(containers::Containers::modal()),
        Box::new(containers::Containers::snapshot(containers::Snapshot::Gcr)),
        Box::new(containers::Containers::snapshot(containers::Snapshot::Criu)),
        Box::new(looseleaf::LooseLeaf::new(budget)),
        Box::new(looseleaf::LooseLeaf::scaling_on_demand(budget)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Autoscaler;
    use crate::costs::Costs;
    use crate::dist::Samples;
    use crate::engine::{simulate, Outcome};
    use crate::workload::{Cell, Session, Workload};

    /// Fixed costs: every draw is known.
    fn costs() -> Costs {
        let one = |ms: f64| Samples::new(vec![ms], "test");
        Costs {
            hit_start_ms: one(5.0),
            cold_start_ms: one(100.0),
            import_tail_ms: one(400.0),
            naive_start_ms: one(2000.0),
            restore_bytes_per_s: 1e9,
            save_bytes_per_s: 1e9,
            host_to_gpu_bytes_per_s: 0.0,
            cuda_init_s: 0.0,
            s3_down_bytes_per_s: 100e6,
            s3_up_bytes_per_s: 100e6,
            snapshot_gcr_s: 2.5,
            snapshot_criu_s: 4.38,
            sources: vec![],
        }
    }

    fn cell(id: &str, gap_s: f64, edit_s: f64, gpu: bool, run_s: f64, closure_bytes: u64) -> Cell {
        Cell {
            cell_id: id.into(),
            gap_s,
            edit_s,
            gpu,
            gpus: u32::from(gpu),
            run_s,
            closure_bytes,
            closure: vec![],
            state_bytes: closure_bytes,
            saved_bytes: 0,
            import_tail: false,
            prepare_s: None,
            ready_s: None,
            save_s: None,
        }
    }

    fn one_session(cells: Vec<Cell>, close_s: f64) -> Workload {
        let session = Session { id: Uuid::from_u128(7), name: "s".into(), open_s: 0.0, close_s, cells };
        Workload { name: "test".into(), params: serde_json::Value::Null, sessions: vec![session] }
    }

    fn run(policy: &mut dyn Policy, w: &Workload) -> Outcome {
        simulate(policy, w, &costs(), Autoscaler::fixed(2, 2), 1, true)
    }

    fn budget() -> looseleaf_planner::speculator::Budget {
        looseleaf_planner::DEFAULT_BUDGET
    }

    #[test]
    fn a_pinned_session_holds_its_gpu_from_open_to_close() {
        // one GPU cell at 10 s (edit 10 s, run 20 s), the session closes at 1000 s
        let w = one_session(vec![cell("a", 0.0, 10.0, true, 20.0, 0)], 1000.0);
        let pinned = run(&mut pinned::Pinned::new(None), &w);
        assert!((pinned.held_gpu_hours * 3600.0 - 1000.0).abs() < 1e-6, "{}", pinned.held_gpu_hours * 3600.0);
        assert_eq!((pinned.gpu_cells, pinned.p50_start_ms), (1, 0.0));
        assert_eq!(pinned.p99_completion_overhead_ms, 0.0, "the pinned run is the reference");
        // LooseLeaf holds it from Run to the end of the run: the worker prepared
        // while the user typed holds none (staged, ADR 70)
        let ll = run(&mut looseleaf::LooseLeaf::new(budget()), &w);
        let held = ll.held_gpu_hours * 3600.0;
        assert!(held > 20.0 && held < 20.1, "{held}");
        assert_eq!(ll.counters.get("hits"), Some(&1.0));
        assert!((ll.p50_start_ms - 5.0).abs() < 1e-9, "a hit starts in the measured hit time");
        assert_eq!(ll.counters.get("lifecycle_violations"), None);
        // both count the same busy time and the same two provisioned hosts
        assert!((pinned.busy_gpu_hours - ll.busy_gpu_hours).abs() < 1e-12);
        assert!((pinned.gpu_hours - ll.gpu_hours).abs() < 1e-9);
    }

    #[test]
    fn looseleaf_runs_cold_or_waits_for_its_preparation_when_the_edit_is_short() {
        // 2 GB closure: 0.1 s + 2 s restore; an edit of 1 s leaves ~1.2 s to wait
        let w = one_session(
            vec![cell("a", 0.0, 1.0, true, 5.0, 2_000_000_000), cell("b", 60.0, 30.0, true, 5.0, 2_000_000_000)],
            1000.0,
        );
        let ll = run(&mut looseleaf::LooseLeaf::new(budget()), &w);
        assert_eq!(ll.counters.get("hits_while_preparing"), Some(&1.0));
        assert_eq!(ll.counters.get("hits"), Some(&1.0));
        assert_eq!(ll.replayed.len(), 2);
        let waited = ll.replayed[0].start_delay_ms;
        // prepared from 0.1 s: claim delay (ms) + 2.1 s, Run at 1 s, + the 5 ms hit
        assert!(waited > 1200.0 && waited < 1230.0, "{waited}");
        assert!((ll.replayed[1].start_delay_ms - 5.0).abs() < 1e-9);
        assert!((ll.within_1s - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_staged_run_holds_its_slot_for_the_copy_in_and_the_run_only() {
        // 2 GB closure typed for 30 s; CUDA init 0.2 s and 1 GB/s to the device:
        // prepared in host memory while typed, 2.2 s of stage-in at Run
        let w = one_session(vec![cell("a", 0.0, 30.0, true, 10.0, 2_000_000_000)], 1000.0);
        let staged_costs = Costs { host_to_gpu_bytes_per_s: 1e9, cuda_init_s: 0.2, ..costs() };
        let mut ll = looseleaf::LooseLeaf::new(budget());
        let o = simulate(&mut ll, &w, &staged_costs, Autoscaler::fixed(2, 2), 1, true);
        assert_eq!(o.counters.get("hits"), Some(&1.0));
        let start = o.replayed[0].start_delay_ms;
        assert!((start - 2205.0).abs() < 1e-6, "the hit (5 ms) and the stage-in (2.2 s): {start}");
        let held = o.held_gpu_hours * 3600.0;
        assert!((held - 12.205).abs() < 0.01, "stage-in and run, not the 30 s of typing: {held}");
        assert!((o.p50_completion_overhead_ms - 2205.0).abs() < 1e-6, "it ends as much later than a pinned run");
        // a save (1 GB at 1 GB/s) comes before the next cell may start
        let saving = one_session(
            vec![Cell { saved_bytes: 1_000_000_000, ..cell("a", 0.0, 30.0, true, 10.0, 2_000_000_000) }],
            1000.0,
        );
        let mut ll = looseleaf::LooseLeaf::new(budget());
        let o = simulate(&mut ll, &saving, &staged_costs, Autoscaler::fixed(2, 2), 1, true);
        let overhead = o.p50_completion_overhead_ms;
        assert!((overhead - 3205.0).abs() < 1e-6, "start 2,205 ms and save 1 s: {overhead}");
    }

    #[test]
    fn an_idle_timeout_reclaims_the_gpu_and_the_next_cell_replays_the_session() {
        let w = one_session(
            vec![
                cell("a", 0.0, 10.0, true, 20.0, 0),
                cell("b", 10.0, 10.0, false, 30.0, 0),
                // back after an hour away
                cell("c", 3600.0, 10.0, true, 5.0, 0),
            ],
            5000.0,
        );
        let p = run(&mut pinned::Pinned::new(Some(1800.0)), &w);
        assert_eq!(p.counters.get("reclaims"), Some(&1.0));
        // the kernel's start (2 s) and both earlier cells again (20 + 30 s)
        assert!((p.max_start_ms - 52_000.0).abs() < 1e-6, "{}", p.max_start_ms);
        let none = run(&mut pinned::Pinned::new(None), &w);
        assert_eq!(none.max_start_ms, 0.0);
        assert!(p.held_gpu_hours < none.held_gpu_hours);
    }

    #[test]
    fn notebookos_runs_on_a_replica_host_and_the_upload_delays_the_next_cell() {
        // a second GPU cell right after the first waits for its 1 GB upload (10 s)
        let w = one_session(
            vec![cell("a", 0.0, 10.0, true, 5.0, 1_000_000_000), cell("b", 0.0, 0.5, true, 5.0, 1_000_000_000)],
            500.0,
        );
        let mut nbos = notebookos::NotebookOs::new();
        let o = simulate(&mut nbos, &w, &costs(), Autoscaler::fixed(4, 1), 1, true);
        assert!(nbos.replica_hosts(0).is_empty(), "a closed session's replicas are gone");
        assert_eq!(o.replayed[0].start_delay_ms, 0.0, "a replica's host had an idle GPU");
        assert!((o.replayed[1].start_delay_ms - 9500.0).abs() < 1e-6, "{}", o.replayed[1].start_delay_ms);
        assert_eq!(o.counters.get("migrations"), Some(&0.0));
        assert!((o.gpu_hours - 4.0 * o.end_s / 3600.0).abs() < 1e-9, "a fixed cluster of 4 hosts of 1 GPU");
    }

    #[test]
    fn naive_serverless_restores_the_whole_session_for_every_gpu_cell() {
        let w = one_session(vec![cell("a", 0.0, 10.0, true, 20.0, 3_000_000_000)], 100.0);
        let o = run(&mut containers::Containers::naive(), &w);
        // 2 s interpreter and imports + 3 GB at 1 GB/s
        assert!((o.p50_start_ms - 5000.0).abs() < 1e-6, "{}", o.p50_start_ms);
    }
}
