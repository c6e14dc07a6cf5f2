//! cuBLAS (the v2 API of `libcublas.so.13`) on the emulated device: handles with a stream and a
//! math mode, and the matrix products `cublasGemmEx`, `cublasGemmStridedBatchedEx`,
//! `cublasSgemm_v2` and `cublasSgemmStridedBatched`.
//!
//! **One library, two names.** cudarc opens `libcublas.so` (then versioned names such as
//! `libcublas.so.13`) apart from `libcuda.so`. `.ci/run` puts `libcublas.so` and
//! `libcublas.so.13`, symbolic links to `libcuda.so`, in the emulator's directory; the dynamic
//! loader maps a file once whatever name it is opened by (it compares the file's device and
//! inode), so both names give the same library with one state: a GEMM sees the allocations and
//! streams made through the driver's calls.
//!
//! **Semantics**, as cuBLAS documents them, column-major: for each of `batchCount` matrices
//! (`stride` elements apart, `0` for the plain calls), `C = alpha * op(A) * op(B) + beta * C`,
//! `op(A)` `m` × `k`, `op(B)` `k` × `n`, `C` `m` × `n`, columns `lda`, `ldb`, `ldc` elements apart;
//! `CUBLAS_OP_T` and `CUBLAS_OP_C` (the same for real types) transpose. The arithmetic is
//! tidemem's simulated device's, bit for bit: the operands widened to `f32`, the product
//! `alpha * op(A) * op(B) + beta * C` computed in `f32` by the `gemm` crate (blocked, with fused
//! multiply-adds where the CPU has them) with the shape and strides the simulated device's twin
//! gives it for the same memory (the row-major `Cᵀ = op(B)ᵀ * op(A)ᵀ`), and each element rounded
//! once to the storage type (round to nearest even). `beta == 0` does not read `C` (a NaN there does not
//! propagate); `alpha == 0` or `k == 0` reads neither `A` nor `B` (`C = beta * C`, or zeros).
//! `m == 0`, `n == 0` or `batchCount == 0` does nothing.
//!
//! **Types.** `A`, `B` and `C` of one type: `CUDA_R_32F`, `CUDA_R_16F` or `CUDA_R_16BF`;
//! compute types `CUBLAS_COMPUTE_32F` and `CUBLAS_COMPUTE_32F_PEDANTIC` (products of the
//! inputs as they are), and for `CUDA_R_32F` data `CUBLAS_COMPUTE_32F_FAST_TF32`,
//! `CUBLAS_COMPUTE_32F_FAST_16F` and `CUBLAS_COMPUTE_32F_FAST_16BF`, which round every element
//! of `A` and `B` to TF32 (10 explicit mantissa bits), fp16 or bf16 (round to nearest even)
//! before multiplying, as the tensor cores take them (a GPU's kernels may break ties or
//! truncate differently: a result that hangs on that is not portable). The handle's math mode
//! `CUBLAS_TF32_TENSOR_OP_MATH` turns `CUBLAS_COMPUTE_32F` on `f32` data (and `cublasSgemm`)
//! into TF32, and the deprecated `CUBLAS_TENSOR_OP_MATH` into fp16 inputs, as cuBLAS
//! documents. `alpha` and `beta` are `f32` on the host (`CUBLAS_POINTER_MODE_HOST`, the
//! default), read at the call; the algorithm is ignored.
//!
//! **Work and checks.** A product is enqueued on the handle's stream (the null stream until
//! `cublasSetStream_v2`) like a kernel launch: it runs late, when something waits for the
//! stream, and the vector clocks order it like any other work (an operand whose stream-ordered
//! allocation is not ordered before it is a fault). Every operand range it reads or writes
//! (all its batches, from the lowest to the highest address) must lie inside one live
//! allocation; one that does not is a fault at the call, which returns
//! `CUBLAS_STATUS_EXECUTION_FAILED` and poisons the driver, as a bad kernel pointer does.
//! Invalid arguments (negative sizes or batch count, a leading dimension smaller than the rows
//! of its stored matrix or than 1, an unknown operation, a null `alpha` or `beta`) return
//! `CUBLAS_STATUS_INVALID_VALUE`, types and compute types not listed above
//! `CUBLAS_STATUS_NOT_SUPPORTED`, an unknown handle `CUBLAS_STATUS_NOT_INITIALIZED`, all
//! without enqueuing anything. Calls made before `cuInit`, or after a fault, return
//! `CUBLAS_STATUS_NOT_INITIALIZED` and `CUBLAS_STATUS_EXECUTION_FAILED`.
//!
//! **Handles.** `cublasCreate_v2` needs the driver initialised (cuBLAS's runtime would
//! initialise it itself); `cublasDestroy_v2` synchronises the device, as cuBLAS documents.
//! `cublasSetStream_v2` takes a live stream or the null stream. `cublasSetWorkspace_v2` is
//! accepted and ignored; `cublasSetPointerMode_v2` accepts only `CUBLAS_POINTER_MODE_HOST`
//! (device scalars answer `CUBLAS_STATUS_NOT_SUPPORTED`). Not emulated: overlapping outputs
//! (one batch's `C` over another's, or `C` over `A`), which cuBLAS leaves undefined, run here
//! one batch after another.
mod gemm;

