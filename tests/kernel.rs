//! The Jupyter kernel (ADR 31) as Jupyter clients use it: `looseleaf kernel
//! install` writes a kernelspec Jupyter finds; jupyter_client starts it (with an
//! embedded cluster), executes cells and reads their outputs, is told
//! complete/incomplete code apart, interrupts a looping cell (its state before
//! the interrupt stays) and restarts it (a fresh session); the Jupyter project's
//! conformance suite (jupyter_kernel_test) passes; nbclient runs corpus notebooks
//! (a pdsh one, a torch one, fidelity/displays) through it with every cell
//! serverless, and nbequiv finds them equal to a plain kernel; papermill runs a
//! parameterised notebook through it.

use std::path::Path;
use std::process::Command;

use looseleaf_test_support::local_cluster::UserDirs;
use looseleaf_test_support::{copy_dir, repo_root, venv_python};

fn install(prefix: &Path) -> anyhow::Result<()> {
    install_as(prefix, &["--name", "looseleaf-test", "--all-gpu"])
}

pub(crate) fn install_as(prefix: &Path, args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["kernel", "install", "--prefix"])
        .arg(prefix)
        .args(args)
        .status()?;
    anyhow::ensure!(status.success(), "looseleaf kernel install failed");
    Ok(())
}

/// `python` with the venv's bin first on PATH and Jupyter looking in `prefix`;
/// the kernels it starts share one local cluster in `prefix`'s user folder (the
/// test's [`UserDirs`] stops it).
pub(crate) fn python(prefix: &Path) -> Command {
    let mut cmd = Command::new(venv_python());
    let venv_bin = venv_python().parent().map(Path::to_path_buf).unwrap_or_default();
    let path = format!("{}:{}", venv_bin.display(), std::env::var("PATH").unwrap_or_default());
    cmd.env("JUPYTER_PATH", prefix.join("share/jupyter")).env("PATH", path);
    cmd.env("LOOSELEAF_USER_DIR", prefix.join("user")).env("LOOSELEAF_RUNTIME_DIR", prefix.join("user/run"));
    cmd
}

#[test]
fn jupyter_clients_run_cells_interrupt_and_restart_through_the_kernel() -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    install(prefix.path())?;
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        prefix.path().join("share/jupyter/kernels/looseleaf-test/kernel.json"),
    )?)?;
    assert_eq!(spec["interrupt_mode"], "message");
    assert!(spec["argv"].as_array().is_some_and(|a| a.iter().any(|x| x == "{connection_file}")), "{spec}");

    let listed = python(prefix.path()).args(["-m", "jupyter_client.kernelspecapp", "list", "--json"]).output()?;
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout)?;
    assert!(listed["kernelspecs"]["looseleaf-test"].is_object(), "jupyter does not list the kernel: {listed}");
    // its logo, which Jupyter serves to the launcher from the kernelspec's directory
    let dir = Path::new(listed["kernelspecs"]["looseleaf-test"]["resource_dir"].as_str().unwrap_or_default());
    for logo in ["logo-svg.svg", "logo-32x32.png", "logo-64x64.png"] {
        let bytes = std::fs::read(dir.join(logo)).unwrap_or_default();
        let is_image = bytes.starts_with(b"\x89PNG") || bytes.starts_with(b"<svg");
        assert!(is_image, "the kernelspec has no {logo} in {}", dir.display());
    }

    let work = tempfile::tempdir()?;
    let out = python(prefix.path())
        .arg(repo_root().join("tests/support/kernel_probe.py"))
        .arg("looseleaf-test")
        .current_dir(work.path())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "kernel_probe.py failed:\n{stderr}");
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    eprintln!("{seen}");
    assert_eq!(seen["language"], "python");
    assert_eq!(seen["print"], "42\n82");
    assert_eq!(seen["reply_count"], 2);
    assert_eq!(seen["execute_result_count"], serde_json::json!([2]));
    assert_eq!(seen["execute_input"], serde_json::json!(["print(x + 1)\nx * 2"]));
    // an empty cell counts nothing, as in IPython: `x` after it is Out[3], and kept so
    assert_eq!(seen["empty_cell"], serde_json::json!(["ok", 2, 3, [3], "[2, 3]\n"]), "{seen}");
    assert_eq!(
        seen["user_expressions"],
        serde_json::json!({"double": "10", "prev": "42", "missing": "NameError"}),
        "{seen}"
    );
    assert_eq!(seen["error"], serde_json::json!(["error", "ZeroDivisionError"]));
    assert_eq!(seen["error_output"], serde_json::json!(["ZeroDivisionError"]));
    assert_eq!(seen["clear_output"], serde_json::json!(["stream", "clear_output", "stream"]));
    assert_eq!(seen["is_complete"], "incomplete");
    assert_eq!(seen["stdin_asked"], serde_json::json!([["name? ", false, true], ["pw: ", true, true]]));
    assert_eq!(seen["stdin_answered"], serde_json::json!(["ok", "asking\nAda 6\n"]));
    assert_eq!(
        seen["no_stdin"],
        serde_json::json!([
            "error",
            "StdinNotImplementedError",
            "raw_input was called, but this frontend does not support input requests."
        ])
    );
    assert_eq!(seen["stdin_interrupted"], serde_json::json!(["error", "KeyboardInterrupt"]));
    assert_eq!(seen["after_stdin_interrupt"], "5\n");
    assert_eq!(seen["interrupted"], serde_json::json!(["error", "KeyboardInterrupt"]));
    assert_eq!(seen["after_interrupt"], "41 1\n");
    assert_eq!(seen["sigint"], serde_json::json!(["error", "KeyboardInterrupt"]));
    assert_eq!(seen["after_restart"], serde_json::json!(["error", "NameError"]));
    Ok(())
}

