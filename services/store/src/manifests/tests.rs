use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::ObjectStore;
use schemas::checkpoint::{chunk_key, Blob, Delta, DeltaVar, ObjectEntry};
use schemas::messages::{CommitV2, RevertTo};
use uuid::Uuid;

use super::{ManifestError, Manifests};

/// Each check runs on every backend: in memory, a local directory (the embedded
/// default) and S3 (a moto server started for the test).
macro_rules! on_every_backend {
    ($check:ident) => {
        mod $check {
            use super::*;

            #[tokio::test]
            async fn in_memory() {
                super::$check(Arc::new(InMemory::new())).await;
            }

            #[tokio::test]
            async fn local_directory() {
                let dir = tempfile::tempdir().unwrap();
                super::$check(schemas::objects::open(dir.path().to_str().unwrap()).unwrap()).await;
            }

            #[tokio::test]
            async fn s3() {
                let s3 = looseleaf_test_support::S3Server::start().unwrap();
                let settings = s3.settings();
                let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                super::$check(schemas::objects::open_with(&s3.url(), &settings).unwrap()).await;
            }
        }
    };
}

on_every_backend!(commits_advance_revisions_and_survive_a_restart);
on_every_backend!(racing_commits_cannot_both_win);
on_every_backend!(stale_base_and_missing_chunks_are_rejected_and_change_nothing);
on_every_backend!(corrupt_manifest_is_an_error_not_a_panic);
on_every_backend!(delete_removes_the_session);
on_every_backend!(nothing_commits_to_a_deleted_session);
on_every_backend!(a_gateway_behind_another_loses_its_commit_then_catches_up);
on_every_backend!(only_chunks_new_to_the_base_revision_are_checked);
on_every_backend!(a_chunk_plan_names_exactly_the_chunks_the_store_lacks);
on_every_backend!(chunks_the_host_uploaded_are_not_looked_up_again);
on_every_backend!(a_get_at_a_known_revision_is_answered_from_memory);
on_every_backend!(only_manifests_signed_with_the_key_load);
on_every_backend!(a_run_given_up_never_commits_later);
on_every_backend!(settling_a_run_whose_save_landed_answers_its_commit);
on_every_backend!(undo_steps_back_one_cells_state_at_a_time);
on_every_backend!(a_check_finds_every_chunk_that_is_gone_and_brings_back_the_trashed);

async fn put_chunk(objects: &Arc<dyn ObjectStore>, hash: &str) {
    objects.put(&Path::from(chunk_key(hash).as_str()), vec![1u8, 2, 3].into()).await.unwrap();
}

fn commit(session: Uuid, base: u64, name: &str, chunk: &str) -> CommitV2 {
    let mut delta = Delta::default();
    delta.objects.insert(
        format!("oid-{name}"),
        ObjectEntry { record: Blob { len: 3, chunks: vec![chunk.into()] }, ..Default::default() },
    );
    delta
        .variables
        .insert(name.into(), DeltaVar { oid: Some(format!("oid-{name}")), module: None, global_reads: vec![] });
    CommitV2 {
        session,
        base_revision: base,
        exec_id: Uuid::now_v7(),
        host: "h".into(),
        worker: "w".into(),
        cell_id: "c".into(),
        delta,
        uploaded: vec![],
    }
}

