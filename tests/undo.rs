//! Undo, checkout and fork of a session's state (issue "Lossless sessions", item
//! 4): each is a new manifest revision holding an earlier state, or a new session
//! sharing the state's chunks; the workers holding the state left behind are
//! stopped, so the next cell sees the state moved to, on the session's
//! persistent CPU worker as on a GPU worker.

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::{Event, Prepare};
use looseleaf_test_support::cluster::{bin_dir_of, Events, Services, TestSession};

/// Run `code` and answer what it printed (an error if it failed).
async fn printed(s: &mut TestSession, cell: &str, code: &str) -> anyhow::Result<String> {
    let (status, error, outputs) = s.run(cell, code).await?;
    anyhow::ensure!(status == ExecStatus::Ok, "{code:?} ended {status:?}: {error:?} {outputs}");
    // one output's JSON a line: the streams' text
    let text: String = outputs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|o| o["text"].as_str().map(str::to_owned))
        .collect();
    Ok(text.trim().to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn undo_and_checkout_move_the_state_and_the_next_cell_sees_it() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    // CPU cells: they run on the session's persistent CPU worker, which holds
    // the state in memory between cells
    let mut s = services.session(false).await?;
    let fe = s.fe.clone();
    let sid = s.sid;

    // nothing has run: nothing to undo
    let nothing = fe.undo(sid).await.expect_err("undo before any cell");
    assert_eq!(nothing.status().map(|c| c.as_u16()), Some(409), "{nothing}");
    assert!(nothing.detail().contains("nothing to undo"), "{nothing}");

    printed(&mut s, "c1", "xs = [1, 2]\nimport random\nrandom.seed(7)").await?;
    let after_c1 = fe.summary(sid).await?["revision"].as_u64().unwrap_or_default();
    printed(&mut s, "c2", "xs.append(3)\ndraw = random.random()\nys = 'new'").await?;
    let first_draw = printed(&mut s, "c3", "print(draw)").await?;

    // undo the cell that only printed, then the one that mutated `xs` in place
    let undone = fe.undo(sid).await?;
    assert!(undone.revision > after_c1 && undone.variables >= 3, "{undone:?}");
    let undone = fe.undo(sid).await?;
    assert_eq!(undone.state_of, after_c1, "{undone:?}");
    assert_eq!(printed(&mut s, "c4", "print(xs, 'ys' in dir())").await?, "[1, 2] False");
    // the random generator went back too: the same draw comes again
    assert_eq!(printed(&mut s, "c5", "print(random.random())").await?, first_draw);

    // checkout returns to a state after the undo, and to one before it
    let summary = fe.summary(sid).await?;
    let executions = summary["executions"].as_array().cloned().unwrap_or_default();
    let with_three = executions
        .iter()
        .find(|e| e["cell_id"] == "c2")
        .and_then(|e| e["after_revision"].as_u64())
        .ok_or_else(|| anyhow::anyhow!("c2 left no revision: {summary}"))?;
    let moved = fe.checkout(sid, with_three).await?;
    assert_eq!(moved.state_of, with_three);
    assert_eq!(printed(&mut s, "c6", "print(xs, ys)").await?, "[1, 2, 3] new");

    // bad input: a revision that does not exist, a cell still running
    let missing = fe.checkout(sid, 9999).await.expect_err("no revision 9999");
    assert_eq!(missing.status().map(|c| c.as_u16()), Some(404), "{missing}");
    assert!(missing.detail().contains("there is no revision 9999"), "{missing}");
    let exec = fe.run(sid, "slow", "import time\ntime.sleep(3)").await?.exec_id;
    s.events.started(exec).await?;
    let busy = fe.undo(sid).await.expect_err("undo while a cell runs");
    assert_eq!(busy.status().map(|c| c.as_u16()), Some(409), "{busy}");
    assert!(busy.detail().contains("running"), "{busy}");
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    assert_eq!(printed(&mut s, "c7", "print(xs)").await?, "[1, 2, 3]", "a refused undo changed nothing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn forks_diverge_without_touching_each_other_or_their_parent() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[2], &[]).await?;
    // GPU cells (virtual GPUs): each restores its closure from the store
    let mut parent = services.session(true).await?;
    let fe = parent.fe.clone();
    // `gen` cannot be saved: only the parent's worker holds it
    let c1 = "import numpy as np\nxs = [1, 2]\nbig = np.arange(1_000_000)\ngen = (i for i in range(3))";
    printed(&mut parent, "c1", c1).await?;

    let mut forks = Vec::new();
    for _ in 0..2 {
        let forked = fe.fork(parent.sid).await?;
        assert_eq!(forked.forked_from, Some(parent.sid));
        assert_eq!(forked.unsavable, vec!["gen".to_string()], "what the fork does not get is named");
        assert!(forked.variables >= 2 && forked.bytes >= 8_000_000, "{forked:?}");
        // a fork starts detached, and is listed as the caller's
        let listed = fe.sessions().await?;
        let mine = listed.iter().find(|l| l.session_id == forked.session_id);
        assert!(mine.is_some_and(|l| l.detached_unix_ms.is_some()), "{listed:?}");
        let events = Events::open(&fe, forked.session_id).await?;
        let cwd = tempfile::tempdir()?;
        forks.push(TestSession { fe: fe.clone(), cwd, sid: forked.session_id, events });
    }
    let [f1, f2] = &mut forks[..] else { unreachable!() };
    printed(f1, "c2", "xs.append('f1')\nbig[0] = -1").await?;
    printed(f2, "c2", "xs.append('f2')").await?;
    printed(&mut parent, "c2", "xs.append('p')").await?;
    assert_eq!(printed(f1, "c3", "print(xs, big[0])").await?, "[1, 2, 'f1'] -1");
    assert_eq!(printed(f2, "c3", "print(xs, big[0])").await?, "[1, 2, 'f2'] 0");
    assert_eq!(printed(&mut parent, "c3", "print(xs, big[0])").await?, "[1, 2, 'p'] 0");
    // the generator stayed the parent's: a fork's cell never runs in its worker
    assert_eq!(printed(f2, "c3b", "print('gen' in dir())").await?, "False");
    assert_eq!(printed(&mut parent, "c3b", "print(next(gen))").await?, "0");

    // a fork's undo stops at the state it was forked with
    fe.undo(f1.sid).await?; // c3
    fe.undo(f1.sid).await?; // c2
    assert_eq!(printed(f1, "c4", "print(xs, big[0])").await?, "[1, 2] 0");
    fe.undo(f1.sid).await?; // c4
    let first = fe.undo(f1.sid).await.expect_err("undo past the fork");
    assert!(first.detail().contains("forked from session"), "{first}");

    // the parent discarded, its forks keep their state (the chunks they share stay)
    fe.delete(parent.sid).await?;
    assert_eq!(printed(f2, "c4", "print(xs, big.sum())").await?, "[1, 2, 'f2'] 499999500000");
    // a deleted session is not forked
    let gone = fe.fork(parent.sid).await.expect_err("fork of a deleted session");
    assert_eq!(gone.status().map(|c| c.as_u16()), Some(404), "{gone}");
    Ok(())
}

/// The kernel's own magics, as a notebook user types them: `%looseleaf undo`
/// after an in-place mutation, `checkout N` by the `In[N]` the user sees,
/// `fork`; a bad magic and an execution the kernel never ran are the cell's
/// error, naming what was wrong.
#[test]
fn the_kernels_magics_undo_check_out_and_fork_the_notebooks_state() -> anyhow::Result<()> {
    use looseleaf_test_support::repo_root;
    let prefix = looseleaf_test_support::local_cluster::UserDirs::new()?;
    crate::kernel::install_as(prefix.path(), &["--name", "looseleaf-magic"])?;
    let work = tempfile::tempdir()?;
    let out = crate::kernel::python(prefix.path())
        .arg(repo_root().join("tests/support/magic_probe.py"))
        .arg("looseleaf-magic")
        .current_dir(work.path())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "magic_probe.py failed:\n{stderr}");
    let seen: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii())?;
    eprintln!("{seen}");
    let said = |key: &str, i: usize| seen[key][i].as_str().unwrap_or_default().to_string();
    assert_eq!(said("undo", 0), "ok");
    assert!(said("undo", 1).starts_with("LooseLeaf: undone") && said("undo", 1).contains("not undone"), "{seen}");
    assert_eq!(said("after_undo", 1), "[1, 2]\n");
    assert!(said("checkout", 1).contains("execution 2's again"), "{seen}");
    assert_eq!(said("after_checkout", 1), "[1, 2, 3]\n");
    assert_eq!(said("unknown_execution", 0), "error");
    assert!(said("unknown_execution", 2).contains("execution 99 is not one this kernel ran"), "{seen}");
    assert_eq!(said("bad_magic", 0), "error");
    assert!(said("bad_magic", 2).contains("undo | checkout N | fork"), "{seen}");
    assert!(said("fork", 1).starts_with("LooseLeaf: forked: session "), "{seen}");
    assert_eq!(said("still_here", 1), "[1, 2, 3]\n", "the notebook stays on its own session");
    Ok(())
}

