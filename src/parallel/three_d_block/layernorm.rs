//! LayerNorm on the 3D layout: [`LayerNorm3D`].

use crate::comm::{CommStats, Communicator, ReduceOp, Tally};
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::heads::{heads_merge, heads_split, Heads};
use crate::ops::layernorm::{
    layernorm_backward, layernorm_backward_scratch_bytes, layernorm_forward, LayerNormBackward,
    LayerNormForward,
};
use crate::ops::{add, add_in_place, Axpby};
use crate::parallel::grid::ProcessGrid;
use crate::parallel::three_d::{by_group, Layout3D, Place3D};
use crate::parallel::Cost;
use crate::parallel::GridNorm;
use crate::store::{BackwardPass, ForwardPass, Guard, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

/// `(a, c)`: `place`'s coordinates on `layout`'s row and column axes.
pub(super) fn axes(place: &Place3D, layout: Layout3D) -> (usize, usize) {
    match layout {
        Layout3D::RowsJColsK => (place.j, place.k),
        Layout3D::RowsKColsJ => (place.k, place.j),
    }
}

/// `(A, Wg, G)`: the group along `layout`'s row axis, the weight group, the group along its
/// column axis (the ranks holding the other column blocks of the same rows).
fn groups(
    grid: &ProcessGrid,
    layout: Layout3D,
) -> Result<(&Communicator, &Communicator, &Communicator)> {
    let (input, weight, output) = (grid.input()?, grid.weight()?, grid.output()?);
    Ok(match layout {
        Layout3D::RowsJColsK => (input, weight, output),
        Layout3D::RowsKColsJ => (output, weight, input),
    })
}

pub(super) use crate::parallel::split;

/// One call over a buffer of `bytes` bytes.
fn tally(calls: u64, bytes: usize) -> Tally {
    Tally {
        calls,
        bytes: bytes as u64,
    }
}

/// LayerNorm over the `C` columns of an activation split in a [`Layout3D`] (see
/// [`Cube`](crate::parallel::Cube)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNorm3D {
    /// This rank's block of γ, `[C/q]`: columns `c·C/q ..` (`c` the rank's column coordinate).
    pub gamma: TensorId,
    /// This rank's block of β, `[C/q]`.
    pub beta: TensorId,
    /// The full features `C`.
    pub cols: usize,
    /// Added to the variance.
    pub eps: f32,
    /// The layout of the input and of the output.
    pub layout: Layout3D,
    /// The rank's place in the cube.
    pub place: Place3D,
}

/// What [`LayerNorm3D::forward`] keeps for the backward: the normalised tile `h` (the input,
/// or `x + r`), its full rows, the gathered γ and the f32 row statistics.
#[derive(Debug)]
pub struct LayerNorm3DSaved {
    h: Act,
    full: Act,
    gamma: Act,
    /// `[n]` means, then `[n]` rstd, f32.
    stats: PoolBlock,
}

impl LayerNorm3DSaved {
    /// The normalised tile `[n, C/q]`: `x + r` with a residual (the residual stream's next
    /// tile), else the input itself.
    pub fn h(&self) -> &Act {
        &self.h
    }
}

