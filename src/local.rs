//! The user's local cluster (ADR 65): one LooseLeaf per user per machine, which
//! every `looseleaf kernel` without `--frontend` uses. Each notebook is a session
//! on it; a kernel's restart is a new session, not a new cluster.
//!
//! Its data folder (the store, the bus's streams, the session records, the API
//! token) is the user's own and outlives it, so a notebook's detached session
//! resumes even after the cluster stopped or died (ADR 63). The data folder's
//! `cluster.lock` is held by the cluster for as long as it runs, so that a second
//! cannot start on the same data, whatever its environment. The runtime folder
//! holds what kernels find it by:
//! - `cluster.json`: the [`Address`] of the one running (written once it is ready);
//! - `start.lock`: held by the kernel starting one, so two kernels racing to
//!   start it make one cluster.
//!
//! The first kernel starts it in the background (`looseleaf up --local`, in a
//! process group of its own, so Jupyter's kill of a kernel's group spares it); it
//! stops by itself after `--idle-exit-s` with no attached session.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use looseleaf_client::Frontend;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::cluster::ClusterOptions;

/// How long a kernel waits for the cluster it started (or another kernel is
/// starting) to be ready: its first start pulls in the zygote's imports.
const START_WAIT: Duration = Duration::from_secs(240);

/// How often a starting cluster's address file is looked for.
const POLL: Duration = Duration::from_millis(100);

/// The default of `up --local --idle-exit-s`.
pub const DEFAULT_IDLE_EXIT_S: f64 = 900.0;

/// Where the running local cluster is: `cluster.json` in the runtime folder.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Address {
    /// The cluster's process.
    pub pid: u32,
    /// Its frontend's base URL.
    pub frontend: String,
    /// Its data folder (the API token is `api-token` there).
    pub data_dir: PathBuf,
    /// The `looseleaf` version that runs it.
    pub version: String,
}

/// The user's local cluster: its runtime and data folders.
#[derive(Clone, Debug)]
pub struct LocalCluster {
    runtime: PathBuf,
    data: PathBuf,
}

/// The user's LooseLeaf folder: `LOOSELEAF_USER_DIR`, else
/// `$XDG_DATA_HOME/looseleaf`, else `~/.local/share/looseleaf`.
fn user_dir() -> anyhow::Result<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("LOOSELEAF_USER_DIR") {
        return Ok(dir);
    }
    if let Some(data) = var("XDG_DATA_HOME") {
        return Ok(data.join("looseleaf"));
    }
    let home = var("HOME").context("neither LOOSELEAF_USER_DIR nor HOME is set: no folder for the local cluster")?;
    Ok(home.join(".local/share/looseleaf"))
}

/// A folder of the user's only (its secrets and the sessions' code are in it).
fn private_dir(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .with_context(|| format!("while creating {}", path.display()))?;
    let mode = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("while making {} private", path.display()))?;
    }
    Ok(())
}

/// Whether process `pid` is alive (a zombie counts as gone), from /proc.
pub fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // `pid (comm) state ...`: comm may hold spaces, so the state follows the last ')'
    match stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) {
        Some("Z" | "X") | None => false,
        Some(_) => true,
    }
}

/// Take the exclusive lock on `path`, waiting for it at most `wait` (None: not at all).
async fn lock(path: &Path, wait: Option<Duration>) -> anyhow::Result<Option<Flock<File>>> {
    let deadline = tokio::time::Instant::now() + wait.unwrap_or_default();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("while opening {}", path.display()))?;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(held) => return Ok(Some(held)),
            Err((back, nix::errno::Errno::EWOULDBLOCK)) => {
                if tokio::time::Instant::now() >= deadline {
                    return Ok(None);
                }
                file = back;
                tokio::time::sleep(POLL).await;
            }
            Err((_, e)) => bail!("while locking {}: {e}", path.display()),
        }
    }
}

impl LocalCluster {
    /// The current user's (see [`user_dir`]; the runtime folder is
    /// `LOOSELEAF_RUNTIME_DIR`, else `run` in the user's folder: not
    /// `$XDG_RUNTIME_DIR`, which some launchers of kernels set and others not).
    pub fn of_user() -> anyhow::Result<Self> {
        let user = user_dir()?;
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let runtime = var("LOOSELEAF_RUNTIME_DIR").unwrap_or_else(|| user.join("run"));
        Ok(Self { runtime, data: user.join("cluster") })
    }

    /// The cluster's data folder.
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    fn address_file(&self) -> PathBuf {
        self.runtime.join("cluster.json")
    }

    /// The running cluster's address; None when none runs (no file, or its
    /// process is gone).
    pub fn address(&self) -> Option<Address> {
        let text = std::fs::read_to_string(self.address_file()).ok()?;
        let address: Address = serde_json::from_str(&text).ok()?;
        alive(address.pid).then_some(address)
    }

    /// Whether the running cluster is still the one at `address` (a kernel
    /// checks before each cell that its cluster did not stop or die meanwhile).
    pub fn serves(&self, address: &Address) -> bool {
        self.address().as_ref() == Some(address)
    }

