//! Property tests: the analysis never panics, and reads name text from the cell.

use looseleaf_planner::analysis::analyze;
use proptest::prelude::*;

fn check(code: &str) {
    let a = analyze(code);
    for name in a.reads.iter().chain(&a.writes).chain(&a.builtin_reads) {
        assert!(!name.is_empty());
        // Python NFKC-normalizes identifiers (so does ruff): only ASCII text is verbatim.
        if code.is_ascii() {
            assert!(code.contains(name.as_str()), "{name:?} not in {code:?}");
        }
    }
}

/// Small Python-ish programs built from a grammar of common statements.
fn python() -> impl Strategy<Value = String> {
    let name = prop::sample::select(vec!["a", "b", "x", "y", "f", "g", "df", "model", "i"]);
    let expr = (name.clone(), name.clone(), 0..12usize).prop_map(|(p, q, k)| match k {
        0 => format!("{p} + {q}"),
        1 => format!("{p}({q})"),
        2 => format!("[{p} for {p} in {q}]"),
        3 => format!("lambda {p}: {p} * {q}"),
        4 => format!("({p} := {q})"),
        5 => format!("{p}.{q}"),
        6 => format!("{{{p}: {q} for {q} in range({p})}}"),
        7 => format!("f\"{{{p}}}\""),
        8 => format!("{p} if {q} else 0"),
        9 => format!("{p}.to(device)"),
        10 => format!("{p}[{q}]"),
        _ => p.to_string(),
    });
    let stmt = (name.clone(), expr.clone(), expr, 0..14usize).prop_map(|(n, e, e2, k)| match k {
        0 => format!("{n} = {e}"),
        1 => format!("{n} += {e}"),
        2 => format!("def {n}({n}=1):\n    global x\n    x = {e}\n    return {e2}"),
        3 => format!("class {n}:\n    v = {e}\n    def m(self):\n        return {e2}"),
        4 => format!("for {n} in {e}:\n    {n} = {e2}"),
        5 => format!("if {e}:\n    {n} = 1\nelse:\n    del {n}"),
        6 => format!("try:\n    {n} = {e}\nexcept E as {n}:\n    pass"),
        7 => format!("with {e} as {n}:\n    pass"),
        8 => format!("match {e}:\n    case [{n}, *rest]:\n        pass\n    case _:\n        pass"),
        9 => format!("!ls {{{n}}} ${n}"),
        10 => format!("%time {n} = {e}"),
        11 => format!("import {n}.sub as {n}"),
        12 => format!("{n}?"),
        _ => e,
    });
    prop::collection::vec(stmt, 0..8).prop_map(|stmts| stmts.join("\n"))
}

#[test]
fn ruff_parser_panics_are_contained() {
    // ruff_python_parser 0.0.10 hits an `unreachable!` on this input in IPython mode.
    let a = analyze("[)'\n,");
    assert!(a.conservative.is_some_and(|r| r.starts_with("parse error at line ")));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_strings_never_panic(code in any::<String>()) {
        check(&code);
    }

    #[test]
    fn python_like_noise_never_panics(code in "[a-z_ %!?${}()\\[\\]:=.,*\n\"'#@-]{0,80}") {
        check(&code);
    }

    #[test]
    fn generated_python_never_panics(code in python()) {
        check(&code);
        // Prefixing a cell magic keeps it working too.
        check(&format!("%%time\n{code}"));
        check(&format!("%%gpu\n{code}"));
    }
}
