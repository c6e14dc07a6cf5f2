//! The device layer: where bytes live and how they move.
//!
//! * [`Backend`] is the interface a device implements (allocate, enqueue a copy or a kernel on a
//!   stream, record and wait on events). Two implementations ship: [`SimBackend`], a simulated
//!   accelerator with a hard capacity whose copy engines are host threads, and [`CudaBackend`],
//!   a CUDA GPU through cudarc.
//! * [`Device`] is the safe API a user holds. It checks every argument (ownership, bounds,
//!   sizes), enforces stream ordering of every access to a device buffer (see [`order`]: an
//!   unordered access is an error, on both backends), counts the bytes moved, and hands
//!   asynchronous copies back as [`Pending`] values, so a host buffer can never be read before the
//!   copy into it completes.
//! * [`HostBuffer`] and [`FileStore`] are the host tiers; [`CachingAllocator`] serves non-model
//!   data and reports the current and peak bytes the tide tracer reads.
//!
//! ```
//! use tidemem::device::{Device, HostBuffer, SimConfig};
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(64 << 20))?;
//! let stream = dev.new_stream()?;
//! let buf = dev.alloc(1024)?;
//! let up = dev.copy_h2d(&stream, HostBuffer::from_slice(&[7u8; 1024])?, &buf)?;
//! let _src = up.wait()?; // the host buffer comes back when the copy is done
//! let back = dev.copy_d2h(&stream, &buf, HostBuffer::paged(1024)?)?.wait()?;
//! assert!(back.iter().all(|&b| b == 7));
//! # Ok(()) }
//! ```

pub mod cuda;
pub mod host;
pub mod launch;
pub mod order;
pub mod pool;
pub mod sim;

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

pub use cuda::{
    device_count as cuda_device_count, driver_present as cuda_driver_present, CudaBackend,
};
pub use host::{FileStore, HostBuffer, HostKind, HOST_ALIGN};
pub use launch::{
    CudaSide, Grid, HostOperand, KernelDesc, LaunchInfo, LibraryCall, Mode, OperandInfo,
    OperandSpec, ParamLayout, TwinArgs,
};
pub use pool::{Block, CachingAllocator, PoolStats, Reclaim};
pub use sim::{LinkModel, SimBackend, SimConfig};

pub use crate::device_id::{BackendKind, DeviceId};
use crate::dtype::DType;
use crate::error::{Error, Result};
use order::{Access, AccessRecord, Clock, Clocks};

/// Free and total device memory in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes free.
    pub free: usize,
    /// Total bytes.
    pub total: usize,
}

/// A backend's handle to a device allocation.
pub type RawBuffer = Box<dyn Any + Send + Sync>;
/// A backend's handle to a stream.
pub type RawStream = Box<dyn Any + Send + Sync>;
/// A backend's handle to an event.
pub type RawEvent = Box<dyn Any + Send + Sync>;

/// One stream-ordered operation, already validated by [`Device`]: ranges are in bounds, lengths
/// match, and the access is ordered after every conflicting access on other streams.
#[derive(Debug)]
pub enum Op<'a> {
    /// Copy `len` bytes from host memory to `dst[dst_offset..]`.
    HostToDevice {
        /// Host source.
        src: *const u8,
        /// Device destination.
        dst: &'a RawBuffer,
        /// Byte offset in `dst`.
        dst_offset: usize,
        /// Bytes to copy.
        len: usize,
    },
    /// Copy `len` bytes from `src[src_offset..]` to host memory.
    DeviceToHost {
        /// Device source.
        src: &'a RawBuffer,
        /// Byte offset in `src`.
        src_offset: usize,
        /// Host destination.
        dst: *mut u8,
        /// Bytes to copy.
        len: usize,
    },
    /// Copy `len` bytes between device ranges (they may overlap when in the same buffer).
    DeviceToDevice {
        /// Source buffer.
        src: &'a RawBuffer,
        /// Byte offset in `src`.
        src_offset: usize,
        /// Destination buffer.
        dst: &'a RawBuffer,
        /// Byte offset in `dst`.
        dst_offset: usize,
        /// Bytes to copy.
        len: usize,
    },
    /// Set `len` bytes at `dst[offset..]` to `value`.
    Fill {
        /// Destination buffer.
        dst: &'a RawBuffer,
        /// Byte offset.
        offset: usize,
        /// Bytes to set.
        len: usize,
        /// Byte value.
        value: u8,
    },
    /// A kernel of an op (see [`launch`]): operands already validated against the descriptor.
    Launch {
        /// The op.
        desc: &'static KernelDesc,
        /// One entry per operand of the signature (`None`: an optional operand left out).
        operands: &'a [Option<RawOperand<'a>>],
        /// The parameter struct's bytes.
        params: &'a [u8],
    },
    /// Work of a library that takes raw device addresses on the backend's native stream (NCCL
    /// collectives): `run` gets the address of every operand (base + offset, in order) and the
    /// stream handle. Backends without device addresses (the simulated device) refuse it.
    Foreign {
        /// Buffer, byte offset, and whether the work writes it.
        operands: &'a [(&'a RawBuffer, usize, bool)],
        /// The work to enqueue.
        run: ForeignCall<'a>,
    },
}

