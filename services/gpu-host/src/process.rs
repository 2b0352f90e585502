//! Worker and zygote processes by pid. Workers are grandchildren of the host (a
//! zygote forks them), so the host cannot wait on them: it checks and kills by pid.

/// Whether the process still exists (signal 0). Reaped workers are gone.
pub fn is_alive(pid: u32) -> bool {
    use nix::unistd::Pid;
    let Ok(raw) = i32::try_from(pid) else { return false };
    raw > 1 && nix::sys::signal::kill(Pid::from_raw(raw), None).is_ok()
}

/// SIGKILL a worker by pid. Workers are grandchildren (forked by a zygote that
/// ignores SIGCHLD, so the kernel reaps them); a pid that is gone is fine.
pub fn kill(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let Ok(raw) = i32::try_from(pid) else { return };
    if raw > 1 {
        let _ = kill(Pid::from_raw(raw), Signal::SIGKILL);
    }
}
