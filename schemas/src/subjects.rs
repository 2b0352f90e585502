//! Every NATS subject LooseLeaf uses, built from a prefix so that tests and tenants
//! are isolated. Grammar: `{prefix}.v1.<noun>[.<id>].<verb>`; the default prefix is `ll`.
//!
//! Services never `format!` a subject; they call these functions, and route incoming
//! messages by [`parse_session_subject`] rather than string comparisons.

use uuid::Uuid;

/// The default subject prefix.
pub const DEFAULT_PREFIX: &str = "ll";

/// Builds subjects under one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    /// Subjects under `prefix` (e.g. `ll`, or a random one per test).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self { prefix: prefix.into() }
    }

    /// The prefix these subjects live under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `{prefix}.v1.session.{sid}.edit` — frontend to planner: a cell's code changed.
    pub fn edit(&self, sid: Uuid) -> String {
        format!("{}.v1.session.{sid}.edit", self.prefix)
    }

    /// `{prefix}.v1.session.*.edit` — every session's edits (planner subscription).
    pub fn all_edits(&self) -> String {
        format!("{}.v1.session.*.edit", self.prefix)
    }

    /// `{prefix}.v1.session.{sid}.run` — frontend to planner: run a cell now.
    pub fn run(&self, sid: Uuid) -> String {
        format!("{}.v1.session.{sid}.run", self.prefix)
    }

    /// `{prefix}.v1.session.*.run` — every session's runs (planner subscription).
    pub fn all_runs(&self) -> String {
        format!("{}.v1.session.*.run", self.prefix)
    }

    /// `{prefix}.v1.session.{sid}.recipe` — planner to every host (fan-out).
    pub fn recipe(&self, sid: Uuid) -> String {
        format!("{}.v1.session.{sid}.recipe", self.prefix)
    }

    /// `{prefix}.v1.session.*.recipe` — every session's recipes (host subscription).
    pub fn all_recipes(&self) -> String {
        format!("{}.v1.session.*.recipe", self.prefix)
    }

    /// `{prefix}.v1.session.{sid}.event` — hosts and planner to frontend: small
    /// lifecycle events (ready, started, saved, failed). Also captured by the
    /// session-events stream so a reconnecting client can replay.
    pub fn event(&self, sid: Uuid) -> String {
        format!("{}.v1.session.{sid}.event", self.prefix)
    }

    /// `{prefix}.v1.session.*.event` — every session's events.
    pub fn all_events(&self) -> String {
        format!("{}.v1.session.*.event", self.prefix)
    }

    /// `{prefix}.v1.session.{sid}.close` — frontend to everyone: the session is gone;
    /// hosts stop its workers, the planner forgets it.
    pub fn close(&self, sid: Uuid) -> String {
        format!("{}.v1.session.{sid}.close", self.prefix)
    }

    /// `{prefix}.v1.session.*.close` — every session's close.
    pub fn all_closes(&self) -> String {
        format!("{}.v1.session.*.close", self.prefix)
    }

    /// `{prefix}.v1.session.{sid}.idle` — frontend to hosts: the session was culled
    /// for idleness; its kept workers stop (its state stays in the store).
    pub fn idle(&self, sid: Uuid) -> String {
        format!("{}.v1.session.{sid}.idle", self.prefix)
    }

    /// `{prefix}.v1.session.*.idle` — every session's culls.
    pub fn all_idles(&self) -> String {
        format!("{}.v1.session.*.idle", self.prefix)
    }

    /// `{prefix}.v1.output.{sid}.{exec}` — a cell's outputs; high volume, own root.
    pub fn output(&self, sid: Uuid, exec: Uuid) -> String {
        format!("{}.v1.output.{sid}.{exec}", self.prefix)
    }

    /// `{prefix}.v1.output.*.*` — every session's outputs.
    pub fn all_outputs(&self) -> String {
        format!("{}.v1.output.*.*", self.prefix)
    }

    /// `{prefix}.v1.output.{sid}.*` — every output of one session.
    pub fn session_outputs(&self, sid: Uuid) -> String {
        format!("{}.v1.output.{sid}.*", self.prefix)
    }

    /// `{prefix}.v1.host.{hid}.status` — a host's slots, zygotes and cache.
    pub fn host_status(&self, hid: &str) -> String {
        format!("{}.v1.host.{hid}.status", self.prefix)
    }

    /// `{prefix}.v1.host.*.status` — every host's status.
    pub fn all_host_status(&self) -> String {
        format!("{}.v1.host.*.status", self.prefix)
    }

    /// `{prefix}.v1.host.{hid}.bid` — how a host scored itself for a run it tried
    /// to claim, and whether it won (placement quality; nobody needs to listen).
    pub fn host_bid(&self, hid: &str) -> String {
        format!("{}.v1.host.{hid}.bid", self.prefix)
    }

    /// `{prefix}.v1.host.*.bid` — every host's bids.
    pub fn all_host_bids(&self) -> String {
        format!("{}.v1.host.*.bid", self.prefix)
    }

    /// `{prefix}.v1.demand.gpu` — the GPU demand the planner sees (for autoscalers).
    pub fn gpu_demand(&self) -> String {
        format!("{}.v1.demand.gpu", self.prefix)
    }

    /// `{prefix}.v1.host.{hid}.{verb}` — a command to one host (evict, cancel).
    pub fn host_command(&self, hid: &str, verb: HostVerb) -> String {
        format!("{}.v1.host.{hid}.{}", self.prefix, verb.as_str())
    }

    /// `{prefix}.v1.space.store` — store to frontends: its volume stays low on
    /// space after garbage collection; a frontend discards the oldest detached
    /// session (queue group: one of them).
    pub fn store_pressure(&self) -> String {
        format!("{}.v1.space.store", self.prefix)
    }

    /// `{prefix}.v1.store.{verb}` — requests to the store gateway (queue group).
    pub fn store(&self, verb: StoreVerb) -> String {
        format!("{}.v1.store.{}", self.prefix, verb.as_str())
    }

    /// The part of a request subject that names the service answering it: every
    /// verb of the store is `{prefix}.v1.store`, every verb of one host
    /// `{prefix}.v1.host.{hid}`; any other subject is its own service.
    pub fn service_of<'a>(&self, subject: &'a str) -> &'a str {
        let store = format!("{}.v1.store.", self.prefix);
        if subject.starts_with(&store) {
            return &subject[..store.len() - 1];
        }
        let host = format!("{}.v1.host.", self.prefix);
        if let Some(dot) = subject.strip_prefix(&host).and_then(|rest| rest.find('.')) {
            return &subject[..host.len() + dot];
        }
        subject
    }

    /// `{prefix}.v1.sync.{unique}` — a request nobody answers, for a round trip
    /// through the server (see `Bus::flush`).
    pub fn round_trip_probe(&self) -> String {
        format!("{}.v1.sync.{}", self.prefix, uuid::Uuid::now_v7().simple())
    }

    /// Name of the JetStream stream that keeps session events for replay.
    pub fn events_stream(&self) -> String {
        format!("{}_session_events", self.prefix.replace(['.', '*', '>'], "_"))
    }

    /// The JetStream stream that keeps cells' outputs, for a frontend that adopts a
    /// session with a cell in flight.
    pub fn outputs_stream(&self) -> String {
        format!("{}_outputs", self.prefix.replace(['.', '*', '>'], "_"))
    }
}

