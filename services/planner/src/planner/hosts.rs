//! Host liveness: which hosts are live and what workers they listed, the
//! largest one's GPU slots, and failing runs pinned to a worker whose host is lost.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::checkpoint::Manifest;
use schemas::messages::{EventKind, HostStatusV2, PinnedWorker, SessionEventV2};
use schemas::{unix_ms, Envelope};
use uuid::Uuid;

use super::Planner;

/// How long a run pinned to a worker is watched for its host's loss (the
/// frontend's claim deadline: a run not claimed by then has failed anyway).
const PINNED_MEMORY: Duration = Duration::from_secs(60);

/// What the planner keeps of a host's status.
#[derive(Clone, Debug)]
pub(crate) struct HostSeen {
    /// Its GPU slots.
    slots: u32,
    /// When the status was made (the host's clock, unix ms).
    unix_ms: u64,
    /// The workers it listed.
    workers: HashSet<String>,
}

/// The workers live hosts listed in their last status, and when they said so.
pub(super) struct LiveHosts(HashMap<String, (u64, HashSet<String>)>);

impl LiveHosts {
    /// Whether the worker a cell is pinned to may still hold the session's
    /// unsavable state: its host is live, and it listed the worker, or its last
    /// status predates the execution that made the state (give or take 2 s of
    /// clock difference between machines).
    pub(super) fn may_keep(&self, p: &PinnedWorker, manifest: &Manifest) -> bool {
        let Some((at, workers)) = self.0.get(&p.host) else { return false };
        let made_ms = manifest
            .unsavable
            .values()
            .filter(|u| u.worker == p.worker)
            .filter_map(|u| u.version.get_timestamp())
            .map(|t| t.to_unix().0 * 1000)
            .max();
        workers.contains(&p.worker) || made_ms.is_none_or(|made| *at < made + 2000)
    }
}

impl Planner {
    /// The most GPU slots one live host has; None until a host was heard (a
    /// planner just started cannot tell yet).
    pub(super) fn largest_host(&self) -> Option<u32> {
        self.hosts.live(self.host_lost, Instant::now()).map(|(_, h)| h.slots).max()
    }

    /// The workers each live host (heard within `host_lost`) listed last, and when.
    pub(super) fn live_hosts(&self) -> LiveHosts {
        let live = self.hosts.live(self.host_lost, Instant::now());
        LiveHosts(live.map(|(h, s)| (h.to_string(), (s.unix_ms, s.workers.clone()))).collect())
    }

    /// A run that must go to the worker holding its unsavable variables cannot run
    /// once that worker's host is lost: it fails at once, naming them, instead of
    /// waiting for a claim no host will make.
    pub(super) fn fail_runs_pinned_to_lost_hosts(&mut self, ctx: &mut Context<Self>) {
        let now = self.now();
        let limit = self.host_lost.as_secs_f64();
        self.pinned_runs.retain(|_, (_, _, at)| at.elapsed() < PINNED_MEMORY);
        let lost: Vec<Uuid> = self
            .pinned_runs
            .iter()
            .filter(|(_, (_, p, _))| self.speculator.host_silent_for(&p.host, now) > limit)
            .map(|(exec, _)| *exec)
            .collect();
        for exec_id in lost {
            let Some((session, p, _)) = self.pinned_runs.remove(&exec_id) else { continue };
            let silent = self.speculator.host_silent_for(&p.host, now);
            let error = if p.names.is_empty() {
                format!(
                    "this cell was sent to worker {} on host {}, which held the session's unsavable variables, and \
                     that host is lost (not heard for {silent:.0} s): run the cell again",
                    p.worker, p.host
                )
            } else {
                format!(
                    "variables {} could not be saved and lived only in worker {} on host {}, which is lost (not \
                     heard for {silent:.0} s); they are gone, so this cell cannot run: run the cells that define them \
                     again",
                    p.names.join(", "),
                    p.worker,
                    p.host
                )
            };
            tracing::warn!(%session, exec = %exec_id, host = %p.host, "a run's unsavable state was on a lost host");
            let ev = SessionEventV2 { session, exec_id, unix_ms: unix_ms(), kind: EventKind::Failed { error } };
            let bus = self.bus.clone();
            ctx.spawn(
                async move {
                    if let Err(e) =
                        bus.publish_kept(bus.subjects().event(session), &ev, schemas::bus::KEPT_PATIENCE).await
                    {
                        tracing::error!(error = %e, "could not fail a run pinned to a lost host");
                    }
                }
                .into_actor(self),
            );
        }
    }
}

impl StreamHandler<Result<Envelope<HostStatusV2>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<HostStatusV2>, Rejected>, _ctx: &mut Self::Context) {
        if let Ok(env) = item {
            let now = self.now();
            self.speculator.host_seen(&env.msg.host, now);
            let slots = u32::try_from(env.msg.slots.len()).unwrap_or(u32::MAX);
            let workers = env.msg.workers.iter().map(|w| w.id.clone()).collect();
            let seen = HostSeen { slots, unix_ms: env.msg.unix_ms, workers };
            self.hosts.heard(env.msg.host, seen, Instant::now());
        }
    }
}
