//! The checkpoint-store gateway: session manifests and atomic commits over
//! `object_store` (DESIGN.md section 6).
//!
//! Speaks: serves `{prefix}.v1.store.manifest.get`, `….chunk.plan`, `….commit`,
//! `….session.delete`, `….gc` and `….settle` as `$SRV` endpoints in queue group
//! `store` (ADR 43). Bulk bytes never pass through it: hosts read and write chunks
//! in the object store directly.
//!
//! Actors: one [`gateway::Gateway`], fed by its six endpoints.

pub mod gateway;
pub mod gc;
pub mod manifests;
pub mod signing;
pub mod space;

use std::future::Future;
use std::sync::Arc;

use actix::prelude::*;
use anyhow::Context as _;
use schemas::messages::{
    ChunkPlanV2, CommitV2, ForkV1, GcV1, ManifestGetV2, RevertV1, SessionDeleteV1, SettleV1, StateCheckV1,
};
use schemas::service::Service;
use schemas::subjects::StoreVerb;

/// What the store gateway needs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where NATS is and how to log in.
    pub nats: schemas::nats::NatsOptions,
    /// Where to serve `/healthz` and `/readyz`, if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Subject prefix.
    pub prefix: String,
    /// Object store: `file:///dir` or a directory path.
    pub store_url: String,
    /// Largest state a session may hold, in bytes (None: unlimited).
    pub session_quota_bytes: Option<u64>,
    /// Garbage collection on a schedule (None: only when asked on the bus).
    pub gc: Option<gc::Schedule>,
    /// A local store collects at once below this many free bytes (None: 5% of the
    /// volume or 2 GiB, whichever is smaller); see [`space`].
    pub gc_free_bytes: Option<u64>,
    /// The file holding the key manifests are signed with (None: unsigned, and
    /// whoever can write the bucket can make a worker unpickle what they wrote).
    pub manifest_key_file: Option<std::path::PathBuf>,
}

/// Run the gateway until `shutdown` resolves. Must be called inside an actix system.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let objects = schemas::objects::open(&config.store_url).context("while opening the object store")?;
    let key = match &config.manifest_key_file {
        Some(path) => Some(signing::ManifestKey::from_file(path)?),
        None => {
            tracing::warn!("no --manifest-key-file: manifests are not signed, so write access to the store is code execution in workers");
            None
        }
    };
    let description = "checkpoint-store gateway: manifests and atomic commits";
    let service = Service::start("looseleaf-store", None, description, &config.nats, &config.prefix).await?;
    let bus = service.bus().clone();
    if let Some(listen) = config.health_listen {
        // the object store answers (a key that does not exist is an answer)
        let store = objects.clone();
        let reachable = schemas::health::check(move || {
            let store = store.clone();
            async move {
                match store.head(&object_store::path::Path::from("looseleaf-readyz")).await {
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(format!("the object store: {e}")),
                }
            }
        });
        let readiness = schemas::health::Readiness::new(&bus).with("object_store", reachable);
        schemas::health::serve(listen, readiness).await?;
    }
    let manifests = Arc::new(manifests::Manifests::new(objects).with_quota(config.session_quota_bytes).with_key(key));
    let s = bus.subjects().clone();
    // every verb is a request: a `$SRV` endpoint with its stats, replicas in one group
    let gets = service.endpoint::<ManifestGetV2>("manifest-get", s.store(StoreVerb::ManifestGet), "store").await?;
    let plans = service.endpoint::<ChunkPlanV2>("chunk-plan", s.store(StoreVerb::ChunkPlan), "store").await?;
    let commits = service.endpoint::<CommitV2>("commit", s.store(StoreVerb::Commit), "store").await?;
    let deletes =
        service.endpoint::<SessionDeleteV1>("session-delete", s.store(StoreVerb::SessionDelete), "store").await?;
    let gcs = service.endpoint::<GcV1>("gc", s.store(StoreVerb::Gc), "store").await?;
    let settles = service.endpoint::<SettleV1>("settle", s.store(StoreVerb::Settle), "store").await?;
    let reverts = service.endpoint::<RevertV1>("revert", s.store(StoreVerb::Revert), "store").await?;
    let forks = service.endpoint::<ForkV1>("fork", s.store(StoreVerb::Fork), "store").await?;
    let checks = service.endpoint::<StateCheckV1>("check", s.store(StoreVerb::Check), "store").await?;
    let gw_bus = bus.clone();
    let volume = space::Volume::of(&config.store_url, config.gc_free_bytes).map(Arc::new);
    let addr = gateway::Gateway::create(move |ctx| {
        ctx.add_stream(gets.into_stream());
        ctx.add_stream(plans.into_stream());
        ctx.add_stream(commits.into_stream());
        ctx.add_stream(deletes.into_stream());
        ctx.add_stream(gcs.into_stream());
        ctx.add_stream(settles.into_stream());
        ctx.add_stream(reverts.into_stream());
        ctx.add_stream(forks.into_stream());
        ctx.add_stream(checks.into_stream());
        gateway::Gateway::new(gw_bus, manifests, config.gc, volume)
    });
    tracing::info!(store = %config.store_url, prefix = %config.prefix, "store gateway serving");
    // a commit is one create-only put: it either landed or not, nothing to hand back
    service.serve(shutdown, || addr.connected(), async {}).await?;
    Ok(())
}
