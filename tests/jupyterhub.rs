//! JupyterHub (issue 40, ADR 67): a Hub from PyPI with its proxy
//! (`configurable-http-proxy`, from npm), the dummy authenticator and
//! `SimpleLocalProcessSpawner`, configured with `deploy/jupyterhub/jupyterhub_config.py`,
//! and one shared LooseLeaf cluster whose frontend serves the Hub's users. In
//! headless Chromium (`tests/browser/jupyterhub.mjs`) alice and bob each log in,
//! open a notebook in their own JupyterLab on the LooseLeaf kernel (its kernelspec
//! uses the server's `$JUPYTERHUB_API_TOKEN`; no LooseLeaf token anywhere) and run
//! it on the cluster; then each, and the Hub's admin, logs in to the frontend's
//! dashboard through the Hub's OAuth: alice and bob see their own session, the
//! admin both. With the Hub tokens the dashboards got, one user's API calls on the
//! other's session are 404; an unknown token is 401, a login callback whose state
//! is not the browser's 400, and a token the Hub cannot be asked about, once the
//! Hub is gone, 503 naming it.
//! scripts/setup-tests installs JupyterHub, the proxy, Chromium and playwright-core.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use looseleaf_test_support::cluster::{bin_dir_of, Services};
use looseleaf_test_support::jupyter::{chromium, install_extension, Terminated};
use looseleaf_test_support::{free_port, repo_root, venv_python, wait_for};

const NOTEBOOK: &str = "hub.ipynb";
const PASSWORD: &str = "hub-test-password";

