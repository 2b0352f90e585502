//! `notebookos`: NotebookOS's `static` policy as `../shared/anchors/notebookos-policies.md`
//! summarises it from its source. Each kernel has 3 replicas on distinct hosts,
//! which subscribe GPUs (oversubscribed by the cluster ratio) without holding
//! them; a GPU is committed only while a cell runs, on a replica's host with idle
//! GPUs, else a replica migrates (with its cost) to a host that has them, else
//! the cluster scales out. Where this simplifies the design is ADR 50.

use std::collections::{BTreeMap, VecDeque};

use super::{busy, secs, session_gpus, take};
use crate::engine::{Policy, Sim};

/// Replicas per kernel.
const REPLICAS: usize = 3;
/// The cluster ratio before any sample (max-subscribed-ratio).
const INITIAL_RATIO: f64 = 7.0;
/// Ratio samples in the moving average.
const RATIO_SAMPLES: usize = 5;
/// A host with more replicas than this is not released.
const MAX_CONTAINERS_TO_RELEASE: usize = 4;

/// NotebookOS.
pub struct NotebookOs {
    replicas: Vec<Vec<usize>>,
    primary: Vec<Option<usize>>,
    committed: Vec<Option<(usize, Vec<u32>)>>,
    upload_until: Vec<f64>,
    /// Sessions still short of replicas.
    placing: VecDeque<usize>,
    /// Runs waiting for GPUs.
    waiting: VecDeque<usize>,
    run_waiting: Vec<bool>,
    ratios: VecDeque<f64>,
    migrations: f64,
    migration_s: f64,
}

impl Default for NotebookOs {
    fn default() -> Self {
        Self::new()
    }
}

impl NotebookOs {
    /// The policy with no kernels yet.
    pub fn new() -> Self {
        Self {
            replicas: vec![],
            primary: vec![],
            committed: vec![],
            upload_until: vec![],
            placing: VecDeque::new(),
            waiting: VecDeque::new(),
            run_waiting: vec![],
            ratios: VecDeque::new(),
            migrations: 0.0,
            migration_s: 0.0,
        }
    }

    /// The hosts of session `s`'s replicas.
    pub fn replica_hosts(&self, s: usize) -> &[usize] {
        self.replicas.get(s).map_or(&[], |r| r.as_slice())
    }

    fn ensure(&mut self, n: usize) {
        if self.replicas.len() < n {
            self.replicas.resize(n, vec![]);
            self.primary.resize(n, None);
            self.committed.resize(n, None);
            self.upload_until.resize(n, 0.0);
            self.run_waiting.resize(n, false);
        }
    }

    /// The cluster subscription ratio S: the moving average of demand / busy.
    fn ratio(&self) -> f64 {
        if self.ratios.is_empty() {
            INITIAL_RATIO
        } else {
            self.ratios.iter().sum::<f64>() / self.ratios.len() as f64
        }
    }

    /// GPUs subscribed on `host` by the replicas placed there.
    fn subscribed(&self, sim: &Sim, host: usize) -> u32 {
        let mut n = 0;
        for (s, hosts) in self.replicas.iter().enumerate() {
            if hosts.contains(&host) {
                n += session_gpus(sim, s);
            }
        }
        n
    }

    fn replicas_on(&self, host: usize) -> usize {
        self.replicas.iter().filter(|r| r.contains(&host)).count()
    }