/// A kernel whose CPU cells run on the session's CPU worker answers completion
/// and inspection from that worker's live objects.
#[test]
fn completion_and_inspection_come_from_the_sessions_live_objects() -> anyhow::Result<()> {
    completes_and_inspects(&["--name", "looseleaf-cpu"])
}

/// With every cell serverless there is no CPU worker: the kernel infers from the
/// session's code (jedi on the cells it ran), with the same answers here.
#[test]
fn completion_and_inspection_without_a_cpu_worker_come_from_the_sessions_code() -> anyhow::Result<()> {
    completes_and_inspects(&["--name", "looseleaf-all-gpu", "--all-gpu"])
}

fn completes_and_inspects(install_args: &[&str]) -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    install_as(prefix.path(), install_args)?;
    let work = tempfile::tempdir()?;
    let out = python(prefix.path())
        .arg(repo_root().join("tests/support/kernel_probe.py"))
        .args([install_args[1], "--complete"])
        .current_dir(work.path())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "kernel_probe.py --complete failed:\n{stderr}");
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    assert_eq!(seen["names"], serde_json::json!(["my_table", "my_tally"]), "{seen}");
    assert_eq!(seen["names_at"], serde_json::json!([4, 9]), "{seen}");
    assert_eq!(seen["attrs"], serde_json::json!(["move_to_end"]), "{seen}");
    assert_eq!(seen["attrs_start"], true, "{seen}");
    assert_eq!(seen["found"], serde_json::json!(["ok", true, true]), "{seen}");
    assert_eq!(seen["missing"], serde_json::json!(["ok", false]), "{seen}");
    Ok(())
}

#[test]
fn edits_streamed_on_the_kernel_comm_prepare_the_worker_that_runs_the_cell() -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    install_as(prefix.path(), &["--name", "looseleaf-edits", "--all-gpu"])?;
    let work = tempfile::tempdir()?;
    let out = python(prefix.path())
        .arg(repo_root().join("tests/support/kernel_probe.py"))
        .args(["looseleaf-edits", "--edits"])
        .current_dir(work.path())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "kernel_probe.py --edits failed:\n{stderr}");
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    // the kernel keeps the comm (no comm_close, as for a target no worker has), and
    // says at once what the session has used so far (the side panel's totals)
    let opened: Vec<&serde_json::Value> = seen["opened"].as_array().into_iter().flatten().collect();
    assert!(opened.iter().all(|m| m[0] == "comm_msg"), "{seen}");
    assert!(opened.iter().any(|m| m[1]["data"]["action"] == "session"), "{seen}");
    assert_eq!(seen["bad"], serde_json::json!([]), "a malformed edit is dropped quietly: {seen}");
    assert_eq!(seen["typed_output"], "10\n", "{seen}");
    let typed = &seen["typed"];
    assert_eq!(typed["prepare"], "speculative", "the typed cell did not run on its prepared worker: {seen}");
    assert_eq!(typed["device"], "gpu", "{seen}");
    assert_eq!(typed["closure"], 1, "{seen}");
    assert!(typed["start_delay_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{seen}");
    assert!(typed["host"].as_str().is_some_and(|h| !h.is_empty()), "{seen}");
    assert_eq!(seen["cold"]["prepare"], "cold", "{seen}");
    // pinned to CPU on the comm: runs there; the cell's own line wins; unpinned: GPU again
    assert_eq!(seen["pinned"]["device"], "cpu", "{seen}");
    assert_eq!(seen["pinned"]["device_reason"], "override %%cpu", "{seen}");
    assert_eq!(seen["pinned_output"], "8\n", "{seen}");
    assert_eq!(seen["own_line"]["device"], "gpu", "{seen}");
    assert_eq!(seen["unpinned"]["device"], "gpu", "{seen}");
    Ok(())
}

