//! The embedded cluster of `looseleaf up` and `looseleaf run`: a local nats-server
//! with JetStream, then the store, the planner, K gpu-hosts and the frontend, all in
//! this process's actix system, stopped together.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use schemas::local_nats::{write_private, LocalNats, NatsUser};
use schemas::nats::NatsOptions;
use schemas::permissions::Role;
use tokio::process::Command;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The subject prefix of the embedded cluster.
pub const PREFIX: &str = "ll";

/// How often [`Cluster::keep_nats_up`] looks at the cluster's own nats-server.
const NATS_CHECK: Duration = Duration::from_millis(500);

/// The longest wait between tries to start again a nats-server that would not start.
const NATS_RETRY_MAX: Duration = Duration::from_secs(10);

/// How to start the embedded cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// The worker runtime's directory, if given (see `schemas::locate`).
    pub worker_path: Option<PathBuf>,
    /// Where NATS, the store and the hosts' sockets live.
    pub data_dir: PathBuf,
    /// The nats-server binary, if given.
    pub nats_server: Option<PathBuf>,
    /// The Python interpreter, if given.
    pub python: Option<PathBuf>,
    /// Virtual GPU slots per host (None: probe real GPUs).
    pub virtual_gpus: Option<u32>,
    /// Number of gpu-hosts.
    pub hosts: u32,
    /// Frontend port (0: a free one).
    pub port: u16,
    /// Checkpoint store URL (None: a directory in the data dir).
    pub store_url: Option<String>,
    /// A directory store collects at once below this many free bytes (None: the default).
    pub gc_free_bytes: Option<u64>,
    /// The planner's speculation budget.
    pub budget: looseleaf_planner::speculator::Budget,
    /// Hosts prepare every worker on a GPU slot.
    pub prepare_holds_slot: bool,
    /// Each session's workers run as a uid of their own from this range
    /// (`FIRST-LAST`; the hosts must run as root; ADR 29).
    pub session_uids: Option<String>,
    /// An existing NATS to use (every service connects with these options); None
    /// starts a nats-server in the data directory, with a user per service.
    pub nats: Option<NatsOptions>,
    /// The users of the frontend's API (`USER TOKEN` lines, as the frontend's
    /// tokens file); None: one user, `local`, with a fresh token in `api-token`.
    pub users: Option<PathBuf>,
    /// A cluster of several users runs every user's cells as the user who started
    /// it (ADR 52): any cell can read every other user's work.
    pub insecure_shared_workers: bool,
    /// Bounds on each worker (memory, processes, cell time).
    pub bounds: looseleaf_gpu_host::Bounds,
    /// Its frontend is the only one of its data folder (the user's local
    /// cluster): sessions left attached when it last stopped are detached at start.
    pub sole_frontend: bool,
    /// Per-user GPU limits (`--quota-file`), read again when the file changes.
    pub quota_file: Option<PathBuf>,
}

/// The uids a cluster of several users gives its sessions' workers when the
/// operator names none (`--session-uids`): far above people's uids.
pub const DEFAULT_SESSION_UIDS: &str = "200000-201999";

/// The users file of `up --users`: readable by its owner only (cells run on this
/// machine), every line `USER TOKEN`. Returns the file's text and its user count.
fn read_users(path: &Path) -> anyhow::Result<(String, usize)> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::metadata(path).with_context(|| format!("--users {}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        bail!(
            "--users {}: the file is open to others (mode {mode:03o}) and holds every user's API token; make it its \
             owner's only: chmod 600 {}",
            path.display(),
            path.display()
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("--users {}", path.display()))?;
    let tokens =
        looseleaf_frontend::auth::Tokens::parse(&text).with_context(|| format!("--users {}", path.display()))?;
    Ok((text, tokens.users().len()))
}

/// The uid range of the cluster's workers: the operator's, or for a cluster of
/// several users the default one; refused where it cannot be used (ADR 52).
fn worker_uids(opts: &ClusterOptions, users: usize) -> anyhow::Result<Option<String>> {
    if let Some(range) = &opts.session_uids {
        return Ok(Some(range.clone()));
    }
    if users < 2 {
        return Ok(None); // one user: cells run as that user, as in Jupyter
    }
    if opts.insecure_shared_workers {
        tracing::warn!(
            users,
            "--insecure-shared-workers: every user's cells run as one uid; any cell can read every other user's \
             work, tokens and checkpoints"
        );
        return Ok(None);
    }
    match looseleaf_gpu_host::session_uids::SessionUids::new(DEFAULT_SESSION_UIDS) {
        Ok(_) => Ok(Some(DEFAULT_SESSION_UIDS.to_string())),
        Err(why) => bail!(
            "this cluster serves {users} users, so each session's workers must run as a uid of their own, and \
             here {why}; run it as root, name a usable range with --session-uids FIRST-LAST, or pass \
             --insecure-shared-workers to let every user's cells read each other's work"
        ),
    }
}

