//! IPython syntax in cells: magics, shell escapes, help, LooseLeaf's device overrides.

use std::collections::BTreeSet;

use looseleaf_planner::analysis::{analyze, CellAnalysis, Device};

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[track_caller]
fn rw(code: &str, reads: &[&str], writes: &[&str]) -> CellAnalysis {
    let a = analyze(code);
    assert_eq!(a.reads, set(reads), "reads of {code:?}: {a:#?}");
    assert_eq!(a.writes, set(writes), "writes of {code:?}: {a:#?}");
    assert_eq!(a.conservative, None, "conservative for {code:?}");
    a
}

#[test]
fn time_magics_analyze_their_python() {
    rw("%time x = f(y)", &["f", "y"], &["x"]);
    rw("%prun -s cumtime -l 10 r = run(cfg)", &["cfg", "run"], &["r"]);
    rw("%debug out = g(a)", &["a", "g"], &["out"]);
    // %timeit compiles the statement into a function: it reads but does not bind
    rw("%timeit -n 10 -r3 z = model(batch)", &["batch", "model"], &[]);
    rw("x = 1\n%time y = x + w", &["w"], &["x", "y"]);
}

#[test]
fn python_cell_magics_analyze_the_body() {
    rw("%%time\nx = f(y)\nprint(x)", &["f", "y"], &["x"]);
    rw("%%capture out\nr = train(m)", &["m", "train"], &["out", "r"]);
    rw("%%capture --no-stderr cap\nr = 1", &[], &["cap", "r"]);
    rw("%%timeit -n 5 setup = prep(a)\nres = work(setup, b)", &["a", "b", "prep", "work"], &[]);
}

#[test]
fn non_python_cell_magics_read_nothing() {
    for magic in ["bash", "sh", "html", "javascript", "latex", "markdown", "svg"] {
        rw(&format!("%%{magic}\necho $x {{y}} <b>z</b>"), &[], &[]);
    }
    rw("%%writefile script.py\nimport os\nprint(secret)", &[], &[]);
}

#[test]
fn shell_escapes_interpolate() {
    rw("!ls {path}", &["path"], &[]);
    rw("!echo $name $$HOME ${brace}", &["brace", "name"], &[]);
    rw("!cp $src.file {dst + '/x'}", &["dst", "src"], &[]);
    rw("files = !ls {d}", &["d"], &["files"]);
    rw("x = !ls", &[], &["x"]);
    rw("!!pwd", &[], &[]);
    rw("!pip install torch", &[], &[]);
}

#[test]
fn help_reads_the_object() {
    rw("obj?", &["obj"], &[]);
    rw("obj.method??", &["obj"], &[]);
    rw("?thing", &["thing"], &[]);
}

#[test]
fn inert_and_unknown_line_magics() {
    for line in [
        "%matplotlib inline",
        "%config InlineBackend.figure_format = 'retina'",
        "%load_ext autoreload",
        "%autoreload 2",
        "%pip install numpy",
        "%env CUDA_VISIBLE_DEVICES=0",
        "%precision 3",
        "%alias say echo said %s",
    ] {
        rw(line, &[], &[]);
    }
    rw("%cd {folder}", &["folder"], &[]);
    rw("%cd data", &[], &[]);
}

#[test]
fn magics_the_notebook_registers_read_their_function_and_named_variables() {
    // `@register_line_magic def seed(line)` binds `seed`; `%tensorinfo x w` looks up
    // the variables it names. Reads resolve only against names the session defined.
    rw("%seed 42", &["seed"], &[]);
    rw("%tensorinfo x w.T, y", &["tensorinfo", "w", "x", "y"], &[]);
    rw("%%hparams cfg\nlr = 0.1\nepochs = 3", &["cfg", "hparams"], &["cfg"]);
    rw("%show {label} $n", &["label", "n", "show"], &[]);
}

#[test]
fn magics_mixed_with_python() {
    let a = rw("import numpy as np\n%matplotlib inline\nx = np.zeros(n)\n!echo {x}", &["n"], &["np", "x"]);
    assert_eq!(a.imports, set(&["numpy"]));
}

#[test]
fn device_overrides() {
    let a = rw("%%gpu\nx = f(y)", &["f", "y"], &["x"]);
    let hint = a.device.unwrap_or_else(|| panic!("no device"));
    assert_eq!(hint.label, Device::Gpu);
    assert_eq!(hint.reason, "override %%gpu");
    let a = rw("%%cpu\nm = model.cuda()", &["model"], &["m"]);
    assert_eq!(a.device.map(|d| d.label), Some(Device::Cpu));
    let a = rw("%%gpu\n%%time\nr = g()", &["g"], &["r"]);
    assert_eq!(a.device.map(|d| d.label), Some(Device::Gpu));
    // not the first line: not an override
    assert!(analyze("x = 1\n%%gpu\n").device.is_none());
}

#[test]
fn a_gpu_override_may_ask_for_several_gpus() {
    let one = analyze("%%gpu\nx = 1").device.unwrap_or_else(|| panic!("no device"));
    assert_eq!((one.label, one.gpus), (Device::Gpu, 1));
    let a = rw("%%gpu 4\nx = f(y)", &["f", "y"], &["x"]);
    let four = a.device.unwrap_or_else(|| panic!("no device"));
    assert_eq!((four.label, four.gpus, four.reason.as_str()), (Device::Gpu, 4, "override %%gpu 4"));
    let a = rw("%%gpu 2\n%%time\nr = g()", &["g"], &["r"]);
    assert_eq!(a.device.map(|d| d.gpus), Some(2));
    // malformed: no placement, and the body is not read (the worker's `%%gpu`
    // magic fails the cell saying what is allowed)
    for code in ["%%gpu 0\nx = y", "%%gpu two\nx = y", "%%gpu 2 3\nx = y", "%%cpu 2\nx = y", "%%gpu -1\nx = y"] {
        let a = analyze(code);
        assert!(a.device.is_none(), "{code}: {:?}", a.device);
        assert!(a.reads.is_empty() && a.writes.is_empty(), "{code}: {:?} {:?}", a.reads, a.writes);
    }
}

#[test]
fn parse_error_line_counts_the_magic_line() {
    let a = analyze("%%time\nx = 1\ny = (\n");
    let reason = a.conservative.unwrap_or_default();
    assert!(reason.starts_with("parse error at line 3"), "{reason}");
}
