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
    /// (the hosts' --cell-timeout-s usually ends it first). Default 0: none, as in
    /// Jupyter.
    #[arg(long, env = "LOOSELEAF_EXEC_DEADLINE_S", default_value_t = 0)]
    exec_deadline_s: u64,
    /// File of `USER TOKEN` lines: the API then needs `Authorization: Bearer TOKEN`
    /// and each session belongs to its creator (without it the API is open).
    #[arg(long, env = "LOOSELEAF_TOKENS_FILE")]
    tokens_file: Option<std::path::PathBuf>,
    /// Serve a JupyterHub's users, as the Hub service `--jupyterhub-service`: a
    /// token the tokens file does not name is asked of the Hub's API at this URL
    /// (`http://HUB:8081/hub/api`), and the dashboard logs in through the Hub's
    /// OAuth (ADR 67).
    #[arg(long, env = "LOOSELEAF_JUPYTERHUB_API_URL")]
    jupyterhub_api_url: Option<String>,
    /// The Hub as browsers reach it, with its base_url (`https://hub.example.org/`),
    /// for the dashboard's login. Default: the API URL without its `hub/api`.
    #[arg(long, env = "LOOSELEAF_JUPYTERHUB_URL", requires = "jupyterhub_api_url")]
    jupyterhub_url: Option<String>,
    /// This service's name in the Hub's `c.JupyterHub.services`.
    #[arg(long, env = "LOOSELEAF_JUPYTERHUB_SERVICE", default_value = "looseleaf")]
    jupyterhub_service: String,
    /// A file holding this service's Hub API token (its first line). Default: the
    /// environment's JUPYTERHUB_API_TOKEN, which the Hub sets for a service it runs.
    #[arg(long, env = "LOOSELEAF_JUPYTERHUB_TOKEN_FILE", requires = "jupyterhub_api_url")]
    jupyterhub_token_file: Option<std::path::PathBuf>,
    /// The service's OAuth redirect URI as registered with the Hub: this
    /// frontend's `/hub/oauth_callback` as browsers reach it. Default: built from
    /// the request's Host, over http.
    #[arg(long, env = "LOOSELEAF_JUPYTERHUB_OAUTH_CALLBACK_URL", requires = "jupyterhub_api_url")]
    jupyterhub_oauth_callback_url: Option<String>,
    /// Per-user GPU limits: a file of `USER gpu_seconds_per_day=N
    /// concurrent_gpu_cells=N` lines (`*`: every user), read again when it changes;
    /// a malformed file is refused at start, and on a change the quotas stay (ADR 66).
    #[arg(long, env = "LOOSELEAF_QUOTA_FILE")]
    quota_file: Option<std::path::PathBuf>,
    /// Every gpu-host of this cluster runs each session's workers as a uid of its
    /// own (`--session-uids`, as compose sets): required of a frontend whose tokens
    /// file names two or more users, unless `--insecure-shared-workers` (ADR 52).
    #[arg(long, env = "LOOSELEAF_WORKERS_ISOLATED")]
    workers_isolated: bool,
    /// Serve several users though the hosts run every user's cells as one uid: any
    /// cell can then read every other user's work.
    #[arg(long, env = "LOOSELEAF_INSECURE_SHARED_WORKERS", conflicts_with = "workers_isolated")]
    insecure_shared_workers: bool,
    /// Stream items (events, outputs) each session keeps for clients that connect
    /// or reconnect later (`Last-Event-ID`); older ones are dropped.
    #[arg(long, env = "LOOSELEAF_HISTORY_ITEMS", default_value_t = looseleaf_frontend::DEFAULT_HISTORY_ITEMS)]
    history_items: usize,
    /// The most bytes of those items (their JSON) each session keeps; the oldest
    /// go first, the newest always stays.
    #[arg(long, env = "LOOSELEAF_HISTORY_BYTES", default_value_t = looseleaf_frontend::DEFAULT_HISTORY_BYTES)]
    history_bytes: usize,
    /// Seconds a session may be idle (nothing running or queued, nobody watching
    /// its events, no request) before it is detached: its workers stop, its state
    /// stays, a new kernel on its notebook resumes it and any request of its
    /// owner attaches it again (0: never).
    #[arg(long, env = "LOOSELEAF_DETACH_UNWATCHED_S", default_value_t = looseleaf_frontend::DEFAULT_DETACH_UNWATCHED.as_secs_f64())]
    detach_unwatched_s: f64,
    /// Seconds a session may be idle (nothing running or queued, no request)
    /// before it gives back its CPU worker and kept workers, even while a client
    /// watches it: it stays attached, and its next cell restores its closure (0:
    /// never).
    #[arg(long, env = "LOOSELEAF_IDLE_CULL_S", default_value_t = looseleaf_frontend::DEFAULT_IDLE_CULL.as_secs_f64())]
    idle_cull_s: f64,
    /// Seconds a detached session is kept before it is deleted with its state
    /// (0: forever).
    #[arg(long, env = "LOOSELEAF_SESSION_RETENTION_S", default_value_t = looseleaf_frontend::DEFAULT_SESSION_RETENTION.as_secs_f64())]
    session_retention_s: f64,
    /// Seconds without a host's status after which a cell it runs ends as lost.
    #[arg(long, env = "LOOSELEAF_HOST_LOST_S", default_value_t = 10)]
    host_lost_s: u64,
    /// Sessions' working directories must lie under this directory (else 400).
    #[arg(long, env = "LOOSELEAF_CWD_ROOT")]
    cwd_root: Option<std::path::PathBuf>,
    /// Sessions one user may hold (429 past it); a session runs one cell at a time,
    /// so this also bounds a user's concurrent cells.
    #[arg(long, env = "LOOSELEAF_MAX_SESSIONS_PER_USER")]
    max_sessions_per_user: Option<usize>,
    /// Runs a session may have queued behind the running one (429 past it).
    #[arg(long, env = "LOOSELEAF_MAX_QUEUED_RUNS", default_value_t = looseleaf_frontend::admission::DEFAULT_QUEUED_RUNS)]
    max_queued_runs: usize,
    /// A host name the API answers (the Host header, without port; repeat the flag
    /// for more). Default: loopback names when --listen is a loopback address, else any.
    #[arg(long = "allowed-host", env = "LOOSELEAF_ALLOWED_HOSTS", value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// A browser origin (`https://lab.example.org`) allowed to read the API through
    /// CORS (repeat for more; none by default).
    #[arg(long = "cors-origin", env = "LOOSELEAF_CORS_ORIGINS", value_delimiter = ',')]
    cors_origins: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    schemas::allocator::keep_freed_memory();
    let args = Args::parse();
    schemas::telemetry::init("looseleaf-frontend", &args.service.log, args.service.log_format)?;
    let mut config = looseleaf_frontend::Config::new(args.service.nats, args.service.prefix, args.listen);
    config.health_listen = args.service.health_listen;
    config.timeouts.claim = std::time::Duration::from_secs(args.claim_timeout_s);
    config.timeouts.execution =
        (args.exec_deadline_s > 0).then(|| std::time::Duration::from_secs(args.exec_deadline_s));
    config.timeouts.host_lost = std::time::Duration::from_secs(args.host_lost_s);
    config.history_items = args.history_items;
    config.history_bytes = args.history_bytes;
    config.detach_unwatched = (args.detach_unwatched_s > 0.0)
        .then(|| std::time::Duration::try_from_secs_f64(args.detach_unwatched_s))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--detach-unwatched-s: {e}"))?;
    config.idle_cull = (args.idle_cull_s > 0.0)
        .then(|| std::time::Duration::try_from_secs_f64(args.idle_cull_s))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--idle-cull-s: {e}"))?;
    config.session_retention = (args.session_retention_s > 0.0)
        .then(|| std::time::Duration::try_from_secs_f64(args.session_retention_s))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--session-retention-s: {e}"))?;
    config.limits = looseleaf_frontend::admission::Limits {
        cwd_root: args.cwd_root,
        sessions_per_user: args.max_sessions_per_user,
        queued_runs: args.max_queued_runs,
    };
    config.origins =
        Some(looseleaf_frontend::origins::Origins::new(args.listen, &args.allowed_hosts, &args.cors_origins));
    if let Some(path) = &args.quota_file {
        config.quotas = looseleaf_frontend::quota::Quotas::load(path)?;
    }
    if let Some(path) = &args.tokens_file {
        config.tokens = looseleaf_frontend::auth::Tokens::load(path)?;
    }
    if let Some(api_url) = args.jupyterhub_api_url {
        let token = match &args.jupyterhub_token_file {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--jupyterhub-token-file {}: {e}", path.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_string(),
            None => std::env::var("JUPYTERHUB_API_TOKEN").map_err(|_| {
                anyhow::anyhow!("--jupyterhub-api-url needs this service's Hub token: --jupyterhub-token-file, or JUPYTERHUB_API_TOKEN")
            })?,
        };
        let public_url = match args.jupyterhub_url {
            Some(url) => url,
            None => looseleaf_frontend::hub::base_of(&api_url)?,
        };
        let hub = looseleaf_frontend::hub::Hub::new(looseleaf_frontend::hub::HubConfig {
            api_url,
            public_url,
            service: args.jupyterhub_service,
            token,
            callback_url: args.jupyterhub_oauth_callback_url,
        })?;
        tracing::info!(scope = %hub.access_scope(), "serving JupyterHub's users");
        config.tokens = config.tokens.with_hub(hub);
    }
    // several users on this cluster, a tokens file's or a Hub's (ADR 52)
    let users = config.tokens.users().len();
    let shared_by = match (&args.tokens_file, config.tokens.hub()) {
        (_, Some(_)) => Some("--jupyterhub-api-url serves every Hub user".to_string()),
        (Some(path), None) if users >= 2 => Some(format!("{} names {users} users", path.display())),
        _ => None,
    };
    if let (Some(shared_by), false) = (shared_by, args.workers_isolated) {
        anyhow::ensure!(
            args.insecure_shared_workers,
            "{shared_by}: their cells must run as uids of their own (every gpu-host with --session-uids \
             FIRST-LAST, as root); say so with --workers-isolated, or pass --insecure-shared-workers to serve \
             them anyway (any cell can then read every other user's work)"
        );
        tracing::warn!("--insecure-shared-workers: any user's cell can read every other user's work");
    }
    // the signal listeners start with the runtime, before anything else
    actix_rt::System::new()
        .block_on(async { looseleaf_frontend::run(config, schemas::telemetry::shutdown_signal()).await })
}