/// The callback of an [`Op::Foreign`]: device addresses of the operands and the native stream
/// handle (a `CUstream` on CUDA).
pub struct ForeignCall<'a>(pub &'a mut dyn FnMut(&[u64], *mut std::ffi::c_void) -> Result<()>);

impl fmt::Debug for ForeignCall<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ForeignCall")
    }
}

/// One operand of an [`Op::Launch`]: a validated byte range of a buffer and its element type.
#[derive(Debug, Clone, Copy)]
pub struct RawOperand<'a> {
    /// The buffer.
    pub buf: &'a RawBuffer,
    /// Byte offset in the buffer.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
}

/// Element types and lengths of a launch's operands, for shape checks and plans.
pub fn operand_infos(ops: &[Option<RawOperand<'_>>]) -> Vec<Option<OperandInfo>> {
    ops.iter()
        .map(|o| {
            o.map(|o| OperandInfo {
                dtype: o.dtype,
                len: o.len / o.dtype.size(),
            })
        })
        .collect()
}

/// The interface a device implements. Users hold a [`Device`], which validates arguments and
/// orders accesses before calling into the backend; a backend only executes.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Identity of this device.
    fn id(&self) -> DeviceId;
    /// Human-readable name (e.g. the GPU's product name).
    fn name(&self) -> String;
    /// Free and total device memory.
    fn mem_info(&self) -> Result<MemInfo>;
    /// Allocates `bytes` of device memory; [`Error::OutOfMemory`] when it does not fit.
    fn alloc(&self, bytes: usize) -> Result<RawBuffer>;
    /// Allocates host memory suited to this device's copies (pinned where the backend can pin).
    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer>;
    /// Creates a stream.
    fn new_stream(&self) -> Result<RawStream>;
    /// Creates an event.
    fn new_event(&self) -> Result<RawEvent>;
    /// Enqueues `op` on `stream`.
    ///
    /// # Safety
    /// Host pointers in `op` must stay valid, and must not be accessed by anything else, until an
    /// event recorded on `stream` after this call completes.
    unsafe fn enqueue(&self, stream: &RawStream, op: Op<'_>) -> Result<()>;
    /// Records `event` on `stream`: it completes when all work enqueued so far does.
    fn record(&self, stream: &RawStream, event: &RawEvent) -> Result<()>;
    /// Makes `stream` wait for the latest recording of `event` before running later work.
    fn wait(&self, stream: &RawStream, event: &RawEvent) -> Result<()>;
    /// Blocks the calling thread until the latest recording of `event` completes.
    fn sync_event(&self, event: &RawEvent) -> Result<()>;
    /// Whether the latest recording of `event` has completed.
    fn query_event(&self, event: &RawEvent) -> Result<bool>;
    /// Blocks until all work on `stream` completes.
    fn sync_stream(&self, stream: &RawStream) -> Result<()>;
    /// Makes this device current on the calling thread, for libraries that act on the current
    /// device (NCCL). Backends without such a notion do nothing.
    fn bind_to_thread(&self) -> Result<()> {
        Ok(())
    }
}

/// Bytes and operations moved by a device since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Host→device bytes.
    pub h2d_bytes: u64,
    /// Device→host bytes.
    pub d2h_bytes: u64,
    /// Device→device bytes.
    pub d2d_bytes: u64,
    /// Host→device copies.
    pub h2d_copies: u64,
    /// Device→host copies.
    pub d2h_copies: u64,
    /// Device→device copies.
    pub d2d_copies: u64,
}

#[derive(Default)]
struct Counters {
    h2d_bytes: AtomicU64,
    d2h_bytes: AtomicU64,
    d2d_bytes: AtomicU64,
    h2d_copies: AtomicU64,
    d2h_copies: AtomicU64,
    d2d_copies: AtomicU64,
}