/// Commands addressed to one host. (A superseded recipe needs no command: the
/// host updates the worker it prepared in place.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostVerb {
    /// Stop a prepared worker that is not running a cell (the speculator's budget).
    Evict,
    /// Complete or inspect code against the session's CPU worker (request/reply).
    Query,
    /// A client's comm message for the session's CPU worker (request/reply).
    Comm,
    /// Stop a cell this host claimed (the frontend knows the claiming host; a run
    /// nobody claimed is stopped by claiming it, ADR 57).
    Interrupt,
    /// What the user typed for a cell's `input()` on this host (or that the
    /// cell's client cannot be asked).
    Input,
}

impl HostVerb {
    fn as_str(self) -> &'static str {
        match self {
            HostVerb::Evict => "evict",
            HostVerb::Query => "query",
            HostVerb::Comm => "comm",
            HostVerb::Interrupt => "interrupt",
            HostVerb::Input => "input",
        }
    }
}

/// Requests the store gateway answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreVerb {
    /// Fetch a session's latest manifest.
    ManifestGet,
    /// Which chunks of a save the store lacks.
    ChunkPlan,
    /// Commit a save as the next manifest revision.
    Commit,
    /// Delete a session's manifests (its chunks are collected later).
    SessionDelete,
    /// Settle a run its frontend gave up: its commit, or a fence in its place.
    Settle,
    /// Collect chunks no manifest references.
    Gc,
    /// Commit an earlier revision's state again (undo, checkout).
    Revert,
    /// Fork a session into a new one sharing its chunks.
    Fork,
    /// Check that a session's latest state can be restored (before a resume).
    Check,
}

