//! Every notebook of ../shared/corpus runs through LooseLeaf, with or without
//! `--all-gpu` (CI runs a fixed slice of the matrix, `bench/corpus` the rest: see
//! `in_ci_slice`), and gives the same outputs as a plain IPython kernel
//! (../shared/tools/nbequiv.py, reference signatures cached so each reference runs
//! once). Without `--all-gpu`, torch cells that move models or tensors to `device`
//! run on GPU slots and the rest on the session's CPU worker.
//!
//! With `--all-gpu` each cell is also replayed as typed (`--typing-cps 400`: an
//! edit every 100 ms), so most cells run on workers prepared while "typing", and
//! the outputs must still match: preparation never runs a cell.
//!
//! Each notebook runs in a copy of its folder at a fixed path (the notebooks write
//! files, and one prints absolute paths), shared by the reference and LooseLeaf.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use looseleaf_test_support::{copy_dir, repo_root, venv_python, LocalCluster};

fn corpus() -> PathBuf {
    std::env::var_os("LOOSELEAF_CORPUS").map(PathBuf::from).unwrap_or_else(|| repo_root().join("../shared/corpus"))
}

/// (cell, expected, got) of every cell an nbequiv verdict file marks as mismatched.
fn verdict_mismatches(verdict: &Path) -> Vec<(usize, serde_json::Value, serde_json::Value)> {
    let Some(v) =
        std::fs::read_to_string(verdict).ok().and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    else {
        return vec![];
    };
    v["cells"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["status"] == "mismatch")
        .filter_map(|c| Some((c["cell"].as_u64()? as usize, c["expected"].clone(), c["got"].clone())))
        .collect()
}

/// Code cells an nbequiv verdict file marks as mismatched, less those that show
/// uninitialised memory (whatever a process's allocator left there is not
/// comparable across processes). None if the verdict cannot be read.
fn mismatched_cells(verdict: &Path, code: &[String]) -> Option<Vec<usize>> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(verdict).ok()?).ok()?;
    Some(
        v["cells"]
            .as_array()?
            .iter()
            .filter(|c| c["status"] == "mismatch")
            .filter_map(|c| c["cell"].as_u64().map(|i| i as usize))
            .filter(|i| !reads_uninitialised_memory(code.get(*i).map(String::as_str).unwrap_or("")))
            .collect(),
    )
}

/// The reference runs nbequiv cached in `dir` (one file: a list of runs, each a
/// list of per-cell signatures).
fn reference_runs(dir: &Path) -> Vec<serde_json::Value> {
    let Ok(entries) = std::fs::read_dir(dir) else { return vec![] };
    entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(e.path()).ok()?).ok())
        .filter_map(|v| v.as_array().cloned())
        .flatten()
        .collect()
}

/// A JSON file the test wrote or reads; a failure names the file.
fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Our own notebooks that probe notebook semantics (lambdas reading globals,
/// closures from factories, Out/_N history, magics, views); they run like corpus
/// notebooks. (tests/notebooks/system.ipynb uses %%gpu, which a plain kernel lacks.)
fn own_notebooks() -> Vec<PathBuf> {
    vec![repo_root().join("tests/notebooks/semantics.ipynb")]
}

/// Look-alikes of patterns real notebooks use (../shared/fidelity-next): they run
/// in a folder of their own beside the corpus's, in both modes in CI too.
const FIDELITY_NEXT: &str = "fidelity-next";

fn fidelity_next() -> Vec<PathBuf> {
    let dir = corpus().join("..").join(FIDELITY_NEXT);
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "ipynb")).collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Folders of the corpus whose notebooks show what LooseLeaf does not do yet, each
/// with the open work that makes it pass. They are listed on every run; nothing in
/// LooseLeaf treats them differently.
const NOT_YET: &[(&str, &str)] = &[];

fn find_notebooks(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("corpus at {}: {e}", dir.display())) {
        let p = e.unwrap_or_else(|e| panic!("corpus at {}: {e}", dir.display())).path();
        if p.is_dir() && !p.ends_with(".ipynb_checkpoints") {
            find_notebooks(&p, out);
        } else if p.extension().is_some_and(|x| x == "ipynb") {
            out.push(p.strip_prefix(corpus()).unwrap_or(&p).to_path_buf());
        }
    }
}

