use clap::Parser;

/// LooseLeaf planner: cell analysis and recipes.
#[derive(Parser, Debug)]
struct Args {
    /// NATS server URL.
    #[arg(long, env = "LOOSELEAF_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Subject prefix (isolates tenants and tests).
    #[arg(long, env = "LOOSELEAF_PREFIX", default_value = "ll")]
    prefix: String,
    /// Log filter.
    #[arg(long, env = "LOOSELEAF_LOG", default_value = "info")]
    log: String,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    schemas::telemetry::init("looseleaf-planner", &a.log);
    let config = looseleaf_planner::Config { nats_url: a.nats_url, prefix: a.prefix };
    actix_rt::System::new().block_on(looseleaf_planner::run(config, schemas::telemetry::shutdown_signal()))
}
