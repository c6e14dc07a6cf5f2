//! An op's descriptor ([`KernelDesc`]): its operands, its parameter struct, its shape check,
//! its CPU twin and its CUDA side; what [`Device::launch`](super::Device::launch) validates and
//! runs.

use std::any::Any;
use std::ffi::c_void;
use std::fmt;

use super::library::LibraryState;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// How a kernel touches one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Only read.
    Read,
    /// Only written (every element the op promises to write is written).
    Write,
    /// Read and written (in place, or written only in part).
    ReadWrite,
}

impl Mode {
    /// Whether the operand is written.
    pub const fn writes(self) -> bool {
        !matches!(self, Mode::Read)
    }
}

/// One operand of a kernel's signature.
#[derive(Clone, Copy, Debug)]
pub struct OperandSpec {
    /// Name used in error messages (and in the `.cu` parameter list).
    pub name: &'static str,
    /// How the kernel accesses it.
    pub mode: Mode,
    /// The element types it accepts.
    pub dtypes: &'static [DType],
    /// Whether a launch may leave it out (a null pointer on CUDA, absent for the twin).
    pub(crate) optional: bool,
}

impl OperandSpec {
    /// A required operand the kernel reads.
    pub const fn read(name: &'static str, dtypes: &'static [DType]) -> Self {
        OperandSpec {
            name,
            mode: Mode::Read,
            dtypes,
            optional: false,
        }
    }
    /// A required operand the kernel writes.
    pub const fn write(name: &'static str, dtypes: &'static [DType]) -> Self {
        OperandSpec {
            name,
            mode: Mode::Write,
            dtypes,
            optional: false,
        }
    }
    /// A required operand the kernel reads and writes.
    pub const fn read_write(name: &'static str, dtypes: &'static [DType]) -> Self {
        OperandSpec {
            name,
            mode: Mode::ReadWrite,
            dtypes,
            optional: false,
        }
    }
    /// The same operand, optional.
    pub const fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

/// The layout of an op's `#[repr(C)]` parameter struct, as the Rust side sees it; a test checks
/// it against the `.cuh` header that mirrors it, with NVRTC and with the host C++ compiler.
#[derive(Clone, Copy, Debug)]
pub struct ParamLayout {
    /// The struct's name in C++ (and in Rust).
    pub c_name: &'static str,
    /// The header under `kernels/` that defines it.
    pub header: &'static str,
    /// `size_of` the struct.
    pub size: usize,
    /// Every field with its byte offset.
    pub fields: &'static [(&'static str, usize)],
}

/// One kernel launch of a CUDA plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grid {
    /// The `extern "C" __global__` function.
    pub entry: String,
    /// Blocks per dimension.
    pub grid: [u32; 3],
    /// Threads per block per dimension.
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes.
    pub(crate) shared_bytes: u32,
}

impl Grid {
    /// A one-dimensional launch of `blocks` blocks of `threads` threads.
    pub fn linear(entry: impl Into<String>, blocks: u32, threads: u32) -> Self {
        Grid {
            entry: entry.into(),
            grid: [blocks, 1, 1],
            block: [threads, 1, 1],
            shared_bytes: 0,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn shared(mut self, bytes: u32) -> Self {
        self.shared_bytes = bytes;
        self
    }
}

/// Blocks for a grid-stride kernel over `n` elements at `threads` per block: enough to cover
/// `n` once, at least 1, at most 65 535.
pub fn grid_stride_blocks(n: usize, threads: u32) -> u32 {
    n.div_ceil(threads.max(1) as usize).clamp(1, 65_535) as u32
}

/// The plan of an elementwise op: one grid-stride launch of `entry` over `n` elements, 256
/// threads a block; nothing at all for `n = 0`.
pub fn grid_stride(entry: String, n: usize) -> Vec<Grid> {
    if n == 0 {
        return vec![];
    }
    vec![Grid::linear(entry, grid_stride_blocks(n, 256), 256)]
}

/// A library call (cuBLAS) made on the backend's native stream, with the context of the stream
/// current.
pub struct LibraryCall<'a> {
    /// The launch's operands and parameters.
    pub info: &'a LaunchInfo<'a>,
    /// Device address of each operand (0 for an absent one), in signature order.
    pub ptrs: &'a [u64],
    /// The native stream (a `CUstream`).
    pub stream: *mut c_void,
    /// The stream's library states.
    pub(super) state: &'a LibraryState,
}

impl LibraryCall<'_> {
    /// Runs `f` on the stream's state of type `T` (a library's handle bound to the stream),
    /// made by `init` on the stream's first call that asks for a `T`; an `init` that fails
    /// leaves nothing behind, and the next call tries again. The state lives exactly as long as
    /// the stream: it is dropped with it, after the stream's pending work has completed and
    /// with its context current, so its `Drop` may destroy a library handle. A library keys
    /// its state by a type of its own (private to it), so libraries never share one. `f` holds
    /// the state's lock (calls on one stream from two threads take turns) and must not ask for
    /// the same `T` again.
    pub fn with_state<T: Any + Send, R>(
        &self,
        init: impl FnOnce() -> Result<T>,
        f: impl FnOnce(&mut T) -> Result<R>,
    ) -> Result<R> {
        self.state.with(init, f)
    }
}