struct Inner {
    backend: Box<dyn Backend>,
    id: DeviceId,
    clocks: Mutex<Clocks>,
    counters: Counters,
    next_buffer: AtomicU64,
}

/// A device: the safe API over a [`Backend`]. Cheap to clone (it is an `Arc`).
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.inner.id)
            .finish()
    }
}

/// A region of device memory.
pub struct DeviceBuffer {
    raw: RawBuffer,
    len: usize,
    device: DeviceId,
    id: u64,
    access: Mutex<AccessRecord>,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("device", &self.device)
            .finish()
    }
}

impl DeviceBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device that owns this buffer.
    pub fn device(&self) -> DeviceId {
        self.device
    }
    /// A number unique among this device's buffers (used in error messages).
    pub fn id(&self) -> u64 {
        self.id
    }
    /// A view of `len` bytes starting at `offset`.
    pub fn view(&self, offset: usize, len: usize) -> Result<DeviceView<'_>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                buffer_len: self.len,
            });
        }
        Ok(DeviceView {
            buf: self,
            offset,
            len,
        })
    }
    /// The backend's handle (for backend implementors and kernels).
    pub fn raw(&self) -> &RawBuffer {
        &self.raw
    }
}

/// A byte range of a [`DeviceBuffer`]; `&DeviceBuffer` converts to a view of the whole buffer.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a> {
    buf: &'a DeviceBuffer,
    offset: usize,
    len: usize,
}

impl<'a> DeviceView<'a> {
    /// The underlying buffer.
    pub fn buffer(&self) -> &'a DeviceBuffer {
        self.buf
    }
    /// Offset in bytes within the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether the two views share at least one byte (same buffer, intersecting ranges; an
    /// empty view overlaps nothing).
    pub fn overlaps(&self, other: &DeviceView<'_>) -> bool {
        std::ptr::eq(self.buf, other.buf)
            && self.len > 0
            && other.len > 0
            && self.offset < other.offset + other.len
            && other.offset < self.offset + self.len
    }
    /// The sub-view of `len` bytes at `offset` within this view.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceView<'a>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                buffer_len: self.len,
            });
        }
        Ok(DeviceView {
            buf: self.buf,
            offset: self.offset + offset,
            len,
        })
    }
}

impl<'a> From<&'a DeviceBuffer> for DeviceView<'a> {
    fn from(buf: &'a DeviceBuffer) -> Self {
        DeviceView {
            buf,
            offset: 0,
            len: buf.len,
        }
    }
}

/// One operand of [`Device::launch`]: a device range and its element type.
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    /// The range.
    pub view: DeviceView<'a>,
    /// Its element type.
    pub dtype: DType,
}

impl<'a> Operand<'a> {
    /// An operand of `dtype` elements over `view`.
    pub fn new(view: impl Into<DeviceView<'a>>, dtype: DType) -> Self {
        Operand {
            view: view.into(),
            dtype,
        }
    }
}

/// An ordered queue of device work. Operations on one stream run in order; different streams
/// run concurrently and are ordered only through [`Event`]s or host synchronisation.
pub struct Stream {
    raw: RawStream,
    device: DeviceId,
    slot: usize,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("slot", &self.slot)
            .field("device", &self.device)
            .finish()
    }
}

impl Stream {
    /// Index of this stream on its device (as named in ordering errors).
    pub fn index(&self) -> usize {
        self.slot
    }
    /// The backend's handle.
    pub fn raw(&self) -> &RawStream {
        &self.raw
    }
}

/// A marker in a stream: completes when the work enqueued before it completes.
pub struct Event {
    raw: RawEvent,
    device: DeviceId,
    clock: Mutex<Clock>,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device)
            .finish()
    }
}

/// The result of an asynchronous copy: it holds the host buffer the copy reads or writes, and
/// gives it back only once the copy has completed. Dropping a `Pending` blocks until the copy is
/// done (if the device fails, the buffer is leaked rather than freed under a running copy).
#[must_use = "a pending copy must be waited on to get its host buffer back"]
pub struct Pending<T> {
    value: Option<T>,
    event: RawEvent,
    clock: Clock,
    device: Device,
}

impl<T> fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("device", &self.device.id())
            .finish()
    }
}

