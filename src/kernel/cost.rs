//! What each cell's last run cost, for its badge (issue 40, item 4): the seconds
//! it ran and, for a GPU cell, the GPU-slot seconds its slot was held, sent on the
//! edit comm as `{"action": "cost", "cell_id", "device", "run_seconds",
//! "gpu_seconds"}` once known. A GPU cell's slot is released as the session's (an
//! event of no run) after its run is done, so GPU runs wait for it in order.

use std::collections::{HashMap, VecDeque};

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::{Device, Event, SlotUse};
use serde_json::{json, Value};
use uuid::Uuid;

/// A run not done: its cell, whether it ran on a GPU, how long it ran.
struct Pending {
    cell_id: String,
    gpu: bool,
    run_ms: f64,
}

/// The runs of the session whose cost is not told yet.
#[derive(Default)]
pub struct RunCosts {
    running: HashMap<Uuid, Pending>,
    /// GPU runs done whose slot was not released yet, oldest first.
    releasing: VecDeque<Pending>,
}

impl RunCosts {
    /// The cost message `item` completes, if it completes one.
    pub fn observe(&mut self, item: &StreamItem) -> Option<Value> {
        match item {
            StreamItem::Queued { exec_id, cell_id, .. } => {
                self.running.insert(*exec_id, Pending { cell_id: cell_id.clone(), gpu: false, run_ms: 0.0 });
                None
            }
            StreamItem::Event { exec_id, event: Event::Started { device, .. }, .. } => {
                self.running.get_mut(exec_id)?.gpu = *device == Device::Gpu;
                None
            }
            StreamItem::Event { exec_id, event: Event::Finished { run_ms, .. }, .. } => {
                self.running.get_mut(exec_id)?.run_ms = *run_ms;
                None
            }
            StreamItem::Done { exec_id, status, .. } => {
                let run = self.running.remove(exec_id)?;
                match (status, run.gpu) {
                    (ExecStatus::Aborted, _) => None,
                    (_, true) => {
                        self.releasing.push_back(run);
                        None
                    }
                    (_, false) => Some(message(&run, 0.0)),
                }
            }
            StreamItem::Event {
                exec_id, event: Event::SlotReleased { held_ms, reason: SlotUse::Cell, .. }, ..
            } if exec_id.is_nil() => {
                let run = self.releasing.pop_front()?;
                Some(message(&run, *held_ms))
            }
            _ => None,
        }
    }
}

fn message(run: &Pending, held_ms: f64) -> Value {
    json!({
        "action": "cost",
        "cell_id": run.cell_id,
        "device": if run.gpu { "gpu" } else { "cpu" },
        "run_seconds": run.run_ms / 1000.0,
        "gpu_seconds": held_ms / 1000.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use looseleaf_client::events::{CellStatus, Prepare, StartPhases};

    fn ev(exec_id: Uuid, event: Event) -> StreamItem {
        StreamItem::Event { exec_id, unix_ms: 1, event }
    }

    fn started(device: Device) -> Event {
        Event::Started {
            host: "host-0".into(),
            slot: None,
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
    }
}