/// The CUDA side of an op.
#[derive(Clone, Copy)]
pub enum CudaSide {
    /// Kernels compiled by NVRTC from `source` (a file of `kernels/`): `plan` gives the
    /// launches, run in order on the stream; an empty plan launches nothing.
    Nvrtc {
        /// Kernel source file name.
        source: &'static str,
        /// The launches for a validated set of operands and parameters.
        plan: fn(&LaunchInfo<'_>) -> Result<Vec<Grid>>,
    },
    /// A library call on the native stream.
    Library(fn(&LibraryCall<'_>) -> Result<()>),
}

impl fmt::Debug for CudaSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaSide::Nvrtc { source, .. } => write!(f, "Nvrtc({source})"),
            CudaSide::Library(_) => f.write_str("Library"),
        }
    }
}

/// One launch path for every kernel.
///
/// An op describes itself once, in a [`KernelDesc`]: its operand signature (name, how it is
/// accessed, which element types it takes), its scalar parameters as one `#[repr(C)]` struct
/// mirrored in a `.cuh` header under `kernels/`, an optional shape check, the CPU twin the
/// simulated device runs, and the CUDA side — an NVRTC entry point with its grid, or a library
/// call on the native stream. [`Device::launch`](super::Device::launch) validates every launch
/// the same way (one device, operands in bounds and aligned to their element type, a written
/// operand overlapping no other operand, the parameter block's size, the op's own shape check)
/// and orders every access like a copy. Each backend has one arm for it.
///
/// On CUDA an NVRTC entry takes the operands' device addresses in signature order (an absent
/// optional operand is a null pointer), then the parameter struct by value.
///
/// Adding an op is one file in `src/ops/` (the descriptor, a typed safe wrapper, the twin) and
/// one `.cu` (+ its `.cuh`) in `kernels/`; nothing here changes.
///
/// An op's descriptor: everything the device layer needs to validate, order and run it.
#[derive(Debug)]
pub struct KernelDesc {
    /// The op's name (as in error messages and the conformance test).
    pub name: &'static str,
    /// The operand signature.
    pub operands: &'static [OperandSpec],
    /// The parameter struct.
    pub params: ParamLayout,
    /// A shape check run before anything is enqueued.
    pub check: Option<fn(&LaunchInfo<'_>) -> Result<()>>,
    /// The CPU twin: what the simulated device runs, on the operands' bytes.
    pub twin: fn(&mut TwinArgs<'_>) -> Result<()>,
    /// What CUDA runs.
    pub cuda: CudaSide,
}

impl KernelDesc {
    /// An error of operands that do not fit this op (shapes, overlaps): an
    /// [`Error::Operands`] naming the op.
    pub fn error(&self, reason: impl Into<String>) -> Error {
        Error::Operands {
            op: self.name,
            reason: reason.into(),
        }
    }

    /// An error of a launch that does not match this op's signature (operand count, element
    /// types, parameter block): an [`Error::Launch`].
    pub(crate) fn signature_error(&self, reason: impl Into<String>) -> Error {
        Error::Launch {
            kernel: self.name,
            reason: reason.into(),
        }
    }
}

/// What a launch knows of one present operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OperandInfo {
    /// Element type.
    pub dtype: DType,
    /// Length in elements.
    pub len: usize,
}

/// The operands' types and lengths and the parameter bytes of a launch, as shape checks and
/// CUDA plans see them.
#[derive(Clone, Copy, Debug)]
pub struct LaunchInfo<'a> {
    /// The op.
    pub desc: &'static KernelDesc,
    /// One entry per operand of the signature (`None`: left out).
    pub operands: &'a [Option<OperandInfo>],
    /// The parameter struct's bytes.
    pub params: &'a [u8],
}

