//! Version 2 of the recipe (`recipe` 2), frozen. It encodes the same types as
//! version 1 (their frozen copies there), plus the run's `user_expressions`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::recipe_v1::{ClosureVar, Device, PinnedWorker, PreparedWorker, RecipeKind};
use super::run_v1::SessionOptions;
use crate::messages::{self as live, RecipeV3};

/// planner -> all hosts: what a cell needs (`session.{sid}.recipe`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecipeV2 {
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
    /// For a run: the run's `user_expressions`.
    pub user_expressions: BTreeMap<String, String>,
}

impl RecipeV2 {
    /// The same recipe as version 3: a GPU cell asks for one slot (version 2 had
    /// no `%%gpu N`), a CPU cell for none.
    pub fn upgrade(self) -> RecipeV3 {
        let (device, gpus) = match self.device {
            Device::Cpu => (live::Device::Cpu, 0),
            Device::Gpu => (live::Device::Gpu, 1),
        };
        RecipeV3 {
            session: self.session,
            cell_id: self.cell_id,
            kind: match self.kind {
                RecipeKind::Speculative => live::RecipeKind::Speculative,
                RecipeKind::Run => live::RecipeKind::Run,
            },
            exec_id: self.exec_id,
            revision: self.revision,
            code: self.code,
            code_hash: self.code_hash,
            closure: self.closure.into_iter().map(|v| live::ClosureVar { name: v.name, version: v.version }).collect(),
            imports: self.imports,
            device,
            gpus,
            device_reason: self.device_reason,
            conservative: self.conservative,
            pinned: self.pinned.map(|p| live::PinnedWorker { host: p.host, worker: p.worker, names: p.names }),
            manifest_revision: self.manifest_revision,
            run_unix_ms: self.run_unix_ms,
            options: self.options.upgrade(),
            prepared: self.prepared.map(|p| live::PreparedWorker { host: p.host, worker: p.worker }),
            speculate: self.speculate,
            user_expressions: self.user_expressions,
        }
    }
}