/// What the session's persistent CPU worker was last restored with, for `exec`:
/// (how it was prepared, bytes restored).
fn started(s: &TestSession, exec: uuid::Uuid) -> Option<(Prepare, u64)> {
    s.events.seen.iter().find_map(|i| match i {
        StreamItem::Event { exec_id, event: Event::Started { prepare, restored_bytes, .. }, .. }
            if *exec_id == exec =>
        {
            Some((*prepare, *restored_bytes))
        }
        _ => None,
    })
}

/// The persistent worker at the session's revision is not restored again for its
/// next cell (ADR 69): it reads nothing, and the interpreter state its cells set
/// (a display formatter) is live; after an undo it is restored from the revision
/// moved to, formatter included.
#[tokio::test(flavor = "multi_thread")]
async fn a_persistent_worker_at_the_revision_runs_its_next_cell_as_it_is() -> anyhow::Result<()> {
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    let mut s = services.session(false).await?;
    let formatter = "x = 1\nget_ipython().display_formatter.formatters['text/plain']\
                     .for_type(int, lambda o, p, cycle: p.text(f'INT {o}'))";
    printed(&mut s, "c1", formatter).await?;
    let mut shown = Vec::new();
    for cell in ["c2", "c3"] {
        let exec = s.fe.run(s.sid, cell, "x + 1").await?.exec_id;
        assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
        shown.push(s.events.text(exec));
        let (prepare, bytes) = started(&s, exec).ok_or_else(|| anyhow::anyhow!("{cell} has no Started event"))?;
        assert_eq!(prepare, Prepare::Persistent, "{cell}");
        assert_eq!(bytes, 0, "{cell}: the worker at the revision was restored again");
    }
    assert!(shown.iter().all(|t| t.contains("INT 2")), "the formatter is not live: {shown:?}");

    // an undo is a new revision: the next cell's worker is restored from it
    s.fe.undo(s.sid).await?;
    let exec = s.fe.run(s.sid, "c4", "x + 1").await?.exec_id;
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    let (_, bytes) = started(&s, exec).ok_or_else(|| anyhow::anyhow!("c4 has no Started event"))?;
    assert!(bytes > 0, "the cell after an undo restored nothing");
    assert!(s.events.text(exec).contains("INT 2"), "the formatter was not restored: {}", s.events.text(exec));
    Ok(())
}
