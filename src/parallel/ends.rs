//! What the layouts' ends share: a model's first layer (a token embedding with a position
//! embedding, [`TokenPosition`]) and its last (a final LayerNorm with a head, [`NormHead`]),
//! each layout bringing its own parts; the checks of what splits, and the position
//! embedding's ids.

use super::ProcessGrid;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::{add_in_place, Axpby};
use std::fmt::Debug;

use crate::nn::{EmbeddingOn, HeadOn, NormOn};
use crate::store::{BackwardPass, ForwardPass};
use crate::tensor::TensorId;

/// A table split over a 2D, 2.5D or 3D grid (a token or a position embedding): ids in (the
/// same on every rank), this rank's tile of their rows out. The 2D and 3D tables are one kind
/// of layer: the layouts' ends run any of them with the grid passed in.
pub trait GridLookup {
    /// What the forward keeps for the backward.
    type Saved: Send + Sync;
    /// The parameters, in fetch order.
    fn params(&self) -> Vec<TensorId>;
    /// This rank's tile of the rows of `ids`, and what the backward needs.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        ids: &[i32],
    ) -> Result<(Act, Self::Saved)>;
    /// The table's gradient from the tile's gradient `dout`.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Self::Saved,
        dout: &Act,
    ) -> Result<()>;
}

/// A LayerNorm over activations split on a 2D, 2.5D or 3D grid.
pub trait GridNorm {
    /// What the forward keeps for the backward.
    type Saved: Send + Sync;
    /// The parameters, in fetch order.
    fn params(&self) -> Vec<TensorId>;
    /// The LayerNorm of this rank's tile `x` (of `x + residual` with one), and what the
    /// backward needs.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, Self::Saved)>;
    /// The normalised input the forward kept (`x + residual` with a residual).
    fn input(saved: &Self::Saved) -> &Act;
    /// The input's gradient (added into `dx_into` when given) from the output's `dy`; γ's and
    /// β's gradients written.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Self::Saved,
        dy: &Act,
        dx_into: Option<&Act>,
    ) -> Result<Act>;
}

/// A classifier with its cross-entropy over classes split on a 2D, 2.5D or 3D grid.
pub trait GridClassifier {
    /// What the forward keeps for the backward.
    type Saved: Send + Sync;
    /// The parameters, in fetch order.
    fn params(&self) -> Vec<TensorId>;
    /// The mean loss of this rank's tile `h` over the whole batch's counted `targets` (the
    /// same on every rank), the gradient kept scaled by `loss_scale`.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        grid: &ProcessGrid,
        h: &Act,
        targets: &[i32],
        loss_scale: f32,
    ) -> Result<(f32, Self::Saved)>;
    /// The input's gradient; the weights' gradients written.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        grid: &ProcessGrid,
        saved: &Self::Saved,
    ) -> Result<Act>;
}

/// A model's first layer on a layout: the token embedding `wte` and the position embedding
/// `wpe`, each this rank's part.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenPosition<T, P> {
    /// The token embedding.
    pub wte: T,
    /// The position embedding.
    pub wpe: P,
}

/// A model's last layer on a layout: the final LayerNorm and the head tied to a `wte` part,
/// each this rank's part.
#[derive(Clone, Debug, PartialEq)]
pub struct NormHead<N, H> {
    /// The final LayerNorm.
    pub ln_f: N,
    /// The head, with its cross-entropy.
    pub head: H,
}

/// What a split end's hint says.
const HINT: &str = "the ends split over the tensor group (pad the vocabulary, GPT-2's 50257 to \
                    50304, or keep the ends whole: EndsLayout::Whole)";

/// Fails unless ends of `[vocab, positions, channels]` split on a grid of side `q`: the
/// vocabulary and the positions by `q`, the channels by `q²`.
pub(crate) fn check_grid_ends(q: usize, [vocab, positions, channels]: [usize; 3]) -> Result<()> {
    if q == 0 {
        return Err(Error::Empty {
            what: "the grid the ends split over (q = 0)".into(),
        });
    }
    for (what, n, by, parts) in [
        ("vocabulary", vocab, "q", q),
        ("positions", positions, "q", q),
        ("channels", channels, "q²", q * q),
    ] {
        if !n.is_multiple_of(parts) {
            return Err(Error::NotSplit {
                layer: HINT.into(),
                what,
                value: n,
                parts,
                by,
            });
        }
    }
    Ok(())
}

