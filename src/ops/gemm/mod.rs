mod cpu;
mod cublas;

use half::{bf16, f16};

use crate::device::kernel::param_layout;
use crate::device::{
    CudaSide, Device, DeviceView, HostOperand, Input, KernelDesc, LaunchInfo, Operand, OperandSpec,
    Stream, TwinArgs,
};
use crate::dtype::DType;
use crate::error::Result;

abi! {
    /// The parameters of a GEMM launch, mirrored by `kernels/gemm.cuh`. Sizes, leading dimensions
    /// and batch strides are in elements.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct GemmParams {
        /// Rows of `op(A)` and of `C`.
        pub m: u64,
        /// Columns of `op(B)` and of `C`.
        pub n: u64,
        /// Columns of `op(A)`, rows of `op(B)`.
        pub k: u64,
        /// Matrices in the batch.
        pub batch: u64,
        /// Leading dimension of `A` as stored (row-major).
        pub lda: u64,
        /// Leading dimension of `B` as stored.
        pub ldb: u64,
        /// Leading dimension of `C`.
        pub ldc: u64,
        /// Elements from one batch's `A` to the next.
        pub stride_a: u64,
        /// Elements from one batch's `B` to the next.
        pub stride_b: u64,
        /// Elements from one batch's `C` to the next.
        pub stride_c: u64,
        /// Scale of the product.
        pub alpha: f32,
        /// Scale of `C`'s old value (0: `C` is not read).
        pub beta: f32,
        /// [`GemmParams::TRANS_A`], [`GemmParams::TRANS_B`], [`GemmParams::TF32`].
        pub flags: u32,
        /// Zero.
        pub pad: u32,
    }
}

impl GemmParams {
    /// `op(A) = Aᵀ`: `A` is stored `k × m`.
    pub const TRANS_A: u32 = 1;
    /// `op(B) = Bᵀ`: `B` is stored `n × k`.
    pub const TRANS_B: u32 = 2;
    /// f32 operands may be multiplied as TF32 (cuBLAS `COMPUTE_32F_FAST_TF32`).
    pub const TF32: u32 = 4;

    fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }
}

/// The shape and scalars of a GEMM: see [`gemm()`]. Built with [`Gemm::new`] and the
/// builder methods; defaults are no transposes, `alpha = 1`, `beta = 0`, packed leading
/// dimensions, one batch, no TF32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
    batch: usize,
    strides: Option<[usize; 3]>,
    ld: Option<[usize; 3]>,
    tf32: bool,
}

impl Gemm {
    /// `C (m × n) = op(A) (m × k) · op(B) (k × n)`.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Gemm {
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
            beta: 0.0,
            batch: 1,
            strides: None,
            ld: None,
            tf32: false,
        }
    }
    /// Whether `A` is used transposed (stored `k × m`).
    pub fn trans_a(mut self, t: bool) -> Self {
        self.trans_a = t;
        self
    }
    /// Whether `B` is used transposed (stored `n × k`, as a weight `out × in` for `x·Wᵀ`).
    pub fn trans_b(mut self, t: bool) -> Self {
        self.trans_b = t;
        self
    }
    /// The scale of the product.
    pub fn alpha(mut self, alpha: f32) -> Self {
        self.alpha = alpha;
        self
    }
    /// The scale of `C`'s old value; 0 (the default) means `C` is not read.
    pub fn beta(mut self, beta: f32) -> Self {
        self.beta = beta;
        self
    }
    /// `batch` products, each operand's next matrix `stride_*` elements after the previous
    /// (0: the same matrix for every batch; `C`'s batches may not overlap).
    pub fn batched(
        mut self,
        batch: usize,
        stride_a: usize,
        stride_b: usize,
        stride_c: usize,
    ) -> Self {
        self.batch = batch;
        self.strides = Some([stride_a, stride_b, stride_c]);
        self
    }
    /// Leading dimensions of `A`, `B` and `C` as stored (row-major: elements from a row to the
    /// next, at least the stored row length).
    pub fn ld(mut self, lda: usize, ldb: usize, ldc: usize) -> Self {
        self.ld = Some([lda, ldb, ldc]);
        self
    }
    /// Whether f32 operands may be multiplied as TF32 (10-bit mantissas, f32 accumulation):
    /// faster on tensor cores, about 3 decimal digits per product. Refused for f16 and bf16.
    /// The CPU twin rounds the inputs to TF32 too (to nearest, ties away from zero), so the
    /// simulated device sees the GPU's precision.
    pub fn tf32(mut self, on: bool) -> Self {
        self.tf32 = on;
        self
    }

    /// `[rows, cols]` of `A`, `B` and `C` as stored.
    fn stored(&self) -> [[usize; 2]; 3] {
        let (m, n, k) = (self.m, self.n, self.k);
        [
            if self.trans_a { [k, m] } else { [m, k] },
            if self.trans_b { [n, k] } else { [k, n] },
            [m, n],
        ]
    }

    abi! {
        /// The launch parameters: leading dimensions and strides resolved (packed by default: the
        /// row length, at least 1; a matrix's rows × its leading dimension).
        fn params(&self) -> GemmParams {
            let shapes = self.stored();
            let ld = self
                .ld
                .unwrap_or_else(|| shapes.map(|[_, cols]| cols.max(1)));
            let strides = self
                .strides
                .unwrap_or_else(|| [0, 1, 2].map(|i| shapes[i][0].saturating_mul(ld[i])));
            let flags = (self.trans_a as u32 * GemmParams::TRANS_A)
                | (self.trans_b as u32 * GemmParams::TRANS_B)
                | (self.tf32 as u32 * GemmParams::TF32);
            let u = |x: usize| x as u64;
            GemmParams {
                m: u(self.m),
                n: u(self.n),
                k: u(self.k),
                batch: u(self.batch),
                lda: u(ld[0]),
                ldb: u(ld[1]),
                ldc: u(ld[2]),
                stride_a: u(strides[0]),
                stride_b: u(strides[1]),
                stride_c: u(strides[2]),
                alpha: self.alpha,
                beta: self.beta,
                flags,
                pad: 0,
            }
        }
    }
}

