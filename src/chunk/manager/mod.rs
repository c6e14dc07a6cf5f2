//! The chunk manager: the API a trainer links against.
//!
//! The manager is one type, [`ChunkManager`], whose methods live by concern: construction and
//! settings here, the tensor table in `table`, a training iteration in `iteration`, optimizer
//! passes in `optimizer`, the move executor in `moves`, and the log and statistics in
//! `telemetry`. Gradient statistics over the parameter chunks
//! ([`ChunkManager::grad_stats`]) are the optimizer's: they live in `optim`, on the in-place
//! chunk access the `optimizer` file gives the crate.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::chunk::layout::ChunkLayout;
use crate::chunk::plan::{plan_chunks, ChunkPlan, MomentStorage};
use crate::device::{
    CachingAllocator, Device, DeviceBuffer, Event, FileStore, HostBuffer, Pending, Stream,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::QUANT8_BLOCK;
use crate::tensor::{ChunkKind, Stage};
use crate::tide::{spill_to_file, MoveStats, Policy, Scheduler, SchedulerConfig, Tracer};

mod iteration;
mod moves;
mod optimizer;
mod overlap;
mod table;
mod telemetry;
mod versions;

pub(crate) use optimizer::grad_ranges;
pub use optimizer::{DeviceMoments, GroupChunks, GroupSlices, GroupVisit, HostMoments};
pub(crate) use overlap::overlap_group_bytes;
pub use overlap::OverlapStats;
pub(crate) use overlap::{HostBlock, OverlapPlan};
use table::TensorMeta;
pub use telemetry::{LogEntry, LogKind, TideSample, Usage};

/// Settings of a [`ChunkManager`].
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Elements per chunk.
    pub chunk_elems: usize,
    /// Element type of the parameter list (F16, BF16 or F32).
    pub param_dtype: DType,
    /// Placement policy.
    pub policy: Policy,
    /// Scheduler settings; `capacity` 0 means the device's total memory.
    pub scheduler: SchedulerConfig,
    /// Host bytes for chunks; beyond it, chunks live on the file tier (`None`: unlimited).
    pub host_budget: Option<u64>,
    /// Directory of the file tier (default: the system temporary directory).
    pub file_dir: Option<PathBuf>,
    /// How Adam's momentum and variance chunks hold their values (default f32; see
    /// [`MomentStorage`]).
    pub moments: MomentStorage,
}

impl ManagerConfig {
    /// Chunks of `chunk_elems` fp16 elements under `policy`, sized for the whole device.
    pub fn new(chunk_elems: usize, policy: Policy) -> Self {
        ManagerConfig {
            chunk_elems,
            param_dtype: DType::F16,
            policy,
            scheduler: SchedulerConfig::new(0),
            host_budget: None,
            file_dir: None,
            moments: MomentStorage::F32,
        }
    }
}

#[derive(Default)]
enum HostSlot {
    #[default]
    None,
    Ready(HostBuffer),
    InFlight(Pending<HostBuffer>),
    /// Lent to a host group's step running during backward (see `overlap`); every access
    /// settles that step first.
    Lent,
}

#[derive(Default)]
struct Payload {
    host: HostSlot,
    device: Option<Arc<DeviceBuffer>>,
    ready: Option<Event>,
}

/// The device buffer of an evicted chunk, reused by a later load of a chunk of its size: the
/// load allocates nothing. Its copy waits, on the device, for `free_after` and `read_after`,
/// recorded on the compute and write-back streams when the chunk was evicted. The scheduler's budget counts evicted chunks'
/// memory as free, so spares are given back the moment any allocation on the device finds it
/// full (a reclaimer the manager registers with [`Device::add_reclaimer`]): on a device that
/// releases memory in stream order, at once.
pub(super) struct Spare {
    pub(super) buf: DeviceBuffer,
    pub(super) free_after: Event,
    /// Recorded on the write-back stream at the eviction: after any copy still reading it.
    pub(super) read_after: Event,
}

/// The spares, shared with the reclaimer that gives them back.
pub(super) type Spares = Arc<parking_lot::Mutex<Vec<Spare>>>;

