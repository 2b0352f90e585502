//! A local nats-server with JetStream, for `looseleaf up` and the tests: started on
//! a free loopback port with its store in a given directory, told apart from
//! anything else on that port by the name it announces (a port another process
//! took meanwhile is noticed and another one tried), and killed when dropped, or
//! when the process that started it exits, however it ends (SIGKILL included).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use crate::permissions::{self, Permissions, Role};

/// How long a nats-server may take to listen.
const START: Duration = Duration::from_secs(15);

/// Why a local nats-server could not be had.
#[derive(Debug, thiserror::Error)]
pub enum LocalNatsError {
    /// The binary could not be started.
    #[error("could not start {bin} (run scripts/setup, or set --nats-server / LOOSELEAF_NATS_SERVER): {source}")]
    Spawn {
        /// The binary.
        bin: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// It started but did not listen in time (or exited).
    #[error("{bin} did not listen within {START:?}")]
    NotListening {
        /// The binary.
        bin: String,
    },
    /// Every free port tried was taken before the server bound it.
    #[error("nats-server could not bind a free port in 5 tries")]
    NoPort,
    /// No free port could be found at all.
    #[error("no free port: {0}")]
    Port(#[source] std::io::Error),
    /// Its configuration file could not be written.
    #[error("could not write the nats-server configuration {path}: {source}")]
    Config {
        /// The file.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// A NATS user of a local server: a name and a password.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsUser {
    /// The user name.
    pub name: String,
    /// Its password (random; hex, so it needs no quoting in a URL or the config).
    pub password: String,
    /// What it may publish and subscribe to (None: everything, the operator).
    pub permissions: Option<Permissions>,
}

impl NatsUser {
    /// A user `name` with a fresh random password, allowed everything.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.into(),
            password: format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple()),
            permissions: None,
        }
    }

    /// The user of a service in `role`, allowed only what the role uses under `prefix`.
    pub fn service(role: Role, prefix: &str) -> Self {
        Self { permissions: Some(role.permissions(prefix)), ..Self::new(role.user()) }
    }
}

/// The server configuration that makes every client log in as one of `users`.
/// The server's configuration: the bus's message limit (ADR 30: a server that
/// refuses anything larger keeps every test and local cluster honest about it),
/// and the users, if clients must log in.
pub fn server_config(users: &[NatsUser]) -> String {
    let limit = format!("max_payload: {}\n", crate::bodies::BUS_MESSAGE_MAX_BYTES);
    match users {
        [] => limit,
        users => limit + &auth_config(users),
    }
}

/// The configuration of a deployed NATS (compose.yaml's deploy/nats/auth.conf):
/// the message limit, a user per service with its permissions under `prefix`, and
/// an `operator` allowed everything, each password a variable the server reads
/// from its environment (`STORE_NATS_PASSWORD`, `GPU_HOST_NATS_PASSWORD`, ...).
pub fn deployment_config(prefix: &str) -> String {
    let env = |name: &str| format!("${}_NATS_PASSWORD", name.to_uppercase().replace('-', "_"));
    let mut users: Vec<NatsUser> = [Role::Store, Role::Planner, Role::Frontend, Role::GpuHost]
        .into_iter()
        .map(|role| NatsUser { password: env(role.user()), ..NatsUser::service(role, prefix) })
        .collect();
    users.push(NatsUser { password: env("operator"), ..NatsUser::new("operator") });
    format!(
        "# Written by `looseleaf nats-config --prefix {prefix}` (regenerate, never edit: the deployment tests check it is current).\n{}",
        server_config(&users)
    )
}

fn auth_config(users: &[NatsUser]) -> String {
    let lines: Vec<String> = users
        .iter()
        .map(|u| {
            let permissions =
                u.permissions.as_ref().map(|p| format!(", {}", permissions::render(p))).unwrap_or_default();
            // `$NAME` unquoted is a variable the server reads from its environment
            let password = if u.password.starts_with('$') { u.password.clone() } else { format!("\"{}\"", u.password) };
            format!("    {{user: \"{}\", password: {password}{permissions}}}", u.name)
        })
        .collect();
    format!("authorization {{\n  users = [\n{}\n  ]\n}}\n", lines.join("\n"))
}

/// Write `text` to a new file only its owner may read (a file there is replaced).
pub fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())
}

/// A running local nats-server.
pub struct LocalNats {
    child: Option<Child>,
    url: String,
    /// How it was started (None for an external server): to start it again.
    started: Option<Started>,
}

