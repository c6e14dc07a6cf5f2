//! LayerNorm on the 2D / 2.5D layout: the row's column blocks gathered, the fused op run on
//! whole rows, this rank's column block kept.

use crate::comm::{Communicator, ReduceOp};
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::heads::{heads_merge, heads_split, Heads};
use crate::ops::{
    add, add_in_place, layernorm_backward, layernorm_backward_scratch_bytes, layernorm_forward,
    Axpby, LayerNormBackward, LayerNormForward,
};
use crate::parallel::GridNorm;
use crate::parallel::{ProcessGrid, TensorMode};
use crate::store::{BackwardPass, ForwardPass, ParamStore, Pass, PassKind};
use crate::tensor::{Init, TensorId};

use crate::parallel::two_d::{remap, split};

/// A rank's place on a 2D grid (`depth = 1`, `dep = 0`) or a 2.5D grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place2D {
    /// Side `q` of the grid (of each depth layer).
    pub q: usize,
    /// Depth layers `d` (1 on a 2D grid).
    pub depth: usize,
    /// The rank's row `i`.
    pub row: usize,
    /// The rank's column `j`.
    pub col: usize,
    /// The rank's depth layer (0 on a 2D grid).
    pub dep: usize,
}

impl Place2D {
    /// This rank's place; [`Error::Conflict`] on a grid that is neither 2D nor 2.5D.
    pub fn of(grid: &ProcessGrid) -> Result<Place2D> {
        let (q, depth, dep) = match grid.spec().tensor {
            TensorMode::TwoD { q } => (q, 1, 0),
            TensorMode::TwoHalfD { q, depth } => (q, depth, grid.dep_index()?),
            other => {
                return Err(Error::Conflict {
                    what: "a 2D / 2.5D layer".into(),
                    with: format!("a grid of tensor mode {other}"),
                })
            }
        };
        Ok(Place2D {
            q,
            depth,
            row: grid.row_index()?,
            col: grid.col_index()?,
            dep,
        })
    }

    /// The ROW, COL and (for `d > 1`) DEP groups of `grid`, after checking that this rank is
    /// at this place.
    pub(super) fn groups<'g>(&self, grid: &'g ProcessGrid) -> Result<Groups<'g>> {
        let here = Place2D::of(grid)?;
        if here != *self {
            return Err(Error::WrongPlace {
                what: "a 2D layer",
                registered: format!("for {self:?}"),
                run: format!("at {here:?}"),
            });
        }
        Ok(Groups {
            row: grid.row()?,
            col: grid.col()?,
            dep: if self.depth > 1 {
                Some(grid.dep()?)
            } else {
                None
            },
        })
    }
}

/// The communicators of one call.
pub(super) struct Groups<'g> {
    pub(super) row: &'g Communicator,
    pub(super) col: &'g Communicator,
    pub(super) dep: Option<&'g Communicator>,
}

