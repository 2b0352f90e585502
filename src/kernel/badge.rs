//! What the JupyterLab extension shows, from the session's stream: each cell's
//! live state for its badge, and the session's totals for the side panel. The
//! kernel sends both on the edit comm (ADR 49); the words are the extension's.

use looseleaf_client::api::StreamItem;
use looseleaf_client::events::{Device, Event, Prepare, PreparedOutcome};
use serde_json::{json, Value};
use uuid::Uuid;

/// The run the kernel is waiting on: its execution and cell.
#[derive(Clone, Copy)]
pub struct CurrentRun<'a> {
    pub exec_id: Uuid,
    pub cell_id: &'a str,
}

fn spelled<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The comm message that moves a cell's badge, if `item` moves one:
/// `{"action": "state", "cell_id", "state", ...}` with `state` one of
/// `planned` (with `device`, `device_reason`, `closure`, `conservative`),
/// `preparing`, `ready`, `released` (with `outcome`): a worker prepared for the
/// cell's edit; and `queued`, `preparing`, `running`, `saving`, `saved`, `failed`
/// for the run in `run`. Another execution's events move no badge.
pub fn cell_state(item: &StreamItem, run: Option<CurrentRun>) -> Option<Value> {
    let of_run = |exec_id: &Uuid| run.filter(|r| r.exec_id == *exec_id && !exec_id.is_nil());
    let (cell_id, mut state) = match item {
        StreamItem::Queued { exec_id, .. } => (of_run(exec_id)?.cell_id.to_string(), json!({ "state": "queued" })),
        StreamItem::Event { exec_id, event, .. } if exec_id.is_nil() => match event {
            Event::Planned { cell_id, .. } => (cell_id.clone(), planned(event)),
            Event::Preparing { cell_id, host, slot, .. } => {
                (cell_id.clone(), json!({ "state": "preparing", "host": host, "slot": slot }))
            }
            Event::Ready { cell_id, host, slot, class, .. } => {
                (cell_id.clone(), json!({ "state": "ready", "host": host, "slot": slot, "class": spelled(class) }))
            }
            // a used worker's cell is starting: its run's events say so
            Event::PreparedEnded { cell_id, outcome, .. } if *outcome != PreparedOutcome::Used => {
                (cell_id.clone(), json!({ "state": "released", "outcome": spelled(outcome) }))
            }
            _ => return None,
        },
        StreamItem::Event { exec_id, event, .. } => {
            let cell = of_run(exec_id)?.cell_id.to_string();
            let state = match event {
                Event::Planned { .. } => planned(event),
                Event::Claimed { host, slot, prepare } => {
                    json!({ "state": "preparing", "host": host, "slot": slot, "prepare": spelled(prepare) })
                }
                Event::Started { host, slot, prepare, device, .. } => json!({
                    "state": "running", "host": host, "slot": slot, "prepare": spelled(prepare),
                    "device": spelled(device),
                }),
                Event::Finished { .. } => json!({ "state": "saving" }),
                Event::Saved { .. } => json!({ "state": "saved" }),
                Event::Failed { error } => json!({ "state": "failed", "error": error }),
                _ => return None,
            };
            (cell, state)
        }
        _ => return None,
    };
    state["action"] = json!("state");
    state["cell_id"] = json!(cell_id);
    Some(state)
}

fn planned(event: &Event) -> Value {
    let Event::Planned { closure, device, device_reason, conservative, .. } = event else { return json!({}) };
    json!({
        "state": "planned",
        "device": spelled(device),
        "device_reason": device_reason,
        "closure": closure.len(),
        "conservative": conservative,
    })
}

/// The session's totals for the side panel, from everything its stream said
/// since the kernel opened it.
#[derive(Debug)]
pub struct SessionTally {
    opened: std::time::Instant,
    cells: u64,
    gpu_cells: u64,
    /// GPU cells that started on a worker prepared while they were edited, with
    /// nothing to refresh at Run (the report's "clean hits").
    clean_hits: u64,
    conservative: u64,
    faulted: u64,
    failed: u64,
    gpu_slot_ms: f64,
}

