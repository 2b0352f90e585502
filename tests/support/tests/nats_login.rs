//! Connecting as operators run NATS (ADR 35), against real nats-servers: TLS with a
//! private CA and client certificates, user and password, NKEY, token, and a seed
//! list whose first server is down. Each refusal is an error that names the
//! servers, and never shows a secret.

use std::time::Duration;

use looseleaf_test_support::free_port;
use looseleaf_test_support::secure_nats::{ConfiguredNats, TestPki};
use schemas::nats::NatsOptions;
use schemas::{Bus, BusError};

/// A request answered over the bus: the login works for more than the handshake.
async fn round_trip(options: &NatsOptions) -> anyhow::Result<()> {
    let bus = Bus::connect_with(options, "t", "login-test").await?;
    let mut sub = bus.client().subscribe("t.echo").await?;
    let client = bus.client().clone();
    tokio::spawn(async move {
        use futures::StreamExt as _;
        if let Some(m) = sub.next().await {
            if let Some(reply) = m.reply {
                let _ = client.publish(reply, m.payload).await;
            }
        }
    });
    let answer = bus.client().request("t.echo", "ping".into()).await?;
    anyhow::ensure!(&answer.payload[..] == b"ping", "echo answered {:?}", answer.payload);
    // JetStream too: the services make their buckets with the configured replicas
    schemas::buckets::claims(&bus.jetstream(), "t", options.replicas).await?;
    Ok(())
}

async fn refused(options: &NatsOptions) -> BusError {
    match Bus::connect_with(options, "t", "login-test").await {
        Ok(_) => panic!("{options:?} connected"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn tls_with_a_private_ca_and_client_certificates_and_each_login() -> anyhow::Result<()> {
    let pki = TestPki::new()?;
    let user = nkeys::KeyPair::new_user();
    let seed_dir = tempfile::tempdir()?;
    let seed_file = seed_dir.path().join("service.nk");
    std::fs::write(&seed_file, format!("{}\n", user.seed()?))?;
    let port = free_port()?;
    let js = tempfile::tempdir()?;
    let config = format!(
        "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\" }}\n{}\nauthorization {{\n  users = [\n    {{ user: svc, password: s3cret }}\n    {{ nkey: {} }}\n  ]\n}}\n",
        js.path().display(),
        pki.server_tls_block(),
        user.public_key(),
    );
    let _server = ConfiguredNats::start(port, &config)?;
    let tls = |url: String| NatsOptions {
        tls_ca: Some(pki.ca.clone()),
        tls_cert: Some(pki.client_cert.clone()),
        tls_key: Some(pki.client_key.clone()),
        ..NatsOptions::url(url)
    };

    // user and password in the URL, over TLS with the client certificate
    round_trip(&tls(format!("nats://svc:s3cret@127.0.0.1:{port}"))).await?;
    // an NKEY seed file
    round_trip(&NatsOptions { nkey: Some(seed_file.clone()), ..tls(format!("tls://127.0.0.1:{port}")) }).await?;
    // a seed list whose first server is down: the next one is used
    let dead = free_port()?;
    round_trip(&tls(format!("nats://svc:s3cret@127.0.0.1:{dead}, nats://svc:s3cret@127.0.0.1:{port}"))).await?;

    // a wrong password is refused, and the error shows no password
    let e = refused(&tls(format!("nats://svc:wrong@127.0.0.1:{port}"))).await;
    let text = e.to_string();
    assert!(
        matches!(&e, BusError::Connect { source, .. } if source.kind() == async_nats::ConnectErrorKind::AuthorizationViolation),
        "{text}"
    );
    assert!(text.contains(&format!("127.0.0.1:{port}")) && !text.contains("wrong"), "{text}");
    // no client certificate: the server's verify refuses the handshake
    let no_cert = NatsOptions { tls_cert: None, tls_key: None, ..tls(format!("nats://svc:s3cret@127.0.0.1:{port}")) };
    assert!(matches!(refused(&NatsOptions { connect_wait_s: 1, ..no_cert }).await, BusError::Connect { .. }));
    // without the private CA the server's certificate is not trusted
    let no_ca = NatsOptions { tls_ca: None, ..tls(format!("tls://svc:s3cret@127.0.0.1:{port}")) };
    let e = refused(&NatsOptions { connect_wait_s: 1, ..no_ca }).await;
    assert!(matches!(&e, BusError::Connect { .. }) && e.to_string().contains("certificate"), "{e}");
    // a user with a password file (a mounted secret, its newline not part of it)
    let password_file = seed_dir.path().join("svc-password");
    std::fs::write(&password_file, "s3cret\n")?;
    let from_file = |path: std::path::PathBuf| NatsOptions {
        user: Some("svc".into()),
        password_file: Some(path),
        ..tls(format!("tls://127.0.0.1:{port}"))
    };
    round_trip(&from_file(password_file.clone())).await?;
    // a missing password file names the file, before any server is asked
    let e = refused(&from_file(seed_dir.path().join("absent"))).await;
    assert!(matches!(&e, BusError::LoginFile { path, .. } if path.ends_with("absent")), "{e}");
    // a seed file that is not one names the file
    let bad_seed = seed_dir.path().join("empty.nk");
    std::fs::write(&bad_seed, "not a seed\n")?;
    let e = refused(&NatsOptions { nkey: Some(bad_seed), ..tls(format!("tls://127.0.0.1:{port}")) }).await;
    assert!(matches!(&e, BusError::LoginFile { path, .. } if path.ends_with("empty.nk")), "{e}");
    // the options' Debug never shows the password
    let shown = format!("{:?}", tls(format!("nats://svc:s3cret@127.0.0.1:{port}")));
    assert!(!shown.contains("s3cret"), "{shown}");
    Ok(())
}

#[tokio::test]
async fn a_token_logs_in_from_the_options_or_the_url() -> anyhow::Result<()> {
    let port = free_port()?;
    let js = tempfile::tempdir()?;
    let config = format!(
        "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\" }}\nauthorization {{ token: \"t0ken-abc\" }}\n",
        js.path().display()
    );
    let _server = ConfiguredNats::start(port, &config)?;
    let url = format!("nats://127.0.0.1:{port}");
    round_trip(&NatsOptions { token: Some("t0ken-abc".into()), ..NatsOptions::url(url.clone()) }).await?;
    round_trip(&NatsOptions::url(format!("nats://t0ken-abc@127.0.0.1:{port}"))).await?;
    let wrong = NatsOptions { token: Some("nope".into()), ..NatsOptions::url(url.clone()) };
    let e = refused(&wrong).await;
    assert!(
        matches!(&e, BusError::Connect { source, .. } if source.kind() == async_nats::ConnectErrorKind::AuthorizationViolation),
        "{e}"
    );
    let shown = format!("{wrong:?} {}", NatsOptions::url(format!("nats://t0ken-abc@127.0.0.1:{port}")).shown());
    assert!(!shown.contains("nope") && !shown.contains("t0ken"), "{shown}");
    // nobody answers at all: after the connect wait, a clear error naming the server
    let nobody = NatsOptions { connect_wait_s: 1, ..NatsOptions::url(format!("nats://127.0.0.1:{}", free_port()?)) };
    let started = std::time::Instant::now();
    let e = refused(&nobody).await;
    assert!(e.to_string().contains("cannot connect to NATS at nats://127.0.0.1:"), "{e}");
    assert!(started.elapsed() >= Duration::from_millis(500), "gave up before its connect wait");
    Ok(())
}
