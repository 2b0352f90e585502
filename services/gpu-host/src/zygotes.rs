//! Zygote processes: Python interpreters that imported packages once and fork
//! workers on request (DESIGN.md section 7). [`crate::import_cache`] decides which
//! zygotes exist.
//!
//! Zygotes and workers connect back to the host's Unix socket and introduce
//! themselves with `hello` ([`crate::socket`]).
//!
//! None of them outlives the host's process, however it ends (SIGKILL
//! included): a zygote gets a parent-death signal, and every zygote, spare and
//! worker holds the host's lifeline (`Lifeline`), which a worker watches
//! (zygote.py).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::protocol::{Conn, ConnError, Frame};
use crate::socket::{Hello, Listener, NoHello};

/// How long a zygote may take to import its packages and say hello.
const ZYGOTE_START: Duration = Duration::from_secs(180);
/// How long a fork and the worker's hello may take.
const FORK: Duration = Duration::from_secs(60);
/// Names the zygote's fd that holds the host's [`Lifeline`] (its stdin, 0).
const LIFELINE_ENV: &str = "LOOSELEAF_HOST_LIFELINE";

/// Why a worker could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    /// The zygote process could not be started.
    #[error("cannot start zygote ({python}): {reason}")]
    Spawn {
        /// The interpreter.
        python: String,
        /// Why.
        reason: String,
    },
    /// Talking to the zygote failed.
    #[error("zygote {id}: {source}")]
    Conn {
        /// Zygote id.
        id: String,
        /// What failed.
        source: ConnError,
    },
    /// The zygote could not fork.
    #[error("zygote could not fork worker {worker}: {reason}")]
    Fork {
        /// Worker id.
        worker: String,
        /// Why.
        reason: String,
    },
    /// The zygote or worker never connected.
    #[error(transparent)]
    NoHello(#[from] NoHello),
    /// The forked worker exited before it connected (it could not enter the
    /// session's working directory, say; the host's log has its last words).
    #[error("worker {worker} (pid {pid}) exited before it connected")]
    WorkerExited {
        /// Worker id.
        worker: String,
        /// Its pid.
        pid: u32,
    },
}

/// How zygote processes are started.
#[derive(Clone, Debug)]
pub struct ZygoteSpec {
    /// Interpreter.
    pub python: PathBuf,
    /// Directory holding `looseleaf_worker` (None: installed in `python`'s environment).
    pub worker_path: Option<PathBuf>,
    /// Packages the base zygote imports.
    pub packages: Vec<String>,
    /// The environment zygotes and their workers get (see [`crate::cell_env`]).
    pub env: std::collections::BTreeMap<String, String>,
    /// The cgroups a zygote puts each spare in ([`crate::cgroups::Cgroups::spare_spec`]).
    pub spare_cgroups: Option<String>,
}

/// A live zygote.
pub struct Zygote {
    /// Its id.
    pub id: String,
    /// Its pid.
    pub pid: u32,
    /// Packages it imported.
    pub packages: Vec<String>,
    /// Packages found to initialise CUDA.
    pub cuda_unsafe: Vec<String>,
    /// The interpreter's standard-library module names.
    pub stdlib: Vec<String>,
    /// Top-level modules already loaded in the zygote (its packages' dependencies
    /// and the worker runtime): never a reason for a child zygote.
    pub loaded: Vec<String>,
    conn: Conn,
    /// The process handle, for zygotes this host started (children of a zygote
    /// are not the host's children: they are killed by pid).
    process: Option<tokio::process::Child>,
}

impl Drop for Zygote {
    fn drop(&mut self) {
        if self.process.is_none() {
            crate::process::kill(self.pid);
        }
    }
}

/// A freshly forked worker's connection.
pub struct Forked {
    /// Worker id.
    pub id: String,
    /// Its pid.
    pub pid: u32,
    /// Its connection.
    pub conn: Conn,
}

/// The host's lifeline: a pipe whose write end only this process holds, and
/// never closes: the kernel closes it when the process exits, however it ends.
/// Every zygote gets the read end as its stdin, and every process a zygote forks
/// inherits it; a worker reads EOF from it once the host is gone, and kills its
/// cell with itself (zygote.py). A worker cannot die with its parent instead:
/// that is a zygote, which may go before it (an evicted child zygote), and a
/// parent-death signal is cleared when a worker takes a session's uid.
struct Lifeline {
    read: std::io::PipeReader,
    /// Held, never used: its end is the message.
    _write: std::io::PipeWriter,
}