/// The chunk manager: registers parameters, packs them into chunks, and moves chunks between
/// device, host and file tiers as the trainer fetches and releases tensors.
///
/// ```
/// use tidemem::chunk::{ChunkManager, ManagerConfig};
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::tensor::{Init, Stage};
/// use tidemem::tide::Policy;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let mut m = ChunkManager::new(dev, ManagerConfig::new(1024, Policy::Tide))?;
/// let w = m.register("w", &[16, 16], Init::Constant(0.5))?;
/// m.fetch(&[w], Stage::Forward)?;
/// assert_eq!(m.read(w)?[0], 0.5);
/// m.release(&[w], Stage::Forward)?;
/// m.end_forward()?;
/// m.fetch(&[w], Stage::Backward)?;
/// m.write_grad(w, &[1.0; 256])?;
/// m.release(&[w], Stage::Backward)?;
/// m.end_backward()?;
/// m.step_host(|mut g| {
///     let grad = g.param_f32();
///     for (x, dx) in g.master.iter_mut().zip(grad) {
///         *x -= 0.1 * dx; // plain SGD on the fp32 masters
///     }
///     g.store_params();
///     Ok(())
/// })?;
/// m.end_step()?;
/// assert_eq!(m.master(w)?[0], 0.4);
/// assert_eq!(m.read(w)?[0], half::f16::from_f32(0.4).to_f32());
/// # Ok(()) }
/// ```
pub struct ChunkManager {
    /// Host groups stepped during backward (declared first, so dropped first: it waits for
    /// the copies its steps read before the chunks they read are freed).
    overlap: overlap::Overlap,
    device: Device,
    /// Uploads: loads, and the new parameters of host groups stepped during backward.
    copy: Arc<Stream>,
    /// Write-backs, on a stream of their own so that they run beside the uploads (as a GPU's
    /// two copy engines do, one each way).
    down: Arc<Stream>,
    compute: Arc<Stream>,
    cfg: ManagerConfig,
    tensors: Vec<TensorMeta>,
    layout: ChunkLayout,
    sched: Option<Scheduler>,
    payload: Vec<Payload>,
    file_tier: Vec<bool>,
    file: Option<FileStore>,
    tracer: Tracer,
    warm: bool,
    stage: Option<Stage>,
    non_model: Option<CachingAllocator>,
    /// Non-model bytes live at the current moment, read from the pool when the moment opened.
    non_model_now: u64,
    retiring: Vec<Pending<HostBuffer>>,
    /// Device buffers of evicted chunks, for later loads of their size (see [`Spare`]); given
    /// back when the device is full, through `reclaim`, registered with the device.
    spares: Spares,
    _reclaim: Arc<crate::device::Reclaimer>,
    iter_start: MoveStats,
    last_iter: MoveStats,
    iterations: u64,
    log: Option<Vec<LogEntry>>,
    epoch: Instant,
    samples: Vec<TideSample>,
    last_samples: Vec<TideSample>,
    /// Why the manager is unusable: moves the scheduler had ordered failed, so its view of
    /// where chunks are may not match the payloads.
    broken: Option<String>,
    /// Groups whose parameter chunk may hold gradients: fetched in backward, and not rewritten
    /// by an optimizer pass since. A checkpoint would save gradients as parameters.
    grads_in: Vec<bool>,
    /// What the model is, as `model.<key>` metadata every checkpoint carries and every load
    /// checks ([`ParamStore::describe_model`](crate::store::ParamStore::describe_model)).
    pub(in crate::chunk) model: std::collections::BTreeMap<String, String>,
}

impl std::fmt::Debug for ChunkManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkManager")
            .field("device", &self.device.id())
            .field("tensors", &self.tensors.len())
            .field("groups", &self.layout.groups())
            .field("policy", &self.cfg.policy)
            .finish()
    }
}

const LISTS: [ChunkKind; 4] = ChunkKind::ALL;

impl ChunkManager {
    /// A manager on `device`.
    pub fn new(device: Device, mut cfg: ManagerConfig) -> Result<Self> {
        if !matches!(cfg.param_dtype, DType::F16 | DType::BF16 | DType::F32) {
            return Err(Error::WrongDType {
                what: "the parameter type of a chunk manager".into(),
                dtype: cfg.param_dtype,
                expected: "F16, BF16 or F32",
            });
        }
        if cfg.scheduler.capacity == 0 {
            cfg.scheduler.capacity = device.mem_info()?.total as u64;
        }
        let mut layout = ChunkLayout::new(cfg.chunk_elems)?;
        if cfg.moments == MomentStorage::Int8 {
            layout.align_tensors(QUANT8_BLOCK);
        }
        let copy = Arc::new(device.new_stream()?);
        let down = Arc::new(device.new_stream()?);
        let compute = Arc::new(device.new_stream()?);
        let pool = CachingAllocator::new(device.clone());
        let spares = Spares::default();
        let reclaim: Arc<crate::device::Reclaimer> = {
            let spares = Arc::clone(&spares);
            Arc::new(move |_bytes| spares.lock().clear())
        };
        device.add_reclaimer(&reclaim);
        let mut m = ChunkManager {
            overlap: overlap::Overlap::default(),
            device,
            copy,
            down,
            compute,
            cfg,
            tensors: Vec::new(),
            layout,
            sched: None,
            payload: Vec::new(),
            file_tier: Vec::new(),
            file: None,
            tracer: Tracer::new(),
            warm: true,
            stage: None,
            non_model: None,
            non_model_now: 0,
            retiring: Vec::new(),
            spares,
            _reclaim: reclaim,
            iter_start: MoveStats::default(),
            last_iter: MoveStats::default(),
            iterations: 0,
            log: None,
            epoch: Instant::now(),
            samples: Vec::new(),
            last_samples: Vec::new(),
            broken: None,
            grads_in: Vec::new(),
            model: Default::default(),
        };
        // a non-model pool of its own, as a ZeroManager has (a trainer may set another)
        m.set_non_model_allocator(pool);
        Ok(m)
    }

