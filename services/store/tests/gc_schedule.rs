//! The store collects garbage by itself on its schedule: old manifest revisions and
//! chunks nothing references go (a full disk recovers without an operator asking).
//! A manifest that does not verify under the store's key (a forger's), or a real one
//! copied under another key, is neither kept as a revision nor deleted, so it
//! cannot push a real revision out.

use std::time::Duration;

use futures::TryStreamExt;
use looseleaf_store::gc::Schedule;
use looseleaf_store::signing::{self, ManifestKey};
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
    let key_file = dir.path().join("manifest-key");
    std::fs::write(&key_file, "k".repeat(64))?;
    let key = ManifestKey::from_file(&key_file)?;
    let session = Uuid::now_v7();
    for revision in 1..=4 {
        let m = Manifest { session, revision, ..Default::default() };
        // revision 4 is a forger's: unsigned
        let signed_by = (revision < 4).then_some(&key);
        let body = signing::seal(&m, signed_by)?;
        objects.put(&Path::from(checkpoint::manifest_key(session, revision)), body.into()).await?;
    }
    // revision 5: a real signed manifest (revision 3's) copied under another key
    let three = objects.get(&Path::from(checkpoint::manifest_key(session, 3))).await?.bytes().await?;
    objects.put(&Path::from(checkpoint::manifest_key(session, 5)), three.to_vec().into()).await?;
    let orphan = Path::from(checkpoint::chunk_key(&checkpoint::chunk_hash(b"nothing references me")));
    objects.put(&orphan, b"nothing references me".to_vec().into()).await?;

    let config = looseleaf_store::Config {
        nats: schemas::nats::NatsOptions::url(nats.url()),
        health_listen: None,
        prefix: random_prefix(),
        store_url,
        session_quota_bytes: None,
        gc: Some(Schedule { every: Duration::from_millis(200), keep_revisions: 1, grace: Duration::ZERO }),
        gc_free_bytes: None,
        manifest_key_file: Some(key_file.clone()),
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
            let mut left: Vec<Path> = left.into_iter().map(|m| m.location).collect();
            left.sort();
            let newest_and_forged: Vec<Path> =
                [3, 4, 5].into_iter().map(|r| Path::from(checkpoint::manifest_key(session, r))).collect();
            left == newest_and_forged && objects.head(&orphan).await.is_err()
        }
    })
    .await?;
    let _ = stop.send(());
    store.await??;
    Ok(())
}
