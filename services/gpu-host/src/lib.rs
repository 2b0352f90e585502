//! The gpu-host: one per machine. It finds GPU slots (cudarc, or `--virtual-gpus`),
//! keeps a zygote that imported the head packages, competes with other hosts for
//! recipes, forks a worker per GPU cell, restores its closure through shared memory,
//! runs the cell, saves what changed and releases the slot. It also runs sessions'
//! persistent CPU workers and keeps workers that hold unsavable variables.
//!
//! Speaks: serves `{prefix}.v1.session.*.recipe` and its host's `query` and `comm`
//! as `$SRV` endpoints (ADR 43; runs' recipes are acknowledged, ADR 42); subscribes
//! `….close`, `….idle` and its own `{prefix}.v1.host.{hid}.interrupt` and `….input`
//! (ADR 57); watches the claims bucket for runs other hosts took;
//! publishes `….event`, `{prefix}.v1.output.{sid}.{exec}`, `{prefix}.v1.host.{hid}.status`;
//! requests `{prefix}.v1.store.manifest.get` and `….commit`; claims in the KV bucket
//! `{prefix}_claims`. Reads and writes chunks in the object store directly.
//!
//! Modules: [`core`] (the host's decisions, without I/O), [`host`] (the actor that
//! drives it), [`exec`] (one execution), [`lifecycle`] (the
//! worker state machine), [`worker`] and [`zygotes`] (their processes, spoken to
//! through [`protocol`] on the host's [`socket`]; [`process`] checks and kills by
//! pid), [`import_cache`] (the zygote tree), [`chunks`] (the byte path), [`gpus`]
//! (slots).

pub mod cell_env;
pub mod cgroups;
pub mod chunks;
pub mod core;
pub mod exec;
pub mod gpus;
pub mod host;
pub mod import_cache;
pub mod input;
pub mod interrupts;
pub mod lifecycle;
pub mod process;
pub mod protocol;
pub mod session_uids;
pub mod socket;
pub mod worker;
mod worker_save;
pub mod zygotes;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use anyhow::Context as _;
use futures::StreamExt as _;
use schemas::buckets;
use schemas::messages::{
    CommV1, EvictV1, HostStatusV2, InputReplyV1, InterruptV1, QueryV1, RecipeV3, SessionCloseV1, SessionIdleV1,
};
use schemas::service::Service;
use schemas::subjects::HostVerb;

/// Child zygotes kept per host (the base zygote always stays).
const MAX_CHILD_ZYGOTES: usize = 4;

/// Private memory all child zygotes together may hold (what their tail imports
/// added on top of the base, which they share).
const MAX_CHILD_ZYGOTE_BYTES: u64 = 4 << 30;

/// What a gpu-host needs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where NATS is and how to log in.
    pub nats: schemas::nats::NatsOptions,
    /// Where to serve `/healthz` and `/readyz`, if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Subject prefix.
    pub prefix: String,
    /// Object store URL (file:///dir or a directory).
    pub store_url: String,
    /// This host's id (unique among hosts).
    pub host_id: String,
    /// Number of CPU-backed GPU slots to create instead of probing real GPUs.
    pub virtual_gpus: Option<u32>,
    /// Python interpreter for zygotes and workers.
    pub python: PathBuf,
    /// Directory holding the `looseleaf_worker` package (put on PYTHONPATH); None:
    /// the package is installed in `python`'s environment.
    pub worker_path: Option<PathBuf>,
    /// Packages the base zygote imports.
    pub base_packages: Vec<String>,
    /// Directory for this host's Unix sockets.
    pub runtime_dir: PathBuf,
    /// Where sessions' package layers live (`%pip install` in a cell lands in
    /// `DIR/<session>`): hosts that run the same sessions must share it.
    pub package_layers: PathBuf,
    /// Bytes the per-host chunk cache may hold.
    pub cache_bytes: u64,
    /// Workers prepared before Run hold a GPU slot even when their closure has no
    /// GPU-resident state (by default such workers are prepared on the CPU and get
    /// their slot at Run).
    pub prepare_holds_slot: bool,
    /// Keep a GPU worker warm with its slot after its cell (a re-run of the cell
    /// finds it ready) until the planner's budget evicts it.
    pub keep_warm: bool,
    /// Host environment variables cells may see besides the allow-list of
    /// [`cell_env`] (the host's others, its credentials among them, stay out).
    pub worker_env: Vec<String>,
    /// What each worker may use (memory, processes), through cgroups, as the
    /// operator's flags say: None takes the default of [`cgroups::Limits::from_flags`],
    /// 0 is unbounded.
    pub worker_limits: cgroups::Limits,
    /// A cell running longer is interrupted (then killed after `interrupt_grace`);
    /// None: no cell timeout, as in Jupyter.
    pub cell_timeout: Option<Duration>,
    /// How long a cell may ignore an interrupt before its worker is killed.
    pub interrupt_grace: Duration,
    /// Run each session's workers as a uid of its own from this range
    /// (`FIRST-LAST`; the host must be root). None: as the host's user.
    pub session_uids: Option<String>,
}

