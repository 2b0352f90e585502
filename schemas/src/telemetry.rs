//! Tracing for every service: a fmt subscriber plus an OpenTelemetry layer whose
//! spans leave the process over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` says where
//! (ADR 38), and W3C trace-context propagation through NATS and HTTP headers, so
//! one cell's spans across all services form one trace.

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;

/// The service name of the `looseleaf` command, whose process may run several
/// components (`up`, a kernel's embedded cluster): its spans leave by component.
pub const MANY_COMPONENTS: &str = "looseleaf";

/// The tracer provider `init` installed, kept so that `flush` can export from it.
static PROVIDER: std::sync::OnceLock<SdkTracerProvider> = std::sync::OnceLock::new();

/// How log lines are written (on stderr).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Text for people; coloured only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line for log collectors, with the trace and span ids of
    /// the OpenTelemetry trace the line belongs to.
    Json,
}

/// A tracing setting in the environment this build cannot honour.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// `OTEL_EXPORTER_OTLP_PROTOCOL` (or its traces variant) names a protocol other
    /// than HTTP/protobuf.
    #[error(
        "{var}={value}: LooseLeaf exports spans over OTLP with http/protobuf only (set {var}=http/protobuf \
         and point the endpoint at the collector's HTTP port, usually 4318)"
    )]
    Protocol { var: &'static str, value: String },
    /// The OTLP exporter could not be built from the endpoint variables.
    #[error("the OTLP span exporter could not be set up from OTEL_EXPORTER_OTLP_* ({0})")]
    Exporter(String),
}

/// Where spans are exported, read from the standard OpenTelemetry variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpExport {
    /// The variable that named the endpoint (the exporter reads it itself).
    pub endpoint_var: &'static str,
    /// Its value.
    pub endpoint: String,
}

/// The OTLP export the environment asks for: none when `OTEL_SDK_DISABLED` is
/// true or no endpoint variable is set (spans then only tie logs and messages
/// together), an error for a protocol this build lacks.
pub fn otlp_export(env: impl Fn(&str) -> Option<String>) -> Result<Option<OtlpExport>, TelemetryError> {
    let set = |var: &str| env(var).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    for var in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Some(value) = set(var) {
            if value != "http/protobuf" {
                return Err(TelemetryError::Protocol { var, value });
            }
            break; // the traces variable wins over the general one
        }
    }
    let endpoint = ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .into_iter()
        .find_map(|var| set(var).map(|endpoint| OtlpExport { endpoint_var: var, endpoint }));
    Ok(endpoint)
}

/// The resource every span carries: `OTEL_SERVICE_NAME` or the `service.name` of
/// `OTEL_RESOURCE_ATTRIBUTES` if set, else `service`; the other attributes of
/// `OTEL_RESOURCE_ATTRIBUTES` too; and the version and this process's instance id.
fn resource(service: &'static str) -> opentelemetry_sdk::Resource {
    let builder = opentelemetry_sdk::Resource::builder()
        .with_attribute(opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attribute(opentelemetry::KeyValue::new("service.instance.id", uuid::Uuid::new_v4().to_string()));
    if env_names_the_service() {
        builder.build()
    } else {
        builder.with_service_name(service).build()
    }
}

/// Whether the environment names the service (compose sets `OTEL_SERVICE_NAME`
/// per container): then every span leaves under that name.
fn env_names_the_service() -> bool {
    std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="))
}

/// The components a process may run together (`looseleaf up`, a kernel's
/// embedded cluster), by the module prefix of the code that made a span; the
/// first match wins. Spans made in shared code (the bus's PRODUCER and CONSUMER
/// spans) name their component in `looseleaf.service`.
const COMPONENTS: [(&str, &str); 6] = [
    ("looseleaf_frontend", "looseleaf-frontend"),
    ("looseleaf_planner", "looseleaf-planner"),
    ("looseleaf_store", "looseleaf-store"),
    ("looseleaf_gpu_host", "looseleaf-gpu-host"),
    ("looseleaf::kernel", "looseleaf-kernel"),
    ("looseleaf::run", "looseleaf-run"),
];

/// The component `span` belongs to, if it names or shows one.
fn component_of(span: &opentelemetry_sdk::trace::SpanData) -> Option<&'static str> {
    let attribute = |key: &str| span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.as_str());
    if let Some(named) = attribute("looseleaf.service") {
        return COMPONENTS.iter().map(|(_, name)| *name).find(|name| *name == named);
    }
    let module = attribute("code.namespace")?;
    COMPONENTS.iter().find(|(prefix, _)| module.starts_with(prefix)).map(|(_, name)| *name)
}

