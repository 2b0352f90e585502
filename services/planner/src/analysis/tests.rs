//! Unit tests of the scoping rules: exact read and write sets per construct.

use std::collections::BTreeSet;

use super::{analyze, CellAnalysis, DefKind};

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
fn assignment_and_sequencing() {
    rw("x = y + 1\nz = x * 2", &["y"], &["x", "z"]);
    rw("a, (b, *c) = d", &["d"], &["a", "b", "c"]);
    rw("x.attr = v\ny[k] = w", &["k", "v", "w", "x", "y"], &[]);
    rw("print(len(q))", &["q"], &[]);
}

#[test]
fn augmented_assignment_reads_and_writes() {
    rw("x += 1", &["x"], &["x"]);
    rw("x = 0\nx += y", &["y"], &["x"]);
    rw("obj.n += k", &["k", "obj"], &[]);
}

#[test]
fn annotated_assignment() {
    rw("x: int = y", &["y"], &["x"]);
    rw("x: MyType", &["MyType"], &[]);
    rw("from __future__ import annotations\nx: MyType = 1", &[], &["annotations", "x"]);
}

#[test]
fn comprehensions_have_their_own_scope() {
    rw("[x for x in y if x > z]", &["y", "z"], &[]);
    rw("{k: v for k, v in d.items()}", &["d"], &[]);
    rw("[a for a in xs for b in f(a) if b]", &["f", "xs"], &[]);
    rw("x = 1\n[x for _ in r]", &["r"], &["x"]);
    // the comprehension variable does not leak
    rw("[i for i in r]\nprint(i)", &["i", "r"], &[]);
}

#[test]
fn walrus_binds_the_enclosing_scope() {
    rw("if (n := len(a)) > 10:\n    print(n)", &["a"], &["n"]);
    let a = rw("[y := f(x) for x in data]", &["data", "f"], &["y"]);
    assert!(a.defs.is_empty());
    rw("total = 0\nvals = [total := total + v for v in vs]", &["vs"], &["total", "vals"]);
    // a walrus in a nested function binds the function, not the cell
    rw("def g():\n    return (w := 1)", &[], &["g"]);
    // short-circuit: the binding may not happen
    rw("ok = flag and (m := 3)\nprint(m)", &["flag", "m"], &["m", "ok"]);
}

#[test]
fn lambdas() {
    rw("f = lambda a, b=d: a + b + c", &["c", "d"], &["f"]);
}

#[test]
fn function_defaults_and_globals() {
    let a = rw("def f(a=b): return c + a", &["b", "c"], &["f"]);
    let f = &a.defs["f"];
    assert_eq!(f.kind, DefKind::Function);
    assert_eq!(f.global_reads, set(&["c"]));
    assert!(f.global_writes.is_empty());
    // globals bound before the def are not cell reads, but stay in the summary
    let a = rw("c = 1\ndef f(): return c", &[], &["c", "f"]);
    assert_eq!(a.defs["f"].global_reads, set(&["c"]));
    // recursion is not a read of the previous f
    rw("def fact(n): return 1 if n < 2 else n * fact(n - 1)", &[], &["fact"]);
    // locals, even assigned after use, are not globals
    let a = rw("def f():\n    print(v)\n    v = 1", &[], &["f"]);
    assert!(a.defs["f"].global_reads.is_empty());
}

#[test]
fn decorators_and_annotations_are_evaluated_at_definition() {
    let a = rw("@deco(arg)\ndef f(x: T) -> R:\n    return x", &["R", "T", "arg", "deco"], &["f"]);
    assert!(a.defs["f"].global_reads.is_empty());
    rw("from __future__ import annotations\ndef f(x: T) -> R:\n    return x", &[], &["annotations", "f"]);
    // local variable annotations inside a function are never evaluated
    let a = rw("def f():\n    y: Hidden = 1\n    return y", &[], &["f"]);
    assert!(a.defs["f"].global_reads.is_empty());
}

