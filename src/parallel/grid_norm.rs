//! LayerNorm on a grid, one algorithm for every layout that splits an activation's columns:
//! the row's column blocks gathered, the fused row op run on whole rows, this rank's column
//! block kept, and γ's and β's gradients reduced to the rank's pieces. What differs between
//! the 2D / 2.5D layout ([`LayerNorm2D`]) and the 3D one ([`LayerNorm3D`]) is only which
//! ranks hold what: the groups ([`NormGroups`]) each passes in.

use crate::comm::{CommStats, Communicator, ReduceOp, Tally};
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::heads::{heads_merge, heads_split, Heads};
use crate::ops::{
    add, add_in_place, layernorm_backward, layernorm_backward_scratch_bytes, layernorm_forward,
    Axpby, LayerNormBackward, LayerNormForward,
};
use crate::parallel::three_d::{by_group, Layout3D, Place3D};
use crate::parallel::two_d::remap;
use crate::parallel::{split, Cost, GridNorm, PassCost, Place2D, ProcessGrid};
use crate::store::{BackwardPass, ForwardPass, Guard, ParamStore, Pass, PassKind};
use crate::tensor::{Init, TensorId};

const ONE: Axpby = Axpby {
    alpha: 1.0,
    beta: 1.0,
};

/// The groups of one grid LayerNorm call, as its layout places the rank.
struct NormGroups<'g> {
    /// The ranks holding the other column blocks of this rank's rows, in block order.
    row: &'g Communicator,
    /// This rank's column block among them.
    block: usize,
    /// γ's and β's pieces become whole through all-gathers over these groups, in order.
    gather: [Option<&'g Communicator>; 2],
    /// The group the block's dγ, dβ are reduce-scattered over to the rank's pieces, where
    /// the layout splits them finer than the column block.
    scatter: Option<&'g Communicator>,
    /// The groups summing the pieces over the other rows' ranks (all-reduces, in order).
    sum: [Option<&'g Communicator>; 2],
}

/// What a grid LayerNorm's forward keeps for the backward.
#[derive(Debug)]
pub struct GridNormSaved {
    h: Act,
    /// `[rows]` means then `[rows]` rstd, f32, of the whole rows.
    stats: PoolBlock,
}

impl GridNormSaved {
    /// This rank's tile of the normalised input: `x + r` with a residual (the residual
    /// stream's next value), else `x` itself.
    pub fn h(&self) -> &Act {
        &self.h
    }
}

/// The whole rows `[rows, q·cl]` of a tile `[rows, cl]`: one all-gather over the row group,
/// one permute.
fn gather_rows<K: PassKind>(pass: &Pass<'_, K>, row: &Communicator, x: &Act) -> Result<Act> {
    let (r, cl, d, q) = (x.rows(), x.cols(), x.dtype(), row.world());
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

/// The algorithm over the groups a layout passes in: γ and β of `cols` features, this
/// rank's pieces of `piece` elements each.
struct GridLn<'g> {
    params: [TensorId; 2],
    cols: usize,
    piece: usize,
    eps: f32,
    groups: NormGroups<'g>,
}

impl GridLn<'_> {
    fn tile_cols(&self) -> usize {
        self.cols / self.groups.row.world()
    }

    /// Parameter `i`'s piece gathered whole (`[cols]`).
    fn gather_param<K: PassKind>(
        &self,
        pass: &Pass<'_, K>,
        g: &Guard<'_, K>,
        i: usize,
    ) -> Result<Act> {
        let d = pass.param_dtype();
        let p = g.param(i)?;
        if p.shape() != [self.piece] || p.dtype() != d {
            return Err(Error::ParamShape {
                tensor: g.ids()[i].0,
                shape: p.shape().to_vec(),
                dtype: p.dtype(),
                expected: vec![self.piece],
                expected_dtype: d,
            });
        }
        let mut have: Option<Act> = None;
        let mut len = self.piece;
        for group in self.groups.gather.iter().flatten() {
            len *= group.world();
            let out = Act::alloc(pass.pool(), 1, len, d)?;
            let src = match &have {
                Some(a) => a.view(),
                None => p.device_view(),
            };
            group.all_gather(pass.stream(), src, out.view(), d)?;
            have = Some(out);
        }
        match have {
            Some(full) if len == self.cols => Ok(full),
            _ => Err(Error::Internal {
                what: format!(
                    "a grid layer norm's pieces of {} gather to {len}, not {} features",
                    self.piece, self.cols
                ),
            }),
        }
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, GridNormSaved)> {
        let (d, cl) = (pass.param_dtype(), self.tile_cols());
        x.expect("x", None, cl, d)?;
        if let Some(r) = residual {
            r.expect("residual", Some(x.rows()), cl, d)?;
        }
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let rows = x.rows();
        let g = pass.fetch(&self.params)?;
        let gamma = self.gather_param(pass, &g, 0)?;
        let beta = self.gather_param(pass, &g, 1)?;
        drop(g);
        let h = match residual {
            Some(r) => {
                let h = Act::alloc(pool, rows, cl, d)?;
                add(dev, s, ONE, x.input(), r.input(), h.view(), d)?;
                h
            }
            None => x.clone(),
        };
        let hf = gather_rows(pass, self.groups.row, &h)?;
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
        let q = self.groups.row.world();
        let y = take_block(pass, &yf, q, self.groups.block)?;
        Ok((y, GridNormSaved { h, stats }))
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &GridNormSaved,
        dy: &Act,
        dx_into: Option<&Act>,
    ) -> Result<Act> {
        let (d, cl) = (pass.param_dtype(), self.tile_cols());
        let rows = saved.h.rows();
        saved.h.expect("saved input", None, cl, d)?;
        dy.expect("dy", Some(rows), cl, d)?;
        if let Some(dx) = dx_into {
            dx.expect("dx", Some(rows), cl, d)?;
            if dx.same_memory(dy) || dx.same_memory(&saved.h) {
                return Err(Error::Operands {
                    op: "grid layer norm backward",
                    reason: "`dx` is the memory of `dy` or of the saved input".into(),
                });
            }
        }
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params)?;
        // γ read before the slots (the parameters' memory) are written
        let gamma = self.gather_param(pass, &g, 0)?;
        let hf = gather_rows(pass, self.groups.row, &saved.h)?;
        let dyf = gather_rows(pass, self.groups.row, dy)?;
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
        let q = self.groups.row.world();
        let dx = take_block(pass, &dxf, q, self.groups.block)?;
        drop(dxf);
        let dx = match dx_into {
            Some(into) => {
                add_in_place(dev, s, ONE, into.view(), dx.input(), d)?;
                into.clone()
            }
            None => dx,
        };
        self.reduce_grads(pass, &g, &sums)?;
        Ok(dx)
    }

    /// dγ, dβ: this rank's column block of the tile's sums (`[2, C]` f32), reduced to its
    /// pieces over the rows of every rank holding them, added into the slots.
    fn reduce_grads(
        &self,
        pass: &BackwardPass<'_>,
        g: &Guard<'_, crate::store::Backward>,
        sums: &PoolBlock,
    ) -> Result<()> {
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let (c4, cl4) = (self.cols * 4, self.tile_cols() * 4);
        let at = self.groups.block * cl4;
        let mine = pool.alloc(2 * cl4)?;
        dev.copy_d2d(s, sums.view(at, cl4)?, mine.view(0, cl4)?)?;
        dev.copy_d2d(s, sums.view(c4 + at, cl4)?, mine.view(cl4, cl4)?)?;
        let (pieces, n) = match self.groups.scatter {
            Some(group) => {
                // [2, P, n] → [P, 2, n]: rank p's dγ and dβ pieces side by side
                let (p, n) = (group.world(), self.piece);
                let packed = pool.alloc(2 * cl4)?;
                let shape = Heads::new(1, p, 2, n);
                let (src, dst) = (mine.view(0, 2 * cl4)?, packed.view(0, 2 * cl4)?);
                heads_merge(dev, s, shape, src, dst, DType::F32)?;
                let out = pool.alloc(2 * n * 4)?;
                let (src, dst) = (packed.view(0, 2 * cl4)?, out.view(0, 2 * n * 4)?);
                group.reduce_scatter(s, src, dst, DType::F32, ReduceOp::Sum)?;
                (out, n)
            }
            None => (mine, self.piece),
        };
        let both = pieces.view(0, 2 * n * 4)?;
        for group in self.groups.sum.iter().flatten() {
            group.all_reduce(s, both, both, DType::F32, ReduceOp::Sum)?;
        }
        g.accumulate_grad(0, pieces.view(0, n * 4)?, DType::F32)?;
        g.accumulate_grad(1, pieces.view(n * 4, n * 4)?, DType::F32)
    }
}