    /// A client of the running cluster, and its address, if one runs and answers.
    pub async fn connect(&self) -> Option<(Frontend, Address)> {
        let address = self.address()?;
        let token = std::fs::read_to_string(address.data_dir.join("api-token")).ok()?;
        let fe = Frontend::new(&address.frontend).with_token(token.trim());
        match tokio::time::timeout(Duration::from_secs(10), fe.sessions()).await {
            Ok(Ok(_)) => Some((fe, address)),
            Ok(Err(e)) => {
                tracing::warn!(frontend = %address.frontend, error = %e, "the local cluster does not answer");
                None
            }
            Err(_) => None,
        }
    }

    /// A client of the running cluster, starting it (as `opts` says) if none
    /// runs. Of two kernels at once, one starts it and the other waits for it.
    pub async fn connect_or_start(&self, opts: &ClusterOptions) -> anyhow::Result<(Frontend, Address)> {
        if let Some(connected) = self.connect().await {
            return Ok(connected);
        }
        private_dir(&self.runtime)?;
        private_dir(&self.data)?;
        let start_lock = self.runtime.join("start.lock");
        let Some(_starting) = lock(&start_lock, Some(START_WAIT)).await? else {
            bail!(
                "another kernel has been starting the local cluster for {START_WAIT:?}: see {}",
                self.log().display()
            );
        };
        // another kernel may have started it while this one waited
        if let Some(connected) = self.connect().await {
            return Ok(connected);
        }
        let mut child = self.spawn(opts)?;
        let deadline = tokio::time::Instant::now() + START_WAIT;
        loop {
            // this one's, or one a kernel killed while starting it had started
            // (this one's then waits for the data folder's lock: not needed)
            if let Some((fe, address)) = self.connect().await {
                if Some(address.pid) != child.id() {
                    stop_group(&mut child).await;
                }
                tracing::info!(pid = address.pid, frontend = %address.frontend, "the local cluster runs");
                // it runs on when this kernel ends: reaped by init then
                return Ok((fe, address));
            }
            if let Some(status) = child.try_wait().context("while watching the local cluster start")? {
                bail!("the local cluster stopped as it started ({status}):\n{}", self.log_tail());
            }
            if tokio::time::Instant::now() >= deadline {
                stop_group(&mut child).await;
                bail!("the local cluster was not ready within {START_WAIT:?}:\n{}", self.log_tail());
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn log(&self) -> PathBuf {
        self.data.join("cluster.log")
    }

    /// The last lines of the cluster's log, to say why it did not start.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        format!("(the end of {})\n{tail}", self.log().display())
    }

    /// `looseleaf up --local` in the background, in a process group of its own,
    /// its output in the data folder's `cluster.log`; what the kernel was told of
    /// the cluster (Python, hosts, bounds) goes in its environment.
    fn spawn(&self, opts: &ClusterOptions) -> anyhow::Result<tokio::process::Child> {
        let exe = std::env::current_exe().context("while finding the looseleaf binary")?;
        // appended to: a cluster that runs may be writing it
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .with_context(|| format!("while opening {}", self.log().display()))?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args(["up", "--local"])
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(false);
        for (name, value) in cluster_env(opts) {
            cmd.env(name, value);
        }
        // what this user's shell may set for an operator's cluster is not the local one's
        for name in [
            "LOOSELEAF_USERS",
            "LOOSELEAF_SESSION_UIDS",
            "LOOSELEAF_INSECURE_SHARED_WORKERS",
            "LOOSELEAF_NATS_URL",
            "LOOSELEAF_PORT",
            "LOOSELEAF_DATA_DIR",
        ] {
            cmd.env_remove(name);
        }
        let child = cmd.spawn().context("while starting the local cluster")?;
        tracing::info!(pid = ?child.id(), data_dir = %self.data.display(), "starting the local cluster");
        Ok(child)
    }

    /// Hold the cluster's lock for as long as the returned guard lives; an error
    /// naming the running one if another holds it.
    pub async fn hold(&self) -> anyhow::Result<Running> {
        private_dir(&self.runtime)?;
        private_dir(&self.data)?;
        let path = self.data.join("cluster.lock");
        // one stopping (idle) still holds it for a few seconds
        let Some(lock) = lock(&path, Some(Duration::from_secs(30))).await? else {
            let running = self.address().map(|a| format!(" (pid {}, {})", a.pid, a.frontend)).unwrap_or_default();
            bail!("the local cluster of {} runs already{running}", self.data.display());
        };
        Ok(Running { _lock: lock, address_file: self.address_file() })
    }
}

/// Stop a cluster this kernel started and no longer wants (its process group:
/// what it started too).
async fn stop_group(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::SIGTERM);
        if tokio::time::timeout(Duration::from_secs(15), child.wait()).await.is_err() {
            let _ = child.kill().await;
        }
    }
}

