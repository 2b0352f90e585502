//! The operator's dashboard (ADR 47): a page at `/`, embedded in the binary (no
//! CDN, no build step), and its data at `/v1/dashboard`, live, as Server-Sent
//! Events of whole snapshots. It shows the gpu-hosts (slots busy or free,
//! zygotes, workers by lifecycle state), the sessions this frontend serves, their
//! last executions (start delay, how the worker was prepared), and the GPU-slot
//! seconds they used against what pinning a GPU to each would have held.
//!
//! Fed by what the frontend hears anyway: every host status, and every stream
//! item its session actors send their clients. Each caller sees the sessions it
//! owns (the API's own rule) and every host.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

use crate::api::{ExecStatus, StreamItem};
use crate::auth::Caller;
use looseleaf_client::events::Event;
use schemas::membership::Members;
use schemas::messages::HostStatusV2;

/// The page, embedded.
pub const PAGE: &str = include_str!("dashboard.html");

/// Executions kept for the page, newest last.
const RECENT_EXECUTIONS: usize = 50;

/// A host not heard for this long is shown as silent; after `HOST_FORGOTTEN`, not at all.
const HOST_SILENT: Duration = Duration::from_secs(10);
const HOST_FORGOTTEN: Duration = Duration::from_secs(300);

/// Closed sessions kept for the page (their GPU time still counts).
const CLOSED_SESSIONS: usize = 50;

/// What the dashboard knows; cheap to clone (shared by the session actors).
#[derive(Clone)]
pub struct Dashboard {
    view: Arc<Mutex<View>>,
    changed: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for Dashboard {
    fn default() -> Self {
        Self { view: Default::default(), changed: Arc::new(tokio::sync::watch::channel(0).0) }
    }
}

struct View {
    /// Hosts as their status last said (the one liveness rule, ADR 58).
    hosts: Members<HostStatusV2>,
    sessions: BTreeMap<Uuid, SessionView>,
    executions: VecDeque<ExecView>,
}

impl Default for View {
    fn default() -> Self {
        Self { hosts: Members::new(Instant::now()), sessions: BTreeMap::new(), executions: VecDeque::new() }
    }
}

#[derive(Clone, Debug, Serialize)]
struct SessionView {
    session_id: Uuid,
    /// Its owner (shown to an admin, who sees every user's sessions).
    owner: Option<String>,
    opened_unix_ms: u64,
    closed_unix_ms: Option<u64>,
    runs: u64,
    gpu_runs: u64,
    /// GPU-slot time its executions held (claim to completion).
    gpu_slot_ms: u64,
}

#[derive(Clone, Debug, Serialize)]
struct ExecView {
    session_id: Uuid,
    exec_id: Uuid,
    cell_id: String,
    run_unix_ms: u64,
    status: String,
    device: Option<String>,
    host: Option<String>,
    slot: Option<u32>,
    prepare: Option<String>,
    start_delay_ms: Option<u64>,
    run_ms: Option<f64>,
    error: Option<String>,
    #[serde(skip)]
    claimed_unix_ms: Option<u64>,
}

/// As the client API spells a value (`"gpu"`, `"speculative"`, …).
fn spelled<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

impl Dashboard {
    /// Keep the latest status of every host heard on `statuses`.
    pub async fn follow_hosts(self, mut statuses: schemas::bus::Subscription<HostStatusV2>) {
        while let Some(item) = statuses.next().await {
            if let Ok(env) = item {
                let mut view = self.lock();
                let now = Instant::now();
                view.hosts.forget_older(HOST_FORGOTTEN, now);
                view.hosts.heard(env.msg.host.clone(), env.msg, now);
                drop(view);
                self.changed();
            }
        }
    }

    /// A session actor started serving session `sid` of `owner`.
    pub fn opened(&self, sid: Uuid, owner: Option<String>) {
        let mut view = self.lock();
        let session = view.sessions.entry(sid).or_insert(SessionView {
            session_id: sid,
            owner,
            opened_unix_ms: schemas::unix_ms(),
            closed_unix_ms: None,
            runs: 0,
            gpu_runs: 0,
            gpu_slot_ms: 0,
        });
        // served again after an idle cull: the user never closed it
        session.closed_unix_ms = None;
        drop(view);
        self.changed();
    }

