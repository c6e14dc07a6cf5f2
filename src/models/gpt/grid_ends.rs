//! The ends of a [`GptGrid`](super::GptGrid): the token and position embeddings, `ln_f` and
//! the LM head tied to `wte`, split over the grid like the blocks or whole on every rank.

use super::model::{default_init, IGNORE_INDEX};
use super::split_ends::{
    Over, Place, SplitEmbKept, SplitEmbedding, SplitHead, SplitHeadKept, CUBE,
};
use super::GptConfig;
use crate::error::{Error, Result};
use crate::nn::{Act, EmbSaved, Embedding, LayerNorm, LmHead, LmSaved, LnSaved, WeightUse};
use crate::parallel::{
    gather_3d, gather_batch_2d, split_3d, split_batch_2d_act, ProcessGrid, TensorMode,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore, Pass, PassKind};
use crate::tensor::TensorId;

/// How a [`GptGrid`](super::GptGrid) holds its ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EndsLayout {
    /// Split over the grid: `wte` by vocabulary and channels (tied to a vocab-parallel head
    /// with the cross-entropy over the split vocabulary), `wpe` and `ln_f` by the blocks'
    /// layout. The vocabulary must split by `q` (pad it, as GPT-2's 50257 to 50304) and the
    /// positions by `q` (2D, 2.5D) or the channels and positions by `q²` (3D).
    #[default]
    Split,
    /// Whole on every rank: the embedding's output cut into the rank's tile, the last block's
    /// tiles gathered for `ln_f` and the head. Any vocabulary.
    Whole,
}

/// The ends of a [`GptGrid`](super::GptGrid), in one of the [`EndsLayout`]s.
// a model holds one: the split variant's size costs nothing
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum GridEnds {
    /// Whole on every rank.
    Whole {
        /// `wte` and `wpe`.
        embedding: Embedding,
        /// `ln_f`.
        ln_f: LayerNorm,
        /// The head over `wte`.
        head: LmHead,
    },
    /// Split over the 2D or 2.5D grid ([`SplitEmbedding::Summa`], [`SplitHead::Summa`]) or
    /// the 3D cube ([`SplitEmbedding::Cube`], [`SplitHead::Cube`]), the head tied to the
    /// embedding's `wte`.
    Split {
        /// `wte` and `wpe`.
        embedding: SplitEmbedding,
        /// `ln_f` and the head.
        head: SplitHead,
    },
}

/// What the embedding keeps for its backward (one a micro-batch in flight: its size is no
/// matter).
#[allow(clippy::large_enum_variant)]
pub(super) enum EmbKept {
    Whole(EmbSaved),
    Split(SplitEmbKept),
}

/// What `ln_f` and the head keep for their backward.
pub(super) enum HeadKept {
    Whole(LnSaved, LmSaved),
    Split(SplitHeadKept),
}

fn mismatch() -> Error {
    Error::InvalidArgument("the ends' saved state of another layout".into())
}