#[derive(Clone, Debug)]
struct Started {
    bin: std::path::PathBuf,
    store_dir: std::path::PathBuf,
    name: String,
    port: u16,
    /// Its configuration (users), if it asks clients to log in: where it is
    /// written for the server to read at start, and the text. The file is removed
    /// once the server listens, so that the passwords lie on disk only meanwhile.
    config: Option<(PathBuf, String)>,
}

impl Started {
    /// Spawn the server; Ok(None) if it exited before listening (port taken).
    fn spawn(&self) -> Result<Option<Child>, LocalNatsError> {
        if let Some((path, text)) = &self.config {
            write_private(path, text)
                .map_err(|source| LocalNatsError::Config { path: path.display().to_string(), source })?;
        }
        let child = self.spawn_and_wait();
        if let Some((path, _)) = &self.config {
            let _ = std::fs::remove_file(path);
        }
        child
    }

    fn spawn_and_wait(&self) -> Result<Option<Child>, LocalNatsError> {
        let bin = self.bin.display().to_string();
        // its log beside its store, kept across restarts: what an operator reads
        // when JetStream does not come back
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.store_dir.with_extension("log"));
        let mut command = Command::new(&self.bin);
        command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-n", &self.name, "-js", "-sd"])
            .arg(&self.store_dir)
            .args(self.config.iter().flat_map(|(c, _)| [std::ffi::OsStr::new("-c"), c.as_os_str()]))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.map_or_else(|_| Stdio::null(), Stdio::from))
            // a group of its own: a Ctrl-C (or Jupyter's SIGINT to a kernel's group)
            // meant for the process that started it does not stop the bus under
            // the services; they stop it
            .process_group(0);
        let mut child = spawn_tied(command).map_err(|source| LocalNatsError::Spawn { bin: bin.clone(), source })?;
        let deadline = Instant::now() + START;
        loop {
            if server_name_on(self.port).is_some_and(|n| n == self.name) {
                return Ok(Some(child));
            }
            if matches!(child.try_wait(), Ok(Some(_))) {
                return Ok(None);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(LocalNatsError::NotListening { bin });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl LocalNats {
    /// Start `bin` with JetStream storing in `store_dir`, and wait until it listens.
    /// Blocks for up to 15 s (call it from `spawn_blocking` in async code).
    pub fn start(bin: &Path, store_dir: &Path) -> Result<Self, LocalNatsError> {
        Self::start_with_users(bin, store_dir, &[])
    }

    /// [`LocalNats::start`], where every client must log in as one of `users` (none:
    /// anyone may connect). The configuration is written beside the store, readable
    /// by this user only, while the server starts.
    pub fn start_with_users(bin: &Path, store_dir: &Path, users: &[NatsUser]) -> Result<Self, LocalNatsError> {
        let config = Some((store_dir.with_extension("conf"), server_config(users)));
        let name = format!("looseleaf-{}", uuid::Uuid::new_v4().simple());
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(LocalNatsError::Port)?
                .port();
            let started = Started {
                bin: bin.to_path_buf(),
                store_dir: store_dir.to_path_buf(),
                name: name.clone(),
                port,
                config: config.clone(),
            };
            // None: the port was taken before it bound: try another
            if let Some(child) = started.spawn()? {
                let url = format!("nats://127.0.0.1:{port}");
                return Ok(Self { child: Some(child), url, started: Some(started) });
            }
        }
        Err(LocalNatsError::NoPort)
    }

    /// Start it again after [`LocalNats::kill`], on the same port with the same
    /// JetStream store (a restart, as an operator's would be). An external server
    /// is not restarted.
    pub fn restart(&mut self) -> Result<(), LocalNatsError> {
        self.kill();
        let Some(started) = self.started.clone() else { return Ok(()) };
        let deadline = Instant::now() + START;
        // the old server's port may take a moment to be free again
        loop {
            if let Some(child) = started.spawn()? {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(LocalNatsError::NotListening { bin: started.bin.display().to_string() });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// An external server, not started (nor stopped) here.
    pub fn external(url: String) -> Self {
        Self { child: None, url, started: None }
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's pid, if it was started here and runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its URL with `user`'s credentials in it (what a client of a server that asks
    /// for users connects to).
    pub fn url_for(&self, user: &NatsUser) -> String {
        self.url.replacen("nats://", &format!("nats://{}:{}@", user.name, user.password), 1)
    }

    /// Kill it now (stopping, or a test of what services do when NATS goes away).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for LocalNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A command for the spawner thread, and where it sends the child.
type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Start `command`, its child to be killed when this process exits: spawned
/// from a thread that lives as long as this process, since a parent-death signal
/// fires when the *thread* that forked the child exits (prctl(2)), and
/// [`LocalNats::start`] runs on threads that come and go (`spawn_blocking`'s, a
/// test's).
fn spawn_tied(mut command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        // the sender is never dropped (a static), so the loop never ends
        let started = std::thread::Builder::new().name("nats-spawner".into()).spawn(move || {
            for (mut command, reply) in rx {
                // the caller waits for it: a failed send means it is gone
                let _ = reply.send(command.spawn());
            }
        });
        if let Err(e) = started {
            tracing::error!(error = %e, "no thread to start nats-server from");
        }
        tx
    });
    parent_death::kill_with_this_process(&mut command);
    let (reply, spawned) = mpsc::channel();
    spawner.send((command, reply)).map_err(|_| std::io::Error::other("no thread to start nats-server from"))?;
    spawned.recv().map_err(|_| std::io::Error::other("the nats-server spawner thread is gone"))?
}

/// The parent-death signal (prctl(2)), declared here: this crate has no libc.
#[cfg(target_os = "linux")]
mod parent_death {
    use std::ffi::{c_int, c_ulong};
    use std::os::unix::process::CommandExt as _;

    extern "C" {
        fn prctl(option: c_int, ...) -> c_int;
        fn getppid() -> c_int;
    }

    const PR_SET_PDEATHSIG: c_int = 1;
    const SIGKILL: c_ulong = 9;

    /// Have the child `command` starts get SIGKILL when this process exits
    /// (when the thread that spawns it does: spawn it from one that lasts).
    pub fn kill_with_this_process(command: &mut std::process::Command) {
        let parent = std::process::id();
        // SAFETY: the closure runs in the forked child before exec and makes only
        // async-signal-safe system calls; it allocates nothing.
        unsafe {
            command.pre_exec(move || set(parent));
        }
    }

    /// In the child: SIGKILL when `parent` exits, or an error if it already has.
    fn set(parent: u32) -> std::io::Result<()> {
        let zero: c_ulong = 0;
        // SAFETY: prctl with PR_SET_PDEATHSIG reads its second argument only
        if unsafe { prctl(PR_SET_PDEATHSIG, SIGKILL, zero, zero, zero) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // the parent died before the signal was set, which then never comes
        // SAFETY: getppid takes nothing and cannot fail
        if u32::try_from(unsafe { getppid() }).ok() != Some(parent) {
            return Err(std::io::ErrorKind::Other.into());
        }
        Ok(())
    }
}

/// Elsewhere no parent-death signal: the server is stopped when dropped only.
#[cfg(not(target_os = "linux"))]
mod parent_death {
    pub fn kill_with_this_process(_command: &mut std::process::Command) {}
}

/// The `server_name` a NATS server on `port` announces in its INFO line, if one
/// answers there.
fn server_name_on(port: u16) -> Option<String> {
    let conn = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line).ok()?;
    let info: serde_json::Value = serde_json::from_str(line.strip_prefix("INFO ")?.trim()).ok()?;
    info["server_name"].as_str().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server with users refuses clients without a user or with a wrong
    /// password, and takes each user with theirs.
    #[tokio::test]
    async fn a_server_with_users_lets_in_only_them() {
        let bin = crate::locate::nats_server(None);
        let dir = tempfile::tempdir().unwrap();
        let (store, host) = (NatsUser::new("store"), NatsUser::new("gpu-host"));
        let users = [store.clone(), host.clone()];
        let nats = match LocalNats::start_with_users(&bin, &dir.path().join("nats"), &users) {
            Ok(n) => n,
            Err(e) => panic!("nats-server (run scripts/setup): {e}"),
        };
        assert!(!dir.path().join("nats.conf").exists(), "the passwords are not left on disk");
        let connect = |url: String| async move { crate::nats::NatsOptions::url(url).connect("test").await };
        assert!(connect(nats.url().to_string()).await.is_err(), "no user");
        let wrong = NatsUser { password: "guess".into(), ..store.clone() };
        assert!(connect(nats.url_for(&wrong)).await.is_err(), "a wrong password");
        for u in &users {
            let client = connect(nats.url_for(u)).await.unwrap();
            client.publish("ll.test", "x".into()).await.unwrap();
            client.flush().await.unwrap();
        }
    }
}
