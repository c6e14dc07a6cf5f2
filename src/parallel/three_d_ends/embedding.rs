//! [`Embedding3D`] and [`VocabEmbedding3D`] (see [`Embedding3D`](crate::parallel::Embedding3D)).

use super::{check_ids, here};
use crate::comm::{CommStats, ReduceOp};
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Act, WeightUse};
use crate::ops::heads::{heads_split, Heads};
use crate::ops::{vocab_embedding_backward, vocab_embedding_forward, VocabPlan, VocabShard};
use crate::parallel::grid::ProcessGrid;
use crate::parallel::three_d::by_group;
use crate::parallel::three_d::{
    groups, shard_init, split, tally, Layout3D, Linear3D, Place3D, Tile,
};
use crate::parallel::Cost;
use crate::parallel::GridLookup;
use crate::store::{BackwardPass, ForwardPass, Guard, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

/// Checks that tensor 0 of `g` is `shape` of `d`.
fn check_shape<K: PassKind>(g: &Guard<'_, K>, shape: [usize; 2], d: DType) -> Result<()> {
    let p = g.param(0)?;
    if p.shape() != shape.as_slice() || p.dtype() != d {
        return Err(Error::ParamShape {
            tensor: g.ids()[0].0,
            shape: p.shape().to_vec(),
            dtype: p.dtype(),
            expected: shape.to_vec(),
            expected_dtype: d,
        });
    }
    Ok(())
}

/// The plan of `ids` for `shard` and its words uploaded to the pass's pool.
fn plan<K: PassKind>(
    pass: &crate::store::Pass<'_, K>,
    ids: &[i32],
    shard: &VocabShard,
) -> Result<(VocabPlan, PoolBlock)> {
    let plan = VocabPlan::new(ids, shard)?;
    let words = pass.upload(bytemuck::cast_slice(&plan.to_words()))?;
    Ok((plan, words))
}

/// The ends of a model on the 3D cube (arXiv 2105.14450) of [`three_d`](crate::parallel::Linear3D): the
/// embeddings that make the first activation tile and the classifiers that end in the loss,
/// each taking a [`Layout3D`](crate::parallel::Layout3D) at registration, the layout of its activation tile (rows
/// `(i·q + a)·R/q² ..`, `R/q²` of them, and columns `c·C/q ..`, with `(a, c)` the rank's
/// coordinates on the layout's axes: `(j, k)` for [`Layout3D::RowsJColsK`](crate::parallel::Layout3D::RowsJColsK), `(k, j)` for
/// [`Layout3D::RowsKColsJ`](crate::parallel::Layout3D::RowsKColsJ)). `A` is the group along `a` (ranked by `a`), `Wg` the weight group
/// ([`ProcessGrid::weight`], ranked by `i`), `n = R/q²`.
///
/// # Embedding3D
///
/// A table `[rows, C]` (positions, or a vocabulary that is not split by vocabulary): rank
/// `(i, j, k)` registers `{name}.weight` `[rows/q, C/q]`, the table's row piece `i` and
/// column block `c`, the same on the `q` ranks along `a` (norm share `1/q`). Forward
/// all-gathers it over `Wg` (`[rows, C/q]`, column block `c`) and looks up the ids of the
/// tile's rows: the tile `[n, C/q]` in the layout. Backward: the table's gradient
/// `[rows, C/q]` from the tile's rows, a reduce-scatter over `Wg` (`[rows/q, C/q]`) and an
/// all-reduce over `A` (the other row blocks), into the slot.
///
/// # VocabEmbedding3D
///
/// The token embedding with the vocabulary split, tied to the LM head: its weight is exactly
/// the [`Linear3D`](crate::parallel::Linear3D) shard of the master `wte` `[V, C]` (outputs `V`, inputs `C`) for input
/// layout `L`: `{name}.weight` `[C/q², V/q]`, element `(r, s)` = `wte[a·V/q + s, c·C/q +
/// i·C/q² + r]`, so [`Classifier3D::tied`](crate::parallel::Classifier3D::tied) is [`Linear3D`](crate::parallel::Linear3D)'s algorithm on the same tensor.
/// `V` must split by `q` and `C` by `q²`: pad the vocabulary (GPT-2's 50257 tokens to 50304,
/// the padding rows never looked up and, as classes, never a target).
///
/// - forward: `W̃ = all-gather_Wg(W)` `[C/q, V/q]` (`wte[vocab block a, C block c]ᵀ`),
///   transposed to `[V/q, C/q]`; a masked lookup
///   ([`vocab_embedding_forward`](crate::ops::vocab_embedding_forward), the tokens
///   `a·V/q ..` of the vocabulary) of the `q·n` rows of row block `i`, a partial sum over the
///   vocabulary blocks; `reduce-scatter_A` completes the sum and keeps the rows of sub-block
///   `i·q + a`: the tile in `L`.
/// - backward: `all-gather_A(dtile)` `[q·n, C/q]`; the lookup's backward into `[V/q, C/q]`,
///   transposed to `[C/q, V/q]`; `reduce-scatter_Wg` (the other row blocks) gives the shard
///   `[C/q², V/q]`, added through
///   [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad) (the head adds the other
///   share).
///
/// # Classifier3D
///
/// `logits = h·Mᵀ (+ b)` by [`Linear3D`](crate::parallel::Linear3D) on an input tile in `L`, so the logits are in
/// `L.swapped()`: rows `(i·q + c)·n ..`, classes block `a`. The ranks holding the other classes
/// of those rows are `A`: [`ShardedCrossEntropy`](crate::parallel::ShardedCrossEntropy) over `A` (the classes `a·classes/q ..`) gives
/// each rank the sum of its tile rows' losses and the logits' gradient; the ranks with `a = 0`
/// add theirs over [`ProcessGrid::tensor`] (one f64 all-reduce) and every rank divides by the
/// rows counted in the whole batch (targets not the ignore index): the mean loss, the same on
/// every rank of the cube. The gradient is scaled by `loss_scale / count`. Backward is
/// [`Linear3D`](crate::parallel::Linear3D)'s, giving `dh` in `L`; a classifier tied to a [`VocabEmbedding3D`]
/// ([`Classifier3D::tied`](crate::parallel::Classifier3D::tied)) adds its weight share with
/// [`Linear3D::backward_with`](crate::parallel::Linear3D::backward_with) and [`WeightUse::Shared`](crate::nn::WeightUse::Shared).
///
/// Every layer checks on the host, on every rank and before any collective, that the grid is
/// 3D and that the dimensions split (a typed [`Error::NotSplit`] naming the dimension), and
/// gives its collectives by group ([`Cost`](crate::parallel::Cost)).
///
/// ```
/// use tidemem::chunk::{ChunkManager, ManagerConfig};
/// use tidemem::comm::Communicator;
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::parallel::{Classifier3D, GridSpec, Layout3D, ProcessGrid, TensorMode};
/// use tidemem::parallel::{GridClassifier, GridLookup, VocabEmbedding3D};
/// use tidemem::store::ParamStore;
/// use tidemem::tensor::Init;
/// use tidemem::tide::Policy;
/// use tidemem::DType;
/// # fn main() -> tidemem::Result<()> {
/// // a cube of one rank: the layers are the serial ones
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let comm = Communicator::local(vec![dev.clone()])?.remove(0);
/// let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::ThreeD { q: 1 } };
/// let grid = ProcessGrid::new(&comm, spec)?;
/// let mut cfg = ManagerConfig::new(1024, Policy::Tide);
/// cfg.param_dtype = DType::F32;
/// let mut m = ChunkManager::new(dev, cfg)?;
/// // wte [3 tokens, 2 channels] = [[1, 0], [0, 1], [1, 1]]
/// let wte = Init::Fn(std::sync::Arc::new(|e| [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0][e]));
/// let lay = Layout3D::RowsJColsK;
/// let emb = VocabEmbedding3D::register(&mut m, &grid, "wte", 3, 2, lay, &wte)?;
/// let head = Classifier3D::tied(&m, &emb, -100)?;
/// let fwd = m.forward()?;
/// let (h, emb_saved) = emb.forward(&fwd, &grid, &[2, 0])?;
/// assert_eq!(h.to_f32(fwd.stream())?, [1.0, 1.0, 1.0, 0.0]);
/// // logits [[1, 1, 2], [1, 0, 1]]; the second row is ignored
/// let (loss, head_saved) = head.forward(&fwd, &grid, &h, &[2, -100], 1.0)?;
/// let want = (2.0f32.exp() + 2.0 * 1.0f32.exp()).ln() - 2.0;
/// assert!((loss - want).abs() < 1e-6);
/// fwd.finish()?;
/// let bwd = m.backward()?;
/// let dh = head.backward(&bwd, &grid, &head_saved)?;
/// assert_eq!(dh.shape(), [2, 2]);
/// emb.backward(&bwd, &grid, &emb_saved, &dh)?;
/// bwd.finish()?;
/// assert_eq!(m.read(emb.weight)?.len(), 6);
/// # Ok(()) }
/// ```
///
/// A table `[rows, C]` whose row pieces are split over the weight group and columns over the
/// layout's column axis (positions, or a vocabulary not split by vocabulary); its output is a
/// tile in [`Embedding3D::layout`] (see [`Embedding3D`](crate::parallel::Embedding3D)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding3D {
    /// This rank's piece `[rows/q, C/q]`: the table's rows `i·rows/q ..`, columns `c·C/q ..`.
    pub weight: TensorId,
    /// The table's rows (the ids are `0..rows`).
    pub rows: usize,
    /// The table's columns `C`.
    pub channels: usize,
    /// The layout of the output tile.
    pub layout: Layout3D,
    /// The rank's place in the cube.
    pub place: Place3D,
    /// How backward writes the piece's gradient: into its slot ([`WeightUse::Once`], as
    /// registered), or as a share ([`WeightUse::Shared`]: a table looked up more than once an
    /// iteration, as by a pipeline stage's micro-batches).
    pub uses: WeightUse,
}