async fn commits_advance_revisions_and_survive_a_restart(objects: Arc<dyn ObjectStore>) {
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

async fn racing_commits_cannot_both_win(objects: Arc<dyn ObjectStore>) {
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

async fn stale_base_and_missing_chunks_are_rejected_and_change_nothing(objects: Arc<dyn ObjectStore>) {
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

async fn corrupt_manifest_is_an_error_not_a_panic(objects: Arc<dyn ObjectStore>) {
    let sid = Uuid::now_v7();
    let key = schemas::checkpoint::manifest_key(sid, 1);
    objects.put(&Path::from(key.as_str()), b"{not json".to_vec().into()).await.unwrap();
    let err = Manifests::new(objects).latest(sid).await.unwrap_err();
    assert!(matches!(err, ManifestError::Corrupt { .. }), "{err}");
}

/// A host cut off while its cell ran (taken for lost) commits after its frontend
/// settled the run as failed: the fence at `base + 1` refuses it, through any gateway.
async fn a_run_given_up_never_commits_later(objects: Arc<dyn ObjectStore>) {
    put_chunk(&objects, "aa").await;
    let (frontends, hosts) = (Manifests::new(objects.clone()), Manifests::new(objects.clone()));
    let sid = Uuid::now_v7();
    hosts.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    let late = commit(sid, 1, "y", "aa");
    let settled = frontends.settle(sid, late.exec_id, 1).await.unwrap();
    assert_eq!(settled.revision, 2, "the fence takes the run's revision");
    assert_ne!(settled.exec_id, late.exec_id, "the run is settled as not committed");
    assert!(settled.variables.contains_key("x") && !settled.variables.contains_key("y"), "the fence keeps the state");
    let refused = hosts.commit(&late).await;
    assert!(matches!(refused, Err(ManifestError::Lost { .. } | ManifestError::Stale { .. })), "{refused:?}");
    let again = frontends.settle(sid, late.exec_id, 1).await.unwrap();
    assert_eq!((again.revision, again.exec_id), (2, Uuid::nil()), "settling twice answers the same");
    let latest = Manifests::new(objects.clone()).latest(sid).await.unwrap();
    assert_eq!(latest.revision, 2);
    assert!(!latest.variables.contains_key("y"), "nothing of the given-up run landed");
    // a run of a session deleted meanwhile settles as deleted (the frontend stops asking)
    frontends.delete(sid).await.unwrap();
    let deleted = frontends.settle(sid, Uuid::now_v7(), 2).await;
    assert!(matches!(deleted, Err(ManifestError::Deleted { .. })), "{deleted:?}");
}

/// The run's save landed before its frontend gave it up: settling reports it.
async fn settling_a_run_whose_save_landed_answers_its_commit(objects: Arc<dyn ObjectStore>) {
    put_chunk(&objects, "aa").await;
    let m = Manifests::new(objects.clone());
    let sid = Uuid::now_v7();
    let landed = commit(sid, 0, "x", "aa");
    m.commit(&landed).await.unwrap();
    let settled = Manifests::new(objects.clone()).settle(sid, landed.exec_id, 0).await.unwrap();
    assert_eq!((settled.revision, settled.exec_id), (1, landed.exec_id));
    assert_eq!(Manifests::new(objects).latest(sid).await.unwrap().revision, 1, "no fence after a commit");
}

async fn delete_removes_the_session(objects: Arc<dyn ObjectStore>) {
    put_chunk(&objects, "aa").await;
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    m.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    assert_eq!(m.delete(sid).await.unwrap().manifests, 1);
    assert_eq!(m.latest(sid).await.unwrap().revision, 0);
}

/// A cell still saving when its session is deleted (base 0 or later), and a
/// gateway that still remembers the session, cannot bring it back.
async fn nothing_commits_to_a_deleted_session(objects: Arc<dyn ObjectStore>) {
    put_chunk(&objects, "aa").await;
    let (a, b) = (Manifests::new(objects.clone()), Manifests::new(objects.clone()));
    let sid = Uuid::now_v7();
    b.commit(&commit(sid, 0, "x", "aa")).await.unwrap(); // b remembers revision 1
    a.delete(sid).await.unwrap();
    let late = b.commit(&commit(sid, 1, "y", "aa")).await;
    assert!(matches!(late, Err(ManifestError::Deleted { session }) if session == sid), "{late:?}");
    // a session deleted before its first save
    let fresh = Uuid::now_v7();
    a.delete(fresh).await.unwrap();
    let first = a.commit(&commit(fresh, 0, "x", "aa")).await;
    assert!(matches!(first, Err(ManifestError::Deleted { .. })), "{first:?}");
    for s in [sid, fresh] {
        assert_eq!(Manifests::new(objects.clone()).latest(s).await.unwrap().revision, 0, "nothing came back");
    }
}

/// Two gateways on one store and a session of which `a` committed revision 1 and
/// `b` revision 2, so `a` still remembers revision 1.
async fn two_gateways_one_behind(objects: &Arc<dyn ObjectStore>) -> (Uuid, Manifests, Manifests) {
    put_chunk(objects, "aa").await;
    let sid = Uuid::now_v7();
    let (a, b) = (Manifests::new(objects.clone()), Manifests::new(objects.clone()));
    a.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    b.commit(&commit(sid, 1, "y", "aa")).await.unwrap();
    (sid, a, b)
}

async fn a_gateway_behind_another_loses_its_commit_then_catches_up(objects: Arc<dyn ObjectStore>) {
    let (sid, a, b) = two_gateways_one_behind(&objects).await;
    // `a` still remembers revision 1: a commit on that base must not win revision 2
    let behind = a.commit(&commit(sid, 1, "z", "aa")).await;
    assert!(matches!(behind, Err(ManifestError::Lost { revision: 2, .. })), "{behind:?}");
    // a commit on the real latest steps `a` forward
    assert_eq!(a.commit(&commit(sid, 2, "z", "aa")).await.unwrap().revision, 3);
    let latest = b.latest(sid).await.unwrap();
    assert!(latest.variables.contains_key("y") && latest.variables.contains_key("z"));
}

async fn only_chunks_new_to_the_base_revision_are_checked(objects: Arc<dyn ObjectStore>) {
    put_chunk(&objects, "aa").await;
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    m.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    // the base revision references "aa": a commit re-referencing it is not asked
    // to prove it again (here it is gone from the store, so asking would fail)
    objects.delete(&Path::from(chunk_key("aa").as_str())).await.unwrap();
    assert_eq!(m.commit(&commit(sid, 1, "y", "aa")).await.unwrap().revision, 2);
    // a chunk new to the session still must be there
    assert!(matches!(m.commit(&commit(sid, 2, "z", "cc")).await, Err(ManifestError::MissingChunks { count: 1, .. })));
}

async fn a_check_finds_every_chunk_that_is_gone_and_brings_back_the_trashed(objects: Arc<dyn ObjectStore>) {
    for hash in ["aa", "bb", "cc"] {
        put_chunk(&objects, hash).await;
    }
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    m.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    m.commit(&commit(sid, 1, "y", "bb")).await.unwrap();
    m.commit(&commit(sid, 2, "z", "cc")).await.unwrap();
    let (latest, missing) = m.check(sid, None).await.unwrap();
    assert_eq!((latest.revision, missing), (3, Vec::<String>::new()));
    // "aa" deleted behind the store's back (the commit trusts what the latest
    // revision references; the check does not), "bb" waiting in the trash
    objects.delete(&Path::from(chunk_key("aa").as_str())).await.unwrap();
    let trashed = Path::from("trash/bb/1");
    objects.rename(&Path::from(chunk_key("bb").as_str()), &trashed).await.unwrap();
    let (_, missing) = m.check(sid, Some(3)).await.unwrap();
    assert_eq!(missing, vec!["aa".to_string()], "only the deleted one is gone");
    assert!(objects.head(&Path::from(chunk_key("bb").as_str())).await.is_ok(), "the trashed one is back");
    // a session with no state has nothing to miss
    let (empty, missing) = m.check(Uuid::now_v7(), None).await.unwrap();
    assert_eq!((empty.revision, missing.len()), (0, 0));
}

async fn a_chunk_plan_names_exactly_the_chunks_the_store_lacks(objects: Arc<dyn ObjectStore>) {
    put_chunk(&objects, "aa").await;
    put_chunk(&objects, "bb").await;
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    // a session that never saved: every hash is looked up
    let plan = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(m.missing_chunks(sid, &plan(&["aa", "cc", "bb", "dd"])).await.unwrap(), plan(&["cc", "dd"]));
    m.commit(&commit(sid, 0, "x", "aa")).await.unwrap();
    // stored by another session (deduplicated) or by this one: not missing
    assert_eq!(m.missing_chunks(sid, &plan(&["aa", "bb", "ee"])).await.unwrap(), plan(&["ee"]));
}

async fn chunks_the_host_uploaded_are_not_looked_up_again(objects: Arc<dyn ObjectStore>) {
    let sid = Uuid::now_v7();
    let m = Manifests::new(objects.clone());
    // "cc" is not in the store: claimed as uploaded it is not asked for (a real host
    // claims only chunks whose put succeeded); unclaimed it must be there
    let mut claimed = commit(sid, 0, "x", "cc");
    claimed.uploaded = vec!["cc".into()];
    assert_eq!(m.commit(&claimed).await.unwrap().revision, 1);
    let unclaimed = m.commit(&commit(sid, 1, "y", "dd")).await;
    assert!(matches!(unclaimed, Err(ManifestError::MissingChunks { count: 1, .. })), "{unclaimed:?}");
}

async fn a_get_at_a_known_revision_is_answered_from_memory(objects: Arc<dyn ObjectStore>) {
    let (sid, a, _b) = two_gateways_one_behind(&objects).await;
    // `a` remembers revision 1: asked for at least 1 it answers that without the
    // store; told that 2 exists, or told nothing, it reads forward to 2
    assert_eq!(a.latest_from(sid, Some(1)).await.unwrap().revision, 1);
    assert_eq!(a.latest_from(sid, Some(2)).await.unwrap().revision, 2);
    let fresh = Manifests::new(objects.clone());
    assert_eq!(fresh.latest_from(sid, None).await.unwrap().revision, 2);
    assert_eq!(fresh.latest_from(sid, Some(0)).await.unwrap().revision, 2, "nothing remembered: read from the store");
    // a revision said to be committed that the store does not have is an error, not older state
    let ahead = fresh.latest_from(sid, Some(3)).await;
    assert!(matches!(ahead, Err(ManifestError::RevisionMissing { revision: 3, latest: 2, .. })), "{ahead:?}");
}

fn signed(objects: &Arc<dyn ObjectStore>, key_byte: u8) -> Manifests {
    let key = crate::signing::ManifestKey::new(&[key_byte; crate::signing::MIN_KEY_BYTES]);
    Manifests::new(objects.clone()).with_key(Some(key))
}

/// Whoever can write the bucket cannot make a worker load their manifest: an
/// unsigned one, a signed one they changed, or a real one moved under another
/// session's key are each refused with an error naming the object.
async fn only_manifests_signed_with_the_key_load(objects: Arc<dyn ObjectStore>) {
    put_chunk(&objects, "aa").await;
    let (victim, attacker) = (Uuid::now_v7(), Uuid::now_v7());
    let m = signed(&objects, 7);
    m.commit(&commit(victim, 0, "x", "aa")).await.unwrap();
    m.commit(&commit(attacker, 0, "x", "aa")).await.unwrap();
    // a restarted gateway with the same key reads what the first one signed
    assert_eq!(signed(&objects, 7).latest(victim).await.unwrap().revision, 1);
    // one with another key (or none of the platform's) refuses it
    let err = signed(&objects, 8).latest(victim).await.unwrap_err();
    assert!(matches!(err, ManifestError::Unverified { .. }), "{err}");

    let key2 = schemas::checkpoint::manifest_key(victim, 2);
    let put = |bytes: Vec<u8>| {
        let (objects, key2) = (objects.clone(), key2.clone());
        async move { objects.put(&Path::from(key2.as_str()), bytes.into()).await.unwrap() }
    };
    // 1. an unsigned revision 2 pointing x at the attacker's record
    let mut forged = (*m.latest(victim).await.unwrap()).clone();
    forged.revision = 2;
    forged.objects.values_mut().for_each(|o| o.record.len = 99);
    put(serde_json::to_vec(&forged).unwrap()).await;
    let err = signed(&objects, 7).latest(victim).await.unwrap_err();
    assert!(matches!(&err, ManifestError::Unverified { key, .. } if key == &key2), "{err}");
    assert!(err.to_string().contains("carries no MAC"), "{err}");
    // 2. the real revision 1, changed, its MAC kept
    let real = objects.get(&Path::from(schemas::checkpoint::manifest_key(victim, 1))).await.unwrap();
    let text = String::from_utf8(real.bytes().await.unwrap().to_vec()).unwrap();
    put(text.replace("\"revision\":1", "\"revision\":2").into_bytes()).await;
    let err = signed(&objects, 7).latest(victim).await.unwrap_err();
    assert!(err.to_string().contains("does not verify"), "{err}");
    // 3. the attacker's own signed manifest, copied under the victim's revision 2
    let theirs = objects.get(&Path::from(schemas::checkpoint::manifest_key(attacker, 1))).await.unwrap();
    put(theirs.bytes().await.unwrap().to_vec()).await;
    let err = signed(&objects, 7).latest(victim).await.unwrap_err();
    assert!(matches!(err, ManifestError::Corrupt { .. }), "{err}");

    // a stray object beside the manifests, not of their key format, is not taken
    // for the newest revision by a gateway that has to list them
    let stray = format!("{}/99.json", schemas::checkpoint::manifests_dir(attacker));
    objects.put(&Path::from(stray.as_str()), b"{}".to_vec().into()).await.unwrap();
    assert_eq!(signed(&objects, 7).latest(attacker).await.unwrap().revision, 1);
}

/// The chunk each name of the session's latest state points at.
async fn state(m: &Manifests, session: Uuid) -> Vec<(String, String)> {
    let latest = m.latest(session).await.unwrap();
    latest
        .variables
        .iter()
        .map(|(n, v)| {
            let oid = v.oid.as_deref().unwrap();
            (n.clone(), latest.objects[oid].record.chunks[0].clone())
        })
        .collect()
}

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

async fn undo_steps_back_one_cells_state_at_a_time(objects: Arc<dyn ObjectStore>) {
    let m = Manifests::new(objects.clone());
    let sid = Uuid::now_v7();
    for c in ["c1", "c2", "c3"] {
        put_chunk(&objects, c).await;
    }
    m.commit(&commit(sid, 0, "a", "c1")).await.unwrap();
    m.commit(&commit(sid, 1, "a", "c2")).await.unwrap(); // `a` mutated in place
    m.commit(&commit(sid, 2, "b", "c3")).await.unwrap();

    let (r4, of) = m.revert(sid, 3, RevertTo::Undo).await.unwrap();
    assert_eq!((r4.revision, of, r4.exec_id), (4, 2, Uuid::nil()));
    assert_eq!(state(&m, sid).await, pairs(&[("a", "c2")]));
    // again: the state before the cell before, not back to revision 3
    let (r5, of) = m.revert(sid, 4, RevertTo::Undo).await.unwrap();
    assert_eq!((r5.revision, of), (5, 1));
    assert_eq!(state(&m, sid).await, pairs(&[("a", "c1")]));
    let (_, of) = m.revert(sid, 5, RevertTo::Undo).await.unwrap();
    assert_eq!(of, 0);
    assert!(state(&m, sid).await.is_empty());
    let err = m.revert(sid, 6, RevertTo::Undo).await.unwrap_err();
    assert!(matches!(err, ManifestError::NothingToUndo { .. }), "{err}");

    // a cell after an undo builds on the state it left; undo returns there
    m.commit(&commit(sid, 6, "c", "c3")).await.unwrap();
    m.revert(sid, 7, RevertTo::Undo).await.unwrap();
    assert!(state(&m, sid).await.is_empty());
    // a revert based on an old revision is stale and changes nothing
    let err = m.revert(sid, 3, RevertTo::Undo).await.unwrap_err();
    assert!(matches!(err, ManifestError::Stale { latest: 8, .. }), "{err}");
    // and a restart reads the same lineage back
    let fresh = Manifests::new(objects.clone());
    assert_eq!(fresh.latest(sid).await.unwrap().revision, 8);
    let (_, of) = fresh.revert(sid, 8, RevertTo::Revision(2)).await.unwrap();
    assert_eq!(of, 2);
    assert_eq!(state(&fresh, sid).await, pairs(&[("a", "c2")]));
}

#[tokio::test]
async fn checkout_commits_a_kept_revisions_state_and_names_what_is_held() {
    let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let m = Manifests::new(objects.clone());
    let sid = Uuid::now_v7();
    for c in ["c1", "c2", "c3"] {
        put_chunk(&objects, c).await;
    }
    m.commit(&commit(sid, 0, "a", "c1")).await.unwrap();
    m.commit(&commit(sid, 1, "b", "c2")).await.unwrap();
    m.commit(&commit(sid, 2, "a", "c3")).await.unwrap();
    let (r4, of) = m.revert(sid, 3, RevertTo::Revision(1)).await.unwrap();
    assert_eq!((r4.revision, of), (4, 1));
    assert_eq!(state(&m, sid).await, pairs(&[("a", "c1")]));
    // undo after a checkout: the state before the cell that made the one checked out
    m.revert(sid, 4, RevertTo::Undo).await.unwrap();
    assert!(state(&m, sid).await.is_empty());

    let err = m.revert(sid, 5, RevertTo::Revision(9)).await.unwrap_err();
    assert!(matches!(err, ManifestError::NoRevision { revision: 9, .. }), "{err}");
    assert!(err.to_string().contains("revisions 1 to 5"), "{err}");
    // a collected revision is not there either, and the message says why
    crate::gc::collect(&m, 2, std::time::Duration::from_secs(3600)).await.unwrap();
    let err = m.revert(sid, 5, RevertTo::Revision(2)).await.unwrap_err();
    assert!(err.to_string().contains("revisions 4 to 5 (older ones were collected)"), "{err}");
    assert_eq!(m.latest(sid).await.unwrap().revision, 5, "a refused revert commits nothing");
}

#[tokio::test]
async fn forks_diverge_without_touching_each_other_or_their_parent() {
    let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let m = Manifests::new(objects.clone());
    let (parent, f1, f2) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    for c in ["c1", "c2", "c3", "c4"] {
        put_chunk(&objects, c).await;
    }
    let mut with_generator = commit(parent, 0, "a", "c1");
    with_generator.delta.unsavable.insert("g".into(), "a generator".into());
    m.commit(&with_generator).await.unwrap();
    // what only the parent's worker holds is not the fork's (nor routed there)
    let (first, lost) = m.fork(parent, Some(1), f1).await.unwrap();
    assert_eq!(lost, vec!["g".to_string()]);
    assert!(first.unsavable.is_empty());
    assert_eq!((first.session, first.revision, first.parent), (f1, 1, None));
    assert_eq!(first.forked_from.map(|f| (f.session, f.revision)), Some((parent, 1)));
    m.fork(parent, Some(1), f2).await.unwrap();

    m.commit(&commit(f1, 1, "a", "c2")).await.unwrap();
    m.commit(&commit(f2, 1, "b", "c3")).await.unwrap();
    m.commit(&commit(parent, 1, "a", "c4")).await.unwrap();
    assert_eq!(state(&m, f1).await, pairs(&[("a", "c2")]));
    assert_eq!(state(&m, f2).await, pairs(&[("a", "c1"), ("b", "c3")]));
    assert_eq!(state(&m, parent).await, pairs(&[("a", "c4")]));

    // a fork's undo stops where it was forked
    m.revert(f1, 2, RevertTo::Undo).await.unwrap();
    assert_eq!(state(&m, f1).await, pairs(&[("a", "c1")]));
    let err = m.revert(f1, 3, RevertTo::Undo).await.unwrap_err();
    assert!(err.to_string().contains("forked from session"), "{err}");
    // a fork never lands on a session that has state
    let err = m.fork(parent, None, f2).await.unwrap_err();
    assert!(matches!(err, ManifestError::ForkExists { .. }), "{err}");
    m.delete(parent).await.unwrap();
    let err = m.fork(parent, None, Uuid::now_v7()).await.unwrap_err();
    assert!(matches!(err, ManifestError::Deleted { .. }), "{err}");
}
