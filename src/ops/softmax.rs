//! Causal softmax, the middle of attention: scores `x` of shape `[BH, T, T]` (batch·heads
//! matrices of `T × T`, row-major) and a scale (`1/√head_dim`), forward
//! ([`softmax_forward`]) `y[i, j] = exp(s·x[i, j] − m_i) / Σ_{k≤i} exp(s·x[i, k] − m_i)` for
//! `j ≤ i` with `m_i = max_{k≤i} s·x[i, k]`, and exactly 0 above the diagonal; backward
//! ([`softmax_backward`]) `dx[i, j] = s·y[i, j]·(dy[i, j] − Σ_{k≤i} dy[i, k]·y[i, k])` for
//! `j ≤ i`, 0 above. Above the diagonal `x`, `y` and `dy` are never read.
//!
//! Storage f32, f16 or bf16; the maximum, the sums and every product in f32. CUDA
//! (`kernels/softmax.cu`) runs one warp per row: lane `l` takes the row's elements
//! `l, l + 32, …`, and the warp reduces by the xor butterfly; the CPU twin keeps that order
//! (`ops::lanes`) and uses [`math::exp`], so the two agree bit for bit.
//!
//! ```
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let s = dev.new_stream()?;
//! // One 2 × 2 matrix of scores; the scale 1.
//! let x = dev.upload(&s, bytemuck::cast_slice(&[5.0f32, 9.0, 1.0, 1.0]))?;
//! let y = dev.alloc(16)?;
//! tidemem::ops::softmax_forward(&dev, &s, &x, &y, 1, 2, 1.0, DType::F32)?;
//! let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
//! assert_eq!(y, [1.0, 0.0, 0.5, 0.5]);
//! # Ok(()) }
//! ```

use crate::device::launch::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::expect_all;
use crate::ops::{lanes, math};

/// The parameters of `kernels/softmax.cu` (`softmax.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SoftmaxParams {
    /// Matrices (batch · heads).
    pub bh: u64,
    /// Rows and columns of each matrix (the sequence length).
    pub t: u64,
    /// The factor applied to the scores before the softmax (and to the gradient after it).
    pub scale: f32,
    /// Padding (0).
    pub pad: u32,
}

/// Threads per block of the softmax kernels: 8 warps, one row each.
pub const SOFTMAX_THREADS: u32 = 256;

const FLOATS: &[DType] = &DType::FLOATS;

/// Causal softmax forward: scores `x` read, probabilities `y` written, one element type.
pub static SOFTMAX_FORWARD: KernelDesc = KernelDesc {
    name: "softmax_forward",
    operands: &[
        OperandSpec::read("x", FLOATS),
        OperandSpec::write("y", FLOATS),
    ],
    params: param_layout!(SoftmaxParams, "softmax.cuh", [bh, t, scale, pad]),
    check: Some(check),
    twin: forward_twin,
    cuda: CudaSide::Nvrtc {
        source: "softmax.cu",
        plan: |info| plan(info, "softmax_forward"),
    },
};

/// Causal softmax backward: probabilities `y` and their gradient `dy` read, the scores'
/// gradient `dx` written, one element type.
pub static SOFTMAX_BACKWARD: KernelDesc = KernelDesc {
    name: "softmax_backward",
    operands: &[
        OperandSpec::read("y", FLOATS),
        OperandSpec::read("dy", FLOATS),
        OperandSpec::write("dx", FLOATS),
    ],
    params: param_layout!(SoftmaxParams, "softmax.cuh", [bh, t, scale, pad]),
    check: Some(check),
    twin: backward_twin,
    cuda: CudaSide::Nvrtc {
        source: "softmax.cu",
        plan: |info| plan(info, "softmax_backward"),
    },
};

/// Elements of `bh` matrices of `t × t`, or `None` on overflow.
fn elements(bh: u64, t: u64) -> Option<u64> {
    t.checked_mul(t)?.checked_mul(bh)
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: SoftmaxParams = info.params()?;
    let Some(n) = elements(p.bh, p.t).and_then(|n| usize::try_from(n).ok()) else {
        return Err(info
            .desc
            .error(format!("[{}, {}, {}] overflows", p.bh, p.t, p.t)));
    };
    expect_all(
        info,
        &format!("[BH, T, T] = [{}, {}, {}]", p.bh, p.t, p.t),
        n,
    )
}

fn plan(info: &LaunchInfo<'_>, entry: &str) -> Result<Vec<Grid>> {
    let p: SoftmaxParams = info.params()?;
    let rows = p.bh * p.t;
    if rows == 0 {
        return Ok(vec![]);
    }
    let t = info.dtype(0).map_or("?", |d| d.name());
    let per_block = (SOFTMAX_THREADS / 32) as u64;
    let blocks = rows.div_ceil(per_block).min(65_535) as u32;
    Ok(vec![Grid::linear(
        format!("{entry}_{t}"),
        blocks,
        SOFTMAX_THREADS,
    )])
}

