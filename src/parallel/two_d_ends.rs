mod classifier;
mod cost;
mod vocab;

pub use classifier::{Classifier2D, Classifier2DSaved};
pub use vocab::{VocabEmbedding2D, VocabEmbedding2DSaved};

use super::two_d::{remap, split};
use super::{Cost, Place2D, ProcessGrid, TensorMode};
use crate::comm::{Communicator, ReduceOp};
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Act, WeightUse};
use crate::ops::{vocab_embedding_backward, vocab_embedding_forward, VocabPlan, VocabShard};
use crate::parallel::GridLookup;
use crate::store::{BackwardPass, ForwardPass, Guard, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

/// The grid's mode and this rank's place, for layer `layer` named `name`; an error on a grid
/// that is neither 2D nor 2.5D.
fn place_of(layer: &str, name: &str, grid: &ProcessGrid) -> Result<(TensorMode, Place2D)> {
    let mode = grid.spec().tensor;
    match mode {
        TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. } => Ok((mode, Place2D::of(grid)?)),
        other => Err(Error::Conflict {
            what: format!("{layer} '{name}'"),
            with: format!("a grid of tensor mode {other} (it runs on a 2D or 2.5D grid)"),
        }),
    }
}

/// The communicators of one call.
struct Groups<'g> {
    row: &'g Communicator,
    col: &'g Communicator,
    /// `None` in 2D and for one depth layer.
    dep: Option<&'g Communicator>,
    tensor: &'g Communicator,
}

/// The groups of `grid`, after checking that it has `mode` and that this rank is at `place`.
fn groups<'g>(
    layer: &'static str,
    mode: TensorMode,
    place: Place2D,
    grid: &'g ProcessGrid,
) -> Result<Groups<'g>> {
    let here = grid.spec().tensor;
    if here != mode {
        return Err(Error::WrongPlace {
            what: layer,
            registered: format!("on a {mode} grid"),
            run: format!("on a grid of tensor mode {here}"),
        });
    }
    let at = Place2D::of(grid)?;
    if at != place {
        return Err(Error::WrongPlace {
            what: layer,
            registered: format!("for {place:?}"),
            run: format!("at {at:?}"),
        });
    }
    Ok(Groups {
        row: grid.row()?,
        col: grid.col()?,
        dep: if place.depth > 1 {
            Some(grid.dep()?)
        } else {
            None
        },
        tensor: grid.tensor(),
    })
}

/// The tensor rank of the rank at `(row, col)` in depth layer `dep` of a `mode` grid.
fn tensor_rank(mode: TensorMode, q: usize, [row, col, dep]: [usize; 3]) -> usize {
    match mode {
        TensorMode::TwoHalfD { .. } => col + q * row + q * q * dep,
        _ => row * q + col,
    }
}

/// Checks on the host that every id of the whole batch names a row of a table of `rows`, so
/// that every rank refuses a bad one (not only those whose tile holds it):
/// [`Error::TokenOutOfRange`] otherwise.
fn check_ids(ids: &[i32], rows: usize) -> Result<()> {
    match ids.iter().position(|&t| t < 0 || t as usize >= rows) {
        None => Ok(()),
        Some(n) => Err(Error::TokenOutOfRange {
            token: ids[n].into(),
            position: n,
            vocab: rows,
        }),
    }
}