/// Every corpus notebook, in every folder, relative to the corpus folder (each runs
/// with its own folder as working directory), then ours (copied to its root).
fn notebooks() -> Vec<PathBuf> {
    let mut out = Vec::new();
    find_notebooks(&corpus(), &mut out);
    out.retain(|nb| match NOT_YET.iter().find(|(dir, _)| nb.starts_with(dir)) {
        Some((_, why)) => {
            eprintln!("not yet run: {} ({why})", nb.display());
            false
        }
        None => true,
    });
    out.sort();
    out.extend(own_notebooks().iter().filter_map(|p| p.file_name()).map(PathBuf::from));
    out.extend(fidelity_next().iter().filter_map(|p| p.file_name()).map(|f| Path::new(FIDELITY_NEXT).join(f)));
    out
}

/// The code of each code cell, in order (nbequiv numbers cells this way).
fn code_sources(notebook: &Path) -> Vec<String> {
    let nb = read_json(notebook);
    nb["cells"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no cells", notebook.display()))
        .iter()
        .filter(|c| c["cell_type"] == "code")
        .map(|c| match &c["source"] {
            serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect(),
            other => other.as_str().unwrap_or("").to_string(),
        })
        .collect()
}

/// Whether a cell shows memory it never initialised (`np.empty`, `torch.empty`).
fn reads_uninitialised_memory(code: &str) -> bool {
    code.lines().any(|l| {
        let code = l.split('#').next().unwrap_or("");
        code.contains("empty(") || code.contains("empty_like(")
    })
}

/// The two ways a notebook runs: `mixed` (CPU cells on the session's CPU worker,
/// GPU cells on slots) and `all-gpu` (every cell on a GPU slot, typed first).
const MODES: [bool; 2] = [false, true];

/// Which part of the (notebook, mode) matrix runs, from `LOOSELEAF_CORPUS_MATRIX`:
/// `slice` (the default, what CI runs), `rest` (what CI does not; `bench/corpus`)
/// or `full`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Matrix {
    Slice,
    Rest,
    Full,
}

