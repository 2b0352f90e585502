//! What each step costs. LooseLeaf's steps are measured: drawn from the samples in
//! the bench results files (cold-start, checkpoint, JupyterLab; the repository's
//! own are compiled in, so no file is read from the working directory) or from the
//! REPORT.json files of real runs. The baselines' steps are the constants cited in
//! `../shared/anchors/` (NotebookOS's simulator, the snapshot restore medians),
//! compiled in as constants: nothing is read from there.

use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use crate::dist::Samples;

/// Step costs.
#[derive(Clone, Debug, Serialize)]
pub struct Costs {
    /// LooseLeaf: Run to first line on a worker prepared before Run (ms).
    pub hit_start_ms: Samples,
    /// LooseLeaf: Run to first line of a cold cell whose packages the zygote holds
    /// and whose closure is small (ms): claim, fork, restore, set-up, bus hops.
    pub cold_start_ms: Samples,
    /// Importing packages a zygote lacks in a fresh process (ms): the import tail.
    pub import_tail_ms: Samples,
    /// Naive serverless: a fresh interpreter, all the session's imports and its
    /// state loaded (ms), before the state's bytes are counted.
    pub naive_start_ms: Samples,
    /// Restoring checkpointed state, bytes a second.
    pub restore_bytes_per_s: f64,
    /// Saving state, bytes a second.
    pub save_bytes_per_s: f64,
    /// Cited: host-to-GPU copy, bytes a second (NotebookOS's simulator, V100/P3).
    pub host_to_gpu_bytes_per_s: f64,
    /// Cited: CUDA initialisation in a fresh process (s).
    pub cuda_init_s: f64,
    /// Cited: object-store download for NotebookOS replicas, bytes a second.
    pub s3_down_bytes_per_s: f64,
    /// Cited: object-store upload after a NotebookOS execution, bytes a second.
    pub s3_up_bytes_per_s: f64,
    /// Cited: whole-process GPU snapshot restore, GCR median (s).
    pub snapshot_gcr_s: f64,
    /// Cited: the same with CRIU (s).
    pub snapshot_criu_s: f64,
    /// Where the measured figures came from.
    pub sources: Vec<String>,
}

/// The cited constants (workloads.md and notebookos-policies.md).
const H2D: f64 = 11.1e9;
const CUDA_INIT_S: f64 = 0.174;
const S3_DOWN: f64 = 300e6;
const S3_UP: f64 = 75e6;
const GCR_S: f64 = 2.50;
const CRIU_S: f64 = 4.38;

/// The bench results files the measured costs come from.
const BENCH_FILES: [&str; 3] = ["cold-start.json", "checkpoint.json", "jupyterlab.json"];

/// The repository's own bench results, compiled in: the default costs hold
/// wherever `looseleaf simulate` is started.
const BUILT_IN: [(&str, &str); 3] = [
    ("cold-start.json", include_str!("../../bench/results/cold-start.json")),
    ("checkpoint.json", include_str!("../../bench/results/checkpoint.json")),
    ("jupyterlab.json", include_str!("../../bench/results/jupyterlab.json")),
];

fn read(dir: &Path, name: &str) -> anyhow::Result<serde_json::Value> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

fn at<'a>(v: &'a serde_json::Value, pointer: &str, file: &str) -> anyhow::Result<&'a serde_json::Value> {
    v.pointer(pointer).with_context(|| format!("{file} has no {pointer}"))
}

fn list<'a>(v: &'a serde_json::Value, pointer: &str, file: &str) -> anyhow::Result<&'a Vec<serde_json::Value>> {
    at(v, pointer, file)?.as_array().with_context(|| format!("{file}: {pointer} is not a list"))
}

fn number(v: &serde_json::Value, pointer: &str, file: &str) -> anyhow::Result<f64> {
    at(v, pointer, file)?.as_f64().with_context(|| format!("{file}: {pointer} is not a number"))
}