/// A one-cell notebook on the LooseLeaf kernel: a GPU cell.
fn notebook() -> serde_json::Value {
    serde_json::json!({
        "cells": [{
            "cell_type": "code", "execution_count": null, "id": "c1", "metadata": {}, "outputs": [],
            "source": "%%gpu\nanswer = 6 * 7\nprint(answer)"
        }],
        "metadata": {"kernelspec": {"name": "looseleaf-hub", "display_name": "LooseLeaf (hub test)", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn hub_users_run_notebooks_on_one_cluster_and_see_only_their_own() -> anyhow::Result<()> {
    let chromium = chromium()?;
    let proxy = repo_root().join("tests/browser/node_modules/.bin/configurable-http-proxy");
    anyhow::ensure!(proxy.exists(), "configurable-http-proxy is not installed: run scripts/setup-tests");
    let venv_bin = venv_python().parent().map(Path::to_path_buf).unwrap_or_default();
    anyhow::ensure!(venv_bin.join("jupyterhub").exists(), "JupyterHub is not installed: run scripts/setup-tests");

    let dir = tempfile::tempdir()?;
    let (prefix, shots) = (dir.path().join("prefix"), dir.path().join("shots"));
    std::fs::create_dir_all(&shots)?;
    let (hub_port, hub_api_port, proxy_api_port) = (free_port()?, free_port()?, free_port()?);
    let hub_url = format!("http://127.0.0.1:{hub_port}");
    let service_token = uuid::Uuid::new_v4().simple().to_string();
    let token_file = dir.path().join("service-token");
    std::fs::write(&token_file, &service_token)?;

    // one shared cluster; its frontend serves the Hub's users
    let env = [
        ("LOOSELEAF_JUPYTERHUB_API_URL", format!("http://127.0.0.1:{hub_api_port}/hub/api")),
        ("LOOSELEAF_JUPYTERHUB_URL", hub_url.clone()),
        ("LOOSELEAF_JUPYTERHUB_TOKEN_FILE", token_file.display().to_string()),
        ("LOOSELEAF_INSECURE_SHARED_WORKERS", "true".to_string()),
    ];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[2], &env).await?;

    // what each user's image has: the kernelspec (against the shared frontend,
    // with the server's Hub token) and the extension's wheel
    let installed = Command::new(env!("CARGO_BIN_EXE_looseleaf"))
        .args(["kernel", "install", "--prefix"])
        .arg(&prefix)
        .args(["--name", "looseleaf-hub", "--display-name", "LooseLeaf (hub test)", "--frontend"])
        .arg(&services.frontend)
        .args(["--token-env", "JUPYTERHUB_API_TOKEN"])
        .status()?;
    anyhow::ensure!(installed.success(), "looseleaf kernel install failed");
    install_extension(&prefix)?;
    for user in ["alice", "bob", "hubadmin"] {
        let home = dir.path().join("home").join(user);
        std::fs::create_dir_all(&home)?;
        std::fs::write(home.join(NOTEBOOK), serde_json::to_string_pretty(&notebook())?)?;
    }

    // the Hub: the shipped service config, and this test's authenticator,
    // spawner, ports and folders
    let d = dir.path().display();
    let config = format!(
        r#"load_subconfig({shipped:?})
c.JupyterHub.bind_url = "{hub_url}"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_api_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{proxy:?}]
c.ConfigurableHTTPProxy.pid_file = "{d}/proxy.pid"
c.JupyterHub.db_url = "sqlite:///{d}/hub.sqlite"
c.JupyterHub.cookie_secret_file = "{d}/cookie_secret"
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = "{PASSWORD}"
c.Authenticator.allowed_users = {{"alice", "bob", "hubadmin"}}
c.Authenticator.admin_users = {{"hubadmin"}}
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = "{d}/home/{{username}}"
c.Spawner.cmd = ["{venv}/jupyterhub-singleuser"]
c.Spawner.args = ["--allow-root", "--LabApp.expose_app_in_browser=True"]
c.Spawner.default_url = "/lab"
c.Spawner.environment = {{"JUPYTER_PATH": "{prefix}/share/jupyter"}}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
"#,
        shipped = repo_root().join("deploy/jupyterhub/jupyterhub_config.py").display().to_string(),
        proxy = proxy.display().to_string(),
        venv = venv_bin.display(),
        prefix = prefix.display(),
    );
    std::fs::write(dir.path().join("jupyterhub_config.py"), config)?;
    let log = std::fs::File::create(dir.path().join("hub.log"))?;
    let path = format!("{}:{}", venv_bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut hub = Some(Terminated(
        Command::new(venv_bin.join("jupyterhub"))
            .arg("-f")
            .arg(dir.path().join("jupyterhub_config.py"))
            .env("PATH", &path)
            .env("LOOSELEAF_FRONTEND_URL", &services.frontend)
            .env("LOOSELEAF_HUB_SERVICE_TOKEN", &service_token)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?,
    ));
    let hub_log = || {
        let text = std::fs::read_to_string(dir.path().join("hub.log")).unwrap_or_default();
        text.lines().rev().take(60).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    };
    let up = wait_for(Duration::from_secs(60), || {
        std::net::TcpStream::connect(("127.0.0.1", hub_port)).is_ok()
            && std::net::TcpStream::connect(("127.0.0.1", hub_api_port)).is_ok()
    });
    anyhow::ensure!(up.is_ok(), "JupyterHub did not start:\n{}", hub_log());

    let out = Command::new("node")
        .arg(repo_root().join("tests/browser/jupyterhub.mjs"))
        .env("HUB_URL", &hub_url)
        .env("FRONTEND_URL", &services.frontend)
        .env("PASSWORD", PASSWORD)
        .env("NOTEBOOK", NOTEBOOK)
        .env("KERNEL_NAME", "looseleaf-hub")
        .env("CHROMIUM", &chromium)
        .env("OUT", &shots)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        let kept = dir.keep();
        anyhow::bail!(
            "the browser driver failed (screenshots in {}):\n{}\n--- JupyterHub's log (tail) ---\n{}",
            kept.join("shots").display(),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(kept.join("hub.log")).unwrap_or_default()
        );
    }
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    eprintln!("{seen}");

    // each user's notebook ran on the LooseLeaf kernel, on the one cluster
    for user in ["alice", "bob"] {
        assert_eq!(seen[user]["kernel"], "looseleaf-hub", "{seen}");
        assert_eq!(seen[user]["output"], "42\n", "{user}'s cell: {seen}");
    }
    let owners = |who: &str| -> Vec<String> {
        let mut users: Vec<String> = seen[who]["dashboard_users"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|u| u.as_str().map(str::to_string))
            .collect();
        users.sort();
        users.dedup();
        users
    };
    // the dashboard, logged in through the Hub: each user sees their own session,
    // the Hub's admin every user's
    assert_eq!(owners("alice"), ["alice"], "{seen}");
    assert_eq!(owners("bob"), ["bob"], "{seen}");
    assert_eq!(owners("hubadmin"), ["alice", "bob"], "{seen}");

    // the API with the Hub tokens the dashboards got: a user's own sessions, and
    // the other's are not there
    let token = |who: &str| seen[who]["token"].as_str().unwrap_or_default().to_string();
    let (alice, bob) = (services.client().with_token(token("alice")), services.client().with_token(token("bob")));
    let alice_sessions = alice.sessions().await?;
    assert_eq!(alice_sessions.len(), 1, "alice has her notebook's session: {alice_sessions:?}");
    let sid = alice_sessions[0].session_id;
    assert!(bob.sessions().await?.iter().all(|s| s.session_id != sid), "bob lists alice's session");
    let http = reqwest::Client::new();
    let front = &services.frontend;
    let summary = http.get(format!("{front}/v1/sessions/{sid}")).bearer_auth(token("bob")).send().await?;
    assert_eq!(summary.status(), 404, "bob reads alice's session");
    let run = http
        .post(format!("{front}/v1/sessions/{sid}/cells/x/run"))
        .bearer_auth(token("bob"))
        .json(&serde_json::json!({"code": "print(answer)"}))
        .send()
        .await?;
    assert_eq!(run.status(), 404, "bob runs a cell in alice's session");
    let mine = http.get(format!("{front}/v1/sessions/{sid}")).bearer_auth(token("alice")).send().await?;
    assert_eq!(mine.status(), 200, "alice reads her own session");

    // a token neither the tokens file nor the Hub knows: 401
    let unknown = http.get(format!("{front}/v1/sessions")).bearer_auth("no-such-token-0123456789").send().await?;
    assert_eq!(unknown.status(), 401);
    let body: serde_json::Value = unknown.json().await?;
    assert!(body["error"].as_str().is_some_and(|e| e.contains("JupyterHub")), "{body}");
    assert_eq!(body["login"], "/hub/login", "{body}");

    // the login's two steps: to the Hub with PKCE's challenge; a callback whose
    // state is not this browser's is refused
    let no_redirects = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build()?;
    let login = no_redirects.get(format!("{front}/hub/login")).send().await?;
    assert_eq!(login.status(), 302);
    let to = login.headers().get("location").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert!(to.starts_with(&format!("{hub_url}/hub/api/oauth2/authorize?")), "{to}");
    assert!(to.contains("client_id=service-looseleaf") && to.contains("code_challenge_method=S256"), "{to}");
    let forged = no_redirects
        .get(format!("{front}/hub/oauth_callback?code=abc&state=not-mine"))
        .header("cookie", "looseleaf-oauth-state=mine.verifier")
        .send()
        .await?;
    assert_eq!(forged.status(), 400);

    // the Hub gone: a token it was never asked about is 503, naming the Hub
    drop(hub.take());
    let down = http.get(format!("{front}/v1/sessions")).bearer_auth("another-token-0123456789").send().await?;
    assert_eq!(down.status(), 503);
    let body: serde_json::Value = down.json().await?;
    let why = body["error"].as_str().unwrap_or_default();
    assert!(why.contains("JupyterHub at") && why.contains(&hub_api_port.to_string()), "{body}");
    Ok(())
}
