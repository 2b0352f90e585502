//! Shared test harness: a real nats-server per test (free port, own JetStream
//! directory, killed on drop), random prefixes, and polling helpers. Tests never
//! sleep to wait; they poll a condition with a deadline.
//!
//! `LOOSELEAF_TEST_NATS_URL` points tests at an external server instead.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use schemas::local_nats::LocalNats;

pub mod cluster;
pub mod jupyter;
pub mod local_cluster;
pub mod otlp;
pub mod secure_nats;

/// Held by a test that starts a whole deployment as processes (compose's, the
/// Kubernetes trial's): each starts a dozen services with their zygotes, and two
/// at once on a CI machine of two cores starve each other's probes.
pub static DEPLOYMENT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The repository root (where Cargo.toml of the workspace is).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap_or_else(|_| PathBuf::from("."))
}

/// The project's Python environment's interpreter (made by scripts/setup).
pub fn venv_python() -> PathBuf {
    std::env::var_os("LOOSELEAF_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo_root().join(".venv/bin/python"))
}

/// Copy the folder `from` (or one file) to `to`, recursively; a failure names the path.
pub fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    if from.is_dir() {
        std::fs::create_dir_all(to).with_context(|| format!("create {}", to.display()))?;
        for entry in std::fs::read_dir(from).with_context(|| format!("read {}", from.display()))? {
            let entry = entry?;
            copy_dir(&entry.path(), &to.join(entry.file_name()))?;
        }
    } else {
        std::fs::copy(from, to).with_context(|| format!("copy {} to {}", from.display(), to.display()))?;
    }
    Ok(())
}

/// A free TCP port on loopback.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A random subject prefix, so concurrent tests never hear each other.
pub fn random_prefix() -> String {
    format!("t{}", uuid::Uuid::new_v4().simple())
}

/// SIGSTOP (or SIGCONT) a process and wait until every one of its threads has
/// stopped (or left the stop): `kill` returns once the signal is queued, and a busy
/// machine may let the process answer one more request before it stops.
fn pause_process(pid: u32, paused: bool) -> anyhow::Result<()> {
    use nix::sys::signal::Signal;
    let signal = if paused { Signal::SIGSTOP } else { Signal::SIGCONT };
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)?;
    let settled = || -> anyhow::Result<bool> {
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            let stat = std::fs::read_to_string(task?.path().join("stat")).unwrap_or_default();
            // the state follows the command name's closing parenthesis; T is stopped
            let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
            if state.is_some() && (state == Some('T')) != paused {
                return Ok(false);
            }
        }
        Ok(true)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !settled()? {
        if Instant::now() > deadline {
            bail!("process {pid} did not {} within 10 s", if paused { "stop" } else { "resume" });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// A nats-server with JetStream for one test; killed on drop.
pub struct NatsServer {
    nats: LocalNats,
    _dir: tempfile::TempDir,
}

impl NatsServer {
    /// Start one (or use `LOOSELEAF_TEST_NATS_URL`), and wait until it accepts connections.
    pub fn start() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        if let Ok(url) = std::env::var("LOOSELEAF_TEST_NATS_URL") {
            return Ok(Self { nats: LocalNats::external(url), _dir: dir });
        }
        let nats = LocalNats::start(&schemas::locate::nats_server(None), dir.path())?;
        Ok(Self { nats, _dir: dir })
    }

    /// A server the test runs itself (a cluster of its own), not started or
    /// stopped here.
    pub fn external(url: String) -> anyhow::Result<Self> {
        Ok(Self { nats: LocalNats::external(url), _dir: tempfile::tempdir()? })
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        self.nats.url()
    }

    /// Kill it now (to test what services do when NATS goes away).
    pub fn kill(&mut self) {
        self.nats.kill();
    }

    /// Freeze it (SIGSTOP: connections stay open and nothing answers, as with a
    /// server that hangs) or let it go on (SIGCONT).
    pub fn pause(&self, paused: bool) -> anyhow::Result<()> {
        let pid = self.nats.pid().context("an external server cannot be paused")?;
        pause_process(pid, paused)
    }

    /// Kill it and start it again on the same port with the same JetStream store.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        Ok(self.nats.restart()?)
    }
}

/// A local S3 server (moto, installed in the venv by scripts/setup-tests) with one bucket,
/// for one test; killed on drop.
pub struct S3Server {
    child: Child,
    /// Its endpoint URL (http://127.0.0.1:PORT).
    pub endpoint: String,
    /// The bucket the test may use.
    pub bucket: String,
}

