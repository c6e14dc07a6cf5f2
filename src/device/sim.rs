use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};

use super::kernel::{HostOperand, KernelDesc, TwinArgs};
use super::{
    Backend, BackendKind, DeviceId, HostBuffer, MemInfo, Op, RawBuffer, RawEvent, RawStream,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Alignment of simulated device allocations: one page. `cudaMalloc` guarantees 256 bytes, but a
/// page keeps host and device copies of a chunk at the same offset modulo 4 KiB, which avoids
/// the 4K-aliasing stall a copy between differently aligned buffers suffers on x86.
pub const SIM_ALIGN: usize = 4096;

/// Bandwidth and latency of the simulated links. A copy takes at least
/// `latency + bytes / bandwidth`; the copy engine sleeps out any time the real `memcpy` saved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Host→device bandwidth in GB/s (10⁹ bytes per second).
    pub h2d_gbps: f64,
    /// Device→host bandwidth in GB/s.
    pub d2h_gbps: f64,
    /// Device-internal copy bandwidth in GB/s.
    pub d2d_gbps: f64,
    /// Fixed cost of every transfer.
    pub latency: Duration,
}

impl LinkModel {
    /// A PCIe 4.0 x16 link as measured with pinned memory (~25 GB/s each way, 10 µs latency).
    pub fn pcie4() -> Self {
        LinkModel {
            h2d_gbps: 25.0,
            d2h_gbps: 25.0,
            d2d_gbps: 1500.0,
            latency: Duration::from_micros(10),
        }
    }

    /// A PCIe 5.0 x16 link (~50 GB/s each way, 8 µs latency), as on an H100 PCIe node.
    pub fn pcie5() -> Self {
        LinkModel {
            h2d_gbps: 50.0,
            d2h_gbps: 50.0,
            d2d_gbps: 2000.0,
            latency: Duration::from_micros(8),
        }
    }

    fn duration(&self, bytes: usize, gbps: f64) -> Duration {
        // rates and latency are checked when the device is made; saturate all the same, since
        // a panic here would leave the caller waiting on the copy thread
        let t = Duration::try_from_secs_f64(bytes as f64 / (gbps * 1e9)).unwrap_or(Duration::MAX);
        self.latency.saturating_add(t)
    }

    /// Checks that every rate is finite and positive and the latency under an hour.
    fn validate(&self) -> Result<()> {
        for (what, r) in [
            ("h2d_gbps", self.h2d_gbps),
            ("d2h_gbps", self.d2h_gbps),
            ("d2d_gbps", self.d2d_gbps),
        ] {
            if !(r.is_finite() && r > 0.0) {
                return Err(Error::BadValue {
                    what: format!("the simulated link's {what}"),
                    value: r,
                    want: "finite and above 0",
                });
            }
        }
        if self.latency > Duration::from_secs(3600) {
            return Err(Error::BadValue {
                what: "the simulated link's latency in seconds".into(),
                value: self.latency.as_secs_f64(),
                want: "at most an hour",
            });
        }
        Ok(())
    }
}

/// Configuration of a simulated device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimConfig {
    /// Device memory capacity in bytes; allocations beyond it fail with
    /// [`Error::OutOfMemory`].
    pub capacity: usize,
    /// Ordinal reported in the device id.
    pub(crate) ordinal: usize,
    /// Optional transfer-time model; `None` copies as fast as the host can.
    pub link: Option<LinkModel>,
    /// Timing only: kernels, copies and fills are checked and ordered as usual but not run, so
    /// what a program does on the host (launch checks, the tide's decisions, plans,
    /// allocation, waits) can be timed without the device's arithmetic. **Every result is
    /// meaningless**: device memory keeps whatever it held, downloads bring back what the host
    /// buffer held. [`Device::name`](super::Device::name) says so, and
    /// [`Device::timing_only`](super::Device::timing_only) tells a program.
    pub(crate) timing_only: bool,
}

impl SimConfig {
    /// A device of `capacity` bytes with no link model.
    pub fn with_capacity(capacity: usize) -> Self {
        SimConfig {
            capacity,
            ordinal: 0,
            link: None,
            timing_only: false,
        }
    }

    /// The same configuration with a link model.
    pub fn link(mut self, link: LinkModel) -> Self {
        self.link = Some(link);
        self
    }

