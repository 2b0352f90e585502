//! Prometheus metrics (ADR 39): every family LooseLeaf exports, in one registry per
//! process, served as `/metrics` on each service's health listener. Each service
//! updates the families it owns; in `looseleaf up` the services share the process
//! and so the registry. docs/operations.md lists them with suggested alerts.

use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

/// One label.
pub type Label = [(&'static str, &'static str); 1];
/// Two labels.
pub type Labels2 = [(&'static str, &'static str); 2];

/// Buckets of a duration, in seconds: prepared starts are milliseconds, cold ones
/// with a large closure seconds; 0.25, 0.5, 1 and 2.5 s are among them, so that
/// "started within 1 s" (DESIGN.md section 10) is one bucket's count.
const SECONDS_BUCKETS: [f64; 16] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

fn seconds_histogram() -> Histogram {
    Histogram::new(SECONDS_BUCKETS)
}

/// An HTTP request's labels, by OpenTelemetry's HTTP conventions:
/// `http_request_method`, `http_route` (the route's template, not the path) and
/// `http_response_status_code`.
pub type HttpLabels = [(&'static str, String); 3];

/// A user's label (`user`: the API's user name, `anonymous` on an open API); the
/// users a frontend serves are those its tokens name, so the series are bounded.
pub type UserLabel = [(&'static str, String); 1];

/// The label of `user` (None: the open API's one anonymous user).
pub fn user_label(user: Option<&str>) -> UserLabel {
    [("user", user.unwrap_or("anonymous").to_string())]
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
    /// Runs ended, by `status` (ok, error, failed, aborted). Frontend.
    pub cells: Family<Label, Counter>,
    /// Runs not ended, by `state`: `queued` behind another run of their session,
    /// `unclaimed` (sent, no host holds it yet) and `running`. The GPU demand an
    /// autoscaler reads. Frontend.
    pub runs: Family<Label, Gauge>,
    /// The GPU demand of the edit stream, by `what`: `typing_sessions`,
    /// `typing_closure_bytes`, `running_gpus`, `wanted_gpus` (what an
    /// autoscaler scales GPU hosts on). Planner.
    pub gpu_demand: Family<Label, Gauge<f64, AtomicU64>>,
    /// HTTP requests served, by method, route and status. Frontend.
    pub http_requests: Family<HttpLabels, Histogram, fn() -> Histogram>,
    /// GPU-slot seconds a user's sessions held, by `user`. Frontend.
    pub user_gpu_seconds: Family<UserLabel, Counter<f64, AtomicU64>>,
    /// Seconds a user's cells ran on the CPU, by `user`. Frontend.
    pub user_cpu_seconds: Family<UserLabel, Counter<f64, AtomicU64>>,
    /// A user's cells that ran, by `user`. Frontend.
    pub user_cells: Family<UserLabel, Counter>,
    /// A user's GPU cells refused by a quota, by `user`. Frontend.
    pub user_quota_refusals: Family<UserLabel, Counter>,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::default();
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
            cells: Family::default(),
            runs: Family::default(),
            gpu_demand: Family::default(),
            http_requests: Family::new_with_constructor(seconds_histogram),
            user_gpu_seconds: Family::default(),
            user_cpu_seconds: Family::default(),
            user_cells: Family::default(),
            user_quota_refusals: Family::default(),
        };
        // the conventions' own names (`process_*`, `http_server_*`) stand unprefixed
        registry.register_collector(Box::new(ProcessMetrics));
        registry.register_with_unit(
            "http_server_request_duration",
            "HTTP requests served, by method, route and status",
            Unit::Seconds,
            m.http_requests.clone(),
        );
        let r = registry.sub_registry_with_prefix("looseleaf");
        r.register(
            "build",
            "The LooseLeaf version this process runs",
            Info::new([("version", env!("CARGO_PKG_VERSION"))]),
        );
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
        r.register("cells", "Runs ended, by status (ok, error, failed, aborted)", m.cells.clone());
        r.register("runs", "Runs not ended, by state (queued, unclaimed, running)", m.runs.clone());
        r.register(
            "gpu_demand",
            "GPU demand of the edit stream (typing_sessions, typing_closure_bytes, running_gpus, wanted_gpus)",
            m.gpu_demand.clone(),
        );
        let u = r.sub_registry_with_prefix("user");
        u.register_with_unit(
            "gpu_slot",
            "GPU-slot time a user's sessions held",
            Unit::Seconds,
            m.user_gpu_seconds.clone(),
        );
        u.register_with_unit("cpu", "Time a user's cells ran on the CPU", Unit::Seconds, m.user_cpu_seconds.clone());
        u.register("cells", "A user's cells that ran", m.user_cells.clone());
        u.register("quota_refusals", "A user's GPU cells refused by a quota", m.user_quota_refusals.clone());
        Self { registry, ..m }
    }

    /// The families in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "could not encode the metrics");
        }
        out
    }

    /// The families in Prometheus' text format 0.0.4, for a scraper that does not
    /// ask for OpenMetrics.
    pub fn encode_text_004(&self) -> String {
        openmetrics_to_text_004(&self.encode())
    }
}

