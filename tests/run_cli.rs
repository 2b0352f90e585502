//! `looseleaf run` as a command people script (as nbconvert and papermill are):
//! it stops at the first cell that raises and exits non-zero unless
//! `--allow-errors`, writes the executed notebook after every cell, streams
//! outputs to the terminal, defaults its output paths beside the notebook, gives
//! cells ids and the notebook the worker's `language_info`, refuses a broken
//! notebook before starting anything, and writes a report that the JSON Schema
//! its `$schema` URL names (`docs/report.schema.json`) validates. Ctrl-C interrupts
//! the running cell, writes it (marked interrupted) with the finished ones, and
//! exits 130. `looseleaf status` finds a cluster or says at once where it looked.

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use looseleaf_test_support::{venv_python, LocalCluster};
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
fn a_session_cpu_worker_goes_through_its_lifecycle_between_cells() {
    // its next cells find nothing to bring in (ADR 69): the host still takes it
    // through Preparing, where it logged `Kept -> Running is not a lifecycle
    // transition` for every such cell and reported the worker Kept while it ran
    let dir = tempfile::tempdir().unwrap();
    let nb = notebook(dir.path(), "cpu.ipynb", &["def f():\n    return 1\nx = f()", "x = f() + 1", "print(x)"]);
    let out = Command::new(looseleaf()).arg("run").arg(&nb).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("3 cells: 3 ok"), "{err}");
    assert!(!err.contains("lifecycle"), "{err}");
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

    // --allow-errors runs every cell and succeeds; the report names its schema by
    // URL, the `$id` of the repository's docs/report.schema.json, which validates it;
    // no copy of the schema is written beside it
    let out = run(&["--allow-errors"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let executed = read(&dir.path().join("nb.looseleaf.ipynb"));
    assert_eq!(stdout_text(&executed["cells"][3]), "three\n");
    let report = dir.path().join("nb.looseleaf.json");
    assert_eq!(read(&report)["cells"].as_array().map(Vec::len), Some(3));
    let schema = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/report.schema.json");
    assert_eq!(read(&report)["$schema"], read(&schema)["$id"]);
    assert!(!dir.path().join("looseleaf-report.schema.json").exists(), "the schema was written beside the report");
    let check = Command::new(venv_python())
        .args(["-c", "import json, sys, jsonschema; jsonschema.validate(json.load(open(sys.argv[1])), json.load(open(sys.argv[2])))"])
        .arg(&report)
        .arg(&schema)
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
}

/// Lines of a child's pipe as they come, read on a thread of their own (so the
/// child never blocks on a full pipe).
fn lines_of(pipe: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// Ctrl-C while a cell runs: the cell is interrupted on the cluster; the notebook
/// holds the finished cell, the interrupted cell's output so far and its
/// KeyboardInterrupt, and nothing of the cells after it; the run exits 130 and
/// says what it wrote.
#[test]
fn ctrl_c_writes_the_finished_cells_and_the_interrupted_one_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(looseleaf(), 1).expect("looseleaf up");
    let nb = notebook(
        dir.path(),
        "slow.ipynb",
        &[
            "print('cell one')",
            "import time\nprint('cell two started', flush=True)\ntime.sleep(60)",
            "print('cell three')",
        ],
    );
    let output = dir.path().join("partial.ipynb");
    let report = dir.path().join("partial.json");
    let mut child = Command::new(looseleaf())
        .args(["run", "--frontend", &cluster.url(), "--token", cluster.token(), "--output"])
        .arg(&output)
        .arg("--report")
        .arg(&report)
        .arg(&nb)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = lines_of(child.stdout.take().unwrap());
    let stderr = lines_of(child.stderr.take().unwrap());
    // the second cell is running once its line reaches the terminal
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains("cell two started")) {
        match stdout.recv_timeout(Duration::from_secs(180)) {
            Ok(line) => seen.push(line),
            Err(e) => {
                let _ = child.kill();
                panic!(
                    "the second cell never printed ({e}); stdout {seen:?}, stderr {:?}",
                    stderr.try_iter().collect::<Vec<_>>()
                );
            }
        }
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let status = child.wait().unwrap();
    let said: Vec<String> = stderr.iter().collect();
    assert_eq!(status.code(), Some(130), "{said:?}");
    // one line says what it wrote, truthfully
    let line = said.iter().find(|l| l.starts_with("interrupted (SIGINT): wrote")).unwrap_or_else(|| panic!("{said:?}"));
    assert!(
        line.contains(&output.display().to_string())
            && line.contains("with 1 finished cell and cell 2")
            && line.contains("marked interrupted")
            && line.contains(&report.display().to_string()),
        "{line}"
    );
    assert!(!said.iter().any(|l| l.starts_with("Error")), "an interrupted run prints no error chain: {said:?}");

    let written = read(&output);
    let cells = written["cells"].as_array().unwrap();
    assert_eq!(stdout_text(&cells[1]), "cell one\n", "the finished cell is intact");
    assert!(stdout_text(&cells[2]).contains("cell two started"), "{}", cells[2]);
    let last = cells[2]["outputs"].as_array().and_then(|o| o.last()).cloned().unwrap_or_default();
    assert_eq!((&last["output_type"], &last["ename"]), (&json!("error"), &json!("KeyboardInterrupt")), "{}", cells[2]);
    assert!(cells[2]["execution_count"].is_u64(), "the interrupted cell's count is known: {}", cells[2]);
    assert_eq!(cells[3]["outputs"], json!([]), "a cell after the interrupted one ran");
    assert_eq!(cells[3]["execution_count"], Value::Null);
    // the report was written too: the finished cell and the interrupted one
    let report = read(&report);
    let entries = report["cells"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{report}");
    assert_eq!(entries[0]["status"], "ok");
    assert_eq!(entries[1]["status"], "error");
    assert!(entries[1]["error"].as_str().is_some_and(|e| e.contains("KeyboardInterrupt")), "{}", entries[1]);
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

/// With no cluster where it looks, `looseleaf status` tries once and fails at
/// once, saying where it looked (the URL, and the data directory it came from)
/// and how to point it at a cluster.
#[test]
fn status_without_a_cluster_says_where_it_looked() -> anyhow::Result<()> {
    // a port nothing listens on
    let port = looseleaf_test_support::free_port()?;
    let url = format!("nats://127.0.0.1:{port}");
    let cwd = tempfile::tempdir()?;
    let status = |args: &[&str]| {
        Command::new(looseleaf())
            .arg("status")
            .args(args)
            .current_dir(cwd.path())
            .env_remove("LOOSELEAF_NATS_URL")
            .env_remove("LOOSELEAF_NATS_CONNECT_WAIT")
            .env_remove("LOOSELEAF_DATA_DIR")
            .stdin(Stdio::null())
            .output()
    };

    let out = status(&["--nats-url", &url])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&url) && err.contains("--data-dir DIR") && err.contains("--nats-url URL"), "{err}");

    // a data directory whose `looseleaf up` died and left its NATS recorded
    let data = tempfile::tempdir()?;
    std::fs::write(data.path().join("nats-url"), format!("{url}\n"))?;
    let out = status(&["--data-dir", &data.path().display().to_string()])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&url) && err.contains(&data.path().display().to_string()), "{err}");
    Ok(())
}
