//! The four services as separate processes on a real nats-server, and a recorder of
//! a session's event stream, for whole-system tests that drive sessions directly
//! (through the one frontend client, `looseleaf-client`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use futures::StreamExt;
use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::Event;
use looseleaf_client::Frontend;
use schemas::messages::HostStatusV2;
use tokio::sync::mpsc;
use uuid::Uuid;

use schemas::nats::NatsOptions;

use crate::{free_port, random_prefix, venv_python, wait_for, NatsServer};

/// How long a test waits for one stream item.
pub const WAIT: Duration = Duration::from_secs(120);

/// Each service's own environment variables, by the service's name.
pub type PerService = Box<dyn Fn(&str) -> Vec<(String, String)>>;

/// One service process of a test cluster: how to start it again, and the process.
struct Proc {
    /// `looseleaf-store`, `looseleaf-planner`, `looseleaf-frontend` or `host-{i}`.
    name: String,
    bin: String,
    args: Vec<String>,
    /// Its own environment, beside what every process gets.
    env: Vec<(String, String)>,
    child: Option<Child>,
}

/// Store, planner, frontend and gpu-hosts; every process is killed on drop.
pub struct Services {
    procs: Vec<Proc>,
    bin_dir: PathBuf,
    /// What every process gets in its environment.
    env: Vec<(String, String)>,
    /// The frontend's base URL.
    pub frontend: String,
    /// The subject prefix.
    pub prefix: String,
    /// The NATS server (kept alive with the services).
    pub nats: NatsServer,
    /// Each service's own environment (its NATS login, on a cluster).
    per_service: PerService,
    _dir: tempfile::TempDir,
}

