mod batch;
mod cost;
mod linear2p5;

pub use batch::{gather_batch_2d, split_batch_2d, split_batch_2d_act, BatchBlock};
pub use linear2p5::Linear2p5D;

use std::sync::Arc;

pub(super) use super::split;
use super::{Cost, ProcessGrid, TensorMode};
use crate::comm::{Communicator, ReduceOp};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::{self, BiasGrad, Gemm};
use crate::store::{BackwardPass, ForwardPass, Guard, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

/// 2D (SUMMA / Optimus) and 2.5D (Tesseract) tensor parallelism: linear layers whose weight is
/// cut into `q × q` blocks over a grid of ranks, the batch cut with it.
///
/// # Layouts
///
/// The layer computes `Y = X·W + b` with `W` the `[inputs, outputs]` matrix of the papers. The
/// crate stores a linear weight as [`nn::Linear`](crate::nn::Linear) does, `[outputs, inputs]`,
/// so the **master** of `{name}.weight` is the serial layer's tensor `M = Wᵀ` (`M[o, i]` at
/// `o·inputs + i`) and every shard is stored transposed too. On a `q × q` grid
/// (`t = row·q + col`; in 2.5D, each depth layer `dep` of `t = col + q·row + q²·dep`), the rank
/// at `(i, j)` = `(row, col)`:
///
/// - registers `{name}.weight` `[outputs/q, inputs/q]` = `M[j·outputs/q .., i·inputs/q ..]`,
///   the transpose of SUMMA's block `W_ij` (element `(a, b)` of the shard is master element
///   `(j·outputs/q + a)·inputs + i·inputs/q + b`), with an [`Init::Fn`] over the master's
///   [`Init`];
/// - registers `{name}.bias` `[outputs/q²]` = piece `j·q + i` of the `[outputs]` bias (bias
///   block `j` cut over the `q` ranks of column `j`): elements `j·outputs/q + i·outputs/q² ..`;
/// - takes `X_ij` `[rows/q, inputs/q]`, row block `i` and column block `j` of the full input,
///   and returns `Y_ij` `[rows/q, outputs/q]`, row block `i` and column block `j` of `Y`
///   ([`split_batch_2d`] and [`gather_batch_2d`] move between the two).
///
/// In 2.5D the weight and bias blocks are the same in every depth layer (replicated over
/// `dep`), and the batch is cut `d·q` ways: the rank at `(row, col, dep)` takes row block
/// `row + q·dep` of `d·q` (Tesseract's depth split, each depth layer a different part of the
/// batch). With `d = 1` the 2.5D layer is the 2D layer, bit for bit.
///
/// # Algorithm (every collective on the pass's stream)
///
/// - Forward: the bias block `b_j` is all-gathered in COL and written in every row of `Y_ij`;
///   then for `t` in `0..q`: `X_it` is broadcast in ROW from `(i, t)`, `W_tj` in COL from
///   `(t, j)`, and `Y_ij += X_it·W_tj` (GEMM with β = 1).
/// - Backward, `dX = dY·Wᵀ` first (it reads the weight, whose memory the gradient then
///   overwrites): for `t`, `W_tj` broadcast in COL from `(t, j)`, `dY_ij·W_tjᵀ` reduced in ROW to
///   `(i, t)`. Then `dW = Xᵀ·dY`: for `t`, `X_it` broadcast in ROW from `(i, t)`, `X_itᵀ·dY_ij`
///   reduced in COL to `(t, j)`, straight into the gradient slot. `db`: the column sums of `dY_ij`
///   (f32) reduce-scattered in COL, so rank `i` of column `j` gets its piece. In 2.5D the weight
///   and bias gradients are then all-reduced over DEP (skipped for `d = 1`). For a weight used
///   twice per iteration (the head tied to the embedding), [`Linear2D::backward_shared`] reduces
///   `dW` into a buffer instead and adds it as a share (after DEP's all-reduce).
///
/// [`Linear2D::collectives`] gives the calls and bytes per group; they are exact.
///
/// Shapes that do not split (`inputs` or `outputs` by `q`, a bias's `outputs` by `q²`, `rows`
/// by the row blocks) are [`Error::NotSplit`] naming the dimension, at registration, in
/// the batch helpers and in [`Linear2D::collectives`], before any collective. A layer runs only
/// on a grid of its mode, at the place it was registered for. The row blocks of the ranks of
/// one ROW must have the same number of rows ([`split_batch_2d`] gives them that).
///
/// ```
/// use tidemem::comm::Communicator;
/// use tidemem::nn::Act;
/// use tidemem::parallel::{split_batch_2d, GridSpec, Linear2D, ProcessGrid, TensorMode};
/// use tidemem::prelude::*;
/// # fn main() -> tidemem::Result<()> {
/// let devices = (0..4)
///     .map(|_| Device::sim(SimConfig::with_capacity(1 << 22)))
///     .collect::<tidemem::Result<Vec<_>>>()?;
/// let comms = Communicator::local(devices)?;
/// let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::TwoD { q: 2 } };
/// let (rows, inputs, outputs) = (4, 6, 8);
/// let x: Vec<f32> = (0..rows * inputs).map(|v| v as f32 / 10.0).collect();
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms
///         .iter()
///         .map(|c| {
///             let x = &x;
///             s.spawn(move || -> tidemem::Result<()> {
///                 let grid = ProcessGrid::new(c, spec)?;
///                 let cfg = ManagerConfig::new(1 << 10, Policy::Tide);
///                 let mut m = ChunkManager::new(c.device().clone(), cfg)?;
///                 let w = Init::Uniform { seed: 1, lo: -0.5, hi: 0.5 };
///                 let lin = Linear2D::register(&mut m, &grid, "fc", inputs, outputs, &w, None)?;
///                 let pass = m.forward()?;
///                 // this rank's X_ij: row block i, column block j, [rows/q, inputs/q]
///                 let xb = split_batch_2d(&grid, x, rows, inputs)?;
///                 let d = pass.param_dtype(); // the manager's default, f16
///                 let xa = Act::upload(pass.pool(), pass.stream(), 2, 3, d, &xb)?;
///                 let y = lin.forward(&pass, &grid, &xa)?;
///                 assert_eq!(y.shape(), [2, 4]); // Y_ij: [rows/q, outputs/q]
///                 drop((y, xa));
///                 pass.finish()
///             })
///         })
///         .collect();
///     ranks.into_iter().try_for_each(|h| h.join().expect("rank panicked"))
/// })?;
/// # Ok(()) }
/// ```
///
/// A linear layer over a `q × q` grid (see [`Linear2D`] for the layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear2D {
    /// This rank's block `[outputs/q, inputs/q]` (the transpose of SUMMA's `W_ij`).
    pub weight: TensorId,
    /// This rank's bias piece `[outputs/q²]`, if the layer has a bias.
    pub bias: Option<TensorId>,
    /// The full layer's input features.
    pub inputs: usize,
    /// The full layer's output features.
    pub outputs: usize,
    /// Side of the grid.
    pub q: usize,
    /// This rank's row `i`.
    pub row: usize,
    /// This rank's column `j`.
    pub col: usize,
}