use super::*;
use gemm::{gemm, Call};

/// `cublasStatus_t`.
type Status = c_int;
const BLAS_SUCCESS: Status = 0;
const BLAS_NOT_INITIALIZED: Status = 1;
const BLAS_INVALID_VALUE: Status = 7;
const BLAS_EXECUTION_FAILED: Status = 13;
const BLAS_NOT_SUPPORTED: Status = 15;

/// `CUBLAS_VERSION` of cuBLAS 13.0.0.
const VERSION: c_int = 130_000;

// `cudaDataType_t`.
const CUDA_R_32F: c_int = 0;
const CUDA_R_16F: c_int = 2;
const CUDA_R_16BF: c_int = 14;

// `cublasComputeType_t`.
const COMPUTE_32F: c_int = 68;
const COMPUTE_32F_PEDANTIC: c_int = 69;
const COMPUTE_32F_FAST_16F: c_int = 74;
const COMPUTE_32F_FAST_16BF: c_int = 75;
const COMPUTE_32F_FAST_TF32: c_int = 77;

// `cublasMath_t`: the base modes, and the flag that may be or-ed into one.
const MATH_TENSOR_OP: c_int = 1;
const MATH_TF32_TENSOR_OP: c_int = 3;
const MATH_MODES: [c_int; 6] = [0, 1, 2, 3, 4, 8];
const MATH_DISALLOW_REDUCED_PRECISION_REDUCTION: c_int = 16;

const POINTER_MODE_HOST: c_int = 0;
const POINTER_MODE_DEVICE: c_int = 1;

struct Handle {
    /// The stream products are enqueued on (0: the null stream).
    stream: usize,
    math: c_int,
}

/// The live handles. Taken after the driver's state, never before it.
static HANDLES: Mutex<BTreeMap<usize, Handle>> = Mutex::new(BTreeMap::new());

fn handles() -> MutexGuard<'static, BTreeMap<usize, Handle>> {
    HANDLES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on the initialised driver state.
fn with_blas<F: FnOnce(&mut State) -> Status>(f: F) -> Status {
    let mut g = state();
    let Some(st) = g.as_mut() else {
        return BLAS_NOT_INITIALIZED;
    };
    if st.fault.is_some() {
        return BLAS_EXECUTION_FAILED;
    }
    f(st)
}

/// Runs `f` on the handle `h`.
fn with_handle<F: FnOnce(&mut Handle) -> Status>(h: *mut c_void, f: F) -> Status {
    with_blas(|_| match handles().get_mut(&(h as usize)) {
        Some(handle) => f(handle),
        None => BLAS_NOT_INITIALIZED,
    })
}