impl LayerNorm3D {
    /// Registers this rank's blocks `{name}.weight` (γ) and `{name}.bias` (β), `[C/q]` each,
    /// from the masters `[cols]` whose values `gamma` and `beta` give: the block of the rank's
    /// column coordinate in `layout`, held alike by the `q²` ranks of that column block (each
    /// counting `1/q²` of its gradient's squared norm). Fails before registering anything if
    /// the grid is not 3D, `cols` does not split by `q` or `eps` is not finite and ≥ 0.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        cols: usize,
        eps: f32,
        layout: Layout3D,
        gamma: &Init,
        beta: &Init,
    ) -> Result<LayerNorm3D> {
        let place = Place3D::of(grid)?;
        LayerNorm3D::register_at(store, place, name, [cols], eps, layout, [gamma, beta])
    }

    /// [`LayerNorm3D::register`] at `place`.
    pub(crate) fn register_at(
        store: &mut impl ParamStore,
        place: Place3D,
        name: &str,
        [cols]: [usize; 1],
        eps: f32,
        layout: Layout3D,
        [gamma, beta]: [&Init; 2],
    ) -> Result<LayerNorm3D> {
        let q = place.q;
        let cq = split(name, "columns", cols, q, "q")?;
        crate::nn::check_eps(name, eps)?;
        let c0 = axes(&place, layout).1 * cq;
        let block = |m: &Init| {
            let m = m.clone();
            Init::Fn(std::sync::Arc::new(move |e| m.value(c0 + e)))
        };
        let share = 1.0 / (q * q) as f64;
        let g = store.register(&format!("{name}.weight"), &[cq], block(gamma))?;
        store.set_norm_share(g, share)?;
        let b = store.register(&format!("{name}.bias"), &[cq], block(beta))?;
        store.set_norm_share(b, share)?;
        Ok(LayerNorm3D {
            gamma: g,
            beta: b,
            cols,
            eps,
            layout,
            place,
        })
    }

    /// The parameters, in fetch order: γ, β.
    pub fn params(&self) -> Vec<TensorId> {
        vec![self.gamma, self.beta]
    }

    /// `C/q`.
    fn cq(&self) -> usize {
        self.cols / self.place.q
    }

    /// The layer's groups on `grid`, which must be the grid it was registered on.
    fn groups<'g>(
        &self,
        grid: &'g ProcessGrid,
    ) -> Result<(&'g Communicator, &'g Communicator, &'g Communicator)> {
        let here = Place3D::of(grid)?;
        if here != self.place {
            return Err(Error::WrongPlace {
                what: "a 3D layer norm",
                registered: format!("at {:?}", self.place),
                run: format!("at {here:?}"),
            });
        }
        groups(grid, self.layout)
    }

    fn check_params<K: PassKind>(&self, g: &Guard<'_, K>, d: DType) -> Result<()> {
        for n in 0..2 {
            let p = g.param(n)?;
            if p.shape() != [self.cq()] || p.dtype() != d {
                return Err(Error::ParamShape {
                    tensor: g.ids()[n].0,
                    shape: p.shape().to_vec(),
                    dtype: p.dtype(),
                    expected: vec![self.cq()],
                    expected_dtype: d,
                });
            }
        }
        Ok(())
    }

    /// The collectives of one forward and backward on tiles of `rows` rows (`n`) in `dtype`:
    /// forward, three all-gathers on the layout's column group (`n × C`, then γ and β, `C`
    /// each); backward, an all-gather of `n × C` there and an all-reduce of `2·C/q` f32 on the
    /// weight group and on the row group.
    pub fn collectives(&self, rows: usize, dtype: DType) -> Cost {
        let (c, es) = (self.cols, dtype.size());
        let fc = CommStats {
            all_gather: tally(3, (rows * c + 2 * c) * es),
            ..CommStats::default()
        };
        let [mut ba, mut bw, mut bc] = [CommStats::default(); 3];
        let reduce = tally(1, 2 * self.cq() * 4);
        bc.all_gather = tally(1, rows * c * es);
        bw.all_reduce = reduce;
        ba.all_reduce = reduce;
        Cost {
            forward: by_group(self.layout, CommStats::default(), CommStats::default(), fc),
            backward: by_group(self.layout, ba, bw, bc),
        }
    }
}

impl GridNorm for LayerNorm3D {
    type Saved = LayerNorm3DSaved;

    fn input(saved: &LayerNorm3DSaved) -> &Act {
        saved.h()
    }

    fn params(&self) -> Vec<TensorId> {
        Self::params(self)
    }

