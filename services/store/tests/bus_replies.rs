//! What a service asking the store over the bus is told when no good answer comes:
//! a reply larger than the bus takes in one message (a manifest of very many
//! variables) is an error that says so, not a time-out; no store running is told
//! apart from a store too slow to answer.

use std::time::Duration;

use looseleaf_test_support::{random_prefix, NatsServer};
use schemas::checkpoint::{Manifest, VarEntry};
use schemas::messages::{ManifestV1, Reply};
use schemas::{Bus, BusError};
use uuid::Uuid;

#[tokio::test]
async fn an_answer_too_large_for_one_message_is_an_error_not_silence() {
    let nats = NatsServer::start().expect("nats-server");
    let prefix = random_prefix();
    let server = Bus::connect(nats.url(), &prefix, "answering").await.expect("connect");
    let client = Bus::connect(nats.url(), &prefix, "asking").await.expect("connect");
    let subject = format!("{prefix}.v1.test.big");
    let mut sub = server.subscribe::<ManifestV1>(subject.clone()).await.expect("subscribe");
    server.flush().await.expect("flush");

    let mut manifest = Manifest::default();
    for i in 0..60_000 {
        let entry =
            VarEntry { version: Uuid::now_v7(), oid: Some(format!("oid-{i:032}")), module: None, global_reads: vec![] };
        manifest.variables.insert(format!("v{i}"), entry);
    }
    let big = ManifestV1 { manifest };
    let answer = tokio::spawn(async move {
        let Some(Ok(env)) = sub.next().await else { panic!("no request") };
        let sent = server.respond(env.reply, &Reply::Ok(big)).await;
        server.flush().await.expect("flush");
        sent
    });
    let asked = ManifestV1 { manifest: Manifest::default() };
    match client.request::<_, ManifestV1>(subject, &asked, Duration::from_secs(10)).await {
        Err(BusError::Remote { message, .. }) => assert!(message.contains("larger than the bus takes"), "{message}"),
        other => panic!("expected a remote error, got {other:?}"),
    }
    assert!(answer.await.expect("task").is_ok());
}

#[tokio::test]
async fn no_responder_and_a_slow_responder_are_different_errors() {
    let nats = NatsServer::start().expect("nats-server");
    let prefix = random_prefix();
    let client = Bus::connect(nats.url(), &prefix, "asking").await.expect("connect");
    let get = schemas::messages::ManifestGetV2 { session: Uuid::now_v7(), at_least: None };

    let nobody = format!("{prefix}.v1.test.nobody");
    let err = client.request::<_, ManifestV1>(nobody.clone(), &get, Duration::from_secs(5)).await.expect_err("nobody");
    assert!(matches!(&err, BusError::NoResponders { subject } if *subject == nobody), "{err}");

    let slow = format!("{prefix}.v1.test.slow");
    let silent = Bus::connect(nats.url(), &prefix, "silent").await.expect("connect");
    let _sub = silent.subscribe::<schemas::messages::ManifestGetV2>(slow.clone()).await.expect("subscribe");
    silent.flush().await.expect("flush");
    let timeout = Duration::from_millis(300);
    let err = client.request::<_, ManifestV1>(slow.clone(), &get, timeout).await.expect_err("silent");
    assert!(matches!(&err, BusError::TimedOut { subject, timeout: t } if *subject == slow && *t == timeout), "{err}");
}
