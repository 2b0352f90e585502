//! Version 1 of the run (`run` 1), frozen.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::run_v2::RunV2;
use crate::messages as live;

/// frontend -> planner: run a cell now (`session.{sid}.run`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunV1 {
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
    /// Session options.
    pub options: SessionOptions,
}

/// Session options, as version 1 encodes them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionOptions {
    /// Working directory of the session's cells.
    pub cwd: String,
    /// Treat every code cell as a GPU cell.
    pub all_gpu: bool,
    /// Prepare workers while cells are edited.
    pub speculate: bool,
}

impl SessionOptions {
    /// The same options now.
    pub fn upgrade(self) -> live::SessionOptions {
        live::SessionOptions { cwd: self.cwd, all_gpu: self.all_gpu, speculate: self.speculate }
    }
}

impl RunV1 {
    /// The same run as version 2: it asks for no user expressions.
    pub fn upgrade(self) -> RunV2 {
        RunV2 {
            session: self.session,
            exec_id: self.exec_id,
            cell_id: self.cell_id,
            code: self.code,
            run_unix_ms: self.run_unix_ms,
            after_revision: self.after_revision,
            options: self.options,
            user_expressions: Default::default(),
        }
    }
}
