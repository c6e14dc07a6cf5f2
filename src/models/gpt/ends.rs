//! The two ends of a GPT: the token and position embedding (on the first stage) and `ln_f`
//! with the LM head tied to `wte` (on the last), whole on every rank or split over the tensor
//! group like the blocks ([`EndsLayout`]).

use super::split_ends::{Over, SplitEmbKept, SplitEmbedding, SplitHead, SplitHeadKept, CUBE};
use crate::device::PoolBlock;
use crate::error::{Error, Result};
use crate::nn::{
    Act, Embedding, EmbeddingSaved, LayerNorm, LayerNormSaved, LmHead, LmHeadSaved, Loss,
};
use crate::parallel::{gather_3d, gather_batch_2d, split_3d, split_batch_2d_act};
use crate::parallel::{ProcessGrid, TensorMode};
use crate::store::{BackwardPass, ForwardPass, Pass, PassKind};
use crate::tensor::TensorId;

/// How a model split over a tensor-parallel group holds its ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EndsLayout {
    /// Split over the tensor group: on a 1D group `wte`'s rows (the tied head's cross-entropy
    /// over the whole vocabulary), `wpe` and `ln_f` whole; on a 2D, 2.5D or 3D grid `wte` by
    /// vocabulary and channels, `wpe` and `ln_f` in the blocks' layout. On a grid the
    /// vocabulary and the positions must split by `q` and the channels by `q²` (pad the
    /// vocabulary, as GPT-2's 50257 to 50304).
    #[default]
    Split,
    /// Whole on every rank: on a grid the embedding's output cut into the rank's tile, the
    /// last block's tiles gathered for `ln_f` and the head. Any vocabulary.
    Whole,
}

/// The ends a model (or a pipeline stage) holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Ends {
    pub(super) embedding: Option<Embed>,
    pub(super) head: Option<Head>,
}

/// The embedding: `wte` and `wpe`.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Embed {
    Whole(Embedding),
    Split(SplitEmbedding),
}

/// `ln_f` and the head over a copy of `wte`.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Head {
    Whole { ln_f: LayerNorm, head: LmHead },
    Split(SplitHead),
}

/// What the embedding keeps for its backward.
#[allow(clippy::large_enum_variant)]
pub(super) enum EmbKept {
    Whole(EmbeddingSaved),
    Split(SplitEmbKept),
}

/// What `ln_f` and the head keep for their backward.
pub(super) enum HeadKept {
    Whole(LayerNormSaved, LmHeadSaved),
    Split(SplitHeadKept),
}

/// Where the ends run: the group split ends run over, and the grid whose tiles whole ends cut
/// their activations into (none when the blocks' activations are whole).
#[derive(Clone, Copy)]
pub(super) struct At<'a> {
    pub(super) over: Option<Over<'a>>,
    pub(super) tiles: Option<&'a ProcessGrid>,
}

/// What happens to a tied `wte`'s gradient share: added to the store as it comes, or handed
/// to `keep` (a pipeline's end stages sum their shares over the step apart from the slot).
pub(super) type Keep<'a> = Option<&'a dyn Fn(&BackwardPass<'_>, &PoolBlock) -> Result<()>>;

/// The ends' saved state of another layout, or run elsewhere.
fn mismatch() -> Error {
    Error::SavedMismatch {
        layer: "the GPT ends".into(),
    }
}

impl At<'_> {
    fn over(&self) -> Result<Over<'_>> {
        self.over.ok_or_else(|| Error::WrongPlace {
            what: "a GPT's split ends",
            registered: "split over the tensor group".into(),
            run: "without it".into(),
        })
    }

    /// This rank's tile of a whole activation (itself when the blocks' are whole).
    fn to_tile<K: PassKind>(self, pass: &Pass<'_, K>, full: Act) -> Result<Act> {
        match self.tiles {
            None => Ok(full),
            Some(grid) => split(pass, grid, &full),
        }
    }

    /// The whole activation from every rank's tile (itself when the blocks' are whole).
    fn to_full<K: PassKind>(self, pass: &Pass<'_, K>, tile: Act) -> Result<Act> {
        match self.tiles {
            None => Ok(tile),
            Some(grid) => gather(pass, grid, &tile),
        }
    }
}

impl Ends {
    /// Whether the ends are split over the tensor group.
    pub(super) fn split(&self) -> bool {
        matches!(self.embedding, Some(Embed::Split(_))) || matches!(self.head, Some(Head::Split(_)))
    }

    /// The embedding's parameters and the head's (`ln_f`'s, then its `wte`), in the order
    /// the forward fetches them.
    pub(super) fn params(&self) -> (Vec<TensorId>, Vec<TensorId>) {
        let first = match &self.embedding {
            Some(Embed::Whole(e)) => vec![e.wte, e.wpe],
            Some(Embed::Split(e)) => e.params(),
            None => Vec::new(),
        };
        let last = match &self.head {
            Some(Head::Whole { ln_f, head }) => vec![ln_f.gamma, ln_f.beta, head.proj.weight],
            Some(Head::Split(h)) => {
                let mut v = h.ln_f().to_vec();
                v.push(h.wte());
                v
            }
            None => Vec::new(),
        };
        (first, last)
    }