/// The environment that gives `looseleaf up --local` the options of `opts`.
fn cluster_env(opts: &ClusterOptions) -> Vec<(&'static str, String)> {
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    let mut env = vec![
        ("LOOSELEAF_HOSTS", Some(opts.hosts.to_string())),
        ("LOOSELEAF_VIRTUAL_GPUS", opts.virtual_gpus.map(|n| n.to_string())),
        ("LOOSELEAF_PYTHON", path(&opts.python)),
        ("LOOSELEAF_NATS_SERVER", path(&opts.nats_server)),
        ("LOOSELEAF_WORKER_PATH", path(&opts.worker_path)),
        ("LOOSELEAF_STORE_URL", opts.store_url.clone()),
        ("LOOSELEAF_GC_FREE_BYTES", opts.gc_free_bytes.map(|n| n.to_string())),
        ("LOOSELEAF_PREPARED_PER_HOST", Some(opts.budget.prepared_per_host.to_string())),
        ("LOOSELEAF_IDLE_GPU_SECONDS", Some(opts.budget.idle_seconds_per_session.to_string())),
        ("LOOSELEAF_WORKER_MEMORY_BYTES", opts.bounds.worker_memory_bytes.map(|n| n.to_string())),
        ("LOOSELEAF_WORKER_PIDS", opts.bounds.worker_pids.map(|n| n.to_string())),
        ("LOOSELEAF_CELL_TIMEOUT_S", opts.bounds.cell_timeout_s.map(|n| n.to_string())),
    ];
    if opts.prepare_holds_slot {
        env.push(("LOOSELEAF_PREPARE_HOLDS_SLOT", Some("true".into())));
    }
    env.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect()
}

/// The running cluster's hold on its runtime folder: its lock, and its address
/// once published (removed when it stops).
pub struct Running {
    _lock: Flock<File>,
    address_file: PathBuf,
}

impl Running {
    /// Say where the cluster is: kernels connect from now on.
    pub fn publish(&self, address: &Address) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(address)?;
        let partial = self.address_file.with_extension("json.partial");
        schemas::local_nats::write_private(&partial, &text)
            .with_context(|| format!("while writing {}", partial.display()))?;
        std::fs::rename(&partial, &self.address_file)
            .with_context(|| format!("while writing {}", self.address_file.display()))
    }

    /// Say it no longer serves (it stops now; the lock is still held, so no other
    /// starts on its data until it stopped).
    pub fn withdraw(&self) {
        let _ = std::fs::remove_file(&self.address_file);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.withdraw();
    }
}

/// Resolves once the cluster at `fe` has had no attached session for `after`
/// (looked at every few seconds).
async fn until_idle(fe: &Frontend, after: Duration) {
    let every = (after / 4).clamp(Duration::from_millis(250), Duration::from_secs(10));
    let mut idle_since = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(every).await;
        match fe.sessions().await {
            Ok(listed) if listed.iter().any(|s| s.detached_unix_ms.is_none()) => {
                idle_since = tokio::time::Instant::now();
            }
            Ok(_) => {}
            // a frontend that does not answer is not idle: the cluster heals or stops
            Err(e) => {
                tracing::warn!(error = %e, "the local cluster's frontend does not answer its idle check");
                idle_since = tokio::time::Instant::now();
            }
        }
        if idle_since.elapsed() >= after {
            return;
        }
    }
}

/// `looseleaf up --local`: the user's local cluster (ADR 65), until a signal or
/// `idle_exit` with no attached session.
pub async fn serve(local: LocalCluster, opts: ClusterOptions, idle_exit: Option<Duration>) -> anyhow::Result<()> {
    let running = local.hold().await?;
    let mut cluster = crate::cluster::Cluster::start(&opts).await?;
    if let Err(e) = cluster.wait_ready(opts.hosts, Duration::from_secs(180)).await {
        cluster.stop().await;
        return Err(e);
    }
    let address = Address {
        pid: std::process::id(),
        frontend: cluster.frontend_url.clone(),
        data_dir: local.data_dir().to_path_buf(),
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    if let Err(e) = running.publish(&address) {
        cluster.stop().await;
        return Err(e);
    }
    eprintln!("the local cluster is up: frontend {} (data in {})", address.frontend, address.data_dir.display());
    let fe = Frontend::new(&cluster.frontend_url).with_token(&cluster.api_token);
    let idle = async {
        match idle_exit {
            Some(after) => until_idle(&fe, after).await,
            None => futures::future::pending().await,
        }
    };
    // its nats-server, if it exits, is started again meanwhile (as a kernel's own cluster's)
    let (trouble, _) = tokio::sync::watch::channel(None);
    tokio::select! {
        () = schemas::telemetry::shutdown_signal() => eprintln!("stopping"),
        () = idle => eprintln!("no attached session for {idle_exit:?}: stopping"),
        () = cluster.keep_nats_up(trouble) => {}
    }
    // no kernel connects from now on; the lock stays until it stopped
    running.withdraw();
    cluster.stop().await;
    Ok(())
}