    /// The same configuration in timing-only mode (see [`SimConfig::timing_only`]).
    pub fn timing_only(mut self) -> Self {
        self.timing_only = true;
        self
    }
}

#[derive(Debug)]
struct Shared {
    id: DeviceId,
    capacity: usize,
    used: AtomicUsize,
    /// Freed allocations kept for reuse, by size: host memory the simulated device already
    /// touched, so an allocation of a size it freed before costs a fill, not fresh pages (the
    /// page faults and zeroing of new memory). Not device memory: `used` no longer counts it.
    spare: Mutex<Spare>,
}

/// Freed allocations of [`Shared::spare`], at most [`SPARE_BYTES`] in all.
#[derive(Default)]
struct Spare {
    by_len: std::collections::BTreeMap<usize, Vec<SpareMem>>,
    bytes: usize,
}

/// Host memory a simulated allocation may keep for reuse.
const SPARE_BYTES: usize = 1 << 30;

/// A freed allocation's pointer.
struct SpareMem(NonNull<u8>);

// SAFETY: the pointer owns its allocation alone (the allocation it came from was dropped), and
// only the spare list, under its mutex, touches it until an allocation takes it.
unsafe impl Send for SpareMem {}

impl std::fmt::Debug for Spare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spare").field("bytes", &self.bytes).finish()
    }
}

impl Spare {
    /// A kept allocation of exactly `len` bytes.
    fn take(&mut self, len: usize) -> Option<NonNull<u8>> {
        let list = self.by_len.get_mut(&len)?;
        let p = list.pop()?;
        if list.is_empty() {
            self.by_len.remove(&len);
        }
        self.bytes -= len;
        Some(p.0)
    }
}

impl Drop for Spare {
    fn drop(&mut self) {
        for (&len, list) in &self.by_len {
            for p in list {
                // SAFETY: allocated in `SimBackend::alloc` with this exact layout, and owned by
                // the list alone.
                unsafe {
                    std::alloc::dealloc(
                        p.0.as_ptr(),
                        Layout::from_size_align_unchecked(len, SIM_ALIGN),
                    )
                };
            }
        }
    }
}

/// One simulated allocation's memory, freed when the last reference goes: the user's handle
/// ([`SimHandle`], whose drop returns the bytes to the capacity), or an operation still queued
/// on a stream.
struct SimMem {
    ptr: NonNull<u8>,
    len: usize,
    shared: Arc<Shared>,
}

// SAFETY: SimMem is a raw allocation touched only by copy-engine threads. `Device` admits an
// operation only if it is ordered (through events, stream order or host synchronisation, all of
// which synchronise through mutexes) after every conflicting access, so no two threads ever
// write, or read and write, the same bytes concurrently.
unsafe impl Send for SimMem {}
// SAFETY: see above.
unsafe impl Sync for SimMem {}

impl SimMem {
    fn at(&self, offset: usize) -> *mut u8 {
        // SAFETY: `Device` checked `offset + len <= self.len` for the operation.
        unsafe { self.ptr.as_ptr().add(offset) }
    }
}

/// The user's handle to a [`SimMem`] (what [`Backend::alloc`] returns). Dropping it gives the
/// bytes back to the capacity at once, as CUDA's stream-ordered allocator makes a freed block
/// available to the next allocation in stream order: work already queued on the memory still
/// runs on it (its operations hold the [`SimMem`], released when the last of them is done), and
/// a new allocation gets memory of its own.
struct SimHandle(Arc<SimMem>);

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.0.shared.used.fetch_sub(self.0.len, Ordering::AcqRel);
    }
}

impl Drop for SimMem {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        {
            let mut spare = self.shared.spare.lock();
            if spare.bytes + self.len <= SPARE_BYTES.min(self.shared.capacity) {
                spare.bytes += self.len;
                spare
                    .by_len
                    .entry(self.len)
                    .or_default()
                    .push(SpareMem(self.ptr));
                return;
            }
        }
        // SAFETY: allocated in `SimBackend::alloc` with this exact layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, SIM_ALIGN),
            )
        };
    }
}

/// How long a waiting thread spins before it parks. Waking a parked thread costs tens of
/// microseconds, a sizeable share of a chunk copy; drivers spin on event waits for the same reason.
const SPIN: Duration = Duration::from_micros(50);

