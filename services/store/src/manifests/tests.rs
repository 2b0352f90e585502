use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::ObjectStore;
use schemas::checkpoint::{chunk_key, Blob, Delta, DeltaVar, ObjectEntry};
use schemas::messages::CommitV1;
use uuid::Uuid;

use super::{ManifestError, Manifests};

async fn put_chunk(objects: &Arc<dyn ObjectStore>, hash: &str) {
    objects.put(&Path::from(chunk_key(hash).as_str()), vec![1u8, 2, 3].into()).await.unwrap();
}

fn commit(session: Uuid, base: u64, name: &str, chunk: &str) -> CommitV1 {
    let mut delta = Delta::default();
    delta.objects.insert(
        format!("oid-{name}"),
        ObjectEntry { record: Blob { len: 3, chunks: vec![chunk.into()] }, ..Default::default() },
    );
    delta.variables.insert(name.into(), DeltaVar { oid: Some(format!("oid-{name}")), module: None, global_reads: vec![] });
    CommitV1 {
        session,
        base_revision: base,
        exec_id: Uuid::now_v7(),
        host: "h".into(),
        worker: "w".into(),
        cell_id: "c".into(),
        delta,
    }
}

#[tokio::test]
async fn commits_advance_revisions_and_survive_a_restart() {
    let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    put_chunk(&objects, "aa").await;
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    assert_eq!(m.latest(sid).await.unwrap().revision, 0);
    let c1 = m.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    assert_eq!(c1.revision, 1);
    assert_eq!(c1.changed, vec!["x".to_string()]);
    let c2 = m.commit(&commit(sid, 1, "y", "aa")).await.unwrap();
    assert_eq!(c2.revision, 2);

    // a fresh gateway (restart) finds revision 2 with both names
    let fresh = Manifests::new(objects.clone());
    let latest = fresh.latest(sid).await.unwrap();
    assert_eq!(latest.revision, 2);
    assert!(latest.variables.contains_key("x") && latest.variables.contains_key("y"));
}

#[tokio::test]
async fn racing_commits_cannot_both_win() {
    let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    put_chunk(&objects, "aa").await;
    let sid = Uuid::now_v7();
    // two gateways with their own caches, both at revision 0
    let g1 = Manifests::new(objects.clone());
    let g2 = Manifests::new(objects.clone());
    g1.latest(sid).await.unwrap();
    g2.latest(sid).await.unwrap();
    let (cx, cy) = (commit(sid, 0, "x", "aa"), commit(sid, 0, "y", "aa"));
    let (a, b) = tokio::join!(g1.commit(&cx), g2.commit(&cy));
    let wins = [a.is_ok(), b.is_ok()].iter().filter(|w| **w).count();
    assert_eq!(wins, 1, "exactly one commit of revision 1: {a:?} {b:?}");
    let loser = if a.is_ok() { b } else { a };
    assert!(matches!(loser, Err(ManifestError::Lost { revision: 1, .. }) | Err(ManifestError::Stale { .. })));
    assert_eq!(Manifests::new(objects).latest(sid).await.unwrap().revision, 1);
}

#[tokio::test]
async fn stale_base_and_missing_chunks_are_rejected_and_change_nothing() {
    let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    put_chunk(&objects, "aa").await;
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    m.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    assert!(matches!(m.commit(&commit(sid, 0, "y", "aa")).await, Err(ManifestError::Stale { latest: 1, .. })));
    // a save whose chunks never reached the store (the worker died mid-upload)
    assert!(matches!(m.commit(&commit(sid, 1, "y", "bb")).await, Err(ManifestError::MissingChunks { count: 1, .. })));
    let latest = m.latest(sid).await.unwrap();
    assert_eq!(latest.revision, 1);
    assert!(!latest.variables.contains_key("y"));
}

#[tokio::test]
async fn corrupt_manifest_is_an_error_not_a_panic() {
    let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let sid = Uuid::now_v7();
    let key = schemas::checkpoint::manifest_key(sid, 1);
    objects.put(&Path::from(key.as_str()), b"{not json".to_vec().into()).await.unwrap();
    let err = Manifests::new(objects).latest(sid).await.unwrap_err();
    assert!(matches!(err, ManifestError::Corrupt { .. }), "{err}");
}

#[tokio::test]
async fn delete_removes_the_session() {
    let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    put_chunk(&objects, "aa").await;
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    m.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    assert_eq!(m.delete(sid).await.unwrap(), 1);
    assert_eq!(m.latest(sid).await.unwrap().revision, 0);
}
