use std::net::SocketAddr;

use clap::Parser;
use schemas::service::ServiceArgs;

/// LooseLeaf frontend: HTTP API for sessions, cells and their events.
#[derive(Parser, Debug)]
struct Args {
    /// Flags every service takes (NATS, prefix, log filter).
    #[command(flatten)]
    service: ServiceArgs,
    /// Address to serve HTTP on; port 0 picks a free port (logged).
    #[arg(long, env = "LOOSELEAF_LISTEN", default_value = "127.0.0.1:8470")]
    listen: SocketAddr,
    /// Seconds a run may wait for a host to claim it before it fails (then no host
    /// can run it any more).
    #[arg(long, env = "LOOSELEAF_CLAIM_TIMEOUT_S", default_value_t = 60)]
    claim_timeout_s: u64,
    /// Seconds a run may take before the frontend interrupts it, as the user would
    /// (the hosts' --cell-timeout-s, a day, usually ends it first).
    #[arg(long, env = "LOOSELEAF_EXEC_DEADLINE_S", default_value_t = 25 * 3600)]
    exec_deadline_s: u64,
    /// File of `USER TOKEN` lines: the API then needs `Authorization: Bearer TOKEN`
    /// and each session belongs to its creator (without it the API is open).
    #[arg(long, env = "LOOSELEAF_TOKENS_FILE")]
    tokens_file: Option<std::path::PathBuf>,
    /// Stream items (events, outputs) each session keeps for clients that connect
    /// or reconnect later (`Last-Event-ID`); older ones are dropped.
    #[arg(long, env = "LOOSELEAF_HISTORY_ITEMS", default_value_t = looseleaf_frontend::DEFAULT_HISTORY_ITEMS)]
    history_items: usize,
    /// Seconds a session may be idle (nothing running or queued, nobody watching
    /// its events, no request) before it is culled: its workers stop, its state
    /// stays and the session reopens on its next request (0: never).
    #[arg(long, env = "LOOSELEAF_CULL_IDLE_S", default_value_t = looseleaf_frontend::DEFAULT_CULL_IDLE.as_secs_f64())]
    cull_idle_s: f64,
    /// Seconds without a host's status after which a cell it runs ends as lost.
    #[arg(long, env = "LOOSELEAF_HOST_LOST_S", default_value_t = 10)]
    host_lost_s: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    schemas::telemetry::init("looseleaf-frontend", &args.service.log);
    let mut config = looseleaf_frontend::Config::new(args.service.nats_url, args.service.prefix, args.listen);
    config.timeouts.claim = std::time::Duration::from_secs(args.claim_timeout_s);
    config.timeouts.execution = std::time::Duration::from_secs(args.exec_deadline_s);
    config.timeouts.host_lost = std::time::Duration::from_secs(args.host_lost_s);
    config.history_items = args.history_items;
    config.cull_idle = (args.cull_idle_s > 0.0)
        .then(|| std::time::Duration::try_from_secs_f64(args.cull_idle_s))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--cull-idle-s: {e}"))?;
    if let Some(path) = &args.tokens_file {
        config.tokens = looseleaf_frontend::auth::Tokens::load(path)?;
    }
    actix_rt::System::new().block_on(looseleaf_frontend::run(config, schemas::telemetry::shutdown_signal()))
}
