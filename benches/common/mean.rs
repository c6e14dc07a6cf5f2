//! Time per iteration of criterion's `iter_custom` calls, for ratios between two functions
//! measured in the same run (included by the benches with `#[path]`).

use std::time::Duration;

/// Time per iteration over every call criterion makes (warm-up included), so two functions
/// that ran different numbers of iterations compare fairly.
#[derive(Default)]
pub struct Mean {
    total: Duration,
    iters: u64,
}

impl Mean {
    /// Adds a call's time and iterations; returns the time for criterion.
    pub fn add(&mut self, t: Duration, iters: u64) -> Duration {
        self.total += t;
        self.iters += iters;
        t
    }

    /// Seconds per iteration (0 before any).
    pub fn per_iter(&self) -> f64 {
        self.total.as_secs_f64() / self.iters.max(1) as f64
    }

    /// Our time per iteration over the baseline's (NaN when either did not run).
    pub fn ratio(&self, base: &Mean) -> f64 {
        if self.iters == 0 || base.iters == 0 {
            return f64::NAN;
        }
        self.per_iter() / base.per_iter()
    }
}
