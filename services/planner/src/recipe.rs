//! From a cell's analysis and the session's committed manifest to a recipe: the
//! state closure with versions, the import closure, the device label and, for cells
//! that need unsavable variables, the worker that holds them.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};

use schemas::checkpoint::Manifest;
use schemas::messages::{ClosureVar, Device, PinnedWorker};

use crate::analysis::{self, CellAnalysis, DefKind, DefSummary, History, NameInfo};
use crate::state::{NameMeta, SessionState};

/// What the planner derives for one cell.
#[derive(Clone, Debug, PartialEq)]
pub struct Derived {
    /// State closure with versions.
    pub closure: Vec<ClosureVar>,
    /// Import closure.
    pub imports: Vec<String>,
    /// Device label.
    pub device: Device,
    /// GPU slots the cell needs on one host (0 for a CPU cell).
    pub gpus: u32,
    /// Why.
    pub device_reason: String,
    /// Why the closure is the whole namespace, if it is.
    pub conservative: Option<String>,
    /// The worker holding unsavable variables the cell needs.
    pub pinned: Option<PinnedWorker>,
    /// Names whose metadata this cell updates when it runs.
    pub writes: BTreeMap<String, NameMeta>,
}

impl Derived {
    /// A hash of what hosts act on (to publish only recipes that changed).
    pub fn fingerprint(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for v in &self.closure {
            v.name.hash(&mut h);
            v.version.hash(&mut h);
        }
        self.imports.hash(&mut h);
        self.device.as_str().hash(&mut h);
        self.gpus.hash(&mut h);
        self.pinned.as_ref().map(|p| (&p.host, &p.worker)).hash(&mut h);
        h.finish()
    }
}

/// The session's live names as the resolver sees them.
pub fn history(manifest: &Manifest, state: &SessionState) -> History {
    let mut history = History::new();
    for (name, var) in &manifest.variables {
        let meta = state.names.get(name);
        let on_gpu = meta.is_some_and(|m| m.on_gpu)
            || var.oid.as_ref().is_some_and(|o| {
                manifest.reachable([o.as_str()]).iter().any(|x| manifest.objects.get(x).is_some_and(|e| e.on_gpu))
            });
        // A def/class summary from the planner's analysis; else what the worker saw
        // a run-time callable (lambda, closure, partial) read.
        let def = meta.and_then(|m| m.def.clone()).or_else(|| {
            (!var.global_reads.is_empty()).then(|| DefSummary {
                kind: DefKind::Function,
                global_reads: var.global_reads.iter().cloned().collect(),
                global_writes: Default::default(),
                dynamic: None,
                evals: false,
            })
        });
        history.insert(name.clone(), NameInfo { version: var.version, def, on_gpu, is_module: var.module.is_some() });
    }
    for (name, u) in &manifest.unsavable {
        let meta = state.names.get(name);
        history.insert(
            name.clone(),
            NameInfo {
                version: u.version,
                def: meta.and_then(|m| m.def.clone()),
                on_gpu: meta.is_some_and(|m| m.on_gpu),
                is_module: false,
            },
        );
    }
    history
}

/// Names a GPU cell moves to the device: receivers of `.to(` and `.cuda(` calls.
fn moved_names(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for pat in [".to(", ".cuda("] {
        let mut rest = code;
        while let Some(i) = rest.find(pat) {
            let before = &rest[..i];
            let name: String = before.chars().rev().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let name: String = name.chars().rev().collect();
            if !name.is_empty() {
                out.insert(name);
            }
            rest = &rest[i + pat.len()..];
        }
    }
    out
}

