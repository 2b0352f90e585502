//! The store collects garbage by itself on its schedule: old manifest revisions and
//! chunks nothing references go (a full disk recovers without an operator asking).

use std::time::Duration;

use futures::TryStreamExt;
use looseleaf_store::gc::Schedule;
use looseleaf_test_support::{random_prefix, wait_for_async, NatsServer};
use object_store::path::Path;
use schemas::checkpoint::{self, Manifest};
use uuid::Uuid;

#[actix_rt::test]
async fn old_revisions_and_orphan_chunks_are_collected_on_schedule() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let store_url = dir.path().display().to_string();
    let objects = schemas::objects::open(&store_url)?;
    let session = Uuid::now_v7();
    for revision in 1..=3 {
        let m = Manifest { revision, ..Default::default() };
        objects.put(&Path::from(checkpoint::manifest_key(session, revision)), serde_json::to_vec(&m)?.into()).await?;
    }
    let orphan = Path::from(checkpoint::chunk_key(&checkpoint::chunk_hash(b"nothing references me")));
    objects.put(&orphan, b"nothing references me".to_vec().into()).await?;

    let config = looseleaf_store::Config {
        nats_url: nats.url().to_string(),
        prefix: random_prefix(),
        store_url,
        session_quota_bytes: None,
        gc: Some(Schedule { every: Duration::from_millis(200), keep_revisions: 1, grace: Duration::ZERO }),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let store = actix_rt::spawn(looseleaf_store::run(config, async move {
        let _ = stopped.await;
    }));

    let manifests = Path::from(checkpoint::manifests_dir(session));
    wait_for_async(Duration::from_secs(20), || {
        let (objects, manifests, orphan) = (objects.clone(), manifests.clone(), orphan.clone());
        async move {
            let left: Vec<_> = objects.list(Some(&manifests)).try_collect().await.unwrap_or_default();
            let only_newest = left.len() == 1 && left[0].location == Path::from(checkpoint::manifest_key(session, 3));
            only_newest && objects.head(&orphan).await.is_err()
        }
    })
    .await?;
    let _ = stop.send(());
    store.await??;
    Ok(())
}
