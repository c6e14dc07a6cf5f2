//! The CPU Adam on 8-bit moments (`CpuAdam::step8`): its paths and thread splits against each
//! other, one step against an f64 reference, and a fit against fp32 moments.

use half::{bf16, f16};

use super::adam::AdamConfig;
use crate::error::Result;
use crate::ops::{
    AdamScalars, CpuAdam, Grad, GradInPlace, Isa, Moments8, ParamCopy, Quant8Map, QUANT8_BLOCK,
};

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
    // three slices of at least 2^16 elements (the least a thread takes) and a short last block
    let n = 3 * (1 << 16) + 77;
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
            assert!(run(isa, 1, kind) == want, "{isa:?}, kind {kind}");
        }
        let fastest = CpuAdam::new().isa();
        for threads in [2, 3] {
            let got = run(fastest, threads, kind);
            assert!(got == want, "{fastest:?}, {threads} threads, kind {kind}");
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
