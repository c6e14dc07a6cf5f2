//! The chunk manager: the API a trainer links against.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};
use serde::Serialize;

use super::layout::{ChunkKind, Layout, Slot};
use crate::device::{
    read_grad_stats, Block, CachingAllocator, Device, DeviceBuffer, DeviceView, Event, FileStore,
    HostBuffer, Pending, Stream, GRAD_STATS_BYTES,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::cpu_adam::{grad_stats_raw, RawKind};
use crate::optim::GradStats;
use crate::simulate::{plan_chunks, push_access, ChunkPlan};
use crate::tensor::{next_state, Init, Stage, TensorId, TensorState, TrainEvent};
use crate::tide::{
    spill_to_file, Access, ChunkNo, Move, MoveStats, Policy, Scheduler, SchedulerConfig, Target,
    Trace, Tracer,
};

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
        }
    }
}

/// Memory of a fetched tensor on the device: valid until the tensor is released.
#[derive(Clone, Debug)]
pub struct TensorView {
    /// The tensor.
    pub id: TensorId,
    /// Element type.
    pub dtype: DType,
    /// Elements.
    pub numel: usize,
    buf: ViewBuf,
    offset: usize,
}

/// What a view keeps alive: a chunk's device copy, or a pooled buffer (a ZeRO gather buffer).
#[derive(Clone, Debug)]
pub(crate) enum ViewBuf {
    Chunk(Arc<DeviceBuffer>),
    Pooled(Arc<Block>),
}

impl TensorView {
    pub(crate) fn new(
        id: TensorId,
        dtype: DType,
        numel: usize,
        buf: ViewBuf,
        offset: usize,
    ) -> Self {
        TensorView {
            id,
            dtype,
            numel,
            buf,
            offset,
        }
    }

    /// The device memory of the tensor, for copies and kernels.
    pub fn view(&self) -> DeviceView<'_> {
        let buf: &DeviceBuffer = match &self.buf {
            ViewBuf::Chunk(b) => b,
            ViewBuf::Pooled(b) => b,
        };
        // in range by construction: the slot lies inside its chunk
        buf.view(self.offset, self.numel * self.dtype.size())
            .expect("tensor slot inside its chunk")
    }
}

/// The four chunks of one group on the host, for an optimizer step.
pub struct GroupSlices<'a> {
    /// Group index.
    pub group: usize,
    /// Tensors of the group: id, offset and length in elements, and whether a gradient was written
    /// into its parameter slot this iteration.
    pub tensors: Vec<(TensorId, usize, usize, bool)>,
    /// Parameter chunk (gradients where written), raw bytes of the parameter dtype.
    pub param: &'a mut [u8],
    /// Parameter dtype.
    pub param_dtype: DType,
    /// fp32 masters.
    pub master: &'a mut [f32],
    /// Momentum.
    pub momentum: &'a mut [f32],
    /// Variance.
    pub variance: &'a mut [f32],
}

impl GroupSlices<'_> {
    /// The parameter chunk decoded to f32 (gradients where written).
    pub fn param_f32(&self) -> Vec<f32> {
        decode(self.param, self.param_dtype)
    }

    /// Writes the masters, rounded to the parameter dtype, into the parameter chunk (the last
    /// thing an optimizer step does).
    pub fn store_params(&mut self) {
        let es = self.param_dtype.size();
        for (i, x) in self.master.iter().enumerate() {
            let b = encode(std::slice::from_ref(x), self.param_dtype);
            self.param[i * es..(i + 1) * es].copy_from_slice(&b);
        }
    }
}

/// The chunks of one group as an optimizer pass sees them (see
/// [`ChunkManager::visit_groups`]).
pub struct GroupVisit<'a> {
    /// Group index.
    pub group: usize,
    /// Tensors of the group: id, offset and length in elements, and whether a gradient was written
    /// into its parameter slot this iteration.
    pub tensors: Vec<(TensorId, usize, usize, bool)>,
    /// Element ranges of the chunk that hold gradients: runs of consecutive tensors with a
    /// gradient (padding between them included; padding is zero in every list).
    pub ranges: Vec<Range<usize>>,
    /// Parameter dtype.
    pub param_dtype: DType,
    /// The chunks, where they are.
    pub chunks: GroupChunks<'a>,
}

/// The chunks of a visited group, on the host or on the device; the lists not asked for are
/// `None`.
pub enum GroupChunks<'a> {
    /// Host memory.
    Host {
        /// Parameter chunk (gradients where written), raw bytes of the parameter dtype.
        param: &'a mut [u8],
        /// fp32 masters.
        master: Option<&'a mut [f32]>,
        /// Momentum.
        momentum: Option<&'a mut [f32]>,
        /// Variance.
        variance: Option<&'a mut [f32]>,
    },
    /// Device memory: enqueue work on `stream`.
    Device {
        /// The device.
        device: &'a Device,
        /// The stream to enqueue on (the manager's compute stream).
        stream: &'a Stream,
        /// Parameter chunk.
        param: &'a DeviceBuffer,
        /// fp32 masters.
        master: Option<&'a DeviceBuffer>,
        /// Momentum.
        momentum: Option<&'a DeviceBuffer>,
        /// Variance.
        variance: Option<&'a DeviceBuffer>,
    },
}

/// Runs of consecutive tensors (by offset) that hold a gradient, as element ranges.
pub(crate) fn grad_ranges(tensors: &[(TensorId, usize, usize, bool)]) -> Vec<Range<usize>> {
    let mut by_offset: Vec<&(TensorId, usize, usize, bool)> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.1);
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut open = false;
    for &&(_, off, n, has) in &by_offset {
        if !has {
            open = false;
            continue;
        }
        match out.last_mut() {
            Some(r) if open => r.end = off + n,
            _ => out.push(off..off + n),
        }
        open = true;
    }
    out
}

/// Chunk bytes per kind (index [`ChunkKind::index`]) on each tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Device bytes.
    pub device: [u64; 4],
    /// Host memory bytes.
    pub host: [u64; 4],
    /// File-tier bytes.
    pub file: [u64; 4],
}

impl Usage {
    /// Total over kinds for one tier.
    pub fn total(tier: &[u64; 4]) -> u64 {
        tier.iter().sum()
    }
}

/// One entry of the manager's event log (for Chrome traces).
#[derive(Clone, Debug, Serialize)]
pub struct LogEntry {
    /// Microseconds since the manager was created.
    pub t_us: f64,
    /// Duration in microseconds (0 for instants).
    pub dur_us: f64,
    /// What happened (`moment`, `fetch`, `load`, `prefetch`, `write-back`, `drop`, ...).
    pub what: &'static str,
    /// Chunk number, or the moment index for `moment`.
    pub n: u64,
    /// Bytes involved.
    pub bytes: u64,
    /// Chunk bytes on the device after it, and the budget at the moment.
    pub device_chunks: u64,
    /// Budget at the moment.
    pub budget: u64,
}

/// Device memory at one moment of the last complete iteration (for the tide plot).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct TideSample {
    /// Non-model bytes (peak over the moment).
    pub non_model: u64,
    /// Chunk bytes on the device.
    pub chunks: u64,
    /// Chunk budget (`None` during warm-up).
    pub budget: Option<u64>,
}

struct TensorMeta {
    name: String,
    shape: Vec<usize>,
    init: Init,
    slot: Slot,
    state: [TensorState; 4],
    fwd_uses: u32,
    bwd_uses: u32,
    grad: bool,
}