/// What [`Embedding3D::forward`] keeps for the backward: the tile's ids, planned.
#[derive(Debug)]
pub struct Embedding3DSaved {
    plan: VocabPlan,
    words: PoolBlock,
}

impl Embedding3D {
    /// Registers `{name}.weight`, this rank's piece of the master `[rows, channels]` whose
    /// values `table` gives element by element (row-major), for an output in `layout`; the
    /// piece is held alike by the `q` ranks along the layout's row axis (norm share `1/q`).
    /// Fails before registering anything if the grid is not 3D or the rows or the channels do
    /// not split by `q`.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        rows: usize,
        channels: usize,
        layout: Layout3D,
        table: &Init,
    ) -> Result<Embedding3D> {
        let place = Place3D::of(grid)?;
        let q = place.q;
        let rq = split(name, "table rows", rows, q, "q")?;
        let cq = split(name, "channels", channels, q, "q")?;
        if rows > i32::MAX as usize {
            return Err(Error::TooLarge {
                what: format!("'{name}': table rows (ids are i32)"),
                requested: rows as u128,
                limit: i32::MAX as u64,
            });
        }
        let (i, (_, c)) = (place.i, place.axes(layout));
        let init = shard_init(table, move |e| {
            (i * rq + e / cq) * channels + c * cq + e % cq
        });
        let weight = store.register(&format!("{name}.weight"), &[rq, cq], init)?;
        store.set_norm_share(weight, 1.0 / q as f64)?;
        Ok(Embedding3D {
            weight,
            rows,
            channels,
            layout,
            place,
            uses: WeightUse::Once,
        })
    }

    /// The same table, its gradient added as a share at each use ([`WeightUse::Shared`]).
    pub fn shared(self) -> Embedding3D {
        Embedding3D {
            uses: WeightUse::Shared,
            ..self
        }
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        vec![self.weight]
    }

    /// This rank's output tile for a batch of `ids.len()` rows, after the host checks.
    fn tile(&self, grid: &ProcessGrid, ids: &[i32]) -> Result<Tile> {
        let place = here(grid, self.place)?;
        check_ids(ids, self.rows)?;
        place.tile(self.layout, ids.len(), self.channels)
    }

    /// The collectives of one forward and backward in `dtype` (they do not depend on the
    /// batch): forward, an all-gather of `rows × C/q` on the weight group; backward, a
    /// reduce-scatter of `rows × C/q` on the weight group and an all-reduce of
    /// `rows/q × C/q` on the layout's row group.
    pub fn collectives(&self, dtype: DType) -> Cost {
        let q = self.place.q;
        let cq = self.channels / q;
        let none = CommStats::default();
        let mut fw = none;
        fw.all_gather = tally(self.rows * cq, dtype);
        let (mut ba, mut bw) = (none, none);
        bw.reduce_scatter = tally(self.rows * cq, dtype);
        ba.all_reduce = tally(self.rows / q * cq, dtype);
        Cost {
            forward: by_group(self.layout, none, fw, none),
            backward: by_group(self.layout, ba, bw, none),
        }
    }
}

