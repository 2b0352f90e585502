//! What the tests that run Jupyter servers share (`tests/jupyterlab.rs`,
//! `tests/jupyterhub.rs`): a server stopped as its operator would, Chromium, and
//! LooseLeaf's JupyterLab extension installed from its wheel.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use crate::{repo_root, venv_python};

/// A server process, stopped on drop with SIGTERM (JupyterLab shuts its kernels
/// down, the Hub its users' servers and its proxy), killed if it lingers 20 s.
pub struct Terminated(pub Child);

impl Drop for Terminated {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0.id() as i32), nix::sys::signal::SIGTERM);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Debian's Chromium (scripts/setup-tests installs it).
pub fn chromium() -> anyhow::Result<PathBuf> {
    ["chromium", "chromium-browser"].iter().map(|b| Path::new("/usr/bin").join(b)).find(|p| p.exists()).ok_or_else(
        || anyhow::anyhow!("no Chromium in /usr/bin: run scripts/setup-tests (it installs Debian's chromium)"),
    )
}

/// The extension as a team installs it: its wheel (scripts/setup builds it)
/// pip-installed into the Jupyter prefix `prefix`.
pub fn install_extension(prefix: &Path) -> anyhow::Result<()> {
    let wheel = std::fs::read_dir(repo_root().join("jupyterlab/dist"))
        .ok()
        .into_iter()
        .flatten()
        .filter_map(|e| Some(e.ok()?.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| anyhow::anyhow!("the JupyterLab extension's wheel is not built: run scripts/setup"))?;
    let pip = Command::new(venv_python())
        // (--ignore-installed: scripts/setup installed it into the venv too)
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--ignore-installed"])
        .arg("--prefix")
        .arg(prefix)
        .arg(&wheel)
        .output()?;
    anyhow::ensure!(pip.status.success(), "pip install {}: {}", wheel.display(), String::from_utf8_lossy(&pip.stderr));
    let install_json = prefix.join("share/jupyter/labextensions/looseleaf-jupyterlab/install.json");
    anyhow::ensure!(install_json.exists(), "the wheel put no labextension into {}", prefix.display());
    Ok(())
}
