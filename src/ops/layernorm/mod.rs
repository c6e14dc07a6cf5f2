use crate::device::kernel::{grid_stride_blocks, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::rows::{column_chunks, elements, expect, scratch};

mod twin;
use twin::{backward_twin, forward_twin};

abi! {
    /// The parameters of the forward kernel (`LayerNormParams` in `kernels/layernorm.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct LayerNormParams {
        /// Rows, N.
        pub rows: u64,
        /// Columns, C (at least 1).
        pub cols: u64,
        /// Added to the variance (finite, ≥ 0).
        pub eps: f32,
        /// Zero.
        pub pad: u32,
    }
}

abi! {
    /// The parameters of the backward kernels (`LayerNormBackwardParams` in
    /// `kernels/layernorm.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct LayerNormBackwardParams {
        /// Rows, N.
        pub rows: u64,
        /// Columns, C (at least 1).
        pub cols: u64,
        /// Rows per chunk of the dγ/dβ column sums: `column_chunks(rows).0`.
        pub(crate) chunk_rows: u64,
        /// Chunks: `column_chunks(rows).1`.
        pub chunks: u64,
        /// 1: `dx +=` the gradient; 0: `dx =` the gradient.
        pub accumulate: u32,
        /// Zero.
        pub pad: u32,
    }
}

impl LayerNormBackwardParams {
    /// The parameters of a backward over `[rows, cols]`.
    pub fn new(rows: usize, cols: usize, accumulate: bool) -> Self {
        let (per, chunks) = column_chunks(rows);
        LayerNormBackwardParams {
            rows: rows as u64,
            cols: cols as u64,
            chunk_rows: per as u64,
            chunks: chunks as u64,
            accumulate: accumulate as u32,
            pad: 0,
        }
    }
}

const FLOATS: &[DType] = &DType::FLOATS;
const F32: &[DType] = &[DType::F32];
/// Warps (rows at a time) per block of the kernels (`LN_WARPS`).
const WARPS: usize = 8;

abi! {
    /// LayerNorm forward: `x`, optional `r`, `γ`, `β` read; optional `h` (present exactly when `r`
    /// is), `y`, `mean`, `rstd` written. All but `mean` and `rstd` (f32) of one storage type.
    static LAYERNORM_FORWARD: KernelDesc = KernelDesc {
        name: "layernorm_forward",
        operands: &[
            OperandSpec::read("x", FLOATS),
            OperandSpec::read("r", FLOATS).optional(),
            OperandSpec::read("gamma", FLOATS),
            OperandSpec::read("beta", FLOATS),
            OperandSpec::write("h", FLOATS).optional(),
            OperandSpec::write("y", FLOATS),
            OperandSpec::write("mean", F32),
            OperandSpec::write("rstd", F32),
        ],
        params: param_layout!(LayerNormParams, "layernorm.cuh", [rows, cols, eps, pad]),
        check: Some(check_forward),
        twin: forward_twin,
        cuda: CudaSide::Nvrtc {
            source: "layernorm.cu",
            plan: plan_forward,
        },
    };
}

abi! {
    /// LayerNorm backward: `dy`, `h`, `mean`, `rstd`, `γ` read; `dx` written or added to; `dγ`,
    /// `dβ` (one model float type, f32 recommended) added to; `scratch` (f32,
    /// [`layernorm_backward_scratch_bytes`]) written.
    static LAYERNORM_BACKWARD: KernelDesc = KernelDesc {
        name: "layernorm_backward",
        operands: &[
            OperandSpec::read("dy", FLOATS),
            OperandSpec::read("h", FLOATS),
            OperandSpec::read("mean", F32),
            OperandSpec::read("rstd", F32),
            OperandSpec::read("gamma", FLOATS),
            OperandSpec::read_write("dx", FLOATS),
            OperandSpec::read_write("dgamma", FLOATS),
            OperandSpec::read_write("dbeta", FLOATS),
            OperandSpec::write("scratch", F32),
        ],
        params: param_layout!(
            LayerNormBackwardParams,
            "layernorm.cuh",
            [rows, cols, chunk_rows, chunks, accumulate, pad]
        ),
        check: Some(check_backward),
        twin: backward_twin,
        cuda: CudaSide::Nvrtc {
            source: "layernorm.cu",
            plan: plan_backward,
        },
    };
}

