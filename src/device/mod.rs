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
pub use pool::{Block, CachingAllocator, PoolStats, Reclaim};
pub use sim::{LinkModel, SimBackend, SimConfig};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::embedding::{BagMode, EmbeddingKernel, RowOptimizer};
use crate::optim::AdamScalars;
use order::{Access, AccessRecord, Clock, Clocks};

/// Which implementation runs a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The simulated accelerator ([`SimBackend`]).
    Sim,
    /// A CUDA GPU ([`CudaBackend`]).
    Cuda,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Sim => "sim",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// Identity of one device instance: its kind, ordinal, and a process-unique number, so handles of
/// two devices are never confused (even two simulated devices with the same ordinal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceId {
    /// Backend kind.
    pub kind: BackendKind,
    /// Device ordinal within its kind.
    pub ordinal: usize,
    /// Process-unique instance number.
    pub uid: u64,
}

impl DeviceId {
    /// A fresh id for a new device instance.
    pub fn new(kind: BackendKind, ordinal: usize) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        DeviceId {
            kind,
            ordinal,
            uid: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} (#{})", self.kind, self.ordinal, self.uid)
    }
}

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
    /// Convert `count` elements from `from` to `to` (non-overlapping, element-aligned ranges).
    Cast {
        /// Source buffer.
        src: &'a RawBuffer,
        /// Byte offset in `src`.
        src_offset: usize,
        /// Source element type.
        from: DType,
        /// Destination buffer.
        dst: &'a RawBuffer,
        /// Byte offset in `dst`.
        dst_offset: usize,
        /// Destination element type.
        to: DType,
        /// Number of elements.
        count: usize,
    },
    /// One Adam step over `count` elements (see [`crate::optim::adam`] for the arithmetic).
    /// `params`, `momentum` and `variance` are f32; the copy, when present, is F16 or BF16 and
    /// either is exactly the gradient range (read, then overwritten) or overlaps nothing.
    Adam {
        /// fp32 parameters (read and written).
        params: (&'a RawBuffer, usize),
        /// Momentum (read and written).
        momentum: (&'a RawBuffer, usize),
        /// Variance (read and written).
        variance: (&'a RawBuffer, usize),
        /// Gradient buffer, offset and element type.
        grad: (&'a RawBuffer, usize, DType),
        /// Where the low-precision copy of the new parameters goes.
        copy: Option<(&'a RawBuffer, usize, DType)>,
        /// Number of elements.
        count: usize,
        /// The step's scalars.
        scalars: AdamScalars,
    },
    /// Gradient statistics of `count` elements of `dtype` at `src[src_offset..]`: writes the sum
    /// of squares as an f64 at `out[out_offset..]` and 1.0 or 0.0 (an element was infinite or
    /// NaN) as an f64 right after it. `out` has room for [`GRAD_STATS_BYTES`] bytes, the rest
    /// being scratch space for partial sums.
    GradStats {
        /// Source buffer.
        src: &'a RawBuffer,
        /// Byte offset in `src`.
        src_offset: usize,
        /// Element type.
        dtype: DType,
        /// Number of elements.
        count: usize,
        /// Output buffer.
        out: &'a RawBuffer,
        /// Byte offset in `out`.
        out_offset: usize,
    },
    /// An embedding kernel (see [`crate::ops::embedding`]): `reads` are `(buffer, byte offset,
    /// byte length)` in the order the kernel lists, `write` the one range it writes.
    Embedding {
        /// Which kernel, with its scalars.
        kernel: EmbeddingKernel,
        /// Operands read.
        reads: &'a [(&'a RawBuffer, usize, usize)],
        /// The operand written.
        write: (&'a RawBuffer, usize, usize),
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

/// Partial sums a device may use in a [`Op::GradStats`] (one per block of the CUDA kernel).
pub const GRAD_STATS_PARTIALS: usize = 256;
/// Bytes of the output range of [`Device::grad_stats`]: the result (two f64) and room for
/// [`GRAD_STATS_PARTIALS`] partial results.
pub const GRAD_STATS_BYTES: usize = 16 * (1 + GRAD_STATS_PARTIALS);

/// The operands of [`Device::adam`].
#[derive(Debug)]
pub struct AdamOperands<'a> {
    /// fp32 parameters.
    pub params: DeviceView<'a>,
    /// fp32 momentum.
    pub momentum: DeviceView<'a>,
    /// fp32 variance.
    pub variance: DeviceView<'a>,
    /// The gradient.
    pub grad: DeviceView<'a>,
    /// The gradient's element type.
    pub grad_dtype: DType,
    /// The low-precision (F16/BF16) copy of the new parameters: the gradient's own range (the
    /// gradient is replaced), a range that overlaps no operand, or `None`.
    pub copy: Option<(DeviceView<'a>, DType)>,
}

fn check_shape(stride: usize, dim: usize) -> Result<()> {
    if dim == 0 || stride < dim || stride > MAX_ROW_FLOATS {
        return Err(Error::InvalidArgument(format!(
            "embedding rows need 1 ≤ dim ≤ stride ≤ {MAX_ROW_FLOATS}, got dim {dim} and stride \
             {stride}"
        )));
    }
    Ok(())
}

/// The widest embedding row, in floats (far beyond any table; keeps sizes from overflowing).
const MAX_ROW_FLOATS: usize = 1 << 24;

/// `packed` holds one row of `row_bytes` per index.
fn check_rows(row_bytes: usize, index: &DeviceView<'_>, packed: &DeviceView<'_>) -> Result<()> {
    if row_bytes == 0
        || !row_bytes.is_multiple_of(4)
        || Some(packed.len) != (index.len / 4).checked_mul(row_bytes)
    {
        return Err(Error::InvalidArgument(format!(
            "row moves need rows of a positive multiple of 4 bytes ({row_bytes}) and one packed \
             row per index: {} bytes for {} indices",
            packed.len,
            index.len / 4
        )));
    }
    Ok(())
}

/// Decodes the result of [`Device::grad_stats`] from the first 16 downloaded bytes.
pub fn read_grad_stats(bytes: &[u8]) -> Result<crate::optim::GradStats> {
    if bytes.len() < 16 {
        return Err(Error::InvalidArgument(format!(
            "gradient statistics are 16 bytes, got {}",
            bytes.len()
        )));
    }
    let f = |i: usize| f64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    Ok(crate::optim::GradStats {
        sum_sq: f(0),
        nonfinite: f(8) != 0.0,
    })
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

/// Bytes in a human-readable binary unit, for messages and examples.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

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

    /// Converts the elements of `src` (type `from`) into `dst` (type `to`) on `stream`, with
    /// round-to-nearest-even. The CUDA backend runs `kernels/convert.cu`; the simulated device
    /// runs its CPU twin, [`crate::ops::cast`].
    pub fn cast<'a, 'b>(
        &self,
        stream: &Stream,
        src: impl Into<DeviceView<'a>>,
        from: DType,
        dst: impl Into<DeviceView<'b>>,
        to: DType,
    ) -> Result<()> {
        let (src, dst) = (src.into(), dst.into());
        for (what, value, align) in [
            ("source offset", src.offset, from.size()),
            ("source length", src.len, from.size()),
            ("destination offset", dst.offset, to.size()),
            ("destination length", dst.len, to.size()),
        ] {
            if value % align != 0 {
                return Err(Error::Misaligned { what, value, align });
            }
        }
        let count = src.len / from.size();
        if count != dst.len / to.size() {
            return Err(Error::InvalidArgument(format!(
                "cast of {count} {from} elements into room for {} {to} elements",
                dst.len / to.size()
            )));
        }
        if from == to {
            return self.copy_d2d(stream, src, dst);
        }
        if std::ptr::eq(src.buf, dst.buf)
            && src.offset < dst.offset + dst.len
            && dst.offset < src.offset + src.len
        {
            return Err(Error::InvalidArgument(
                "cast source and destination overlap".into(),
            ));
        }
        let op = Op::Cast {
            src: &src.buf.raw,
            src_offset: src.offset,
            from,
            dst: &dst.buf.raw,
            dst_offset: dst.offset,
            to,
            count,
        };
        self.submit(
            stream,
            &[(src.buf, Access::Read), (dst.buf, Access::Write)],
            op,
        )
        .map(|_| ())
    }

    /// One Adam step on `stream` over the operands (see [`crate::optim::adam`] for the
    /// arithmetic). The CUDA backend runs `kernels/adam.cu`; the simulated device runs the CPU
    /// kernel, [`crate::optim::CpuAdam`], so both placements of a step give the same bits there.
    pub fn adam(&self, stream: &Stream, s: &AdamScalars, ops: AdamOperands<'_>) -> Result<()> {
        let count = ops.params.len / 4;
        let mut ranges: Vec<(&'static str, &DeviceView<'_>, usize)> = vec![
            ("parameters", &ops.params, 4),
            ("momentum", &ops.momentum, 4),
            ("variance", &ops.variance, 4),
            ("gradient", &ops.grad, ops.grad_dtype.size()),
        ];
        if let Some((c, dt)) = &ops.copy {
            if *dt == DType::F32 {
                return Err(Error::InvalidArgument(
                    "the parameter copy of an Adam step must be F16 or BF16".into(),
                ));
            }
            let in_place = std::ptr::eq(c.buf, ops.grad.buf)
                && c.offset == ops.grad.offset
                && c.len == ops.grad.len;
            if in_place && *dt != ops.grad_dtype {
                return Err(Error::InvalidArgument(
                    "an Adam copy in place of the gradient must have the gradient's type".into(),
                ));
            }
            if !in_place {
                ranges.push(("parameter copy", c, dt.size()));
            }
        }
        for (i, &(what, v, es)) in ranges.iter().enumerate() {
            if v.offset % es != 0 || v.len % es != 0 {
                return Err(Error::Misaligned {
                    what,
                    value: v.offset,
                    align: es,
                });
            }
            if v.len / es != count {
                return Err(Error::InvalidArgument(format!(
                    "Adam {what} holds {} elements, the parameters {count}",
                    v.len / es
                )));
            }
            for &(other, o, _) in &ranges[..i] {
                if std::ptr::eq(v.buf, o.buf)
                    && v.offset < o.offset + o.len
                    && o.offset < v.offset + v.len
                {
                    return Err(Error::InvalidArgument(format!(
                        "Adam {what} overlaps the {other}"
                    )));
                }
            }
        }
        let op = Op::Adam {
            params: (&ops.params.buf.raw, ops.params.offset),
            momentum: (&ops.momentum.buf.raw, ops.momentum.offset),
            variance: (&ops.variance.buf.raw, ops.variance.offset),
            grad: (&ops.grad.buf.raw, ops.grad.offset, ops.grad_dtype),
            copy: ops.copy.as_ref().map(|(c, dt)| (&c.buf.raw, c.offset, *dt)),
            count,
            scalars: *s,
        };
        let mut acc = vec![
            (ops.params.buf, Access::Write),
            (ops.momentum.buf, Access::Write),
            (ops.variance.buf, Access::Write),
            (ops.grad.buf, Access::Read),
        ];
        if let Some((c, _)) = &ops.copy {
            acc.push((c.buf, Access::Write));
        }
        self.submit(stream, &acc, op).map(|_| ())
    }

    /// Validates and enqueues an embedding kernel: every range 4-byte aligned, the written one
    /// overlapping no read one.
    fn embedding_op(
        &self,
        stream: &Stream,
        kernel: EmbeddingKernel,
        reads: &[(&'static str, &DeviceView<'_>)],
        write: (&'static str, &DeviceView<'_>),
    ) -> Result<()> {
        for &(what, v) in reads.iter().chain(std::iter::once(&write)) {
            if v.offset % 4 != 0 || v.len % 4 != 0 {
                return Err(Error::Misaligned {
                    what,
                    value: if v.offset % 4 != 0 { v.offset } else { v.len },
                    align: 4,
                });
            }
        }
        let (wn, w) = write;
        for &(what, r) in reads {
            if std::ptr::eq(r.buf, w.buf)
                && r.offset < w.offset + w.len
                && w.offset < r.offset + r.len
            {
                return Err(Error::InvalidArgument(format!(
                    "embedding {wn} overlaps the {what}"
                )));
            }
        }
        let raw: Vec<(&RawBuffer, usize, usize)> = reads
            .iter()
            .map(|(_, v)| (&v.buf.raw, v.offset, v.len))
            .collect();
        let op = Op::Embedding {
            kernel,
            reads: &raw,
            write: (&w.buf.raw, w.offset, w.len),
        };
        let mut acc: Vec<(&DeviceBuffer, Access)> =
            reads.iter().map(|(_, v)| (v.buf, Access::Read)).collect();
        acc.push((w.buf, Access::Write));
        self.submit(stream, &acc, op).map(|_| ())
    }

    /// Embedding bags on `stream`: bag `b` of `out` (`bags × dim` f32) reduces the rows
    /// `indices[offsets[b]..offsets[b + 1]]` (u32) of `table` (f32 rows of `stride` floats,
    /// the first `dim` the embedding), weighted by `weights` (f32 per index) when given.
    /// `offsets` holds `bags + 1` u32 that must not decrease; index values out of range are
    /// skipped. See [`crate::ops::embedding::bag_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_bag(
        &self,
        stream: &Stream,
        table: DeviceView<'_>,
        stride: usize,
        dim: usize,
        indices: DeviceView<'_>,
        offsets: DeviceView<'_>,
        weights: Option<DeviceView<'_>>,
        mode: BagMode,
        out: DeviceView<'_>,
    ) -> Result<()> {
        check_shape(stride, dim)?;
        let bags = (offsets.len / 4).checked_sub(1).ok_or_else(|| {
            Error::InvalidArgument("embedding bag offsets need bags + 1 entries".into())
        })?;
        if Some(out.len) != bags.checked_mul(dim * 4) {
            return Err(Error::InvalidArgument(format!(
                "embedding bag output of {} bytes for {bags} bags of {dim} f32",
                out.len
            )));
        }
        if let Some(w) = &weights {
            if w.len != indices.len {
                return Err(Error::InvalidArgument(format!(
                    "{} bytes of weights for {} bytes of indices",
                    w.len, indices.len
                )));
            }
        }
        let mut reads = vec![
            ("table", &table),
            ("indices", &indices),
            ("offsets", &offsets),
        ];
        if let Some(w) = &weights {
            reads.push(("weights", w));
        }
        let kernel = EmbeddingKernel::Bag {
            stride,
            dim,
            mode,
            weighted: weights.is_some(),
        };
        self.embedding_op(stream, kernel, &reads, ("output", &out))
    }

    /// Sparse embedding backward on `stream`: `grads` (`rows × dim` f32, `rows = row_ptr
    /// entries - 1`) gets, for each distinct row, Σ `scale[e]·grad_out[entries[e]]` over its
    /// entries (u32 bag indices, f32 scales). See [`crate::ops::embedding::bag_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_backward(
        &self,
        stream: &Stream,
        grad_out: DeviceView<'_>,
        dim: usize,
        row_ptr: DeviceView<'_>,
        entries: DeviceView<'_>,
        scale: DeviceView<'_>,
        grads: DeviceView<'_>,
    ) -> Result<()> {
        check_shape(dim, dim)?;
        let rows = (row_ptr.len / 4).checked_sub(1).ok_or_else(|| {
            Error::InvalidArgument("embedding backward row starts need rows + 1 entries".into())
        })?;
        if Some(grads.len) != rows.checked_mul(dim * 4)
            || scale.len != entries.len
            || !grad_out.len.is_multiple_of(dim * 4)
        {
            return Err(Error::InvalidArgument(format!(
                "embedding backward: {} bytes of gradients for {rows} rows of {dim} f32, {} bytes                  of scales for {} bytes of entries, {} bytes of output gradient",
                grads.len, scale.len, entries.len, grad_out.len
            )));
        }
        let reads = [
            ("output gradient", &grad_out),
            ("row starts", &row_ptr),
            ("entries", &entries),
            ("scales", &scale),
        ];
        self.embedding_op(
            stream,
            EmbeddingKernel::Backward { dim },
            &reads,
            ("gradients", &grads),
        )
    }

    /// One optimizer step on the rows `rows` (u32, distinct: on a GPU a repeated row races) of
    /// `table` with gradients `grads`
    /// (`rows × dim` f32), on `stream`. Each row's state is stored after its embedding, so
    /// `stride ≥ dim + opt.state_len(dim)`. See [`crate::ops::embedding::row_step`].
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_step(
        &self,
        stream: &Stream,
        table: DeviceView<'_>,
        stride: usize,
        dim: usize,
        rows: DeviceView<'_>,
        grads: DeviceView<'_>,
        opt: &RowOptimizer,
    ) -> Result<()> {
        check_shape(stride, dim)?;
        if stride < dim + opt.state_len(dim) {
            return Err(Error::InvalidArgument(format!(
                "rows of {stride} floats cannot hold {dim} weights and {} floats of optimizer state",
                opt.state_len(dim)
            )));
        }
        if Some(grads.len) != rows.len.checked_mul(dim) {
            return Err(Error::InvalidArgument(format!(
                "{} bytes of gradients for {} rows of {dim} f32",
                grads.len,
                rows.len / 4
            )));
        }
        let kernel = EmbeddingKernel::Step {
            stride,
            dim,
            opt: *opt,
        };
        self.embedding_op(
            stream,
            kernel,
            &[("rows", &rows), ("gradients", &grads)],
            ("table", &table),
        )
    }

    /// Row `i` of `dst` = row `index[i]` (u32) of `src`, rows of `row_bytes` (a multiple of 4),
    /// on `stream`; index values out of range are skipped.
    pub fn gather_rows(
        &self,
        stream: &Stream,
        src: DeviceView<'_>,
        row_bytes: usize,
        index: DeviceView<'_>,
        dst: DeviceView<'_>,
    ) -> Result<()> {
        check_rows(row_bytes, &index, &dst)?;
        let kernel = EmbeddingKernel::Gather { row_bytes };
        self.embedding_op(
            stream,
            kernel,
            &[("source", &src), ("index", &index)],
            ("destination", &dst),
        )
    }

    /// Row `index[i]` (u32) of `dst` = row `i` of `src`, rows of `row_bytes` (a multiple of 4),
    /// on `stream`; index values out of range are skipped. Index values must be distinct: on a
    /// GPU two writes of one row race.
    pub fn scatter_rows(
        &self,
        stream: &Stream,
        src: DeviceView<'_>,
        row_bytes: usize,
        index: DeviceView<'_>,
        dst: DeviceView<'_>,
    ) -> Result<()> {
        check_rows(row_bytes, &index, &src)?;
        let kernel = EmbeddingKernel::Scatter { row_bytes };
        self.embedding_op(
            stream,
            kernel,
            &[("source", &src), ("index", &index)],
            ("destination", &dst),
        )
    }

    /// Gradient statistics of `src` (elements of `dtype`) on `stream`: the sum of squares and
    /// whether an element is infinite or NaN, written as two f64 at the start of `out`, which
    /// must hold [`GRAD_STATS_BYTES`] bytes (the rest is scratch) at an 8-byte aligned offset.
    /// Read them with [`Device::download`] and [`read_grad_stats`].
    pub fn grad_stats<'a, 'b>(
        &self,
        stream: &Stream,
        src: impl Into<DeviceView<'a>>,
        dtype: DType,
        out: impl Into<DeviceView<'b>>,
    ) -> Result<()> {
        let (src, out) = (src.into(), out.into());
        if src.offset % dtype.size() != 0 || src.len % dtype.size() != 0 {
            return Err(Error::Misaligned {
                what: "gradient statistics source",
                value: src.offset,
                align: dtype.size(),
            });
        }
        if out.offset % 8 != 0 {
            return Err(Error::Misaligned {
                what: "gradient statistics output",
                value: out.offset,
                align: 8,
            });
        }
        if out.len < GRAD_STATS_BYTES {
            return Err(Error::InvalidArgument(format!(
                "gradient statistics need {GRAD_STATS_BYTES} output bytes, got {}",
                out.len
            )));
        }
        if std::ptr::eq(src.buf, out.buf)
            && src.offset < out.offset + GRAD_STATS_BYTES
            && out.offset < src.offset + src.len
        {
            return Err(Error::InvalidArgument(
                "gradient statistics output overlaps the source".into(),
            ));
        }
        let op = Op::GradStats {
            src: &src.buf.raw,
            src_offset: src.offset,
            dtype,
            count: src.len / dtype.size(),
            out: &out.buf.raw,
            out_offset: out.offset,
        };
        self.submit(
            stream,
            &[(src.buf, Access::Read), (out.buf, Access::Write)],
            op,
        )
        .map(|_| ())
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

    #[test]
    fn fmt_bytes_units() {
        assert_eq!(fmt_bytes(5), "5 B");
        assert_eq!(fmt_bytes(3 << 20), "3.00 MiB");
    }
}
