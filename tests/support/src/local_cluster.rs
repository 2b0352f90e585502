//! A user's local cluster (ADR 65) in a test's own folders: kernels started with
//! [`UserDirs::env`] share one cluster there, and it is stopped when the test ends.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The user folder and runtime folder of a test's local cluster.
pub struct UserDirs {
    path: PathBuf,
    /// Removed on drop, unless kept.
    dir: Option<tempfile::TempDir>,
}

impl UserDirs {
    pub fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        Ok(Self { path: dir.path().to_path_buf(), dir: Some(dir) })
    }

    /// The folder the test owns (a kernelspec prefix, work files).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Keep the folder after the test (for whoever reads its failure); the
    /// cluster is still stopped.
    pub fn keep(&mut self) -> PathBuf {
        if let Some(dir) = self.dir.take() {
            let _ = dir.keep();
        }
        self.path.clone()
    }

    /// `LOOSELEAF_USER_DIR`.
    pub fn user_dir(&self) -> PathBuf {
        self.path.join("user")
    }

    /// `LOOSELEAF_RUNTIME_DIR`.
    pub fn runtime_dir(&self) -> PathBuf {
        self.user_dir().join("run")
    }

    /// The environment that puts a kernel's local cluster here.
    pub fn env(&self) -> [(&'static str, PathBuf); 2] {
        [("LOOSELEAF_USER_DIR", self.user_dir()), ("LOOSELEAF_RUNTIME_DIR", self.runtime_dir())]
    }

    /// The running cluster's address file, parsed (None: none runs).
    pub fn address(&self) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(self.runtime_dir().join("cluster.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The running cluster's pid.
    pub fn pid(&self) -> Option<i32> {
        self.address()?.get("pid")?.as_i64().map(|p| p as i32)
    }

    /// Stop the cluster that runs here, if one does: SIGTERM, then after 20 s
    /// SIGKILL to its process group (its nats-server, zygotes and workers).
    pub fn stop_cluster(&self) {
        use nix::sys::signal::{kill, killpg, Signal};
        use nix::unistd::Pid;
        let Some(pid) = self.pid() else { return };
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if !alive(pid) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // the cluster leads its process group: whatever it left
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

impl Drop for UserDirs {
    fn drop(&mut self) {
        self.stop_cluster();
    }
}

/// Whether process `pid` runs (a zombie, whose parent has not reaped it, does not).
pub fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    match stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) {
        Some("Z" | "X") | None => false,
        Some(_) => true,
    }
}
