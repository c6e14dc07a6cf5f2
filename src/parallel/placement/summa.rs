//! [`Summa`]: the 2D (SUMMA) and 2.5D (Tesseract) layouts as a [`Layout`], their ends
//! included.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{by_rank_block, Act, Block, Layout, LinearOn, Pair, WeightUse};
use crate::ops::attention::Attention;
use crate::ops::heads::Heads;
use crate::parallel::ends::{check_grid_ends, OnGrid};
use crate::parallel::two_d::split;
use crate::parallel::{gather_batch_2d, split_batch_2d_act, BatchBlock, Classifier2D};
use crate::parallel::{Cost, Embedding2D, LayerNorm2D};
use crate::parallel::{Linear2D, Linear2p5D, NormHead, Place2D, ProcessGrid};
use crate::parallel::{SummaLinear, TensorMode, TokenPosition, VocabEmbedding2D};
use crate::store::{BackwardPass, ForwardPass, ParamStore, Pass, PassKind};
use crate::tensor::{Init, TensorId};

/// The 2D (SUMMA / Optimus) and 2.5D (Tesseract) layout of GPT-2's pre-LayerNorm
/// [`Block`](crate::nn::Block): [`LayerNorm2D`], [`SummaLinear`] for the four linears, and
/// [`Summa`], the [`Layout`] that runs the block on them.
///
/// # Layouts
///
/// Activations are the linears' (see [`two_d`](crate::parallel::Linear2D)): the rank at `(i, j)`
/// (depth `dep` in 2.5D) holds `X_ij` `[rows_l, C/q]`, row block `i` (2.5D: `i + q·dep` of
/// `d·q`) and column block `j` of the full `[rows, C]`. The block asks each row block to be
/// whole sequences (`rows_l` a multiple of the sequence length) and the heads `H` to split
/// over `q`: the rank's column block of the queries, keys and values is then heads
/// `j·H/q .. (j+1)·H/q`, and attention runs locally over those heads and sequences
/// ([`ops::attention`](crate::ops::attention)), with no collective.
///
/// `c_attn`'s serial output is `[q | k | v]` (each `C` wide). So that column block `j` of its
/// output is `[q_j | k_j | v_j]` (the layout the attention op reads), the 2D layer registered
/// as `{name}.attn.c_attn` is the serial one with its **output features permuted**
/// ([`by_rank_block`]): output `o' = j·3C/q + s·C/q + a` (`s` = 0 for q, 1 for k, 2 for v;
/// `a < C/q`) is serial output `s·C + j·C/q + a`. Its weight and bias shards are
/// [`Linear2D`]'s blocks of that permuted master; every other parameter is the plain 2D layout
/// of its serial tensor, under GPT-2's names.
///
/// [`LayerNorm2D::collectives`] and the block's `collectives` give the calls and bytes per
/// group (ROW, COL, DEP) of one forward and backward; they are exact. Shapes that do not
/// split are [`Error::NotSplit`] naming the dimension, at registration and before any
/// collective in the forward.
///
/// ```
/// use tidemem::comm::Communicator;
/// use tidemem::nn::{Act, Block, BlockOn};
/// use tidemem::parallel::{split_batch_2d, GridSpec, ProcessGrid, Summa, TensorMode};
/// use tidemem::prelude::*;
/// # fn main() -> tidemem::Result<()> {
/// let devices = (0..4)
///     .map(|_| Device::sim(SimConfig::with_capacity(1 << 24)))
///     .collect::<tidemem::Result<Vec<_>>>()?;
/// let comms = Communicator::local(devices)?;
/// let spec = GridSpec { data: 1, pipeline: 1, sequence: 1, tensor: TensorMode::TwoD { q: 2 } };
/// // 4 sequences of 3 tokens, 8 channels, 2 heads
/// let (rows, seq, c) = (12, 3, 8);
/// let x: Vec<f32> = (0..rows * c).map(|v| (v % 7) as f32 / 10.0).collect();
/// let init = |_: &str| Init::Uniform { seed: 1, lo: 0.1, hi: 0.5 };
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms
///         .iter()
///         .map(|comm| {
///             let (x, init) = (&x, &init);
///             s.spawn(move || -> tidemem::Result<()> {
///                 let grid = ProcessGrid::new(comm, spec)?;
///                 let mut m = ChunkManager::new(
///                     comm.device().clone(),
///                     ManagerConfig::new(1 << 12, Policy::Tide),
///                 )?;
///                 let layout = Summa::of(&grid)?;
///                 let block = Block::register(&mut m, layout, "h.0", [c, 2], 1e-5, init)?;
///                 let fwd = m.forward()?;
///                 let xb = split_batch_2d(&grid, x, rows, c)?; // X_ij: [6, 4]
///                 let d = fwd.param_dtype();
///                 let xa = Act::upload(fwd.pool(), fwd.stream(), 6, 4, d, &xb)?;
///                 let (out, saved) = block.forward(&fwd, &xa, [4, seq], None)?;
///                 assert_eq!(out.shape(), [6, 4]);
///                 drop((out, saved, xa));
///                 fwd.finish()
///             })
///         })
///         .collect();
///     ranks.into_iter().try_for_each(|h| h.join().expect("rank panicked"))
/// })?;
/// # Ok(()) }
/// ```
///
/// The 2D (SUMMA) and 2.5D (Tesseract) layout as a [`Layout`] (see [`Summa`]): the
/// rank's tiles `[rows_l, C/q]`, its linears [`SummaLinear`]s, its LayerNorms
/// [`LayerNorm2D`]s, `H/q` heads a rank attending locally over its row block's whole
/// sequences. On a 2.5D grid every parameter counts `1/d` of its gradients' squared norm (the
/// depth layers hold the same shards).
#[derive(Clone, Debug)]
pub struct Summa {
    /// The rank's place.
    pub place: Place2D,
    /// Whether the grid is 2.5D ([`Linear2p5D`]s, the batch split over depth).
    pub(crate) depth_split: bool,
    grid: ProcessGrid,
}

