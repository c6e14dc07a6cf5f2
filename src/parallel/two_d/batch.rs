//! Moving a batch activation between its full `[rows, cols]` form and the 2D / 2.5D blocks.

use crate::device::{CachingAllocator, Stream};
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::parallel::{ProcessGrid, TensorMode};

use super::split;

/// Where one rank's block of a batch activation sits in the full `[rows, cols]` matrix: row
/// block `row` of `row_blocks`, column block `col` of `col_blocks`.
///
/// On a 2D grid the rank at `(row, col)` holds row block `row` of `q` and column block `col` of
/// `q`; on a 2.5D grid the rank at `(row, col, dep)` holds row block `row + q·dep` of `d·q` and
/// column block `col` of `q`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchBlock {
    /// The row block.
    pub row: usize,
    /// Row blocks in all.
    pub(crate) row_blocks: usize,
    /// The column block.
    pub col: usize,
    /// Column blocks in all.
    pub(crate) col_blocks: usize,
}

impl BatchBlock {
    /// This rank's block; [`Error::Conflict`] on a grid that is neither 2D nor 2.5D.
    pub fn of(grid: &ProcessGrid) -> Result<BatchBlock> {
        BatchBlock::of_tensor_rank(grid.spec().tensor, grid.tensor_rank())
    }

    /// The block of tensor rank `t` of a tensor group of `mode` (2D: `t = row·q + col`; 2.5D:
    /// `t = col + q·row + q²·dep`).
    pub(crate) fn of_tensor_rank(mode: TensorMode, t: usize) -> Result<BatchBlock> {
        let block = match mode {
            TensorMode::TwoD { q } => BatchBlock {
                row: t / q.max(1),
                row_blocks: q,
                col: t % q.max(1),
                col_blocks: q,
            },
            TensorMode::TwoHalfD { q, depth } => BatchBlock {
                row: t / q.max(1),
                row_blocks: q * depth,
                col: t % q.max(1),
                col_blocks: q,
            },
            other => {
                return Err(Error::Conflict {
                    what: "batch blocks (of the 2D and 2.5D schemes)".into(),
                    with: format!("tensor mode {other}"),
                })
            }
        };
        if t >= mode.size() {
            return Err(Error::IndexOutOfRange {
                what: format!("tensor rank of a {mode} group"),
                index: t,
                len: mode.size(),
            });
        }
        Ok(block)
    }

    /// The block's shape `[rows/row_blocks, cols/col_blocks]`; [`Error::NotSplit`] naming
    /// `rows` or `cols` when it does not split.
    pub fn shape(&self, rows: usize, cols: usize) -> Result<[usize; 2]> {
        Ok([
            split("batch", "rows", rows, self.row_blocks, "row blocks")?,
            split("batch", "cols", cols, self.col_blocks, "column blocks")?,
        ])
    }
}

/// This rank's block of a full row-major `[rows, cols]` host matrix (see [`BatchBlock`]): the
/// input `X_ij` of a first 2D or 2.5D layer from data every rank holds, or a test's shard.
/// Fails when the grid is neither 2D nor 2.5D, when `full` is not `rows · cols` long, or when
/// `rows` or `cols` do not split (naming which).
pub fn split_batch_2d(
    grid: &ProcessGrid,
    full: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>> {
    let b = BatchBlock::of(grid)?;
    let [r, c] = b.shape(rows, cols)?;
    let want = rows.checked_mul(cols);
    if Some(full.len()) != want {
        return Err(match want {
            None => Error::Overflow {
                what: format!("the values of a batch of [{rows}, {cols}]"),
            },
            Some(expected) => Error::Length {
                what: format!("values for a batch of [{rows}, {cols}]"),
                got: full.len(),
                expected,
            },
        });
    }
    Ok((0..r)
        .flat_map(|k| {
            let start = (b.row * r + k) * cols + b.col * c;
            full[start..start + c].iter().copied()
        })
        .collect())
}

/// This rank's block of a full `[rows, cols]` activation on the device (every rank holding
/// the same), copied into a new activation from `pool` on `stream`: one copy per row of the
/// block (`rows/q` or `rows/(d·q)`), for a first layer's input. Fails as [`split_batch_2d`].
pub fn split_batch_2d_act(
    pool: &CachingAllocator,
    stream: &Stream,
    grid: &ProcessGrid,
    full: &Act,
) -> Result<Act> {
    let b = BatchBlock::of(grid)?;
    let [rows, cols] = full.shape();
    let [r, c] = b.shape(rows, cols)?;
    let e = full.dtype().size();
    let out = Act::alloc(pool, r, c, full.dtype())?;
    for k in 0..r {
        let src = full
            .view()
            .slice(((b.row * r + k) * cols + b.col * c) * e, c * e)?;
        let dst = out.view().slice(k * c * e, c * e)?;
        pool.device().copy_d2d(stream, src, dst)?;
    }
    Ok(out)
}

/// The full `[rows, cols]` activation from every rank's block (each `[rows/row_blocks,
/// cols/col_blocks]`, the same shape on every rank): one all-gather over the grid's tensor
/// group on `stream`, then one copy per row of each block into a new activation from `pool`.
/// For a last layer's output or a check; every rank of the tensor group must call it.
pub fn gather_batch_2d(
    pool: &CachingAllocator,
    stream: &Stream,
    grid: &ProcessGrid,
    block: &Act,
) -> Result<Act> {
    let mode = grid.spec().tensor;
    let me = BatchBlock::of(grid)?;
    let [r, c] = block.shape();
    let (d, e) = (block.dtype(), block.dtype().size());
    let (rows, cols) = (r * me.row_blocks, c * me.col_blocks);
    let ranks = mode.size();
    let all = Act::alloc(pool, ranks * r, c, d)?;
    grid.tensor()
        .all_gather(stream, block.view(), all.view(), d)?;
    let full = Act::alloc(pool, rows, cols, d)?;
    for t in 0..ranks {
        let b = BatchBlock::of_tensor_rank(mode, t)?;
        for k in 0..r {
            let src = all.view().slice((t * r + k) * c * e, c * e)?;
            let at = ((b.row * r + k) * cols + b.col * c) * e;
            pool.device()
                .copy_d2d(stream, src, full.view().slice(at, c * e)?)?;
        }
    }
    Ok(full)
}
