//! `looseleaf status`: what the hosts report and which services answer `$SRV.PING`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use schemas::messages::HostStatusV2;
use schemas::nats::NatsOptions;
use schemas::Bus;

/// The NATS service API's discovery subject (NATS protocol, not a LooseLeaf subject).
const SRV_PING: &str = "$SRV.PING";

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
pub async fn status(nats: &NatsOptions, prefix: &str, wait: Duration) -> anyhow::Result<()> {
    let bus = Bus::connect_with(nats, prefix, "looseleaf-status").await?;
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