impl PartialEq for Summa {
    fn eq(&self, other: &Summa) -> bool {
        (self.place, self.depth_split) == (other.place, other.depth_split)
    }
}

impl Summa {
    /// The layout of `grid`'s rank; [`Error::Conflict`] on a grid that is neither 2D nor
    /// 2.5D.
    pub fn of(grid: &ProcessGrid) -> Result<Summa> {
        Ok(Summa {
            place: Place2D::of(grid)?,
            depth_split: matches!(grid.spec().tensor, TensorMode::TwoHalfD { .. }),
            grid: grid.clone(),
        })
    }

    /// Counts `1/d` of the gradient norm of `ids` on a grid of `d > 1` depth layers.
    fn share_depth(&self, store: &mut impl ParamStore, ids: &[TensorId]) -> Result<()> {
        if self.place.depth > 1 {
            for &id in ids {
                store.set_norm_share(id, 1.0 / self.place.depth as f64)?;
            }
        }
        Ok(())
    }
}

impl OnGrid for Summa {
    fn grid(&self) -> &ProcessGrid {
        &self.grid
    }
}

impl Layout for Summa {
    type Linear = SummaLinear;
    type Norm = LayerNorm2D;
    type Embedding = TokenPosition<VocabEmbedding2D, Embedding2D>;
    type Head = NormHead<LayerNorm2D, Classifier2D>;

    fn cols(&self, features: usize) -> usize {
        features / self.place.q
    }

    fn heads(&self, heads: usize) -> usize {
        heads / self.place.q
    }

    fn check_split(&self, name: &str, channels: usize, heads: usize) -> Result<()> {
        let q = self.place.q;
        split(name, "heads", heads, q, "q")?;
        split(name, "channels", channels, heads, "heads")?;
        split(name, "channels", channels, q * q, "q²")?;
        Ok(())
    }

    fn attention(
        &self,
        rows: usize,
        [_, seq]: [usize; 2],
        heads: usize,
        head_dim: usize,
    ) -> Result<Attention> {
        if seq == 0 || rows == 0 {
            return Err(Error::TooFew {
                what: format!(
                    "the smaller of a 2D block's row-block rows {rows} and sequence length {seq}"
                ),
                got: 0,
                need: 1,
            });
        }
        if !rows.is_multiple_of(seq) {
            return Err(Error::NotMultiple {
                what: "the rows of a 2D block's row block (whole sequences)",
                value: rows,
                of: "the sequence length",
                divisor: seq,
            });
        }
        Ok(Attention::new(Heads::new(rows / seq, seq, heads, head_dim)))
    }

    fn check_ends(&self, dims: [usize; 3]) -> Result<()> {
        check_grid_ends(self.place.q, dims)
    }

