//! The embedding kernels as device ops: bags forward and backward, the row optimizer step, and
//! row gathers and scatters. Descriptors, typed wrappers and twins (the functions of the parent
//! module); CUDA runs `kernels/embedding.cu`, whose results are bitwise the twins'.

use crate::device::kernel::{param_layout, Grid};
use crate::device::{
    CudaSide, Device, DeviceView, KernelDesc, LaunchInfo, Operand, OperandSpec, Stream,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::{
    bag_backward_clamped, bag_forward_clamped, step_rows, BagMode, EmbeddingOptimizer, RowStep,
};

const F32: &[DType] = &[DType::F32];
const U32: &[DType] = &[DType::U32];

abi! {
    /// The parameters of `emb_bag` (`embedding.cuh`).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct EmbBagParams {
        /// Table rows.
        pub rows: u64,
        /// Floats per row.
        pub stride: u64,
        /// Floats per embedding.
        pub dim: u64,
        /// Indices.
        pub n: u64,
        /// Bags.
        pub bags: u64,
        /// 1: mean, 0: sum.
        pub mean: i32,
        /// Padding (0).
        pub pad: i32,
    }
}

abi! {
    /// The parameters of `emb_backward`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct EmbBackwardParams {
        /// Distinct rows.
        pub nrows: u64,
        /// Floats per embedding.
        pub dim: u64,
        /// Rows of the output gradient.
        pub bags: u64,
        /// Entries.
        pub nentries: u64,
    }
}

abi! {
    /// The parameters of `emb_step`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct EmbStepParams {
        /// Table rows.
        pub table_rows: u64,
        /// Floats per row.
        pub stride: u64,
        /// Floats per embedding.
        pub dim: u64,
        /// Rows stepped.
        pub n: u64,
        /// 0 SGD, 1 row-wise Adagrad, 2 Adam, 3 Adam on 8-bit moments.
        pub kind: i32,
        /// Learning rate.
        pub lr: f32,
        /// ε.
        pub eps: f32,
        /// β1.
        pub beta1: f32,
        /// β2.
        pub beta2: f32,
        /// 1 − β1ᵗ.
        pub bias1: f32,
        /// 1 − β2ᵗ.
        pub bias2: f32,
        /// Padding (0).
        pub pad: i32,
    }
}

abi! {
    /// The parameters of `emb_gather` and `emb_scatter`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
    struct EmbRowsParams {
        /// Rows of the indexed table (the gather's source, the scatter's destination).
        pub rows: u64,
        /// 32-bit words per row.
        pub words: u64,
        /// Indices.
        pub n: u64,
    }
}

/// The result of an op's shape check: `ok`, or an error naming the parameters.
fn fits(info: &LaunchInfo<'_>, ok: bool, p: &impl std::fmt::Debug) -> Result<()> {
    if ok {
        return Ok(());
    }
    Err(info.desc.error(format!("operands do not fit {p:?}")))
}

