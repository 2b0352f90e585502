//! JupyterLab in a real browser (the Kernel issue): the test starts JupyterLab
//! with the LooseLeaf kernelspec installed, and headless Chromium, driven by
//! Playwright (`tests/browser/jupyterlab.mjs`), opens a corpus notebook, chooses
//! the LooseLeaf kernel in the kernel dialog, runs all cells, sees the plots
//! rendered, interrupts a looping cell from the toolbar (its state before the
//! interrupt stays), moves an ipywidgets slider with the keyboard and reads its
//! value back in a later cell, and restarts the kernel (a fresh session); the
//! launcher shows the kernel's logo. With the LooseLeaf extension installed from
//! its wheel, a GPU cell typed a character at a time runs on
//! the worker prepared while it was typed, and its badge says so. Last, Jupyter
//! Server culls the idle kernel, and the notebook opened again has its variables
//! (the Lossless-sessions issue).
//! scripts/setup installs JupyterLab; scripts/setup-tests Chromium and playwright-core.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use looseleaf_test_support::jupyter::{chromium, install_extension, Terminated};
use looseleaf_test_support::{copy_dir, free_port, repo_root, venv_python, wait_for};
use serde_json::json;

const NOTEBOOK: &str = "pdsh_04.01-Simple-Line-Plots.ipynb";

fn venv_bin() -> std::path::PathBuf {
    venv_python().parent().map(Path::to_path_buf).unwrap_or_default()
}

