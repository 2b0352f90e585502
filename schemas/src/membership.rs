//! Which gpu-hosts are alive, as their status says (ADR 58). One rule serves the
//! frontend (a host running a session's cell that falls silent is lost), its
//! dashboard, the planner (live hosts' slots and workers) and each host (whether a
//! peer could take a recipe; whether a CPU worker's host was lost): a host is heard
//! when its status arrives (every 2 s), and is silent from then, or, if never heard,
//! from when the listener started. Silence while the listener itself could not hear
//! anyone (its NATS connection was down) says nothing about a host.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Hosts as their last status said (`S`: what a listener keeps of it), and when
/// each was heard.
#[derive(Clone, Debug)]
pub struct Members<S> {
    heard: HashMap<String, (S, Instant)>,
    /// Since when this listener listens.
    since: Instant,
    /// When this listener last could not hear anyone.
    blind_at: Option<Instant>,
}

impl<S> Members<S> {
    /// No host heard yet; listening from `now`.
    pub fn new(now: Instant) -> Self {
        Self { heard: HashMap::new(), since: now, blind_at: None }
    }

    /// `host`'s status, heard at `now`.
    pub fn heard(&mut self, host: String, status: S, now: Instant) {
        self.heard.insert(host, (status, now));
    }

    /// This listener could not hear anyone at `now`.
    pub fn blind(&mut self, now: Instant) {
        self.blind_at = Some(now);
    }

    /// Whether this listener could not hear anyone within `window` before `now`.
    pub fn blind_within(&self, window: Duration, now: Instant) -> bool {
        self.blind_at.is_some_and(|at| now.saturating_duration_since(at) < window)
    }

    /// How long this listener has listened.
    pub fn listening_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }

    /// How long `host` has been silent at `now`: since it was last heard, or, if it
    /// never was, since this listener started; never longer than since it was
    /// last blind.
    pub fn silent_for(&self, host: &str, now: Instant) -> Duration {
        let heard = self.heard.get(host).map(|(_, at)| *at).unwrap_or(self.since);
        now.saturating_duration_since(heard.max(self.blind_at.unwrap_or(self.since)))
    }

    /// The hosts heard within `within` before `now`, with their last status.
    pub fn live(&self, within: Duration, now: Instant) -> impl Iterator<Item = (&str, &S)> + '_ {
        self.heard
            .iter()
            .filter(move |(h, _)| self.silent_for(h, now) < within)
            .map(|(h, (status, _))| (h.as_str(), status))
    }

    /// Whether some host once heard has been silent for `within` or longer.
    pub fn any_silent(&self, within: Duration, now: Instant) -> bool {
        self.heard.keys().any(|h| self.silent_for(h, now) >= within)
    }

    /// Every host heard, with its last status and how long ago it was heard.
    pub fn all(&self, now: Instant) -> impl Iterator<Item = (&str, &S, Duration)> + '_ {
        self.heard.iter().map(move |(h, (status, at))| (h.as_str(), status, now.saturating_duration_since(*at)))
    }

    /// Forget the hosts not heard for `age` (gone for good).
    pub fn forget_older(&mut self, age: Duration, now: Instant) {
        self.heard.retain(|_, (_, at)| now.saturating_duration_since(*at) < age);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_host_is_silent_since_it_was_heard_or_since_listening_began() {
        let t0 = Instant::now();
        let mut m = Members::new(t0);
        assert_eq!(m.silent_for("h1", t0 + 3 * S), 3 * S, "never heard: since listening began");
        m.heard("h1".into(), 4u32, t0 + 2 * S);
        assert_eq!(m.silent_for("h1", t0 + 5 * S), 3 * S);
        let live: Vec<_> = m.live(4 * S, t0 + 5 * S).collect();
        assert_eq!(live, vec![("h1", &4)]);
        assert_eq!(m.live(3 * S, t0 + 5 * S).count(), 0, "silent 3 s is not live within 3 s");
        assert!(m.any_silent(3 * S, t0 + 5 * S) && !m.any_silent(4 * S, t0 + 5 * S));
    }

    #[test]
    fn silence_while_the_listener_was_blind_says_nothing() {
        let t0 = Instant::now();
        let mut m = Members::new(t0);
        m.heard("h1".into(), (), t0);
        m.blind(t0 + 10 * S);
        assert_eq!(m.silent_for("h1", t0 + 11 * S), S, "counted from when it could hear again");
        assert!(m.blind_within(2 * S, t0 + 11 * S) && !m.blind_within(S, t0 + 11 * S));
    }

    #[test]
    fn hosts_gone_for_good_are_forgotten() {
        let t0 = Instant::now();
        let mut m = Members::new(t0);
        m.heard("old".into(), (), t0);
        m.heard("new".into(), (), t0 + 50 * S);
        m.forget_older(30 * S, t0 + 60 * S);
        let left: Vec<_> = m.all(t0 + 60 * S).map(|(h, _, ago)| (h.to_string(), ago)).collect();
        assert_eq!(left, vec![("new".to_string(), 10 * S)]);
        assert_eq!(m.listening_for(t0 + 60 * S), 60 * S);
    }
}