#[derive(Default)]
enum HostSlot {
    #[default]
    None,
    Ready(HostBuffer),
    InFlight(Pending<HostBuffer>),
}

#[derive(Default)]
struct Payload {
    host: HostSlot,
    device: Option<Arc<DeviceBuffer>>,
    ready: Option<Event>,
}

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
    device: Device,
    copy: Arc<Stream>,
    compute: Arc<Stream>,
    cfg: ManagerConfig,
    tensors: Vec<TensorMeta>,
    layout: Layout,
    sched: Option<Scheduler>,
    payload: Vec<Payload>,
    file_tier: Vec<bool>,
    file: Option<FileStore>,
    tracer: Tracer,
    warm: bool,
    stage: Option<Stage>,
    non_model: Option<CachingAllocator>,
    retiring: Vec<Pending<HostBuffer>>,
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
            return Err(Error::InvalidArgument(format!(
                "unsupported parameter dtype {}",
                cfg.param_dtype.name()
            )));
        }
        if cfg.scheduler.capacity == 0 {
            cfg.scheduler.capacity = device.mem_info()?.total as u64;
        }
        let layout = Layout::new(cfg.chunk_elems)?;
        let copy = Arc::new(device.new_stream()?);
        let compute = Arc::new(device.new_stream()?);
        let pool = CachingAllocator::new(device.clone());
        let mut m = ChunkManager {
            device,
            copy,
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
            retiring: Vec::new(),
            iter_start: MoveStats::default(),
            last_iter: MoveStats::default(),
            iterations: 0,
            log: None,
            epoch: Instant::now(),
            samples: Vec::new(),
            last_samples: Vec::new(),
            broken: None,
            grads_in: Vec::new(),
        };
        // a non-model pool of its own, as a ZeroManager has (a trainer may set another)
        m.set_non_model_allocator(pool);
        Ok(m)
    }

    /// Fails once moves the scheduler ordered have failed.
    fn usable(&self) -> Result<()> {
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
    /// When the pool finds the device full it waits for the manager's streams, which may still
    /// hold chunks evicted a moment ago (their memory is released once their copies finish).
    pub fn set_non_model_allocator(&mut self, pool: CachingAllocator) {
        let (dev, copy, compute) = (
            self.device.clone(),
            Arc::clone(&self.copy),
            Arc::clone(&self.compute),
        );
        pool.set_reclaim(Some(Arc::new(move || {
            // best effort: an error here resurfaces on the retried allocation
            let _ = dev.sync_stream(&copy);
            let _ = dev.sync_stream(&compute);
        })));
        self.non_model = Some(pool);
    }

    /// Starts logging moments and moves (see [`ChunkManager::log`]).
    pub fn enable_log(&mut self) {
        self.log = Some(Vec::new());
    }

    /// The event log (empty unless [`ChunkManager::enable_log`] was called).
    pub fn log(&self) -> &[LogEntry] {
        self.log.as_deref().unwrap_or(&[])
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
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Parameter element type.
    pub fn param_dtype(&self) -> DType {
        self.cfg.param_dtype
    }

    /// Registers a parameter; it is packed after the previous one. Registration closes at the
    /// first fetch.
    pub fn register(&mut self, name: &str, shape: &[usize], init: Init) -> Result<TensorId> {
        if self.sched.is_some() {
            return Err(Error::InvalidArgument(format!(
                "cannot register '{name}': registration closed at the first fetch"
            )));
        }
        let numel = numel_of(name, shape)?;
        let slot = self.layout.push(numel)?;
        self.tensors.push(TensorMeta {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            slot,
            state: [TensorState::Free; 4],
            fwd_uses: 0,
            bwd_uses: 0,
            grad: false,
        });
        Ok(TensorId(self.tensors.len() as u32 - 1))
    }

    /// Closes the open chunk: the next registered tensor starts a new chunk group (e.g. at a
    /// module boundary).
    pub fn seal_chunk(&mut self) -> Result<()> {
        if self.sched.is_some() {
            return Err(Error::InvalidArgument(
                "cannot seal a chunk: registration closed at the first fetch".into(),
            ));
        }
        self.layout.seal();
        Ok(())
    }

    /// Name, shape and slot of a tensor.
    pub fn tensor_info(&self, id: TensorId) -> Result<(&str, &[usize], Slot)> {
        let t = self.meta(id)?;
        Ok((&t.name, &t.shape, t.slot))
    }

    /// State of a tensor in one list.
    pub fn state(&self, id: TensorId, kind: ChunkKind) -> Result<TensorState> {
        Ok(self.meta(id)?.state[kind.index()])
    }

    /// Number of registered tensors.
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// State of a chunk: the highest-priority state of its tensors, `None` for RELEASED (no
    /// payload anywhere).
    pub fn chunk_state(&self, group: usize, kind: ChunkKind) -> Option<TensorState> {
        if group >= self.layout.groups() {
            return None;
        }
        let c = ChunkPlan::chunk_no(group as u32, kind) as usize;
        let p = self.payload.get(c)?;
        if matches!(p.host, HostSlot::None) && p.device.is_none() {
            return None;
        }
        self.layout.group_tensors.get(group).map(|ts| {
            ts.iter()
                .map(|&t| self.tensors[t as usize].state[kind.index()])
                .max_by_key(|s| s.priority())
                .unwrap_or(TensorState::Free)
        })
    }

    /// Id of the device buffer holding chunk `kind` of `group`, if it is on the device (a chunk
    /// that moves gets a new buffer).
    pub fn device_buffer_id(&self, group: usize, kind: ChunkKind) -> Option<u64> {
        if group >= self.layout.groups() {
            return None;
        }
        let c = ChunkPlan::chunk_no(group as u32, kind) as usize;
        self.payload.get(c)?.device.as_ref().map(|b| b.id())
    }

    fn meta(&self, id: TensorId) -> Result<&TensorMeta> {
        self.tensors
            .get(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })
    }

    fn chunk_of(&self, id: TensorId, kind: ChunkKind) -> ChunkNo {
        ChunkPlan::chunk_no(self.tensors[id.index()].slot.group, kind)
    }

    fn elem_bytes(&self, kind: ChunkKind) -> usize {
        if kind == ChunkKind::Param {
            self.cfg.param_dtype.size()
        } else {
            4
        }
    }

    fn chunk_bytes(&self, c: usize) -> usize {
        let (g, k) = (c / 4, LISTS[c % 4]);
        self.layout.group_elems[g] * self.elem_bytes(k)
    }

    /// Closes registration: builds the scheduler and the tiers.
    pub(crate) fn close(&mut self) -> Result<()> {
        if self.sched.is_some() {
            return Ok(());
        }
        if self.tensors.is_empty() {
            return Err(Error::InvalidArgument("no tensor registered".into()));
        }
        let chunks = plan_chunks(&self.layout, self.cfg.param_dtype.size() as u64);
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

    fn sched(&mut self) -> &mut Scheduler {
        self.sched.as_mut().expect("scheduler exists after close")
    }

    fn check_transition(&self, ids: &[TensorId], kind: ChunkKind, ev: TrainEvent) -> Result<()> {
        for &id in ids {
            let t = self.meta(id)?;
            let s = t.state[kind.index()];
            if next_state(s, ev).is_none() {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: kind.name(),
                    state: s,
                    event: ev,
                });
            }
        }
        Ok(())
    }

    fn apply(&mut self, id: TensorId, kind: ChunkKind, ev: TrainEvent) {
        let t = &mut self.tensors[id.index()];
        let s = &mut t.state[kind.index()];
        *s = next_state(*s, ev).expect("transition checked before");
    }

    fn now_us(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e6
    }

    fn note(&mut self, what: &'static str, n: u64, bytes: u64, t0: f64) {
        if self.log.is_some() {
            let t = self.now_us();
            let (dc, b) = self
                .sched
                .as_ref()
                .map_or((0, 0), |s| (s.device_used(), s.budget()));
            if let Some(l) = self.log.as_mut() {
                l.push(LogEntry {
                    t_us: t0,
                    dur_us: t - t0,
                    what,
                    n,
                    bytes,
                    device_chunks: dc,
                    budget: b,
                });
            }
        }
    }

    /// Opens a moment: folds the non-model peak into the tracer and ticks the scheduler.
    fn tick(&mut self, stage: Stage, accesses: &[Access]) -> usize {
        let (peak, now) = match &self.non_model {
            Some(p) => {
                let s = p.stats();
                p.reset_peak();
                (s.peak_allocated as u64, s.allocated as u64)
            }
            None => (0, 0),
        };
        if let Some(last) = self.samples.last_mut() {
            last.non_model = last.non_model.max(peak);
        }
        if self.warm {
            self.tracer.non_model(peak);
            self.tracer.tick(stage, accesses.to_vec(), now);
        }
        let m = self.sched().tick();
        let t = self.now_us();
        self.note("moment", m as u64, 0, t);
        m
    }

    fn sample(&mut self) {
        let s = self.sched.as_ref().expect("scheduler");
        let budget = s.trace().map(|_| s.budget());
        let chunks = s.device_used();
        let non_model = self
            .non_model
            .as_ref()
            .map_or(0, |p| p.stats().allocated as u64);
        self.samples.push(TideSample {
            non_model,
            chunks,
            budget,
        });
    }

    /// Fetches tensors for an op of `stage` (forward or backward) on the device and returns views
    /// of their memory, ready on [`ChunkManager::compute_stream`]. Their chunks will not move
    /// until [`ChunkManager::release`].
    pub fn fetch(&mut self, ids: &[TensorId], stage: Stage) -> Result<Vec<TensorView>> {
        self.usable()?;
        let t0 = self.now_us();
        let ev = match stage {
            Stage::Forward => TrainEvent::BeforeFwdOp,
            Stage::Backward => TrainEvent::BeforeBwdOp,
            Stage::Optimizer => {
                return Err(Error::WrongStage {
                    call: "fetch for the optimizer (fetch is for forward and backward; the \
                           optimizer visits groups)"
                        .into(),
                    stage: self.stage.map_or("idle", Stage::name),
                })
            }
        };
        self.check_stage(stage)?;
        check_distinct(ids)?;
        self.check_transition(ids, ChunkKind::Param, ev)?;
        self.close()?;
        // One access per tensor (a chunk stays in use until each of its tensors is released);
        // the trace records one per chunk.
        let mut uses = Vec::with_capacity(ids.len());
        let mut acc = Vec::new();
        for &id in ids {
            let t = &self.tensors[id.index()];
            let last = stage == Stage::Backward && t.bwd_uses + 1 >= t.fwd_uses;
            let chunk = self.chunk_of(id, ChunkKind::Param);
            uses.push(Access {
                chunk,
                target: Target::Device,
                write: last,
            });
            push_access(&mut acc, chunk, Target::Device, last);
        }
        self.tick(stage, &acc);
        let moves = self.fetch_moment(&uses)?;
        self.execute(&moves)?;
        self.stage = Some(stage);
        for &id in ids {
            self.apply(id, ChunkKind::Param, ev);
            let t = &mut self.tensors[id.index()];
            match stage {
                Stage::Forward => t.fwd_uses += 1,
                _ => {
                    t.bwd_uses += 1;
                    let g = t.slot.group as usize;
                    self.grads_in[g] = true;
                }
            }
        }
        // Compute waits for the loads of its chunks.
        let mut views = Vec::with_capacity(ids.len());
        for a in &acc {
            if let Some(ev) = self.payload[a.chunk as usize].ready.take() {
                self.device.wait_event(&self.compute, &ev)?;
            }
        }
        for &id in ids {
            let c = self.chunk_of(id, ChunkKind::Param) as usize;
            let t = &self.tensors[id.index()];
            let buf = self.payload[c]
                .device
                .clone()
                .ok_or_else(|| Error::InvalidArgument("fetched chunk has no device copy".into()))?;
            views.push(TensorView {
                id,
                dtype: self.cfg.param_dtype,
                numel: t.slot.numel,
                buf: ViewBuf::Chunk(buf),
                offset: t.slot.offset * self.cfg.param_dtype.size(),
            });
        }
        let pre = self.sched().prefetch();
        self.execute(&pre)?;
        self.sample();
        self.note("fetch", ids.len() as u64, 0, t0);
        Ok(views)
    }

    /// The scheduler's moves for the accesses of the moment just ticked; if it refuses, the
    /// moment did not happen and a warm-up in progress starts over.
    fn fetch_moment(&mut self, accesses: &[Access]) -> Result<Vec<Move>> {
        let r = self.sched().fetch(accesses);
        if r.is_err() && self.warm {
            self.tracer.discard();
            self.warm_restart();
        }
        r
    }

    fn warm_restart(&mut self) {
        self.samples.clear();
    }

    fn check_stage(&self, stage: Stage) -> Result<()> {
        let ok = match (self.stage, stage) {
            (None, _) => true,
            (Some(Stage::Forward), Stage::Forward) => true,
            (Some(Stage::Forward), Stage::Backward) => false, // end_forward first
            (Some(Stage::Backward), Stage::Backward) => true,
            (Some(Stage::Optimizer), Stage::Forward) => false,
            (Some(a), b) => a == b,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::WrongStage {
                call: format!(
                    "a {stage} access (call end_forward / end_backward / end_step first)"
                ),
                stage: self.stage.map_or("idle", Stage::name),
            })
        }
    }

    /// Ends the use of tensors fetched for an op of `stage`. In backward, a tensor's last use
    /// (as many backward uses as forward uses) takes it to HOLD_AFTER_BWD.
    pub fn release(&mut self, ids: &[TensorId], stage: Stage) -> Result<()> {
        self.usable()?;
        check_distinct(ids)?;
        let mut events = Vec::with_capacity(ids.len());
        for &id in ids {
            let t = self.meta(id)?;
            let ev = match stage {
                Stage::Forward => TrainEvent::AfterFwdOp,
                Stage::Backward if t.bwd_uses >= t.fwd_uses => TrainEvent::AfterLastBwdOp,
                Stage::Backward => TrainEvent::AfterBwdOp,
                Stage::Optimizer => TrainEvent::AfterOptim,
            };
            if self.stage != Some(stage) {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: ChunkKind::Param.name(),
                    state: t.state[0],
                    event: ev,
                });
            }
            self.check_transition(&[id], ChunkKind::Param, ev)?;
            events.push(ev);
        }
        // one release per tensor, matching the one use per tensor of the fetch
        let chunks: Vec<ChunkNo> = ids
            .iter()
            .map(|&id| self.chunk_of(id, ChunkKind::Param))
            .collect();
        for &c in &chunks {
            let times = chunks.iter().filter(|&&d| d == c).count() as u32;
            let idle = self
                .sched
                .as_ref()
                .and_then(|s| s.status(c))
                .is_some_and(|s| s.in_use <= times);
            if let Some(buf) = &self.payload[c as usize].device {
                // views handed out must be gone before the chunk may move
                if idle && Arc::strong_count(buf) > 1 {
                    return Err(Error::ViewAlive {
                        what: format!("chunk {c}"),
                        during: "release",
                    });
                }
            }
        }
        for (&id, &ev) in ids.iter().zip(&events) {
            self.apply(id, ChunkKind::Param, ev);
        }
        let moves = self.sched().release(&chunks)?;
        self.execute(&moves)
    }

    /// Writes the gradient of a tensor into its parameter slot (converted to the parameter dtype).
    /// Allowed only while the tensor is fetched for its last backward use: a shared parameter gets
    /// its gradient once, after all its uses.
    pub fn write_grad(&mut self, id: TensorId, grad: &[f32]) -> Result<()> {
        self.usable()?;
        let (buf, off) = self.grad_slot(id, grad.len())?;
        let bytes = encode(grad, self.cfg.param_dtype);
        let mut h = HostBuffer::paged(bytes.len())?;
        h.copy_from_slice(&bytes);
        self.device
            .copy_h2d(&self.compute, h, buf.view(off, bytes.len())?)?
            .wait()?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }

    /// Like [`ChunkManager::write_grad`], from device memory already in the parameter dtype
    /// (`src` holds the tensor's elements; the copy runs on [`ChunkManager::compute_stream`]).
    pub fn write_grad_device(&mut self, id: TensorId, src: DeviceView<'_>) -> Result<()> {
        self.usable()?;
        let es = self.cfg.param_dtype.size();
        if !src.len().is_multiple_of(es) {
            return Err(Error::Misaligned {
                what: "gradient length",
                value: src.len(),
                align: es,
            });
        }
        let (buf, off) = self.grad_slot(id, src.len() / es)?;
        self.device
            .copy_d2d(&self.compute, src, buf.view(off, src.len())?)?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }

    /// The device chunk and byte offset a gradient of `len` elements of `id` goes to, after the
    /// checks both gradient writes share.
    fn grad_slot(&self, id: TensorId, len: usize) -> Result<(Arc<DeviceBuffer>, usize)> {
        if !self.grad_use(id)? {
            let t = &self.tensors[id.index()];
            return Err(Error::InvalidArgument(format!(
                "gradient of shared tensor '{}' written at backward use {} of {}; write it at the last",
                t.name, t.bwd_uses, t.fwd_uses
            )));
        }
        let t = &self.tensors[id.index()];
        if len != t.slot.numel {
            return Err(Error::SizeMismatch {
                src: len,
                dst: t.slot.numel,
            });
        }
        let c = self.chunk_of(id, ChunkKind::Param) as usize;
        let buf = self.payload[c]
            .device
            .clone()
            .ok_or_else(|| Error::InvalidArgument("fetched chunk has no device copy".into()))?;
        Ok((buf, t.slot.offset * self.cfg.param_dtype.size()))
    }

    /// Values of a tensor's parameter slot as f32, from wherever the chunk is (a gradient after
    /// the tensor's last backward use). Reads from the device run on the compute stream.
    pub fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        self.usable()?;
        let t = self.meta(id)?;
        let (slot, init_needed) = (t.slot, self.sched.is_none());
        if init_needed
            || self
                .chunk_state(slot.group as usize, ChunkKind::Param)
                .is_none()
        {
            let mut v = vec![0.0; slot.numel];
            t.init.fill(&mut v);
            return Ok(decode(
                &encode(&v, self.cfg.param_dtype),
                self.cfg.param_dtype,
            ));
        }
        let c = self.chunk_of(id, ChunkKind::Param) as usize;
        let es = self.cfg.param_dtype.size();
        let (off, len) = (slot.offset * es, slot.numel * es);
        if let Some(buf) = self.payload[c].device.clone() {
            if let Some(ev) = self.payload[c].ready.take() {
                self.device.wait_event(&self.compute, &ev)?;
            }
            let bytes = self.device.download(&self.compute, buf.view(off, len)?)?;
            return Ok(decode(&bytes, self.cfg.param_dtype));
        }
        let dt = self.cfg.param_dtype;
        let h = self.host_ready(c)?;
        Ok(decode(&h[off..off + len], dt))
    }

    /// Copies the parameter of `id` (in the parameter dtype) into `dst` on the compute stream,
    /// from the device copy of its chunk when there is one, else from the host copy, without a
    /// use: no state changes and no moves. The copy may still be in flight on return; work on
    /// the compute stream is ordered after it. For gathers whose use is counted elsewhere (a
    /// shared parameter's second forward gather, a gather made ahead in backward).
    pub fn copy_param_into(&mut self, id: TensorId, dst: DeviceView<'_>) -> Result<()> {
        self.usable()?;
        let t = self.meta(id)?;
        let (slot, es) = (t.slot, self.cfg.param_dtype.size());
        let (off, len) = (slot.offset * es, slot.numel * es);
        if dst.len() != len {
            return Err(Error::SizeMismatch {
                src: len,
                dst: dst.len(),
            });
        }
        let c = self.chunk_of(id, ChunkKind::Param) as usize;
        if self.sched.is_some()
            && self
                .chunk_state(slot.group as usize, ChunkKind::Param)
                .is_some()
        {
            if let Some(buf) = self.payload[c].device.clone() {
                if let Some(ev) = self.payload[c].ready.take() {
                    self.device.wait_event(&self.compute, &ev)?;
                }
                return self
                    .device
                    .copy_d2d(&self.compute, buf.view(off, len)?, dst);
            }
            // no device copy: the host copy is current; the copy reads it in flight
            self.host_ready(c)?;
            let HostSlot::Ready(h) = std::mem::take(&mut self.payload[c].host) else {
                unreachable!("host_ready leaves the slot ready")
            };
            return match self.device.copy_h2d_part(&self.compute, h, off, dst) {
                Ok(pending) => {
                    self.payload[c].host = HostSlot::InFlight(pending);
                    Ok(())
                }
                Err(e) => {
                    // the host copy went with the failed copy: nothing is left to serve
                    self.broken = Some(format!("a parameter copy out of chunk {c} failed: {e}"));
                    Err(e)
                }
            };
        }
        let bytes = encode(&self.read(id)?, self.cfg.param_dtype);
        let h = HostBuffer::from_slice(&bytes)?;
        self.device.copy_h2d(&self.compute, h, dst)?.wait()?;
        Ok(())
    }

    /// The fp32 master values of a tensor (its initial values before the first step).
    pub fn master(&mut self, id: TensorId) -> Result<Vec<f32>> {
        self.usable()?;
        let t = self.meta(id)?;
        let slot = t.slot;
        let c = self.chunk_of(id, ChunkKind::Master) as usize;
        if self.sched.is_none()
            || self
                .chunk_state(slot.group as usize, ChunkKind::Master)
                .is_none()
        {
            let mut v = vec![0.0; slot.numel];
            t.init.fill(&mut v);
            return Ok(v);
        }
        let moves = self.sched().sync_host(c as ChunkNo, false)?;
        self.execute(&moves)?;
        let h = self.host_ready(c)?;
        let f: &[f32] = bytemuck::cast_slice(&h[slot.offset * 4..(slot.offset + slot.numel) * 4]);
        Ok(f.to_vec())
    }

    /// Ends the forward pass: every tensor used in it goes HOLD_AFTER_FWD → HOLD.
    /// An iteration that fetched nothing in forward may end its forward pass too.
    pub fn end_forward(&mut self) -> Result<()> {
        self.usable()?;
        if !matches!(self.stage, None | Some(Stage::Forward)) {
            return Err(Error::WrongStage {
                call: "end_forward".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        // the tiers and the scheduler exist from here on, even if nothing was fetched
        self.close()?;
        let all: Vec<TensorId> = (0..self.tensors.len() as u32).map(TensorId).collect();
        self.check_transition(&all, ChunkKind::Param, TrainEvent::EndForward)?;
        for id in all {
            self.apply(id, ChunkKind::Param, TrainEvent::EndForward);
        }
        self.stage = Some(Stage::Backward);
        Ok(())
    }

    /// Ends the backward pass. Fails if a tensor is still fetched.
    pub fn end_backward(&mut self) -> Result<()> {
        self.usable()?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "end_backward".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        self.check_nothing_fetched("backward")?;
        self.stage = Some(Stage::Optimizer);
        Ok(())
    }

    /// Runs an optimizer over every chunk group on the host: the group's four chunks are brought
    /// to host memory (dirty device copies written back, stale ones dropped) and handed to `f`,
    /// which updates masters and optimizer state and must leave the new parameter values in the
    /// parameter chunk. One moment per group.
    pub fn step_host(&mut self, mut f: impl FnMut(GroupSlices<'_>) -> Result<()>) -> Result<()> {
        self.usable()?;
        self.visit_groups(
            &ChunkKind::ALL,
            |_| Target::Host,
            |v| match v.chunks {
                GroupChunks::Host {
                    param,
                    master: Some(master),
                    momentum: Some(momentum),
                    variance: Some(variance),
                } => f(GroupSlices {
                    group: v.group,
                    tensors: v.tensors,
                    param,
                    param_dtype: v.param_dtype,
                    master,
                    momentum,
                    variance,
                }),
                _ => unreachable!("four host chunks were asked for"),
            },
        )
    }

    /// Visits every chunk group once, in order, during the optimizer stage (after
    /// [`ChunkManager::end_backward`]): the chunks of `kinds` (the parameter chunk is always
    /// included) are brought to the tier `place(group)` names and handed to `f`. One moment per
    /// group; every chunk visited counts as written. On the device, `f` enqueues its work on
    /// the stream it is given, which runs after the loads of the group's chunks; later moves of
    /// those chunks run after it. A pass that includes the masters must leave parameters in the
    /// parameter chunk (an optimizer step, or a restore from the masters): afterwards the
    /// group's parameter chunk counts as holding parameters again, not gradients, for
    /// [`ChunkManager::save_checkpoint`].
    pub fn visit_groups(
        &mut self,
        kinds: &[ChunkKind],
        mut place: impl FnMut(usize) -> Target,
        mut f: impl FnMut(GroupVisit<'_>) -> Result<()>,
    ) -> Result<()> {
        self.usable()?;
        if self.stage != Some(Stage::Optimizer) {
            return Err(Error::WrongStage {
                call: "an optimizer pass (between end_backward and end_step)".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        let mut lists = vec![ChunkKind::Param];
        lists.extend(kinds.iter().copied().filter(|&k| k != ChunkKind::Param));
        lists.sort_by_key(|k| k.index());
        lists.dedup();
        let opt: Vec<ChunkKind> = lists[1..].to_vec();
        for g in 0..self.layout.groups() {
            let t0 = self.now_us();
            let target = place(g);
            let ids: Vec<TensorId> = self.layout.group_tensors[g]
                .iter()
                .map(|&t| TensorId(t))
                .collect();
            for &k in &opt {
                self.check_transition(&ids, k, TrainEvent::BeforeOptim)?;
            }
            let acc: Vec<Access> = lists
                .iter()
                .map(|&k| Access {
                    chunk: ChunkPlan::chunk_no(g as u32, k),
                    target,
                    write: true,
                })
                .collect();
            self.tick(Stage::Optimizer, &acc);
            let moves = self.fetch_moment(&acc)?;
            self.execute(&moves)?;
            for &id in &ids {
                for &k in &opt {
                    self.apply(id, k, TrainEvent::BeforeOptim);
                }
            }
            let tensors: Vec<(TensorId, usize, usize, bool)> = ids
                .iter()
                .map(|&id| {
                    let t = &self.tensors[id.index()];
                    (id, t.slot.offset, t.slot.numel, t.grad)
                })
                .collect();
            let ranges = grad_ranges(&tensors);
            let result = match target {
                Target::Host => self.visit_host(g, &lists, tensors, ranges, &mut f),
                Target::Device => self.visit_device(g, &lists, tensors, ranges, &mut f),
            };
            for &id in &ids {
                for &k in &opt {
                    self.apply(id, k, TrainEvent::AfterOptim);
                }
            }
            let chunks: Vec<ChunkNo> = acc.iter().map(|a| a.chunk).collect();
            let moves = self.sched().release(&chunks)?;
            self.execute(&moves)?;
            self.sample();
            self.note("optimizer", g as u64, 0, t0);
            result?;
            if lists.contains(&ChunkKind::Master) {
                // an optimizer pass (or a restore from the masters) leaves parameters in the
                // parameter chunk
                self.grads_in[g] = false;
            }
        }
        Ok(())
    }

    fn visit_host(
        &mut self,
        g: usize,
        lists: &[ChunkKind],
        tensors: Vec<(TensorId, usize, usize, bool)>,
        ranges: Vec<Range<usize>>,
        f: &mut impl FnMut(GroupVisit<'_>) -> Result<()>,
    ) -> Result<()> {
        // every copy in place first, so an error cannot leave a chunk taken out of its slot
        for &k in lists {
            self.host_ready(ChunkPlan::chunk_no(g as u32, k) as usize)?;
        }
        let mut bufs: [Option<HostBuffer>; 4] = Default::default();
        for &k in lists {
            let c = ChunkPlan::chunk_no(g as u32, k) as usize;
            match std::mem::take(&mut self.payload[c].host) {
                HostSlot::Ready(b) => bufs[k.index()] = Some(b),
                _ => unreachable!("host_ready leaves the slot ready"),
            }
        }
        let result = {
            let [p, ma, mo, va] = &mut bufs;
            fn f32s(b: &mut Option<HostBuffer>) -> Result<Option<&mut [f32]>> {
                match b {
                    None => Ok(None),
                    Some(b) => bytemuck::try_cast_slice_mut::<u8, f32>(b)
                        .map(Some)
                        .map_err(|_| Error::Misaligned {
                            what: "host chunk",
                            value: 0,
                            align: 4,
                        }),
                }
            }
            match (f32s(ma), f32s(mo), f32s(va)) {
                (Ok(master), Ok(momentum), Ok(variance)) => f(GroupVisit {
                    group: g,
                    tensors,
                    ranges,
                    param_dtype: self.cfg.param_dtype,
                    chunks: GroupChunks::Host {
                        param: p.as_mut().expect("the parameter chunk is always visited"),
                        master,
                        momentum,
                        variance,
                    },
                }),
                (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => Err(e),
            }
        };
        for (i, b) in bufs.into_iter().enumerate() {
            if let Some(b) = b {
                self.payload[ChunkPlan::chunk_no(g as u32, LISTS[i]) as usize].host =
                    HostSlot::Ready(b);
            }
        }
        result
    }

    fn visit_device(
        &mut self,
        g: usize,
        lists: &[ChunkKind],
        tensors: Vec<(TensorId, usize, usize, bool)>,
        ranges: Vec<Range<usize>>,
        f: &mut impl FnMut(GroupVisit<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut bufs: [Option<Arc<DeviceBuffer>>; 4] = Default::default();
        for &k in lists {
            let c = ChunkPlan::chunk_no(g as u32, k) as usize;
            if let Some(ev) = self.payload[c].ready.take() {
                self.device.wait_event(&self.compute, &ev)?;
            }
            bufs[k.index()] = Some(self.payload[c].device.clone().ok_or_else(|| {
                Error::InvalidArgument(format!("chunk {c} was fetched but has no device copy"))
            })?);
        }
        let [p, ma, mo, va] = &bufs;
        f(GroupVisit {
            group: g,
            tensors,
            ranges,
            param_dtype: self.cfg.param_dtype,
            chunks: GroupChunks::Device {
                device: &self.device,
                stream: &self.compute,
                param: p.as_deref().expect("the parameter chunk is always visited"),
                master: ma.as_deref(),
                momentum: mo.as_deref(),
                variance: va.as_deref(),
            },
        })
    }

    /// Tells the scheduler where the optimizer will run each group from now on: the installed
    /// trace's optimizer moments are rewritten to `place(group)`, so next-use distances and
    /// prefetching count the optimizer's device uses. Without an installed trace (during
    /// warm-up) nothing changes.
    pub fn plan_optimizer(&mut self, mut place: impl FnMut(usize) -> Target) {
        let Some(s) = self.sched.as_mut() else {
            return;
        };
        let Some(mut trace) = s.trace().cloned() else {
            return;
        };
        trace.place_optimizer(|c| place(ChunkPlan::group_of(c) as usize));
        s.install_trace(trace);
    }

    /// Statistics (sum of squares, any infinite or NaN element) of every gradient written this
    /// iteration, computed where each parameter chunk is, without moving it: on the device with
    /// [`Device::grad_stats`], on the host with the CPU kernel. Ranges are combined in group
    /// order, so the result does not depend on placement where both sides run the same code
    /// (the simulated device).
    pub fn grad_stats(&mut self) -> Result<GradStats> {
        self.usable()?;
        let mut on_device: Vec<(usize, Range<usize>)> = Vec::new();
        let mut parts: Vec<Option<GradStats>> = Vec::new();
        let es = self.cfg.param_dtype.size();
        let kind = RawKind::of(self.cfg.param_dtype);
        for g in 0..self.layout.groups() {
            let tensors: Vec<(TensorId, usize, usize, bool)> = self.layout.group_tensors[g]
                .iter()
                .map(|&t| {
                    let m = &self.tensors[t as usize];
                    (TensorId(t), m.slot.offset, m.slot.numel, m.grad)
                })
                .collect();
            let c = ChunkPlan::chunk_no(g as u32, ChunkKind::Param) as usize;
            for r in grad_ranges(&tensors) {
                if self.payload[c].device.is_some() {
                    on_device.push((c, r));
                    parts.push(None);
                } else {
                    let h = self.host_ready(c)?;
                    let bytes = &h[r.start * es..r.end * es];
                    // SAFETY: `bytes` holds `r.len()` elements of the parameter dtype.
                    parts.push(Some(unsafe {
                        grad_stats_raw(kind, bytes.as_ptr(), r.len())
                    }));
                }
            }
        }
        if !on_device.is_empty() {
            // one scratch range, reused, and the 16-byte results gathered on the device for one
            // download; without room for them, the gradients are read back and summed on the
            // host by the same code
            let n = on_device.len();
            let scratch = match (
                self.alloc_device(GRAD_STATS_BYTES),
                self.alloc_device(16 * n),
            ) {
                (Ok(s), Ok(r)) => Some((s, r)),
                (Err(Error::OutOfMemory { .. }), _) | (_, Err(Error::OutOfMemory { .. })) => None,
                (Err(e), _) | (_, Err(e)) => return Err(e),
            };
            let mut results = Vec::with_capacity(n);
            for (i, (c, r)) in on_device.iter().enumerate() {
                if let Some(ev) = self.payload[*c].ready.take() {
                    self.device.wait_event(&self.compute, &ev)?;
                }
                let buf = self.payload[*c].device.clone().expect("checked above");
                let src = buf.view(r.start * es, r.len() * es)?;
                match &scratch {
                    Some((out, res)) => {
                        self.device
                            .grad_stats(&self.compute, src, self.cfg.param_dtype, out)?;
                        self.device.copy_d2d(
                            &self.compute,
                            out.view(0, 16)?,
                            res.view(16 * i, 16)?,
                        )?;
                    }
                    None => {
                        let bytes = self.device.download(&self.compute, src)?;
                        // an aligned copy for the typed reads
                        let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
                        bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..bytes.len()]
                            .copy_from_slice(&bytes);
                        // SAFETY: `aligned` holds `r.len()` elements of the parameter dtype,
                        // 8-byte aligned.
                        results.push(unsafe {
                            grad_stats_raw(kind, aligned.as_ptr().cast(), r.len())
                        });
                    }
                }
            }
            if let Some((_, res)) = &scratch {
                let bytes = self.device.download(&self.compute, res)?;
                for i in 0..n {
                    results.push(read_grad_stats(&bytes[16 * i..])?);
                }
            }
            let mut results = results.into_iter();
            for p in parts.iter_mut().filter(|p| p.is_none()) {
                *p = results.next();
            }
        }
        Ok(parts
            .into_iter()
            .flatten()
            .fold(GradStats::default(), GradStats::merge))
    }

    /// The highest non-model device memory seen at any moment of this iteration or the last
    /// complete one (0 without a non-model allocator).
    pub fn non_model_peak(&self) -> u64 {
        self.samples
            .iter()
            .chain(&self.last_samples)
            .map(|s| s.non_model)
            .max()
            .unwrap_or(0)
            .max(
                self.non_model
                    .as_ref()
                    .map_or(0, |p| p.stats().peak_allocated as u64),
            )
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

    /// Ends the step: parameters go back to HOLD, use counts restart, and the warm-up trace (if
    /// this was the first complete iteration) is installed.
    pub fn end_step(&mut self) -> Result<()> {
        self.usable()?;
        self.finish_iteration(false)
    }

    /// Ends an iteration whose step was skipped (e.g. a gradient overflow): like
    /// [`ChunkManager::end_step`], but a warm-up iteration is discarded and warm-up runs again.
    pub fn skip_step(&mut self) -> Result<()> {
        self.usable()?;
        self.finish_iteration(true)
    }

    fn check_nothing_fetched(&self, end_of: &str) -> Result<()> {
        match self
            .tensors
            .iter()
            .find(|t| t.state[0] == TensorState::Compute)
        {
            Some(t) => Err(Error::InvalidArgument(format!(
                "tensor '{}' is still fetched at the end of {end_of}",
                t.name
            ))),
            None => Ok(()),
        }
    }

    fn finish_iteration(&mut self, skipped: bool) -> Result<()> {
        self.check_nothing_fetched("the step")?;
        let all: Vec<TensorId> = (0..self.tensors.len() as u32).map(TensorId).collect();
        self.check_transition(&all, ChunkKind::Param, TrainEvent::EndStep)?;
        for id in all {
            self.apply(id, ChunkKind::Param, TrainEvent::EndStep);
            let t = &mut self.tensors[id.index()];
            t.fwd_uses = 0;
            t.bwd_uses = 0;
            t.grad = false;
        }
        self.stage = None;
        let Some(s) = self.sched.as_mut() else {
            return Ok(());
        };
        if let Some(p) = &self.non_model {
            let st = p.stats();
            p.reset_peak();
            self.tracer.non_model(st.peak_allocated as u64);
            if let Some(l) = self.samples.last_mut() {
                l.non_model = l.non_model.max(st.peak_allocated as u64);
            }
        }
        if self.warm {
            if skipped {
                self.tracer.discard();
            } else if let Some(trace) = self.tracer.finish() {
                s.install_trace(trace);
                self.warm = false;
            }
        }
        s.start_iteration();
        let now = s.stats();
        self.last_iter = now.since(&self.iter_start);
        self.iter_start = now;
        self.iterations += 1;
        self.last_samples = std::mem::take(&mut self.samples);
        Ok(())
    }

    /// Iterations completed (`end_step` or `skip_step` calls).
    pub fn iterations_done(&self) -> u64 {
        self.iterations
    }

    /// Whether warm-up is over (a trace is installed).
    pub fn is_steady(&self) -> bool {
        !self.warm
    }

    /// The installed trace.
    pub fn trace(&self) -> Option<&Trace> {
        self.sched.as_ref().and_then(|s| s.trace())
    }

    /// Moves ordered since the manager was created.
    pub fn stats(&self) -> MoveStats {
        self.sched
            .as_ref()
            .map_or_else(MoveStats::default, |s| s.stats())
    }

    /// Moves of the last complete iteration.
    pub fn last_iteration(&self) -> MoveStats {
        self.last_iter
    }

    /// Device memory at every moment of the last complete iteration.
    pub fn tide_samples(&self) -> &[TideSample] {
        &self.last_samples
    }

    /// The scheduler (after the first fetch).
    pub fn scheduler(&self) -> Option<&Scheduler> {
        self.sched.as_ref()
    }

    /// Exact chunk bytes per kind on every tier, from the payloads that exist.
    pub fn usage(&self) -> Usage {
        let mut u = Usage::default();
        for (c, p) in self.payload.iter().enumerate() {
            let k = c % 4;
            let b = self.chunk_bytes(c) as u64;
            if p.device.is_some() {
                u.device[k] += b;
            }
            if !matches!(p.host, HostSlot::None) {
                if self.file_tier[c] {
                    u.file[k] += b;
                } else {
                    u.host[k] += b;
                }
            }
        }
        u
    }

    /// Waits for every copy in flight.
    pub fn synchronize(&mut self) -> Result<()> {
        self.usable()?;
        self.device.sync_stream(&self.copy)?;
        self.device.sync_stream(&self.compute)?;
        for c in 0..self.payload.len() {
            if matches!(self.payload[c].host, HostSlot::InFlight(_)) {
                self.host_ready(c)?;
            }
        }
        for p in self.retiring.drain(..) {
            p.wait()?;
        }
        Ok(())
    }

    /// Makes the host slot of chunk `c` ready (waiting for a copy in flight) and returns it.
    fn host_ready(&mut self, c: usize) -> Result<&mut HostBuffer> {
        if let HostSlot::InFlight(_) = &self.payload[c].host {
            let HostSlot::InFlight(p) = std::mem::take(&mut self.payload[c].host) else {
                unreachable!()
            };
            self.payload[c].host = HostSlot::Ready(p.wait()?);
        }
        match &mut self.payload[c].host {
            HostSlot::Ready(b) => Ok(b),
            _ => Err(Error::InvalidArgument(format!(
                "chunk {c} has no host copy"
            ))),
        }
    }

    fn alloc_host(&mut self, c: usize) -> Result<HostBuffer> {
        let bytes = self.chunk_bytes(c);
        if self.file_tier[c] {
            if let Some(f) = &self.file {
                return f.alloc(bytes);
            }
        }
        self.device.alloc_host(bytes)
    }

    fn materialize(&mut self, c: usize) -> Result<()> {
        let mut h = self.alloc_host(c)?;
        self.fill_initial(c, &mut h);
        self.payload[c].host = HostSlot::Ready(h);
        Ok(())
    }

    /// Chunk `c`'s bytes before any use: its tensors' initial values (zeros for the moments and
    /// the padding).
    fn fill_initial(&self, c: usize, h: &mut [u8]) {
        h.fill(0);
        let (g, k) = (c / 4, LISTS[c % 4]);
        if matches!(k, ChunkKind::Momentum | ChunkKind::Variance) {
            return;
        }
        let (es, dt) = (self.elem_bytes(k), self.list_dtype(k));
        for &t in &self.layout.group_tensors[g] {
            let t = &self.tensors[t as usize];
            let mut v = vec![0.0f32; t.slot.numel];
            t.init.fill(&mut v);
            let bytes = encode(&v, dt);
            h[t.slot.offset * es..t.slot.offset * es + bytes.len()].copy_from_slice(&bytes);
        }
    }

    /// The element type of a list: the parameter dtype, f32 for the optimizer lists.
    pub(super) fn list_dtype(&self, kind: ChunkKind) -> DType {
        if kind == ChunkKind::Param {
            self.cfg.param_dtype
        } else {
            DType::F32
        }
    }

    /// Refuses `what` (a checkpoint) unless the manager is between iterations: before the
    /// first fetch or after `end_step`/`skip_step`. With `params_only`, also while a parameter
    /// chunk may hold gradients (fetched in backward and not rewritten by an optimizer pass
    /// since, as after a `skip_step` that did not restore the parameters).
    pub(crate) fn check_idle(&self, what: &str, params_only: bool) -> Result<()> {
        self.usable()?;
        if let Some(s) = self.stage {
            return Err(Error::InvalidArgument(format!(
                "{what} runs between iterations (before the first fetch or after end_step), not \
                 during the {} stage",
                s.name()
            )));
        }
        let dirty: Vec<usize> = (0..self.grads_in.len())
            .filter(|&g| self.grads_in[g])
            .collect();
        if params_only && !dirty.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{what}: the parameter chunks of groups {dirty:?} may hold gradients (a step \
                 skipped or ended without an optimizer pass restoring the parameters, as \
                 HybridAdam does)"
            )));
        }
        Ok(())
    }

    /// After a checkpoint load every parameter chunk holds parameters.
    pub(super) fn params_restored(&mut self) {
        self.grads_in.iter_mut().for_each(|g| *g = false);
    }

    /// Hands `f` chunk `c`'s current bytes on the host: a dirty device copy is written back
    /// first (under move semantics the chunk moves to the host), and a chunk that never had a
    /// payload shows its initial values. No moment passes.
    pub(super) fn read_chunk_host(
        &mut self,
        c: usize,
        f: impl FnOnce(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (g, k) = (c / 4, LISTS[c % 4]);
        if self.sched.is_none() || self.chunk_state(g, k).is_none() {
            let mut h = vec![0u8; self.chunk_bytes(c)];
            self.fill_initial(c, &mut h);
            return f(&h);
        }
        let moves = self.sched().sync_host(c as ChunkNo, false)?;
        self.execute(&moves)?;
        f(self.host_ready(c)?)
    }

    /// After a checkpoint load every tensor has a payload: FREE tensors become HOLD.
    pub(super) fn hold_loaded(&mut self) {
        for t in &mut self.tensors {
            for s in &mut t.state {
                if *s == TensorState::Free {
                    *s = TensorState::Hold;
                }
            }
        }
    }

    /// Hands `f` chunk `c`'s host copy to overwrite, after which it is the chunk's only copy:
    /// a chunk without a payload gets one, and a device copy is dropped (written back first if
    /// dirty, as any eviction). Closes registration. No moment passes.
    /// A failure leaves the manager unusable: a load that stopped midway left some chunks
    /// from the checkpoint and some not.
    pub(super) fn write_chunk_host(&mut self, c: usize, f: impl FnOnce(&mut [u8])) -> Result<()> {
        let r = (|| {
            self.close()?;
            let mut moves = self.sched().materialize_on_host(c as ChunkNo)?;
            moves.extend(self.sched().sync_host(c as ChunkNo, true)?);
            self.execute(&moves)?;
            f(self.host_ready(c)?);
            Ok(())
        })();
        if let Err(e) = &r {
            if self.broken.is_none() {
                self.broken = Some(format!("a checkpoint load failed midway: {e}"));
            }
        }
        r
    }

    /// Carries out the scheduler's moves; a failure makes the manager unusable.
    fn execute(&mut self, moves: &[Move]) -> Result<()> {
        let r = self.execute_moves(moves);
        if let Err(e) = &r {
            self.broken = Some(format!("a chunk move the scheduler ordered failed: {e}"));
        }
        r
    }

    fn execute_moves(&mut self, moves: &[Move]) -> Result<()> {
        // retire finished host frees
        self.retiring.retain(|p| !p.is_ready().unwrap_or(false));
        for mv in moves {
            let t0 = self.now_us();
            match *mv {
                Move::Materialize { chunk } => {
                    self.materialize(chunk as usize)?;
                    self.note("materialize", chunk as u64, 0, t0);
                }
                Move::Load { chunk, prefetch } => {
                    let c = chunk as usize;
                    let bytes = self.chunk_bytes(c);
                    let buf = self.alloc_device(bytes)?;
                    self.host_ready(c)?;
                    let HostSlot::Ready(h) = std::mem::take(&mut self.payload[c].host) else {
                        unreachable!()
                    };
                    let pending = self.device.copy_h2d(&self.copy, h, &buf)?;
                    let ev = self.device.new_event()?;
                    self.device.record(&self.copy, &ev)?;
                    self.payload[c].host = HostSlot::InFlight(pending);
                    self.payload[c].device = Some(Arc::new(buf));
                    self.payload[c].ready = Some(ev);
                    self.note(
                        if prefetch { "prefetch" } else { "load" },
                        chunk as u64,
                        bytes as u64,
                        t0,
                    );
                }
                Move::WriteBack { chunk } => {
                    let c = chunk as usize;
                    let buf = self.payload[c].device.clone().ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "write-back of chunk {c} without a device copy"
                        ))
                    })?;
                    let h = match std::mem::take(&mut self.payload[c].host) {
                        HostSlot::Ready(h) => h,
                        HostSlot::InFlight(p) => p.wait()?,
                        HostSlot::None => self.alloc_host(c)?,
                    };
                    // the copy engine reads the chunk after everything compute did to it
                    let ev = self.device.new_event()?;
                    self.device.record(&self.compute, &ev)?;
                    self.device.wait_event(&self.copy, &ev)?;
                    if let Some(r) = self.payload[c].ready.take() {
                        self.device.wait_event(&self.copy, &r)?;
                    }
                    let p = self.device.copy_d2h(&self.copy, &*buf, h)?;
                    self.payload[c].host = HostSlot::InFlight(p);
                    self.note("write-back", chunk as u64, buf.len() as u64, t0);
                }
                Move::Drop { chunk } => {
                    let c = chunk as usize;
                    if let Some(buf) = self.payload[c].device.take() {
                        if Arc::strong_count(&buf) > 1 {
                            return Err(Error::ViewAlive {
                                what: format!("chunk {c}"),
                                during: "eviction",
                            });
                        }
                    }
                    self.payload[c].ready = None;
                    self.note("drop", chunk as u64, 0, t0);
                }
                Move::FreeHost { chunk } => {
                    let c = chunk as usize;
                    match std::mem::take(&mut self.payload[c].host) {
                        HostSlot::InFlight(p) => self.retiring.push(p),
                        HostSlot::Ready(_) | HostSlot::None => {}
                    }
                    self.note("free-host", chunk as u64, 0, t0);
                }
            }
        }
        Ok(())
    }

    /// Allocates a chunk's device copy; if the device is full because freed chunks are still
    /// waiting for their copies or the non-model pool caches free blocks, waits for the streams,
    /// empties the cache and tries once more.
    fn alloc_device(&mut self, bytes: usize) -> Result<DeviceBuffer> {
        match self.device.alloc(bytes) {
            Ok(b) => Ok(b),
            Err(Error::OutOfMemory { .. }) => {
                self.device.sync_stream(&self.copy)?;
                self.device.sync_stream(&self.compute)?;
                if let Some(p) = &self.non_model {
                    p.empty_cache();
                }
                self.device.alloc(bytes)
            }
            Err(e) => Err(e),
        }
    }
}

/// Elements of a tensor of `shape`: an error for none or more than `usize` holds.
pub(crate) fn numel_of(name: &str, shape: &[usize]) -> Result<usize> {
    // every list's bytes (4 per element at most) must be addressable
    match shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) {
        Some(n) if n > 0 && n <= isize::MAX as usize / 4 => Ok(n),
        _ => Err(Error::InvalidArgument(format!(
            "tensor '{name}' has shape {shape:?} with no elements or too many"
        ))),
    }
}

pub(crate) fn check_distinct(ids: &[TensorId]) -> Result<()> {
    if ids.is_empty() {
        return Err(Error::InvalidArgument("an access names no tensor".into()));
    }
    for (i, a) in ids.iter().enumerate() {
        if ids[i + 1..].contains(a) {
            return Err(Error::InvalidArgument(format!(
                "tensor {a} listed twice in one access"
            )));
        }
    }
    Ok(())
}

/// Encodes f32 values as `dtype` little-endian bytes.
pub fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(v).to_vec(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
    }
}

/// Decodes `dtype` little-endian bytes to f32.
pub fn decode(b: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

// --- support for the trainer API (`crate::store`): the non-model pool and gradient marks ---
impl ChunkManager {
    /// The non-model pool: the manager's own unless [`ChunkManager::set_non_model_allocator`]
    /// replaced it. Activations and other non-model buffers should come from it, so that the
    /// tide sees them.
    pub fn pool(&self) -> &CachingAllocator {
        self.non_model
            .as_ref()
            .expect("a manager always holds a non-model pool")
    }

    /// Checks that a gradient of `id` may be written now (the backward stage, the tensor
    /// fetched); returns whether this is the tensor's last backward use, the one its gradient
    /// is written at.
    pub(crate) fn grad_use(&self, id: TensorId) -> Result<bool> {
        let t = self.meta(id)?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: format!("a gradient write of '{}'", t.name),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        if t.state[0] != TensorState::Compute {
            return Err(Error::InvalidArgument(format!(
                "gradient of '{}' written outside a backward fetch (state {})",
                t.name, t.state[0]
            )));
        }
        Ok(t.bwd_uses >= t.fwd_uses)
    }

    /// Marks the gradient of `id` written into its parameter slot (by device work the caller
    /// enqueued on the compute stream), after the checks of [`ChunkManager::write_grad`].
    pub(crate) fn mark_grad(&mut self, id: TensorId) -> Result<()> {
        self.usable()?;
        let numel = self.meta(id)?.slot.numel;
        self.grad_slot(id, numel)?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }
}