/// Derive the recipe of `code` (already analysed) against `manifest`.
pub fn derive(
    analysis: &CellAnalysis,
    code: &str,
    manifest: &Manifest,
    state: &SessionState,
    all_gpu: bool,
    exec_id: uuid::Uuid,
    cell_id: &str,
) -> Derived {
    let history = history(manifest, state);
    // Notebook-defined classes always come along: pickle, torch.load and friends
    // look them up in __main__ by name, which no static read shows.
    let mut extra: Vec<String> = history
        .iter()
        .filter(|(n, i)| i.def.as_ref().is_some_and(|d| d.kind == DefKind::Class) && !analysis.reads.contains(*n))
        .map(|(n, _)| n.clone())
        .collect();
    // Names this cell's earlier runs reached that the closure missed.
    if let Some(faulted) = state.faulted.get(cell_id) {
        extra.extend(faulted.iter().filter(|n| history.contains_key(*n)).cloned());
    }
    // `Out[N]` is `_N`: a cell that reads the output history needs those names.
    if analysis.reads.contains("Out") || analysis.builtin_reads.contains("Out") {
        extra.extend(
            history
                .keys()
                .filter(|n| n.len() > 1 && n.starts_with('_') && n[1..].bytes().all(|b| b.is_ascii_digit()))
                .cloned(),
        );
    }
    let closure = if extra.is_empty() {
        analysis::resolve(analysis, &history)
    } else {
        let mut with_classes = analysis.clone();
        with_classes.reads.extend(extra);
        analysis::resolve(&with_classes, &history)
    };

    // only a `%%gpu N` override asks for more than one slot
    let (device, device_reason, gpus) = match (&analysis.device, all_gpu) {
        (Some(h), _) if h.reason.starts_with("override") => (to_device(h.label), h.reason.clone(), h.gpus),
        (_, true) => (Device::Gpu, "--all-gpu".to_string(), 1),
        (Some(h), false) => (to_device(h.label), h.reason.clone(), 1),
        (None, false) => match analysis::closure_device(&closure, &history) {
            Some(h) => (to_device(h.label), h.reason, 1),
            None if state.cuda_cells.contains(cell_id) => {
                (Device::Gpu, "the worker saw CUDA used the last time this cell ran".to_string(), 1)
            }
            None => (Device::Cpu, "no GPU sign in the cell or its closure".to_string(), 0),
        },
    };
    let gpus = if device == Device::Gpu { gpus.max(1) } else { 0 };

    let mut imports: BTreeSet<String> = analysis.imports.iter().filter(|m| !m.starts_with('.')).cloned().collect();
    for name in closure.names.keys() {
        if let Some(var) = manifest.variables.get(name) {
            if let Some(m) = &var.module {
                imports.insert(m.clone());
                let prefix = format!("{m}.");
                imports.extend(state.submodules.iter().filter(|s| s.starts_with(&prefix)).cloned());
            }
            if let Some(oid) = &var.oid {
                for o in manifest.reachable([oid.as_str()]) {
                    if let Some(obj) = manifest.objects.get(&o) {
                        imports.extend(
                            obj.modules.iter().filter(|m| !matches!(m.as_str(), "__main__" | "builtins")).cloned(),
                        );
                    }
                }
            }
        }
    }

    let mut pinned: Option<PinnedWorker> = None;
    for name in closure.names.keys() {
        if let Some(u) = manifest.unsavable.get(name) {
            match &mut pinned {
                Some(p) if p.worker == u.worker => p.names.push(name.clone()),
                Some(_) => {} // needs two pinned workers: the host reports the missing one
                None => {
                    pinned =
                        Some(PinnedWorker { host: u.host.clone(), worker: u.worker.clone(), names: vec![name.clone()] })
                }
            }
        }
    }
    // A session's unsavable state has one home (ADR 51): a GPU cell that reads none
    // of it still runs in the worker that holds it (the newest, should there be
    // several), so that what it makes that cannot be saved joins the rest instead
    // of leaving a second kept worker no later cell could run beside the first.
    // (CPU cells run on the session's CPU worker, itself kept for the session.)
    if pinned.is_none() && device == Device::Gpu {
        if let Some(u) = manifest.unsavable.values().max_by_key(|u| u.version) {
            pinned = Some(PinnedWorker { host: u.host.clone(), worker: u.worker.clone(), names: vec![] });
        }
    }

    // What this cell's run teaches us about the names it writes.
    // Only a static sign (a move to the device) makes values GPU-resident; a
    // placement override or --all-gpu says where the cell runs, not where its values live.
    let gpu_cell =
        analysis.device.as_ref().is_some_and(|h| h.label == analysis::Device::Gpu && !h.reason.starts_with("override"))
            || device_reason.contains("on a GPU");
    let moved = if gpu_cell { moved_names(code) } else { BTreeSet::new() };
    let mut writes = BTreeMap::new();
    for name in analysis::cell_writes(analysis, &history)
        .into_iter()
        .chain(moved.into_iter().filter(|n| history.contains_key(n)))
    {
        // rebinding without a def keeps no summary
        let def = analysis.defs.get(&name).cloned();
        writes.insert(name, NameMeta { exec_id, def, on_gpu: gpu_cell });
    }

    Derived {
        closure: closure.names.into_iter().map(|(name, version)| ClosureVar { name, version }).collect(),
        imports: imports.into_iter().collect(),
        device,
        gpus,
        device_reason,
        conservative: closure.conservative,
        pinned,
        writes,
    }
}

fn to_device(d: analysis::Device) -> Device {
    match d {
        analysis::Device::Gpu => Device::Gpu,
        analysis::Device::Cpu => Device::Cpu,
    }
}

#[cfg(test)]
mod tests {
    use schemas::checkpoint::{Unsavable, VarEntry};
    use uuid::Uuid;

    use super::*;

