//! `looseleaf status`: what the hosts report and which services answer `$SRV.PING`;
//! `looseleaf health`: one service's probe, for a container's healthcheck.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use schemas::messages::HostStatusV2;
use schemas::nats::NatsOptions;
use schemas::{Bus, BusError};

/// The NATS service API's discovery subject (NATS protocol, not a LooseLeaf subject).
const SRV_PING: &str = "$SRV.PING";

/// How long the one try to reach NATS may take when no wait was asked for: a
/// status is a glance, and a cluster that is not there will not come meanwhile.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// `looseleaf health URL`: Ok when URL answers 2xx within `timeout_s`; else an
/// error naming the status and the start of the body (a `/readyz` names the
/// check that failed), which compose shows in `docker inspect`.
pub async fn health(url: &str, timeout_s: f64) -> anyhow::Result<()> {
    let timeout = Duration::try_from_secs_f64(timeout_s).context("--timeout-s must be a positive number of seconds")?;
    let client = reqwest::Client::builder().timeout(timeout).build().context("an HTTP client")?;
    let response = client.get(url).send().await.with_context(|| format!("{url} did not answer"))?;
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let body = response.text().await.unwrap_or_default();
    let body: String = body.chars().take(400).collect();
    anyhow::bail!("{url} answered {status}: {}", body.trim())
}

/// Where `looseleaf status` found the NATS it asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// `--nats-url` (or `LOOSELEAF_NATS_URL`) named it.
    Given,
    /// The `looseleaf up` of this data directory recorded it there.
    Recorded(PathBuf),
    /// Nothing named one and this data directory records none: the default URL.
    Default(PathBuf),
}

/// The NATS `looseleaf status` asks, and how it came to it.
#[derive(Debug)]
pub struct Target {
    pub nats: NatsOptions,
    pub found: Found,
    /// `--nats-connect-wait` was given: wait that long for NATS, as asked.
    pub wait_asked: bool,
}

impl Target {
    /// The NATS the flags name, else the one the `looseleaf up` of `data_dir`
    /// recorded, else the default URL. It is tried once unless `wait_asked`.
    pub fn find(nats: NatsOptions, nats_given: bool, wait_asked: bool, data_dir: &Path) -> Self {
        let wait_s = nats.connect_wait_s;
        let (mut nats, found) = if nats_given {
            (nats, Found::Given)
        } else {
            match crate::cluster::recorded_nats(data_dir) {
                Some(recorded) => (recorded, Found::Recorded(data_dir.to_path_buf())),
                None => (nats, Found::Default(data_dir.to_path_buf())),
            }
        };
        // 0: one try, no retries
        nats.connect_wait_s = if wait_asked { wait_s } else { 0 };
        Self { nats, found, wait_asked }
    }

    /// What a failed connect says: where it looked and how to point it at a cluster.
    fn nobody_there(&self) -> String {
        let url = self.nats.shown();
        let looked = match &self.found {
            Found::Given => format!("{url} (given by --nats-url or LOOSELEAF_NATS_URL)"),
            Found::Recorded(dir) => format!(
                "{url}, which the `looseleaf up` of {} recorded there (one that crashed leaves it behind)",
                dir.display()
            ),
            Found::Default(dir) => {
                format!("{url}, the default URL ({} records no running `looseleaf up`)", dir.display())
            }
        };
        format!(
            "found no LooseLeaf cluster: no NATS answered at {looked}. Point looseleaf status at one: \
             --data-dir DIR for the data directory of a `looseleaf up` on this machine, or --nats-url URL \
             (with --nats-creds or the other login flags) for a shared cluster's NATS"
        )
    }
}

/// Whether a failed connect found nobody there (refused, unreachable, timed out),
/// rather than a server that refused the login or the TLS.
fn nobody_answered(e: &BusError) -> bool {
    matches!(e, BusError::Connect { source, .. } if schemas::nats::nobody_answered(source))
}

