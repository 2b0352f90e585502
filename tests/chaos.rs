//! Faults against a whole cluster (the Reliability and security issue, item 6).
//!
//! Sessions replay a notebook through `looseleaf run --retries` (a cell the
//! platform failed is run again, as a user would) on a cluster whose store is S3
//! (moto), while a schedule injects faults: workers killed, a gpu-host killed
//! mid-cell or stopped, the store gateway, the planner and the frontend killed and
//! restarted or left stopped for seconds, nats-server restarted, the S3 server
//! stopped for a while. Then:
//! - every run's outcome is checked against what the store committed: a run
//!   reported `ok` or `error` must have committed (a manifest names it), one
//!   reported `failed` must not have, and every run has an outcome (`runs_lost`);
//! - every session's notebook must print exactly what a kernel prints. The notebook
//!   is not idempotent (each cell appends to a list): a run that committed though
//!   it was reported failed, then ran again, shows (`sessions_diverged`).
//!
//! `chaos_smoke` (CI) runs one session through each fault once; `bench_chaos`
//! (`bench/chaos`) runs several sessions through a longer schedule and a load of
//! sessions without faults, then fills a small tmpfs store and deletes the
//! session that filled it, and writes bench/results/chaos.json.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::TryStreamExt;
use looseleaf_test_support::cluster::{bin_dir_of, Services};
use looseleaf_test_support::{repo_root, S3Server};
use nix::sys::signal::Signal;
use uuid::Uuid;

/// One fault of the schedule.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL every worker (and zygote child) of host 0.
    Workers,
    /// SIGKILL host 0, start it again after 2 s.
    HostKilled,
    /// SIGTERM host 1 (it fails its cells and exits), start it again.
    HostStopped,
    /// SIGKILL the store gateway, start it again after 1 s.
    Store,
    /// SIGKILL the store gateway and leave it down this long: runs accepted
    /// meanwhile fail (within seconds: `store_down_fail_s`) and are run again.
    StoreStopped(Duration),
    /// SIGKILL the planner, start it again after 1 s.
    Planner,
    /// SIGKILL the frontend, start it again after 1 s.
    Frontend,
    /// Restart nats-server (same port, same JetStream store).
    Nats,
    /// Stop the S3 server for this long.
    S3Paused(Duration),
}

impl Fault {
    fn name(&self) -> &'static str {
        match self {
            Fault::Workers => "workers",
            Fault::HostKilled => "host_killed",
            Fault::HostStopped => "host_stopped",
            Fault::Store => "store",
            Fault::StoreStopped(_) => "store_stopped",
            Fault::Planner => "planner",
            Fault::Frontend => "frontend",
            Fault::Nats => "nats",
            Fault::S3Paused(_) => "s3_paused",
        }
    }
}

/// A cluster with an S3 store, test-sized deadlines, and the faults it can suffer.
struct Cluster {
    services: Services,
    s3: S3Server,
}

impl Cluster {
    async fn start(host_slots: &[u32]) -> anyhow::Result<Self> {
        let s3 = S3Server::start()?;
        let mut env: Vec<(&str, String)> = s3.env();
        env.push(("LOOSELEAF_STORE_URL", s3.url()));
        // a lost host is noticed in 3 s, a run nobody took fails in 15 s
        env.push(("LOOSELEAF_HOST_LOST_S", "3".into()));
        env.push(("LOOSELEAF_CLAIM_TIMEOUT_S", "15".into()));
        if let Ok(log) = std::env::var("LOOSELEAF_CHAOS_LOG") {
            env.push(("LOOSELEAF_LOG", log));
        }
        let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), host_slots, &env).await?;
        Ok(Self { services, s3 })
    }

    /// Inject `fault`; returns once what it stopped runs again.
    async fn inject(&mut self, fault: Fault) -> anyhow::Result<()> {
        let s = &mut self.services;
        let pause = |secs: f64| tokio::time::sleep(Duration::from_secs_f64(secs));
        match fault {
            Fault::Workers => {
                s.kill_workers(0)?;
            }
            Fault::HostKilled => {
                s.kill("host-0")?;
                pause(2.0).await;
                s.restart("host-0")?;
            }
            Fault::HostStopped => {
                s.signal("host-1", Signal::SIGTERM)?;
                tokio::task::block_in_place(|| s.wait_host(1))?;
                s.restart("host-1")?;
            }
            Fault::Store => {
                s.kill("looseleaf-store")?;
                pause(1.0).await;
                s.restart("looseleaf-store")?;
            }
            Fault::StoreStopped(d) => {
                s.kill("looseleaf-store")?;
                tokio::time::sleep(d).await;
                s.restart("looseleaf-store")?;
            }
            Fault::Planner => {
                s.kill("looseleaf-planner")?;
                pause(1.0).await;
                s.restart("looseleaf-planner")?;
            }
            Fault::Frontend => {
                s.kill("looseleaf-frontend")?;
                pause(1.0).await;
                s.restart("looseleaf-frontend")?;
            }
            Fault::Nats => tokio::task::block_in_place(|| s.nats.restart())?,
            Fault::S3Paused(d) => {
                self.s3.pause(true)?;
                tokio::time::sleep(d).await;
                self.s3.pause(false)?;
            }
        }
        Ok(())
    }

    /// The executions the store committed for `session` (each manifest names one).
    async fn committed(&self, session: Uuid) -> anyhow::Result<HashSet<Uuid>> {
        let settings = self.s3.settings();
        let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let objects = schemas::objects::open_with(&self.s3.url(), &settings)?;
        let dir = object_store::path::Path::from(schemas::checkpoint::manifests_dir(session));
        let metas: Vec<_> = objects.list(Some(&dir)).try_collect().await?;
        let mut execs = HashSet::new();
        for meta in metas {
            let bytes = objects.get(&meta.location).await?.bytes().await?;
            let manifest: serde_json::Value = serde_json::from_slice(&bytes)?;
            let exec = manifest["exec_id"].as_str().context("a manifest without exec_id")?;
            execs.insert(Uuid::parse_str(exec)?);
        }
        Ok(execs)
    }
}