/// Checks that parameter 0 of `g` is `[rows, cols]` of `d`.
fn check_param<K: PassKind>(g: &Guard<'_, K>, shape: [usize; 2], d: DType) -> Result<()> {
    let p = g.param(0)?;
    if p.shape() != shape || p.dtype() != d {
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

/// The ends of a model on the 2D (SUMMA / Optimus) and 2.5D (Tesseract) layouts: the
/// embeddings that make the first activation blocks from token ids and the classifier (or LM
/// head) that turns the last ones into a loss. Every layer runs on both schemes (a 2.5D grid
/// of one depth layer gives the 2D results bit for bit).
///
/// # Layouts
///
/// Activations are the linears' (see [`two_d`](crate::parallel::Linear2D)): the rank at
/// `(i, j)` = `(row, col)` (depth `dep` in 2.5D) holds the tile `[N/(d·q), C/q]`, row block
/// `i + q·dep` of `d·q` (`d = 1` in 2D) and column block `j` of the full `[N, C]`
/// ([`BatchBlock`]). The ids and the targets are the whole batch's `N`, the same on every rank.
///
/// - [`Embedding2D`] (positions, or a vocabulary not split as such): a table `[rows, C]`; the
///   rank registers `{name}.weight` `[rows/q, C/q]` = `table[i·rows/q .., j·C/q ..]`,
///   replicated over depth (norm share `1/d`).
/// - [`VocabEmbedding2D`] (tied to the head): `wte` `[V, C]`; the rank registers
///   `{name}.weight` `[V/q, C/q]` = `wte[j·V/q .., i·C/q ..]` (vocabulary block `j`, channel
///   block `i`), replicated over depth — exactly [`Linear2D`]'s shard of the master
///   `[outputs = V, inputs = C]`, so the tied head is the 2D linear on the same tensor. `V` and
///   `C` must divide by `q`; a vocabulary that does not is padded by the user (GPT-2's 50257
///   tokens to 50304, the extra rows never named by an id nor a target).
/// - [`Classifier2D`]: a [`SummaLinear`] `C → classes` (classes split by `q`, and by `q²` with
///   a bias), or the head tied to a [`VocabEmbedding2D`]: the logits tile is row block
///   `i + q·dep`, class block `j`.
///
/// # Algorithms (every collective on the pass's stream)
///
/// - [`Embedding2D`]: forward all-gathers the table's column block `j` in COL
///   (`[rows, C/q]`) and looks up the tile's ids; backward scatters the tile gradient into a
///   `[rows, C/q]` buffer, reduce-scatters it in COL (rank `i` keeps row piece `i`),
///   all-reduces it over DEP (`d > 1`) and writes the gradient slot.
/// - [`VocabEmbedding2D`]: forward is the masked lookup of the depth layer's `N/d` ids in
///   vocabulary block `j` (`[N/d, C/q]`, channel block `i`, a partial sum over the vocabulary
///   blocks), reduce-scattered in ROW: rank `(i, j)` then holds row block `j` of the depth layer
///   in channel block `i`, the tile of rank `(j, i)`, and swaps it with that rank (one
///   `send_recv` over the tensor group; the diagonal copies). Backward mirrors it: the tile
///   gradient swapped with `(j, i)`, all-gathered in ROW, scattered into `[V/q, C/q]`,
///   all-reduced over DEP (`d > 1`) and added as a share
///   ([`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad)): the tied head adds the
///   other.
/// - [`Classifier2D`]: the linear's forward, then [`ShardedCrossEntropy`] over ROW (the ranks
///   that hold the other class blocks of the same rows); the loss is the mean over the whole
///   batch's counted rows: the ranks of column 0 add their tiles' sums in one f64 all-reduce
///   over the tensor group. Backward is the linear's (a share of the weight gradient when
///   tied).
///
/// Each layer's `collectives` gives the calls and bytes per group (ROW, COL, DEP and the
/// tensor group's `send_recv` and loss), forward and backward; they are exact. Shapes that do
/// not split are [`Error::NotSplit`] naming the dimension, at registration and before any
/// collective, on every rank; a grid of another mode is [`Error::Conflict`], and a layer run at
/// a place it was not registered for [`Error::WrongPlace`].
///
/// ```
/// use tidemem::comm::Communicator;
/// use tidemem::parallel::{Classifier2D, GridSpec, ProcessGrid, TensorMode, VocabEmbedding2D};
/// use tidemem::parallel::{GridClassifier, GridLookup};
/// use tidemem::prelude::*;
/// # fn main() -> tidemem::Result<()> {
/// let devices = (0..4)
///     .map(|_| Device::sim(SimConfig::with_capacity(1 << 22)))
///     .collect::<tidemem::Result<Vec<_>>>()?;
/// let comms = Communicator::local(devices)?;
/// let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::TwoD { q: 2 } };
/// let (vocab, c) = (16, 8);
/// let ids: Vec<i32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
/// let targets: Vec<i32> = vec![1, 4, 1, 5, 9, 2, 6, -100];
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms
///         .iter()
///         .map(|comm| {
///             let (ids, targets) = (&ids, &targets);
///             s.spawn(move || -> tidemem::Result<f32> {
///                 let grid = ProcessGrid::new(comm, spec)?;
///                 let cfg = ManagerConfig::new(1 << 10, Policy::Tide);
///                 let mut m = ChunkManager::new(comm.device().clone(), cfg)?;
///                 let init = Init::Uniform { seed: 1, lo: -0.5, hi: 0.5 };
///                 let wte = VocabEmbedding2D::register(&mut m, &grid, "wte", vocab, c, &init)?;
///                 let head = Classifier2D::tied(&m, &wte, -100)?;
///                 let fwd = m.forward()?;
///                 let (x, emb) = wte.forward(&fwd, &grid, ids)?;
///                 assert_eq!(x.shape(), [4, 4]); // this rank's tile [N/q, C/q]
///                 let (loss, saved) = head.forward(&fwd, &grid, &x, targets, 1.0)?;
///                 drop(x);
///                 fwd.finish()?;
///                 let bwd = m.backward()?;
///                 let dx = head.backward(&bwd, &grid, &saved)?;
///                 wte.backward(&bwd, &grid, &emb, &dx)?;
///                 drop((dx, saved));
///                 bwd.finish()?;
///                 Ok(loss)
///             })
///         })
///         .collect();
///     let losses = ranks
///         .into_iter()
///         .map(|h| h.join().expect("rank panicked"))
///         .collect::<tidemem::Result<Vec<f32>>>()?;
///     assert!(losses.iter().all(|&l| l == losses[0])); // the same mean on every rank
///     Ok::<(), tidemem::Error>(())
/// })?;
/// # Ok(()) }
/// ```
///
/// [`Linear2D`]: crate::parallel::Linear2D
/// [`SummaLinear`]: crate::parallel::SummaLinear
/// [`ShardedCrossEntropy`]: crate::parallel::ShardedCrossEntropy
/// [`BatchBlock`]: crate::parallel::BatchBlock
///
/// An embedding table `[rows, C]` on the 2D / 2.5D layout, looked up into the rank's tile
/// (see [`Embedding2D`]): positions, or a vocabulary whose rows are split as a plain table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding2D {
    /// This rank's piece `[rows/q, C/q]` = `table[row·rows/q .., col·C/q ..]`.
    pub weight: TensorId,
    /// The table's rows (ids `0..rows`).
    pub rows: usize,
    /// `C`.
    pub channels: usize,
    /// The grid's mode it was registered on.
    pub mode: TensorMode,
    /// This rank's place.
    pub place: Place2D,
    /// How backward writes the piece's gradient: into its slot ([`WeightUse::Once`], as
    /// registered), or as a share ([`WeightUse::Shared`]: a table looked up more than once an
    /// iteration, as by a pipeline stage's micro-batches).
    pub uses: WeightUse,
}

/// What [`Embedding2D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct Embedding2DSaved {
    plan: VocabPlan,
    words: PoolBlock,
}