    /// The actor of session `sid` stopped (closed, deleted, culled, or the frontend stops).
    pub fn closed(&self, sid: Uuid) {
        let mut view = self.lock();
        if let Some(s) = view.sessions.get_mut(&sid) {
            s.closed_unix_ms.get_or_insert(schemas::unix_ms());
        }
        let closed: Vec<Uuid> =
            view.sessions.values().filter(|s| s.closed_unix_ms.is_some()).map(|s| s.session_id).collect();
        for old in closed.iter().take(closed.len().saturating_sub(CLOSED_SESSIONS)) {
            view.sessions.remove(old);
        }
        drop(view);
        self.changed();
    }

    /// An item session `sid` sent its clients.
    pub fn observe(&self, sid: Uuid, item: &StreamItem) {
        if matches!(item, StreamItem::Output { .. }) {
            return; // not shown; a cell may print thousands
        }
        let mut view = self.lock();
        match item {
            StreamItem::Queued { exec_id, cell_id, run_unix_ms } => {
                view.executions.push_back(ExecView {
                    session_id: sid,
                    exec_id: *exec_id,
                    cell_id: cell_id.clone(),
                    run_unix_ms: *run_unix_ms,
                    status: "queued".into(),
                    device: None,
                    host: None,
                    slot: None,
                    prepare: None,
                    start_delay_ms: None,
                    run_ms: None,
                    error: None,
                    claimed_unix_ms: None,
                });
                while view.executions.len() > RECENT_EXECUTIONS {
                    view.executions.pop_front();
                }
            }
            StreamItem::Event { exec_id, unix_ms, event } => {
                let Some(e) = view.executions.iter_mut().rev().find(|e| e.exec_id == *exec_id) else { return };
                match event {
                    Event::Planned { device, .. } => e.device = Some(spelled(device)),
                    Event::Claimed { host, slot, prepare } => {
                        e.status = "preparing".into();
                        e.host = Some(host.clone());
                        e.slot = *slot;
                        e.prepare = Some(spelled(prepare));
                        e.claimed_unix_ms = Some(*unix_ms);
                    }
                    Event::Started { device, prepare, .. } => {
                        e.status = "running".into();
                        e.device = Some(spelled(device));
                        e.prepare = Some(spelled(prepare));
                        e.start_delay_ms = Some(unix_ms.saturating_sub(e.run_unix_ms));
                    }
                    Event::Finished { run_ms, .. } => {
                        e.status = "saving".into();
                        e.run_ms = Some(*run_ms);
                    }
                    _ => return,
                }
            }
            StreamItem::Done { exec_id, status, unix_ms, error, .. } => {
                let Some(e) = view.executions.iter_mut().rev().find(|e| e.exec_id == *exec_id) else { return };
                e.status = spelled(status);
                e.error = error.clone();
                let gpu = e.device.as_deref() == Some("gpu") && e.slot.is_some();
                let held = e.claimed_unix_ms.filter(|_| gpu).map(|at| unix_ms.saturating_sub(at)).unwrap_or(0);
                let ran = !matches!(status, ExecStatus::Aborted);
                if let Some(s) = view.sessions.get_mut(&sid) {
                    s.runs += u64::from(ran);
                    s.gpu_runs += u64::from(ran && gpu);
                    s.gpu_slot_ms += held;
                }
            }
            StreamItem::Output { .. } => return,
        }
        drop(view);
        self.changed();
    }

    /// What `caller` may see now, as the page reads it: its own sessions, or
    /// every user's for an `admin`.
    pub fn snapshot(&self, caller: &Caller, admin: bool) -> serde_json::Value {
        let view = self.lock();
        let now = schemas::unix_ms();
        let mut heard: Vec<_> = view.hosts.all(Instant::now()).collect();
        heard.sort_by(|a, b| a.0.cmp(b.0));
        let hosts: Vec<serde_json::Value> = heard
            .into_iter()
            .map(|(_, status, ago)| {
                let mut by_state: BTreeMap<String, usize> = BTreeMap::new();
                for w in &status.workers {
                    *by_state.entry(format!("{:?}", w.state).to_lowercase()).or_default() += 1;
                }
                json!({
                    "host": status.host,
                    "real_gpus": status.real_gpus,
                    "silent": ago > HOST_SILENT,
                    "heard_s_ago": ago.as_secs(),
                    "slots": status.slots.iter().map(|s| json!({
                        "index": s.index,
                        "name": s.name,
                        "busy": s.exec_id.is_some() || s.session.is_some(),
                        "session_id": s.session,
                        "held_for": s.held_for,
                    })).collect::<Vec<_>>(),
                    "zygotes": status.zygotes.iter().map(|z| json!({"id": z.id, "packages": z.packages})).collect::<Vec<_>>(),
                    "workers_by_state": by_state,
                    "forks": status.forks,
                    "cache_bytes": status.cache_bytes,
                })
            })
            .collect();
        let sessions: Vec<&SessionView> = view.sessions.values().filter(|s| admin || s.owner == caller.user).collect();
        let visible: std::collections::HashSet<Uuid> = sessions.iter().map(|s| s.session_id).collect();
        // an admin sees other users' runs, never what they said (an error's text)
        let executions: Vec<ExecView> = view
            .executions
            .iter()
            .rev()
            .filter(|e| visible.contains(&e.session_id))
            .map(|e| {
                let own = view.sessions.get(&e.session_id).is_some_and(|s| s.owner == caller.user);
                ExecView { error: e.error.clone().filter(|_| own), ..e.clone() }
            })
            .collect();
        let used_ms: u64 = sessions.iter().map(|s| s.gpu_slot_ms).sum();
        // a pinned platform holds a GPU from a GPU session's start to its end
        let pinned_ms: u64 = sessions
            .iter()
            .filter(|s| s.gpu_runs > 0)
            .map(|s| s.closed_unix_ms.unwrap_or(now).saturating_sub(s.opened_unix_ms))
            .sum();
        json!({
            "unix_ms": now,
            "hosts": hosts,
            "sessions": sessions,
            "executions": executions,
            "gpu_slot_seconds": used_ms as f64 / 1000.0,
            "pinned_gpu_seconds": pinned_ms as f64 / 1000.0,
        })
    }

