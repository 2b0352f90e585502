//! The usage report's JSON (`GET /v1/usage`, issue 40): what users, notebooks and
//! sessions used, per UTC day.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// How `GET /v1/usage` groups what was used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum UsageBy {
    /// One row per user.
    #[default]
    User,
    /// One row per user and notebook.
    Notebook,
    /// One row per session.
    Session,
    /// One row per UTC day and user.
    Day,
}

impl UsageBy {
    /// As the query spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageBy::User => "user",
            UsageBy::Notebook => "notebook",
            UsageBy::Session => "session",
            UsageBy::Day => "day",
        }
    }
}

/// What one group used; the fields that name the group are those its `by` uses
/// (the others are null).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UsageRow {
    /// The UTC day (`by=day`).
    pub day: Option<String>,
    /// The user (null: the open API's one user).
    pub user: Option<String>,
    /// The notebook (`by=notebook` and `by=session`; null: none named).
    pub notebook: Option<String>,
    /// The session (`by=session`).
    pub session_id: Option<Uuid>,
    /// GPU-slot seconds its sessions held (cells, prepared workers, unsavable state).
    pub gpu_seconds: f64,
    /// Seconds its cells ran on the CPU.
    pub cpu_seconds: f64,
    /// Runs that started.
    pub cells: u64,
    /// Of those, runs on a GPU.
    pub gpu_cells: u64,
}

/// `GET /v1/usage` answer (JSON; `format=csv` gives the rows as CSV).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UsageReport {
    /// The first UTC day counted (`YYYY-MM-DD`).
    pub from: String,
    /// The last UTC day counted.
    pub to: String,
    /// How the rows are grouped.
    pub by: UsageBy,
    /// One per group, largest GPU use first (`by=day`: by day, then user).
    pub rows: Vec<UsageRow>,
}