/// The span exporter of a process that runs several components: each span leaves
/// under its component's own `service.name` (one OTLP exporter each, with the
/// process's resource but for the name), the rest under the process's (ADR 38).
#[derive(Debug)]
struct ByComponent {
    /// The process's own exporter, then one per component.
    exporters: Vec<(&'static str, opentelemetry_otlp::SpanExporter)>,
}

impl ByComponent {
    fn new(process: &'static str) -> Result<Self, TelemetryError> {
        let names = std::iter::once(process).chain(COMPONENTS.iter().map(|(_, name)| *name));
        let exporters = names
            .map(|name| {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
                Ok((name, exporter))
            })
            .collect::<Result<_, TelemetryError>>()?;
        Ok(Self { exporters })
    }
}

impl opentelemetry_sdk::trace::SpanExporter for ByComponent {
    async fn export(&self, batch: Vec<opentelemetry_sdk::trace::SpanData>) -> opentelemetry_sdk::error::OTelSdkResult {
        let mut by_exporter: Vec<Vec<opentelemetry_sdk::trace::SpanData>> =
            self.exporters.iter().map(|_| Vec::new()).collect();
        for span in batch {
            let name = component_of(&span);
            let at = self.exporters.iter().position(|(n, _)| Some(*n) == name).unwrap_or(0);
            by_exporter[at].push(span);
        }
        let mut result = Ok(());
        for ((_, exporter), spans) in self.exporters.iter().zip(by_exporter) {
            if !spans.is_empty() {
                // one component's failure does not keep the others' spans back
                if let Err(e) = exporter.export(spans).await {
                    result = Err(e);
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: std::time::Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.exporters.iter_mut().map(|(_, e)| e.shutdown_with_timeout(timeout)).fold(Ok(()), Result::and)
    }

    fn force_flush(&mut self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.exporters.iter_mut().map(|(_, e)| e.force_flush()).fold(Ok(()), Result::and)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        for (name, exporter) in &mut self.exporters {
            let attributes = resource
                .iter()
                .filter(|(key, _)| key.as_str() != "service.name" && key.as_str() != "service.instance.id")
                .map(|(key, value)| opentelemetry::KeyValue::new(key.clone(), value.clone()));
            let named = opentelemetry_sdk::Resource::builder_empty()
                .with_attributes(attributes)
                .with_service_name(*name)
                .with_attribute(opentelemetry::KeyValue::new("service.instance.id", uuid::Uuid::new_v4().to_string()))
                .build();
            exporter.set_resource(&named);
        }
    }
}

/// Install the process-wide subscriber once: logs filtered by `filter` (an
/// `EnvFilter` directive such as `info,looseleaf=debug`) in `format`, and an
/// OpenTelemetry layer that traces at info whatever the log level (so trace
/// context always travels), exporting over OTLP where the environment says.
/// Calling it again is harmless.
pub fn init(service: &'static str, filter: &str, format: LogFormat) -> Result<(), TelemetryError> {
    let export = otlp_export(|var| std::env::var(var).ok())?;
    let provider = match PROVIDER.get() {
        Some(p) => p.clone(),
        None => {
            let mut builder = SdkTracerProvider::builder().with_resource(resource(service));
            // the batch processor exports from its own thread, with the blocking client
            if export.is_some() && service == MANY_COMPONENTS && !env_names_the_service() {
                builder = builder.with_batch_exporter(ByComponent::new(service)?);
            } else if export.is_some() {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
                builder = builder.with_batch_exporter(exporter);
            }
            PROVIDER.get_or_init(|| builder.build()).clone()
        }
    };
    let tracer = provider.tracer(service);
    opentelemetry::global::set_tracer_provider(provider);
    let fmt = tracing_subscriber::fmt::layer().with_target(true).with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Text => fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).boxed(),
        LogFormat::Json => fmt.event_format(JsonLines { service }).boxed(),
    };
    let _already_set = tracing_subscriber::registry()
        .with(fmt.with_filter(log_filter(filter)))
        .with(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(traced()))
        .try_init();
    if let Some(export) = export {
        tracing::info!(endpoint = %export.endpoint, from = export.endpoint_var, "exporting spans over OTLP");
    }
    Ok(())
}

/// What becomes a span: everything at INFO and above but the exporter's own HTTP
/// client and the SDK's reports (a span per export would export itself).
fn traced() -> Targets {
    Targets::new()
        .with_default(LevelFilter::INFO)
        .with_target("opentelemetry", LevelFilter::OFF)
        .with_target("opentelemetry_sdk", LevelFilter::OFF)
        .with_target("opentelemetry_otlp", LevelFilter::OFF)
        .with_target("reqwest", LevelFilter::OFF)
        .with_target("hyper", LevelFilter::OFF)
        .with_target("hyper_util", LevelFilter::OFF)
}

/// What the log shows: the events `filter` (`--log`) enables, written in every
/// span that is traced, whatever `filter` says of spans. A log line finds its
/// trace through the spans the log layer sees, so one at `warn` written while
/// the bus's `info` span of a message is entered still carries that message's
/// trace.
fn log_filter<S>(filter: &str) -> impl tracing_subscriber::layer::Filter<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::filter::FilterExt as _;
    let events = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let spans = tracing_subscriber::filter::filter_fn(|meta| meta.is_span()).and(traced());
    events.or(spans)
}

/// `--log-format json`: one object per line with the time, level, service, target,
/// message and fields, the names of the spans it happened in, and the trace and
/// span ids that tie it to its cell's trace.
struct JsonLines {
    service: &'static str,
}

/// Collects an event's fields as JSON values.
struct JsonFields<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for JsonFields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.0.insert(field.name().to_string(), value.into());
    }
}

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for JsonLines
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use opentelemetry::trace::TraceContextExt as _;
        let mut fields = serde_json::Map::new();
        event.record(&mut JsonFields(&mut fields));
        let meta = event.metadata();
        let mut line = serde_json::Map::new();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        line.insert("time_unix_ms".into(), (now.as_millis() as u64).into());
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("service".into(), self.service.into());
        line.insert("target".into(), meta.target().into());
        if let Some(message) = fields.remove("message") {
            line.insert("message".into(), message);
        }
        if !fields.is_empty() {
            line.insert("fields".into(), fields.into());
        }
        if let Some(scope) = ctx.event_scope() {
            let spans: Vec<serde_json::Value> = scope.from_root().map(|s| s.name().into()).collect();
            line.insert("spans".into(), spans.into());
        }
        // from the span's OpenTelemetry data (`Span::current()` cannot be asked from
        // inside the subscriber: tracing answers a re-entrant call with no span)
        if let Some(span) = ctx.lookup_current() {
            if let Some(otel) = span.extensions().get::<tracing_opentelemetry::OtelData>() {
                // the trace the exported span joins: its parent's, when it has one
                // (set after the span was made, from a message's or a request's
                // headers); the id made for it as a root only otherwise
                let parent = otel.parent_cx.span().span_context().clone();
                let trace = if parent.is_valid() {
                    parent.trace_id()
                } else {
                    otel.builder.trace_id.unwrap_or(opentelemetry::trace::TraceId::INVALID)
                };
                if trace != opentelemetry::trace::TraceId::INVALID {
                    line.insert("trace_id".into(), trace.to_string().into());
                }
                if let Some(id) = otel.builder.span_id {
                    line.insert("span_id".into(), id.to_string().into());
                }
            }
        }
        writeln!(writer, "{}", serde_json::Value::Object(line))
    }
}

