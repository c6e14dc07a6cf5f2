//! ZeRO over chunks: data-parallel ranks that each hold a shard of the model data.
//!
//! # Sharding by chunk ownership
//!
//! Every rank packs the same tensors into the same chunk groups. Groups form *communication
//! groups* of N consecutive groups (N = world size); in communication group `j`, group
//! `j·N + r` is owned by rank `r`. A rank keeps, in its own [`ChunkManager`], only the groups it
//! owns — all four lists (parameters/gradients, fp32 masters, momentum, variance) — so its model
//! data is about 1/N of the whole, placed on device, host or file tier by the same tide-aware
//! scheduler as without sharding. [`HybridAdam`] runs on that manager, so only owned chunks are
//! stepped.
//!
//! Chunk ownership (PatrickStar's scheme) rather than N contiguous shards of every chunk
//! (Gemini's) keeps every tensor whole inside one owned chunk: the optimizer, gradient
//! statistics, checkpointing and the host/device/file tiers work on whole chunks unchanged, and
//! a collective moves one chunk per rank, large messages that run at full bus bandwidth. The
//! price: the group count is rounded up to a multiple of N (the last communication group may
//! have ranks that own nothing, and contribute padding), and a rank's share is uneven when the
//! number of groups is not a multiple of N or chunk sizes differ (a tensor larger than a chunk
//! gets a group of its own). [`ZeroManager::shard_balance`] reports it.
//!
//! # One iteration
//!
//! - **Gather before use.** The first fetch of a tensor whose communication group is not
//!   gathered allocates a gather buffer of N chunk slots from the non-model pool, copies the
//!   owned chunk (fetched through the rank's manager) into this rank's slot and all-gathers the
//!   group. Fetches return views into it. Gather buffers come from the pool the tide tracer
//!   watches, so the scheduler's budget at every moment leaves room for them.
//! - **Prefetch** (opt-in, [`ZeroManager::set_prefetch`]). The warm-up iteration records the
//!   order in which forward and backward first use communication groups. Afterwards, each use
//!   of the group the record expects next starts the gathers of the following `depth` groups:
//!   the owned chunk is copied into the buffer on the compute stream and the all-gather runs on
//!   a separate communication stream, overlapping the compute of the current group (with NCCL;
//!   the in-process backend gathers on the host either way). The first fetch of a prefetched
//!   group orders the compute stream after its all-gather through an event. If a stage leaves
//!   the recorded order, prefetching stops until the next stage; every rank makes the same
//!   decision, since every rank runs the same code. Prefetching starts once every rank's
//!   manager has finished its warm-up, agreed by a one-byte all-reduce at the end of each
//!   warm-up step, so no rank prefetches while another still records. During warm-up the pool
//!   holds a reserve of `depth` gather buffers, so the tide the scheduler plans with has room
//!   for the prefetched buffers. A forward gather made ahead fetches the owned chunk then, as an on-demand one
//!   does. A backward gather made ahead copies the owned chunk's parameters without a use
//!   ([`ChunkManager::copy_param_into`]); the chunk is fetched and held for its gradients at
//!   the group's first backward use, the moment the warm-up recorded, so the rank's manager
//!   never holds more chunks than its tide planned for. A group gathered ahead that its stage
//!   never uses is freed at the end of the stage, without a collective.
//! - **Free after the stage.** In forward, when every tensor of the communication group has
//!   finished its forward use (HOLD_AFTER_FWD), the buffer is freed; a later forward use (a
//!   shared parameter) gathers again. The end of forward frees what is left.
//! - **Reduce-scatter after backward.** When every tensor of the group that was used in forward
//!   has had its last backward use (HOLD_AFTER_BWD), the gradients written into the buffer are
//!   reduce-scattered with [`ReduceOp::Avg`] (each rank's gradient is the mean over its share of
//!   the global batch, so the average is the gradient of the global batch) and the owner copies
//!   its slot's gradients into its chunk. The owned chunk stays fetched from the group's first
//!   backward use to this point.
//! - **Step.** [`ZeroManager::step`] runs HybridAdam on the owned chunks with the gradient
//!   statistics all-reduced: sums of squares summed, the overflow flag by MAX, so every rank
//!   clips by the global norm and skips together.
//!
//! Every rank must make the same calls in the same order (the trainer code is the same on all
//! ranks); the collectives check it on the in-process backend.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::checkpoint::Reader;
use crate::chunk::{ChunkManager, Layout, ManagerConfig};
use crate::comm::{Communicator, ReduceOp};
use crate::device::{CachingAllocator, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::HybridAdam;
use crate::tensor::Stage;

// ZeroManager's methods live by concern: construction, accessors and checkpoints here, the
// tensor table in `table`, gathers and prefetch in `gather`, fetches, releases and gradient
// writes in `iteration`, the reduce-scatter and optimizer step in `step`, statistics in `stats`.
mod gather;
mod iteration;
mod stats;
mod step;
mod table;
mod versions;

use gather::{Gather, Prefetch};
pub use stats::ZeroStats;
use table::ZTensor;

/// A data-parallel rank's view of a model sharded over chunks. See the [module docs](self).
///
/// ```
/// use tidemem::chunk::ManagerConfig;
/// use tidemem::comm::Communicator;
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::optim::{AdamConfig, HybridAdam, HybridConfig};
/// use tidemem::tensor::{Init, Stage};
/// use tidemem::tide::Policy;
/// use tidemem::zero::ZeroManager;
/// # fn main() -> tidemem::Result<()> {
/// let devs = (0..2)
///     .map(|_| Device::sim(SimConfig::with_capacity(1 << 20)))
///     .collect::<tidemem::Result<Vec<_>>>()?;
/// let comms = Communicator::local(devs)?;
/// let masters = std::thread::scope(|s| {
///     let hs: Vec<_> = comms
///         .into_iter()
///         .map(|c| {
///             s.spawn(move || -> tidemem::Result<(bool, f32)> {
///                 let mut z = ZeroManager::new(c, ManagerConfig::new(64, Policy::Tide))?;
///                 z.set_prefetch(1)?; // gather the next group ahead once warm
///                 let a = z.register("a", &[64], Init::Constant(1.0))?; // group 0: rank 0
///                 let b = z.register("b", &[64], Init::Constant(2.0))?; // group 1: rank 1
///                 let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1)))?;
///                 z.fetch(&[a, b], Stage::Forward)?;
///                 z.release(&[a, b], Stage::Forward)?;
///                 z.end_forward()?;
///                 z.fetch(&[a, b], Stage::Backward)?;
///                 let g = z.comm().rank() as f32; // each rank's gradient: 0 and 1
///                 z.write_grad(a, &[g; 64])?;
///                 z.write_grad(b, &[g; 64])?;
///                 z.release(&[a, b], Stage::Backward)?;
///                 z.end_backward()?;
///                 z.step(&mut adam)?;
///                 let own = if z.owns(a) { a } else { b };
///                 Ok((z.owns(a), z.master(own)?[0]))
///             })
///         })
///         .collect();
///     hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
/// });
/// // the averaged gradient (0.5) moved both tensors down by lr on the first Adam step
/// assert_eq!(masters[0].as_ref().unwrap(), &(true, 0.9));
/// assert_eq!(masters[1].as_ref().unwrap(), &(false, 1.9));
/// # Ok(()) }
/// ```
pub struct ZeroManager {
    comm: Communicator,
    local: ChunkManager,
    pool: CachingAllocator,
    stream: Arc<Stream>,
    comm_stream: Stream,
    layout: Layout,
    tensors: Vec<ZTensor>,
    closed: bool,
    gathers: Vec<Option<Gather>>,
    prefetch: Prefetch,
    stage: Option<Stage>,
    stats: ZeroStats,
}

impl std::fmt::Debug for ZeroManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroManager")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world())
            .field("tensors", &self.tensors.len())
            .field("groups", &self.layout.groups())
            .finish()
    }
}

