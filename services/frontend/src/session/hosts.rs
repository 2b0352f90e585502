//! When each gpu-host's status was last heard, shared by a frontend's sessions:
//! a host that falls silent while it runs a session's cell is lost.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use schemas::messages::HostStatusV2;

/// When each gpu-host's status was last heard, shared by the sessions: a host
/// running a session's cell that falls silent is lost.
#[derive(Clone, Debug)]
pub struct HostsSeen {
    heard: Arc<std::sync::Mutex<HashMap<String, Instant>>>,
    /// Since when this frontend listens (a host never heard is silent since then).
    since: Instant,
    /// When this frontend last could not hear anyone (its NATS connection was
    /// down): silence before then says nothing about a host.
    blind_at: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl Default for HostsSeen {
    fn default() -> Self {
        Self { heard: Default::default(), since: Instant::now(), blind_at: Default::default() }
    }
}

impl HostsSeen {
    /// Note every quarter second whether `client` is connected; while it is not,
    /// no host's silence counts (a NATS outage is not every host lost).
    pub async fn watch_connection(self, client: async_nats::Client) {
        loop {
            if client.connection_state() != async_nats::connection::State::Connected {
                *self.blind_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Record every status heard on `statuses` until the subscription ends.
    pub async fn follow(self, mut statuses: schemas::bus::Subscription<HostStatusV2>) {
        while let Some(item) = statuses.next().await {
            if let Ok(env) = item {
                self.heard.lock().unwrap_or_else(|e| e.into_inner()).insert(env.msg.host, Instant::now());
            }
        }
    }

    /// How long `host` has been silent: since it was last heard, or, if it never
    /// was, since this frontend started listening (a live host is heard every 2 s).
    pub fn silent_for(&self, host: &str) -> Duration {
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner()).get(host).copied();
        let blind = *self.blind_at.lock().unwrap_or_else(|e| e.into_inner());
        heard.unwrap_or(self.since).max(blind.unwrap_or(self.since)).elapsed()
    }

    /// Whether this frontend could not hear hosts within the last `window`.
    pub fn blind_within(&self, window: Duration) -> bool {
        self.blind_at.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|at| at.elapsed() < window)
    }
}
