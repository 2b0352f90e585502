//! `looseleaf kernel install`: the kernelspec (`kernel.json`) that makes Jupyter
//! list the LooseLeaf kernel and start it as `looseleaf kernel -f CONNECTION_FILE`,
//! its logo (the launcher's card and the notebook's kernel icon), and the
//! kernelspec directory they are written into.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::{json, Value};

/// Which kernelspec directory `install` writes into.
#[derive(Clone, Debug)]
pub enum InstallPlace {
    /// The user's Jupyter data directory.
    User,
    /// The current Python environment's (`sys.prefix`).
    SysPrefix,
    /// `PREFIX/share/jupyter/kernels`.
    Prefix(PathBuf),
}

/// What `looseleaf kernel install` writes.
#[derive(Clone, Debug)]
pub struct Install {
    /// Where.
    pub place: InstallPlace,
    /// The kernel's name (its directory).
    pub name: String,
    /// The name Jupyter shows.
    pub display_name: String,
    /// The frontend the kernel uses (else it starts an embedded cluster).
    pub frontend: Option<String>,
    /// A file holding the frontend's token.
    pub token_file: Option<PathBuf>,
    /// The environment variable holding it when the kernel starts.
    pub token_env: Option<String>,
    /// Run every cell serverless.
    pub all_gpu: bool,
}

/// The kernelspec (`kernel.json`) that starts `exe` as a LooseLeaf kernel.
pub fn kernelspec(exe: &Path, install: &Install) -> Value {
    let mut argv = vec![exe.display().to_string(), "kernel".into(), "-f".into(), "{connection_file}".into()];
    if let Some(url) = &install.frontend {
        argv.extend(["--frontend".into(), url.clone()]);
    }
    if let Some(file) = &install.token_file {
        argv.extend(["--token-file".into(), file.display().to_string()]);
    }
    if let Some(var) = &install.token_env {
        argv.extend(["--token-env".into(), var.clone()]);
    }
    if install.all_gpu {
        argv.push("--all-gpu".into());
    }
    json!({
        "argv": argv,
        "display_name": install.display_name,
        "language": "python",
        "interrupt_mode": "message",
        "metadata": { "debugger": false, "looseleaf": { "all_gpu": install.all_gpu } },
    })
}

/// The kernel's logo, in the names Jupyter serves as a kernelspec's resources
/// (`/kernelspecs/NAME/logo-64x64.png`; JupyterLab prefers the SVG).
pub const LOGO: [(&str, &[u8]); 3] = [
    ("logo-svg.svg", include_bytes!("logo/logo-svg.svg")),
    ("logo-32x32.png", include_bytes!("logo/logo-32x32.png")),
    ("logo-64x64.png", include_bytes!("logo/logo-64x64.png")),
];

/// The Jupyter data directory of this user (`JUPYTER_DATA_DIR`, else XDG's).
fn user_data_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("JUPYTER_DATA_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME") {
        return Ok(PathBuf::from(dir).join("jupyter"));
    }
    let home = std::env::var_os("HOME").context("neither JUPYTER_DATA_DIR nor HOME is set")?;
    Ok(PathBuf::from(home).join(".local/share/jupyter"))
}

/// `sys.prefix` of the Python environment in use: the active virtual
/// environment, else `python3`'s.
fn sys_prefix() -> anyhow::Result<PathBuf> {
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        return Ok(PathBuf::from(venv));
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.prefix)"])
        .output()
        .context("--sys-prefix: could not run python3 to find sys.prefix")?;
    anyhow::ensure!(out.status.success(), "--sys-prefix: python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Write the kernelspec; returns its directory.
pub fn install(install: &Install) -> anyhow::Result<PathBuf> {
    anyhow::ensure!(
        !install.name.is_empty()
            && install.name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')),
        "kernel name {:?}: use letters, digits, '-', '_' and '.' (Jupyter's rule)",
        install.name
    );
    let kernels = match &install.place {
        InstallPlace::User => user_data_dir()?.join("kernels"),
        InstallPlace::SysPrefix => sys_prefix()?.join("share/jupyter/kernels"),
        InstallPlace::Prefix(p) => p.join("share/jupyter/kernels"),
    };
    let dir = kernels.join(&install.name);
    std::fs::create_dir_all(&dir).with_context(|| format!("while creating {}", dir.display()))?;
    let exe = std::env::current_exe().context("while finding the looseleaf binary")?;
    let exe = exe.canonicalize().unwrap_or(exe);
    let spec = serde_json::to_string_pretty(&kernelspec(&exe, install))?;
    let file = dir.join("kernel.json");
    std::fs::write(&file, spec + "\n").with_context(|| format!("while writing {}", file.display()))?;
    for (name, bytes) in LOGO {
        let file = dir.join(name);
        std::fs::write(&file, bytes).with_context(|| format!("while writing {}", file.display()))?;
    }
    Ok(dir)
}