impl Drop for Services {
    fn drop(&mut self) {
        for p in &mut self.procs {
            if let Some(mut c) = p.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

impl Services {
    /// Start the services from `bin_dir` (where cargo put the binaries) with one
    /// gpu-host per entry of `host_slots` (its virtual GPU count), `env` added to
    /// every process (overriding the defaults: a store URL, for one); returns once
    /// every host reported its base zygote.
    pub async fn start(bin_dir: &Path, host_slots: &[u32], env: &[(&str, String)]) -> anyhow::Result<Self> {
        let nats = NatsServer::start()?;
        let mut env = env.to_vec();
        env.push(("LOOSELEAF_NATS_URL", nats.url().to_string()));
        let watch = NatsOptions::url(nats.url());
        Self::start_on(bin_dir, host_slots, &env, nats, watch, random_prefix(), Box::new(|_| Vec::new())).await
    }

    /// [`Services::start`] on a NATS of the test's own: `env` must say how to reach
    /// it (`LOOSELEAF_NATS_*`), `watch` is how the test connects, `prefix` the
    /// subject prefix (its users' permissions name it), and `per_service` adds each
    /// service's own variables (by name: `looseleaf-store`, `host-0`, ...).
    pub async fn start_on(
        bin_dir: &Path,
        host_slots: &[u32],
        env: &[(&str, String)],
        nats: NatsServer,
        watch: NatsOptions,
        prefix: String,
        per_service: PerService,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        // the store signs manifests as a deployment's does (ADR 24)
        let key_file = dir.path().join("manifest-key");
        schemas::local_nats::write_private(&key_file, &uuid::Uuid::new_v4().simple().to_string().repeat(2))?;
        let mut common: Vec<(String, String)> = vec![
            ("LOOSELEAF_PREFIX".into(), prefix.clone()),
            ("LOOSELEAF_STORE_URL".into(), dir.path().join("store").display().to_string()),
            ("LOOSELEAF_PYTHON".into(), venv_python().display().to_string()),
            // LOOSELEAF_TEST_LOG (e.g. "info") turns up the services' logs to debug a test
            ("LOOSELEAF_LOG".into(), std::env::var("LOOSELEAF_TEST_LOG").unwrap_or_else(|_| "warn".into())),
            ("LOOSELEAF_MANIFEST_KEY_FILE".into(), key_file.display().to_string()),
        ];
        common.extend(env.iter().map(|(k, v)| (k.to_string(), v.clone())));
        let client = watch.connect("test-watch").await?;
        let mut statuses = client.subscribe(format!("{prefix}.v1.host.*.status")).await?;
        let port = free_port()?;
        let mut s = Self {
            procs: Vec::new(),
            bin_dir: bin_dir.to_path_buf(),
            env: common,
            frontend: format!("http://127.0.0.1:{port}"),
            prefix,
            nats,
            per_service,
            _dir: dir,
        };
        s.add("looseleaf-store", "looseleaf-store", vec![])?;
        s.add("looseleaf-planner", "looseleaf-planner", vec![])?;
        for (i, slots) in host_slots.iter().enumerate() {
            let rt = s._dir.path().join(format!("host-{i}"));
            let args = vec![
                "--host-id".into(),
                format!("host-{i}"),
                "--virtual-gpus".into(),
                slots.to_string(),
                "--runtime-dir".into(),
                rt.display().to_string(),
            ];
            s.add(&format!("host-{i}"), "looseleaf-gpu-host", args)?;
        }
        s.add("looseleaf-frontend", "looseleaf-frontend", vec!["--listen".into(), format!("127.0.0.1:{port}")])?;
        wait_for(Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
            .context("the frontend did not start listening")?;
        let mut ready = std::collections::BTreeSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        while ready.len() < host_slots.len() {
            let Ok(Some(m)) = tokio::time::timeout_at(deadline, statuses.next()).await else {
                bail!("only {ready:?} of {} hosts reported a zygote", host_slots.len());
            };
            if let Ok(st) = schemas::codec::decode::<HostStatusV2>(m.headers.as_ref(), &m.payload) {
                if !st.zygotes.is_empty() {
                    ready.insert(st.host);
                }
            }
        }
        Ok(s)
    }

    fn spawn(&self, name: &str, bin: &str, args: &[String], own: &[(String, String)]) -> anyhow::Result<Child> {
        let mut cmd = Command::new(self.bin_dir.join(bin));
        cmd.args(args).stdin(Stdio::null()).envs(self.env.iter().chain(own).map(|(k, v)| (k, v)));
        if self.env.iter().any(|(k, v)| k == "LOOSELEAF_LOG_FORMAT" && v == "json") {
            // JSON logs are for the test to read (`log_lines`), not for its output
            let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_file(name))?;
            cmd.stderr(log);
        }
        cmd.spawn().with_context(|| format!("while starting {bin} (build the workspace's binaries first)"))
    }

    fn add(&mut self, name: &str, bin: &str, args: Vec<String>) -> anyhow::Result<()> {
        let env = (self.per_service)(name);
        let child = self.spawn(name, bin, &args, &env)?;
        self.procs.push(Proc { name: name.into(), bin: bin.into(), args, env, child: Some(child) });
        Ok(())
    }

    fn log_file(&self, name: &str) -> std::path::PathBuf {
        self._dir.path().join(format!("{name}.log"))
    }

    /// The JSON log lines service `name` wrote so far, for a cluster started with
    /// `LOOSELEAF_LOG_FORMAT=json` among its environment (each service's log then
    /// goes to a file of its own).
    pub fn log_lines(&self, name: &str) -> anyhow::Result<Vec<serde_json::Value>> {
        let text = std::fs::read_to_string(self.log_file(name)).with_context(|| format!("no JSON log of {name}"))?;
        Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
    }

    /// Start one more instance of the service binary `bin` under `name` (a
    /// second planner, say), with the environment the others have.
    pub fn start_another(&mut self, name: &str, bin: &str) -> anyhow::Result<()> {
        self.add(name, bin, vec![])
    }

    fn proc(&mut self, name: &str) -> anyhow::Result<&mut Proc> {
        self.procs.iter_mut().find(|p| p.name == name).with_context(|| format!("no service {name}"))
    }

    /// The pid of service `name` (`looseleaf-store`, `looseleaf-planner`,
    /// `looseleaf-frontend`, `host-{i}`), if it runs.
    pub fn pid(&mut self, name: &str) -> Option<u32> {
        self.proc(name).ok().and_then(|p| p.child.as_ref().map(Child::id))
    }

    /// Send `signal` to service `name` (SIGKILL: it dies; SIGTERM: it stops).
    pub fn signal(&mut self, name: &str, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = self.pid(name).with_context(|| format!("{name} is not running"))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)?;
        Ok(())
    }

    /// Kill service `name` (SIGKILL) and wait until it is gone.
    pub fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        if let Some(mut c) = self.proc(name)?.child.take() {
            let _ = c.kill();
            c.wait()?;
        }
        Ok(())
    }

    /// Start service `name` again (killing it first if it still runs), with the
    /// arguments and environment it started with.
    pub fn restart(&mut self, name: &str) -> anyhow::Result<()> {
        self.kill(name)?;
        let (bin, args, env) = {
            let p = self.proc(name)?;
            (p.bin.clone(), p.args.clone(), p.env.clone())
        };
        let child = self.spawn(name, &bin, &args, &env)?;
        self.proc(name)?.child = Some(child);
        Ok(())
    }

    /// Kill (SIGKILL) the workers of gpu-host `host-{i}`: every process its zygotes
    /// forked, and their children. Returns how many processes were killed.
    pub fn kill_workers(&mut self, i: usize) -> anyhow::Result<usize> {
        let host = self.pid(&format!("host-{i}")).context("the host is not running")?;
        let parents = process_parents()?;
        // depth 1: the host's zygotes (and helpers); depth 2 and below: workers
        let depth_of = |mut pid: u32| -> Option<usize> {
            let mut depth = 0;
            while let Some(&parent) = parents.get(&pid) {
                depth += 1;
                if parent == host {
                    return Some(depth);
                }
                if parent <= 1 || depth > 16 {
                    return None;
                }
                pid = parent;
            }
            None
        };
        let workers: Vec<u32> = parents.keys().copied().filter(|&p| depth_of(p).is_some_and(|d| d >= 2)).collect();
        for &pid in &workers {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        }
        Ok(workers.len())
    }

    /// Send `signal` to gpu-host `host-{i}` (SIGKILL: it dies; SIGTERM: it stops).
    pub fn signal_host(&mut self, i: usize, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        self.signal(&format!("host-{i}"), signal)
    }

    /// Wait until gpu-host `host-{i}` has exited.
    pub fn wait_host(&mut self, i: usize) -> anyhow::Result<std::process::ExitStatus> {
        let p = self.proc(&format!("host-{i}"))?;
        let child = p.child.as_mut().context("the host is not running")?;
        Ok(child.wait()?)
    }

    /// Where the services keep their data (the store, the manifest key).
    pub fn data_dir(&self) -> &Path {
        self._dir.path()
    }

    /// A client of the frontend.
    pub fn client(&self) -> Frontend {
        Frontend::new(&self.frontend)
    }

    /// A session in a folder of its own (every cell a GPU cell if `all_gpu`, no
    /// speculation), with its client and event stream.
    pub async fn session(&self, all_gpu: bool) -> anyhow::Result<TestSession> {
        let fe = self.client();
        let cwd = tempfile::tempdir()?;
        let sid = fe.create_session(&cwd.path().display().to_string(), all_gpu, false).await?;
        let events = Events::open(&fe, sid).await?;
        Ok(TestSession { fe, cwd, sid, events })
    }
}

/// A session of a test cluster.
pub struct TestSession {
    /// The frontend's client.
    pub fe: Frontend,
    /// Its working directory (removed when dropped).
    pub cwd: tempfile::TempDir,
    /// The session.
    pub sid: Uuid,
    /// Its event stream.
    pub events: Events,
}

impl TestSession {
    /// Run `code` as cell `cell` and wait for its outcome: (status, error, outputs' text).
    pub async fn run(&mut self, cell: &str, code: &str) -> anyhow::Result<(ExecStatus, Option<String>, String)> {
        let exec = self.fe.run(self.sid, cell, code).await?.exec_id;
        let (status, error) = self.events.outcome(exec).await?;
        Ok((status, error, self.events.text(exec)))
    }
}

/// A session's event stream, keeping everything seen.
pub struct Events {
    rx: mpsc::UnboundedReceiver<StreamItem>,
    /// Every item so far.
    pub seen: Vec<StreamItem>,
}

impl Events {
    /// Open `sid`'s event stream.
    pub async fn open(fe: &Frontend, sid: Uuid) -> anyhow::Result<Self> {
        Ok(Self { rx: fe.events(sid).await?, seen: Vec::new() })
    }

