//! Device sizing from a recorded iteration: what a model needs of a device under a policy.
//!
//! A [`Sizing`] holds one complete iteration's [`Trace`] and the chunks it names (from
//! [`ChunkManager::sizing`](crate::chunk::ChunkManager::sizing) after an iteration on a roomy
//! device, or from the simulator). It answers without allocating anything:
//!
//! - the non-model peak and the **largest single moment**: the chunk bytes one moment needs on
//!   the device at once (an oversized tensor such as a GPT's token embedding has a chunk of its
//!   own, and the embedding moment also needs the position table's chunk), plus the non-model
//!   bytes the moment must leave room for;
//! - whether a [`SchedulerConfig`] trains under a [`Policy`] ([`Sizing::fits`]): a replay of a
//!   warm-up iteration (no trace, warm-up budgets) and a steady one (the trace installed)
//!   through the same [`Scheduler`] the manager drives;
//! - the smallest device that trains ([`Sizing::smallest_device`]), by bisection over replays.
//!
//! ```
//! use tidemem::tensor::{ChunkKind, Stage};
//! use tidemem::tide::{Access, ChunkDesc, Moment, Policy, SchedulerConfig, Sizing, Target, Trace};
//! # fn main() -> tidemem::Result<()> {
//! let chunks: Vec<ChunkDesc> =
//!     (0..4).map(|g| ChunkDesc { bytes: 100, kind: ChunkKind::Param, group: g }).collect();
//! let dev = |c: u32| Access { chunk: c, target: Target::Device, write: false };
//! // a moment using chunks 0 and 1 together, then one each for 2 and 3, 50 bytes of activations
//! let moments = [vec![dev(0), dev(1)], vec![dev(2)], vec![dev(3)]]
//!     .into_iter()
//!     .map(|accesses| Moment { stage: Stage::Forward, accesses, non_model: 50 })
//!     .collect();
//! let s = Sizing::new(Trace { moments }, chunks)?;
//! assert_eq!(s.largest_moment(), 200);
//! let cfg = |capacity| SchedulerConfig {
//!     overall_fraction: 1.0,
//!     warmup_chunk_fraction: 1.0 - 50.0 / capacity as f64,
//!     ..SchedulerConfig::new(capacity)
//! };
//! assert!(s.fits(Policy::Tide, cfg(250)).is_ok());
//! assert!(s.fits(Policy::Tide, cfg(240)).is_err());
//! assert_eq!(s.smallest_device(Policy::Tide, cfg)?, 250);
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use crate::tensor::Stage;

use super::scheduler::{Policy, Scheduler, SchedulerConfig};
use super::trace::{ChunkDesc, ChunkNo, Target, Trace};

/// One recorded iteration and its chunks: what a device must hold to train it.
#[derive(Clone, Debug)]
pub struct Sizing {
    trace: Trace,
    chunks: Vec<ChunkDesc>,
}

impl Sizing {
    /// The sizing of `trace` over `chunks`; every chunk the trace names must exist.
    pub fn new(trace: Trace, chunks: Vec<ChunkDesc>) -> Result<Sizing> {
        if trace.is_empty() {
            return Err(Error::Empty {
                what: "the trace (sizing needs a complete iteration)".into(),
            });
        }
        for m in &trace.moments {
            for a in &m.accesses {
                if a.chunk as usize >= chunks.len() {
                    return Err(Error::IndexOutOfRange {
                        what: "trace chunk".into(),
                        index: a.chunk as usize,
                        len: chunks.len(),
                    });
                }
            }
        }
        Ok(Sizing { trace, chunks })
    }

    /// The recorded iteration.
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// The chunks the iteration uses.
    pub fn chunks(&self) -> &[ChunkDesc] {
        &self.chunks
    }