impl Matrix {
    fn from_env() -> Self {
        match std::env::var("LOOSELEAF_CORPUS_MATRIX").as_deref() {
            Err(_) | Ok("slice") => Matrix::Slice,
            Ok("rest") => Matrix::Rest,
            Ok("full") => Matrix::Full,
            Ok(other) => panic!("LOOSELEAF_CORPUS_MATRIX must be slice, rest or full, not {other:?}"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Matrix::Slice => "slice",
            Matrix::Rest => "rest",
            Matrix::Full => "full",
        }
    }

    fn includes(self, position: usize, notebook: &Path, all_gpu: bool) -> bool {
        match self {
            Matrix::Slice => in_ci_slice(position, notebook, all_gpu),
            // the fidelity look-alikes are reported with the rest too
            Matrix::Rest => !in_ci_slice(position, notebook, all_gpu) || notebook.starts_with(FIDELITY_NEXT),
            Matrix::Full => true,
        }
    }
}

/// Whether CI runs this (notebook, mode) of the matrix: each behaviour once, the
/// rest in `bench/corpus` (ADR 59). Each notebook runs once, but the bigstate one,
/// which `tests/large_state.rs` runs on its own cluster: the torch notebooks in
/// `mixed` (where their CPU/GPU placement is checked, their GPU cells restored on
/// fresh workers), every other notebook in a folder, ours and the fidelity
/// look-alikes in `all-gpu` (every cell restored on a fresh worker, the stricter
/// mode; in `mixed` their cells would run on the CPU worker as in a plain kernel),
/// and the notebooks at the corpus's top level alternate between the modes by
/// their place in the sorted list, so both paths meet every kind of notebook. The
/// slice is fixed, so a CI failure reproduces.
fn in_ci_slice(position: usize, notebook: &Path, all_gpu: bool) -> bool {
    if notebook.starts_with("fidelity/bigstate") {
        return false;
    }
    if notebook.starts_with("torch") {
        return !all_gpu;
    }
    let in_folder = notebook.components().count() > 1;
    let ours = own_notebooks().iter().any(|own| own.file_name() == Some(notebook.as_os_str()));
    if in_folder || ours {
        all_gpu
    } else {
        all_gpu == (position % 2 == 1)
    }
}

#[test]
fn corpus_matches_a_pinned_kernel() {
    let work = repo_root().join("target/corpus-run");
    let cache = repo_root().join("target/nbequiv-cache");
    let cluster = LocalCluster::start(Path::new(env!("CARGO_BIN_EXE_looseleaf")), 2).expect("looseleaf up");
    let frontend = cluster.url();

    let mut failures = Vec::new();
    let (mut typed_cells, mut prepared_cells) = (0usize, 0usize);
    let nbequiv = repo_root().join("../shared/tools/nbequiv.py");
    let nbequiv = if nbequiv.exists() { nbequiv } else { corpus().join("../tools/nbequiv.py") };
    let matrix = Matrix::from_env();
    // one entry per (notebook, mode) run: what bench/corpus reports
    let mut runs: Vec<serde_json::Value> = Vec::new();
    for (position, rel) in notebooks().into_iter().enumerate() {
        for all_gpu in MODES {
            if !matrix.includes(position, &rel, all_gpu) {
                continue;
            }
            let started = std::time::Instant::now();
            let failures_before = failures.len();
            let copy = work.join("corpus");
            let _ = std::fs::remove_dir_all(&copy);
            copy_dir(&corpus(), &copy).unwrap_or_else(|e| panic!("copy the corpus to {}: {e}", copy.display()));
            for own in own_notebooks() {
                std::fs::copy(&own, copy.join(own.file_name().unwrap())).unwrap();
            }
            std::fs::create_dir_all(copy.join(FIDELITY_NEXT)).unwrap();
            for nb in fidelity_next() {
                std::fs::copy(&nb, copy.join(FIDELITY_NEXT).join(nb.file_name().unwrap())).unwrap();
            }
            let source = copy.join(&rel);
            let mode = if all_gpu { "all-gpu" } else { "mixed" };
            let stem = rel.file_stem().unwrap().to_string_lossy().to_string();
            let out = work.join(format!("{stem}.{mode}.ipynb"));
            let report = work.join(format!("{stem}.{mode}.report.json"));
            let run_looseleaf = || {
                let mut run = Command::new(env!("CARGO_BIN_EXE_looseleaf"));
                // corpus notebooks raise on purpose (the errors must match too)
                run.args(["run", "--allow-errors"]).arg(&source).arg("--output").arg(&out).arg("--report").arg(&report);
                run.args(["--frontend", &frontend]).env("LOOSELEAF_TOKEN", cluster.token()).stdout(Stdio::null());
                if all_gpu {
                    run.args(["--all-gpu", "--typing-cps", "400"]);
                }
                run.status().unwrap().success()
            };
            // A cell the platform failed (no host took it, its host was lost) is a
            // LooseLeaf defect whatever the outputs look like: it fails the run and is
            // never retried away as a nondeterministic output.
            let platform_failures = || -> Vec<String> {
                let r: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&report).unwrap_or_default()).unwrap_or_default();
                let cells = r["cells"].as_array().cloned().unwrap_or_default();
                cells
                    .iter()
                    .filter(|c| matches!(c["status"].as_str(), Some("failed" | "aborted")))
                    .map(|c| format!("cell {} {}: {}", c["index"], c["status"], c["error"].as_str().unwrap_or("")))
                    .collect()
            };
            if !run_looseleaf() {
                failures.push(format!("{} ({mode}): looseleaf run failed", rel.display()));
                runs.push(serde_json::json!({"notebook": rel, "mode": mode, "ok": false,
                    "seconds": started.elapsed().as_secs_f64()}));
                continue;
            }
            let failed_cells = platform_failures();
            if !failed_cells.is_empty() {
                failures.push(format!("{} ({mode}): the platform failed {}", rel.display(), failed_cells.join("; ")));
                runs.push(serde_json::json!({"notebook": rel, "mode": mode, "ok": false,
                    "seconds": started.elapsed().as_secs_f64(), "platform_failures": failed_cells}));
                continue;
            }
            let verdict = work.join(format!("{stem}.{mode}.nbequiv.json"));
            let equiv = |cache: &Path, runs: u32| {
                let check = Command::new(venv_python())
                    .arg(&nbequiv)
                    .arg(&source)
                    .arg(&out)
                    .arg("--runs")
                    .arg(runs.to_string())
                    .arg("--reference-cache")
                    .arg(cache)
                    .arg("--json")
                    .arg(&verdict)
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&check.stdout).to_string();
                eprint!("{text}");
                if check.status.success() {
                    return (true, text);
                }
                let real = mismatched_cells(&verdict, &code_sources(&source)).unwrap_or_else(|| vec![usize::MAX]);
                if real.is_empty() {
                    eprintln!("  (only cells that show uninitialised memory differ)");
                }
                (real.is_empty(), text)
            };
            // every attempt's mismatched cells: what the plain kernel gave, what LooseLeaf gave
            let mut seen: Vec<(usize, serde_json::Value, serde_json::Value)> = Vec::new();
            let mut note_mismatches = |ok: bool| {
                if !ok {
                    seen.extend(verdict_mismatches(&verdict));
                }
            };
            let (mut ok, mut text) = equiv(&cache, 2);
            note_mismatches(ok);
            // Two kinds of reference outputs that a cached pair of runs can get wrong:
            // outputs that show the wall clock (`ls -l` of a file the cell wrote, minutes
            // after the cached reference ran) and cells whose kernel output varies run
            // to run (sklearn's SpectralClustering here) but happened to agree twice.
            // Run LooseLeaf again and compare with four fresh reference runs right after;
            // a cell differs only if it differs every time.
            let mut fresh_refs = Vec::new();
            let mut attempts = 1;
            for _ in 0..2 {
                if ok {
                    break;
                }
                attempts += 1;
                if !run_looseleaf() {
                    break;
                }
                let failed_cells = platform_failures();
                if !failed_cells.is_empty() {
                    text = format!("the platform failed {}", failed_cells.join("; "));
                    break;
                }
                let fresh = tempfile::tempdir().unwrap();
                (ok, text) = equiv(fresh.path(), 4);
                note_mismatches(ok);
                fresh_refs.push(fresh);
            }
            // A cell whose plain-kernel output itself varies (an unseeded draw that
            // usually lands the same way) may differ in every attempt by chance: it
            // is fine when every output LooseLeaf gave for it is one the plain
            // kernel also gave, and the kernel gave more than one.
            if !ok && fresh_refs.len() == 2 {
                let mismatched = mismatched_cells(&verdict, &code_sources(&source)).unwrap_or_default();
                let from_kernel_too = |i: usize| {
                    let kernel: Vec<&serde_json::Value> = seen.iter().filter(|s| s.0 == i).map(|s| &s.1).collect();
                    let ours: Vec<&serde_json::Value> = seen.iter().filter(|s| s.0 == i).map(|s| &s.2).collect();
                    let kernel_varies = kernel.windows(2).any(|w| w[0] != w[1]);
                    kernel_varies && !ours.is_empty() && ours.iter().all(|o| kernel.contains(o))
                };
                if !mismatched.is_empty() && mismatched.iter().all(|&i| from_kernel_too(i)) {
                    eprintln!("  (cells {mismatched:?} differ, but only in outputs a plain kernel also gave)");
                    ok = true;
                }
            }
            // A wall-clock output can still differ if the reference runs all fell in
            // one minute and LooseLeaf's in another. Such a cell is one whose reference
            // output itself changed between the batches of reference runs, minutes apart.
            if !ok && fresh_refs.len() == 2 {
                let mismatched = mismatched_cells(&verdict, &code_sources(&source)).unwrap_or_default();
                let runs: Vec<serde_json::Value> = fresh_refs.iter().flat_map(|d| reference_runs(d.path())).collect();
                let varies = |i: usize| runs.iter().map(|r| &r[i]).collect::<Vec<_>>().windows(2).any(|w| w[0] != w[1]);
                if !mismatched.is_empty() && runs.len() >= 2 && mismatched.iter().all(|&i| varies(i)) {
                    eprintln!("  (cells {mismatched:?} differ, but so do the reference's own runs minutes apart)");
                    ok = true;
                }
            }
            if !ok {
                failures.push(format!(
                    "{} ({mode}): {}",
                    rel.display(),
                    text.lines().last().unwrap_or("nbequiv failed")
                ));
            }
            let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
            let cells = r["cells"].as_array().unwrap();
            if all_gpu {
                // cells typed for at least half a second (200 characters at 400 cps)
                // had time to be prepared before Run; a cell pinned to the worker that
                // holds the session's unsavable state runs there, never on a prepared
                // one (ADR 51), so it is not counted
                let nbj: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&source).unwrap()).unwrap();
                let long = |c: &&serde_json::Value| {
                    let i = c["index"].as_u64().unwrap_or(0) as usize;
                    let len = match &nbj["cells"][i]["source"] {
                        serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).map(str::len).sum(),
                        other => other.as_str().map_or(0, str::len),
                    };
                    len >= 200 && c["prepare"] != "pinned"
                };
                typed_cells += cells.iter().filter(long).count();
                prepared_cells += cells.iter().filter(long).filter(|c| c["prepare"] == "speculative").count();
                if let Some(c) = cells.iter().find(|c| c["device"] != "gpu") {
                    failures.push(format!("{} (all-gpu): cell {} ran on {}", rel.display(), c["index"], c["device"]));
                }
            } else if rel.starts_with("torch") {
                // cells that move models or tensors to `device` run on GPU slots, the rest on the CPU worker
                // the report's index is the cell's position in the notebook
                let nbj: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&source).unwrap()).unwrap();
                let code = |i: usize| -> String {
                    match &nbj["cells"][i]["source"] {
                        serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect(),
                        other => other.as_str().unwrap_or("").to_string(),
                    }
                };
                for c in cells {
                    let i = c["index"].as_u64().unwrap() as usize;
                    let src = code(i);
                    // a move in code, not in a comment
                    let moves = src.lines().any(|l| {
                        let code = l.split('#').next().unwrap_or("");
                        code.contains(".to(device)") || code.contains(".cuda(")
                    });
                    if moves && c["device"] != "gpu" {
                        failures.push(format!(
                            "{}: cell {i} moves to device but ran on {}",
                            rel.display(),
                            c["device"]
                        ));
                    }
                    if c["device"] == "gpu" && c["prepare"] == "persistent" {
                        failures.push(format!("{}: GPU cell {i} ran on the CPU worker", rel.display()));
                    }
                }
                let cpu = cells.iter().filter(|c| c["device"] == "cpu").count();
                if cpu == 0 {
                    failures.push(format!("{}: no cell ran on the CPU worker", rel.display()));
                }
            }
            let seconds = started.elapsed().as_secs_f64();
            eprintln!("{} ({mode}): {seconds:.0} s", rel.display());
            runs.push(serde_json::json!({
                "notebook": rel,
                "mode": mode,
                "ok": failures.len() == failures_before,
                "seconds": seconds,
                "attempts": attempts,
                "cells": cells.len(),
                "on_gpu": cells.iter().filter(|c| c["device"] == "gpu").count(),
                "prepared": cells.iter().filter(|c| c["prepare"] == "speculative").count(),
            }));
        }
    }
    if let Some(path) = std::env::var_os("LOOSELEAF_CORPUS_RESULTS") {
        let summary = serde_json::json!({
            "matrix": matrix.name(),
            "runs": runs,
            "typed_cells": typed_cells,
            "prepared_typed_cells": prepared_cells,
            "failures": failures,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap_or_default())
            .unwrap_or_else(|e| panic!("{}: {e}", PathBuf::from(&path).display()));
    }
    assert!(failures.is_empty(), "corpus failures:\n{}", failures.join("\n"));
    // cells typed long enough found a worker prepared for them
    assert!(typed_cells > 0);
    assert!(
        prepared_cells * 10 >= typed_cells * 9,
        "only {prepared_cells} of {typed_cells} cells typed for 0.5 s or more ran on prepared workers"
    );
}
