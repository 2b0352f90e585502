use clap::Parser;
use schemas::service::ServiceArgs;

/// LooseLeaf checkpoint-store gateway.
#[derive(Parser, Debug)]
struct Args {
    /// Flags every service takes (NATS, prefix, log filter).
    #[command(flatten)]
    service: ServiceArgs,
    /// Object store URL: file:///dir or a directory.
    #[arg(long, env = "LOOSELEAF_STORE_URL", default_value = ".looseleaf/store")]
    store_url: String,
    /// Largest state one session may hold, in bytes (unlimited if not set).
    #[arg(long, env = "LOOSELEAF_SESSION_QUOTA_BYTES")]
    session_quota_bytes: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    schemas::telemetry::init("looseleaf-store", &args.service.log);
    let config = looseleaf_store::Config {
        nats_url: args.service.nats_url,
        prefix: args.service.prefix,
        store_url: args.store_url,
        session_quota_bytes: args.session_quota_bytes,
    };
    actix_rt::System::new().block_on(looseleaf_store::run(config, schemas::telemetry::shutdown_signal()))
}
