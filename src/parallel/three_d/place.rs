//! Where a rank's tiles lie on the cube ([`Layout3D`], [`Tile`], [`Place3D`]), and an
//! activation split into tiles or gathered from them ([`split_3d`], [`gather_3d`]).

use serde::Serialize;

use super::{groups, split};
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::heads::{heads_merge, heads_split, Heads};
use crate::parallel::{ProcessGrid, TensorMode};
use crate::store::{Pass, PassKind};

/// How an activation is split over the cube (see [`Linear3D`](crate::parallel::Linear3D)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Layout3D {
    /// Rows by `(i, j)` (row block `i·q + j` of `q²`), columns by `k` (block `k` of `q`): a
    /// first layer's input. A layer taking it gathers `X` over the grid's `input()` group and
    /// scatters `Y` over `output()`.
    RowsJColsK,
    /// Rows by `(i, k)`, columns by `j`: the output of a [`Layout3D::RowsJColsK`] layer, the
    /// input of the next. A layer taking it gathers over `output()` and scatters over
    /// `input()`.
    RowsKColsJ,
}

impl Layout3D {
    /// The other layout: a layer's output layout is its input's swapped.
    pub fn swapped(self) -> Layout3D {
        match self {
            Layout3D::RowsJColsK => Layout3D::RowsKColsJ,
            Layout3D::RowsKColsJ => Layout3D::RowsJColsK,
        }
    }
}

/// A rank's rectangle of a row-major `[rows, cols]` matrix: rows `row0 .. row0 + rows`,
/// columns `col0 .. col0 + cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Tile {
    /// First row.
    pub(crate) row0: usize,
    /// Rows.
    pub rows: usize,
    /// First column.
    pub(crate) col0: usize,
    /// Columns.
    pub cols: usize,
}

impl Tile {
    /// The tile's elements, row-major, of the row-major `full` of `full_cols` columns (a data
    /// loader's share of a batch). [`Error::TooFew`] (columns, or elements) if the tile does
    /// not fit.
    pub fn extract<T: Copy>(&self, full: &[T], full_cols: usize) -> Result<Vec<T>> {
        let col_end = self.col0.checked_add(self.cols);
        if col_end.is_none_or(|c| c > full_cols) {
            return Err(Error::TooFew {
                what: format!("columns of the matrix for {self:?}"),
                got: full_cols,
                need: col_end.unwrap_or(usize::MAX),
            });
        }
        let elems = (self.row0.checked_add(self.rows)).and_then(|r| r.checked_mul(full_cols));
        if elems.is_none_or(|n| n > full.len()) {
            return Err(Error::TooFew {
                what: format!("elements of the matrix (rows of {full_cols}) for {self:?}"),
                got: full.len(),
                need: elems.unwrap_or(usize::MAX),
            });
        }
        Ok((self.row0..self.row0 + self.rows)
            .flat_map(|r| &full[r * full_cols + self.col0..r * full_cols + self.col0 + self.cols])
            .copied()
            .collect())
    }
}

/// A rank's place in the cube: side `q` and coordinates `t = i + q·j + q²·k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Place3D {
    /// Side of the cube.
    pub q: usize,
    /// Coordinate along the weight group.
    pub i: usize,
    /// Coordinate along the input group.
    pub j: usize,
    /// Coordinate along the output group.
    pub k: usize,
}

impl Place3D {
    /// This rank's place on `grid`; [`Error::Conflict`] naming the grid's tensor mode if it is
    /// not 3D.
    pub fn of(grid: &ProcessGrid) -> Result<Place3D> {
        match grid.spec().tensor {
            TensorMode::ThreeD { q } => Ok(Place3D {
                q,
                i: grid.i()?,
                j: grid.j()?,
                k: grid.k()?,
            }),
            other => Err(Error::Conflict {
                what: "a 3D layer".into(),
                with: format!(
                    "a grid of tensor mode {other} (it needs a 3D grid, tensor mode 3d:Q)"
                ),
            }),
        }
    }

