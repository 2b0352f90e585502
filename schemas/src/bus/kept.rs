//! Messages a JetStream stream must keep: a cell's outputs and events survive
//! a NATS restart, and a frontend that missed them live reads them back (ADR 55).

use std::time::Duration;

use async_nats::HeaderMap;

use super::{Bus, BusError};
use crate::codec::WireMessage;

/// How long an event or output is sent again until its stream keeps it (NATS
/// restarting meanwhile, [`Kept::confirmed`]); after that it is lost to a client
/// that did not see it live.
pub const KEPT_PATIENCE: Duration = Duration::from_secs(60);

impl Bus {
    /// Publish `msg` on a subject a JetStream stream keeps, and wait until the
    /// stream has it ([`Kept::confirmed`]).
    pub async fn publish_kept<M: WireMessage>(
        &self,
        subject: String,
        msg: &M,
        patience: Duration,
    ) -> Result<(), BusError> {
        self.send_kept(subject, msg).await?.confirmed(self, patience).await
    }

    /// Send `msg` once on a subject a JetStream stream keeps; [`Kept::confirmed`]
    /// waits for the stream to have it (a sender keeps several in flight so that
    /// the round trips overlap).
    pub async fn send_kept<M: WireMessage>(&self, subject: String, msg: &M) -> Result<Kept, BusError> {
        let span = super::send_span(&subject, self.service);
        let (mut headers, payload) = self.encode(&subject, msg, &span).await?;
        // one id for every copy: the stream keeps the first
        headers.insert(async_nats::header::NATS_MESSAGE_ID, uuid::Uuid::now_v7().simple().to_string().as_str());
        let ack = self.jetstream().publish_with_headers(subject.clone(), headers.clone(), payload.clone()).await;
        Ok(Kept { subject, headers, payload, ack: Some(ack) })
    }
}

/// A message sent to a stream that has not acknowledged it yet
/// ([`Bus::send_kept`]). A plain publish is lost when NATS restarts under it;
/// one the stream acknowledged is kept, and a reader that missed it live
/// (reconnecting meanwhile) reads it back from the stream.
pub struct Kept {
    subject: String,
    headers: HeaderMap,
    payload: bytes::Bytes,
    ack: Option<Result<async_nats::jetstream::context::PublishAckFuture, async_nats::jetstream::context::PublishError>>,
}

impl Kept {
    /// Wait until the stream has the message, sending it again (same message id,
    /// so the stream keeps one copy; a live subscriber may see two) for up to
    /// `patience`. A subject no stream keeps (a cluster without the stream) gets
    /// a plain publish.
    pub async fn confirmed(mut self, bus: &Bus, patience: Duration) -> Result<(), BusError> {
        use async_nats::jetstream::context::PublishErrorKind;
        let deadline = tokio::time::Instant::now() + patience;
        let mut backoff = Duration::from_millis(50);
        loop {
            let sent = match self.ack.take() {
                Some(Ok(ack)) => ack.await,
                Some(Err(e)) => Err(e),
                None => match bus
                    .jetstream()
                    .publish_with_headers(self.subject.clone(), self.headers.clone(), self.payload.clone())
                    .await
                {
                    Ok(ack) => ack.await,
                    Err(e) => Err(e),
                },
            };
            let error = match sent {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                    let Kept { subject, headers, payload, .. } = self;
                    return bus
                        .client
                        .publish_with_headers(subject.clone(), headers, payload)
                        .await
                        .map_err(|source| BusError::Publish { subject, source });
                }
                Err(e) => e,
            };
            if tokio::time::Instant::now() + backoff > deadline {
                return Err(BusError::Kept { subject: self.subject, reason: error.to_string() });
            }
            tracing::warn!(subject = %self.subject, %error, "a stream did not acknowledge a message; sending it again");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}
