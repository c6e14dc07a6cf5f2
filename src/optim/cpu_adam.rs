//! The CPU Adam: one pass over flat slices that reads the fp32 parameter, momentum and variance
//! and the gradient (fp32, fp16 or bf16), and writes the parameter, momentum, variance and,
//! optionally, an fp16/bf16 copy of the new parameter, in the same pass. The copy may replace
//! the gradient in place (the parameter chunk that held the gradient gets the new value), which
//! is what a chunked mixed-precision step wants.
//!
//! Three code paths, chosen at run time: AVX-512 (16 lanes), AVX2 with FMA and F16C (8 lanes),
//! and a scalar loop that also serves other architectures. The two vector paths run one generic
//! body over a small lane trait, and the scalar loop performs the same operations in the same
//! order (fused multiply-adds through `f32::mul_add`, which is fast where the target has FMA and
//! exact everywhere), so every path gives bitwise identical results. Large slices are split over
//! threads; the split never changes a result.
//!
//! ```
//! use tidemem::optim::{AdamConfig, CpuAdam, Grad, ParamCopy};
//! # fn main() -> tidemem::Result<()> {
//! let adam = CpuAdam::new();
//! let s = AdamConfig::adamw(1e-3, 0.01).scalars(1, 1.0 / 1024.0)?;
//! let (mut p, mut m, mut v) = (vec![1.0f32; 100], vec![0.0f32; 100], vec![0.0f32; 100]);
//! let g = vec![half::f16::from_f32(512.0); 100]; // gradients under a loss scale of 1024
//! let mut p16 = vec![half::f16::ZERO; 100];
//! adam.step(&s, &mut p, &mut m, &mut v, Grad::F16(&g), ParamCopy::F16(&mut p16))?;
//! assert!(p[0] < 1.0 && p16[0] == half::f16::from_f32(p[0]));
//! # Ok(()) }
//! ```

use half::{bf16, f16};
use serde::Serialize;

use super::adam::AdamScalars;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// An instruction-set path of the CPU kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Isa {
    /// AVX-512F (+BW), 16 lanes.
    Avx512,
    /// AVX2 with FMA and F16C, 8 lanes.
    Avx2,
    /// Plain Rust, one element at a time.
    Scalar,
}

impl Isa {
    /// Every path, fastest first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Scalar];

    /// The fastest path this CPU supports.
    pub fn detect() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Scalar)
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Lowercase name (`avx512`, `avx2`, `scalar`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Scalar => "scalar",
        }
    }

    /// Parses a name given by [`Isa::name`].
    pub fn parse(s: &str) -> Result<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown instruction set '{s}'")))
    }
}

/// A gradient slice.
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    /// fp32 gradients.
    F32(&'a [f32]),
    /// fp16 gradients.
    F16(&'a [f16]),
    /// bf16 gradients.
    Bf16(&'a [bf16]),
}

impl Grad<'_> {
    fn len(&self) -> usize {
        match self {
            Grad::F32(g) => g.len(),
            Grad::F16(g) => g.len(),
            Grad::Bf16(g) => g.len(),
        }
    }

    fn raw(&self) -> (RawKind, *const u8) {
        match self {
            Grad::F32(g) => (RawKind::F32, g.as_ptr().cast()),
            Grad::F16(g) => (RawKind::F16, g.as_ptr().cast()),
            Grad::Bf16(g) => (RawKind::Bf16, g.as_ptr().cast()),
        }
    }
}

/// Where the low-precision copy of the updated parameters goes.
#[derive(Debug)]
pub enum ParamCopy<'a> {
    /// No copy.
    None,
    /// fp16 copy.
    F16(&'a mut [f16]),
    /// bf16 copy.
    Bf16(&'a mut [bf16]),
}

/// A low-precision slice that holds the gradient and receives the updated parameter.
#[derive(Debug)]
pub enum GradInPlace<'a> {
    /// fp16.
    F16(&'a mut [f16]),
    /// bf16.
    Bf16(&'a mut [bf16]),
}

/// Element type at a raw pointer (the kernels' view of a slice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RawKind {
    F32,
    F16,
    Bf16,
}

impl RawKind {
    pub(crate) fn of(d: DType) -> RawKind {
        match d {
            DType::F32 => RawKind::F32,
            DType::F16 => RawKind::F16,
            DType::BF16 => RawKind::Bf16,
        }
    }
}

/// The operands of one step as raw pointers: `n` elements at each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawStep {
    pub n: usize,
    pub p: *mut f32,
    pub m: *mut f32,
    pub v: *mut f32,
    pub grad: (RawKind, *const u8),
    /// The copy (`F16` or `Bf16`), or `None`. May equal the gradient pointer exactly.
    pub copy: Option<(RawKind, *mut u8)>,
}

// SAFETY: a RawStep is only built from slices (or device memory) that the caller keeps
// exclusively for the duration of the step; the threads it is split over touch disjoint ranges.
unsafe impl Send for RawStep {}
unsafe impl Sync for RawStep {}

impl RawStep {
    /// The sub-range `lo..hi`.
    fn range(&self, lo: usize, hi: usize) -> RawStep {
        let at = |k: RawKind, ptr: *const u8| -> *const u8 {
            let es = if k == RawKind::F32 { 4 } else { 2 };
            ptr.wrapping_add(lo * es)
        };
        RawStep {
            n: hi - lo,
            p: self.p.wrapping_add(lo),
            m: self.m.wrapping_add(lo),
            v: self.v.wrapping_add(lo),
            grad: (self.grad.0, at(self.grad.0, self.grad.1)),
            copy: self.copy.map(|(k, ptr)| (k, at(k, ptr) as *mut u8)),
        }
    }
}

/// Slices shorter than this per thread run on one thread.
const MIN_PER_THREAD: usize = 1 << 16;

/// The CPU Adam: a chosen instruction-set path and a thread count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuAdam {
    isa: Isa,
    threads: usize,
}