/// `n` rounded up to whole warps (32 lanes).
fn whole_warps(n: usize) -> usize {
    n.div_ceil(32) * 32
}

/// One row `i` of the forward: `x` holds its `i + 1` elements on and below the diagonal, `y`
/// the whole row of `T`, `buf` room for `x` rounded up to whole warps. The padding is `-inf`,
/// whose `exp` is 0: it leaves the maximum and every lane's sum as they are (`p + 0 = p` for
/// the non-negative partials), and keeps the `exp` loop free of a scalar tail. Lane `l` of the
/// 32 running maxima and sums takes elements `l, l + 32, …`, as the kernel's lanes do.
#[inline(always)]
fn forward_row<T: Float>(x: &[T], y: &mut [T], scale: f32, buf: &mut [f32]) {
    let n = x.len();
    let full = n / 32 * 32;
    let mut mx = [f32::NEG_INFINITY; 32];
    for (b, x) in buf.chunks_exact_mut(32).zip(x.chunks_exact(32)) {
        for l in 0..32 {
            b[l] = scale * x[l].get();
            mx[l] = mx[l].max(b[l]);
        }
    }
    let (tail, pad) = buf[full..].split_at_mut(n - full);
    for (b, &x) in tail.iter_mut().zip(&x[full..]) {
        *b = scale * x.get();
    }
    pad.fill(f32::NEG_INFINITY);
    for (m, &b) in mx.iter_mut().zip(&buf[full..]) {
        *m = m.max(b);
    }
    let m = lanes::max_lanes(mx);
    let mut sums = [0f32; 32];
    for b in buf.chunks_exact_mut(32) {
        for l in 0..32 {
            b[l] = math::exp(b[l] - m);
            sums[l] += b[l];
        }
    }
    let inv = 1.0 / lanes::warp_sum(&sums);
    let (low, high) = y.split_at_mut(n);
    for (y, &e) in low.iter_mut().zip(buf.iter()) {
        *y = T::put(e * inv);
    }
    high.fill(T::put(0.0));
}

/// One row of the backward, as [`forward_row`] (`y` and `dy` its live elements, `dx` the
/// whole row).
#[inline(always)]
fn backward_row<T: Float>(y: &[T], dy: &[T], dx: &mut [T], scale: f32) {
    let mut sums = [0f32; 32];
    for (y, dy) in y.chunks_exact(32).zip(dy.chunks_exact(32)) {
        for l in 0..32 {
            sums[l] += dy[l].get() * y[l].get();
        }
    }
    let full = y.len() / 32 * 32;
    for ((s, &y), &dy) in sums.iter_mut().zip(&y[full..]).zip(&dy[full..]) {
        *s += dy.get() * y.get();
    }
    let d = lanes::warp_sum(&sums);
    let (low, high) = dx.split_at_mut(y.len());
    for ((dx, &y), &dy) in low.iter_mut().zip(y).zip(dy) {
        *dx = T::put(scale * (y.get() * (dy.get() - d)));
    }
    high.fill(T::put(0.0));
}

fn forward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: SoftmaxParams = a.params()?;
    let t = p.t as usize;
    let x = a.read_as::<T>(0)?;
    let y = a.take_as::<T>(1)?;
    if t == 0 {
        return Ok(());
    }
    let mut buf = vec![0f32; whole_warps(t)];
    simd(
        #[inline(always)]
        || {
            for (r, (x, y)) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)).enumerate() {
                let n = r % t + 1;
                forward_row(&x[..n], y, p.scale, &mut buf[..whole_warps(n)]);
            }
        },
    );
    Ok(())
}

fn backward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: SoftmaxParams = a.params()?;
    let t = p.t as usize;
    let (y, dy) = (a.read_as::<T>(0)?, a.read_as::<T>(1)?);
    let dx = a.take_as::<T>(2)?;
    if t == 0 {
        return Ok(());
    }
    simd(
        #[inline(always)]
        || {
            let rows = y.chunks_exact(t).zip(dy.chunks_exact(t));
            for (r, ((y, dy), dx)) in rows.zip(dx.chunks_exact_mut(t)).enumerate() {
                let n = r % t + 1;
                backward_row(&y[..n], &dy[..n], dx, p.scale);
            }
        },
    );
    Ok(())
}

fn forward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    with_float!(a.dtype(0).unwrap_or(DType::F32), T => forward_typed::<T>(a))
}

fn backward_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    with_float!(a.dtype(0).unwrap_or(DType::F32), T => backward_typed::<T>(a))
}

