//! The CPU Adam on 8-bit moments ([`quant8`](super::quant8)): one pass a block of
//! [`QUANT8_BLOCK`] elements dequantizes the momentum and the variance and steps the fp32
//! master exactly as [`CpuAdam::step`] does. It then requantizes both moments under the block's
//! new largest magnitudes and writes the fp16/bf16 copy of the parameters. Per element it reads
//! and writes the master (8 bytes), the two codes (4 bytes), the 16-bit gradient and the copy
//! (4 bytes): about 16 bytes, against 28 with fp32 moments.
//!
//! One body serves every path. It is compiled plainly (the scalar path), for AVX2 with FMA and
//! F16C, and for AVX-512, and chosen at run time as [`CpuAdam::isa`] says. Every operation is
//! an IEEE operation (a fused multiply-add where it fuses), a comparison, or an exact
//! conversion, and the largest magnitude is an integer maximum. So the paths give the same
//! bits, and so does any split over threads, which cuts on block edges.
//!
//! ```
//! use tidemem::optim::AdamConfig;
//! use tidemem::ops::{CpuAdam, Grad, Moments8, ParamCopy, QUANT8_BLOCK};
//! # fn main() -> tidemem::Result<()> {
//! let n = 1000;
//! let s = AdamConfig::adamw(1e-3, 0.01).scalars(1, 1.0)?;
//! let mut p = vec![1.0f32; n];
//! let (mut m, mut v) = (vec![127u8; n], vec![0u8; n]); // zeros in each map
//! let blocks = n.div_ceil(QUANT8_BLOCK);
//! let (mut ms, mut vs) = (vec![0.0f32; blocks], vec![0.0f32; blocks]);
//! let g = vec![half::f16::from_f32(0.5); n];
//! let mut p16 = vec![half::f16::ZERO; n];
//! let moments = Moments8 { momentum: &mut m, variance: &mut v, momentum_scales: &mut ms, variance_scales: &mut vs };
//! CpuAdam::new().step8(&s, &mut p, moments, Grad::F16(&g), ParamCopy::F16(&mut p16))?;
//! assert!(p[0] < 1.0 && p16[0] == half::f16::from_f32(p[0]));
//! # Ok(()) }
//! ```

use half::slice::HalfFloatSliceExt;

use super::quant8::{check_quant8, dequantize_block, quantize_block, Quant8Map, QUANT8_BLOCK};
use super::{AdamScalars, CpuAdam, Grad, GradInPlace, Isa, ParamCopy};
use crate::error::{Error, Result};

/// The 8-bit moments of a slice of parameters: a code an element and a scale a
/// [`QUANT8_BLOCK`] elements, each moment in its map ([`Quant8Map::Signed`] for the momentum,
/// [`Quant8Map::Unsigned`] for the variance). Zeros are code 127 and code 0 with any scale.
#[derive(Debug)]
pub struct Moments8<'a> {
    /// The momentum's codes.
    pub momentum: &'a mut [u8],
    /// The variance's codes.
    pub variance: &'a mut [u8],
    /// The momentum's block scales.
    pub momentum_scales: &'a mut [f32],
    /// The variance's block scales.
    pub variance_scales: &'a mut [f32],
}

/// The gradient and where the copy goes, for a range of elements.
enum Io<'a> {
    Split(Grad<'a>, ParamCopy<'a>),
    InPlace(GradInPlace<'a>),
}

impl<'a> Io<'a> {
    fn len(&self) -> Option<usize> {
        match self {
            Io::Split(g, ParamCopy::None) => Some(g.len()),
            Io::Split(g, ParamCopy::F16(c)) => (g.len() == c.len()).then_some(g.len()),
            Io::Split(g, ParamCopy::Bf16(c)) => (g.len() == c.len()).then_some(g.len()),
            Io::InPlace(GradInPlace::F16(g)) => Some(g.len()),
            Io::InPlace(GradInPlace::Bf16(g)) => Some(g.len()),
        }
    }

