//! A reply larger than the bus takes in one message (a manifest of very many
//! variables) reaches the asker as an error that says so, not as a time-out.

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