    /// Normalises this rank's tile `x` `[n, C/q]` (in [`LayerNorm3D::layout`]), or
    /// `h = x + residual` (a tile of the same shape): returns the output tile `[n, C/q]` and
    /// what the backward needs. The rows' `q` column blocks are all-gathered over the column
    /// group, the full rows normalised ([`ops::layernorm`](crate::ops::layernorm_forward)) with γ and
    /// β all-gathered there too, and the rank's block kept. A wrong grid, shape or type is an
    /// error before any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, LayerNorm3DSaved)> {
        let (_, _, gc) = self.groups(grid)?;
        let (q, cq, c) = (self.place.q, self.cq(), self.cols);
        let d = pass.param_dtype();
        x.expect("x", None, cq, d)?;
        if let Some(r) = residual {
            r.expect("residual", Some(x.rows()), cq, d)?;
        }
        let n = x.rows();
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        let h = match residual {
            Some(r) => {
                let h = Act::alloc(pool, n, cq, d)?;
                let one = Axpby {
                    alpha: 1.0,
                    beta: 1.0,
                };
                add(dev, s, one, x.input(), r.input(), h.view(), d)?;
                h
            }
            None => x.clone(),
        };
        let blocks = Act::alloc(pool, q * n, cq, d)?;
        let full = Act::alloc(pool, n, c, d)?;
        let (gamma, beta) = (Act::alloc(pool, 1, c, d)?, Act::alloc(pool, 1, c, d)?);
        let y_full = Act::alloc(pool, n, c, d)?;
        let stats = pool.alloc(2 * n * 4)?;
        // [q (c), n, C/q] → [n, C]: the tile's full rows
        let shape = Heads::new(1, n, q, cq);
        gc.all_gather(s, h.view(), blocks.view(), d)?;
        heads_merge(dev, s, shape, blocks.input(), full.view(), d)?;
        gc.all_gather(s, g.param(0)?.device_view(), gamma.view(), d)?;
        gc.all_gather(s, g.param(1)?.device_view(), beta.view(), d)?;
        let ops = LayerNormForward {
            x: full.input(),
            residual: None,
            gamma: gamma.input(),
            beta: beta.input(),
            y: y_full.view(),
            mean: stats.view(0, n * 4)?,
            rstd: stats.view(n * 4, n * 4)?,
        };
        layernorm_forward(dev, s, ops, n, c, self.eps, d)?;
        drop(beta);
        // [n, C] → [q, n, C/q]: this rank's column block (re-using the gather's buffer)
        heads_split(dev, s, shape, y_full.input(), blocks.view(), d)?;
        drop(y_full);
        let y = Act::alloc(pool, n, cq, d)?;
        let c_here = axes(&self.place, self.layout).1;
        let bytes = n * cq * d.size();
        dev.copy_d2d(s, blocks.view().slice(c_here * bytes, bytes)?, y.view())?;
        let saved = LayerNorm3DSaved {
            h,
            full,
            gamma,
            stats,
        };
        Ok((y, saved))
    }

    /// The backward of [`LayerNorm3D::forward`] from this rank's output-gradient tile `dy`:
    /// returns the input's gradient tile — added to `dx_into` (the residual stream's gradient,
    /// returned shared) when given, else in a new activation — and writes the γ and β
    /// gradient blocks. The gradient's full rows are all-gathered over the column group and
    /// the full rows' backward run; the rank keeps its block of `dx`, and its blocks of the
    /// rows' `dγ`, `dβ` (f32) are summed over the other rows by all-reduces over the weight
    /// group and the row group. A wrong grid, shape or type is an error before any
    /// collective; `dx_into` may not be `dy` or the saved input.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &LayerNorm3DSaved,
        dy: &Act,
        dx_into: Option<&Act>,
    ) -> Result<Act> {
        let (ga, gw, gc) = self.groups(grid)?;
        let (q, cq, c) = (self.place.q, self.cq(), self.cols);
        let d = pass.param_dtype();
        let n = saved.h.rows();
        saved.h.expect("saved input", None, cq, d)?;
        saved.full.expect("saved rows", Some(n), c, d)?;
        saved.gamma.expect("saved gamma", Some(1), c, d)?;
        dy.expect("dy", Some(n), cq, d)?;
        if let Some(dx) = dx_into {
            dx.expect("dx", Some(n), cq, d)?;
            if dx.same_memory(dy) || dx.same_memory(&saved.h) {
                return Err(Error::Operands {
                    op: "3D layer norm backward",
                    reason: "`dx` is the memory of `dy` or of the saved input".into(),
                });
            }
        }
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        let blocks = Act::alloc(pool, q * n, cq, d)?;
        let (dfull, dx_full) = (Act::alloc(pool, n, c, d)?, Act::alloc(pool, n, c, d)?);
        let c4 = c * 4;
        let sums = pool.alloc(2 * c4)?;
        let (dgamma, dbeta) = (sums.view(0, c4)?, sums.view(c4, c4)?);
        let scratch_bytes = layernorm_backward_scratch_bytes(n, c);
        let scratch = pool.alloc(scratch_bytes)?;
        let mine = pool.alloc(2 * cq * 4)?;
        let dx = match dx_into {
            Some(dx) => dx.clone(),
            None => Act::alloc(pool, n, cq, d)?,
        };
        let shape = Heads::new(1, n, q, cq);
        gc.all_gather(s, dy.view(), blocks.view(), d)?;
        heads_merge(dev, s, shape, blocks.input(), dfull.view(), d)?;
        dev.memset(s, sums.view(0, 2 * c4)?, 0)?;
        let ops = LayerNormBackward {
            dy: dfull.input(),
            h: saved.full.input(),
            mean: saved.stats.view(0, n * 4)?.into(),
            rstd: saved.stats.view(n * 4, n * 4)?.into(),
            gamma: saved.gamma.input(),
            dx: dx_full.view(),
            accumulate: false,
            dgamma,
            dbeta,
            param_grad_dtype: DType::F32,
            scratch: scratch.view(0, scratch_bytes)?,
        };
        layernorm_backward(dev, s, ops, n, c, d)?;
        drop(dfull);
        // the full rows' dx → [q, n, C/q]; this rank's block, written or added
        heads_split(dev, s, shape, dx_full.input(), blocks.view(), d)?;
        let c_here = axes(&self.place, self.layout).1;
        let bytes = n * cq * d.size();
        let block = blocks.view().slice(c_here * bytes, bytes)?;
        match dx_into {
            Some(_) => {
                let one = Axpby {
                    alpha: 1.0,
                    beta: 1.0,
                };
                add_in_place(dev, s, one, dx.view(), block, d)?;
            }
            None => dev.copy_d2d(s, block, dx.view())?,
        }
        // this rank's blocks of the rows' dγ, dβ, summed over every row block
        let cq4 = cq * 4;
        dev.copy_d2d(s, sums.view(c_here * cq4, cq4)?, mine.view(0, cq4)?)?;
        dev.copy_d2d(s, sums.view(c4 + c_here * cq4, cq4)?, mine.view(cq4, cq4)?)?;
        let both = mine.view(0, 2 * cq4)?;
        gw.all_reduce(s, both, both, DType::F32, ReduceOp::Sum)?;
        ga.all_reduce(s, both, both, DType::F32, ReduceOp::Sum)?;
        g.accumulate_grad(0, mine.view(0, cq4)?, DType::F32)?;
        g.accumulate_grad(1, mine.view(cq4, cq4)?, DType::F32)?;
        Ok(dx)
    }
}
