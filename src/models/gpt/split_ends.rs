//! GPT-2's ends split over a tensor-parallel group, as a [`Gpt`](super::Gpt) (or its end
//! stages, in a pipeline) holds them with [`EndsLayout::Split`](super::EndsLayout): the embedding
//! ([`SplitEmbedding`]: `wte` by vocabulary, `wpe` in the blocks' layout) and the head
//! ([`SplitHead`]: `ln_f` in the blocks' layout, the vocab-parallel head tied to a `wte` shard,
//! the cross-entropy over the split vocabulary). Over a 1D group the blocks' activations are
//! whole on every rank, so `wpe` and `ln_f` are whole too; on a 2D, 2.5D or 3D grid they are
//! tiles.

use super::config::IGNORE_INDEX;
use super::GptConfig;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nn::{Act, LayerNorm, LayerNormSaved, WeightUse};
use crate::ops::{add_in_place, Axpby};
use crate::parallel::{
    Classifier2D, Classifier2DSaved, Classifier3D, Classifier3DSaved, Embedding2D,
    Embedding2DSaved, Embedding3D, Embedding3DSaved, LayerNorm2D, LayerNorm2DSaved, LayerNorm3D,
    LayerNorm3DSaved, Layout3D, ProcessGrid, Shard, TensorMode, VocabEmbedding1D,
    VocabEmbedding1DSaved, VocabEmbedding2D, VocabEmbedding2DSaved, VocabEmbedding3D,
    VocabEmbedding3DSaved, VocabHead1D, VocabHead1DSaved,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// The token and position embeddings split over a tensor-parallel group.
#[derive(Clone, Debug, PartialEq)]
pub enum SplitEmbedding {
    /// Over a 1D group: `wte`'s rows split, `wpe` whole on every rank.
    OneD(VocabEmbedding1D),
    /// Over a 2D or 2.5D grid.
    Summa {
        /// `wte`, split by vocabulary and channels.
        wte: VocabEmbedding2D,
        /// `wpe`, split like a table.
        wpe: Embedding2D,
    },
    /// Over a 3D cube (the blocks' layout [`Layout3D::RowsJColsK`]).
    Cube {
        /// `wte`, split by vocabulary and channels.
        wte: VocabEmbedding3D,
        /// `wpe`, split like a table.
        wpe: Embedding3D,
    },
}

/// `ln_f` and the vocab-parallel head tied to a `wte` shard, split over a tensor-parallel
/// group.
#[derive(Clone, Debug, PartialEq)]
pub enum SplitHead {
    /// Over a 1D group: `ln_f` whole on every rank.
    OneD {
        /// `ln_f`.
        ln_f: LayerNorm,
        /// The head over the rank's `wte` rows.
        head: VocabHead1D,
    },
    /// Over a 2D or 2.5D grid.
    Summa {
        /// `ln_f`.
        ln_f: LayerNorm2D,
        /// The vocab-parallel head.
        head: Classifier2D,
    },
    /// Over a 3D cube.
    Cube {
        /// `ln_f`.
        ln_f: LayerNorm3D,
        /// The vocab-parallel head.
        head: Classifier3D,
    },
}

/// Where a rank's split ends are registered: its place in a 1D group, or a grid.
#[derive(Clone, Copy, Debug)]
pub(super) enum Place<'a> {
    OneD(Shard),
    Grid(&'a ProcessGrid),
}

/// The group the split ends run over.
#[derive(Clone, Copy, Debug)]
pub(super) enum Over<'a> {
    OneD(&'a Communicator),
    Grid(&'a ProcessGrid),
}

/// What the split embedding keeps for its backward.
pub(super) enum SplitEmbKept {
    OneD(Box<VocabEmbedding1DSaved>),
    Summa(VocabEmbedding2DSaved, Embedding2DSaved),
    Cube(VocabEmbedding3DSaved, Embedding3DSaved),
}

/// What the split `ln_f` and head keep for their backward.
pub(super) enum SplitHeadKept {
    OneD(LayerNormSaved, VocabHead1DSaved),
    Summa(LayerNorm2DSaved, Classifier2DSaved),
    Cube(LayerNorm3DSaved, Classifier3DSaved),
}

/// The blocks' 3D layout.
pub(super) const CUBE: Layout3D = Layout3D::RowsJColsK;

/// The split ends run over another group than the one they were registered on.
fn elsewhere(registered: &str, over: Over<'_>) -> Error {
    Error::WrongPlace {
        what: "a GPT's split ends",
        registered: registered.into(),
        run: match over {
            Over::OneD(_) => "over a 1D group".into(),
            Over::Grid(g) => format!("on a grid of tensor mode {}", g.spec().tensor),
        },
    }
}

/// The split ends' backward with another's state (or run on another group).
fn mismatch() -> Error {
    Error::SavedMismatch {
        layer: "the GPT's split ends (or run on another group)".into(),
    }
}

/// A head tied to an embedding of another layout: the model registers both at one place.
fn tied_elsewhere() -> Error {
    Error::Internal {
        what: "a split head tied to an embedding split another way".into(),
    }
}

fn not_split(mode: TensorMode) -> Error {
    Error::Conflict {
        what: "split ends (EndsLayout::Split)".into(),
        with: format!(
            "a grid of tensor mode {mode}: the ends split over a 1D group, a 2D, 2.5D or 3D grid"
        ),
    }
}

/// Fails, before anything is registered, when `cfg`'s ends do not split at `place`: the
/// vocabulary and the positions by `q` and the channels by `q²` on a grid (pad the vocabulary,
/// as GPT-2's 50257 to 50304, or keep the ends whole), a vocabulary with fewer tokens than
/// ranks on a 1D group.
pub(super) fn check_splits(cfg: &GptConfig, place: Place<'_>) -> Result<()> {
    let (v, t, c) = (cfg.vocab, cfg.max_seq, cfg.channels);
    const HINT: &str = "the ends split over the tensor group (pad the vocabulary, GPT-2's 50257 \
                        to 50304, or keep the ends whole: EndsLayout::Whole)";
    match place {
        Place::OneD(s) => {
            if s.size == 0 {
                return Err(Error::Empty {
                    what: "the 1D group the ends split over".into(),
                });
            }
            if v < s.size {
                return Err(Error::TooFew {
                    what: format!(
                        "vocabulary tokens of ends split over a 1D group of {} ranks (pad the \
                         vocabulary, or keep the ends whole: EndsLayout::Whole)",
                        s.size
                    ),
                    got: v,
                    need: s.size,
                });
            }
        }
        Place::Grid(g) => {
            let q = g.q()?;
            if q == 0 {
                return Err(Error::Empty {
                    what: "the grid the ends split over (q = 0)".into(),
                });
            }
            for (what, n) in [("vocabulary", v), ("positions", t)] {
                if !n.is_multiple_of(q) {
                    return Err(Error::NotSplit {
                        layer: HINT.into(),
                        what,
                        value: n,
                        parts: q,
                        by: "q",
                    });
                }
            }
            if !c.is_multiple_of(q * q) {
                return Err(Error::NotSplit {
                    layer: HINT.into(),
                    what: "channels",
                    value: c,
                    parts: q * q,
                    by: "q²",
                });
            }
        }
    }
    Ok(())
}

/// The share of the squared gradient norm of a rank's `wte` shard: `1/d` on a 2.5D grid of
/// depth `d` (every depth layer holds it), else 1.
pub(super) fn wte_norm_share(place: Place<'_>) -> f64 {
    match place {
        Place::Grid(g) => match g.spec().tensor {
            TensorMode::TwoHalfD { depth, .. } => 1.0 / depth as f64,
            _ => 1.0,
        },
        Place::OneD(_) => 1.0,
    }
}

impl SplitEmbedding {
    /// Registers `wte` and `wpe` (in that order) with the values of the masters `init(name)`; `wpe`'s gradient is written as `uses` says (shares when a step looks
    /// it up more than once, as a pipeline stage's micro-batches do). Replicated pieces count
    /// their share of the squared gradient norm.
    pub(super) fn register(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        init: &dyn Fn(&str) -> Init,
        place: Place<'_>,
        uses: WeightUse,
    ) -> Result<SplitEmbedding> {
        let (c, v, t) = (cfg.channels, cfg.vocab, cfg.max_seq);
        let (te, pe) = (init("wte.weight"), init("wpe.weight"));
        Ok(match place {
            Place::OneD(shard) => {
                let e = VocabEmbedding1D::register(store, v, t, c, &te, &pe, shard)?;
                store.set_norm_share(e.wpe, 1.0 / shard.size as f64)?;
                SplitEmbedding::OneD(e)
            }
            Place::Grid(grid) => match grid.spec().tensor {
                TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. } => {
                    let wte = VocabEmbedding2D::register(store, grid, "wte", v, c, &te)?;
                    let wpe = Embedding2D::register(store, grid, "wpe", t, c, &pe)?;
                    let wpe = match uses {
                        WeightUse::Once => wpe,
                        WeightUse::Shared => wpe.shared(),
                    };
                    SplitEmbedding::Summa { wte, wpe }
                }
                TensorMode::ThreeD { .. } => {
                    let wte = VocabEmbedding3D::register(store, grid, "wte", v, c, CUBE, &te)?;
                    let wpe = Embedding3D::register(store, grid, "wpe", t, c, CUBE, &pe)?;
                    let wpe = match uses {
                        WeightUse::Once => wpe,
                        WeightUse::Shared => wpe.shared(),
                    };
                    SplitEmbedding::Cube { wte, wpe }
                }
                m => return Err(not_split(m)),
            },
        })
    }

    /// Where the embedding was registered, in words.
    fn registered(&self) -> &'static str {
        match self {
            SplitEmbedding::OneD(_) => "over a 1D group",
            SplitEmbedding::Summa { .. } => "on a 2D or 2.5D grid",
            SplitEmbedding::Cube { .. } => "on a 3D grid",
        }
    }

    /// This rank's shard of `wte`.
    pub fn wte(&self) -> TensorId {
        match self {
            SplitEmbedding::OneD(e) => e.wte,
            SplitEmbedding::Summa { wte, .. } => wte.weight,
            SplitEmbedding::Cube { wte, .. } => wte.weight,
        }
    }

    /// The parameters, in the order one forward fetches them.
    pub fn params(&self) -> Vec<TensorId> {
        match self {
            SplitEmbedding::OneD(e) => vec![e.wte, e.wpe],
            SplitEmbedding::Summa { wte, wpe } => vec![wte.weight, wpe.weight],
            SplitEmbedding::Cube { wte, wpe } => {
                let mut v = wte.params();
                v.extend(wpe.params());
                v
            }
        }
    }

    /// The embedding of `tokens` (`[batch·seq]`, the same on every rank) in the blocks'
    /// layout: whole on a 1D group, the rank's tile on a grid. `first` is the position of the
    /// tokens' first column in their sequences (a sequence ring's block).
    pub(super) fn forward(
        &self,
        fwd: &ForwardPass<'_>,
        over: Over<'_>,
        tokens: &[i32],
        [batch, seq, first]: [usize; 3],
    ) -> Result<(Act, SplitEmbKept)> {
        let positions = || -> Vec<i32> {
            (0..tokens.len())
                .map(|n| (first + n % seq) as i32)
                .collect()
        };
        let sum = |a: &Act, b: &Act| {
            let one = Axpby {
                alpha: 1.0,
                beta: 1.0,
            };
            let (dev, s) = (fwd.device(), fwd.stream());
            add_in_place(dev, s, one, a.view(), b.input(), a.dtype())
        };
        match (self, over) {
            (SplitEmbedding::OneD(e), Over::OneD(group)) => {
                let (x, s) = e.forward_at(fwd, group, tokens, batch, seq, first)?;
                Ok((x, SplitEmbKept::OneD(Box::new(s))))
            }
            (SplitEmbedding::Summa { wte, wpe }, Over::Grid(grid)) => {
                let (x, st) = wte.forward(fwd, grid, tokens)?;
                let (p, sp) = wpe.forward(fwd, grid, &positions())?;
                sum(&x, &p)?;
                Ok((x, SplitEmbKept::Summa(st, sp)))
            }
            (SplitEmbedding::Cube { wte, wpe }, Over::Grid(grid)) => {
                let (x, st) = wte.forward(fwd, grid, tokens)?;
                let (p, sp) = wpe.forward(fwd, grid, &positions())?;
                sum(&x, &p)?;
                Ok((x, SplitEmbKept::Cube(st, sp)))
            }
            _ => Err(elsewhere(self.registered(), over)),
        }
    }

    /// The embeddings' gradients (`wte`'s through
    /// [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad)) from the gradient of
    /// the output, `dx`.
    pub(super) fn backward(
        &self,
        bwd: &BackwardPass<'_>,
        over: Over<'_>,
        kept: SplitEmbKept,
        dx: &Act,
    ) -> Result<()> {
        match (self, over, kept) {
            (SplitEmbedding::OneD(e), Over::OneD(_), SplitEmbKept::OneD(s)) => {
                e.backward(bwd, &s, dx)
            }
            (SplitEmbedding::Summa { wte, wpe }, Over::Grid(grid), SplitEmbKept::Summa(st, sp)) => {
                wpe.backward(bwd, grid, &sp, dx)?;
                wte.backward(bwd, grid, &st, dx)
            }
            (SplitEmbedding::Cube { wte, wpe }, Over::Grid(grid), SplitEmbKept::Cube(st, sp)) => {
                wpe.backward(bwd, grid, &sp, dx)?;
                wte.backward(bwd, grid, &st, dx)
            }
            _ => Err(mismatch()),
        }
    }
}

