//! Where the optimizer steps each chunk group, chosen by the time model: [`plan`].
//!
//! Memory alone (PatrickStar's rule, [`DevicePlacement::Auto`]) puts the first groups on the
//! device while their fp32 state fits. Whether that is the fastest step depends on the rates:
//! a device group's state takes room the scheduler could cache parameters in, and a host group
//! whose gradients are final last in backward (the first layers) has its write-back, its step
//! and its upload left when the next forward wants it. [`plan`] replays the step on the
//! [`timeline`] for every count of device groups up to the memory rule's (the first in order:
//! the last whose gradients are final) and every count of host groups stepped after backward
//! ([`SimOptions::overlap_tail`]), and keeps the shortest.
//!
//! ```
//! use tidemem::models::gpt::GptConfig;
//! use tidemem::optim::DevicePlacement;
//! use tidemem::simulate::{plan, Rates, SimOptions, StepSchedule};
//! use tidemem::tide::Policy;
//! # fn main() -> tidemem::Result<()> {
//! let model = GptConfig::preset("gpt2").unwrap().spec(8, 1024, true)?;
//! let rates = Rates::profile("h100-pcie5").unwrap();
//! let mut opts = SimOptions::new(4 << 30, 64 << 30);
//! opts.optimizer = DevicePlacement::Auto { fraction: 0.8 };
//! let p = plan(&model, Policy::Tide, &opts, &rates, StepSchedule::Overlapped)?;
//! assert!(p.device_groups <= p.memory_groups);
//! assert!(p.step.step <= p.memory_step);
//! # Ok(()) }
//! ```

use serde::Serialize;

use super::{simulate, timeline, ModelSpec, Rates, SimOptions, StepSchedule, StepTime};
use crate::error::Result;
use crate::optim::DevicePlacement;
use crate::tide::Policy;

/// Counts [`plan`] tries of each kind at most (every count up to it, then evenly spaced).
const TRIES: usize = 24;

/// What [`plan`] chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepPlan {
    /// Chunk groups the optimizer steps on the device, the first in order
    /// ([`DevicePlacement::Groups`]).
    pub device_groups: usize,
    /// Host groups stepped after backward, the first in order
    /// ([`HybridConfig::overlap_tail`](crate::optim::HybridConfig::overlap_tail)).
    pub overlap_tail: usize,
    /// The device groups of [`SimOptions::optimizer`] alone (the memory rule): the most
    /// [`plan`] tries.
    pub memory_groups: usize,
    /// The predicted step of the plan.
    pub step: StepTime,
    /// The predicted step of the memory rule alone (its device groups, the options' tail), in
    /// seconds.
    pub memory_step: f64,
}

/// The count of device groups (up to what [`SimOptions::optimizer`] places) and of host groups
/// stepped after backward whose step of `spec` under `policy` at `rates` is the shortest on
/// `schedule` (the tail only where the overlapped step runs). Ties keep more device groups and
/// a shorter tail: the memory rule's choice unless the time model finds a shorter step.
pub fn plan(
    spec: &ModelSpec,
    policy: Policy,
    opts: &SimOptions,
    rates: &Rates,
    schedule: StepSchedule,
) -> Result<StepPlan> {
    let memory = simulate(spec, policy, opts)?;
    let memory_groups = memory.device_adam_groups;
    let memory_time = timeline(spec, policy, opts, rates, schedule)?;
    let overlapped =
        schedule == StepSchedule::Overlapped && opts.overlap != super::SimOverlap::Serial;
    let mut best = StepPlan {
        device_groups: memory_groups,
        overlap_tail: opts.overlap_tail,
        memory_groups,
        memory_step: memory_time.step,
        step: memory_time,
    };
    // more device groups first, then shorter tails: a later try wins only when shorter
    for k in counts(memory_groups).into_iter().rev() {
        let at_k = SimOptions {
            optimizer: DevicePlacement::Groups(k),
            ..opts.clone()
        };
        let host_groups = memory.groups - k;
        let tails = if overlapped {
            counts(host_groups)
        } else {
            vec![0]
        };
        for tail in tails {
            let o = SimOptions {
                overlap_tail: tail,
                ..at_k.clone()
            };
            // a count the device cannot hold is not a choice
            let Ok(t) = timeline(spec, policy, &o, rates, schedule) else {
                continue;
            };
            if t.step < best.step.step * (1.0 - 1e-9) {
                best.device_groups = k;
                best.overlap_tail = tail;
                best.step = t;
            }
        }
    }
    Ok(best)
}

/// `0..=n`: every count up to [`TRIES`], else `TRIES` evenly spaced with both ends.
fn counts(n: usize) -> Vec<usize> {
    if n <= TRIES {
        return (0..=n).collect();
    }
    (0..=TRIES).map(|i| i * n / TRIES).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cover_both_ends() {
        assert_eq!(counts(3), vec![0, 1, 2, 3]);
        let c = counts(1000);
        assert_eq!((c[0], *c.last().unwrap(), c.len()), (0, 1000, TRIES + 1));
    }
}
