//! The user's local cluster (ADR 65; the Team issue's item 1, and the
//! Lossless-sessions issue's resume after the cluster died): kernels without
//! `--frontend` share one cluster per user per machine, started in the background
//! by the first; a restart is a new session on it; a cluster killed under a kernel
//! is started again by the kernel's next cell, which keeps its variables; a new
//! kernel on a notebook whose kernel and cluster both died resumes it from the
//! same data folder; the cluster stops by itself when no session is attached.

use looseleaf_test_support::local_cluster::UserDirs;
use looseleaf_test_support::repo_root;

#[test]
fn notebooks_on_one_machine_share_one_local_cluster_and_survive_its_death() -> anyhow::Result<()> {
    let dirs = UserDirs::new()?;
    crate::kernel::install_as(dirs.path(), &["--name", "looseleaf-local"])?;
    let work = tempfile::tempdir()?;
    let out = crate::kernel::python(dirs.path())
        .arg(repo_root().join("tests/support/local_cluster_probe.py"))
        .arg("looseleaf-local")
        .arg(dirs.runtime_dir())
        .arg(dirs.user_dir())
        .current_dir(work.path())
        .env("LOOSELEAF_IDLE_EXIT_S", "5")
        .env("LOOSELEAF_LOG", std::env::var("LOOSELEAF_TEST_LOG").unwrap_or_else(|_| "warn".into()))
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = std::fs::read_to_string(dirs.user_dir().join("cluster/cluster.log")).unwrap_or_default();
    anyhow::ensure!(out.status.success(), "local_cluster_probe.py failed:\n{stderr}\n--- the cluster's log ---\n{log}");
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())
        .map_err(|e| anyhow::anyhow!("the probe printed no JSON ({e}):\n{stderr}"))?;

    // ten notebooks, one cluster, each cell on it
    assert_eq!(seen["clusters_with_ten"], 1, "{seen}");
    let ran = seen["ten_ran"].as_array().cloned().unwrap_or_default();
    assert_eq!(ran.len(), 10, "{seen}");
    for (i, r) in ran.iter().enumerate() {
        assert_eq!(r[0], "ok", "kernel {i}: {seen}");
        assert_eq!(r[1], (i * 2).to_string(), "kernel {i} ran in another's session: {seen}");
    }
    // a restart is a fresh session, not a new cluster
    assert_eq!(seen["after_restart"][0], "ok", "{seen}");
    assert_eq!(seen["after_restart"][1], "False\n", "the restart kept the state: {seen}");
    assert_eq!(seen["address_after_restart"], seen["first_address"], "{seen}");
    // the cluster killed: the kernel's next cell starts it again, with its state
    let (first, second) = (&seen["first_address"]["pid"], &seen["second_address"]["pid"]);
    assert!(second.is_u64() && first != second, "no new cluster: {seen}");
    assert_eq!(seen["after_cluster_killed"][0], "ok", "{seen}");
    let text = seen["after_cluster_killed"][1].as_str().unwrap_or_default();
    assert!(text.contains("started again") && text.ends_with("6\n"), "{seen}");
    // kernel and cluster killed: a new kernel on the notebook resumes from the data folder
    assert_ne!(seen["third_address"]["pid"], *second, "{seen}");
    assert_eq!(seen["after_both_killed"][0], "ok", "{seen}");
    let text = seen["after_both_killed"][1].as_str().unwrap_or_default();
    assert!(text.starts_with("LooseLeaf: resumed") && text.ends_with("6\n"), "{seen}");
    // no session attached: it stopped by itself, and said so where kernels look
    assert_eq!(seen["clusters_after_idle"], 0, "the idle cluster runs on: {seen}");
    assert!(seen["address_after_idle"].is_null(), "{seen}");
    Ok(())
}