impl Default for CpuAdam {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuAdam {
    /// The fastest path on this CPU, one thread per available core.
    pub fn new() -> Self {
        CpuAdam {
            isa: Isa::detect(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }

    /// Forces `isa`; an error if this CPU cannot run it.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        if !isa.is_supported() {
            return Err(Error::InvalidArgument(format!(
                "this CPU cannot run the {} path",
                isa.name()
            )));
        }
        self.isa = isa;
        Ok(self)
    }

    /// Uses up to `threads` threads (at least 1).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// The path in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The thread count.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// One step over `params`, `momentum`, `variance` with `grad`, writing `copy` when asked.
    /// Every slice must have the same length.
    pub fn step(
        &self,
        s: &AdamScalars,
        params: &mut [f32],
        momentum: &mut [f32],
        variance: &mut [f32],
        grad: Grad<'_>,
        copy: ParamCopy<'_>,
    ) -> Result<()> {
        let n = params.len();
        let copy = match copy {
            ParamCopy::None => None,
            ParamCopy::F16(c) => Some((RawKind::F16, c.len(), c.as_mut_ptr().cast::<u8>())),
            ParamCopy::Bf16(c) => Some((RawKind::Bf16, c.len(), c.as_mut_ptr().cast::<u8>())),
        };
        check_lengths(
            n,
            &[
                momentum.len(),
                variance.len(),
                grad.len(),
                copy.map_or(n, |c| c.1),
            ],
        )?;
        let raw = RawStep {
            n,
            p: params.as_mut_ptr(),
            m: momentum.as_mut_ptr(),
            v: variance.as_mut_ptr(),
            grad: grad.raw(),
            copy: copy.map(|(k, _, p)| (k, p)),
        };
        // SAFETY: every pointer covers `n` elements of its type; the mutable ones come from
        // distinct `&mut` slices (so they alias nothing), and the gradient is a shared slice that
        // the copy, a distinct `&mut`, cannot overlap.
        unsafe { self.run(s, raw) };
        Ok(())
    }

    /// One step whose low-precision gradient is replaced by the updated parameter in the same
    /// pass (each element is read before it is written).
    pub fn step_in_place(
        &self,
        s: &AdamScalars,
        params: &mut [f32],
        momentum: &mut [f32],
        variance: &mut [f32],
        grad: GradInPlace<'_>,
    ) -> Result<()> {
        let n = params.len();
        let (k, len, ptr) = match grad {
            GradInPlace::F16(g) => (RawKind::F16, g.len(), g.as_mut_ptr().cast::<u8>()),
            GradInPlace::Bf16(g) => (RawKind::Bf16, g.len(), g.as_mut_ptr().cast::<u8>()),
        };
        check_lengths(n, &[momentum.len(), variance.len(), len])?;
        let raw = RawStep {
            n,
            p: params.as_mut_ptr(),
            m: momentum.as_mut_ptr(),
            v: variance.as_mut_ptr(),
            grad: (k, ptr),
            copy: Some((k, ptr)),
        };
        // SAFETY: as in `step`; the gradient and the copy are the same slice, which the kernels
        // allow (every element is loaded before the same element is stored).
        unsafe { self.run(s, raw) };
        Ok(())
    }