    /// The first `k` elements and the rest.
    fn split_at(self, k: usize) -> (Io<'a>, Io<'a>) {
        fn grad(g: Grad<'_>, k: usize) -> (Grad<'_>, Grad<'_>) {
            match g {
                Grad::F32(g) => (Grad::F32(&g[..k]), Grad::F32(&g[k..])),
                Grad::F16(g) => (Grad::F16(&g[..k]), Grad::F16(&g[k..])),
                Grad::Bf16(g) => (Grad::Bf16(&g[..k]), Grad::Bf16(&g[k..])),
            }
        }
        match self {
            Io::Split(g, c) => {
                let (g0, g1) = grad(g, k);
                let (c0, c1) = match c {
                    ParamCopy::None => (ParamCopy::None, ParamCopy::None),
                    ParamCopy::F16(c) => {
                        let (a, b) = c.split_at_mut(k);
                        (ParamCopy::F16(a), ParamCopy::F16(b))
                    }
                    ParamCopy::Bf16(c) => {
                        let (a, b) = c.split_at_mut(k);
                        (ParamCopy::Bf16(a), ParamCopy::Bf16(b))
                    }
                };
                (Io::Split(g0, c0), Io::Split(g1, c1))
            }
            Io::InPlace(GradInPlace::F16(g)) => {
                let (a, b) = g.split_at_mut(k);
                (
                    Io::InPlace(GradInPlace::F16(a)),
                    Io::InPlace(GradInPlace::F16(b)),
                )
            }
            Io::InPlace(GradInPlace::Bf16(g)) => {
                let (a, b) = g.split_at_mut(k);
                (
                    Io::InPlace(GradInPlace::Bf16(a)),
                    Io::InPlace(GradInPlace::Bf16(b)),
                )
            }
        }
    }

    /// Widens the gradient to f32 into `out` (exact conversions).
    #[inline(always)]
    fn read(&self, out: &mut [f32]) {
        match self {
            Io::Split(Grad::F32(g), _) => out.copy_from_slice(g),
            Io::Split(Grad::F16(g), _) => g.convert_to_f32_slice(out),
            Io::Split(Grad::Bf16(g), _) => g.convert_to_f32_slice(out),
            Io::InPlace(GradInPlace::F16(g)) => g.convert_to_f32_slice(out),
            Io::InPlace(GradInPlace::Bf16(g)) => g.convert_to_f32_slice(out),
        }
    }

    /// Writes the copy of `params` (rounded to nearest even), where one is asked for.
    #[inline(always)]
    fn write(&mut self, params: &[f32]) {
        match self {
            Io::Split(_, ParamCopy::None) => {}
            Io::Split(_, ParamCopy::F16(c)) => c.convert_from_f32_slice(params),
            Io::Split(_, ParamCopy::Bf16(c)) => c.convert_from_f32_slice(params),
            Io::InPlace(GradInPlace::F16(g)) => g.convert_from_f32_slice(params),
            Io::InPlace(GradInPlace::Bf16(g)) => g.convert_from_f32_slice(params),
        }
    }
}

/// One range of whole blocks (the last possibly short).
struct Part<'a> {
    p: &'a mut [f32],
    m: Moments8<'a>,
    io: Io<'a>,
}

impl<'a> Part<'a> {
    /// The first `k` elements (a multiple of [`QUANT8_BLOCK`], or all) and the rest.
    fn split_at(self, k: usize) -> (Part<'a>, Part<'a>) {
        let b = k.div_ceil(QUANT8_BLOCK);
        let (p0, p1) = self.p.split_at_mut(k);
        let (m0, m1) = self.m.momentum.split_at_mut(k);
        let (v0, v1) = self.m.variance.split_at_mut(k);
        let (ms0, ms1) = self.m.momentum_scales.split_at_mut(b);
        let (vs0, vs1) = self.m.variance_scales.split_at_mut(b);
        let (io0, io1) = self.io.split_at(k);
        let moments = |momentum, variance, momentum_scales, variance_scales| Moments8 {
            momentum,
            variance,
            momentum_scales,
            variance_scales,
        };
        (
            Part {
                p: p0,
                m: moments(m0, v0, ms0, vs0),
                io: io0,
            },
            Part {
                p: p1,
                m: moments(m1, v1, ms1, vs1),
                io: io1,
            },
        )
    }
}

impl CpuAdam {
    /// One step over `params` with 8-bit `moments`, with `grad`, writing `copy` when asked.
    /// `params`, the codes, the gradient and the copy have one length `n`, and the scales
    /// `ceil(n / QUANT8_BLOCK)`.
    pub fn step8(
        &self,
        s: &AdamScalars,
        params: &mut [f32],
        moments: Moments8<'_>,
        grad: Grad<'_>,
        copy: ParamCopy<'_>,
    ) -> Result<()> {
        self.run8(s, params, moments, Io::Split(grad, copy))
    }

