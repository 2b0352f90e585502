//! Simulated GPU hosts and their provisioning. Each host's GPUs are the gpu-host's
//! own [`Slots`] on the simulation's clock. Hosts are powered on and off by
//! NotebookOS's autoscaler (notebookos-policies.md, "Autoscaling") for every
//! policy, so GPU-hours compare policies, not provisioning.

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use looseleaf_gpu_host::gpus::Gpu;
use looseleaf_gpu_host::host::slots::Slots;
use schemas::clock::Clock;
use serde::Serialize;

/// The simulation's clock: seconds since the start, shared by everything that
/// reads time (the hosts' slots).
#[derive(Clone)]
pub struct SimClock {
    base: Instant,
    now_s: Rc<Cell<f64>>,
}

impl SimClock {
    /// A clock at 0.
    pub fn new() -> Self {
        Self { base: Instant::now(), now_s: Rc::new(Cell::new(0.0)) }
    }

    /// Seconds since the start.
    pub fn seconds(&self) -> f64 {
        self.now_s.get()
    }

    /// Move to `t` seconds (never back).
    pub fn set(&self, t: f64) {
        self.now_s.set(self.now_s.get().max(t));
    }
}

impl Default for SimClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        self.base + Duration::from_secs_f64(self.now_s.get())
    }
}

/// A host's power.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Power {
    /// Not provisioned.
    Off,
    /// Provisioned, usable from `ready_at`.
    Booting {
        /// When it is up.
        ready_at: f64,
    },
    /// Usable.
    On,
    /// Being released; provisioned until `off_at`.
    Stopping {
        /// When it is off.
        off_at: f64,
    },
}

/// One host.
pub struct Host {
    /// Its name (`host-N`).
    pub name: String,
    /// Its power.
    pub power: Power,
    /// Its GPUs.
    pub slots: Slots<SimClock>,
    /// Since when it is provisioned (booting, on or stopping).
    pub on_since: f64,
}

impl Host {
    /// Usable now.
    pub fn is_on(&self) -> bool {
        self.power == Power::On
    }

    /// Slots in use.
    pub fn held(&self) -> u32 {
        self.slots.len() - self.slots.free_count()
    }
}

/// NotebookOS's autoscaler settings.
#[derive(Clone, Debug, Serialize)]
pub struct Autoscaler {
    /// GPUs per host.
    pub gpus_per_host: u32,
    /// Scale-out target = ceil(load x this / GPUs per host).
    pub scaling_factor: f64,
    /// Scale-in limit = ceil(load x this / GPUs per host).
    pub scaling_limit: f64,
    /// Seconds between checks.
    pub interval_s: f64,
    /// Ratio samples taken before the first check.
    pub samples_before_first: u32,
    /// Hosts released at most per operation.
    pub scale_in_per_op: u32,
    /// The minimum capacity (hosts).
    pub min_hosts: u32,
    /// Hosts kept above it for fluctuation.
    pub buffer_hosts: u32,
    /// Hosts on at the start.
    pub initial_hosts: u32,
    /// Host boot: normal mean and std (s).
    pub boot_s: (f64, f64),
    /// Host release: normal mean and std (s).
    pub stop_s: (f64, f64),
    /// No autoscaling: `initial_hosts` stay on (a fixed cluster, as in validation).
    pub fixed: bool,
}

impl Autoscaler {
    /// The EC2 deployment's settings (notebookos-policies.md, "Configurations").
    pub fn ec2() -> Self {
        Self {
            gpus_per_host: 8,
            scaling_factor: 1.05,
            scaling_limit: 1.1,
            interval_s: 30.0,
            samples_before_first: 5,
            scale_in_per_op: 2,
            min_hosts: 4,
            buffer_hosts: 3,
            initial_hosts: 4,
            boot_s: (8.0, 2.0),
            stop_s: (6.0, 1.0),
            fixed: false,
        }
    }

    /// The EC2 settings without the reserved floor (min 4 + buffer 3 hosts = 56
    /// GPUs), which would otherwise decide every policy's GPU-hours at these loads
    /// (ADR 50): at least one host stays on.
    pub fn ec2_without_floor() -> Self {
        Self { min_hosts: 1, buffer_hosts: 0, initial_hosts: 1, ..Self::ec2() }
    }

