//! The simulated accelerator: a device with a hard capacity whose memory is taken from the host,
//! and whose streams are copy-engine threads that execute operations asynchronously, in order.
//!
//! Events complete when the work before them does, exactly as on a GPU; an optional
//! [`LinkModel`] stretches each transfer to the time a PCIe link would take, so a timeline of
//! prefetches and evictions looks like one on real hardware. Together with the stream-ordering
//! checks of [`Device`](super::Device), every bug that would corrupt data on a GPU (reading a
//! buffer before the copy into it finished, racing two streams on one buffer) is an error here.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};

use super::{
    Backend, BackendKind, DeviceId, HostBuffer, MemInfo, Op, RawBuffer, RawEvent, RawStream,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::embedding::EmbeddingKernel;
use crate::optim::adam::AdamScalars;
use crate::optim::cpu_adam::{grad_stats_raw, RawKind, RawStep};
use crate::optim::CpuAdam;

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
                return Err(Error::InvalidArgument(format!(
                    "the simulated link's {what} must be finite and positive, got {r}"
                )));
            }
        }
        if self.latency > Duration::from_secs(3600) {
            return Err(Error::InvalidArgument(format!(
                "the simulated link's latency of {:?} is over an hour",
                self.latency
            )));
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
    pub ordinal: usize,
    /// Optional transfer-time model; `None` copies as fast as the host can.
    pub link: Option<LinkModel>,
}

impl SimConfig {
    /// A device of `capacity` bytes with no link model.
    pub fn with_capacity(capacity: usize) -> Self {
        SimConfig {
            capacity,
            ordinal: 0,
            link: None,
        }
    }

    /// The same configuration with a link model.
    pub fn link(mut self, link: LinkModel) -> Self {
        self.link = Some(link);
        self
    }
}

#[derive(Debug)]
struct Shared {
    id: DeviceId,
    capacity: usize,
    used: AtomicUsize,
}

/// One simulated allocation. Freed (and its bytes returned to the capacity) when the last
/// reference goes: the user's buffer, or an operation still queued on a stream.
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

impl Drop for SimMem {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `SimBackend::alloc` with this exact layout.
            unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, SIM_ALIGN),
                )
            };
        }
        self.shared.used.fetch_sub(self.len, Ordering::AcqRel);
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
}