impl S3Server {
    /// Start moto on a free port and create a bucket.
    pub fn start() -> anyhow::Result<Self> {
        let port = free_port()?;
        let bin = repo_root().join(".venv/bin/moto_server");
        let child = Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("while starting {} (run scripts/setup first)", bin.display()))?;
        let bucket = format!("ll-{}", uuid::Uuid::new_v4().simple());
        let server = Self { child, endpoint: format!("http://127.0.0.1:{port}"), bucket };
        wait_for(Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
            .context("the S3 server did not start listening")?;
        // listening is not yet answering: a server still starting (seen on a loaded
        // CI machine) resets the first request, so the bucket is asked for again
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match server.create_bucket(port) {
                Ok(()) => return Ok(server),
                Err(e) if Instant::now() < deadline && e.downcast_ref::<std::io::Error>().is_some() => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e.context("while creating the test bucket")),
            }
        }
    }

    /// moto accepts unsigned requests, so one plain HTTP PUT makes the bucket.
    fn create_bucket(&self, port: u16) -> anyhow::Result<()> {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port))?;
        write!(
            conn,
            "PUT /{} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.bucket
        )?;
        let mut reply = String::new();
        conn.read_to_string(&mut reply)?;
        // 409: made by an earlier try whose answer was lost
        anyhow::ensure!(
            reply.starts_with("HTTP/1.1 200") || reply.starts_with("HTTP/1.1 409"),
            "creating bucket {}: {}",
            self.bucket,
            reply.lines().next().unwrap_or("")
        );
        Ok(())
    }

    /// Stop the server (SIGSTOP: connections hang, as with a store that stopped
    /// answering) or let it go on (SIGCONT); its data stays.
    pub fn pause(&self, paused: bool) -> anyhow::Result<()> {
        pause_process(self.child.id(), paused)
    }

    /// The store URL for the bucket.
    pub fn url(&self) -> String {
        format!("s3://{}", self.bucket)
    }

    /// The `AWS_*` variables a service needs to use this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "looseleaf-test".into()),
            ("AWS_SECRET_ACCESS_KEY", "looseleaf-test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// The same, as settings for `schemas::objects::open_with` (lower-case keys).
    pub fn settings(&self) -> Vec<(String, String)> {
        self.env().into_iter().map(|(k, v)| (k.to_lowercase(), v)).collect()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Poll `cond` until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("condition not met within {timeout:?}")
}

/// Async version of [`wait_for`] for conditions that need the runtime.
pub async fn wait_for_async<F, Fut>(timeout: Duration, mut cond: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond().await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("condition not met within {timeout:?}")
}

/// `looseleaf up` as a child process on a free port with its own data directory,
/// as a user runs it; stopped with SIGINT (so it stops its services and
/// nats-server) on drop.
pub struct LocalCluster {
    child: Child,
    port: u16,
    _data: tempfile::TempDir,
    token: String,
}

impl LocalCluster {
    /// Start one with `virtual_gpus` CPU-backed GPU slots and wait for its frontend.
    pub fn start(looseleaf: &Path, virtual_gpus: u32) -> anyhow::Result<Self> {
        Self::start_with(looseleaf, virtual_gpus, &[])
    }

    /// [`LocalCluster::start`] with more arguments to `looseleaf up`.
    pub fn start_with(looseleaf: &Path, virtual_gpus: u32, args: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_env(looseleaf, virtual_gpus, args, &[])
    }

    /// [`LocalCluster::start_with`], with more environment variables.
    pub fn start_with_env(
        looseleaf: &Path,
        virtual_gpus: u32,
        args: &[&str],
        env: &[(&str, String)],
    ) -> anyhow::Result<Self> {
        let port = free_port()?;
        let data = tempfile::tempdir()?;
        let child = Command::new(looseleaf)
            .args(["up", "--virtual-gpus", &virtual_gpus.to_string(), "--port", &port.to_string(), "--data-dir"])
            .arg(data.path())
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("while starting looseleaf up")?;
        let token_file = data.path().join("api-token");
        let mut up = LocalCluster { child, port, _data: data, token: String::new() };
        wait_for(Duration::from_secs(180), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
            .context("looseleaf up: no frontend")?;
        // written before the frontend listens (unless `--users` names the users)
        if !args.contains(&"--users") {
            let token = std::fs::read_to_string(&token_file).context("looseleaf up wrote no API token")?;
            up.token = token.trim().to_string();
        }
        Ok(up)
    }

    /// The frontend's URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its data directory.
    pub fn data_dir(&self) -> &Path {
        self._data.path()
    }

    /// The bearer token of its API (what `looseleaf up` printed).
    pub fn token(&self) -> &str {
        &self.token
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