/// This process's [`Lifeline`] (None if no pipe could be made: then a worker
/// busy with a cell outlives a host killed outright).
fn lifeline() -> Option<&'static Lifeline> {
    static LIFELINE: OnceLock<Option<Lifeline>> = OnceLock::new();
    LIFELINE
        .get_or_init(|| match std::io::pipe() {
            // both ends close on exec: no other program the host runs holds them
            Ok((read, write)) => Some(Lifeline { read, _write: write }),
            Err(e) => {
                tracing::warn!(error = %e, "no lifeline for workers: a host killed outright leaves busy workers behind");
                None
            }
        })
        .as_ref()
}

/// Work for the spawner thread.
type SpawnJob = Box<dyn FnOnce() + Send>;

/// Run `job` on a thread that lives as long as this process. A parent-death
/// signal fires when the *thread* that forked the child exits, not its process
/// (prctl(2)): a runtime's worker and blocking threads may come and go while the
/// host runs on, and a zygote forked from one would die with it.
fn on_lasting_thread(job: SpawnJob) -> Result<(), String> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        // the sender is never dropped (a static), so the loop never ends
        let started = std::thread::Builder::new().name("zygote-spawner".into()).spawn(move || {
            for job in rx {
                job();
            }
        });
        if let Err(e) = started {
            tracing::error!(error = %e, "no thread to start zygotes from");
        }
        tx
    });
    spawner.send(job).map_err(|_| "no thread to start zygotes from".to_string())
}

/// Have the child `command` starts get SIGKILL when this process exits. Call
/// [`Command::spawn`](tokio::process::Command::spawn) from [`on_lasting_thread`].
#[cfg(target_os = "linux")]
fn die_with_this_process(command: &mut tokio::process::Command) {
    let parent = nix::unistd::Pid::this();
    // SAFETY: the closure runs in the forked child before exec and makes only
    // async-signal-safe system calls (prctl, getppid); it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
            // the host died before the signal was set, which then never comes
            if nix::unistd::getppid() != parent {
                return Err(std::io::ErrorKind::Other.into());
            }
            Ok(())
        });
    }
}

/// Elsewhere a zygote notices the host's end by its connection closing.
#[cfg(not(target_os = "linux"))]
fn die_with_this_process(_command: &mut tokio::process::Command) {}