    /// Fails once moves the scheduler ordered have failed.
    pub(crate) fn usable(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::Poisoned {
                what: "chunk manager",
                reason: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Tracks non-model device memory through `pool`, in place of the manager's own
    /// ([`ChunkManager::pool`]): its peak of live bytes over every moment
    /// feeds the tide. Blocks it caches are not counted: when a chunk does not fit, the manager
    /// empties the pool's cache before giving up.
    ///
    /// When the pool finds the device full it takes back the evicted chunks' buffers the
    /// manager keeps for reuse, and if that is not enough waits for the manager's streams,
    /// which may still hold chunks evicted a moment ago (on a device that releases their
    /// memory once their copies finish).
    pub fn set_non_model_allocator(&mut self, pool: CachingAllocator) {
        let (dev, copy, down, compute) = (
            self.device.clone(),
            Arc::clone(&self.copy),
            Arc::clone(&self.down),
            Arc::clone(&self.compute),
        );
        pool.set_reclaim(Some(Arc::new(move |bytes| {
            // (the device already took back the manager's spares)
            if dev.mem_info().is_ok_and(|m| m.free >= bytes) {
                return;
            }
            // best effort: an error here resurfaces on the retried allocation
            let _ = dev.sync_stream(&copy);
            let _ = dev.sync_stream(&down);
            let _ = dev.sync_stream(&compute);
        })));
        self.non_model = Some(pool);
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The stream a trainer runs its device work on; fetched chunks are ready on it.
    pub fn compute_stream(&self) -> &Stream {
        &self.compute
    }

    pub(crate) fn compute_arc(&self) -> Arc<Stream> {
        Arc::clone(&self.compute)
    }

    /// The chunk layout (grows while parameters are registered).
    pub fn layout(&self) -> &ChunkLayout {
        &self.layout
    }

    /// Parameter element type.
    pub fn param_dtype(&self) -> DType {
        self.cfg.param_dtype
    }

    /// Bytes of one element of list `kind`.
    fn elem_bytes(&self, kind: ChunkKind) -> usize {
        if kind == ChunkKind::Param {
            self.cfg.param_dtype.size()
        } else {
            4
        }
    }

    /// Bytes of schedulable chunk `c`.
    fn chunk_bytes(&self, c: usize) -> usize {
        let (g, k) = (c / 4, LISTS[c % 4]);
        let elems = self.layout.group_elems[g];
        match k {
            ChunkKind::Momentum | ChunkKind::Variance => self.cfg.moments.bytes(elems) as usize,
            _ => elems * self.elem_bytes(k),
        }
    }

    /// The 8-bit map of list `kind`'s chunks, or `None` where they hold a value an element.
    pub(in crate::chunk) fn moment_map(&self, kind: ChunkKind) -> Option<crate::ops::Quant8Map> {
        super::moments::map_of(self.cfg.moments, kind)
    }

    /// Closes registration: builds the scheduler and the tiers.
    pub(crate) fn close(&mut self) -> Result<()> {
        if self.sched.is_some() {
            return Ok(());
        }
        if self.tensors.is_empty() {
            return Err(Error::Empty {
                what: "the chunk manager (no tensor registered)".into(),
            });
        }
        let bytes = self.cfg.param_dtype.size() as u64;
        let chunks = plan_chunks(&self.layout, bytes, self.cfg.moments);
        self.file_tier = spill_to_file(&chunks, self.cfg.host_budget);
        if self.file_tier.iter().any(|&f| f) {
            let dir = self.cfg.file_dir.clone().unwrap_or_else(std::env::temp_dir);
            self.file = Some(FileStore::new(dir)?);
        }
        self.payload = (0..chunks.len()).map(|_| Payload::default()).collect();
        self.grads_in = vec![false; self.layout.groups()];
        self.sched = Some(Scheduler::new(self.cfg.policy, self.cfg.scheduler, chunks)?);
        Ok(())
    }

    /// The scheduler, which exists once registration has closed.
    fn sched(&mut self) -> &mut Scheduler {
        self.sched.as_mut().expect("scheduler exists after close")
    }

    /// Bytes of every parameter chunk (the fp16/bf16 footprint).
    pub fn param_footprint(&self) -> u64 {
        (0..self.layout.groups())
            .map(|g| {
                self.chunk_bytes(ChunkPlan::chunk_no(g as u32, ChunkKind::Param) as usize) as u64
            })
            .sum()
    }

    /// The scheduler's device capacity for chunks and non-model data.
    pub fn capacity(&self) -> u64 {
        self.cfg.scheduler.capacity
    }

    /// The manager's settings.
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// The stage of the iteration in progress (`None` between iterations).
    pub fn stage(&self) -> Option<Stage> {
        self.stage
    }

    /// Number of chunk groups.
    pub fn groups(&self) -> usize {
        self.layout.groups()
    }

    /// The element type of a list: the parameter dtype, f32 for the optimizer lists.
    pub(in crate::chunk) fn list_dtype(&self, kind: ChunkKind) -> DType {
        if kind == ChunkKind::Param {
            self.cfg.param_dtype
        } else {
            DType::F32
        }
    }
}