/// LayerNorm over `cols` features on the 2D / 2.5D layout, with the residual add fused
/// (`h = x + r`, GPT-2's `ln_2`) when asked.
///
/// # Layout
///
/// The rank at `(i, j)` (and depth `dep`) takes `X_ij` `[rows_l, cols/q]` as the linears do
/// (see [`two_d`](crate::parallel::Linear2D)) and returns `Y_ij` of the same shape. γ and β are
/// laid out as a 2D linear's bias: the rank registers `{name}.weight` and `{name}.bias`
/// `[cols/q²]`, piece `j·q + i` of the `[cols]` master (elements `j·cols/q + i·cols/q² ..`),
/// replicated over depth.
///
/// # Algorithm (exact; every collective on the pass's stream)
///
/// - Forward: γ and β all-gathered in COL (column block `j`), then in ROW (whole); `h_ij`
///   (`x_ij`, or `x_ij + r_ij`) all-gathered in ROW and permuted
///   ([`heads_merge`] with `q` "heads") into whole rows `[rows_l, cols]`; the fused op
///   ([`ops::layernorm`](crate::ops::layernorm_forward)) normalises them; column block `j` of the
///   result is kept. Saved: `h_ij` (not the whole rows) and the f32 row statistics.
/// - Backward: γ gathered again, `h_ij` and `dY_ij` all-gathered in ROW, the op's backward on
///   whole rows; `dX` keeps column block `j`; dγ and dβ (f32 sums over the row block) keep
///   block `j`, reduce-scattered in COL (rank `i` gets piece `i`) and all-reduced over DEP for
///   `d > 1`, then added into the gradient slots.
///
/// Per rank with `r = rows_l`, `c = cols`, `e` bytes an element, the calls and bytes each
/// receives: forward ROW 3 all-gathers (`r·c·e`, and `c·e` twice for γ and β), COL 2
/// all-gathers (`c/q·e`); backward ROW 3 all-gathers (`r·c·e` twice, for `h` and `dY`, and
/// `c·e` for γ), COL 1 all-gather (`c/q·e`) and 2 reduce-scatters (`c/q·4` sent), DEP 2
/// all-reduces (`c/q²·4`) for `d > 1`. Optimus's form (Σx and Σx² all-reduced in ROW, `2r`
/// elements forward and again backward) moves less; this one moves `(q−1)/q·r·c` elements per
/// gather in exchange for running the existing, tested row op unchanged, each row normalised `q`
/// times over (once per rank of the row).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNorm2D {
    /// This rank's piece of γ, `[cols/q²]`.
    pub gamma: TensorId,
    /// This rank's piece of β, `[cols/q²]`.
    pub beta: TensorId,
    /// The full layer's features.
    pub cols: usize,
    /// Added to the variance.
    pub eps: f32,
    /// Where the pieces belong.
    pub place: Place2D,
}

/// What [`LayerNorm2D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct LayerNorm2DSaved {
    h: Act,
    /// `[rows_l]` means then `[rows_l]` rstd, f32, of the whole rows.
    stats: PoolBlock,
}

impl LayerNorm2DSaved {
    /// This rank's block of the normalised input: `x_ij + r_ij` with a residual (the residual
    /// stream's next value), else `x_ij` itself.
    pub fn h(&self) -> &Act {
        &self.h
    }
}

/// `full` `[rows, q·cl]` from the row's `q` blocks `[rows, cl]`: one all-gather in ROW, one
/// permute.
fn gather_row<K: PassKind>(
    pass: &Pass<'_, K>,
    row: &Communicator,
    x: &Act,
    q: usize,
) -> Result<Act> {
    let (r, cl, d) = (x.rows(), x.cols(), x.dtype());
    let buf = Act::alloc(pass.pool(), q * r, cl, d)?;
    row.all_gather(pass.stream(), x.view(), buf.view(), d)?;
    let full = Act::alloc(pass.pool(), r, q * cl, d)?;
    let shape = Heads::new(1, r, q, cl);
    heads_merge(
        pass.device(),
        pass.stream(),
        shape,
        buf.input(),
        full.view(),
        d,
    )?;
    Ok(full)
}

/// Column block `j` of `q` of `full` `[rows, q·cl]`: one permute, one copy.
fn take_block<K: PassKind>(pass: &Pass<'_, K>, full: &Act, q: usize, j: usize) -> Result<Act> {
    let (r, d) = (full.rows(), full.dtype());
    let cl = full.cols() / q;
    let buf = Act::alloc(pass.pool(), q * r, cl, d)?;
    let shape = Heads::new(1, r, q, cl);
    heads_split(
        pass.device(),
        pass.stream(),
        shape,
        full.input(),
        buf.view(),
        d,
    )?;
    let out = Act::alloc(pass.pool(), r, cl, d)?;
    let bytes = out.len_bytes();
    let src = buf.view().slice(j * bytes, bytes)?;
    pass.device().copy_d2d(pass.stream(), src, out.view())?;
    Ok(out)
}

