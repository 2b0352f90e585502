//! What each cell's last run cost, for its badge (issue 40, item 4): the seconds
//! it ran and, for a GPU cell, the GPU-slot seconds its slot was held, sent on the
//! edit comm as `{"action": "cost", "cell_id", "device", "run_seconds",
//! "gpu_seconds"}` once known. A GPU cell's slot is released as the session's (an
//! event of no run) after its run is done, so GPU runs wait for it in order.

use std::collections::{HashMap, VecDeque};

use looseleaf_client::api::StreamItem;
use looseleaf_client::events::{Device, Event, SlotUse};
use serde_json::{json, Value};
use uuid::Uuid;

/// A run not told yet: its cell, where it ran on a GPU, how long it ran, and the
/// slot time its release said (a release may come before its run is done).
struct Pending {
    cell_id: String,
    started: bool,
    gpu: Option<(String, Option<u32>)>,
    run_ms: f64,
    held_ms: Option<f64>,
}

/// The runs of the session whose cost is not told yet.
#[derive(Default)]
pub struct RunCosts {
    running: HashMap<Uuid, Pending>,
    /// GPU runs done whose slot was not released yet, oldest first (a slot kept
    /// for unsavable state is released later, or never: each waits for its own).
    releasing: VecDeque<Pending>,
}

/// GPU runs done that wait for their slot's release, at most (older ones are
/// never told: their slot stayed with a kept worker).
const RELEASING_KEPT: usize = 16;

impl RunCosts {
    /// The cost message `item` completes, if it completes one.
    pub fn observe(&mut self, item: &StreamItem) -> Option<Value> {
        match item {
            StreamItem::Queued { exec_id, cell_id, .. } => {
                let run = Pending { cell_id: cell_id.clone(), started: false, gpu: None, run_ms: 0.0, held_ms: None };
                self.running.insert(*exec_id, run);
                None
            }
            StreamItem::Event { exec_id, event: Event::Started { device, host, slot, .. }, .. } => {
                let run = self.running.get_mut(exec_id)?;
                run.started = true;
                run.gpu = (*device == Device::Gpu).then(|| (host.clone(), *slot));
                None
            }
            StreamItem::Event { exec_id, event: Event::Finished { run_ms, .. }, .. } => {
                self.running.get_mut(exec_id)?.run_ms = *run_ms;
                None
            }
            StreamItem::Done { exec_id, .. } => {
                let run = self.running.remove(exec_id)?;
                match (run.started, &run.gpu, run.held_ms) {
                    (false, ..) => None, // never ran (aborted, refused)
                    (true, None, _) => Some(message(&run, 0.0)),
                    (true, Some(_), Some(held_ms)) => Some(message(&run, held_ms)),
                    (true, Some(_), None) => {
                        self.releasing.push_back(run);
                        while self.releasing.len() > RELEASING_KEPT {
                            self.releasing.pop_front();
                        }
                        None
                    }
                }
            }
            StreamItem::Event {
                exec_id,
                event: Event::SlotReleased { host, slot, held_ms, reason: SlotUse::Cell },
                ..
            } if exec_id.is_nil() => {
                let on = |run: &Pending| run.gpu.as_ref().is_some_and(|(h, s)| h == host && *s == Some(*slot));
                if let Some(at) = self.releasing.iter().position(on) {
                    let run = self.releasing.remove(at)?;
                    return Some(message(&run, *held_ms));
                }
                // released before its run was done: told at its end
                if let Some(run) = self.running.values_mut().find(|r| on(r)) {
                    run.held_ms = Some(*held_ms);
                }
                None
            }
            _ => None,
        }
    }
}

