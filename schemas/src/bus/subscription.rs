//! Subscriptions that decode each message, fetch its body first (ADR 30), and
//! answer presence probes without handing them on.

use std::marker::PhantomData;
use std::sync::Arc;

use async_nats::{Client, HeaderMap, Message};
use futures::StreamExt;

use super::presence::answered_probe;
use super::{Bus, EndpointRequest, Envelope, ReplyTo};
use crate::bodies::{Bodies, BODY_HEADER};
use crate::codec::{self, CodecError, WireMessage};
use crate::messages::{ErrorCode, Reply};

/// A subscription that decodes each message.
pub struct Subscription<M> {
    source: Source,
    /// Answers presence probes.
    client: Client,
    bodies: Bodies,
    /// The service that subscribed (named on its messages' spans).
    service: &'static str,
    _m: PhantomData<fn() -> M>,
}

/// Where a subscription's messages come from.
pub(super) enum Source {
    /// A plain (or queue) subscription.
    Subscriber(async_nats::Subscriber),
    /// A `$SRV` endpoint's requests.
    Endpoint { name: String, endpoint: Box<async_nats::service::endpoint::Endpoint> },
}

impl Source {
    /// The stream of messages, each with the endpoint request it came as.
    fn messages(self) -> futures::stream::BoxStream<'static, (Message, Option<Arc<EndpointRequest>>)> {
        match self {
            Source::Subscriber(s) => s.map(|m| (m, None)).boxed(),
            Source::Endpoint { name, endpoint } => endpoint
                .map(move |request| {
                    let message = request.message.clone();
                    (message, Some(Arc::new(EndpointRequest { name: name.clone(), request })))
                })
                .boxed(),
        }
    }
}

/// A message that did not decode; the service logs it and goes on.
#[derive(Debug)]
pub struct Rejected {
    /// The subject it arrived on.
    pub subject: String,
    /// Where the sender waits for a reply, if it was a request.
    pub reply: Option<String>,
    /// The `$SRV` endpoint it came through, for requests to one.
    pub endpoint: Option<Arc<EndpointRequest>>,
    /// Why it was rejected.
    pub error: CodecError,
}

impl<M> std::fmt::Debug for Subscription<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.source {
            Source::Subscriber(s) => f.debug_tuple("Subscription").field(s).finish(),
            Source::Endpoint { name, .. } => f.debug_struct("Subscription").field("endpoint", name).finish(),
        }
    }
}

impl<M: WireMessage> Subscription<M> {
    pub(super) fn new(source: Source, bus: &Bus) -> Self {
        Self { source, client: bus.client.clone(), bodies: bus.bodies.clone(), service: bus.service, _m: PhantomData }
    }

    /// The next message; `None` when the subscription ends.
    pub async fn next(&mut self) -> Option<Result<Envelope<M>, Rejected>> {
        loop {
            let (message, endpoint) = match &mut self.source {
                Source::Subscriber(s) => (s.next().await?, None),
                Source::Endpoint { name, endpoint } => {
                    let request = endpoint.next().await?;
                    (request.message.clone(), Some(Arc::new(EndpointRequest { name: name.clone(), request })))
                }
            };
            if !answered_probe(&self.client, &message, endpoint.as_deref()).await {
                return Some(decode_message(&self.bodies, message, endpoint, self.service).await);
            }
        }
    }

    /// The decoding stream, for `ctx.add_stream` in actors (in order: a message
    /// with a body is fetched before the next one is yielded).
    pub fn into_stream(self) -> futures::stream::BoxStream<'static, Result<Envelope<M>, Rejected>> {
        let (bodies, client, service) = (self.bodies, self.client, self.service);
        self.source
            .messages()
            .filter_map(move |(message, endpoint)| {
                let client = client.clone();
                async move {
                    let probe = answered_probe(&client, &message, endpoint.as_deref()).await;
                    (!probe).then_some((message, endpoint))
                }
            })
            .then(move |(message, endpoint)| {
                let bodies = bodies.clone();
                async move { decode_message(&bodies, message, endpoint, service).await }
            })
            .boxed()
    }
}

/// Decode a payload as `M`, fetching its body first if its headers name one.
pub(super) async fn decode_with<M: WireMessage>(
    bodies: &Bodies,
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Result<M, CodecError> {
    match headers.and_then(|h| h.get(BODY_HEADER)) {
        Some(body) => {
            // a message of another type is refused before its body is fetched
            codec::check_headers::<M>(headers)?;
            let bytes = bodies.get(body.as_str()).await.map_err(|e| CodecError::Body(e.to_string()))?;
            codec::decode(headers, &bytes)
        }
        None => codec::decode(headers, payload),
    }
}

/// Decode a raw NATS message as `M`.
async fn decode_message<M: WireMessage>(
    bodies: &Bodies,
    message: Message,
    endpoint: Option<Arc<EndpointRequest>>,
    service: &'static str,
) -> Result<Envelope<M>, Rejected> {
    let subject = message.subject.to_string();
    let reply = message.reply.as_ref().map(|r| r.to_string());
    match decode_with::<M>(bodies, message.headers.as_ref(), &message.payload).await {
        Ok(msg) => Ok(Envelope { subject, reply, headers: message.headers, msg, endpoint, service }),
        Err(error) => {
            tracing::error!(%subject, %error, "rejected a message that does not decode");
            Err(Rejected { subject, reply, endpoint, error })
        }
    }
}

impl Rejected {
    /// Tell a requester its request was bad; plain publishes are only logged.
    pub async fn answer<T: WireMessage>(&self, bus: &Bus) {
        let reply: Reply<T> = Reply::Err { code: ErrorCode::BadRequest, message: self.error.to_string() };
        let to = ReplyTo { subject: self.reply.clone(), endpoint: self.endpoint.clone() };
        if let Err(e) = bus.respond(to, &reply).await {
            tracing::warn!(error = %e, "could not answer a rejected request");
        }
    }
}