impl ZeroManager {
    /// Rank `comm.rank()` of a data-parallel group, with its shard in a [`ChunkManager`] on the
    /// communicator's device configured by `cfg` (and a non-model pool the trainer shares, see
    /// [`ZeroManager::pool`]).
    pub fn new(comm: Communicator, cfg: ManagerConfig) -> Result<Self> {
        let device = comm.device().clone();
        let layout = Layout::new(cfg.chunk_elems)?;
        let mut local = ChunkManager::new(device.clone(), cfg)?;
        let comm_stream = device.new_stream()?;
        let pool = CachingAllocator::new(device);
        local.set_non_model_allocator(pool.clone());
        let stream = local.compute_arc();
        Ok(ZeroManager {
            comm,
            local,
            pool,
            stream,
            comm_stream,
            layout,
            tensors: Vec::new(),
            closed: false,
            gathers: Vec::new(),
            prefetch: Prefetch::default(),
            stage: None,
            stats: ZeroStats::default(),
        })
    }

    /// Gathers up to `depth` communication groups ahead of their first use in forward and in
    /// backward, in the order the warm-up iteration recorded (0, the default, gathers on demand only). Set it
    /// before the first fetch, to the same value on every rank.
    pub fn set_prefetch(&mut self, depth: usize) -> Result<()> {
        if self.closed {
            return Err(Error::InvalidArgument(
                "set_prefetch must come before registration closes (the first fetch, or a \
                 checkpoint save or load)"
                    .into(),
            ));
        }
        self.prefetch.depth = depth;
        Ok(())
    }

    /// The communication stream prefetched all-gathers run on.
    pub fn comm_stream(&self) -> &Stream {
        &self.comm_stream
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// This rank's manager, which holds the owned chunks.
    pub fn local(&self) -> &ChunkManager {
        &self.local
    }

    /// The non-model pool: gather buffers come from it, and so should the trainer's activations,
    /// so that the tide sees both.
    pub fn pool(&self) -> &CachingAllocator {
        &self.pool
    }

    /// The stream every device operation of this rank runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The global chunk layout (the same on every rank).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn es(&self) -> usize {
        self.local.param_dtype().size()
    }

    /// The element type of parameters and gradients.
    pub fn param_dtype(&self) -> DType {
        self.local.param_dtype()
    }