impl<T> Pending<T> {
    /// Whether the copy has completed (then [`Pending::wait`] does not block).
    pub fn is_ready(&self) -> Result<bool> {
        self.device.inner.backend.query_event(&self.event)
    }

    /// Blocks until the copy completes and returns the host buffer.
    pub fn wait(mut self) -> Result<T> {
        match self.device.inner.backend.sync_event(&self.event) {
            Ok(()) => {
                self.device.inner.clocks.lock().observe(&self.clock);
                Ok(self.value.take().expect("value present until waited"))
            }
            Err(e) => {
                // The copy may still touch the buffer: leak it rather than free it.
                std::mem::forget(self.value.take());
                Err(e)
            }
        }
    }
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        if let Some(v) = self.value.take() {
            match self.device.inner.backend.sync_event(&self.event) {
                Ok(()) => {
                    self.device.inner.clocks.lock().observe(&self.clock);
                    drop(v)
                }
                Err(_) => std::mem::forget(v),
            }
        }
    }
}

pub use crate::units::fmt_bytes;

impl Device {
    /// Wraps a backend.
    pub fn new(backend: Box<dyn Backend>) -> Self {
        let id = backend.id();
        Device {
            inner: Arc::new(Inner {
                backend,
                id,
                clocks: Mutex::new(Clocks::default()),
                counters: Counters::default(),
                next_buffer: AtomicU64::new(1),
            }),
        }
    }

    /// A simulated device.
    pub fn sim(config: SimConfig) -> Result<Self> {
        Ok(Self::new(Box::new(SimBackend::new(config)?)))
    }

