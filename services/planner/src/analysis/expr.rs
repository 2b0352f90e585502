//! Expressions: names, walrus, lambdas, comprehensions, conditional evaluation, patterns.

use ruff_python_ast::visitor::{walk_expr, walk_pattern, Visitor};
use ruff_python_ast::{self as ast, Expr, ExprContext, Pattern, Stmt};

use super::scope::{Analyzer, FrameKind};

impl Analyzer<'_> {
    // ---- expressions --------------------------------------------------------------------

    pub(super) fn comprehension(&mut self, generators: &[ast::Comprehension], elts: &[&Expr]) {
        let Some(first) = generators.first() else {
            elts.iter().for_each(|e| self.visit_expr(e));
            return;
        };
        self.visit_expr(&first.iter);
        self.push(FrameKind::Comprehension);
        for (i, g) in generators.iter().enumerate() {
            if i > 0 {
                self.visit_expr(&g.iter);
            }
            self.visit_expr(&g.target);
            g.ifs.iter().for_each(|e| self.visit_expr(e));
        }
        elts.iter().for_each(|e| self.visit_expr(e));
        let r = self.pop();
        self.absorb(r, None);
    }
}

/// A pattern that matches anything (`case _:` / `case x:`), making a match exhaustive.
pub(super) fn irrefutable(p: &Pattern) -> bool {
    match p {
        Pattern::MatchAs(a) => a.pattern.as_deref().is_none_or(irrefutable),
        Pattern::MatchOr(o) => o.patterns.iter().any(irrefutable),
        _ => false,
    }
}

impl<'a> Visitor<'a> for Analyzer<'_> {
    fn visit_stmt(&mut self, stmt: &'a Stmt) {
        self.stmt(stmt);
    }

    fn visit_expr(&mut self, e: &'a Expr) {
        match e {
            Expr::Name(n) => match n.ctx {
                ExprContext::Load => {
                    self.check_dynamic_name(&n.id, n.range.start());
                    self.load(&n.id);
                    self.check_cupy(&n.id, n.range.start());
                }
                ExprContext::Store => self.bind(&n.id),
                ExprContext::Del => self.delete_target(e),
                ExprContext::Invalid => {}
            },
            Expr::Named(n) => {
                self.visit_expr(&n.value);
                match &*n.target {
                    Expr::Name(t) => self.bind_walrus(&t.id),
                    other => self.visit_expr(other),
                }
            }
            Expr::Lambda(l) => {
                if let Some(p) = &l.parameters {
                    self.parameter_defaults(p);
                }
                self.push(FrameKind::Function);
                if let Some(p) = &l.parameters {
                    self.bind_parameters(p);
                }
                self.visit_expr(&l.body);
                let r = self.pop();
                self.absorb(r, None);
            }
            Expr::ListComp(c) => self.comprehension(&c.generators, &[&c.elt]),
            Expr::SetComp(c) => self.comprehension(&c.generators, &[&c.elt]),
            Expr::Generator(c) => self.comprehension(&c.generators, &[&c.elt]),
            Expr::DictComp(c) => match &c.key {
                Some(k) => self.comprehension(&c.generators, &[k, &c.value]),
                None => self.comprehension(&c.generators, &[&c.value]),
            },
            Expr::BoolOp(b) => {
                let mut values = b.values.iter();
                if let Some(first) = values.next() {
                    self.visit_expr(first);
                }
                for v in values {
                    self.maybe(|a| a.visit_expr(v));
                }
            }
            Expr::If(i) => {
                self.visit_expr(&i.test);
                let m = self.mark();
                self.visit_expr(&i.body);
                let d1 = self.unwind(m);
                let m = self.mark();
                self.visit_expr(&i.orelse);
                let d2 = self.unwind(m);
                self.merge(vec![d1, d2], true);
            }
            Expr::Call(c) => {
                self.check_dynamic_call(c);
                self.check_device_call(c);
                self.check_string_reads(c);
                walk_expr(self, e);
            }
            Expr::Attribute(a) => {
                self.check_device_attribute(a);
                walk_expr(self, e);
            }
            Expr::Subscript(s) => {
                self.check_dynamic_subscript(s);
                walk_expr(self, e);
            }
            Expr::IpyEscapeCommand(c) => self.escape_command(c.kind, &c.value, c.range.start()),
            _ => walk_expr(self, e),
        }
    }

    fn visit_pattern(&mut self, p: &'a Pattern) {
        walk_pattern(self, p);
        match p {
            Pattern::MatchAs(ast::PatternMatchAs { name: Some(n), .. })
            | Pattern::MatchStar(ast::PatternMatchStar { name: Some(n), .. })
            | Pattern::MatchMapping(ast::PatternMatchMapping { rest: Some(n), .. }) => {
                self.bind(n);
            }
            _ => {}
        }
    }
}