// ---------------------------------------------------------------------------------------------
// Handles. Each `unsafe extern "C"` entry point has cuBLAS's contract: an out-parameter is
// valid for one write of its type (null is refused).

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(handle: *mut *mut c_void) -> Status {
    with_blas(|st| {
        if handle.is_null() {
            return BLAS_INVALID_VALUE;
        }
        let id = st.id();
        handles().insert(id, Handle { stream: 0, math: 0 });
        *handle = id as *mut c_void;
        BLAS_SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn cublasDestroy_v2(handle: *mut c_void) -> Status {
    let r = with_blas(|_| {
        if handles().remove(&(handle as usize)).is_none() {
            return BLAS_NOT_INITIALIZED;
        }
        BLAS_SUCCESS
    });
    if r != BLAS_SUCCESS {
        return r;
    }
    // cublasDestroy synchronises the device.
    match with_waiting(false, State::synchronize) {
        SUCCESS => BLAS_SUCCESS,
        _ => BLAS_EXECUTION_FAILED,
    }
}

#[no_mangle]
pub extern "C" fn cublasSetStream_v2(handle: *mut c_void, stream: *mut c_void) -> Status {
    with_blas(|st| {
        let Some(id) = st.stream_id(stream) else {
            return BLAS_INVALID_VALUE;
        };
        match handles().get_mut(&(handle as usize)) {
            Some(h) => {
                h.stream = id;
                BLAS_SUCCESS
            }
            None => BLAS_NOT_INITIALIZED,
        }
    })
}

/// Stores `v` through the out-parameter `p`, or answers `CUBLAS_STATUS_INVALID_VALUE` when it
/// is null.
unsafe fn put_status<T>(p: *mut T, v: T) -> Status {
    if p.is_null() {
        return BLAS_INVALID_VALUE;
    }
    *p = v;
    BLAS_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetStream_v2(
    handle: *mut c_void,
    stream: *mut *mut c_void,
) -> Status {
    with_handle(handle, |h| put_status(stream, h.stream as *mut c_void))
}

#[no_mangle]
pub extern "C" fn cublasSetMathMode(handle: *mut c_void, mode: c_int) -> Status {
    with_handle(handle, |h| {
        if !MATH_MODES.contains(&(mode & !MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) {
            return BLAS_INVALID_VALUE;
        }
        h.math = mode;
        BLAS_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetMathMode(handle: *mut c_void, mode: *mut c_int) -> Status {
    with_handle(handle, |h| put_status(mode, h.math))
}

#[no_mangle]
pub extern "C" fn cublasSetPointerMode_v2(handle: *mut c_void, mode: c_int) -> Status {
    with_handle(handle, |_| match mode {
        POINTER_MODE_HOST => BLAS_SUCCESS,
        POINTER_MODE_DEVICE => BLAS_NOT_SUPPORTED,
        _ => BLAS_INVALID_VALUE,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetPointerMode_v2(handle: *mut c_void, mode: *mut c_int) -> Status {
    with_handle(handle, |_| put_status(mode, POINTER_MODE_HOST))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetVersion_v2(handle: *mut c_void, version: *mut c_int) -> Status {
    with_handle(handle, |_| put_status(version, VERSION))
}

#[no_mangle]
pub extern "C" fn cublasSetWorkspace_v2(
    handle: *mut c_void,
    _workspace: *mut c_void,
    _bytes: usize,
) -> Status {
    with_handle(handle, |_| BLAS_SUCCESS)
}

fn status_name(s: Status) -> &'static CStr {
    match s {
        0 => c"CUBLAS_STATUS_SUCCESS",
        1 => c"CUBLAS_STATUS_NOT_INITIALIZED",
        3 => c"CUBLAS_STATUS_ALLOC_FAILED",
        7 => c"CUBLAS_STATUS_INVALID_VALUE",
        8 => c"CUBLAS_STATUS_ARCH_MISMATCH",
        11 => c"CUBLAS_STATUS_MAPPING_ERROR",
        13 => c"CUBLAS_STATUS_EXECUTION_FAILED",
        14 => c"CUBLAS_STATUS_INTERNAL_ERROR",
        15 => c"CUBLAS_STATUS_NOT_SUPPORTED",
        16 => c"CUBLAS_STATUS_LICENSE_ERROR",
        _ => c"CUBLAS_STATUS_UNKNOWN",
    }
}

#[no_mangle]
pub extern "C" fn cublasGetStatusName(s: Status) -> *const c_char {
    status_name(s).as_ptr()
}

#[no_mangle]
pub extern "C" fn cublasGetStatusString(s: Status) -> *const c_char {
    let text = match s {
        0 => c"success",
        1 => c"the library was not initialized",
        3 => c"the resource allocation failed",
        7 => c"an invalid numeric value was used as an argument",
        8 => c"an absent device architectural feature is required",
        11 => c"an access to GPU memory space failed",
        13 => c"the GPU program failed to execute (emulated)",
        14 => c"an internal operation failed",
        15 => c"the functionality requested is not supported by the CUDA emulator",
        16 => c"error detected trying to check the license",
        _ => c"unknown error",
    };
    text.as_ptr()
}

// ---------------------------------------------------------------------------------------------
// Matrix products (`gemm.rs`).

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasGemmEx(
    handle: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    atype: c_int,
    lda: c_int,
    b: *const c_void,
    btype: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    ctype: c_int,
    ldc: c_int,
    compute: c_int,
    _algo: c_int,
) -> Status {
    gemm(Call {
        name: "cublasGemmEx",
        handle,
        trans: [transa, transb],
        mnk: [m, n, k],
        alpha: alpha as *const f32,
        beta: beta as *const f32,
        ptr: [a as usize, b as usize, c as usize],
        ld: [lda, ldb, ldc],
        stride: [0; 3],
        batch: 1,
        types: [atype, btype, ctype],
        compute,
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasGemmStridedBatchedEx(
    handle: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    atype: c_int,
    lda: c_int,
    stride_a: i64,
    b: *const c_void,
    btype: c_int,
    ldb: c_int,
    stride_b: i64,
    beta: *const c_void,
    c: *mut c_void,
    ctype: c_int,
    ldc: c_int,
    stride_c: i64,
    batch: c_int,
    compute: c_int,
    _algo: c_int,
) -> Status {
    gemm(Call {
        name: "cublasGemmStridedBatchedEx",
        handle,
        trans: [transa, transb],
        mnk: [m, n, k],
        alpha: alpha as *const f32,
        beta: beta as *const f32,
        ptr: [a as usize, b as usize, c as usize],
        ld: [lda, ldb, ldc],
        stride: [stride_a, stride_b, stride_c],
        batch,
        types: [atype, btype, ctype],
        compute,
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasSgemm_v2(
    handle: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> Status {
    gemm(Call {
        name: "cublasSgemm_v2",
        handle,
        trans: [transa, transb],
        mnk: [m, n, k],
        alpha,
        beta,
        ptr: [a as usize, b as usize, c as usize],
        ld: [lda, ldb, ldc],
        stride: [0; 3],
        batch: 1,
        types: [CUDA_R_32F; 3],
        compute: COMPUTE_32F,
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasSgemmStridedBatched(
    handle: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    stride_a: i64,
    b: *const f32,
    ldb: c_int,
    stride_b: i64,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
    stride_c: i64,
    batch: c_int,
) -> Status {
    gemm(Call {
        name: "cublasSgemmStridedBatched",
        handle,
        trans: [transa, transb],
        mnk: [m, n, k],
        alpha,
        beta,
        ptr: [a as usize, b as usize, c as usize],
        ld: [lda, ldb, ldc],
        stride: [stride_a, stride_b, stride_c],
        batch,
        types: [CUDA_R_32F; 3],
        compute: COMPUTE_32F,
    })
}
