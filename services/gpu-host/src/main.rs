use std::path::PathBuf;

use clap::Parser;
use schemas::service::ServiceArgs;

/// LooseLeaf gpu-host: GPU slots, zygotes and workers for one machine.
#[derive(Parser, Debug)]
struct Args {
    /// Flags every service takes (NATS, prefix, log filter).
    #[command(flatten)]
    service: ServiceArgs,
    /// Object store URL: file:///dir or a directory (shared by every host and the store).
    #[arg(long, env = "LOOSELEAF_STORE_URL", default_value = ".looseleaf/store")]
    store_url: String,
    /// This host's id, unique among hosts.
    #[arg(long, env = "LOOSELEAF_HOST_ID")]
    host_id: String,
    /// Make N CPU-backed GPU slots instead of probing real GPUs.
    #[arg(long, env = "LOOSELEAF_VIRTUAL_GPUS")]
    virtual_gpus: Option<u32>,
    /// Python interpreter for zygotes and workers (default: the checkout's `.venv`
    /// when run from one, else `python3` on PATH).
    #[arg(long, env = "LOOSELEAF_PYTHON")]
    python: Option<PathBuf>,
    /// Directory holding the looseleaf_worker package (default: the checkout's when
    /// run from one, else the package installed in the workers' Python).
    #[arg(long, env = "LOOSELEAF_WORKER_PATH")]
    worker_path: Option<PathBuf>,
    /// Packages the base zygote imports, comma-separated.
    #[arg(long, env = "LOOSELEAF_BASE_PACKAGES", default_value = "IPython,numpy,pandas", value_delimiter = ',')]
    base_packages: Vec<String>,
    /// Directory for this host's sockets.
    #[arg(long, env = "LOOSELEAF_RUNTIME_DIR", default_value = ".looseleaf/run")]
    runtime_dir: PathBuf,
    /// Where sessions' package layers live (`%pip install` in a cell lands in
    /// DIR/<session>); hosts that run the same sessions must share it (default:
    /// RUNTIME_DIR/packages, right for one host).
    #[arg(long, env = "LOOSELEAF_PACKAGE_LAYERS")]
    package_layers: Option<PathBuf>,
    /// Bytes the chunk cache may hold.
    #[arg(long, env = "LOOSELEAF_CACHE_BYTES", default_value_t = 1 << 30)]
    cache_bytes: u64,
    /// Prepared workers hold a GPU slot even when their closure has no GPU-resident
    /// state (default: they get their slot at Run).
    #[arg(long, env = "LOOSELEAF_PREPARE_HOLDS_SLOT")]
    prepare_holds_slot: bool,
    /// Keep a GPU worker warm with its slot after its cell until the planner's
    /// budget evicts it (a re-run of the cell starts at once; costs idle slot time).
    #[arg(long, env = "LOOSELEAF_KEEP_WARM")]
    keep_warm: bool,
    /// Host environment variables cells may see, comma-separated, besides the
    /// built-in allow-list (PATH, HOME, locale, CUDA_*, PIP_*, …); every other
    /// variable of the host's, its credentials among them, stays out of cells.
    #[arg(long, env = "LOOSELEAF_WORKER_ENV", value_delimiter = ',')]
    worker_env: Vec<String>,
    /// Bounds on each worker: memory, processes, cell time.
    #[command(flatten)]
    bounds: looseleaf_gpu_host::Bounds,
    /// Seconds a cell may ignore an interrupt (or the cell timeout's) before its
    /// worker is killed with every process it started.
    #[arg(long, env = "LOOSELEAF_INTERRUPT_GRACE_S", default_value_t = looseleaf_gpu_host::DEFAULT_INTERRUPT_GRACE_S)]
    interrupt_grace_s: f64,
    /// Run each session's workers as a uid of its own from this range (e.g.
    /// `200000-265535`; the host must run as root): a cell cannot read other
    /// sessions' files or the host's. The session's working directory must be
    /// usable by that uid. Unset: workers run as the host's user.
    #[arg(long, env = "LOOSELEAF_SESSION_UIDS")]
    session_uids: Option<String>,
}

fn main() -> anyhow::Result<()> {
    schemas::allocator::keep_freed_memory();
    let a = Args::parse();
    schemas::telemetry::init("looseleaf-gpu-host", &a.service.log, a.service.log_format)?;
    let config = looseleaf_gpu_host::Config {
        nats: a.service.nats,
        health_listen: a.service.health_listen,
        prefix: a.service.prefix,
        store_url: a.store_url,
        host_id: a.host_id,
        virtual_gpus: a.virtual_gpus,
        python: schemas::locate::python(a.python.as_deref()),
        worker_path: schemas::locate::worker_path(a.worker_path.as_deref()),
        base_packages: a.base_packages,
        package_layers: a.package_layers.unwrap_or_else(|| a.runtime_dir.join("packages")),
        runtime_dir: a.runtime_dir,
        cache_bytes: a.cache_bytes,
        prepare_holds_slot: a.prepare_holds_slot,
        keep_warm: a.keep_warm,
        worker_env: a.worker_env,
        worker_limits: a.bounds.limits(),
        cell_timeout: a.bounds.cell_timeout(),
        interrupt_grace: std::time::Duration::try_from_secs_f64(a.interrupt_grace_s)
            .ok()
            .filter(|g| *g <= std::time::Duration::from_secs(3600))
            .ok_or_else(|| anyhow::anyhow!("--interrupt-grace-s must be between 0 and 3600 seconds"))?,
        session_uids: a.session_uids,
    };
    // the signal listeners start with the runtime, before anything else
    actix_rt::System::new()
        .block_on(async { looseleaf_gpu_host::run(config, schemas::telemetry::shutdown_signal()).await })
}