    /// CUDA device `ordinal`; [`Error::BackendUnavailable`] when there is no driver or GPU.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Ok(Self::new(Box::new(CudaBackend::new(ordinal)?)))
    }

    /// The default device: chosen by `TIDEMEM_BACKEND` (`sim` or `cuda`) if set, otherwise CUDA
    /// device 0 when a GPU is present, else a simulated device of `TIDEMEM_SIM_CAPACITY` bytes
    /// (e.g. `2GiB`; default 1 GiB).
    pub fn default_device() -> Result<Self> {
        let choice = std::env::var("TIDEMEM_BACKEND").unwrap_or_default();
        let sim = || -> Result<Self> {
            let capacity = match std::env::var("TIDEMEM_SIM_CAPACITY") {
                Ok(s) => crate::units::parse_bytes(&s)?,
                Err(_) => 1 << 30,
            };
            Self::sim(SimConfig::with_capacity(capacity))
        };
        match choice.to_ascii_lowercase().as_str() {
            "sim" => sim(),
            "cuda" => Self::cuda(0),
            "" => Self::cuda(0).or_else(|_| sim()),
            other => Err(Error::InvalidArgument(format!(
                "TIDEMEM_BACKEND={other}: expected `sim` or `cuda`"
            ))),
        }
    }

    /// This device's identity.
    pub fn id(&self) -> DeviceId {
        self.inner.id
    }

    /// The backend kind.
    pub fn kind(&self) -> BackendKind {
        self.inner.id.kind
    }

    /// Human-readable name.
    pub fn name(&self) -> String {
        self.inner.backend.name()
    }

    /// The backend (for kernels and backend-specific code).
    pub fn backend(&self) -> &dyn Backend {
        &*self.inner.backend
    }

    /// Free and total device memory.
    pub fn mem_info(&self) -> Result<MemInfo> {
        self.inner.backend.mem_info()
    }

    /// Bytes and copies moved so far.
    pub fn stats(&self) -> TransferStats {
        let c = &self.inner.counters;
        TransferStats {
            h2d_bytes: c.h2d_bytes.load(Ordering::Relaxed),
            d2h_bytes: c.d2h_bytes.load(Ordering::Relaxed),
            d2d_bytes: c.d2d_bytes.load(Ordering::Relaxed),
            h2d_copies: c.h2d_copies.load(Ordering::Relaxed),
            d2h_copies: c.d2h_copies.load(Ordering::Relaxed),
            d2d_copies: c.d2d_copies.load(Ordering::Relaxed),
        }
    }

    /// Allocates `bytes` of device memory (contents unspecified until written; the simulated
    /// device fills it with `0xff` bytes, so reading memory never written shows there too).
    /// Freed when the buffer is dropped, once work already enqueued on it completes.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let raw = self.inner.backend.alloc(bytes)?;
        Ok(DeviceBuffer {
            raw,
            len: bytes,
            device: self.inner.id,
            id: self.inner.next_buffer.fetch_add(1, Ordering::Relaxed),
            access: Mutex::new(AccessRecord::default()),
        })
    }

    /// Allocates host memory suited to this device's copies: pinned on CUDA, paged on Sim.
    pub fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        self.inner.backend.alloc_host(bytes)
    }

    /// Creates a stream.
    pub fn new_stream(&self) -> Result<Stream> {
        let raw = self.inner.backend.new_stream()?;
        let slot = self.inner.clocks.lock().add_stream();
        Ok(Stream {
            raw,
            device: self.inner.id,
            slot,
        })
    }

    /// Creates an event (complete until first recorded).
    pub fn new_event(&self) -> Result<Event> {
        Ok(Event {
            raw: self.inner.backend.new_event()?,
            device: self.inner.id,
            clock: Mutex::new(Clock::new()),
        })
    }

    fn check(&self, what: &'static str, found: DeviceId) -> Result<()> {
        if found != self.inner.id {
            return Err(Error::WrongDevice {
                what,
                expected: self.inner.id,
                found,
            });
        }
        Ok(())
    }

    /// Stamps and enqueues an op touching `accesses` under the clock lock, so the stamp order
    /// equals the enqueue order.
    fn submit(
        &self,
        stream: &Stream,
        accesses: &[(&DeviceBuffer, Access)],
        op: Op<'_>,
    ) -> Result<Clock> {
        self.check("stream", stream.device)?;
        for (b, _) in accesses {
            self.check("buffer", b.device)?;
        }
        let mut clocks = self.inner.clocks.lock();
        // Lock each distinct buffer once (a buffer may be both read and written).
        let mut distinct: Vec<(&DeviceBuffer, Access)> = Vec::with_capacity(accesses.len());
        for &(b, a) in accesses {
            match distinct.iter_mut().find(|(d, _)| std::ptr::eq(*d, b)) {
                Some(d) if a == Access::Write => d.1 = Access::Write,
                Some(_) => {}
                None => distinct.push((b, a)),
            }
        }
        let mut guards: Vec<_> = distinct.iter().map(|(b, _)| b.access.lock()).collect();
        let mut recs: Vec<(&mut AccessRecord, u64, Access)> = guards
            .iter_mut()
            .zip(&distinct)
            .map(|(g, (b, a))| (&mut **g, b.id, *a))
            .collect();
        clocks.stamp(stream.slot, &mut recs)?;
        // SAFETY: callers pass host pointers owned by a `Pending` that outlives the copy (its
        // event is recorded right after, and it blocks on that event before releasing them).
        unsafe { self.inner.backend.enqueue(&stream.raw, op)? };
        Ok(clocks.snapshot(stream.slot))
    }

    /// Records a private event after the last op of `stream` for a `Pending`.
    fn pending<T>(&self, stream: &Stream, value: T, clock: Clock) -> Result<Pending<T>> {
        let event = match self
            .inner
            .backend
            .new_event()
            .and_then(|e| self.inner.backend.record(&stream.raw, &e).map(|_| e))
        {
            Ok(e) => e,
            Err(err) => {
                // Without an event the copy cannot be awaited: drain the stream before giving up
                // the host buffer, or leak it if even that fails.
                match self.inner.backend.sync_stream(&stream.raw) {
                    Ok(()) => drop(value),
                    Err(_) => std::mem::forget(value),
                }
                return Err(err);
            }
        };
        Ok(Pending {
            value: Some(value),
            event,
            clock,
            device: self.clone(),
        })
    }

    /// Copies all of `src` into `dst` asynchronously on `stream`. The host buffer comes back from
    /// [`Pending::wait`] once the copy is done.
    pub fn copy_h2d<'a>(
        &self,
        stream: &Stream,
        src: HostBuffer,
        dst: impl Into<DeviceView<'a>>,
    ) -> Result<Pending<HostBuffer>> {
        let dst = dst.into();
        if src.len() != dst.len {
            return Err(Error::SizeMismatch {
                src: src.len(),
                dst: dst.len,
            });
        }
        self.copy_h2d_part(stream, src, 0, dst)
    }

    /// Copies `dst.len()` bytes of `src` starting at `src_offset` into `dst` asynchronously on
    /// `stream`, for staging buffers filled only in part. The host buffer comes back from
    /// [`Pending::wait`] once the copy is done.
    pub fn copy_h2d_part<'a>(
        &self,
        stream: &Stream,
        src: HostBuffer,
        src_offset: usize,
        dst: impl Into<DeviceView<'a>>,
    ) -> Result<Pending<HostBuffer>> {
        let dst = dst.into();
        if src_offset
            .checked_add(dst.len)
            .is_none_or(|end| end > src.len())
        {
            return Err(Error::OutOfBounds {
                offset: src_offset,
                len: dst.len,
                buffer_len: src.len(),
            });
        }
        let op = Op::HostToDevice {
            // SAFETY: `src_offset + dst.len <= src.len()` was checked above.
            src: unsafe { src.as_ptr().add(src_offset) },
            dst: &dst.buf.raw,
            dst_offset: dst.offset,
            len: dst.len,
        };
        let clock = self.submit(stream, &[(dst.buf, Access::Write)], op)?;
        let c = &self.inner.counters;
        c.h2d_bytes.fetch_add(dst.len as u64, Ordering::Relaxed);
        c.h2d_copies.fetch_add(1, Ordering::Relaxed);
        self.pending(stream, src, clock)
    }

    /// Copies `src` into all of `dst` asynchronously on `stream`. The filled host buffer comes
    /// back from [`Pending::wait`]; it cannot be read before.
    pub fn copy_d2h<'a>(
        &self,
        stream: &Stream,
        src: impl Into<DeviceView<'a>>,
        dst: HostBuffer,
    ) -> Result<Pending<HostBuffer>> {
        let src = src.into();
        if src.len != dst.len() {
            return Err(Error::SizeMismatch {
                src: src.len,
                dst: dst.len(),
            });
        }
        self.copy_d2h_part(stream, src, dst, 0)
    }

    /// Copies all of `src` into `dst[dst_offset..dst_offset + src.len()]` asynchronously on
    /// `stream`. The host buffer comes back from [`Pending::wait`]; it cannot be read before.
    pub fn copy_d2h_part<'a>(
        &self,
        stream: &Stream,
        src: impl Into<DeviceView<'a>>,
        mut dst: HostBuffer,
        dst_offset: usize,
    ) -> Result<Pending<HostBuffer>> {
        let src = src.into();
        if dst_offset
            .checked_add(src.len)
            .is_none_or(|end| end > dst.len())
        {
            return Err(Error::OutOfBounds {
                offset: dst_offset,
                len: src.len,
                buffer_len: dst.len(),
            });
        }
        let op = Op::DeviceToHost {
            src: &src.buf.raw,
            src_offset: src.offset,
            // SAFETY: `dst_offset + src.len <= dst.len()` was checked above.
            dst: unsafe { dst.as_mut_ptr().add(dst_offset) },
            len: src.len,
        };
        let clock = self.submit(stream, &[(src.buf, Access::Read)], op)?;
        let c = &self.inner.counters;
        c.d2h_bytes.fetch_add(src.len as u64, Ordering::Relaxed);
        c.d2h_copies.fetch_add(1, Ordering::Relaxed);
        self.pending(stream, dst, clock)
    }

    /// Copies between device ranges of equal length on `stream` (overlap within one buffer is
    /// handled like `memmove`).
    pub fn copy_d2d<'a, 'b>(
        &self,
        stream: &Stream,
        src: impl Into<DeviceView<'a>>,
        dst: impl Into<DeviceView<'b>>,
    ) -> Result<()> {
        let (src, dst) = (src.into(), dst.into());
        if src.len != dst.len {
            return Err(Error::SizeMismatch {
                src: src.len,
                dst: dst.len,
            });
        }
        let op = Op::DeviceToDevice {
            src: &src.buf.raw,
            src_offset: src.offset,
            dst: &dst.buf.raw,
            dst_offset: dst.offset,
            len: src.len,
        };
        self.submit(
            stream,
            &[(src.buf, Access::Read), (dst.buf, Access::Write)],
            op,
        )?;
        let c = &self.inner.counters;
        c.d2d_bytes.fetch_add(src.len as u64, Ordering::Relaxed);
        c.d2d_copies.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Sets every byte of `dst` to `value` on `stream`.
    pub fn memset<'a>(
        &self,
        stream: &Stream,
        dst: impl Into<DeviceView<'a>>,
        value: u8,
    ) -> Result<()> {
        let dst = dst.into();
        let op = Op::Fill {
            dst: &dst.buf.raw,
            offset: dst.offset,
            len: dst.len,
            value,
        };
        self.submit(stream, &[(dst.buf, Access::Write)], op)
            .map(|_| ())
    }

    /// Enqueues work of a library that takes raw device addresses (NCCL) on `stream`, ordered
    /// like every other op: `run` gets the address of each view (in order) and the backend's
    /// native stream handle. The simulated device has no device addresses and refuses it.
    pub(crate) fn enqueue_foreign(
        &self,
        stream: &Stream,
        views: &[(DeviceView<'_>, bool)],
        run: &mut dyn FnMut(&[u64], *mut std::ffi::c_void) -> Result<()>,
    ) -> Result<()> {
        let operands: Vec<(&RawBuffer, usize, bool)> = views
            .iter()
            .map(|(v, w)| (&v.buf.raw, v.offset, *w))
            .collect();
        let accesses: Vec<(&DeviceBuffer, Access)> = views
            .iter()
            .map(|(v, w)| (v.buf, if *w { Access::Write } else { Access::Read }))
            .collect();
        let op = Op::Foreign {
            operands: &operands,
            run: ForeignCall(run),
        };
        self.submit(stream, &accesses, op).map(|_| ())
    }

    /// Launches an op's kernel on `stream` (see [`launch`]): `operands` follow the descriptor's
    /// signature (`None` for an optional operand left out) and `params` are the bytes of its
    /// parameter struct. Every launch is validated here the same way — one device, each operand
    /// of an accepted element type, aligned to it and whole elements long, no written operand
    /// overlapping another operand, the parameter block's size, then the op's shape check — and
    /// ordered like a copy. Ops wrap this in a typed function (see `tidemem::ops`).
    pub fn launch(
        &self,
        stream: &Stream,
        desc: &'static KernelDesc,
        operands: &[Option<Operand<'_>>],
        params: &[u8],
    ) -> Result<()> {
        self.validate_launch(desc, operands, params)?;
        let raw: Vec<Option<RawOperand<'_>>> = operands
            .iter()
            .map(|o| {
                o.as_ref().map(|o| RawOperand {
                    buf: &o.view.buf.raw,
                    offset: o.view.offset,
                    len: o.view.len,
                    dtype: o.dtype,
                })
            })
            .collect();
        if let Some(check) = desc.check {
            let infos = operand_infos(&raw);
            check(&LaunchInfo {
                desc,
                operands: &infos,
                params,
            })?;
        }
        let accesses: Vec<(&DeviceBuffer, Access)> = desc
            .operands
            .iter()
            .zip(operands)
            .filter_map(|(spec, o)| {
                let a = if spec.mode.writes() {
                    Access::Write
                } else {
                    Access::Read
                };
                o.as_ref().map(|o| (o.view.buf, a))
            })
            .collect();
        let op = Op::Launch {
            desc,
            operands: &raw,
            params,
        };
        self.submit(stream, &accesses, op).map(|_| ())
    }

    /// The generic checks of [`Device::launch`].
    fn validate_launch(
        &self,
        desc: &'static KernelDesc,
        operands: &[Option<Operand<'_>>],
        params: &[u8],
    ) -> Result<()> {
        if operands.len() != desc.operands.len() {
            return Err(desc.signature_error(format!(
                "{} operands for a signature of {}",
                operands.len(),
                desc.operands.len()
            )));
        }
        if params.len() != desc.params.size {
            return Err(desc.signature_error(format!(
                "parameters of {} bytes, the struct {} has {}",
                params.len(),
                desc.params.c_name,
                desc.params.size
            )));
        }
        for (i, (spec, op)) in desc.operands.iter().zip(operands).enumerate() {
            let Some(op) = op else {
                if spec.optional {
                    continue;
                }
                return Err(desc.signature_error(format!("operand `{}` is required", spec.name)));
            };
            self.check("buffer", op.view.buf.device)?;
            launch::check_type(desc, spec, op.dtype)?;
            let es = op.dtype.size();
            for value in [op.view.offset, op.view.len] {
                if !value.is_multiple_of(es) {
                    return Err(Error::Misaligned {
                        what: spec.name,
                        value,
                        align: es,
                    });
                }
            }
            if !spec.mode.writes() {
                continue;
            }
            let clash = desc
                .operands
                .iter()
                .zip(operands)
                .enumerate()
                .find(|(j, (_, o))| *j != i && o.is_some_and(|o| o.view.overlaps(&op.view)));
            if let Some((_, (other, _))) = clash {
                return Err(desc.error(format!(
                    "written operand `{}` overlaps operand `{}`",
                    spec.name, other.name
                )));
            }
        }
        Ok(())
    }

    /// Records `event` on `stream`: it completes when all work enqueued on `stream` so far does.
    pub fn record(&self, stream: &Stream, event: &Event) -> Result<()> {
        self.check("stream", stream.device)?;
        self.check("event", event.device)?;
        let mut clocks = self.inner.clocks.lock();
        self.inner.backend.record(&stream.raw, &event.raw)?;
        clocks.stamp_plain(stream.slot);
        *event.clock.lock() = clocks.snapshot(stream.slot);
        Ok(())
    }

    /// Makes `stream` wait for the latest recording of `event` before running later work.
    pub fn wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        self.check("stream", stream.device)?;
        self.check("event", event.device)?;
        let mut clocks = self.inner.clocks.lock();
        self.inner.backend.wait(&stream.raw, &event.raw)?;
        clocks.stamp_plain(stream.slot);
        let c = event.clock.lock().clone();
        clocks.wait(stream.slot, &c);
        Ok(())
    }

    /// Blocks until the latest recording of `event` completes.
    pub fn sync_event(&self, event: &Event) -> Result<()> {
        self.check("event", event.device)?;
        let c = event.clock.lock().clone();
        self.inner.backend.sync_event(&event.raw)?;
        self.inner.clocks.lock().observe(&c);
        Ok(())
    }

    /// Whether the latest recording of `event` has completed.
    pub fn event_done(&self, event: &Event) -> Result<bool> {
        self.check("event", event.device)?;
        self.inner.backend.query_event(&event.raw)
    }

    /// Blocks until every operation enqueued on `stream` so far completes.
    pub fn sync_stream(&self, stream: &Stream) -> Result<()> {
        self.check("stream", stream.device)?;
        let c = self.inner.clocks.lock().snapshot(stream.slot);
        self.inner.backend.sync_stream(&stream.raw)?;
        self.inner.clocks.lock().observe(&c);
        Ok(())
    }

    /// Copies `data` to a new device buffer and waits for it (a convenience for tests and
    /// set-up code; the training path uses the asynchronous calls).
    pub fn upload(&self, stream: &Stream, data: &[u8]) -> Result<DeviceBuffer> {
        let buf = self.alloc(data.len())?;
        let mut host = self.alloc_host(data.len())?;
        host.copy_from_slice(data);
        self.copy_h2d(stream, host, &buf)?.wait()?;
        Ok(buf)
    }

    /// Copies a device range back to a new `Vec` and waits for it.
    pub fn download<'a>(&self, stream: &Stream, src: impl Into<DeviceView<'a>>) -> Result<Vec<u8>> {
        let src = src.into();
        let host = self.alloc_host(src.len)?;
        Ok(self.copy_d2h(stream, src, host)?.wait()?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        assert_send_sync::<Device>();
        assert_send_sync::<DeviceBuffer>();
        assert_send_sync::<DeviceView<'static>>();
        assert_send_sync::<Stream>();
        assert_send_sync::<Event>();
        assert_send_sync::<Pending<HostBuffer>>();
        assert_send_sync::<HostBuffer>();
        assert_send_sync::<FileStore>();
        assert_send_sync::<CachingAllocator>();
        assert_send_sync::<Block>();
        assert_send_sync::<SimBackend>();
        assert_send_sync::<CudaBackend>();
        assert_send_sync::<Error>();
    }

    #[test]
    fn partial_host_copies() {
        let dev = Device::sim(SimConfig::with_capacity(1 << 16)).unwrap();
        let s = dev.new_stream().unwrap();
        let buf = dev.alloc(8).unwrap();
        let host = HostBuffer::from_slice(&[9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9]).unwrap();
        let host = dev
            .copy_h2d_part(&s, host, 2, &buf)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            dev.download(&s, &buf).unwrap(),
            vec![1, 2, 3, 4, 5, 6, 7, 8]
        );
        let out = HostBuffer::paged(6).unwrap();
        let out = dev
            .copy_d2h_part(&s, buf.view(4, 4).unwrap(), out, 1)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(&out[..], &[0, 5, 6, 7, 8, 0]);
        assert!(matches!(
            dev.copy_h2d_part(&s, host, 5, &buf),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            dev.copy_d2h_part(&s, &buf, out, 1),
            Err(Error::OutOfBounds { .. })
        ));
        assert_eq!(dev.stats().h2d_bytes, 8);
        assert_eq!(dev.stats().d2h_bytes, 8 + 4);
    }
}
