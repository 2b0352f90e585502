//! The planner's lease (ADR 60): one planner plans, the others stand by.
//!
//! The planner keeps its speculator's admissions, the edit debounce and the runs
//! it heard in its own memory, so two planners sharing the queue group would each
//! see part of a session's events. Instead one planner holds the lease, the key
//! [`PLANNER_LEASE_KEY`] in the planner bucket, and only it subscribes; a standby waits.
//!
//! - The holder renews it every [`RENEW`] with compare-and-set on the revision it
//!   wrote. A renewal refused because another planner wrote the key meanwhile
//!   means the lease was taken over: the holder stops ([`Lease::lost`]).
//! - A standby watches the key and takes the lease over with compare-and-set when
//!   its revision has not changed for [`EXPIRY`] on the standby's own clock (no
//!   clocks are compared across machines). It then subscribes; runs sent in the
//!   gap are delivered again by the frontend until a planner answers (ADR 42), and
//!   cells edited in the gap are prepared at their next edit.
//! - A holder that cannot reach NATS cannot plan either; when it is back, a
//!   renewal that nobody overtook succeeds and it goes on.

use std::time::Duration;

use async_nats::jetstream::kv;
use schemas::buckets::PLANNER_LEASE_KEY;
use tokio::time::Instant;

/// How often the holder renews the lease.
pub const RENEW: Duration = Duration::from_secs(1);
/// How long a standby sees the lease unchanged before it takes it over.
pub const EXPIRY: Duration = Duration::from_secs(4);

/// Why a planner holds no lease.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another planner wrote the lease after this one last renewed it.
    #[error("another planner ({holder}) took the planner lease over; this one stops planning")]
    TakenOver { holder: String },
}

/// The lease held by this planner.
pub struct Lease {
    kv: kv::Store,
    holder: String,
    revision: u64,
}

impl Lease {
    /// Wait until this planner (`holder`, unique per process) holds the lease.
    /// Standing by meanwhile is logged once.
    pub async fn acquire(kv: kv::Store, holder: String) -> Lease {
        let mut seen: Option<(u64, Instant)> = None;
        let mut said = false;
        loop {
            match kv.entry(PLANNER_LEASE_KEY).await {
                // this planner's own write, whose answer was lost (a create that
                // timed out but landed)
                Ok(Some(e)) if e.operation == kv::Operation::Put && e.value == holder.as_bytes() => {
                    tracing::info!(%holder, "holds the planner lease");
                    return Lease { kv, holder, revision: e.revision };
                }
                Ok(Some(e)) if e.operation == kv::Operation::Put => {
                    let now = Instant::now();
                    match seen {
                        Some((rev, since)) if rev == e.revision => {
                            if now.duration_since(since) >= EXPIRY {
                                match kv.update(PLANNER_LEASE_KEY, holder.clone().into(), e.revision).await {
                                    Ok(revision) => {
                                        let from = String::from_utf8_lossy(&e.value).to_string();
                                        tracing::warn!(%holder, %from, "took the planner lease over from a silent planner");
                                        return Lease { kv, holder, revision };
                                    }
                                    // another standby was first, or NATS is away
                                    Err(e) => tracing::debug!(error = %e, "could not take the planner lease over"),
                                }
                            }
                        }
                        _ => seen = Some((e.revision, now)),
                    }
                    if !said {
                        let current = String::from_utf8_lossy(&e.value).to_string();
                        tracing::info!(%holder, %current, "standing by: another planner holds the lease");
                        said = true;
                    }
                }
                // absent, or deleted (create writes over a delete marker): the
                // first to create it holds it
                Ok(_) => {
                    match kv.create(PLANNER_LEASE_KEY, holder.clone().into()).await {
                        Ok(revision) => {
                            tracing::info!(%holder, "holds the planner lease");
                            return Lease { kv, holder, revision };
                        }
                        // another planner was first, or NATS is away
                        Err(e) => tracing::debug!(error = %e, "could not create the planner lease"),
                    }
                }
                Err(e) => tracing::debug!(error = %e, "could not read the planner lease; trying again"),
            }
            tokio::time::sleep(RENEW).await;
        }
    }

    /// Renew the lease every [`RENEW`] until another planner takes it over (the
    /// error says who). Failing to reach the bucket is retried: a planner that
    /// cannot reach NATS cannot plan either.
    pub async fn lost(&mut self) -> LeaseError {
        loop {
            tokio::time::sleep(RENEW).await;
            match self.kv.update(PLANNER_LEASE_KEY, self.holder.clone().into(), self.revision).await {
                Ok(revision) => self.revision = revision,
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    match self.kv.entry(PLANNER_LEASE_KEY).await {
                        // a renewal of ours that landed though its answer was lost
                        // (NATS stalled): still ours, at the revision it wrote
                        Ok(Some(e)) if e.operation == kv::Operation::Put && e.value == self.holder.as_bytes() => {
                            self.revision = e.revision;
                        }
                        Ok(Some(e)) if e.operation == kv::Operation::Put => {
                            return LeaseError::TakenOver { holder: String::from_utf8_lossy(&e.value).to_string() };
                        }
                        // deleted meanwhile (by an operator): nobody else holds it
                        Ok(_) => match self.kv.create(PLANNER_LEASE_KEY, self.holder.clone().into()).await {
                            Ok(revision) => self.revision = revision,
                            Err(e) => {
                                tracing::warn!(error = %e, "could not take the deleted planner lease back; trying again")
                            }
                        },
                        Err(e) => tracing::warn!(error = %e, "could not read the planner lease; trying again"),
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not renew the planner lease; trying again"),
            }
        }
    }

    /// Give the lease up (a planner that stops cleanly), so that a standby or the
    /// next planner takes it at once instead of after [`EXPIRY`]. Only the
    /// revision this planner wrote is deleted.
    pub async fn release(self) {
        if let Err(e) = self.kv.delete_expect_revision(PLANNER_LEASE_KEY, Some(self.revision)).await {
            tracing::debug!(error = %e, "the planner lease was not released (taken over, or NATS is away)");
        }
    }
}
