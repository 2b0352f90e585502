//! Stopping cells: the user's interrupt and the cell timeout.
//!
//! An interrupt of an execution that has not started on this host keeps it from
//! ever starting; one that runs gets SIGINT on its worker's process group (the
//! cell sees a KeyboardInterrupt, as in a kernel) once the worker said the run
//! started (before that the worker would not see the signal as the cell's), and
//! its whole group is killed if it has not ended after the grace period.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// How long an interrupt is remembered (a run recipe that arrives later still
/// never starts).
const MEMORY: Duration = Duration::from_secs(600);

#[derive(Debug, Default)]
struct Entry {
    /// When the user asked (None: running, not asked).
    asked: Option<Instant>,
    /// The worker running it, once it said the run started.
    pid: Option<u32>,
    /// The grace period passed and the worker was killed.
    killed: bool,
}

/// The interrupts and running cells of one host.
#[derive(Clone, Debug)]
pub struct Interrupts {
    entries: Arc<Mutex<HashMap<Uuid, Entry>>>,
    grace: Duration,
}

impl Interrupts {
    /// Cells that ignore an interrupt are killed `grace` after it.
    pub fn new(grace: Duration) -> Self {
        Self { entries: Default::default(), grace }
    }

    /// How long a cell may ignore an interrupt.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The user interrupted `exec`: signal it if it runs here.
    pub fn ask(&self, exec: Uuid) {
        let pid = {
            let mut entries = self.lock();
            let now = Instant::now();
            entries.retain(|_, e| e.pid.is_some() || e.asked.is_some_and(|at| now - at < MEMORY));
            let e = entries.entry(exec).or_default();
            if e.asked.is_some() {
                return; // asked twice: the first one's grace period holds
            }
            e.asked = Some(now);
            e.pid
        };
        if let Some(pid) = pid {
            self.signal(exec, pid);
        }
    }

    /// Whether the user interrupted `exec` (then it must not start).
    pub fn asked(&self, exec: Uuid) -> bool {
        self.lock().get(&exec).is_some_and(|e| e.asked.is_some())
    }

    /// Worker `pid` said run `exec` started; signalled at once if it was
    /// interrupted meanwhile.
    pub fn started(&self, exec: Uuid, pid: u32) {
        let asked = {
            let mut entries = self.lock();
            let e = entries.entry(exec).or_default();
            e.pid = Some(pid);
            e.asked.is_some()
        };
        if asked {
            self.signal(exec, pid);
        }
    }

    /// Run `exec` ended (however); returns whether its worker was killed because it
    /// ignored an interrupt.
    pub fn ended(&self, exec: Uuid) -> bool {
        let mut entries = self.lock();
        let killed = entries.get(&exec).is_some_and(|e| e.killed);
        match entries.get_mut(&exec) {
            // remembered, so that a second run recipe for it never starts
            Some(e) if e.asked.is_some() => e.pid = None,
            Some(_) => {
                entries.remove(&exec);
            }
            None => {}
        }
        killed
    }

    fn signal(&self, exec: Uuid, pid: u32) {
        tracing::info!(%exec, pid, "interrupting a cell");
        crate::process::interrupt(pid);
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(this.grace).await;
            let still = {
                let mut entries = this.lock();
                match entries.get_mut(&exec) {
                    Some(e) if e.pid == Some(pid) => {
                        e.killed = true;
                        true
                    }
                    _ => false,
                }
            };
            if still {
                tracing::warn!(%exec, pid, grace = ?this.grace, "the cell ignored the interrupt; killing its worker");
                crate::process::kill(pid);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_interrupt_before_the_start_is_remembered_and_a_finished_run_forgotten() {
        let i = Interrupts::new(Duration::from_secs(5));
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        i.ask(a);
        assert!(i.asked(a));
        assert!(!i.asked(b));
        i.started(b, u32::MAX); // not a real pid: never signalled
        assert!(!i.ended(b));
        assert!(i.lock().get(&b).is_none());
        assert!(!i.ended(a));
        assert!(i.asked(a), "an interrupted run stays interrupted");
    }

    #[tokio::test]
    async fn a_cell_that_ignores_the_interrupt_is_killed_with_its_group_after_the_grace_period() {
        use std::os::unix::process::CommandExt;
        // a worker that ignores SIGINT, leading its group, with a child of its own
        let mut worker = std::process::Command::new("sh")
            .args(["-c", "trap '' INT; sleep 60 & echo $!; wait"])
            .process_group(0)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = worker.id();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(worker.stdout.take().unwrap()), &mut line).unwrap();
        let child: u32 = line.trim().parse().unwrap();
        let i = Interrupts::new(Duration::from_millis(300));
        let exec = Uuid::now_v7();
        i.started(exec, pid);
        i.ask(exec);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(worker.try_wait().unwrap().is_none(), "it ignores SIGINT");
        let status = tokio::task::spawn_blocking(move || worker.wait()).await.unwrap().unwrap();
        assert!(!status.success());
        assert!(i.ended(exec), "killed after the grace period");
        // the child went with the group (gone, or a zombie nobody reaped yet)
        let mut gone = false;
        for _ in 0..50 {
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
            gone = stat.is_empty() || stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'));
            if gone {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(gone, "the child of the killed worker is left running");
    }
}
