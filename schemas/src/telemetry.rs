//! Tracing for every service: a fmt subscriber plus an OpenTelemetry layer, and
//! W3C trace-context propagation through NATS headers, so one cell's spans across
//! all services form one trace.

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;

/// The tracer provider `init` installed, kept so that `shutdown` can flush it.
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

/// Install the process-wide subscriber once: logs filtered by `filter` (an
/// `EnvFilter` directive such as `info,looseleaf=debug`) in `format`, and an
/// OpenTelemetry layer whose span contexts travel in NATS headers. Calling it
/// again is harmless.
pub fn init(service: &'static str, filter: &str, format: LogFormat) {
    let provider = PROVIDER.get_or_init(|| SdkTracerProvider::builder().build()).clone();
    let tracer = provider.tracer(service);
    opentelemetry::global::set_tracer_provider(provider);
    let fmt = tracing_subscriber::fmt::layer().with_target(true).with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Text => fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).boxed(),
        LogFormat::Json => fmt.event_format(JsonLines { service }).boxed(),
    };
    let _already_set = tracing_subscriber::registry()
        .with(EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info")))
        .with(fmt)
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init();
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
                let parent = otel.parent_cx.span().span_context().trace_id();
                let trace = otel.builder.trace_id.unwrap_or(parent);
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
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
}

/// Make `span` a child of the trace context carried in `headers`, if any.
pub fn continue_trace(span: &tracing::Span, headers: Option<&HeaderMap>) {
    if let Some(h) = headers {
        let cx = TraceContextPropagator::new().extract(&HeaderExtractor(h));
        span.set_parent(cx);
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
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

    #[test]
    fn json_lines_carry_fields_spans_and_the_trace_ids() {
        let captured = Captured::default();
        let writer = captured.clone();
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .event_format(JsonLines { service: "looseleaf-test" })
                    .with_writer(move || writer.clone()),
            )
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!("outside any span");
            let span = tracing::info_span!("run_cell");
            let _entered = span.enter();
            tracing::warn!(exec = 7, host = "host-0", "claim failed");
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2, "{text}");
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
}
