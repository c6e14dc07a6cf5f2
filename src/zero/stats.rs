//! Statistics of a [`ZeroManager`]: its collective work, and the balance and usage of the
//! shards.

use super::ZeroManager;
use crate::chunk::Usage;

/// Collective work of a [`ZeroManager`] so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ZeroStats {
    /// Communication groups gathered.
    pub gathers: u64,
    /// Communication groups whose gradients were reduce-scattered.
    pub reduce_scatters: u64,
    /// Bytes of gather buffers all-gathered (N slots each).
    pub gathered_bytes: u64,
    /// Bytes of gather buffers reduce-scattered.
    pub scattered_bytes: u64,
    /// Gathers started ahead of their first use, in forward and backward (included in
    /// `gathers`).
    pub prefetched: u64,
}

impl ZeroManager {
    /// Collectives so far.
    pub fn stats(&self) -> ZeroStats {
        self.stats
    }

    /// Model-data bytes of every rank's shard (four lists), and the unsharded total:
    /// `(per rank, total)`.
    pub fn shard_balance(&self) -> (Vec<u64>, u64) {
        let n = self.comm.world();
        let per_elem = 3 * 4 + self.local.param_dtype().size() as u64;
        let mut per = vec![0u64; n];
        for (g, &e) in self.layout.group_elems.iter().enumerate() {
            per[g % n] += e as u64 * per_elem;
        }
        let total = per.iter().sum();
        (per, total)
    }

    /// The most non-model bytes allocated at once so far on this rank, as
    /// [`ChunkManager::non_model_peak`](crate::chunk::ChunkManager::non_model_peak) reports for
    /// one process: the activations and scratch from [`ZeroManager::pool`] and the gather
    /// buffers of the groups gathered at the time, i.e. what the rank's device must hold beside
    /// its shard.
    pub fn non_model_peak(&self) -> u64 {
        self.local.non_model_peak()
    }

    /// Exact chunk bytes of this rank's shard on every tier.
    pub fn usage(&self) -> Usage {
        self.local.usage()
    }
}