/// `calls` calls of `bytes` bytes each.
fn tally(calls: usize, bytes: usize) -> Tally {
    Tally {
        calls: calls as u64,
        bytes: (calls * bytes) as u64,
    }
}

/// LayerNorm over `cols` features on the 2D / 2.5D layout, with the residual add fused
/// (`h = x + r`, GPT-2's `ln_2`) when asked, with the ROW group gathering a tile's rows: the
/// grid LayerNorm's one algorithm, which [`LayerNorm3D`] runs on its own groups.
///
/// The rank at `(i, j)` (and depth `dep`) takes `X_ij` `[rows_l, cols/q]` as the linears do
/// (see [`two_d`](crate::parallel::Linear2D)) and returns `Y_ij` of the same shape. γ and β are
/// laid out as a 2D linear's bias: the rank registers `{name}.weight` and `{name}.bias`
/// `[cols/q²]`, piece `j·q + i` of the `[cols]` master (elements `j·cols/q + i·cols/q² ..`),
/// replicated over depth; they gather over COL then ROW, and their gradients are
/// reduce-scattered over COL and all-reduced over DEP for `d > 1`.
///
/// # Algorithm (exact; every collective on the pass's stream)
///
/// - Forward: γ and β gathered whole (`[C]`) over the layout's parameter groups; `h` (`x`, or
///   `x + r` with GPT-2's fused residual) all-gathered over the row group (the ranks holding
///   the other column blocks of the same rows) and permuted into whole rows; the fused op
///   ([`ops::layernorm`](crate::ops::layernorm_forward)) normalises them; this rank's column
///   block of the result is kept. Saved: `h` (the tile, not the whole rows) and the f32 row
///   statistics.
/// - Backward: γ gathered again, `h` and `dY` all-gathered over the row group, the op's
///   backward on whole rows; `dX` keeps this rank's column block; dγ and dβ (f32 sums over
///   the tile's rows) keep the same block, packed, reduce-scattered to the rank's pieces where
///   the layout splits γ further (2D) and all-reduced over the groups holding the same
///   pieces for other rows, then added into the gradient slots.
///
/// Each row is normalised once per rank of its row group, in exchange for running the
/// existing, tested row op unchanged; Optimus's form (Σx and Σx² all-reduced, `2r` elements)
/// would move less.
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

    fn on<'g>(&self, grid: &'g ProcessGrid) -> Result<GridLn<'g>> {
        let gr = self.place.groups(grid)?;
        let q = self.place.q;
        Ok(GridLn {
            params: [self.gamma, self.beta],
            cols: self.cols,
            piece: self.cols / (q * q),
            eps: self.eps,
            groups: NormGroups {
                row: gr.row,
                block: self.place.col,
                gather: [Some(gr.col), Some(gr.row)],
                scatter: Some(gr.col),
                sum: [gr.dep, None],
            },
        })
    }

    /// The collectives of one forward and one backward over a full batch of `rows` rows of
    /// `dtype` (the store's parameter dtype), per group, as
    /// [`Communicator::stats`](crate::comm::Communicator::stats) counts them: forward ROW 3
    /// all-gathers (the tile's rows, γ, β), COL 2 (γ's and β's pieces); backward ROW 3 (`h`,
    /// `dY`, γ), COL 1 all-gather (γ) and 1 reduce-scatter (dγ, dβ packed, f32), DEP 1
    /// all-reduce for `d > 1`. Fails when `rows` does not split into the row blocks (`q`,
    /// or `d·q` in 2.5D).
    pub fn collectives(&self, rows: usize, dtype: DType) -> Result<Cost> {
        let p = self.place;
        let r = split("batch", "rows", rows, p.q * p.depth, "row blocks")?;
        let (c, e, q) = (self.cols, dtype.size(), p.q);
        let mut f = PassCost::default();
        f.row.all_gather = tally(1, r * c * e) + tally(2, c * e);
        f.col.all_gather = tally(2, c / q * e);
        let mut b = PassCost::default();
        b.row.all_gather = tally(2, r * c * e) + tally(1, c * e);
        b.col.all_gather = tally(1, c / q * e);
        b.col.reduce_scatter = tally(1, 2 * c / q * 4);
        if p.depth > 1 {
            b.dep.all_reduce = tally(1, 2 * c / (q * q) * 4);
        }
        Ok(Cost {
            forward: f,
            backward: b,
        })
    }
}

