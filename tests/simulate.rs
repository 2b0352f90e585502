//! `looseleaf simulate --recorded`: a REPORT.json of a real `looseleaf run
//! --typing-cps` replays as a session with the report's cells, in order, with
//! their device labels and closures; a report that is not one is refused with an
//! error that names the file.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use looseleaf_test_support::LocalCluster;
use serde_json::{json, Value};

fn looseleaf() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_looseleaf"))
}

fn read(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Each cell's (id, device, closure), from a report's `cells` or a replay's list.
fn cells_of(list: &Value) -> Vec<(String, String, Value)> {
    let text = |c: &Value, k: &str| c[k].as_str().unwrap_or_else(|| panic!("no {k} in {c}")).to_string();
    let cells = list.as_array().unwrap_or_else(|| panic!("not a list: {list}"));
    cells.iter().map(|c| (text(c, "cell_id"), text(c, "device"), c["closure"].clone())).collect()
}

fn simulate(report: &Path, out: &Path) -> std::process::Output {
    let costs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench/results");
    Command::new(looseleaf())
        .args(["simulate", "--recorded"])
        .arg(report)
        .args([
            "--hosts",
            "1",
            "--gpus-per-host",
            "2",
            "--virtual-gpus",
            "--no-plots",
            "--policies",
            "looseleaf,pinned",
        ])
        .arg("--costs")
        .arg(&costs)
        .arg("--out")
        .arg(out)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("looseleaf simulate: {e}"))
}

#[test]
fn a_recorded_run_replays_with_its_cells_devices_and_closures() {
    let dir = tempfile::tempdir().unwrap();
    let cells = ["x = 1\ny = [1, 2, 3]", "%%gpu\nz = x + len(y)", "w = x * 2", "%%gpu\nprint(z + w)"];
    let nb = json!({
        "cells": cells.iter().map(|src| json!({"cell_type": "code", "metadata": {}, "source": src,
            "outputs": [], "execution_count": null})).collect::<Vec<_>>(),
        "metadata": {}, "nbformat": 4, "nbformat_minor": 4,
    });
    let nb_path = dir.path().join("nb.ipynb");
    std::fs::write(&nb_path, nb.to_string()).unwrap();
    let report_path = dir.path().join("nb.report.json");

    let cluster = LocalCluster::start(looseleaf(), 1).expect("looseleaf up");
    let run = Command::new(looseleaf())
        .args(["run", "--frontend", &cluster.url(), "--token", cluster.token(), "--typing-cps", "200"])
        .arg("--report")
        .arg(&report_path)
        .arg(&nb_path)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report = read(&report_path);
    let expected = cells_of(&report["cells"]);
    // the run itself: two GPU cells whose closures are what they read
    let devices: Vec<&str> = expected.iter().map(|(_, d, _)| d.as_str()).collect();
    assert_eq!(devices, ["cpu", "gpu", "cpu", "gpu"]);
    assert_eq!(expected[1].2, json!(["x", "y"]));
    assert_eq!(expected[3].2, json!(["w", "z"]));

    let out = dir.path().join("sim");
    let sim = simulate(&report_path, &out);
    assert!(sim.status.success(), "{}", String::from_utf8_lossy(&sim.stderr));
    let results = read(&out.join("simulation.json"));
    let policies = results["loads"]["recorded"]["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 2);
    for p in policies {
        let replayed = cells_of(&p["replayed"]);
        assert_eq!(replayed, expected, "{}", p["policy"]);
        assert_eq!(p["gpu_cells"], 2, "{}", p["policy"]);
    }
    let ll = policies.iter().find(|p| p["policy"] == "looseleaf").unwrap();
    assert!(ll["held_gpu_hours"].as_f64().unwrap() > 0.0);
    assert!(ll["counters"].get("lifecycle_violations").is_none(), "{}", ll["counters"]);
    assert!(out.join("summary.md").exists());

    // not a report: refused, naming the file and what it lacks
    let bad = dir.path().join("bad.report.json");
    std::fs::write(&bad, r#"{"cells": [{"cell_id": "a"}]}"#).unwrap();
    let refused = simulate(&bad, &dir.path().join("sim2"));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{err}");
    assert!(err.contains("bad.report.json") && err.contains("started_at"), "{err}");
}

/// `looseleaf simulate` started outside the repository: the measured costs it
/// needs are built in, its results land under `--out` relative to where it was
/// started, and a `--costs` directory that is not there is named.
#[test]
fn simulate_runs_from_any_folder() {
    let cwd = tempfile::tempdir().unwrap();
    let sim = |extra: &[&str]| {
        Command::new(looseleaf())
            .arg("simulate")
            .args(["--sessions", "2", "--no-trace", "--no-variants", "--no-floor-runs", "--no-plots"])
            .args(["--policies", "looseleaf,pinned", "--hosts", "1", "--gpus-per-host", "2", "--out", "out"])
            .args(extra)
            .current_dir(cwd.path())
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("looseleaf simulate: {e}"))
    };
    let out = sim(&[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let results = read(&cwd.path().join("out/simulation.json"));
    let sources = results["costs"]["sources"].as_array().unwrap_or_else(|| panic!("no sources: {}", results["costs"]));
    assert!(sources.iter().all(|s| s.as_str().is_some_and(|s| s.ends_with("(built in)"))), "{sources:?}");
    assert!(results["loads"]["s2"]["policies"].as_array().is_some_and(|p| p.len() == 2), "{}", results["loads"]);

    let missing = cwd.path().join("no-such-results");
    let refused = sim(&["--costs", &missing.display().to_string()]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains(&missing.display().to_string()), "{err}");
}