impl GridEnds {
    /// Registers this rank's part of the ends with [`Gpt::register`](super::Gpt::register)'s
    /// masters for `seed`, and sets the norm shares of what is replicated.
    pub(super) fn register(
        store: &mut impl ParamStore,
        grid: &ProcessGrid,
        cfg: &GptConfig,
        seed: u64,
        layout: EndsLayout,
    ) -> Result<GridEnds> {
        let init = |name: &str| default_init(cfg, name, seed);
        let (c, v, t) = (cfg.channels, cfg.vocab, cfg.max_seq);
        let mode = grid.spec().tensor;
        if !matches!(
            mode,
            TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. } | TensorMode::ThreeD { .. }
        ) {
            return Err(Error::InvalidArgument(format!(
                "GptGrid runs on a 2D, 2.5D or 3D grid; this one is {mode}"
            )));
        }
        let ends = match layout {
            EndsLayout::Whole => {
                let wte = store.register("wte.weight", &[v, c], init("wte.weight"))?;
                let wpe = store.register("wpe.weight", &[t, c], init("wpe.weight"))?;
                let ln_f = LayerNorm {
                    gamma: store.register("ln_f.weight", &[c], init("ln_f.weight"))?,
                    beta: store.register("ln_f.bias", &[c], init("ln_f.bias"))?,
                    cols: c,
                    eps: cfg.eps,
                };
                let share = 1.0 / mode.size() as f64;
                for id in [wte, wpe, ln_f.gamma, ln_f.beta] {
                    store.set_norm_share(id, share)?;
                }
                let embedding = Embedding {
                    wte,
                    wpe,
                    vocab: v,
                    max_seq: t,
                    channels: c,
                };
                GridEnds::Whole {
                    embedding,
                    ln_f,
                    head: LmHead::tied(&*store, wte, IGNORE_INDEX)?,
                }
            }
            EndsLayout::Split => {
                let place = Place::Grid(grid);
                let embedding = SplitEmbedding::register(store, cfg, seed, place, WeightUse::Once)?;
                let head = SplitHead::register(store, cfg, seed, place, Some(&embedding))?;
                GridEnds::Split { embedding, head }
            }
        };
        Ok(ends)
    }

    /// The rank's tile of the embedding of the batch (`tokens`, `[batch·seq]`, the same on
    /// every rank): the first block's input.
    /// `first` is the position of the tokens' first column in their sequences (a sequence
    /// ring's block).
    pub(super) fn embed(
        &self,
        fwd: &ForwardPass<'_>,
        grid: &ProcessGrid,
        tokens: &[i32],
        [batch, seq, first]: [usize; 3],
    ) -> Result<(Act, EmbKept)> {
        match self {
            GridEnds::Whole { embedding, .. } => {
                let (x, saved) = embedding.forward_at(fwd, tokens, batch, seq, first)?;
                Ok((split(fwd, grid, &x)?, EmbKept::Whole(saved)))
            }
            GridEnds::Split { embedding, .. } => {
                let over = Over::Grid(grid);
                let (x, kept) = embedding.forward(fwd, over, tokens, [batch, seq, first])?;
                Ok((x, EmbKept::Split(kept)))
            }
        }
    }

    /// `ln_f` and the head on the last block's tile: the mean loss over the whole batch
    /// (`targets`, the same on every rank), the gradient kept scaled by `loss_scale`.
    pub(super) fn head_forward(
        &self,
        fwd: &ForwardPass<'_>,
        grid: &ProcessGrid,
        tile: &Act,
        targets: &[i32],
        loss_scale: f32,
    ) -> Result<(f32, HeadKept)> {
        match self {
            GridEnds::Whole { ln_f, head, .. } => {
                let full = gather(fwd, grid, tile)?;
                let (h, ln) = ln_f.forward(fwd, &full, None)?;
                drop(full);
                let (loss, hs) = head.forward_scaled(fwd, &h, targets, loss_scale)?;
                Ok((loss, HeadKept::Whole(ln, hs)))
            }
            GridEnds::Split { head, .. } => {
                let over = Over::Grid(grid);
                let (loss, kept) = head.forward(fwd, over, tile, targets, loss_scale)?;
                Ok((loss, HeadKept::Split(kept)))
            }
        }
    }

    /// The gradient of the last block's tile.
    pub(super) fn head_backward(
        &self,
        bwd: &BackwardPass<'_>,
        grid: &ProcessGrid,
        kept: HeadKept,
    ) -> Result<Act> {
        match (self, kept) {
            (GridEnds::Whole { ln_f, head, .. }, HeadKept::Whole(ln, hs)) => {
                let dh = head.backward(bwd, &hs)?;
                drop(hs);
                let dfull = ln_f.backward(bwd, &ln, &dh, None)?;
                drop((dh, ln));
                split(bwd, grid, &dfull)
            }
            (GridEnds::Split { head, .. }, HeadKept::Split(kept)) => {
                head.backward(bwd, Over::Grid(grid), kept)
            }
            _ => Err(mismatch()),
        }
    }

    /// The embeddings' gradients from the first block's input gradient `dtile`.
    pub(super) fn embed_backward(
        &self,
        bwd: &BackwardPass<'_>,
        grid: &ProcessGrid,
        kept: EmbKept,
        dtile: &Act,
    ) -> Result<()> {
        match (self, kept) {
            (GridEnds::Whole { embedding, .. }, EmbKept::Whole(s)) => {
                let dx = gather(bwd, grid, dtile)?;
                embedding.backward(bwd, &s, &dx)
            }
            (GridEnds::Split { embedding, .. }, EmbKept::Split(kept)) => {
                embedding.backward(bwd, Over::Grid(grid), kept, dtile)
            }
            _ => Err(mismatch()),
        }
    }

    /// The ends' parameters on this rank.
    pub fn params(&self) -> Vec<TensorId> {
        match self {
            GridEnds::Whole {
                embedding, ln_f, ..
            } => {
                vec![embedding.wte, embedding.wpe, ln_f.gamma, ln_f.beta]
            }
            GridEnds::Split { embedding, head } => {
                let mut v = embedding.params();
                v.extend(head.ln_f());
                v
            }
        }
    }
}

/// This rank's tile of a whole `[N, C]` activation (no collective).
pub(super) fn split<K: PassKind>(
    pass: &Pass<'_, K>,
    grid: &ProcessGrid,
    full: &Act,
) -> Result<Act> {
    match grid.spec().tensor {
        TensorMode::ThreeD { .. } => split_3d(pass, grid, CUBE, full),
        _ => split_batch_2d_act(pass.pool(), pass.stream(), grid, full),
    }
}

/// The whole `[N, C]` activation from every rank's tile.
pub(super) fn gather<K: PassKind>(
    pass: &Pass<'_, K>,
    grid: &ProcessGrid,
    tile: &Act,
) -> Result<Act> {
    match grid.spec().tensor {
        TensorMode::ThreeD { .. } => gather_3d(pass, grid, CUBE, tile),
        _ => gather_batch_2d(pass.pool(), pass.stream(), grid, tile),
    }
}
