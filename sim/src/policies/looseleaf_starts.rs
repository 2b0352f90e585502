//! What the `looseleaf` policy's workers cost to start, from the measured costs
//! (or a recorded cell's own times), and what a simulated host's core asks of the
//! world.

use std::collections::HashMap;

use looseleaf_gpu_host::core::Facts;
use schemas::messages::RecipeV3;
use uuid::Uuid;

use super::secs;
use crate::engine::Sim;

/// What a simulated host's core asks of the world.
pub(super) struct World<'a> {
    pub(super) host: usize,
    pub(super) by_id: &'a HashMap<Uuid, usize>,
    pub(super) cached_on: &'a [Option<usize>],
    pub(super) import_tail: &'a [bool],
}

impl Facts for World<'_> {
    fn alive(&self, _worker: &str) -> bool {
        true // simulated workers do not die
    }

    fn placement(&self, recipe: &RecipeV3) -> (f64, f64) {
        let Some(&s) = self.by_id.get(&recipe.session) else { return (1.0, 0.0) };
        // every host runs the same zygotes; a cell with an import tail matches
        // half of its import closure
        let zygote = if self.import_tail[s] { 0.5 } else { 1.0 };
        (zygote, if self.cached_on[s] == Some(self.host) { 1.0 } else { 0.0 })
    }
}

/// Fork from a zygote, import the tail, restore the closure, put it on the GPU:
/// a cold start.
pub(super) fn prepare_s(sim: &mut Sim, s: usize) -> f64 {
    restore_s(sim, s) + stage_in_s(sim, s)
}

/// Fork from a zygote, import the tail, restore the closure into host memory
/// (a recorded cell: what preparing it took when it was recorded).
pub(super) fn restore_s(sim: &mut Sim, s: usize) -> f64 {
    let c = sim.costs;
    let cell = sim.cell(s);
    if let Some(t) = cell.prepare_s {
        return t;
    }
    let mut t = sim.draw.sample(&c.cold_start_ms) / 1000.0;
    if cell.import_tail {
        t += sim.draw.sample(&c.import_tail_ms) / 1000.0;
    }
    t + secs(cell.closure_bytes, c.restore_bytes_per_s)
}

/// A worker's first use of its slot: CUDA initialised and the closure's
/// GPU-resident state (every simulated closure's) copied to the device.
pub(super) fn stage_in_s(sim: &Sim, s: usize) -> f64 {
    let c = sim.costs;
    c.cuda_init_s + secs(sim.cell(s).closure_bytes, c.host_to_gpu_bytes_per_s)
}

pub(super) fn hit_s(sim: &mut Sim) -> f64 {
    sim.draw.sample(&sim.costs.hit_start_ms) / 1000.0
}