    /// Runs `raw`, split over the configured threads.
    ///
    /// # Safety
    /// Every pointer of `raw` must be valid for `raw.n` elements of its type and not accessed by
    /// anything else during the call; the copy may equal the gradient pointer exactly but must
    /// not otherwise overlap any operand.
    pub(crate) unsafe fn run(&self, s: &AdamScalars, raw: RawStep) {
        let parts = self.threads.min(raw.n / MIN_PER_THREAD).max(1);
        if parts == 1 {
            // SAFETY: forwarded contract.
            unsafe { run_on(self.isa, s, raw) };
            return;
        }
        // split on 64-element boundaries (a cache line of fp32 and of 16-bit values)
        let per = raw.n.div_ceil(parts).div_ceil(64) * 64;
        std::thread::scope(|scope| {
            let mut lo = per.min(raw.n);
            while lo < raw.n {
                let hi = (lo + per).min(raw.n);
                let part = raw.range(lo, hi);
                let isa = self.isa;
                // SAFETY: disjoint sub-ranges of the caller's operands.
                scope.spawn(move || unsafe { run_on(isa, s, part) });
                lo = hi;
            }
            // SAFETY: the first sub-range, on this thread.
            unsafe { run_on(self.isa, s, raw.range(0, per.min(raw.n))) };
        });
    }
}

fn check_lengths(n: usize, others: &[usize]) -> Result<()> {
    match others.iter().find(|&&l| l != n) {
        Some(&l) => Err(Error::InvalidArgument(format!(
            "Adam operands differ in length: {n} parameters, an operand of {l}"
        ))),
        None => Ok(()),
    }
}

/// Runs one path over `raw` on this thread.
///
/// # Safety
/// As [`CpuAdam::run`]; `isa` must be supported by this CPU.
pub(crate) unsafe fn run_on(isa: Isa, s: &AdamScalars, raw: RawStep) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the path (checked by `CpuAdam::with_isa` / `Isa::detect`).
        Isa::Avx512 => unsafe { x86::adam_avx512(s, raw) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::adam_avx2(s, raw) },
        // SAFETY: forwarded contract.
        _ => unsafe { adam_scalar(s, raw) },
    }
}

/// The scalar path.
///
/// # Safety
/// As [`CpuAdam::run`].
unsafe fn adam_scalar(s: &AdamScalars, raw: RawStep) {
    for i in 0..raw.n {
        // SAFETY: `i < n` and every pointer covers `n` elements; each element is read before
        // it is written, so a copy that equals the gradient is fine.
        unsafe {
            let g = match raw.grad.0 {
                RawKind::F32 => *raw.grad.1.cast::<f32>().add(i),
                RawKind::F16 => f16::from_bits(*raw.grad.1.cast::<u16>().add(i)).to_f32(),
                RawKind::Bf16 => bf16::from_bits(*raw.grad.1.cast::<u16>().add(i)).to_f32(),
            };
            let (p, m, v) = (&mut *raw.p.add(i), &mut *raw.m.add(i), &mut *raw.v.add(i));
            // the vector paths' operations, fused where they fuse, so every path gives the
            // same bits (`mul_add` rounds once)
            let g = s.l2.mul_add(*p, g * s.grad_scale);
            *m = s.beta1.mul_add(*m, s.one_minus_beta1 * g);
            *v = s.beta2.mul_add(*v, s.one_minus_beta2 * (g * g));
            let d = v.sqrt().mul_add(s.inv_sqrt_bc2, s.eps);
            *p -= s.decoupled.mul_add(*p, s.step_size * (*m / d));
            match raw.copy {
                Some((RawKind::F16, c)) => *c.cast::<u16>().add(i) = f16::from_f32(*p).to_bits(),
                Some((RawKind::Bf16, c)) => *c.cast::<u16>().add(i) = bf16::from_f32(*p).to_bits(),
                _ => {}
            }
        }
    }
}