impl SimEvent {
    fn arm(&self) -> u64 {
        let mut s = self.state.lock();
        s.0 += 1;
        s.0
    }
    fn target(&self) -> u64 {
        self.state.lock().0
    }
    fn complete(&self, generation: u64) {
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
    Cast {
        src: Arc<SimMem>,
        soff: usize,
        from: DType,
        dst: Arc<SimMem>,
        doff: usize,
        to: DType,
        count: usize,
    },
    Adam {
        p: (Arc<SimMem>, usize),
        m: (Arc<SimMem>, usize),
        v: (Arc<SimMem>, usize),
        g: (Arc<SimMem>, usize, DType),
        copy: Option<(Arc<SimMem>, usize, DType)>,
        count: usize,
        scalars: AdamScalars,
    },
    GradStats {
        src: Arc<SimMem>,
        soff: usize,
        dtype: DType,
        count: usize,
        out: Arc<SimMem>,
        ooff: usize,
    },
    Embedding {
        kernel: EmbeddingKernel,
        reads: Vec<(Arc<SimMem>, usize, usize)>,
        write: (Arc<SimMem>, usize, usize),
    },
}

struct SendPtr(*mut u8);
// SAFETY: the pointer targets host memory held by a `Pending` until this work completes
// (contract of `Backend::enqueue`).
unsafe impl Send for SendPtr {}

struct SimStream {
    tx: Sender<Task>,
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

fn run(work: Work, link: Option<LinkModel>) {
    let start = Instant::now();
    // SAFETY (all arms): ranges were bounds-checked by `Device`, host pointers are valid for
    // `len` bytes until completion (enqueue contract), and the ordering checks guarantee no
    // concurrent conflicting access to device memory.
    let model = match work {
        Work::H2D { src, dst, off, len } => {
            unsafe { std::ptr::copy_nonoverlapping(src.0, dst.at(off), len) };
            link.map(|l| l.duration(len, l.h2d_gbps))
        }
        Work::D2H { src, off, dst, len } => {
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
            unsafe { std::ptr::copy(src.at(soff), dst.at(doff), len) };
            link.map(|l| l.duration(len, l.d2d_gbps))
        }
        Work::Fill {
            dst,
            off,
            len,
            value,
        } => {
            unsafe { std::ptr::write_bytes(dst.at(off), value, len) };
            None
        }
        Work::Cast {
            src,
            soff,
            from,
            dst,
            doff,
            to,
            count,
        } => {
            // Non-overlapping ranges (checked by `Device`), so the two slices do not alias.
            let s = unsafe { std::slice::from_raw_parts(src.at(soff), count * from.size()) };
            let d = unsafe { std::slice::from_raw_parts_mut(dst.at(doff), count * to.size()) };
            // Lengths and types were validated by `Device::cast`.
            let _ = crate::ops::cast::cast_bytes(s, from, d, to);
            None
        }
        Work::Adam {
            p,
            m,
            v,
            g,
            copy,
            count,
            scalars,
        } => {
            let raw = RawStep {
                n: count,
                p: p.0.at(p.1).cast(),
                m: m.0.at(m.1).cast(),
                v: v.0.at(v.1).cast(),
                grad: (RawKind::of(g.2), g.0.at(g.1) as *const u8),
                copy: copy.as_ref().map(|c| (RawKind::of(c.2), c.0.at(c.1))),
            };
            // In range and aligned, the copy either equal to the gradient or disjoint from every
            // operand (checked by `Device::adam`); the same kernel as the host path, so a step
            // gives the same bits on either side.
            unsafe { CpuAdam::new().run(&scalars, raw) };
            None
        }
        Work::GradStats {
            src,
            soff,
            dtype,
            count,
            out,
            ooff,
        } => {
            let st = unsafe { grad_stats_raw(RawKind::of(dtype), src.at(soff), count) };
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&st.sum_sq.to_le_bytes());
            b[8..].copy_from_slice(&(st.nonfinite as u8 as f64).to_le_bytes());
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), out.at(ooff), 16) };
            None
        }
        Work::Embedding {
            kernel,
            reads,
            write,
        } => {
            // The written range overlaps no read range (checked by `Device`), so the mutable
            // slice aliases none of the shared ones; all are in bounds and 4-byte aligned.
            let r: Vec<&[u8]> = reads
                .iter()
                .map(|(m, off, len)| unsafe { std::slice::from_raw_parts(m.at(*off), *len) })
                .collect();
            let w = unsafe { std::slice::from_raw_parts_mut(write.0.at(write.1), write.2) };
            // Shapes were validated by `Device`; index values out of range are skipped.
            let _ = crate::ops::embedding::execute(&kernel, &r, w);
            None
        }
    };
    if let Some(t) = model {
        let left = t.saturating_sub(start.elapsed());
        if !left.is_zero() {
            thread::sleep(left);
        }
    }
}

/// The simulated accelerator. See the [module docs](self).
#[derive(Debug)]
pub struct SimBackend {
    shared: Arc<Shared>,
    link: Option<LinkModel>,
}

impl SimBackend {
    /// A simulated device with the given configuration.
    pub fn new(config: SimConfig) -> Result<Self> {
        if let Some(link) = &config.link {
            link.validate()?;
        }
        Ok(SimBackend {
            shared: Arc::new(Shared {
                id: DeviceId::new(BackendKind::Sim, config.ordinal),
                capacity: config.capacity,
                used: AtomicUsize::new(0),
            }),
            link: config.link,
        })
    }

    /// Bytes currently allocated (including buffers dropped by the user but still referenced by
    /// queued work).
    pub fn used(&self) -> usize {
        self.shared.used.load(Ordering::Acquire)
    }
}

