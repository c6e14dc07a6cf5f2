use crate::device::kernel::{grid_stride, grid_stride_blocks, param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, Input, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
    TwinArgs,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::float::{simd, with_float, Float};
use crate::ops::rows::{add_columns, column_chunks, elements, expect, scratch, Operands};

abi! {
    /// The parameters of `bias_rows` (`BiasParams` in `kernels/bias.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct BiasParams {
        /// Rows, N.
        pub rows: u64,
        /// Columns, C (at least 1).
        pub cols: u64,
        /// 1: `y += b`; 0: `y = b`.
        pub accumulate: u32,
        /// Zero.
        pub pad: u32,
    }
}

abi! {
    /// The parameters of `bias_grad` (`BiasGradParams` in `kernels/bias.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct BiasGradParams {
        /// Rows, N.
        pub rows: u64,
        /// Columns, C (at least 1).
        pub cols: u64,
        /// Rows per chunk of the column sums: `column_chunks(rows).0`.
        pub(crate) chunk_rows: u64,
        /// Chunks: `column_chunks(rows).1`.
        pub chunks: u64,
        /// 1: `db += Σ dy`; 0: `db = Σ dy`.
        pub accumulate: u32,
        /// Zero.
        pub pad: u32,
    }
}

impl BiasGradParams {
    /// The parameters of a bias gradient over `[rows, cols]`.
    pub fn new(rows: usize, cols: usize, accumulate: bool) -> Self {
        let (per, chunks) = column_chunks(rows);
        BiasGradParams {
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

abi! {
    /// `y = b` or `y += b` broadcast over rows: `b` `[C]` read, `y` `[N, C]` read and written, one
    /// element type.
    static BIAS_ROWS: KernelDesc = KernelDesc {
        name: "bias_rows",
        operands: &[
            OperandSpec::read("b", FLOATS),
            OperandSpec::read_write("y", FLOATS),
        ],
        params: param_layout!(BiasParams, "bias.cuh", [rows, cols, accumulate, pad]),
        check: Some(check_rows),
        twin: rows_twin,
        cuda: CudaSide::Nvrtc {
            source: "bias.cu",
            plan: plan_rows,
        },
    };
}

abi! {
    /// `db (+)= Σ_rows dy`: `dy` `[N, C]` read, `db` `[C]` (any model float) read and written,
    /// `scratch` (f32, [`bias_grad_scratch_bytes`]) written.
    static BIAS_GRAD: KernelDesc = KernelDesc {
        name: "bias_grad",
        operands: &[
            OperandSpec::read("dy", FLOATS),
            OperandSpec::read_write("db", FLOATS),
            OperandSpec::write("scratch", &[DType::F32]),
        ],
        params: param_layout!(
            BiasGradParams,
            "bias.cuh",
            [rows, cols, chunk_rows, chunks, accumulate, pad]
        ),
        check: Some(check_grad),
        twin: grad_twin,
        cuda: CudaSide::Nvrtc {
            source: "bias.cu",
            plan: plan_grad,
        },
    };
}

/// Bytes of the scratch operand of [`bias_grad`] over `[rows, cols]`: one f32 column sum per
/// chunk of rows (at most 256 chunks, so at most `1 KiB · cols`).
pub fn bias_grad_scratch_bytes(rows: usize, cols: usize) -> usize {
    column_chunks(rows).1.saturating_mul(cols).saturating_mul(4)
}

fn check_rows(info: &LaunchInfo<'_>) -> Result<()> {
    let p: BiasParams = info.params()?;
    if p.cols == 0 || p.accumulate > 1 {
        return Err(info.desc.error(format!(
            "C = {} columns (at least 1), accumulate = {} (0 or 1)",
            p.cols, p.accumulate
        )));
    }
    let nc = elements(info, p.rows, p.cols)?;
    let t = info.dtype(0).unwrap_or(DType::F32);
    let c = p.cols as usize;
    expect(info, 0, &format!("[C] = [{c}]"), c, t)?;
    expect(info, 1, &format!("[N, C] = [{}, {c}]", p.rows), nc, t)
}

fn check_grad(info: &LaunchInfo<'_>) -> Result<()> {
    let p: BiasGradParams = info.params()?;
    let (n, c) = (p.rows as usize, p.cols as usize);
    let (per, chunks) = column_chunks(n);
    if p.cols == 0
        || (p.chunk_rows, p.chunks, p.accumulate) != (per as u64, chunks as u64, p.accumulate & 1)
    {
        return Err(info.desc.error(format!(
            "C = {c}, chunk_rows = {}, chunks = {}, accumulate = {} for {n} rows (expected C ≥ \
             1, {per}, {chunks}, 0 or 1: BiasGradParams::new)",
            p.chunk_rows, p.chunks, p.accumulate
        )));
    }
    let nc = elements(info, p.rows, p.cols)?;
    let t = info.dtype(0).unwrap_or(DType::F32);
    let g = info.dtype(1).unwrap_or(DType::F32);
    expect(info, 0, &format!("[N, C] = [{n}, {c}]"), nc, t)?;
    expect(info, 1, &format!("[C] = [{c}]"), c, g)?;
    let shape = format!("[chunks, C] = [{chunks}, {c}]");
    expect(info, 2, &shape, chunks * c, DType::F32)
}

fn plan_rows(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let t = info.dtype(0).map_or("?", |d| d.name());
    Ok(grid_stride(format!("bias_rows_{t}"), info.len(1)))
}

fn plan_grad(info: &LaunchInfo<'_>) -> Result<Vec<Grid>> {
    let p: BiasGradParams = info.params()?;
    let t = info.dtype(0).map_or("?", |d| d.name());
    let g = info.dtype(1).map_or("?", |d| d.name());
    let mut v = vec![];
    if p.chunks > 0 {
        v.push(Grid::linear(
            format!("bias_grad_partial_{t}"),
            p.chunks as u32,
            256,
        ));
    }
    // With no rows the sum is 0: the reduction still writes (or adds) it.
    v.push(Grid::linear(
        format!("bias_grad_reduce_{g}"),
        grid_stride_blocks(p.cols as usize, 256),
        256,
    ));
    Ok(v)
}

fn rows_typed<T: Float>(mut o: Operands<'_>, p: &BiasParams) -> Result<()> {
    let c = p.cols as usize;
    let b = o.read::<T>(0)?;
    let y = o.write::<T>(1)?;
    if p.accumulate == 0 {
        for row in y.chunks_exact_mut(c) {
            row.copy_from_slice(b);
        }
        return Ok(());
    }
    let bv = T::widen(b, &mut vec![0.0; c]).to_vec();
    let (mut buf, mut out) = (vec![0.0f32; c], vec![0.0f32; c]);
    simd(
        #[inline(always)]
        || {
            for row in y.chunks_exact_mut(c) {
                for ((o, &v), &b) in out.iter_mut().zip(T::widen(row, &mut buf)).zip(&bv) {
                    *o = v + b;
                }
                T::narrow(&out, row);
            }
        },
    );
    Ok(())
}

fn rows_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: BiasParams = a.params()?;
    let o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => rows_typed::<T>(o, &p))
}

/// Each chunk's column sums into `scratch`: rows in order, four at a time per column (so a
/// column's running sum stays in a register across them).
fn grad_partials<T: Float>(
    o: &Operands<'_>,
    p: &BiasGradParams,
    scratch: &mut [f32],
) -> Result<()> {
    let (n, c) = (p.rows as usize, p.cols as usize);
    let dy = o.read::<T>(0)?;
    let per = p.chunk_rows.max(1) as usize;
    simd(
        #[inline(always)]
        || {
            for (k, part) in scratch.chunks_exact_mut(c).enumerate() {
                part.fill(0.0);
                let rows = &dy[k * per * c..((k + 1) * per).min(n) * c];
                let mut quads = rows.chunks_exact(4 * c);
                for q in &mut quads {
                    let (r0, rest) = q.split_at(c);
                    let (r1, rest) = rest.split_at(c);
                    let (r2, r3) = rest.split_at(c);
                    let cols = part.iter_mut().zip(r0).zip(r1).zip(r2).zip(r3);
                    for ((((s, &a), &b), &d), &e) in cols {
                        *s = (((*s + a.get()) + b.get()) + d.get()) + e.get();
                    }
                }
                for row in quads.remainder().chunks_exact(c) {
                    for (s, &a) in part.iter_mut().zip(row) {
                        *s += a.get();
                    }
                }
            }
        },
    );
    Ok(())
}

/// `db (+)= Σ_chunks`, the chunks in order, one rounding.
fn grad_reduce<G: Float>(o: &mut Operands<'_>, p: &BiasGradParams, scratch: &[f32]) -> Result<()> {
    let c = p.cols as usize;
    let db = o.write::<G>(1)?;
    let (mut sum, mut buf) = (vec![0.0f32; c], vec![0.0f32; c]);
    simd(
        #[inline(always)]
        || {
            for part in scratch.chunks_exact(c) {
                add_columns(&mut sum, part);
            }
            if p.accumulate != 0 {
                for (s, &v) in sum.iter_mut().zip(G::widen(db, &mut buf)) {
                    *s += v;
                }
            }
            G::narrow(&sum, db);
        },
    );
    Ok(())
}

fn grad_twin(a: &mut TwinArgs<'_>) -> Result<()> {
    let p: BiasGradParams = a.params()?;
    let mut o = Operands::checked(a, bytemuck::bytes_of(&p))?;
    let scratch = o.write::<f32>(2)?;
    with_float!(o.dtype(0).unwrap_or(DType::F32), T => grad_partials::<T>(&o, &p, scratch))?;
    with_float!(o.dtype(1).unwrap_or(DType::F32), G => grad_reduce::<G>(&mut o, &p, scratch))
}

fn launch_rows<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    (b, y): (Input<'a>, DeviceView<'b>),
    (rows, cols): (usize, usize),
    accumulate: bool,
    dtype: DType,
) -> Result<()> {
    let p = BiasParams {
        rows: rows as u64,
        cols: cols as u64,
        accumulate: accumulate as u32,
        pad: 0,
    };
    let ops = [Some(Operand::input(b, dtype)), Some(Operand::new(y, dtype))];
    dev.launch(stream, &BIAS_ROWS, &ops, bytemuck::bytes_of(&p))
}