    /// Saves this rank's shard (the tensors of the chunks it owns, by their global names) and
    /// `adam`'s counters to `path`, as [`HybridAdam::save_checkpoint`] does, with the rank and
    /// world size in the metadata: every rank saves its own file. Every rank must call it:
    /// each writes its file beside its target, the ranks agree (a one-byte all-reduce) that all
    /// did, and only then does any file replace an earlier one; otherwise every rank fails and
    /// the earlier files stay, so the ranks' files are always from one step (short of a failed
    /// rename itself, which every rank then reports and [`ZeroManager::load_checkpoint`] would
    /// notice). Between iterations only; closes registration.
    pub fn save_checkpoint(&mut self, adam: &HybridAdam, path: impl AsRef<Path>) -> Result<()> {
        let mine = self
            .idle("save_checkpoint")
            .and_then(|()| self.close())
            .and_then(|()| adam.checkpoint_metadata())
            .and_then(|mut meta| {
                meta.insert(META_RANK.into(), self.comm.rank().to_string());
                meta.insert(META_WORLD.into(), self.world().to_string());
                self.local.save_checkpoint_unpersisted(path.as_ref(), &meta)
            });
        // every rank leaves here alike (an error everywhere unless all wrote), and otherwise
        // reaches the second agreement
        self.comm.agree(mine.is_ok())?;
        let done = mine?.persist();
        // a rename that failed on one rank after the agreement is reported on every rank
        self.comm.agree(done.is_ok())?;
        done
    }

    /// Loads this rank's shard and `adam`'s counters from a file that
    /// [`ZeroManager::save_checkpoint`] wrote on the same rank of a group of the same size.
    /// Every rank must call it: each checks its file, the ranks agree (a one-byte all-reduce)
    /// that every file fits and (two more) that all were saved at the same step, and only then
    /// does any rank load; otherwise every rank fails and none changes. Between iterations
    /// only; closes registration.
    pub fn load_checkpoint(&mut self, adam: &mut HybridAdam, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        // every local failure, closing registration included, goes into the agreement, so that
        // no rank waits for one that returned early; the file stays open from check to load
        let mine = self
            .idle("load_checkpoint")
            .and_then(|()| self.close())
            .and_then(|()| Reader::open(path))
            .and_then(|file| Ok((self.check_shard(adam, &file, path)?, file)));
        self.comm.agree(mine.is_ok())?;
        let (meta, file) = mine?;
        let steps = adam.checkpoint_steps(&meta)? as f64;
        let (mut lo, mut hi) = ([steps], [steps]);
        self.comm.all_reduce_host(&mut lo, ReduceOp::Min)?;
        self.comm.all_reduce_host(&mut hi, ReduceOp::Max)?;
        if lo != hi {
            return Err(Error::InvalidArgument(format!(
                "the ranks' checkpoints were saved at different steps ({} to {}): no rank loads",
                lo[0], hi[0]
            )));
        }
        let done = self
            .local
            .load_checkpoint_file(&file, |_| Ok(()))
            .and_then(|meta| adam.restore_metadata(&meta));
        // a load that failed on one rank after the agreement is reported on every rank
        self.comm.agree(done.is_ok())?;
        done
    }

    /// This rank's file fits: saved by this rank of this group, for this optimizer and these
    /// tensors. Returns its metadata.
    fn check_shard(
        &self,
        adam: &HybridAdam,
        file: &Reader,
        path: &Path,
    ) -> Result<BTreeMap<String, String>> {
        let meta = file.metadata()?;
        let (r, n) = (self.comm.rank().to_string(), self.world().to_string());
        if meta.get(META_RANK) != Some(&r) || meta.get(META_WORLD) != Some(&n) {
            return Err(Error::InvalidArgument(format!(
                "checkpoint {} was saved by rank {} of {}, this is rank {r} of {n}",
                path.display(),
                meta.get(META_RANK).map_or("?", String::as_str),
                meta.get(META_WORLD).map_or("?", String::as_str),
            )));
        }
        adam.check_metadata(&meta)?;
        self.local.check_checkpoint(file)
    }

    fn idle(&self, what: &str) -> Result<()> {
        match self.stage {
            None => Ok(()),
            Some(s) => Err(Error::InvalidArgument(format!(
                "{what} runs between iterations, not during the {} stage",
                s.name()
            ))),
        }
    }
}

/// Checkpoint metadata keys of a [`ZeroManager`] shard.
const META_RANK: &str = "zero.rank";
const META_WORLD: &str = "zero.world";

// --- support for the trainer API (`crate::store`): the stage (shapes are in `table`, gradient
// marks in `iteration`) ---
/// The name of a stage in a [`Error::WrongStage`] (`idle` between iterations).
fn stage_name(s: Option<Stage>) -> &'static str {
    s.map_or("idle", Stage::name)
}

impl ZeroManager {
    /// The stage of the iteration in progress (`None` between iterations).
    pub fn stage(&self) -> Option<Stage> {
        self.stage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_manager_crosses_threads() {
        fn check<T: Send + Sync>() {}
        check::<ZeroManager>();
    }
}