#[test]
fn global_and_nonlocal() {
    let a = rw("def inc():\n    global counter\n    counter += step", &["counter", "step"], &["inc"]);
    assert_eq!(a.defs["inc"].global_reads, set(&["counter", "step"]));
    assert_eq!(a.defs["inc"].global_writes, set(&["counter"]));
    let a = rw(
        "def outer():\n    n = 0\n    def inner():\n        nonlocal n\n        n += k\n    return inner",
        &["k"],
        &["outer"],
    );
    assert_eq!(a.defs["outer"].global_reads, set(&["k"]));
    assert!(a.defs["outer"].global_writes.is_empty());
    // a global declared in a nested function bypasses the enclosing function's local
    let a = rw(
        "def outer():\n    g = 1\n    def inner():\n        global g\n        return g\n    return inner",
        &["g"],
        &["outer"],
    );
    assert_eq!(a.defs["outer"].global_reads, set(&["g"]));
}

#[test]
fn nested_functions_resolve_free_names() {
    let a = rw("def outer(a):\n    def inner():\n        return a + b\n    return inner", &["b"], &["outer"]);
    assert_eq!(a.defs["outer"].global_reads, set(&["b"]));
}

#[test]
fn class_bodies_do_not_enclose_methods() {
    let code =
        "class C(Base):\n    x = 1\n    y = x + z\n    def m(self):\n        return x\n    ys = [x for _ in range(3)]";
    let a = rw(code, &["Base", "x", "z"], &["C"]);
    let c = &a.defs["C"];
    assert_eq!(c.kind, DefKind::Class);
    // `x` in the method and in the comprehension is the global x, not the class's
    assert_eq!(c.global_reads, set(&["x", "z"]));
    // a class attribute read after it is bound is not a global read
    let a = rw("class D:\n    a = 1\n    b = a", &[], &["D"]);
    assert!(a.defs["D"].global_reads.is_empty());
}

#[test]
fn last_definition_wins() {
    let a = rw("def f(): return a\ndef f(): return b", &["a", "b"], &["f"]);
    assert_eq!(a.defs["f"].global_reads, set(&["b"]));
}

#[test]
fn control_flow_definite_binding() {
    rw("if c:\n    x = 1\nelse:\n    x = 2\nprint(x)", &["c"], &["x"]);
    rw("if c:\n    x = 1\nprint(x)", &["c", "x"], &["x"]);
    rw("if c:\n    x = 1\nelif d:\n    x = 2\nelse:\n    x = 3\nx", &["c", "d"], &["x"]);
    rw("for i in r:\n    x = i\nprint(x, i)", &["i", "r", "x"], &["i", "x"]);
    rw("while c:\n    x = 1\nx", &["c", "x"], &["x"]);
    rw("x = 1\nif c:\n    del x\nx", &["c", "x"], &["x"]);
    rw("y = a if c else b", &["a", "b", "c"], &["y"]);
}

#[test]
fn with_and_for_targets() {
    rw("with open(p) as fh, lock:\n    data = fh.read()", &["lock", "p"], &["data", "fh"]);
    rw("for k, v in items:\n    total = k", &["items"], &["k", "total", "v"]);
    rw("async def f():\n    async for x in aiter_():\n        pass", &["aiter_"], &["f"]);
}

#[test]
fn try_except_as_unbinds() {
    let a = rw("try:\n    r = f()\nexcept ValueError as e:\n    log(e)\nprint(e)", &["e", "f", "log"], &["e", "r"]);
    assert_eq!(a.deletes, set(&["e"]));
    rw("try:\n    x = 1\nexcept E:\n    x = 2\nfinally:\n    y = x", &["E"], &["x", "y"]);
    rw("try:\n    x = 1\nexcept E:\n    pass\nx", &["E", "x"], &["x"]);
    rw("try:\n    x = g()\nexcept* OSError as eg:\n    pass", &["g"], &["eg", "x"]);
}

#[test]
fn del_reads_and_deletes() {
    let a = rw("del x, y[0]", &["x", "y"], &[]);
    assert_eq!(a.deletes, set(&["x"]));
    let a = rw("x = 1\ndel x\nx", &["x"], &["x"]);
    assert_eq!(a.deletes, set(&["x"]));
}

#[test]
fn match_statement() {
    let code = "match cmd:\n    case Point(x=0, y=yy):\n        r = yy\n    case [first, *rest]:\n        r = first\n    case {\"k\": v, **others}:\n        r = v\n    case Color.RED:\n        r = 0\n    case str() | bytes() as s:\n        r = s\n    case _:\n        r = None\nprint(r)";
    rw(code, &["Color", "Point", "cmd"], &["first", "others", "r", "rest", "s", "v", "yy"]);
    // without an irrefutable case, r may be unbound after the match
    rw("match c:\n    case 1:\n        r = 1\nprint(r)", &["c", "r"], &["r"]);
    rw("match c:\n    case 1 if g:\n        pass", &["c", "g"], &[]);
}

