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

/// The tracer provider `init` installed, kept so that `shutdown` can flush it.
static PROVIDER: std::sync::OnceLock<SdkTracerProvider> = std::sync::OnceLock::new();

/// Install the process-wide subscriber once: logs filtered by `filter` (an
/// `EnvFilter` directive such as `info,looseleaf=debug`) and an OpenTelemetry layer
/// whose span contexts travel in NATS headers. Calling it again is harmless.
pub fn init(service: &'static str, filter: &str) {
    let provider = PROVIDER.get_or_init(|| SdkTracerProvider::builder().build()).clone();
    let tracer = provider.tracer(service);
    opentelemetry::global::set_tracer_provider(provider);
    let _already_set = tracing_subscriber::registry()
        .with(EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info")))
        .with(tracing_subscriber::fmt::layer().with_target(true).with_writer(std::io::stderr))
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init();
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