fn samples(
    items: &[serde_json::Value],
    keep: impl Fn(&serde_json::Value) -> bool,
    value: &str,
    source: String,
) -> anyhow::Result<Samples> {
    let values: Vec<f64> = items.iter().filter(|c| keep(c)).filter_map(|c| c.pointer(value)?.as_f64()).collect();
    anyhow::ensure!(!values.is_empty(), "{source}: no samples");
    Ok(Samples::new(values, source))
}

impl Costs {
    /// Costs from the bench results in `dir` (a `bench/results` of one's own).
    pub fn from_bench(dir: &Path) -> anyhow::Result<Self> {
        anyhow::ensure!(
            dir.is_dir(),
            "{} is not a directory of bench results (it should hold {})",
            dir.display(),
            BENCH_FILES.join(", ")
        );
        let [cold, ckpt, lab] = BENCH_FILES.map(|name| read(dir, name));
        let sources = BENCH_FILES.map(|name| dir.join(name).display().to_string());
        Self::from_results(cold?, ckpt?, lab?, sources.into())
    }

    /// Costs from the repository's bench results as this build compiled them in
    /// (`bench/results` when it was built).
    pub fn built_in() -> anyhow::Result<Self> {
        let [cold, ckpt, lab] = BUILT_IN.map(|(name, text)| {
            serde_json::from_str::<serde_json::Value>(text)
                .with_context(|| format!("the built-in bench/results/{name} is not JSON"))
        });
        let sources = BUILT_IN.map(|(name, _)| format!("bench/results/{name} (built in)"));
        Self::from_results(cold?, ckpt?, lab?, sources.into())
    }

    /// Costs from the three results files (cold-start, checkpoint, JupyterLab).
    fn from_results(
        cold: serde_json::Value,
        ckpt: serde_json::Value,
        lab: serde_json::Value,
        sources: Vec<String>,
    ) -> anyhow::Result<Self> {
        let cells = list(&cold, "/looseleaf/cells", "cold-start.json")?;
        let naive = list(&cold, "/naive/cells", "cold-start.json")?;
        let lab_cells = list(&lab, "/cells_extension", "jupyterlab.json")?;
        let ok = |c: &serde_json::Value| c.get("status").and_then(|s| s.as_str()).is_none_or(|s| s == "ok");
        Ok(Self {
            hit_start_ms: samples(
                lab_cells,
                |c| ok(c) && c.get("prepare").and_then(|p| p.as_str()) == Some("speculative"),
                "/start_delay_ms",
                "jupyterlab.json: cells_extension[prepare=speculative].start_delay_ms".into(),
            )?,
            cold_start_ms: samples(
                cells,
                ok,
                "/start_delay_ms",
                "cold-start.json: looseleaf.cells[].start_delay_ms".into(),
            )?,
            import_tail_ms: samples(
                naive,
                |_| true,
                "/breakdown/imports_ms",
                "cold-start.json: naive.cells[].breakdown.imports_ms".into(),
            )?,
            naive_start_ms: samples(naive, |_| true, "/start_ms", "cold-start.json: naive.cells[].start_ms".into())?,
            restore_bytes_per_s: number(&ckpt, "/local/raw/restore_all_bytes_per_s", "checkpoint.json")?,
            save_bytes_per_s: number(&ckpt, "/local/raw/save_bytes_per_s", "checkpoint.json")?,
            host_to_gpu_bytes_per_s: H2D,
            cuda_init_s: CUDA_INIT_S,
            s3_down_bytes_per_s: S3_DOWN,
            s3_up_bytes_per_s: S3_UP,
            snapshot_gcr_s: GCR_S,
            snapshot_criu_s: CRIU_S,
            sources,
        })
    }

