//! [`Cube`]: the 3D layout as a [`Layout`], its ends included.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{by_rank_block, Act, Block, Layout, LinearOn, Pair, WeightUse};
use crate::ops::attention::Attention;
use crate::ops::heads::Heads;
use crate::parallel::ends::{check_grid_ends, OnGrid};
use crate::parallel::split;
use crate::parallel::VocabEmbedding3D;
use crate::parallel::{gather_3d, split_3d, Classifier3D, Cost};
use crate::parallel::{Embedding3D, LayerNorm3D, Layout3D};
use crate::parallel::{Linear3D, Linear3DSaved, NormHead, Place3D, ProcessGrid, TokenPosition};
use crate::store::{BackwardPass, ForwardPass, ParamStore, Pass, PassKind};
use crate::tensor::{Init, TensorId};

/// GPT-2's transformer block on the 3D layout (arXiv 2105.14450): [`LayerNorm3D`] and
/// [`Cube`], the [`Layout`] that runs GPT-2's [`Block`] over the [`Linear3D`] of
/// [`three_d`](crate::parallel::Linear3D) on a cube of `q³` ranks.
///
/// # LayerNorm3D
///
/// An activation `[R, C]` in a [`Layout3D`] gives each rank an `[n, C/q]` tile (`n = R/q²`):
/// the `C` columns of a row lie on the `q` ranks of the layout's column group (the grid's
/// `output()` for [`Layout3D::RowsJColsK`], whose column coordinate is `k`; `input()` for
/// [`Layout3D::RowsKColsJ`]). [`LayerNorm3D`] all-gathers the tile's `q` column blocks there
/// (then a `heads_merge` permute) into its full rows, runs the serial
/// [`ops::layernorm`](crate::ops::layernorm_forward) on them with γ and β whole, and keeps its block.
/// Backward all-gathers the saved tile and the output gradient likewise (and γ again), runs
/// the full rows' backward, keeps its block of `dx` and reduces its blocks of `dγ`, `dβ` (the
/// [grid LayerNorm](crate::parallel::LayerNorm2D)'s one algorithm, with the 3D groups).
///
/// - γ and β: `{name}.weight` and `{name}.bias` `[C/q]`, the block `c·C/q ..` of the rank's
///   column coordinate `c`, held alike by the `q²` ranks of that column block (norm share
///   `1/q²`, as [`Linear3D`]'s bias). Forward all-gathers them in the column group. The full
///   rows' `dγ`, `dβ` (f32, summed over the tile's rows) are the same on the `q` ranks of a
///   column group (they hold the same rows); each keeps its block and sums it over the other
///   `q²` row blocks with an all-reduce over the weight group (`i`) and one over the row
///   group (`a`), `2·C/q` f32 each: the exact gradient, on every rank holding the block.
/// - Cost, per rank, against the paper's (which all-reduces the row sums `Σx`, `Σx²`, `2n`
///   floats, in the column group, and `Σdy`, `Σdy·x̂` backward): forward moves the tile's full
///   rows (`(q−1)/q · n·C` elements, all-gather) instead of `2n`, and every rank of a column
///   group normalises the same `n` full rows (`q×` the arithmetic); backward the same for the
///   gradient. At `C/q ≫ 2`, the statistics are the cheaper wire format; the gather is exact
///   with no new kernel (the layer norm op, its f32 statistics and fixed-order sums are the
///   serial ones) and is what this layer does.
///
/// # The block on the cube
///
/// [`Block`] on [`Cube`]: `h1 = x + attn(ln_1(x))`, `out = h1 + mlp(ln_2(h1))` on tiles, its input and
/// output in the same layout `L` (the block's), so blocks chain. The four linears are
/// [`Linear3D`]s and alternate the layout: `c_attn` (`C → 3C`) takes `L` and gives
/// `L.swapped()`; `attn.c_proj` (`C → C`) takes that and gives `L` back, where the first
/// residual add needs it; `c_fc` (`C → 4C`) and `mlp.c_proj` (`4C → C`) do the same around
/// the GELU. The LayerNorms and the residual adds run in `L`.
///
/// The attention runs on each rank alone ([`ops::attention`](crate::ops::attention) over
/// its heads, as [`nn::CausalSelfAttention`](crate::nn::CausalSelfAttention)):
///
/// - heads: `c_attn`'s output column block `a` (of `q`) must hold the queries, keys and values
///   of the same heads. The master `[3C, C]` (GPT-2's q, k, v rows stacked) is registered as
///   one [`Linear3D`] of `3C` outputs **reordered** so that output row `a·3C/q + p·C/q + s`
///   is master row `p·C + a·C/q + s` (part `p` of q, k, v): block `a` is q, k, v of heads
///   `a·H/q ..`, laid out `[3, H/q, D]` per row, which is the fused layout the attention op
///   takes. The bias likewise. So `H` must split by `q`. `attn.c_proj` takes the heads'
///   merged output, the columns `a·C/q ..` of the serial one, unchanged.
/// - rows: a tile's `n = R/q²` rows must be whole sequences: the batch must split by `q²`
///   (each tile holds `B/q²` sequences of `T` tokens, rows batch-major).
///
/// Every parameter is registered under GPT-2's name (`{name}.ln_1.weight`,
/// `{name}.attn.c_attn.weight`, …) with the rank's shard of its master, from `init(name)`
/// (linear weights `[outputs, inputs]`), so the parallel block computes the serial one.
/// Shapes that do not split are refused at registration (channels by `q²`, heads by `q`,
/// channels by heads), and a batch that does not split by `q²` at forward, before any
/// collective, naming the dimension.
///
/// ```
/// use tidemem::chunk::{ChunkManager, ManagerConfig};
/// use tidemem::comm::Communicator;
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::nn::{Act, Block, BlockOn};
/// use tidemem::parallel::{Cube, GridSpec, Layout3D, ProcessGrid, TensorMode};
/// use tidemem::store::ParamStore;
/// use tidemem::tensor::Init;
/// use tidemem::tide::Policy;
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// // a cube of one rank: the block is the serial one
/// let dev = Device::sim(SimConfig::with_capacity(1 << 22))?;
/// let comm = Communicator::local(vec![dev.clone()])?.remove(0);
/// let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::ThreeD { q: 1 } };
/// let grid = ProcessGrid::new(&comm, spec)?;
/// let mut cfg = ManagerConfig::new(256, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// let init = |name: &str| match name.ends_with("weight") {
///     true if name.contains("ln_") => Init::Constant(1.0),
///     true => Init::Uniform { seed: name.len() as u64, lo: -0.3, hi: 0.3 },
///     false => Init::Zeros,
/// };
/// let layout = Cube::of(&grid, Layout3D::RowsJColsK)?;
/// let block = Block::register(&mut m, layout, "h.0", [8, 2], 1e-5, &init)?;
/// assert_eq!(block.params().len(), 12);
/// let fwd = m.forward()?;
/// let x = Act::upload(fwd.pool(), fwd.stream(), 6, 8, DType::F32, &[0.5; 48])?;
/// let (out, saved) = block.forward(&fwd, &x, [2, 3], None)?;
/// assert_eq!(out.shape(), [6, 8]);
/// fwd.finish()?;
/// let mut bwd = m.backward()?;
/// let dout = Act::upload(bwd.pool(), bwd.stream(), 6, 8, DType::F32, &[1.0; 48])?;
/// let dx = block.backward(&mut bwd, &saved, &dout, None)?;
/// assert_eq!(dx.shape(), [6, 8]);
/// bwd.finish()?;
/// // the output bias's gradient: Σ_rows dout
/// assert_eq!(m.read(block.mlp_proj.bias.unwrap())?, vec![6.0; 8]);
/// # Ok(()) }
/// ```
///
/// The 3D layout as a [`Layout`] (see [`Cube`]): the rank's tiles `[n, C/q]` in
/// [`Cube::layout`], its linears [`Linear3D`]s (a row linear takes the column linear's output
/// layout, and gives back the block's), its LayerNorms [`LayerNorm3D`]s, `H/q` heads a rank
/// attending locally over its tile's `batch/q²` whole sequences.
#[derive(Clone, Debug)]
pub struct Cube {
    /// The rank's place.
    pub place: Place3D,
    /// The layout of the block's input and output tiles.
    pub layout: Layout3D,
    grid: ProcessGrid,
}

