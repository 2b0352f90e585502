//! LooseLeaf on NATS as operators run it (ADR 35): a 3-node JetStream cluster on
//! loopback with TLS (a private CA, client certificates verified), a user per
//! service with least-privilege permissions (ADR 27), buckets and streams with 3
//! replicas, and the services spread over the nodes by their seed lists. A
//! notebook runs; the node leading the claims bucket is killed in the middle; the
//! run finishes with every cell equal to a plain IPython kernel's.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use looseleaf_test_support::cluster::{bin_dir_of, Services};
use looseleaf_test_support::secure_nats::{ConfiguredNats, TestPki};
use looseleaf_test_support::{free_port, random_prefix, repo_root, venv_python, wait_for, wait_for_async, NatsServer};
use schemas::local_nats::{server_config, NatsUser};
use schemas::nats::NatsOptions;
use schemas::permissions::Role;

const NODES: usize = 3;

/// The cells: state carried from cell to cell, an expression's value, an error.
const CELLS: &[&str] = &[
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())",
    "y = x * 2\ny[:3]",
    "d = {'a': 1}\nd['b'] = int(len(y))\nd",
    "import time\ntime.sleep(2)\nprint('slept')",
    "def f(v):\n    return v + d['b']\nf(5)",
    "z = [f(i) for i in range(3)]\nz",
    "1 / 0",
    "print(x[-1], y[-1], sorted(d))",
];