abi! {
    /// The GEMM: `a` and `b` read, `c` read and written, one element type (f32, f16 or bf16).
    static GEMM: KernelDesc = KernelDesc {
        name: "gemm",
        operands: &[
            OperandSpec::read("a", FLOATS),
            OperandSpec::read("b", FLOATS),
            OperandSpec::read_write("c", FLOATS),
        ],
        params: param_layout!(
            GemmParams,
            "gemm.cuh",
            [m, n, k, batch, lda, ldb, ldc, stride_a, stride_b, stride_c, alpha, beta, flags, pad]
        ),
        check: Some(check),
        twin: cpu::twin,
        cuda: CudaSide::Library(cublas::call),
    };
}

const FLOATS: &[DType] = &DType::FLOATS;

/// The largest size, batch count or leading dimension cuBLAS takes (its `int`).
const INT_MAX: u64 = i32::MAX as u64;

/// One stored operand of a launch: its shape, leading dimension and batch stride.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    name: &'static str,
    rows: u64,
    cols: u64,
    ld: u64,
    stride: u64,
}

impl Layout {
    /// `A`, `B`, `C` of `p`.
    pub(crate) fn of(p: &GemmParams) -> [Layout; 3] {
        let (ta, tb) = (p.has(GemmParams::TRANS_A), p.has(GemmParams::TRANS_B));
        let l = |name, [rows, cols]: [u64; 2], ld, stride| Layout {
            name,
            rows,
            cols,
            ld,
            stride,
        };
        [
            l(
                "a",
                if ta { [p.k, p.m] } else { [p.m, p.k] },
                p.lda,
                p.stride_a,
            ),
            l(
                "b",
                if tb { [p.n, p.k] } else { [p.k, p.n] },
                p.ldb,
                p.stride_b,
            ),
            l("c", [p.m, p.n], p.ldc, p.stride_c),
        ]
    }

    /// Elements from the first batch's first element to the last batch's last one, plus one
    /// (0 for an empty matrix or batch); `None` past `u64`.
    pub(crate) fn extent(&self, batch: u64) -> Option<u64> {
        if self.rows == 0 || self.cols == 0 || batch == 0 {
            return Some(0);
        }
        let one = (self.rows - 1)
            .checked_mul(self.ld)?
            .checked_add(self.cols)?;
        (batch - 1).checked_mul(self.stride)?.checked_add(one)
    }

    fn describe(&self, batch: u64) -> String {
        format!(
            "operand `{}` ([rows, cols] = [{}, {}], ld {}, stride {}, batch {})",
            self.name, self.rows, self.cols, self.ld, self.stride, batch
        )
    }
}