/// An event: `recorded` counts recordings, `completed` the highest recording reached
/// (mirrored in `done` so waiters can spin without the lock).
#[derive(Default)]
struct SimEvent {
    state: Mutex<(u64, u64)>,
    done: AtomicU64,
    cv: Condvar,
    /// The sticky error of the stream the latest completed recording ran on, if it had one.
    error: Mutex<Option<Failure>>,
    /// When the latest recording completed on its stream's engine: the device's timeline.
    stamp: Mutex<Option<Instant>>,
}

/// A twin's failure, kept by its stream (sticky) and handed to every event recorded after it.
#[derive(Clone, Debug)]
struct Failure {
    kernel: String,
    message: String,
}

impl Failure {
    fn error(&self) -> Error {
        Error::KernelFailed {
            kernel: self.kernel.clone(),
            message: self.message.clone(),
        }
    }
}

/// A stream's sticky error, shared by its handle and its engine thread.
type Sticky = Arc<Mutex<Option<Failure>>>;

impl SimEvent {
    fn arm(&self) -> u64 {
        let mut s = self.state.lock();
        s.0 += 1;
        s.0
    }
    fn target(&self) -> u64 {
        self.state.lock().0
    }
    fn complete(&self, generation: u64, failure: Option<Failure>) {
        *self.error.lock() = failure;
        *self.stamp.lock() = Some(Instant::now());
        let mut s = self.state.lock();
        s.1 = s.1.max(generation);
        self.done.store(s.1, Ordering::Release);
        self.cv.notify_all();
    }
    fn wait_for(&self, generation: u64) {
        let start = Instant::now();
        while self.done.load(Ordering::Acquire) < generation {
            if start.elapsed() > SPIN {
                break;
            }
            std::hint::spin_loop();
        }
        let mut s = self.state.lock();
        while s.1 < generation {
            self.cv.wait(&mut s);
        }
    }
    fn failure(&self) -> Option<Failure> {
        self.error.lock().clone()
    }
}

enum Task {
    Copy(Work),
    Record(Arc<SimEvent>, u64),
    Wait(Arc<SimEvent>, u64),
}

/// An operation with its memory kept alive by reference counts.
enum Work {
    H2D {
        src: SendPtr,
        dst: Arc<SimMem>,
        off: usize,
        len: usize,
    },
    D2H {
        src: Arc<SimMem>,
        off: usize,
        dst: SendPtr,
        len: usize,
    },
    D2D {
        src: Arc<SimMem>,
        soff: usize,
        dst: Arc<SimMem>,
        doff: usize,
        len: usize,
    },
    Fill {
        dst: Arc<SimMem>,
        off: usize,
        len: usize,
        value: u8,
    },
    Launch {
        desc: &'static KernelDesc,
        operands: Vec<SimOperand>,
        params: Vec<u8>,
    },
}

/// One operand of a launch: memory, byte offset, byte length, element type (`None`: left out).
type SimOperand = Option<(Arc<SimMem>, usize, usize, DType)>;

struct SendPtr(*mut u8);
// SAFETY: the pointer targets host memory held by a `Pending` until this work completes
// (contract of `Backend::enqueue`).
unsafe impl Send for SendPtr {}

struct SimStream {
    tx: Sender<Task>,
    sticky: Sticky,
}