impl GridLookup for Embedding3D {
    type Saved = Embedding3DSaved;

    fn params(&self) -> Vec<TensorId> {
        Self::params(self)
    }

    /// The embedding of `ids` (the whole batch's `R` ids, row by row, the same on every rank):
    /// this rank's tile `[R/q², C/q]` in [`Embedding3D::layout`], after one all-gather over the
    /// weight group. The ids (in `0..rows`, `R` a multiple of `q²`) and the grid are checked
    /// on the host before any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        ids: &[i32],
    ) -> Result<(Act, Embedding3DSaved)> {
        let tile = self.tile(grid, ids)?;
        let (_, gw, _) = groups(grid, self.layout)?;
        let (q, d, cq) = (self.place.q, pass.param_dtype(), tile.cols);
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let mine = &ids[tile.row0..tile.row0 + tile.rows];
        let all = VocabShard::new(self.rows, 0, self.rows)?;
        let (plan, words) = plan(pass, mine, &all)?;
        let g = pass.fetch(&self.params())?;
        check_shape(&g, [self.rows / q, cq], d)?;
        let table = Act::alloc(pool, self.rows, cq, d)?;
        let out = Act::alloc(pool, tile.rows, cq, d)?;
        gw.all_gather(s, g.param(0)?.device_view(), table.view(), d)?;
        drop(g);
        let tok = pass.upload(bytemuck::cast_slice(mine))?;
        let tv = tok.view(0, tile.rows * 4)?;
        vocab_embedding_forward(dev, s, tv, table.input(), out.view(), &all, cq, d)?;
        Ok((out, Embedding3DSaved { plan, words }))
    }

    /// The backward of [`Embedding3D::forward`] from this rank's output-gradient tile `dout`
    /// `[R/q², C/q]`: the table's gradient from the tile's rows, a reduce-scatter over the
    /// weight group and an all-reduce over the layout's row group, written into the weight's
    /// slot (or added as a share: [`Embedding3D::uses`]).
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Embedding3DSaved,
        dout: &Act,
    ) -> Result<()> {
        here(grid, self.place)?;
        let (ga, gw, _) = groups(grid, self.layout)?;
        let (q, d) = (self.place.q, pass.param_dtype());
        let cq = self.channels / q;
        dout.expect("dout", Some(saved.plan.positions()), cq, d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params())?;
        check_shape(&g, [self.rows / q, cq], d)?;
        let dtable = Act::alloc(pool, self.rows, cq, d)?;
        let wv = saved.words.view(0, saved.plan.words() * 4)?;
        let p = &saved.plan;
        vocab_embedding_backward(dev, s, dout.input(), p, wv, dtable.view(), cq, false, d)?;
        let bytes = dtable.len_bytes() / q;
        let share = match self.uses {
            WeightUse::Once => None,
            WeightUse::Shared => Some(pool.alloc(bytes)?),
        };
        let slot = match &share {
            None => g.grad(0)?.view(),
            Some(b) => b.view(0, bytes)?,
        };
        gw.reduce_scatter(s, dtable.view(), slot, d, ReduceOp::Sum)?;
        ga.all_reduce(s, slot, slot, d, ReduceOp::Sum)?;
        if share.is_some() {
            g.accumulate_grad(0, slot, d)?;
        }
        Ok(())
    }
}

