//! Claims in the KV bucket (DESIGN.md section 5): a host wins a run, the
//! preparation of a cell's recipe revision, or a session's CPU worker by creating
//! its key first. Every claim goes through [`Claims::claim`].

use std::collections::HashSet;
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
    /// As metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Claim::Won => "won",
            Claim::Mine => "mine",
            Claim::Lost => "lost",
            Claim::Failed => "failed",
        }
    }

    /// Whether this host holds the claim.
    pub fn held(self) -> bool {
        matches!(self, Claim::Won | Claim::Mine)
    }
}

impl ClaimKey {
    /// What is claimed, as metrics spell it.
    pub fn kind(&self) -> &'static str {
        match self {
            ClaimKey::Run(_) => "run",
            ClaimKey::Cpu(_) => "cpu",
            ClaimKey::Prepare { .. } => "prepare",
        }
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
    /// then try to create the claim. `live`: the hosts known to be alive (their
    /// status was heard lately), or None while this host cannot know yet; a CPU
    /// worker's claim held by a host not among them is taken over, since its worker
    /// went with its host.
    pub async fn claim(&self, key: ClaimKey, delay: Duration, live: Option<HashSet<String>>) -> Claim {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let k = key.key();
        let me = self.host_id.clone().into_bytes();
        // within the frontend's wait for a claim
        let mut retry = buckets::ElectionRetry::new();
        let mut failed_before = false;
        loop {
            let created = self.kv.create(&k, me.clone().into()).await;
            match created {
                // the bucket's leader was lost (a NATS node died) and a new one is
                // being elected: try again, within bounds
                Err(e) if !matches!(e.kind(), kv::CreateErrorKind::AlreadyExists) => {
                    let Some(wait) = retry.next_wait() else {
                        tracing::warn!(error = %e, key = %k, "claim failed");
                        return Claim::Failed;
                    };
                    tracing::info!(error = %e, key = %k, "claim failed; trying again in {wait:?}");
                    tokio::time::sleep(wait).await;
                    failed_before = true;
                }
                // an earlier try may have created it and lost only the answer
                Err(_) if failed_before && self.holds(&k, &me).await => return Claim::Won,
                _ => return self.settle(&key, &k, me, live, created).await,
            }
        }
    }

    /// Whether this host holds key `k`.
    async fn holds(&self, k: &str, me: &[u8]) -> bool {
        matches!(self.kv.entry(k).await, Ok(Some(entry)) if entry.value.as_ref() == me && entry.operation == kv::Operation::Put)
    }

    /// What a create of claim `key` (KV key `k`) came to.
    async fn settle(
        &self,
        key: &ClaimKey,
        k: &str,
        me: Vec<u8>,
        live: Option<HashSet<String>>,
        created: Result<u64, kv::CreateError>,
    ) -> Claim {
        match created {
            Ok(_) => Claim::Won,
            // Only a CPU worker's claim may be this host's already (its worker died
            // and is restarted here) or a lost host's; a run or preparation is
            // claimed once.
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists && matches!(key, ClaimKey::Cpu(_)) => {
                match self.kv.entry(k).await {
                    Ok(Some(entry)) if entry.value.as_ref() == me.as_slice() => Claim::Mine,
                    Ok(Some(entry)) => {
                        let holder = String::from_utf8_lossy(&entry.value).to_string();
                        if live.is_none_or(|live| live.contains(&holder)) {
                            return Claim::Lost;
                        }
                        // revision-checked: of the hosts taking over, one wins
                        match self.kv.update(k, me.into(), entry.revision).await {
                            Ok(_) => {
                                tracing::warn!(key = %k, lost = %holder, "took over the claim of a host that is gone");
                                Claim::Won
                            }
                            Err(_) => Claim::Lost,
                        }
                    }
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

    /// Run claims as they are made (or renewed), for as long as the host lives:
    /// the execution and its holder (a host, or the frontend that abandoned it). How
    /// a host learns that a run it waits for was taken, without reading anyone's
    /// session events (ADR 57). A watch that ends (NATS reconnecting) is opened
    /// again.
    pub fn runs_claimed(&self) -> impl futures::Stream<Item = (Uuid, String)> + 'static {
        futures::stream::unfold((self.kv.clone(), None::<kv::Watch>), |(store, mut watch)| async move {
            loop {
                let mut w = match watch.take() {
                    Some(w) => w,
                    None => match store.watch_all().await {
                        Ok(w) => w,
                        Err(e) => {
                            tracing::warn!(error = %e, "could not watch the claims; trying again");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            continue;
                        }
                    },
                };
                match futures::StreamExt::next(&mut w).await {
                    Some(Ok(entry)) => {
                        let run = entry.key.strip_prefix("run-").and_then(|u| Uuid::parse_str(u).ok());
                        watch = Some(w);
                        if let (Some(exec), kv::Operation::Put) = (run, entry.operation) {
                            let holder = String::from_utf8_lossy(&entry.value).into_owned();
                            return Some(((exec, holder), (store, watch)));
                        }
                    }
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "the claims watch broke; opening it again");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    None => tokio::time::sleep(Duration::from_secs(1)).await,
                }
            }
        })
    }

    /// Renew claims this host holds (they expire after `CLAIM_TTL` otherwise, so a
    /// dead host's claims free themselves). Returns the claims another holder took
    /// meanwhile: a CPU worker claim another host took over (this host was taken for
    /// lost: its worker is no longer the session's CPU worker), or a run claim its
    /// frontend gave up (`!interrupted`; never overwritten here).
    pub async fn renew(&self, keys: Vec<ClaimKey>) -> Vec<ClaimKey> {
        let me = self.host_id.clone().into_bytes();
        let mut lost = Vec::new();
        for key in keys {
            let k = key.key();
            // never overwrite a takeover (another host's CPU worker claim, or a run
            // the frontend gave up: `!interrupted`): renew only what is still this host's
            let renewed = match self.kv.entry(&k).await {
                Ok(Some(e)) if e.value.as_ref() != me.as_slice() && e.operation == kv::Operation::Put => {
                    if matches!(key, ClaimKey::Run(_)) {
                        tracing::warn!(key = %k, "a run this host holds was given up by its frontend");
                    }
                    lost.push(key);
                    continue;
                }
                Ok(Some(e)) if e.operation == kv::Operation::Put => {
                    self.kv.update(&k, me.clone().into(), e.revision).await.map(|_| ()).map_err(|e| e.to_string())
                }
                Ok(_) => self.kv.create(&k, me.clone().into()).await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = renewed {
                tracing::warn!(error = %e, key = %k, "could not renew a claim");
            }
        }
        lost
    }

    /// Give up a claim.
    pub async fn release(&self, key: ClaimKey) {
        if let Err(e) = self.kv.delete(key.key()).await {
            tracing::debug!(error = %e, "claim delete");
        }
    }
}
