//! `looseleaf simulate` (DESIGN.md section 15): replays notebook sessions on
//! simulated GPU hosts and compares provisioning policies by GPU-hours and start
//! delay, in one run.
//!
//! LooseLeaf's policy is the services' own code on a simulated clock: the
//! planner's [`Speculator`](looseleaf_planner::speculator::Speculator) (admission
//! and eviction), the gpu-host's claim delay
//! ([`claim_delay`](looseleaf_gpu_host::host::placement::claim_delay)), its
//! [`Slots`](looseleaf_gpu_host::host::slots::Slots) and its worker lifecycle
//! table. Step costs are measured (bench results, REPORT.json files); baselines'
//! costs are the anchors' cited constants.
//!
//! - [`workload`]: sessions (synthetic, trace-derived, recorded).
//! - [`costs`]: step costs and where they came from.
//! - [`cluster`]: hosts, their power, NotebookOS's autoscaler.
//! - [`engine`]: the event loop and the [`engine::Policy`] trait.
//! - [`policies`]: pinned, NotebookOS, naive, Modal-style, snapshot, LooseLeaf.
//! - [`run`]: a whole comparison, its JSON and Markdown.

pub mod cluster;
pub mod costs;
pub mod dist;
pub mod engine;
pub mod policies;
pub mod run;
pub mod workload;