fn message(run: &Pending, held_ms: f64) -> Value {
    json!({
        "action": "cost",
        "cell_id": run.cell_id,
        "device": if run.gpu.is_some() { "gpu" } else { "cpu" },
        "run_seconds": run.run_ms / 1000.0,
        "gpu_seconds": held_ms / 1000.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use looseleaf_client::api::ExecStatus;
    use looseleaf_client::events::{CellStatus, Prepare, StartPhases};

    fn ev(exec_id: Uuid, event: Event) -> StreamItem {
        StreamItem::Event { exec_id, unix_ms: 1, event }
    }

    fn started(device: Device) -> Event {
        Event::Started {
            host: "host-0".into(),
            slot: (device == Device::Gpu).then_some(0),
            worker: "w".into(),
            device,
            prepare: Prepare::Cold,
            execution_count: 1,
            restored_bytes: 0,
            prepare_ms: 0.0,
            restore_ms: 0.0,
            refreshed: 0,
            import_hit: true,
            python: "3.11".into(),
            phases: StartPhases::default(),
        }
    }

    fn finished(run_ms: f64) -> Event {
        Event::Finished {
            status: CellStatus::Ok,
            error: None,
            execution_count: 1,
            run_ms,
            outputs: 0,
            cuda_used: false,
            faulted: vec![],
        }
    }

    fn done(exec_id: Uuid, status: ExecStatus) -> StreamItem {
        StreamItem::Done { exec_id, status, after_revision: 1, unix_ms: 2, error: None }
    }

    fn released(held_ms: f64, reason: SlotUse) -> StreamItem {
        ev(Uuid::nil(), Event::SlotReleased { host: "host-0".into(), slot: 0, held_ms, reason })
    }

    #[test]
    fn a_cpu_run_costs_its_time_at_its_end_and_a_gpu_run_its_slot_once_released() {
        let mut costs = RunCosts::default();
        let (cpu, gpu, aborted) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        for (exec, cell) in [(cpu, "c1"), (gpu, "c2"), (aborted, "c3")] {
            let queued = StreamItem::Queued { exec_id: exec, cell_id: cell.into(), run_unix_ms: 0 };
            assert_eq!(costs.observe(&queued), None);
        }
        assert_eq!(costs.observe(&ev(cpu, started(Device::Cpu))), None);
        assert_eq!(costs.observe(&ev(cpu, finished(300.0))), None);
        let told = costs.observe(&done(cpu, ExecStatus::Ok)).unwrap();
        assert_eq!(
            (&told["cell_id"], &told["device"], &told["run_seconds"]),
            (&json!("c1"), &json!("cpu"), &json!(0.3))
        );

        assert_eq!(costs.observe(&ev(gpu, started(Device::Gpu))), None);
        assert_eq!(costs.observe(&ev(gpu, finished(1500.0))), None);
        assert_eq!(costs.observe(&done(gpu, ExecStatus::Error)), None, "its slot is not released yet");
        assert_eq!(costs.observe(&released(40.0, SlotUse::Speculation)), None, "a prepared worker's slot");
        let told = costs.observe(&released(2000.0, SlotUse::Cell)).unwrap();
        assert_eq!((&told["cell_id"], &told["device"]), (&json!("c2"), &json!("gpu")));
        assert_eq!((&told["run_seconds"], &told["gpu_seconds"]), (&json!(1.5), &json!(2.0)));

        assert_eq!(costs.observe(&done(aborted, ExecStatus::Aborted)), None, "an aborted run never ran");
        assert_eq!(costs.observe(&released(10.0, SlotUse::Cell)), None, "no GPU run waits for a slot");

        // a slot released before its run is done is told at the run's end
        let early = Uuid::now_v7();
        costs.observe(&StreamItem::Queued { exec_id: early, cell_id: "c4".into(), run_unix_ms: 0 });
        costs.observe(&ev(early, started(Device::Gpu)));
        assert_eq!(costs.observe(&released(700.0, SlotUse::Cell)), None);
        let told = costs.observe(&done(early, ExecStatus::Ok)).unwrap();
        assert_eq!((&told["cell_id"], &told["gpu_seconds"]), (&json!("c4"), &json!(0.7)));
        // a release on another slot is not this run's
        let other = Uuid::now_v7();
        costs.observe(&StreamItem::Queued { exec_id: other, cell_id: "c5".into(), run_unix_ms: 0 });
        costs.observe(&ev(other, started(Device::Gpu)));
        costs.observe(&done(other, ExecStatus::Ok));
        let elsewhere = ev(
            Uuid::nil(),
            Event::SlotReleased { host: "host-1".into(), slot: 0, held_ms: 5.0, reason: SlotUse::Cell },
        );
        assert_eq!(costs.observe(&elsewhere), None);
        assert_eq!(costs.observe(&released(9.0, SlotUse::Cell)).map(|t| t["cell_id"].clone()), Some(json!("c5")));
    }
}
