//! An OTLP receiver of the test's own: it takes what services export to
//! `/v1/traces` (HTTP/protobuf, as a collector would) and keeps every span, so a
//! test can check a cell's span tree.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message as _;

/// One span as received.
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    /// `service.name` of the resource that sent it.
    pub service: String,
    /// Every attribute of that resource, as text.
    pub resource: BTreeMap<String, String>,
    /// Hex trace id.
    pub trace_id: String,
    /// Hex span id.
    pub span_id: String,
    /// Hex id of its parent; empty for a root.
    pub parent_id: String,
    /// Its name.
    pub name: String,
    /// Its kind, as OTLP numbers it: 1 internal, 2 server, 3 client, 4 producer,
    /// 5 consumer.
    pub kind: i32,
    /// Its attributes, as text.
    pub attributes: BTreeMap<String, String>,
    /// The spans it links to: (trace id, span id), hex.
    pub links: Vec<(String, String)>,
    /// Start and end, unix nanoseconds.
    pub start_ns: u64,
    /// End, unix nanoseconds.
    pub end_ns: u64,
}

type Spans = Arc<Mutex<Vec<ReceivedSpan>>>;

/// The receiver; it stops when dropped.
pub struct OtlpReceiver {
    endpoint: String,
    spans: Spans,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn export(State(spans): State<Spans>, body: Bytes) -> (StatusCode, Vec<u8>) {
    let Ok(req) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut got = Vec::new();
    for rs in req.resource_spans {
        let resource: BTreeMap<String, String> =
            rs.resource.iter().flat_map(|r| r.attributes.iter()).map(|kv| (kv.key.clone(), text(kv))).collect();
        let service = resource.get("service.name").cloned().unwrap_or_default();
        for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
            got.push(ReceivedSpan {
                service: service.clone(),
                resource: resource.clone(),
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_id: hex(&span.parent_span_id),
                name: span.name,
                kind: span.kind,
                attributes: span.attributes.iter().map(|kv| (kv.key.clone(), text(kv))).collect(),
                links: span.links.iter().map(|l| (hex(&l.trace_id), hex(&l.span_id))).collect(),
                start_ns: span.start_time_unix_nano,
                end_ns: span.end_time_unix_nano,
            });
        }
    }
    spans.lock().unwrap_or_else(|e| e.into_inner()).extend(got);
    // an empty ExportTraceServiceResponse: everything accepted
    (StatusCode::OK, Vec::new())
}

impl OtlpReceiver {
    /// Listen on a free loopback port.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_on(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Listen on `addr` (a collector's address, for a test that stands in for one).
    pub async fn start_on(addr: std::net::SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let spans: Spans = Arc::default();
        let app = axum::Router::new().route("/v1/traces", axum::routing::post(export)).with_state(spans.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { endpoint, spans, server })
    }

    /// What `OTEL_EXPORTER_OTLP_ENDPOINT` should say.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Wait (up to `within`) until the spans received satisfy `done`; the spans.
    pub async fn until(
        &self,
        within: Duration,
        what: &str,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> anyhow::Result<Vec<ReceivedSpan>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return Ok(spans);
            }
            if tokio::time::Instant::now() > deadline {
                let names: Vec<_> = spans.iter().map(|s| format!("{}:{}", s.service, s.name)).collect();
                return Err(anyhow::anyhow!("never received {what}; got {names:?}")).context("OTLP receiver");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