    /// Hosts that accept another replica of `s`, least loaded first: most idle
    /// GPUs, then the lowest subscription ratio.
    fn candidates(&self, sim: &Sim, s: usize) -> Vec<usize> {
        let gpus = session_gpus(sim, s);
        let spec = (sim.cluster.autoscaler.gpus_per_host as usize * REPLICAS) as f64;
        let ratio = self.ratio();
        let mut hosts: Vec<(usize, u32, f64)> = sim
            .cluster
            .hosts
            .iter()
            .enumerate()
            .filter(|(h, host)| host.is_on() && !self.replicas[s].contains(h))
            .map(|(h, host)| (h, host.slots.free_count(), self.subscribed(sim, h) as f64 / spec))
            .filter(|(_, _, sub)| *sub + gpus as f64 / spec - ratio < 0.0)
            .collect();
        hosts.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.total_cmp(&b.2)));
        hosts.into_iter().map(|(h, _, _)| h).collect()
    }

    /// Place the replicas `s` lacks; false (and more hosts asked for) if too few hosts.
    fn place(&mut self, sim: &mut Sim, s: usize) -> bool {
        let lacking = REPLICAS - self.replicas[s].len().min(REPLICAS);
        let hosts = self.candidates(sim, s);
        for h in hosts.iter().take(lacking) {
            self.replicas[s].push(*h);
        }
        if self.replicas[s].len() < REPLICAS {
            sim.request_hosts((REPLICAS - self.replicas[s].len()) as u32);
            return false;
        }
        true
    }

    /// Run `s`'s GPU cell if a replica's host (or a migration target) has GPUs.
    fn execute(&mut self, sim: &mut Sim, s: usize) -> bool {
        if self.replicas[s].len() < REPLICAS {
            return false;
        }
        let gpus = sim.cell(s).gpus.max(1);
        let idle = |sim: &Sim, h: usize| {
            let host = &sim.cluster.hosts[h];
            if host.is_on() {
                host.slots.free_count()
            } else {
                0
            }
        };
        // the last primary, else the replica whose host has the most idle GPUs
        let mut order = self.replicas[s].clone();
        order.sort_by_key(|h| (Some(*h) != self.primary[s], std::cmp::Reverse(idle(sim, *h))));
        let mut migration = 0.0;
        let host = match order.into_iter().find(|h| idle(sim, *h) >= gpus) {
            Some(h) => h,
            None => {
                // migrate a random replica to the least-loaded host without one
                let Some(target) = self.candidates(sim, s).into_iter().find(|h| idle(sim, *h) >= gpus) else {
                    return false;
                };
                let i = (sim.draw.unit() * REPLICAS as f64) as usize % REPLICAS;
                self.replicas[s][i] = target;
                // prewarmed container; the replica's state comes down from the store
                migration = secs(sim.cell(s).state_bytes, sim.costs.s3_down_bytes_per_s);
                self.migrations += 1.0;
                self.migration_s += migration;
                target
            }
        };
        let state = busy(sim, s);
        let Some(slots) = take(sim, host, gpus, state) else { return false };
        self.committed[s] = Some((host, slots));
        self.primary[s] = Some(host);
        let c = sim.costs;
        let to_gpu = secs(sim.cell(s).state_bytes, c.host_to_gpu_bytes_per_s);
        let at = sim.now().max(self.upload_until[s]) + migration + c.cuda_init_s + to_gpu;
        sim.start(s, at);
        true
    }

    fn serve(&mut self, sim: &mut Sim) {
        let mut still = VecDeque::new();
        while let Some(s) = self.placing.pop_front() {
            if sim.progress[s].open && !self.place(sim, s) {
                still.push_back(s);
            }
        }
        self.placing = still;
        while let Some(&s) = self.waiting.front() {
            if !self.run_waiting[s] {
                self.waiting.pop_front();
                continue;
            }
            if !self.execute(sim, s) {
                sim.request_hosts(1);
                return;
            }
            self.run_waiting[s] = false;
            self.waiting.pop_front();
        }
    }

    /// Replicas on hosts that went off move to hosts that are on.
    fn rehome(&mut self, sim: &mut Sim) {
        for s in 0..self.replicas.len() {
            let before = self.replicas[s].len();
            self.replicas[s]
                .retain(|h| sim.cluster.hosts[*h].is_on() || self.committed[s].as_ref().is_some_and(|c| c.0 == *h));
            if self.replicas[s].len() < before && sim.progress[s].open && !self.placing.contains(&s) {
                self.placing.push_back(s);
            }
        }
    }
}

impl Policy for NotebookOs {
    fn name(&self) -> String {
        "notebookos".into()
    }

    fn open(&mut self, sim: &mut Sim, s: usize) {
        self.ensure(sim.workload.sessions.len());
        if !self.place(sim, s) {
            self.placing.push_back(s);
        }
    }

    fn run(&mut self, sim: &mut Sim, s: usize) {
        if !sim.cell(s).gpu {
            let at = sim.now().max(self.upload_until[s]);
            sim.start(s, at);
            return;
        }
        if !self.execute(sim, s) {
            self.run_waiting[s] = true;
            self.waiting.push_back(s);
            sim.request_hosts(1);
        }
    }

    fn finished(&mut self, sim: &mut Sim, s: usize) {
        let now = sim.now();
        if let Some((host, slots)) = self.committed[s].take() {
            sim.cluster.release(host, &slots);
            // the state goes up to the store after the cell; the next cell waits for it
            self.upload_until[s] = now + secs(sim.cell(s).state_bytes, sim.costs.s3_up_bytes_per_s);
        }
        sim.done(s, now);
        self.serve(sim);
    }

    fn close(&mut self, sim: &mut Sim, s: usize) {
        self.replicas[s].clear();
        self.run_waiting[s] = false;
        if let Some((host, slots)) = self.committed[s].take() {
            sim.cluster.release(host, &slots);
        }
        self.serve(sim);
    }

    fn capacity_changed(&mut self, sim: &mut Sim) {
        self.rehome(sim);
        self.serve(sim);
    }

    fn tick(&mut self, sim: &mut Sim) {
        // demand: GPUs of the open sessions; busy: committed GPUs
        let demand: u32 =
            (0..self.replicas.len()).filter(|s| sim.progress[*s].open).map(|s| session_gpus(sim, s)).sum();
        let busy = sim.cluster.load();
        let sample = if busy == 0 {
            INITIAL_RATIO
        } else if demand < busy {
            1.0
        } else {
            demand as f64 / busy as f64
        };
        self.ratios.push_back(sample);
        if self.ratios.len() > RATIO_SAMPLES {
            self.ratios.pop_front();
        }
    }

    fn releasable(&self, sim: &Sim, host: usize) -> bool {
        // its replicas (at most 4) must have somewhere else to go
        let on = sim.cluster.hosts.iter().filter(|h| h.is_on()).count();
        self.replicas_on(host) <= MAX_CONTAINERS_TO_RELEASE && on > REPLICAS
    }

    fn counters(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([
            ("migrations".into(), self.migrations),
            ("migration_seconds".into(), self.migration_s),
            ("cluster_ratio".into(), self.ratio()),
        ])
    }
}
