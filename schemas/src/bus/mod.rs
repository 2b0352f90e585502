//! A typed client over async-nats: publish, request and subscribe-and-decode, with
//! the message type and version in headers and W3C trace context on every message.
//!
//! A payload that does not decode is yielded as an error by [`Subscription::next`];
//! services log it and keep serving (CONVENTIONS.md 14). A payload too large for
//! one message travels as a body beside it ([`crate::bodies`], ADR 30): sending
//! and receiving here store and fetch it, so callers never see the difference.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::{Client, HeaderMap};

use crate::bodies::{Bodies, BODY_HEADER, INLINE_MAX_BYTES};
use crate::codec::{self, CodecError, WireMessage};
use crate::messages::{ErrorCode, Reply};
use crate::nats::NatsOptions;
use crate::subjects::Subjects;
use crate::telemetry;

mod error;
mod kept;
mod presence;
mod subscription;

pub use error::BusError;
pub use kept::{Kept, KEPT_PATIENCE};
pub use presence::{PRESENCE_PROBE_EVERY, PROBE_HEADER};
use subscription::{decode_with, Source};
pub use subscription::{Rejected, Subscription};

/// How long [`Bus::deliver`] waits for an acknowledgement before it sends the
/// message again (it may have been lost with a NATS node or a receiver that died
/// holding it; receivers drop a copy they already have).
pub const ACK_WAIT: Duration = Duration::from_secs(2);

/// How long one attempt of [`Bus::request_idempotent`] waits for its answer
/// before it asks again. Store reads answer in milliseconds; a loaded store in
/// well under this.
pub const ATTEMPT_WAIT: Duration = Duration::from_secs(5);

/// How long [`Bus::request_idempotent`] asks again while nobody serves its
/// subject: long enough for a service restarting in place (it subscribes within a
/// second of starting), short enough that a service that is down fails a cell
/// within seconds even when two requests of the cell each find it so.
pub const ABSENT_PATIENCE: Duration = Duration::from_secs(2);

/// How many times [`Bus::deliver`] sends a message nobody acknowledges before it
/// takes it as received by a listener that does not acknowledge (an older version).
pub const UNACKNOWLEDGED_SENDS: u32 = 5;

/// The typed bus of one service.
#[derive(Clone, Debug)]
pub struct Bus {
    client: Client,
    subjects: Subjects,
    bodies: Bodies,
    replicas: usize,
    /// The service this bus belongs to, named on the spans it makes (a process
    /// may run several: `looseleaf up`).
    service: &'static str,
    /// Error replies sent per `$SRV` endpoint (its stats' `data.errors`).
    endpoint_errors: Arc<Mutex<HashMap<String, u64>>>,
    /// Subjects nothing served when last asked, and since when
    /// ([`Bus::request_idempotent`]): a cell's later reads of a service found
    /// down fail at once, not after patience each.
    absent: Arc<Mutex<HashMap<String, tokio::time::Instant>>>,
}

/// A request that came through a `$SRV` endpoint: answered through it, it counts
/// in the endpoint's stats (requests, processing time).
#[derive(Debug)]
pub struct EndpointRequest {
    name: String,
    request: async_nats::service::Request,
}

/// Where a request's answer goes: its reply subject, and the endpoint it came
/// through, if any.
#[derive(Clone, Debug, Default)]
pub struct ReplyTo {
    subject: Option<String>,
    endpoint: Option<Arc<EndpointRequest>>,
}

impl From<Option<String>> for ReplyTo {
    fn from(subject: Option<String>) -> Self {
        Self { subject, endpoint: None }
    }
}

/// A decoded message with what came with it.
#[derive(Debug)]
pub struct Envelope<M> {
    /// The subject it arrived on.
    pub subject: String,
    /// Where to send the reply, for requests.
    pub reply: Option<String>,
    /// Its headers (trace context).
    pub headers: Option<HeaderMap>,
    /// The message.
    pub msg: M,
    /// The `$SRV` endpoint it came through, for requests to one.
    pub endpoint: Option<Arc<EndpointRequest>>,
    /// The service that received it (see [`Bus::for_service`]).
    pub service: &'static str,
}

