//! LooseLeaf installed as operators install it (ADR 36): no binary holds a path of
//! the build tree, and the worker runtime is a package (services/gpu-host/python's
//! pyproject.toml) that a user installs into an environment of their own (here with
//! scripts/install-worker-env, as the Dockerfile does); a
//! `looseleaf` copied out of the checkout runs cells from that package, found
//! through `--python` alone, and a Python without it is refused with a message
//! that says what to install.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use looseleaf_test_support::cluster::bin_dir_of;
use looseleaf_test_support::repo_root;

const BINARIES: &[&str] =
    &["looseleaf", "looseleaf-frontend", "looseleaf-gpu-host", "looseleaf-planner", "looseleaf-store"];

fn run(cmd: &mut Command) -> anyhow::Result<Output> {
    let out = cmd.stdin(Stdio::null()).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

#[test]
fn no_binary_holds_a_path_of_the_build_tree() -> anyhow::Result<()> {
    let bin_dir = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let root = repo_root().display().to_string();
    for name in BINARIES {
        let bytes = std::fs::read(bin_dir.join(name))?;
        let found = bytes.windows(root.len()).any(|w| w == root.as_bytes());
        assert!(!found, "{name} holds the build tree's path {root}");
    }
    Ok(())
}

/// A notebook of `cells`, written to `dir`.
fn notebook(dir: &Path, cells: &[&str]) -> anyhow::Result<PathBuf> {
    let cells: Vec<serde_json::Value> = cells
        .iter()
        .map(|src| serde_json::json!({"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": null}))
        .collect();
    let path = dir.join("nb.ipynb");
    std::fs::write(
        &path,
        serde_json::json!({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 4}).to_string(),
    )?;
    Ok(path)
}

/// The looseleaf binary copied out of the checkout, run with only `python` to find
/// the worker runtime by (no checkout, no `LOOSELEAF_*` settings).
fn looseleaf_outside(exe: &Path, python: &Path, nb: &Path) -> anyhow::Result<Output> {
    let mut cmd = Command::new(exe);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("LOOSELEAF_")) {
        cmd.env_remove(k);
    }
    let nats = schemas::locate::nats_server(None);
    cmd.args(["run", "--virtual-gpus", "1", "--python"]).arg(python).arg("--nats-server").arg(nats).arg(nb);
    Ok(cmd.stdin(Stdio::null()).output()?)
}

#[test]
fn the_worker_runtime_installs_as_a_package_and_cells_run_from_it() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let t = tmp.path();
    // a user's environment, made as the Dockerfile makes the image's (without torch:
    // no GPU here): a fresh venv with the package and the libraries zygotes import
    let env = t.join("env");
    run(Command::new(repo_root().join("scripts/install-worker-env")).arg(&env).args(["--torch", "none"]))?;
    let python = env.join("bin/python");
    let out = run(Command::new(&python).args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]))?;
    let site = String::from_utf8_lossy(&out.stdout).trim().to_string();

    // looseleaf out of the checkout: cells run from the installed package
    let exe = t.join("bin/looseleaf");
    std::fs::create_dir_all(t.join("bin"))?;
    std::fs::copy(env!("CARGO_BIN_EXE_looseleaf"), &exe)?;
    let nb = notebook(t, &["import looseleaf_worker\nprint(looseleaf_worker.__file__)", "x = 6 * 7\nprint(x)"])?;
    let out = looseleaf_outside(&exe, &python, &nb)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let executed: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(t.join("nb.looseleaf.ipynb"))?)?;
    let text = |i: usize| executed["cells"][i]["outputs"][0]["text"].as_str().unwrap_or_default().to_string();
    assert!(text(0).starts_with(&site), "the worker runtime came from {} (not {site})", text(0));
    assert_eq!(text(1), "42\n");

    // a Python without the package is refused at start, saying what to install
    let bare = t.join("bare");
    run(Command::new("python3").args(["-m", "venv", "--without-pip"]).arg(&bare))?;
    let out = looseleaf_outside(&exe, &bare.join("bin/python"), &nb)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("cannot import the worker runtime") && stderr.contains("pip install"), "{stderr}");
    Ok(())
}
