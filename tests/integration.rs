//! The root crate's integration tests, one module per file, linked into a single
//! test binary: on two cores, linking twenty release binaries cost CI more time than
//! most tests, and one binary lets `--test-threads 2` overlap the long corpus test
//! with the rest (ADR 40). Run one file's tests with a filter:
//! `cargo test --release --test integration corpus::`.

mod cell_messages;
mod chaos;
mod closure_soundness;
mod competition;
mod compose;
mod corpus;
mod dashboard;
mod detached;
mod health;
mod host_loss;
mod http_faults;
mod interrupt;
mod isolation;
mod jupyterhub;
mod jupyterlab;
mod kernel;
mod kernel_faults;
mod kubernetes;
mod large_state;
mod limits;
mod local_cluster;
mod metrics;
mod multi_gpu;
mod nats_cluster;
mod operations_doc;
mod orphans;
mod planner_failover;
mod relocatable;
mod run_cli;
mod run_delivery;
mod security;
mod session_delete;
mod simulate;
mod speculation;
mod store_faults;
mod system;
mod undo;
mod unsavable;
mod usage;
// named for what it checks: a module `tracing` would shadow the crate of that name
#[path = "tracing.rs"]
mod trace_tree;
