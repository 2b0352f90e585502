//! deploy/kubernetes kept honest where no cluster runs (ADR 62): every manifest,
//! and every overlay as kustomize builds it, is valid for Kubernetes under
//! `kubernetes-validate --strict`; the NATS servers' users are the ones our
//! permissions give; the pods read secrets from files, probe `/readyz` and
//! `/healthz`, have limits and security contexts, and the gpu-host holds only the
//! capabilities per-session uids take; and the trial overlay, started as
//! processes from what it declares (tests/kubernetes/pods.py: commands,
//! environment, secret files, users and capabilities, probes, each pod in a
//! network namespace of its own), runs a notebook equal to a plain kernel's, and
//! runs the next one on the gpu-host that replaces a deleted one. Stand-ins, where
//! an image cannot run here: the venv's nats-server, moto for MinIO, one PUT for
//! MinIO's client.

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use looseleaf_test_support::cluster::bin_dir_of;
use looseleaf_test_support::{copy_dir, repo_root, venv_python, wait_for, wait_for_async};

fn pods_py() -> PathBuf {
    repo_root().join("tests/kubernetes/pods.py")
}

/// deploy/kubernetes copied into `dir` with fresh secrets for the trial overlay,
/// as an operator would have it after `scripts/kubernetes-secrets`; its path there.
fn deployment(dir: &Path) -> anyhow::Result<PathBuf> {
    for item in ["deploy/kubernetes", "scripts/kubernetes-secrets"] {
        std::fs::create_dir_all(dir.join(item).parent().context("a parent")?)?;
        copy_dir(&repo_root().join(item), &dir.join(item))?;
    }
    // not the secrets of this checkout, if it has some
    let _ = std::fs::remove_dir_all(dir.join("deploy/kubernetes/overlays/trial/secrets"));
    let secrets = Command::new(dir.join("scripts/kubernetes-secrets")).output()?;
    anyhow::ensure!(secrets.status.success(), "kubernetes-secrets: {}", String::from_utf8_lossy(&secrets.stderr));
    Ok(dir.join("deploy/kubernetes"))
}

fn validate(manifests: &Path) -> std::process::Output {
    Command::new(venv_python())
        .arg(pods_py())
        .arg("validate")
        .arg(manifests)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", pods_py().display()))
}

/// The resources a kustomization builds (`pods.py render --json`).
fn render(kustomization: &Path) -> Vec<serde_json::Value> {
    let out = Command::new(venv_python())
        .arg(pods_py())
        .arg("render")
        .arg(kustomization)
        .arg("--json")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", pods_py().display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("pods.py render {}: {e}", kustomization.display()))
}

fn find<'a>(resources: &'a [serde_json::Value], kind: &str, name: &str) -> &'a serde_json::Value {
    resources
        .iter()
        .find(|r| r["kind"] == kind && r["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Every container (init containers too) of every pod template: (owner, container).
fn containers(resources: &[serde_json::Value]) -> Vec<(String, &serde_json::Value)> {
    let mut out = Vec::new();
    for r in resources {
        let spec = &r["spec"]["template"]["spec"];
        let owner = format!(
            "{} {}",
            r["kind"].as_str().unwrap_or_default(),
            r["metadata"]["name"].as_str().unwrap_or_default()
        );
        for c in spec["initContainers"].as_array().into_iter().chain(spec["containers"].as_array()).flatten() {
            out.push((format!("{owner}/{}", c["name"].as_str().unwrap_or_default()), c));
        }
    }
    out
}

fn strings(value: &serde_json::Value) -> Vec<&str> {
    value.as_array().into_iter().flatten().filter_map(serde_json::Value::as_str).collect()
}

#[test]
fn kubernetes_manifests_are_valid_for_kubernetes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let manifests = deployment(dir.path())?;
    let ok = validate(&manifests);
    let text = format!("{}{}", String::from_utf8_lossy(&ok.stdout), String::from_utf8_lossy(&ok.stderr));
    assert!(ok.status.success(), "{text}");
    assert!(text.contains("3 builds valid"), "base, trial and gpu built and checked: {text}");
    // and the check can fail: a field Kubernetes does not have
    let planner = manifests.join("base/planner.yaml");
    let kept = std::fs::read_to_string(&planner)?;
    anyhow::ensure!(kept.contains("\n  replicas: 2\n"), "base/planner.yaml has no `replicas: 2` to misspell");
    std::fs::write(&planner, kept.replacen("\n  replicas: 2\n", "\n  replicaz: 2\n", 1))?;
    let refused = validate(&manifests);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("replicaz"), "{stderr}");
    Ok(())
}