/// Squared L2 norm and finiteness of a gradient slice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct GradStats {
    /// Sum of squares (of the values as stored, before any unscaling).
    pub sum_sq: f64,
    /// Whether an element is infinite or NaN.
    pub nonfinite: bool,
}

impl GradStats {
    /// Combines two partial results (in a fixed order, so combining is deterministic).
    pub fn merge(self, o: GradStats) -> GradStats {
        GradStats {
            sum_sq: self.sum_sq + o.sum_sq,
            nonfinite: self.nonfinite || o.nonfinite,
        }
    }
}

/// The statistics of `n` elements of type `kind` at `ptr`: squares summed in f64, in blocks of
/// 256 consecutive elements (each block summed in order), so the result does not depend on the
/// instruction set.
///
/// # Safety
/// `ptr` must be valid for `n` elements of `kind`.
pub(crate) unsafe fn grad_stats_raw(kind: RawKind, ptr: *const u8, n: usize) -> GradStats {
    let mut sum = 0.0f64;
    let mut nonfinite = false;
    let mut buf = [0.0f32; 256];
    let mut lo = 0;
    while lo < n {
        let len = (n - lo).min(256);
        // SAFETY: `lo + len <= n`.
        unsafe {
            match kind {
                RawKind::F32 => buf[..len]
                    .copy_from_slice(std::slice::from_raw_parts(ptr.cast::<f32>().add(lo), len)),
                RawKind::F16 => {
                    use half::slice::HalfFloatSliceExt;
                    std::slice::from_raw_parts(ptr.cast::<f16>().add(lo), len)
                        .convert_to_f32_slice(&mut buf[..len])
                }
                RawKind::Bf16 => {
                    use half::slice::HalfFloatSliceExt;
                    std::slice::from_raw_parts(ptr.cast::<bf16>().add(lo), len)
                        .convert_to_f32_slice(&mut buf[..len])
                }
            }
        }
        let mut block = 0.0f64;
        for &x in &buf[..len] {
            let x = x as f64;
            block += x * x;
        }
        nonfinite |= !block.is_finite();
        sum += block;
        lo += len;
    }
    GradStats {
        sum_sq: sum,
        nonfinite,
    }
}

