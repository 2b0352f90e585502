//! Prometheus metrics (ADR 39): every family LooseLeaf exports, in one registry per
//! process, served as `/metrics` on each service's health listener. Each service
//! updates the families it owns; in `looseleaf up` the services share the process
//! and so the registry. docs/operations.md lists them with suggested alerts.

use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// One label.
pub type Label = [(&'static str, &'static str); 1];
/// Two labels.
pub type Labels2 = [(&'static str, &'static str); 2];

fn seconds_histogram() -> Histogram {
    // 1 ms to about 33 s: prepared starts are milliseconds, cold ones with a large
    // closure seconds
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Every metric family.
pub struct Metrics {
    registry: Registry,
    /// Run to the cell starting, by how its worker was made (`prepare`: cold,
    /// speculative, warm, persistent, pinned). Frontend.
    pub start_delay: Family<Label, Histogram, fn() -> Histogram>,
    /// The parts of a start, by `phase` (claim, fork, manifest, restore_file,
    /// imports, load, setup). gpu-host.
    pub start_phase: Family<Label, Histogram, fn() -> Histogram>,
    /// GPU-slot seconds held, by `use` (cell, prepared, kept, warm). gpu-host.
    pub slot_seconds: Family<Label, Counter<f64, AtomicU64>>,
    /// Slots by `state` (free, busy, prepared, pinned, claiming). gpu-host.
    pub slots: Family<Label, Gauge>,
    /// Prepared workers ended, by `outcome` (used: a speculation hit; evicted,
    /// superseded, lost, evicted_for_run: no hit). gpu-host.
    pub prepared_ended: Family<Label, Counter>,
    /// GPU runs that found no prepared worker though their session speculates
    /// (speculation misses). gpu-host.
    pub speculation_misses: Counter,
    /// Claims settled, by `claim` (run, cpu, prepare) and `outcome` (won, lost, ...).
    /// gpu-host.
    pub claims: Family<Labels2, Counter>,
    /// Chunk cache lookups when restoring, by `result` (hit, miss). gpu-host.
    pub chunk_cache: Family<Label, Counter>,
    /// Bytes of state restored into workers. gpu-host.
    pub restored_bytes: Counter,
    /// Bytes of chunks saved by cells. gpu-host.
    pub saved_bytes: Counter,
    /// Commits answered, by `result` (committed, conflict, refused). Store.
    pub commits: Family<Label, Counter>,
    /// Reconnections to NATS. Every service.
    pub nats_reconnects: Counter,
    /// Sessions this frontend serves. Frontend.
    pub sessions: Gauge,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("looseleaf");
        let m = Self {
            registry: Registry::default(),
            start_delay: Family::new_with_constructor(seconds_histogram),
            start_phase: Family::new_with_constructor(seconds_histogram),
            slot_seconds: Family::default(),
            slots: Family::default(),
            prepared_ended: Family::default(),
            speculation_misses: Counter::default(),
            claims: Family::default(),
            chunk_cache: Family::default(),
            restored_bytes: Counter::default(),
            saved_bytes: Counter::default(),
            commits: Family::default(),
            nats_reconnects: Counter::default(),
            sessions: Gauge::default(),
        };
        let r = &mut registry;
        r.register_with_unit(
            "start_delay",
            "From Run to the cell starting, by how its worker was made",
            Unit::Seconds,
            m.start_delay.clone(),
        );
        r.register_with_unit(
            "start_phase",
            "The parts of a cell's start on its host",
            Unit::Seconds,
            m.start_phase.clone(),
        );
        r.register_with_unit("gpu_slot", "GPU-slot time held, by what held it", Unit::Seconds, m.slot_seconds.clone());
        r.register("gpu_slots", "GPU slots by state", m.slots.clone());
        r.register(
            "prepared_workers_ended",
            "Prepared workers ended, by outcome (used = a hit)",
            m.prepared_ended.clone(),
        );
        r.register(
            "speculation_misses",
            "GPU runs of speculating sessions that found no prepared worker",
            m.speculation_misses.clone(),
        );
        r.register("claims", "Claims settled, by claim and outcome", m.claims.clone());
        r.register("chunk_cache_lookups", "Chunk cache lookups when restoring, by result", m.chunk_cache.clone());
        r.register_with_unit("restored", "State restored into workers", Unit::Bytes, m.restored_bytes.clone());
        r.register_with_unit("saved", "Chunks saved by cells", Unit::Bytes, m.saved_bytes.clone());
        r.register("commits", "Commits answered by the store, by result", m.commits.clone());
        r.register("nats_reconnects", "Reconnections to NATS", m.nats_reconnects.clone());
        r.register("sessions", "Sessions this frontend serves", m.sessions.clone());
        Self { registry, ..m }
    }

    /// The families in Prometheus' text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "could not encode the metrics");
        }
        out
    }
}

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// A slot use as a label value.
pub fn slot_use(u: crate::messages::SlotUse) -> &'static str {
    use crate::messages::SlotUse;
    match u {
        SlotUse::Cell => "cell",
        SlotUse::Speculation => "speculation",
        SlotUse::UnsavableState => "unsavable_state",
    }
}

/// A prepared worker's end as a label value.
pub fn prepared_outcome(o: crate::messages::PreparedOutcome) -> &'static str {
    use crate::messages::PreparedOutcome;
    match o {
        PreparedOutcome::Used => "used",
        PreparedOutcome::Superseded => "superseded",
        PreparedOutcome::Evicted => "evicted",
        PreparedOutcome::EvictedForRun => "evicted_for_run",
        PreparedOutcome::SessionClosed => "session_closed",
        PreparedOutcome::Lost => "lost",
    }
}

/// Observe a duration in milliseconds on a seconds histogram.
pub fn observe_ms(h: &Histogram, ms: f64) {
    if ms.is_finite() && ms >= 0.0 {
        h.observe(ms / 1000.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_named_as_prometheus_expects() {
        let m = metrics();
        observe_ms(&m.start_delay.get_or_create(&[("prepare", "cold")]), 12.0);
        m.claims.get_or_create(&[("claim", "run"), ("outcome", "won")]).inc();
        m.slot_seconds.get_or_create(&[("use", "cell")]).inc_by(1.5);
        m.restored_bytes.inc_by(10);
        let text = m.encode();
        for line in [
            "# TYPE looseleaf_start_delay_seconds histogram",
            "looseleaf_start_delay_seconds_count{prepare=\"cold\"} 1",
            "looseleaf_claims_total{claim=\"run\",outcome=\"won\"} 1",
            "looseleaf_gpu_slot_seconds_total{use=\"cell\"} 1.5",
            "looseleaf_restored_bytes_total 10",
            "# TYPE looseleaf_sessions gauge",
            "# TYPE looseleaf_nats_reconnects counter",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
