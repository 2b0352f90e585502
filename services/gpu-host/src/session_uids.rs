//! A uid of its own for each session's workers (ADR 29), where the host runs as
//! root and the operator gives a range (`--session-uids FIRST-LAST`): a cell then
//! cannot read another session's files or restore files, the host's data (the
//! manifest key, the store directory), or signal the services' processes.
//!
//! Uids are handed out per host, lowest free first, and taken back when the
//! session is deleted or culled here. The gid is the uid; workers keep no
//! supplementary groups.

use std::collections::HashMap;
use std::sync::Mutex;

use uuid::Uuid;

/// Why session uids cannot be used as configured.
#[derive(Debug, thiserror::Error)]
pub enum UidError {
    /// The range is not `FIRST-LAST` with 0 < FIRST <= LAST.
    #[error("--session-uids {0:?} is not a range FIRST-LAST of uids above 0")]
    Range(String),
    /// Only root can run workers as other users.
    #[error("--session-uids needs the gpu-host to run as root (it runs as uid {0}, not root)")]
    NotRoot(u32),
    /// The range lies outside the uids this user namespace maps.
    #[error("uids {0} are not mapped in this user namespace (/proc/self/uid_map): name a range it maps")]
    Unmapped(String),
    /// Every uid of the range is taken by a session on this host.
    #[error("every session uid of {first}-{last} is taken by a session on this host; widen --session-uids")]
    Exhausted {
        /// The range's first uid.
        first: u32,
        /// Its last.
        last: u32,
    },
}

/// The uids this host gives sessions' workers.
#[derive(Debug)]
pub struct SessionUids {
    first: u32,
    last: u32,
    /// Sessions' uids, and the uid handed out last (the next search starts after
    /// it, so a released uid goes to a new session as late as possible).
    assigned: Mutex<(HashMap<Uuid, u32>, u32)>,
}

impl SessionUids {
    /// The range `FIRST-LAST` (checked: the host must be root to use it).
    pub fn new(range: &str) -> Result<Self, UidError> {
        let bad = || UidError::Range(range.to_string());
        let (first, last) = range.split_once('-').ok_or_else(bad)?;
        let (first, last): (u32, u32) =
            (first.trim().parse().map_err(|_| bad())?, last.trim().parse().map_err(|_| bad())?);
        if first == 0 || first > last {
            return Err(bad());
        }
        let euid = effective_uid();
        if euid != 0 {
            return Err(UidError::NotRoot(euid));
        }
        if !mapped(&std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default(), first, last) {
            return Err(UidError::Unmapped(range.to_string()));
        }
        Ok(Self { first, last, assigned: Mutex::new((HashMap::new(), last)) })
    }

    /// The uid of `session`'s workers on this host (the same for all of them).
    pub fn of(&self, session: Uuid) -> Result<u32, UidError> {
        let mut guard = self.assigned.lock().unwrap_or_else(|e| e.into_inner());
        let (assigned, last_given) = &mut *guard;
        if let Some(uid) = assigned.get(&session) {
            return Ok(*uid);
        }
        let taken: std::collections::HashSet<u32> = assigned.values().copied().collect();
        let after = (last_given.saturating_add(1)..=self.last).chain(self.first..=*last_given);
        let uid = after
            .into_iter()
            .find(|u| !taken.contains(u))
            .ok_or(UidError::Exhausted { first: self.first, last: self.last })?;
        assigned.insert(session, uid);
        *last_given = uid;
        drop(guard);
        clear_private_dirs(uid); // what an earlier session of this uid left (a crash, say)
        Ok(uid)
    }

    /// `session` has no workers here any more: its uid may go to another session,
    /// which must not find this one's home or temporary files (ADR 52).
    pub fn release(&self, session: Uuid) {
        let uid = self.assigned.lock().unwrap_or_else(|e| e.into_inner()).0.remove(&session);
        if let Some(uid) = uid {
            clear_private_dirs(uid);
        }
    }
}

/// Remove uid `uid`'s home and temporary directory (the worker makes them anew).
fn clear_private_dirs(uid: u32) {
    for name in ["home", "tmp"] {
        let dir = std::env::temp_dir().join(format!("looseleaf-{name}-{uid}"));
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %dir.display(), error = %e, "could not clear a session uid's files");
            }
        }
    }
}

/// Whether `uid_map` (of /proc/self; empty: no user namespace) maps every uid of
/// `first..=last`.
fn mapped(uid_map: &str, first: u32, last: u32) -> bool {
    uid_map.trim().is_empty()
        || uid_map.lines().any(|l| {
            let n: Vec<u64> = l.split_whitespace().filter_map(|w| w.parse().ok()).collect();
            n.len() == 3 && n[0] <= u64::from(first) && u64::from(last) < n[0] + n[2]
        })
}

impl SessionUids {
    /// `FIRST-LAST` cut into `parts` ranges that share no uid, the `i`th of them:
    /// hosts that share files (one machine, or volumes) must never give two
    /// sessions one uid.
    pub fn split(range: &str, parts: u32, i: u32) -> Result<String, UidError> {
        let bad = || UidError::Range(range.to_string());
        let (first, last) = range.split_once('-').ok_or_else(bad)?;
        let (first, last): (u32, u32) =
            (first.trim().parse().map_err(|_| bad())?, last.trim().parse().map_err(|_| bad())?);
        let size = (last.saturating_sub(first) + 1) / parts.max(1);
        if first == 0 || first > last || size == 0 {
            return Err(bad());
        }
        let start = first + size * i;
        Ok(format!("{start}-{}", start + size - 1))
    }
}

/// This process's effective uid (`/proc/self` belongs to it).
fn effective_uid() -> u32 {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_session_gets_its_own_uid_until_released() {
        if effective_uid() != 0 {
            assert!(matches!(SessionUids::new("1000-1001"), Err(UidError::NotRoot(_))));
            return;
        }
        for bad in ["", "5", "0-10", "10-5", "a-b"] {
            assert!(matches!(SessionUids::new(bad), Err(UidError::Range(_))), "{bad}");
        }
        let uids = SessionUids::new("7000-7001").unwrap();
        let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let (ua, ub) = (uids.of(a).unwrap(), uids.of(b).unwrap());
        assert_ne!(ua, ub);
        assert_eq!(uids.of(a).unwrap(), ua, "stable for a session");
        assert!(matches!(uids.of(c), Err(UidError::Exhausted { .. })));
        uids.release(a);
        assert_eq!(uids.of(c).unwrap(), ua, "a released uid is given again");
    }

    #[test]
    fn ranges_split_apart_and_maps_are_read() {
        assert_eq!(SessionUids::split("1000-1999", 2, 0).unwrap(), "1000-1499");
        assert_eq!(SessionUids::split("1000-1999", 2, 1).unwrap(), "1500-1999");
        assert!(SessionUids::split("1000-1000", 2, 0).is_err());
        assert!(mapped("", 5, 10), "no user namespace");
        assert!(mapped("         0          0 4294967295\n", 200000, 201999));
        assert!(!mapped("         0     100000      65536\n", 200000, 201999));
    }
}
