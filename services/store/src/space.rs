//! The store's volume (a local directory store only; an S3 bucket has no free
//! space to speak of): how much is free, when garbage collection must run at once,
//! and which saves still fit (ADR 54).
//!
//! Below `--gc-free-bytes` free (default: 5% of the volume or 2 GiB, whichever is
//! smaller) the gateway collects at once instead of waiting for its schedule. A
//! save is admitted only if it leaves half of that threshold free; the other half
//! is the reserve for small saves (a cell's ambient state and its manifest, under
//! [`SMALL_SAVE_BYTES`]), so a cell that changes no large variable still succeeds
//! on a store that large saves have filled.

use std::path::{Path, PathBuf};
use std::time::Duration;

use uuid::Uuid;

use crate::manifests::ManifestError;

/// A save that adds at most this many bytes may use the reserve.
pub const SMALL_SAVE_BYTES: u64 = 1 << 20;

/// How often the gateway looks at the free space when nothing wakes it sooner.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);

/// The default threshold is the smaller of this share of the volume...
const DEFAULT_SHARE_PERCENT: u64 = 5;
/// ...and this many bytes.
const DEFAULT_MAX_BYTES: u64 = 2 << 30;

/// Free and total bytes of a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Space {
    /// Bytes an unprivileged writer may still use.
    pub free: u64,
    /// The volume's size.
    pub total: u64,
}

/// The local directory a store URL names (None for a bucket).
pub fn local_dir(store_url: &str) -> Option<PathBuf> {
    if store_url.contains("://") {
        return store_url.strip_prefix("file://").map(PathBuf::from);
    }
    Some(PathBuf::from(store_url))
}

/// Free and total bytes of the volume holding `dir`.
pub fn space_of(dir: &Path) -> std::io::Result<Space> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    let unit = st.fragment_size() as u64;
    Ok(Space { free: st.blocks_available() as u64 * unit, total: st.blocks() as u64 * unit })
}

/// The free space below which the store collects garbage at once: `configured`, or
/// 5% of the volume or 2 GiB, whichever is smaller.
pub fn threshold(configured: Option<u64>, total: u64) -> u64 {
    configured.unwrap_or_else(|| (total / 100 * DEFAULT_SHARE_PERCENT).min(DEFAULT_MAX_BYTES))
}

/// The store's volume and what the gateway does about it filling up.
#[derive(Debug)]
pub struct Volume {
    dir: PathBuf,
    configured: Option<u64>,
    wake: tokio::sync::Notify,
}

impl Volume {
    /// The volume of the store at `store_url`, if it is a local directory;
    /// `gc_free_bytes`: the threshold (None: the default).
    pub fn of(store_url: &str, gc_free_bytes: Option<u64>) -> Option<Self> {
        let dir = local_dir(store_url)?;
        Some(Self { dir, configured: gc_free_bytes, wake: tokio::sync::Notify::new() })
    }

    /// Its space now.
    pub fn space(&self) -> std::io::Result<Space> {
        space_of(&self.dir)
    }

    /// The free space below which it collects, for a volume of `total` bytes.
    pub fn threshold(&self, total: u64) -> u64 {
        threshold(self.configured, total)
    }

    /// Whether free space is below the threshold (and what it is).
    pub fn pressed(&self) -> Option<Space> {
        let space = self.space().ok()?;
        (space.free < threshold(self.configured, space.total)).then_some(space)
    }

    /// An error if a save of `session` that adds about `growth` bytes does not fit
    /// (see the module docs); a refusal also wakes the collector.
    pub fn admit(&self, session: Uuid, growth: u64) -> Result<(), ManifestError> {
        // an unreadable volume is the put's problem, not a refusal
        let Ok(space) = self.space() else { return Ok(()) };
        let reserve = if growth <= SMALL_SAVE_BYTES { 0 } else { threshold(self.configured, space.total) / 2 };
        if space.free >= growth.saturating_add(reserve) {
            return Ok(());
        }
        self.wake.notify_one();
        Err(ManifestError::StoreFull {
            session,
            store: self.dir.display().to_string(),
            free: space.free,
            total: space.total,
            needed: growth,
        })
    }

    /// Wake the collector now (a refused save, a write that found the disk full).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Wait until woken or [`CHECK_EVERY`] has passed.
    pub async fn woken_or_due(&self) {
        let _ = tokio::time::timeout(CHECK_EVERY, self.wake.notified()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_threshold_is_five_percent_up_to_two_gib() {
        assert_eq!(threshold(None, 100 << 20), 5 << 20);
        assert_eq!(threshold(None, 1 << 40), 2 << 30);
        assert_eq!(threshold(Some(7), 1 << 40), 7);
    }

    #[test]
    fn only_local_stores_have_a_volume() {
        assert_eq!(local_dir("file:///data/store"), Some(PathBuf::from("/data/store")));
        assert_eq!(local_dir("/data/store"), Some(PathBuf::from("/data/store")));
        assert_eq!(local_dir("s3://bucket/prefix"), None);
    }

    #[test]
    fn a_large_save_is_refused_before_the_reserve_and_a_small_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let free = space_of(dir.path()).unwrap().free;
        // a threshold of all the free space: the reserve is half of it
        let volume = Volume::of(&dir.path().display().to_string(), Some(free)).unwrap();
        let sid = Uuid::nil();
        let err = volume.admit(sid, free / 2 + (64 << 20)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&dir.path().display().to_string()) && msg.contains("bytes free"), "{msg}");
        assert!(volume.admit(sid, SMALL_SAVE_BYTES).is_ok());
        assert!(volume.admit(sid, u64::MAX).is_err());
    }
}