/// LayerNorm over the `C` columns of an activation split in a [`Layout3D`] (see
/// [`Cube`](crate::parallel::Cube)): the grid algorithm of [`LayerNorm2D`] with the layout's column
/// group gathering a tile's rows and γ's and β's blocks, their gradients all-reduced over the
/// weight group and the row group.
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
        LayerNorm3D::register_at(store, place, name, cols, eps, layout, [gamma, beta])
    }

    /// [`LayerNorm3D::register`] at `place`.
    pub(crate) fn register_at(
        store: &mut impl ParamStore,
        place: Place3D,
        name: &str,
        cols: usize,
        eps: f32,
        layout: Layout3D,
        [gamma, beta]: [&Init; 2],
    ) -> Result<LayerNorm3D> {
        let q = place.q;
        let cq = split(name, "columns", cols, q, "q")?;
        crate::nn::check_eps(name, eps)?;
        let c0 = place.axes(layout).1 * cq;
        let share = 1.0 / (q * q) as f64;
        let g = store.register(
            &format!("{name}.weight"),
            &[cq],
            remap(gamma, move |k| c0 + k),
        )?;
        store.set_norm_share(g, share)?;
        let b = store.register(&format!("{name}.bias"), &[cq], remap(beta, move |k| c0 + k))?;
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

    /// The layer on `grid`, which must be the grid it was registered on: the column group
    /// (along the layout's column axis) gathers the rows and the parameters, the weight and
    /// the row group sum the gradients.
    fn on<'g>(&self, grid: &'g ProcessGrid) -> Result<GridLn<'g>> {
        let here = Place3D::of(grid)?;
        if here != self.place {
            return Err(Error::WrongPlace {
                what: "a 3D layer norm",
                registered: format!("at {:?}", self.place),
                run: format!("at {here:?}"),
            });
        }
        let (input, weight, output) = (grid.input()?, grid.weight()?, grid.output()?);
        let (rows, cols) = match self.layout {
            Layout3D::RowsJColsK => (input, output),
            Layout3D::RowsKColsJ => (output, input),
        };
        Ok(GridLn {
            params: [self.gamma, self.beta],
            cols: self.cols,
            piece: self.cols / self.place.q,
            eps: self.eps,
            groups: NormGroups {
                row: cols,
                block: self.place.axes(self.layout).1,
                gather: [Some(cols), None],
                scatter: None,
                sum: [Some(weight), Some(rows)],
            },
        })
    }

    /// The collectives of one forward and backward on tiles of `rows` rows (`n`) in `dtype`:
    /// forward, three all-gathers on the layout's column group (`n × C`, then γ and β, `C`
    /// each); backward, three there (`n × C` for `h` and for `dY`, `C` for γ) and an
    /// all-reduce of `2·C/q` f32 on the weight group and on the row group.
    pub fn collectives(&self, rows: usize, dtype: DType) -> Cost {
        let (c, es) = (self.cols, dtype.size());
        let gathers = |calls: u64, bytes: usize| CommStats {
            all_gather: Tally {
                calls,
                bytes: bytes as u64,
            },
            ..CommStats::default()
        };
        let fc = gathers(3, (rows * c + 2 * c) * es);
        let bc = gathers(3, (2 * rows * c + c) * es);
        let reduce = CommStats {
            all_reduce: Tally {
                calls: 1,
                bytes: (2 * c / self.place.q * 4) as u64,
            },
            ..CommStats::default()
        };
        let none = CommStats::default();
        Cost {
            forward: by_group(self.layout, none, none, fc),
            backward: by_group(self.layout, reduce, reduce, bc),
        }
    }
}