/// The shape check of a launch with operand element types `dtypes` and lengths `lens` (in
/// elements).
pub(crate) fn check_shapes(
    p: &GemmParams,
    dtypes: [Option<DType>; 3],
    lens: [usize; 3],
) -> Result<()> {
    let err = |reason: String| GEMM.error(reason);
    if dtypes[1] != dtypes[0] || dtypes[2] != dtypes[0] {
        let name = |d: Option<DType>| d.map_or("absent", |d| d.name());
        return Err(err(format!(
            "a, b and c must have one element type; they are {}, {} and {}",
            name(dtypes[0]),
            name(dtypes[1]),
            name(dtypes[2])
        )));
    }
    let known = GemmParams::TRANS_A | GemmParams::TRANS_B | GemmParams::TF32;
    if p.flags & !known != 0 || p.pad != 0 {
        return Err(err(format!(
            "unknown flags {:#x} (pad {}) in the parameters",
            p.flags & !known,
            p.pad
        )));
    }
    if p.has(GemmParams::TF32) && dtypes[0] != Some(DType::F32) {
        return Err(err(format!(
            "TF32 applies to f32 operands only; these are {}",
            dtypes[0].map_or("absent", |d| d.name())
        )));
    }
    for (what, v) in [("m", p.m), ("n", p.n), ("k", p.k), ("batch", p.batch)] {
        if v > INT_MAX {
            return Err(err(format!(
                "{what} = {v} exceeds {INT_MAX} (cuBLAS's int)"
            )));
        }
    }
    let layouts = Layout::of(p);
    for (l, &len) in layouts.iter().zip(&lens) {
        if l.ld < l.cols.max(1) || l.ld > INT_MAX {
            return Err(err(format!(
                "{}: the leading dimension must be at least the row length {} (and 1) and at \
                 most {INT_MAX}",
                l.describe(p.batch),
                l.cols
            )));
        }
        match l.extent(p.batch) {
            Some(need) if need <= len as u64 => {}
            need => {
                let need = need.map_or("more than 2^64".into(), |n| n.to_string());
                return Err(err(format!(
                    "{} needs {need} elements, the view holds {len}",
                    l.describe(p.batch)
                )));
            }
        }
    }
    check_disjoint_batches(p, &layouts[2])
}

/// `C`'s batches are written concurrently: refuse strides under which they share elements.
/// Accepted are batches one after another (each stride at least one matrix's extent) and
/// batches side by side within the rows (each stride at least the row length, all of them
/// within one leading dimension).
fn check_disjoint_batches(p: &GemmParams, c: &Layout) -> Result<()> {
    if p.batch <= 1 || c.rows == 0 || c.cols == 0 {
        return Ok(());
    }
    let one = c.extent(1).unwrap_or(u64::MAX);
    let side_by_side = c.stride >= c.cols
        && (p.batch - 1)
            .checked_mul(c.stride)
            .and_then(|s| s.checked_add(c.cols))
            .is_some_and(|end| end <= c.ld);
    if c.stride >= one || side_by_side {
        return Ok(());
    }
    Err(GEMM.error(format!(
        "{}: the batches of c overlap (a stride of at least {one} elements, one matrix, or \
         batches side by side within the leading dimension are needed)",
        c.describe(p.batch)
    )))
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: GemmParams = info.params()?;
    check_shapes(
        &p,
        [info.dtype(0), info.dtype(1), info.dtype(2)],
        [0, 1, 2].map(|i| info.len(i)),
    )
}

/// General matrix multiply: `C[b] = alpha·op(A[b])·op(B[b]) + beta·C[b]` for each `b` of a
/// strided batch, on row-major f32, f16 or bf16 matrices with f32 accumulation.
///
/// A [`Gemm`] describes the shapes: `op(A)` is `m × k`, `op(B)` is `k × n`, `C` is `m × n`;
/// `op(X)` is `X` or its transpose. Matrices are row-major with a leading dimension (elements
/// from one row to the next, at least the row length; packed by default), and batch `b` of an
/// operand starts `b · stride` elements into its view (a stride of 0 broadcasts one matrix to
/// every batch, as a weight shared by a batch of inputs). `beta == 0` means `C` is not read (a
/// NaN there does not propagate), and `alpha == 0` or `k == 0` means `A` and `B` are not read
/// (`C = beta·C`), as in BLAS. TF32 is used only when asked ([`Gemm::tf32`], f32 only).
///
/// [`gemm()`] launches it on a device: CUDA calls cuBLAS (`cublasGemmStridedBatchedEx` with
/// `CUBLAS_COMPUTE_32F`, on the stream; see `cublas.rs`), the simulated device runs the CPU
/// twin (the `gemm` crate, wrapped once in `cpu.rs`). [`gemm_host`] runs the twin on host
/// slices. Every operand's extent is checked against its view before anything runs: a bad
/// shape is an [`Error::Operands`](crate::Error::Operands) naming the operand, its shape and the elements it
/// needs, and nothing is written.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::Gemm;
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// // x: 2×3, w: 2×3 (a weight stored out × in), y = x·wᵀ: 2×2
/// let x = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]))?;
/// let w = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 0.0, 0.0, 0.0, 1.0, 1.0]))?;
/// let y = dev.alloc(16)?;
/// tidemem::ops::gemm(&dev, &s, &Gemm::new(2, 2, 3).trans_b(true), &x, &w, &y, DType::F32)?;
/// let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
/// assert_eq!(y, [1.0, 5.0, 4.0, 11.0]);
/// # Ok(()) }
/// ```
///
/// `C[b] = alpha·op(A[b])·op(B[b]) + beta·C[b]` on `stream` (see [`gemm()`]): `a`, `b`
/// and `c` hold `dtype` elements (f32, f16 or bf16), laid out as `g` says; `c` overlaps neither
/// input. Shapes are checked before anything is enqueued.
pub fn gemm<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    g: &Gemm,
    a: impl Into<Input<'a>>,
    b: impl Into<Input<'b>>,
    c: impl Into<DeviceView<'c>>,
    dtype: DType,
) -> Result<()> {
    let p = g.params();
    let ops = [
        Some(Operand::input(a, dtype)),
        Some(Operand::input(b, dtype)),
        Some(Operand::new(c, dtype)),
    ];
    dev.launch(stream, &GEMM, &ops, bytemuck::bytes_of(&p))
}

