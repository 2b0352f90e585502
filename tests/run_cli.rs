//! `looseleaf run` as a command people script (as nbconvert and papermill are):
//! it stops at the first cell that raises and exits non-zero unless
//! `--allow-errors`, writes the executed notebook after every cell (an interrupted
//! run leaves the cells so far), streams outputs to the terminal, defaults its
//! output paths beside the notebook, gives cells ids and the notebook the worker's
//! `language_info`, refuses a broken notebook before starting anything, and writes
//! a report that its JSON Schema (written beside it) validates.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use looseleaf_test_support::{venv_python, wait_for, LocalCluster};
use serde_json::{json, Value};

fn looseleaf() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_looseleaf"))
}

fn notebook(dir: &Path, name: &str, cells: &[&str]) -> PathBuf {
    let mut all = vec![json!({"cell_type": "markdown", "metadata": {}, "source": "# a notebook without cell ids"})];
    all.extend(cells.iter().map(
        |src| json!({"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": null}),
    ));
    let nb = json!({"cells": all, "metadata": {}, "nbformat": 4, "nbformat_minor": 4});
    let path = dir.join(name);
    let text = serde_json::to_string_pretty(&nb).unwrap_or_else(|e| panic!("notebook json: {e}"));
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}

fn read(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn stdout_text(cell: &Value) -> String {
    cell["outputs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["output_type"] == "stream")
        .filter_map(|o| o["text"].as_str())
        .collect()
}

#[test]
fn looseleaf_run_behaves_like_a_notebook_runner() {
    let dir = tempfile::tempdir().unwrap();
    // a broken notebook is refused at once, before any cluster starts
    let bad = dir.path().join("bad.ipynb");
    std::fs::write(&bad, r#"{"nbformat": 4, "nbformat_minor": 4, "metadata": {}, "cells": [{"cell_type": "code"}]}"#)
        .unwrap();
    let out = Command::new(looseleaf()).args(["run"]).arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("cell 0 has no source") && !err.contains("starting an embedded cluster"), "{err}");

    let cluster = LocalCluster::start(looseleaf(), 1).expect("looseleaf up");
    let nb = notebook(dir.path(), "nb.ipynb", &["print('one')", "1 / 0", "print('three')"]);
    let run = |extra: &[&str]| {
        Command::new(looseleaf())
            .args(["run", "--frontend", &cluster.url(), "--token", cluster.token()])
            .args(extra)
            .arg(&nb)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };

    // `looseleaf up`'s API asks for the token it printed
    let refused = Command::new(looseleaf())
        .args(["run", "--frontend", &cluster.url()])
        .arg(&nb)
        .env_remove("LOOSELEAF_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("401") && err.contains("bearer token"), "{err}");

    // stops at the error, non-zero, the notebook so far at the default path
    let out = run(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cell 2") && err.contains("ZeroDivisionError") && err.contains("--allow-errors"), "{err}");
    // the outputs were streamed to the terminal as they came
    assert!(String::from_utf8_lossy(&out.stdout).contains("one"));
    let executed = read(&dir.path().join("nb.looseleaf.ipynb"));
    let cells = executed["cells"].as_array().unwrap();
    assert_eq!(stdout_text(&cells[1]), "one\n");
    assert_eq!(cells[2]["outputs"][0]["ename"], "ZeroDivisionError");
    assert_eq!(cells[3]["execution_count"], Value::Null, "a cell after the error does not run");
    // cells got ids (nbformat 4.5) and the notebook the worker's language_info
    assert!(cells.iter().all(|c| c["id"].as_str().is_some_and(|id| !id.is_empty())));
    assert_eq!(executed["nbformat_minor"], 5);
    assert!(
        executed["metadata"]["language_info"]["version"].as_str().is_some_and(|v| v.starts_with("3.")),
        "{}",
        executed["metadata"]
    );

    // --allow-errors runs every cell and succeeds; the report validates against the
    // schema written beside it
    let out = run(&["--allow-errors"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let executed = read(&dir.path().join("nb.looseleaf.ipynb"));
    assert_eq!(stdout_text(&executed["cells"][3]), "three\n");
    let report = dir.path().join("nb.looseleaf.json");
    assert_eq!(read(&report)["cells"].as_array().map(Vec::len), Some(3));
    let check = Command::new(venv_python())
        .args(["-c", "import json, sys, jsonschema; jsonschema.validate(json.load(open(sys.argv[1])), json.load(open(sys.argv[2])))"])
        .arg(&report)
        .arg(dir.path().join("looseleaf-report.schema.json"))
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));

    // an interrupted run leaves the cells that finished
    let slow = notebook(dir.path(), "slow.ipynb", &["print('done before')", "import time\ntime.sleep(20)"]);
    let partial = dir.path().join("partial.ipynb");
    let mut child = Command::new(looseleaf())
        .args(["run", "--frontend", &cluster.url(), "--token", cluster.token(), "--output"])
        .arg(&partial)
        .arg(&slow)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(120), || partial.exists()).expect("the first cell is written as soon as it ran");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGINT);
    let status = child.wait().unwrap();
    assert!(!status.success());
    let so_far = read(&partial);
    assert_eq!(stdout_text(&so_far["cells"][1]), "done before\n");
    assert_eq!(so_far["cells"][2]["execution_count"], Value::Null);
}

/// `looseleaf status` with `args`, from a directory of its own (so that no
/// `.looseleaf` of the checkout is found by accident).
fn status(args: &[&str]) -> anyhow::Result<String> {
    let cwd = tempfile::tempdir()?;
    let out = Command::new(looseleaf())
        .args(["status", "--wait-ms", "3000"])
        .args(args)
        .current_dir(cwd.path())
        .stdin(Stdio::null())
        .output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn status_finds_the_cluster_up_started_and_up_uses_an_existing_nats() -> anyhow::Result<()> {
    // `up` records its NATS in the data directory; `status --data-dir` finds it
    let cluster = LocalCluster::start(looseleaf(), 1)?;
    let data = cluster.data_dir().display().to_string();
    let shown = status(&["--data-dir", &data])?;
    assert!(shown.contains("host-0") && shown.contains("looseleaf-frontend"), "{shown}");
    let record = cluster.data_dir().join("nats-url");
    drop(cluster);
    assert!(!record.exists(), "a stopped cluster's NATS is still recorded");

    // `up --nats-url` uses the operator's NATS and starts none of its own
    let nats = looseleaf_test_support::NatsServer::start()?;
    let cluster = LocalCluster::start_with(looseleaf(), 1, &["--nats-url", nats.url()])?;
    assert!(!cluster.data_dir().join("nats").exists(), "up started a nats-server of its own");
    let shown = status(&["--nats-url", nats.url()])?;
    assert!(shown.contains("host-0") && shown.contains("looseleaf-planner"), "{shown}");
    Ok(())
}
