//! Resolving a cell's reads against the session history into its state closure.

use std::collections::BTreeSet;

use looseleaf_planner::analysis::{
    analyze, cell_writes, closure_device, resolve, DefKind, DefSummary, Device, History, NameInfo,
};
use uuid::Uuid;

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn var(history: &mut History, name: &str) -> Uuid {
    let version = Uuid::new_v4();
    history.insert(name.to_string(), NameInfo { version, def: None, on_gpu: false, is_module: false });
    version
}

fn func(history: &mut History, name: &str, reads: &[&str], writes: &[&str]) -> Uuid {
    let version = Uuid::new_v4();
    let def = DefSummary {
        kind: DefKind::Function,
        global_reads: set(reads),
        global_writes: set(writes),
        dynamic: None,
        evals: false,
    };
    history.insert(name.to_string(), NameInfo { version, def: Some(def), on_gpu: false, is_module: false });
    version
}

fn names(c: &looseleaf_planner::analysis::Closure) -> BTreeSet<String> {
    c.names.keys().cloned().collect()
}

#[test]
fn reads_intersect_history() {
    let mut h = History::new();
    let x = var(&mut h, "x");
    var(&mut h, "unused");
    let c = resolve(&analyze("y = x + not_defined_anywhere"), &h);
    assert_eq!(names(&c), set(&["x"]));
    assert_eq!(c.names["x"], x);
    assert_eq!(c.conservative, None);
}

#[test]
fn functions_pull_in_their_globals_transitively() {
    let mut h = History::new();
    func(&mut h, "train", &["model", "helper", "lr"], &[]);
    func(&mut h, "helper", &["scale"], &[]);
    var(&mut h, "model");
    var(&mut h, "lr");
    var(&mut h, "scale");
    var(&mut h, "other");
    let c = resolve(&analyze("loss = train(batch)"), &h);
    assert_eq!(names(&c), set(&["helper", "lr", "model", "scale", "train"]));
}

#[test]
fn functions_defined_in_the_cell_contribute_their_reads() {
    let mut h = History::new();
    func(&mut h, "helper", &["scale"], &[]);
    var(&mut h, "scale");
    var(&mut h, "w");
    let c = resolve(&analyze("def g(v):\n    return helper(v) * w\nout = g(1)"), &h);
    assert_eq!(names(&c), set(&["helper", "scale", "w"]));
}

#[test]
fn shadowed_builtins_are_found() {
    let mut h = History::new();
    var(&mut h, "input");
    let c = resolve(&analyze("out = model(input)"), &h);
    assert_eq!(names(&c), set(&["input"]));
}

#[test]
fn conservative_cells_take_the_whole_history() {
    let mut h = History::new();
    var(&mut h, "a");
    var(&mut h, "b");
    let c = resolve(&analyze("exec(src)"), &h);
    assert_eq!(names(&c), set(&["a", "b"]));
    assert_eq!(c.conservative.as_deref(), Some("exec() at line 1"));
}

#[test]
fn cell_writes_follow_global_writes_of_called_functions() {
    let mut h = History::new();
    func(&mut h, "bump", &["counter", "log_it"], &["counter"]);
    func(&mut h, "log_it", &[], &["last_log"]);
    func(&mut h, "never_called", &[], &["zzz"]);
    let a = analyze("r = bump()");
    assert_eq!(cell_writes(&a, &h), set(&["counter", "last_log", "r"]));
    // a function defined and called in the same cell
    let a = analyze("def reset():\n    global state\n    state = None\nreset()");
    assert_eq!(cell_writes(&a, &h), set(&["reset", "state"]));
}

#[test]
fn gpu_closure_variables_hint_the_device() {
    let mut h = History::new();
    var(&mut h, "x");
    h.insert("model".into(), NameInfo { version: Uuid::new_v4(), def: None, on_gpu: true, is_module: false });
    let c = resolve(&analyze("y = model(x)"), &h);
    let hint = closure_device(&c, &h);
    assert_eq!(hint.as_ref().map(|d| d.label), Some(Device::Gpu));
    let c = resolve(&analyze("y = x + 1"), &h);
    assert_eq!(closure_device(&c, &h), None);
}

