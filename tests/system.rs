//! Whole-system test: the four services as separate processes (store, planner,
//! frontend, two gpu-hosts with one virtual GPU slot each) on a real nats-server,
//! driven by `looseleaf run --frontend` like any client.
//!
//! It checks that GPU cells ran on the hosts' slots, that each slot was released
//! after its save (on the hosts' status subjects, not only in the report), that CPU
//! cells ran on the session's persistent CPU worker, that aliases keep sharing across
//! GPU cells, that an unsavable generator stays in its worker and keeps its values,
//! that an error in a cell does not end the session, and that a name a closure
//! missed (read through eval) is brought in while the cell runs.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use looseleaf_test_support::cluster::{bin_dir_of, Services};
use looseleaf_test_support::{repo_root, wait_for, S3Server};
use schemas::messages::HostStatusV2;

#[tokio::test(flavor = "multi_thread")]
async fn four_services_two_hosts() -> anyhow::Result<()> {
    four_services_two_hosts_on(vec![]).await
}

/// The same notebook with checkpoints in S3 (a local moto server): the store
/// gateway and both hosts use the bucket directly.
#[tokio::test(flavor = "multi_thread")]
async fn four_services_two_hosts_on_s3() -> anyhow::Result<()> {
    let s3 = S3Server::start().context("S3 server")?;
    let mut env = s3.env();
    env.push(("LOOSELEAF_STORE_URL", s3.url()));
    four_services_two_hosts_on(env).await
}