/// Bytes of the scratch operand of [`layernorm_backward`] over `[rows, cols]`: two f32 column
/// sums (dγ, dβ) per chunk of rows (at most 256 chunks, so at most `2 KiB · cols`).
pub fn layernorm_backward_scratch_bytes(rows: usize, cols: usize) -> usize {
    column_chunks(rows).1.saturating_mul(cols).saturating_mul(8)
}

fn shape_nc(n: u64, c: u64) -> String {
    format!("[N, C] = [{n}, {c}]")
}

fn check_forward(info: &LaunchInfo<'_>) -> Result<()> {
    let p: LayerNormParams = info.params()?;
    if p.cols == 0 {
        return Err(info.desc.error("C = 0 columns: a row needs at least one"));
    }
    if !(p.eps.is_finite() && p.eps >= 0.0) {
        return Err(info.desc.error(format!("eps = {} (finite, ≥ 0)", p.eps)));
    }
    if info.present(1) != info.present(4) {
        return Err(info
            .desc
            .error("the residual `r` and the sum `h` come together: give both or neither"));
    }
    let nc = elements(info, p.rows, p.cols)?;
    let t = info.dtype(0).unwrap_or(DType::F32);
    let (n, c) = (p.rows as usize, p.cols as usize);
    let (snc, sc, sn) = (
        shape_nc(p.rows, p.cols),
        format!("[C] = [{c}]"),
        format!("[N] = [{n}]"),
    );
    for (i, shape, want, d) in [
        (0, &snc, nc, t),
        (1, &snc, nc, t),
        (2, &sc, c, t),
        (3, &sc, c, t),
        (4, &snc, nc, t),
        (5, &snc, nc, t),
        (6, &sn, n, DType::F32),
        (7, &sn, n, DType::F32),
    ] {
        expect(info, i, shape, want, d)?;
    }
    Ok(())
}

fn check_backward(info: &LaunchInfo<'_>) -> Result<()> {
    let p: LayerNormBackwardParams = info.params()?;
    if p.cols == 0 {
        return Err(info.desc.error("C = 0 columns: a row needs at least one"));
    }
    let nc = elements(info, p.rows, p.cols)?;
    let (n, c) = (p.rows as usize, p.cols as usize);
    let (per, chunks) = column_chunks(n);
    if (p.chunk_rows, p.chunks, p.accumulate) != (per as u64, chunks as u64, p.accumulate & 1) {
        return Err(info.desc.error(format!(
            "chunk_rows = {}, chunks = {}, accumulate = {} for {n} rows (expected {per}, \
             {chunks}, 0 or 1: LayerNormBackwardParams::new)",
            p.chunk_rows, p.chunks, p.accumulate
        )));
    }
    let t = info.dtype(0).unwrap_or(DType::F32);
    let g = info.dtype(6).unwrap_or(DType::F32);
    let (snc, sc, sn) = (
        shape_nc(p.rows, p.cols),
        format!("[C] = [{c}]"),
        format!("[N] = [{n}]"),
    );
    let scratch = layernorm_backward_scratch_bytes(n, c) / 4;
    let ss = format!("[chunks, 2, C] = [{chunks}, 2, {c}]");
    for (i, shape, want, d) in [
        (0, &snc, nc, t),
        (1, &snc, nc, t),
        (2, &sn, n, DType::F32),
        (3, &sn, n, DType::F32),
        (4, &sc, c, t),
        (5, &snc, nc, t),
        (6, &sc, c, g),
        (7, &sc, c, g),
        (8, &ss, scratch, DType::F32),
    ] {
        expect(info, i, shape, want, d)?;
    }
    Ok(())
}

fn plan_forward(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: LayerNormParams = info.params()?;
    let t = info.dtype(0).map_or("?", |d| d.name());
    if p.rows == 0 {
        return Ok(vec![]);
    }
    let blocks = (p.rows as usize).div_ceil(WARPS).min(65_535) as u32;
    Ok(vec![Grid::linear(
        format!("layernorm_forward_{t}"),
        blocks,
        32 * WARPS as u32,
    )])
}