/// Fails unless a vocabulary of `vocab` tokens splits over a 1D group of `size` ranks.
pub(crate) fn check_rows_ends(size: usize, vocab: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::Empty {
            what: "the 1D group the ends split over".into(),
        });
    }
    if vocab < size {
        return Err(Error::TooFew {
            what: format!(
                "vocabulary tokens of ends split over a 1D group of {size} ranks (pad the \
                 vocabulary, or keep the ends whole: EndsLayout::Whole)"
            ),
            got: vocab,
            need: size,
        });
    }
    Ok(())
}

/// A grid's LayerNorm runs on every layout on that grid.
impl<L: OnGrid, N> NormOn<L> for N
where
    N: GridNorm + Debug + PartialEq + Send + Sync,
    N::Saved: Debug,
{
    type Saved = N::Saved;

    fn params(&self) -> Vec<TensorId> {
        GridNorm::params(self)
    }

    fn forward_on(
        &self,
        layout: &L,
        pass: &ForwardPass<'_>,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, N::Saved)> {
        GridNorm::forward(self, pass, layout.grid(), x, residual)
    }

    fn input(saved: &N::Saved) -> &Act {
        <N as GridNorm>::input(saved)
    }

    fn backward_on(
        &self,
        layout: &L,
        pass: &BackwardPass<'_>,
        saved: &N::Saved,
        dy: &Act,
        dx_into: &Act,
    ) -> Result<()> {
        GridNorm::backward(self, pass, layout.grid(), saved, dy, Some(dx_into)).map(drop)
    }
}

/// A layout on a grid (2D, 2.5D or 3D): the grid its ends run on.
pub trait OnGrid {
    /// The rank's grid.
    fn grid(&self) -> &ProcessGrid;
}

impl<L: OnGrid, T, P> EmbeddingOn<L> for TokenPosition<T, P>
where
    T: GridLookup + Clone + Debug + PartialEq + Send + Sync,
    P: GridLookup + Clone + Debug + PartialEq + Send + Sync,
{
    type Saved = (T::Saved, P::Saved);

    fn params(&self) -> Vec<TensorId> {
        let mut v = self.wte.params();
        v.extend(self.wpe.params());
        v
    }

    fn forward(
        &self,
        layout: &L,
        pass: &ForwardPass<'_>,
        tokens: &[i32],
        [_, seq, first]: [usize; 3],
    ) -> Result<(Act, Self::Saved)> {
        // the token rows plus the rows of their positions, `first ..` of each sequence
        let grid = layout.grid();
        let positions: Vec<i32> = (0..tokens.len())
            .map(|n| (first + n % seq.max(1)) as i32)
            .collect();
        let (x, st) = self.wte.forward(pass, grid, tokens)?;
        let (p, sp) = self.wpe.forward(pass, grid, &positions)?;
        let one = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        add_in_place(
            pass.device(),
            pass.stream(),
            one,
            x.view(),
            p.input(),
            x.dtype(),
        )?;
        Ok((x, (st, sp)))
    }

    fn backward(
        &self,
        layout: &L,
        pass: &BackwardPass<'_>,
        (st, sp): Self::Saved,
        dx: &Act,
    ) -> Result<()> {
        self.wpe.backward(pass, layout.grid(), &sp, dx)?;
        self.wte.backward(pass, layout.grid(), &st, dx)
    }
}

impl<L: OnGrid, N, C> HeadOn<L> for NormHead<N, C>
where
    N: GridNorm + Clone + Debug + PartialEq + Send + Sync,
    C: GridClassifier + Clone + Debug + PartialEq + Send + Sync,
{
    type Saved = (N::Saved, C::Saved);

    fn params(&self) -> [TensorId; 3] {
        let ln = self.ln_f.params();
        let w = self.head.params();
        [ln[0], ln[1], w[0]]
    }

    fn forward(
        &self,
        layout: &L,
        pass: &ForwardPass<'_>,
        x: &Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(f32, Self::Saved)> {
        let grid = layout.grid();
        let (y, ln) = self.ln_f.forward(pass, grid, x, None)?;
        let (loss, hs) = self.head.forward(pass, grid, &y, targets, scale)?;
        Ok((loss, (ln, hs)))
    }

    fn backward(&self, layout: &L, pass: &BackwardPass<'_>, (ln, hs): Self::Saved) -> Result<Act> {
        let dy = self.head.backward(pass, layout.grid(), &hs)?;
        drop(hs);
        self.ln_f.backward(pass, layout.grid(), &ln, &dy, None)
    }
}
