//! A whole comparison: every policy on one workload, side by side, and what the
//! results file and the Markdown summary say about it.

use looseleaf_planner::speculator::Budget;
use serde_json::{json, Map, Value};

use crate::cluster::Autoscaler;
use crate::costs::Costs;
use crate::engine::{simulate, Outcome};
use crate::policies;
use crate::workload::Workload;

/// One workload under every policy.
pub struct Comparison {
    /// Its key in the results (`s24`, `trace`, `s48_edit_halved`, ...).
    pub key: String,
    /// The workload.
    pub workload: Workload,
    /// The provisioning every policy got.
    pub autoscaler: Autoscaler,
    /// One outcome per policy, in [`policies::all`]'s order.
    pub outcomes: Vec<Outcome>,
}

/// What every comparison of a run shares.
pub struct Setup<'a> {
    /// Step costs.
    pub costs: &'a Costs,
    /// LooseLeaf's speculation budget.
    pub budget: Budget,
    /// The seed of every draw.
    pub seed: u64,
    /// Only these policies (None: all).
    pub only: Option<&'a [String]>,
    /// Keep each replayed cell in the outcomes.
    pub keep_cells: bool,
}

/// Run `workload` under each policy. Policies run on threads of their own: each
/// simulation is independent and seeded alike.
pub fn compare(key: &str, workload: Workload, autoscaler: Autoscaler, setup: &Setup) -> Comparison {
    let Setup { costs, budget, seed, only, keep_cells } = *setup;
    let names: Vec<String> = policies::all(budget).iter().map(|p| p.name()).collect();
    let chosen: Vec<usize> =
        (0..names.len()).filter(|i| only.is_none_or(|o| o.iter().any(|n| n == &names[*i]))).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).max(1);
    let mut outcomes: Vec<Option<Outcome>> = vec![None; names.len()];
    for batch in chosen.chunks(threads) {
        std::thread::scope(|scope| {
            let handles: Vec<_> = batch
                .iter()
                .map(|&i| {
                    let (w, a) = (&workload, autoscaler.clone());
                    scope.spawn(move || {
                        let mut all = policies::all(budget);
                        let policy = all[i].as_mut();
                        (i, simulate(policy, w, costs, a, seed, keep_cells))
                    })
                })
                .collect();
            for h in handles {
                if let Ok((i, o)) = h.join() {
                    outcomes[i] = Some(o);
                }
            }
        });
    }
    Comparison { key: key.into(), workload, autoscaler, outcomes: outcomes.into_iter().flatten().collect() }
}

impl Comparison {
    fn outcome(&self, policy: &str) -> Option<&Outcome> {
        self.outcomes.iter().find(|o| o.policy == policy)
    }

    /// LooseLeaf's GPU-hours below `baseline`'s, as a share of the baseline's.
    pub fn reduction_vs(&self, baseline: &str) -> Option<f64> {
        let ll = self.outcome("looseleaf")?.gpu_hours;
        let base = self.outcome(baseline)?.gpu_hours;
        (base > 0.0).then(|| 1.0 - ll / base)
    }

    /// The flat keys the bench reports (`{policy}_gpu_hours`, ...), the reductions,
    /// and each policy's whole outcome and the workload's parameters beside them.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for o in &self.outcomes {
            let p = &o.policy;
            m.insert(format!("{p}_gpu_hours"), json!(o.gpu_hours));
            m.insert(format!("{p}_within_1s"), json!(o.within_1s));
            m.insert(format!("{p}_p50_start_ms"), json!(o.p50_start_ms));
            m.insert(format!("{p}_p99_start_ms"), json!(o.p99_start_ms));
            m.insert(format!("{p}_completion_overhead_ms_p50"), json!(o.p50_completion_overhead_ms));
            m.insert(format!("{p}_completion_overhead_ms_p99"), json!(o.p99_completion_overhead_ms));
        }
        for base in ["pinned", "notebookos", "naive", "modal"] {
            if let Some(r) = self.reduction_vs(base) {
                m.insert(format!("reduction_vs_{base}"), json!(r));
            }
        }
        m.insert("sessions".into(), json!(self.workload.sessions.len()));
        m.insert("gpu_cells".into(), json!(self.workload.gpu_cells()));
        m.insert("workload".into(), json!({ "name": self.workload.name, "params": self.workload.params }));
        m.insert("provisioning".into(), json!(self.autoscaler));
        m.insert("policies".into(), json!(self.outcomes));
        Value::Object(m)
    }

    /// What the plots draw: each policy's start-delay CDF (at most 300 points)
    /// and its occupancy every minute.
    pub fn plot_json(&self) -> Value {
        let mut cdf = Map::new();
        let mut occupancy = Map::new();
        for o in &self.outcomes {
            let n = o.start_delays_ms.len();
            let step = n.div_ceil(300).max(1);
            let pts: Vec<[f64; 2]> = o
                .start_delays_ms
                .iter()
                .enumerate()
                .filter(|(i, _)| i % step == 0 || *i + 1 == n)
                .map(|(i, d)| [*d, (i + 1) as f64 / n as f64])
                .collect();
            cdf.insert(o.policy.clone(), json!(pts));
            occupancy.insert(o.policy.clone(), json!(o.occupancy));
        }
        json!({ "cdf": cdf, "occupancy": occupancy })
    }

    /// A Markdown table of the outcomes.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "### {} ({} sessions, {} GPU cells)\n\n| policy | GPU-hours | held | busy | within 1 s | p50 start | p99 start | max start |\n|---|---|---|---|---|---|---|---|\n",
            self.key,
            self.workload.sessions.len(),
            self.workload.gpu_cells()
        );
        for o in &self.outcomes {
            s.push_str(&format!(
                "| {} | {:.1} | {:.1} | {:.1} | {:.1}% | {} | {} | {} |\n",
                o.policy,
                o.gpu_hours,
                o.held_gpu_hours,
                o.busy_gpu_hours,
                o.within_1s * 100.0,
                ms(o.p50_start_ms),
                ms(o.p99_start_ms),
                ms(o.max_start_ms)
            ));
        }
        let reductions: Vec<String> = ["pinned", "notebookos", "naive", "modal"]
            .iter()
            .filter_map(|b| self.reduction_vs(b).map(|r| format!("{:.0}% vs {b}", r * 100.0)))
            .collect();
        if !reductions.is_empty() {
            s.push_str(&format!("\nLooseLeaf's GPU-hours: {}.\n", reductions.join(", ")));
        }
        s
    }
}

fn ms(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.0} s", v / 1000.0)
    } else if v >= 1000.0 {
        format!("{:.1} s", v / 1000.0)
    } else {
        format!("{v:.0} ms")
    }
}
