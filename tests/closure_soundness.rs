//! The planner's static state closures are sound on real notebooks: for every notebook
//! of ../shared/corpus, every name each cell actually read that an earlier cell defined
//! (tools/closure_audit.py, an instrumented in-process IPython) is in the cell's static
//! closure (`looseleaf analyze`), except in cells the analysis marked conservative, and
//! at most 2% of cells are conservative. `bench/analysis` reports the same figures
//! with precision, closure ratios and timings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{ensure, Context};
use looseleaf_test_support::{repo_root, venv_python};
use serde_json::Value;

fn corpus() -> PathBuf {
    std::env::var_os("LOOSELEAF_CORPUS").map(PathBuf::from).unwrap_or_else(|| repo_root().join("../shared/corpus"))
}

fn notebooks() -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for dir in [corpus(), corpus().join("torch")] {
        for entry in std::fs::read_dir(&dir).with_context(|| format!("while listing {}", dir.display()))? {
            let p = entry?.path();
            if p.extension().is_some_and(|e| e == "ipynb") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("while reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("while parsing {}", path.display()))
}

fn names(v: &Value, key: &str) -> BTreeSet<String> {
    v[key].as_array().map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect()).unwrap_or_default()
}

/// Run tools/closure_audit.py on `nb`, writing its JSON to `out`.
fn audit(nb: &Path, out: &Path) -> anyhow::Result<()> {
    let run = Command::new(venv_python())
        .arg(repo_root().join("tools/closure_audit.py"))
        .arg(nb)
        .arg("--out")
        .arg(out)
        .env("MPLBACKEND", "Agg")
        .stdin(Stdio::null())
        .output()
        .context("while running tools/closure_audit.py")?;
    ensure!(
        run.status.success(),
        "closure_audit.py failed on {}:\n{}",
        nb.display(),
        String::from_utf8_lossy(&run.stderr)
    );
    Ok(())
}

/// The audit itself sees reads through notebook functions, comprehensions, class
/// bodies and `eval`, and not reads of names the cell rebound first.
#[test]
fn audit_records_reads_through_functions_class_bodies_and_eval() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let cell = |src: &str| serde_json::json!({"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": null, "source": src});
    let nb = serde_json::json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        cell("import math\na, b, c, d, e, unused = 1, 2, 3, 4, 5, 6\ndef f():\n    return a\n"),
        cell("b = 10\nx = f() + b\nclass K:\n    k = c\ny = [d for _ in range(2)]\nz = eval('e') + math.pi\n"),
    ]});
    let path = tmp.path().join("t.ipynb");
    std::fs::write(&path, nb.to_string())?;
    let out = tmp.path().join("t.json");
    audit(&path, &out)?;
    let v = read_json(&out)?;
    let reads = names(&v["cells"][1], "reads");
    let want: BTreeSet<String> = ["a", "c", "d", "e", "f", "math"].map(String::from).into();
    ensure!(reads == want, "reads {reads:?}, want {want:?}");
    let live = names(&v["cells"][1], "live_before");
    ensure!(!live.contains("math") && live.contains("unused") && !live.contains("In"), "live {live:?}");
    Ok(())
}

#[test]
fn static_closures_cover_every_actual_read_on_the_corpus() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let (mut cells, mut conservative, mut violations) = (0usize, Vec::new(), Vec::new());
    for nb in notebooks()? {
        let stem = nb.file_stem().and_then(|s| s.to_str()).unwrap_or("nb").to_string();
        let audit_path = tmp.path().join(format!("{stem}.audit.json"));
        let static_path = tmp.path().join(format!("{stem}.static.json"));
        audit(&nb, &audit_path)?;
        let status = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
            .args(["analyze"])
            .arg(&nb)
            .arg("--json")
            .arg(&static_path)
            .status()
            .context("while running looseleaf analyze")?;
        ensure!(status.success(), "looseleaf analyze failed on {}", nb.display());

        let audit = read_json(&audit_path)?;
        let stat = read_json(&static_path)?;
        let by_index: BTreeMap<u64, &Value> =
            stat["cells"].as_array().into_iter().flatten().filter_map(|c| Some((c["index"].as_u64()?, c))).collect();
        for dyn_cell in audit["cells"].as_array().into_iter().flatten() {
            cells += 1;
            let index = dyn_cell["index"].as_u64().unwrap_or(u64::MAX);
            let Some(st) = by_index.get(&index) else {
                violations.push(format!("{stem} cell {index}: not analysed"));
                continue;
            };
            if let Some(reason) = st["conservative"].as_str() {
                conservative.push(format!("{stem} cell {index}: {reason}"));
                continue;
            }
            let missing: Vec<String> = names(dyn_cell, "reads").difference(&names(st, "closure")).cloned().collect();
            if !missing.is_empty() {
                violations.push(format!("{stem} cell {index} read {missing:?}, not in its closure"));
            }
        }
    }
    ensure!(cells > 0, "no corpus cells found under {}", corpus().display());
    ensure!(violations.is_empty(), "unsound closures:\n{}", violations.join("\n"));
    ensure!(
        conservative.len() * 50 <= cells,
        "{} of {cells} cells are conservative (> 2%):\n{}",
        conservative.len(),
        conservative.join("\n")
    );
    Ok(())
}