/// The bias of a linear layer `Y[N, C] = X·Wᵀ + b`, on f32, f16 or bf16 storage with f32 math.
///
/// Forward: [`bias_rows`] writes `b` into every row of the output (`y[r, c] = b[c]`, the stored
/// value copied), and the GEMM then runs with β = 1 so it adds `X·Wᵀ` to it — the bias add costs
/// one write of `Y` and no extra read. [`add_bias_rows`] adds instead (`y += b`, in f32, rounded
/// once).
///
/// Backward: [`bias_grad`] sums the output gradient over its rows, `db[c] (+)= Σ_r dy[r, c]`,
/// in f32 and in a fixed order: the rows are cut into fixed chunks
/// ([`column_chunks`]), each chunk's column sums are written to
/// a scratch operand of [`bias_grad_scratch_bytes`], then the chunks are added in order and the
/// total is written to (or added to) `db` with one rounding. `db` is f32 (what a mixed-precision
/// trainer's fp32 gradient holds) or any model float; no atomics, so the result is the same
/// bits every run. CUDA runs `kernels/bias.cu`; the CPU twin adds in the same order, bit for
/// bit.
///
/// ```
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::ops::{bias_grad, bias_grad_scratch_bytes, bias_rows, BiasGrad};
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let s = dev.new_stream()?;
/// let b = dev.upload(&s, bytemuck::cast_slice(&[1.0f32, 2.0]))?;
/// let y = dev.alloc(3 * 2 * 4)?;
/// bias_rows(&dev, &s, &b, &y, 3, 2, DType::F32)?;
/// let got: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &y)?);
/// assert_eq!(got, [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
///
/// let db = dev.alloc(8)?;
/// let scratch = dev.alloc(bias_grad_scratch_bytes(3, 2))?;
/// let ops = BiasGrad {
///     dy: (&y).into(),
///     db: (&db).into(),
///     db_dtype: DType::F32,
///     accumulate: false,
///     scratch: (&scratch).into(),
/// };
/// bias_grad(&dev, &s, ops, 3, 2, DType::F32)?;
/// let db: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &db)?);
/// assert_eq!(db, [3.0, 6.0]);
/// # Ok(()) }
/// ```
///
/// `y[r, c] = b[c]` for every row of `y` `[rows, cols]` on `stream`: the bias of a linear
/// forward written before its GEMM runs with β = 1. `b` holds `cols` and `y` `rows · cols`
/// elements of `dtype`; they do not overlap.
pub fn bias_rows<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    b: impl Into<Input<'a>>,
    y: impl Into<DeviceView<'b>>,
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Result<()> {
    launch_rows(
        dev,
        stream,
        (b.into(), y.into()),
        (rows, cols),
        false,
        dtype,
    )
}