/// The NATS users of the embedded cluster: one per service, and the operator's
/// (`looseleaf status`). Workers get none: a cell cannot use the bus.
struct NatsUsers {
    frontend: NatsUser,
    planner: NatsUser,
    store: NatsUser,
    host: NatsUser,
    operator: NatsUser,
}

impl NatsUsers {
    /// Each service allowed only what it uses under `prefix` (ADR 27).
    fn new(prefix: &str) -> Self {
        Self {
            frontend: NatsUser::service(Role::Frontend, prefix),
            planner: NatsUser::service(Role::Planner, prefix),
            store: NatsUser::service(Role::Store, prefix),
            host: NatsUser::service(Role::GpuHost, prefix),
            operator: NatsUser::new("operator"),
        }
    }

    fn all(&self) -> Vec<NatsUser> {
        [&self.frontend, &self.planner, &self.store, &self.host, &self.operator].into_iter().cloned().collect()
    }
}

/// The file in a data directory that records how to reach the NATS of the
/// `looseleaf up` running there (its URL, with the operator's login), so that
/// `looseleaf status` finds it.
const NATS_URL_FILE: &str = "nats-url";

/// The NATS that the `looseleaf up` of `data_dir` recorded, if one is running there.
pub fn recorded_nats(data_dir: &Path) -> Option<NatsOptions> {
    let url = std::fs::read_to_string(data_dir.join(NATS_URL_FILE)).ok()?;
    Some(NatsOptions::url(url.trim()))
}

/// Where the services' NATS is.
enum ClusterNats {
    /// A nats-server started here, with a user per service.
    Local { server: LocalNats, users: Box<NatsUsers> },
    /// An operator's NATS, used with the options given.
    External(NatsOptions),
}

impl ClusterNats {
    /// How the service logged in as `user` connects (on an external NATS, every
    /// service uses the options given).
    fn for_user(&self, user: impl Fn(&NatsUsers) -> &NatsUser) -> NatsOptions {
        match self {
            Self::Local { server, users } => NatsOptions::url(server.url_for(user(users))),
            Self::External(options) => options.clone(),
        }
    }
}

/// A running embedded cluster.
pub struct Cluster {
    nats: ClusterNats,
    data_dir: PathBuf,
    token: CancellationToken,
    tasks: Vec<(String, JoinHandle<anyhow::Result<()>>)>,
    /// The frontend's base URL.
    pub frontend_url: String,
    /// The NATS URL (shown without passwords).
    pub nats_url: String,
    /// The bearer token of the frontend's API (also in `DATA_DIR/api-token`);
    /// empty where `--users` names the users.
    pub api_token: String,
}

/// The data directory's manifest key, made on the first start and kept: manifests
/// signed with a lost key no longer load.
fn manifest_key(data_dir: &Path) -> anyhow::Result<PathBuf> {
    let path = data_dir.join("manifest-key");
    if !path.exists() {
        let key = format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
        write_private(&path, &key).with_context(|| format!("while writing {}", path.display()))?;
    }
    Ok(path)
}

/// Let session uids reach their package layers in the data directory by name,
/// and nothing else of it: its owner's bits stay, others may only traverse. (Its
/// secrets are 0600 by `write_private`, the store 0700 by the store, the bus's
/// folder 0700 here.)
fn traversable_data_dir(data_dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(data_dir).with_context(|| format!("{}", data_dir.display()))?.permissions().mode();
    std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode((mode & 0o700) | 0o011))
        .with_context(|| format!("while making {} traversable only", data_dir.display()))
}