    fn wte_share(&self) -> f64 {
        1.0 / self.place.depth.max(1) as f64
    }

    fn register_embedding<S: ParamStore>(
        &self,
        store: &mut S,
        [v, t, c]: [usize; 3],
        [te, pe]: [&Init; 2],
        uses: WeightUse,
    ) -> Result<Self::Embedding> {
        let grid = &self.grid;
        let wte = VocabEmbedding2D::register(store, grid, "wte", v, c, te)?;
        let wpe = Embedding2D::register(store, grid, "wpe", t, c, pe)?;
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
                own = VocabEmbedding2D::register(store, &self.grid, "wte", v, c, te)?;
                &own
            }
        };
        // γ and β are the same in every depth layer
        let ln_f = self.register_norm(store, "ln_f", c, eps, [g, b])?;
        let head = Classifier2D::tied(&*store, wte, ignore)?;
        Ok(NormHead { ln_f, head })
    }

    fn to_tile<K: PassKind>(&self, pass: &Pass<'_, K>, full: Act) -> Result<Act> {
        split_batch_2d_act(pass.pool(), pass.stream(), &self.grid, &full)
    }

    fn to_full<K: PassKind>(&self, pass: &Pass<'_, K>, part: Act) -> Result<Act> {
        gather_batch_2d(pass.pool(), pass.stream(), &self.grid, &part)
    }

    fn tile_shape(&self, [rows, cols]: [usize; 2]) -> Result<[usize; 2]> {
        BatchBlock::of(&self.grid)?.shape(rows, cols)
    }

    fn register_norm<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        features: usize,
        eps: f32,
        init: [&Init; 2],
    ) -> Result<LayerNorm2D> {
        let ln = LayerNorm2D::register_at(store, self.place, name, features, eps, init)?;
        self.share_depth(store, &[ln.gamma, ln.beta])?;
        Ok(ln)
    }

    fn register_linear<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        io: [usize; 2],
        pair: Pair,
        [w, b]: [&Init; 2],
    ) -> Result<SummaLinear> {
        let parts = match pair {
            Pair::Column { parts } => parts,
            Pair::Row => 1,
        };
        let (q, out) = (self.place.q, io[1]);
        let w = by_rank_block(w, io, parts, q);
        let b = by_rank_block(b, [1, out], parts, q);
        let l = register_at(store, self, name, io, &w, Some(&b))?;
        self.share_depth(store, &l.params())?;
        Ok(l)
    }
}

/// Registers layer `name` at `summa`'s place, as [`SummaLinear::register`].
fn register_at(
    store: &mut impl ParamStore,
    summa: &Summa,
    name: &str,
    io: [usize; 2],
    weight: &Init,
    bias: Option<&Init>,
) -> Result<SummaLinear> {
    let p = summa.place;
    let slice = Linear2D::register_at(store, name, io, [p.q, p.row, p.col], weight, bias)?;
    Ok(match summa.depth_split {
        true => SummaLinear::TwoHalfD(Linear2p5D {
            slice,
            depth: p.depth,
            dep: p.dep,
        }),
        false => SummaLinear::TwoD(slice),
    })
}

impl Block<Summa> {
    /// The collectives of one forward and one backward of the block over a full batch of
    /// `rows` rows of `dtype`: the sum of its two LayerNorms' and four linears' (the attention
    /// itself is local). Fails when `rows` does not split into the row blocks.
    pub fn collectives(&self, rows: usize, dtype: DType) -> Result<Cost> {
        let mut sum = self.ln_1.collectives(rows, dtype)?;
        sum += self.ln_2.collectives(rows, dtype)?;
        for l in [self.c_attn, self.attn_proj, self.c_fc, self.mlp_proj] {
            sum += l.collectives(rows, dtype)?;
        }
        Ok(sum)
    }
}

impl LinearOn<Summa> for SummaLinear {
    type Saved = Act;

    fn params(&self) -> Vec<TensorId> {
        SummaLinear::params(self)
    }

    fn forward_on(&self, layout: &Summa, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, Act)> {
        Ok((self.forward(pass, &layout.grid, x)?, x.clone()))
    }

    fn backward_on(
        &self,
        layout: &Summa,
        pass: &BackwardPass<'_>,
        x: &Act,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act> {
        match uses {
            WeightUse::Once => self.backward(pass, &layout.grid, x, dy),
            WeightUse::Shared => self.backward_shared(pass, &layout.grid, x, dy),
        }
    }
}
