//! The planner's integration tests, one module per file, in one test binary (ADR 40:
//! one link instead of five on CI's two cores).

mod analysis_device;
mod analysis_ipython;
mod analysis_props;
mod analysis_resolve;
mod state_kv;
