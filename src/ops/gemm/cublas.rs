//! The CUDA side of the GEMM: cuBLAS through cudarc's raw bindings, on the launch's stream.
//!
//! * **Probe before use.** cudarc loads `libcublas` on first use and panics when it is
//!   missing (or lacks a symbol). [`available`] checks once that the library loads and
//!   exports every function called here; without it the op answers
//!   [`Error::BackendUnavailable`].
//! * **One handle per stream, owned by the stream.** A handle is created on a stream's first
//!   GEMM, bound to it (`cublasSetStream_v2`) with the default math mode (tensor cores for
//!   f16/bf16; TF32 only through the compute type, when asked), and kept in the stream's
//!   library state ([`LibraryCall::with_state`]), which lends it to one call at a time. It is
//!   destroyed (`cublasDestroy_v2`, when the library exports it) when the stream drops, after
//!   the stream's work has completed and with its context current: no handle outlives its
//!   stream or its context, and a new stream never meets an old stream's handle.
//! * **Row-major as column-major.** A row-major `m × n` `C` is a column-major `n × m` `Cᵀ`, and
//!   `Cᵀ = op(B)ᵀ·op(A)ᵀ`: cuBLAS is called with `(op_b, op_a, n, m, k, B, ldb, A, lda, C,
//!   ldc)`, the leading dimensions unchanged.
//! * `alpha == 0` is passed as `k = 0` (BLAS: `C = beta·C`, `A` and `B` not read).

use std::ffi::{c_int, c_longlong, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::cublas::sys as cb;

use super::GemmParams;
use crate::device::{BackendKind, LibraryCall};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The cuBLAS functions this module needs: each must be exported. (`cublasDestroy_v2` is
/// called only if exported, to free a handle.)
const SYMBOLS: [&str; 4] = [
    "cublasCreate_v2",
    "cublasSetStream_v2",
    "cublasSetMathMode",
    "cublasGemmStridedBatchedEx",
];

/// Whether cuBLAS loads and exports what the GEMM calls (checked once).
pub(super) fn available() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let probe = PROBE.get_or_init(|| {
        // SAFETY: only tries to dlopen the library by cudarc's candidate names.
        if !unsafe { cb::is_culib_present() } {
            return Err(
                "cuBLAS (libcublas.so.13) cannot be loaded: install it (the \
                        nvidia-cublas wheel or a CUDA toolkit) and put its directory on \
                        LD_LIBRARY_PATH"
                    .into(),
            );
        }
        // SAFETY: the library loads (checked above), so `culib` returns it rather than
        // panicking; looking a symbol up calls nothing.
        let lib = unsafe { cb::culib() };
        for name in SYMBOLS {
            // SAFETY: the symbol is only looked up, never called through this pointer.
            if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
                return Err(format!("the cuBLAS library found does not export {name}"));
            }
        }
        Ok(())
    });
    probe.clone().map_err(|reason| Error::BackendUnavailable {
        kind: BackendKind::Cuda,
        reason,
    })
}

fn status(s: cb::cublasStatus_t, during: &'static str) -> Result<()> {
    if s == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    Err(Error::Library {
        library: "cuBLAS",
        during,
        status: format!("{s:?}"),
    })
}

/// Handles alive now (created and not yet destroyed), for tests.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The number of cuBLAS handles alive in this process: one per stream that has run a GEMM and
/// not been dropped.
pub(super) fn live_handles() -> usize {
    LIVE.load(Ordering::SeqCst)
}

/// A stream's cuBLAS handle, kept in the stream's library state: created on its first GEMM,
/// destroyed when the stream drops (after its work completed, with its context current).
struct Handle(cb::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it do not overlap;
// every use goes through the stream's state, which lends it to one call at a time.
unsafe impl Send for Handle {}

impl Handle {
    /// A new handle of the current context, bound to `stream` with the default math mode.
    fn new(stream: *mut c_void) -> Result<Handle> {
        let mut raw: cb::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: writes a new handle to `raw` (the library was probed).
        let created = unsafe { cb::cublasCreate_v2(&mut raw) };
        status(created, "creating a handle")?;
        LIVE.fetch_add(1, Ordering::SeqCst);
        // From here `h` destroys the handle on every path out.
        let h = Handle(raw);
        // SAFETY: `h.0` is a live handle; `stream` is a stream of the current context.
        let bound = unsafe { cb::cublasSetStream_v2(h.0, stream.cast()) };
        status(bound, "binding a handle to a stream")?;
        // SAFETY: `h.0` is a live handle.
        let math = unsafe { cb::cublasSetMathMode(h.0, cb::cublasMath_t::CUBLAS_DEFAULT_MATH) };
        status(math, "setting the math mode")?;
        Ok(h)
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::SeqCst);
        // SAFETY: the library loads (probed before the handle was made); the symbol is only
        // looked up.
        if unsafe { cb::culib().get::<*const c_void>(b"cublasDestroy_v2") }.is_ok() {
            // SAFETY: `self.0` is a live handle, used by no one else now; its context is current
            // and its stream's work complete (the stream's state is dropped so), or it was never
            // used. A failure cannot be reported from a drop.
            unsafe { cb::cublasDestroy_v2(self.0) };
        }
    }
}