    /// Wait until something changed (or `at_most` passed: ages and the pinned
    /// time move on their own).
    pub async fn changes(&self, seen: &mut tokio::sync::watch::Receiver<u64>, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, seen.changed()).await;
    }

    /// A receiver of change notices.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn changed(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use looseleaf_client::events::{Device, Prepare, StartPhases};

    fn started(unix_ms: u64) -> StreamItem {
        StreamItem::Event {
            exec_id: Uuid::nil(),
            unix_ms,
            event: Event::Started {
                host: "host-0".into(),
                slot: Some(0),
                worker: "w".into(),
                device: Device::Gpu,
                prepare: Prepare::Speculative,
                execution_count: 1,
                restored_bytes: 0,
                prepare_ms: 0.0,
                restore_ms: 0.0,
                refreshed: 0,
                import_hit: true,
                python: "3.11".into(),
                phases: StartPhases::default(),
            },
        }
    }

    #[test]
    fn an_execution_shows_its_start_and_its_slot_time_counts_for_its_owner_only() {
        let d = Dashboard::default();
        let (sid, exec) = (Uuid::now_v7(), Uuid::nil());
        d.opened(sid, Some("alice".into()));
        d.observe(sid, &StreamItem::Queued { exec_id: exec, cell_id: "c1".into(), run_unix_ms: 1_000 });
        let claimed = Event::Claimed { host: "host-0".into(), slot: Some(0), prepare: Prepare::Speculative };
        d.observe(sid, &StreamItem::Event { exec_id: exec, unix_ms: 1_002, event: claimed });
        d.observe(sid, &started(1_013));
        let done = StreamItem::Done {
            exec_id: exec,
            status: ExecStatus::Error,
            after_revision: 1,
            unix_ms: 3_002,
            error: Some("KeyError: 'secret'".into()),
        };
        d.observe(sid, &done);

        let seen = d.snapshot(&Caller::user("alice"), false);
        let e = &seen["executions"][0];
        assert_eq!(e["cell_id"], "c1");
        assert_eq!(e["start_delay_ms"], 13);
        assert_eq!(e["prepare"], "speculative");
        assert_eq!(e["device"], "gpu");
        assert_eq!(e["status"], "error");
        assert_eq!(e["error"], "KeyError: 'secret'", "its owner reads what the run said");
        assert_eq!(seen["gpu_slot_seconds"], 2.0);
        assert_eq!(seen["sessions"][0]["gpu_runs"], 1);
        assert!(seen["pinned_gpu_seconds"].as_f64().is_some_and(|p| p >= 0.0));

        let other = d.snapshot(&Caller::user("bob"), false);
        assert_eq!(other["sessions"].as_array().map(Vec::len), Some(0));
        assert_eq!(other["executions"].as_array().map(Vec::len), Some(0));
        let admin = d.snapshot(&Caller::user("bob"), true);
        assert_eq!(admin["sessions"][0]["owner"], "alice", "an admin sees every user's sessions");
        assert_eq!(admin["executions"].as_array().map(Vec::len), Some(1));
        assert_eq!(admin["executions"][0]["error"], serde_json::Value::Null, "an admin never reads what it said");
    }
}
