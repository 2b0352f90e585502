//! `/healthz` and `/readyz` (ADR 37) on the real service binaries: ready once what
//! each needs answers (NATS, its bucket, a gpu-host's base zygote), 503 naming NATS
//! when the server freezes, ready again when it resumes; the frontend answers
//! probes on its API address without a token.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use looseleaf_test_support::cluster::bin_dir_of;
use looseleaf_test_support::{free_port, random_prefix, NatsServer};
use serde_json::Value;

/// A service process, killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(bin: &str, nats: &NatsServer, prefix: &str, args: &[&str]) -> anyhow::Result<Proc> {
    let exe = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")).join(bin);
    let child = Command::new(exe)
        .args(["--nats-url", nats.url(), "--prefix", prefix, "--log", "warn"])
        .args(args)
        .stdin(Stdio::null())
        .spawn()?;
    Ok(Proc(child))
}

/// GET `url`: (status, body as JSON or a string).
async fn get(url: &str) -> Option<(u16, Value)> {
    let resp = reqwest::Client::new().get(url).timeout(Duration::from_secs(10)).send().await.ok()?;
    let status = resp.status().as_u16();
    let text = resp.text().await.ok()?;
    Some((status, serde_json::from_str(&text).unwrap_or(Value::String(text))))
}

/// Wait until GET `url` answers `status`; the body.
async fn until(url: &str, status: u16) -> anyhow::Result<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let last = get(url).await;
        match last {
            Some((s, body)) if s == status => return Ok(body),
            _ if tokio::time::Instant::now() > deadline => anyhow::bail!("{url}: never {status}; last answer {last:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn services_are_ready_when_what_they_need_answers() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let prefix = random_prefix();
    let (planner_port, host_port) = (free_port()?, free_port()?);
    let planner_listen = format!("127.0.0.1:{planner_port}");
    let _planner = start("looseleaf-planner", &nats, &prefix, &["--health-listen", &planner_listen])?;
    let runtime = tempfile::tempdir()?;
    let host_listen = format!("127.0.0.1:{host_port}");
    let store = runtime.path().join("store").display().to_string();
    let run_dir = runtime.path().join("run").display().to_string();
    let _host = start(
        "looseleaf-gpu-host",
        &nats,
        &prefix,
        &[
            "--host-id",
            "h0",
            "--virtual-gpus",
            "1",
            "--store-url",
            &store,
            "--runtime-dir",
            &run_dir,
            "--health-listen",
            &host_listen,
        ],
    )?;

    let planner = format!("http://{planner_listen}");
    assert_eq!(until(&format!("{planner}/healthz"), 200).await?, Value::String("ok\n".into()));
    let ready = until(&format!("{planner}/readyz"), 200).await?;
    assert_eq!(ready["checks"]["nats"], "ok", "{ready}");
    assert_eq!(ready["checks"]["planner_bucket"], "ok", "{ready}");
    // a gpu-host is ready once its base zygote is up
    let host = format!("http://{host_listen}");
    let ready = until(&format!("{host}/readyz"), 200).await?;
    assert_eq!(ready["checks"]["zygote"], "ok", "{ready}");
    assert_eq!(ready["checks"]["claims_bucket"], "ok", "{ready}");

    // NATS freezes: the socket stays open, nothing answers; not ready, naming NATS
    nats.pause(true)?;
    let not_ready = until(&format!("{planner}/readyz"), 503).await;
    let not_ready = not_ready.inspect_err(|_| {
        let _ = nats.pause(false);
    })?;
    assert_eq!(not_ready["ready"], false, "{not_ready}");
    assert_ne!(not_ready["checks"]["nats"], "ok", "{not_ready}");
    // `looseleaf health` (compose's healthcheck) fails too, naming the status
    let probe = looseleaf_health(&format!("{planner}/readyz"));
    nats.pause(false)?;
    let probe = probe?;
    assert!(!probe.0 && probe.1.contains("503"), "{probe:?}");
    // alive all along, and ready again once NATS answers
    assert_eq!(get(&format!("{planner}/healthz")).await.map(|(s, _)| s), Some(200));
    until(&format!("{planner}/readyz"), 200).await?;
    let probe = looseleaf_health(&format!("{planner}/readyz"))?;
    assert!(probe.0, "{probe:?}");
    // nothing listening: it fails, naming the address
    let nobody = format!("http://127.0.0.1:{}/readyz", free_port()?);
    let probe = looseleaf_health(&nobody)?;
    assert!(!probe.0 && probe.1.contains(&nobody), "{probe:?}");
    Ok(())
}

/// `looseleaf health URL`: (exited 0, its stderr).
fn looseleaf_health(url: &str) -> anyhow::Result<(bool, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_looseleaf")).args(["health", url, "--timeout-s", "5"]).output()?;
    Ok((out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_frontend_answers_probes_without_a_token() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "alice s3cret-token-for-the-api\n")?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let tokens_arg = tokens.display().to_string();
    let _frontend =
        start("looseleaf-frontend", &nats, &random_prefix(), &["--listen", &listen, "--tokens-file", &tokens_arg])?;
    let base = format!("http://{listen}");
    let ready = until(&format!("{base}/readyz"), 200).await?;
    assert_eq!(ready["checks"]["sessions_bucket"], "ok", "{ready}");
    assert_eq!(get(&format!("{base}/healthz")).await.map(|(s, _)| s), Some(200));
    // the API itself still asks for its token
    let session = format!("{base}/v1/sessions/00000000-0000-0000-0000-000000000000");
    assert_eq!(get(&session).await.map(|(s, _)| s), Some(401));
    Ok(())
}
