//! Message versions that newer ones replaced, frozen: what older services still
//! send, and what a stream may still hold. Each file holds one version with copies
//! of every type it encodes, so nothing outside it can change its bytes, and its
//! `upgrade` to the current version; `tests` pins each one's bytes.

mod chunk_plan_v1;
mod commit_v1;
mod host_status_v1;
mod manifest_get_v1;
mod manifest_v1;
mod output_v1;
mod recipe_v1;
mod recipe_v2;
mod run_v1;
mod run_v2;
mod session_event_v1;

pub use chunk_plan_v1::ChunkPlanV1;
pub use commit_v1::CommitV1;
pub use host_status_v1::HostStatusV1;
pub use manifest_get_v1::ManifestGetV1;
pub use manifest_v1::ManifestV1;
pub use output_v1::OutputV1;
pub use recipe_v1::RecipeV1;
pub use recipe_v2::RecipeV2;
pub use run_v1::RunV1;
pub use run_v2::RunV2;
pub use session_event_v1::SessionEventV1;

#[cfg(test)]
mod tests;