/// What bounds each worker, as an operator sets it (`looseleaf-gpu-host`,
/// `looseleaf up` and `run`, compose; ADR 52). On by default: a cell past a bound
/// fails naming it and the session goes on.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Bounds {
    /// Memory each worker (with everything its cells start) may use, in bytes;
    /// past it the kernel kills the worker and the cell fails naming the limit.
    /// Default: the machine's RAM divided by its GPU slots plus one; 0: unbounded.
    /// Through cgroups (v2, or the v1 memory hierarchy).
    #[arg(long, env = "LOOSELEAF_WORKER_MEMORY_BYTES")]
    pub worker_memory_bytes: Option<u64>,
    /// Processes and threads each worker may have (cgroup pids controller).
    /// Default: 4096; 0: unbounded.
    #[arg(long, env = "LOOSELEAF_WORKER_PIDS")]
    pub worker_pids: Option<u64>,
    /// A cell running longer than this many seconds is interrupted, as if the user
    /// had pressed interrupt, and killed if it ignores that. Default: none, as in
    /// Jupyter; 0: none.
    #[arg(long, env = "LOOSELEAF_CELL_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(0..=365 * 24 * 3600))]
    pub cell_timeout_s: Option<u64>,
}

impl Bounds {
    /// The workers' limits as flags (None: the default; see [`cgroups::Limits::from_flags`]).
    pub fn limits(&self) -> cgroups::Limits {
        cgroups::Limits { memory_bytes: self.worker_memory_bytes, pids: self.worker_pids }
    }

    /// The cell timeout (None: none).
    pub fn cell_timeout(&self) -> Option<Duration> {
        self.cell_timeout_s.filter(|s| *s > 0).map(Duration::from_secs)
    }
}

/// The default time a cell may ignore an interrupt (seconds).
pub const DEFAULT_INTERRUPT_GRACE_S: f64 = 5.0;

/// The cgroups that bound this host's workers. Where the machine cannot make
/// them, the defaults give way (after one warning that says what stays
/// unbounded), and bounds an operator asked for stop the host (ADR 52).
fn worker_cgroups(config: &Config, slots: usize) -> anyhow::Result<Option<cgroups::Cgroups>> {
    let asked = config.worker_limits;
    let limits = cgroups::Limits::from_flags(asked.memory_bytes, asked.pids, slots);
    match cgroups::Cgroups::new(&config.host_id, limits) {
        Ok(c) => Ok(c),
        Err(e) if asked.memory_bytes.is_none_or(|b| b == 0) && asked.pids.is_none_or(|n| n == 0) => {
            tracing::warn!(
                host = %config.host_id,
                "workers' {} are unbounded: this machine cannot limit them ({e}); a cell may use all of the machine",
                limits.describe()
            );
            Ok(None)
        }
        Err(e) => Err(anyhow::Error::new(e).context("while setting up the workers' limits")),
    }
}

