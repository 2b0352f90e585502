//! Static analysis of notebook cells.
//!
//! [`analyze`] parses one cell (ruff's parser in IPython mode) and reports what the cell
//! may read from and write to the session namespace, the modules it imports, summaries of
//! the functions and classes it defines, a device hint, and whether the analysis had to
//! give up on precision ([`CellAnalysis::conservative`]).
//!
//! [`resolve`] turns an analysis plus the session's definition history into the cell's
//! state closure; [`cell_writes`] widens the cell's writes by the `global` writes of the
//! functions it calls.
//!
//! Layout: `scope.rs` holds the scope frames, bindings and branch merging (Python's
//! scoping rules), `stmt.rs` and `expr.rs` walk statements and expressions,
//! `ipython.rs` handles magics and shell escapes, `device.rs` spots GPU signs and dynamic
//! namespace access,
//! `builtins.rs` lists names that are never session reads, `resolve.rs` computes closures.

mod builtins;
mod device;
mod expr;
mod ipython;
mod resolve;
mod scope;
mod stmt;
mod strings;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

pub use builtins::is_builtin;
pub use resolve::{cell_writes, closure_device, resolve, Closure, History, NameInfo};

/// What one cell may do to the session namespace.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CellAnalysis {
    /// Global names the cell may read from the session namespace: reads not preceded, on
    /// every path, by a binding in the cell; includes the globals read by functions and
    /// classes defined in the cell, minus the names definitely bound before the definition.
    /// Builtins are not here (see `builtin_reads`).
    pub reads: BTreeSet<String>,
    /// Names the cell may bind at top level.
    pub writes: BTreeSet<String>,
    /// Names the cell may unbind at top level (`del x`, and the implicit unbinding of an
    /// `except ... as x` target).
    pub deletes: BTreeSet<String>,
    /// Modules imported, dotted as written; relative imports keep their leading dots.
    pub imports: BTreeSet<String>,
    /// Functions and classes defined at top level (the last definition wins).
    pub defs: BTreeMap<String, DefSummary>,
    /// Top-level names the cell calls or otherwise uses as a value.
    pub calls: BTreeSet<String>,
    /// Builtin names read the same way as `reads`. They matter only when the session has
    /// shadowed the builtin (`input = ...`), which [`resolve`] checks against the history.
    pub builtin_reads: BTreeSet<String>,
    /// A device hint from static signs in the code or a `%%gpu`/`%%cpu` override.
    pub device: Option<DeviceHint>,
    /// `Some(reason)` when the analysis cannot be sure of its reads and writes.
    pub conservative: Option<String>,
    /// The code has a syntax error (not IPython syntax the parser lacks): text
    /// typed halfway, or a cell that raises SyntaxError when run.
    #[serde(default)]
    pub syntax_error: bool,
    /// Names in the string literals passed to a call of a name (`show('x', 'x.T')`
    /// gives `show: {x}`): a definition that evaluates its arguments reads them.
    pub literal_args: BTreeMap<String, BTreeSet<String>>,
}

/// Whether a definition is a function or a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DefKind {
    /// `def` or `async def`.
    Function,
    /// `class`.
    Class,
}

/// The global names a notebook-defined function or class reads and writes when used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefSummary {
    /// Function or class.
    pub kind: DefKind,
    /// Non-builtin globals read by the body (and by nested functions, lambdas, methods).
    pub global_reads: BTreeSet<String>,
    /// Globals the body binds through `global x` declarations.
    pub global_writes: BTreeSet<String>,
    /// `Some(what, where)` when the body reaches names by a computed string
    /// (`eval(s)`, `globals()[k]`): no static read shows them, so a cell that uses
    /// the definition restores conservatively.
    #[serde(default)]
    pub dynamic: Option<String>,
    /// The body calls `eval`/`exec`: names it reaches that way come in through the
    /// worker's safety net, and those named by string literals at a call site are
    /// read up front (`CellAnalysis::literal_args`).
    #[serde(default)]
    pub evals: bool,
}

/// Where a cell should run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Device {
    /// Needs a GPU.
    Gpu,
    /// Runs on the CPU.
    Cpu,
}

/// A device label and the sign that justifies it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceHint {
    /// The device.
    pub label: Device,
    /// The sign, naming the construct and its line (or the override).
    pub reason: String,
    /// The GPU slots the cell asks for, all on one host: N for `%%gpu N`, else 1
    /// (meaningless for a CPU label).
    #[serde(default = "one_gpu")]
    pub gpus: u32,
}

fn one_gpu() -> u32 {
    1
}

impl DeviceHint {
    /// A GPU label from a sign in the code or the closure (one slot).
    pub fn gpu(reason: String) -> Self {
        Self { label: Device::Gpu, reason, gpus: 1 }
    }
}

/// Analyze one cell's code. Never panics; unparseable code yields a conservative result.
pub fn analyze(code: &str) -> CellAnalysis {
    ipython::analyze_cell(code)
}
