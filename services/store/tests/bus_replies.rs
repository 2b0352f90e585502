//! What a service asking the store over the bus is told: a reply larger than one
//! message (a manifest of very many variables) arrives whole, as a body (ADR 30);
//! one larger than the bus carries at all is an error that says so, not a
//! time-out; no store running is told apart from a store too slow to answer, and
//! so is a store that died holding the request (presence probes).

use std::time::Duration;

use looseleaf_test_support::{random_prefix, NatsServer};
use schemas::checkpoint::{Manifest, VarEntry};
use schemas::messages::{ManifestV2, Reply};
use schemas::{Bus, BusError};
use uuid::Uuid;

/// Ask `subject` and have another connection answer with `answer`: what the asker
/// got, and whether the answer was sent.
type Asked = (Result<ManifestV2, BusError>, Result<(), BusError>);

async fn ask_and_answer(nats: &NatsServer, prefix: &str, answer: ManifestV2) -> anyhow::Result<Asked> {
    let server = Bus::connect(nats.url(), prefix, "answering").await?;
    let client = Bus::connect(nats.url(), prefix, "asking").await?;
    let subject = format!("{prefix}.v1.test.big");
    let mut sub = server.subscribe::<ManifestV2>(subject.clone()).await?;
    server.flush().await?;
    let answering = tokio::spawn(async move {
        let Some(Ok(env)) = sub.next().await else { return Err(anyhow::anyhow!("no request")) };
        let sent = server.respond(env.reply, &Reply::Ok(answer)).await;
        server.flush().await?;
        Ok(sent)
    });
    let asked = ManifestV2 { manifest: Manifest::default() };
    let got = client.request::<_, ManifestV2>(subject, &asked, Duration::from_secs(20)).await;
    Ok((got, answering.await??))
}

#[tokio::test]
async fn an_answer_larger_than_a_message_arrives_and_one_larger_than_the_bus_carries_says_so() {
    let nats = NatsServer::start().expect("nats-server");
    let prefix = random_prefix();

    let mut manifest = Manifest::default();
    for i in 0..60_000 {
        let entry =
            VarEntry { version: Uuid::now_v7(), oid: Some(format!("oid-{i:032}")), module: None, global_reads: vec![] };
        manifest.variables.insert(format!("v{i}"), entry);
    }
    let (got, sent) = ask_and_answer(&nats, &prefix, ManifestV2 { manifest: manifest.clone() }).await.expect("asked");
    assert!(sent.is_ok());
    assert_eq!(got.expect("a 60,000-name manifest").manifest, manifest);

    let mut huge = Manifest::default();
    let module = "m".repeat(schemas::bodies::MAX_BODY_BYTES + 1);
    huge.variables
        .insert("x".into(), VarEntry { version: Uuid::nil(), oid: None, module: Some(module), global_reads: vec![] });
    let (got, sent) = ask_and_answer(&nats, &prefix, ManifestV2 { manifest: huge }).await.expect("asked");
    assert!(sent.is_ok());
    match got {
        Err(BusError::Remote { message, .. }) => assert!(message.contains("larger than the bus carries"), "{message}"),
        other => panic!("expected a remote error, got {other:?}"),
    }
}

#[tokio::test]
async fn no_responder_and_a_slow_responder_are_different_errors() {
    let nats = NatsServer::start().expect("nats-server");
    let prefix = random_prefix();
    let client = Bus::connect(nats.url(), &prefix, "asking").await.expect("connect");
    let get = schemas::messages::ManifestGetV2 { session: Uuid::now_v7(), at_least: None };

    let nobody = format!("{prefix}.v1.test.nobody");
    let err = client.request::<_, ManifestV2>(nobody.clone(), &get, Duration::from_secs(5)).await.expect_err("nobody");
    assert!(matches!(&err, BusError::NoResponders { subject } if *subject == nobody), "{err}");

    let slow = format!("{prefix}.v1.test.slow");
    let silent = Bus::connect(nats.url(), &prefix, "silent").await.expect("connect");
    let _sub = silent.subscribe::<schemas::messages::ManifestGetV2>(slow.clone()).await.expect("subscribe");
    silent.flush().await.expect("flush");
    let timeout = Duration::from_millis(300);
    let err = client.request::<_, ManifestV2>(slow.clone(), &get, timeout).await.expect_err("silent");
    assert!(matches!(&err, BusError::TimedOut { subject, timeout: t } if *subject == slow && *t == timeout), "{err}");
}