    /// Read until `stop` holds for an item (which is returned).
    pub async fn until(&mut self, stop: impl Fn(&StreamItem) -> bool) -> anyhow::Result<StreamItem> {
        loop {
            let item = match tokio::time::timeout(WAIT, self.rx.recv()).await {
                Ok(Some(item)) => item,
                Ok(None) => bail!("the event stream ended"),
                Err(_) => {
                    // the last items say where the session stopped
                    let last = &self.seen[self.seen.len().saturating_sub(8)..];
                    bail!("nothing on the event stream for {WAIT:?}; the last items: {last:#?}")
                }
            };
            self.seen.push(item.clone());
            if stop(&item) {
                return Ok(item);
            }
        }
    }

    /// Execution `exec`'s (status, error), once it is done (it may have been seen
    /// already: an aborted run is done before the one that was running).
    pub async fn outcome(&mut self, exec: Uuid) -> anyhow::Result<(ExecStatus, Option<String>)> {
        let done = |i: &StreamItem| matches!(i, StreamItem::Done { exec_id, .. } if *exec_id == exec);
        let seen = self.seen.iter().find(|i| done(i)).cloned();
        let item = match seen {
            Some(item) => item,
            None => self.until(done).await?,
        };
        match item {
            StreamItem::Done { status, error, .. } => Ok((status, error)),
            _ => bail!("not done"),
        }
    }