impl SessionTally {
    pub fn new() -> Self {
        Self {
            opened: std::time::Instant::now(),
            cells: 0,
            gpu_cells: 0,
            clean_hits: 0,
            conservative: 0,
            faulted: 0,
            failed: 0,
            gpu_slot_ms: 0.0,
        }
    }

    /// Count `item`; true if the totals changed.
    pub fn observe(&mut self, item: &StreamItem) -> bool {
        let StreamItem::Event { exec_id, event, .. } = item else { return false };
        match event {
            Event::SlotReleased { held_ms, .. } => self.gpu_slot_ms += held_ms,
            Event::Planned { conservative, .. } if !exec_id.is_nil() => {
                self.cells += 1;
                self.conservative += u64::from(conservative.is_some());
            }
            Event::Started { device, prepare, refreshed, .. } => {
                if *device == Device::Gpu {
                    self.gpu_cells += 1;
                    self.clean_hits += u64::from(*prepare == Prepare::Speculative && *refreshed == 0);
                }
            }
            Event::Finished { faulted, .. } => {
                self.faulted += u64::from(!faulted.is_empty());
            }
            Event::Failed { .. } if !exec_id.is_nil() => self.failed += 1,
            _ => return false,
        }
        true
    }

    /// `{"action": "session", ...}`: GPU-slot seconds used against what a GPU
    /// pinned since the session opened would have held (nothing, for a session
    /// that ran no GPU cell), the speculation hit rate, and the cells that ran with
    /// their whole namespace (conservative) or faulted names in.
    pub fn message(&self) -> Value {
        let pinned_s = if self.gpu_cells > 0 { self.opened.elapsed().as_secs_f64() } else { 0.0 };
        json!({
            "action": "session",
            "cells": self.cells,
            "gpu_cells": self.gpu_cells,
            "gpu_slot_seconds": self.gpu_slot_ms / 1000.0,
            "pinned_gpu_seconds": pinned_s,
            "hit_rate": (self.gpu_cells > 0).then(|| self.clean_hits as f64 / self.gpu_cells as f64),
            "conservative": self.conservative,
            "faulted": self.faulted,
            "failed": self.failed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use looseleaf_client::events::{CellStatus, PreparedClass, SlotUse, StartPhases};

    fn ev(exec_id: Uuid, event: Event) -> StreamItem {
        StreamItem::Event { exec_id, unix_ms: 1, event }
    }

    fn planned_ev(cell: &str, device: Device, conservative: Option<&str>) -> Event {
        Event::Planned {
            cell_id: cell.into(),
            closure: vec!["x".into(), "y".into()],
            imports: vec![],
            device,
            device_reason: "torch.cuda".into(),
            conservative: conservative.map(str::to_owned),
            pinned: vec![],
        }
    }

    fn started(device: Device, prepare: Prepare, refreshed: u32) -> Event {
        Event::Started {
            host: "host-0".into(),
            slot: Some(1),
            worker: "w".into(),
            device,
            prepare,
            execution_count: 1,
            restored_bytes: 0,
            prepare_ms: 1.0,
            restore_ms: 0.0,
            refreshed,
            import_hit: true,
            python: "3.11".into(),
            phases: StartPhases::default(),
        }
    }

    #[test]
    fn an_edit_moves_its_cell_through_planned_preparing_ready_and_released() {
        let nil = Uuid::nil();
        let s = cell_state(&ev(nil, planned_ev("c1", Device::Gpu, None)), None).unwrap();
        assert_eq!(s["action"], "state");
        assert_eq!(s["cell_id"], "c1");
        assert_eq!((&s["state"], &s["device"], &s["closure"]), (&json!("planned"), &json!("gpu"), &json!(2)));
        assert_eq!(s["device_reason"], "torch.cuda");
        let prep = Event::Preparing { host: "host-0".into(), slot: Some(1), cell_id: "c1".into(), revision: 3 };
        let s = cell_state(&ev(nil, prep), None).unwrap();
        assert_eq!((&s["state"], &s["host"], &s["slot"]), (&json!("preparing"), &json!("host-0"), &json!(1)));
        let ready = Event::Ready {
            host: "host-0".into(),
            slot: Some(1),
            worker: "w".into(),
            pid: 9,
            cell_id: "c1".into(),
            revision: 3,
            class: PreparedClass::Speculative,
            prepare_ms: 40.0,
        };
        assert_eq!(cell_state(&ev(nil, ready), None).unwrap()["state"], "ready");
        let ended = |outcome| Event::PreparedEnded {
            host: "host-0".into(),
            slot: Some(1),
            worker: "w".into(),
            cell_id: "c1".into(),
            class: PreparedClass::Speculative,
            idle_ms: 5.0,
            outcome,
        };
        let s = cell_state(&ev(nil, ended(PreparedOutcome::Superseded)), None).unwrap();
        assert_eq!((&s["state"], &s["outcome"]), (&json!("released"), &json!("superseded")));
        // a worker a run used: the run's own events move the badge
        assert!(cell_state(&ev(nil, ended(PreparedOutcome::Used)), None).is_none());
    }

    #[test]
    fn only_the_current_runs_events_move_a_badge_and_they_name_its_cell() {
        let exec = Uuid::new_v4();
        let run = Some(CurrentRun { exec_id: exec, cell_id: "c2" });
        let s = cell_state(&ev(exec, started(Device::Gpu, Prepare::Speculative, 0)), run).unwrap();
        assert_eq!(
            (&s["cell_id"], &s["state"], &s["prepare"]),
            (&json!("c2"), &json!("running"), &json!("speculative"))
        );
        let fin = Event::Finished {
            status: CellStatus::Ok,
            error: None,
            execution_count: 1,
            run_ms: 1.0,
            outputs: 0,
            cuda_used: false,
            faulted: vec![],
        };
        assert_eq!(cell_state(&ev(exec, fin.clone()), run).unwrap()["state"], "saving");
        let failed = Event::Failed { error: "worker died".into() };
        assert_eq!(cell_state(&ev(exec, failed), run).unwrap()["error"], "worker died");
        // an execution the kernel is not waiting on (an earlier, settled one)
        assert!(cell_state(&ev(Uuid::new_v4(), fin.clone()), run).is_none());
        assert!(cell_state(&ev(exec, fin), None).is_none());
        let queued = StreamItem::Queued { exec_id: exec, cell_id: "c2".into(), run_unix_ms: 1 };
        assert_eq!(cell_state(&queued, run).unwrap()["state"], "queued");
    }

    #[test]
    fn the_tally_counts_gpu_cells_clean_hits_slot_time_and_conservative_cells() {
        let mut t = SessionTally::new();
        assert_eq!(t.message()["pinned_gpu_seconds"], 0.0, "no GPU cell ran: nothing pinned");
        assert_eq!(t.message()["hit_rate"], Value::Null);
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        assert!(t.observe(&ev(a, planned_ev("c1", Device::Gpu, None))));
        assert!(t.observe(&ev(a, started(Device::Gpu, Prepare::Speculative, 0))));
        assert!(t.observe(&ev(b, planned_ev("c2", Device::Gpu, Some("exec() reads names")))));
        assert!(t.observe(&ev(b, started(Device::Gpu, Prepare::Cold, 0))));
        assert!(t.observe(&ev(c, planned_ev("c3", Device::Cpu, None))));
        assert!(t.observe(&ev(c, started(Device::Cpu, Prepare::Persistent, 0))));
        let released = Event::SlotReleased { host: "h".into(), slot: 0, held_ms: 1500.0, reason: SlotUse::Cell };
        assert!(t.observe(&ev(Uuid::nil(), released)));
        // an edit's plan is no cell run
        assert!(!t.observe(&ev(Uuid::nil(), planned_ev("c4", Device::Gpu, None))));
        let m = t.message();
        assert_eq!((&m["cells"], &m["gpu_cells"], &m["conservative"]), (&json!(3), &json!(2), &json!(1)));
        assert_eq!(m["hit_rate"], 0.5);
        assert_eq!(m["gpu_slot_seconds"], 1.5);
        assert!(m["pinned_gpu_seconds"].as_f64().is_some_and(|s| s >= 0.0));
    }
}
