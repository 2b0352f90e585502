//! `looseleaf analyze`: the planner's static closures for a whole notebook, offline,
//! and `looseleaf bench-edits`: edit events per second through a running planner.
//!
//! `analyze` walks the notebook's code cells in order, as a session would run them,
//! keeping a simulated committed manifest and planner state: after each cell its
//! writes (`analysis::cell_writes`, as `recipe::derive` reports them) become live
//! names with a fresh version and their `def` summaries, and its deletes disappear.
//! Each cell's closure is derived exactly as the planner derives a run's recipe
//! (`recipe::derive`, which also brings notebook-defined classes along). With
//! `--time` it also measures, per cell, the analysis plus derivation in µs (the
//! median of repeated runs). `tools/closure_audit.py` gives the dynamic side;
//! `bench/analysis` compares the two.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use looseleaf_planner::analysis;
use looseleaf_planner::recipe::derive;
use looseleaf_planner::state::SessionState;
use schemas::checkpoint::{Manifest, VarEntry};
use schemas::messages::{EditV1, RecipeV3, SessionOptions};
use schemas::Bus;
use serde::Serialize;
use uuid::Uuid;

use crate::notebook;

/// One cell's static view.
#[derive(Debug, Serialize)]
pub struct CellReport {
    /// Index in the notebook's `cells`.
    pub index: usize,
    /// The cell's id.
    pub cell_id: String,
    /// Lines of code.
    pub lines: usize,
    /// The state closure (names only; versions are simulated).
    pub closure: Vec<String>,
    /// Why the closure is the whole namespace, if it is.
    pub conservative: Option<String>,
    /// Names live in the simulated session before the cell (modules included).
    pub history_size: usize,
    /// The live names before the cell.
    pub history: Vec<String>,
    /// Names the cell may bind.
    pub writes: Vec<String>,
    /// Names the cell may unbind.
    pub deletes: Vec<String>,
    /// Median µs of `analyze` + `derive` (with `--time`).
    pub time_us: Option<f64>,
}

/// The whole notebook.
#[derive(Debug, Serialize)]
pub struct NotebookReport {
    /// The notebook path.
    pub notebook: String,
    /// Per code cell, in order.
    pub cells: Vec<CellReport>,
}