#[test]
fn kubernetes_nats_users_are_the_services_permissions() {
    let out = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .arg("nats-config")
        .output()
        .unwrap_or_else(|e| panic!("looseleaf nats-config: {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let users = String::from_utf8_lossy(&out.stdout);
    let base = render(&repo_root().join("deploy/kubernetes/base"));
    let conf = find(&base, "ConfigMap", "nats-config")["data"]["nats.conf"].as_str().unwrap_or_default();
    // the passwords' variables first (an included file's variables reach the file
    // that includes it), then exactly what `looseleaf nats-config` prints
    let (head, tail) = conf.split_once("include passwords.conf\n").unwrap_or(("", ""));
    assert!(head.contains("port: 4222") && head.contains("http_port: 8222"), "{conf}");
    assert_eq!(
        tail.trim_start_matches('\n'),
        users,
        "deploy/kubernetes/base/nats-config.yaml is stale: its nats.conf must end with `looseleaf nats-config`"
    );
    // the trial's bucket policy is compose's
    let trial = std::fs::read_to_string(repo_root().join("deploy/kubernetes/overlays/trial/minio.yaml"))
        .unwrap_or_else(|e| panic!("minio.yaml: {e}"));
    let policy = trial.split("policy.json: |\n").nth(1).unwrap_or_default().split("\n---").next().unwrap_or_default();
    let policy: serde_json::Value = serde_json::from_str(policy).unwrap_or_else(|e| panic!("policy.json: {e}"));
    let compose = std::fs::read_to_string(repo_root().join("deploy/minio/checkpoints-policy.json")).unwrap_or_default();
    let compose: serde_json::Value = serde_json::from_str(&compose).unwrap_or_else(|e| panic!("compose's: {e}"));
    assert_eq!(policy, compose, "the trial's bucket policy and deploy/minio/checkpoints-policy.json differ");
}

#[test]
fn kubernetes_pods_read_secrets_from_files_and_are_bounded() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let manifests = deployment(dir.path())?;
    for overlay in ["trial", "gpu"] {
        let resources = render(&manifests.join("overlays").join(overlay));
        for (name, c) in containers(&resources) {
            let security = &c["securityContext"];
            assert_eq!(security["allowPrivilegeEscalation"], false, "{overlay}: {name}");
            assert_eq!(security["readOnlyRootFilesystem"], true, "{overlay}: {name}");
            assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"], "{overlay}: {name}");
            assert!(c["resources"]["limits"]["memory"].is_string(), "{overlay}: {name} has no memory limit");
            // no secret in an environment: values and references are files' paths
            for var in c["env"].as_array().into_iter().flatten() {
                assert!(var["valueFrom"]["secretKeyRef"].is_null(), "{overlay}: {name}: {var}");
                let value = var["value"].as_str().unwrap_or_default().to_lowercase();
                assert!(!value.contains("://") || !value.contains('@'), "{overlay}: {name}: a login in {var}");
            }
            assert!(
                c["envFrom"].as_array().into_iter().flatten().all(|e| e["secretRef"].is_null()),
                "{overlay}: {name}"
            );
            let image = c["image"].as_str().unwrap_or_default();
            let ours = image.contains("looseleaf:") && !strings(&c["command"]).contains(&"sh");
            if ours {
                assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz", "{overlay}: {name}");
                assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz", "{overlay}: {name}");
            }
            if name.contains("/gpu-host") && ours {
                // root with the capabilities session uids take, and no others
                assert_eq!(security["runAsUser"], 0, "{overlay}: {name}");
                let caps: BTreeSet<&str> = strings(&security["capabilities"]["add"]).into_iter().collect();
                assert_eq!(caps, BTreeSet::from(["CHOWN", "DAC_OVERRIDE", "KILL", "SETGID", "SETUID"]), "{overlay}");
            } else {
                assert!(strings(&security["capabilities"]["add"]).is_empty(), "{overlay}: {name}");
            }
        }
        // everything but the gpu-host and its init container runs as a user
        for r in &resources {
            let spec = &r["spec"]["template"]["spec"];
            if spec.is_object() && r["metadata"]["name"] != "gpu-host" {
                assert_eq!(spec["securityContext"]["runAsNonRoot"], true, "{overlay}: {}", r["metadata"]["name"]);
            }
            if spec.is_object() {
                assert_eq!(spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
            }
        }
        let host = &find(&resources, "DaemonSet", "gpu-host")["spec"]["template"]["spec"];
        let env = &host["containers"][0]["env"];
        let id = env.as_array().into_iter().flatten().find(|v| v["name"] == "LOOSELEAF_HOST_ID");
        let id = id.and_then(|v| v["valueFrom"]["fieldRef"]["fieldPath"].as_str());
        assert_eq!(id, Some("metadata.name"), "{overlay}: the host id is the pod's name");
        let shm = host["volumes"].as_array().into_iter().flatten().find(|v| v["name"] == "dshm");
        assert_eq!(shm.and_then(|v| v["emptyDir"]["medium"].as_str()), Some("Memory"), "{overlay}");
        assert!(host["terminationGracePeriodSeconds"].as_u64() > Some(10), "longer than the 10 s drain");
        let gpus = &host["containers"][0]["resources"]["limits"]["nvidia.com/gpu"];
        assert_eq!(gpus.is_string(), overlay == "gpu", "{overlay}: nvidia.com/gpu limits only on GPU nodes");
    }
    Ok(())
}

/// pods.py running the trial overlay; dropping it closes its stdin, which stops
/// every pod and removes the namespaces.
struct Cluster {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    started: serde_json::Value,
    /// pods.py's work folder (its logs under logs/).
    work: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Cluster {
    fn start(overlay: &Path, work: &Path) -> anyhow::Result<Self> {
        let mut child = Command::new(venv_python())
            .arg(pods_py())
            .arg("up")
            .arg(overlay)
            .arg("--work")
            .arg(work)
            .arg("--bin")
            .arg(bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")))
            .arg("--venv")
            .arg(repo_root().join(".venv"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().context("stdout")?);
        let mut cluster = Self { child, stdin, stdout, started: serde_json::Value::Null, work: work.to_path_buf() };
        cluster.started = cluster.answer().context("pods.py did not start its pods (see work/logs)")?;
        Ok(cluster)
    }

    /// The next line pods.py prints, a JSON object.
    fn answer(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        serde_json::from_str(&line).with_context(|| format!("pods.py said {line:?}"))
    }

    /// A command to pods.py (`delete POD`, `ready`), and its answer.
    fn ask(&mut self, command: &str) -> anyhow::Result<serde_json::Value> {
        let stdin = self.stdin.as_mut().context("pods.py's stdin")?;
        writeln!(stdin, "{command}")?;
        stdin.flush()?;
        self.answer()
    }

    /// The address a Service's name resolved to when every pod had started.
    fn service(&self, name: &str) -> String {
        self.started["services"][name].as_str().unwrap_or_default().to_string()
    }

    /// Until every pod but the bucket Job's (which completes) is ready.
    fn all_ready(&mut self, within: Duration) -> anyhow::Result<()> {
        let mut waiting = Vec::new();
        let ready = wait_for(within, || {
            let Ok(states) = self.ask("ready") else { return false };
            let pods = states["ready"].as_object().into_iter().flatten();
            let unready = pods.filter(|(name, ready)| !name.starts_with("minio-bucket-") && **ready != true);
            waiting = unready.map(|(name, _)| name.clone()).collect::<Vec<String>>();
            waiting.is_empty()
        });
        ready.with_context(|| format!("pods not ready: {waiting:?}\n{}", self.log_tails(&waiting)))
    }

    /// The last lines each of `pods`' containers logged (the work folder goes
    /// with the test: a failure in CI must say why itself).
    fn log_tails(&self, pods: &[String]) -> String {
        let Ok(entries) = std::fs::read_dir(self.work.join("logs")) else { return "(no logs)".into() };
        let mut out = String::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if !pods.iter().any(|p| name.starts_with(&format!("{p}."))) {
                continue;
            }
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!(
                "--- {name} (last 30 lines)\n{}\n",
                lines[lines.len().saturating_sub(30)..].join("\n")
            ));
        }
        out
    }

    /// The pods whose names start with `prefix`, and their addresses.
    fn pods(&self, prefix: &str) -> Vec<(String, String)> {
        let pods = self.started["pods"].as_object().into_iter().flatten();
        pods.filter(|(name, _)| name.starts_with(prefix))
            .map(|(name, ip)| (name.clone(), ip.as_str().unwrap_or_default().to_string()))
            .collect()
    }
}

/// Until the pod at `ip` answers its readiness probe.
async fn ready(http: &reqwest::Client, ip: &str) -> anyhow::Result<()> {
    let url = format!("http://{ip}:9464/readyz");
    wait_for_async(Duration::from_secs(180), || {
        let (http, url) = (http.clone(), url.clone());
        async move { http.get(&url).send().await.is_ok_and(|r| r.status().is_success()) }
    })
    .await
    .with_context(|| format!("{url} never answered 200 (see the logs under work/logs)"))
}

const CELLS: &[&str] = &[
    "import numpy as np\nx = np.arange(12).reshape(3, 4)\nprint(x.sum())",
    "y = x.T @ x\ny",
    "total = int(y.trace())\ntotal",
    "1 / 0",
    "print(total, x.shape)",
    "with open('written.txt', 'w') as f:\n    f.write(str(6 * 7))",
];

const CELLS_AFTER: &[&str] = &[
    "import numpy as np\nv = np.arange(8) ** 2\nv",
    "w = v[::-1] - v\nint(w.sum()), w.min()",
    "raise ValueError('on purpose')",
    "print(sorted(w.tolist())[:3])",
    "with open('second.txt', 'w') as f:\n    f.write('after the host was replaced')",
];

/// Run `cells` as notebook `name` through the frontend at `frontend`, working in
/// `cwd`; check that every cell equals a plain IPython kernel's; the hosts the
/// report says ran them.
fn run_checked(
    frontend: &str,
    token: &str,
    cwd: &Path,
    client: &Path,
    name: &str,
    cells: &[&str],
) -> anyhow::Result<BTreeSet<String>> {
    let nb_cells: Vec<serde_json::Value> = cells
        .iter()
        .map(|src| serde_json::json!({"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": null}))
        .collect();
    let source = client.join(format!("{name}.ipynb"));
    let nb = serde_json::json!({"cells": nb_cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 4});
    std::fs::write(&source, nb.to_string())?;
    let out = client.join(format!("{name}.looseleaf.ipynb"));
    let report = client.join(format!("{name}.report.json"));
    let run = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["run", "--allow-errors", "--all-gpu", "--frontend", &format!("http://{frontend}:8470"), "--output"])
        .arg(&out)
        .arg("--report")
        .arg(&report)
        .arg("--cwd")
        .arg(cwd)
        .arg(&source)
        .env("LOOSELEAF_TOKEN", token)
        .stdout(Stdio::null())
        .output()?;
    anyhow::ensure!(run.status.success(), "looseleaf run {name}: {}", String::from_utf8_lossy(&run.stderr));
    let verdict = client.join(format!("{name}.nbequiv.json"));
    let check = Command::new(venv_python())
        .arg(repo_root().join("../shared/tools/nbequiv.py"))
        .arg(&source)
        .arg(&out)
        .args(["--runs", "1", "--json"])
        .arg(&verdict)
        .output()?;
    let text = std::fs::read_to_string(&verdict).unwrap_or_default();
    anyhow::ensure!(check.status.success(), "{name}: {}\n{text}", String::from_utf8_lossy(&check.stdout));
    let verdict: serde_json::Value = serde_json::from_str(&text)?;
    anyhow::ensure!(verdict["matched"] == cells.len(), "{name}: {text}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
    let cells = report["cells"].as_array().into_iter().flatten();
    Ok(cells.filter_map(|c| c["host"].as_str().map(str::to_string)).collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_trial_overlay_runs_notebooks_as_pods_and_outlives_a_deleted_gpu_host() -> anyhow::Result<()> {
    let _alone = looseleaf_test_support::DEPLOYMENT.lock().await;
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    // the manifests with fresh secrets, as an operator would have them; the pods'
    // users (10001, the sessions' uids) must reach the folders under it
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    let manifests = deployment(d)?;
    let tokens = std::fs::read_to_string(manifests.join("overlays/trial/secrets/api-tokens/api-tokens"))?;
    let token = tokens.split_whitespace().nth(1).context("no token written")?.to_string();
    let work = d.join("work");
    let mut cluster = Cluster::start(&manifests.join("overlays/trial"), &work)?;

    // one node: one gpu-host, whose host id is its pod's name
    let hosts = cluster.pods("gpu-host-");
    anyhow::ensure!(hosts.len() == 1, "one gpu-host pod on the trial's one node: {}", cluster.started);
    let host = hosts[0].0.clone();
    cluster.all_ready(Duration::from_secs(180))?;
    let frontend = cluster.service("frontend");
    let http = reqwest::Client::new();
    ready(&http, &frontend).await?;

    // a notebook through the frontend, with the API token, working in the folder
    // of the notebooks claim that the gpu-host's init container made for every uid
    let shared = work.join("volumes/notebooks/shared");
    let client = d.join("client");
    std::fs::create_dir_all(&client)?;
    let ran_on = run_checked(&frontend, &token, &shared, &client, "first", CELLS)?;
    assert_eq!(ran_on, BTreeSet::from([host.clone()]));
    // as a uid of the session's own, from the range the DaemonSet gives
    let written = shared.join("written.txt");
    assert_eq!(std::fs::read_to_string(&written).context("the cell's file in --cwd")?, "42");
    let uid = std::fs::metadata(&written)?.uid();
    assert!((200_000..=201_999).contains(&uid), "written by uid {uid}, not a session's");

    // the gpu-host pod deleted: the DaemonSet starts another on the node, a new host
    let deleted = cluster.ask(&format!("delete {host}"))?;
    let replacement = deleted["replacement"].as_str().with_context(|| format!("{deleted}"))?.to_string();
    assert_ne!(replacement, host);
    ready(&http, deleted["ip"].as_str().unwrap_or_default()).await?;
    // every pod ready again, so the deleted one has stopped within its grace period
    cluster.all_ready(Duration::from_secs(60))?;
    let states = cluster.ask("ready")?;
    assert_eq!(states["ready"][&replacement], true, "{states}");
    assert!(states["ready"][&host].is_null(), "the deleted pod is gone: {states}");

    // and the next notebook runs there
    let ran_on = run_checked(&frontend, &token, &shared, &client, "second", CELLS_AFTER)?;
    assert_eq!(ran_on, BTreeSet::from([replacement]));
    assert_eq!(std::fs::read_to_string(shared.join("second.txt"))?, "after the host was replaced");
    Ok(())
}
