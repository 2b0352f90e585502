//! Where "now" comes from. The services read the system clock; the simulator
//! (`sim`, DESIGN.md section 15) drives the same policy code on its own clock, so
//! code that measures held time takes a [`Clock`] instead of calling
//! `Instant::now()` itself.

use std::time::Instant;

/// A source of the current instant.
pub trait Clock {
    /// Now.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock: what every service uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}