/// Connect to the target's NATS: once, within [`CONNECT_TIMEOUT`], unless a wait
/// was asked for; a failure says where it looked.
async fn connect(target: &Target, prefix: &str) -> anyhow::Result<Bus> {
    let url = target.nats.shown();
    let connect = Bus::connect_with(&target.nats, prefix, "looseleaf-status");
    let res = if target.wait_asked {
        connect.await
    } else {
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(res) => res,
            Err(_) => {
                let late = anyhow::anyhow!("no answer from {url} within {CONNECT_TIMEOUT:?}");
                return Err(late.context(target.nobody_there()));
            }
        }
    };
    match res {
        Ok(bus) => Ok(bus),
        Err(e) if nobody_answered(&e) => Err(anyhow::Error::new(e).context(target.nobody_there())),
        Err(e) => Err(anyhow::Error::new(e).context(format!("while connecting to {url}"))),
    }
}

fn bytes(n: u64) -> String {
    const MIB: f64 = (1 << 20) as f64;
    format!("{:.1} MiB", n as f64 / MIB)
}

/// Human-readable lines for the hosts' latest statuses.
pub fn render_hosts(hosts: &BTreeMap<String, HostStatusV2>) -> String {
    let mut out = String::new();
    if hosts.is_empty() {
        out.push_str("no host status heard\n");
    }
    for h in hosts.values() {
        let busy = h.slots.iter().filter(|s| s.exec_id.is_some() || s.session.is_some()).count();
        let _ = writeln!(
            out,
            "{}: {} slots ({} busy, {} free, {}), {} workers ({} forked), {} zygotes, {} cpu sessions, cache {}",
            h.host,
            h.slots.len(),
            busy,
            h.slots.len() - busy,
            if h.real_gpus { "real GPUs" } else { "virtual" },
            h.workers.len(),
            h.forks,
            h.zygotes.len(),
            h.cpu_sessions.len(),
            bytes(h.cache_bytes),
        );
        for s in &h.slots {
            let state = match (&s.session, &s.held_for) {
                (Some(sid), why) => format!("busy session {sid} ({})", why.as_deref().unwrap_or("cell")),
                (None, _) if s.exec_id.is_some() => "busy".to_string(),
                _ => "free".to_string(),
            };
            let _ = writeln!(out, "  slot {} {} {}: {state}", s.index, s.name, bytes(s.memory_bytes));
        }
        for z in &h.zygotes {
            let _ = writeln!(out, "  zygote {} pid {}: {}", z.id, z.pid, z.packages.join(", "));
        }
        for sid in &h.cpu_sessions {
            let _ = writeln!(out, "  cpu session {sid}");
        }
        for w in &h.workers {
            let _ = writeln!(
                out,
                "  worker {} pid {} session {}: {:?} for {} ms",
                w.id, w.pid, w.session, w.state, w.for_ms
            );
        }
    }
    out
}

