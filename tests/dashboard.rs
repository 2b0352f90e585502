//! The operator's dashboard in a real browser (ADR 47): headless Chromium, driven
//! by Playwright (`tests/browser/dashboard.mjs`), opens the frontend's `/` while a
//! session runs GPU cells, and sees the host's slots, the session and its
//! execution (where it ran, how it was prepared, its start delay); then the next
//! execution appears without a reload. The page's screenshot is left in a temporary
//! folder named in the output, for a person to look at (never committed).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use looseleaf_client::api::ExecStatus;
use looseleaf_test_support::cluster::{bin_dir_of, Services};
use looseleaf_test_support::repo_root;

#[tokio::test(flavor = "multi_thread")]
async fn the_dashboard_shows_hosts_sessions_and_executions_live() -> anyhow::Result<()> {
    let chromium = ["chromium", "chromium-browser"]
        .iter()
        .map(|b| Path::new("/usr/bin").join(b))
        .find(|p| p.exists())
        .ok_or_else(|| {
            anyhow::anyhow!("no Chromium in /usr/bin: run scripts/setup-tests (it installs Debian's chromium)")
        })?;
    anyhow::ensure!(
        repo_root().join("tests/browser/node_modules/playwright-core").exists(),
        "playwright-core is not installed: run scripts/setup-tests"
    );
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(true).await?;
    let first = s.fe.run(s.sid, "first", "x = 6 * 7").await?.exec_id;
    let (status, error) = s.events.outcome(first).await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?}");

    let shots = tempfile::tempdir()?;
    let mut driver = Command::new("node")
        .arg(repo_root().join("tests/browser/dashboard.mjs"))
        .env("DASHBOARD_URL", format!("{}/", services.frontend))
        .env("SESSION", s.sid.to_string())
        .env("FIRST_EXEC", first.to_string())
        .env("CHROMIUM", &chromium)
        .env("OUT", shots.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdout = BufReader::new(driver.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?);
    let mut stdin = driver.stdin.take().ok_or_else(|| anyhow::anyhow!("no stdin"))?;
    let mut stage = || -> anyhow::Result<serde_json::Value> {
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        Ok(serde_json::from_str(line.trim()).unwrap_or(serde_json::Value::Null))
    };
    let seen = tokio::task::block_in_place(&mut stage)?;
    if seen.is_null() {
        let out = driver.wait_with_output()?;
        anyhow::bail!("the browser driver failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    eprintln!("{seen}");
    assert_eq!(seen["session_shown"], true, "{seen}");
    assert_eq!(seen["slots"], serde_json::json!(["slot 0 free"]), "{seen}");
    // session, cell, device, where, how prepared, start delay, run time, status
    let row = &seen["row"];
    assert_eq!(row[1], "first", "{seen}");
    assert_eq!(row[2], "gpu", "{seen}");
    assert_eq!(row[3], "host-0/slot 0", "{seen}");
    assert_eq!(row[4], "cold", "{seen}");
    assert!(row[5].as_str().is_some_and(|d| d.ends_with(" ms")), "a start delay: {seen}");

    // the next run, while the page is open
    let second = s.fe.run(s.sid, "second", "y = x + 1").await?.exec_id;
    let (status, error) = s.events.outcome(second).await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?}");
    writeln!(stdin, "{second}")?;
    let seen = tokio::task::block_in_place(&mut stage)?;
    let out = driver.wait_with_output()?;
    anyhow::ensure!(
        out.status.success() && !seen.is_null(),
        "the browser driver failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{seen}");
    assert_eq!(seen["row"][1], "second", "{seen}");
    assert_eq!(seen["rows"], 2, "both executions, newest first: {seen}");
    assert_eq!(seen["errors"], serde_json::json!([]), "{seen}");
    assert!(seen["status"].as_str().is_some_and(|s| s.starts_with("live")), "{seen}");
    match seen["screenshot_error"].as_str() {
        None => eprintln!("the dashboard's screenshot: {}", shots.keep().join("dashboard.png").display()),
        Some(e) => eprintln!("no screenshot of the dashboard: {e}"),
    }
    Ok(())
}
