//! The service skeleton on a real nats-server: a service is seen on `$SRV` while it
//! serves and gone after; a signal drains, a drain that hangs is cut off, and an
//! actor that stops is noticed and is an error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use looseleaf_test_support::{random_prefix, NatsServer};
use schemas::nats::NatsOptions;
use schemas::service::{Service, ServiceError};
use schemas::BusError;

/// Whether `$SRV.PING.<name>` gets an answer.
async fn answers_ping(nats: &NatsServer, name: &str) -> anyhow::Result<bool> {
    let client = async_nats::connect(nats.url()).await?;
    Ok(client.request(format!("$SRV.PING.{name}"), "".into()).await.is_ok())
}

#[tokio::test]
async fn a_signal_drains_then_leaves_srv() {
    let nats = NatsServer::start().expect("nats-server");
    let service = Service::start("ll-test-drains", None, "test", &NatsOptions::url(nats.url()), &random_prefix())
        .await
        .expect("start");
    assert!(answers_ping(&nats, "ll-test-drains").await.expect("ping"), "registered while serving");
    let drained = Arc::new(AtomicBool::new(false));
    let flag = drained.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(async move {
        let shutdown = async {
            let _ = stop_rx.await;
        };
        service.serve(shutdown, || true, async move { flag.store(true, Ordering::SeqCst) }).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!serving.is_finished(), "serves until the signal");
    stop_tx.send(()).expect("signal");
    serving.await.expect("join").expect("a signal is a clean stop");
    assert!(drained.load(Ordering::SeqCst), "the drain ran");
    assert!(!answers_ping(&nats, "ll-test-drains").await.expect("ping"), "gone from $SRV after stopping");
}

#[tokio::test]
async fn a_hung_drain_is_cut_off() {
    let nats = NatsServer::start().expect("nats-server");
    let service = Service::start("ll-test-hung", None, "test", &NatsOptions::url(nats.url()), &random_prefix())
        .await
        .expect("start")
        .with_drain_timeout(Duration::from_millis(300));
    let started = Instant::now();
    service.serve(async {}, || true, std::future::pending()).await.expect("stops anyway");
    assert!(started.elapsed() < Duration::from_secs(10), "cut off at the drain timeout");
}

#[tokio::test]
async fn a_stopped_actor_is_an_error() {
    let nats = NatsServer::start().expect("nats-server");
    let service = Service::start("ll-test-dies", None, "test", &NatsOptions::url(nats.url()), &random_prefix())
        .await
        .expect("start");
    let alive = Arc::new(AtomicBool::new(true));
    let a = alive.clone();
    let serving =
        tokio::spawn(
            async move { service.serve(std::future::pending(), move || a.load(Ordering::SeqCst), async {}).await },
        );
    tokio::time::sleep(Duration::from_millis(200)).await;
    alive.store(false, Ordering::SeqCst);
    let result = tokio::time::timeout(Duration::from_secs(10), serving).await.expect("noticed").expect("join");
    assert!(matches!(result, Err(ServiceError::ActorStopped { service: "ll-test-dies" })), "{result:?}");
}

#[tokio::test]
async fn no_nats_is_a_clear_error() {
    let err = Service::start(
        "ll-test-none",
        None,
        "test",
        &NatsOptions { connect_wait_s: 0, ..NatsOptions::url("nats://127.0.0.1:1") },
        "p",
    )
    .await
    .err()
    .expect("no server");
    assert!(matches!(err, ServiceError::Bus(BusError::Connect { .. })), "{err}");
}

#[tokio::test]
async fn stopping_without_nats_is_quick() {
    let mut nats = NatsServer::start().expect("nats-server");
    let service = Service::start("ll-test-nonats", None, "test", &NatsOptions::url(nats.url()), &random_prefix())
        .await
        .expect("start");
    nats.kill();
    let started = Instant::now();
    service.serve(async {}, || true, async {}).await.expect("a clean stop");
    assert!(started.elapsed() < Duration::from_secs(8), "stopping took {:?}", started.elapsed());
}

#[tokio::test]
async fn a_service_started_before_nats_waits_for_it() {
    let mut nats = NatsServer::start().expect("nats-server");
    let options = NatsOptions { connect_wait_s: 60, ..NatsOptions::url(nats.url()) };
    nats.kill();
    let starting = tokio::spawn(async move { Service::start("ll-test-early", None, "test", &options, "p").await });
    // it keeps trying while nothing listens
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!starting.is_finished(), "gave up while NATS was down");
    nats.restart().expect("restart");
    let service = tokio::time::timeout(Duration::from_secs(30), starting).await.expect("connected").expect("join");
    assert!(service.is_ok(), "{:?}", service.err());
}

#[tokio::test]
async fn a_refused_login_is_reported_at_once() {
    let nats = NatsServer::start().expect("nats-server");
    // the test server takes anyone, so a TLS requirement it cannot meet is the refusal
    let options = NatsOptions { connect_wait_s: 60, ..NatsOptions::url(nats.url().replace("nats://", "tls://")) };
    let started = Instant::now();
    let err = Service::start("ll-test-refused", None, "test", &options, "p").await.err().expect("refused");
    assert!(matches!(err, ServiceError::Bus(BusError::Connect { .. })), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "retried a refusal for {:?}", started.elapsed());
}
