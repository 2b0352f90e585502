//! The embedded cluster's options as every subcommand that starts one (`up`,
//! `run`, the kernel's local cluster) takes them.

use std::path::PathBuf;

use clap::Args;

use crate::cluster::ClusterOptions;

/// Where the embedded cluster finds its pieces.
#[derive(Args, Debug, Clone)]
pub struct EmbedArgs {
    /// The nats-server binary (default: the checkout's `.venv/bin/nats-server` when
    /// run from one, else PATH).
    #[arg(long, env = "LOOSELEAF_NATS_SERVER")]
    pub nats_server: Option<PathBuf>,
    /// Python interpreter for zygotes and workers (default: the checkout's `.venv`
    /// when run from one, else `python3` on PATH).
    #[arg(long, env = "LOOSELEAF_PYTHON")]
    pub python: Option<PathBuf>,
    /// Directory holding the worker runtime, the `looseleaf_worker` package (default:
    /// the checkout's when run from one, else the package installed in that Python).
    #[arg(long, env = "LOOSELEAF_WORKER_PATH")]
    pub worker_path: Option<PathBuf>,
    /// Number of gpu-hosts to run.
    #[arg(long, env = "LOOSELEAF_HOSTS", default_value_t = 1)]
    pub hosts: u32,
    /// Checkpoint object store: s3://bucket[/prefix] (AWS_* variables give the
    /// endpoint and credentials) or a directory (default: <data dir>/store).
    #[arg(long, env = "LOOSELEAF_STORE_URL")]
    pub store_url: Option<String>,
    /// A directory store collects garbage at once below this many free bytes
    /// (default: 5% of its volume or 2 GiB, whichever is smaller).
    #[arg(long, env = "LOOSELEAF_GC_FREE_BYTES")]
    pub gc_free_bytes: Option<u64>,
    /// Speculation budget: prepared-but-idle workers per host.
    #[arg(long, env = "LOOSELEAF_PREPARED_PER_HOST", default_value_t = looseleaf_planner::DEFAULT_BUDGET.prepared_per_host)]
    pub prepared_per_host: usize,
    /// Speculation budget: idle GPU-slot seconds one session's prepared workers may spend per hour.
    #[arg(long, env = "LOOSELEAF_IDLE_GPU_SECONDS", default_value_t = looseleaf_planner::DEFAULT_BUDGET.idle_seconds_per_session)]
    pub idle_gpu_seconds_per_session: f64,
    /// Prepared workers hold a GPU slot even when their closure has no GPU-resident state.
    #[arg(long, env = "LOOSELEAF_PREPARE_HOLDS_SLOT")]
    pub prepare_holds_slot: bool,
    /// Per-user GPU limits: a file of `USER gpu_seconds_per_day=N
    /// concurrent_gpu_cells=N` lines (`*`: every user), read again when it
    /// changes (ADR 66).
    #[arg(long, env = "LOOSELEAF_QUOTA_FILE")]
    pub quota_file: Option<PathBuf>,
    /// Bounds on each worker.
    #[command(flatten)]
    pub bounds: looseleaf_gpu_host::Bounds,
}

pub fn options(embed: EmbedArgs, data_dir: PathBuf, virtual_gpus: Option<u32>, port: u16) -> ClusterOptions {
    ClusterOptions {
        worker_path: embed.worker_path,
        data_dir,
        nats_server: embed.nats_server,
        python: embed.python,
        virtual_gpus,
        hosts: embed.hosts,
        store_url: embed.store_url,
        gc_free_bytes: embed.gc_free_bytes,
        budget: looseleaf_planner::speculator::Budget {
            prepared_per_host: embed.prepared_per_host,
            idle_seconds_per_session: embed.idle_gpu_seconds_per_session,
        },
        prepare_holds_slot: embed.prepare_holds_slot,
        port,
        session_uids: None,
        nats: None,
        users: None,
        insecure_shared_workers: false,
        bounds: embed.bounds,
        sole_frontend: false,
        quota_file: embed.quota_file,
    }
}