fn plan_backward(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: LayerNormBackwardParams = info.params()?;
    let t = info.dtype(0).map_or("?", |d| d.name());
    let g = info.dtype(6).map_or("?", |d| d.name());
    if p.rows == 0 {
        return Ok(vec![]);
    }
    Ok(vec![
        Grid::linear(
            format!("layernorm_backward_{t}"),
            p.chunks as u32,
            32 * WARPS as u32,
        ),
        Grid::linear(
            format!("layernorm_backward_reduce_{g}"),
            grid_stride_blocks(p.cols as usize, 256),
            256,
        ),
    ])
}

/// The operands of [`layernorm_forward`].
#[derive(Clone, Copy, Debug)]
pub struct LayerNormForward<'a> {
    /// `[N, C]` input.
    pub x: Input<'a>,
    /// The residual add: `h = x + r` is normalised and written to `h` (both `[N, C]`).
    pub residual: Option<Residual<'a>>,
    /// `[C]` scale γ.
    pub gamma: Input<'a>,
    /// `[C]` shift β.
    pub beta: Input<'a>,
    /// `[N, C]` output.
    pub y: DeviceView<'a>,
    /// `[N]` f32 row means (for the backward).
    pub mean: DeviceView<'a>,
    /// `[N]` f32 reciprocal standard deviations (for the backward).
    pub rstd: DeviceView<'a>,
}

/// The residual of a fused LayerNorm forward.
#[derive(Clone, Copy, Debug)]
pub struct Residual<'a> {
    /// `[N, C]` added to `x`.
    pub r: Input<'a>,
    /// `[N, C]` where `x + r` is written.
    pub h: DeviceView<'a>,
}

/// LayerNorm over the rows of an `[N, C]` activation, fused with the residual add as GPT-2
/// (llm.c) runs it, forward ([`layernorm_forward`]) and backward ([`layernorm_backward`]), on
/// f32, f16 or bf16 storage with f32 math.
///
/// Forward: with a residual `r`, `h = x + r` is rounded to the storage type, written to `h`
/// (the residual stream) and normalised; without one `h` is `x`. Per row, in two passes,
/// `mean = Σh / C`, `rstd = 1 / √(Σ(h − mean)² / C + eps)` (f32, written for the backward),
/// and `y = ((h − mean)·rstd)·γ + β`.
///
/// Backward, per row, with `n = (h − mean)·rstd` and `w = γ·dy`:
/// `dx (+)= ((w − Σw/C) − n·Σ(w·n)/C)·rstd` — added to `dx` (how the residual stream sums its
/// gradient) or written over it — and `dγ += Σ_rows n·dy`, `dβ += Σ_rows dy`, summed in f32 in
/// a fixed order: fixed chunks of rows ([`column_chunks`])
/// write their column sums to a scratch operand of [`layernorm_backward_scratch_bytes`], then
/// the chunks are added in order, and once, with one rounding, to `dγ` and `dβ` (f32, or any
/// model float). No atomics: the result is the same bits every run.
///
/// CUDA runs `kernels/layernorm.cu` (a warp per row); the CPU twin adds in the kernel's order
/// (32 lane partial sums, the warp's butterfly) with the same single roundings, so the two agree
/// bit for bit.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::{layernorm_forward, LayerNormForward};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let up = |v: &[f32]| dev.upload(&s, bytemuck::cast_slice(v));
/// let (x, gamma, beta) = (up(&[1.0, 2.0, 3.0, 4.0])?, up(&[1.0; 2])?, up(&[0.0; 2])?);
/// let (y, mean, rstd) = (dev.alloc(16)?, dev.alloc(8)?, dev.alloc(8)?);
/// let ops = LayerNormForward {
///     x: (&x).into(),
///     residual: None,
///     gamma: (&gamma).into(),
///     beta: (&beta).into(),
///     y: (&y).into(),
///     mean: (&mean).into(),
///     rstd: (&rstd).into(),
/// };
/// layernorm_forward(&dev, &s, ops, 2, 2, 1e-5, DType::F32)?;
/// let y: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
/// let mean: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &mean)?);
/// assert_eq!(mean, [1.5, 3.5]);
/// assert!((y[0] + 1.0).abs() < 1e-4 && (y[3] - 1.0).abs() < 1e-4);
/// # Ok(()) }
/// ```
///
/// LayerNorm forward over `[rows, cols]` on `stream` (see [`layernorm_forward`]): storage of
/// `dtype` (a model float) for every operand but `mean` and `rstd` (f32); no written operand may
/// overlap another operand. A wrong shape or type is an error naming the operand and the
/// expected shape, before anything runs.
pub fn layernorm_forward(
    dev: &Device,
    stream: &Stream,
    ops: LayerNormForward<'_>,
    rows: usize,
    cols: usize,
    eps: f32,
    dtype: DType,
) -> Result<()> {
    let p = LayerNormParams {
        rows: rows as u64,
        cols: cols as u64,
        eps,
        pad: 0,
    };
    let res = ops.residual;
    let operands = [
        Some(Operand::input(ops.x, dtype)),
        res.map(|r| Operand::input(r.r, dtype)),
        Some(Operand::input(ops.gamma, dtype)),
        Some(Operand::input(ops.beta, dtype)),
        res.map(|r| Operand::new(r.h, dtype)),
        Some(Operand::new(ops.y, dtype)),
        Some(Operand::new(ops.mean, DType::F32)),
        Some(Operand::new(ops.rstd, DType::F32)),
    ];
    dev.launch(
        stream,
        &LAYERNORM_FORWARD,
        &operands,
        bytemuck::bytes_of(&p),
    )
}

