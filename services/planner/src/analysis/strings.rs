//! Names read through strings that the code spells out: literal arguments of a call
//! (`show('x', 'pd.concat([x, y])')`, for a definition that evaluates its
//! arguments) and pandas expressions (`df.query('a > @limit')`, `pd.eval('a + b')`),
//! which look names up in the caller's scope.

use std::collections::BTreeSet;

use ruff_python_ast::visitor::{walk_expr, Visitor};
use ruff_python_ast::{self as ast, Expr, ExprContext};
use ruff_python_parser::parse_expression;

use super::scope::Analyzer;

/// The names an expression in a string loads; empty if it does not parse.
fn names_in(text: &str) -> BTreeSet<String> {
    struct Names(BTreeSet<String>);
    impl<'a> Visitor<'a> for Names {
        fn visit_expr(&mut self, e: &'a Expr) {
            if let Expr::Name(n) = e {
                if n.ctx == ExprContext::Load {
                    self.0.insert(n.id.to_string());
                }
            }
            walk_expr(self, e);
        }
    }
    let mut names = Names(BTreeSet::new());
    if let Ok(parsed) = parse_expression(text) {
        names.visit_expr(&parsed.syntax().body);
    }
    names.0
}

/// `@name` references of a pandas query or eval string.
fn at_names(text: &str) -> impl Iterator<Item = &str> {
    text.split('@').skip(1).filter_map(|rest| {
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        let name = &rest[..end];
        name.starts_with(|c: char| c.is_alphabetic() || c == '_').then_some(name)
    })
}

fn literal(e: &Expr) -> Option<String> {
    match e {
        Expr::StringLiteral(s) => Some(s.value.to_str().to_owned()),
        _ => None,
    }
}

impl Analyzer<'_> {
    pub(super) fn check_string_reads(&mut self, c: &ast::ExprCall) {
        let literals: Vec<String> = c.arguments.args.iter().filter_map(literal).collect();
        if literals.is_empty() {
            return;
        }
        match &*c.func {
            Expr::Name(f) => {
                let names: BTreeSet<String> = literals.iter().flat_map(|l| names_in(l)).collect();
                if !names.is_empty() {
                    self.out.literal_args.entry(f.id.to_string()).or_default().extend(names);
                }
            }
            Expr::Attribute(a) if matches!(a.attr.as_str(), "query" | "eval") => {
                let whole_scope = matches!(&*a.value, Expr::Name(m) if matches!(m.id.as_str(), "pd" | "pandas"));
                for l in &literals {
                    for name in at_names(l) {
                        self.load(name);
                    }
                    // `pd.eval('a + b')` resolves bare names in the caller's scope too
                    if whole_scope {
                        for name in names_in(l) {
                            self.load(&name);
                        }
                    }
                }
            }
            _ => {}
        }
    }
}
