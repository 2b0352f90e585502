//! How long a host waits before it claims a recipe (DESIGN.md section 5): a pure
//! function of where the host stands, so the host and the simulator (issue 17)
//! run the same rule.

use std::time::Duration;

/// The most jitter added to a delay; it breaks ties between equal hosts.
pub const MAX_JITTER: Duration = Duration::from_millis(3);

/// The delay of the best-placed host (score 1), before jitter, in microseconds.
const BASE_DELAY_US: u64 = 2_000;

/// What a score of 0 adds to the base delay, in microseconds.
const SCORE_SPAN_US: f64 = 12_000.0;

/// Where a host stands for one recipe.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Standing {
    /// The share of its slots that are free (0..=1).
    pub free_share: f64,
    /// How much of the recipe's import closure its zygotes hold (0..=1).
    pub zygote: f64,
    /// How much of the closure's bytes its chunk cache holds (0..=1).
    pub cached: f64,
    /// Whether another live host has room for the recipe: if none has, nobody
    /// could do better and this host claims at once.
    pub competitor_has_room: bool,
}

/// The host's score (free slots weigh half, the zygote and the cache a quarter
/// each) and its claim delay: a better-placed host waits less, so it wins the
/// claim. `jitter` is capped at [`MAX_JITTER`].
pub fn claim_delay(standing: Standing, jitter: Duration) -> (Duration, f64) {
    let Standing { free_share, zygote, cached, competitor_has_room } = standing;
    let score = (0.5 * free_share + 0.25 * zygote + 0.25 * cached).clamp(0.0, 1.0);
    if !competitor_has_room {
        return (Duration::ZERO, score);
    }
    let delay = Duration::from_micros(BASE_DELAY_US + (SCORE_SPAN_US * (1.0 - score)) as u64);
    (delay + jitter.min(MAX_JITTER), score)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn standing(free_share: f64, zygote: f64, cached: f64) -> Standing {
        Standing { free_share, zygote, cached, competitor_has_room: true }
    }

    #[test]
    fn a_better_placed_host_waits_less() {
        let (idle, s_idle) = claim_delay(standing(1.0, 1.0, 1.0), Duration::ZERO);
        let (busy, s_busy) = claim_delay(standing(0.5, 1.0, 1.0), Duration::ZERO);
        let (cold, s_cold) = claim_delay(standing(1.0, 0.0, 0.0), Duration::ZERO);
        assert_eq!((s_idle, s_busy, s_cold), (1.0, 0.75, 0.5));
        assert_eq!(idle, Duration::from_millis(2));
        assert_eq!(busy, Duration::from_millis(5));
        assert_eq!(cold, Duration::from_millis(8));
        // the worst standing still claims within the base, the span and the jitter
        let (worst, _) = claim_delay(standing(0.0, 0.0, 0.0), Duration::from_secs(1));
        assert_eq!(worst, Duration::from_millis(14) + MAX_JITTER);
    }

    #[test]
    fn with_no_competitor_that_has_room_the_host_claims_at_once() {
        let alone = Standing { competitor_has_room: false, ..standing(0.1, 0.0, 0.0) };
        assert_eq!(claim_delay(alone, MAX_JITTER), (Duration::ZERO, 0.05));
    }
}