    /// A fixed cluster of `hosts` hosts of `gpus` GPUs.
    pub fn fixed(hosts: u32, gpus: u32) -> Self {
        Self {
            gpus_per_host: gpus,
            initial_hosts: hosts,
            min_hosts: hosts,
            buffer_hosts: 0,
            fixed: true,
            ..Self::ec2()
        }
    }

    /// Hosts to scale out to for `load` committed GPUs.
    pub fn scale_out_target(&self, load: u32) -> u32 {
        let want = (load as f64 * self.scaling_factor / self.gpus_per_host as f64).ceil() as u32;
        want.max(self.min_hosts + self.buffer_hosts)
    }

    /// Hosts that may stay after a scale-in for `load` committed GPUs.
    pub fn scale_in_limit(&self, load: u32) -> u32 {
        let limit = (load as f64 * self.scaling_limit / self.gpus_per_host as f64).ceil() as u32;
        if limit < self.min_hosts {
            self.min_hosts + self.buffer_hosts
        } else {
            limit
        }
    }
}

/// The hosts and their provisioning record.
pub struct Cluster {
    /// Every host ever provisioned.
    pub hosts: Vec<Host>,
    /// The autoscaler's settings.
    pub autoscaler: Autoscaler,
    /// When the scaling operation in flight ends (one at a time).
    pub op_until: Option<f64>,
    /// Host-seconds provisioned by hosts already off.
    pub off_host_seconds: f64,
    /// GPU-slot seconds of holds already released (what [`Slots::release`] said).
    pub released_slot_seconds: f64,
    clock: SimClock,
}

impl Cluster {
    /// `autoscaler.initial_hosts` hosts on at time 0.
    pub fn new(autoscaler: Autoscaler, clock: SimClock) -> Self {
        let mut c = Self {
            hosts: vec![],
            autoscaler,
            op_until: None,
            off_host_seconds: 0.0,
            released_slot_seconds: 0.0,
            clock,
        };
        for _ in 0..c.autoscaler.initial_hosts {
            let h = c.add_host();
            c.hosts[h].power = Power::On;
        }
        c
    }

    fn add_host(&mut self) -> usize {
        let gpus = (0..self.autoscaler.gpus_per_host)
            .map(|index| Gpu { index, name: "simulated".into(), memory_bytes: 0 })
            .collect();
        self.hosts.push(Host {
            name: format!("host-{}", self.hosts.len()),
            power: Power::Off,
            slots: Slots::with_clock(gpus, self.clock.clone()),
            on_since: self.clock.seconds(),
        });
        self.hosts.len() - 1
    }

    /// Hosts provisioned (booting, on, stopping).
    pub fn provisioned(&self) -> u32 {
        self.hosts.iter().filter(|h| h.power != Power::Off).count() as u32
    }

    /// Hosts on or booting: what a scale-out counts.
    pub fn on_or_booting(&self) -> u32 {
        self.hosts.iter().filter(|h| matches!(h.power, Power::On | Power::Booting { .. })).count() as u32
    }

    /// Committed GPUs: slots in use on any host.
    pub fn load(&self) -> u32 {
        self.hosts.iter().map(Host::held).sum()
    }

    /// Start booting `n` hosts (reusing hosts that are off) as one operation that
    /// lasts the longest boot; `boot` draws a boot time. Returns the time they are up.
    pub fn scale_out(&mut self, n: u32, mut boot: impl FnMut() -> f64) -> Option<f64> {
        if n == 0 || self.op_until.is_some() || self.autoscaler.fixed {
            return None;
        }
        let now = self.clock.seconds();
        let longest = (0..n).map(|_| boot()).fold(0.0, f64::max);
        let ready_at = now + longest;
        for _ in 0..n {
            let h = match self.hosts.iter().position(|h| h.power == Power::Off) {
                Some(h) => h,
                None => self.add_host(),
            };
            self.hosts[h].power = Power::Booting { ready_at };
            self.hosts[h].on_since = now;
        }
        self.op_until = Some(ready_at);
        Some(ready_at)
    }