/// The [`GridNorm`] of a layer that runs the grid algorithm on its groups.
macro_rules! grid_norm {
    ($t:ty) => {
        impl GridNorm for $t {
            type Saved = GridNormSaved;

            fn input(saved: &GridNormSaved) -> &Act {
                saved.h()
            }

            fn params(&self) -> Vec<TensorId> {
                vec![self.gamma, self.beta]
            }

            /// Normalises this rank's tile `x`, or `h = x + residual` (a tile of the same
            /// shape) when given: returns the output tile and what the backward needs.
            /// Shapes, types and the grid place are checked before any collective.
            fn forward(
                &self,
                pass: &ForwardPass<'_>,
                grid: &ProcessGrid,
                x: &Act,
                residual: Option<&Act>,
            ) -> Result<(Act, GridNormSaved)> {
                self.on(grid)?.forward(pass, x, residual)
            }

            /// The backward from this rank's output-gradient tile `dy`: returns the input's
            /// gradient tile — added to `dx_into` (the residual stream's gradient, returned
            /// shared) when given — and adds this rank's dγ and dβ pieces into their slots.
            /// Shapes are checked before any collective; `dx_into` may not be `dy` or the
            /// saved input.
            fn backward(
                &self,
                pass: &BackwardPass<'_>,
                grid: &ProcessGrid,
                saved: &GridNormSaved,
                dy: &Act,
                dx_into: Option<&Act>,
            ) -> Result<Act> {
                self.on(grid)?.backward(pass, saved, dy, dx_into)
            }
        }
    };
}

grid_norm!(LayerNorm2D);
grid_norm!(LayerNorm3D);
