//! Version 2 of the run (`run` 2), frozen.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::run_v1::SessionOptions;
use crate::messages::RunV3;

/// frontend -> planner: run a cell now (`session.{sid}.run`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunV2 {
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
    /// Manifest revision committed by the session's previous cell.
    pub after_revision: u64,
    /// Session options (encoded as version 1 encodes them: unchanged since).
    pub options: SessionOptions,
    /// Jupyter's `user_expressions`.
    pub user_expressions: BTreeMap<String, String>,
}

impl RunV2 {
    /// The same run as version 3: no quota refuses it a GPU.
    pub fn upgrade(self) -> RunV3 {
        RunV3 {
            session: self.session,
            exec_id: self.exec_id,
            cell_id: self.cell_id,
            code: self.code,
            run_unix_ms: self.run_unix_ms,
            after_revision: self.after_revision,
            options: self.options.upgrade(),
            user_expressions: self.user_expressions,
            gpu_refused: None,
        }
    }
}