    /// `(a, c)`: the coordinates on `layout`'s row and column axes.
    pub(in crate::parallel) fn axes(&self, layout: Layout3D) -> (usize, usize) {
        match layout {
            Layout3D::RowsJColsK => (self.j, self.k),
            Layout3D::RowsKColsJ => (self.k, self.j),
        }
    }

    /// This rank's tile of a `[rows, cols]` activation in `layout`; [`Error::NotSplit`] naming
    /// the dimension when the rows do not split by `q²` or the columns by `q`.
    pub fn tile(&self, layout: Layout3D, rows: usize, cols: usize) -> Result<Tile> {
        let q = self.q;
        let rows_l = split("a 3D tile", "rows", rows, q * q, "q²")?;
        let cols_l = split("a 3D tile", "columns", cols, q, "q")?;
        let (a, c) = self.axes(layout);
        Ok(Tile {
            row0: (self.i * q + a) * rows_l,
            rows: rows_l,
            col0: c * cols_l,
            cols: cols_l,
        })
    }
}

/// This rank's tile (in `layout`) of `full` `[R, C]`, an activation every rank of the cube
/// holds whole (a first layer's input): one `heads_split` permute and a copy on the pass's
/// stream, no collective. Rows that do not split by `q²` or columns by `q` are an error naming
/// the dimension.
pub fn split_3d<K: PassKind>(
    pass: &Pass<'_, K>,
    grid: &ProcessGrid,
    layout: Layout3D,
    full: &Act,
) -> Result<Act> {
    let place = Place3D::of(grid)?;
    let tile = place.tile(layout, full.rows(), full.cols())?;
    let (q, d, cols) = (place.q, full.dtype(), full.cols());
    let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
    let es = d.size();
    // the tile's rows, [n, q, C/q] → [q, n, C/q], then column block c
    let rows = full
        .view()
        .slice(tile.row0 * cols * es, tile.rows * cols * es)?;
    let perm = Act::alloc(pool, q * tile.rows, tile.cols, d)?;
    let out = Act::alloc(pool, tile.rows, tile.cols, d)?;
    heads_split(
        dev,
        s,
        Heads::new(1, tile.rows, q, tile.cols),
        rows,
        perm.view(),
        d,
    )?;
    let block = tile.rows * tile.cols * es;
    let c = tile.col0 / tile.cols;
    dev.copy_d2d(s, perm.view().slice(c * block, block)?, out.view())?;
    Ok(out)
}

/// The full `[q²·n, q·cols]` activation from every rank's tile `shard` `[n, cols]` (in
/// `layout`), on every rank of the cube: all-gathers over the layout's row group, its column
/// group (then a `heads_merge` permute) and the weight group, on the pass's stream. Every
/// rank must call it.
pub fn gather_3d<K: PassKind>(
    pass: &Pass<'_, K>,
    grid: &ProcessGrid,
    layout: Layout3D,
    shard: &Act,
) -> Result<Act> {
    let q = Place3D::of(grid)?.q;
    let (ga, gw, gc) = groups(grid, layout)?;
    let (n, cols, d) = (shard.rows(), shard.cols(), shard.dtype());
    let (s, pool) = (pass.stream(), pass.pool());
    let rows_i = Act::alloc(pool, q * n, cols, d)?;
    let blocks = Act::alloc(pool, q * q * n, cols, d)?;
    let merged = Act::alloc(pool, q * n, q * cols, d)?;
    let full = Act::alloc(pool, q * q * n, q * cols, d)?;
    // rows block i, columns block c; then [q (c), q·n, cols] → [q·n, q·cols]; then every i
    ga.all_gather(s, shard.view(), rows_i.view(), d)?;
    gc.all_gather(s, rows_i.view(), blocks.view(), d)?;
    let shape = Heads::new(1, q * n, q, cols);
    heads_merge(pass.device(), s, shape, blocks.input(), merged.view(), d)?;
    gw.all_gather(s, merged.view(), full.view(), d)?;
    Ok(full)
}