    /// Bytes of every chunk of every list (parameters, fp32 masters, momentum, variance, with
    /// their padding): the model data a device smaller than this offloads.
    pub fn model_data_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.bytes).sum()
    }

    /// Highest non-model device bytes over the iteration.
    pub fn non_model_peak(&self) -> u64 {
        self.trace.peak_non_model()
    }

    /// Bytes of the chunks that visit the device (the parameter chunks).
    pub fn device_chunk_bytes(&self) -> u64 {
        let mut seen = vec![false; self.chunks.len()];
        for m in &self.trace.moments {
            for a in m.accesses.iter().filter(|a| a.target == Target::Device) {
                seen[a.chunk as usize] = true;
            }
        }
        self.chunks
            .iter()
            .zip(seen)
            .filter(|(_, s)| *s)
            .map(|(c, _)| c.bytes)
            .sum()
    }

    /// Chunk bytes moment `m` needs on the device at once.
    pub(crate) fn moment_chunks(&self, m: usize) -> u64 {
        let mut named: Vec<ChunkNo> = self.trace.moments[m]
            .accesses
            .iter()
            .filter(|a| a.target == Target::Device)
            .map(|a| a.chunk)
            .collect();
        named.sort_unstable();
        named.dedup();
        named.iter().map(|&c| self.chunks[c as usize].bytes).sum()
    }

    /// The largest chunk bytes any one moment needs on the device at once.
    pub fn largest_moment(&self) -> u64 {
        (0..self.trace.len())
            .map(|m| self.moment_chunks(m))
            .max()
            .unwrap_or(0)
    }

    /// The most device bytes any one moment needs: its chunks plus the non-model bytes it must
    /// leave room for (its own and the next moment's, as the steady budget reserves them).
    #[cfg(test)]
    fn largest_moment_total(&self) -> u64 {
        (0..self.trace.len())
            .map(|m| self.moment_chunks(m) + self.trace.reserve_at(m))
            .max()
            .unwrap_or(0)
    }

    /// The scheduler configuration of a device of `capacity` bytes sized from this iteration:
    /// it plans with all of the device and, during warm-up, gives chunks what the non-model
    /// peak leaves (the steady budgets follow the tide).
    pub fn config_for(&self, capacity: u64) -> SchedulerConfig {
        let left = capacity.saturating_sub(self.non_model_peak()).max(1);
        SchedulerConfig {
            overall_fraction: 1.0,
            warmup_chunk_fraction: (left as f64 / capacity.max(1) as f64)
                .clamp(f64::MIN_POSITIVE, 1.0),
            ..SchedulerConfig::new(capacity)
        }
    }

    /// A device for `policy` with room for the non-model peak and `share` (in `[0, 1]`) of the
    /// chunks that visit the device, and never smaller than the smallest device that trains
    /// ([`Sizing::smallest_device`] with [`Sizing::config_for`]).
    pub fn device_for(&self, policy: Policy, share: f64) -> Result<u64> {
        if !(0.0..=1.0).contains(&share) {
            return Err(Error::BadValue {
                what: "the device share of the chunks".into(),
                value: share,
                want: "in [0, 1]",
            });
        }
        let asked = self.non_model_peak() + (share * self.device_chunk_bytes() as f64) as u64;
        let least = self.smallest_device(policy, |c| self.config_for(c))?;
        Ok(asked.max(least))
    }

    /// Whether a device configured by `cfg` trains the iteration under `policy`: a warm-up
    /// iteration and a steady one replayed through the scheduler, as the chunk manager drives
    /// it. The error is the scheduler's ([`Error::BudgetExceeded`] with the numbers).
    pub fn fits(&self, policy: Policy, cfg: SchedulerConfig) -> Result<()> {
        let mut s = Scheduler::new(policy, cfg, self.chunks.clone())?;
        for steady in [false, true] {
            s.start_iteration();
            for m in &self.trace.moments {
                s.tick();
                s.fetch(&m.accesses)?;
                if m.stage != Stage::Optimizer {
                    s.prefetch();
                }
                let used: Vec<ChunkNo> = m.accesses.iter().map(|a| a.chunk).collect();
                s.release(&used)?;
            }
            if !steady {
                s.install_trace(self.trace.clone());
            }
        }
        Ok(())
    }

    /// The smallest device capacity (to the byte) whose configuration `cfg(capacity)` trains
    /// the iteration under `policy` ([`Sizing::fits`]), searched between the largest moment
    /// and the chunks plus the non-model peak (or beyond, doubling, for configurations that
    /// plan with less than all of the device). The scheduler's error at 2^50 bytes when no capacity
    /// up to there fits.
    pub fn smallest_device(
        &self,
        policy: Policy,
        cfg: impl Fn(u64) -> SchedulerConfig,
    ) -> Result<u64> {
        let fits = |c: u64| self.fits(policy, cfg(c));
        let mut lo = self.largest_moment().max(1);
        let mut hi = (self.device_chunk_bytes() + self.non_model_peak()).max(lo);
        while let Err(e) = fits(hi) {
            if hi >= 1 << 50 {
                return Err(e);
            }
            lo = hi;
            hi = hi.saturating_mul(2);
        }
        let fits = |c: u64| fits(c).is_ok();
        // invariant: hi fits; below lo nothing fits (lo itself may)
        if fits(lo) {
            return Ok(lo);
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Ok(hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::ChunkKind;
    use crate::tide::{Access, Moment};

    fn dev(c: u32) -> Access {
        Access {
            chunk: c,
            target: Target::Device,
            write: false,
        }
    }

    fn sizing(bytes: &[u64], moments: &[(&[u32], u64)]) -> Sizing {
        let chunks = bytes
            .iter()
            .enumerate()
            .map(|(g, &b)| ChunkDesc {
                bytes: b,
                kind: ChunkKind::Param,
                group: g as u32,
            })
            .collect();
        let moments = moments
            .iter()
            .map(|(cs, nm)| Moment {
                stage: Stage::Forward,
                accesses: cs.iter().map(|&c| dev(c)).collect(),
                non_model: *nm,
            })
            .collect();
        Sizing::new(Trace { moments }, chunks).unwrap()
    }

    fn full(capacity: u64) -> SchedulerConfig {
        SchedulerConfig {
            overall_fraction: 1.0,
            warmup_chunk_fraction: 1.0,
            ..SchedulerConfig::new(capacity)
        }
    }

    #[test]
    fn an_oversized_chunk_sets_the_smallest_device() {
        // a large first chunk used together with a small one, then small chunks one by one
        let s = sizing(&[1000, 10, 10, 10], &[(&[0, 1], 0), (&[2], 0), (&[3], 0)]);
        assert_eq!(s.largest_moment(), 1010);
        assert_eq!(s.device_chunk_bytes(), 1030);
        for p in [Policy::Tide, Policy::PatrickStar, Policy::Lru] {
            assert_eq!(s.smallest_device(p, full).unwrap(), 1010, "{}", p.name());
            assert!(s.fits(p, full(1009)).is_err());
        }
        // a static policy keeps its resident chunks: half of 4 is chunks 0 and 1
        let st = Policy::Static {
            device_fraction: 0.5,
        };
        assert_eq!(s.smallest_device(st, full).unwrap(), 1020);
    }

    #[test]
    fn the_steady_budget_reserves_the_next_moment() {
        // 100 bytes of activations at the second moment: the steady budget of the first moment
        // already leaves room for them
        let s = sizing(&[50, 50], &[(&[0], 0), (&[1], 100)]);
        assert_eq!(s.largest_moment_total(), 150);
        assert_eq!(s.smallest_device(Policy::Tide, full).unwrap(), 150);
    }

    #[test]
    fn a_trace_naming_missing_chunks_is_refused() {
        let t = Trace {
            moments: vec![Moment {
                stage: Stage::Forward,
                accesses: vec![dev(3)],
                non_model: 0,
            }],
        };
        assert!(Sizing::new(t, Vec::new()).is_err());
        assert!(Sizing::new(Trace::default(), Vec::new()).is_err());
    }
}