impl PartialEq for Cube {
    fn eq(&self, other: &Cube) -> bool {
        (self.place, self.layout) == (other.place, other.layout)
    }
}

impl Cube {
    /// The layout of `grid`'s rank with tiles in `layout`; [`Error::Conflict`] on a grid that
    /// is not 3D.
    pub fn of(grid: &ProcessGrid, layout: Layout3D) -> Result<Cube> {
        Ok(Cube {
            place: Place3D::of(grid)?,
            layout,
            grid: grid.clone(),
        })
    }
}

impl OnGrid for Cube {
    fn grid(&self) -> &ProcessGrid {
        &self.grid
    }
}

impl Layout for Cube {
    type Linear = Linear3D;
    type Norm = LayerNorm3D;
    type Embedding = TokenPosition<VocabEmbedding3D, Embedding3D>;
    type Head = NormHead<LayerNorm3D, Classifier3D>;

    fn cols(&self, features: usize) -> usize {
        features / self.place.q
    }

    fn heads(&self, heads: usize) -> usize {
        heads / self.place.q
    }

    fn check_split(&self, name: &str, channels: usize, heads: usize) -> Result<()> {
        let q = self.place.q;
        split(name, "channels", channels, q * q, "q²")?;
        split(name, "heads", heads, q, "q")?;
        split(name, "channels", channels, heads, "heads").map(drop)
    }

