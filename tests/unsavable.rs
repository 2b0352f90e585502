//! Objects that cannot be saved never strand a session (ADR 51): a host with two
//! GPU slots, every cell serverless, and cells that each make an object that
//! cannot be saved (an event, a generator, an iterator) between ordinary cells.
//! Every later cell runs; a cell that reads objects two cells made finds them
//! together; and since none of them holds GPU memory, no slot stays held for them.

use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use looseleaf_test_support::cluster::{bin_dir_of, Services};
use looseleaf_test_support::wait_for;
use schemas::messages::HostStatusV2;

const CELLS: &[&str] = &[
    "import threading\nready = threading.Event()",
    "ticks = (i for i in range(5))\nnext(ticks)",
    "total = 40\ntotal + 2",
    "total += 1\ntotal",
    "total += 1\ntotal",
    "total += 1\ntotal",
    "ready.set()\nready.is_set(), next(ticks), total",
    "lines = iter(['a', 'b', 'c'])\nnext(lines)",
    "next(lines), next(ticks), total",
    "print('an ordinary cell', total * 2)",
];

fn notebook(cells: &[&str]) -> serde_json::Value {
    let cells: Vec<serde_json::Value> = cells
        .iter()
        .enumerate()
        .map(|(i, src)| {
            serde_json::json!({"cell_type": "code", "id": format!("c{i}"), "metadata": {},
                "execution_count": null, "outputs": [], "source": src})
        })
        .collect();
    serde_json::json!({"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
        "language": "python"}}, "nbformat": 4, "nbformat_minor": 5})
}

#[tokio::test(flavor = "multi_thread")]
async fn cells_with_unsavable_objects_never_strand_the_session() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let bin_dir = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let services = Services::start(&bin_dir, &[2], &[]).await?;
    let client = async_nats::connect(services.nats.url()).await?;
    let mut sub = client.subscribe(format!("{}.v1.host.*.status", services.prefix)).await?;
    let last = std::sync::Arc::new(std::sync::Mutex::new(None::<HostStatusV2>));
    let sink = last.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Ok(s) = schemas::codec::decode::<HostStatusV2>(m.headers.as_ref(), &m.payload) {
                *sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
            }
        }
    });

    let nb = dir.path().join("unsavable.ipynb");
    std::fs::write(&nb, serde_json::to_string(&notebook(CELLS))?)?;
    let (out, report_path) = (dir.path().join("out.ipynb"), dir.path().join("report.json"));
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["run", "--all-gpu", "--allow-errors"])
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
    let text = |i: usize| executed["cells"][i]["outputs"].to_string();
    for (i, c) in cells.iter().enumerate() {
        assert_eq!(c["status"], "ok", "cell {i}: {c} {}", text(i));
    }
    // objects two cells made are read together, each where it left off
    assert!(text(6).contains("(True, 1, 43)"), "{}", text(6));
    assert!(text(8).contains("('b', 2, 43)"), "{}", text(8));
    assert!(text(9).contains("an ordinary cell 86"), "{}", text(9));
    // after the first unsavable object, the session's cells ran where it lives
    let keeper = &cells[0]["worker"];
    for (i, c) in cells.iter().enumerate().skip(1) {
        assert_eq!(&c["worker"], keeper, "cell {i} ran in another worker: {c}");
    }
    // no slot is held for objects that hold no GPU memory
    wait_for(Duration::from_secs(10), || {
        let s = last.lock().unwrap_or_else(|e| e.into_inner());
        s.as_ref().is_some_and(|s| s.slots.len() == 2 && s.slots.iter().all(|slot| slot.held_for.is_none()))
    })
    .context("both slots free after the notebook, none held for unsavable state")?;
    drop(services);
    Ok(())
}
