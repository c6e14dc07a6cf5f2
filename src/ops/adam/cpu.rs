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
//! use tidemem::optim::AdamConfig;
//! use tidemem::ops::{CpuAdam, Grad, ParamCopy};
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

use super::AdamScalars;
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
    pub(crate) fn detect() -> Isa {
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
            .ok_or_else(|| Error::Parse {
                what: "instruction set",
                input: s.to_string(),
                expected: Isa::ALL.map(|i| i.name()).join(", "),
            })
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
    /// Elements.
    pub fn len(&self) -> usize {
        self.len_()
    }
    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len_() == 0
    }
    fn len_(&self) -> usize {
        match self {
            Grad::F32(g) => g.len(),
            Grad::F16(g) => g.len(),
            Grad::Bf16(g) => g.len(),
        }
    }

    pub(crate) fn raw(&self) -> (RawKind, *const u8) {
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
// SAFETY: as above.
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
            return Err(Error::Conflict {
                what: format!("the {} path of CPU Adam", isa.name()),
                with: "this CPU, which lacks its instructions".into(),
            });
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
        Some(&l) => Err(Error::Length {
            what: "elements of a CPU Adam operand for its parameters".into(),
            got: l,
            expected: n,
        }),
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

#[cfg(target_arch = "x86_64")]
mod x86;
