use clap::Parser;

/// LooseLeaf checkpoint-store gateway.
#[derive(Parser, Debug)]
struct Args {
    /// NATS server URL.
    #[arg(long, env = "LOOSELEAF_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Subject prefix (isolates tenants and tests).
    #[arg(long, env = "LOOSELEAF_PREFIX", default_value = "ll")]
    prefix: String,
    /// Object store URL: file:///dir or a directory.
    #[arg(long, env = "LOOSELEAF_STORE_URL", default_value = ".looseleaf/store")]
    store_url: String,
    /// Largest state one session may hold, in bytes (unlimited if not set).
    #[arg(long, env = "LOOSELEAF_SESSION_QUOTA_BYTES")]
    session_quota_bytes: Option<u64>,
    /// Log filter.
    #[arg(long, env = "LOOSELEAF_LOG", default_value = "info")]
    log: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    schemas::telemetry::init("looseleaf-store", &args.log);
    let config = looseleaf_store::Config {
        nats_url: args.nats_url,
        prefix: args.prefix,
        store_url: args.store_url,
        session_quota_bytes: args.session_quota_bytes,
    };
    actix_rt::System::new().block_on(looseleaf_store::run(config, schemas::telemetry::shutdown_signal()))
}