/// The statistics of a gradient slice (see [`GradStats`]).
pub fn grad_stats(grad: Grad<'_>) -> GradStats {
    let (k, p) = grad.raw();
    // SAFETY: the slice covers `len` elements of its type.
    unsafe { grad_stats_raw(k, p, grad.len()) }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The vector paths: one generic body over [`Lanes`], instantiated for AVX2 and AVX-512
    //! inside `#[target_feature]` functions.
    use std::arch::x86_64::*;

    use super::{AdamScalars, RawKind, RawStep};

    /// The vector operations the body needs. Every method is `unsafe` because it requires its
    /// target features (guaranteed by the caller of the `#[target_feature]` entry points) and,
    /// for loads and stores, valid pointers for `N` elements.
    pub(super) trait Lanes: Copy {
        const N: usize;
        unsafe fn splat(x: f32) -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(self, p: *mut f32);
        unsafe fn load_f16(p: *const u16) -> Self;
        unsafe fn store_f16(self, p: *mut u16);
        unsafe fn load_bf16(p: *const u16) -> Self;
        unsafe fn store_bf16(self, p: *mut u16);
        unsafe fn sub(self, o: Self) -> Self;
        unsafe fn mul(self, o: Self) -> Self;
        unsafe fn div(self, o: Self) -> Self;
        unsafe fn sqrt(self) -> Self;
        /// `self · b + c`, rounded once.
        unsafe fn fma(self, b: Self, c: Self) -> Self;
    }

    #[derive(Clone, Copy)]
    pub(super) struct V8(__m256);
    #[derive(Clone, Copy)]
    pub(super) struct V16(__m512);

    impl Lanes for V8 {
        const N: usize = 8;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn splat(x: f32) -> Self {
            V8(_mm256_set1_ps(x))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: caller contract (8 valid elements).
            V8(unsafe { _mm256_loadu_ps(p) })
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: caller contract.
            unsafe { _mm256_storeu_ps(p, self.0) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load_f16(p: *const u16) -> Self {
            // SAFETY: caller contract.
            V8(_mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) }))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn store_f16(self, p: *mut u16) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0);
            // SAFETY: caller contract.
            unsafe { _mm_storeu_si128(p.cast(), h) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load_bf16(p: *const u16) -> Self {
            // SAFETY: caller contract.
            let h = unsafe { _mm_loadu_si128(p.cast()) };
            V8(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                _mm256_cvtepu16_epi32(h),
            )))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn store_bf16(self, p: *mut u16) {
            let x = _mm256_castps_si256(self.0);
            // round to nearest even: add 0x7fff plus the lowest kept bit, keep the top half
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
                _mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                lsb,
            ));
            // NaN: keep the top half and set the quiet bit
            let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
            let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
            let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
            let r = _mm256_blendv_epi8(rounded, quiet, nan);
            // values fit 16 bits: pack without saturation effects, then gather the two lanes
            let packed = _mm256_packus_epi32(r, r);
            let ordered = _mm256_permute4x64_epi64::<0b1000>(packed);
            // SAFETY: caller contract.
            unsafe { _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(ordered)) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sub(self, o: Self) -> Self {
            V8(_mm256_sub_ps(self.0, o.0))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn mul(self, o: Self) -> Self {
            V8(_mm256_mul_ps(self.0, o.0))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn div(self, o: Self) -> Self {
            V8(_mm256_div_ps(self.0, o.0))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sqrt(self) -> Self {
            V8(_mm256_sqrt_ps(self.0))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn fma(self, b: Self, c: Self) -> Self {
            V8(_mm256_fmadd_ps(self.0, b.0, c.0))
        }
    }

    impl Lanes for V16 {
        const N: usize = 16;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn splat(x: f32) -> Self {
            V16(_mm512_set1_ps(x))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: caller contract (16 valid elements).
            V16(unsafe { _mm512_loadu_ps(p) })
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: caller contract.
            unsafe { _mm512_storeu_ps(p, self.0) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn load_f16(p: *const u16) -> Self {
            // SAFETY: caller contract.
            V16(_mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) }))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn store_f16(self, p: *mut u16) {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self.0);
            // SAFETY: caller contract.
            unsafe { _mm256_storeu_si256(p.cast(), h) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn load_bf16(p: *const u16) -> Self {
            // SAFETY: caller contract.
            let h = unsafe { _mm256_loadu_si256(p.cast()) };
            V16(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                _mm512_cvtepu16_epi32(h),
            )))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn store_bf16(self, p: *mut u16) {
            let x = _mm512_castps_si512(self.0);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
                _mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)),
                lsb,
            ));
            let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
            let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff));
            let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
            let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
            // SAFETY: caller contract.
            unsafe { _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(r)) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn sub(self, o: Self) -> Self {
            V16(_mm512_sub_ps(self.0, o.0))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn mul(self, o: Self) -> Self {
            V16(_mm512_mul_ps(self.0, o.0))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn div(self, o: Self) -> Self {
            V16(_mm512_div_ps(self.0, o.0))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn sqrt(self) -> Self {
            V16(_mm512_sqrt_ps(self.0))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn fma(self, b: Self, c: Self) -> Self {
            V16(_mm512_fmadd_ps(self.0, b.0, c.0))
        }
    }

    /// The scalars, broadcast once per call.
    #[derive(Clone, Copy)]
    struct Consts<V> {
        gs: V,
        l2: V,
        b1: V,
        omb1: V,
        b2: V,
        omb2: V,
        ibc2: V,
        eps: V,
        decay: V,
        step: V,
    }

    /// One vector of elements at `i`.
    ///
    /// # Safety
    /// `N` elements from `i` are valid at every pointer of `raw`; target features present.
    #[inline(always)]
    unsafe fn block<V: Lanes, const G: u8, const C: u8>(c: &Consts<V>, raw: &RawStep, i: usize) {
        // SAFETY: caller contract; the gradient is loaded before the copy is stored.
        unsafe {
            let g = match G {
                0 => V::load(raw.grad.1.cast::<f32>().add(i)),
                1 => V::load_f16(raw.grad.1.cast::<u16>().add(i)),
                _ => V::load_bf16(raw.grad.1.cast::<u16>().add(i)),
            };
            let p = V::load(raw.p.add(i));
            let m = V::load(raw.m.add(i));
            let v = V::load(raw.v.add(i));
            let g = c.l2.fma(p, g.mul(c.gs));
            let m = c.b1.fma(m, c.omb1.mul(g));
            let v = c.b2.fma(v, c.omb2.mul(g.mul(g)));
            let d = v.sqrt().fma(c.ibc2, c.eps);
            let p = p.sub(c.decay.fma(p, c.step.mul(m.div(d))));
            p.store(raw.p.add(i));
            m.store(raw.m.add(i));
            v.store(raw.v.add(i));
            if let Some((_, cp)) = raw.copy {
                match C {
                    1 => p.store_f16(cp.cast::<u16>().add(i)),
                    2 => p.store_bf16(cp.cast::<u16>().add(i)),
                    _ => {}
                }
            }
        }
    }

    /// The generic body: full vectors, then the tail through a padded stack copy so the tail
    /// runs the very same operations.
    ///
    /// # Safety
    /// As `CpuAdam::run`; target features present.
    #[inline(always)]
    unsafe fn body<V: Lanes, const G: u8, const C: u8>(s: &AdamScalars, raw: RawStep) {
        // SAFETY: target features are present (caller contract).
        let c = unsafe {
            Consts {
                gs: V::splat(s.grad_scale),
                l2: V::splat(s.l2),
                b1: V::splat(s.beta1),
                omb1: V::splat(s.one_minus_beta1),
                b2: V::splat(s.beta2),
                omb2: V::splat(s.one_minus_beta2),
                ibc2: V::splat(s.inv_sqrt_bc2),
                eps: V::splat(s.eps),
                decay: V::splat(s.decoupled),
                step: V::splat(s.step_size),
            }
        };
        let full = raw.n / V::N * V::N;
        let mut i = 0;
        while i < full {
            // SAFETY: `i + N <= n`.
            unsafe { block::<V, G, C>(&c, &raw, i) };
            i += V::N;
        }
        let rest = raw.n - full;
        if rest == 0 {
            return;
        }
        let (mut p, mut m, mut v, mut g) = ([0f32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
        let mut cp = [0u16; 16];
        // SAFETY: `full + rest == n`; the stack arrays hold 16 >= N elements.
        unsafe {
            std::ptr::copy_nonoverlapping(raw.p.add(full), p.as_mut_ptr(), rest);
            std::ptr::copy_nonoverlapping(raw.m.add(full), m.as_mut_ptr(), rest);
            std::ptr::copy_nonoverlapping(raw.v.add(full), v.as_mut_ptr(), rest);
            let gb = if G == 0 { 4 } else { 2 };
            std::ptr::copy_nonoverlapping(
                raw.grad.1.add(full * gb),
                g.as_mut_ptr().cast::<u8>(),
                rest * gb,
            );
            let tail = RawStep {
                n: V::N,
                p: p.as_mut_ptr(),
                m: m.as_mut_ptr(),
                v: v.as_mut_ptr(),
                grad: (raw.grad.0, g.as_ptr().cast()),
                copy: raw.copy.map(|(k, _)| (k, cp.as_mut_ptr().cast::<u8>())),
            };
            block::<V, G, C>(&c, &tail, 0);
            std::ptr::copy_nonoverlapping(p.as_ptr(), raw.p.add(full), rest);
            std::ptr::copy_nonoverlapping(m.as_ptr(), raw.m.add(full), rest);
            std::ptr::copy_nonoverlapping(v.as_ptr(), raw.v.add(full), rest);
            if let Some((_, dst)) = raw.copy {
                std::ptr::copy_nonoverlapping(cp.as_ptr(), dst.cast::<u16>().add(full), rest);
            }
        }
    }

    /// Picks the body for the operand types.
    #[inline(always)]
    unsafe fn dispatch<V: Lanes>(s: &AdamScalars, raw: RawStep) {
        let c = match raw.copy {
            None => 0,
            Some((RawKind::Bf16, _)) => 2,
            Some(_) => 1,
        };
        // SAFETY: forwarded contract.
        unsafe {
            match (raw.grad.0, c) {
                (RawKind::F32, 0) => body::<V, 0, 0>(s, raw),
                (RawKind::F32, 1) => body::<V, 0, 1>(s, raw),
                (RawKind::F32, _) => body::<V, 0, 2>(s, raw),
                (RawKind::F16, 0) => body::<V, 1, 0>(s, raw),
                (RawKind::F16, 1) => body::<V, 1, 1>(s, raw),
                (RawKind::F16, _) => body::<V, 1, 2>(s, raw),
                (RawKind::Bf16, 0) => body::<V, 2, 0>(s, raw),
                (RawKind::Bf16, 1) => body::<V, 2, 1>(s, raw),
                (RawKind::Bf16, _) => body::<V, 2, 2>(s, raw),
            }
        }
    }

    /// # Safety
    /// As `CpuAdam::run`; the CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn adam_avx2(s: &AdamScalars, raw: RawStep) {
        // SAFETY: forwarded contract; features enabled on this function.
        unsafe { dispatch::<V8>(s, raw) }
    }

    /// # Safety
    /// As `CpuAdam::run`; the CPU has AVX-512F and AVX-512BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn adam_avx512(s: &AdamScalars, raw: RawStep) {
        // SAFETY: forwarded contract; features enabled on this function.
        unsafe { dispatch::<V16>(s, raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::adam::{reference_step, AdamConfig};
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn paths() -> Vec<CpuAdam> {
        Isa::ALL
            .into_iter()
            .filter_map(|i| match CpuAdam::new().with_isa(i) {
                Ok(a) => Some(a.with_threads(1)),
                Err(_) => {
                    eprintln!("skipping the {} path: not supported by this CPU", i.name());
                    None
                }
            })
            .collect()
    }

    #[test]
    fn every_path_matches_the_f64_reference_over_100_steps() {
        for cfg in [
            AdamConfig::adam(1e-3),
            AdamConfig {
                weight_decay: 0.05,
                ..AdamConfig::adam(1e-3)
            },
            AdamConfig::adamw(1e-3, 0.1),
            AdamConfig {
                bias_correction: false,
                ..AdamConfig::adamw(3e-3, 0.01)
            },
        ] {
            for adam in paths() {
                let mut worst = 0f64;
                for n in [1usize, 7, 16, 33, 257] {
                    // offset by one element: unaligned starts
                    let mut seed = n as u64;
                    let mut p = vec![0f32; n + 1];
                    p.iter_mut().for_each(|x| *x = lcg(&mut seed));
                    let mut m = vec![0f32; n + 1];
                    let mut v = vec![0f32; n + 1];
                    let mut rp: Vec<f64> = p[1..].iter().map(|&x| x as f64).collect();
                    let (mut rm, mut rv) = (vec![0f64; n], vec![0f64; n]);
                    for step in 1..=100u64 {
                        let g: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 4.0).collect();
                        let gs = 0.5f32;
                        let s = cfg.scalars(step, gs).unwrap();
                        adam.step(
                            &s,
                            &mut p[1..],
                            &mut m[1..],
                            &mut v[1..],
                            Grad::F32(&g),
                            ParamCopy::None,
                        )
                        .unwrap();
                        let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                        reference_step(&cfg, step, gs as f64, &mut rp, &mut rm, &mut rv, &g64)
                            .unwrap();
                    }
                    // norm-wise relative error ≤ 1e-6; no element further than a few f32
                    // roundings per step (p is rounded once per step, 100 times)
                    let (mut num, mut den) = (0f64, 0f64);
                    for i in 0..n {
                        let (a, b) = (p[i + 1] as f64, rp[i]);
                        num += (a - b).powi(2);
                        den += b * b;
                        assert!(
                            (a - b).abs() <= 4e-6 * b.abs().max(1e-2),
                            "{} n={n} i={i}: {a} vs {b} ({cfg:?})",
                            adam.isa().name()
                        );
                    }
                    let rel = (num / den).sqrt();
                    worst = worst.max(rel);
                    assert!(
                        rel <= 1e-6,
                        "{} n={n}: relative error {rel:e}",
                        adam.isa().name()
                    );
                }
                eprintln!(
                    "{}: worst norm-wise relative error {worst:.2e}",
                    adam.isa().name()
                );
            }
        }
    }

    #[test]
    fn half_gradients_and_fused_copies_match_the_scalar_path() {
        let cfg = AdamConfig::adamw(1e-3, 0.01);
        let s = cfg.scalars(3, 1.0 / 256.0).unwrap();
        let n = 1000 + 13;
        let mut seed = 9;
        let p0: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let g32: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 300.0).collect();
        for adam in paths() {
            // fp16 grads, fp16 copy; bf16 grads in place
            let g16: Vec<f16> = g32.iter().map(|&x| f16::from_f32(x)).collect();
            let (mut p, mut m, mut v) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
            let mut c16 = vec![f16::ZERO; n];
            adam.step(
                &s,
                &mut p,
                &mut m,
                &mut v,
                Grad::F16(&g16),
                ParamCopy::F16(&mut c16),
            )
            .unwrap();
            // the same step through f32 gradients gives the same state
            let gw: Vec<f32> = g16.iter().map(|x| x.to_f32()).collect();
            let (mut q, mut qm, mut qv) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
            adam.step(
                &s,
                &mut q,
                &mut qm,
                &mut qv,
                Grad::F32(&gw),
                ParamCopy::None,
            )
            .unwrap();
            assert_eq!(p, q);
            assert_eq!((&m, &v), (&qm, &qv));
            for i in 0..n {
                assert_eq!(
                    c16[i],
                    f16::from_f32(p[i]),
                    "{} f16 copy at {i}",
                    adam.isa().name()
                );
            }
            let mut gb: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
            let gbw: Vec<f32> = gb.iter().map(|x| x.to_f32()).collect();
            let (mut p, mut m, mut v) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
            adam.step_in_place(&s, &mut p, &mut m, &mut v, GradInPlace::Bf16(&mut gb))
                .unwrap();
            let (mut q, mut qm, mut qv) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
            adam.step(
                &s,
                &mut q,
                &mut qm,
                &mut qv,
                Grad::F32(&gbw),
                ParamCopy::None,
            )
            .unwrap();
            assert_eq!(p, q);
            for i in 0..n {
                assert_eq!(
                    gb[i],
                    bf16::from_f32(p[i]),
                    "{} bf16 copy at {i}",
                    adam.isa().name()
                );
            }
        }
    }

    #[test]
    fn every_path_agrees_bitwise_and_threads_do_not_change_results() {
        let cfg = AdamConfig::adam(1e-3);
        let s = cfg.scalars(1, 1.0).unwrap();
        let n = (1 << 18) + 5;
        let mut seed = 1;
        let p0: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let g: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let run = |a: CpuAdam| {
            let (mut p, mut m, mut v) = (p0.clone(), vec![0f32; n], vec![0f32; n]);
            a.step(&s, &mut p, &mut m, &mut v, Grad::F32(&g), ParamCopy::None)
                .unwrap();
            (p, m, v)
        };
        let all = paths();
        for a in &all {
            assert_eq!(run(*a), run(a.with_threads(3)), "{}", a.isa().name());
            assert_eq!(
                run(*a),
                run(all[0]),
                "{} against {}",
                a.isa().name(),
                all[0].isa().name()
            );
        }
    }

    #[test]
    fn mismatched_lengths_and_unsupported_paths_are_errors() {
        let s = AdamConfig::adam(1e-3).scalars(1, 1.0).unwrap();
        let (mut p, mut m, mut v) = (vec![0f32; 4], vec![0f32; 4], vec![0f32; 3]);
        let a = CpuAdam::new();
        assert!(a
            .step(
                &s,
                &mut p,
                &mut m,
                &mut v,
                Grad::F32(&[0.0; 4]),
                ParamCopy::None
            )
            .is_err());
        let mut v = vec![0f32; 4];
        let mut c = vec![f16::ZERO; 5];
        assert!(a
            .step(
                &s,
                &mut p,
                &mut m,
                &mut v,
                Grad::F32(&[0.0; 4]),
                ParamCopy::F16(&mut c)
            )
            .is_err());
        for i in Isa::ALL {
            assert_eq!(CpuAdam::new().with_isa(i).is_ok(), i.is_supported());
        }
        assert!(Isa::parse("sse9").is_err());
        assert_eq!(Isa::parse("avx2").unwrap(), Isa::Avx2);
    }

    #[test]
    fn grad_stats_sum_squares_and_flag_overflow() {
        let g: Vec<f16> = (0..1000).map(|i| f16::from_f32(i as f32 / 100.0)).collect();
        let st = grad_stats(Grad::F16(&g));
        let want: f64 = g.iter().map(|x| (x.to_f32() as f64).powi(2)).sum();
        assert!((st.sum_sq - want).abs() <= 1e-9 * want);
        assert!(!st.nonfinite);
        let mut g = g;
        g[777] = f16::INFINITY;
        assert!(grad_stats(Grad::F16(&g)).nonfinite);
        g[777] = f16::NAN;
        assert!(grad_stats(Grad::F16(&g)).nonfinite);
    }
}
