//! Per-worker limits through cgroups: memory and process count (never RLIMIT_AS,
//! which breaks CUDA processes: they map far more address space than they use).
//!
//! Each worker gets a cgroup of its own under `looseleaf-{host}` in the host's own
//! cgroup, for every controller it is limited by: cgroup v2 where the machine has
//! it, else the v1 `memory` and `pids` hierarchies. Processes a cell starts stay
//! in it. When a worker dies, its cgroup tells whether it hit a limit, so the cell
//! fails naming the limit instead of "the worker was lost".

use std::path::{Path, PathBuf};

/// How old an empty worker cgroup must be before a sweep removes it.
const SETTLED: std::time::Duration = std::time::Duration::from_secs(5);

/// What each worker may use (None: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Memory, in bytes.
    pub memory_bytes: Option<u64>,
    /// Processes and threads.
    pub pids: Option<u64>,
}

/// Processes and threads a worker may have unless the operator says otherwise.
pub const DEFAULT_WORKER_PIDS: u64 = 4096;

impl Limits {
    /// The limits an operator's flags ask for on a host of `slots` GPU slots: a
    /// flag not given takes its default (memory: the machine's RAM shared by the
    /// slots' workers and the session's CPU worker; processes: 4,096), and 0
    /// means unbounded (ADR 52).
    pub fn from_flags(memory_bytes: Option<u64>, pids: Option<u64>, slots: usize) -> Self {
        let memory = memory_bytes.or_else(|| total_memory().map(|m| m / (slots as u64 + 1)));
        let pids = pids.unwrap_or(DEFAULT_WORKER_PIDS);
        Self { memory_bytes: memory.filter(|b| *b > 0), pids: Some(pids).filter(|n| *n > 0) }
    }

    /// What these limits bound, in words (for the warning of a machine that cannot).
    pub fn describe(&self) -> String {
        let memory = self.memory_bytes.map(|b| format!("memory ({} MiB a worker)", b >> 20));
        let pids = self.pids.map(|n| format!("processes ({n} a worker)"));
        [memory, pids].into_iter().flatten().collect::<Vec<_>>().join(" and ")
    }
}

/// The RAM this host may use: the machine's (`MemTotal` of /proc/meminfo), or
/// less where its own cgroup or one above it is limited (a container's memory
/// limit: workers sized by the machine's RAM would take the container down).
fn total_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok();
    let kib: Option<u64> = info.as_deref().and_then(|info| {
        info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()
    });
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let limit = cgroup_memory_limit(Path::new("/sys/fs/cgroup"), &own);
    match (kib.map(|k| k * 1024), limit) {
        (Some(machine), Some(limit)) => Some(machine.min(limit)),
        (machine, limit) => machine.or(limit),
    }
}

/// The least memory limit of the cgroup `own` (/proc/self/cgroup) names and its
/// parents, under the cgroup mount `root`: `memory.max` on cgroup v2,
/// `memory.limit_in_bytes` on v1; None where none is set ("max").
fn cgroup_memory_limit(root: &Path, own: &str) -> Option<u64> {
    let (top, path, file) = match v1_path(own, "memory") {
        Some(path) => (root.join("memory"), path, "memory.limit_in_bytes"),
        None => (root.to_path_buf(), own.lines().find_map(|l| l.strip_prefix("0::"))?, "memory.max"),
    };
    let mut dir = top.join(path.trim_start_matches('/'));
    let mut least: Option<u64> = None;
    loop {
        let limit = std::fs::read_to_string(dir.join(file)).ok().and_then(|t| t.trim().parse::<u64>().ok());
        if let Some(limit) = limit {
            least = Some(least.map_or(limit, |l| l.min(limit)));
        }
        if dir == top || !dir.pop() {
            return least;
        }
    }
}

/// Why limits could not be set up or applied.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The machine lacks the controller a limit needs.
    #[error("cannot limit workers' {what}: no cgroup {what} controller is mounted (see /proc/self/cgroup)")]
    NoController {
        /// "memory" or "pids".
        what: &'static str,
    },
    /// A cgroup file could not be written.
    #[error("cgroup {path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io { path: path.display().to_string(), source }
}

/// Where this host's workers' cgroups go, per controller.
#[derive(Clone, Debug)]
enum Layout {
    /// cgroup v2: one directory for both controllers.
    V2(PathBuf),
    /// cgroup v1: one directory per hierarchy (None: not limited by it).
    V1 { memory: Option<PathBuf>, pids: Option<PathBuf> },
}

