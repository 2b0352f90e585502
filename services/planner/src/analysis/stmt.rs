//! Statements: bindings, control flow (with definite-binding merges), definitions, imports.

use std::collections::BTreeSet;

use ruff_python_ast::visitor::Visitor;
use ruff_python_ast::{self as ast, Expr, Stmt};

use super::builtins::is_builtin;
use super::expr::irrefutable;
use super::scope::{Analyzer, FrameKind, ScopeResult};
use super::{DefKind, DefSummary};

impl Analyzer<'_> {
    // ---- statements ---------------------------------------------------------------------

    pub(super) fn body(&mut self, stmts: &[Stmt]) {
        for s in stmts {
            self.stmt(s);
        }
    }

    pub(super) fn stmt(&mut self, s: &Stmt) {
        match s {
            Stmt::FunctionDef(f) => self.function_def(f),
            Stmt::ClassDef(c) => self.class_def(c),
            Stmt::Return(r) => self.opt_expr(r.value.as_deref()),
            Stmt::Delete(d) => d.targets.iter().for_each(|t| self.delete_target(t)),
            Stmt::TypeAlias(t) => {
                self.visit_expr(&t.name);
                self.push(FrameKind::Function);
                self.type_params(t.type_params.as_deref());
                self.visit_expr(&t.value);
                let r = self.pop();
                self.absorb(r, None);
            }
            Stmt::Assign(a) => {
                self.visit_expr(&a.value);
                a.targets.iter().for_each(|t| self.visit_expr(t));
            }
            Stmt::AugAssign(a) => match &*a.target {
                Expr::Name(n) => {
                    self.load(&n.id);
                    self.visit_expr(&a.value);
                    self.bind(&n.id);
                }
                target => {
                    self.visit_expr(&a.value);
                    self.visit_expr(target);
                }
            },
            Stmt::AnnAssign(a) => {
                if self.annotations_evaluated() {
                    self.visit_expr(&a.annotation);
                }
                self.opt_expr(a.value.as_deref());
                match (&*a.target, a.value.is_some()) {
                    (_, true) => self.visit_expr(&a.target),
                    (Expr::Name(n), false) => {
                        // `x: int` makes x local to a function without binding it.
                        if let Some(f) = self.frames.last_mut() {
                            if matches!(f.kind, FrameKind::Function | FrameKind::Comprehension) {
                                f.ever.insert(n.id.to_string());
                            }
                        }
                    }
                    (target, false) => self.visit_expr(target),
                }
            }
            Stmt::For(f) => {
                self.visit_expr(&f.iter);
                self.maybe(|a| {
                    a.visit_expr(&f.target);
                    a.body(&f.body);
                });
                self.maybe(|a| a.body(&f.orelse));
            }
            Stmt::While(w) => {
                self.visit_expr(&w.test);
                self.maybe(|a| a.body(&w.body));
                self.maybe(|a| a.body(&w.orelse));
            }
            Stmt::If(i) => {
                self.visit_expr(&i.test);
                let mut deltas = Vec::with_capacity(1 + i.elif_else_clauses.len());
                let m = self.mark();
                self.body(&i.body);
                deltas.push(self.unwind(m));
                for clause in &i.elif_else_clauses {
                    let m = self.mark();
                    self.opt_expr(clause.test.as_ref());
                    self.body(&clause.body);
                    deltas.push(self.unwind(m));
                }
                let exhaustive = i.elif_else_clauses.last().is_some_and(|c| c.test.is_none());
                self.merge(deltas, exhaustive);
            }
            Stmt::With(w) => {
                for item in &w.items {
                    self.visit_expr(&item.context_expr);
                    if let Some(vars) = &item.optional_vars {
                        self.visit_expr(vars);
                    }
                }
                self.body(&w.body);
            }
            Stmt::Match(m) => {
                self.visit_expr(&m.subject);
                let mut deltas = Vec::with_capacity(m.cases.len());
                let mut exhaustive = false;
                for case in &m.cases {
                    let mark = self.mark();
                    self.visit_pattern(&case.pattern);
                    self.opt_expr(case.guard.as_deref());
                    self.body(&case.body);
                    deltas.push(self.unwind(mark));
                    exhaustive |= case.guard.is_none() && irrefutable(&case.pattern);
                }
                self.merge(deltas, exhaustive);
            }
            Stmt::Raise(r) => {
                self.opt_expr(r.exc.as_deref());
                self.opt_expr(r.cause.as_deref());
            }
            Stmt::Try(t) => {
                let mut deltas = Vec::with_capacity(1 + t.handlers.len());
                let m = self.mark();
                self.body(&t.body);
                self.body(&t.orelse);
                deltas.push(self.unwind(m));
                for ast::ExceptHandler::ExceptHandler(h) in &t.handlers {
                    let m = self.mark();
                    self.opt_expr(h.type_.as_deref());
                    if let Some(name) = &h.name {
                        self.bind(name);
                    }
                    self.body(&h.body);
                    if let Some(name) = &h.name {
                        self.unbind(name);
                    }
                    deltas.push(self.unwind(m));
                }
                self.merge(deltas, true);
                self.body(&t.finalbody);
            }
            Stmt::Assert(a) => {
                self.visit_expr(&a.test);
                self.opt_expr(a.msg.as_deref());
            }
            Stmt::Import(i) => {
                for alias in &i.names {
                    let module = alias.name.as_str();
                    self.out.imports.insert(module.to_owned());
                    if module == "__main__" {
                        self.conservative("import __main__", alias.range.start());
                    }
                    let bound = match &alias.asname {
                        Some(asname) => asname.as_str(),
                        None => module.split('.').next().unwrap_or(module),
                    };
                    if module == "cupy" || module.starts_with("cupy.") {
                        self.cupy_aliases.insert(bound.to_owned());
                    }
                    self.bind(bound);
                }
            }
            Stmt::ImportFrom(i) => {
                let mut module = ".".repeat(i.level as usize);
                if let Some(m) = &i.module {
                    module.push_str(m);
                }
                for alias in &i.names {
                    let name = alias.name.as_str();
                    if name == "*" {
                        let why = format!("star import from {module}");
                        self.conservative(&why, alias.range.start());
                        continue;
                    }
                    let bound = alias.asname.as_ref().map_or(name, |a| a.as_str());
                    if module == "cupy" || module.starts_with("cupy.") {
                        self.cupy_aliases.insert(bound.to_owned());
                    }
                    self.bind(bound);
                }
                self.out.imports.insert(module);
            }
            Stmt::Global(g) => {
                if let Some(f) = self.frames.last_mut() {
                    if f.kind != FrameKind::Module {
                        f.global_decl.extend(g.names.iter().map(|n| n.id.to_string()));
                    }
                }
            }
            Stmt::Nonlocal(n) => {
                if let Some(f) = self.frames.last_mut() {
                    f.nonlocal_decl.extend(n.names.iter().map(|n| n.id.to_string()));
                }
            }
            Stmt::Expr(e) => self.visit_expr(&e.value),
            Stmt::Pass(_) | Stmt::Break(_) | Stmt::Continue(_) => {}
            Stmt::IpyEscapeCommand(c) => self.escape_command(c.kind, &c.value, c.range.start()),
        }
    }

    pub(super) fn opt_expr(&mut self, e: Option<&Expr>) {
        if let Some(e) = e {
            self.visit_expr(e);
        }
    }

    pub(super) fn annotations_evaluated(&self) -> bool {
        !self.future_annotations && matches!(self.kind(), FrameKind::Module | FrameKind::Class)
    }

    pub(super) fn delete_target(&mut self, t: &Expr) {
        match t {
            Expr::Name(n) => {
                self.load(&n.id);
                self.unbind(&n.id);
            }
            Expr::Tuple(t) => t.elts.iter().for_each(|e| self.delete_target(e)),
            Expr::List(l) => l.elts.iter().for_each(|e| self.delete_target(e)),
            other => self.visit_expr(other),
        }
    }

    pub(super) fn type_params(&mut self, tp: Option<&ast::TypeParams>) {
        let Some(tp) = tp else { return };
        for p in &tp.type_params {
            match p {
                ast::TypeParam::TypeVar(v) => {
                    self.bind(&v.name);
                    self.opt_expr(v.bound.as_deref());
                    self.opt_expr(v.default.as_deref());
                }
                ast::TypeParam::TypeVarTuple(v) => {
                    self.bind(&v.name);
                    self.opt_expr(v.default.as_deref());
                }
                ast::TypeParam::ParamSpec(v) => {
                    self.bind(&v.name);
                    self.opt_expr(v.default.as_deref());
                }
            }
        }
    }

    pub(super) fn parameter_defaults(&mut self, p: &ast::Parameters) {
        for d in p.posonlyargs.iter().chain(&p.args).chain(&p.kwonlyargs) {
            self.opt_expr(d.default.as_deref());
        }
    }

    pub(super) fn parameter_annotations(&mut self, p: &ast::Parameters) {
        let all = p.posonlyargs.iter().chain(&p.args).chain(&p.kwonlyargs).map(|d| &d.parameter);
        for param in all.chain(p.vararg.as_deref()).chain(p.kwarg.as_deref()) {
            self.opt_expr(param.annotation.as_deref());
        }
    }

    pub(super) fn bind_parameters(&mut self, p: &ast::Parameters) {
        let all = p.posonlyargs.iter().chain(&p.args).chain(&p.kwonlyargs).map(|d| &d.parameter);
        for param in all.chain(p.vararg.as_deref()).chain(p.kwarg.as_deref()) {
            self.bind(&param.name);
        }
    }

    pub(super) fn function_def(&mut self, f: &ast::StmtFunctionDef) {
        for d in &f.decorator_list {
            self.visit_expr(&d.expression);
        }
        self.parameter_defaults(&f.parameters);
        let annotations = !self.future_annotations;
        let generic = f.type_params.is_some();
        if generic {
            self.push(FrameKind::Function);
            self.type_params(f.type_params.as_deref());
        }
        if annotations {
            self.parameter_annotations(&f.parameters);
            self.opt_expr(f.returns.as_deref());
        }
        self.push(FrameKind::Function);
        self.bind_parameters(&f.parameters);
        self.body(&f.body);
        let mut r = self.pop();
        if generic {
            self.absorb(r, None);
            r = self.pop();
        }
        self.finish_def(r, &f.name, DefKind::Function);
    }

    pub(super) fn class_def(&mut self, c: &ast::StmtClassDef) {
        for d in &c.decorator_list {
            self.visit_expr(&d.expression);
        }
        let generic = c.type_params.is_some();
        if generic {
            self.push(FrameKind::Function);
            self.type_params(c.type_params.as_deref());
        }
        if let Some(args) = &c.arguments {
            args.args.iter().for_each(|a| self.visit_expr(a));
            args.keywords.iter().for_each(|k| self.visit_expr(&k.value));
        }
        self.push(FrameKind::Class);
        self.body(&c.body);
        let mut r = self.pop();
        if generic {
            self.absorb(r, None);
            r = self.pop();
        }
        self.finish_def(r, &c.name, DefKind::Class);
    }

    pub(super) fn finish_def(&mut self, r: ScopeResult, name: &str, kind: DefKind) {
        let summary = self.at_module().then(|| DefSummary {
            kind,
            global_reads: r
                .free
                .iter()
                .chain(&r.global_reads)
                .filter(|n| !is_builtin(n))
                .cloned()
                .collect::<BTreeSet<_>>(),
            global_writes: r.global_writes.iter().cloned().collect(),
            dynamic: r.dynamic.clone(),
            evals: r.evals,
        });
        self.absorb(r, Some(name));
        self.bind(name);
        if let Some(summary) = summary {
            self.out.defs.insert(name.to_owned(), summary);
        }
    }
}
