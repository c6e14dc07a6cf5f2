//! The matrix products: a call's arguments checked (`check`), its operands' ranges checked and
//! the product enqueued on the handle's stream (`gemm`), and the CPU product that runs there.
use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    fn of(t: c_int) -> Option<Self> {
        match t {
            CUDA_R_32F => Some(Dtype::F32),
            CUDA_R_16F => Some(Dtype::F16),
            CUDA_R_16BF => Some(Dtype::Bf16),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

/// How the elements of `A` and `B` are rounded before they are multiplied.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Inputs {
    Exact,
    Tf32,
    F16,
    Bf16,
}

/// `x` rounded to TF32: 10 explicit mantissa bits, to nearest even (infinities and NaN kept).
fn round_tf32(x: f32) -> f32 {
    let u = x.to_bits();
    if u & 0x7f80_0000 == 0x7f80_0000 {
        return x;
    }
    f32::from_bits((u + 0x0fff + ((u >> 13) & 1)) & !0x1fff)
}

impl Inputs {
    fn round(self, x: f32) -> f32 {
        match self {
            Inputs::Exact => x,
            Inputs::Tf32 => round_tf32(x),
            Inputs::F16 => shim_f16_to_f32(shim_f32_to_f16(x)),
            Inputs::Bf16 => shim_bf16_to_f32(shim_f32_to_bf16(x)),
        }
    }
}

/// A GEMM call's arguments, as given.
pub(super) struct Call {
    pub(super) name: &'static str,
    pub(super) handle: *mut c_void,
    pub(super) trans: [c_int; 2],
    pub(super) mnk: [c_int; 3],
    pub(super) alpha: *const f32,
    pub(super) beta: *const f32,
    /// Device addresses of A, B and C.
    pub(super) ptr: [usize; 3],
    pub(super) ld: [c_int; 3],
    /// Elements between the matrices of a batch.
    pub(super) stride: [i64; 3],
    pub(super) batch: c_int,
    pub(super) types: [c_int; 3],
    pub(super) compute: c_int,
}

/// A GEMM, checked.
#[derive(Clone, Copy, Debug)]
struct Gemm {
    trans: [bool; 2],
    m: usize,
    n: usize,
    k: usize,
    ptr: [usize; 3],
    ld: [usize; 3],
    stride: [i64; 3],
    batch: usize,
    dtype: Dtype,
    inputs: Inputs,
    alpha: f32,
    beta: f32,
}

impl Gemm {
    /// Whether the product reads `A` and `B`.
    fn reads_ab(&self) -> bool {
        self.k > 0 && self.alpha != 0.0
    }

    /// The rows and columns of operand `i` (A, B, C) as stored.
    fn stored(&self, i: usize) -> (usize, usize) {
        let (m, n, k) = (self.m, self.n, self.k);
        match i {
            0 if self.trans[0] => (k, m),
            0 => (m, k),
            1 if self.trans[1] => (n, k),
            1 => (k, n),
            _ => (m, n),
        }
    }
}

/// Checks a call's arguments (the handle's math mode is `math`), reading `alpha` and `beta`.
unsafe fn check(c: &Call, math: c_int) -> Result<Gemm, Status> {
    let op = |t: c_int| match t {
        0 => Ok(false),
        1 | 2 => Ok(true),
        _ => Err(BLAS_INVALID_VALUE),
    };
    let trans = [op(c.trans[0])?, op(c.trans[1])?];
    let size = |v: c_int| usize::try_from(v).map_err(|_| BLAS_INVALID_VALUE);
    let [m, n, k] = [size(c.mnk[0])?, size(c.mnk[1])?, size(c.mnk[2])?];
    let batch = size(c.batch)?;
    let ld = [size(c.ld[0])?, size(c.ld[1])?, size(c.ld[2])?];
    if c.alpha.is_null() || c.beta.is_null() {
        return Err(BLAS_INVALID_VALUE);
    }
    let [ta, tb, tc] = c.types;
    let dtype = Dtype::of(ta)
        .filter(|_| ta == tb && tb == tc)
        .ok_or(BLAS_NOT_SUPPORTED)?;
    let base = math & !MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    let inputs = match (dtype, c.compute) {
        (Dtype::F32, COMPUTE_32F) if base == MATH_TF32_TENSOR_OP => Inputs::Tf32,
        (Dtype::F32, COMPUTE_32F) if base == MATH_TENSOR_OP => Inputs::F16,
        (_, COMPUTE_32F | COMPUTE_32F_PEDANTIC) => Inputs::Exact,
        (Dtype::F32, COMPUTE_32F_FAST_TF32) => Inputs::Tf32,
        (Dtype::F32, COMPUTE_32F_FAST_16F) => Inputs::F16,
        (Dtype::F32, COMPUTE_32F_FAST_16BF) => Inputs::Bf16,
        _ => return Err(BLAS_NOT_SUPPORTED),
    };
    let g = Gemm {
        trans,
        m,
        n,
        k,
        ptr: c.ptr,
        ld,
        stride: c.stride,
        batch,
        dtype,
        inputs,
        // Non-null host pointers, readable per cuBLAS's contract.
        alpha: *c.alpha,
        beta: *c.beta,
    };
    for (i, &ld) in ld.iter().enumerate() {
        if ld < g.stored(i).0.max(1) {
            return Err(BLAS_INVALID_VALUE);
        }
    }
    Ok(g)
}

/// The bytes `[start, start + len)` spanned by `batch` matrices of `rows` × `cols` elements of
/// `es` bytes, columns `ld` apart, matrices `stride` apart, the first at `base`; `None` when
/// they do not fit the address space. `rows`, `cols` and `batch` are not zero.
fn span(
    base: usize,
    (rows, cols): (usize, usize),
    ld: usize,
    stride: i64,
    batch: usize,
    es: usize,
) -> Option<(usize, usize)> {
    let extent = (cols as i128 - 1) * ld as i128 + rows as i128;
    let last = (batch as i128 - 1) * stride as i128;
    let (lo, hi) = (last.min(0), last.max(0) + extent);
    let start = base as i128 + lo * es as i128;
    let len = (hi - lo) * es as i128;
    Some((usize::try_from(start).ok()?, usize::try_from(len).ok()?))
}

/// Checks a GEMM call and enqueues it on the handle's stream.
pub(super) unsafe fn gemm(c: Call) -> Status {
    with_blas(|st| {
        let Some((stream, math)) = handles()
            .get(&(c.handle as usize))
            .map(|h| (h.stream, h.math))
        else {
            return BLAS_NOT_INITIALIZED;
        };
        let g = match check(&c, math) {
            Ok(g) => g,
            Err(s) => return s,
        };
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return BLAS_SUCCESS;
        }
        let Some(stream) = st.stream_id(stream as *mut c_void) else {
            // The handle's stream was destroyed.
            return BLAS_EXECUTION_FAILED;
        };
        let mut ranges = Vec::with_capacity(3);
        for (i, operand) in ["A", "B", "C"].into_iter().enumerate() {
            if i < 2 && !g.reads_ab() {
                continue;
            }
            let (rows, cols) = g.stored(i);
            let es = g.dtype.size();
            let r = span(g.ptr[i], (rows, cols), g.ld[i], g.stride[i], g.batch, es);
            match r.filter(|&(p, len)| st.alloc_of(p, len).is_some()) {
                Some(range) => ranges.push(range),
                None => {
                    let (p, ld, s, b) = (g.ptr[i], g.ld[i], g.stride[i], g.batch);
                    let what = format!(
                        "{}: operand {operand} at {p:#x} ({rows} x {cols}, ld {ld}, {b} \
                         matrices {s} elements apart) is not inside one live allocation",
                        c.name
                    );
                    st.fault(what);
                    return BLAS_EXECUTION_FAILED;
                }
            }
        }
        // SAFETY: every range the product reads or writes lies inside a live allocation whose
        // free is ordered after this op (checked when a free is enqueued).
        let work = Box::new(move || unsafe { run(&g) });
        match st.enqueue(stream, Op::Host { work, ranges }) {
            SUCCESS => BLAS_SUCCESS,
            _ => BLAS_EXECUTION_FAILED,
        }
    })
}

