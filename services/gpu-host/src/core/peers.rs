//! Other hosts as their status last said: whether one of them could take a
//! recipe (the claim delay waits only then), and which are alive (a CPU worker's
//! claim held by a lost host is taken over). The liveness rule is [`Members`]'s,
//! as everywhere (ADR 58).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use schemas::membership::Members;

/// A peer not heard from for this long (three status ticks) is not competing.
pub const PEER_STALE: Duration = Duration::from_secs(6);

/// Other hosts: their free slots, and when each was last heard.
#[derive(Debug)]
pub struct Peers(Members<usize>);

impl Peers {
    /// No peer heard yet; this host started at `started`.
    pub fn new(started: Instant) -> Self {
        Self(Members::new(started))
    }

    /// `host` said it has `free_slots` free, at `now`.
    pub fn heard(&mut self, host: String, free_slots: usize, now: Instant) {
        self.0.heard(host, free_slots, now);
    }

    /// Whether another live host has `n` free slots.
    pub fn has_room(&self, n: u32, now: Instant) -> bool {
        self.0.live(PEER_STALE, now).any(|(_, free)| *free >= n as usize)
    }

    /// Whether `host` said lately that it has `n` free slots; None if it was not
    /// heard lately.
    pub fn host_has_room(&self, host: &str, n: u32, now: Instant) -> Option<bool> {
        self.0.live(PEER_STALE, now).find(|(h, _)| *h == host).map(|(_, free)| *free >= n as usize)
    }

    /// The hosts alive as far as this one knows: itself (`me`) and every other one
    /// heard lately; None until this host has listened long enough to have heard
    /// every live one.
    pub fn live(&self, me: &str, now: Instant) -> Option<HashSet<String>> {
        if self.0.listening_for(now) < PEER_STALE {
            return None;
        }
        let live = self.0.live(PEER_STALE, now).map(|(h, _)| h.to_string());
        Some(live.chain(std::iter::once(me.to_string())).collect())
    }

    /// Whether some host once heard is not heard any more (it may be lost).
    pub fn any_lost(&self, now: Instant) -> bool {
        self.0.listening_for(now) >= PEER_STALE && self.0.any_silent(PEER_STALE, now)
    }
}