/// A request or delivery lost on its way (here: heard by a service that drops it,
/// as one dying with it would) is sent again, and the second copy gets through
/// (ADR 46). A plain request waits out its whole timeout instead.
#[tokio::test]
async fn a_lost_request_or_delivery_is_sent_again() {
    let nats = NatsServer::start().expect("nats-server");
    let prefix = random_prefix();
    let client = Bus::connect(nats.url(), &prefix, "asking").await.expect("connect");
    let server = Bus::connect(nats.url(), &prefix, "answering").await.expect("connect");
    let get = schemas::messages::ManifestGetV2 { session: Uuid::now_v7(), at_least: None };

    // answers every copy but the first, and counts the copies it heard
    let subject = format!("{prefix}.v1.test.lossy");
    let mut sub = server.subscribe::<schemas::messages::ManifestGetV2>(subject.clone()).await.expect("subscribe");
    server.flush().await.expect("flush");
    let heard = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = heard.clone();
    tokio::spawn(async move {
        while let Some(Ok(env)) = sub.next().await {
            if counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
                let _ = server.respond(env.reply, &Reply::Ok(ManifestV2 { manifest: Manifest::default() })).await;
            }
        }
    });

    let plain = client.request::<_, ManifestV2>(subject.clone(), &get, Duration::from_millis(500)).await;
    assert!(matches!(plain, Err(BusError::TimedOut { .. })), "{plain:?}");
    heard.store(0, std::sync::atomic::Ordering::SeqCst);
    let asked_again = client.request_idempotent::<_, ManifestV2>(subject.clone(), &get, Duration::from_secs(30)).await;
    assert!(asked_again.is_ok(), "{asked_again:?}");
    assert_eq!(heard.load(std::sync::atomic::Ordering::SeqCst), 2);

    // a delivery is acknowledged by an (empty) answer: the second copy's
    heard.store(0, std::sync::atomic::Ordering::SeqCst);
    client.deliver(subject, &get, Duration::from_secs(30)).await.expect("delivered");
    assert_eq!(heard.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A service that dies holding a request (no answer, its subscription gone) is
/// found gone by the asker's presence probes, which the service's subscription
/// answers without handing them on: the request fails as "nothing answers"
/// before its attempt would have timed out.
#[tokio::test]
async fn a_service_that_dies_holding_a_request_is_found_gone() {
    let nats = NatsServer::start().expect("nats-server");
    let prefix = random_prefix();
    let server = Bus::connect(nats.url(), &prefix, "dying").await.expect("connect");
    let client = Bus::connect(nats.url(), &prefix, "asking").await.expect("connect");
    let subject = format!("{prefix}.v1.test.held");
    let mut sub = server.subscribe::<ManifestV2>(subject.clone()).await.expect("subscribe");
    server.flush().await.expect("flush");
    let holding = tokio::spawn(async move {
        let request = sub.next().await;
        // held for several probes: none of them reaches the service
        let more = tokio::time::timeout(schemas::bus::PRESENCE_PROBE_EVERY * 3, sub.next()).await;
        drop(sub);
        server.flush().await.expect("flush");
        (request.map(|r| r.is_ok()), more.is_ok())
    });
    // shorter than one attempt's wait: without probes this times out
    let timeout = schemas::bus::ATTEMPT_WAIT - Duration::from_millis(500);
    let asked = ManifestV2 { manifest: Manifest::default() };
    let got = client.request_idempotent::<_, ManifestV2>(subject, &asked, timeout).await;
    let (request, probe_handed_on) = holding.await.expect("holder");
    assert_eq!(request, Some(true), "the service got the request");
    assert!(!probe_handed_on, "a presence probe reached the service");
    assert!(matches!(got, Err(BusError::NoResponders { .. })), "got {got:?}");
}