/// The operands of [`layernorm_backward`].
#[derive(Clone, Copy, Debug)]
pub struct LayerNormBackward<'a> {
    /// `[N, C]` gradient of the output.
    pub dy: Input<'a>,
    /// `[N, C]` the forward's normalised input (`h` of a residual forward, else `x`).
    pub h: Input<'a>,
    /// `[N]` f32 means of the forward.
    pub mean: Input<'a>,
    /// `[N]` f32 reciprocal standard deviations of the forward.
    pub rstd: Input<'a>,
    /// `[C]` scale γ.
    pub gamma: Input<'a>,
    /// `[N, C]` input gradient.
    pub dx: DeviceView<'a>,
    /// Whether the gradient is added to `dx` (`true`: the residual stream's gradient) or
    /// written over it.
    pub accumulate: bool,
    /// `[C]` gradient of γ, added to.
    pub dgamma: DeviceView<'a>,
    /// `[C]` gradient of β, added to.
    pub dbeta: DeviceView<'a>,
    /// Element type of `dgamma` and `dbeta` (f32 recommended; any model float).
    pub param_grad_dtype: DType,
    /// At least [`layernorm_backward_scratch_bytes`] bytes (only those are used), 4-byte
    /// aligned.
    pub scratch: DeviceView<'a>,
}

/// LayerNorm backward over `[rows, cols]` on `stream` (see [`layernorm_forward`]): storage of
/// `dtype` for `dy`, `h`, `γ` and `dx`; no written operand may overlap another operand.
pub fn layernorm_backward(
    dev: &Device,
    stream: &Stream,
    ops: LayerNormBackward<'_>,
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Result<()> {
    let need = layernorm_backward_scratch_bytes(rows, cols);
    let scratch = scratch(
        &LAYERNORM_BACKWARD,
        ops.scratch,
        need,
        (rows, cols),
        "layernorm_backward_scratch_bytes",
    )?;
    let p = LayerNormBackwardParams::new(rows, cols, ops.accumulate);
    let g = ops.param_grad_dtype;
    let operands = [
        Some(Operand::input(ops.dy, dtype)),
        Some(Operand::input(ops.h, dtype)),
        Some(Operand::input(ops.mean, DType::F32)),
        Some(Operand::input(ops.rstd, DType::F32)),
        Some(Operand::input(ops.gamma, dtype)),
        Some(Operand::new(ops.dx, dtype)),
        Some(Operand::new(ops.dgamma, g)),
        Some(Operand::new(ops.dbeta, g)),
        Some(Operand::new(scratch, DType::F32)),
    ];
    dev.launch(
        stream,
        &LAYERNORM_BACKWARD,
        &operands,
        bytemuck::bytes_of(&p),
    )
}