/// A notebook of `cells` code cells that is not idempotent: each cell after the
/// first appends to a list and adds to an array (state the next cell restores),
/// sleeps `sleep_s` (so faults land mid-cell) and prints what it sees.
fn notebook(cells: usize, sleep_s: f64) -> serde_json::Value {
    let mut code = vec!["import numpy as np\nacc = []\narr = np.zeros(1000)".to_string()];
    for k in 1..cells {
        code.push(format!(
            "import time\nacc.append({k})\narr += 1\ntime.sleep({sleep_s})\nprint('cell', {k}, len(acc), int(arr[0]), acc[-1])"
        ));
    }
    let cells: Vec<serde_json::Value> = code
        .iter()
        .enumerate()
        .map(|(i, src)| {
            serde_json::json!({"cell_type": "code", "id": format!("c{i}"), "metadata": {}, "execution_count": null,
                               "outputs": [], "source": src})
        })
        .collect();
    serde_json::json!({"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                       "language": "python"}}, "nbformat": 4, "nbformat_minor": 5})
}

/// What a kernel prints for code cell `k` of [`notebook`].
fn expected_output(k: usize) -> String {
    if k == 0 {
        String::new()
    } else {
        format!("cell {k} {k} {k} {k}\n")
    }
}

/// One session's replay: its report and executed notebook.
struct Replay {
    report: serde_json::Value,
    executed: serde_json::Value,
    exit_ok: bool,
}

/// Replay `nb` as one session through `looseleaf run`, typing each cell.
async fn replay(frontend: &str, dir: &Path, name: &str, nb: &serde_json::Value) -> anyhow::Result<Replay> {
    let source = dir.join(format!("{name}.ipynb"));
    std::fs::write(&source, serde_json::to_vec(nb)?)?;
    let (output, report) = (dir.join(format!("{name}.out.ipynb")), dir.join(format!("{name}.report.json")));
    let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .arg("run")
        .arg(&source)
        .args(["--frontend", frontend, "--all-gpu", "--allow-errors", "--keep-session", "--retries", "8"])
        .args(["--typing-cps", "300", "--output"])
        .arg(&output)
        .arg("--report")
        .arg(&report)
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .status()
        .await?;
    let read = |p: &Path| -> serde_json::Value {
        std::fs::read(p).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or(serde_json::Value::Null)
    };
    Ok(Replay { report: read(&report), executed: read(&output), exit_ok: status.success() })
}

/// Start `n` replays of `nb` at once, named `{name}0`, `{name}1`, ….
fn start_replays(
    cluster: &Cluster,
    work: &Path,
    name: &str,
    n: usize,
    nb: &serde_json::Value,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<Replay>>> {
    (0..n)
        .map(|i| {
            let (frontend, work, nb) = (cluster.services.frontend.clone(), work.to_path_buf(), nb.clone());
            let name = format!("{name}{i}");
            tokio::spawn(async move { replay(&frontend, &work, &name, &nb).await })
        })
        .collect()
}

/// The text a code cell of an executed notebook printed.
fn printed(executed: &serde_json::Value, k: usize) -> String {
    let code: Vec<&serde_json::Value> = executed["cells"]
        .as_array()
        .map(|c| c.iter().filter(|c| c["cell_type"] == "code").collect())
        .unwrap_or_default();
    let Some(cell) = code.get(k) else { return "<cell missing>".into() };
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::Array(parts) => parts.iter().filter_map(|p| p.as_str()).collect::<String>(),
        other => other.as_str().unwrap_or_default().to_string(),
    };
    cell["outputs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| if o["output_type"] == "stream" { text(&o["text"]) } else { format!("<{}>", o["output_type"]) })
        .collect()
}

/// What the checks found.
#[derive(Debug, Default)]
struct Verdict {
    runs: usize,
    runs_failed: usize,
    runs_lost: Vec<String>,
    sessions_diverged: Vec<String>,
    /// Seconds from each fault to the next successful run of a session that had a
    /// cell in flight when it struck.
    recoveries_s: Vec<f64>,
    /// Seconds from acceptance to the failed outcome of each run accepted while
    /// the store was stopped, or failed because nothing answered for it.
    store_down_fail_s: Vec<f64>,
    /// The error of each store-down failure slower than 3 s (where the time went).
    store_down_slow: Vec<String>,
}

async fn check(
    cluster: &Cluster,
    name: &str,
    cells: usize,
    r: &Replay,
    faults: &[(u64, &'static str)],
    store_down: &[(u64, u64)],
    v: &mut Verdict,
) -> anyhow::Result<()> {
    let rows = r.report["cells"].as_array().cloned().unwrap_or_default();
    let sid = r.report["session_id"].as_str().and_then(|s| Uuid::parse_str(s).ok());
    let committed = match sid {
        Some(sid) => cluster.committed(sid).await?,
        None => HashSet::new(),
    };
    let mut done_ok: Vec<u64> = Vec::new();
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for row in &rows {
        v.runs += 1;
        let exec = row["exec_id"].as_str().and_then(|s| Uuid::parse_str(s).ok()).unwrap_or_default();
        let status = row["status"].as_str().unwrap_or("?");
        let error = row["error"].as_str().unwrap_or_default();
        let did_commit = committed.contains(&exec);
        let lost = match status {
            "ok" | "error" => !did_commit,
            "failed" => did_commit || error.contains("never completed"),
            _ => true,
        };
        if status == "failed" {
            v.runs_failed += 1;
            if let (Some(run), Some(done)) = (row["run_unix_ms"].as_u64(), row["done_unix_ms"].as_u64()) {
                // failed because the stopped store answered nothing (accepted while it
                // was down, or in flight when it went)
                let store_absent = error.contains(".v1.store.") && error.contains("nothing answers");
                if store_absent || store_down.iter().any(|(from, to)| (*from..=*to).contains(&run)) {
                    let secs = (done - run) as f64 / 1000.0;
                    v.store_down_fail_s.push(secs);
                    if secs > 3.0 {
                        v.store_down_slow.push(format!("{name} {exec} {secs:.1}s: {error}"));
                    }
                }
            }
        }
        if lost {
            v.runs_lost.push(format!("{name} {exec}: reported {status} ({error}), committed: {did_commit}"));
        }
        let done = row["done_unix_ms"].as_u64();
        if let (Some(start), Some(end)) = (row["run_unix_ms"].as_u64(), done) {
            spans.push((start, end));
        }
        if status == "ok" {
            done_ok.extend(done);
        }
    }
    // affected: a cell of this session was in flight when the fault struck
    for (at, _) in faults {
        if spans.iter().any(|(s, e)| s <= at && at <= e) {
            if let Some(next) = done_ok.iter().filter(|d| *d > at).min() {
                v.recoveries_s.push((next - at) as f64 / 1000.0);
            }
        }
    }
    let wrong: Vec<usize> = (0..cells).filter(|&k| printed(&r.executed, k) != expected_output(k)).collect();
    if !r.exit_ok || !wrong.is_empty() {
        let shown: Vec<String> =
            wrong.iter().take(3).map(|&k| format!("cell {k}: {:?}", printed(&r.executed, k))).collect();
        v.sessions_diverged.push(format!(
            "{name}: exit ok {}, cells {wrong:?} differ: {}",
            r.exit_ok,
            shown.join("; ")
        ));
    }
    Ok(())
}

/// A chaos run: `sessions` replays of a `cells`-cell notebook (each cell sleeping
/// `sleep_s`) while `schedule` injects each fault `every` apart, after `first`.
struct Plan {
    sessions: usize,
    cells: usize,
    sleep_s: f64,
    schedule: Vec<Fault>,
    first: Duration,
    every: Duration,
}

/// Run `plan`; returns the verdict and the faults' times.
async fn chaos_run(
    cluster: &mut Cluster,
    work: &Path,
    plan: &Plan,
) -> anyhow::Result<(Verdict, Vec<(u64, &'static str)>)> {
    let mut store_down = Vec::new();
    let Plan { sessions, cells, sleep_s, ref schedule, first, every } = *plan;
    let replays = start_replays(cluster, work, "s", sessions, &notebook(cells, sleep_s));
    let mut faults = Vec::new();
    tokio::time::sleep(first).await;
    for fault in schedule {
        if replays.iter().all(|r| r.is_finished()) {
            break; // the sessions finished early: the rest of the schedule has nothing to hit
        }
        let at = schemas::unix_ms();
        eprintln!("fault: {}", fault.name());
        cluster.inject(*fault).await.with_context(|| format!("while injecting {}", fault.name()))?;
        faults.push((at, fault.name()));
        if let Fault::StoreStopped(_) = fault {
            store_down.push((at, schemas::unix_ms()));
        }
        tokio::time::sleep(every).await;
    }
    let mut verdict = Verdict::default();
    for (i, handle) in replays.into_iter().enumerate() {
        let r = handle.await??;
        check(cluster, &format!("s{i}"), cells, &r, &faults, &store_down, &mut verdict).await?;
    }
    Ok((verdict, faults))
}

/// A store on a small tmpfs, filled by one session until a save is refused; then
/// that session is deleted. Seconds from the deletion to the first success of a
/// new session's cell that saves 16 MiB (one that needs the freed room: a cell
/// that saves little succeeds on the full store all along, which is checked).
async fn disk_full_recovery() -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(crate::store_faults::is_root(), "the full-disk fault mounts a tmpfs: run as root");
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("store");
    std::fs::create_dir(&store)?;
    let tmpfs = crate::store_faults::Tmpfs::mount(&store, 128)?;
    let env = [("LOOSELEAF_STORE_URL", store.display().to_string())];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &env).await?;
    let big = "big = __import__('os').urandom(16 << 20)";
    let mut filler = services.session(false).await?;
    let mut refused = None;
    let mut fills = 0;
    for i in 0..16 {
        let (status, error, _) =
            filler.run(&format!("fill{i}"), &format!("b{i} = __import__('os').urandom(16 << 20)")).await?;
        fills += 1;
        if status != looseleaf_client::api::ExecStatus::Ok {
            refused = error;
            break;
        }
    }
    let refused = refused.context("the store never filled")?;
    let mut fresh = services.session(false).await?;
    let (small, _, _) = fresh.run("small", "print('small')").await?;
    anyhow::ensure!(small == looseleaf_client::api::ExecStatus::Ok, "a small cell failed on the full store");
    let free_full = tmpfs.free();
    let deleted = Instant::now();
    filler.fe.delete(filler.sid).await?;
    let mut tries = 0;
    loop {
        tries += 1;
        let (status, _, _) = fresh.run(&format!("big{tries}"), big).await?;
        if status == looseleaf_client::api::ExecStatus::Ok {
            break;
        }
        anyhow::ensure!(deleted.elapsed() < Duration::from_secs(300), "no room five minutes after the deletion");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(serde_json::json!({
        "disk_full_recovery_s": deleted.elapsed().as_secs_f64(),
        "disk_full_store_mib": 128,
        "disk_full_fills": fills,
        "disk_full_free_bytes_when_full": free_full,
        "disk_full_refusal": refused,
        "disk_full_big_cell_tries": tries,
    }))
}

/// The p-th percentile (0-100) of `values`, nearest rank.
fn percentile(values: &[f64], p: f64) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v.get(rank.saturating_sub(1).min(v.len().saturating_sub(1))).copied()
}

fn work_dir(name: &str) -> anyhow::Result<PathBuf> {
    let dir = repo_root().join("target").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn chaos_smoke() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(&[1, 1]).await?;
    let work = work_dir("chaos-smoke")?;
    let every_fault = [
        Fault::Workers,
        Fault::HostKilled,
        Fault::Store,
        Fault::Planner,
        Fault::Frontend,
        Fault::Nats,
        Fault::S3Paused(Duration::from_secs(4)),
        Fault::StoreStopped(Duration::from_secs(4)),
        Fault::HostStopped,
    ];
    // LOOSELEAF_CHAOS_FAULTS=frontend,nats runs only those (to study one)
    let only = std::env::var("LOOSELEAF_CHAOS_FAULTS").ok();
    let schedule: Vec<Fault> = every_fault
        .into_iter()
        .filter(|f| only.as_deref().is_none_or(|o| o.split(',').any(|n| n == f.name())))
        .collect();
    let (first, every, sleep_s) = (Duration::from_secs(6), Duration::from_secs(4), 1.5);
    // the cells' sleeps alone outlast the last fault (with six to spare), however
    // fast the platform recovers from the earlier ones
    let last_fault = first + every * (schedule.len() as u32).saturating_sub(1);
    let cells = (last_fault.as_secs_f64() / sleep_s).ceil() as usize + 6;
    let plan = Plan { sessions: 1, cells, sleep_s, schedule, first, every };
    let (v, faults) = chaos_run(&mut cluster, &work, &plan).await?;
    eprintln!("{v:#?}\nfaults: {faults:?}");
    assert_eq!(faults.len(), plan.schedule.len(), "the session ended before every fault struck");
    assert!(v.runs_lost.is_empty(), "runs lost: {:#?} (logs in {})", v.runs_lost, work.display());
    assert!(v.sessions_diverged.is_empty(), "diverged: {:#?} (logs in {})", v.sessions_diverged, work.display());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: bench/chaos runs it"]
async fn bench_chaos() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut cluster = Cluster::start(&[2, 2]).await?;
    let work = work_dir("chaos-bench")?;
    let once = [
        Fault::Workers,
        Fault::HostKilled,
        Fault::Store,
        Fault::Workers,
        Fault::Planner,
        Fault::Frontend,
        Fault::Nats,
        Fault::S3Paused(Duration::from_secs(10)),
        Fault::StoreStopped(Duration::from_secs(8)),
        Fault::HostStopped,
    ];
    let schedule: Vec<Fault> = once.iter().chain(once.iter()).copied().collect();
    let sessions = 6;
    let plan = Plan {
        sessions,
        cells: 60,
        sleep_s: 1.0,
        schedule,
        first: Duration::from_secs(8),
        every: Duration::from_secs(6),
    };
    let (v, faults) = chaos_run(&mut cluster, &work, &plan).await?;
    eprintln!("{v:#?}");
    drop(cluster);

    // load: many sessions at once, no faults
    let cluster = Cluster::start(&[4, 4]).await?;
    let load_sessions = 64;
    let replays = start_replays(&cluster, &work_dir("chaos-load")?, "l", load_sessions, &notebook(4, 0.0));
    let mut starts = Vec::new();
    let mut load = Verdict::default();
    for (i, handle) in replays.into_iter().enumerate() {
        let r = handle.await??;
        starts.extend(r.report["cells"].as_array().into_iter().flatten().filter_map(|c| c["start_delay_ms"].as_f64()));
        check(&cluster, &format!("l{i}"), 4, &r, &[], &[], &mut load).await?;
    }

    let disk_full = disk_full_recovery().await?;
    eprintln!("{disk_full:#}");

    let fault_counts: BTreeMap<&str, usize> = faults.iter().fold(BTreeMap::new(), |mut m, (_, f)| {
        *m.entry(*f).or_default() += 1;
        m
    });
    let result = serde_json::json!({
        "runs": v.runs,
        "runs_failed_and_retried": v.runs_failed,
        "runs_lost": v.runs_lost.len(),
        "runs_lost_detail": v.runs_lost,
        "sessions": sessions,
        "sessions_diverged": v.sessions_diverged.len(),
        "sessions_diverged_detail": v.sessions_diverged,
        "faults": fault_counts,
        "recovery_p50_s": percentile(&v.recoveries_s, 50.0),
        "recovery_p99_s": percentile(&v.recoveries_s, 99.0),
        "recoveries_s": v.recoveries_s,
        "store_down_fail_s_p99": percentile(&v.store_down_fail_s, 99.0),
        "store_down_fail_s_p50": percentile(&v.store_down_fail_s, 50.0),
        "store_down_fail_s": v.store_down_fail_s,
        "store_down_slow": v.store_down_slow,
        "disk_full": disk_full,
        "disk_full_recovery_s": disk_full["disk_full_recovery_s"],
        "load_sessions": load_sessions,
        "load_runs": load.runs,
        "load_runs_lost": load.runs_lost.len(),
        "load_sessions_diverged": load.sessions_diverged.len(),
        "load_p50_start_ms": percentile(&starts, 50.0),
        "load_p99_start_ms": percentile(&starts, 99.0),
        "load_slots": 8,
        "machine_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "wall_s": started.elapsed().as_secs_f64(),
    });
    let out = repo_root().join("bench/results/chaos.json");
    std::fs::write(&out, serde_json::to_string_pretty(&result)? + "\n")?;
    eprintln!("{}", serde_json::to_string_pretty(&result)?);
    Ok(())
}