impl Zygote {
    /// Start a zygote and wait for its hello.
    pub async fn start(spec: &ZygoteSpec, id: &str, listener: &Listener) -> Result<Self, ZygoteError> {
        let spawn_error = |reason: String| ZygoteError::Spawn { python: spec.python.display().to_string(), reason };
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| spawn_error(e.to_string()))?;
        let rx = listener.expect(id);
        let mut pythonpath = std::ffi::OsString::new();
        for dir in spec.worker_path.iter().map(|p| p.as_os_str()) {
            pythonpath.push(dir);
        }
        if let Some(existing) = spec.env.get("PYTHONPATH") {
            if !pythonpath.is_empty() {
                pythonpath.push(":");
            }
            pythonpath.push(existing);
        }
        let mut command = tokio::process::Command::new(&spec.python);
        command
            .args(["-m", "looseleaf_worker.zygote", "--socket"])
            .arg(listener.path())
            .args(["--id", id, "--packages", &spec.packages.join(",")])
            .args(spec.spare_cgroups.iter().flat_map(|c| ["--cgroups", c.as_str()]))
            // never the host's whole environment: it holds the services' credentials
            .env_clear()
            .envs(&spec.env)
            .env("PYTHONPATH", pythonpath)
            // a zygote never touches a GPU; workers get their device at fork
            .env("CUDA_VISIBLE_DEVICES", "")
            .env("LOOSELEAF_VIRTUAL_DEVICES", "")
            // One string hash in every worker of every host: a set of strings is
            // restored in the order it iterated, which only holds where strings
            // hash alike (hash flooding is no threat a notebook's own cells pose).
            // An operator's value, passed through the allow-list, wins.
            .env("PYTHONHASHSEED", spec.env.get("PYTHONHASHSEED").map_or("0", String::as_str))
            // a group of its own: a Ctrl-C (or Jupyter's SIGINT to a kernel's group)
            // meant for the process that embeds the host never reaches the zygote;
            // the host stops it
            .process_group(0)
            .kill_on_drop(true);
        // its stdin is the host's lifeline (the zygote gives itself /dev/null again)
        match lifeline().map(|l| l.read.try_clone()) {
            Some(Ok(read)) => {
                command.stdin(Stdio::from(read)).env(LIFELINE_ENV, "0");
            }
            other => {
                if let Some(Err(e)) = other {
                    tracing::warn!(error = %e, zygote = id, "no lifeline for this zygote's workers");
                }
                command.stdin(Stdio::null()).env_remove(LIFELINE_ENV);
            }
        }
        die_with_this_process(&mut command);
        let (spawned_tx, spawned) = oneshot::channel();
        let spawn = move || {
            let _entered = runtime.enter();
            // a start given up meanwhile drops the child, which kills it
            let _ = spawned_tx.send(command.spawn());
        };
        if let Err(reason) = on_lasting_thread(Box::new(spawn)) {
            listener.forget(id);
            return Err(spawn_error(reason));
        }
        let child = match spawned.await {
            Ok(Ok(child)) => child,
            Ok(Err(e)) => {
                listener.forget(id);
                return Err(spawn_error(e.to_string()));
            }
            Err(_) => {
                listener.forget(id);
                return Err(spawn_error("the spawner thread is gone".into()));
            }
        };
        let hello = listener.wait(id, rx, ZYGOTE_START).await?;
        Self::from_hello(id, hello, Some(child))
    }

    fn from_hello(id: &str, hello: Hello, process: Option<tokio::process::Child>) -> Result<Self, ZygoteError> {
        let Frame::Hello { pid, packages, cuda_unsafe, import_ms, import_errors, stdlib, loaded, .. } = hello.frame
        else {
            return Err(NoHello { what: id.into(), timeout: ZYGOTE_START }.into());
        };
        tracing::info!(zygote = id, pid, ?packages, ?cuda_unsafe, ?import_errors, import_ms, "zygote ready");
        Ok(Self { id: id.to_string(), pid, packages, cuda_unsafe, stdlib, loaded, conn: hello.conn, process })
    }

    /// Ask this zygote to fork a child zygote that also imports `packages`; returns
    /// what to await for the child's hello (see [`Zygote::child_ready`]).
    pub async fn spawn_child(
        &mut self,
        listener: &Listener,
        child_id: &str,
        packages: Vec<String>,
    ) -> Result<oneshot::Receiver<Hello>, ZygoteError> {
        let rx = listener.expect(child_id);
        let frame = Frame::SpawnZygote { zygote_id: child_id.to_string(), packages };
        if let Err(source) = self.conn.send(&frame).await {
            listener.forget(child_id);
            return Err(ZygoteError::Conn { id: self.id.clone(), source });
        }
        Ok(rx)
    }

    /// Wait for a child zygote's hello (its tail imports may take seconds).
    pub async fn child_ready(
        listener: &Listener,
        child_id: &str,
        rx: oneshot::Receiver<Hello>,
    ) -> Result<Self, ZygoteError> {
        let hello = listener.wait(child_id, rx, ZYGOTE_START).await?;
        Self::from_hello(child_id, hello, None)
    }

    /// Fork a worker with `env` in `cwd` (as `uid`, if given), and wait for it to connect.
    pub async fn fork(
        &mut self,
        listener: &Listener,
        worker_id: &str,
        env: BTreeMap<String, String>,
        cwd: &str,
        uid: Option<u32>,
    ) -> Result<Forked, ZygoteError> {
        let rx = listener.expect(worker_id);
        let conn_err = |source| ZygoteError::Conn { id: self.id.clone(), source };
        let fork = Frame::Fork {
            worker_id: worker_id.to_string(),
            env,
            cwd: cwd.to_string(),
            socket: listener.path().display().to_string(),
            uid,
        };
        if let Err(e) = self.conn.send(&fork).await {
            listener.forget(worker_id);
            return Err(conn_err(e));
        }
        let pid = match self.conn.recv(FORK).await {
            Ok(Frame::Forked { pid, .. }) => pid,
            Ok(Frame::ForkFailed { error, .. }) => {
                listener.forget(worker_id);
                return Err(ZygoteError::Fork { worker: worker_id.into(), reason: error });
            }
            Ok(other) => {
                listener.forget(worker_id);
                return Err(ZygoteError::Fork {
                    worker: worker_id.into(),
                    reason: format!("zygote answered {}", other.kind()),
                });
            }
            Err(e) => {
                listener.forget(worker_id);
                return Err(conn_err(e));
            }
        };
        // a worker that dies before it connects is noticed at once, not after
        // FORK (the caller holds the zygote cache meanwhile)
        let exited = async {
            while crate::process::is_alive(pid) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let hello = tokio::select! {
            hello = listener.wait(worker_id, rx, FORK) => hello?,
            () = exited => {
                listener.forget(worker_id);
                return Err(ZygoteError::WorkerExited { worker: worker_id.into(), pid });
            }
        };
        let Frame::Hello { pid, .. } = hello.frame else {
            return Err(NoHello { what: worker_id.into(), timeout: FORK }.into());
        };
        Ok(Forked { id: worker_id.to_string(), pid, conn: hello.conn })
    }

    /// Ask the zygote to exit.
    pub async fn shutdown(mut self) {
        let _ = self.conn.send(&Frame::Shutdown {}).await;
    }
}