/// Listen for `wait` and print hosts and services.
pub async fn status(target: &Target, prefix: &str, wait: Duration) -> anyhow::Result<()> {
    let bus = connect(target, prefix).await?;
    let mut hosts_sub = bus.subscribe::<HostStatusV2>(bus.subjects().all_host_status()).await?;
    let client = bus.client().clone();
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.context("while subscribing for $SRV replies")?;
    client.publish_with_reply(SRV_PING, inbox, "".into()).await.context("while sending $SRV.PING")?;
    let mut hosts = BTreeMap::new();
    let mut services = Vec::new();
    let deadline = tokio::time::sleep(wait);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            () = &mut deadline => break,
            Some(item) = hosts_sub.next() => {
                if let Ok(env) = item {
                    hosts.insert(env.msg.host.clone(), env.msg);
                }
            }
            Some(msg) = replies.next() => {
                // an empty reply is the server's "no responders" status
                if msg.payload.is_empty() {
                    continue;
                }
                match serde_json::from_slice::<serde_json::Value>(&msg.payload) {
                    Ok(v) => services.push(v),
                    Err(e) => tracing::warn!(error = %e, "unreadable $SRV.PING reply"),
                }
            }
        }
    }
    print!("{}", render_hosts(&hosts));
    if services.is_empty() {
        println!("no services answered {SRV_PING}");
    }
    for s in services {
        let field = |k: &str| s.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_string();
        println!("service {} {} id {}", field("name"), field("version"), field("id"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::messages::{SlotStatus, WorkerState, WorkerStatus, ZygoteStatus};

    /// A URL nothing listens on: a port the OS gave and took back.
    fn dead_url() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        format!("nats://127.0.0.1:{port}")
    }

    #[test]
    fn the_target_says_where_it_looked_and_tries_once_unless_asked_to_wait() {
        let dir = tempfile::tempdir().unwrap();
        let flags = NatsOptions { connect_wait_s: 60, ..NatsOptions::url("nats://127.0.0.1:4222") };

        // nothing named, nothing recorded: the default URL, once
        let t = Target::find(flags.clone(), false, false, dir.path());
        assert_eq!(t.found, Found::Default(dir.path().to_path_buf()));
        assert_eq!(t.nats.connect_wait_s, 0);
        let said = t.nobody_there();
        let shown = dir.path().display().to_string();
        for part in ["nats://127.0.0.1:4222", "default URL", shown.as_str(), "--data-dir DIR", "--nats-url URL"] {
            assert!(said.contains(part), "{part:?} not in {said}");
        }

        // recorded by a `looseleaf up` of the data dir: that URL, naming the dir
        std::fs::write(dir.path().join("nats-url"), "nats://127.0.0.1:4999\n").unwrap();
        let t = Target::find(flags.clone(), false, false, dir.path());
        assert_eq!(t.found, Found::Recorded(dir.path().to_path_buf()));
        let said = t.nobody_there();
        assert!(said.contains("nats://127.0.0.1:4999") && said.contains(&shown), "{said}");

        // --nats-url wins over the record; --nats-connect-wait is kept as asked
        let given = NatsOptions { url: "nats://10.0.0.1:4222".into(), ..flags };
        let t = Target::find(given, true, true, dir.path());
        assert_eq!((t.found.clone(), t.nats.connect_wait_s), (Found::Given, 60));
        assert!(t.nobody_there().contains("nats://10.0.0.1:4222 (given by --nats-url"), "{}", t.nobody_there());
    }

    #[tokio::test]
    async fn no_cluster_fails_at_once_saying_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let url = dead_url();
        let t = Target::find(NatsOptions::url(&url), true, false, dir.path());
        let err = match connect(&t, "ll").await {
            Ok(_) => panic!("something answered at {url}"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            err.contains("found no LooseLeaf cluster") && err.contains(&url) && err.contains("--data-dir"),
            "{err}"
        );
    }

    #[test]
    fn renders_busy_and_free_slots() {
        let sid = uuid::Uuid::now_v7();
        let slot = |index, session| SlotStatus {
            index,
            name: "virtual".into(),
            memory_bytes: 0,
            exec_id: None,
            session,
            held_for: session.map(|_| "unsavable state".to_string()),
        };
        let h = HostStatusV2 {
            host: "host-0".into(),
            slots: vec![slot(0, Some(sid)), slot(1, None)],
            real_gpus: false,
            zygotes: vec![ZygoteStatus {
                id: "base".into(),
                packages: vec!["numpy".into()],
                cuda_unsafe: vec![],
                pid: 7,
            }],
            cpu_sessions: vec![sid],
            workers: vec![
                WorkerStatus { id: "w1".into(), pid: 11, session: sid, state: WorkerState::Kept, for_ms: 5 },
                WorkerStatus { id: "w2".into(), pid: 12, session: sid, state: WorkerState::Running, for_ms: 1 },
            ],
            cache_bytes: 3 << 20,
            forks: 5,
            unix_ms: 0,
        };
        let text = render_hosts(&BTreeMap::from([("host-0".to_string(), h)]));
        assert!(text.contains("2 slots (1 busy, 1 free, virtual)"), "{text}");
        assert!(text.contains(&format!("busy session {sid} (unsavable state)")), "{text}");
        assert!(text.contains("slot 1 virtual 0.0 MiB: free"), "{text}");
        assert!(text.contains("zygote base pid 7: numpy"), "{text}");
        assert!(text.contains("cache 3.0 MiB"), "{text}");
        assert!(text.contains("2 workers (5 forked)"), "{text}");
        assert!(text.contains(&format!("worker w2 pid 12 session {sid}: Running")), "{text}");
    }
}
