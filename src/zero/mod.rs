//! ZeRO over chunks: data-parallel ranks that each hold a shard of the model data.
//!
//! # Sharding by chunk ownership
//!
//! Every rank packs the same tensors into the same chunk groups. Groups form *communication
//! groups* of N consecutive groups (N = world size); in communication group `j`, group
//! `j·N + r` is owned by rank `r`. A rank keeps, in its own [`ChunkManager`], only the groups it
//! owns — all four lists (parameters/gradients, fp32 masters, momentum, variance) — so its model
//! data is about 1/N of the whole, placed on device, host or file tier by the same tide-aware
//! scheduler as without sharding. [`HybridAdam`](crate::optim::HybridAdam) runs on that
//! manager, so only owned chunks are stepped.
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
//!   reduce-scattered with [`ReduceOp::Avg`](crate::comm::ReduceOp::Avg) (each rank's
//!   gradient is the mean over its share of the global batch, so the average is the gradient
//!   of the global batch) and the owner copies
//!   its slot's gradients into its chunk. The owned chunk stays fetched from the group's first
//!   backward use to this point.
//! - **Step.** [`ZeroManager::step`] runs HybridAdam on the owned chunks with the gradient
//!   statistics all-reduced: sums of squares summed, the overflow flag by MAX, so every rank
//!   clips by the global norm and skips together.
//!
//! Every rank must make the same calls in the same order (the trainer code is the same on all
//! ranks); the collectives check it on the in-process backend.
//!
//! # Checkpoints
//!
//! A checkpoint of several ranks is one file a rank, each carrying its rank and the world
//! size (metadata `zero.rank`, `zero.world` for a ZeRO shard; `ranks.rank`, `ranks.world` for
//! the whole manager of a tensor-, sequence- or pipeline-parallel rank, saved by
//! [`ParamStore::save_rank`](crate::store::ParamStore::save_rank)). The ranks that agree on a
//! save are the communicator's: a ZeRO group's own ([`ZeroManager::save_checkpoint`]), or every
//! rank of a model-parallel run (`save_rank`'s `world`), so that no tensor-parallel group ends
//! at another save than its neighbours. The protocol below is the same for both.
//!
//! Every save has an identity all its files carry (metadata `zero.save`, `ranks.save`): a
//! number rank 0
//! draws (the time in microseconds, and above every save the ranks' files hold) and every rank
//! receives through an all-reduce. A rank's file at `path` is the current generation; while a
//! save is under way, the save every rank holds is kept beside it as the previous generation,
//! `path` + `.prev` (beside the final target when `path` is a symbolic link). A save:
//!
//! 1. each rank lists the saves of its current and previous files; the ranks agree on the
//!    newest save every rank holds (all-reduces: the oldest of the ranks' newest saves, then
//!    older ones while a rank lacks the candidate), the one a load would pick now, and on the
//!    new save's identity;
//! 2. each rank writes its new file beside its target (a temporary file, synced); the ranks
//!    agree that all did, or all fail and nothing changed;
//! 3. each rank keeps the agreed save: if its current file holds it, it is renamed to the
//!    previous generation (if the previous generation holds it already, it stays); then the
//!    new file is renamed over the current one and the directory synced;
//! 4. the ranks agree that every rename happened, and only then does each rank remove its
//!    previous generation.
//!
//! A kill at any point leaves every rank holding the agreed save, as its current or previous
//! file, until every rank holds the new one. A load does what step 1 does: each rank lists its
//! generations, the ranks agree on the newest save every rank holds, and each rank loads its
//! file of that save; a rank that has none (the files of two runs, or of two saves, put
//! together) fails with [`Error::SaveMismatch`] and no rank loads.
//! So a load after a kill gives the earlier save or the new one, bit for bit, never a mix; and
//! the next save starts from the same agreement, so a kill during it loses nothing either. A
//! killed save's temporary files are removed by the next save to the same paths, its previous
//! generations by the next save that completes.
//!
//! Files written before save identities existed count as save 0 and load as before (the ranks'
//! step counts must then agree).

use std::sync::Arc;

use crate::chunk::{ChunkLayout, ChunkManager, ManagerConfig};
use crate::comm::Communicator;
use crate::device::{CachingAllocator, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Stage;

// ZeroManager's methods live by concern: construction and accessors here, checkpoints in
// `checkpoint`, the tensor table in `table`, gathers and prefetch in `gather`, fetches, releases and gradient
// writes in `iteration`, the reduce-scatter and optimizer step in `step`, statistics in `stats`.
mod checkpoint;
mod gather;
mod iteration;
mod rank_files;
mod stats;
mod step;
mod table;
mod versions;

use gather::{Gather, Prefetch};
pub(crate) use rank_files::{Holds, RankFiles};
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
    layout: ChunkLayout,
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
        let layout = ChunkLayout::new(cfg.chunk_elems)?;
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
            return Err(Error::Conflict {
                what: "set_prefetch".into(),
                with: "a closed registration (it closes at the first fetch, or a checkpoint \
                       save or load): set it before"
                    .into(),
            });
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
    pub fn layout(&self) -> &ChunkLayout {
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

    fn idle(&self, what: &str) -> Result<()> {
        match self.stage {
            None => Ok(()),
            Some(s) => Err(Error::WrongStage {
                call: format!("{what} (it runs between iterations)"),
                stage: s.name(),
            }),
        }
    }
}

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
