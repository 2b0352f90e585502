//! The planner's per-session state in a real JetStream KV bucket: a state too
//! large for the bucket is an error that says how large, not a retry storm that
//! ends in "too many concurrent updates"; a corrupt state is an error, not a reset.

use looseleaf_planner::state::{self, NameMeta};
use looseleaf_test_support::{random_prefix, NatsServer};
use uuid::Uuid;

/// The planner's bucket on a nats-server of the test's own (kept alive with it).
async fn planner_bucket() -> anyhow::Result<(NatsServer, async_nats::jetstream::kv::Store)> {
    let nats = NatsServer::start()?;
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await?);
    let kv = schemas::buckets::planner(&js, &random_prefix(), 1).await?;
    Ok((nats, kv))
}

#[tokio::test]
async fn a_state_too_large_to_write_says_so() {
    let (_nats, kv) = planner_bucket().await.expect("planner bucket on a real nats-server");
    let session = Uuid::now_v7();

    // an ordinary update goes through
    let meta = NameMeta { exec_id: Uuid::now_v7(), def: None, on_gpu: false };
    state::modify(&kv, session, |st| st.names.insert("x".into(), meta.clone())).await.expect("small state");

    // a cell of very many assignments
    let err = state::modify(&kv, session, |st| {
        for i in 0..40_000 {
            st.names.insert(format!("v{i}"), meta.clone());
        }
    })
    .await
    .expect_err("over the bucket's message size");
    let msg = err.to_string();
    assert!(msg.contains("bytes of state") && !msg.contains("concurrent"), "{msg}");
    // and nothing was lost: the state before the failed update is still there
    let kept = state::modify(&kv, session, |st| st.names.contains_key("x") && !st.names.contains_key("v1"))
        .await
        .expect("read back");
    assert!(kept);
}

/// A stored state that does not decode is an error naming the session, and it is
/// left in place: a silent reset would forget which cells define which names.
#[tokio::test]
async fn a_corrupt_state_is_reported_not_reset() {
    let (_nats, kv) = planner_bucket().await.expect("planner bucket on a real nats-server");
    let session = Uuid::now_v7();
    kv.put(session.to_string(), "{not json".into()).await.expect("put garbage");

    let mut called = false;
    let err = state::modify(&kv, session, |_| called = true).await.expect_err("corrupt state");
    assert!(matches!(err, state::StateError::Corrupt { session: s, .. } if s == session), "{err}");
    assert!(err.to_string().contains(&session.to_string()), "{err}");
    assert!(!called, "nothing is planned on a state that was not read");
    let stored = kv.get(session.to_string()).await.expect("get").expect("still there");
    assert_eq!(stored.as_ref(), b"{not json", "the stored state is untouched");
}
