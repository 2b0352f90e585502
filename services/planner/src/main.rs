use clap::Parser;
use schemas::service::ServiceArgs;

/// LooseLeaf planner: cell analysis and recipes.
#[derive(Parser, Debug)]
struct Args {
    /// Flags every service takes (NATS, prefix, log filter).
    #[command(flatten)]
    service: ServiceArgs,
    /// Edits of one cell are planned at most once per this many milliseconds.
    #[arg(long, env = "LOOSELEAF_DEBOUNCE_MS", default_value_t = looseleaf_planner::DEFAULT_DEBOUNCE_MS)]
    debounce_ms: u64,
    /// Speculation budget: prepared-but-idle workers per host.
    #[arg(long, env = "LOOSELEAF_PREPARED_PER_HOST", default_value_t = looseleaf_planner::DEFAULT_BUDGET.prepared_per_host)]
    prepared_per_host: usize,
    /// Speculation budget: idle GPU-slot seconds one session's prepared workers may spend per hour.
    #[arg(long, env = "LOOSELEAF_IDLE_GPU_SECONDS", default_value_t = looseleaf_planner::DEFAULT_BUDGET.idle_seconds_per_session)]
    idle_gpu_seconds_per_session: f64,
    /// Seconds without a host's status after which runs that must go to its
    /// worker (unsavable state) fail.
    #[arg(long, env = "LOOSELEAF_HOST_LOST_S", default_value_t = 10)]
    host_lost_s: u64,
    /// How far ahead the published GPU demand looks (s): about what adding a GPU
    /// host takes (the autoscaler's polling and the node's boot).
    #[arg(long, env = "LOOSELEAF_DEMAND_LEAD_S", default_value_t = looseleaf_planner::DEFAULT_DEMAND_LEAD_S)]
    demand_lead_s: u64,
}

fn main() -> anyhow::Result<()> {
    schemas::allocator::keep_freed_memory();
    let a = Args::parse();
    schemas::telemetry::init("looseleaf-planner", &a.service.log, a.service.log_format)?;
    let config = looseleaf_planner::Config {
        nats: a.service.nats,
        health_listen: a.service.health_listen,
        prefix: a.service.prefix,
        debounce: std::time::Duration::from_millis(a.debounce_ms),
        host_lost: std::time::Duration::from_secs(a.host_lost_s),
        demand_lead: std::time::Duration::from_secs(a.demand_lead_s),
        budget: looseleaf_planner::speculator::Budget {
            prepared_per_host: a.prepared_per_host,
            idle_seconds_per_session: a.idle_gpu_seconds_per_session,
        },
    };
    // the signal listeners start with the runtime, before anything else
    actix_rt::System::new()
        .block_on(async { looseleaf_planner::run(config, schemas::telemetry::shutdown_signal()).await })
}
