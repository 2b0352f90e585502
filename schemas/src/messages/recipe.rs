//! planner -> all hosts: the recipe of a cell: its state and import closures, the
//! device it runs on, and the worker it must or may run in.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::frozen::{RecipeV1, RecipeV2};
use super::run::SessionOptions;
use crate::codec::WireMessage;

/// Where a cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// On the session's persistent CPU worker.
    Cpu,
    /// On a freshly prepared worker bound to one GPU slot.
    Gpu,
}

impl Device {
    /// "cpu" or "gpu", as reports spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }
}

/// Why a recipe was published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecipeKind {
    /// Derived from an edit; hosts may prepare a worker for it.
    Speculative,
    /// Derived from Run; exactly one host must run it.
    Run,
}

/// One variable of a state closure, at the version the cell needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClosureVar {
    /// The variable's name.
    pub name: String,
    /// The execution that last defined it.
    pub version: Uuid,
}

/// A worker that holds variables which cannot be saved; cells needing them run there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedWorker {
    /// The host that keeps the worker.
    pub host: String,
    /// The worker's id on that host.
    pub worker: String,
    /// The unsavable names the cell needs from it.
    pub names: Vec<String>,
}

/// A worker a host prepared for a cell before Run; a run recipe names it so that
/// its host runs the cell there and the other hosts stand back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedWorker {
    /// The host that holds it.
    pub host: String,
    /// The worker's id on that host.
    pub worker: String,
}

/// planner -> all hosts: what a cell needs (`session.{sid}.recipe`). Version 3:
/// a GPU cell may ask for several slots (`gpus`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecipeV3 {
    /// The session.
    pub session: Uuid,
    /// The cell.
    pub cell_id: String,
    /// Speculative (from an edit) or run.
    pub kind: RecipeKind,
    /// For a run recipe, the execution; for a speculative one, nil.
    pub exec_id: Uuid,
    /// Per-cell recipe revision (increases whenever the recipe changes).
    pub revision: u64,
    /// The code (run recipes execute it; preparation never does).
    pub code: String,
    /// Hash of the code the recipe was derived from.
    pub code_hash: u64,
    /// The state closure, with versions.
    pub closure: Vec<ClosureVar>,
    /// The import closure: modules to import before restoring.
    pub imports: Vec<String>,
    /// Where the cell runs.
    pub device: Device,
    /// The GPU slots the cell needs, all on one host: 1 for a GPU cell unless its
    /// `%%gpu N` asks for more; 0 for a CPU cell.
    pub gpus: u32,
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
    /// For a run: the worker prepared for this cell, if the planner knows of one.
    pub prepared: Option<PreparedWorker>,
    /// For an edit-derived recipe: the speculator admitted it, so a host may prepare
    /// a worker (or update the one it prepared) for it.
    pub speculate: bool,
    /// For a run: the run's `user_expressions` (see `RunV2`).
    pub user_expressions: BTreeMap<String, String>,
}
wire!(RecipeV3, "recipe", 3, upgrades RecipeV2 from 2, RecipeV1 from 1);
