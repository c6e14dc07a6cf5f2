//! Replays an id trace through a [`CacheIndex`] without any table memory: hit rates, rows and
//! bytes a cache would move, and the speed of id preparation, for comparing policies and
//! cache sizes (the evaluation example and benches use it).

use std::time::{Duration, Instant};

use super::index::CacheIndex;
use super::policy::{CachePolicy, OptimalTrace};
use crate::error::Result;

/// How to replay a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayConfig {
    /// Rows of the (concatenated) table.
    pub rows: usize,
    /// Cached rows.
    pub capacity: usize,
    /// Bytes of one row (embedding and optimizer state), for byte counts.
    pub row_bytes: usize,
    /// Fraction of the cache preloaded with the hottest rows before the first batch.
    pub warmup: f64,
    /// Whether every row a batch uses becomes dirty (training), so evicting it writes it back.
    pub train: bool,
}

/// What a replay measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReplayStats {
    /// Batches replayed.
    pub batches: usize,
    /// Id occurrences served from the cache over id occurrences.
    pub hit_rate: f64,
    /// Rows copied host → device per batch (warm-up excluded).
    pub h2d_rows_per_batch: f64,
    /// Bytes copied host → device per batch.
    pub h2d_bytes_per_batch: f64,
    /// Bytes copied device → host per batch.
    pub d2h_bytes_per_batch: f64,
    /// Rows preloaded by the warm-up.
    pub(crate) warmup_rows: usize,
    /// Time spent deciding (preparing ids), all batches.
    pub(crate) prepare_time: Duration,
    /// Ids prepared per second.
    pub ids_per_second: f64,
    /// Distinct rows per batch, on average.
    pub unique_per_batch: f64,
}

/// Replays `trace` (ids of every batch) under `policy`, after a frequency reorder by `counts`
/// (id counts, e.g. a [`super::bincount`] of the trace: dataset statistics) and a warm-up. A
/// [`CachePolicy::Optimal`] given here is rebuilt from the trace itself.
pub fn replay(
    trace: &[Vec<u32>],
    counts: &[u64],
    policy: CachePolicy,
    config: &ReplayConfig,
) -> Result<ReplayStats> {
    let mut index = CacheIndex::new(config.rows, config.capacity, CachePolicy::Frequency)?;
    index.reorder(counts)?;
    let policy = match policy {
        CachePolicy::Optimal(_) => {
            let rows: Vec<Vec<u32>> = trace
                .iter()
                .map(|b| index.rows_of(b))
                .collect::<Result<_>>()?;
            CachePolicy::Optimal(OptimalTrace::new(&rows)?)
        }
        p => p,
    };
    index.set_policy(policy);
    let warm = (config.warmup.clamp(0.0, 1.0) * index.capacity() as f64).ceil() as usize;
    let warmup_rows = index.preload(warm).len();
    let before = index.stats();
    let mut time = Duration::ZERO;
    let mut ids = 0usize;
    let mut unique = 0usize;
    let mut dirty = Vec::new();
    for batch in trace {
        let t = Instant::now();
        let plan = index.prepare(batch)?;
        time += t.elapsed();
        ids += batch.len();
        unique += plan.unique;
        if config.train {
            dirty.clear();
            dirty.extend_from_slice(&plan.slots);
            dirty.sort_unstable();
            dirty.dedup();
            index.mark_dirty(&dirty)?;
        }
    }
    let s = index.stats();
    let n = trace.len().max(1) as f64;
    let admitted = (s.admitted - before.admitted) as f64;
    let written = (s.written_back - before.written_back) as f64;
    Ok(ReplayStats {
        batches: trace.len(),
        hit_rate: s.hit_rate(),
        h2d_rows_per_batch: admitted / n,
        h2d_bytes_per_batch: admitted * config.row_bytes as f64 / n,
        d2h_bytes_per_batch: written * config.row_bytes as f64 / n,
        warmup_rows,
        prepare_time: time,
        ids_per_second: ids as f64 / time.as_secs_f64().max(1e-12),
        unique_per_batch: unique as f64 / n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rng::{Rng, SplitMix64};
    use crate::embedding::bincount;

    #[test]
    fn optimal_bounds_every_policy_and_counts_bytes() {
        let mut rng = SplitMix64::new(1);
        let trace: Vec<Vec<u32>> = (0..40)
            .map(|_| {
                (0..50)
                    .map(|_| {
                        // Skewed: ids squared toward 0.
                        let u = rng.below(1000) as u32;
                        u * u / 1000
                    })
                    .collect()
            })
            .collect();
        let counts = bincount(1000, trace.iter().map(|b| b.as_slice())).unwrap();
        let config = ReplayConfig {
            rows: 1000,
            capacity: 80,
            row_bytes: 16,
            warmup: 0.7,
            train: true,
        };
        let opt = replay(
            &trace,
            &counts,
            CachePolicy::Optimal(OptimalTrace::new([[0u32]]).unwrap()),
            &config,
        )
        .unwrap();
        for p in [CachePolicy::Frequency, CachePolicy::Lfu, CachePolicy::Lru] {
            let s = replay(&trace, &counts, p, &config).unwrap();
            assert!(s.hit_rate <= opt.hit_rate + 1e-12);
            assert!(s.hit_rate > 0.0);
            assert_eq!(s.h2d_bytes_per_batch, s.h2d_rows_per_batch * 16.0);
            assert!(s.d2h_bytes_per_batch > 0.0);
        }
        assert_eq!(opt.warmup_rows, 56);
        let ro = ReplayConfig {
            train: false,
            ..config
        };
        let s = replay(&trace, &counts, CachePolicy::Lru, &ro).unwrap();
        assert_eq!(
            s.d2h_bytes_per_batch, 0.0,
            "nothing is dirty without training"
        );
    }
}
