//! Whether something serves a subject: presence probes, and what each bus
//! remembers of services found absent (ADR 55). A request held by a service that
//! dies is found out by probes while it waits, not after its attempt; a
//! service found down fails a cell's later requests at once.

use std::time::Duration;

use async_nats::{Client, HeaderMap, Message};

use super::{Bus, EndpointRequest, ATTEMPT_WAIT};

/// How often an attempt of [`Bus::request_idempotent`] checks, while it waits,
/// that something still serves its subject: a service killed while it held the
/// request is then known gone within this, not after [`ATTEMPT_WAIT`].
pub const PRESENCE_PROBE_EVERY: Duration = Duration::from_millis(500);

/// The header of a presence probe: a request every subscription answers at once,
/// empty, without handing it to its service ([`Bus::request_idempotent`]). A
/// service of an older version answers it with a decoding error, which says as
/// much: something is there.
pub const PROBE_HEADER: &str = "LooseLeaf-Probe";

impl Bus {
    /// Since when nothing has served `subject`'s service, if that is what it was
    /// last found. Kept per service, not per verb: one request that found the
    /// store down fails the store's other verbs at once, not each after waiting.
    pub(super) fn absent_since(&self, subject: &str) -> Option<tokio::time::Instant> {
        let service = self.subjects.service_of(subject);
        self.absent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(service).copied()
    }

    /// Remember that `subject`'s service is served (`None`) or has not been since `since`.
    pub(super) fn note_presence(&self, subject: &str, since: Option<tokio::time::Instant>) {
        let service = self.subjects.service_of(subject);
        let mut absent = self.absent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match since {
            None => {
                absent.remove(service);
            }
            Some(since) => {
                // services that went away for good (a host) are not kept forever
                if absent.len() >= 1024 {
                    absent.clear();
                }
                absent.insert(service.to_string(), since);
            }
        }
    }

    /// Probe `subject` every [`PRESENCE_PROBE_EVERY`] until nothing serves it any
    /// more; returns when something was last seen serving it (a probe unanswered
    /// in time says nothing either way). Never returns while something serves it.
    pub(super) async fn watch_presence(&self, subject: &str) -> tokio::time::Instant {
        let mut last_seen = tokio::time::Instant::now();
        let mut headers = HeaderMap::new();
        headers.insert(PROBE_HEADER, "1");
        loop {
            tokio::time::sleep(PRESENCE_PROBE_EVERY).await;
            let asked_at = tokio::time::Instant::now();
            let probe = async_nats::Request::new()
                .headers(headers.clone())
                .payload(bytes::Bytes::new())
                .timeout(Some(ATTEMPT_WAIT));
            match self.client.send_request(subject.to_string(), probe).await {
                Ok(_) => last_seen = asked_at,
                Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => return last_seen,
                Err(_) => {}
            }
        }
    }
}

/// Answer `message` at once if it is a presence probe ([`PROBE_HEADER`]); says
/// whether it was one.
pub(super) async fn answered_probe(client: &Client, message: &Message, endpoint: Option<&EndpointRequest>) -> bool {
    if message.headers.as_ref().and_then(|h| h.get(PROBE_HEADER)).is_none() {
        return false;
    }
    let sent = match (endpoint, &message.reply) {
        (Some(e), _) => e.request.respond(Ok(bytes::Bytes::new())).await,
        (None, Some(reply)) => client.publish(reply.clone(), bytes::Bytes::new()).await,
        (None, None) => Ok(()),
    };
    if let Err(e) = sent {
        tracing::debug!(error = %e, "could not answer a presence probe");
    }
    true
}