    /// Release `hosts` (each fully idle) as one operation lasting the longest of
    /// `stop` draws. Returns when they are off.
    pub fn scale_in(&mut self, hosts: &[usize], mut stop: impl FnMut() -> f64) -> Option<f64> {
        if hosts.is_empty() || self.op_until.is_some() {
            return None;
        }
        let off_at = self.clock.seconds() + hosts.iter().map(|_| stop()).fold(0.0, f64::max);
        for &h in hosts {
            self.hosts[h].power = Power::Stopping { off_at };
        }
        self.op_until = Some(off_at);
        Some(off_at)
    }

    /// The operation that ends now is done: booting hosts are on, stopping ones
    /// off. Returns the hosts that came on.
    pub fn op_done(&mut self) -> Vec<usize> {
        let now = self.clock.seconds();
        self.op_until = None;
        let mut up = vec![];
        for (i, h) in self.hosts.iter_mut().enumerate() {
            match h.power {
                Power::Booting { .. } => {
                    h.power = Power::On;
                    up.push(i);
                }
                Power::Stopping { .. } => {
                    h.power = Power::Off;
                    self.off_host_seconds += now - h.on_since;
                }
                _ => {}
            }
        }
        up
    }

    /// Free `slots` of `host`, adding their held time to the record.
    pub fn release(&mut self, host: usize, slots: &[u32]) {
        for &s in slots {
            if let Some(ms) = self.hosts[host].slots.release(s) {
                self.released_slot_seconds += ms / 1000.0;
            }
        }
    }

    /// Host-seconds provisioned up to now.
    pub fn host_seconds(&self) -> f64 {
        let now = self.clock.seconds();
        self.off_host_seconds
            + self.hosts.iter().filter(|h| h.power != Power::Off).map(|h| now - h.on_since).sum::<f64>()
    }

    /// Slots held now (not yet released).
    pub fn held_now(&self) -> u32 {
        self.load()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use looseleaf_gpu_host::host::slots::SlotState;
    use uuid::Uuid;

    #[test]
    fn the_autoscaler_targets_follow_notebookos() {
        let a = Autoscaler::ec2();
        // the floor: min 4 + buffer 3
        assert_eq!(a.scale_out_target(0), 7);
        assert_eq!(a.scale_out_target(72), 10); // ceil(72 x 1.05 / 8)
        assert_eq!(a.scale_in_limit(0), 7);
        assert_eq!(a.scale_in_limit(40), 6); // ceil(40 x 1.1 / 8)
        let b = Autoscaler::ec2_without_floor();
        assert_eq!((b.scale_out_target(0), b.scale_out_target(9)), (1, 2));
    }

    #[test]
    fn hosts_count_from_boot_to_off_and_slots_count_while_held() {
        let clock = SimClock::new();
        let mut c = Cluster::new(Autoscaler::ec2_without_floor(), clock.clone());
        assert_eq!(c.provisioned(), 1);
        let (exec, session) = (Uuid::nil(), Uuid::nil());
        c.hosts[0].slots.take(&[0, 1], SlotState::Busy { exec, session });
        assert_eq!(c.load(), 2);
        clock.set(10.0);
        let up = c.scale_out(2, || 8.0);
        assert_eq!(up, Some(18.0));
        assert!(c.scale_out(1, || 1.0).is_none(), "one operation at a time");
        clock.set(18.0);
        assert_eq!(c.op_done().len(), 2);
        c.release(0, &[0, 1]);
        assert!((c.released_slot_seconds - 36.0).abs() < 1e-6, "{}", c.released_slot_seconds);
        clock.set(20.0);
        c.scale_in(&[1, 2], || 6.0);
        clock.set(26.0);
        c.op_done();
        // host 0: 26 s; hosts 1 and 2: 10..26 each
        assert!((c.host_seconds() - (26.0 + 16.0 + 16.0)).abs() < 1e-6, "{}", c.host_seconds());
    }
}