#[test]
fn a_definition_that_reads_names_dynamically_makes_its_users_conservative() {
    // a helper that looks names up in the namespace dict: nothing can intercept that
    let def = analyze("def fetch(*names):\n    ns = globals()\n    return [ns[n] for n in names]");
    let summary = def.defs["fetch"].clone();
    assert_eq!(summary.dynamic.as_deref(), Some("globals() at line 2"));
    // defining it is not conservative: the body does not run
    assert_eq!(def.conservative, None);

    let mut h = History::new();
    let x = var(&mut h, "x");
    h.insert("fetch".into(), NameInfo { version: Uuid::new_v4(), def: Some(summary), on_gpu: false, is_module: false });
    let c = resolve(&analyze("fetch('x')"), &h);
    assert_eq!(names(&c), set(&["fetch", "x"]));
    assert_eq!(c.names["x"], x);
    assert!(c.conservative.as_deref().is_some_and(|r| r.starts_with("uses fetch")), "{c:?}");
    // a cell that does not use it stays precise
    let c = resolve(&analyze("y = 1"), &h);
    assert!(c.names.is_empty() && c.conservative.is_none());
    // a dynamic definition used in its own cell, through another one
    let c =
        resolve(&analyze("def get(n):\n    return globals()[n]\ndef twice(n):\n    return 2 * get(n)\ntwice('x')"), &h);
    assert!(c.conservative.as_deref().is_some_and(|r| r.starts_with("uses get")), "{c:?}");
}

#[test]
fn a_definition_that_evaluates_its_arguments_reads_the_names_they_spell() {
    // the display helper of a real notebook: `_repr_html_` evaluates the names given
    let def = analyze(
        "class display:\n    def __init__(self, *args):\n        self.args = args\n    def _repr_html_(self):\n        return ''.join(str(eval(a)) for a in self.args)",
    );
    let summary = def.defs["display"].clone();
    assert!(summary.evals && summary.dynamic.is_none(), "{summary:?}");
    assert_eq!(def.conservative, None);
    let mut h = History::new();
    for n in ["x", "y", "pd", "unused"] {
        var(&mut h, n);
    }
    h.insert(
        "display".into(),
        NameInfo { version: Uuid::new_v4(), def: Some(summary), on_gpu: false, is_module: false },
    );
    // precise: what the literals spell, no more (the worker's safety net covers the rest)
    let c = resolve(&analyze("display('x', \"pd.concat([x, y], keys=['x', 'y'])\")"), &h);
    assert_eq!(names(&c), set(&["display", "pd", "x", "y"]));
    assert_eq!(c.conservative, None);
    // literals passed to a function that does not evaluate them are just strings
    func(&mut h, "label", &[], &[]);
    let c = resolve(&analyze("label('x')"), &h);
    assert_eq!(names(&c), set(&["label"]));
}

#[test]
fn pandas_expressions_read_the_names_they_reference() {
    let mut h = History::new();
    for n in ["df", "limit", "a", "b", "pd"] {
        var(&mut h, n);
    }
    let c = resolve(&analyze("df.query('x > @limit and y < 3')"), &h);
    assert_eq!(names(&c), set(&["df", "limit"]));
    let c = resolve(&analyze("pd.eval('a + b')"), &h);
    assert_eq!(names(&c), set(&["a", "b", "pd"]));
}

#[test]
fn top_level_dynamic_access_is_conservative() {
    for code in [
        "for i in range(3):\n    globals()[f'v{i}'] = i",
        "total = sum(globals()[f'v{i}'] for i in range(3))",
        "exec(src)",
    ] {
        assert!(analyze(code).conservative.is_some(), "{code}");
    }
    assert_eq!(analyze("def f(v):\n    return vars(v)").conservative, None);
}