#[test]
fn imports() {
    let a = rw(
        "import a.b.c\nimport numpy as np\nfrom x.y import z as w, q\nfrom . import sib\nfrom ..pkg import m",
        &[],
        &["a", "m", "np", "q", "sib", "w"],
    );
    assert_eq!(a.imports, set(&[".", "..pkg", "a.b.c", "numpy", "x.y"]));
}

#[test]
fn star_import_is_conservative() {
    let a = analyze("from m import *");
    assert_eq!(a.conservative.as_deref(), Some("star import from m at line 1"));
    assert_eq!(a.imports, set(&["m"]));
}

#[test]
fn type_aliases_and_type_params() {
    rw("type Pair[T] = tuple[T, T]", &[], &["Pair"]);
    rw("type Tree = list[Tree] | Leaf", &["Leaf"], &["Tree"]);
    let a = rw("def first[T](xs: list[T]) -> T:\n    return xs[0]", &[], &["first"]);
    assert!(a.defs["first"].global_reads.is_empty());
    rw("class Box[T](Base[T]):\n    item: T", &["Base"], &["Box"]);
}

#[test]
fn builtins_are_not_reads() {
    let a = rw("print(len(range(3)), sorted(xs), display(y))", &["xs", "y"], &[]);
    assert!(a.builtin_reads.contains("print"));
    assert!(!a.calls.contains("print"));
}

#[test]
fn calls_are_top_level_uses() {
    let a = rw("def g(): return h()\nr = f(x)\ng()", &["f", "h", "x"], &["g", "r"]);
    assert_eq!(a.calls, set(&["f", "g", "x"]));
    let a = rw("r = [f(v) for v in vs]", &["f", "vs"], &["r"]);
    assert_eq!(a.calls, set(&["f", "vs"]));
}

#[test]
fn fstrings_read() {
    rw("s = f\"{a!r} {b:{width}}\"", &["a", "b", "width"], &["s"]);
}

#[test]
fn dynamic_constructs_are_conservative() {
    let cases = [
        ("exec(code)", "exec() at line 1"),
        ("x = 1\neval('x')", "eval() at line 2"),
        ("g = globals()", "globals() at line 1"),
        ("l = locals()", "locals() at line 1"),
        ("v = vars()", "vars() at line 1"),
        ("names = sorted(n for n in dir() if not n.startswith('_'))", "dir() at line 1"),
        ("ip = get_ipython()", "get_ipython() at line 1"),
        ("import sys\nm = sys.modules['__main__']", "sys.modules['__main__'] at line 2"),
        ("m = __import__('__main__')", "__import__('__main__') at line 1"),
        ("import __main__", "import __main__ at line 1"),
        ("%run other.py", "%run magic at line 1"),
        ("%store x", "%store magic at line 1"),
        ("%load snippet.py", "%load magic at line 1"),
        ("%reset -f", "%reset magic at line 1"),
        ("%who", "%who magic at line 1"),
        ("%whos", "%whos magic at line 1"),
        ("names = %who_ls", "%who_ls magic at line 1"),
    ];
    for (code, reason) in cases {
        assert_eq!(analyze(code).conservative.as_deref(), Some(reason), "{code}");
    }
    // locals()/vars() inside a function only see the function's own scope
    assert_eq!(analyze("def f():\n    return locals(), vars(obj)").conservative, None);
    assert_eq!(analyze("d = dir(obj)\ndef f():\n    return dir()").conservative, None);
}

#[test]
fn parse_error_is_conservative_with_line() {
    let a = analyze("x = 1\ny = (\n");
    let reason = a.conservative.unwrap_or_default();
    assert!(reason.starts_with("parse error at line "), "{reason}");
    assert!(a.syntax_error);
    let a = analyze("a = 1\nb = 2\ndef f(:\n    pass");
    assert!(a.syntax_error);
    let reason = a.conservative.unwrap_or_default();
    assert!(reason.starts_with("parse error at line 3: "), "{reason}");
    assert!(!analyze("x = f(a)").syntax_error);
}