fn mem(raw: &RawBuffer) -> Result<Arc<SimMem>> {
    raw.downcast_ref::<Arc<SimMem>>()
        .cloned()
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
        format!("simulated device ({} bytes)", self.shared.capacity)
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
            NonNull::dangling()
        } else {
            let layout = Layout::from_size_align(bytes, SIM_ALIGN).map_err(|e| {
                self.shared.used.fetch_sub(bytes, Ordering::AcqRel);
                Error::InvalidArgument(e.to_string())
            })?;
            // SAFETY: non-zero size.
            match NonNull::new(unsafe { std::alloc::alloc(layout) }) {
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
        Ok(Box::new(Arc::new(SimMem {
            ptr,
            len: bytes,
            shared: self.shared.clone(),
        })))
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        HostBuffer::paged(bytes)
    }

    fn new_stream(&self) -> Result<RawStream> {
        let (tx, rx) = unbounded::<Task>();
        let link = self.link;
        thread::Builder::new()
            .name(format!("tidemem-sim{}-copy", self.shared.id.uid))
            .spawn(move || {
                // Runs until every sender (the stream) is gone and the queue is drained.
                while let Some(task) = next_task(&rx) {
                    match task {
                        Task::Copy(work) => run(work, link),
                        Task::Record(ev, generation) => ev.complete(generation),
                        Task::Wait(ev, generation) => ev.wait_for(generation),
                    }
                }
            })
            .map_err(|e| Error::Sim(format!("cannot start a copy engine thread: {e}")))?;
        Ok(Box::new(SimStream { tx }))
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
            Op::Cast {
                src,
                src_offset,
                from,
                dst,
                dst_offset,
                to,
                count,
            } => {
                crate::ops::cast::check_supported(from, to)?;
                Work::Cast {
                    src: mem(src)?,
                    soff: src_offset,
                    from,
                    dst: mem(dst)?,
                    doff: dst_offset,
                    to,
                    count,
                }
            }
            Op::Adam {
                params,
                momentum,
                variance,
                grad,
                copy,
                count,
                scalars,
            } => Work::Adam {
                p: (mem(params.0)?, params.1),
                m: (mem(momentum.0)?, momentum.1),
                v: (mem(variance.0)?, variance.1),
                g: (mem(grad.0)?, grad.1, grad.2),
                copy: match copy {
                    Some(c) => Some((mem(c.0)?, c.1, c.2)),
                    None => None,
                },
                count,
                scalars,
            },
            Op::GradStats {
                src,
                src_offset,
                dtype,
                count,
                out,
                out_offset,
            } => Work::GradStats {
                src: mem(src)?,
                soff: src_offset,
                dtype,
                count,
                out: mem(out)?,
                ooff: out_offset,
            },
            Op::Embedding {
                kernel,
                reads,
                write,
            } => Work::Embedding {
                kernel,
                reads: reads
                    .iter()
                    .map(|&(b, off, len)| Ok((mem(b)?, off, len)))
                    .collect::<Result<_>>()?,
                write: (mem(write.0)?, write.1, write.2),
            },
            Op::Foreign { .. } => {
                return Err(Error::InvalidArgument(
                    "the simulated device has no device addresses for foreign work (NCCL)".into(),
                ))
            }
        };
        stream(s)?.send(Task::Copy(work))
    }

    fn record(&self, s: &RawStream, e: &RawEvent) -> Result<()> {
        let (s, e) = (stream(s)?, event(e)?);
        let generation = e.arm();
        s.send(Task::Record(e.clone(), generation))
    }

    fn wait(&self, s: &RawStream, e: &RawEvent) -> Result<()> {
        let (s, e) = (stream(s)?, event(e)?);
        s.send(Task::Wait(e.clone(), e.target()))
    }

    fn sync_event(&self, e: &RawEvent) -> Result<()> {
        let e = event(e)?;
        e.wait_for(e.target());
        Ok(())
    }

    fn query_event(&self, e: &RawEvent) -> Result<bool> {
        let e = event(e)?;
        let s = e.state.lock();
        Ok(s.1 >= s.0)
    }

    fn sync_stream(&self, s: &RawStream) -> Result<()> {
        let e = Arc::new(SimEvent::default());
        let generation = e.arm();
        stream(s)?.send(Task::Record(e.clone(), generation))?;
        e.wait_for(generation);
        Ok(())
    }
}
