//! The service skeleton on a real nats-server: a service is seen on `$SRV` while it
//! serves and gone after; a signal drains, a drain that hangs is cut off, and an
//! actor that stops is noticed and is an error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use looseleaf_test_support::{random_prefix, NatsServer};
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
    let service = Service::start("ll-test-drains", None, "test", nats.url(), &random_prefix()).await.expect("start");
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
    let service = Service::start("ll-test-hung", None, "test", nats.url(), &random_prefix())
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
    let service = Service::start("ll-test-dies", None, "test", nats.url(), &random_prefix()).await.expect("start");
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
    let err = Service::start("ll-test-none", None, "test", "nats://127.0.0.1:1", "p").await.err().expect("no server");
    assert!(matches!(err, ServiceError::Bus(BusError::Connect { .. })), "{err}");
}

#[tokio::test]
async fn stopping_without_nats_is_quick() {
    let mut nats = NatsServer::start().expect("nats-server");
    let service = Service::start("ll-test-nonats", None, "test", nats.url(), &random_prefix()).await.expect("start");
    nats.kill();
    let started = Instant::now();
    service.serve(async {}, || true, async {}).await.expect("a clean stop");
    assert!(started.elapsed() < Duration::from_secs(8), "stopping took {:?}", started.elapsed());
}