/// This host's worker cgroups.
#[derive(Clone, Debug)]
pub struct Cgroups {
    layout: Layout,
    limits: Limits,
}

impl Cgroups {
    /// Set up the parent cgroup for host `host_id`'s workers; None when `limits`
    /// limit nothing. Leftovers of an earlier run of this host are removed.
    pub fn new(host_id: &str, limits: Limits) -> Result<Option<Self>, CgroupError> {
        if limits == Limits::default() {
            return Ok(None);
        }
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let name = format!("looseleaf-{host_id}");
        let unified = Path::new("/sys/fs/cgroup/cgroup.controllers");
        let layout = if unified.exists() && v1_path(&own, "memory").is_none() {
            let own_path = own.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or("/");
            let parent = Path::new("/sys/fs/cgroup").join(own_path.trim_start_matches('/')).join(name);
            std::fs::create_dir_all(&parent).map_err(io(&parent))?;
            let control = parent.join("cgroup.subtree_control");
            let wanted = [limits.memory_bytes.map(|_| "+memory"), limits.pids.map(|_| "+pids")];
            let line = wanted.into_iter().flatten().collect::<Vec<_>>().join(" ");
            std::fs::write(&control, line).map_err(io(&control))?;
            Layout::V2(parent)
        } else {
            let hierarchy = |what: &'static str, wanted: bool| -> Result<Option<PathBuf>, CgroupError> {
                if !wanted {
                    return Ok(None);
                }
                let own_path = v1_path(&own, what).ok_or(CgroupError::NoController { what })?;
                let mount = Path::new("/sys/fs/cgroup").join(what);
                if !mount.join("cgroup.procs").exists() {
                    return Err(CgroupError::NoController { what });
                }
                let parent = mount.join(own_path.trim_start_matches('/')).join(&name);
                std::fs::create_dir_all(&parent).map_err(io(&parent))?;
                Ok(Some(parent))
            };
            Layout::V1 {
                memory: hierarchy("memory", limits.memory_bytes.is_some())?,
                pids: hierarchy("pids", limits.pids.is_some())?,
            }
        };
        let cgroups = Self { layout, limits };
        cgroups.sweep();
        Ok(Some(cgroups))
    }

    fn parents(&self) -> Vec<&PathBuf> {
        match &self.layout {
            Layout::V2(p) => vec![p],
            Layout::V1 { memory, pids } => memory.iter().chain(pids.iter()).collect(),
        }
    }

    /// Remove worker cgroups left empty (a worker's own removal can come too early,
    /// while its processes exit). Ones made in the last seconds are left alone: a
    /// worker being attached has an empty cgroup for a moment.
    pub fn sweep(&self) {
        for parent in self.parents() {
            let Ok(entries) = std::fs::read_dir(parent) else { continue };
            for e in entries.flatten() {
                let settled = e.metadata().ok().and_then(|m| m.modified().ok()).and_then(|t| t.elapsed().ok());
                if e.file_type().is_ok_and(|t| t.is_dir()) && settled.is_some_and(|age| age > SETTLED) {
                    let _ = std::fs::remove_dir(e.path()); // fails while processes remain
                }
            }
        }
    }

    /// Remove every worker cgroup that is empty, and this host's own (shutdown).
    pub fn remove_all(&self) {
        for parent in self.parents() {
            if let Ok(entries) = std::fs::read_dir(parent) {
                for e in entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
            let _ = std::fs::remove_dir(parent);
        }
    }

    /// What a zygote needs to put each spare it forks in cgroups of its own, ahead
    /// of need (JSON for its `--cgroups`): moving a process between cgroups waits
    /// for an RCU grace period (~10 ms), which a cold start must not. For each
    /// limited hierarchy: the parent, and the files to write (name, value, whether
    /// it must succeed). A spare's cgroups are `PARENT/spare-PID`.
    pub fn spare_spec(&self) -> String {
        let entry = |dir: &Path, files: Vec<(&str, u64, bool)>| serde_json::json!({ "dir": dir, "files": files });
        let mut spec = Vec::new();
        match &self.layout {
            Layout::V2(parent) => {
                let mut files = Vec::new();
                if let Some(bytes) = self.limits.memory_bytes {
                    files.extend([("memory.max", bytes, true), ("memory.swap.max", 0, false)]);
                }
                if let Some(n) = self.limits.pids {
                    files.push(("pids.max", n, true));
                }
                spec.push(entry(parent, files));
            }
            Layout::V1 { memory, pids } => {
                if let (Some(parent), Some(bytes)) = (memory, self.limits.memory_bytes) {
                    let files =
                        vec![("memory.limit_in_bytes", bytes, true), ("memory.memsw.limit_in_bytes", bytes, false)];
                    spec.push(entry(parent, files));
                }
                if let (Some(parent), Some(n)) = (pids, self.limits.pids) {
                    spec.push(entry(parent, vec![("pids.max", n, true)]));
                }
            }
        }
        serde_json::Value::Array(spec).to_string()
    }

    /// The cgroups a zygote put spare `pid` in, if it is in every one of them.
    fn spare(&self, pid: u32) -> Option<WorkerCgroup> {
        let name = format!("spare-{pid}");
        let mut cg = WorkerCgroup { dirs: Vec::new(), memory: None, pids: None, limits: self.limits };
        let mut holds = |parent: &Path| -> Option<PathBuf> {
            let dir = parent.join(&name);
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
            procs.lines().any(|l| l.trim() == pid.to_string()).then(|| {
                cg.dirs.push(dir.clone());
                dir
            })
        };
        match &self.layout {
            Layout::V2(parent) => {
                let dir = holds(parent)?;
                cg.memory = self.limits.memory_bytes.map(|_| dir.join("memory.events"));
                cg.pids = self.limits.pids.map(|_| dir.join("pids.events"));
            }
            Layout::V1 { memory, pids } => {
                if let (Some(parent), Some(_)) = (memory, self.limits.memory_bytes) {
                    cg.memory = Some(holds(parent)?.join("memory.oom_control"));
                }
                if let (Some(parent), Some(_)) = (pids, self.limits.pids) {
                    cg.pids = Some(holds(parent)?.join("pids.events"));
                }
            }
        }
        Some(cg)
    }

    /// A cgroup named `name` (one directory per limited hierarchy) with the limits.
    fn make(&self, name: &str) -> Result<WorkerCgroup, CgroupError> {
        let mut cg = WorkerCgroup { dirs: Vec::new(), memory: None, pids: None, limits: self.limits };
        let mut make = |parent: &Path| -> Result<PathBuf, CgroupError> {
            let dir = parent.join(name);
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
            cg.dirs.push(dir.clone());
            Ok(dir)
        };
        match &self.layout {
            Layout::V2(parent) => {
                let dir = make(parent)?;
                if let Some(bytes) = self.limits.memory_bytes {
                    write(&dir.join("memory.max"), bytes)?;
                    let _ = std::fs::write(dir.join("memory.swap.max"), "0"); // absent without swap accounting
                    cg.memory = Some(dir.join("memory.events"));
                }
                if let Some(n) = self.limits.pids {
                    write(&dir.join("pids.max"), n)?;
                    cg.pids = Some(dir.join("pids.events"));
                }
            }
            Layout::V1 { memory, pids } => {
                if let (Some(parent), Some(bytes)) = (memory, self.limits.memory_bytes) {
                    let dir = make(parent)?;
                    write(&dir.join("memory.limit_in_bytes"), bytes)?;
                    // swap must not let a worker past its limit (absent without swap accounting)
                    let _ = std::fs::write(dir.join("memory.memsw.limit_in_bytes"), bytes.to_string());
                    cg.memory = Some(dir.join("memory.oom_control"));
                }
                if let (Some(parent), Some(n)) = (pids, self.limits.pids) {
                    let dir = make(parent)?;
                    write(&dir.join("pids.max"), n)?;
                    cg.pids = Some(dir.join("pids.events"));
                }
            }
        }
        Ok(cg)
    }

    /// Put worker `worker_id` (process `pid`) in a cgroup of its own with the
    /// limits, unless it is a spare its zygote already put in one.
    pub fn attach(&self, worker_id: &str, pid: u32) -> Result<WorkerCgroup, CgroupError> {
        if let Some(cg) = self.spare(pid) {
            return Ok(cg);
        }
        let cg = self.make(worker_id)?;
        for dir in &cg.dirs {
            write(&dir.join("cgroup.procs"), pid)?;
        }
        Ok(cg)
    }
}