    /// [`CpuAdam::step8`] with the 16-bit gradient replaced by the updated parameters in the
    /// same pass.
    pub fn step8_in_place(
        &self,
        s: &AdamScalars,
        params: &mut [f32],
        moments: Moments8<'_>,
        grad: GradInPlace<'_>,
    ) -> Result<()> {
        self.run8(s, params, moments, Io::InPlace(grad))
    }

    fn run8(&self, s: &AdamScalars, p: &mut [f32], m: Moments8<'_>, io: Io<'_>) -> Result<()> {
        let n = p.len();
        check_quant8(n, m.momentum.len(), m.momentum_scales.len())?;
        check_quant8(n, m.variance.len(), m.variance_scales.len())?;
        if io.len() != Some(n) {
            return Err(Error::Length {
                what: "elements of the gradient (and its copy) for the parameters".into(),
                got: io.len().unwrap_or(0),
                expected: n,
            });
        }
        let blocks = n.div_ceil(QUANT8_BLOCK);
        let parts = self.threads().min(n / MIN_PER_THREAD).max(1);
        let per = blocks.div_ceil(parts) * QUANT8_BLOCK;
        let isa = self.isa();
        let mut rest = Part { p, m, io };
        std::thread::scope(|scope| {
            while rest.p.len() > per {
                let (part, more) = rest.split_at(per);
                rest = more;
                scope.spawn(move || run_on(isa, s, part));
            }
            run_on(isa, s, rest);
        });
        Ok(())
    }
}

/// Elements under which a step stays on one thread.
const MIN_PER_THREAD: usize = 1 << 16;

/// Runs `part` on this thread on the `isa` path.
fn run_on(isa: Isa, s: &AdamScalars, part: Part<'_>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `CpuAdam` holds only a path this CPU supports (`Isa::detect`,
        // `CpuAdam::with_isa`); the body is safe code.
        Isa::Avx512 => unsafe { blocks_avx512(s, part) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { blocks_avx2(s, part) },
        _ => blocks(s, part),
    }
}

/// [`blocks`] compiled for AVX2, FMA and F16C.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks_avx2(s: &AdamScalars, part: Part<'_>) {
    blocks(s, part)
}

/// [`blocks`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW (with FMA and F16C).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn blocks_avx512(s: &AdamScalars, part: Part<'_>) {
    blocks(s, part)
}

/// Steps every block of `part` in order.
#[inline(always)]
fn blocks(s: &AdamScalars, mut part: Part<'_>) {
    // the block's gradient and moments in f32, written before they are read
    let mut scratch = [[0f32; QUANT8_BLOCK]; 3];
    while !part.p.is_empty() {
        let len = QUANT8_BLOCK.min(part.p.len());
        let (this, rest) = part.split_at(len);
        block(s, this, &mut scratch);
        part = rest;
    }
}

/// One block: its scales are the part's first.
#[inline(always)]
fn block(s: &AdamScalars, part: Part<'_>, scratch: &mut [[f32; QUANT8_BLOCK]; 3]) {
    let Part { p, m, mut io } = part;
    let n = p.len();
    let [g, mf, vf] = scratch;
    let (g, mf, vf) = (&mut g[..n], &mut mf[..n], &mut vf[..n]);
    io.read(g);
    dequantize_block(Quant8Map::Signed, m.momentum, m.momentum_scales[0], mf);
    dequantize_block(Quant8Map::Unsigned, m.variance, m.variance_scales[0], vf);
    for (((p, m), v), &g) in p
        .iter_mut()
        .zip(mf.iter_mut())
        .zip(vf.iter_mut())
        .zip(g.iter())
    {
        // `CpuAdam::step`'s operations, fused where they fuse
        let g = s.l2.mul_add(*p, g * s.grad_scale);
        *m = s.beta1.mul_add(*m, s.one_minus_beta1 * g);
        *v = s.beta2.mul_add(*v, s.one_minus_beta2 * (g * g));
        let d = v.sqrt().mul_add(s.inv_sqrt_bc2, s.eps);
        *p -= s.decoupled.mul_add(*p, s.step_size * (*m / d));
    }
    m.momentum_scales[0] = quantize_block(Quant8Map::Signed, mf, m.momentum);
    m.variance_scales[0] = quantize_block(Quant8Map::Unsigned, vf, m.variance);
    io.write(p);
}