fn params(bh: usize, t: usize, scale: f32) -> Result<SoftmaxParams> {
    let (bh, t) = (bh as u64, t as u64);
    if elements(bh, t).is_none_or(|n| n > usize::MAX as u64) {
        return Err(Error::InvalidArgument(format!(
            "softmax: [{bh}, {t}, {t}] overflows"
        )));
    }
    Ok(SoftmaxParams {
        bh,
        t,
        scale,
        pad: 0,
    })
}

/// Causal softmax forward on `stream`: `x` and `y` hold `bh` matrices of `t × t` `dtype`
/// elements and do not overlap; `y[i, j]` is the softmax over `j ≤ i` of `scale·x[i, j]`
/// (statistics in f32), 0 for `j > i`. See [the module](self).
#[allow(clippy::too_many_arguments)]
pub fn softmax_forward<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    x: impl Into<Input<'a>>,
    y: impl Into<DeviceView<'b>>,
    bh: usize,
    t: usize,
    scale: f32,
    dtype: DType,
) -> Result<()> {
    let (x, y) = (x.into(), y.into());
    let p = params(bh, t, scale)?;
    let ops = [Some(Operand::input(x, dtype)), Some(Operand::new(y, dtype))];
    dev.launch(stream, &SOFTMAX_FORWARD, &ops, bytemuck::bytes_of(&p))
}

/// Causal softmax backward on `stream`: from the forward's output `y` and its gradient `dy`,
/// the scores' gradient `dx[i, j] = scale·y[i, j]·(dy[i, j] − Σ_{k≤i} dy[i, k]·y[i, k])` for
/// `j ≤ i`, 0 above the diagonal. All three hold `bh` matrices of `t × t` `dtype` elements;
/// `dx` overlaps neither input.
#[allow(clippy::too_many_arguments)]
pub fn softmax_backward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    y: impl Into<Input<'a>>,
    dy: impl Into<Input<'b>>,
    dx: impl Into<DeviceView<'c>>,
    bh: usize,
    t: usize,
    scale: f32,
    dtype: DType,
) -> Result<()> {
    let (y, dy, dx) = (y.into(), dy.into(), dx.into());
    let p = params(bh, t, scale)?;
    let ops = [
        Some(Operand::input(y, dtype)),
        Some(Operand::input(dy, dtype)),
        Some(Operand::new(dx, dtype)),
    ];
    dev.launch(stream, &SOFTMAX_BACKWARD, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f64 reference of one row's forward.
    fn row64(x: &[f64], scale: f64) -> Vec<f64> {
        let m = x
            .iter()
            .map(|v| v * scale)
            .fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v * scale - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    #[test]
    fn rows_match_f64_and_keep_zeros_above_the_diagonal() {
        for n in [1usize, 2, 31, 32, 33, 100] {
            let t = n + 3;
            let x: Vec<f32> = (0..n).map(|j| ((j * 37 % 11) as f32 - 5.0) * 0.7).collect();
            let mut y = vec![f32::NAN; t];
            let mut buf = vec![0f32; whole_warps(n)];
            forward_row(&x, &mut y, 0.3, &mut buf);
            let want = row64(
                &x.iter().map(|&v| v as f64).collect::<Vec<_>>(),
                0.3f32 as f64,
            );
            for (g, w) in y.iter().zip(&want) {
                assert!((*g as f64 - w).abs() <= 1e-7 + 1e-6 * w, "{g} vs {w}");
            }
            assert!(y[n..].iter().all(|&v| v.to_bits() == 0));
        }
    }

    #[test]
    fn backward_row_matches_finite_differences() {
        let n = 45;
        let scale = 0.25f64;
        let x: Vec<f64> = (0..n).map(|j| ((j * 13 % 7) as f64 - 3.0) * 0.9).collect();
        let dy: Vec<f64> = (0..n).map(|j| ((j * 5 % 9) as f64 - 4.0) * 0.3).collect();
        let loss = |x: &[f64]| -> f64 { row64(x, scale).iter().zip(&dy).map(|(a, b)| a * b).sum() };
        let y32: Vec<f32> = row64(&x, scale).iter().map(|&v| v as f32).collect();
        let dy32: Vec<f32> = dy.iter().map(|&v| v as f32).collect();
        let mut dx = vec![0f32; n + 1];
        backward_row(&y32, &dy32, &mut dx, scale as f32);
        for j in 0..n {
            let h = 1e-6;
            let (mut a, mut b) = (x.clone(), x.clone());
            a[j] += h;
            b[j] -= h;
            let fd = (loss(&a) - loss(&b)) / (2.0 * h);
            assert!((dx[j] as f64 - fd).abs() <= 1e-6, "{j}: {} vs {fd}", dx[j]);
        }
        assert_eq!(dx[n], 0.0);
    }
}
