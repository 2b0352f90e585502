//! From a cell's analysis and the session's definition history to its state closure.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{CellAnalysis, DefSummary, DeviceHint};

/// What the session knows about one live name: its latest definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NameInfo {
    /// The execution that last defined the name.
    pub version: Uuid,
    /// Set when the name is bound to a notebook-defined function or class.
    pub def: Option<DefSummary>,
    /// The value lives (at least partly) on a GPU.
    pub on_gpu: bool,
    /// The value is a module.
    pub is_module: bool,
}

/// The session's live names, each with its latest definition.
pub type History = BTreeMap<String, NameInfo>;

/// The variables (with versions) a cell needs restored.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Closure {
    /// Name to the version the cell must see.
    pub names: BTreeMap<String, Uuid>,
    /// `Some(reason)` when the closure is the whole history because the analysis could not
    /// be precise.
    pub conservative: Option<String>,
}

/// The state closure: the cell's reads found in the history, plus, transitively, the
/// global reads of the notebook-defined functions and classes in the closure.
pub fn resolve(analysis: &CellAnalysis, history: &History) -> Closure {
    let whole = |reason: String| Closure {
        names: history.iter().map(|(n, i)| (n.clone(), i.version)).collect(),
        conservative: Some(reason),
    };
    if let Some(reason) = &analysis.conservative {
        return whole(reason.clone());
    }
    // A definition that reaches names by computed strings: the cell that uses it
    // may need any name (a class whose `_repr_html_` calls `eval(name)`).
    let dynamic = |n: &str, d: &DefSummary| {
        d.dynamic.as_ref().map(|why| format!("uses {n}, which reaches names dynamically ({why})"))
    };
    // ... also one this cell defines and uses, directly or through its other definitions
    let mut seen = BTreeSet::new();
    let mut work: Vec<&String> = analysis.calls.iter().filter(|n| analysis.defs.contains_key(*n)).collect();
    while let Some(n) = work.pop() {
        let Some(d) = analysis.defs.get(n).filter(|_| seen.insert(n)) else { continue };
        if let Some(reason) = dynamic(n, d) {
            return whole(reason);
        }
        work.extend(d.global_reads.iter());
    }
    let mut names = BTreeMap::new();
    let mut work: Vec<&str> = Vec::new();
    // names spelled in the string arguments of a call to a definition that
    // evaluates them (the safety net would bring them in; up front is cheaper)
    let evaluates = |f: &String| {
        analysis.defs.get(f).or_else(|| history.get(f).and_then(|i| i.def.as_ref())).is_some_and(|d| d.evals)
    };
    let spelled = analysis.literal_args.iter().filter(|(f, _)| evaluates(f)).flat_map(|(_, names)| names);
    for n in analysis.reads.iter().chain(&analysis.builtin_reads).chain(spelled) {
        if let Some(info) = history.get(n) {
            if names.insert(n.clone(), info.version).is_none() {
                work.push(n);
            }
        }
    }
    while let Some(n) = work.pop() {
        let Some(def) = history.get(n).and_then(|i| i.def.as_ref()) else {
            continue;
        };
        if let Some(reason) = dynamic(n, def) {
            return whole(reason);
        }
        for g in &def.global_reads {
            if let Some(info) = history.get(g) {
                if !names.contains_key(g) {
                    names.insert(g.clone(), info.version);
                    work.push(g);
                }
            }
        }
    }
    Closure { names, conservative: None }
}

/// The names the cell may bind: its own writes plus the `global` writes of the functions
/// it calls, following calls transitively (this cell's definitions take precedence over
/// the history's).
pub fn cell_writes(analysis: &CellAnalysis, history: &History) -> BTreeSet<String> {
    let mut out = analysis.writes.clone();
    let mut seen: HashSet<&str> = HashSet::new();
    let mut work: Vec<&str> = analysis.calls.iter().map(String::as_str).collect();
    while let Some(n) = work.pop() {
        if !seen.insert(n) {
            continue;
        }
        let def = analysis.defs.get(n).or_else(|| history.get(n).and_then(|i| i.def.as_ref()));
        if let Some(def) = def {
            out.extend(def.global_writes.iter().cloned());
            work.extend(def.global_reads.iter().map(String::as_str));
        }
    }
    out
}

/// A GPU hint from the closure: a restored variable that lives on a GPU.
pub fn closure_device(closure: &Closure, history: &History) -> Option<DeviceHint> {
    closure
        .names
        .keys()
        .find(|n| history.get(*n).is_some_and(|i| i.on_gpu))
        .map(|n| DeviceHint::gpu(format!("closure variable {n} is on a GPU")))
}