impl<M> Envelope<M> {
    /// Where its answer goes (see [`Bus::respond`]).
    pub fn reply_to(&self) -> ReplyTo {
        ReplyTo { subject: self.reply.clone(), endpoint: self.endpoint.clone() }
    }

    /// A span for handling this message, continuing the sender's trace.
    pub fn span(&self, name: &'static str) -> tracing::Span {
        let span = tracing::info_span!(
            "handle",
            otel.name = name,
            otel.kind = "consumer",
            messaging.system = "nats",
            messaging.destination.name = %self.subject,
            messaging.destination.template = %crate::subjects::template(&self.subject),
            messaging.operation.type = "process",
            looseleaf.service = self.service,
        );
        telemetry::continue_trace(&span, self.headers.as_ref());
        span
    }
}

/// A PRODUCER span for sending a message on `subject`, by OpenTelemetry's
/// messaging conventions, when the sender is inside a trace (a status heartbeat
/// is not: it starts no trace of its own). Its context travels in the message,
/// so the receiver's CONSUMER span is its child.
fn send_span(subject: &str, service: &'static str) -> tracing::Span {
    if !telemetry::in_trace() {
        return tracing::Span::none();
    }
    let template = crate::subjects::template(subject);
    tracing::info_span!(
        "send",
        otel.name = %format_args!("send {template}"),
        otel.kind = "producer",
        messaging.system = "nats",
        messaging.destination.name = %subject,
        messaging.destination.template = %template,
        messaging.operation.type = "send",
        looseleaf.service = service,
    )
}

/// `url` without its password, for messages and logs.
pub fn shown_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}{}", &url[..scheme + 3], &url[at + 1..]),
        _ => url.to_string(),
    }
}

impl Bus {
    /// Connect to `url` (one server or a seed list; it may carry a user and
    /// password) as `name`, with subjects under `prefix`.
    pub async fn connect(url: &str, prefix: &str, name: &str) -> Result<Self, BusError> {
        Self::connect_with(&NatsOptions::url(url), prefix, name).await
    }

    /// Connect as `nats` says (servers, login, TLS, replicas) as `name`, with
    /// subjects under `prefix`.
    pub async fn connect_with(nats: &NatsOptions, prefix: &str, name: &str) -> Result<Self, BusError> {
        let client = nats.connect(name).await?;
        Ok(Self::from_client(client, prefix, nats.replicas))
    }

    /// Wrap an existing client; buckets and streams it creates get `replicas` copies.
    pub fn from_client(client: Client, prefix: &str, replicas: usize) -> Self {
        let bodies = Bodies::new(client.clone(), prefix, replicas);
        Self {
            client,
            subjects: Subjects::new(prefix),
            bodies,
            replicas,
            service: telemetry::MANY_COMPONENTS,
            endpoint_errors: Default::default(),
            absent: Default::default(),
        }
    }

    /// This bus belongs to `service` (its spans say so).
    pub fn for_service(mut self, service: &'static str) -> Self {
        self.service = service;
        self
    }