impl Embedding2D {
    /// Registers this rank's piece of table `name` (`{name}.weight` `[rows/q, channels/q]`,
    /// the values of the master `[rows, channels]` that `init` gives element by element,
    /// row-major) on a 2D or 2.5D grid; in 2.5D with `d > 1` its norm share is `1/d` (every
    /// depth layer holds it). Fails on another grid and when `rows` or `channels` do not split
    /// by `q`, naming the dimension.
    pub fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        name: &str,
        rows: usize,
        channels: usize,
        init: &Init,
    ) -> Result<Embedding2D> {
        let (mode, place) = place_of("Embedding2D", name, grid)?;
        let (q, i, j) = (place.q, place.row, place.col);
        let rows_l = split(name, "rows", rows, q, "q")?;
        let cl = split(name, "channels", channels, q, "q")?;
        VocabShard::new(rows, 0, rows)?;
        let w = remap(init, move |k| {
            (i * rows_l + k / cl) * channels + j * cl + k % cl
        });
        let weight = store.register(&format!("{name}.weight"), &[rows_l, cl], w)?;
        if place.depth > 1 {
            store.set_norm_share(weight, 1.0 / place.depth as f64)?;
        }
        Ok(Embedding2D {
            weight,
            rows,
            channels,
            mode,
            place,
            uses: WeightUse::Once,
        })
    }

    /// The same table, its gradient added as a share at each use ([`WeightUse::Shared`]).
    pub fn shared(self) -> Embedding2D {
        Embedding2D {
            uses: WeightUse::Shared,
            ..self
        }
    }

    /// The whole table as one shard.
    fn shard(&self) -> Result<VocabShard> {
        VocabShard::new(self.rows, 0, self.rows)
    }

    /// The collectives of one forward and one backward over a batch of `n` ids, elements of
    /// `dtype` (the store's parameter dtype): forward COL one all-gather of `rows·C/q·e`
    /// bytes; backward COL one reduce-scatter of `rows·C/q·e` and, for `d > 1`, DEP one
    /// all-reduce of `rows/q·C/q·e`. Fails when `n` does not split into the row blocks.
    pub fn collectives(&self, n: usize, dtype: DType) -> Result<Cost> {
        let p = self.place;
        split("batch", "ids", n, p.q * p.depth, "row blocks")?;
        let (e, cl) = (dtype.size(), self.channels / p.q);
        let mut c = Cost::default();
        c.forward.col.all_gather = cost::tally(1, self.rows * cl * e);
        c.backward.col.reduce_scatter = cost::tally(1, self.rows * cl * e);
        if p.depth > 1 {
            c.backward.dep.all_reduce = cost::tally(1, self.rows / p.q * cl * e);
        }
        Ok(c)
    }
}

