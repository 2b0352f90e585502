//! When each gpu-host's status was last heard, shared by a frontend's sessions:
//! a host that falls silent while it runs a session's cell is lost. The rule is
//! [`Members`]'s, as everywhere (ADR 58).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use schemas::membership::Members;
use schemas::messages::HostStatusV2;

/// When each gpu-host's status was last heard, shared by the sessions: a host
/// running a session's cell that falls silent is lost.
#[derive(Clone, Debug)]
pub struct HostsSeen(Arc<Mutex<Members<()>>>);

impl Default for HostsSeen {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Members::new(Instant::now()))))
    }
}

impl HostsSeen {
    fn members(&self) -> MutexGuard<'_, Members<()>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Note every quarter second whether `client` is connected; while it is not,
    /// no host's silence counts (a NATS outage is not every host lost).
    pub async fn watch_connection(self, client: async_nats::Client) {
        loop {
            if client.connection_state() != async_nats::connection::State::Connected {
                self.members().blind(Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Record every status heard on `statuses` until the subscription ends.
    pub async fn follow(self, mut statuses: schemas::bus::Subscription<HostStatusV2>) {
        while let Some(item) = statuses.next().await {
            if let Ok(env) = item {
                self.members().heard(env.msg.host, (), Instant::now());
            }
        }
    }

    /// How long `host` has been silent: since it was last heard, or, if it never
    /// was, since this frontend started listening (a live host is heard every 2 s).
    pub fn silent_for(&self, host: &str) -> Duration {
        self.members().silent_for(host, Instant::now())
    }

    /// Whether this frontend could not hear hosts within the last `window`.
    pub fn blind_within(&self, window: Duration) -> bool {
        self.members().blind_within(window, Instant::now())
    }
}