/// The next task: spins for a short while, then blocks; `None` once the stream is gone.
fn next_task(rx: &Receiver<Task>) -> Option<Task> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(t) => return Some(t),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if start.elapsed() < SPIN => std::hint::spin_loop(),
            Err(TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// Runs one operation; a twin's error comes back for the stream to keep.
fn run(work: Work, link: Option<LinkModel>) -> Option<Failure> {
    let start = Instant::now();
    // In every arm: ranges were bounds-checked by `Device`, host pointers are valid for `len`
    // bytes until completion (enqueue contract), and the ordering checks guarantee no
    // concurrent conflicting access to device memory.
    let model = match work {
        Work::H2D { src, dst, off, len } => {
            // SAFETY: see above; host and device memory never overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.0, dst.at(off), len) };
            link.map(|l| l.duration(len, l.h2d_gbps))
        }
        Work::D2H { src, off, dst, len } => {
            // SAFETY: see above.
            unsafe { std::ptr::copy_nonoverlapping(src.at(off), dst.0, len) };
            link.map(|l| l.duration(len, l.d2h_gbps))
        }
        Work::D2D {
            src,
            soff,
            dst,
            doff,
            len,
        } => {
            // SAFETY: see above; `copy` allows overlap within one buffer.
            unsafe { std::ptr::copy(src.at(soff), dst.at(doff), len) };
            link.map(|l| l.duration(len, l.d2d_gbps))
        }
        Work::Fill {
            dst,
            off,
            len,
            value,
        } => {
            // SAFETY: see above.
            unsafe { std::ptr::write_bytes(dst.at(off), value, len) };
            None
        }
        Work::Launch {
            desc,
            operands,
            params,
        } => {
            if let Err(e) = run_twin(desc, &operands, &params) {
                return Some(Failure {
                    kernel: desc.name.to_string(),
                    message: e.to_string(),
                });
            }
            None
        }
    };
    if let Some(t) = model {
        let left = t.saturating_sub(start.elapsed());
        if !left.is_zero() {
            thread::sleep(left);
        }
    }
    None
}

/// Runs an op's CPU twin on the operands' memory.
fn run_twin(desc: &'static KernelDesc, operands: &[SimOperand], params: &[u8]) -> Result<()> {
    let args = desc
        .operands
        .iter()
        .zip(operands)
        .map(|(spec, op)| match op {
            None => HostOperand::Absent,
            // SAFETY: `Device::launch` checked every range in bounds, aligned to its element
            // type (allocations are page-aligned), and that no written operand overlaps another
            // operand; the stream-ordering checks guarantee no other thread touches a written
            // range while this work runs. So the shared slices alias no mutable one.
            Some((m, off, len, d)) if spec.mode.writes() => HostOperand::Write(
                unsafe { std::slice::from_raw_parts_mut(m.at(*off), *len) },
                *d,
            ),
            Some((m, off, len, d)) => {
                // SAFETY: as above.
                HostOperand::Read(unsafe { std::slice::from_raw_parts(m.at(*off), *len) }, *d)
            }
        })
        .collect();
    let mut args = TwinArgs::new(desc, args, params)?;
    (desc.twin)(&mut args)
}

/// The simulated accelerator: a device with a hard capacity whose memory is taken from the host,
/// and whose streams are copy-engine threads that execute operations asynchronously, in order.
///
/// Events complete when the work before them does, exactly as on a GPU; an optional
/// [`LinkModel`] stretches each transfer to the time a PCIe link would take, so a timeline of
/// prefetches and evictions looks like one on real hardware. Together with the stream-ordering
/// checks of [`Device`](super::Device), every bug that would corrupt data on a GPU (reading a
/// buffer before the copy into it finished, racing two streams on one buffer) is an error here.
///
/// The simulated accelerator. See [`SimBackend`].
#[derive(Debug)]
pub struct SimBackend {
    shared: Arc<Shared>,
    link: Option<LinkModel>,
    timing_only: bool,
}

/// The threads `TIDEMEM_SIM_THREADS` gives the simulated device's CPU kernels (`None` when
/// unset: every core); a value that is not a count of at least 1 is an error, reported when a
/// simulated device is made.
pub(crate) fn sim_threads() -> Result<Option<usize>> {
    parse_sim_threads(std::env::var("TIDEMEM_SIM_THREADS").ok())
}

/// [`sim_threads`] of the variable's value.
fn parse_sim_threads(value: Option<String>) -> Result<Option<usize>> {
    match value {
        None => Ok(None),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(Error::Parse {
                what: "TIDEMEM_SIM_THREADS",
                input: v,
                expected: "a thread count of at least 1".into(),
            }),
        },
    }
}

impl SimBackend {
    /// A simulated device with the given configuration; refused when `TIDEMEM_SIM_THREADS` is
    /// set to something other than a thread count.
    pub fn new(config: SimConfig) -> Result<Self> {
        if let Some(link) = &config.link {
            link.validate()?;
        }
        sim_threads()?;
        Ok(SimBackend {
            shared: Arc::new(Shared {
                id: DeviceId::new(BackendKind::Sim, config.ordinal),
                capacity: config.capacity,
                used: AtomicUsize::new(0),
                spare: Mutex::new(Spare::default()),
            }),
            link: config.link,
            timing_only: config.timing_only,
        })
    }