    /// The same, with LooseLeaf's start costs measured in the given REPORT.json
    /// files instead, where they hold samples: the start delays of clean
    /// speculation hits and of cold starts, from their claim on. What came before
    /// the claim (`phases.claim_ms`: the placement delay, waiting for a slot or for
    /// a preparation to finish) held no slot, and the simulator plays those waits
    /// with the host's own core: counted in the cost, it held a slot through them.
    pub fn with_reports(mut self, reports: &[(String, serde_json::Value)]) -> Self {
        let mut hits = Vec::new();
        let mut colds = Vec::new();
        for (_, r) in reports {
            for c in r.get("cells").and_then(|c| c.as_array()).into_iter().flatten() {
                let gpu = c.get("device").and_then(|d| d.as_str()).is_some_and(|d| d != "cpu");
                let Some(delay) = c.get("start_delay_ms").and_then(|d| d.as_f64()) else { continue };
                let claim = c.pointer("/phases/claim_ms").and_then(|d| d.as_f64()).unwrap_or(0.0);
                let delay = (delay - claim).max(0.0);
                if !gpu || c.get("status").and_then(|s| s.as_str()) != Some("ok") {
                    continue;
                }
                match c.get("prepare").and_then(|p| p.as_str()) {
                    Some("speculative") if c.get("refreshed").and_then(|r| r.as_u64()) == Some(0) => hits.push(delay),
                    Some("cold") => colds.push(delay),
                    _ => {}
                }
            }
        }
        let files: Vec<&str> = reports.iter().map(|(p, _)| p.as_str()).collect();
        if !hits.is_empty() {
            self.hit_start_ms = Samples::new(hits, format!("reports {files:?}: speculation hits' start_delay_ms"));
        }
        if !colds.is_empty() {
            self.cold_start_ms = Samples::new(colds, format!("reports {files:?}: cold cells' start_delay_ms"));
        }
        self.sources.extend(files.iter().map(|f| f.to_string()));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The costs `looseleaf simulate` uses by default come with the binary and
    /// hold samples, and a results directory of one's own gives the same costs.
    #[test]
    fn the_built_in_costs_are_the_repositorys_bench_results() {
        let built_in = Costs::built_in().unwrap();
        assert!(!built_in.hit_start_ms.values.is_empty() && !built_in.cold_start_ms.values.is_empty());
        assert!(built_in.sources.iter().all(|s| s.ends_with("(built in)")), "{:?}", built_in.sources);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results");
        let read = Costs::from_bench(&dir).unwrap();
        assert_eq!(read.cold_start_ms.values, built_in.cold_start_ms.values);
        assert_eq!(read.restore_bytes_per_s, built_in.restore_bytes_per_s);
    }

    #[test]
    fn a_reports_start_costs_begin_at_the_claim() {
        let cell = |prepare: &str, delay: f64, claim: f64| {
            serde_json::json!({"device": "gpu", "status": "ok", "prepare": prepare, "refreshed": 0,
                "start_delay_ms": delay, "phases": {"claim_ms": claim}})
        };
        // a hit that waited 7 s for its preparation before it was claimed, a hit
        // without phases, a cold start that waited 2 s for a slot
        let report = serde_json::json!({"cells": [
            cell("speculative", 7413.0, 7026.0), {"device": "gpu", "status": "ok", "prepare": "speculative",
            "refreshed": 0, "start_delay_ms": 6.0}, cell("cold", 2500.0, 2000.0)]});
        let costs = Costs::built_in().unwrap().with_reports(&[("r.json".into(), report)]);
        let hits = &costs.hit_start_ms.values;
        assert_eq!(hits.len(), 2);
        assert!(hits.iter().any(|h| (h - 387.0).abs() < 1e-9) && hits.contains(&6.0), "{hits:?}");
        assert_eq!(costs.cold_start_ms.values, vec![500.0]);
    }

    #[test]
    fn a_missing_results_directory_is_named() {
        let err = Costs::from_bench(Path::new("/nonexistent/bench/results")).err().map(|e| format!("{e:#}"));
        let err = err.unwrap_or_default();
        assert!(err.contains("/nonexistent/bench/results") && err.contains("cold-start.json"), "{err}");
    }
}