/// `y[r, c] += b[c]` (in f32, rounded once) for every row of `y` `[rows, cols]` on `stream`;
/// shapes as [`bias_rows`].
pub fn add_bias_rows<'a, 'b>(
    dev: &Device,
    stream: &Stream,
    b: impl Into<Input<'a>>,
    y: impl Into<DeviceView<'b>>,
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Result<()> {
    launch_rows(dev, stream, (b.into(), y.into()), (rows, cols), true, dtype)
}

/// The operands of [`bias_grad`].
#[derive(Clone, Copy, Debug)]
pub struct BiasGrad<'a> {
    /// `[N, C]` gradient of the layer's output.
    pub dy: Input<'a>,
    /// `[C]` bias gradient.
    pub db: DeviceView<'a>,
    /// `db`'s element type: f32 (recommended) or any model float.
    pub db_dtype: DType,
    /// `true`: `db += Σ dy`; `false`: `db = Σ dy`.
    pub accumulate: bool,
    /// At least [`bias_grad_scratch_bytes`] bytes (only those are used), 4-byte aligned.
    pub scratch: DeviceView<'a>,
}

/// `db (+)= Σ_rows dy` over `dy` `[rows, cols]` of `dtype` on `stream` (see
/// [`bias_rows`]); no written operand may overlap another operand.
pub fn bias_grad(
    dev: &Device,
    stream: &Stream,
    ops: BiasGrad<'_>,
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Result<()> {
    let need = bias_grad_scratch_bytes(rows, cols);
    let scratch = scratch(
        &BIAS_GRAD,
        ops.scratch,
        need,
        (rows, cols),
        "bias_grad_scratch_bytes",
    )?;
    let p = BiasGradParams::new(rows, cols, ops.accumulate);
    let operands = [
        Some(Operand::input(ops.dy, dtype)),
        Some(Operand::new(ops.db, ops.db_dtype)),
        Some(Operand::new(scratch, DType::F32)),
    ];
    dev.launch(stream, &BIAS_GRAD, &operands, bytemuck::bytes_of(&p))
}