/// The folder of the local nats-server's streams (sessions' code among them),
/// its owner's only.
fn private_dir(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(path).with_context(|| format!("while creating {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("while making {} private", path.display()))
}

/// Whether `python -c "import torch"` works (bounded, so a broken install cannot hang `up`).
async fn has_torch(python: &Path) -> bool {
    let child = Command::new(python)
        .args(["-c", "import torch"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .status();
    matches!(tokio::time::timeout(Duration::from_secs(30), child).await, Ok(Ok(s)) if s.success())
}

impl Cluster {
    /// Start everything; returns once the frontend listens. Call inside an actix system.
    pub async fn start(opts: &ClusterOptions) -> anyhow::Result<Self> {
        let users = opts.users.as_deref().map(read_users).transpose()?;
        let session_uids = worker_uids(opts, users.as_ref().map_or(1, |(_, n)| *n))?;
        let opts = &ClusterOptions { session_uids, ..opts.clone() };
        std::fs::create_dir_all(&opts.data_dir)
            .with_context(|| format!("while creating {}", opts.data_dir.display()))?;
        let data_dir = opts.data_dir.canonicalize().context("while resolving the data dir")?;
        if opts.session_uids.is_some() {
            traversable_data_dir(&data_dir)?;
        }
        let nats = match &opts.nats {
            Some(external) => ClusterNats::External(external.clone()),
            None => {
                let bin = schemas::locate::nats_server(opts.nats_server.as_deref());
                let store = data_dir.join("nats");
                private_dir(&store)?;
                // every client logs in; each service as itself, fresh passwords each start
                let users = NatsUsers::new(PREFIX);
                let all = users.all();
                let server = tokio::task::spawn_blocking(move || LocalNats::start_with_users(&bin, &store, &all))
                    .await
                    .context("while starting nats-server")??;
                // `looseleaf status` reads it (the file is the user's own, like the API token)
                let record = data_dir.join(NATS_URL_FILE);
                write_private(&record, &server.url_for(&users.operator))
                    .with_context(|| format!("while writing {}", record.display()))?;
                ClusterNats::Local { server, users: Box::new(users) }
            }
        };
        let nats_url = nats.for_user(|u| &u.operator).shown();
        let token = CancellationToken::new();
        // a fresh API token per start, readable by this user only (unless the
        // operator named the users)
        let token_file = data_dir.join("api-token");
        let (api_token, tokens) = match users {
            Some((text, _)) => {
                let _ = std::fs::remove_file(&token_file); // an earlier start's
                (String::new(), text)
            }
            None => {
                let token = format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
                write_private(&token_file, &token)
                    .with_context(|| format!("while writing {}", token_file.display()))?;
                (token.clone(), format!("local {token}\n"))
            }
        };
        let mut cluster = Cluster {
            nats,
            data_dir: data_dir.clone(),
            token: token.clone(),
            tasks: Vec::new(),
            frontend_url: String::new(),
            nats_url,
            api_token,
        };
        match cluster.start_services(opts, &data_dir, &tokens).await {
            Ok(url) => {
                cluster.frontend_url = url;
                Ok(cluster)
            }
            Err(e) => {
                cluster.stop().await;
                Err(e)
            }
        }
    }

    async fn start_services(&mut self, opts: &ClusterOptions, data_dir: &Path, tokens: &str) -> anyhow::Result<String> {
        let (store_nats, planner_nats) = (self.nats.for_user(|u| &u.store), self.nats.for_user(|u| &u.planner));
        let (host_nats, frontend_nats) = (self.nats.for_user(|u| &u.host), self.nats.for_user(|u| &u.frontend));
        let store_url = opts.store_url.clone().unwrap_or_else(|| data_dir.join("store").display().to_string());
        let store = looseleaf_store::Config {
            nats: store_nats,
            health_listen: None,
            prefix: PREFIX.into(),
            store_url: store_url.clone(),
            session_quota_bytes: None,
            gc: Some(looseleaf_store::gc::Schedule::default()),
            gc_free_bytes: opts.gc_free_bytes,
            manifest_key_file: Some(manifest_key(data_dir)?),
        };
        self.spawn("store", |stop| looseleaf_store::run(store, stop));
        let planner = looseleaf_planner::Config {
            nats: planner_nats,
            health_listen: None,
            prefix: PREFIX.into(),
            debounce: Duration::from_millis(looseleaf_planner::DEFAULT_DEBOUNCE_MS),
            budget: opts.budget,
            host_lost: Duration::from_secs(10),
            demand_lead: Duration::from_secs(looseleaf_planner::DEFAULT_DEMAND_LEAD_S),
        };
        self.spawn("planner", |stop| looseleaf_planner::run(planner, stop));

        let python = schemas::locate::python(opts.python.as_deref());
        let worker_path = schemas::locate::worker_path(opts.worker_path.as_deref());
        let mut base_packages: Vec<String> = ["IPython", "numpy", "pandas"].map(String::from).to_vec();
        if has_torch(&python).await {
            base_packages.push("torch".into());
        }
        for i in 0..opts.hosts {
            let host_id = format!("host-{i}");
            let runtime_dir = data_dir.join("run").join(&host_id);
            std::fs::create_dir_all(&runtime_dir)
                .with_context(|| format!("while creating {}", runtime_dir.display()))?;
            let config = looseleaf_gpu_host::Config {
                nats: host_nats.clone(),
                health_listen: None,
                prefix: PREFIX.into(),
                store_url: store_url.clone(),
                host_id: host_id.clone(),
                virtual_gpus: opts.virtual_gpus,
                python: python.clone(),
                worker_path: worker_path.clone(),
                base_packages: base_packages.clone(),
                runtime_dir,
                // one directory for every host of the machine: a session's installs
                // are there wherever its next cell runs
                package_layers: data_dir.join("packages"),
                cache_bytes: 1 << 30,
                prepare_holds_slot: opts.prepare_holds_slot,
                keep_warm: false,
                worker_env: Vec::new(),
                worker_limits: opts.bounds.limits(),
                cell_timeout: opts.bounds.cell_timeout(),
                interrupt_grace: Duration::from_secs_f64(looseleaf_gpu_host::DEFAULT_INTERRUPT_GRACE_S),
                // cells write where the notebook lies, as its owner: the embedded
                // cluster runs them as the user who started it (ADR 29), unless it
                // serves several users (ADR 52); its hosts share this machine's
                // files, so each gets uids of its own
                session_uids: match &opts.session_uids {
                    Some(range) => Some(looseleaf_gpu_host::session_uids::SessionUids::split(range, opts.hosts, i)?),
                    None => None,
                },
            };
            self.spawn(&host_id, |stop| looseleaf_gpu_host::run(config, stop));
        }

        let listen = SocketAddr::from(([127, 0, 0, 1], opts.port));
        let mut config = looseleaf_frontend::Config::new(frontend_nats, PREFIX, listen);
        config.tokens = looseleaf_frontend::auth::Tokens::parse(tokens)?;
        config.sole_frontend = opts.sole_frontend;
        if let Some(path) = &opts.quota_file {
            config.quotas = looseleaf_frontend::quota::Quotas::load(path)?;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.spawn("frontend", move |stop| {
            looseleaf_frontend::run_with_bound(config, stop, move |addr| {
                if tx.send(addr).is_err() {
                    tracing::warn!("nobody waits for the frontend address");
                }
            })
        });
        match tokio::time::timeout(Duration::from_secs(60), rx).await {
            Ok(Ok(addr)) => Ok(format!("http://{addr}")),
            Ok(Err(_)) => {
                let (_, handle) = self.tasks.pop().context("frontend task missing")?;
                match handle.await {
                    Ok(Err(e)) => Err(e.context("the frontend failed to start")),
                    _ => bail!("the frontend stopped before it listened"),
                }
            }
            Err(_) => bail!("the frontend did not listen within 60 s"),
        }
    }

    fn spawn<F, Fut>(&mut self, name: &str, f: F)
    where
        F: FnOnce(tokio_util::sync::WaitForCancellationFutureOwned) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>> + 'static,
    {
        let fut = f(self.token.clone().cancelled_owned());
        self.tasks.push((name.to_string(), actix_rt::spawn(fut)));
    }

    /// Wait until `hosts` gpu-hosts report a ready zygote on their status subjects, so
    /// the first cell does not pay for the base imports. A service that stops
    /// meanwhile (a host whose Python lacks the worker runtime) ends the wait with
    /// its error.
    pub async fn wait_ready(&mut self, hosts: u32, timeout: Duration) -> anyhow::Result<()> {
        let ready = hosts_ready(self.nats.for_user(|u| &u.operator), hosts, timeout);
        tokio::select! {
            res = ready => res,
            (name, res) = self.any_exit() => match res {
                Ok(()) => Err(anyhow::anyhow!("{name} stopped by itself")),
                Err(e) => Err(e.context(format!("{name} failed to start"))),
            },
        }
    }

    /// Resolves when any service stops by itself (an error, usually), naming it.
    pub async fn any_exit(&mut self) -> (String, anyhow::Result<()>) {
        if self.tasks.is_empty() {
            return futures::future::pending().await;
        }
        let (res, i, _) = futures::future::select_all(self.tasks.iter_mut().map(|(_, h)| h)).await;
        let (name, _) = self.tasks.remove(i);
        let res = res.unwrap_or_else(|e| Err(anyhow::anyhow!("task panicked or was cancelled: {e}")));
        (name, res)
    }

    /// Keep the cluster's own nats-server running: one that exited (killed,
    /// crashed) is started again on its port, with its JetStream store and its
    /// users, so the services' clients reconnect by themselves and nothing that
    /// was committed is lost. While it is down, `trouble` says so (a kernel names
    /// it in the errors of the cells it could not run); None once it runs again.
    /// One that will not start (its port taken meanwhile) is tried again, waiting
    /// longer each time. Never returns; an operator's NATS is not watched.
    ///
    /// Cancelled while a start is under way, the server being started is killed
    /// when that start ends (its `LocalNats` is dropped with the blocking task).
    pub async fn keep_nats_up(&mut self, trouble: tokio::sync::watch::Sender<Option<String>>) {
        let ClusterNats::Local { server, .. } = &mut self.nats else {
            return futures::future::pending().await;
        };
        let mut wait = NATS_CHECK;
        loop {
            tokio::time::sleep(wait).await;
            let Some(why) = nats_down(server) else {
                wait = NATS_CHECK;
                continue;
            };
            tracing::error!(%why, "the cluster's nats-server is down; starting it again on its port with its store");
            trouble.send_replace(Some(format!("the embedded cluster's nats-server {why}; it is being started again")));
            // started on a blocking thread (it waits up to 15 s for the server to
            // listen), a stand-in in its place meanwhile
            let url = server.url().to_string();
            let mut taken = std::mem::replace(server, LocalNats::external(url));
            let restarted = tokio::task::spawn_blocking(move || {
                let res = taken.restart();
                (taken, res)
            })
            .await;
            match restarted {
                Ok((back, Ok(()))) => {
                    *server = back;
                    tracing::warn!(pid = ?server.pid(), "the cluster's nats-server runs again");
                    trouble.send_replace(None);
                    wait = NATS_CHECK;
                }
                Ok((back, Err(e))) => {
                    *server = back;
                    wait = (wait * 2).min(NATS_RETRY_MAX);
                    tracing::error!(error = %e, retry_in = ?wait, "could not start the cluster's nats-server again");
                    trouble.send_replace(Some(format!(
                        "the embedded cluster's nats-server {why} and could not be started again ({e}); trying again"
                    )));
                }
                Err(e) => {
                    // the server went with the task: nothing is left to start again
                    tracing::error!(error = %e, "the task that started nats-server again failed");
                    trouble.send_replace(Some(format!(
                        "the embedded cluster's nats-server {why} and starting it again failed ({e}); restart the kernel"
                    )));
                    return futures::future::pending().await;
                }
            }
        }
    }

    /// Stop every service (10 s each at most), then nats-server.
    pub async fn stop(mut self) {
        self.token.cancel();
        for (name, handle) in self.tasks.drain(..) {
            match tokio::time::timeout(Duration::from_secs(10), handle).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    tracing::warn!(service = %name, error = format!("{e:#}"), "service stopped with an error")
                }
                Ok(Err(e)) => tracing::warn!(service = %name, error = %e, "service task failed"),
                Err(_) => tracing::warn!(service = %name, "service did not stop within 10 s"),
            }
        }
        if let ClusterNats::Local { mut server, .. } = self.nats {
            server.kill();
            let _ = std::fs::remove_file(self.data_dir.join(NATS_URL_FILE));
        }
    }
}

/// Why the nats-server started here is not running, if it is not: it exited (a
/// zombie until its `LocalNats` reaps it; a stopped one still runs) or none was
/// started (a start that failed). From /proc: waiting on it here would reap it
/// behind its `Child`'s back.
fn nats_down(server: &LocalNats) -> Option<String> {
    let Some(pid) = server.pid() else { return Some("is not running".into()) };
    (!crate::local::alive(pid)).then(|| format!("(pid {pid}) exited"))
}

/// Wait until `hosts` gpu-hosts report a ready zygote, watching as `nats` says.
async fn hosts_ready(nats: NatsOptions, hosts: u32, timeout: Duration) -> anyhow::Result<()> {
    use futures::StreamExt;
    let client = nats.connect("looseleaf-up").await.context("while watching host status")?;
    let subjects = schemas::Subjects::new(PREFIX);
    let mut sub = client.subscribe(subjects.all_host_status()).await?;
    let mut ready = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while (ready.len() as u32) < hosts {
        let msg = match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(m)) => m,
            Ok(None) => bail!("status subscription ended"),
            Err(_) => bail!("only {} of {hosts} gpu-hosts were ready within {timeout:?}", ready.len()),
        };
        match schemas::codec::decode::<schemas::messages::HostStatusV2>(msg.headers.as_ref(), &msg.payload) {
            Ok(s) if !s.zygotes.is_empty() => {
                ready.insert(s.host);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "undecodable host status"),
        }
    }
    Ok(())
}
