//! Claims in the KV bucket (DESIGN.md section 5): a host wins a run, the
//! preparation of a cell's recipe revision, or a session's CPU worker by creating
//! its key first. Every claim goes through [`Claims::claim`].

use std::time::Duration;

use async_nats::jetstream::kv;
use schemas::buckets;
use uuid::Uuid;

/// What a host claims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimKey {
    /// Running one execution.
    Run(Uuid),
    /// Preparing a worker for one revision of a cell's edit-derived recipe.
    Prepare {
        /// The session.
        session: Uuid,
        /// The cell.
        cell_id: String,
        /// The recipe revision.
        revision: u64,
    },
    /// Keeping a session's persistent CPU worker.
    Cpu(Uuid),
}

impl ClaimKey {
    /// The KV key.
    pub fn key(&self) -> String {
        match self {
            ClaimKey::Run(exec) => buckets::run_claim_key(*exec),
            ClaimKey::Prepare { session, cell_id, revision } => {
                buckets::prepare_claim_key(*session, cell_id, *revision)
            }
            ClaimKey::Cpu(session) => buckets::cpu_claim_key(*session),
        }
    }
}

/// How a claim settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This host holds it now.
    Won,
    /// This host already held it (only for a CPU worker this host restarts).
    Mine,
    /// Another host holds it.
    Lost,
    /// The bucket could not be reached: nobody is known to hold it (logged).
    Failed,
}

impl Claim {
    /// Whether this host holds the claim.
    pub fn held(self) -> bool {
        matches!(self, Claim::Won | Claim::Mine)
    }
}

/// This host's view of the claims bucket.
#[derive(Clone)]
pub struct Claims {
    kv: kv::Store,
    host_id: String,
}

impl Claims {
    /// Claims made as `host_id`.
    pub fn new(kv: kv::Store, host_id: String) -> Self {
        Self { kv, host_id }
    }

    /// Wait `delay` (the host's placement score: better-placed hosts wait less),
    /// then try to create the claim.
    pub async fn claim(&self, key: ClaimKey, delay: Duration) -> Claim {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let k = key.key();
        match self.kv.create(&k, self.host_id.clone().into_bytes().into()).await {
            Ok(_) => Claim::Won,
            // Only a CPU worker's claim may be this host's already (its worker died
            // and is restarted here); a run or preparation is claimed once.
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists && matches!(key, ClaimKey::Cpu(_)) => {
                match self.kv.get(&k).await {
                    Ok(Some(v)) if v.as_ref() == self.host_id.as_bytes() => Claim::Mine,
                    _ => Claim::Lost,
                }
            }
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Claim::Lost,
            Err(e) => {
                tracing::warn!(error = %e, key = %k, "claim failed");
                Claim::Failed
            }
        }
    }

    /// Renew claims this host holds (they expire after `CLAIM_TTL` otherwise, so a
    /// dead host's claims free themselves).
    pub async fn renew(&self, keys: Vec<ClaimKey>) {
        for key in keys {
            let k = key.key();
            if let Err(e) = self.kv.put(&k, self.host_id.clone().into_bytes().into()).await {
                tracing::warn!(error = %e, key = %k, "could not renew a claim");
            }
        }
    }

    /// Give up a claim.
    pub async fn release(&self, key: ClaimKey) {
        if let Err(e) = self.kv.delete(key.key()).await {
            tracing::debug!(error = %e, "claim delete");
        }
    }
}