    fn manifest(names: &[&str]) -> Manifest {
        let mut m = Manifest::default();
        for n in names {
            m.variables.insert(
                n.to_string(),
                VarEntry { version: Uuid::now_v7(), oid: Some(format!("o{n}")), module: None, global_reads: vec![] },
            );
        }
        m
    }

    #[test]
    fn closure_follows_function_globals_and_versions() {
        let m = manifest(&["a", "b", "f", "unused"]);
        let mut state = SessionState::default();
        let def_cell = analysis::analyze("def f():\n    return a + 1\n");
        state
            .names
            .insert("f".into(), NameMeta { exec_id: Uuid::nil(), def: def_cell.defs.get("f").cloned(), on_gpu: false });
        let code = "x = f() + b";
        let d = derive(&analysis::analyze(code), code, &m, &state, false, Uuid::now_v7(), "c");
        let names: Vec<&str> = d.closure.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, vec!["a", "b", "f"]);
        assert_eq!(d.closure[0].version, m.variables["a"].version);
        assert_eq!(d.device, Device::Cpu);
        assert!(d.writes.contains_key("x"));
    }

    #[test]
    fn gpu_moves_taint_later_readers() {
        let m = manifest(&["model", "device", "X"]);
        let code = "model.to(device)\nX_gpu = X.to(device)";
        let a = analysis::analyze(code);
        let d = derive(&a, code, &m, &SessionState::default(), false, Uuid::now_v7(), "c");
        assert_eq!(d.device, Device::Gpu, "{}", d.device_reason);
        assert!(d.writes["model"].on_gpu && d.writes["X_gpu"].on_gpu);
        assert!(!d.writes.contains_key("device"));

        let mut state = SessionState::default();
        state.learn(&d.writes);
        let code2 = "for _ in range(3):\n    loss = model(X)\n";
        let d2 = derive(&analysis::analyze(code2), code2, &m, &state, false, Uuid::now_v7(), "c");
        assert_eq!(d2.device, Device::Gpu);
        assert!(d2.device_reason.contains("on a GPU"), "{}", d2.device_reason);
        let code3 = "print(device)";
        let d3 = derive(&analysis::analyze(code3), code3, &m, &state, false, Uuid::now_v7(), "c");
        assert_eq!(d3.device, Device::Cpu);
    }

    #[test]
    fn unsavable_names_pin_the_cell_to_their_worker() {
        let mut m = manifest(&["x"]);
        m.unsavable.insert(
            "gen".into(),
            Unsavable {
                version: Uuid::now_v7(),
                reason: "generator".into(),
                host: "h1".into(),
                worker: "w9".into(),
                cell_id: "c0".into(),
            },
        );
        let code = "y = next(gen) + x";
        let d = derive(&analysis::analyze(code), code, &m, &SessionState::default(), true, Uuid::now_v7(), "c");
        let p = d.pinned.expect("pinned");
        assert_eq!((p.host.as_str(), p.worker.as_str(), p.names.clone()), ("h1", "w9", vec!["gen".to_string()]));
        assert_eq!(d.device, Device::Gpu);
    }

    #[test]
    fn a_gpu_cell_reading_no_unsavable_state_runs_where_it_lives() {
        let mut m = manifest(&["x"]);
        let older = Uuid::now_v7();
        for (name, worker, version) in [("it", "w1", older), ("gen", "w2", Uuid::now_v7())] {
            let u = Unsavable {
                version,
                reason: "generator".into(),
                host: "h1".into(),
                worker: worker.into(),
                cell_id: "c0".into(),
            };
            m.unsavable.insert(name.into(), u);
        }
        let code = "y = x + 1";
        let d = derive(&analysis::analyze(code), code, &m, &SessionState::default(), true, Uuid::now_v7(), "c");
        let p = d.pinned.expect("a GPU cell goes to the kept worker");
        assert_eq!((p.worker.as_str(), p.names.is_empty()), ("w2", true), "the newest kept worker, no names");
        // a CPU cell stays on the session's CPU worker
        let d = derive(&analysis::analyze(code), code, &m, &SessionState::default(), false, Uuid::now_v7(), "c");
        assert_eq!(d.device, Device::Cpu);
        assert!(d.pinned.is_none());
        // without unsavable state nothing is pinned
        let d = derive(
            &analysis::analyze(code),
            code,
            &manifest(&["x"]),
            &SessionState::default(),
            true,
            Uuid::now_v7(),
            "c",
        );
        assert!(d.pinned.is_none());
    }

    #[test]
    fn run_time_callables_bring_the_globals_they_read() {
        let mut m = manifest(&["f", "k", "other"]);
        if let Some(f) = m.variables.get_mut("f") {
            f.global_reads = vec!["k".into()];
        }
        let code = "print(f(1))";
        let d = derive(&analysis::analyze(code), code, &m, &SessionState::default(), false, Uuid::now_v7(), "c");
        let names: Vec<&str> = d.closure.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, vec!["f", "k"]);
    }

    #[test]
    fn output_history_reads_bring_the_numbered_outputs() {
        let m = manifest(&["_3", "_7", "x"]);
        let code = "print(Out[3])";
        let d = derive(&analysis::analyze(code), code, &m, &SessionState::default(), false, Uuid::now_v7(), "c");
        let names: Vec<&str> = d.closure.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, vec!["_3", "_7"]);
    }

    #[test]
    fn notebook_classes_always_come_along() {
        let m = manifest(&["Model", "path", "other"]);
        let mut state = SessionState::default();
        let def = analysis::analyze("class Model:\n    pass\n");
        state.names.insert(
            "Model".into(),
            NameMeta { exec_id: Uuid::nil(), def: def.defs.get("Model").cloned(), on_gpu: false },
        );
        let code = "import torch\nmodel_new = torch.load(path)";
        let d = derive(&analysis::analyze(code), code, &m, &state, false, Uuid::now_v7(), "c");
        let names: Vec<&str> = d.closure.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, vec!["Model", "path"]);
    }

    #[test]
    fn a_restored_module_brings_the_submodules_the_session_imported() {
        let mut m = manifest(&["x"]);
        m.variables.insert(
            "sk".into(),
            VarEntry { version: Uuid::now_v7(), oid: None, module: Some("sklearn".into()), global_reads: vec![] },
        );
        let mut state = SessionState::default();
        state.submodules.extend([
            "sklearn.linear_model".to_string(),
            "sklearnx.other".to_string(),
            "os.path".to_string(),
        ]);
        let code = "print(sk.linear_model.__name__, x)";
        let d = derive(&analysis::analyze(code), code, &m, &state, false, Uuid::now_v7(), "c");
        assert_eq!(d.imports, vec!["sklearn".to_string(), "sklearn.linear_model".to_string()]);
    }

    #[test]
    fn names_a_cell_faulted_in_are_restored_up_front_next_time() {
        let m = manifest(&["show", "a", "b"]);
        let mut state = SessionState::default();
        let code = "show('a' + suffix)";
        let a = analysis::analyze(code);
        let names = |d: &Derived| d.closure.iter().map(|v| v.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&derive(&a, code, &m, &state, false, Uuid::now_v7(), "c3")), vec!["show"]);
        // the worker reported that the run reached `a` (and a name the session lost since)
        state.faulted.insert("c3".into(), ["a".to_string(), "gone".to_string()].into());
        assert_eq!(names(&derive(&a, code, &m, &state, false, Uuid::now_v7(), "c3")), vec!["a", "show"]);
        // only for that cell
        assert_eq!(names(&derive(&a, code, &m, &state, false, Uuid::now_v7(), "c4")), vec!["show"]);
    }

    #[test]
    fn a_cell_that_used_cuda_last_time_is_a_gpu_cell() {
        let m = manifest(&["x"]);
        let mut state = SessionState::default();
        state.cuda_cells.insert("c7".into());
        let code = "y = some_library_call(x)";
        let a = analysis::analyze(code);
        let d = derive(&a, code, &m, &state, false, Uuid::now_v7(), "c7");
        assert_eq!(d.device, Device::Gpu);
        assert!(d.device_reason.contains("CUDA"), "{}", d.device_reason);
        assert_eq!(derive(&a, code, &m, &state, false, Uuid::now_v7(), "c8").device, Device::Cpu);
    }

    #[test]
    fn overrides_and_conservative_cells() {
        let m = manifest(&["a", "b"]);
        let code = "%%cpu\nz = a";
        let d = derive(&analysis::analyze(code), code, &m, &SessionState::default(), true, Uuid::now_v7(), "c");
        assert_eq!((d.device, d.gpus), (Device::Cpu, 0));
        // `%%gpu N` asks for N slots; --all-gpu and signs in the code for one
        let code = "%%gpu 3\nz = a";
        let d3 = derive(&analysis::analyze(code), code, &m, &SessionState::default(), true, Uuid::now_v7(), "c");
        assert_eq!((d3.device, d3.gpus), (Device::Gpu, 3));
        let code = "z = a";
        let d1 = derive(&analysis::analyze(code), code, &m, &SessionState::default(), true, Uuid::now_v7(), "c");
        assert_eq!((d1.device, d1.gpus), (Device::Gpu, 1));
        assert_ne!(d3.fingerprint(), d1.fingerprint(), "hosts act on the slot count");
        let code = "exec('c = a')";
        let d = derive(&analysis::analyze(code), code, &m, &SessionState::default(), false, Uuid::now_v7(), "c");
        assert!(d.conservative.is_some());
        assert_eq!(d.closure.len(), 2, "whole namespace");
    }
}
