use std::sync::Arc;

mod place;

pub use place::{gather_3d, split_3d, Layout3D, Place3D, Tile};

use super::grid::ProcessGrid;
use super::{Cost, PassCost};
use crate::comm::{CommStats, Communicator, ReduceOp, Tally};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Act, WeightUse};
use crate::ops::{self, BiasGrad, Gemm};
use crate::store::{BackwardPass, ForwardPass, Guard, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

pub(super) use super::split;

/// The collectives `(a, w, c)` of a layer on `layout`'s row group, the weight group and its
/// column group, by the grid's groups.
pub(super) fn by_group(layout: Layout3D, a: CommStats, w: CommStats, c: CommStats) -> PassCost {
    let (input, output) = match layout {
        Layout3D::RowsJColsK => (a, c),
        Layout3D::RowsKColsJ => (c, a),
    };
    PassCost {
        input,
        weight: w,
        output,
        ..PassCost::default()
    }
}

/// The groups of a layer taking `layout`: `(A, Wg, G)`, the group along the layout's row axis
/// `a` (gathers `X`), the weight group, the group along its column axis `c` (scatters `Y`).
pub(super) fn groups(
    grid: &ProcessGrid,
    layout: Layout3D,
) -> Result<(&Communicator, &Communicator, &Communicator)> {
    let (input, weight, output) = (grid.input()?, grid.weight()?, grid.output()?);
    Ok(match layout {
        Layout3D::RowsJColsK => (input, weight, output),
        Layout3D::RowsKColsJ => (output, weight, input),
    })
}

/// The activations a [`Linear3D`] keeps from forward for backward.
#[derive(Clone, Debug)]
pub struct Linear3DSaved {
    /// `X̃` `[q·n, I/q]`: the input gathered over the layout's row group.
    pub x: Act,
    /// `W̃` `[I/q, O/q]`: the weight gathered over the weight group.
    pub w: Act,
}

/// 3D tensor parallelism (arXiv 2105.14450) over a cube of `q³` ranks, `t = i + q·j + q²·k`
/// ([`ProcessGrid`] with [`TensorMode::ThreeD`](super::TensorMode::ThreeD)): a linear layer whose input, weight and
/// output are each split over the cube, with all-gathers and reduce-scatters in the grid's
/// `input()` (varies `j`), `weight()` (varies `i`) and `output()` (varies `k`) groups.
///
/// # Layouts
///
/// An activation `[R, C]` (rows are samples) is split in one of two [`Layout3D`]s. Call `a`
/// and `c` a rank's coordinates on the layout's two axes (`j` and `k` for
/// [`Layout3D::RowsJColsK`], `k` and `j` for [`Layout3D::RowsKColsJ`]): the rank holds rows
/// `(i·q + a)·R/q² ..` (`R/q²` of them) and columns `c·C/q ..` (`C/q`), its [`Tile`].
///
/// The master weight is the crate's linear weight `M` `[outputs, inputs]` (as
/// [`nn::Linear`](crate::nn::Linear) stores it: `Y = X·Mᵀ + b`, so the same initialisers give
/// a serial layer the same function); write `W = Mᵀ` `[inputs, outputs]`, `I` inputs and `O`
/// outputs. A [`Linear3D`] whose input is in layout `L` (axes `a`, `c`) registers on each rank:
///
/// - `{name}.weight` `[I/q², O/q]`, stored in `W`'s orientation (`[in, out]`, transposed from
///   the master, so that gathering it is a concatenation): element `(r, s)` is
///   `M[a·O/q + s, c·I/q + i·I/q² + r]`. The `q³` shards are disjoint.
/// - `{name}.bias` `[O/q]`: `b[a·O/q ..]`, held alike by the `q²` ranks of each `a` (each
///   counts `1/q²` of its gradient's squared norm, [`ParamStore::set_norm_share`]).
///
/// Its output is in layout `L.swapped()`: rows `(i·q + c)·R/q²`, columns `a·O/q`; so the next
/// layer, registered with the swapped layout, takes it as it is (the roles of the `input()` and
/// `output()` groups swap from layer to layer).
///
/// # Passes
///
/// With `A` the group along `a` (ranked by `a`), `G` the group along `c`, `Wg` the weight
/// group (ranked by `i`) and `n = R/q²`:
///
/// - forward: `X̃ = all-gather_A(X)` `[q·n, I/q]` (rows block `i`, columns block `c`);
///   `W̃ = all-gather_Wg(W)` `[I/q, O/q]` (`W`'s block `(c, a)`);
///   `Y = reduce-scatter_G(X̃·W̃) + b` `[n, O/q]`. `X̃` and `W̃` are kept for the backward
///   ([`Linear3DSaved`]).
/// - backward: `dỸ = all-gather_G(dY)`; `dX = reduce-scatter_A(dỸ·W̃ᵀ)` (when asked);
///   `dW = reduce-scatter_Wg(X̃ᵀ·dỸ)` straight into the weight's gradient slot;
///   `db = all-reduce_Wg(Σ_rows dỸ)` (`dỸ` holds every row of row block `i`, so the weight
///   group completes the sum over all rows: the value an all-reduce over the output × weight
///   plane of `Σ_rows dY` would give, over `q` ranks instead of `q²`).
///
/// Every buffer comes from the pass's pool, every collective runs on the pass's stream, and
/// [`Linear3D::collectives`] gives the calls and bytes of each pass. Shapes that do not split
/// (inputs by `q²`, outputs by `q`, rows by `q²`, columns by `q`) are refused before any
/// collective, naming the dimension; so is a grid that is not 3D.
///
/// ```
/// use tidemem::chunk::{ChunkManager, ManagerConfig};
/// use tidemem::comm::Communicator;
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::nn::Act;
/// use tidemem::parallel::{GridSpec, Layout3D, Linear3D, ProcessGrid, TensorMode};
/// use tidemem::store::ParamStore;
/// use tidemem::tensor::Init;
/// use tidemem::tide::Policy;
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// // a cube of one rank: the layer is the serial one
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let comm = Communicator::local(vec![dev.clone()])?.remove(0);
/// let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::ThreeD { q: 1 } };
/// let grid = ProcessGrid::new(&comm, spec)?;
/// let mut cfg = ManagerConfig::new(1024, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// // master [outputs 2, inputs 2] = [[1, 2], [3, 4]], bias [10, 20]
/// let w = Init::Fn(std::sync::Arc::new(|e| [1.0f32, 2.0, 3.0, 4.0][e]));
/// let b = Init::Fn(std::sync::Arc::new(|e| [10.0f32, 20.0][e]));
/// let layer =
///     Linear3D::register(&mut m, &grid, "fc", 2, 2, Layout3D::RowsJColsK, &w, Some(&b))?;
/// let pass = m.forward()?;
/// let x = Act::upload(pass.pool(), pass.stream(), 1, 2, DType::F32, &[1.0, 1.0])?;
/// let (y, _saved) = layer.forward(&pass, &grid, &x)?;
/// assert_eq!(y.to_f32(pass.stream())?, [13.0, 27.0]);
/// # Ok(()) }
/// ```
///
/// A 3D tensor-parallel linear layer `Y = X·Mᵀ + b` (see [`Linear3D`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear3D {
    /// This rank's weight shard `[I/q², O/q]` (stored `[in, out]`).
    pub weight: TensorId,
    /// This rank's bias shard `[O/q]`, if the layer has a bias.
    pub bias: Option<TensorId>,
    /// The full layer's inputs `I`.
    pub inputs: usize,
    /// The full layer's outputs `O`.
    pub outputs: usize,
    /// The layout of the input; the output's is [`Layout3D::swapped`].
    pub layout: Layout3D,
    /// The rank's place in the cube.
    pub place: Place3D,
}