/// Median µs of `f` over repeated runs (at least 5, and at least ~2 ms in all).
fn time_us(mut f: impl FnMut()) -> f64 {
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || (start.elapsed() < Duration::from_millis(2) && samples.len() < 1000) {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Static closures of every code cell of `path`, in order.
pub fn analyze_notebook(path: &Path, time: bool) -> anyhow::Result<NotebookReport> {
    let nb = notebook::load(path)?;
    let session = Uuid::now_v7();
    let mut manifest = Manifest::empty(session);
    let mut state = SessionState::default();
    let mut cells = Vec::new();
    for cell in notebook::code_cells(&nb) {
        let exec_id = Uuid::now_v7();
        let a = analysis::analyze(&cell.source);
        let d = derive(&a, &cell.source, &manifest, &state, false, exec_id, &cell.cell_id);
        let time_us = time.then(|| {
            time_us(|| {
                let a = analysis::analyze(&cell.source);
                std::hint::black_box(derive(&a, &cell.source, &manifest, &state, false, exec_id, &cell.cell_id));
            })
        });
        cells.push(CellReport {
            index: cell.index,
            cell_id: cell.cell_id.clone(),
            lines: cell.source.lines().count(),
            closure: d.closure.iter().map(|v| v.name.clone()).collect(),
            conservative: d.conservative.clone(),
            history_size: manifest.variables.len(),
            history: manifest.variables.keys().cloned().collect(),
            writes: d.writes.keys().cloned().collect(),
            deletes: a.deletes.iter().cloned().collect(),
            time_us,
        });
        // What the run commits: every written name gets this execution's version.
        for name in d.writes.keys() {
            manifest.variables.insert(
                name.clone(),
                VarEntry {
                    version: exec_id,
                    oid: Some(format!("{exec_id}/{name}")),
                    module: None,
                    global_reads: vec![],
                },
            );
        }
        state.names.extend(d.writes);
        for name in &a.deletes {
            manifest.variables.remove(name);
            state.names.remove(name);
        }
        manifest.revision += 1;
    }
    Ok(NotebookReport { notebook: path.display().to_string(), cells })
}

/// `looseleaf analyze`: print per-cell closures; write JSON with `--json`.
pub fn analyze_command(notebook: &Path, json: Option<&PathBuf>, time: bool) -> anyhow::Result<()> {
    let report = analyze_notebook(notebook, time)?;
    if let Some(out) = json {
        let text = serde_json::to_string_pretty(&report).context("while encoding the report")?;
        std::fs::write(out, text).with_context(|| format!("while writing {}", out.display()))?;
        return Ok(());
    }
    for c in &report.cells {
        let t = c.time_us.map(|t| format!(" {t:.1}µs")).unwrap_or_default();
        let cons = c.conservative.as_ref().map(|r| format!(" CONSERVATIVE ({r})")).unwrap_or_default();
        println!("[{}] live {}{t}{cons}: {}", c.index, c.history_size, c.closure.join(", "));
    }
    Ok(())
}

/// What `bench-edits` measured.
#[derive(Debug, Serialize)]
pub struct EditBench {
    /// Edits published.
    pub events: u64,
    /// Recipes received.
    pub recipes: u64,
    /// Seconds from the first publish to the last recipe.
    pub seconds: f64,
    /// Recipes per second.
    pub edit_events_per_sec: f64,
}

/// `looseleaf bench-edits`: publish `events` edits of one cell, each with different
/// imports (so every edit yields a new recipe), and time until all recipes arrived.
pub async fn bench_edits(nats_url: &str, prefix: &str, events: u64, json: Option<&PathBuf>) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    let bus = Bus::connect(nats_url, prefix, "looseleaf-bench-edits").await?;
    let session = Uuid::now_v7();
    let mut recipes = bus.subscribe::<RecipeV3>(bus.subjects().recipe(session)).await?.into_stream();
    bus.flush().await?;
    // Edits of different cells, so the planner's per-cell debounce merges none of them.
    let options = SessionOptions { cwd: String::new(), all_gpu: false, speculate: false };
    // A realistic cell body (a training step) plus a changing import.
    let body = "for epoch in range(epochs):\n    model.train()\n    y_pred = model(X_train)\n    loss = loss_fn(y_pred, y_train)\n    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n    if epoch % 10 == 0:\n        print(f\"Epoch: {epoch} | Loss: {loss}\")\n";
    // Wait until the planner answers (it may still be subscribing): one warm-up edit
    // every 100 ms, each with new imports, until a recipe comes back.
    let deadline = Instant::now() + Duration::from_secs(30);
    for attempt in 0u64.. {
        anyhow::ensure!(Instant::now() < deadline, "the planner sent no recipe within 30 s");
        let warm = EditV1 {
            session,
            cell_id: "warm".into(),
            code: format!("import warm_{attempt}"),
            seq: attempt,
            options: options.clone(),
        };
        bus.publish(bus.subjects().edit(session), &warm).await?;
        if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), recipes.next()).await {
            break;
        }
    }
    // Drain late warm-up recipes.
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(300), recipes.next()).await {}
    let start = Instant::now();
    let publisher = {
        let bus = bus.clone();
        tokio::spawn(async move {
            let options = options.clone();
            for i in 0..events {
                let code = format!("import mod_{i}\n{body}");
                let e = EditV1 { session, cell_id: format!("c{i}"), code, seq: i + 1, options: options.clone() };
                bus.publish(bus.subjects().edit(session), &e).await?;
            }
            bus.flush().await?;
            anyhow::Ok(())
        })
    };
    let mut got = 0u64;
    let mut last = start;
    while got < events {
        match tokio::time::timeout(Duration::from_secs(10), recipes.next()).await {
            Ok(Some(Ok(_))) => {
                got += 1;
                last = Instant::now();
            }
            Ok(Some(Err(e))) => anyhow::bail!("undecodable recipe: {:?}", e.error),
            Ok(None) => break,
            Err(_) => break, // lost or dropped recipes: report what arrived
        }
    }
    publisher.await.context("while publishing")??;
    let seconds = (last - start).as_secs_f64();
    let r = EditBench { events, recipes: got, seconds, edit_events_per_sec: got as f64 / seconds.max(1e-9) };
    let text = serde_json::to_string_pretty(&r).context("while encoding")?;
    match json {
        Some(out) => std::fs::write(out, text).with_context(|| format!("while writing {}", out.display()))?,
        None => println!("{text}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_history_versions_and_closures() {
        let dir = tempfile::tempdir().expect("tempdir");
        let nb = serde_json::json!({
            "nbformat": 4, "nbformat_minor": 5, "metadata": {},
            "cells": [
                {"cell_type": "code", "metadata": {}, "outputs": [], "source": "a = 1\nb = 2\ndef f():\n    return a\n"},
                {"cell_type": "code", "metadata": {}, "outputs": [], "source": "y = f() + 1\ndel b\n"},
                {"cell_type": "code", "metadata": {}, "outputs": [], "source": "print(y, b)\n"},
            ]
        });
        let path = dir.path().join("t.ipynb");
        std::fs::write(&path, nb.to_string()).expect("write");
        let r = analyze_notebook(&path, true).expect("analyze");
        assert_eq!(r.cells[1].closure, vec!["a", "b", "f"], "del b needs b");
        assert_eq!(r.cells[1].history_size, 3);
        assert_eq!(r.cells[2].closure, vec!["y"], "b was deleted");
        assert!(r.cells.iter().all(|c| c.time_us.is_some()));
    }
}