impl GridLookup for Embedding2D {
    type Saved = Embedding2DSaved;

    fn params(&self) -> Vec<TensorId> {
        vec![self.weight]
    }

    /// This rank's tile `[N/(d·q), C/q]` of the lookup of `ids` (the whole batch's `N` ids,
    /// the same on every rank): one all-gather in COL. The ids, their count and the grid are
    /// checked before any collective.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        ids: &[i32],
    ) -> Result<(Act, Embedding2DSaved)> {
        let gr = groups("Embedding2D", self.mode, self.place, grid)?;
        let p = self.place;
        let nl = split("batch", "ids", ids.len(), p.q * p.depth, "row blocks")?;
        check_ids(ids, self.rows)?;
        let rb = p.row + p.q * p.dep;
        let mine = &ids[rb * nl..(rb + 1) * nl];
        let shard = self.shard()?;
        let plan = VocabPlan::new(mine, &shard)?;
        let (dev, s, pool, d) = (
            pass.device(),
            pass.stream(),
            pass.pool(),
            pass.param_dtype(),
        );
        let cl = self.channels / p.q;
        let g = pass.fetch(&[self.weight])?;
        check_param(&g, [self.rows / p.q, cl], d)?;
        let table = Act::alloc(pool, self.rows, cl, d)?;
        let piece = table.len_bytes() / p.q;
        let at = table.view().slice(p.row * piece, piece)?;
        g.param(0)?.copy_to(at)?;
        gr.col.all_gather(s, at, table.view(), d)?;
        drop(g);
        let tok = pass.upload(bytemuck::cast_slice(mine))?;
        let tile = Act::alloc(pool, nl, cl, d)?;
        let tv = tok.view(0, nl * 4)?;
        vocab_embedding_forward(dev, s, tv, table.input(), tile.view(), &shard, cl, d)?;
        let words = pass.upload(bytemuck::cast_slice(&plan.to_words()))?;
        Ok((tile, Embedding2DSaved { plan, words }))
    }

    /// Writes this rank's piece of the table's gradient from the tile's `dout`
    /// `[N/(d·q), C/q]` (into its slot, or as a share: [`Embedding2D::uses`]): one
    /// reduce-scatter in COL, one all-reduce over DEP for `d > 1`.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Embedding2DSaved,
        dout: &Act,
    ) -> Result<()> {
        let gr = groups("Embedding2D", self.mode, self.place, grid)?;
        let (dev, s, pool, d) = (
            pass.device(),
            pass.stream(),
            pass.pool(),
            pass.param_dtype(),
        );
        let cl = self.channels / self.place.q;
        dout.expect("dout", Some(saved.plan.positions()), cl, d)?;
        if saved.plan.shard() != &self.shard()? {
            return Err(Error::SavedMismatch {
                layer: "Embedding2D".into(),
            });
        }
        let g = pass.fetch(&[self.weight])?;
        check_param(&g, [self.rows / self.place.q, cl], d)?;
        let full = Act::alloc(pool, self.rows, cl, d)?;
        let wv = saved.words.view(0, saved.plan.words() * 4)?;
        let plan = &saved.plan;
        vocab_embedding_backward(dev, s, dout.input(), plan, wv, full.view(), cl, false, d)?;
        let share = match self.uses {
            WeightUse::Once => None,
            WeightUse::Shared => Some(pool.alloc(full.len_bytes() / self.place.q)?),
        };
        let slot = match &share {
            None => g.grad(0)?.view(),
            Some(b) => b.view(0, full.len_bytes() / self.place.q)?,
        };
        gr.col
            .reduce_scatter(s, full.view(), slot, d, ReduceOp::Sum)?;
        if let Some(dep) = gr.dep {
            dep.all_reduce(s, slot, slot, d, ReduceOp::Sum)?;
        }
        if share.is_some() {
            g.accumulate_grad(0, slot, d)?;
        }
        Ok(())
    }
}