fn notebook(dir: &Path) -> PathBuf {
    let cells: Vec<serde_json::Value> = CELLS
        .iter()
        .map(|src| serde_json::json!({"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": null}))
        .collect();
    let nb = serde_json::json!({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 4});
    let path = dir.join("cluster.ipynb");
    std::fs::write(&path, nb.to_string()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn a_notebook_survives_a_nats_node_lost_mid_run() -> anyhow::Result<()> {
    let pki = TestPki::new()?;
    let prefix = random_prefix();
    let users: Vec<(&str, NatsUser)> = vec![
        ("looseleaf-store", NatsUser::service(Role::Store, &prefix)),
        ("looseleaf-planner", NatsUser::service(Role::Planner, &prefix)),
        ("looseleaf-frontend", NatsUser::service(Role::Frontend, &prefix)),
        ("host", NatsUser::service(Role::GpuHost, &prefix)),
        ("operator", NatsUser::new("operator")),
    ];
    let all: Vec<NatsUser> = users.iter().map(|(_, u)| u.clone()).collect();
    let client_ports: Vec<u16> = (0..NODES).map(|_| free_port()).collect::<Result<_, _>>()?;
    let route_ports: Vec<u16> = (0..NODES).map(|_| free_port()).collect::<Result<_, _>>()?;
    let stores = tempfile::tempdir()?;
    let mut nodes = Vec::new();
    for i in 0..NODES {
        let routes: Vec<String> =
            (0..NODES).filter(|&j| j != i).map(|j| format!("nats-route://127.0.0.1:{}", route_ports[j])).collect();
        let config = format!(
            "server_name: n{i}\nlisten: 127.0.0.1:{}\njetstream {{ store_dir: \"{}\" }}\ncluster {{\n  name: looseleaf-test\n  listen: 127.0.0.1:{}\n  routes: [{}]\n}}\n{}{}",
            client_ports[i],
            stores.path().join(format!("n{i}")).display(),
            route_ports[i],
            routes.join(", "),
            pki.server_tls_block(),
            server_config(&all),
        );
        nodes.push(ConfiguredNats::start(client_ports[i], &config)?);
    }
    // a seed list of every node, starting at `first`, logged in as `user`
    let seeds = |user: &NatsUser, first: usize| -> String {
        (0..NODES)
            .map(|k| format!("nats://{}:{}@127.0.0.1:{}", user.name, user.password, client_ports[(first + k) % NODES]))
            .collect::<Vec<_>>()
            .join(",")
    };
    let tls = |url: String| NatsOptions {
        tls_ca: Some(pki.ca.clone()),
        tls_cert: Some(pki.client_cert.clone()),
        tls_key: Some(pki.client_key.clone()),
        replicas: 3,
        connect_wait_s: 60,
        ..NatsOptions::url(url)
    };
    let operator = &users[4].1;
    let watch = tls(seeds(operator, 0));

    // the cluster has formed once JetStream can place three replicas
    let probe = watch.clone();
    wait_for_async(Duration::from_secs(60), || {
        let probe = probe.clone();
        async move {
            let Ok(client) = probe.connect("test-probe").await else { return false };
            let js = async_nats::jetstream::new(client);
            let config =
                async_nats::jetstream::kv::Config { bucket: "probe".into(), num_replicas: 3, ..Default::default() };
            js.create_key_value(config).await.is_ok()
        }
    })
    .await?;

    let env: Vec<(&str, String)> = vec![
        ("LOOSELEAF_NATS_TLS_CA", pki.ca.display().to_string()),
        ("LOOSELEAF_NATS_TLS_CERT", pki.client_cert.display().to_string()),
        ("LOOSELEAF_NATS_TLS_KEY", pki.client_key.display().to_string()),
        ("LOOSELEAF_NATS_REPLICAS", "3".into()),
        ("LOOSELEAF_NATS_CONNECT_WAIT", "60".into()),
    ];
    // each service's own login, its seed list starting at a node of its own
    let service_users: Vec<(String, NatsUser)> = users.iter().map(|(n, u)| (n.to_string(), u.clone())).collect();
    let seeds_of = {
        let ports = client_ports.clone();
        move |name: &str| -> Vec<(String, String)> {
            let key = if name.starts_with("host-") { "host" } else { name };
            let Some(index) = service_users.iter().position(|(n, _)| n == key) else { return Vec::new() };
            let user = &service_users[index].1;
            let first = (index + name.len()) % NODES;
            let url = (0..NODES)
                .map(|k| format!("nats://{}:{}@127.0.0.1:{}", user.name, user.password, ports[(first + k) % NODES]))
                .collect::<Vec<_>>()
                .join(",");
            vec![("LOOSELEAF_NATS_URL".into(), url)]
        }
    };
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let nats = NatsServer::external(watch.url.clone())?;
    let js = async_nats::jetstream::new(watch.connect("test-watch").await?);
    let claims = schemas::buckets::claims_bucket(&prefix);
    let services = Services::start_on(&bin, &[1, 1], &env, nats, watch, prefix, Box::new(seeds_of)).await?;
    // the services made their buckets with three replicas
    let bucket = js.get_key_value(&claims).await?;
    assert_eq!(bucket.status().await?.info.config.num_replicas, 3);

    // the notebook runs; once its first cell is written, the node that leads the
    // claims bucket dies (the hardest node to lose: every cell's claim waits for a
    // new leader)
    let dir = tempfile::tempdir()?;
    let source = notebook(dir.path());
    let out = dir.path().join("cluster.looseleaf.ipynb");
    let mut run = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["run", "--allow-errors", "--all-gpu", "--frontend", &services.frontend, "--output"])
        .arg(&out)
        .arg(&source)
        .stdout(Stdio::null())
        .spawn()?;
    wait_for(Duration::from_secs(300), || out.exists())?;
    let leader = bucket.status().await?.info.cluster.and_then(|c| c.leader).unwrap_or_default();
    let lost = (0..NODES).find(|i| leader == format!("n{i}")).unwrap_or(0);
    nodes[lost].kill();
    let status = run.wait()?;
    assert!(status.success(), "looseleaf run failed with a node lost: {status}");

    // every cell equal to a plain IPython kernel's
    let verdict = dir.path().join("nbequiv.json");
    let nbequiv = repo_root().join("../shared/tools/nbequiv.py");
    let check = Command::new(venv_python())
        .arg(&nbequiv)
        .arg(&source)
        .arg(&out)
        .args(["--runs", "1", "--json"])
        .arg(&verdict)
        .output()?;
    let report = std::fs::read_to_string(&verdict).unwrap_or_default();
    assert!(check.status.success(), "{}\n{report}", String::from_utf8_lossy(&check.stdout));
    let verdict: serde_json::Value = serde_json::from_str(&report)?;
    assert_eq!(verdict["matched"], CELLS.len(), "{report}");
    drop(nodes);
    Ok(())
}
