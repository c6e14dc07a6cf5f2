//! The interface a device implements ([`Backend`]) and the validated operations it executes.

use std::any::Any;
use std::fmt;

use super::kernel::{KernelDesc, OperandInfo};
use super::{DeviceId, HostBuffer};
use crate::dtype::DType;
use crate::error::Result;

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

/// One stream-ordered operation, already validated by [`Device`](super::Device): ranges are in bounds, lengths
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
    /// A kernel of an op (see [`KernelDesc`](super::KernelDesc)): operands already validated against the descriptor.
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

/// The interface a device implements. Users hold a [`Device`](super::Device), which validates arguments and
/// orders accesses before calling into the backend; a backend only executes.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Identity of this device.
    fn id(&self) -> DeviceId;
    /// Human-readable name (e.g. the GPU's product name).
    fn name(&self) -> String;
    /// Free and total device memory.
    fn mem_info(&self) -> Result<MemInfo>;
    /// Allocates `bytes` of device memory; [`Error::OutOfMemory`](crate::Error::OutOfMemory) when it does not fit.
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
    /// Creates an event whose recordings carry a time stamp on the device's timeline (for
    /// [`Backend::elapsed`]; on CUDA an event with timing enabled, a little dearer to record
    /// than the synchronisation events of [`Backend::new_event`]).
    fn new_timing_event(&self) -> Result<RawEvent> {
        self.new_event()
    }
    /// Seconds on the device's timeline from the latest recording of `start` to that of `end`,
    /// both of them [timing events](Backend::new_timing_event) already complete; `None` where
    /// the backend keeps no time stamps.
    fn elapsed(&self, _start: &RawEvent, _end: &RawEvent) -> Result<Option<f64>> {
        Ok(None)
    }
    /// Whether the backend checks and orders work without running it (a timing-only simulated
    /// device): every result is meaningless.
    fn timing_only(&self) -> bool {
        false
    }
    /// Makes this device current on the calling thread, for libraries that act on the current
    /// device (NCCL). Backends without such a notion do nothing.
    fn bind_to_thread(&self) -> Result<()> {
        Ok(())
    }
}