#[test]
fn a_slider_moved_in_the_browser_is_read_back_in_a_later_cell() -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    install_as(prefix.path(), &["--name", "looseleaf-widgets"])?;
    let work = tempfile::tempdir()?;
    let out = python(prefix.path())
        .arg(repo_root().join("tests/support/kernel_probe.py"))
        .args(["looseleaf-widgets", "--widgets"])
        .current_dir(work.path())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "kernel_probe.py --widgets failed:\n{stderr}");
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    assert_eq!(seen["cpu_shown"], true, "{seen}");
    assert_eq!(seen["comm_info"], serde_json::json!({"target_name": "jupyter.widget"}), "{seen}");
    assert_eq!(seen["observer"], "now 7\n", "{seen}");
    assert_eq!(seen["cpu_read_back"], "7\n", "{seen}");
    assert_eq!(seen["gpu_shown"], true, "{seen}");
    assert_eq!(seen["gpu_read_back"], "6 True\n", "{seen}");
    assert_eq!(seen["gpu_reopened"], serde_json::json!([]), "{seen}");
    assert_eq!(seen["gpu_moved"], "11\n", "{seen}");
    assert_eq!(seen["unknown_target"], serde_json::json!([["comm_close", "c0ffee"]]), "{seen}");
    Ok(())
}

#[test]
fn nbclient_runs_corpus_notebooks_through_the_kernel_as_a_plain_kernel_would() -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    install(prefix.path())?;
    // a copy: the notebooks write files, and the corpus test copies the corpus meanwhile
    let corpus = prefix.path().join("corpus");
    copy_dir(&repo_root().join("../shared/corpus"), &corpus)?;
    // a pdsh one, a torch one, and ipykernel's display semantics
    for notebook in [
        "pdsh_02.02-The-Basics-Of-NumPy-Arrays.ipynb",
        "torch/mrdbourke_01_pytorch_workflow.ipynb",
        "fidelity/displays/training_displays.ipynb",
    ] {
        let notebook = corpus.join(notebook);
        let folder = notebook.parent().map(Path::to_path_buf).unwrap_or_else(|| corpus.clone());
        let executed = prefix.path().join("executed.ipynb");
        let script = "import sys, nbformat\nfrom nbclient import NotebookClient\n\
                      nb = nbformat.read(sys.argv[1], as_version=4)\n\
                      NotebookClient(nb, kernel_name='looseleaf-test', timeout=600, startup_timeout=300,\n\
                          resources={'metadata': {'path': sys.argv[3]}}).execute()\n\
                      nbformat.write(nb, sys.argv[2])\n";
        let status = python(prefix.path())
            .args(["-c", script])
            .arg(&notebook)
            .arg(&executed)
            .arg(&folder)
            .env("LOOSELEAF_LOG", "error")
            .status()?;
        anyhow::ensure!(status.success(), "nbclient could not run {} through the kernel", notebook.display());
        let (same, text) = nbequiv(&notebook, &executed, &folder, prefix.path())?;
        assert!(same, "nbequiv finds {} different through the kernel: {text}", notebook.display());
    }
    Ok(())
}