/// Element types [`gemm_host`] takes: f32, f16 and bf16.
pub trait GemmElem: bytemuck::Pod + sealed::Sealed {
    /// The element type.
    const DTYPE: DType;
}
impl GemmElem for f32 {
    const DTYPE: DType = DType::F32;
}
impl GemmElem for f16 {
    const DTYPE: DType = DType::F16;
}
impl GemmElem for bf16 {
    const DTYPE: DType = DType::BF16;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// The GEMM of [`gemm()`] on host slices, computed by the CPU twin (what the simulated device
/// runs), with the same shape checks: on an error nothing is written.
pub fn gemm_host<T: GemmElem>(g: &Gemm, a: &[T], b: &[T], c: &mut [T]) -> Result<()> {
    let p = g.params();
    let mut args = TwinArgs::new(
        &GEMM,
        vec![
            HostOperand::Read(bytemuck::cast_slice(a), T::DTYPE),
            HostOperand::Read(bytemuck::cast_slice(b), T::DTYPE),
            HostOperand::Write(bytemuck::cast_slice_mut(c), T::DTYPE),
        ],
        bytemuck::bytes_of(&p),
    )?;
    cpu::twin(&mut args)
}

/// Whether cuBLAS can be loaded here (checked once): the CUDA side of [`gemm()`] needs it, and
/// answers [`Error::BackendUnavailable`](crate::Error::BackendUnavailable) without it.
pub fn cublas_available() -> bool {
    cublas::available().is_ok()
}

/// The number of cuBLAS handles alive in this process (one per CUDA stream that has run a GEMM
/// and not been dropped). For tests that check handles are freed with their streams.
#[doc(hidden)]
pub fn cublas_live_handles() -> usize {
    cublas::live_handles()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_packed_and_one_batch() {
        let p = Gemm::new(3, 4, 5).trans_b(true).params();
        assert_eq!((p.lda, p.ldb, p.ldc), (5, 5, 4));
        assert_eq!((p.stride_a, p.stride_b, p.stride_c), (15, 20, 12));
        assert_eq!((p.batch, p.alpha, p.beta), (1, 1.0, 0.0));
        assert_eq!(p.flags, GemmParams::TRANS_B);
        // An empty row still has a leading dimension of 1, as cuBLAS requires.
        let p = Gemm::new(3, 4, 0).trans_a(true).tf32(true).params();
        assert_eq!((p.lda, p.ldb, p.ldc), (3, 4, 4));
        assert_eq!(p.flags, GemmParams::TRANS_A | GemmParams::TF32);
    }

    #[test]
    fn extents_cover_the_last_batch_and_refuse_overflow() {
        let l = Layout {
            name: "a",
            rows: 3,
            cols: 4,
            ld: 6,
            stride: 100,
        };
        assert_eq!(l.extent(1), Some(16));
        assert_eq!(l.extent(3), Some(216));
        assert_eq!(l.extent(0), Some(0));
        let wide = Layout {
            ld: u64::MAX / 2,
            ..l
        };
        assert_eq!(wide.extent(1), None);
    }

    #[test]
    fn the_shape_check_names_operand_shape_and_sizes() {
        let p = Gemm::new(2, 3, 4).ld(4, 5, 3).params();
        let f = Some(DType::F32);
        check_shapes(&p, [f; 3], [8, 18, 6]).unwrap();
        let e = check_shapes(&p, [f; 3], [8, 17, 6])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gemm: operand `b` ([rows, cols] = [4, 3], ld 5, stride 20, batch 1)")
                && e.contains("needs 18 elements, the view holds 17"),
            "{e}"
        );
        let e = check_shapes(&p, [f, Some(DType::F16), f], [8, 18, 6]).unwrap_err();
        assert!(e.to_string().contains("one element type"), "{e}");
        let mut bad = p;
        bad.flags |= 8;
        assert!(check_shapes(&bad, [f; 3], [8, 18, 6]).is_err());
    }
}
