//! Hosts compete for recipes (DESIGN.md section 5, issue 5): three gpu-hosts receive
//! every one of 1,000 run recipes; each recipe is prepared exactly once, counted as
//! real forks on the hosts (their status) and as distinct workers in the events.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use looseleaf_test_support::cluster::{bin_dir_of, Services};
use schemas::messages::{
    Device, EventKind, HostStatusV1, RecipeKind, RecipeV1, SessionEventV1, SessionOptions,
};
use schemas::Bus;
use uuid::Uuid;

const RECIPES: usize = 1000;

fn recipe(cwd: &str) -> RecipeV1 {
    let session = Uuid::now_v7();
    RecipeV1 {
        session,
        cell_id: "c".into(),
        kind: RecipeKind::Run,
        exec_id: Uuid::now_v7(),
        revision: 1,
        code: "x = 1".into(),
        code_hash: 1,
        closure: vec![],
        imports: vec![],
        device: Device::Gpu,
        device_reason: "test".into(),
        conservative: None,
        pinned: None,
        manifest_revision: 0,
        run_unix_ms: schemas::unix_ms(),
        options: SessionOptions { cwd: cwd.into(), all_gpu: true, speculate: false },
        prepared: None,
        speculate: false,
    }
}

#[derive(Default)]
struct Seen {
    claimed: Vec<String>,
    workers: Vec<String>,
    saved: u32,
    failed: Vec<String>,
}

#[actix_rt::test]
async fn three_hosts_prepare_each_of_a_thousand_recipes_exactly_once() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[2, 2, 2], &[]).await?;
    let bus = Bus::connect(services.nats.url(), &services.prefix, "competition-test").await?;
    let mut events = bus.subscribe::<SessionEventV1>(bus.subjects().all_events()).await?;
    let mut statuses = bus.subscribe::<HostStatusV1>(bus.subjects().all_host_status()).await?;
    bus.flush().await?;
    let cwd = tempfile::tempdir()?;
    let recipes: Vec<RecipeV1> = (0..RECIPES).map(|_| recipe(&cwd.path().display().to_string())).collect();
    let base_forks = latest_forks(&mut statuses, Duration::from_secs(5)).await;
    for r in &recipes {
        bus.publish(bus.subjects().recipe(r.session), r).await?;
    }

    let mut seen: HashMap<Uuid, Seen> = HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(900);
    let mut finished = 0;
    while finished < RECIPES {
        let Ok(Some(ev)) = tokio::time::timeout_at(deadline, events.next()).await else {
            anyhow::bail!("only {finished} of {RECIPES} executions finished");
        };
        let Ok(ev) = ev else { continue };
        let s = seen.entry(ev.msg.exec_id).or_default();
        match ev.msg.kind {
            EventKind::Claimed { host, .. } => s.claimed.push(host),
            EventKind::Started { worker, .. } => s.workers.push(worker),
            EventKind::Saved { .. } => {
                s.saved += 1;
                finished += 1;
            }
            EventKind::Failed { error } => {
                s.failed.push(error);
                finished += 1;
            }
            _ => {}
        }
    }
    let mut per_host: BTreeMap<String, usize> = BTreeMap::new();
    let mut workers = BTreeSet::new();
    for r in &recipes {
        let s = seen.get(&r.exec_id).ok_or_else(|| anyhow::anyhow!("no events for {}", r.exec_id))?;
        assert!(s.failed.is_empty(), "{}: {:?}", r.exec_id, s.failed);
        assert_eq!(s.claimed.len(), 1, "{} claimed by {:?}", r.exec_id, s.claimed);
        assert_eq!((s.workers.len(), s.saved), (1, 1), "{}", r.exec_id);
        *per_host.entry(s.claimed[0].clone()).or_default() += 1;
        workers.insert(s.workers[0].clone());
    }
    assert_eq!(workers.len(), RECIPES, "one distinct worker per recipe");
    assert_eq!(per_host.len(), 3, "every host won some: {per_host:?}");

    // the hosts' own fork counters: exactly one fork per recipe, none wasted
    let mut forks: BTreeMap<String, u64> = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while forks.values().sum::<u64>() < base_forks + RECIPES as u64 || forks.len() < 3 {
        let Ok(Some(Ok(st))) = tokio::time::timeout_at(deadline, statuses.next()).await else { break };
        forks.insert(st.msg.host.clone(), st.msg.forks);
    }
    assert_eq!(forks.values().sum::<u64>(), base_forks + RECIPES as u64, "forks per host {forks:?}, per host wins {per_host:?}");
    Ok(())
}

/// Forks the hosts report before the test's recipes (0 on fresh hosts).
async fn latest_forks(statuses: &mut schemas::bus::Subscription<HostStatusV1>, wait: Duration) -> u64 {
    let mut forks: BTreeMap<String, u64> = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + wait;
    while forks.len() < 3 {
        match tokio::time::timeout_at(deadline, statuses.next()).await {
            Ok(Some(Ok(st))) => {
                forks.insert(st.msg.host.clone(), st.msg.forks);
            }
            _ => break,
        }
    }
    forks.values().sum()
}