fn int(v: u64, what: &'static str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| super::GEMM.error(format!("{what} = {v} exceeds cuBLAS's int")))
}

fn long(v: u64, what: &'static str) -> Result<c_longlong> {
    c_longlong::try_from(v)
        .map_err(|_| super::GEMM.error(format!("{what} = {v} exceeds cuBLAS's long long")))
}

/// The library call of [`GEMM`](super::GEMM) (operands checked by the launch).
pub(super) fn call(c: &LibraryCall<'_>) -> Result<()> {
    let p: GemmParams = c.info.params()?;
    if p.m == 0 || p.n == 0 || p.batch == 0 {
        return Ok(());
    }
    available()?;
    let dt = match c.info.dtype(0) {
        Some(DType::F32) => cb::cudaDataType::CUDA_R_32F,
        Some(DType::F16) => cb::cudaDataType::CUDA_R_16F,
        Some(DType::BF16) => cb::cudaDataType::CUDA_R_16BF,
        other => return Err(super::GEMM.signature_error(format!("no cuBLAS type for {other:?}"))),
    };
    let compute = if p.has(GemmParams::TF32) {
        cb::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        cb::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let op = |flag| {
        if p.has(flag) {
            cb::cublasOperation_t::CUBLAS_OP_T
        } else {
            cb::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let k = if p.alpha == 0.0 { 0 } else { p.k };
    let (m, n, k, batch) = (
        int(p.m, "m")?,
        int(p.n, "n")?,
        int(k, "k")?,
        int(p.batch, "batch")?,
    );
    let (lda, ldb, ldc) = (int(p.lda, "lda")?, int(p.ldb, "ldb")?, int(p.ldc, "ldc")?);
    let (sa, sb, sc) = (
        long(p.stride_a, "stride_a")?,
        long(p.stride_b, "stride_b")?,
        long(p.stride_c, "stride_c")?,
    );
    // An input cuBLAS does not read (k = 0) may be an empty view at address 0: give it C's
    // address instead, a valid one.
    let addr = |i: usize| {
        if c.ptrs[i] == 0 {
            c.ptrs[2]
        } else {
            c.ptrs[i]
        }
    };
    let (a, b) = (addr(0) as *const c_void, addr(1) as *const c_void);
    let out = c.ptrs[2] as *mut c_void;
    let (alpha, beta) = (p.alpha, p.beta);
    let stream = c.stream;
    c.with_state(
        || Handle::new(stream),
        |h: &mut Handle| {
            // SAFETY: `h` is a live handle of the current context bound to `c.stream`, used
            // by this call alone (the stream's state lends it to one call at a time). The
            // launch checked that every operand's extent under these sizes, leading dimensions
            // and strides lies in its view, that the leading dimensions are at least the row
            // lengths (cuBLAS's column-major requirement after the swap: `ldb ≥ cols(B)`,
            // `lda ≥ cols(A)`, `ldc ≥ n`), and that `C` overlaps neither input; the element
            // type is the operands' own. `alpha` and `beta` are host f32 (the handle's default
            // pointer mode, `COMPUTE_32F`'s scalar type), read during the call.
            let s = unsafe {
                cb::cublasGemmStridedBatchedEx(
                    h.0,
                    op(GemmParams::TRANS_B),
                    op(GemmParams::TRANS_A),
                    n,
                    m,
                    k,
                    (&alpha as *const f32).cast(),
                    b,
                    dt,
                    ldb,
                    sb,
                    a,
                    dt,
                    lda,
                    sa,
                    (&beta as *const f32).cast(),
                    out,
                    dt,
                    ldc,
                    sc,
                    batch,
                    compute,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            status(s, "cublasGemmStridedBatchedEx")
        },
    )
}
