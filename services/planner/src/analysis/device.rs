//! Static signs that a cell needs a GPU, and the constructs that make the analysis
//! conservative (dynamic access to the namespace).

use ruff_python_ast::{self as ast, Expr};
use ruff_text_size::{Ranged, TextSize};

use super::scope::Analyzer;
use super::DeviceHint;

/// `torch.cuda.*` functions that only ask about the machine; they are not GPU signs.
const CUDA_QUERIES: &[&str] = &[
    "device_count",
    "get_arch_list",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "is_available",
    "is_initialized",
];

fn is_name(e: &Expr, name: &str) -> bool {
    matches!(e, Expr::Name(n) if n.id.as_str() == name)
}

fn is_cuda_string(e: &Expr) -> bool {
    matches!(e, Expr::StringLiteral(s) if s.value.to_str().starts_with("cuda"))
}

fn names_a_device(ident: &str) -> bool {
    let lower = ident.to_ascii_lowercase();
    lower.contains("dev")
}

/// An expression that designates a GPU device, or a variable that names a device.
fn is_device_expr(e: &Expr) -> bool {
    match e {
        Expr::StringLiteral(_) => is_cuda_string(e),
        Expr::Name(n) => names_a_device(&n.id),
        Expr::Attribute(a) => names_a_device(&a.attr),
        Expr::Call(c) => {
            let is_torch_device = match &*c.func {
                Expr::Attribute(a) => a.attr.as_str() == "device" && is_name(&a.value, "torch"),
                Expr::Name(n) => n.id.as_str() == "device",
                _ => false,
            };
            is_torch_device && c.arguments.args.first().is_some_and(is_device_expr)
        }
        _ => false,
    }
}

impl Analyzer<'_> {
    fn gpu_sign(&mut self, what: &str, at: TextSize) {
        if self.out.device.is_none() {
            let line = self.line_of(at);
            self.out.device = Some(DeviceHint::gpu(format!("{what} at line {line}")));
        }
    }

    pub(super) fn check_device_call(&mut self, c: &ast::ExprCall) {
        if self.out.device.is_some() {
            return;
        }
        let at = c.range().start();
        if let Expr::Attribute(f) = &*c.func {
            match f.attr.as_str() {
                "cuda" => self.gpu_sign(".cuda() call", at),
                "to" => {
                    let device_kw =
                        c.arguments.keywords.iter().any(|k| {
                            k.arg.as_ref().is_some_and(|a| a.as_str() == "device") && is_device_expr(&k.value)
                        });
                    if device_kw || c.arguments.args.iter().any(is_device_expr) {
                        self.gpu_sign(".to(device) call", at);
                    }
                }
                "device_put" if is_name(&f.value, "jax") => self.gpu_sign("jax.device_put", at),
                "compile" if is_name(&f.value, "torch") => self.gpu_sign("torch.compile", at),
                _ => {}
            }
        }
        let device_kw = c
            .arguments
            .keywords
            .iter()
            .any(|k| k.arg.as_ref().is_some_and(|a| a.as_str() == "device") && is_device_expr(&k.value));
        if device_kw {
            self.gpu_sign("device= keyword argument", at);
        }
    }

    /// `torch.cuda.<anything but a query>`.
    pub(super) fn check_device_attribute(&mut self, a: &ast::ExprAttribute) {
        if self.out.device.is_some() {
            return;
        }
        if let Expr::Attribute(inner) = &*a.value {
            if inner.attr.as_str() == "cuda"
                && is_name(&inner.value, "torch")
                && !CUDA_QUERIES.contains(&a.attr.as_str())
            {
                let what = format!("torch.cuda.{}", a.attr.as_str());
                self.gpu_sign(&what, a.range.start());
            }
        }
    }

    /// A use of a name bound to cupy by an import in this cell.
    pub(super) fn check_cupy(&mut self, name: &str, at: TextSize) {
        if self.out.device.is_none() && self.cupy_aliases.contains(name) {
            let what = format!("cupy usage ({name})");
            self.gpu_sign(&what, at);
        }
    }

    /// `exec`, `eval`, `globals`, `get_ipython`: the namespace is used dynamically,
    /// by the cell or, inside a definition, by whoever calls it.
    pub(super) fn check_dynamic_name(&mut self, name: &str, at: TextSize) {
        if self.out.conservative.is_some() {
            return;
        }
        // called for every name read: format only when it is one of these
        match name {
            "exec" | "eval" => self.evaluates(&format!("{name}()"), at),
            "globals" | "get_ipython" => self.dynamic(&format!("{name}()"), at),
            _ => {}
        }
    }

    /// `locals()`/`vars()`/`dir()` at top level, `__import__('__main__')`.
    pub(super) fn check_dynamic_call(&mut self, c: &ast::ExprCall) {
        if self.out.conservative.is_some() {
            return;
        }
        let Expr::Name(f) = &*c.func else { return };
        let at = c.range().start();
        let no_args = c.arguments.args.is_empty() && c.arguments.keywords.is_empty();
        match f.id.as_str() {
            // dir() with no argument lists the namespace's names, as locals() does
            "locals" | "vars" | "dir" if no_args && self.at_module() => {
                let what = format!("{}()", f.id.as_str());
                self.conservative(&what, at);
            }
            "__import__"
                if c.arguments
                    .args
                    .first()
                    .is_some_and(|a| matches!(a, Expr::StringLiteral(s) if s.value.to_str() == "__main__")) =>
            {
                self.conservative("__import__('__main__')", at);
            }
            _ => {}
        }
    }

    /// `sys.modules['__main__']` / `sys.modules[__name__]`.
    pub(super) fn check_dynamic_subscript(&mut self, s: &ast::ExprSubscript) {
        if self.out.conservative.is_some() {
            return;
        }
        let Expr::Attribute(a) = &*s.value else {
            return;
        };
        if a.attr.as_str() != "modules" || !is_name(&a.value, "sys") {
            return;
        }
        let main = match &*s.slice {
            Expr::StringLiteral(lit) => lit.value.to_str() == "__main__",
            Expr::Name(n) => n.id.as_str() == "__name__",
            _ => false,
        };
        if main {
            self.conservative("sys.modules['__main__']", s.range.start());
        }
    }
}
