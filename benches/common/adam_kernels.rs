//! The kernels the CPU Adam bench and the `adam_bench` example time over one set of buffers
//! (included by both with `#[path]`).

use std::hint::black_box;

use super::stream::stream_4r3w;
use half::f16;
use half::slice::HalfFloatSliceExt;
use tidemem::ops::{
    AdamScalars, CpuAdam, Grad, GradInPlace, Moments8, ParamCopy, Quant8Map, QUANT8_BLOCK,
};

/// Bytes per element of fp16-gradient Adam without a copy (p, m, v read and written; g read).
pub const ADAM_F16_BYTES: usize = 26;
/// Bytes per element of the cast pass (fp32 read, fp16 written).
pub const CAST_BYTES: usize = 6;
/// Bytes per element of the fused step on 8-bit moments: the fp32 master read and written, the
/// two codes read and written, the fp16 gradient read and the fp16 parameter written (and 16
/// bytes of scales a 256 elements, not counted).
pub const ADAM8_BYTES: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `stream_4r3w` over (p, g, m, v).
    Stream,
    /// Adam, fp32 gradients, no copy.
    AdamF32,
    /// Adam, fp16 gradients replaced by the fp16 parameters in the same pass.
    Fused,
    /// Adam, fp16 gradients, no copy.
    AdamF16,
    /// fp32 parameters → fp16 (into the gradient buffer, as the fused step does).
    Cast,
    /// [`Kernel::Fused`] on 8-bit block-wise moments.
    Fused8,
}

pub const KERNELS: [Kernel; 6] = [
    Kernel::Stream,
    Kernel::AdamF32,
    Kernel::Fused,
    Kernel::AdamF16,
    Kernel::Cast,
    Kernel::Fused8,
];

/// One set of operands, shared by every kernel.
pub struct Bufs {
    pub p: Vec<f32>,
    pub g: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub g16: Vec<f16>,
    /// The 8-bit step's own parameters and fp16 gradients (its codes depend on the values,
    /// which the other kernels would drift), then its moments: codes and block scales.
    pub p8: Vec<f32>,
    pub g8: Vec<f16>,
    pub m8: Vec<u8>,
    pub v8: Vec<u8>,
    pub ms: Vec<f32>,
    pub vs: Vec<f32>,
}

impl Bufs {
    /// Non-zero fills, so every page is written (zeroed vectors would be mapped lazily).
    pub fn new(n: usize) -> Self {
        Bufs {
            p: vec![1.0; n],
            g: vec![1e-3; n],
            m: vec![1e-4; n],
            v: vec![1e-6; n],
            g16: vec![f16::from_f32(1e-3); n],
            p8: vec![1.0; n],
            g8: vec![f16::from_f32(1e-3); n],
            m8: vec![Quant8Map::Signed.code(0.5); n],
            v8: vec![Quant8Map::Unsigned.code(0.5); n],
            ms: vec![1e-4; n.div_ceil(QUANT8_BLOCK)],
            vs: vec![1e-6; n.div_ceil(QUANT8_BLOCK)],
        }
    }

    pub fn run(&mut self, k: Kernel, adam: &CpuAdam, s: &AdamScalars) -> tidemem::Result<()> {
        let b = self;
        match k {
            Kernel::Stream => stream_4r3w(
                adam.isa(),
                adam.threads(),
                &mut b.p,
                &b.g,
                &mut b.m,
                &mut b.v,
            )?,
            Kernel::AdamF32 => adam.step(
                s,
                &mut b.p,
                &mut b.m,
                &mut b.v,
                Grad::F32(&b.g),
                ParamCopy::None,
            )?,
            Kernel::Fused => adam.step_in_place(
                s,
                &mut b.p,
                &mut b.m,
                &mut b.v,
                GradInPlace::F16(&mut b.g16),
            )?,
            Kernel::AdamF16 => adam.step(
                s,
                &mut b.p,
                &mut b.m,
                &mut b.v,
                Grad::F16(&b.g16),
                ParamCopy::None,
            )?,
            Kernel::Cast => cast(adam.threads(), &b.p, &mut b.g16),
            Kernel::Fused8 => {
                let moments = Moments8 {
                    momentum: &mut b.m8,
                    variance: &mut b.v8,
                    momentum_scales: &mut b.ms,
                    variance_scales: &mut b.vs,
                };
                adam.step8_in_place(s, &mut b.p8, moments, GradInPlace::F16(&mut b.g8))?
            }
        }
        black_box(&b.p);
        Ok(())
    }
}

/// `dst = f16(src)`, split over threads as the CPU Adam splits a step (parts aligned to 64
/// elements, at least 65536 elements each, the first on this thread).
pub fn cast(threads: usize, src: &[f32], dst: &mut [f16]) {
    let n = src.len();
    let parts = threads.min(n >> 16).max(1);
    let per = n.div_ceil(parts).div_ceil(64) * 64;
    if parts == 1 {
        dst.convert_from_f32_slice(src);
        return;
    }
    std::thread::scope(|scope| {
        let mut pairs = src.chunks(per).zip(dst.chunks_mut(per));
        let (s0, d0) = pairs.next().expect("n > 0 when parts > 1");
        for (s, d) in pairs {
            scope.spawn(move || d.convert_from_f32_slice(s));
        }
        d0.convert_from_f32_slice(s0);
    });
}

/// Median of `v` (not empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|x, y| x.total_cmp(y));
    v[v.len() / 2]
}
