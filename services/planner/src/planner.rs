//! The planner actor: for every run, derive the recipe against the session's
//! committed manifest and publish it to all hosts (naming the worker prepared for
//! the cell, if any); for edits, debounced per cell, publish an edit-derived recipe
//! when it changed, marked for preparation if the speculator admits it. Each run is
//! planned in its own future; a session's runs arrive one at a time (the frontend's
//! run queue).
//!
//! Layout: this file holds the actor's state, its construction and its periodic
//! budget tick; `plan.rs` plans a run (and builds the recipes and `Planned` events
//! edits share), `runs.rs` handles the runs heard, `edits.rs` debounces edits
//! into speculative recipes and sends evictions, `hosts.rs` tracks host liveness
//! and fails runs pinned to a lost host, `sessions.rs` learns from session events
//! and forgets closed sessions, `scaling.rs` publishes the GPU demand.

mod edits;
mod hosts;
mod plan;
mod runs;
mod scaling;
mod sessions;

pub use plan::{PlanError, RECIPE_PATIENCE};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use async_nats::jetstream::kv;
use schemas::checkpoint::Manifest;
use schemas::membership::Members;
use schemas::messages::{EditV1, PinnedWorker};
use schemas::Bus;
use uuid::Uuid;

use crate::demand::Demand;
use crate::speculator::{Budget, Speculator};
use crate::state;

/// How often the speculator's idle budget is enforced.
const BUDGET_TICK: Duration = Duration::from_secs(1);
/// How often the GPU demand is published (the frontends' run gauge's pace).
const DEMAND_TICK: Duration = Duration::from_secs(2);

/// The planner actor.
pub struct Planner {
    bus: Bus,
    kv: kv::Store,
    /// Latest manifest and planner state seen per session, for edits (runs always
    /// fetch both; a save refreshes the manifest).
    manifests: HashMap<Uuid, (Arc<Manifest>, Arc<state::SessionState>)>,
    /// Per (session, cell): recipe revision and fingerprint of the last speculative
    /// recipe; no fingerprint once the cell ran (its prepared worker, if any, is used
    /// or ended, so the next edit prepares again even with the same closure).
    speculative: HashMap<(Uuid, String), (u64, Option<u64>)>,
    /// The newest edit per (session, cell) waiting for its debounce timer.
    pending_edits: HashMap<(Uuid, String), (EditV1, tracing::Span)>,
    /// The code hash of each cell's latest run, until an edit changes its text: an
    /// edit of that same text (sent before Run, heard after it) prepares nothing.
    ran_code: HashMap<(Uuid, String), u64>,
    debounce: Duration,
    speculator: Speculator,
    clock: Instant,
    /// Runs sent to the worker that holds their unsavable variables, not claimed
    /// yet: exec -> (session, that worker).
    /// Forgotten after `PINNED_MEMORY` (with several planners another one may hear
    /// the Claimed event).
    pinned_runs: HashMap<Uuid, (Uuid, PinnedWorker, Instant)>,
    /// A host not heard for this long is lost (see `fail_runs_pinned_to_lost_hosts`).
    host_lost: Duration,
    /// Each host as its last status said (GPU slots, when it was made, the
    /// workers it listed), and when that was heard (ADR 58).
    hosts: Members<hosts::HostSeen>,
    /// Runs heard lately: a run the frontend sent again (its acknowledgement was
    /// lost) is planned once (ADR 46). Forgotten after `RUN_MEMORY`.
    heard_runs: HashMap<Uuid, Instant>,
    /// The GPU demand of the edit stream, published every `DEMAND_TICK`.
    demand: Demand,
}

impl Planner {
    /// A planner on `bus`, with session state in `kv`; edits of a cell are planned
    /// at most once per `debounce`; speculation stays within `budget`.
    pub fn new(bus: Bus, kv: kv::Store, debounce: Duration, budget: Budget) -> Self {
        Self {
            bus,
            kv,
            manifests: HashMap::new(),
            speculative: HashMap::new(),
            pending_edits: HashMap::new(),
            ran_code: HashMap::new(),
            debounce,
            speculator: Speculator::new(budget),
            clock: Instant::now(),
            pinned_runs: HashMap::new(),
            host_lost: Duration::from_secs(10),
            hosts: Members::new(Instant::now()),
            heard_runs: HashMap::new(),
            demand: Demand::new(crate::DEFAULT_DEMAND_LEAD_S as f64),
        }
    }

    /// Look `lead` ahead for the GPU demand.
    pub fn with_demand_lead(mut self, lead: Duration) -> Self {
        self.demand = Demand::new(lead.as_secs_f64());
        self
    }

    /// Take a host not heard for `host_lost` for lost.
    pub fn with_host_lost(mut self, host_lost: Duration) -> Self {
        self.host_lost = host_lost;
        self
    }

    fn now(&self) -> f64 {
        self.clock.elapsed().as_secs_f64()
    }
}

impl Actor for Planner {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(BUDGET_TICK, |act, ctx| {
            let now = act.now();
            let over = act.speculator.over_budget(now);
            act.send_evictions(over, ctx);
            act.fail_runs_pinned_to_lost_hosts(ctx);
        });
        ctx.run_interval(DEMAND_TICK, |act, ctx| act.publish_demand(ctx));
    }
}
