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
use crate::chunk::{
    check_distinct, encode, numel_of, ChunkManager, Layout, ManagerConfig, Slot, TensorView, Usage,
    ViewBuf,
};
use crate::comm::{Communicator, Elem, ReduceOp};
use crate::device::{Block, CachingAllocator, DeviceView, Event, HostBuffer, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::{GradStats, HybridAdam, StepReport};
use crate::tensor::{next_state, Init, Stage, TensorId, TensorState, TrainEvent};

struct ZTensor {
    name: String,
    shape: Vec<usize>,
    init: Init,
    slot: Slot,
    state: TensorState,
    fwd_uses: u32,
    bwd_uses: u32,
    grad: bool,
    /// Id in this rank's manager, for tensors of owned groups.
    local: Option<TensorId>,
}

struct Gather {
    buf: Arc<Block>,
    /// Whether this rank's owned chunk is held fetched in the rank's manager (backward).
    held: bool,
    /// For a gather made ahead: recorded on the communication stream after its all-gather;
    /// the compute stream waits for it before touching the buffer.
    ready: Option<Event>,
    /// Whether a fetch has used the buffer (false for a gather made ahead until its first
    /// fetch), which decides a forward's first uses the same way on every rank.
    used: bool,
}

/// Prefetch of gathers: the recorded order of first uses and where this stage is in it.
#[derive(Default)]
struct Prefetch {
    depth: usize,
    /// Communication groups in the order forward (0) and backward (1) first used them during
    /// warm-up.
    order: [Vec<usize>; 2],
    recording: bool,
    cursor: usize,
    on_order: bool,
    /// Room for `depth` gather buffers, held in the pool during warm-up.
    reserve: Vec<Block>,
    /// Every rank's manager has finished its warm-up (agreed in `step`, so that every rank
    /// records and prefetches alike).
    all_steady: bool,
}

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

    /// Exact chunk bytes of this rank's shard on every tier.
    pub fn usage(&self) -> Usage {
        self.local.usage()
    }

    /// Registers a parameter on every rank (same calls, same order everywhere).
    pub fn register(&mut self, name: &str, shape: &[usize], init: Init) -> Result<TensorId> {
        if self.closed {
            return Err(Error::InvalidArgument(format!(
                "cannot register '{name}': registration closed at the first fetch"
            )));
        }
        let numel = numel_of(name, shape)?;
        let slot = self.layout.push(numel)?;
        self.tensors.push(ZTensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            slot,
            state: TensorState::Free,
            fwd_uses: 0,
            bwd_uses: 0,
            grad: false,
            local: None,
        });
        Ok(TensorId(self.tensors.len() as u32 - 1))
    }

    /// Whether this rank owns the chunk of `id`.
    pub fn owns(&self, id: TensorId) -> bool {
        self.tensors
            .get(id.index())
            .is_some_and(|t| t.slot.group as usize % self.comm.world() == self.comm.rank())
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn es(&self) -> usize {
        self.local.param_dtype().size()
    }

    /// Closes registration: the owned groups go into this rank's manager, one chunk each, at the
    /// same offsets as in the global layout.
    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let (n, r) = (self.world(), self.comm.rank());
        let groups = self.layout.groups();
        if groups < n {
            return Err(Error::InvalidArgument(format!(
                "the model packs into {groups} chunk groups, fewer than the {n} ranks: use smaller chunks"
            )));
        }
        if self.prefetch.depth > 0 && self.prefetch.reserve.is_empty() {
            // Room for `depth` gather buffers during warm-up, one block each so that each can
            // serve a gather later; allocated first, so a failure changes nothing.
            let largest = (0..groups.div_ceil(n))
                .map(|j| n * self.slot_elems(j) * self.es())
                .max()
                .unwrap_or(0);
            let depth = self.prefetch.depth.min(groups.div_ceil(n));
            let reserve = (0..depth)
                .map(|_| self.pool.alloc(largest))
                .collect::<Result<Vec<_>>>()?;
            self.prefetch.reserve = reserve;
        }
        for g in (r..groups).step_by(n) {
            self.local.seal_chunk()?;
            for &t in &self.layout.group_tensors[g].clone() {
                let zt = &self.tensors[t as usize];
                let id = self.local.register(&zt.name, &zt.shape, zt.init.clone())?;
                let (_, _, slot) = self.local.tensor_info(id)?;
                if slot.offset != zt.slot.offset {
                    return Err(Error::InvalidArgument(format!(
                        "tensor '{}' packs at offset {} locally but {} globally",
                        zt.name, slot.offset, zt.slot.offset
                    )));
                }
                self.tensors[t as usize].local = Some(id);
            }
        }
        self.local.close()?;
        self.gathers = (0..groups.div_ceil(n)).map(|_| None).collect();
        self.closed = true;
        Ok(())
    }

    /// Elements of one rank's slot in communication group `j` (its largest chunk).
    fn slot_elems(&self, j: usize) -> usize {
        let n = self.world();
        let end = ((j + 1) * n).min(self.layout.groups());
        self.layout.group_elems[j * n..end]
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Tensors of communication group `j`.
    fn comm_group_tensors(&self, j: usize) -> Vec<u32> {
        let n = self.world();
        let end = ((j + 1) * n).min(self.layout.groups());
        (j * n..end)
            .flat_map(|g| self.layout.group_tensors[g].iter().copied())
            .collect()
    }

    /// Local ids of the tensors of the group this rank owns in communication group `j`.
    fn owned_local(&self, j: usize) -> Vec<(u32, TensorId)> {
        let g = j * self.world() + self.comm.rank();
        if g >= self.layout.groups() {
            return Vec::new();
        }
        self.layout.group_tensors[g]
            .iter()
            .map(|&t| (t, self.tensors[t as usize].local.expect("owned")))
            .collect()
    }

    /// Gathers communication group `j`: this rank's owned chunk into its slot, then the
    /// all-gather, on the compute stream, or on the communication stream when `ahead`.
    fn gather(&mut self, j: usize, stage: Stage, ahead: bool) -> Result<()> {
        let (n, r, es) = (self.world(), self.comm.rank(), self.es());
        let slot = self.slot_elems(j) * es;
        let owned = self.owned_local(j);
        let ids: Vec<TensorId> = owned.iter().map(|&(_, id)| id).collect();
        let already_fwd = !ids.is_empty()
            && self.local.state(ids[0], crate::chunk::ChunkKind::Param)?
                == TensorState::HoldAfterFwd;
        let mut held = false;
        let buf = Arc::new(self.pool.alloc(n * slot)?);
        let dev = self.comm.device().clone();
        let mine = buf.view(r * slot, slot)?;
        dev.memset(&self.stream, mine, 0)?;
        if (stage == Stage::Forward && already_fwd) || (stage == Stage::Backward && ahead) {
            // A second forward gather (a shared parameter): the chunk was fetched once this
            // forward; its values are unchanged, copy them without a second use. A backward
            // gather made ahead: copy the values without a use too; the owned chunk is fetched
            // and held for its gradients at the group's first use, where the tide has it.
            for &(t, id) in &owned {
                let zt = &self.tensors[t as usize];
                let (off, len) = (zt.slot.offset * es, zt.slot.numel * es);
                self.local
                    .copy_param_into(id, buf.view(r * slot + off, len)?)?;
            }
        } else if !ids.is_empty() {
            let views = self.local.fetch(&ids, stage)?;
            for (v, &(t, _)) in views.iter().zip(&owned) {
                let off = self.tensors[t as usize].slot.offset * es;
                dev.copy_d2d(
                    &self.stream,
                    v.view(),
                    buf.view(r * slot + off, v.view().len())?,
                )?;
            }
            drop(views);
            if stage == Stage::Forward {
                self.local.release(&ids, stage)?;
            } else {
                held = true;
            }
        }
        let elem = Elem::from(self.local.param_dtype());
        let mut ready = None;
        if ahead {
            let filled = dev.new_event()?;
            dev.record(&self.stream, &filled)?;
            dev.wait_event(&self.comm_stream, &filled)?;
        }
        let stream = if ahead {
            &self.comm_stream
        } else {
            &*self.stream
        };
        self.comm.all_gather(
            stream,
            buf.view(r * slot, slot)?,
            buf.view(0, n * slot)?,
            elem,
        )?;
        if ahead {
            let done = dev.new_event()?;
            dev.record(&self.comm_stream, &done)?;
            ready = Some(done);
            self.stats.prefetched += 1;
        }
        self.stats.gathers += 1;
        self.stats.gathered_bytes += (n * slot) as u64;
        self.gathers[j] = Some(Gather {
            buf,
            held,
            used: !ahead,
            ready,
        });
        Ok(())
    }

    /// Orders the compute stream after the all-gather of group `j` if it was made ahead.
    fn wait_ready(&self, j: usize) -> Result<()> {
        match self.gathers[j].as_ref().and_then(|g| g.ready.as_ref()) {
            Some(ev) => self.comm.device().wait_event(&self.stream, ev),
            None => Ok(()),
        }
    }

    /// The first use of group `j` in `stage`: recorded during warm-up; afterwards, if it is the
    /// use the record expects, the next `depth` groups of the record are gathered ahead.
    fn first_use(&mut self, j: usize, stage: Stage) -> Result<()> {
        let p = &mut self.prefetch;
        if p.depth == 0 {
            return Ok(());
        }
        let order = &mut p.order[usize::from(stage == Stage::Backward)];
        if p.recording {
            order.push(j);
            return Ok(());
        }
        if !p.on_order || order.get(p.cursor) != Some(&j) {
            p.on_order = false;
            return Ok(());
        }
        p.cursor += 1;
        let next: Vec<usize> = order[p.cursor..(p.cursor + p.depth).min(order.len())].to_vec();
        for k in next {
            if self.gathers[k].is_none() {
                self.gather(k, stage, true)?;
            }
        }
        Ok(())
    }

    /// Fetches and holds this rank's owned chunk of group `j` for its gradients, if a gather
    /// made ahead in backward did not.
    fn hold_owned(&mut self, j: usize) -> Result<()> {
        if self.gathers[j].as_ref().is_none_or(|g| g.held) {
            return Ok(());
        }
        let ids: Vec<TensorId> = self.owned_local(j).iter().map(|&(_, id)| id).collect();
        if !ids.is_empty() {
            drop(self.local.fetch(&ids, Stage::Backward)?);
            self.gathers[j].as_mut().expect("gathered").held = true;
        }
        Ok(())
    }

    fn take_gather(&mut self, j: usize) -> Result<Gather> {
        let g = self.gathers[j].as_ref().expect("gathered");
        if Arc::strong_count(&g.buf) > 1 {
            return Err(Error::ViewAlive {
                what: format!("communication group {j}"),
                during: "release",
            });
        }
        // A prefetched buffer never used: the pool may hand it to the compute stream next.
        self.wait_ready(j)?;
        Ok(self.gathers[j].take().expect("gathered"))
    }

    /// Averages the gradients of communication group `j` into their owners' chunks and frees
    /// the gather buffer.
    fn reduce_scatter(&mut self, j: usize) -> Result<()> {
        let g = self.take_gather(j)?;
        let (n, r, es) = (self.world(), self.comm.rank(), self.es());
        let slot = self.slot_elems(j) * es;
        let elem = Elem::from(self.local.param_dtype());
        self.comm.reduce_scatter(
            &self.stream,
            g.buf.view(0, n * slot)?,
            g.buf.view(r * slot, slot)?,
            elem,
            ReduceOp::Avg,
        )?;
        if g.held {
            let owned = self.owned_local(j);
            for &(t, id) in &owned {
                let zt = &self.tensors[t as usize];
                if zt.grad {
                    let src = g
                        .buf
                        .view(r * slot + zt.slot.offset * es, zt.slot.numel * es)?;
                    self.local.write_grad_device(id, src)?;
                }
            }
            let ids: Vec<TensorId> = owned.iter().map(|&(_, id)| id).collect();
            self.local.release(&ids, Stage::Backward)?;
        }
        self.stats.reduce_scatters += 1;
        self.stats.scattered_bytes += (n * slot) as u64;
        Ok(())
    }

    fn check(&self, ids: &[TensorId], ev: TrainEvent) -> Result<()> {
        for &id in ids {
            let t = self
                .tensors
                .get(id.index())
                .ok_or(Error::UnknownTensor { id: id.0 })?;
            if next_state(t.state, ev).is_none() {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: "param",
                    state: t.state,
                    event: ev,
                });
            }
        }
        check_distinct(ids)
    }

    fn apply(&mut self, id: TensorId, ev: TrainEvent) {
        let t = &mut self.tensors[id.index()];
        t.state = next_state(t.state, ev).expect("checked");
    }

    fn comm_group(&self, id: TensorId) -> usize {
        self.tensors[id.index()].slot.group as usize / self.world()
    }

    fn view_of(&self, id: TensorId) -> Result<DeviceView<'_>> {
        let t = &self.tensors[id.index()];
        let (n, es) = (self.world(), self.es());
        let j = t.slot.group as usize / n;
        let q = t.slot.group as usize % n;
        let g = self.gathers[j].as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!("tensor '{}' is not gathered on this rank", t.name))
        })?;
        let slot = self.slot_elems(j) * es;
        g.buf.view(q * slot + t.slot.offset * es, t.slot.numel * es)
    }

    /// Fetches tensors for an op of `stage`, gathering their communication groups first; the
    /// views point into the gather buffers and stay valid until [`ZeroManager::release`].
    pub fn fetch(&mut self, ids: &[TensorId], stage: Stage) -> Result<Vec<TensorView>> {
        let ev = match stage {
            Stage::Forward => TrainEvent::BeforeFwdOp,
            Stage::Backward => TrainEvent::BeforeBwdOp,
            Stage::Optimizer => {
                return Err(Error::WrongStage {
                    call: "fetch for the optimizer (fetch is for forward and backward; the \
                           optimizer runs in step)"
                        .into(),
                    stage: stage_name(self.stage),
                })
            }
        };
        match (self.stage, stage) {
            (None, Stage::Forward) | (Some(Stage::Forward), Stage::Forward) => {}
            (Some(Stage::Backward), Stage::Backward) => {}
            (s, _) => {
                return Err(Error::WrongStage {
                    call: format!("a {stage} fetch (call end_forward / end_backward / step first)"),
                    stage: stage_name(s),
                })
            }
        }
        self.check(ids, ev)?;
        self.close()?;
        if self.stage.is_none() {
            // a new iteration: record the forward order until the tide is steady
            let p = &mut self.prefetch;
            p.recording = p.depth > 0 && !p.all_steady;
            if p.recording {
                p.order.iter_mut().for_each(Vec::clear);
            }
            p.cursor = 0;
            p.on_order = true;
        }
        let mut groups: Vec<usize> = ids.iter().map(|&id| self.comm_group(id)).collect();
        groups.dedup();
        for j in groups {
            let first_use = match &self.gathers[j] {
                None => {
                    self.gather(j, stage, false)?;
                    true
                }
                Some(g) => !g.used,
            };
            if let Some(ev) = self.gathers[j].as_mut().and_then(|g| g.ready.take()) {
                self.comm.device().wait_event(&self.stream, &ev)?;
            }
            if first_use {
                if stage == Stage::Backward {
                    self.hold_owned(j)?;
                }
                self.first_use(j, stage)?;
            }
            // used only once the owned chunk is held: a failed fetch is a first use again
            self.gathers[j].as_mut().expect("gathered above").used = true;
        }
        self.stage = Some(stage);
        for &id in ids {
            self.apply(id, ev);
            let t = &mut self.tensors[id.index()];
            match stage {
                Stage::Forward => t.fwd_uses += 1,
                _ => t.bwd_uses += 1,
            }
        }
        let (n, es, dt) = (self.world(), self.es(), self.local.param_dtype());
        ids.iter()
            .map(|&id| {
                let t = &self.tensors[id.index()];
                let j = t.slot.group as usize / n;
                let q = t.slot.group as usize % n;
                let g = self.gathers[j].as_ref().expect("gathered above");
                let off = q * self.slot_elems(j) * es + t.slot.offset * es;
                Ok(TensorView::new(
                    id,
                    dt,
                    t.slot.numel,
                    ViewBuf::Pooled(Arc::clone(&g.buf)),
                    off,
                ))
            })
            .collect()
    }

    /// Ends an op's use of tensors; frees or reduce-scatters communication groups that are done
    /// with the stage.
    pub fn release(&mut self, ids: &[TensorId], stage: Stage) -> Result<()> {
        if self.stage != Some(stage) || stage == Stage::Optimizer {
            return Err(Error::WrongStage {
                call: format!("a release for {stage}"),
                stage: stage_name(self.stage),
            });
        }
        let evs: Vec<TrainEvent> = ids
            .iter()
            .map(|&id| {
                let t = self.tensors.get(id.index());
                match (stage, t) {
                    (Stage::Forward, _) => TrainEvent::AfterFwdOp,
                    (_, Some(t)) if t.bwd_uses >= t.fwd_uses => TrainEvent::AfterLastBwdOp,
                    _ => TrainEvent::AfterBwdOp,
                }
            })
            .collect();
        for (&id, &ev) in ids.iter().zip(&evs) {
            self.check(&[id], ev)?;
        }
        // the groups this release completes, decided on the states it leads to, so that a
        // refusal (a view still alive) changes nothing
        let after = |t: u32| -> (TensorState, u32) {
            let z = &self.tensors[t as usize];
            match ids.iter().position(|id| id.0 == t) {
                Some(k) => (next_state(z.state, evs[k]).expect("checked"), z.fwd_uses),
                None => (z.state, z.fwd_uses),
            }
        };
        let mut groups: Vec<usize> = ids.iter().map(|&id| self.comm_group(id)).collect();
        groups.sort_unstable();
        groups.dedup();
        let mut done = Vec::new();
        for j in groups {
            let Some(g) = &self.gathers[j] else { continue };
            let ts = self.comm_group_tensors(j);
            let complete = match stage {
                Stage::Forward => ts.iter().all(|&t| after(t).0 == TensorState::HoldAfterFwd),
                _ => ts.iter().all(|&t| {
                    let (s, fwd) = after(t);
                    s == TensorState::HoldAfterBwd || (fwd == 0 && s != TensorState::Compute)
                }),
            };
            if complete {
                if Arc::strong_count(&g.buf) > 1 {
                    return Err(Error::ViewAlive {
                        what: format!("communication group {j}"),
                        during: "release",
                    });
                }
                done.push(j);
            }
        }
        for (&id, &ev) in ids.iter().zip(&evs) {
            self.apply(id, ev);
        }
        for j in done {
            match stage {
                Stage::Forward => drop(self.take_gather(j)?),
                _ => self.reduce_scatter(j)?,
            }
        }
        Ok(())
    }

    /// A fetched tensor's values as f32 (from the gather buffer), or an owned tensor's from this
    /// rank's manager.
    pub fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        if id.index() >= self.tensors.len() {
            return Err(Error::UnknownTensor { id: id.0 });
        }
        if self.closed && self.gathers[self.comm_group(id)].is_some() {
            self.wait_ready(self.comm_group(id))?;
            let dev = self.comm.device().clone();
            let bytes = dev.download(&self.stream, self.view_of(id)?)?;
            return Ok(crate::chunk::decode(&bytes, self.local.param_dtype()));
        }
        match self.tensors[id.index()].local {
            Some(l) => self.local.read(l),
            None => Err(Error::InvalidArgument(format!(
                "tensor '{}' is neither gathered nor owned by rank {}",
                self.tensors[id.index()].name,
                self.comm.rank()
            ))),
        }
    }

    /// The fp32 master values of a tensor this rank owns.
    pub fn master(&mut self, id: TensorId) -> Result<Vec<f32>> {
        match self.tensors.get(id.index()).and_then(|t| t.local) {
            Some(l) => self.local.master(l),
            None => Err(Error::InvalidArgument(format!(
                "rank {} does not own tensor {id}",
                self.comm.rank()
            ))),
        }
    }

    /// Writes a tensor's local gradient (of this rank's share of the batch) at its last backward
    /// use; it is averaged over ranks when its communication group is reduce-scattered.
    pub fn write_grad(&mut self, id: TensorId, grad: &[f32]) -> Result<()> {
        if !self.grad_use(id)? {
            let t = &self.tensors[id.index()];
            return Err(Error::InvalidArgument(format!(
                "gradient of shared tensor '{}' written at backward use {} of {}; write it at the last",
                t.name, t.bwd_uses, t.fwd_uses
            )));
        }
        let t = &self.tensors[id.index()];
        if grad.len() != t.slot.numel {
            return Err(Error::SizeMismatch {
                src: grad.len(),
                dst: t.slot.numel,
            });
        }
        let bytes = encode(grad, self.local.param_dtype());
        let h = HostBuffer::from_slice(&bytes)?;
        let dev = self.comm.device().clone();
        let copy = dev.copy_h2d(&self.stream, h, self.view_of(id)?)?;
        // the stream may hold collectives: wait through the communicator, which gives up on a
        // peer that failed or never comes
        self.comm.wait(&self.stream)?;
        copy.wait()?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }

    /// Ends the forward pass; frees every gather buffer still held.
    pub fn end_forward(&mut self) -> Result<()> {
        if !matches!(self.stage, None | Some(Stage::Forward)) {
            return Err(Error::WrongStage {
                call: "end_forward".into(),
                stage: stage_name(self.stage),
            });
        }
        self.close()?;
        let all: Vec<TensorId> = (0..self.tensors.len() as u32).map(TensorId).collect();
        for &id in &all {
            let t = &self.tensors[id.index()];
            if next_state(t.state, TrainEvent::EndForward).is_none() {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: "param",
                    state: t.state,
                    event: TrainEvent::EndForward,
                });
            }
        }
        for j in 0..self.gathers.len() {
            if self.gathers[j].is_some() {
                drop(self.take_gather(j)?);
            }
        }
        for id in all {
            self.apply(id, TrainEvent::EndForward);
        }
        self.local.end_forward()?;
        self.stage = Some(Stage::Backward);
        self.prefetch.cursor = 0;
        self.prefetch.on_order = true;
        Ok(())
    }

    /// Ends the backward pass: communication groups still gathered (tensors with forward uses
    /// and fewer backward uses) are reduce-scattered now.
    pub fn end_backward(&mut self) -> Result<()> {
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "end_backward".into(),
                stage: stage_name(self.stage),
            });
        }
        if let Some(t) = self
            .tensors
            .iter()
            .find(|t| t.state == TensorState::Compute)
        {
            return Err(Error::InvalidArgument(format!(
                "tensor '{}' is still fetched at the end of backward",
                t.name
            )));
        }
        for j in 0..self.gathers.len() {
            match &self.gathers[j] {
                // gathered ahead but not used: no rank has gradients for it
                Some(g) if !g.used => drop(self.take_gather(j)?),
                Some(_) => self.reduce_scatter(j)?,
                None => {}
            }
        }
        // the reduce-scatters finished (or a peer's failure is an error) before the step's host
        // work reads their results
        self.comm.wait(&self.stream)?;
        self.local.end_backward()?;
        self.stage = Some(Stage::Optimizer);
        Ok(())
    }

    /// The optimizer step on this rank's chunks, with gradient statistics all-reduced so that
    /// every rank clips by the global norm and skips an overflow together; ends the iteration.
    /// A step that fails on a collective (a peer failed or timed out) leaves the group of no
    /// further use: start new communicators and managers and load the ranks' checkpoints
    /// ([`ZeroManager::load_checkpoint`]).
    pub fn step(&mut self, adam: &mut HybridAdam) -> Result<StepReport> {
        if self.stage != Some(Stage::Optimizer) {
            return Err(Error::WrongStage {
                call: "ZeroManager::step (it runs after end_backward)".into(),
                stage: stage_name(self.stage),
            });
        }
        let comm = &self.comm;
        let report = adam.step_reducing(&mut self.local, &mut |st: GradStats| {
            let mut sq = [st.sum_sq];
            comm.all_reduce_host(&mut sq, ReduceOp::Sum)?;
            let mut flag = [u8::from(st.nonfinite)];
            comm.all_reduce_host(&mut flag, ReduceOp::Max)?;
            Ok(GradStats {
                sum_sq: sq[0],
                nonfinite: flag[0] != 0,
            })
        })?;
        // the iteration is over whatever follows (the rank's manager ended it)
        for id in 0..self.tensors.len() {
            let t = &mut self.tensors[id];
            t.state = next_state(t.state, TrainEvent::EndStep).unwrap_or(t.state);
            t.fwd_uses = 0;
            t.bwd_uses = 0;
            t.grad = false;
        }
        self.stage = None;
        if self.prefetch.depth > 0 && !self.prefetch.all_steady {
            // A rank's manager may finish warm-up later than another's (say, one whose chunks
            // had no backward use): prefetch starts when all have, on every rank alike.
            let mut steady = [u8::from(self.local.is_steady())];
            self.comm.all_reduce_host(&mut steady, ReduceOp::Min)?;
            if steady[0] == 1 {
                self.prefetch.all_steady = true;
                // every tide has the reserve's room at every moment; prefetched buffers use it
                self.prefetch.reserve.clear();
            }
        }
        Ok(report)
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

// --- support for the trainer API (`crate::store`): stage, shapes and gradient marks ---
/// The name of a stage in a [`Error::WrongStage`] (`idle` between iterations).
fn stage_name(s: Option<Stage>) -> &'static str {
    s.map_or("idle", Stage::name)
}