/// Export every finished span now (the last step of a service's shutdown, so the
/// spans of its drain leave the process too). Only a flush: in `looseleaf up` the
/// services share one process and the others still trace.
pub fn flush() {
    if let Some(provider) = PROVIDER.get() {
        if let Err(e) = provider.force_flush() {
            tracing::debug!(error = %e, "tracer provider flush");
        }
    }
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// Put the current span's trace context (`traceparent`) into NATS headers.
pub fn inject_current(headers: &mut HeaderMap) {
    inject(&tracing::Span::current(), headers);
}

/// Put `span`'s trace context into NATS headers; for a disabled span (none),
/// the current span's.
pub fn inject(span: &tracing::Span, headers: &mut HeaderMap) {
    let cx = if span.is_disabled() { tracing::Span::current().context() } else { span.context() };
    TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
}

/// Whether the current span belongs to a trace (a valid span context).
pub fn in_trace() -> bool {
    use opentelemetry::trace::TraceContextExt as _;
    tracing::Span::current().context().span().span_context().is_valid()
}

/// Make `span` a child of the trace context carried in `headers`, if any.
pub fn continue_trace(span: &tracing::Span, headers: Option<&HeaderMap>) {
    if let Some(h) = headers {
        let cx = TraceContextPropagator::new().extract(&HeaderExtractor(h));
        span.set_parent(cx);
    }
}

/// The current span's trace context as HTTP header pairs (`traceparent`,
/// `tracestate`), for a request that continues this trace elsewhere.
pub fn http_trace_headers() -> Vec<(String, String)> {
    struct Pairs(Vec<(String, String)>);
    impl Injector for Pairs {
        fn set(&mut self, key: &str, value: String) {
            self.0.push((key.to_string(), value));
        }
    }
    let mut pairs = Pairs(Vec::new());
    TraceContextPropagator::new().inject_context(&tracing::Span::current().context(), &mut pairs);
    pairs.0
}

/// Make `span` a child of the trace context an HTTP request carried (its
/// `traceparent` and `tracestate` headers), if it carried one.
pub fn continue_http_trace(span: &tracing::Span, traceparent: Option<&str>, tracestate: Option<&str>) {
    let Some(parent) = traceparent else { return };
    let mut carrier = std::collections::HashMap::from([("traceparent".to_string(), parent.to_string())]);
    if let Some(state) = tracestate {
        carrier.insert("tracestate".to_string(), state.to_string());
    }
    span.set_parent(TraceContextPropagator::new().extract(&carrier));
}

/// Link `span` to the span `other` (a preparation to the run it prepared):
/// related work in another trace.
pub fn link(span: &tracing::Span, other: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt as _;
    let cx = other.context();
    let linked = cx.span().span_context().clone();
    if linked.is_valid() {
        span.add_link(linked);
    }
}

/// Record a finished child of the current span that something else timed (a
/// worker process reports how long its phases took): `name` from `start` to `end`.
pub fn timed_child(name: &'static str, start: std::time::SystemTime, end: std::time::SystemTime) {
    use opentelemetry::trace::{Span as _, TraceContextExt as _, Tracer as _};
    let parent = tracing::Span::current().context();
    if !parent.span().span_context().is_valid() {
        return; // not traced
    }
    let tracer = opentelemetry::global::tracer("looseleaf");
    tracer.span_builder(name).with_start_time(start).start_with_context(&tracer, &parent).end_with_timestamp(end);
}

/// Resolves on SIGINT or SIGTERM. The listeners are set up when this is called
/// (inside the runtime), not when it is first polled: a service that is still
/// starting (connecting, starting its zygotes) must not miss a SIGTERM sent
/// meanwhile, or it runs on until its supervisor's kill.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (int, term) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()));
        async move {
            match (int, term) {
                (Ok(mut int), Ok(mut term)) => {
                    tokio::select! {
                        _ = int.recv() => {},
                        _ = term.recv() => {},
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A log destination the test reads back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn otlp_export_follows_the_standard_variables() {
        assert_eq!(otlp_export(env(&[])).unwrap(), None, "no endpoint, no export");
        let base = otlp_export(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")])).unwrap().unwrap();
        assert_eq!(
            (base.endpoint_var, base.endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
        );
        let both = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/v1/traces"),
        ];
        assert_eq!(otlp_export(env(&both)).unwrap().unwrap().endpoint_var, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        let disabled = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"), ("OTEL_SDK_DISABLED", "TRUE")];
        assert_eq!(otlp_export(env(&disabled)).unwrap(), None);
        let grpc = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")];
        let e = otlp_export(env(&grpc)).unwrap_err().to_string();
        assert!(e.contains("OTEL_EXPORTER_OTLP_PROTOCOL=grpc") && e.contains("http/protobuf"), "{e}");
        // the traces variable decides over the general one
        let traces = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ];
        assert!(otlp_export(env(&traces)).unwrap().is_some());
        let json =
            [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"), ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")];
        assert!(otlp_export(env(&json)).unwrap_err().to_string().contains("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"));
    }

    #[test]
    fn http_trace_context_round_trips() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let parent = tracing::info_span!("execute_request");
            let headers = parent.in_scope(http_trace_headers);
            let traceparent = headers.iter().find(|(k, _)| k == "traceparent").map(|(_, v)| v.clone()).unwrap();
            let child = tracing::info_span!("run cell");
            continue_http_trace(&child, Some(&traceparent), None);
            use opentelemetry::trace::TraceContextExt as _;
            let (p, c) = (parent.context(), child.context());
            assert_eq!(p.span().span_context().trace_id(), c.span().span_context().trace_id());
            assert!(traceparent.contains(&p.span().span_context().span_id().to_string()), "{traceparent}");
        });
        assert!(http_trace_headers().is_empty(), "outside any span there is no context to send");
    }

    /// The JSON log lines `body` writes, through the layers and filters `init`
    /// sets up, with `--log` `filter`.
    fn json_log_lines(filter: &str, body: impl FnOnce()) -> Vec<serde_json::Value> {
        let captured = Captured::default();
        let writer = captured.clone();
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .event_format(JsonLines { service: "looseleaf-test" })
                    .with_writer(move || writer.clone())
                    .with_filter(log_filter(filter)),
            )
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")).with_filter(traced()));
        tracing::subscriber::with_default(subscriber, body);
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }

    #[test]
    fn json_lines_carry_fields_spans_and_the_trace_ids() {
        let lines = json_log_lines("info", || {
            tracing::info!("outside any span");
            let span = tracing::info_span!("run_cell");
            let _entered = span.enter();
            tracing::warn!(exec = 7, host = "host-0", "claim failed");
        });
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["message"], "outside any span");
        assert!(lines[0].get("trace_id").is_none(), "{}", lines[0]);
        let line = &lines[1];
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["service"], "looseleaf-test");
        assert_eq!(line["message"], "claim failed");
        assert_eq!(line["fields"]["exec"], 7);
        assert_eq!(line["fields"]["host"], "host-0");
        assert_eq!(line["spans"], serde_json::json!(["run_cell"]));
        let trace = line["trace_id"].as_str().unwrap_or_else(|| panic!("{line}"));
        assert_eq!(trace.len(), 32, "{line}");
        assert!(trace.chars().all(|c| c.is_ascii_hexdigit()) && trace != "0".repeat(32), "{line}");
        assert_eq!(line["span_id"].as_str().map(str::len), Some(16), "{line}");
    }

    /// A span continued from a message's headers (its parent set after it was
    /// made, as `continue_trace` does): its log lines carry the trace it joins
    /// when exported, the sender's, not the id it was given as a root; also
    /// where the log shows warnings only, and the span is at info.
    #[test]
    fn json_lines_of_a_span_continued_from_headers_carry_the_senders_trace() {
        let sender = "0af7651916cd43dd8448eb211c80319c";
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", format!("00-{sender}-b7ad6b7169203331-01").as_str());
        let lines = json_log_lines("warn", || {
            let span = tracing::info_span!("on_recipe");
            continue_trace(&span, Some(&headers));
            let _entered = span.enter();
            tracing::warn!("claimed");
            tracing::info!("not shown");
            let child = tracing::info_span!("fork");
            let _in_child = child.enter();
            tracing::warn!("forked");
        });
        assert_eq!(lines.len(), 2, "{lines:?}");
        for line in &lines {
            assert_eq!(line["trace_id"], sender, "{line}");
        }
        assert_eq!(lines[1]["spans"], serde_json::json!(["on_recipe", "fork"]));
    }
}