impl LaunchInfo<'_> {
    /// Elements of operand `i` (0 when absent).
    pub fn len(&self, i: usize) -> usize {
        self.operands.get(i).copied().flatten().map_or(0, |o| o.len)
    }
    /// Element type of operand `i`, if present.
    pub fn dtype(&self, i: usize) -> Option<DType> {
        self.operands.get(i).copied().flatten().map(|o| o.dtype)
    }
    /// Whether operand `i` is present.
    pub(crate) fn present(&self, i: usize) -> bool {
        self.operands.get(i).is_some_and(|o| o.is_some())
    }
    /// The parameter struct (its size was checked against the descriptor).
    pub fn params<P: bytemuck::Pod>(&self) -> Result<P> {
        read_params(self.desc, self.params)
    }
}

fn read_params<P: bytemuck::Pod>(desc: &KernelDesc, bytes: &[u8]) -> Result<P> {
    if bytes.len() != std::mem::size_of::<P>() {
        return Err(desc.signature_error(format!(
            "parameters of {} bytes read as {} bytes",
            bytes.len(),
            std::mem::size_of::<P>()
        )));
    }
    Ok(bytemuck::pod_read_unaligned(bytes))
}

enum Slot<'a> {
    Absent,
    Read(&'a [u8]),
    Write(Option<&'a mut [u8]>),
}

/// The operands of one twin run, as byte slices: read operands shared, written ones handed out
/// once each (no written operand overlaps another operand, so they never alias).
pub struct TwinArgs<'a> {
    desc: &'static KernelDesc,
    slots: Vec<Slot<'a>>,
    dtypes: Vec<Option<DType>>,
    params: &'a [u8],
}