    /// Bytes currently allocated: the buffers the user holds (a dropped buffer's bytes return at
    /// once, in stream order, even while queued work still reads it).
    pub(crate) fn used(&self) -> usize {
        self.shared.used.load(Ordering::Acquire)
    }
}

fn mem(raw: &RawBuffer) -> Result<Arc<SimMem>> {
    raw.downcast_ref::<SimHandle>()
        .map(|h| h.0.clone())
        .ok_or_else(|| Error::Sim("buffer was not allocated by a simulated device".into()))
}

fn event(raw: &RawEvent) -> Result<&Arc<SimEvent>> {
    raw.downcast_ref::<Arc<SimEvent>>()
        .ok_or_else(|| Error::Sim("event was not created by a simulated device".into()))
}

fn stream(raw: &RawStream) -> Result<&SimStream> {
    raw.downcast_ref::<SimStream>()
        .ok_or_else(|| Error::Sim("stream was not created by a simulated device".into()))
}

impl SimStream {
    fn send(&self, task: Task) -> Result<()> {
        self.tx
            .send(task)
            .map_err(|_| Error::Sim("copy engine thread has stopped".into()))
    }
}

impl Backend for SimBackend {
    fn id(&self) -> DeviceId {
        self.shared.id
    }

    fn name(&self) -> String {
        let cap = self.shared.capacity;
        if self.timing_only {
            format!("simulated device ({cap} bytes, timing only: results meaningless)")
        } else {
            format!("simulated device ({cap} bytes)")
        }
    }

    fn timing_only(&self) -> bool {
        self.timing_only
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let used = self.used();
        Ok(MemInfo {
            free: self.shared.capacity.saturating_sub(used),
            total: self.shared.capacity,
        })
    }