/// The content type of `encode`.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of `encode_text_004`.
pub const TEXT_004_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// OpenMetrics text as text format 0.0.4: a counter family is named by its
/// samples (`…_total`), an info family is a gauge `…_info`, and `# UNIT` and
/// `# EOF` go (0.0.4 has neither).
fn openmetrics_to_text_004(text: &str) -> String {
    let mut renamed = std::collections::HashMap::new();
    for line in text.lines() {
        let mut words = line.splitn(4, ' ');
        if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (words.next(), words.next(), words.next(), words.next())
        {
            match kind {
                "counter" => renamed.insert(name.to_string(), (format!("{name}_total"), "counter")),
                "info" => renamed.insert(name.to_string(), (format!("{name}_info"), "gauge")),
                _ => None,
            };
        }
    }
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut words = line.splitn(4, ' ');
        let line = match (words.next(), words.next(), words.next(), words.next()) {
            (Some("#"), Some("EOF" | "UNIT"), ..) => continue,
            (Some("#"), Some("HELP"), Some(name), rest) if renamed.contains_key(name) => {
                format!("# HELP {} {}", renamed[name].0, rest.unwrap_or_default())
            }
            (Some("#"), Some("TYPE"), Some(name), _) if renamed.contains_key(name) => {
                format!("# TYPE {} {}", renamed[name].0, renamed[name].1)
            }
            _ => line.to_string(),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The process's own figures, read from `/proc` at each scrape, by the names
/// Prometheus' client libraries give them.
#[derive(Debug)]
struct ProcessMetrics;

impl Collector for ProcessMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(p) = ProcessFigures::read() else { return Ok(()) };
        let cpu = ConstCounter::new(p.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu",
            "User and system CPU time spent",
            Some(&Unit::Seconds),
            cpu.metric_type(),
        )?)?;
        let rss = ConstGauge::new(p.resident_bytes as i64);
        rss.encode(encoder.encode_descriptor(
            "process_resident_memory",
            "Resident memory size",
            Some(&Unit::Bytes),
            rss.metric_type(),
        )?)?;
        let fds = ConstGauge::new(p.open_fds as i64);
        fds.encode(encoder.encode_descriptor("process_open_fds", "Open file descriptors", None, fds.metric_type())?)?;
        let start = ConstGauge::new(p.start_time_seconds);
        start.encode(encoder.encode_descriptor(
            "process_start_time",
            "Start time of the process since the Unix epoch",
            Some(&Unit::Seconds),
            start.metric_type(),
        )?)?;
        Ok(())
    }
}

/// What `/proc` says of this process.
struct ProcessFigures {
    cpu_seconds: f64,
    resident_bytes: u64,
    open_fds: usize,
    start_time_seconds: f64,
}

impl ProcessFigures {
    /// `/proc` counts CPU time and start time in clock ticks of USER_HZ, which
    /// Linux fixes at 100 for what it shows user space.
    const TICKS_PER_SECOND: f64 = 100.0;

    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // the fields after the command's name, which may hold spaces and parentheses
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
        // utime and stime are fields 14 and 15 of stat(5), starttime 22; here
        // counted from field 3
        let cpu_seconds = (ticks(11)? + ticks(12)?) / Self::TICKS_PER_SECOND;
        let since_boot = ticks(19)? / Self::TICKS_PER_SECOND;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let btime: f64 = boot.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let rss_kib: u64 =
            status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
        let open_fds = std::fs::read_dir("/proc/self/fd").map(Iterator::count).unwrap_or(0);
        Some(Self { cpu_seconds, resident_bytes: rss_kib * 1024, open_fds, start_time_seconds: btime + since_boot })
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
        // "within 1 s" is a bucket
        assert!(text.lines().any(|l| l.starts_with("looseleaf_start_delay_seconds_bucket{le=\"1.0\",")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("looseleaf_build_info{version=")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("process_resident_memory_bytes ")), "{text}");
    }

    #[test]
    fn usage_is_labelled_by_user_only() {
        let m = metrics();
        m.user_gpu_seconds.get_or_create(&user_label(Some("metrics-ada"))).inc_by(2.5);
        m.user_cells.get_or_create(&user_label(None)).inc();
        m.user_quota_refusals.get_or_create(&user_label(Some("metrics-ada"))).inc();
        let text = m.encode();
        for line in [
            "looseleaf_user_gpu_slot_seconds_total{user=\"metrics-ada\"} 2.5",
            "looseleaf_user_quota_refusals_total{user=\"metrics-ada\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line:?} in\n{text}");
        }
        assert!(text.lines().any(|l| l.starts_with("looseleaf_user_cells_total{user=\"anonymous\"} ")), "{text}");
    }

    #[test]
    fn text_004_names_counters_by_their_samples_and_has_no_unit_or_eof() {
        let m = metrics();
        m.cells.get_or_create(&[("status", "ok")]).inc();
        // (a family with no sample yet is not written: this test does not rely on
        // another one having observed a start first; its label is its own, as the
        // registry is shared with the test that counts `cold` starts)
        m.start_delay.get_or_create(&[("prepare", "text-004")]).observe(0.5);
        let text = m.encode_text_004();
        for line in [
            "# TYPE looseleaf_cells_total counter",
            "# TYPE looseleaf_build_info gauge",
            "# TYPE looseleaf_start_delay_seconds histogram",
            "# TYPE process_cpu_seconds_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line:?} in\n{text}");
        }
        assert!(text.lines().any(|l| l.starts_with("# HELP looseleaf_cells_total ")), "{text}");
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
    }
}