async fn four_services_two_hosts_on(store_env: Vec<(&'static str, String)>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut env = store_env;
    // both hosts share the package-layer directory, as hosts of one cluster must
    env.push(("LOOSELEAF_PACKAGE_LAYERS", dir.path().join("packages").display().to_string()));
    let bin_dir = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    // returns once both hosts reported their base zygote
    let services = Services::start(&bin_dir, &[1, 1], &env).await?;

    // Watch host status from before the first cell.
    let client = async_nats::connect(services.nats.url()).await?;
    let mut sub = client.subscribe(format!("{}.v1.host.*.status", services.prefix)).await?;
    let collected = std::sync::Arc::new(std::sync::Mutex::new(Vec::<HostStatusV2>::new()));
    let sink = collected.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Ok(s) = schemas::codec::decode::<HostStatusV2>(m.headers.as_ref(), &m.payload) {
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(s);
            }
        }
    });

    let nb = repo_root().join("tests/notebooks/system.ipynb");
    let out = dir.path().join("out.ipynb");
    let report_path = dir.path().join("report.json");
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["run", "--allow-errors"])
        .arg(&nb)
        .arg("--output")
        .arg(&out)
        .arg("--report")
        .arg(&report_path)
        .args(["--frontend", &services.frontend])
        .status()
        .await?;
    assert!(status.success(), "looseleaf run failed");

    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report_path)?)?;
    let cells = report["cells"].as_array().context("report without cells")?;
    let executed: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    let code: Vec<&serde_json::Value> = executed["cells"]
        .as_array()
        .context("notebook without cells")?
        .iter()
        .filter(|c| c["cell_type"] == "code")
        .collect();
    let text = |i: usize| -> String { code[i]["outputs"].to_string() };

    // CPU cells on the persistent CPU worker; GPU cells on fresh or pinned workers.
    for (i, c) in cells.iter().enumerate() {
        let is_gpu = i != 0 && i != 6 && i != 21;
        if c["status"] == "failed" && (10..=13).contains(&i) {
            continue; // failed before a worker started: no device recorded
        }
        assert_eq!(c["device"], if is_gpu { "gpu" } else { "cpu" }, "cell {i}: {c}");
        if !is_gpu {
            assert_eq!(c["prepare"], "persistent", "cell {i}");
        }
    }
    assert_eq!(cells[0]["worker"], cells[6]["worker"], "one CPU worker for the session");
    // aliases survive: b.append on one worker is seen through a and d['k'] on another
    assert!(text(2).contains("[1, 2, 3] True True"), "{}", text(2));
    assert!(text(7).contains("[1, 2, 3, 4] True [1, 2, 3, 4] 30"), "{}", text(7));
    // the generator stayed in its worker and kept its position
    assert!(text(3).contains('0'));
    assert!(text(5).contains("1 4"), "{}", text(5));
    assert_eq!(cells[5]["prepare"], "pinned");
    assert_eq!(cells[5]["worker"], cells[3]["worker"]);
    assert!(text(9).contains("after the error 9"), "{}", text(9));
    // the error is reported like IPython's and the session goes on
    assert_eq!(cells[8]["status"], "error");
    assert!(text(8).contains("ZeroDivisionError"));
    assert_eq!(cells[9]["status"], "ok");
    // the worker holding the generator dies mid-cell: that cell fails clearly, a later
    // cell needing the generator fails naming it and the cell that defined it, and
    // the session goes on
    assert_eq!(cells[10]["status"], "failed");
    assert!(cells[10]["error"].as_str().unwrap_or("").contains("lost"), "{}", cells[10]);
    assert_eq!(cells[11]["status"], "failed");
    let err = cells[11]["error"].as_str().unwrap_or("");
    assert!(err.contains("'g'") && err.contains("c3"), "{err}");
    assert_eq!(cells[12]["status"], "ok");
    assert!(text(12).contains("still going [1, 2, 3, 4]"), "{}", text(12));
    // a worker killed in the middle of its save: the cell fails, the last committed
    // revision is intact (a is without the 5 the dead cell appended), the next cell runs
    assert!(text(13).contains("ran"), "{}", text(13));
    assert_eq!(cells[13]["status"], "failed");
    assert!(cells[13]["error"].as_str().unwrap_or("").contains("saving"), "{}", cells[13]);
    assert_eq!(cells[14]["status"], "ok");
    assert!(text(14).contains("after the crash [1, 2, 3, 4]"), "{}", text(14));
    // a 160 MB array is saved in several files (uploaded as each is written) and a
    // fresh worker restores it intact
    assert_eq!(cells[15]["status"], "ok", "{}", cells[15]);
    assert!(cells[15]["saved_bytes"].as_u64().unwrap_or(0) >= 160_000_000, "{}", cells[15]);
    assert!(text(16).contains("big restored True (20000000,)"), "{}", text(16));
    // names reached through eval of computed strings, which no closure holds, are
    // brought in from the committed state while the cell runs (each in its own
    // restore file), shared as restored (look('d')['k'] is a), and the report
    // names them
    assert!(text(18).contains("looked up [7, 8] True 9"), "{}", text(18));
    assert_eq!(cells[18]["faulted"], serde_json::json!(["w", "v"]), "{}", cells[18]);
    // a package installed from a cell is there for the session's later cells, on
    // either host and on its CPU worker (the hosts share the package-layer directory)
    assert_eq!(cells[19]["status"], "ok", "{}", text(19));
    assert!(text(20).contains("from the layer 42"), "{}", text(20));
    assert!(text(21).contains("on the CPU worker 42"), "{}", text(21));
    // the hosts' environment holds the store's settings (and, on S3, its keys): a
    // cell sees none of them
    assert!(text(22).contains("secrets []"), "{}", text(22));

    // From the generator's cell until its worker died, GPU cells ran where it lives
    // (one home for unsavable state, ADR 51), on its host's slot, lent per cell.
    for i in [4, 5, 7, 8, 9] {
        assert_eq!(cells[i]["worker"], cells[3]["worker"], "cell {i}: {}", cells[i]);
    }
    let gpu_hosts: BTreeSet<&str> =
        cells.iter().filter(|c| c["device"] == "gpu").filter_map(|c| c["host"].as_str()).collect();
    assert!(!gpu_hosts.is_empty(), "GPU cells ran on {gpu_hosts:?}");

    // On the status subjects: every execution seen holding a slot was later seen
    // with that slot free, on every host that ran one (the generator holds no GPU
    // memory, so no slot stays held for it).
    wait_for(Duration::from_secs(10), || {
        let all = collected.lock().unwrap_or_else(|e| e.into_inner());
        let mut busy: BTreeMap<(String, u32), bool> = BTreeMap::new();
        for s in all.iter() {
            for slot in &s.slots {
                let key = (s.host.clone(), slot.index);
                let held = slot.held_for.as_deref() == Some("cell");
                if held {
                    busy.insert(key, true);
                } else if slot.exec_id.is_none() {
                    busy.entry(key).and_modify(|b| *b = false);
                }
            }
        }
        busy.len() == gpu_hosts.len() && busy.values().all(|b| !b)
    })
    .context("the slots that ran cells were released after them")?;
    drop(services);
    Ok(())
}
