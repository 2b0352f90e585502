//! The GPU demand of the edit stream, for autoscalers (issue "Scale", item 5):
//! fed by edits, runs and session events, published every `DEMAND_TICK` on
//! `{prefix}.v1.demand.gpu` and as the `looseleaf_gpu_demand` gauges.

use actix::prelude::*;
use schemas::checkpoint::Manifest;
use schemas::messages::GpuDemandV1;
use uuid::Uuid;

use super::Planner;
use crate::demand::GpuDemand;
use crate::recipe::Derived;

impl Planner {
    /// A planned edit: typing a GPU cell (from its first edit), or not.
    pub(super) fn edit_demand(&mut self, session: Uuid, cell_id: &str, d: &Derived, manifest: &Manifest) {
        if d.device == schemas::messages::Device::Gpu && d.pinned.is_none() {
            let bytes = closure_bytes(manifest, d.closure.iter().map(|v| v.name.as_str()));
            let now = self.now();
            self.demand.typing(session, cell_id, d.gpus, bytes, now);
        } else {
            self.demand.not_typing(session, cell_id);
        }
    }

    /// A session event: a host bound slots to a run, or the run ended (its slots
    /// are given back as it is saved; `SlotReleased` names no run).
    pub(super) fn event_demand(&mut self, exec_id: Uuid, kind: &schemas::messages::EventKind) {
        use schemas::messages::EventKind;
        let now = self.now();
        match kind {
            EventKind::Claimed { slot: Some(_), .. } => self.demand.running(exec_id, 1, now),
            EventKind::Saved { .. } | EventKind::Failed { .. } => self.demand.ended(exec_id, now),
            _ => {}
        }
    }

    pub(super) fn publish_demand(&mut self, ctx: &mut Context<Self>) {
        let now = self.now();
        let g = self.demand.at(now);
        set_gauges(&g);
        let msg = GpuDemandV1 {
            unix_ms: schemas::unix_ms(),
            typing_sessions: g.typing_sessions,
            typing_closure_bytes: g.typing_closure_bytes,
            running_gpus: g.running_gpus,
            wanted_gpus: g.wanted_gpus,
        };
        let bus = self.bus.clone();
        ctx.spawn(
            async move {
                if let Err(e) = bus.publish(bus.subjects().gpu_demand(), &msg).await {
                    tracing::debug!(error = %e, "could not publish the GPU demand");
                }
            }
            .into_actor(self),
        );
    }
}

fn set_gauges(g: &GpuDemand) {
    let gauges = &schemas::metrics::metrics().gpu_demand;
    gauges.get_or_create(&[("what", "typing_sessions")]).set(g.typing_sessions as f64);
    gauges.get_or_create(&[("what", "typing_closure_bytes")]).set(g.typing_closure_bytes as f64);
    gauges.get_or_create(&[("what", "running_gpus")]).set(g.running_gpus as f64);
    gauges.get_or_create(&[("what", "wanted_gpus")]).set(g.wanted_gpus);
}

/// The bytes of what the named variables reach in `manifest` (records and
/// payloads): what a start of the cell restores and copies in.
fn closure_bytes<'a>(manifest: &Manifest, names: impl Iterator<Item = &'a str>) -> u64 {
    let roots = names.filter_map(|n| manifest.variables.get(n).and_then(|e| e.oid.as_deref()));
    manifest
        .reachable(roots)
        .iter()
        .filter_map(|oid| manifest.objects.get(oid))
        .map(|o| o.record.len + o.payloads.iter().map(|p| p.len).sum::<u64>())
        .sum()
}
