//! The planner: turns each session's edit stream and runs into recipes
//! (DESIGN.md section 4, step 2).
//!
//! One planner plans at a time: it holds the lease in [`lease`], and a second
//! one stands by, subscribed to nothing, until it takes the lease over (ADR 60).
//!
//! Speaks: serves `{prefix}.v1.session.*.run` as a `$SRV` endpoint (runs are
//! delivered and acknowledged, ADR 42 and 43); subscribes `….edit`, `….close` (queue
//! group `planner`); requests
//! `{prefix}.v1.store.manifest.get`; delivers runs' recipes and publishes edits'
//! on `{prefix}.v1.session.{sid}.recipe`, and `Planned` events; keeps
//! per-session state in the JetStream KV bucket `{prefix}_planner`.
//!
//! Modules: [`lease`] (who plans), [`analysis`] (reads, writes, imports, device signs of a cell),
//! [`recipe`] (closure, imports, label against the manifest), [`state`] (what the
//! planner remembers), [`speculator`] (which edits get a prepared worker),
//! [`demand`] (the GPU demand autoscalers read), [`planner`] (the actor).

pub mod analysis;
pub mod demand;
pub mod lease;
pub mod planner;
pub mod recipe;
pub mod speculator;
pub mod state;

use std::future::Future;
use std::time::Duration;

use actix::prelude::*;
use schemas::buckets;
use schemas::health::Readiness;
use schemas::messages::{EditV1, HostStatusV2, RunV3, SessionCloseV1, SessionEventV2};
use schemas::service::Service;

/// Default edit debounce (ms): typing yields a recipe at most this often per cell.
pub const DEFAULT_DEBOUNCE_MS: u64 = 100;

/// Default speculation budget, chosen with `looseleaf simulate` on the base
/// workload (ADR 50): one prepared worker per host and 120 idle seconds per
/// session's lifetime refused or evicted 40% of GPU cells' workers; four per host
/// and 300 idle seconds an hour leave well under 1% cold.
pub const DEFAULT_BUDGET: speculator::Budget =
    speculator::Budget { prepared_per_host: 4, idle_seconds_per_session: 300.0 };

/// Default scaling lead (s): how far ahead the GPU demand looks, about what a GPU
/// host takes to be added (an autoscaler's polling and a node's boot).
pub const DEFAULT_DEMAND_LEAD_S: u64 = 60;

/// What the planner needs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where NATS is and how to log in.
    pub nats: schemas::nats::NatsOptions,
    /// Where to serve `/healthz` and `/readyz`, if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Subject prefix.
    pub prefix: String,
    /// Edits of one cell are planned at most once per this interval.
    pub debounce: Duration,
    /// What speculation may cost.
    pub budget: speculator::Budget,
    /// A host not heard for this long is lost: runs that must go to its worker
    /// (it holds their unsavable variables) fail at once, naming them.
    pub host_lost: Duration,
    /// How far ahead the published GPU demand looks (`demand`).
    pub demand_lead: Duration,
}

/// Run the planner until `shutdown` resolves. Must be called inside an actix system.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let service =
        Service::start("looseleaf-planner", None, "cell analysis and recipes", &config.nats, &config.prefix).await?;
    let bus = service.bus().clone();
    let kv = buckets::planner(&bus.jetstream(), &config.prefix, bus.replicas()).await?;
    if let Some(listen) = config.health_listen {
        let bucket = schemas::health::bucket(&bus, buckets::planner_bucket(&config.prefix));
        schemas::health::serve(listen, Readiness::new(&bus).with("planner_bucket", bucket)).await?;
    }
    // standby until this planner holds the lease: only one plans (ADR 60)
    let mut shutdown = std::pin::pin!(shutdown);
    let holder = format!("looseleaf-planner-{}", uuid::Uuid::new_v4());
    let mut lease = tokio::select! {
        lease = lease::Lease::acquire(kv.clone(), holder) => lease,
        () = &mut shutdown => return Ok(()),
    };
    let s = bus.subjects().clone();
    // requests (the frontend delivers runs): a `$SRV` endpoint with its stats
    let runs = service.endpoint::<RunV3>("run", s.all_runs(), "planner").await?;
    let edits = bus.queue_subscribe::<EditV1>(s.all_edits(), "planner").await?;
    let closes = bus.queue_subscribe::<SessionCloseV1>(s.all_closes(), "planner").await?;
    let events = bus.queue_subscribe::<SessionEventV2>(s.all_events(), "planner").await?;
    let hosts = bus.subscribe::<HostStatusV2>(s.all_host_status()).await?;
    let actor_bus = bus.clone();
    let addr = planner::Planner::create(move |ctx| {
        ctx.add_stream(runs.into_stream());
        ctx.add_stream(edits.into_stream());
        ctx.add_stream(closes.into_stream());
        ctx.add_stream(events.into_stream());
        ctx.add_stream(hosts.into_stream());
        planner::Planner::new(actor_bus, kv, config.debounce, config.budget)
            .with_host_lost(config.host_lost)
            .with_demand_lead(config.demand_lead)
    });
    tracing::info!(prefix = %config.prefix, "planner serving");
    // nothing to hand back: a run planned halfway is planned again by its retry
    tokio::select! {
        served = service.serve(shutdown, || addr.connected(), async {}) => served?,
        lost = lease.lost() => return Err(lost.into()),
    }
    lease.release().await;
    Ok(())
}
