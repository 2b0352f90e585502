//! Worker and zygote processes by pid. Workers are grandchildren of the host (a
//! zygote forks them), so the host cannot wait on them: it checks, interrupts and
//! kills by pid. Each worker leads a process group of its own (it calls setsid),
//! so a signal to the group reaches what its cells started too.

use nix::sys::signal::{kill as signal_pid, killpg, Signal};
use nix::unistd::Pid;

/// Whether the process still exists (signal 0). Reaped workers are gone.
pub fn is_alive(pid: u32) -> bool {
    pid_of(pid).is_some_and(|p| signal_pid(p, None).is_ok())
}

/// SIGKILL a worker and, when it leads its own process group, every process a
/// cell started (a child must not outlive its worker and keep the slot busy). A
/// pid that is gone is fine. Workers are reaped by the kernel (their zygote
/// ignores SIGCHLD).
pub fn kill(pid: u32) {
    signal_group(pid, Signal::SIGKILL);
}

/// SIGINT a worker's process group, as jupyter_client interrupts a kernel: the
/// cell gets a KeyboardInterrupt and a `!cmd` child stops too.
pub fn interrupt(pid: u32) {
    signal_group(pid, Signal::SIGINT);
}

fn signal_group(pid: u32, signal: Signal) {
    let Some(p) = pid_of(pid) else { return };
    // A group's id is its leader's pid and lives as long as any member does, even
    // after the leader exited; a process that leads no group has no group of that
    // id (ESRCH), so this never reaches anyone else's processes. The process
    // itself is signalled only then: a second SIGINT to a worker that already
    // took the first would interrupt the cell's traceback too.
    if killpg(p, signal).is_err() {
        let _ = signal_pid(p, signal);
    }
}

fn pid_of(pid: u32) -> Option<Pid> {
    i32::try_from(pid).ok().filter(|&raw| raw > 1).map(Pid::from_raw)
}