impl SplitHead {
    /// Registers `ln_f` and the head with the values of the masters `init(name)`: tied to `tied`'s `wte` shard, or, without one, over its own copy of the
    /// shard the embedding holds at the same place (registered first, as `wte.weight`).
    /// Replicated pieces count their share of the squared gradient norm.
    pub(super) fn register(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        init: &dyn Fn(&str) -> Init,
        place: Place<'_>,
        tied: Option<&SplitEmbedding>,
    ) -> Result<SplitHead> {
        let (c, v, eps) = (cfg.channels, cfg.vocab, cfg.eps);
        let (te, g, b) = (init("wte.weight"), init("ln_f.weight"), init("ln_f.bias"));
        Ok(match (place, tied) {
            (Place::OneD(shard), tied) => {
                // over its own copy of the rows (registered first) or the embedding's
                let head = match tied {
                    None => VocabHead1D::register(store, v, c, &te, IGNORE_INDEX, shard)?,
                    Some(SplitEmbedding::OneD(e)) => VocabHead1D::tied(&*store, e, IGNORE_INDEX)?,
                    Some(_) => return Err(tied_elsewhere()),
                };
                let ln_f = whole_ln_f(store, cfg, &g, &b, shard)?;
                SplitHead::OneD { ln_f, head }
            }
            (Place::Grid(grid), tied) => match grid.spec().tensor {
                mode @ (TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. }) => {
                    let own;
                    let wte = match tied {
                        Some(SplitEmbedding::Summa { wte, .. }) => wte,
                        None => {
                            own = VocabEmbedding2D::register(store, grid, "wte", v, c, &te)?;
                            &own
                        }
                        Some(_) => return Err(tied_elsewhere()),
                    };
                    let ln_f = LayerNorm2D::register(store, grid, "ln_f", c, eps, &g, &b)?;
                    // γ and β are the same in every depth layer
                    if let TensorMode::TwoHalfD { depth, .. } = mode {
                        for id in [ln_f.gamma, ln_f.beta] {
                            store.set_norm_share(id, 1.0 / depth as f64)?;
                        }
                    }
                    let head = Classifier2D::tied(&*store, wte, IGNORE_INDEX)?;
                    SplitHead::Summa { ln_f, head }
                }
                TensorMode::ThreeD { .. } => {
                    let own;
                    let wte = match tied {
                        Some(SplitEmbedding::Cube { wte, .. }) => wte,
                        None => {
                            own = VocabEmbedding3D::register(store, grid, "wte", v, c, CUBE, &te)?;
                            &own
                        }
                        Some(_) => return Err(tied_elsewhere()),
                    };
                    let ln_f = LayerNorm3D::register(store, grid, "ln_f", c, eps, CUBE, &g, &b)?;
                    let head = Classifier3D::tied(&*store, wte, IGNORE_INDEX)?;
                    SplitHead::Cube { ln_f, head }
                }
                m => return Err(not_split(m)),
            },
        })
    }

    /// Where the head was registered, in words.
    fn registered(&self) -> &'static str {
        match self {
            SplitHead::OneD { .. } => "over a 1D group",
            SplitHead::Summa { .. } => "on a 2D or 2.5D grid",
            SplitHead::Cube { .. } => "on a 3D grid",
        }
    }

    /// This rank's shard of `wte` (the head's weight).
    pub fn wte(&self) -> TensorId {
        match self {
            SplitHead::OneD { head, .. } => head.proj.weight,
            SplitHead::Summa { head, .. } => head.linear.slice().weight,
            SplitHead::Cube { head, .. } => head.linear.weight,
        }
    }

    /// `ln_f`'s γ and β.
    pub fn ln_f(&self) -> [TensorId; 2] {
        match self {
            SplitHead::OneD { ln_f, .. } => [ln_f.gamma, ln_f.beta],
            SplitHead::Summa { ln_f, .. } => [ln_f.gamma, ln_f.beta],
            SplitHead::Cube { ln_f, .. } => [ln_f.gamma, ln_f.beta],
        }
    }

    /// `ln_f` and the head on the last block's output `x` (whole on a 1D group, the rank's
    /// tile on a grid): the mean loss over the whole batch (`targets`, the same on every
    /// rank), the gradient kept scaled by `loss_scale`.
    pub(super) fn forward(
        &self,
        fwd: &ForwardPass<'_>,
        over: Over<'_>,
        x: &Act,
        targets: &[i32],
        loss_scale: f32,
    ) -> Result<(f32, SplitHeadKept)> {
        match (self, over) {
            (SplitHead::OneD { ln_f, head }, Over::OneD(group)) => {
                let (h, ln) = ln_f.forward(fwd, x, None)?;
                let (loss, hs) = head.forward(fwd, group, &h, targets, loss_scale)?;
                Ok((loss, SplitHeadKept::OneD(ln, hs)))
            }
            (SplitHead::Summa { ln_f, head }, Over::Grid(grid)) => {
                let (h, ln) = ln_f.forward(fwd, grid, x, None)?;
                let (loss, hs) = head.forward(fwd, grid, &h, targets, loss_scale)?;
                Ok((loss, SplitHeadKept::Summa(ln, hs)))
            }
            (SplitHead::Cube { ln_f, head }, Over::Grid(grid)) => {
                let (h, ln) = ln_f.forward(fwd, grid, x, None)?;
                let (loss, hs) = head.forward(fwd, grid, &h, targets, loss_scale)?;
                Ok((loss, SplitHeadKept::Cube(ln, hs)))
            }
            _ => Err(elsewhere(self.registered(), over)),
        }
    }

    /// The gradient of the last block's output; adds the head's share of `wte`'s gradient
    /// through [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad).
    pub(super) fn backward(
        &self,
        bwd: &BackwardPass<'_>,
        over: Over<'_>,
        kept: SplitHeadKept,
    ) -> Result<Act> {
        match (self, over, kept) {
            (SplitHead::OneD { ln_f, head }, Over::OneD(group), SplitHeadKept::OneD(ln, hs)) => {
                let dh = head.backward(bwd, group, &hs)?;
                drop(hs);
                ln_f.backward(bwd, &ln, &dh, None)
            }
            (SplitHead::Summa { ln_f, head }, Over::Grid(grid), SplitHeadKept::Summa(ln, hs)) => {
                let dh = head.backward(bwd, grid, &hs)?;
                drop(hs);
                ln_f.backward(bwd, grid, &ln, &dh, None)
            }
            (SplitHead::Cube { ln_f, head }, Over::Grid(grid), SplitHeadKept::Cube(ln, hs)) => {
                let dh = head.backward(bwd, grid, &hs)?;
                drop(hs);
                ln_f.backward(bwd, grid, &ln, &dh, None)
            }
            _ => Err(mismatch()),
        }
    }
}

/// `ln_f` whole on every rank of a 1D group (its norm share `1/T`).
fn whole_ln_f(
    store: &mut impl ParamStore,
    cfg: &GptConfig,
    gamma: &Init,
    beta: &Init,
    shard: Shard,
) -> Result<LayerNorm> {
    let c = cfg.channels;
    let ln_f = LayerNorm {
        gamma: store.register("ln_f.weight", &[c], gamma.clone())?,
        beta: store.register("ln_f.bias", &[c], beta.clone())?,
        cols: c,
        eps: cfg.eps,
    };
    for id in [ln_f.gamma, ln_f.beta] {
        store.set_norm_share(id, 1.0 / shard.size as f64)?;
    }
    Ok(ln_f)
}