    /// Replicas of the buckets and streams this service creates.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The subjects of this bus's prefix.
    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// The raw client (JetStream, service API).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// A JetStream context on this connection.
    pub fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client.clone())
    }

    /// Encode `msg` with the trace context of `span` (a PRODUCER span the sender
    /// holds until it is sent, or none: then the current span's); a payload too
    /// large to travel inline is stored as a body.
    async fn encode<M: WireMessage>(
        &self,
        subject: &str,
        msg: &M,
        span: &tracing::Span,
    ) -> Result<(HeaderMap, bytes::Bytes), BusError> {
        let (mut headers, payload) =
            codec::encode(msg).map_err(|source| BusError::Codec { subject: subject.to_string(), source })?;
        telemetry::inject(span, &mut headers);
        if payload.len() <= INLINE_MAX_BYTES {
            return Ok((headers, payload.into()));
        }
        let body = self
            .bodies
            .put(&payload)
            .await
            .map_err(|source| BusError::Body { subject: subject.to_string(), source })?;
        headers.insert(BODY_HEADER, body.header().as_str());
        Ok((headers, bytes::Bytes::new()))
    }

    /// Decode a message received on this bus (fetching its body if it has one).
    pub async fn decode<M: WireMessage>(&self, headers: Option<&HeaderMap>, payload: &[u8]) -> Result<M, CodecError> {
        decode_with(&self.bodies, headers, payload).await
    }

    /// Publish a message.
    pub async fn publish<M: WireMessage>(&self, subject: String, msg: &M) -> Result<(), BusError> {
        let span = send_span(&subject, self.service);
        let (headers, payload) = self.encode(&subject, msg, &span).await?;
        self.client
            .publish_with_headers(subject.clone(), headers, payload)
            .await
            .map_err(|source| BusError::Publish { subject, source })
    }

    /// Publish `msg` to subscribers that [`Bus::acknowledge`] it, trying again while
    /// nobody listens (a service that is still starting, or an interest a NATS
    /// cluster has not spread yet) for up to `patience`. A plain publish to nobody
    /// is dropped without a word; a run must not be. It is sent as a request: the
    /// server answers "no responders" at once when nobody listens, so that retry
    /// never duplicates it. With no acknowledgement within [`ACK_WAIT`] the message
    /// may be lost (with a NATS node, or a receiver that died holding it): it is
    /// sent again, so receivers must drop a copy they already have (ADR 46). After
    /// [`UNACKNOWLEDGED_SENDS`] such sends (a listener of an older version that
    /// never acknowledges) it is taken as received.
    pub async fn deliver<M: WireMessage>(&self, subject: String, msg: &M, patience: Duration) -> Result<(), BusError> {
        let span = send_span(&subject, self.service);
        let (headers, payload) = self.encode(&subject, msg, &span).await?;
        let deadline = tokio::time::Instant::now() + patience;
        let mut backoff = Duration::from_millis(50);
        let mut unacknowledged = 0;
        loop {
            let request =
                async_nats::Request::new().headers(headers.clone()).payload(payload.clone()).timeout(Some(ACK_WAIT));
            match self.client.send_request(subject.clone(), request).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == async_nats::RequestErrorKind::TimedOut => {
                    unacknowledged += 1;
                    if unacknowledged >= UNACKNOWLEDGED_SENDS || tokio::time::Instant::now() + ACK_WAIT > deadline {
                        return Ok(());
                    }
                    tracing::warn!(%subject, "no acknowledgement within {ACK_WAIT:?}; sending it again");
                }
                Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                    if tokio::time::Instant::now() + backoff > deadline {
                        return Err(BusError::NoResponders { subject });
                    }
                    tracing::debug!(%subject, "nobody listens yet; trying again in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(BusError::from_request(subject, ACK_WAIT, e)),
            }
        }
    }

    /// Acknowledge a message sent with [`Bus::deliver`] (an empty answer, through
    /// its endpoint if it came through one; a plain publish has no reply subject,
    /// and nothing is sent).
    pub async fn acknowledge(&self, to: ReplyTo) {
        let Some(subject) = to.subject else { return };
        let sent = match to.endpoint {
            Some(endpoint) => endpoint.request.respond(Ok(bytes::Bytes::new())).await,
            None => self.client.publish(subject, bytes::Bytes::new()).await,
        };
        if let Err(e) = sent {
            tracing::debug!(error = %e, "could not acknowledge a delivery");
        }
    }

    /// [`Bus::request`], for a request that may be answered twice (a read, or a
    /// write its answerer makes idempotent). An attempt unanswered after
    /// [`ATTEMPT_WAIT`] may have been lost with a NATS node or the service that
    /// held it, so it is sent again; "no responders" (a service restarting, or
    /// reconnecting to another node) is tried again shortly, for up to
    /// [`ABSENT_PATIENCE`]. All within `timeout`: a lost request costs
    /// [`ATTEMPT_WAIT`], not the whole timeout (ADR 46).
    pub async fn request_idempotent<Req: WireMessage, Resp: WireMessage>(
        &self,
        subject: String,
        msg: &Req,
        timeout: Duration,
    ) -> Result<Resp, BusError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // since when nobody has answered "here" (a service down or restarting),
        // as any request of this bus found
        let mut absent_since = self.absent_since(&subject);
        let mut backoff = Duration::from_millis(50);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let attempt = left.min(ATTEMPT_WAIT).max(Duration::from_millis(1));
            // the service holding the attempt may die with it: watched meanwhile
            let answer = tokio::select! {
                answer = self.request(subject.clone(), msg, attempt) => answer,
                last_seen = self.watch_presence(&subject) => {
                    tracing::warn!(%subject, "the service holding the request is gone; asking again");
                    absent_since = Some(last_seen);
                    Err(BusError::NoResponders { subject: subject.clone() })
                }
            };
            match answer {
                Err(BusError::TimedOut { .. }) if tokio::time::Instant::now() + Duration::from_millis(1) < deadline => {
                    absent_since = None;
                    self.note_presence(&subject, None);
                    tracing::warn!(%subject, "no answer within {attempt:?}; asking again");
                }
                Err(BusError::NoResponders { subject }) => {
                    let now = tokio::time::Instant::now();
                    let since = *absent_since.get_or_insert(now);
                    self.note_presence(&subject, Some(since));
                    if now + backoff >= deadline || now + backoff >= since + ABSENT_PATIENCE {
                        return Err(BusError::NoResponders { subject });
                    }
                    tracing::debug!(%subject, "nobody answers yet; asking again in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(BusError::TimedOut { subject, .. }) => return Err(BusError::TimedOut { subject, timeout }),
                other => {
                    self.note_presence(&subject, None);
                    return other;
                }
            }
        }
    }

    /// Send a request and decode the reply envelope; a remote error becomes
    /// [`BusError::Remote`].
    pub async fn request<Req: WireMessage, Resp: WireMessage>(
        &self,
        subject: String,
        msg: &Req,
        timeout: Duration,
    ) -> Result<Resp, BusError> {
        let span = send_span(&subject, self.service);
        let (headers, payload) = self.encode(&subject, msg, &span).await?;
        let request = async_nats::Request::new().headers(headers).payload(payload).timeout(Some(timeout));
        let reply = self
            .client
            .send_request(subject.clone(), request)
            .await
            .map_err(|e| BusError::from_request(subject.clone(), timeout, e))?;
        let decoded = self.decode::<Reply<Resp>>(reply.headers.as_ref(), &reply.payload).await;
        // a reply has exactly one reader: its body can go once read
        if let Some(body) = reply.headers.as_ref().and_then(|h| h.get(BODY_HEADER)) {
            let (bodies, body) = (self.bodies.clone(), body.as_str().to_string());
            tokio::spawn(async move { bodies.delete(&body).await });
        }
        let reply = decoded.map_err(|source| BusError::Codec { subject: subject.clone(), source })?;
        match reply {
            Reply::Ok(v) => Ok(v),
            Reply::Err { code, message } => Err(BusError::Remote { subject, code, message }),
        }
    }

    /// Answer a request with a reply envelope (`reply_to`: an envelope's
    /// [`Envelope::reply_to`], or a bare reply subject). An answer to a `$SRV`
    /// endpoint's request goes through the endpoint, which counts it; an error
    /// answer counts in the endpoint's `data.errors`. A reply that cannot be sent
    /// (its body could not be stored) is answered with an error that says so,
    /// never left unsent (the asker would only see a time-out).
    pub async fn respond<T: WireMessage>(
        &self,
        reply_to: impl Into<ReplyTo>,
        reply: &Reply<T>,
    ) -> Result<(), BusError> {
        let to = reply_to.into();
        let Some(subject) = to.subject else { return Ok(()) };
        let mut failed = matches!(reply, Reply::Err { .. });
        // an answer travels in the handler's own span
        let current = tracing::Span::current();
        let (headers, payload) = match self.encode(&subject, reply, &current).await {
            Ok(encoded) => encoded,
            Err(BusError::Body { source, .. }) => {
                failed = true;
                let unsent: Reply<T> = Reply::Err {
                    code: ErrorCode::Internal,
                    message: format!("the answer could not be sent: {source}"),
                };
                self.encode(&subject, &unsent, &current).await?
            }
            Err(e) => return Err(e),
        };
        let Some(endpoint) = to.endpoint else {
            return self
                .client
                .publish_with_headers(subject.clone(), headers, payload)
                .await
                .map_err(|source| BusError::Publish { subject, source });
        };
        if failed {
            let mut errors = self.endpoint_errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *errors.entry(endpoint.name.clone()).or_default() += 1;
        }
        endpoint
            .request
            .respond_with_headers(Ok(payload), headers)
            .await
            .map_err(|source| BusError::Publish { subject, source })
    }

    /// Subscribe and decode each message as `M`.
    pub async fn subscribe<M: WireMessage>(&self, subject: String) -> Result<Subscription<M>, BusError> {
        let inner = self
            .client
            .subscribe(subject.clone())
            .await
            .map_err(|e| BusError::Subscribe { subject, source: e.into() })?;
        Ok(Subscription::new(Source::Subscriber(inner), self))
    }

    /// Subscribe in a queue group (work any replica may take) and decode as `M`.
    pub async fn queue_subscribe<M: WireMessage>(
        &self,
        subject: String,
        group: &str,
    ) -> Result<Subscription<M>, BusError> {
        let inner = self
            .client
            .queue_subscribe(subject.clone(), group.to_string())
            .await
            .map_err(|e| BusError::Subscribe { subject, source: e.into() })?;
        Ok(Subscription::new(Source::Subscriber(inner), self))
    }

    /// Register with the NATS service API (`$SRV`), so `nats micro ls`, `nats micro
    /// stats` and `looseleaf status` see this service. Keep the returned handle for
    /// as long as the service runs. Each endpoint's stats carry `data.errors`: the
    /// error answers it sent (LooseLeaf's typed errors travel in the answer, so
    /// the standard `num_errors`, which counts NATS service errors, stays 0).
    pub async fn register_service(
        &self,
        name: &str,
        description: &str,
    ) -> Result<async_nats::service::Service, BusError> {
        use async_nats::service::ServiceExt;
        let errors = self.endpoint_errors.clone();
        self.client
            .service_builder()
            .description(description)
            .stats_handler(move |endpoint, _| {
                let errors = errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                serde_json::json!({ "errors": errors.get(&endpoint).copied().unwrap_or(0) })
            })
            .start(name, env!("CARGO_PKG_VERSION"))
            .await
            .map_err(|source| BusError::Subscribe { subject: format!("$SRV ({name})"), source })
    }

    /// Serve requests on `subject` as endpoint `name` of `service` (so `$SRV`
    /// lists it with its stats), in `queue_group` (replicas sharing the work share
    /// a group; a listener every instance must hear uses a group of its own).
    /// Decodes each request as `M`; answer with [`Bus::respond`] and the
    /// envelope's [`Envelope::reply_to`].
    pub async fn endpoint<M: WireMessage>(
        &self,
        service: &async_nats::service::Service,
        name: &str,
        subject: String,
        queue_group: &str,
    ) -> Result<Subscription<M>, BusError> {
        let endpoint = service
            .endpoint_builder()
            .name(name)
            .queue_group(queue_group)
            .add(subject.clone())
            .await
            .map_err(|source| BusError::Subscribe { subject, source })?;
        let source = Source::Endpoint { name: name.to_string(), endpoint: Box::new(endpoint) };
        Ok(Subscription::new(source, self))
    }

    /// Round trip through the server: when this returns, the server has
    /// processed everything sent before it, subscriptions included.
    /// (async-nats' own `flush` only writes the buffer to the socket, so a
    /// subscription could still miss a message another connection publishes
    /// right after.) The round trip is a request nobody answers; the server
    /// replies "no responders" once it got there.
    pub async fn flush(&self) -> Result<(), BusError> {
        let subject = self.subjects().round_trip_probe();
        // the client's default request timeout applies
        match self.client.request(subject.clone(), bytes::Bytes::new()).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => Ok(()),
            Err(e) => Err(BusError::from_request(subject, Duration::from_secs(10), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_url_is_shown_without_its_password() {
        assert_eq!(super::shown_url("nats://store:s3cret@127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(super::shown_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }
}
