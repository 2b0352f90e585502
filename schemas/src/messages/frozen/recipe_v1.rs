//! Version 1 of the recipe (`recipe` 1), frozen.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::recipe_v2::RecipeV2;
use super::run_v1::SessionOptions;

/// planner -> all hosts: what a cell needs (`session.{sid}.recipe`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecipeV1 {
    /// The session.
    pub session: Uuid,
    /// The cell.
    pub cell_id: String,
    /// Speculative (from an edit) or run.
    pub kind: RecipeKind,
    /// For a run recipe, the execution; for a speculative one, nil.
    pub exec_id: Uuid,
    /// Per-cell recipe revision.
    pub revision: u64,
    /// The code.
    pub code: String,
    /// Hash of the code the recipe was derived from.
    pub code_hash: u64,
    /// The state closure, with versions.
    pub closure: Vec<ClosureVar>,
    /// The import closure.
    pub imports: Vec<String>,
    /// Where the cell runs.
    pub device: Device,
    /// Why that device.
    pub device_reason: String,
    /// Set when the closure is the whole namespace, with the reason.
    pub conservative: Option<String>,
    /// Set when the cell needs unsavable variables held by one worker.
    pub pinned: Option<PinnedWorker>,
    /// Manifest revision the closure was resolved against.
    pub manifest_revision: u64,
    /// When the frontend received Run (unix ms; 0 for speculative).
    pub run_unix_ms: u64,
    /// Session options.
    pub options: SessionOptions,
    /// For a run: the worker prepared for this cell.
    pub prepared: Option<PreparedWorker>,
    /// For an edit-derived recipe: the speculator admitted it.
    pub speculate: bool,
}

/// Why a recipe was published, as version 1 encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecipeKind {
    /// Derived from an edit.
    Speculative,
    /// Derived from Run.
    Run,
}

/// Where a cell runs, as version 1 encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Device {
    /// The session's persistent CPU worker.
    Cpu,
    /// A worker bound to one GPU slot.
    Gpu,
}

/// One variable of a state closure, as version 1 encodes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClosureVar {
    /// The variable's name.
    pub name: String,
    /// The execution that last defined it.
    pub version: Uuid,
}

/// A worker holding unsavable variables, as version 1 encodes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedWorker {
    /// The host that keeps the worker.
    pub host: String,
    /// The worker's id on that host.
    pub worker: String,
    /// The unsavable names the cell needs from it.
    pub names: Vec<String>,
}

/// A worker prepared before Run, as version 1 encodes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedWorker {
    /// The host that holds it.
    pub host: String,
    /// The worker's id on that host.
    pub worker: String,
}

impl RecipeV1 {
    /// The same recipe as version 2: it asks for no user expressions.
    pub fn upgrade(self) -> RecipeV2 {
        RecipeV2 {
            session: self.session,
            cell_id: self.cell_id,
            kind: self.kind,
            exec_id: self.exec_id,
            revision: self.revision,
            code: self.code,
            code_hash: self.code_hash,
            closure: self.closure,
            imports: self.imports,
            device: self.device,
            device_reason: self.device_reason,
            conservative: self.conservative,
            pinned: self.pinned,
            manifest_revision: self.manifest_revision,
            run_unix_ms: self.run_unix_ms,
            options: self.options,
            prepared: self.prepared,
            speculate: self.speculate,
            user_expressions: Default::default(),
        }
    }
}