    fn attention(
        &self,
        rows: usize,
        [batch, seq]: [usize; 2],
        heads: usize,
        head_dim: usize,
    ) -> Result<Attention> {
        let q = self.place.q;
        let whole = batch.checked_mul(seq);
        let tiled = rows.checked_mul(q * q);
        if batch == 0 || seq == 0 || whole != tiled {
            if batch == 0 || seq == 0 {
                return Err(Error::TooFew {
                    what: format!("the smaller of a 3D block's batch {batch} and sequence {seq}"),
                    got: 0,
                    need: 1,
                });
            }
            let Some(whole) = whole else {
                return Err(Error::Overflow {
                    what: format!("a 3D block's batch {batch} × sequence {seq}"),
                });
            };
            return Err(Error::Length {
                what: format!(
                    "rows · q² (q = {q}) of a 3D block tile of {rows} rows, for a batch of \
                     {batch} × sequence {seq}"
                ),
                got: tiled.unwrap_or(usize::MAX),
                expected: whole,
            });
        }
        // a tile holds whole sequences
        let local = split("a 3D block tile", "sequences", batch, q * q, "q²")?;
        Ok(Attention::new(Heads::new(local, seq, heads, head_dim)))
    }

    fn check_ends(&self, dims: [usize; 3]) -> Result<()> {
        check_grid_ends(self.place.q, dims)
    }

    fn register_embedding<S: ParamStore>(
        &self,
        store: &mut S,
        [v, t, c]: [usize; 3],
        [te, pe]: [&Init; 2],
        uses: WeightUse,
    ) -> Result<Self::Embedding> {
        let (grid, l) = (&self.grid, self.layout);
        let wte = VocabEmbedding3D::register(store, grid, "wte", v, c, l, te)?;
        let wpe = Embedding3D::register(store, grid, "wpe", t, c, l, pe)?;
        let wpe = match uses {
            WeightUse::Once => wpe,
            WeightUse::Shared => wpe.shared(),
        };
        Ok(TokenPosition { wte, wpe })
    }

    fn register_head<S: ParamStore>(
        &self,
        store: &mut S,
        [v, c]: [usize; 2],
        eps: f32,
        [te, g, b]: [&Init; 3],
        ignore: i32,
        tied: Option<&Self::Embedding>,
    ) -> Result<Self::Head> {
        let own;
        let wte = match tied {
            Some(e) => &e.wte,
            None => {
                let l = self.layout;
                own = VocabEmbedding3D::register(store, &self.grid, "wte", v, c, l, te)?;
                &own
            }
        };
        let ln_f = self.register_norm(store, "ln_f", c, eps, [g, b])?;
        let head = Classifier3D::tied(&*store, wte, ignore)?;
        Ok(NormHead { ln_f, head })
    }

    fn to_tile<K: PassKind>(&self, pass: &Pass<'_, K>, full: Act) -> Result<Act> {
        split_3d(pass, &self.grid, self.layout, &full)
    }

    fn to_full<K: PassKind>(&self, pass: &Pass<'_, K>, part: Act) -> Result<Act> {
        gather_3d(pass, &self.grid, self.layout, &part)
    }

    fn tile_shape(&self, [rows, cols]: [usize; 2]) -> Result<[usize; 2]> {
        let t = self.place.tile(self.layout, rows, cols)?;
        Ok([t.rows, t.cols])
    }

    fn register_norm<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        features: usize,
        eps: f32,
        init: [&Init; 2],
    ) -> Result<LayerNorm3D> {
        LayerNorm3D::register_at(store, self.place, name, features, eps, self.layout, init)
    }

    fn register_linear<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        io: [usize; 2],
        pair: Pair,
        [w, b]: [&Init; 2],
    ) -> Result<Linear3D> {
        let (parts, layout) = match pair {
            Pair::Column { parts } => (parts, self.layout),
            Pair::Row => (1, self.layout.swapped()),
        };
        let q = self.place.q;
        let w = by_rank_block(w, io, parts, q);
        let b = by_rank_block(b, [1, io[1]], parts, q);
        Linear3D::register_at(store, self.place, name, io, layout, [&w], Some(&b))
    }
}

impl Block<Cube> {
    /// The collectives of one forward and backward on tiles of `rows` rows (`n`) in `dtype`:
    /// the sum of its layers' ([`LayerNorm3D::collectives`], [`Linear3D::collectives`], every
    /// linear asked for its input gradient).
    pub fn collectives(&self, rows: usize, dtype: DType) -> Cost {
        let lin = |l: &Linear3D| l.collectives(rows, dtype, true);
        [
            self.ln_1.collectives(rows, dtype),
            lin(&self.c_attn),
            lin(&self.attn_proj),
            self.ln_2.collectives(rows, dtype),
            lin(&self.c_fc),
            lin(&self.mlp_proj),
        ]
        .into_iter()
        .sum()
    }
}

impl LinearOn<Cube> for Linear3D {
    type Saved = Linear3DSaved;

    fn params(&self) -> Vec<TensorId> {
        Linear3D::params(self)
    }

    fn forward_on(
        &self,
        layout: &Cube,
        pass: &ForwardPass<'_>,
        x: &Act,
    ) -> Result<(Act, Linear3DSaved)> {
        self.forward(pass, &layout.grid, x)
    }

    fn backward_on(
        &self,
        layout: &Cube,
        pass: &BackwardPass<'_>,
        saved: &Linear3DSaved,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act> {
        self.backward_with(pass, &layout.grid, saved, dy, true, uses)?
            .ok_or_else(|| Error::Internal {
                what: "a 3D linear asked for dx gave none".into(),
            })
    }
}