/// Run the host until `shutdown` resolves. Must be called inside an actix system.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let description = "GPU slots, zygotes and workers";
    let service =
        Service::start("looseleaf-gpu-host", Some(&config.host_id), description, &config.nats, &config.prefix).await?;
    let bus = service.bus().clone();
    let objects = schemas::objects::open(&config.store_url).context("while opening the object store")?;
    std::fs::create_dir_all(&config.runtime_dir)
        .with_context(|| format!("while creating {}", config.runtime_dir.display()))?;
    let shm_dir =
        if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let listener = socket::Listener::bind(&socket_path(&config)).context("while binding the host socket")?;
    let (slots, real_gpus) = gpus::slots(config.virtual_gpus);
    tracing::info!(host = %config.host_id, slots = slots.len(), real_gpus, "gpu-host starting");

    // a Python without the worker runtime would fail every cell; say so at start
    schemas::locate::check_worker_runtime(&config.python, config.worker_path.as_deref())
        .await
        .map_err(|why| anyhow::anyhow!("the workers' Python: {why}"))?;
    let js = bus.jetstream();
    let claims =
        host::claims::Claims::new(buckets::claims(&js, &config.prefix, bus.replicas()).await?, config.host_id.clone());
    let cgroups = worker_cgroups(&config, slots.len())?;
    let zygote_spec = zygotes::ZygoteSpec {
        python: config.python.clone(),
        worker_path: config.worker_path.clone(),
        packages: config.base_packages.clone(),
        env: cell_env::cell_env(std::env::vars(), &config.worker_env),
        spare_cgroups: cgroups.as_ref().map(cgroups::Cgroups::spare_spec),
    };
    // Start the base zygote in the background: the host serves at once, and the first
    // fork waits for the zygote's imports instead of the host's subscriptions.
    let zygotes = Arc::new(tokio::sync::Mutex::new(import_cache::ImportCache::new(
        zygote_spec,
        MAX_CHILD_ZYGOTES,
        MAX_CHILD_ZYGOTE_BYTES,
    )));
    {
        let (listener, id) = (listener.clone(), format!("z-{}-base", config.host_id));
        let mut cache = zygotes.clone().lock_owned().await;
        tokio::spawn(async move {
            if let Err(e) = cache.ensure_base(&listener, &id).await {
                tracing::error!(error = %e, "base zygote failed to start; the next fork retries");
            }
        });
    }
    let env = exec::ExecEnv {
        bus: bus.clone(),
        host_id: config.host_id.clone(),
        chunks: chunks::Chunks::new(objects, config.cache_bytes, shm_dir),
        listener,
        zygotes,
        limits: worker::RunLimits { timeout: config.cell_timeout, grace: config.interrupt_grace },
        interrupts: interrupts::Interrupts::new(config.interrupt_grace),
        inputs: Default::default(),
        cgroups,
        real_gpus,
        recent_manifests: Default::default(),
        forks: Default::default(),
        lifecycle: Default::default(),
        package_layers: config.package_layers.clone(),
        stopping: Default::default(),
        session_uids: match &config.session_uids {
            Some(range) => Some(Arc::new(session_uids::SessionUids::new(range)?)),
            None => None,
        },
    };
    let s = bus.subjects().clone();
    // requests (the planner delivers runs' recipes; queries, comms): `$SRV`
    // endpoints with their stats, each host in a group of its own (all hear recipes)
    let recipes = service.endpoint::<RecipeV3>("recipe", s.all_recipes(), &config.host_id).await?;
    let closes = bus.subscribe::<SessionCloseV1>(s.all_closes()).await?;
    // what concerns only the host that claimed a run comes to it alone (ADR 57)
    let interrupts = bus.subscribe::<InterruptV1>(s.host_command(&config.host_id, HostVerb::Interrupt)).await?;
    let inputs = bus.subscribe::<InputReplyV1>(s.host_command(&config.host_id, HostVerb::Input)).await?;
    // runs other hosts took, from the claims bucket, not from anyone's session events
    let runs_claimed = claims.runs_claimed().map(|(exec_id, holder)| host::RunClaimed { exec_id, holder });
    let idles = bus.subscribe::<SessionIdleV1>(s.all_idles()).await?;
    let evictions = bus.subscribe::<EvictV1>(s.host_command(&config.host_id, HostVerb::Evict)).await?;
    let queries =
        service.endpoint::<QueryV1>("query", s.host_command(&config.host_id, HostVerb::Query), &config.host_id).await?;
    let comms =
        service.endpoint::<CommV1>("comm", s.host_command(&config.host_id, HostVerb::Comm), &config.host_id).await?;
    // other hosts' status: whether anyone else could take a run (see `claim_delay`)
    let peers = bus.subscribe::<HostStatusV2>(s.all_host_status()).await?;
    let zygote_handle = env.zygotes.clone();
    let cgroups = env.cgroups.clone();
    if let Some(listen) = config.health_listen {
        let zygotes = env.zygotes.clone();
        // the base zygote is up (while it starts, its cache is locked)
        let zygote = schemas::health::check(move || {
            let zygotes = zygotes.clone();
            async move {
                match tokio::time::timeout(std::time::Duration::from_secs(1), zygotes.lock()).await {
                    Ok(mut cache) => cache.base().map(|_| ()).ok_or_else(|| "no base zygote".to_string()),
                    Err(_) => Err("the base zygote is starting".to_string()),
                }
            }
        });
        let claims = schemas::health::bucket(&bus, buckets::claims_bucket(&config.prefix));
        let readiness = schemas::health::Readiness::new(&bus).with("claims_bucket", claims).with("zygote", zygote);
        schemas::health::serve(listen, readiness).await?;
    }
    let addr = host::Host::create(move |ctx| {
        ctx.add_stream(recipes.into_stream());
        ctx.add_stream(runs_claimed);
        ctx.add_stream(closes.into_stream());
        ctx.add_stream(interrupts.into_stream());
        ctx.add_stream(inputs.into_stream());
        ctx.add_stream(idles.into_stream());
        ctx.add_stream(evictions.into_stream());
        ctx.add_stream(queries.into_stream());
        ctx.add_stream(comms.into_stream());
        ctx.add_stream(peers.into_stream());
        host::Host::new(env, claims, slots, real_gpus, config.prepare_holds_slot, config.keep_warm)
    });
    let drain = async {
        // every worker this host keeps or prepared is stopped, then the zygotes
        if let Err(e) = addr.send(host::Stop).await {
            tracing::warn!(error = %e, "host actor already stopped");
        }
        zygote_handle.lock().await.shutdown().await;
        if let Some(cgroups) = &cgroups {
            // the workers' processes are gone now; their cgroups go too
            tokio::time::sleep(Duration::from_millis(200)).await;
            cgroups.remove_all();
        }
    };
    let served = service.serve(shutdown, || addr.connected(), drain).await;
    let _ = std::fs::remove_file(socket_path(&config));
    Ok(served?)
}

/// The host's Unix socket: in the runtime directory when the path is short enough
/// for a socket address (108 bytes), else under /tmp.
fn socket_path(config: &Config) -> PathBuf {
    let p = config.runtime_dir.join("host.sock");
    if p.as_os_str().len() < 100 {
        p
    } else {
        std::env::temp_dir().join(format!("looseleaf-{}-{}.sock", config.host_id, std::process::id()))
    }
}
