//! Where a LooseLeaf process finds its pieces (the Python that runs zygotes and
//! workers, the worker runtime, nats-server) with no path of the build tree baked
//! into any binary (ADR 36). In order: an explicit flag or variable; else the
//! development checkout the binary lies in, found from the binary's own location
//! (so `cargo build` and a run from the checkout need no setting); else what is
//! installed: `python3` and `nats-server` on PATH, and the `looseleaf_worker`
//! package in that Python (`pip install` of `services/gpu-host/python`).

use std::path::{Path, PathBuf};

/// The worker runtime's directory in a checkout (the package's parent).
const WORKER_DIR: &str = "services/gpu-host/python";

/// The LooseLeaf checkout the running binary was built in, if it still lies there
/// (`target/release/looseleaf`, or `target/release/deps/…` for a test).
pub fn checkout() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .skip(1)
        .take(4)
        .find(|dir| dir.join(WORKER_DIR).join("looseleaf_worker/__init__.py").is_file())
        .map(Path::to_path_buf)
}

/// The Python interpreter for zygotes and workers: `explicit`, else the
/// checkout's `.venv` (made by scripts/setup), else `python3` on PATH.
pub fn python(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    checkout().map(|c| c.join(".venv/bin/python")).filter(|p| p.exists()).unwrap_or_else(|| PathBuf::from("python3"))
}

/// The directory to put on workers' `PYTHONPATH` for the worker runtime:
/// `explicit`, else the checkout's (its edits apply without reinstalling), else
/// None: the `looseleaf_worker` package installed in the workers' Python.
pub fn worker_path(explicit: Option<&Path>) -> Option<PathBuf> {
    explicit.map(Path::to_path_buf).or_else(|| checkout().map(|c| c.join(WORKER_DIR)))
}

/// The nats-server binary: `explicit`, else `LOOSELEAF_NATS_SERVER`, else the one
/// scripts/setup put in the checkout's `.venv/bin`, else the first on PATH.
pub fn nats_server(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os("LOOSELEAF_NATS_SERVER") {
        return PathBuf::from(p);
    }
    checkout()
        .map(|c| c.join(".venv/bin/nats-server"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

/// The version of the worker protocol (`worker-protocol.json`'s `version`) this
/// build's hosts speak.
pub const WORKER_PROTOCOL_VERSION: u32 = 2;

/// Whether `python` can import the worker runtime with `worker_path` on its path,
/// and it speaks this host's worker protocol; the error says what to install
/// where. Bounded, so a broken interpreter cannot hang a host's start.
pub async fn check_worker_runtime(python: &Path, worker_path: Option<&Path>) -> Result<(), String> {
    let mut cmd = tokio::process::Command::new(python);
    // the zygote module: it loads the protocol contract and the runtime's imports
    let probe = "import looseleaf_worker.zygote\nfrom looseleaf_worker import protocol\nprint(protocol.VERSION)";
    cmd.args(["-c", probe]).stdin(std::process::Stdio::null()).kill_on_drop(true);
    if let Some(dir) = worker_path {
        cmd.env("PYTHONPATH", dir);
    }
    let shown = python.display();
    match tokio::time::timeout(std::time::Duration::from_secs(60), cmd.output()).await {
        Err(_) => Err(format!("{shown} did not import the worker runtime within 60 s")),
        Ok(Err(e)) => Err(format!("cannot run the workers' Python {shown}: {e} (give it with --python)")),
        Ok(Ok(out)) if out.status.success() => {
            let spoken = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if spoken == WORKER_PROTOCOL_VERSION.to_string() {
                return Ok(());
            }
            Err(format!(
                "{shown}'s worker runtime speaks worker protocol {spoken:?}, this host {WORKER_PROTOCOL_VERSION}: \
                 install the runtime of this LooseLeaf version (`pip install services/gpu-host/python`) or give --worker-path"
            ))
        }
        Ok(Ok(out)) => {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or("").trim().to_string();
            Err(match worker_path {
                Some(dir) => format!("{shown} cannot import the worker runtime from {}: {last}", dir.display()),
                None => format!(
                    "{shown} cannot import the worker runtime ({last}): install it into that environment \
                     (`pip install services/gpu-host/python` from a LooseLeaf checkout) or give --worker-path"
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime of another protocol version is refused with both versions named;
    /// one of this version is taken.
    #[tokio::test]
    async fn a_worker_runtime_of_another_protocol_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let package = dir.path().join("looseleaf_worker");
        std::fs::create_dir(&package).unwrap();
        std::fs::write(package.join("__init__.py"), "").unwrap();
        std::fs::write(package.join("zygote.py"), "").unwrap();
        let python = Path::new("python3");
        std::fs::write(package.join("protocol.py"), "VERSION = 1\n").unwrap();
        let err = check_worker_runtime(python, Some(dir.path())).await.unwrap_err();
        assert!(err.contains("worker protocol \"1\"") && err.contains(&WORKER_PROTOCOL_VERSION.to_string()), "{err}");
        std::fs::write(package.join("protocol.py"), format!("VERSION = {WORKER_PROTOCOL_VERSION}\n")).unwrap();
        assert_eq!(check_worker_runtime(python, Some(dir.path())).await, Ok(()));
    }
}