impl LayerNorm2D {
    /// Registers this rank's pieces of γ (`{name}.weight`) and β (`{name}.bias`), from the
    /// `[cols]` masters `gamma` and `beta`. Fails on a grid that is neither 2D nor 2.5D, when
    /// `cols` does not split by `q²` (naming it) or `eps` is not finite and ≥ 0.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        cols: usize,
        eps: f32,
        gamma: &Init,
        beta: &Init,
    ) -> Result<LayerNorm2D> {
        let place = Place2D::of(grid)?;
        LayerNorm2D::register_at(store, place, name, cols, eps, [gamma, beta])
    }

    pub(crate) fn register_at(
        store: &mut impl ParamStore,
        place: Place2D,
        name: &str,
        cols: usize,
        eps: f32,
        [gamma, beta]: [&Init; 2],
    ) -> Result<LayerNorm2D> {
        let q = place.q;
        let piece = split(name, "cols", cols, q * q, "q²")?;
        crate::nn::check_eps(name, eps)?;
        let start = place.col * (cols / q) + place.row * piece;
        let g = remap(gamma, move |k| start + k);
        let b = remap(beta, move |k| start + k);
        Ok(LayerNorm2D {
            gamma: store.register(&format!("{name}.weight"), &[piece], g)?,
            beta: store.register(&format!("{name}.bias"), &[piece], b)?,
            cols,
            eps,
            place,
        })
    }

    /// The parameters (γ, β).
    pub fn params(&self) -> Vec<TensorId> {
        vec![self.gamma, self.beta]
    }

    fn local(&self) -> usize {
        self.cols / self.place.q
    }

    /// Parameter `i`'s piece gathered whole (`[cols]`): COL then ROW all-gathers.
    fn gather_param<K: PassKind>(
        &self,
        pass: &Pass<'_, K>,
        gr: &Groups<'_>,
        g: &crate::store::Guard<'_, K>,
        i: usize,
    ) -> Result<Act> {
        let d = pass.param_dtype();
        let (q, s) = (self.place.q, pass.stream());
        let p = g.param(i)?;
        if p.shape() != [self.local() / q] || p.dtype() != d {
            return Err(Error::ParamShape {
                tensor: g.ids()[i].0,
                shape: p.shape().to_vec(),
                dtype: p.dtype(),
                expected: vec![self.local() / q],
                expected_dtype: d,
            });
        }
        let blk = Act::alloc(pass.pool(), 1, self.local(), d)?;
        let piece = blk.len_bytes() / q;
        let mine = blk.view().slice(self.place.row * piece, piece)?;
        p.copy_to(mine)?;
        gr.col.all_gather(s, mine, blk.view(), d)?;
        let full = Act::alloc(pass.pool(), 1, self.cols, d)?;
        gr.row.all_gather(s, blk.view(), full.view(), d)?;
        Ok(full)
    }

    pub(super) fn forward_in(
        &self,
        pass: &ForwardPass<'_>,
        gr: &Groups<'_>,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, LayerNorm2DSaved)> {
        let d = pass.param_dtype();
        let (q, cl) = (self.place.q, self.local());
        x.expect("x", None, cl, d)?;
        if let Some(r) = residual {
            r.expect("residual", Some(x.rows()), cl, d)?;
        }
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let rows = x.rows();
        let g = pass.fetch(&self.params())?;
        let gamma = self.gather_param(pass, gr, &g, 0)?;
        let beta = self.gather_param(pass, gr, &g, 1)?;
        drop(g);
        let h = match residual {
            Some(r) => {
                let h = Act::alloc(pool, rows, cl, d)?;
                let one = Axpby {
                    alpha: 1.0,
                    beta: 1.0,
                };
                add(dev, s, one, x.input(), r.input(), h.view(), d)?;
                h
            }
            None => x.clone(),
        };
        let hf = gather_row(pass, gr.row, &h, q)?;
        let yf = Act::alloc(pool, rows, self.cols, d)?;
        let stats = pool.alloc(2 * rows * 4)?;
        let op = LayerNormForward {
            x: hf.input(),
            residual: None,
            gamma: gamma.input(),
            beta: beta.input(),
            y: yf.view(),
            mean: stats.view(0, rows * 4)?,
            rstd: stats.view(rows * 4, rows * 4)?,
        };
        layernorm_forward(dev, s, op, rows, self.cols, self.eps, d)?;
        drop((hf, gamma, beta));
        let y = take_block(pass, &yf, q, self.place.col)?;
        Ok((y, LayerNorm2DSaved { h, stats }))
    }

    pub(super) fn backward_in(
        &self,
        pass: &BackwardPass<'_>,
        gr: &Groups<'_>,
        saved: &LayerNorm2DSaved,
        dy: &Act,
        dx_into: Option<&Act>,
    ) -> Result<Act> {
        let d = pass.param_dtype();
        let (q, cl) = (self.place.q, self.local());
        let rows = saved.h.rows();
        saved.h.expect("saved input", None, cl, d)?;
        dy.expect("dy", Some(rows), cl, d)?;
        if let Some(dx) = dx_into {
            dx.expect("dx", Some(rows), cl, d)?;
            if dx.same_memory(dy) || dx.same_memory(&saved.h) {
                return Err(Error::Operands {
                    op: "2D layer norm backward",
                    reason: "`dx` is the memory of `dy` or of the saved input".into(),
                });
            }
        }
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params())?;
        // γ read before the slots (the parameters' memory) are written
        let gamma = self.gather_param(pass, gr, &g, 0)?;
        let hf = gather_row(pass, gr.row, &saved.h, q)?;
        let dyf = gather_row(pass, gr.row, dy, q)?;
        let c4 = self.cols * 4;
        let sums = pool.alloc(2 * c4)?;
        dev.memset(s, sums.view(0, 2 * c4)?, 0)?;
        let scratch_bytes = layernorm_backward_scratch_bytes(rows, self.cols);
        let scratch = pool.alloc(scratch_bytes)?;
        let dxf = Act::alloc(pool, rows, self.cols, d)?;
        let op = LayerNormBackward {
            dy: dyf.input(),
            h: hf.input(),
            mean: saved.stats.view(0, rows * 4)?.into(),
            rstd: saved.stats.view(rows * 4, rows * 4)?.into(),
            gamma: gamma.input(),
            dx: dxf.view(),
            accumulate: false,
            dgamma: sums.view(0, c4)?,
            dbeta: sums.view(c4, c4)?,
            param_grad_dtype: DType::F32,
            scratch: scratch.view(0, scratch_bytes)?,
        };
        layernorm_backward(dev, s, op, rows, self.cols, d)?;
        drop((hf, dyf, gamma, scratch));
        let dx = take_block(pass, &dxf, q, self.place.col)?;
        drop(dxf);
        let dx = match dx_into {
            Some(into) => {
                let one = Axpby {
                    alpha: 1.0,
                    beta: 1.0,
                };
                add_in_place(dev, s, one, into.view(), dx.input(), d)?;
                into.clone()
            }
            None => dx,
        };
        // dγ, dβ: block j of the row block's sums, summed over the column's row blocks
        let blk = cl * 4;
        for i in 0..2 {
            let piece = Act::alloc(pool, 1, cl / q, DType::F32)?;
            let mine = sums.view(i * c4 + self.place.col * blk, blk)?;
            gr.col
                .reduce_scatter(s, mine, piece.view(), DType::F32, ReduceOp::Sum)?;
            if let Some(dep) = gr.dep {
                dep.all_reduce(s, piece.view(), piece.view(), DType::F32, ReduceOp::Sum)?;
            }
            g.accumulate_grad(i, piece.view(), DType::F32)?;
        }
        Ok(dx)
    }
}

impl GridNorm for LayerNorm2D {
    type Saved = LayerNorm2DSaved;

    fn input(saved: &LayerNorm2DSaved) -> &Act {
        saved.h()
    }

    fn params(&self) -> Vec<TensorId> {
        Self::params(self)
    }

    /// Normalises this rank's block `x` `[rows_l, cols/q]`, or `h = x + residual` (same shape)
    /// when given: returns `Y_ij` and what the backward needs. Shapes, types and the grid
    /// place are checked before any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, LayerNorm2DSaved)> {
        let gr = self.place.groups(grid)?;
        self.forward_in(pass, &gr, x, residual)
    }

    /// The backward of [`LayerNorm2D::forward`] from `dY_ij`: returns `dX_ij` — added to
    /// `dx_into` (the residual stream's gradient, returned shared) when given — and adds this
    /// rank's dγ and dβ pieces into their slots. Shapes are checked before any collective.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &LayerNorm2DSaved,
        dy: &Act,
        dx_into: Option<&Act>,
    ) -> Result<Act> {
        let gr = self.place.groups(grid)?;
        self.backward_in(pass, &gr, saved, dy, dx_into)
    }
}
