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
    /// Collect garbage every this many seconds (0: only when asked on the bus).
    #[arg(long, env = "LOOSELEAF_GC_INTERVAL_S", default_value_t = 3600)]
    gc_interval_s: u64,
    /// Manifest revisions garbage collection keeps per session: how far back
    /// `%looseleaf undo` and checkout reach.
    #[arg(long, env = "LOOSELEAF_GC_KEEP_REVISIONS", default_value_t = 20)]
    gc_keep_revisions: u64,
    /// Chunks younger than this many seconds are never collected (keep it above the
    /// longest save: a save uploads its chunks before it commits them).
    #[arg(long, env = "LOOSELEAF_GC_GRACE_S", default_value_t = 3600)]
    gc_grace_s: u64,
    /// A local store collects garbage at once when its volume has less than this
    /// many bytes free (default: 5% of the volume or 2 GiB, whichever is smaller);
    /// saves that would leave less than half of it are refused.
    #[arg(long, env = "LOOSELEAF_GC_FREE_BYTES")]
    gc_free_bytes: Option<u64>,
    /// File holding the key (32 bytes or more) manifests are signed and verified with.
    /// Keep it; manifests signed with a lost key no longer load.
    #[arg(long, env = "LOOSELEAF_MANIFEST_KEY_FILE")]
    manifest_key_file: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    schemas::allocator::keep_freed_memory();
    let args = Args::parse();
    schemas::telemetry::init("looseleaf-store", &args.service.log, args.service.log_format)?;
    let config = looseleaf_store::Config {
        nats: args.service.nats,
        health_listen: args.service.health_listen,
        prefix: args.service.prefix,
        store_url: args.store_url,
        session_quota_bytes: args.session_quota_bytes,
        gc: (args.gc_interval_s > 0).then(|| looseleaf_store::gc::Schedule {
            every: std::time::Duration::from_secs(args.gc_interval_s),
            keep_revisions: args.gc_keep_revisions,
            grace: std::time::Duration::from_secs(args.gc_grace_s),
        }),
        gc_free_bytes: args.gc_free_bytes,
        manifest_key_file: args.manifest_key_file,
    };
    // the signal listeners start with the runtime, before anything else
    actix_rt::System::new()
        .block_on(async { looseleaf_store::run(config, schemas::telemetry::shutdown_signal()).await })
}