fn write(path: &Path, value: impl ToString) -> Result<(), CgroupError> {
    std::fs::write(path, value.to_string()).map_err(io(path))
}

/// The path of this process's cgroup in v1 hierarchy `what`, from /proc/self/cgroup.
fn v1_path<'a>(own: &'a str, what: &str) -> Option<&'a str> {
    own.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == what).then_some(path)
    })
}

/// One worker's cgroups; removed when dropped (once its processes are gone).
#[derive(Debug)]
pub struct WorkerCgroup {
    dirs: Vec<PathBuf>,
    /// The file that counts OOM kills.
    memory: Option<PathBuf>,
    /// The file that counts refused forks.
    pids: Option<PathBuf>,
    limits: Limits,
}

/// `name N` in a cgroup key-value file (0 if absent).
fn counter(path: &Path, name: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .find_map(|l| {
            let (key, value) = l.split_once(' ')?;
            if key == name {
                value.trim().parse().ok()
            } else {
                None
            }
        })
        .unwrap_or(0)
}

impl WorkerCgroup {
    /// The memory limit, if the kernel killed a process of this worker for it.
    pub fn memory_exceeded(&self) -> Option<u64> {
        let file = self.memory.as_ref()?;
        (counter(file, "oom_kill") > 0).then_some(self.limits.memory_bytes).flatten()
    }