/// Element `idx` of the `t` array at `base`.
unsafe fn load(t: Dtype, base: usize, idx: usize) -> f32 {
    match t {
        Dtype::F32 => std::ptr::read_unaligned((base as *const f32).add(idx)),
        Dtype::F16 => shim_f16_to_f32(std::ptr::read_unaligned((base as *const u16).add(idx))),
        Dtype::Bf16 => shim_bf16_to_f32(std::ptr::read_unaligned((base as *const u16).add(idx))),
    }
}

/// Stores `v`, rounded to `t`, as element `idx` of the `t` array at `base`.
unsafe fn store(t: Dtype, base: usize, idx: usize, v: f32) {
    match t {
        Dtype::F32 => std::ptr::write_unaligned((base as *mut f32).add(idx), v),
        Dtype::F16 => std::ptr::write_unaligned((base as *mut u16).add(idx), shim_f32_to_f16(v)),
        Dtype::Bf16 => std::ptr::write_unaligned((base as *mut u16).add(idx), shim_f32_to_bf16(v)),
    }
}

/// Below this many multiply-adds a product runs on the calling thread, above it on every
/// available one: the twin's rule, so that both call the `gemm` crate alike.
const SERIAL_BELOW: u128 = 1 << 18;

/// Runs the product. The caller guarantees that every range [`gemm`] checked is live.
///
/// The arithmetic is the simulated device's (tidemem's CPU twin): the operands widened to f32
/// in their stored layout (the inputs rounded as the compute type says), `C` read when
/// `beta != 0`, the product by the `gemm` crate as the twin calls it, and `C` rounded once to
/// its type. The twin sees this column-major call as the row-major product
/// `Cᵀ = op(B)ᵀ·op(A)ᵀ` over the same memory (`m` and `n` swapped); the crate is called with
/// that shape and those strides, since its blocking, and so its rounding, depends on both.
unsafe fn run(g: &Gemm) {
    let (m, n, k) = (g.m, g.n, g.k);
    let es = g.dtype.size() as i64;
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let parallelism = if threads <= 1 || (m as u128) * (n as u128) * (k as u128) < SERIAL_BELOW {
        ::gemm::Parallelism::None
    } else {
        ::gemm::Parallelism::Rayon(threads)
    };
    // Operand `i` of the batch member at `base`, widened in its stored layout.
    let widen = |i: usize, base: usize, round: bool| -> Vec<f32> {
        let (rows, cols) = g.stored(i);
        let len = (cols - 1) * g.ld[i] + rows;
        (0..len)
            .map(|x| {
                let v = load(g.dtype, base, x);
                if round {
                    g.inputs.round(v)
                } else {
                    v
                }
            })
            .collect()
    };
    // (row stride, column stride) of the twin's op(B)ᵀ (n × k) and op(A)ᵀ (k × m).
    let lhs = if g.trans[1] {
        (1, g.ld[1])
    } else {
        (g.ld[1], 1)
    };
    let rhs = if g.trans[0] {
        (1, g.ld[0])
    } else {
        (g.ld[0], 1)
    };
    for batch in 0..g.batch as i64 {
        let at = |i: usize| g.ptr[i].wrapping_add_signed((batch * g.stride[i] * es) as isize);
        let cb = at(2);
        if !g.reads_ab() {
            for j in 0..n {
                for i in 0..m {
                    let idx = i + j * g.ld[2];
                    let v = if g.beta == 0.0 {
                        0.0
                    } else {
                        g.beta * load(g.dtype, cb, idx)
                    };
                    store(g.dtype, cb, idx, v);
                }
            }
            continue;
        }
        let (a, b) = (widen(0, at(0), true), widen(1, at(1), true));
        let mut c = if g.beta != 0.0 {
            widen(2, cb, false)
        } else {
            vec![0.0; (n - 1) * g.ld[2] + m]
        };
        // SAFETY: each matrix's last element, (rows - 1)·rs + (cols - 1)·cs, lies within its
        // buffer (the widened extent of the stored operand), and `c` aliases neither input.
        ::gemm::gemm(
            n,
            m,
            k,
            c.as_mut_ptr(),
            1,
            g.ld[2] as isize,
            g.beta != 0.0,
            b.as_ptr(),
            lhs.1 as isize,
            lhs.0 as isize,
            a.as_ptr(),
            rhs.1 as isize,
            rhs.0 as isize,
            // the crate's `dst := alpha·dst + beta·lhs·rhs`
            g.beta,
            g.alpha,
            false,
            false,
            false,
            parallelism,
        );
        for j in 0..n {
            for i in 0..m {
                let idx = i + j * g.ld[2];
                store(g.dtype, cb, idx, c[idx]);
            }
        }
    }
}
