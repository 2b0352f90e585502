//! Large state on a real cluster (issue 11 item 6, ADR 30): a session of 50,000
//! variables, the corpus's bigstate notebook, a 256 MiB array and a cell of
//! several MiB all run and keep their state, and no message on the bus is larger
//! than 512 KiB meanwhile. A watcher subscribed to every subject measures each
//! message (payload and headers), JetStream's own traffic included; the test's
//! nats-server also refuses anything larger (`max_payload`), so a message over
//! the limit would fail its cell as well.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use looseleaf_client::api::ExecStatus;
use looseleaf_test_support::cluster::{bin_dir_of, Services, TestSession};
use looseleaf_test_support::repo_root;
use schemas::bodies::BUS_MESSAGE_MAX_BYTES;

/// The largest message seen on every subject, and its subject.
#[derive(Default)]
struct Largest {
    bytes: AtomicUsize,
    subject: Mutex<String>,
}

async fn watch_every_message(url: &str) -> anyhow::Result<Arc<Largest>> {
    let client = async_nats::connect(url).await?;
    let mut all = client.subscribe(">").await?;
    client.flush().await?;
    let largest = Arc::new(Largest::default());
    let seen = largest.clone();
    tokio::spawn(async move {
        let _client = client;
        while let Some(m) = all.next().await {
            let headers: usize = m
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .map(|(k, vs)| vs.iter().map(|v| k.to_string().len() + v.as_str().len() + 4).sum::<usize>())
                .sum();
            let bytes = m.payload.len() + headers;
            if seen.bytes.fetch_max(bytes, Ordering::Relaxed) < bytes {
                if let Ok(mut s) = seen.subject.lock() {
                    *s = m.subject.to_string();
                }
            }
        }
    });
    Ok(largest)
}

async fn ok(s: &mut TestSession, cell: &str, code: &str) -> anyhow::Result<String> {
    let (status, error, text) = s.run(cell, code).await?;
    anyhow::ensure!(status == ExecStatus::Ok, "cell {cell} ended {status:?}: {error:?}\n{text}");
    Ok(text)
}

/// The code cells of a notebook, in order.
fn code_cells(notebook: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let nb: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(notebook)?)?;
    let cells = nb["cells"].as_array().ok_or_else(|| anyhow::anyhow!("{}: no cells", notebook.display()))?;
    Ok(cells
        .iter()
        .filter(|c| c["cell_type"] == "code")
        .map(|c| match &c["source"] {
            serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect(),
            other => other.as_str().unwrap_or_default().to_string(),
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn no_bus_message_exceeds_512_kib_whatever_the_session_holds() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    let largest = watch_every_message(services.nats.url()).await?;

    // 50,000 variables, made dynamically, then all read (a conservative closure),
    // then one changed: manifests, deltas, recipes and planner state of 50,000 names
    let mut s = services.session(true).await?;
    ok(&mut s, "a", "for i in range(50_000):\n    globals()[f'v{i}'] = i").await?;
    let text = ok(&mut s, "b", "print(sum(globals()[f'v{i}'] for i in range(50_000)))").await?;
    assert!(text.contains("1249975000"), "{text}");
    ok(&mut s, "c", "v49999 = -1").await?;
    let text = ok(&mut s, "d", "print(v0 + v49999, len([n for n in globals() if n.startswith('v')]))").await?;
    assert!(text.contains("-1 50000"), "{text}");

    // a cell of 3 MiB of source, and a 256 MiB array saved and restored
    let big_cell = format!("s = '{}'\nprint(len(s))", "y".repeat(3 << 20));
    assert!(ok(&mut s, "e", &big_cell).await?.contains(&(3usize << 20).to_string()));
    ok(&mut s, "f", "import numpy as np\nbig = np.arange(32 << 20, dtype=np.int64)").await?;
    let text = ok(&mut s, "g", "print(int(big[-1]), big.nbytes, len(s))").await?;
    assert!(text.contains(&format!("{} {} {}", (32u64 << 20) - 1, 256u64 << 20, 3usize << 20)), "{text}");

    // the corpus's bigstate notebook, every cell serverless
    let notebook = repo_root().join("../shared/corpus/fidelity/bigstate/large_state.ipynb");
    let mut nb = services.session(true).await?;
    for (i, code) in code_cells(&notebook)?.iter().enumerate() {
        ok(&mut nb, &format!("bigstate-{i}"), code).await?;
    }

    let (bytes, subject) = (largest.bytes.load(Ordering::Relaxed), largest.subject.lock().map(|s| s.clone()));
    assert!(bytes > 100 << 10, "the watcher saw no large message ({bytes} bytes): it measured nothing");
    assert!(bytes <= BUS_MESSAGE_MAX_BYTES, "a message of {bytes} bytes on {subject:?}");
    eprintln!("largest bus message: {bytes} bytes on {subject:?}");
    Ok(())
}
