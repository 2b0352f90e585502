//! Seeded draws: the shapes the workload anchors name (log-normal from a median
//! and a p90, exponential, quantile tables) and measured samples.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// The simulation's random source: one seed, so a run can be repeated exactly.
pub struct Draw(StdRng);

/// z of the 90th percentile of a standard normal.
const Z90: f64 = 1.281_551_565_5;

impl Draw {
    /// A source seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(StdRng::seed_from_u64(seed))
    }

    /// Uniform on [0, 1).
    pub fn unit(&mut self) -> f64 {
        self.0.random::<f64>()
    }

    /// Uniform on [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(f64::MIN_POSITIVE);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Normal with `mean` and `std`, at least `min`.
    pub fn normal_at_least(&mut self, mean: f64, std: f64, min: f64) -> f64 {
        (mean + std * self.normal()).max(min)
    }

    /// Exponential with `mean`.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Log-normal given by its median and 90th percentile.
    pub fn lognormal(&mut self, shape: LogNormal) -> f64 {
        (shape.median.ln() + shape.sigma() * self.normal()).exp()
    }

    /// Poisson with mean `lambda` (Knuth; the means used here are small).
    pub fn poisson(&mut self, lambda: f64) -> u32 {
        let limit = (-lambda).exp();
        let (mut k, mut p) = (0u32, self.unit());
        while p > limit {
            k += 1;
            p *= self.unit();
        }
        k
    }

    /// A value from a quantile table.
    pub fn quantiles(&mut self, table: &Quantiles) -> f64 {
        table.at(self.unit())
    }

    /// One of `samples`, uniformly (an empirical distribution).
    pub fn sample(&mut self, samples: &Samples) -> f64 {
        let n = samples.values.len();
        if n == 0 {
            return 0.0;
        }
        samples.values[((self.unit() * n as f64) as usize).min(n - 1)]
    }
}

/// A log-normal by median and 90th percentile (how the workload anchors give them).
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct LogNormal {
    /// The median.
    pub median: f64,
    /// The 90th percentile.
    pub p90: f64,
}

impl LogNormal {
    /// The log's standard deviation.
    pub fn sigma(&self) -> f64 {
        (self.p90 / self.median).ln().max(0.0) / Z90
    }

    /// Both ends scaled by `k`.
    pub fn scaled(self, k: f64) -> Self {
        Self { median: self.median * k, p90: self.p90 * k }
    }
}

/// An inverse CDF given as (probability, value) points, interpolated linearly (in
/// log space when `log` is set, for heavy tails).
#[derive(Clone, Debug, Serialize)]
pub struct Quantiles {
    /// Points, probabilities rising from 0 to 1.
    pub points: Vec<(f64, f64)>,
    /// Interpolate between the logs of the values.
    pub log: bool,
}

impl Quantiles {
    /// The value at probability `p`.
    pub fn at(&self, p: f64) -> f64 {
        let pts = &self.points;
        let Some(first) = pts.first() else { return 0.0 };
        if p <= first.0 {
            return first.1;
        }
        for w in pts.windows(2) {
            let ((p0, v0), (p1, v1)) = (w[0], w[1]);
            if p <= p1 {
                let f = if p1 > p0 { (p - p0) / (p1 - p0) } else { 1.0 };
                return if self.log && v0 > 0.0 && v1 > 0.0 {
                    (v0.ln() + f * (v1.ln() - v0.ln())).exp()
                } else {
                    v0 + f * (v1 - v0)
                };
            }
        }
        pts.last().map_or(0.0, |l| l.1)
    }
}

/// Measured values: drawn from as they are (no fitted shape).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Samples {
    /// The values, sorted.
    #[serde(skip)]
    pub values: Vec<f64>,
    /// Where they came from.
    pub source: String,
}

impl Samples {
    /// Samples from `source`, sorted; NaNs dropped.
    pub fn new(mut values: Vec<f64>, source: impl Into<String>) -> Self {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        Self { values, source: source.into() }
    }

    /// The `q` quantile (0 when empty).
    pub fn quantile(&self, q: f64) -> f64 {
        quantile(&self.values, q)
    }
}

/// The `q` quantile of sorted `values` (linear between ranks; 0 when empty).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let r = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (r.floor() as usize, r.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (r - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lognormal_has_the_median_and_p90_it_was_given() {
        let shape = LogNormal { median: 9.5, p90: 40.0 };
        let mut d = Draw::new(7);
        let mut xs: Vec<f64> = (0..40_000).map(|_| d.lognormal(shape)).collect();
        xs.sort_by(f64::total_cmp);
        assert!((quantile(&xs, 0.5) / 9.5 - 1.0).abs() < 0.03, "median {}", quantile(&xs, 0.5));
        assert!((quantile(&xs, 0.9) / 40.0 - 1.0).abs() < 0.05, "p90 {}", quantile(&xs, 0.9));
    }

    #[test]
    fn a_quantile_table_is_followed_and_interpolated() {
        let t = Quantiles { points: vec![(0.0, 1.0), (0.5, 5.0), (0.9, 32.0), (1.0, 100.0)], log: true };
        assert_eq!(t.at(0.0), 1.0);
        assert!((t.at(0.5) - 5.0).abs() < 1e-9);
        assert!(t.at(0.7) > 5.0 && t.at(0.7) < 32.0);
        assert!((t.at(1.0) - 100.0).abs() < 1e-9);
        let mut d = Draw::new(1);
        let mut xs: Vec<f64> = (0..20_000).map(|_| d.quantiles(&t)).collect();
        xs.sort_by(f64::total_cmp);
        assert!((quantile(&xs, 0.5) - 5.0).abs() < 0.3);
    }

    #[test]
    fn the_same_seed_draws_the_same_values() {
        let (mut a, mut b) = (Draw::new(3), Draw::new(3));
        let xa: Vec<f64> = (0..5).map(|_| a.exp(2.0)).collect();
        let xb: Vec<f64> = (0..5).map(|_| b.exp(2.0)).collect();
        assert_eq!(xa, xb);
    }
}