/// The token embedding with the vocabulary split over the cube, tied to the LM head
/// ([`Classifier3D::tied`](crate::parallel::Classifier3D::tied)(crate::parallel::Classifier3D::tied)); its output is a tile in
/// [`VocabEmbedding3D::layout`] (see [`Embedding3D`](crate::parallel::Embedding3D)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabEmbedding3D {
    /// This rank's shard `[C/q², V/q]`: [`Linear3D`]'s for the master `wte` `[V, C]` and input
    /// layout [`VocabEmbedding3D::layout`].
    pub weight: TensorId,
    /// The vocabulary `V` (a multiple of `q`: pad it).
    pub vocab: usize,
    /// The channels `C` (a multiple of `q²`).
    pub channels: usize,
    /// The layout of the output tile (and of the tied head's input).
    pub layout: Layout3D,
    /// The rank's place in the cube.
    pub place: Place3D,
}

/// What [`VocabEmbedding3D::forward`] keeps for the backward: the ids of the rank's row
/// block, planned for its vocabulary block.
#[derive(Debug)]
pub struct VocabEmbedding3DSaved {
    plan: VocabPlan,
    words: PoolBlock,
}

impl VocabEmbedding3D {
    /// Registers `{name}.weight`, this rank's shard of the master `wte` `[vocab, channels]`
    /// whose values `wte` gives element by element (row-major), for an output in `layout`.
    /// Fails before registering anything if the grid is not 3D, the vocabulary does not split
    /// by `q` (pad it: GPT-2's 50257 tokens to 50304) or the channels by `q²`.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        vocab: usize,
        channels: usize,
        layout: Layout3D,
        wte: &Init,
    ) -> Result<VocabEmbedding3D> {
        let place = Place3D::of(grid)?;
        let q = place.q;
        if vocab == 0 || !vocab.is_multiple_of(q) {
            return Err(Error::NotSplit {
                layer: name.to_string(),
                what: "vocabulary",
                value: vocab,
                parts: q,
                by: "q ranks of a 3D cube; pad the vocabulary to a multiple of q, as GPT-2's \
                     50257 to 50304",
            });
        }
        split(name, "channels", channels, q * q, "q²")?;
        let (a, _) = place.axes(layout);
        VocabShard::new(vocab, a * vocab / q, vocab / q)?;
        let lin = Linear3D::register(store, grid, name, channels, vocab, layout, wte, None)?;
        Ok(VocabEmbedding3D {
            weight: lin.weight,
            vocab,
            channels,
            layout,
            place,
        })
    }

    /// The parameters, in fetch order.
    pub fn params(&self) -> Vec<TensorId> {
        vec![self.weight]
    }

    /// The vocabulary block this rank holds: tokens `a·V/q ..`.
    pub fn shard(&self) -> Result<VocabShard> {
        let (a, _) = self.place.axes(self.layout);
        let vq = self.vocab / self.place.q;
        VocabShard::new(self.vocab, a * vq, vq)
    }

    /// The same weight as the tied head's [`Linear3D`] (inputs `C`, outputs `V`, no bias).
    pub fn linear(&self) -> Linear3D {
        Linear3D {
            weight: self.weight,
            bias: None,
            inputs: self.channels,
            outputs: self.vocab,
            layout: self.layout,
            place: self.place,
        }
    }

    /// `(q, C/q, V/q)`.
    fn dims(&self) -> (usize, usize, usize) {
        let q = self.place.q;
        (q, self.channels / q, self.vocab / q)
    }

    /// The collectives of one forward and backward on tiles of `rows` rows (`n = R/q²`) in
    /// `dtype`: forward, an all-gather of `C/q × V/q` on the weight group and a reduce-scatter
    /// of `q·n × C/q` on the layout's row group; backward, an all-gather of `q·n × C/q` on the
    /// row group and a reduce-scatter of `C/q × V/q` on the weight group.
    pub fn collectives(&self, rows: usize, dtype: DType) -> Cost {
        let (q, cq, vq) = self.dims();
        let none = CommStats::default();
        let (mut fa, mut fw) = (none, none);
        fw.all_gather = tally(cq * vq, dtype);
        fa.reduce_scatter = tally(q * rows * cq, dtype);
        let (mut ba, mut bw) = (none, none);
        ba.all_gather = tally(q * rows * cq, dtype);
        bw.reduce_scatter = tally(cq * vq, dtype);
        Cost {
            forward: by_group(self.layout, fa, fw, none),
            backward: by_group(self.layout, ba, bw, none),
        }
    }
}