    /// The process limit, if a fork of this worker's was refused for it.
    pub fn pids_exceeded(&self) -> Option<u64> {
        let file = self.pids.as_ref()?;
        (counter(file, "max") > 0).then_some(self.limits.pids).flatten()
    }
}

impl Drop for WorkerCgroup {
    fn drop(&mut self) {
        for dir in &self.dirs {
            let _ = std::fs::remove_dir(dir); // still busy: the host's sweep removes it later
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_containers_memory_limit_bounds_the_ram_workers_share() {
        let root = tempfile::tempdir().unwrap();
        // cgroup v2: the container's limit two levels up, "max" on the way
        let own = root.path().join("ctr/host");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(root.path().join("ctr/memory.max"), "17179869184\n").unwrap();
        std::fs::write(own.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_memory_limit(root.path(), "0::/ctr/host\n"), Some(16 << 30));
        // a tighter one nearer wins; none anywhere is no limit
        std::fs::write(own.join("memory.max"), "1073741824\n").unwrap();
        assert_eq!(cgroup_memory_limit(root.path(), "0::/ctr/host\n"), Some(1 << 30));
        assert_eq!(cgroup_memory_limit(root.path(), "0::/elsewhere\n"), None);
        // cgroup v1: the memory hierarchy's limit_in_bytes
        let v1 = root.path().join("memory/docker/abc");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "2147483648\n").unwrap();
        std::fs::write(root.path().join("memory/memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(cgroup_memory_limit(root.path(), "4:memory:/docker/abc\n0::/\n"), Some(2 << 30));
    }

    #[test]
    fn v1_paths_and_counters_are_read() {
        let own = "9:name=systemd:/\n8:pids:/a/b\n4:memory:/process_api/x\n3:cpu,cpuacct:/\n0::/\n";
        assert_eq!(v1_path(own, "memory"), Some("/process_api/x"));
        assert_eq!(v1_path(own, "pids"), Some("/a/b"));
        assert_eq!(v1_path(own, "cpuacct"), Some("/"));
        assert_eq!(v1_path(own, "blkio"), None);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("memory.oom_control");
        std::fs::write(&f, "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n").unwrap();
        assert_eq!(counter(&f, "oom_kill"), 2);
        assert_eq!(counter(&f, "oom_kill_disable"), 0);
        assert_eq!(counter(&f, "under_oom"), 0);
    }

    #[test]
    fn flags_not_given_take_the_defaults_and_zero_is_unbounded() {
        let ram = total_memory().expect("/proc/meminfo");
        let d = Limits::from_flags(None, None, 3);
        assert_eq!(d, Limits { memory_bytes: Some(ram / 4), pids: Some(DEFAULT_WORKER_PIDS) });
        let given = Limits::from_flags(Some(1 << 30), Some(64), 3);
        assert_eq!(given, Limits { memory_bytes: Some(1 << 30), pids: Some(64) });
        assert_eq!(given.describe(), "memory (1024 MiB a worker) and processes (64 a worker)");
        assert_eq!(Limits::from_flags(Some(0), Some(0), 3), Limits::default());
    }
}
