//! Sessions' workers as uids of their own (`--session-uids`, ADR 29): what an
//! attacker's cell tries (read another session's files, the manifest key, the
//! store, the host's environment) fails, while each session's own cells work,
//! restores included. Needs root (the gpu-host drops to the session's uid); it
//! says so and passes trivially elsewhere.

use looseleaf_client::api::ExecStatus;
use looseleaf_test_support::cluster::{bin_dir_of, Services, TestSession};

const UIDS: &str = "231000-231099";

fn shared_cwd(s: &TestSession) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    // a folder every session uid may use (a deployment gives each user their own)
    std::fs::set_permissions(s.cwd.path(), std::fs::Permissions::from_mode(0o777))?;
    Ok(())
}

fn uid_of(text: &str) -> Option<u32> {
    text.split("uid ").nth(1)?.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_cannot_reach_other_sessions_or_the_services() -> anyhow::Result<()> {
    if std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m))? != 0 {
        eprintln!("not root: session uids are not tested here");
        return Ok(());
    }
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let mut services = Services::start(&bin, &[1], &[("LOOSELEAF_SESSION_UIDS", UIDS.to_string())]).await?;
    let mut victim = services.session(true).await?;
    shared_cwd(&victim)?;
    let mut attacker = services.session(false).await?;
    shared_cwd(&attacker)?;

    // the victim's cells work as its own uid: files, and state restored in a new worker
    let (status, error, text) = victim
        .run("a", "import os\nopen('secret.txt', 'w').write('alpha')\nos.chmod('secret.txt', 0o600)\nx = 41\nprint('uid', os.getuid())")
        .await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?} {text}");
    let victim_uid = uid_of(&text).ok_or_else(|| anyhow::anyhow!("no uid in {text}"))?;
    let (status, error, text) = victim.run("b", "print(x + 1, open('secret.txt').read())").await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?}");
    assert!(text.contains("42 alpha"), "{text}");

    let secret = victim.cwd.path().join("secret.txt");
    let key = services.data_dir().join("manifest-key");
    let store = services.data_dir().join("store");
    let host_pid = services.pid("host-0").ok_or_else(|| anyhow::anyhow!("no host pid"))?;
    let environ = format!("/proc/{host_pid}/environ");
    let probe = format!(
        "import os\nprint('uid', os.getuid())\nfor p in {paths:?}:\n    try:\n        os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read()\n        print('READ', p)\n    except PermissionError:\n        print('DENIED', p)\n",
        paths = [secret.display().to_string(), key.display().to_string(), store.display().to_string(), environ]
    );
    let (status, error, text) = attacker.run("probe", &probe).await?;
    assert_eq!(status, ExecStatus::Ok, "{error:?} {text}");
    let attacker_uid = uid_of(&text).ok_or_else(|| anyhow::anyhow!("no uid in {text}"))?;
    assert_ne!(victim_uid, attacker_uid, "each session has its own uid");
    for uid in [victim_uid, attacker_uid] {
        assert!((231000..=231099).contains(&uid), "{uid} is from the range");
    }
    assert!(!text.contains("READ"), "the attacker's cell read what is not its session's: {text}");
    assert_eq!(text.matches("DENIED").count(), 4, "{text}");
    Ok(())
}
