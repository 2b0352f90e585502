//! Other hosts as their status last said: whether one of them could take a
//! recipe (the claim delay waits only then), and which are alive (a CPU worker's
//! claim held by a lost host is taken over).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// A peer not heard from for this long (three status ticks) is not competing.
pub const PEER_STALE: Duration = Duration::from_secs(6);

/// Other hosts: free slots and when each was last heard.
#[derive(Debug)]
pub struct Peers {
    heard: HashMap<String, (usize, Instant)>,
    /// When this host started: it judges other hosts lost only after a while.
    started: Instant,
}

impl Peers {
    /// No peer heard yet; this host started at `started`.
    pub fn new(started: Instant) -> Self {
        Self { heard: HashMap::new(), started }
    }

    /// `host` said it has `free_slots` free, at `now`.
    pub fn heard(&mut self, host: String, free_slots: usize, now: Instant) {
        self.heard.insert(host, (free_slots, now));
    }

    fn fresh(seen: Instant, now: Instant) -> bool {
        now.saturating_duration_since(seen) < PEER_STALE
    }

    /// Whether another live host has `n` free slots.
    pub fn has_room(&self, n: u32, now: Instant) -> bool {
        self.heard.values().any(|(free, seen)| *free >= n as usize && Self::fresh(*seen, now))
    }

    /// The hosts alive as far as this one knows: itself (`me`) and every other one
    /// heard lately; None until this host has listened long enough to have heard
    /// every live one.
    pub fn live(&self, me: &str, now: Instant) -> Option<HashSet<String>> {
        if now.saturating_duration_since(self.started) < PEER_STALE {
            return None;
        }
        let live = self.heard.iter().filter(|(_, (_, seen))| Self::fresh(*seen, now)).map(|(h, _)| h.clone());
        Some(live.chain(std::iter::once(me.to_string())).collect())
    }

    /// Whether some host once heard is not heard any more (it may be lost).
    pub fn any_lost(&self, me: &str, now: Instant) -> bool {
        match self.live(me, now) {
            Some(live) => self.heard.keys().any(|h| !live.contains(h)),
            None => false,
        }
    }
}
