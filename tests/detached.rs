//! Detached sessions (issue "Lossless sessions", items 1 and 2; ADR 63): a session
//! detached by its client, or idle with no client, frees its workers and keeps its
//! state; a new session asking to resume the same notebook gets it back with its
//! variables, once (of two asking at once, one wins and the other gets a fresh
//! session saying why); a detached session past its retention is deleted, and
//! under disk pressure the oldest detached sessions are discarded first, each
//! listed for its owner and named to its notebook's next kernel; a session whose
//! chunks are gone is said, and a fresh one opens.

use std::time::Duration;

use looseleaf_client::api::{CreateSession, ExecStatus};
use looseleaf_client::Frontend;
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services};

fn asking(cwd: &str, notebook: &str) -> CreateSession {
    CreateSession {
        cwd: cwd.to_string(),
        all_gpu: false,
        speculate: false,
        notebook: Some(notebook.to_string()),
        resume: true,
    }
}

/// Run `code` as cell `cell` of `sid` and wait for its end: its printed text.
async fn run(fe: &Frontend, sid: uuid::Uuid, cell: &str, code: &str) -> anyhow::Result<String> {
    let mut events = Events::open(fe, sid).await?;
    let exec = fe.run(sid, cell, code).await?.exec_id;
    let (status, error) = events.outcome(exec).await?;
    anyhow::ensure!(status == ExecStatus::Ok, "{code:?} ended {status:?}: {error:?} {}", events.text(exec));
    Ok(events.text(exec))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_detached_session_is_resumed_by_its_notebook_once() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    let fe = services.client();
    let dir = tempfile::tempdir()?;
    let cwd = dir.path().display().to_string();

    // nothing to resume yet: a fresh session, and no reason given
    let first = fe.open_session(&asking(&cwd, "work/a.ipynb")).await?;
    assert!(first.resumed.is_none() && first.fresh_because.is_none(), "{first:?}");
    let sid = first.session_id;
    run(&fe, sid, "c1", "xs = [1, 2]\nxs.append(3)\ngen = (i for i in range(3))").await?;

    let detached = fe.detach(sid).await?;
    assert_eq!(detached.session_id, sid);
    assert_eq!(detached.unsavable, vec!["gen".to_string()], "what is gone is named at detach");
    let listed = fe.sessions().await?;
    let mine = listed.iter().find(|s| s.session_id == sid).ok_or_else(|| anyhow::anyhow!("not listed: {listed:?}"))?;
    assert_eq!(mine.detached_unix_ms, Some(detached.detached_unix_ms), "{mine:?}");
    assert_eq!(mine.notebook.as_deref(), Some("work/a.ipynb"));

    // another notebook does not get it
    let other = fe.open_session(&asking(&cwd, "work/b.ipynb")).await?;
    assert!(other.resumed.is_none() && other.session_id != sid, "{other:?}");

    // the same notebook does, with its state: what it holds is said
    let back = fe.open_session(&asking(&cwd, "work/a.ipynb")).await?;
    assert_eq!(back.session_id, sid, "{back:?}");
    let resumed = back.resumed.ok_or_else(|| anyhow::anyhow!("no resume description"))?;
    assert!(resumed.revision >= 1 && resumed.variables >= 1 && resumed.bytes > 0, "{resumed:?}");
    assert_eq!(resumed.detached_unix_ms, Some(detached.detached_unix_ms));
    assert!(run(&fe, sid, "c2", "print(xs)").await?.contains("[1, 2, 3]"), "the resumed state");
    // it is attached now, its client following it as a kernel does: nothing is
    // left to resume, and resuming it by id is refused
    let _following = Events::open(&fe, sid).await?;
    let again = fe.open_session(&asking(&cwd, "work/a.ipynb")).await?;
    assert!(again.resumed.is_none() && again.session_id != sid, "{again:?}");
    let refused = fe.resume(sid).await;
    assert!(refused.as_ref().is_err_and(|e| e.to_string().contains("409")), "{refused:?}");
    // an unknown session is not found
    let unknown = fe.resume(uuid::Uuid::now_v7()).await;
    assert!(unknown.as_ref().is_err_and(|e| e.to_string().contains("404")), "{unknown:?}");

    // two kernels resume one notebook at once: one wins, the other is told why
    fe.detach(sid).await?;
    let ask = asking(&cwd, "work/a.ipynb");
    let (a, b) = tokio::join!(fe.open_session(&ask), fe.open_session(&ask));
    let (a, b) = (a?, b?);
    let winners = [&a, &b].iter().filter(|c| c.resumed.is_some()).count();
    assert_eq!(winners, 1, "{a:?} {b:?}");
    let loser = if a.resumed.is_some() { &b } else { &a };
    assert_ne!(loser.session_id, sid);
    assert!(loser.fresh_because.as_deref().is_some_and(|w| w.contains("first")), "{loser:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_idle_with_no_client_detaches_and_expires_after_its_retention() -> anyhow::Result<()> {
    let env = [("LOOSELEAF_DETACH_UNWATCHED_S", "1".to_string()), ("LOOSELEAF_SESSION_RETENTION_S", "20".to_string())];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &env).await?;
    let fe = services.client();
    let dir = tempfile::tempdir()?;
    let cwd = dir.path().display().to_string();
    let sid = fe.open_session(&asking(&cwd, "killed.ipynb")).await?.session_id;
    run(&fe, sid, "c1", "kept = 'still here'").await?;
    // its client is gone (the events stream closed with `run`): detached soon
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let detached_at = loop {
        let listed = fe.sessions().await?;
        if let Some(at) = listed.iter().find(|s| s.session_id == sid).and_then(|s| s.detached_unix_ms) {
            break at;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "never detached: {listed:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let back = fe.open_session(&asking(&cwd, "killed.ipynb")).await?;
    assert_eq!((back.session_id, back.resumed.as_ref().and_then(|r| r.detached_unix_ms)), (sid, Some(detached_at)));
    assert!(run(&fe, sid, "c2", "print(kept)").await?.contains("still here"));

    // detached again, and past its retention (20 s): gone, with its record
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let listed = fe.sessions().await?;
        if !listed.iter().any(|s| s.session_id == sid) {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "never expired: {listed:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let fresh = fe.open_session(&asking(&cwd, "killed.ipynb")).await?;
    assert!(fresh.resumed.is_none() && fresh.session_id != sid, "{fresh:?}");
    Ok(())
}

/// The issue's own scenario: corpus notebooks (three) each run halfway in a
/// kernel, the kernel SIGKILLed, a new kernel on the same notebook resumes
/// (saying so) and runs the rest, re-running nothing: each notebook equals a
/// plain kernel's run (nbequiv).
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_kernels_notebook_resumes_in_a_new_kernel() -> anyhow::Result<()> {
    use looseleaf_test_support::{copy_dir, repo_root};
    // the new kernel takes over the dead one's session at once, not the culler
    let env = [("LOOSELEAF_DETACH_UNWATCHED_S", "600".to_string())];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[2], &env).await?;
    let prefix = tempfile::tempdir()?;
    crate::kernel::install_as(prefix.path(), &["--name", "looseleaf-resume", "--all-gpu"])?;
    let corpus = prefix.path().join("corpus");
    copy_dir(&repo_root().join("../shared/corpus"), &corpus)?;
    // three notebooks of different kinds: arrays, a kishu test notebook, pandas
    for name in [
        "pdsh_02.02-The-Basics-Of-NumPy-Arrays.ipynb",
        "kishu_numpy.ipynb",
        "pdsh_03.02-Data-Indexing-and-Selection.ipynb",
    ] {
        let notebook = corpus.join(name);
        let executed = prefix.path().join(format!("executed-{name}"));
        let mut probe = crate::kernel::python(prefix.path());
        probe
            .arg(repo_root().join("tests/support/resume_probe.py"))
            .arg("looseleaf-resume")
            .arg(&notebook)
            .arg(&executed)
            .arg(&corpus)
            .arg(&services.frontend);
        let out = tokio::task::spawn_blocking(move || probe.output()).await??;
        let stderr = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(out.status.success(), "resume_probe.py failed on {name}:\n{stderr}");
        let said: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let notice = said["notice"].as_str().unwrap_or_default();
        assert!(notice.starts_with("LooseLeaf: resumed") && notice.contains("%looseleaf fresh"), "{name}: {said}");
        assert!(said["split"].as_u64() > Some(0), "{name}: {said}");
        assert!(said["killed"]["detached_unix_ms"].is_null(), "{name}: detached before it was taken over: {said}");
        let (same, text) = crate::kernel::nbequiv(&notebook, &executed, &corpus, prefix.path())?;
        assert!(same, "{name}: the resumed notebook differs from a plain kernel's run: {text}");
    }
    Ok(())
}

/// A store that stays low on space after collecting has the oldest detached
/// sessions discarded first, one at a time; attached sessions are never
/// discarded (item 5 of the issue).
#[tokio::test(flavor = "multi_thread")]
async fn a_store_low_on_space_discards_the_oldest_detached_sessions_first() -> anyhow::Result<()> {
    // a threshold above the volume's free space: low on space from the start,
    // while saves still fit (they need only half of it free)
    let free = {
        let st = nix::sys::statvfs::statvfs(&std::env::temp_dir())?;
        st.blocks_available() as u64 * st.fragment_size() as u64
    };
    anyhow::ensure!(free > 4 << 30, "the test needs 4 GiB free, the volume has {free} bytes");
    let env = [("LOOSELEAF_GC_FREE_BYTES", (free + (1 << 30)).to_string())];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &env).await?;
    let fe = services.client();
    let dir = tempfile::tempdir()?;
    let cwd = dir.path().display().to_string();
    let mut sids = Vec::new();
    for name in ["oldest", "newer", "attached"] {
        let sid = fe.open_session(&asking(&cwd, &format!("{name}.ipynb"))).await?.session_id;
        run(&fe, sid, "c1", &format!("kept = '{name}'")).await?;
        sids.push(sid);
    }
    let [oldest, newer, attached] = sids[..] else { unreachable!() };
    fe.detach(oldest).await?;
    fe.detach(newer).await?;

    // at which listing each was gone: one at a time (the store asks again once
    // what the last discard freed is free), the oldest first
    let (mut gone, start) = (std::collections::HashMap::new(), tokio::time::Instant::now());
    for listing in 0u64.. {
        if gone.len() == 2 {
            break;
        }
        anyhow::ensure!(start.elapsed() < Duration::from_secs(150), "not discarded: {gone:?}");
        let listed = fe.sessions().await?;
        for sid in [oldest, newer] {
            if !listed.iter().any(|s| s.session_id == sid) {
                gone.entry(sid).or_insert(listing);
            }
        }
        assert!(listed.iter().any(|s| s.session_id == attached), "an attached session was discarded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone[&oldest] < gone[&newer], "not one at a time, the oldest first: {gone:?}");
    // the attached one still works, with its state
    assert!(run(&fe, attached, "c2", "print(kept)").await?.contains("attached"));
    let resumed = fe.open_session(&asking(&cwd, "oldest.ipynb")).await?;
    assert!(resumed.resumed.is_none(), "a discarded session came back: {resumed:?}");
    // listed for their owner, and said to the notebook's next kernel
    let discards = fe.discards().await?;
    for sid in [oldest, newer] {
        let d = discards.iter().find(|d| d.session_id == sid);
        assert!(d.is_some_and(|d| d.why.contains("low on space") && d.detached_unix_ms.is_some()), "{discards:?}");
    }
    let why = resumed.fresh_because.unwrap_or_default();
    assert!(why.contains(&oldest.to_string()) && why.contains("discarded") && why.contains("low on space"), "{why}");
    Ok(())
}

/// A detached session whose chunks are gone from the store (deleted behind its
/// back) is not resumed: its notebook's next kernel gets a fresh session that
/// says why, resuming it by id is a 410 naming the chunks, and it stays listed
/// for its owner to discard.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_whose_chunks_are_gone_is_said_and_a_fresh_one_opens() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    let fe = services.client();
    let dir = tempfile::tempdir()?;
    let cwd = dir.path().display().to_string();
    let sid = fe.open_session(&asking(&cwd, "gone.ipynb")).await?.session_id;
    run(&fe, sid, "c1", "big = list(range(100_000))").await?;
    fe.detach(sid).await?;
    let chunks = services.data_dir().join("store/chunks");
    let mut removed = 0;
    for fan in std::fs::read_dir(&chunks)? {
        for chunk in std::fs::read_dir(fan?.path())? {
            std::fs::remove_file(chunk?.path())?;
            removed += 1;
        }
    }
    assert!(removed > 0, "the session saved no chunk");

    let next = fe.open_session(&asking(&cwd, "gone.ipynb")).await?;
    assert!(next.resumed.is_none() && next.session_id != sid, "{next:?}");
    let why = next.fresh_because.clone().unwrap_or_default();
    assert!(why.contains(&sid.to_string()) && why.contains("chunks are gone"), "{next:?}");
    assert!(run(&fe, next.session_id, "c1", "print('big' in dir())").await?.contains("False"), "a fresh session");
    let by_id = fe.resume(sid).await;
    assert!(by_id.as_ref().is_err_and(|e| e.to_string().contains("410")), "{by_id:?}");
    let listed = fe.sessions().await?;
    assert!(listed.iter().any(|s| s.session_id == sid && s.detached_unix_ms.is_some()), "{listed:?}");
    Ok(())
}
