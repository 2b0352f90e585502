//! What a user may ask for: a working directory under the operator's root, a
//! bounded number of sessions, a bounded run queue per session. A session runs one
//! cell at a time, so the session limit also bounds a user's concurrent cells.

use std::path::{Component, Path, PathBuf};

/// Runs a session may have queued by default (a notebook's worth, many times over).
pub const DEFAULT_QUEUED_RUNS: usize = 1000;

/// The operator's limits.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Working directories must lie under this (None: anywhere).
    pub cwd_root: Option<PathBuf>,
    /// Sessions one user may hold, culled ones included (None: any number).
    pub sessions_per_user: Option<usize>,
    /// Runs one session may have waiting behind the running one.
    pub queued_runs: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { cwd_root: None, sessions_per_user: None, queued_runs: DEFAULT_QUEUED_RUNS }
    }
}

impl Limits {
    /// Why `cwd` may not be a session's working directory, if it may not: it must be
    /// absolute, name no `..`, and lie under the root. Where the path exists here
    /// (the frontend shares the hosts' file system, as with `looseleaf up`) its
    /// symlinks are resolved first, so a link cannot lead out of the root.
    pub fn check_cwd(&self, cwd: &str) -> Result<(), String> {
        let path = Path::new(cwd);
        if !path.is_absolute() {
            return Err(format!("working directory {cwd:?} is not an absolute path"));
        }
        if path.components().any(|c| c == Component::ParentDir) {
            return Err(format!("working directory {cwd:?} names '..'"));
        }
        let Some(root) = &self.cwd_root else { return Ok(()) };
        let root = root.canonicalize().unwrap_or_else(|_| root.clone());
        let resolved = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        if resolved.starts_with(&root) {
            Ok(())
        } else {
            Err(format!("working directory {cwd:?} is not under {} (the frontend's --cwd-root)", root.display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_absolute_directories_under_the_root_are_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("users");
        std::fs::create_dir_all(root.join("ada")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("ada/out")).unwrap();
        let limits = Limits { cwd_root: Some(root.clone()), ..Default::default() };
        let under = root.join("ada");
        assert_eq!(limits.check_cwd(under.to_str().unwrap()), Ok(()));
        // not made yet: judged by its name
        assert_eq!(limits.check_cwd(root.join("bob/new").to_str().unwrap()), Ok(()));
        let e = limits.check_cwd("/etc").unwrap_err();
        assert!(e.contains("not under") && e.contains("--cwd-root"), "{e}");
        let e = limits.check_cwd(root.join("ada/out").to_str().unwrap()).unwrap_err();
        assert!(e.contains("not under"), "a symlink out of the root: {e}");
        let e = limits.check_cwd(&format!("{}/ada/../../x", root.display())).unwrap_err();
        assert!(e.contains("'..'"), "{e}");
        assert!(limits.check_cwd("relative/dir").unwrap_err().contains("not an absolute path"));
        // without a root, any absolute directory
        assert_eq!(Limits::default().check_cwd("/etc"), Ok(()));
    }
}