/// The initialiser of a shard: element `e` of the shard is element `map(e)` of the master.
pub(super) fn shard_init(
    master: &Init,
    map: impl Fn(usize) -> usize + Send + Sync + 'static,
) -> Init {
    let master = master.clone();
    Init::Fn(Arc::new(move |e| master.value(map(e))))
}

/// One call over a buffer of `elems` elements of `dtype`.
pub(super) fn tally(elems: usize, dtype: DType) -> Tally {
    Tally {
        calls: 1,
        bytes: (elems * dtype.size()) as u64,
    }
}

impl Linear3D {
    /// Registers this rank's shards of a layer of `inputs` → `outputs` taking its input in
    /// `layout`: `{name}.weight` from the master `[outputs, inputs]` whose values `weight`
    /// gives element by element (row-major) and, with `bias`, `{name}.bias` from the master
    /// `[outputs]` (layouts in [`Linear3D`]). Fails before registering anything if the
    /// grid is not 3D, the inputs do not split by `q²` or the outputs by `q`.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        inputs: usize,
        outputs: usize,
        layout: Layout3D,
        weight: &Init,
        bias: Option<&Init>,
    ) -> Result<Linear3D> {
        let place = Place3D::of(grid)?;
        Linear3D::register_at(
            store,
            place,
            name,
            [inputs, outputs],
            layout,
            [weight],
            bias,
        )
    }

    /// [`Linear3D::register`] at `place`.
    pub(super) fn register_at(
        store: &mut impl ParamStore,
        place: Place3D,
        name: &str,
        [inputs, outputs]: [usize; 2],
        layout: Layout3D,
        [weight]: [&Init; 1],
        bias: Option<&Init>,
    ) -> Result<Linear3D> {
        let q = place.q;
        let iq2 = split(name, "inputs", inputs, q * q, "q²")?;
        let oq = split(name, "outputs", outputs, q, "q")?;
        let (i, (a, c)) = (place.i, place.axes(layout));
        let w = shard_init(weight, move |e| {
            let (r, s) = (e / oq, e % oq);
            (a * oq + s) * inputs + c * q * iq2 + i * iq2 + r
        });
        let weight = store.register(&format!("{name}.weight"), &[iq2, oq], w)?;
        let bias = match bias {
            Some(b) => {
                let id = store.register(
                    &format!("{name}.bias"),
                    &[oq],
                    shard_init(b, move |e| a * oq + e),
                )?;
                store.set_norm_share(id, 1.0 / (q * q) as f64)?;
                Some(id)
            }
            None => None,
        };
        Ok(Linear3D {
            weight,
            bias,
            inputs,
            outputs,
            layout,
            place,
        })
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        std::iter::once(self.weight).chain(self.bias).collect()
    }

    /// The layout of the output: the next layer's input layout.
    pub fn output_layout(&self) -> Layout3D {
        self.layout.swapped()
    }

    /// `(q, I/q, O/q)`.
    fn dims(&self) -> (usize, usize, usize) {
        let q = self.place.q;
        (q, self.inputs / q, self.outputs / q)
    }

    /// The layer's groups on `grid`, which must be the grid it was registered on.
    fn groups<'g>(
        &self,
        grid: &'g ProcessGrid,
    ) -> Result<(&'g Communicator, &'g Communicator, &'g Communicator)> {
        let here = Place3D::of(grid)?;
        if here != self.place {
            return Err(Error::WrongPlace {
                what: "a 3D layer",
                registered: format!("at {:?}", self.place),
                run: format!("at {here:?}"),
            });
        }
        groups(grid, self.layout)
    }

    fn check_params<K: PassKind>(&self, g: &Guard<'_, K>, d: DType) -> Result<()> {
        let (q, _, oq) = self.dims();
        let shapes = [vec![self.inputs / (q * q), oq], vec![oq]];
        for (n, shape) in shapes.iter().enumerate().take(g.len()) {
            let p = g.param(n)?;
            if p.shape() != shape.as_slice() || p.dtype() != d {
                return Err(Error::ParamShape {
                    tensor: g.ids()[n].0,
                    shape: p.shape().to_vec(),
                    dtype: p.dtype(),
                    expected: shape.clone(),
                    expected_dtype: d,
                });
            }
        }
        Ok(())
    }

    /// `Y = reduce-scatter(X̃·W̃) + b` for this rank's input tile `x` `[n, I/q]` (in
    /// [`Linear3D::layout`]): this rank's output tile `[n, O/q]` (in the swapped layout) and
    /// what the backward needs. A wrong grid, shape or type is an error before any collective.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
    ) -> Result<(Act, Linear3DSaved)> {
        let (ga, gw, gc) = self.groups(grid)?;
        let (q, iq, oq) = self.dims();
        let d = pass.param_dtype();
        x.expect("x", None, iq, d)?;
        let n = x.rows();
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        let (xt, wt) = (
            Act::alloc(pool, q * n, iq, d)?,
            Act::alloc(pool, iq, oq, d)?,
        );
        let (z, y) = (Act::alloc(pool, q * n, oq, d)?, Act::alloc(pool, n, oq, d)?);
        ga.all_gather(s, x.view(), xt.view(), d)?;
        gw.all_gather(s, g.param(0)?.device_view(), wt.view(), d)?;
        let mm = Gemm::new(q * n, oq, iq);
        ops::gemm(dev, s, &mm, xt.input(), wt.input(), z.view(), d)?;
        gc.reduce_scatter(s, z.view(), y.view(), d, ReduceOp::Sum)?;
        if self.bias.is_some() {
            ops::add_bias_rows(dev, s, g.param(1)?, y.view(), n, oq, d)?;
        }
        Ok((y, Linear3DSaved { x: xt, w: wt }))
    }

    /// The backward of [`Linear3D::forward`] from its `saved` activations and this rank's
    /// output-gradient tile `dy` `[n, O/q]`: writes the weight's (and bias's) gradient shard
    /// into its slot and, with `need_dx`, returns this rank's input-gradient tile `[n, I/q]`.
    /// A wrong grid, shape or type is an error before any collective.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Linear3DSaved,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        self.backward_with(pass, grid, saved, dy, need_dx, WeightUse::Once)
    }

    /// [`Linear3D::backward`] with the gradients written as `uses` says: with
    /// [`WeightUse::Shared`] (a weight tied to another layer, e.g. the LM head on the token
    /// embedding) the weight's reduce-scattered shard (and the bias's) goes into a pool buffer
    /// and is added through [`Guard::accumulate_grad`] instead of written into the slot; the
    /// collectives are the same.
    pub fn backward_with(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Linear3DSaved,
        dy: &Act,
        need_dx: bool,
        uses: WeightUse,
    ) -> Result<Option<Act>> {
        let (ga, gw, gc) = self.groups(grid)?;
        let (q, iq, oq) = self.dims();
        let d = pass.param_dtype();
        saved.x.expect("saved.x", None, iq, d)?;
        saved.w.expect("saved.w", Some(iq), oq, d)?;
        let rows = saved.x.rows();
        if !rows.is_multiple_of(q) {
            return Err(Error::NotSplit {
                layer: "a 3D linear's backward".into(),
                what: "saved.x rows",
                value: rows,
                parts: q,
                by: "q tiles",
            });
        }
        dy.expect("dy", Some(rows / q), oq, d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params())?;
        self.check_params(&g, d)?;
        let dyt = Act::alloc(pool, rows, oq, d)?;
        let dxs = match need_dx {
            true => Some((
                Act::alloc(pool, rows, iq, d)?,
                Act::alloc(pool, rows / q, iq, d)?,
            )),
            false => None,
        };
        let dwt = Act::alloc(pool, iq, oq, d)?;
        let scratch_bytes = ops::bias_grad_scratch_bytes(rows, oq);
        let scratch = self.bias.map(|_| pool.alloc(scratch_bytes)).transpose()?;
        gc.all_gather(s, dy.view(), dyt.view(), d)?;
        if let Some((dxt, dx)) = &dxs {
            let mm = Gemm::new(rows, iq, oq).trans_b(true);
            ops::gemm(dev, s, &mm, dyt.input(), saved.w.input(), dxt.view(), d)?;
            ga.reduce_scatter(s, dxt.view(), dx.view(), d, ReduceOp::Sum)?;
        }
        let mm = Gemm::new(iq, oq, rows).trans_a(true);
        ops::gemm(dev, s, &mm, saved.x.input(), dyt.input(), dwt.view(), d)?;
        let shared = |elems: usize| match uses {
            WeightUse::Once => Ok(None),
            WeightUse::Shared => pool.alloc(elems * d.size()).map(Some),
        };
        let (dw_share, db_share) = (shared(dwt.numel() / q)?, shared(oq)?);
        match &dw_share {
            None => gw.reduce_scatter(s, dwt.view(), g.grad(0)?.view(), d, ReduceOp::Sum)?,
            Some(b) => {
                let dw = b.view(0, dwt.len_bytes() / q)?;
                gw.reduce_scatter(s, dwt.view(), dw, d, ReduceOp::Sum)?;
                g.accumulate_grad(0, dw, d)?;
            }
        }
        if let Some(scratch) = &scratch {
            let db = match &db_share {
                None => g.grad(1)?.view(),
                Some(b) => b.view(0, oq * d.size())?,
            };
            let grads = BiasGrad {
                dy: dyt.input(),
                db,
                db_dtype: d,
                accumulate: false,
                scratch: scratch.view(0, scratch_bytes)?,
            };
            ops::bias_grad(dev, s, grads, rows, oq, d)?;
            gw.all_reduce(s, db, db, d, ReduceOp::Sum)?;
            if db_share.is_some() {
                g.accumulate_grad(1, db, d)?;
            }
        }
        Ok(dxs.map(|(_, dx)| dx))
    }

    /// The collectives of one forward and backward on input tiles of `rows` rows (`n`, the
    /// rows of `x`) in `dtype`: forward, two all-gathers (`q·n × I/q` on the layout's row
    /// group, `I/q × O/q` on the weight group) and a reduce-scatter (`q·n × O/q` on its column
    /// group); backward, an all-gather of `q·n × O/q` (column group), with `need_dx` a
    /// reduce-scatter of `q·n × I/q` (row group), a reduce-scatter of `I/q × O/q` and, with a
    /// bias, an all-reduce of `O/q` (weight group).
    pub fn collectives(&self, rows: usize, dtype: DType, need_dx: bool) -> Cost {
        let (q, iq, oq) = self.dims();
        let [mut fa, mut fw, mut fc] = [CommStats::default(); 3];
        fa.all_gather = tally(q * rows * iq, dtype);
        fw.all_gather = tally(iq * oq, dtype);
        fc.reduce_scatter = tally(q * rows * oq, dtype);
        let [mut ba, mut bw, mut bc] = [CommStats::default(); 3];
        bc.all_gather = tally(q * rows * oq, dtype);
        if need_dx {
            ba.reduce_scatter = tally(q * rows * iq, dtype);
        }
        bw.reduce_scatter = tally(iq * oq, dtype);
        if self.bias.is_some() {
            bw.all_reduce = tally(oq, dtype);
        }
        Cost {
            forward: by_group(self.layout, fa, fw, fc),
            backward: by_group(self.layout, ba, bw, bc),
        }
    }
}