    /// Read until a host claimed `exec`; returns the index `i` of its `host-{i}`.
    pub async fn claimed_by(&mut self, exec: Uuid) -> anyhow::Result<usize> {
        let claimed = |i: &StreamItem| matches!(i, StreamItem::Event { exec_id, event: Event::Claimed { .. }, .. } if *exec_id == exec);
        let StreamItem::Event { event: Event::Claimed { host, .. }, .. } = self.until(claimed).await? else {
            bail!("not claimed")
        };
        Ok(host.trim_start_matches("host-").parse()?)
    }

    /// Read until `exec`'s cell started running.
    pub async fn started(&mut self, exec: Uuid) -> anyhow::Result<()> {
        self.until(|i| matches!(i, StreamItem::Event { exec_id, event: Event::Started { .. }, .. } if *exec_id == exec))
            .await
            .map(|_| ())
    }

    /// Read until execution `exec` is done; returns its outputs' text joined.
    pub async fn done(&mut self, exec: Uuid) -> anyhow::Result<String> {
        self.until(|i| matches!(i, StreamItem::Done { exec_id, .. } if *exec_id == exec)).await?;
        Ok(self.text(exec))
    }

    /// The text of `exec`'s outputs (streams, results, errors) so far.
    pub fn text(&self, exec: Uuid) -> String {
        self.seen
            .iter()
            .filter_map(|i| match i {
                StreamItem::Output { exec_id, output, .. } if *exec_id == exec => Some(output.to_json().to_string()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Every process's parent, from /proc.
fn process_parents() -> anyhow::Result<std::collections::HashMap<u32, u32>> {
    let mut parents = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(pid) = entry?.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // `pid (comm) state ppid ...`: comm may hold spaces, so split after its ')'
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            parents.insert(pid, ppid);
        }
    }
    Ok(parents)
}

/// Where cargo put this test's binaries (next to the test executable's deps dir).
pub fn bin_dir_of(exe: &str) -> PathBuf {
    Path::new(exe).parent().map(Path::to_path_buf).unwrap_or_default()
}