    fn alloc(&self, bytes: usize) -> Result<RawBuffer> {
        let cap = self.shared.capacity;
        let oom = |used: usize| Error::OutOfMemory {
            device: self.shared.id,
            requested: bytes,
            free: cap.saturating_sub(used),
            capacity: cap,
        };
        // Reserve capacity first, so concurrent allocations can never over-commit.
        self.shared
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(bytes).filter(|&n| n <= cap)
            })
            .map_err(oom)?;
        let ptr = if bytes == 0 {
            // Never dereferenced; aligned like every allocation, so an empty operand is aligned
            // for any element type.
            NonNull::new(std::ptr::without_provenance_mut::<u8>(SIM_ALIGN))
                .unwrap_or(NonNull::dangling())
        } else {
            let layout = Layout::from_size_align(bytes, SIM_ALIGN).map_err(|e| {
                self.shared.used.fetch_sub(bytes, Ordering::AcqRel);
                Error::Internal {
                    what: format!("the simulated device's layout of {bytes} bytes: {e}"),
                }
            })?;
            let reused = self.shared.spare.lock().take(bytes);
            if self.timing_only {
                // Zeros, left as they are: nothing ever writes a timing-only device's memory, so
                // reads see zeros (no overflow flag, no NaN) and the pages are touched only
                // where the host reads them.
                // SAFETY: non-zero size.
                let p =
                    reused.or_else(|| NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }));
                let Some(p) = p else {
                    self.shared.used.fetch_sub(bytes, Ordering::AcqRel);
                    return Err(Error::HostAlloc {
                        requested: bytes,
                        tier: "simulated device",
                        reason: "the system allocator returned null".into(),
                    });
                };
                return Ok(Box::new(SimHandle(Arc::new(SimMem {
                    ptr: p,
                    len: bytes,
                    shared: self.shared.clone(),
                }))));
            }
            // SAFETY: non-zero size.
            match reused.or_else(|| NonNull::new(unsafe { std::alloc::alloc(layout) })) {
                Some(p) => {
                    // Filled, so device memory never exposes uninitialised bytes; with 0xff
                    // (NaN as floats), not zeros, because a GPU's fresh memory is not zeroed
                    // either and code that reads what it never wrote must fail here too.
                    // SAFETY: `bytes` writable bytes were just allocated at `p`.
                    unsafe { std::ptr::write_bytes(p.as_ptr(), 0xff, bytes) };
                    p
                }
                None => {
                    self.shared.used.fetch_sub(bytes, Ordering::AcqRel);
                    return Err(Error::HostAlloc {
                        requested: bytes,
                        tier: "simulated device",
                        reason: "the system allocator returned null".into(),
                    });
                }
            }
        };
        Ok(Box::new(SimHandle(Arc::new(SimMem {
            ptr,
            len: bytes,
            shared: self.shared.clone(),
        }))))
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        HostBuffer::paged(bytes)
    }

    fn new_stream(&self) -> Result<RawStream> {
        let (tx, rx) = unbounded::<Task>();
        let link = self.link;
        let sticky: Sticky = Arc::default();
        let engine_sticky = sticky.clone();
        thread::Builder::new()
            .name(format!("tidemem-sim{}-copy", self.shared.id.uid))
            .spawn(move || {
                // Runs until every sender (the stream) is gone and the queue is drained. After
                // a twin fails, the stream runs no further work (as a CUDA context after a
                // kernel fault): events still complete, carrying the failure.
                while let Some(task) = next_task(&rx) {
                    let failed = engine_sticky.lock().clone();
                    match task {
                        Task::Copy(work) if failed.is_none() => {
                            if let Some(f) = run(work, link) {
                                *engine_sticky.lock() = Some(f);
                            }
                        }
                        Task::Copy(_) => {}
                        Task::Record(ev, generation) => ev.complete(generation, failed),
                        Task::Wait(ev, generation) => {
                            ev.wait_for(generation);
                            // Work ordered after a failure fails too.
                            if let (None, Some(f)) = (failed, ev.failure()) {
                                *engine_sticky.lock() = Some(f);
                            }
                        }
                    }
                }
            })
            .map_err(|e| Error::Sim(format!("cannot start a copy engine thread: {e}")))?;
        Ok(Box::new(SimStream { tx, sticky }))
    }

    fn new_event(&self) -> Result<RawEvent> {
        Ok(Box::new(Arc::new(SimEvent::default())))
    }

    unsafe fn enqueue(&self, s: &RawStream, op: Op<'_>) -> Result<()> {
        let work = match op {
            Op::HostToDevice {
                src,
                dst,
                dst_offset,
                len,
            } => Work::H2D {
                src: SendPtr(src as *mut u8),
                dst: mem(dst)?,
                off: dst_offset,
                len,
            },
            Op::DeviceToHost {
                src,
                src_offset,
                dst,
                len,
            } => Work::D2H {
                src: mem(src)?,
                off: src_offset,
                dst: SendPtr(dst),
                len,
            },
            Op::DeviceToDevice {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => Work::D2D {
                src: mem(src)?,
                soff: src_offset,
                dst: mem(dst)?,
                doff: dst_offset,
                len,
            },
            Op::Fill {
                dst,
                offset,
                len,
                value,
            } => Work::Fill {
                dst: mem(dst)?,
                off: offset,
                len,
                value,
            },
            Op::Launch {
                desc,
                operands,
                params,
            } => Work::Launch {
                desc,
                operands: operands
                    .iter()
                    .map(|o| match o {
                        Some(o) => Ok(Some((mem(o.buf)?, o.offset, o.len, o.dtype))),
                        None => Ok(None),
                    })
                    .collect::<Result<_>>()?,
                params: params.to_vec(),
            },
            Op::Foreign { .. } => {
                return Err(Error::Conflict {
                    what: "foreign work (NCCL)".into(),
                    with: "the simulated device, which has no device addresses".into(),
                })
            }
        };
        let s = stream(s)?;
        if self.timing_only {
            // checked and ordered, not run: the stream sees nothing to do
            drop(work);
            return Ok(());
        }
        s.send(Task::Copy(work))
    }

    fn record(&self, s: &RawStream, e: &RawEvent) -> Result<()> {
        let (s, e) = (stream(s)?, event(e)?);
        let generation = e.arm();
        s.send(Task::Record(e.clone(), generation))
    }

    fn wait(&self, s: &RawStream, e: &RawEvent) -> Result<()> {
        let (s, e) = (stream(s)?, event(e)?);
        if let Some(f) = s.sticky.lock().as_ref() {
            return Err(f.error());
        }
        s.send(Task::Wait(e.clone(), e.target()))
    }

    fn sync_event(&self, e: &RawEvent) -> Result<()> {
        let e = event(e)?;
        e.wait_for(e.target());
        e.failure().map_or(Ok(()), |f| Err(f.error()))
    }

    fn query_event(&self, e: &RawEvent) -> Result<bool> {
        let e = event(e)?;
        let done = {
            let s = e.state.lock();
            s.1 >= s.0
        };
        match e.failure() {
            Some(f) if done => Err(f.error()),
            _ => Ok(done),
        }
    }

    fn elapsed(&self, start: &RawEvent, end: &RawEvent) -> Result<Option<f64>> {
        let (a, b) = (*event(start)?.stamp.lock(), *event(end)?.stamp.lock());
        Ok(match (a, b) {
            (Some(a), Some(b)) => Some(b.saturating_duration_since(a).as_secs_f64()),
            _ => None,
        })
    }

    fn sync_stream(&self, s: &RawStream) -> Result<()> {
        let s = stream(s)?;
        let e = Arc::new(SimEvent::default());
        let generation = e.arm();
        s.send(Task::Record(e.clone(), generation))?;
        e.wait_for(generation);
        match s.sticky.lock().as_ref() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_threads_are_a_count_or_an_error() {
        assert_eq!(parse_sim_threads(None).unwrap(), None);
        assert_eq!(parse_sim_threads(Some(" 3 ".into())).unwrap(), Some(3));
        for bad in ["0", "garbage", "-1", ""] {
            let e = parse_sim_threads(Some(bad.into())).unwrap_err();
            assert!(e.to_string().contains("TIDEMEM_SIM_THREADS"), "{bad}: {e}");
        }
    }
    use crate::device::{Device, HostBuffer};

    /// A timing-only device checks, orders and counts work but runs none of it: memory stays
    /// zero, events complete, bad operands are still refused, and it says so.
    #[test]
    fn a_timing_only_device_runs_nothing_and_says_so() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 20).timing_only()).unwrap();
        assert!(dev.timing_only() && dev.name().contains("results meaningless"));
        assert!(!Device::sim(SimConfig::with_capacity(64))
            .unwrap()
            .timing_only());
        let s = dev.new_stream().unwrap();
        let a = dev.alloc(4096).unwrap();
        dev.copy_h2d(&s, HostBuffer::from_slice(&[7u8; 4096]).unwrap(), &a)
            .unwrap()
            .wait()
            .unwrap();
        dev.memset(&s, &a, 9).unwrap();
        assert_eq!(dev.download(&s, &a).unwrap(), vec![0u8; 4096]);
        let e = dev.new_event().unwrap();
        dev.record(&s, &e).unwrap();
        dev.sync_event(&e).unwrap();
        assert!(dev.event_done(&e).unwrap());
        let small = dev.alloc(16).unwrap();
        assert!(
            dev.copy_d2d(&s, &a, &small).is_err(),
            "sizes are still checked"
        );
        assert!(dev.alloc(2 << 20).is_err(), "the capacity still holds");
        let st = dev.stats();
        assert_eq!((st.h2d_copies, st.d2h_copies), (1, 1), "and counted");
    }

    /// A freed allocation comes back for the next of its size, filled with 0xff again (never
    /// the bytes it held), and the capacity counts only live allocations.
    #[test]
    fn freed_memory_is_reused_and_refilled() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
        let s = dev.new_stream().unwrap();
        let a = dev.alloc(4096).unwrap();
        dev.copy_h2d(&s, HostBuffer::from_slice(&[7u8; 4096]).unwrap(), &a)
            .unwrap()
            .wait()
            .unwrap();
        drop(a);
        dev.sync_stream(&s).unwrap();
        assert_eq!(dev.mem_info().unwrap().free, 1 << 20, "nothing live");
        let b = dev.alloc(4096).unwrap();
        let back = dev.download(&s, &b).unwrap();
        assert!(
            back.iter().all(|&x| x == 0xff),
            "refilled, not the old bytes"
        );
        assert_eq!(dev.mem_info().unwrap().free, (1 << 20) - 4096);
    }
}
