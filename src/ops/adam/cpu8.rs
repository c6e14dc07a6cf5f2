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

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::optim::AdamConfig;

    /// A state after a few steps of varied gradients: codes and scales that mean something.
    struct State {
        p: Vec<f32>,
        m: Vec<u8>,
        v: Vec<u8>,
        ms: Vec<f32>,
        vs: Vec<f32>,
    }

    impl State {
        fn new(n: usize) -> State {
            let b = n.div_ceil(QUANT8_BLOCK);
            let p = (0..n).map(|i| ((i as f32) * 0.013).sin()).collect();
            let mut st = State {
                p,
                m: vec![127; n],
                v: vec![0; n],
                ms: vec![0.0; b],
                vs: vec![0.0; b],
            };
            let adam = CpuAdam::new().with_isa(Isa::Scalar).unwrap();
            for t in 1..=3 {
                let s = AdamConfig::adamw(1e-2, 0.1).scalars(t, 1.0).unwrap();
                let g = grads(n, t as f32);
                st.step8(&adam, &s, Grad::F32(&g), ParamCopy::None).unwrap();
            }
            st
        }

        fn parts(&mut self) -> (&mut [f32], Moments8<'_>) {
            let m = Moments8 {
                momentum: &mut self.m,
                variance: &mut self.v,
                momentum_scales: &mut self.ms,
                variance_scales: &mut self.vs,
            };
            (&mut self.p, m)
        }

        fn step8(&mut self, a: &CpuAdam, s: &AdamScalars, g: Grad, c: ParamCopy) -> Result<()> {
            let (p, m) = self.parts();
            a.step8(s, p, m, g, c)
        }

        fn step8_in_place(&mut self, a: &CpuAdam, s: &AdamScalars, g: GradInPlace) -> Result<()> {
            let (p, m) = self.parts();
            a.step8_in_place(s, p, m, g)
        }

        /// Every value's bits: parameters and scales as u32, codes widened.
        fn bits(&self) -> Vec<Vec<u32>> {
            let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let c = |v: &[u8]| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
            vec![b(&self.p), c(&self.m), c(&self.v), b(&self.ms), b(&self.vs)]
        }
    }

    /// Gradients over six decades of magnitude, both signs.
    fn grads(n: usize, t: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as f32 * 0.71 + t).sin();
                x * 10f32.powi((i % 7) as i32 - 4)
            })
            .collect()
    }

    #[test]
    fn every_path_and_split_gives_the_same_bits() {
        let n = 5 * QUANT8_BLOCK * 64 + 77;
        let s = AdamConfig::adamw(1e-3, 0.01).scalars(4, 0.5).unwrap();
        let g32 = grads(n, 4.0);
        let g16: Vec<f16> = g32.iter().map(|&x| f16::from_f32(x)).collect();
        let gb: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
        let start = State::new(n);
        let run = |isa: Isa, threads: usize, kind: usize| {
            let adam = CpuAdam::new().with_isa(isa).unwrap().with_threads(threads);
            let mut st = State {
                p: start.p.clone(),
                m: start.m.clone(),
                v: start.v.clone(),
                ms: start.ms.clone(),
                vs: start.vs.clone(),
            };
            let mut copy = vec![0u16; n];
            match kind {
                0 => st.step8(&adam, &s, Grad::F32(&g32), ParamCopy::None),
                1 => {
                    let c: &mut [f16] = bytemuck::cast_slice_mut(&mut copy);
                    st.step8(&adam, &s, Grad::F16(&g16), ParamCopy::F16(c))
                }
                2 => {
                    let c: &mut [bf16] = bytemuck::cast_slice_mut(&mut copy);
                    st.step8(&adam, &s, Grad::Bf16(&gb), ParamCopy::Bf16(c))
                }
                _ => {
                    let c: &mut [f16] = bytemuck::cast_slice_mut(&mut copy);
                    c.copy_from_slice(&g16);
                    st.step8_in_place(&adam, &s, GradInPlace::F16(c))
                }
            }
            .unwrap();
            (st.bits(), copy)
        };
        for kind in 0..4 {
            let want = run(Isa::Scalar, 1, kind);
            for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
                for threads in [1, 2, 3] {
                    assert!(
                        run(isa, threads, kind) == want,
                        "{isa:?}, {threads} threads, kind {kind}"
                    );
                }
            }
            if kind == 1 {
                let (bits, copy) = &want;
                let p = |i: usize| f32::from_bits(bits[0][i]);
                assert!(
                    (0..n).all(|i| copy[i] == f16::from_f32(p(i)).to_bits()),
                    "the f16 copy"
                );
            }
        }
        // the in-place step is the separate one's
        assert_eq!(run(Isa::Scalar, 1, 3), run(Isa::Scalar, 1, 1));
    }

    /// One step against an f64 reference on the dequantized state: the parameters to f32's
    /// rounding, the requantized moments to the map's spacing.
    #[test]
    fn a_step_matches_an_f64_reference() {
        let n = 3 * QUANT8_BLOCK + 5;
        let mut st = State::new(n);
        let (b1, b2, lr, wd, eps, t) = (0.9f64, 0.999f64, 1e-3f64, 0.01f64, 1e-8f64, 4);
        let s = AdamConfig::adamw(lr as f32, wd as f32)
            .scalars(t, 1.0)
            .unwrap();
        let g = grads(n, 4.0);
        let deq = |map: Quant8Map, codes: &[u8], scales: &[f32]| -> Vec<f64> {
            let t = map.table();
            (0..codes.len())
                .map(|i| t[codes[i] as usize] as f64 * scales[i / QUANT8_BLOCK] as f64)
                .collect()
        };
        let (m0, v0) = (
            deq(Quant8Map::Signed, &st.m, &st.ms),
            deq(Quant8Map::Unsigned, &st.v, &st.vs),
        );
        let p0 = st.p.clone();
        st.step8(&CpuAdam::new(), &s, Grad::F32(&g), ParamCopy::None)
            .unwrap();
        let (m1, v1) = (
            deq(Quant8Map::Signed, &st.m, &st.ms),
            deq(Quant8Map::Unsigned, &st.v, &st.vs),
        );
        for i in 0..n {
            let gi = g[i] as f64;
            let m = b1 * m0[i] + (1.0 - b1) * gi;
            let v = b2 * v0[i] + (1.0 - b2) * gi * gi;
            let mhat = m / (1.0 - b1.powi(t as i32));
            let vhat = v / (1.0 - b2.powi(t as i32));
            let p = p0[i] as f64 * (1.0 - lr * wd) - lr * mhat / (vhat.sqrt() + eps);
            // f32's rounding of the start and of the update (not of their difference); the
            // update's includes that of the f32 bias correction 1 − β2ᵗ (1.5e-5 at t = 4)
            let tol = 1e-6 * p0[i].abs() as f64 + 2e-5 * lr;
            assert!(
                (st.p[i] as f64 - p).abs() <= tol,
                "p[{i}]: {} vs {p}",
                st.p[i]
            );
            // within the map's spacing at the value (one gap: the reference and the step round
            // differently near an edge)
            let (mb, vb) = (
                st.ms[i / QUANT8_BLOCK] as f64,
                st.vs[i / QUANT8_BLOCK] as f64,
            );
            let gm = gap(Quant8Map::Signed, m / mb) * mb;
            let gv = gap(Quant8Map::Unsigned, v / vb) * vb;
            assert!(
                (m1[i] - m).abs() <= gm,
                "m[{i}]: {} vs {m} (gap {gm})",
                m1[i]
            );
            assert!(
                (v1[i] - v).abs() <= gv,
                "v[{i}]: {} vs {v} (gap {gv})",
                v1[i]
            );
        }
    }

    /// The distance between the map's entries on either side of `x`.
    fn gap(map: Quant8Map, x: f64) -> f64 {
        let t = map.table();
        let above = t.iter().position(|&e| e as f64 >= x).unwrap_or(255).max(1);
        (t[above] - t[above - 1]) as f64
    }

    /// Least squares fitted by Adam from the same start: 8-bit moments reach the fp32
    /// moments' loss.
    #[test]
    fn trains_as_well_as_fp32_moments() {
        let n = 4 * QUANT8_BLOCK;
        let target: Vec<f32> = (0..n)
            .map(|i| ((i as f32) * 0.37).cos() * 10f32.powi((i % 4) as i32 - 3))
            .collect();
        let loss = |p: &[f32]| {
            let d = p.iter().zip(&target).map(|(a, b)| ((a - b) as f64).powi(2));
            d.sum::<f64>()
        };
        let adam = CpuAdam::new();
        let (mut p32, mut m32, mut v32) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let mut st = State {
            p: vec![0.0; n],
            m: vec![127; n],
            v: vec![0; n],
            ms: vec![0.0; 4],
            vs: vec![0.0; 4],
        };
        let start = loss(&p32);
        let grad = |p: &[f32]| {
            let g = p.iter().zip(&target).map(|(a, b)| 2.0 * (a - b));
            g.collect::<Vec<f32>>()
        };
        for t in 1..=600 {
            let lr = if t <= 400 { 1e-2 } else { 1e-3 };
            let s = AdamConfig::adam(lr).scalars(t, 1.0).unwrap();
            let (g32, g8) = (grad(&p32), grad(&st.p));
            let (m, v) = (&mut m32, &mut v32);
            adam.step(&s, &mut p32, m, v, Grad::F32(&g32), ParamCopy::None)
                .unwrap();
            st.step8(&adam, &s, Grad::F32(&g8), ParamCopy::None)
                .unwrap();
        }
        let (l32, l8) = (loss(&p32), loss(&st.p));
        eprintln!("loss from {start}: fp32 moments {l32}, 8-bit {l8}");
        assert!(l32 < 1e-8 * start, "{l32} from {start}");
        assert!(l8 < 1e-8 * start, "8-bit {l8}, fp32 {l32}, start {start}");
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let s = AdamConfig::adam(1e-3).scalars(1, 1.0).unwrap();
        let mut st = State {
            p: vec![0.0; 300],
            m: vec![127; 300],
            v: vec![0; 300],
            ms: vec![0.0; 1],
            vs: vec![0.0; 2],
        };
        let g = vec![0.0f32; 300];
        assert!(st
            .step8(&CpuAdam::new(), &s, Grad::F32(&g), ParamCopy::None)
            .is_err());
        st.ms = vec![0.0; 2];
        assert!(st
            .step8(&CpuAdam::new(), &s, Grad::F32(&g[..299]), ParamCopy::None)
            .is_err());
        assert!(st
            .step8(&CpuAdam::new(), &s, Grad::F32(&g), ParamCopy::None)
            .is_ok());
    }
}