/// One operand of a twin run on host memory: see [`TwinArgs::new`].
#[derive(Debug)]
pub enum HostOperand<'a> {
    /// Left out (optional operands only).
    Absent,
    /// A read operand.
    Read(&'a [u8], DType),
    /// A written (or read-and-written) operand.
    Write(&'a mut [u8], DType),
}

impl<'a> TwinArgs<'a> {
    /// The arguments of a twin run on host slices, checked against the signature like a device
    /// launch (types, element alignment, and which operands are written); overlap cannot occur
    /// (the borrow checker sees to it). Used by the simulated device and to run a twin directly.
    pub fn new(
        desc: &'static KernelDesc,
        operands: Vec<HostOperand<'a>>,
        params: &'a [u8],
    ) -> Result<Self> {
        if operands.len() != desc.operands.len() {
            return Err(desc.signature_error(format!(
                "{} operands for a signature of {}",
                operands.len(),
                desc.operands.len()
            )));
        }
        let mut slots = Vec::with_capacity(operands.len());
        let mut dtypes = Vec::with_capacity(operands.len());
        for (spec, op) in desc.operands.iter().zip(operands) {
            let (slot, info) = match op {
                HostOperand::Absent => (Slot::Absent, None),
                HostOperand::Read(b, d) => (Slot::Read(b), Some((b.as_ptr(), b.len(), d, false))),
                HostOperand::Write(b, d) => {
                    let info = (b.as_ptr(), b.len(), d, true);
                    (Slot::Write(Some(b)), Some(info))
                }
            };
            match info {
                None if !spec.optional => {
                    return Err(desc.signature_error(format!("operand `{}` is required", spec.name)))
                }
                None => dtypes.push(None),
                Some((ptr, len, d, written)) => {
                    check_type(desc, spec, d)?;
                    if written != spec.mode.writes() {
                        return Err(desc.signature_error(format!(
                            "operand `{}` is {:?} in the signature",
                            spec.name, spec.mode
                        )));
                    }
                    // An empty operand may sit anywhere (an empty allocation): it is no elements.
                    let misaligned = len > 0 && !(ptr as usize).is_multiple_of(d.size());
                    if misaligned || !len.is_multiple_of(d.size()) {
                        return Err(Error::Misaligned {
                            what: spec.name,
                            value: ptr as usize,
                            align: d.size(),
                        });
                    }
                    dtypes.push(Some(d));
                }
            }
            slots.push(slot);
        }
        if params.len() != desc.params.size {
            return Err(desc.signature_error(format!(
                "parameters of {} bytes, the struct {} has {}",
                params.len(),
                desc.params.c_name,
                desc.params.size
            )));
        }
        Ok(TwinArgs {
            desc,
            slots,
            dtypes,
            params,
        })
    }

    /// The op.
    pub(crate) fn desc(&self) -> &'static KernelDesc {
        self.desc
    }
    /// The parameter struct.
    pub fn params<P: bytemuck::Pod>(&self) -> Result<P> {
        read_params(self.desc, self.params)
    }
    /// Element type of operand `i`, if present.
    pub fn dtype(&self, i: usize) -> Option<DType> {
        self.dtypes.get(i).copied().flatten()
    }
    /// Whether operand `i` is present.
    pub(crate) fn present(&self, i: usize) -> bool {
        self.dtype(i).is_some()
    }
    /// The bytes of read operand `i`.
    pub fn read(&self, i: usize) -> Result<&'a [u8]> {
        match self.slots.get(i) {
            Some(Slot::Read(b)) => Ok(b),
            _ => Err(self.misuse(i, "is not a present read operand")),
        }
    }
    /// Read operand `i` as elements of `T`.
    pub(crate) fn read_as<T: bytemuck::Pod>(&self, i: usize) -> Result<&'a [T]> {
        let b = self.read(i)?;
        if b.is_empty() {
            return Ok(&[]);
        }
        bytemuck::try_cast_slice(b).map_err(|_| self.misuse(i, "has the wrong element size"))
    }
    /// The bytes of written operand `i` (each written operand can be taken once).
    pub fn take(&mut self, i: usize) -> Result<&'a mut [u8]> {
        match self.slots.get_mut(i) {
            Some(Slot::Write(b)) => b.take().ok_or_else(|| self.misuse(i, "was already taken")),
            _ => Err(self.misuse(i, "is not a present written operand")),
        }
    }
    /// Written operand `i` as elements of `T`.
    pub(crate) fn take_as<T: bytemuck::Pod>(&mut self, i: usize) -> Result<&'a mut [T]> {
        let b = self.take(i)?;
        if b.is_empty() {
            return Ok(&mut []);
        }
        bytemuck::try_cast_slice_mut(b).map_err(|_| self.misuse(i, "has the wrong element size"))
    }

    fn misuse(&self, i: usize, what: &str) -> Error {
        let name = self.desc.operands.get(i).map_or("?", |s| s.name);
        self.desc
            .signature_error(format!("the twin's operand {i} (`{name}`) {what}"))
    }
}

pub(super) fn check_type(desc: &KernelDesc, spec: &OperandSpec, d: DType) -> Result<()> {
    if !spec.dtypes.contains(&d) {
        let allowed: Vec<&str> = spec.dtypes.iter().map(|d| d.name()).collect();
        return Err(desc.signature_error(format!(
            "operand `{}` is {d}, the kernel takes {}",
            spec.name,
            allowed.join(" or ")
        )));
    }
    Ok(())
}

/// Defines a [`ParamLayout`] for a `#[repr(C)]` struct: its name, header, size and the offset
/// of every listed field (`a.b` for a field of a nested struct).
macro_rules! param_layout {
    ($t:ty, $header:literal, [$($($field:ident).+),* $(,)?]) => {
        $crate::device::kernel::ParamLayout {
            c_name: stringify!($t),
            header: $header,
            size: ::std::mem::size_of::<$t>(),
            fields: &[$((stringify!($($field).+), ::std::mem::offset_of!($t, $($field).+))),*],
        }
    };
}
pub(crate) use param_layout;