impl StoreVerb {
    /// The verb as it appears in the subject.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreVerb::ManifestGet => "manifest.get",
            StoreVerb::ChunkPlan => "chunk.plan",
            StoreVerb::Commit => "commit",
            StoreVerb::SessionDelete => "session.delete",
            StoreVerb::Settle => "settle",
            StoreVerb::Gc => "gc",
            StoreVerb::Revert => "revert",
            StoreVerb::Fork => "fork",
            StoreVerb::Check => "check",
        }
    }
}

/// A subject with its variable parts named (`{prefix}.v1.session.{id}.run`,
/// `{prefix}.v1.host.{host}.recipe`): what telemetry groups messages by, since
/// the subject itself names one session or host.
pub fn template(subject: &str) -> String {
    // the prefix is everything before the version, dots and all
    let (prefix, rest) = match subject.split_once(".v1.") {
        Some((_, rest)) => ("{prefix}.v1", rest),
        None => ("", subject),
    };
    let mut out = if prefix.is_empty() { Vec::new() } else { vec![prefix] };
    let mut after_host = false;
    for token in rest.split('.') {
        let named = match token {
            _ if after_host => "{host}",
            _ if Uuid::parse_str(token).is_ok() => "{id}",
            other => other,
        };
        after_host = token == "host";
        out.push(named);
    }
    out.join(".")
}

/// The session id and verb of a `{prefix}.v1.session.{sid}.{verb}` subject.
pub fn parse_session_subject(subject: &str) -> Option<(Uuid, &str)> {
    let mut parts = subject.rsplitn(3, '.');
    let verb = parts.next()?;
    let sid = parts.next()?;
    let rest = parts.next()?;
    if !rest.ends_with(".v1.session") {
        return None;
    }
    Some((Uuid::parse_str(sid).ok()?, verb))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_name_the_variable_parts() {
        let sid = Uuid::from_u128(7);
        assert_eq!(template(&format!("ll1.v1.session.{sid}.run")), "{prefix}.v1.session.{id}.run");
        assert_eq!(template(&format!("ll1.v1.output.{sid}.{sid}")), "{prefix}.v1.output.{id}.{id}");
        assert_eq!(template("ll1.v1.host.host-0.recipe"), "{prefix}.v1.host.{host}.recipe");
        assert_eq!(template("ll1.v1.store.commit"), "{prefix}.v1.store.commit");
        assert_eq!(template("team.a.v1.store.commit"), "{prefix}.v1.store.commit");
        assert_eq!(template("$SRV.PING"), "$SRV.PING");
    }

    #[test]
    fn session_subjects_parse_back() {
        let s = Subjects::new("t1");
        let sid = Uuid::now_v7();
        assert_eq!(parse_session_subject(&s.run(sid)), Some((sid, "run")));
        assert_eq!(parse_session_subject(&s.edit(sid)), Some((sid, "edit")));
        assert_eq!(parse_session_subject("t1.v1.host.x.status"), None);
        assert_eq!(parse_session_subject("t1.v1.session.notauuid.run"), None);
    }

    #[test]
    fn a_service_is_named_by_what_its_verbs_share() {
        let s = Subjects::new("t1");
        let plan = s.store(StoreVerb::ChunkPlan);
        assert_eq!(s.service_of(&plan), "t1.v1.store");
        assert_eq!(s.service_of(&s.store(StoreVerb::ManifestGet)), s.service_of(&plan));
        assert_eq!(s.service_of("t1.v1.host.h-1.query"), "t1.v1.host.h-1");
        assert_ne!(s.service_of("t1.v1.host.h-1.query"), s.service_of("t1.v1.host.h-2.query"));
        assert_eq!(s.service_of("t1.v1.session.x.run"), "t1.v1.session.x.run", "others are their own");
        assert_eq!(s.service_of("t2.v1.store.commit"), "t2.v1.store.commit", "another prefix's");
    }

    #[test]
    fn prefix_isolates() {
        let a = Subjects::new("a");
        let b = Subjects::new("b");
        let sid = Uuid::now_v7();
        assert_ne!(a.recipe(sid), b.recipe(sid));
        assert!(a.store(StoreVerb::Commit).starts_with("a.v1.store."));
        assert_eq!(a.events_stream(), "a_session_events");
    }
}
