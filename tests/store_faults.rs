//! The store's faults heal (the Faults-that-heal issue, items 1 and 2): a full
//! store fails only the saves that need room, says which store and how much is
//! free, and takes new saves again within a minute of a session's deletion; a
//! stopped store gateway fails a cell with its message, and the next cell works
//! once it is back.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use looseleaf_client::api::ExecStatus;
use looseleaf_test_support::cluster::{bin_dir_of, Services};
use looseleaf_test_support::wait_for;

pub(crate) fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

/// A tmpfs of `mib` MiB mounted on `dir`, unmounted on drop.
pub(crate) struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    pub(crate) fn mount(dir: &Path, mib: u32) -> anyhow::Result<Self> {
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0700"),
                "looseleaf-test",
                &dir.display().to_string(),
            ])
            .status()?
            .success();
        anyhow::ensure!(ok, "mount -t tmpfs on {} failed", dir.display());
        Ok(Self(dir.to_path_buf()))
    }

    pub(crate) fn free(&self) -> u64 {
        nix::sys::statvfs::statvfs(&self.0).map_or(0, |st| st.blocks_available() * st.fragment_size())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_fails_only_large_saves_and_heals_when_a_session_is_deleted() -> anyhow::Result<()> {
    if !is_root() {
        eprintln!("skipped: mounting a small tmpfs store needs root (CI runs as root)");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("store");
    std::fs::create_dir(&store)?;
    let tmpfs = Tmpfs::mount(&store, 96)?;
    let env = [("LOOSELEAF_STORE_URL", store.display().to_string())];
    let services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &env).await?;

    // fill it: 16 MiB of random bytes a cell, until a save is refused
    let mut filler = services.session(false).await?;
    let mut refused = None;
    for i in 0..8 {
        let (status, error, _) =
            filler.run(&format!("fill{i}"), &format!("b{i} = __import__('os').urandom(16 << 20)")).await?;
        if status != ExecStatus::Ok {
            refused = error;
            break;
        }
    }
    let refused = refused.expect("96 MiB cannot hold 8 x 16 MiB");
    assert!(refused.contains("is full") && refused.contains(&store.display().to_string()), "{refused}");
    assert!(refused.contains("bytes free"), "{refused}");

    // a cell that adds nothing large still saves, in the full session and a new one
    let (status, error, out) = filler.run("small", "print(len(b0))").await?;
    assert_eq!((status, error), (ExecStatus::Ok, None), "{out}");
    assert!(out.contains(&(16u64 << 20).to_string()), "{out}");
    let mut other = services.session(false).await?;
    let (status, error, _) = other.run("one", "x = 41\nprint('small')").await?;
    assert_eq!((status, error), (ExecStatus::Ok, None));
    let (status, _, _) = other.run("big", "big = __import__('os').urandom(16 << 20)").await?;
    assert_eq!(status, ExecStatus::Failed, "a large save still does not fit");

    // deleting the full session frees its chunks (they are minutes young: not
    // the hourly collector's doing), and large saves fit again
    let before = tmpfs.free();
    filler.fe.delete(filler.sid).await?;
    let freed =
        tokio::task::block_in_place(|| wait_for(Duration::from_secs(90), || tmpfs.free() > before + (32 << 20)));
    assert!(freed.is_ok(), "deleting the session freed {} bytes", tmpfs.free().saturating_sub(before));
    let (status, error, _) = other.run("big", "big = __import__('os').urandom(16 << 20)\nprint(x + 1)").await?;
    assert_eq!((status, error), (ExecStatus::Ok, None));
    let (_, _, out) = other.run("check", "print(len(big), x)").await?;
    assert!(out.contains(&format!("{} 41", 16u64 << 20)), "{out}");
    drop(services);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_store_fails_the_cell_with_its_message_and_the_next_works_once_back() -> anyhow::Result<()> {
    let mut services = Services::start(&bin_dir_of(env!("CARGO_BIN_EXE_looseleaf")), &[1], &[]).await?;
    let mut s = services.session(true).await?;
    let (status, _, _) = s.run("a", "x = 1").await?;
    assert_eq!(status, ExecStatus::Ok);

    services.kill("looseleaf-store")?;
    let started = std::time::Instant::now();
    let (status, error, _) = s.run("b", "y = x + 1").await?;
    eprintln!("with the store stopped, the cell failed after {:?}", started.elapsed());
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("store"), "the failure names the store: {error}");

    services.restart("looseleaf-store")?;
    let (status, error, out) = s.run("c", "print(x + 2)").await?;
    assert_eq!((status, error), (ExecStatus::Ok, None));
    assert!(out.contains('3'), "{out}");
    Ok(())
}