    /// This end's copy of `wte` (its shard, split): the embedding's, else the head's.
    pub(super) fn wte(&self) -> Option<TensorId> {
        let first = self.embedding.as_ref().map(|e| match e {
            Embed::Whole(e) => e.wte,
            Embed::Split(e) => e.wte(),
        });
        first.or_else(|| {
            self.head.as_ref().map(|h| match h {
                Head::Whole { head, .. } => head.proj.weight,
                Head::Split(h) => h.wte(),
            })
        })
    }

    /// The embedding of `tokens` at positions `first .. first + seq` of their sequences, in
    /// the blocks' layout.
    pub(super) fn embed(
        &self,
        fwd: &ForwardPass<'_>,
        at: At<'_>,
        tokens: &[i32],
        [batch, seq, first]: [usize; 3],
    ) -> Result<(Act, EmbKept)> {
        match &self.embedding {
            Some(Embed::Whole(e)) => {
                let (x, s) = e.forward_at(fwd, tokens, batch, seq, first)?;
                Ok((at.to_tile(fwd, x)?, EmbKept::Whole(s)))
            }
            Some(Embed::Split(e)) => {
                let (x, s) = e.forward(fwd, at.over()?, tokens, [batch, seq, first])?;
                Ok((x, EmbKept::Split(s)))
            }
            None => Err(Error::WrongPlace {
                what: "a GPT's embedding",
                registered: "on the first pipeline stage".into(),
                run: "on a stage that holds none".into(),
            }),
        }
    }

    /// `ln_f` and the head on the last block's output: the mean loss over the batch, the
    /// loss gradient kept scaled by `scale`.
    pub(super) fn head_forward(
        &self,
        fwd: &ForwardPass<'_>,
        at: At<'_>,
        x: Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(Loss, HeadKept)> {
        match &self.head {
            Some(Head::Whole { ln_f, head }) => {
                let full = at.to_full(fwd, x)?;
                let (h, ln) = ln_f.forward(fwd, &full, None)?;
                drop(full);
                let (loss, hs) = head.forward_deferred(fwd, &h, targets, scale)?;
                Ok((loss, HeadKept::Whole(ln, hs)))
            }
            Some(Head::Split(h)) => {
                let (loss, k) = h.forward(fwd, at.over()?, &x, targets, scale)?;
                Ok((Loss::ready(loss), HeadKept::Split(k)))
            }
            None => Err(Error::WrongPlace {
                what: "a GPT's head",
                registered: "on the last pipeline stage".into(),
                run: "on a stage that holds none".into(),
            }),
        }
    }

    /// The gradient of the last block's output, from what the head kept; `wte`'s share as
    /// `keep` says.
    pub(super) fn head_backward(
        &self,
        bwd: &BackwardPass<'_>,
        at: At<'_>,
        kept: HeadKept,
        keep: Keep<'_>,
    ) -> Result<Act> {
        match (&self.head, kept) {
            (Some(Head::Whole { ln_f, head }), HeadKept::Whole(ln, hs)) => {
                let dh = match keep {
                    Some(keep) => {
                        let (dh, share) = head.backward_returning(bwd, &hs)?;
                        keep(bwd, &share)?;
                        dh
                    }
                    None => head.backward(bwd, &hs)?,
                };
                drop(hs);
                let dfull = ln_f.backward(bwd, &ln, &dh, None)?;
                drop((dh, ln));
                at.to_tile(bwd, dfull)
            }
            // the split head adds its share of wte's gradient to the store's sum
            (Some(Head::Split(h)), HeadKept::Split(k)) => h.backward(bwd, at.over()?, k),
            _ => Err(mismatch()),
        }
    }

    /// The embeddings' gradients from the first block's input gradient `dx`; `wte`'s share
    /// as `keep` says.
    pub(super) fn embed_backward(
        &self,
        bwd: &BackwardPass<'_>,
        at: At<'_>,
        kept: EmbKept,
        dx: Act,
        keep: Keep<'_>,
    ) -> Result<()> {
        match (&self.embedding, kept) {
            (Some(Embed::Whole(e)), EmbKept::Whole(s)) => {
                let dfull = at.to_full(bwd, dx)?;
                match keep {
                    Some(keep) => keep(bwd, &e.backward_returning(bwd, &s, &dfull)?),
                    None => e.backward(bwd, &s, &dfull),
                }
            }
            (Some(Embed::Split(e)), EmbKept::Split(k)) => e.backward(bwd, at.over()?, k, &dx),
            _ => Err(mismatch()),
        }
    }
}

/// This rank's tile of a whole `[N, C]` activation (no collective).
fn split<K: PassKind>(pass: &Pass<'_, K>, grid: &ProcessGrid, full: &Act) -> Result<Act> {
    match grid.spec().tensor {
        TensorMode::ThreeD { .. } => split_3d(pass, grid, CUBE, full),
        _ => split_batch_2d_act(pass.pool(), pass.stream(), grid, full),
    }
}

/// The whole `[N, C]` activation from every rank's tile.
fn gather<K: PassKind>(pass: &Pass<'_, K>, grid: &ProcessGrid, tile: &Act) -> Result<Act> {
    match grid.spec().tensor {
        TensorMode::ThreeD { .. } => gather_3d(pass, grid, CUBE, tile),
        _ => gather_batch_2d(pass.pool(), pass.stream(), grid, tile),
    }
}
