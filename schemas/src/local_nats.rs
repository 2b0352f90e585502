//! A local nats-server with JetStream, for `looseleaf up` and the tests: started on
//! a free loopback port with its store in a given directory, told apart from
//! anything else on that port by the name it announces (a port another process
//! took meanwhile is noticed and another one tried), and killed when dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
}

/// The nats-server binary: `explicit`, else `LOOSELEAF_NATS_SERVER`, else the one
/// scripts/setup put in `<repo>/.venv/bin`, else the first on PATH.
pub fn binary(explicit: Option<&Path>, repo: &Path) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os("LOOSELEAF_NATS_SERVER") {
        return PathBuf::from(p);
    }
    let venv = repo.join(".venv/bin/nats-server");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("nats-server")
}

/// A running local nats-server.
pub struct LocalNats {
    child: Option<Child>,
    url: String,
}

impl LocalNats {
    /// Start `bin` with JetStream storing in `store_dir`, and wait until it listens.
    /// Blocks for up to 15 s (call it from `spawn_blocking` in async code).
    pub fn start(bin: &Path, store_dir: &Path) -> Result<Self, LocalNatsError> {
        let name = format!("looseleaf-{}", uuid::Uuid::new_v4().simple());
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(LocalNatsError::Port)?
                .port();
            let mut child = Command::new(bin)
                .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-n", &name, "-js", "-sd"])
                .arg(store_dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|source| LocalNatsError::Spawn { bin: bin.display().to_string(), source })?;
            let deadline = Instant::now() + START;
            loop {
                if server_name_on(port).is_some_and(|n| n == name) {
                    return Ok(Self { child: Some(child), url: format!("nats://127.0.0.1:{port}") });
                }
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break; // the port was taken before it bound: try another
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(LocalNatsError::NotListening { bin: bin.display().to_string() });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(LocalNatsError::NoPort)
    }

    /// An external server, not started (nor stopped) here.
    pub fn external(url: String) -> Self {
        Self { child: None, url }
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
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
