use crate::device::kernel::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::expect_all;
use crate::ops::{lanes, math};

abi! {
    /// The parameters of `kernels/softmax.cu` (`softmax.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct SoftmaxParams {
        /// Matrices (batch · heads).
        pub bh: u64,
        /// Rows of each matrix (the block's query positions).
        pub rows: u64,
        /// Columns of each matrix (the key positions).
        pub cols: u64,
        /// The global position of row 0: row `i` sees the columns `j ≤ offset + i`.
        pub offset: u64,
        /// The factor applied to the scores before the softmax (and to the gradient after it).
        pub scale: f32,
        /// Padding (0).
        pub pad: u32,
    }
}

/// Threads per block of the softmax kernels: 8 warps, one row each.
pub const SOFTMAX_THREADS: u32 = 256;

const FLOATS: &[DType] = &DType::FLOATS;

abi! {
    /// Causal softmax forward: scores `x` read, probabilities `y` written, one element type.
    static SOFTMAX_FORWARD: KernelDesc = KernelDesc {
        name: "softmax_forward",
        operands: &[
            OperandSpec::read("x", FLOATS),
            OperandSpec::write("y", FLOATS),
        ],
        params: param_layout!(
            SoftmaxParams,
            "softmax.cuh",
            [bh, rows, cols, offset, scale, pad]
        ),
        check: Some(check),
        twin: forward_twin,
        cuda: CudaSide::Nvrtc {
            source: "softmax.cu",
            plan: |info| plan(info, "softmax_forward"),
        },
    };
}

abi! {
    /// Causal softmax backward: probabilities `y` and their gradient `dy` read, the scores'
    /// gradient `dx` written, one element type.
    static SOFTMAX_BACKWARD: KernelDesc = KernelDesc {
        name: "softmax_backward",
        operands: &[
            OperandSpec::read("y", FLOATS),
            OperandSpec::read("dy", FLOATS),
            OperandSpec::write("dx", FLOATS),
        ],
        params: param_layout!(
            SoftmaxParams,
            "softmax.cuh",
            [bh, rows, cols, offset, scale, pad]
        ),
        check: Some(check),
        twin: backward_twin,
        cuda: CudaSide::Nvrtc {
            source: "softmax.cu",
            plan: |info| plan(info, "softmax_backward"),
        },
    };
}

/// The elements of the parameters' matrices, or why they are not a valid block: sizes that
/// overflow, rows without columns, a position `offset + rows` past `u64`, a non-finite scale.
fn validate(p: &SoftmaxParams) -> std::result::Result<usize, String> {
    let shape = format!("[{}, {}, {}] (offset {})", p.bh, p.rows, p.cols, p.offset);
    let n = p.rows.checked_mul(p.cols).and_then(|n| n.checked_mul(p.bh));
    let Some(n) = n.and_then(|n| usize::try_from(n).ok()) else {
        return Err(format!("{shape} overflows"));
    };
    if p.offset.checked_add(p.rows).is_none() {
        return Err(format!("{shape}: offset + rows overflows"));
    }
    if p.cols == 0 && p.rows > 0 {
        return Err(format!("{shape}: rows of 0 columns have no softmax"));
    }
    if !p.scale.is_finite() {
        return Err(format!("{shape}: the scale {} is not finite", p.scale));
    }
    Ok(n)
}

fn check(info: &LaunchInfo<'_>) -> Result<()> {
    let p: SoftmaxParams = info.params()?;
    let n = validate(&p).map_err(|e| info.desc.error(e))?;
    let shape = format!(
        "[BH, rows, cols] = [{}, {}, {}] (offset {})",
        p.bh, p.rows, p.cols, p.offset
    );
    expect_all(info, &shape, n)
}

