//! frontend -> planner: a cell's edits and runs, with the session options they carry.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::frozen::{RunV1, RunV2};
use crate::codec::WireMessage;

/// frontend -> planner: the code of a cell changed (`session.{sid}.edit`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EditV1 {
    /// The session.
    pub session: Uuid,
    /// The notebook's id for the cell.
    pub cell_id: String,
    /// The cell's full code after the edit.
    pub code: String,
    /// Per-cell edit sequence number; older edits are dropped.
    pub seq: u64,
    /// The session's options (device labelling and speculation follow them).
    pub options: SessionOptions,
}
wire!(EditV1, "edit", 1);

/// Session options a run carries, so every service sees the same ones.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionOptions {
    /// Working directory of the session's cells (the notebook's folder).
    pub cwd: String,
    /// Treat every code cell as a GPU cell.
    pub all_gpu: bool,
    /// Prepare workers while cells are edited (DESIGN.md section 4, step 3).
    pub speculate: bool,
}

/// frontend -> planner: run a cell now (`session.{sid}.run`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunV3 {
    /// The session.
    pub session: Uuid,
    /// This execution.
    pub exec_id: Uuid,
    /// The notebook's id for the cell.
    pub cell_id: String,
    /// The code submitted with Run.
    pub code: String,
    /// When the frontend received Run (unix ms).
    pub run_unix_ms: u64,
    /// Manifest revision committed by the session's previous cell; the planner
    /// resolves the closure against at least this revision.
    pub after_revision: u64,
    /// Session options.
    pub options: SessionOptions,
    /// Jupyter's `user_expressions`: name -> expression, evaluated after the cell
    /// if it succeeds, in its namespace; the results are an output of the cell.
    pub user_expressions: BTreeMap<String, String>,
    /// Why the cell may not have a GPU (its user's GPU quota is used up): a cell
    /// the planner places on a GPU fails with this, before any slot is taken; a
    /// CPU cell runs. None: no quota stands in the way.
    pub gpu_refused: Option<String>,
}
wire!(RunV3, "run", 3, upgrades RunV2 from 2, RunV1 from 1);