/// The communicators one layer call uses.
struct Groups<'g> {
    row: &'g Communicator,
    col: &'g Communicator,
    /// `None` for 2D and for 2.5D with one depth layer.
    dep: Option<&'g Communicator>,
}

/// An initialiser whose element `k` is element `map(k)` of `master`.
pub(super) fn remap(master: &Init, map: impl Fn(usize) -> usize + Send + Sync + 'static) -> Init {
    let master = master.clone();
    Init::Fn(Arc::new(move |k| master.value(map(k))))
}

/// `rows` of a full batch over `blocks` row blocks.
fn split_rows(rows: usize, blocks: usize) -> Result<usize> {
    split("batch", "rows", rows, blocks, "row blocks")
}

/// Broadcasts `mine` (on the root) into `buf` (elsewhere) over `group`; returns the one that
/// holds the root's block.
fn bcast<'a>(
    group: &Communicator,
    s: &crate::device::Stream,
    mine: &'a Act,
    buf: &'a Act,
    root: usize,
) -> Result<&'a Act> {
    let a = if group.rank() == root { mine } else { buf };
    group.broadcast(s, a.view(), a.dtype(), root)?;
    Ok(a)
}

impl Linear2D {
    /// Registers this rank's blocks of layer `name` on a 2D `grid`: `{name}.weight` (its block
    /// of the master `[outputs, inputs]`, whose values `weight` gives element by element,
    /// row-major) and, with `bias`, `{name}.bias` (its piece of the `[outputs]` master). Fails
    /// on a grid of another mode, and when `inputs` or `outputs` do not split by `q` (or, with a
    /// bias, `outputs` by `q²`), naming the dimension.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        inputs: usize,
        outputs: usize,
        weight: &Init,
        bias: Option<&Init>,
    ) -> Result<Linear2D> {
        let TensorMode::TwoD { q } = grid.spec().tensor else {
            return Err(wrong_mode("Linear2D", name, "a 2D", grid));
        };
        let (row, col) = (grid.row_index()?, grid.col_index()?);
        Linear2D::register_at(store, name, [inputs, outputs], [q, row, col], weight, bias)
    }

    pub(super) fn register_at(
        store: &mut impl ParamStore,
        name: &str,
        [inputs, outputs]: [usize; 2],
        [q, row, col]: [usize; 3],
        weight: &Init,
        bias: Option<&Init>,
    ) -> Result<Linear2D> {
        let in_l = split(name, "inputs", inputs, q, "q")?;
        let out_l = split(name, "outputs", outputs, q, "q")?;
        let piece = match bias {
            Some(_) => split(name, "outputs (with a bias)", outputs, q * q, "q²")?,
            None => 0,
        };
        let w = remap(weight, move |k| {
            (col * out_l + k / in_l) * inputs + row * in_l + k % in_l
        });
        let w = store.register(&format!("{name}.weight"), &[out_l, in_l], w)?;
        let b = match bias {
            Some(b) => {
                let init = remap(b, move |k| col * out_l + row * piece + k);
                Some(store.register(&format!("{name}.bias"), &[piece], init)?)
            }
            None => None,
        };
        Ok(Linear2D {
            weight: w,
            bias: b,
            inputs,
            outputs,
            q,
            row,
            col,
        })
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        std::iter::once(self.weight).chain(self.bias).collect()
    }

    /// `Y_ij = (X·W + b)_ij` from this rank's `X_ij` `[rows/q, inputs/q]` (see
    /// [`Linear2D`]); `Y_ij` `[rows/q, outputs/q]` comes from the pass's pool. `q`
    /// broadcasts in ROW and in COL, and one all-gather in COL with a bias.
    pub fn forward(&self, pass: &ForwardPass<'_>, grid: &ProcessGrid, x: &Act) -> Result<Act> {
        self.forward_in(pass, &self.groups_2d(grid)?, x)
    }

    /// Writes this rank's weight and bias gradients from its saved `X_ij` and `dY_ij`
    /// `[rows/q, outputs/q]`; with `need_dx`, returns `dX_ij` `[rows/q, inputs/q]`. Shapes are
    /// checked before anything runs.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        self.backward_in(pass, &self.groups_2d(grid)?, x, dy, need_dx, false)
    }

    /// [`Linear2D::backward`] for a weight used more than once per iteration (tied, as the
    /// vocab-parallel head's weight is to the embedding's): the weight gradient is reduced in COL
    /// into a buffer from the pool and added as this use's share with
    /// [`Guard::accumulate_grad`] instead of written into the slot. The same collectives.
    pub fn backward_shared(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        self.backward_in(pass, &self.groups_2d(grid)?, x, dy, need_dx, true)
    }

    /// The collectives of one forward and one backward (with `need_dx` as given) over a full
    /// batch of `rows` rows of `dtype` (the store's parameter dtype): per group, calls and bytes
    /// as [`Communicator::stats`] counts them. Fails when `rows` does not split by `q`.
    pub fn collectives(&self, rows: usize, dtype: DType, need_dx: bool) -> Result<Cost> {
        Ok(self.costs(split_rows(rows, self.q)?, 1, dtype, need_dx))
    }

    fn groups_2d<'g>(&self, grid: &'g ProcessGrid) -> Result<Groups<'g>> {
        let mode = TensorMode::TwoD { q: self.q };
        if grid.spec().tensor != mode {
            return Err(wrong_mode("Linear2D", "", &format!("its {mode}"), grid));
        }
        self.check_place(grid)?;
        Ok(Groups {
            row: grid.row()?,
            col: grid.col()?,
            dep: None,
        })
    }

    fn check_place(&self, grid: &ProcessGrid) -> Result<()> {
        let (row, col) = (grid.row_index()?, grid.col_index()?);
        if (row, col) != (self.row, self.col) {
            return Err(Error::WrongPlace {
                what: "a 2D layer",
                registered: format!("for grid place ({}, {})", self.row, self.col),
                run: format!("at ({row}, {col})"),
            });
        }
        Ok(())
    }

    /// `[inputs/q, outputs/q]`.
    fn local(&self) -> (usize, usize) {
        (self.inputs / self.q, self.outputs / self.q)
    }

    fn check_params<K: PassKind>(&self, g: &Guard<'_, K>, d: DType) -> Result<()> {
        let (in_l, out_l) = self.local();
        let want: [&[usize]; 2] = [&[out_l, in_l], &[out_l / self.q]];
        for (i, shape) in want.iter().enumerate().take(g.len()) {
            let p = g.param(i)?;
            if p.shape() != *shape || p.dtype() != d {
                return Err(Error::ParamShape {
                    tensor: g.ids()[i].0,
                    shape: p.shape().to_vec(),
                    dtype: p.dtype(),
                    expected: shape.to_vec(),
                    expected_dtype: d,
                });
            }
        }
        Ok(())
    }

    fn forward_in(&self, pass: &ForwardPass<'_>, gr: &Groups<'_>, x: &Act) -> Result<Act> {
        let d = pass.param_dtype();
        let (in_l, out_l) = self.local();
        x.expect("x", None, in_l, d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let rows = x.rows();
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        let y = Act::alloc(pool, rows, out_l, d)?;
        let mut beta = 0.0;
        if self.bias.is_some() {
            // b_j: every piece of column j, gathered in place
            let b = Act::alloc(pool, 1, out_l, d)?;
            let piece = b.len_bytes() / self.q;
            let mine = b.view().slice(self.row * piece, piece)?;
            g.param(1)?.copy_to(mine)?;
            gr.col.all_gather(s, mine, b.view(), d)?;
            ops::bias_rows(dev, s, b.input(), y.view(), rows, out_l, d)?;
            beta = 1.0;
        }
        let w = g.param(0)?;
        let (xb, wb) = (
            Act::alloc(pool, rows, in_l, d)?,
            Act::alloc(pool, out_l, in_l, d)?,
        );
        let step = Gemm::new(rows, out_l, in_l).trans_b(true);
        for t in 0..self.q {
            let xt = bcast(gr.row, s, x, &xb, t)?;
            if self.row == t {
                w.copy_to(wb.view())?;
            }
            gr.col.broadcast(s, wb.view(), d, t)?;
            ops::gemm(
                dev,
                s,
                &step.beta(beta),
                xt.input(),
                wb.input(),
                y.view(),
                d,
            )?;
            beta = 1.0;
        }
        Ok(y)
    }

    fn backward_in(
        &self,
        pass: &BackwardPass<'_>,
        gr: &Groups<'_>,
        x: &Act,
        dy: &Act,
        need_dx: bool,
        shared: bool,
    ) -> Result<Option<Act>> {
        let d = pass.param_dtype();
        let (in_l, out_l) = self.local();
        x.expect("x", None, in_l, d)?;
        dy.expect("dy", Some(x.rows()), out_l, d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let rows = x.rows();
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        // dX = dY·Wᵀ first: it reads the weight
        let dx = if need_dx {
            let w = g.param(0)?;
            let dx = Act::alloc(pool, rows, in_l, d)?;
            let (wb, part) = (
                Act::alloc(pool, out_l, in_l, d)?,
                Act::alloc(pool, rows, in_l, d)?,
            );
            for t in 0..self.q {
                if self.row == t {
                    w.copy_to(wb.view())?;
                }
                gr.col.broadcast(s, wb.view(), d, t)?;
                let step = Gemm::new(rows, in_l, out_l);
                ops::gemm(dev, s, &step, dy.input(), wb.input(), part.view(), d)?;
                let recv = if self.col == t {
                    dx.view()
                } else {
                    part.view()
                };
                gr.row.reduce(s, part.view(), recv, d, ReduceOp::Sum, t)?;
            }
            Some(dx)
        } else {
            None
        };
        // dW = Xᵀ·dY (stored transposed: dYᵀ·X), reduced into the owner's gradient slot (or,
        // for a shared weight, into a buffer added as a share)
        let (xb, part) = (
            Act::alloc(pool, rows, in_l, d)?,
            Act::alloc(pool, out_l, in_l, d)?,
        );
        let share = if shared {
            Some(Act::alloc(pool, out_l, in_l, d)?)
        } else {
            None
        };
        let step = Gemm::new(out_l, in_l, rows).trans_a(true);
        let mut slot = None;
        for t in 0..self.q {
            let xt = bcast(gr.row, s, x, &xb, t)?;
            ops::gemm(dev, s, &step, dy.input(), xt.input(), part.view(), d)?;
            let recv = if self.row == t {
                let v = match &share {
                    Some(b) => b.view(),
                    None => g.grad(0)?.view(),
                };
                slot = Some(v);
                v
            } else {
                part.view()
            };
            gr.col.reduce(s, part.view(), recv, d, ReduceOp::Sum, t)?;
        }
        if let (Some(dep), Some(v)) = (gr.dep, slot) {
            dep.all_reduce(s, v, v, d, ReduceOp::Sum)?;
        }
        if let Some(b) = &share {
            g.accumulate_grad(0, b.view(), d)?;
        }
        if self.bias.is_some() {
            self.bias_backward(pass, gr, &g, dy)?;
        }
        Ok(dx)
    }

    /// `db`: the column sums of `dY_ij` in f32, reduce-scattered in COL (and all-reduced over
    /// DEP), into the bias's slot.
    fn bias_backward(
        &self,
        pass: &BackwardPass<'_>,
        gr: &Groups<'_>,
        g: &Guard<'_, crate::store::Backward>,
        dy: &Act,
    ) -> Result<()> {
        let (d, s, pool) = (pass.param_dtype(), pass.stream(), pass.pool());
        let (rows, out_l) = (dy.rows(), self.outputs / self.q);
        let scratch_bytes = ops::bias_grad_scratch_bytes(rows, out_l);
        let scratch = pool.alloc(scratch_bytes)?;
        let sums = Act::alloc(pool, 1, out_l, DType::F32)?;
        let piece = Act::alloc(pool, 1, out_l / self.q, DType::F32)?;
        let op = BiasGrad {
            dy: dy.input(),
            db: sums.view(),
            db_dtype: DType::F32,
            accumulate: false,
            scratch: scratch.view(0, scratch_bytes)?,
        };
        ops::bias_grad(pass.device(), s, op, rows, out_l, d)?;
        gr.col
            .reduce_scatter(s, sums.view(), piece.view(), DType::F32, ReduceOp::Sum)?;
        if let Some(dep) = gr.dep {
            dep.all_reduce(s, piece.view(), piece.view(), DType::F32, ReduceOp::Sum)?;
        }
        g.accumulate_grad(1, piece.view(), DType::F32)
    }
}

/// The error for a layer built or run on a grid of another mode.
fn wrong_mode(layer: &str, name: &str, needs: &str, grid: &ProcessGrid) -> Error {
    let name = if name.is_empty() {
        String::new()
    } else {
        format!(" '{name}'")
    };
    Error::Conflict {
        what: format!("{layer}{name}"),
        with: format!(
            "a grid of tensor mode {} (it runs on {needs} grid)",
            grid.spec().tensor
        ),
    }
}