fn plan(info: &LaunchInfo<'_>, entry: &str) -> Result<Vec<Grid>> {
    let p: SoftmaxParams = info.params()?;
    // Checked: `bh · rows` does not overflow when there are columns.
    let rows = p.bh.wrapping_mul(p.rows);
    if rows == 0 || p.cols == 0 {
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

/// The live elements of row `r` (counted over all matrices) of a block: `min(offset + r % rows
/// + 1, cols)`.
#[inline(always)]
fn live(p: &SoftmaxParams, r: usize) -> usize {
    let n = p
        .offset
        .saturating_add((r as u64) % p.rows)
        .saturating_add(1);
    n.min(p.cols) as usize
}

/// One row of the forward: `x` holds its live elements, `y` the whole row of `cols`, `buf` room for `x` rounded up to whole warps. The padding is `-inf`,
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
    let cols = p.cols as usize;
    let x = a.read_as::<T>(0)?;
    let y = a.take_as::<T>(1)?;
    if p.rows == 0 || cols == 0 {
        return Ok(());
    }
    let mut buf = vec![0f32; whole_warps(cols)];
    simd(
        #[inline(always)]
        || {
            for (r, (x, y)) in x
                .chunks_exact(cols)
                .zip(y.chunks_exact_mut(cols))
                .enumerate()
            {
                let n = live(&p, r);
                forward_row(&x[..n], y, p.scale, &mut buf[..whole_warps(n)]);
            }
        },
    );
    Ok(())
}

fn backward_typed<T: Float>(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: SoftmaxParams = a.params()?;
    let cols = p.cols as usize;
    let (y, dy) = (a.read_as::<T>(0)?, a.read_as::<T>(1)?);
    let dx = a.take_as::<T>(2)?;
    if p.rows == 0 || cols == 0 {
        return Ok(());
    }
    simd(
        #[inline(always)]
        || {
            let rows = y.chunks_exact(cols).zip(dy.chunks_exact(cols));
            for (r, ((y, dy), dx)) in rows.zip(dx.chunks_exact_mut(cols)).enumerate() {
                let n = live(&p, r);
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

/// A block of causal softmax rows: `bh` matrices of `rows × cols` scores whose row `i` is the
/// global query position `offset + i` and sees the key columns `j ≤ offset + i` (`min(offset +
/// i + 1, cols)` live elements). The square `[BH, T, T]` of self-attention is
/// [`SoftmaxBlock::square`]; rank `r` of `N` in ring self-attention holds
/// `rows = T/N, cols = T, offset = r·T/N`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxBlock {
    /// Matrices (batch · heads).
    pub bh: usize,
    /// Rows of each matrix (the block's query positions).
    pub rows: usize,
    /// Columns of each matrix (the key positions).
    pub cols: usize,
    /// The global position of row 0 (the first query of the block).
    pub offset: usize,
    /// The factor applied to the scores before the softmax (and to the gradient after it);
    /// finite.
    pub scale: f32,
}

impl SoftmaxBlock {
    /// The square `[bh, t, t]` of causal self-attention: `rows = cols = t`, offset 0.
    pub fn square(bh: usize, t: usize, scale: f32) -> Self {
        Self {
            bh,
            rows: t,
            cols: t,
            offset: 0,
            scale,
        }
    }

    /// The elements of the block's operands, `bh · rows · cols`, or `None` on overflow.
    pub fn elements(&self) -> Option<usize> {
        self.rows.checked_mul(self.cols)?.checked_mul(self.bh)
    }

    /// The kernels' parameters, or a typed error when the block is not valid.
    fn params(&self) -> Result<SoftmaxParams> {
        let p = SoftmaxParams {
            bh: self.bh as u64,
            rows: self.rows as u64,
            cols: self.cols as u64,
            offset: self.offset as u64,
            scale: self.scale,
            pad: 0,
        };
        validate(&p).map_err(|reason| Error::Operands {
            op: "softmax",
            reason,
        })?;
        Ok(p)
    }
}

/// Causal softmax forward on `stream` over a block of rows: `x` and `y` hold the block's
/// `bh · rows · cols` `dtype` elements and do not overlap; `y[i, j]` is the softmax over the
/// live `j < min(offset + i + 1, cols)` of `scale·x[i, j]` (statistics in f32), exactly 0 past
/// them. See [`softmax_forward`].
///
/// Errors: [`Error::Operands`] on sizes that overflow, rows without columns, a non-finite
/// scale, or operands that do not hold the block (nothing is written).
pub fn softmax_block_forward<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    x: impl Into<Input<'a>>,
    y: impl Into<DeviceView<'b>>,
    block: &SoftmaxBlock,
    dtype: DType,
) -> Result<()> {
    let (x, y) = (x.into(), y.into());
    let p = block.params()?;
    let ops = [Some(Operand::input(x, dtype)), Some(Operand::new(y, dtype))];
    dev.launch(stream, &SOFTMAX_FORWARD, &ops, bytemuck::bytes_of(&p))
}

/// Causal softmax backward on `stream` over a block of rows: from the forward's output `y` and
/// its gradient `dy`, the scores' gradient
/// `dx[i, j] = scale·y[i, j]·(dy[i, j] − Σ_{k<n_i} dy[i, k]·y[i, k])` for the live
/// `j < n_i = min(offset + i + 1, cols)`, exactly 0 past them. All three hold the block's
/// `bh · rows · cols` `dtype` elements; `dx` overlaps neither input. Errors as
/// [`softmax_block_forward`].
pub fn softmax_block_backward<'a, 'b, 'c>(
    dev: &Device,
    stream: &Stream,
    y: impl Into<Input<'a>>,
    dy: impl Into<Input<'b>>,
    dx: impl Into<DeviceView<'c>>,
    block: &SoftmaxBlock,
    dtype: DType,
) -> Result<()> {
    let (y, dy, dx) = (y.into(), dy.into(), dx.into());
    let p = block.params()?;
    let ops = [
        Some(Operand::input(y, dtype)),
        Some(Operand::input(dy, dtype)),
        Some(Operand::new(dx, dtype)),
    ];
    dev.launch(stream, &SOFTMAX_BACKWARD, &ops, bytemuck::bytes_of(&p))
}

/// Causal softmax, the middle of attention, on a block of score rows: `x` of shape
/// `[BH, rows, cols]` (batch·heads matrices of `rows × cols`, row-major) whose row `i` is the
/// global query position `o + i` (`o` the block's offset), seeing the key columns `j ≤ o + i`,
/// and a scale `s` (`1/√head_dim`). Row `i` has `n_i = min(o + i + 1, cols)` live elements.
/// Forward ([`softmax_block_forward`]):
/// `y[i, j] = exp(s·x[i, j] − m_i) / Σ_{k<n_i} exp(s·x[i, k] − m_i)` for `j < n_i` with
/// `m_i = max_{k<n_i} s·x[i, k]`, and exactly 0 for `j ≥ n_i`; backward
/// ([`softmax_block_backward`]) `dx[i, j] = s·y[i, j]·(dy[i, j] − Σ_{k<n_i} dy[i, k]·y[i, k])`
/// for `j < n_i`, exactly 0 past them. Past the live elements `x`, `y` and `dy` are never read.
///
/// The square `[BH, T, T]` of ordinary self-attention is `rows = cols = T`, offset 0
/// ([`softmax_forward`], [`softmax_backward`]): `n_i = i + 1`, 0 above the diagonal. Ring
/// self-attention over `N` ranks holds on rank `r` the rows `r·T/N …` of that square: the block
/// `rows = T/N`, `cols = T`, offset `r·T/N` ([`SoftmaxBlock`]), whose rows are the square's bit
/// for bit.
///
/// Storage f32, f16 or bf16; the maximum, the sums and every product in f32. CUDA
/// (`kernels/softmax.cu`) runs one warp per row: lane `l` takes the row's live elements
/// `l, l + 32, …`, and the warp reduces by the xor butterfly; the CPU twin keeps that order
/// (`ops::lanes`) and uses [`math::exp`], so the two agree bit for bit.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::SoftmaxBlock;
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// // One 2 × 2 matrix of scores; the scale 1.
/// let x = dev.upload(&s, bytemuck::cast_slice(&[5.0f32, 9.0, 1.0, 1.0]))?;
/// let y = dev.alloc(16)?;
/// tidemem::ops::softmax_forward(&dev, &s, &x, &y, 1, 2, 1.0, DType::F32)?;
/// let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
/// assert_eq!(y, [1.0, 0.0, 0.5, 0.5]);
///
/// // Row 1 of that square alone: a block of one row at offset 1 over 2 columns.
/// let x1 = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 1.0]))?;
/// let y1 = dev.alloc(8)?;
/// let block = SoftmaxBlock { bh: 1, rows: 1, cols: 2, offset: 1, scale: 1.0 };
/// tidemem::ops::softmax_block_forward(&dev, &s, &x1, &y1, &block, DType::F32)?;
/// let y1: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y1)?);
/// assert_eq!(y1, [0.5, 0.5]);
/// # Ok(()) }
/// ```
///
/// Causal softmax forward on `stream`: `x` and `y` hold `bh` matrices of `t × t` `dtype`
/// elements and do not overlap; `y[i, j]` is the softmax over `j ≤ i` of `scale·x[i, j]`
/// (statistics in f32), 0 for `j > i`. The block [`SoftmaxBlock::square`] of
/// [`softmax_block_forward`]. See [`softmax_forward`].
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
    let block = SoftmaxBlock::square(bh, t, scale);
    softmax_block_forward(dev, stream, x, y, &block, dtype)
}

/// Causal softmax backward on `stream`: from the forward's output `y` and its gradient `dy`,
/// the scores' gradient `dx[i, j] = scale·y[i, j]·(dy[i, j] − Σ_{k≤i} dy[i, k]·y[i, k])` for
/// `j ≤ i`, 0 above the diagonal. All three hold `bh` matrices of `t × t` `dtype` elements;
/// `dx` overlaps neither input. The block [`SoftmaxBlock::square`] of
/// [`softmax_block_backward`].
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
    let block = SoftmaxBlock::square(bh, t, scale);
    softmax_block_backward(dev, stream, y, dy, dx, &block, dtype)
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

    fn p(bh: u64, rows: u64, cols: u64, offset: u64, scale: f32) -> SoftmaxParams {
        SoftmaxParams {
            bh,
            rows,
            cols,
            offset,
            scale,
            pad: 0,
        }
    }

    #[test]
    fn live_elements_follow_the_offset_and_stop_at_the_columns() {
        // Rows 0..3 at offset 4 over 6 columns, two matrices.
        let b = p(2, 3, 6, 4, 1.0);
        let n: Vec<usize> = (0..6).map(|r| live(&b, r)).collect();
        assert_eq!(n, [5, 6, 6, 5, 6, 6]);
        // The square: i + 1.
        let sq = p(1, 4, 4, 0, 1.0);
        assert_eq!(
            (0..4).map(|r| live(&sq, r)).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        // Positions past u64 saturate (validate refuses them before a launch).
        assert_eq!(live(&p(1, 2, 9, u64::MAX, 1.0), 1), 9);
    }

    #[test]
    fn validate_counts_elements_and_names_what_is_wrong() {
        assert_eq!(validate(&p(2, 3, 6, 4, 0.5)), Ok(36));
        assert_eq!(validate(&p(0, 3, 6, 4, 0.5)), Ok(0));
        assert_eq!(validate(&p(2, 0, 0, 0, 0.5)), Ok(0));
        let err = |q| validate(&q).unwrap_err();
        assert!(err(p(u64::MAX, 2, 2, 0, 1.0)).contains("overflows"));
        assert!(err(p(1, 2, 2, u64::MAX, 1.0)).contains("offset + rows"));
        assert!(err(p(1, 2, 0, 0, 1.0)).contains("0 columns"));
        assert!(err(p(1, 2, 2, 0, f32::NAN)).contains("not finite"));
    }
}