#[test]
fn jupyterlab_in_a_browser_runs_interrupts_and_restarts_a_notebook_on_looseleaf() -> anyhow::Result<()> {
    let chromium = chromium()?;
    let driver = repo_root().join("tests/browser/jupyterlab.mjs");
    anyhow::ensure!(
        repo_root().join("tests/browser/node_modules/playwright-core").exists(),
        "playwright-core is not installed: run scripts/setup-tests"
    );
    // the kernels' local cluster, stopped after JupyterLab (declared before it)
    let mut dir = looseleaf_test_support::local_cluster::UserDirs::new()?;
    let (root, prefix, state, shots) =
        (dir.path().join("root"), dir.path().join("prefix"), dir.path().join("state"), dir.path().join("shots"));
    for d in [&root, &state, &shots] {
        std::fs::create_dir_all(d)?;
    }
    std::fs::copy(repo_root().join("../shared/corpus").join(NOTEBOOK), root.join(NOTEBOOK))?;
    let installed = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["kernel", "install", "--prefix"])
        .arg(&prefix)
        .args(["--name", "looseleaf-lab", "--display-name", "LooseLeaf (lab test)"])
        .status()?;
    anyhow::ensure!(installed.success(), "looseleaf kernel install failed");
    // the LooseLeaf extension as a team installs it: its wheel, into the Jupyter
    // prefix this JupyterLab looks in
    install_extension(&prefix)?;

    let port = free_port()?;
    let token = uuid::Uuid::new_v4().simple().to_string();
    let path = format!("{}:{}", venv_bin().display(), std::env::var("PATH").unwrap_or_default());
    let log = std::fs::File::create(dir.path().join("lab.log"))?;
    let _lab = Terminated(
        Command::new(venv_bin().join("jupyter"))
            .args(["lab", "--no-browser", "--allow-root", "--ip=127.0.0.1"])
            .arg(format!("--port={port}"))
            .arg(format!("--ServerApp.token={token}"))
            .arg(format!("--ServerApp.root_dir={}", root.display()))
            // the driver reaches JupyterLab's commands and models, as Galata does
            .arg("--LabApp.expose_app_in_browser=True")
            // Jupyter's culler, as hubs run it (an hour there): the last step
            // waits for it, then opens the notebook again
            .arg("--MappingKernelManager.cull_idle_timeout=20")
            .arg("--MappingKernelManager.cull_interval=5")
            .env("PATH", &path)
            .env("JUPYTER_PATH", prefix.join("share/jupyter"))
            // a fresh user: no settings or workspace of this machine's
            .env("JUPYTER_CONFIG_DIR", state.join("config"))
            .env("JUPYTER_DATA_DIR", state.join("data"))
            .env("JUPYTER_RUNTIME_DIR", state.join("runtime"))
            .env("JUPYTERLAB_SETTINGS_DIR", state.join("settings"))
            .env("JUPYTERLAB_WORKSPACES_DIR", state.join("workspaces"))
            .envs(dir.env())
            .current_dir(&root)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?,
    );
    wait_for(Duration::from_secs(120), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())?;

    let out = Command::new("node")
        .arg(&driver)
        .env("LAB_URL", format!("http://127.0.0.1:{port}"))
        .env("LAB_TOKEN", &token)
        .env("NOTEBOOK", NOTEBOOK)
        .env("KERNEL_NAME", "looseleaf-lab")
        .env("KERNEL_DISPLAY", "LooseLeaf (lab test)")
        .env("CHROMIUM", &chromium)
        .env("OUT", &shots)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        let lab_log = std::fs::read_to_string(dir.path().join("lab.log")).unwrap_or_default();
        let kept = dir.keep(); // the screenshots, for whoever reads the failure
        anyhow::bail!(
            "the browser driver failed (screenshots in {}):\n{}\n--- JupyterLab's log (tail) ---\n{}",
            kept.join("shots").display(),
            String::from_utf8_lossy(&out.stderr),
            lab_log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    // LOOSELEAF_TEST_SHOTS=DIR keeps the screenshots (badges, side panel) to look at
    if let Some(keep) = std::env::var_os("LOOSELEAF_TEST_SHOTS") {
        copy_dir(&shots, Path::new(&keep))?;
    }
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    eprintln!("{seen}");
    assert_eq!(seen["kernel"], "looseleaf-lab", "{seen}");
    // the kernel's logo on the launcher: the kernelspec's, drawn
    let logo = &seen["launcher_logo"];
    assert!(logo["src"].as_str().is_some_and(|s| s.contains("/kernelspecs/looseleaf-lab/logo")), "{seen}");
    assert!(logo["width"].as_u64().is_some_and(|w| w > 0), "{seen}");
    let code_cells = seen["code_cells"].as_u64().unwrap_or(0);
    assert!(code_cells >= 10, "{seen}");
    assert_eq!(seen["executed"], code_cells, "every code cell ran: {seen}");
    assert_eq!(seen["errors"], serde_json::json!([]), "{seen}");
    // the notebook's plots came back as PNGs and the browser drew them (those
    // JupyterLab rendered: it may leave cells far off screen unrendered)
    assert!(seen["png_outputs"].as_u64().unwrap_or(0) >= 10, "{seen}");
    assert!(seen["images_rendered"].as_u64().unwrap_or(0) >= 1, "{seen}");
    assert_eq!(seen["interrupted"], serde_json::json!(["KeyboardInterrupt"]), "{seen}");
    assert_eq!(seen["after_interrupt"], "1\n", "{seen}");
    assert!(seen["slider_drawn"].as_u64().unwrap_or(0) >= 1, "{seen}");
    assert_eq!(seen["slider_value"], "5\n", "the slider's value moved in the browser: {seen}");
    assert_eq!(seen["after_restart"], "NameError", "{seen}");
    // culled by Jupyter Server and opened again: the new kernel resumed the
    // notebook's session, said so, and the variable is there
    assert_eq!(seen["culled"], true, "{seen}");
    let after_cull = seen["after_cull"].as_str().unwrap_or_default();
    assert!(after_cull.starts_with("LooseLeaf: resumed") && after_cull.ends_with("42\n"), "{seen}");
    // the extension: a GPU cell typed at 20 characters a second ran on the worker
    // prepared while it was typed, and its badge says so
    assert_eq!(seen["typed_source_equal"], true, "the typed text is not the cell's source: {seen}");
    assert_eq!(seen["typed_output"], "2000\n", "{seen}");
    assert_eq!(seen["typed_badge"]["prepare"], "speculative", "{seen}");
    assert_eq!(seen["typed_badge"]["device"], "gpu", "{seen}");
    assert!(seen["typed_badge"]["text"].as_str().is_some_and(|t| t.starts_with("GPU · prepared")), "{seen}");
    // and what its run cost: the GPU-slot seconds its slot was held
    let costed = &seen["typed_cost_badge"];
    let cost: serde_json::Value = serde_json::from_str(costed["cost"].as_str().unwrap_or("{}"))?;
    assert_eq!(cost["device"], "gpu", "{seen}");
    assert!(cost["gpu_seconds"].as_f64().is_some_and(|s| s > 0.0), "{seen}");
    assert!(
        costed["text"].as_str().is_some_and(|t| t.starts_with("GPU · prepared") && t.ends_with(" GPU-s")),
        "{seen}"
    );
    assert!(costed["title"].as_str().is_some_and(|t| t.contains("Last run cost")), "{seen}");
    // before Run, the badge followed the worker: planned on a GPU, preparing, ready
    // on a host; after it, running and saved
    let ready = &seen["typed_ready_badge"];
    // for the text as typed: the closure the run used (`x`)
    assert_eq!(ready["text"], json!("GPU · 1 var · ready on host-0"), "{seen}");
    let live: serde_json::Value = serde_json::from_str(ready["live"].as_str().unwrap_or("{}"))?;
    assert_eq!(live["closure"], 1, "{seen}");
    assert_eq!((&ready["device"], &ready["state"]), (&json!("gpu"), &json!("ready")), "{seen}");
    // (on the host's CPU: a prepared worker takes its GPU slot at Run, ADR 9)
    assert!(ready["text"].as_str().is_some_and(|t| t.contains("ready on host-0")), "{seen}");
    let states: Vec<&str> = seen["typed_states"].as_array().into_iter().flatten().filter_map(|s| s.as_str()).collect();
    let order = ["planned", "preparing", "ready", "running", "saved"];
    let at = |s: &str| states.iter().position(|x| *x == s);
    assert!(order.iter().all(|s| at(s).is_some()), "states {states:?}: {seen}");
    assert!(order.windows(2).all(|w| at(w[0]) < at(w[1])), "states out of order {states:?}: {seen}");
    // edited into a CPU cell: the badge says CPU, its prepared worker released,
    // and it runs on the session's CPU worker
    assert_eq!(seen["before_cpu_badge"]["device"], "gpu", "{seen}");
    assert_eq!(
        (&seen["cpu_badge"]["device"], &seen["cpu_badge"]["state"]),
        (&json!("cpu"), &json!("released")),
        "{seen}"
    );
    assert!(seen["cpu_badge"]["text"].as_str().is_some_and(|t| t.starts_with("CPU")), "{seen}");
    assert!(seen["cpu_badge"]["text"].as_str().is_some_and(|t| t.contains("released (superseded)")), "{seen}");
    assert_eq!(seen["cpu_output"], "3000\n", "{seen}");
    assert_eq!(seen["cpu_ran_badge"]["device"], "cpu", "{seen}");
    // the side panel: this session's GPU time against a pinned GPU's, and its hit rate
    let panel = &seen["panel"];
    let number = |key: &str| panel[key].as_str().and_then(|v| v.split(' ').next()?.parse::<f64>().ok());
    assert!(number("gpu-slot-seconds").is_some_and(|s| s > 0.0), "{seen}");
    assert!(number("pinned-gpu-seconds").is_some_and(|p| p > number("gpu-slot-seconds").unwrap_or(f64::MAX)), "{seen}");
    assert!(number("cells").is_some_and(|c| c >= 10.0), "{seen}");
    assert!(panel["hit-rate"].as_str().is_some_and(|h| h.ends_with('%')), "{seen}");
    // its Undo button took back the last cell: `later` is gone, `x` stays
    assert!(seen["panel_undo"].as_str().is_some_and(|u| u.starts_with("LooseLeaf: undone")), "{seen}");
    assert_eq!(seen["after_panel_undo"], "False 1000\n", "{seen}");
    // pinned to GPU from its badge: in the cell's metadata, and run on a GPU
    assert_eq!(seen["pin_metadata"], serde_json::json!({"device": "gpu"}), "{seen}");
    assert_eq!(seen["pinned_output"], "1001\n", "{seen}");
    assert_eq!(seen["pinned_badge"]["device"], "gpu", "{seen}");
    assert!(seen["pinned_badge"]["text"].as_str().is_some_and(|t| t.starts_with("pinned GPU · GPU")), "{seen}");
    Ok(())
}