impl ZeroManager {
    /// The stage of the iteration in progress (`None` between iterations).
    pub fn stage(&self) -> Option<Stage> {
        self.stage
    }

    /// Name and shape of a tensor, and its slot in the global layout.
    pub fn tensor_info(&self, id: TensorId) -> Result<(&str, &[usize], Slot)> {
        let t = self
            .tensors
            .get(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })?;
        Ok((&t.name, &t.shape, t.slot))
    }

    /// Checks that a gradient of `id` may be written now (the backward stage, the tensor
    /// fetched); returns whether this is the tensor's last backward use, the one its gradient
    /// is written at.
    pub(crate) fn grad_use(&self, id: TensorId) -> Result<bool> {
        let t = self
            .tensors
            .get(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: format!("a gradient write of '{}'", t.name),
                stage: stage_name(self.stage),
            });
        }
        if t.state != TensorState::Compute {
            return Err(Error::InvalidArgument(format!(
                "gradient of '{}' written outside a backward fetch (state {})",
                t.name, t.state
            )));
        }
        Ok(t.bwd_uses >= t.fwd_uses)
    }

    /// Marks the gradient of `id` written into its gather buffer (by device work the caller
    /// enqueued on the compute stream), after the checks of [`ZeroManager::write_grad`].
    pub(crate) fn mark_grad(&mut self, id: TensorId) -> Result<()> {
        if !self.grad_use(id)? {
            let t = &self.tensors[id.index()];
            return Err(Error::InvalidArgument(format!(
                "gradient of shared tensor '{}' written at backward use {} of {}; write it at the last",
                t.name, t.bwd_uses, t.fwd_uses
            )));
        }
        self.tensors[id.index()].grad = true;
        Ok(())
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