/// nbequiv on `executed` against a plain kernel's run of `notebook` in `folder`
/// (its verdict written under `scratch`): (equal, the verdict's JSON).
pub(crate) fn nbequiv(
    notebook: &Path,
    executed: &Path,
    folder: &Path,
    scratch: &Path,
) -> anyhow::Result<(bool, String)> {
    let verdict = scratch.join("verdict.json");
    let status = Command::new(venv_python())
        .arg(repo_root().join("../shared/tools/nbequiv.py"))
        .arg(notebook)
        .arg(executed)
        .arg("--cwd")
        .arg(folder)
        .arg("--reference-cache")
        .arg(repo_root().join("target/nbequiv-cache-kernel"))
        .arg("--json")
        .arg(&verdict)
        .status()?;
    Ok((status.success(), std::fs::read_to_string(&verdict).unwrap_or_default()))
}

#[test]
fn the_jupyter_kernel_conformance_suite_passes() -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    install(prefix.path())?;
    let out = python(prefix.path())
        .args(["-m", "unittest", "-v", "kernel_conformance"])
        .env("LOOSELEAF_TEST_KERNEL", "looseleaf-test")
        .env("LOOSELEAF_LOG", "error")
        .current_dir(repo_root().join("tests/support"))
        .output()?;
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "jupyter_kernel_test failed:\n{report}");
    // the suite's samples ran: a test that skips for want of a sample would pass vacuously
    for test in [
        "test_execute_stdout",
        "test_execute_stderr",
        "test_is_complete",
        "test_pager",
        "test_error",
        "test_execute_result",
        "test_display_data",
        "test_history",
        "test_clear_output",
        "test_kernel_info",
        "test_completion",
        "test_inspect",
    ] {
        assert!(report.lines().any(|l| l.starts_with(test) && l.ends_with("ok")), "{test} did not pass:\n{report}");
    }
    Ok(())
}

#[test]
fn papermill_runs_a_parameterised_notebook_through_the_kernel() -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    install(prefix.path())?;
    let cell = |source: &str, tags: &[&str]| {
        serde_json::json!({"cell_type": "code", "execution_count": null, "metadata": {"tags": tags},
                           "outputs": [], "source": source})
    };
    let notebook = serde_json::json!({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "looseleaf-test", "display_name": "LooseLeaf", "language": "python"}},
        "cells": [cell("alpha = 1\nlabel = 'default'", &["parameters"]), cell("print(label, alpha * 2)", &[])],
    });
    let input = prefix.path().join("params.ipynb");
    let output = prefix.path().join("params.out.ipynb");
    std::fs::write(&input, serde_json::to_string(&notebook)?)?;
    let status = python(prefix.path())
        .args(["-m", "papermill"])
        .arg(&input)
        .arg(&output)
        .args(["-k", "looseleaf-test", "-p", "alpha", "21", "-p", "label", "answer", "--cwd"])
        .arg(prefix.path())
        .env("LOOSELEAF_LOG", "error")
        .status()?;
    assert!(status.success(), "papermill failed");
    let out: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&output)?)?;
    let text = out["cells"].to_string();
    assert!(text.contains("answer 42"), "the parameters did not reach the cells: {text}");
    Ok(())
}

/// A kernel whose frontend is not there starts, and says so in the cell's reply
/// and output (naming the frontend), instead of hanging or running elsewhere.
#[test]
fn a_kernel_without_its_frontend_says_so_in_the_notebook() -> anyhow::Result<()> {
    let prefix = UserDirs::new()?;
    let dead = format!("http://127.0.0.1:{}", looseleaf_test_support::free_port()?);
    let status = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["kernel", "install", "--prefix"])
        .arg(prefix.path())
        .args(["--name", "looseleaf-test", "--frontend", &dead])
        .status()?;
    anyhow::ensure!(status.success(), "looseleaf kernel install failed");
    let out = python(prefix.path())
        .arg(repo_root().join("tests/support/kernel_probe.py"))
        .args(["looseleaf-test", "--one-cell"])
        .env("LOOSELEAF_LOG", "error")
        .output()?;
    anyhow::ensure!(out.status.success(), "kernel_probe.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    assert_eq!(seen["reply"]["status"], "error", "{seen}");
    assert_eq!(seen["reply"]["ename"], "LooseLeafUnavailable", "{seen}");
    assert!(seen["reply"]["evalue"].as_str().is_some_and(|e| e.contains(&dead)), "{seen}");
    let shown = seen["outputs"].to_string();
    assert!(shown.contains("\"error\"") && shown.contains(&dead), "the notebook does not say why: {shown}");
    Ok(())
}