impl GridLookup for VocabEmbedding3D {
    type Saved = VocabEmbedding3DSaved;

    fn params(&self) -> Vec<TensorId> {
        Self::params(self)
    }

    /// The embedding of `tokens` (the whole batch's `R` ids, row by row, the same on every
    /// rank): this rank's tile `[R/q², C/q]` in [`VocabEmbedding3D::layout`], after an
    /// all-gather over the weight group and a reduce-scatter over the layout's row group. The
    /// tokens (in `0..V`, `R` a multiple of `q²`) and the grid are checked on the host before
    /// any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        tokens: &[i32],
    ) -> Result<(Act, VocabEmbedding3DSaved)> {
        let place = here(grid, self.place)?;
        check_ids(tokens, self.vocab)?;
        let tile = place.tile(self.layout, tokens.len(), self.channels)?;
        let (ga, gw, _) = groups(grid, self.layout)?;
        let (q, cq, vq) = self.dims();
        let (d, n) = (pass.param_dtype(), tile.rows);
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let shard = self.shard()?;
        // the q·n rows of row block i
        let block = &tokens[place.i * q * n..(place.i + 1) * q * n];
        let (plan, words) = plan(pass, block, &shard)?;
        let g = pass.fetch(&self.params())?;
        check_shape(&g, [cq / q, vq], d)?;
        let (wt, table) = (Act::alloc(pool, cq, vq, d)?, Act::alloc(pool, vq, cq, d)?);
        let (part, out) = (Act::alloc(pool, q * n, cq, d)?, Act::alloc(pool, n, cq, d)?);
        gw.all_gather(s, g.param(0)?.device_view(), wt.view(), d)?;
        drop(g);
        // [C/q, V/q] → [V/q, C/q]
        let t = Heads::new(1, cq, vq, 1);
        heads_split(dev, s, t, wt.input(), table.view(), d)?;
        let tok = pass.upload(bytemuck::cast_slice(block))?;
        let tv = tok.view(0, q * n * 4)?;
        vocab_embedding_forward(dev, s, tv, table.input(), part.view(), &shard, cq, d)?;
        ga.reduce_scatter(s, part.view(), out.view(), d, ReduceOp::Sum)?;
        Ok((out, VocabEmbedding3DSaved { plan, words }))
    }

    /// The backward of [`VocabEmbedding3D::forward`] from this rank's output-gradient tile
    /// `dout` `[R/q², C/q]`: adds this rank's share of its shard's gradient through
    /// [`Guard::accumulate_grad`] (the tied head adds the other), after an all-gather over the
    /// layout's row group and a reduce-scatter over the weight group.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &VocabEmbedding3DSaved,
        dout: &Act,
    ) -> Result<()> {
        here(grid, self.place)?;
        let (ga, gw, _) = groups(grid, self.layout)?;
        let (q, cq, vq) = self.dims();
        let d = pass.param_dtype();
        let rows = saved.plan.positions();
        dout.expect("dout", Some(rows / q), cq, d)?;
        let (dev, s, pool) = (pass.device(), pass.stream(), pass.pool());
        let g = pass.fetch(&self.params())?;
        check_shape(&g, [cq / q, vq], d)?;
        let full = Act::alloc(pool, rows, cq, d)?;
        let (dtable, dwt) = (Act::alloc(pool, vq, cq, d)?, Act::alloc(pool, cq, vq, d)?);
        let share = Act::alloc(pool, cq / q, vq, d)?;
        ga.all_gather(s, dout.view(), full.view(), d)?;
        let (p, wv) = (&saved.plan, saved.words.view(0, saved.plan.words() * 4)?);
        vocab_embedding_backward(dev, s, full.input(), p, wv, dtable.view(), cq, false, d)?;
        // [V/q, C/q] → [C/q, V/q]
        let t = Heads::new(1, vq, cq, 1);
        heads_split(dev, s, t, dtable.input(), dwt.view(), d)?;
        gw.reduce_scatter(s, dwt.view(), share.view(), d, ReduceOp::Sum)?;
        g.accumulate_grad(0, share.view(), d)
    }
}