const fn nvrtc(plan: fn(&LaunchInfo<'_>) -> Result<Vec<Grid>>) -> CudaSide {
    CudaSide::Nvrtc {
        source: "embedding.cu",
        plan,
    }
}

/// Threads per block of the embedding kernels.
const EMBEDDING_THREADS: u32 = 128;

/// Threads per block over rows of `width` columns: whole warps, at most
/// `EMBEDDING_THREADS` (128). The result bits do not depend on it (each column is summed by one
/// thread in a fixed order).
pub(crate) fn embedding_threads(width: usize) -> u32 {
    (width.div_ceil(32) * 32).clamp(32, EMBEDDING_THREADS as usize) as u32
}

fn rows_grid(entry: &str, blocks: u64, width: u64) -> Vec<Grid> {
    if blocks == 0 {
        return vec![];
    }
    vec![Grid::linear(
        entry,
        blocks.min(65_535) as u32,
        embedding_threads(width as usize),
    )]
}

abi! {
    /// Embedding bags: table, indices, offsets, weights (optional) read; out written.
    static EMBEDDING_BAG: KernelDesc = KernelDesc {
        name: "embedding_bag",
        operands: &[
            OperandSpec::read("table", F32),
            OperandSpec::read("indices", U32),
            OperandSpec::read("offsets", U32),
            OperandSpec::read("weights", F32).optional(),
            OperandSpec::write("output", F32),
        ],
        params: param_layout!(
            EmbBagParams,
            "embedding.cuh",
            [rows, stride, dim, n, bags, mean, pad]
        ),
        check: Some(|info| {
            let p: EmbBagParams = info.params()?;
            let ok = p.dim >= 1
                && p.stride >= p.dim
                && info.len(0) as u64 == p.rows * p.stride
                && info.len(1) as u64 == p.n
                && info.len(2) as u64 == p.bags + 1
                && (!info.present(3) || info.len(3) as u64 == p.n)
                && info.len(4) as u64 == p.bags * p.dim;
            fits(info, ok, &p)
        }),
        twin: |a| {
            let p: EmbBagParams = a.params()?;
            let w = if a.present(3) {
                Some(a.read_as::<f32>(3)?)
            } else {
                None
            };
            let (table, idx, off) = (a.read_as(0)?, a.read_as(1)?, a.read_as(2)?);
            let mode = if p.mean != 0 {
                BagMode::Mean
            } else {
                BagMode::Sum
            };
            let out = a.take_as(4)?;
            bag_forward_clamped(
                table,
                p.stride as usize,
                p.dim as usize,
                idx,
                off,
                w,
                mode,
                out,
            )
        },
        cuda: nvrtc(|info| {
            let p: EmbBagParams = info.params()?;
            Ok(rows_grid("emb_bag", p.bags, p.dim))
        }),
    };
}

abi! {
    /// Sparse embedding backward: output gradient, row starts, entries, scales read; gradients
    /// written.
    static EMBEDDING_BACKWARD: KernelDesc = KernelDesc {
        name: "embedding_backward",
        operands: &[
            OperandSpec::read("output gradient", F32),
            OperandSpec::read("row starts", U32),
            OperandSpec::read("entries", U32),
            OperandSpec::read("scales", F32),
            OperandSpec::write("gradients", F32),
        ],
        params: param_layout!(
            EmbBackwardParams,
            "embedding.cuh",
            [nrows, dim, bags, nentries]
        ),
        check: Some(|info| {
            let p: EmbBackwardParams = info.params()?;
            let ok = p.dim >= 1
                && info.len(0) as u64 == p.bags * p.dim
                && info.len(1) as u64 == p.nrows + 1
                && info.len(2) as u64 == p.nentries
                && info.len(3) as u64 == p.nentries
                && info.len(4) as u64 == p.nrows * p.dim;
            fits(info, ok, &p)
        }),
        twin: |a| {
            let p: EmbBackwardParams = a.params()?;
            let (g, rp, e, s) = (a.read_as(0)?, a.read_as(1)?, a.read_as(2)?, a.read_as(3)?);
            let out = a.take_as(4)?;
            bag_backward_clamped(g, p.dim as usize, rp, e, s, out)
        },
        cuda: nvrtc(|info| {
            let p: EmbBackwardParams = info.params()?;
            Ok(rows_grid("emb_backward", p.nrows, p.dim))
        }),
    };
}

abi! {
    /// The row optimizer step: the table read and written, rows and gradients read.
    static EMBEDDING_STEP: KernelDesc = KernelDesc {
        name: "embedding_step",
        operands: &[
            OperandSpec::read_write("table", F32),
            OperandSpec::read("rows", U32),
            OperandSpec::read("gradients", F32),
        ],
        params: param_layout!(
            EmbStepParams,
            "embedding.cuh",
            [table_rows, stride, dim, n, kind, lr, eps, beta1, beta2, bias1, bias2, pad]
        ),
        check: Some(|info| {
            let p: EmbStepParams = info.params()?;
            let ok = p.dim >= 1
                && (0..=3).contains(&p.kind)
                && p.stride >= p.dim + row_optimizer(&p).state_len(p.dim as usize) as u64
                && info.len(0) as u64 == p.table_rows * p.stride
                && info.len(1) as u64 == p.n
                && info.len(2) as u64 == p.n * p.dim;
            fits(info, ok, &p)
        }),
        twin: |a| {
            let p: EmbStepParams = a.params()?;
            let opt = row_optimizer(&p);
            let (rows, grads) = (a.read_as(1)?, a.read_as(2)?);
            let table = a.take_as(0)?;
            step_rows(table, p.stride as usize, p.dim as usize, rows, grads, &opt)
        },
        cuda: nvrtc(|info| {
            let p: EmbStepParams = info.params()?;
            Ok(rows_grid("emb_step", p.n, p.dim))
        }),
    };
}

fn rows_check(info: &LaunchInfo<'_>, table: usize) -> Result<()> {
    let p: EmbRowsParams = info.params()?;
    let packed = 2 - table;
    let ok = p.words >= 1
        && info.len(table) as u64 == p.rows * p.words
        && info.len(1) as u64 == p.n
        && info.len(packed) as u64 == p.n * p.words;
    fits(info, ok, &p)
}

abi! {
    /// Row gather: source and index read, destination (one row per index) written.
    static GATHER_ROWS: KernelDesc = KernelDesc {
        name: "gather_rows",
        operands: &[
            OperandSpec::read("source", U32),
            OperandSpec::read("index", U32),
            OperandSpec::write("destination", U32),
        ],
        params: param_layout!(EmbRowsParams, "embedding.cuh", [rows, words, n]),
        check: Some(|info| rows_check(info, 0)),
        twin: |a| {
            let p: EmbRowsParams = a.params()?;
            let (src, index) = (a.read(0)?, a.read_as::<u32>(1)?);
            super::gather_rows(src, p.words as usize * 4, index, a.take(2)?);
            Ok(())
        },
        cuda: nvrtc(|info| {
            let p: EmbRowsParams = info.params()?;
            Ok(rows_grid("emb_gather", p.n, p.words))
        }),
    };
}

abi! {
    /// Row scatter: source (one row per index) and index read, destination rows written (the
    /// others kept, so read-write).
    static SCATTER_ROWS: KernelDesc = KernelDesc {
        name: "scatter_rows",
        operands: &[
            OperandSpec::read("source", U32),
            OperandSpec::read("index", U32),
            OperandSpec::read_write("destination", U32),
        ],
        params: param_layout!(EmbRowsParams, "embedding.cuh", [rows, words, n]),
        check: Some(|info| rows_check(info, 2)),
        twin: |a| {
            let p: EmbRowsParams = a.params()?;
            let (src, index) = (a.read(0)?, a.read_as::<u32>(1)?);
            super::scatter_rows(src, p.words as usize * 4, index, a.take(2)?);
            Ok(())
        },
        cuda: nvrtc(|info| {
            let p: EmbRowsParams = info.params()?;
            Ok(rows_grid("emb_scatter", p.n, p.words))
        }),
    };
}

fn row_optimizer(p: &EmbStepParams) -> RowStep {
    match p.kind {
        0 => RowStep::Sgd { lr: p.lr },
        1 => RowStep::RowwiseAdagrad {
            lr: p.lr,
            eps: p.eps,
        },
        kind => RowStep::Adam {
            lr: p.lr,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            bias1: p.bias1,
            bias2: p.bias2,
            packed: kind == 3,
        },
    }
}

/// The widest embedding row, in floats (far beyond any table; keeps sizes from overflowing).
const MAX_ROW_FLOATS: usize = 1 << 24;

fn check_shape(stride: usize, dim: usize) -> Result<()> {
    if dim == 0 {
        return Err(Error::Empty {
            what: "an embedding row's weights".into(),
        });
    }
    if stride < dim {
        return Err(Error::TooFew {
            what: "floats in an embedding row's stride".into(),
            got: stride,
            need: dim,
        });
    }
    if stride > MAX_ROW_FLOATS {
        return Err(Error::TooLarge {
            what: "floats in an embedding row's stride".into(),
            requested: stride as u128,
            limit: MAX_ROW_FLOATS as u64,
        });
    }
    Ok(())
}

fn f32s(v: DeviceView<'_>) -> Operand<'_> {
    Operand::new(v, DType::F32)
}

fn u32s(v: DeviceView<'_>) -> Operand<'_> {
    Operand::new(v, DType::U32)
}

/// Embedding bags on `stream`: bag `b` of `out` (`bags × dim` f32) reduces the rows
/// `indices[offsets[b]..offsets[b + 1]]` (u32) of `table` (f32 rows of `stride` floats,
/// the first `dim` the embedding), weighted by `weights` (f32 per index) when given.
/// `offsets` holds `bags + 1` u32 that must not decrease; index values out of range are
/// skipped. See [`super::bag_forward`].
#[allow(clippy::too_many_arguments)]
pub fn embedding_bag(
    dev: &Device,
    stream: &Stream,
    table: DeviceView<'_>,
    stride: usize,
    dim: usize,
    indices: DeviceView<'_>,
    offsets: DeviceView<'_>,
    weights: Option<DeviceView<'_>>,
    mode: BagMode,
    out: DeviceView<'_>,
) -> Result<()> {
    check_shape(stride, dim)?;
    let bags = (offsets.len() / 4).checked_sub(1).ok_or(Error::Empty {
        what: "embedding bag offsets (bags + 1 entries)".into(),
    })?;
    let what = || format!("bytes of embedding bag output for {bags} bags of {dim} f32");
    let expected = bags
        .checked_mul(dim * 4)
        .ok_or_else(|| Error::Overflow { what: what() })?;
    if out.len() != expected {
        return Err(Error::Length {
            what: what(),
            got: out.len(),
            expected,
        });
    }
    if let Some(w) = &weights {
        if w.len() != indices.len() {
            return Err(Error::Length {
                what: "bytes of per-sample weights for the bytes of indices".into(),
                got: w.len(),
                expected: indices.len(),
            });
        }
    }
    let p = EmbBagParams {
        rows: (table.len() / 4 / stride) as u64,
        stride: stride as u64,
        dim: dim as u64,
        n: (indices.len() / 4) as u64,
        bags: bags as u64,
        mean: (mode == BagMode::Mean) as i32,
        pad: 0,
    };
    // A table of a partial last row is cut to whole rows (the kernel indexes whole rows).
    let table = table.slice(0, p.rows as usize * stride * 4)?;
    let ops = [
        Some(f32s(table)),
        Some(u32s(indices)),
        Some(u32s(offsets)),
        weights.map(f32s),
        Some(f32s(out)),
    ];
    dev.launch(stream, &EMBEDDING_BAG, &ops, bytemuck::bytes_of(&p))
}

/// Sparse embedding backward on `stream`: `grads` (`rows × dim` f32, `rows = row_ptr
/// entries - 1`) gets, for each distinct row, Σ `scale[e]·grad_out[entries[e]]` over its
/// entries (u32 bag indices, f32 scales). See [`super::bag_backward`].
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward(
    dev: &Device,
    stream: &Stream,
    grad_out: DeviceView<'_>,
    dim: usize,
    row_ptr: DeviceView<'_>,
    entries: DeviceView<'_>,
    scale: DeviceView<'_>,
    grads: DeviceView<'_>,
) -> Result<()> {
    check_shape(dim, dim)?;
    let rows = (row_ptr.len() / 4).checked_sub(1).ok_or(Error::Empty {
        what: "embedding backward row starts (rows + 1 entries)".into(),
    })?;
    let what = || format!("embedding backward: bytes of gradients for {rows} rows of {dim} f32");
    let expected = rows
        .checked_mul(dim * 4)
        .ok_or_else(|| Error::Overflow { what: what() })?;
    if grads.len() != expected {
        return Err(Error::Length {
            what: what(),
            got: grads.len(),
            expected,
        });
    }
    if scale.len() != entries.len() {
        return Err(Error::Length {
            what: "embedding backward: bytes of scales for the bytes of entries".into(),
            got: scale.len(),
            expected: entries.len(),
        });
    }
    if !grad_out.len().is_multiple_of(dim * 4) {
        return Err(Error::NotMultiple {
            what: "embedding backward: bytes of output gradient",
            value: grad_out.len(),
            of: "the bytes of a row",
            divisor: dim * 4,
        });
    }
    let p = EmbBackwardParams {
        nrows: rows as u64,
        dim: dim as u64,
        bags: (grad_out.len() / 4 / dim) as u64,
        nentries: (entries.len() / 4) as u64,
    };
    let ops = [
        Some(f32s(grad_out)),
        Some(u32s(row_ptr)),
        Some(u32s(entries)),
        Some(f32s(scale)),
        Some(f32s(grads)),
    ];
    dev.launch(stream, &EMBEDDING_BACKWARD, &ops, bytemuck::bytes_of(&p))
}

/// One optimizer step on the rows `rows` (u32, distinct: on a GPU a repeated row races) of
/// `table` with gradients `grads` (`rows × dim` f32), on `stream`. Each row's state is stored
/// after its embedding, so `stride ≥ dim + opt.state_len(dim)`; `step` (1-based) gives Adam's
/// bias correction. See [`super::row_step`].
#[allow(clippy::too_many_arguments)]
pub fn embedding_step(
    dev: &Device,
    stream: &Stream,
    table: DeviceView<'_>,
    stride: usize,
    dim: usize,
    rows: DeviceView<'_>,
    grads: DeviceView<'_>,
    opt: &EmbeddingOptimizer,
    step: u64,
) -> Result<()> {
    let opt = &opt.at_step(step);
    check_shape(stride, dim)?;
    if stride < dim + opt.state_len(dim) {
        return Err(Error::TooFew {
            what: format!(
                "floats in a row of {dim} weights and {} of optimizer state",
                opt.state_len(dim)
            ),
            got: stride,
            need: dim + opt.state_len(dim),
        });
    }
    let what = || {
        format!(
            "bytes of gradients for {} rows of {dim} f32",
            rows.len() / 4
        )
    };
    let expected = rows
        .len()
        .checked_mul(dim)
        .ok_or_else(|| Error::Overflow { what: what() })?;
    if grads.len() != expected {
        return Err(Error::Length {
            what: what(),
            got: grads.len(),
            expected,
        });
    }
    let (kind, lr, eps, beta1, beta2, bias1, bias2) = match *opt {
        RowStep::Sgd { lr } => (0, lr, 0.0, 0.0, 0.0, 1.0, 1.0),
        RowStep::RowwiseAdagrad { lr, eps } => (1, lr, eps, 0.0, 0.0, 1.0, 1.0),
        RowStep::Adam {
            lr,
            beta1,
            beta2,
            eps,
            bias1,
            bias2,
            packed,
        } => (2 + i32::from(packed), lr, eps, beta1, beta2, bias1, bias2),
    };
    let p = EmbStepParams {
        table_rows: (table.len() / 4 / stride) as u64,
        stride: stride as u64,
        dim: dim as u64,
        n: (rows.len() / 4) as u64,
        kind,
        lr,
        eps,
        beta1,
        beta2,
        bias1,
        bias2,
        pad: 0,
    };
    let table = table.slice(0, p.table_rows as usize * stride * 4)?;
    let ops = [Some(f32s(table)), Some(u32s(rows)), Some(f32s(grads))];
    dev.launch(stream, &EMBEDDING_STEP, &ops, bytemuck::bytes_of(&p))
}

fn rows_params(
    row_bytes: usize,
    table: &DeviceView<'_>,
    index: &DeviceView<'_>,
    packed: &DeviceView<'_>,
) -> Result<EmbRowsParams> {
    if row_bytes == 0 {
        return Err(Error::Empty {
            what: "the bytes of a moved row".into(),
        });
    }
    if !row_bytes.is_multiple_of(4) {
        return Err(Error::NotMultiple {
            what: "bytes of a moved row",
            value: row_bytes,
            of: "the size of an f32",
            divisor: 4,
        });
    }
    let n = index.len() / 4;
    let what = || format!("row moves: packed bytes for {n} indices of rows of {row_bytes} bytes");
    let expected = n
        .checked_mul(row_bytes)
        .ok_or_else(|| Error::Overflow { what: what() })?;
    if packed.len() != expected {
        return Err(Error::Length {
            what: what(),
            got: packed.len(),
            expected,
        });
    }
    Ok(EmbRowsParams {
        rows: (table.len() / row_bytes) as u64,
        words: (row_bytes / 4) as u64,
        n: (index.len() / 4) as u64,
    })
}

/// Row `i` of `dst` = row `index[i]` (u32) of `src`, rows of `row_bytes` (a multiple of 4),
/// on `stream`; index values out of range are skipped.
pub fn gather_rows(
    dev: &Device,
    stream: &Stream,
    src: DeviceView<'_>,
    row_bytes: usize,
    index: DeviceView<'_>,
    dst: DeviceView<'_>,
) -> Result<()> {
    let p = rows_params(row_bytes, &src, &index, &dst)?;
    let src = src.slice(0, p.rows as usize * row_bytes)?;
    let ops = [Some(u32s(src)), Some(u32s(index)), Some(u32s(dst))];
    dev.launch(stream, &GATHER_ROWS, &ops, bytemuck::bytes_of(&p))
}

/// Row `index[i]` (u32) of `dst` = row `i` of `src`, rows of `row_bytes` (a multiple of 4),
/// on `stream`; index values out of range are skipped. Index values must be distinct: on a
/// GPU two writes of one row race.
pub fn scatter_rows(
    dev: &Device,
    stream: &Stream,
    src: DeviceView<'_>,
    row_bytes: usize,
    index: DeviceView<'_>,
    dst: DeviceView<'_>,
) -> Result<()> {
    let p = rows_params(row_bytes, &dst, &index, &src)?;
    let dst = dst.slice(0, p.rows as usize * row_bytes)?;
    let ops = [Some(u32s(src)), Some(u32s(index)), Some(u32s(dst))];
    dev.launch(stream, &SCATTER_ROWS, &ops, bytemuck::bytes_of(&p))
}

#[cfg(test)]
mod tests {
    use super::embedding_threads;

    #[test]
    fn embedding_blocks_are_whole_warps_up_to_the_cap() {
        assert_eq!(embedding_threads(1), 32);
        assert_eq!(embedding_threads(16), 32);
        assert_eq!(embedding_threads(33), 64);
        assert_eq!(embedding_threads(128), 128);
        assert_eq!(embedding_threads(131), 128);
        assert_eq!(embedding_threads(0), 32);
    }
}
