//! The offline lower bound on transfers for a known trace.

use serde::Serialize;

use super::scheduler::SchedulerConfig;
use super::trace::{ChunkDesc, Target, Trace};
use crate::error::{Error, Result};

/// Bytes per iteration no schedule can go below (see [`lower_bound`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Bound {
    /// Host→device bytes: loads of Belady's farthest-next-use schedule with free eviction.
    pub h2d_bytes: u64,
    /// Device→host bytes: one write-back for every device write later read on the host.
    pub d2h_bytes: u64,
}

impl Bound {
    /// Both directions.
    pub fn total(&self) -> u64 {
        self.h2d_bytes + self.d2h_bytes
    }
}

/// Offline lower bound on the bytes one steady iteration of `trace` must move.
///
/// - Loads: Belady's rule (on a miss, evict the resident chunk whose next device use is farthest)
///   with eviction free of charge, under the same per-moment budget as the scheduler (capacity
///   share minus the tide's non-model reserve). Evicting a dirty chunk is not charged: the bound
///   only assumes the copy exists.
/// - Write-backs: for every chunk, each device write followed (before the next device write) by a
///   host access must reach the host once; nothing else must.
///
/// The cache starts empty and the iteration is repeated until the counts of two successive
/// iterations agree (at most eight times); the last iteration's counts are returned.
pub fn lower_bound(trace: &Trace, chunks: &[ChunkDesc], cfg: &SchedulerConfig) -> Result<Bound> {
    let n = trace.len();
    let overall = (cfg.capacity as f64 * cfg.overall_fraction) as u64;
    let index = trace.index(chunks.len());
    let mut resident = vec![false; chunks.len()];
    let mut used = 0u64;
    let mut dirty = vec![false; chunks.len()];
    let mut last = Bound::default();
    for it in 0..8 {
        let mut b = Bound::default();
        for (m, moment) in trace.moments.iter().enumerate() {
            let budget = overall
                .saturating_sub(trace.reserve_at(m))
                .saturating_sub(cfg.reserve);
            let now = (it * n + m) as u64;
            let here: Vec<usize> = moment.accesses.iter().map(|a| a.chunk as usize).collect();
            let mut pending = 0u64; // bytes the moment still has to load
            for a in &moment.accesses {
                let i = a.chunk as usize;
                if i < chunks.len() && a.target == Target::Device && !resident[i] {
                    pending += chunks[i].bytes;
                }
            }
            // The budget holds at every moment (non-model data needs the room), so evict down to
            // it even when nothing is missing.
            while used + pending > budget {
                let victim = (0..chunks.len())
                    .filter(|&j| resident[j] && !here.contains(&j))
                    .max_by_key(|&j| (index.distance(j as u32, now), std::cmp::Reverse(j)));
                let Some(j) = victim else {
                    return Err(Error::BudgetExceeded {
                        moment: m,
                        requested: pending,
                        budget,
                        capacity: cfg.capacity,
                        non_model_peak: trace.reserve_at(m),
                        unevictable: used,
                        chunks: moment
                            .accesses
                            .iter()
                            .filter(|a| a.target == Target::Device)
                            .map(|a| a.chunk)
                            .collect(),
                        tensors: Vec::new(),
                    });
                };
                resident[j] = false;
                used -= chunks[j].bytes;
            }
            for a in &moment.accesses {
                let i = a.chunk as usize;
                if i >= chunks.len() {
                    return Err(Error::IndexOutOfRange {
                        what: "trace chunk".into(),
                        index: i,
                        len: chunks.len(),
                    });
                }
                match a.target {
                    Target::Host => {
                        if dirty[i] {
                            b.d2h_bytes += chunks[i].bytes;
                            dirty[i] = false;
                        }
                        if a.write && resident[i] {
                            resident[i] = false;
                            used -= chunks[i].bytes;
                        }
                    }
                    Target::Device => {
                        if a.write {
                            dirty[i] = true;
                        }
                        if !resident[i] {
                            let need = chunks[i].bytes;
                            resident[i] = true;
                            used += need;
                            b.h2d_bytes += need;
                        }
                    }
                }
            }
        }
        if it > 0 && b == last {
            return Ok(b);
        }
        last = b;
    }
    Ok(last)
}
