//! Per-worker limits through cgroups on a real cluster: a cell that uses more
//! memory than a worker may is killed and fails naming the limit, a cell that
//! starts more processes than a worker may gets an error naming that limit, and
//! the session goes on from its committed state either way.

use looseleaf_client::api::ExecStatus;
use looseleaf_test_support::cluster::{bin_dir_of, Services};

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_past_its_memory_or_process_limit_fails_the_cell_naming_the_limit() -> anyhow::Result<()> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    if !cgroups.lines().any(|l| l.contains(":memory:") || l.starts_with("0::")) {
        eprintln!("skipped: no cgroup memory controller on this machine");
        return Ok(());
    }
    let env =
        [("LOOSELEAF_WORKER_MEMORY_BYTES", (600u64 << 20).to_string()), ("LOOSELEAF_WORKER_PIDS", "64".to_string())];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &env).await?;
    for all_gpu in [true, false] {
        let mut s = services.session(all_gpu).await?;
        assert_eq!(s.run("a", "x = 41").await?.0, ExecStatus::Ok);

        // 2 GB, touched: far past 600 MiB
        let (status, error, text) =
            s.run("b", "import numpy as np\nx = 0\nbig = np.ones(2 << 30, dtype=np.uint8)").await?;
        assert_eq!(status, ExecStatus::Failed, "{text}");
        let error = error.unwrap_or_default();
        assert!(error.contains("more memory than a worker may (600 MiB)"), "{error}");
        let (status, error, text) = s.run("c", "print(x + 1)").await?;
        assert_eq!(status, ExecStatus::Ok, "{error:?}");
        assert!(text.contains("42"), "the killed cell committed nothing: {text}");

        // (in a function: the processes are not variables, which would pin the worker)
        let fork_bomb = "import subprocess\ndef spawn():\n    kids = []\n    for _ in range(200):\n        \
                         kids.append(subprocess.Popen(['sleep', '30']))\nspawn()";
        let (status, error, text) = s.run("d", fork_bomb).await?;
        assert_eq!(status, ExecStatus::Error, "{text}");
        let error = error.unwrap_or_default();
        assert!(error.contains("limit of 64 processes"), "{error}");
        let (status, error, text) = s.run("e", "print('still here', x)").await?;
        assert_eq!(status, ExecStatus::Ok, "{error:?}");
        assert!(text.contains("still here 41"), "{text}");
    }
    Ok(())
}

/// Chunk files the store holds (a directory store: every object but manifests).
fn stored_chunks(store: &std::path::Path) -> usize {
    fn walk(dir: &std::path::Path, n: &mut usize) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, n);
            } else if path.to_string_lossy().contains("chunks") {
                *n += 1;
            }
        }
    }
    let mut n = 0;
    walk(store, &mut n);
    n
}

/// A save that would take the session over its quota is refused before any of
/// its bytes are uploaded, naming the quota; the session keeps its state.
#[tokio::test(flavor = "multi_thread")]
async fn a_save_over_the_sessions_quota_is_refused_before_upload() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let quota = (4u64 << 20).to_string();
    let services = Services::start(&bin, &[1], &[("LOOSELEAF_SESSION_QUOTA_BYTES", quota)]).await?;
    let mut s = services.session(true).await?;
    assert_eq!(s.run("a", "small = list(range(1000))").await?.0, ExecStatus::Ok);
    let store = services.data_dir().join("store");
    let before = stored_chunks(&store);
    assert!(before > 0, "the first save stored chunks in {}", store.display());

    let (status, error, _) = s.run("b", "import os\nbig = os.urandom(16 << 20)").await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("quota"), "the error names the quota: {error}");
    assert_eq!(stored_chunks(&store), before, "nothing of the refused save was uploaded");

    let (status, _, text) = s.run("c", "print(len(small), 'big' in dir())").await?;
    assert_eq!(status, ExecStatus::Ok);
    assert!(text.contains("1000 False"), "{text}");
    Ok(())
}
