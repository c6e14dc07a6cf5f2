//! [`Layout`]: what differs between the serial layers and their tensor-parallel layouts, and
//! [`Serial`], the layers on whole tensors.

use std::fmt::Debug;

use super::act::Act;
use super::layernorm::{LayerNorm, LayerNormSaved};
use super::linear::{Linear, WeightUse};
use crate::error::Result;
use crate::ops::attention::Attention;
use crate::ops::heads::Heads;
use crate::store::{BackwardPass, ForwardPass, ParamStore, Pass, PassKind};
use crate::tensor::{Init, TensorId};

/// Where a linear stands in a pair of linears (Megatron's names): a column linear opens the
/// pair — its outputs are what a layout splits (the attention's `c_attn`, the MLP's `c_fc`) —
/// and a row linear closes it, taking the column linear's split outputs back to the
/// activation's layout (the `c_proj`s). Layouts that split both sides alike ignore it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pair {
    /// Opens a pair. Its outputs are `parts` stacked blocks, each split on its own (3 for
    /// the attention's queries, keys and values side by side).
    Column {
        /// Stacked output blocks.
        parts: usize,
    },
    /// Closes a pair.
    Row,
}

/// How a block's layers are split over ranks: what differs between the serial layers and
/// their tensor-parallel layouts. A layer written over a `Layout` (the transformer
/// [`Block`](super::Block)) is written once; [`Serial`] runs it on whole tensors, and
/// [`parallel`](crate::parallel) implements it for Megatron's 1D split
/// ([`OneD`](crate::parallel::OneD)), the 2D/2.5D grid ([`Summa`](crate::parallel::Summa))
/// and the 3D cube ([`Cube`](crate::parallel::Cube)).
///
/// A layout value is the rank's place (which shard it registers) and the communicators its
/// layers run on, shared with the grid they come from: a layer written over a layout takes
/// activations only, and runs on the groups it was registered for. [`Serial`] holds nothing.
pub trait Layout: Clone + Debug + PartialEq + Send + Sync + 'static {
    /// This rank's part of a linear layer.
    type Linear: LinearOn<Self> + Copy;
    /// This rank's part of a LayerNorm.
    type Norm: NormOn<Self> + Copy;
    /// Whether the layout holds whole tensors ([`Serial`]): its model's ends are then whole
    /// too, and its split ends ([`Layout::Embedding`], [`Layout::Head`]) have no value.
    const WHOLE: bool = false;
    /// This rank's part of a model's first layer: a token embedding `wte` split by
    /// vocabulary, with a position embedding `wpe`, giving the blocks' layout.
    type Embedding: EmbeddingOn<Self>;
    /// This rank's part of a model's last layer: the final LayerNorm and the head tied to a
    /// `wte` part, with its cross-entropy over the split vocabulary.
    type Head: HeadOn<Self>;

    /// Columns of this rank's part of an activation of `features` features.
    fn cols(&self, features: usize) -> usize;
    /// Heads this rank's attention computes of `heads`.
    fn heads(&self, heads: usize) -> usize;
    /// Checks that `channels` channels over `heads` heads split on this layout, naming layer
    /// `name` and what does not divide what.
    fn check_split(&self, name: &str, channels: usize, heads: usize) -> Result<()>;
    /// The attention on this rank's `rows` rows of a batch of `batch` sequences of `seq`
    /// tokens, over its heads of `heads` heads of `head_dim` channels; an error naming what
    /// does not split when the rows are not whole sequences.
    fn attention(
        &self,
        rows: usize,
        batch_seq: [usize; 2],
        heads: usize,
        head_dim: usize,
    ) -> Result<Attention>;

    /// Checks that ends of `[vocab, positions, channels]` split on this layout, naming what
    /// does not divide what.
    fn check_ends(&self, dims: [usize; 3]) -> Result<()>;
    /// The share of the squared gradient norm of this rank's part of `wte`.
    fn wte_share(&self) -> f64 {
        1.0
    }
    /// Registers this rank's part of `wte.weight` and `wpe.weight` (`[vocab, positions,
    /// channels]`), in that order, from the masters `init`; `wpe`'s gradient written as `uses`
    /// says. Replicated parts count their share of the gradient norm.
    fn register_embedding<S: ParamStore>(
        &self,
        store: &mut S,
        dims: [usize; 3],
        init: [&Init; 2],
        uses: WeightUse,
    ) -> Result<Self::Embedding>;
    /// Registers this rank's part of `ln_f` (of `eps`) and a head over `[vocab, channels]`
    /// tied to `tied`'s `wte` part, or, without one, to a `wte.weight` part of its own
    /// registered first; from the masters `init` (`wte`, γ, β). Targets equal to `ignore`
    /// count for nothing.
    fn register_head<S: ParamStore>(
        &self,
        store: &mut S,
        dims: [usize; 2],
        eps: f32,
        init: [&Init; 3],
        ignore: i32,
        tied: Option<&Self::Embedding>,
    ) -> Result<Self::Head>;
    /// This rank's part of a whole `[rows, cols]` activation (itself where the layout's
    /// activations are whole), without a collective.
    fn to_tile<K: PassKind>(&self, _pass: &Pass<'_, K>, full: Act) -> Result<Act> {
        Ok(full)
    }
    /// The whole activation from every rank's part (itself where they are whole).
    fn to_full<K: PassKind>(&self, _pass: &Pass<'_, K>, part: Act) -> Result<Act> {
        Ok(part)
    }
    /// The shape of this rank's part of a whole `[rows, cols]` activation.
    fn tile_shape(&self, rows_cols: [usize; 2]) -> Result<[usize; 2]> {
        Ok(rows_cols)
    }

    /// Registers this rank's part of a LayerNorm over `features` features, `{name}.weight`
    /// and `{name}.bias` with the values of the masters `init` (γ, β); replicated parts count
    /// their share of the gradient norm.
    fn register_norm<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        features: usize,
        eps: f32,
        init: [&Init; 2],
    ) -> Result<Self::Norm>;
    /// Registers this rank's part of linear `name` (`[inputs, outputs]`), `{name}.weight`
    /// (master `[outputs, inputs]`) and `{name}.bias`, from the masters `init`.
    fn register_linear<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        inputs_outputs: [usize; 2],
        pair: Pair,
        init: [&Init; 2],
    ) -> Result<Self::Linear>;
}

/// The layers on whole tensors, on one rank: [`LayerNorm`] and [`Linear`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Serial;

/// The split ends of a layout that has none ([`Serial`]: its ends are whole): no value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsplit {}

/// A linear layer's part on layout `L`: how it runs there, the groups its layout holds.
pub trait LinearOn<L: ?Sized>: Debug + PartialEq + Send + Sync {
    /// What the forward keeps for the backward.
    type Saved: Debug + Send + Sync;
    /// The parameters, in registration order.
    fn params(&self) -> Vec<TensorId>;
    /// The linear on this rank's part `x`: its output and what the backward needs.
    fn forward_on(&self, layout: &L, pass: &ForwardPass<'_>, x: &Act)
        -> Result<(Act, Self::Saved)>;
    /// The backward from `dy`: the weights' gradients written as `uses` says, the input's
    /// gradient returned.
    fn backward_on(
        &self,
        layout: &L,
        pass: &BackwardPass<'_>,
        saved: &Self::Saved,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act>;
}

/// A LayerNorm's part on layout `L`: how it runs there.
pub trait NormOn<L: ?Sized>: Debug + PartialEq + Send + Sync {
    /// What the forward keeps for the backward.
    type Saved: Debug + Send + Sync;
    /// γ and β's parts, in registration order.
    fn params(&self) -> Vec<TensorId>;
    /// The LayerNorm of this rank's part `x`, or of `x + residual`: its output and what the
    /// backward needs.
    fn forward_on(
        &self,
        layout: &L,
        pass: &ForwardPass<'_>,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, Self::Saved)>;
    /// The normalised input the forward kept: `x + residual` with a residual.
    fn input(saved: &Self::Saved) -> &Act;
    /// The backward from `dy`: the input's gradient added into `dx_into`, γ's and β's
    /// gradients written.
    fn backward_on(
        &self,
        layout: &L,
        pass: &BackwardPass<'_>,
        saved: &Self::Saved,
        dy: &Act,
        dx_into: &Act,
    ) -> Result<()>;
}

impl LinearOn<Serial> for Linear {
    type Saved = Act;

    fn params(&self) -> Vec<TensorId> {
        Linear::params(self)
    }

    fn forward_on(&self, _: &Serial, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, Act)> {
        Ok((self.forward(pass, x)?, x.clone()))
    }

    fn backward_on(
        &self,
        _: &Serial,
        pass: &BackwardPass<'_>,
        x: &Act,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act> {
        let dx = self.with_uses(uses).backward(pass, x, dy, true)?;
        super::asked_dx(dx)
    }
}

/// A whole LayerNorm runs alike on every layout that holds it whole (serial, and replicated
/// on a 1D group).
impl<L: ?Sized> NormOn<L> for LayerNorm {
    type Saved = LayerNormSaved;

    fn params(&self) -> Vec<TensorId> {
        vec![self.gamma, self.beta]
    }

    fn forward_on(
        &self,
        _: &L,
        pass: &ForwardPass<'_>,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, LayerNormSaved)> {
        self.forward(pass, x, residual)
    }

    fn input(saved: &LayerNormSaved) -> &Act {
        saved.h()
    }

    fn backward_on(
        &self,
        _: &L,
        pass: &BackwardPass<'_>,
        saved: &LayerNormSaved,
        dy: &Act,
        dx_into: &Act,
    ) -> Result<()> {
        self.backward(pass, saved, dy, Some(dx_into)).map(drop)
    }
}

/// A model's first layer on layout `L` (its token and position embedding, this rank's part):
/// how it runs there. A layout's ends are layers of their own, written once for every layout
/// that runs them alike (the 2D and 3D grids share theirs).
pub trait EmbeddingOn<L: ?Sized>: Clone + Debug + PartialEq + Send + Sync {
    /// What the forward keeps for the backward.
    type Saved: Send + Sync;
    /// The parameters in fetch order, this rank's `wte` part first.
    fn params(&self) -> Vec<TensorId>;
    /// The embedding of `tokens` (`[batch·seq]`, the same on every rank) at positions
    /// `first ..` of their sequences, in the blocks' layout.
    fn forward(
        &self,
        layout: &L,
        pass: &ForwardPass<'_>,
        tokens: &[i32],
        batch_seq_first: [usize; 3],
    ) -> Result<(Act, Self::Saved)>;
    /// The gradients (`wte`'s added to the store's sum) from the output's `dx`.
    fn backward(
        &self,
        layout: &L,
        pass: &BackwardPass<'_>,
        saved: Self::Saved,
        dx: &Act,
    ) -> Result<()>;
}

/// A model's last layer on layout `L` (the final LayerNorm and the head tied to a `wte` part,
/// with its cross-entropy; this rank's part): how it runs there.
pub trait HeadOn<L: ?Sized>: Clone + Debug + PartialEq + Send + Sync {
    /// What the forward keeps for the backward.
    type Saved: Send + Sync;
    /// `ln_f`'s γ and β, then the `wte` part.
    fn params(&self) -> [TensorId; 3];
    /// `ln_f` and the head on the last block's output `x`: the mean loss over the whole batch
    /// (`targets`, the same on every rank), the gradient kept scaled by `scale`.
    fn forward(
        &self,
        layout: &L,
        pass: &ForwardPass<'_>,
        x: &Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(f32, Self::Saved)>;
    /// The gradient of the last block's output; the head's share of `wte`'s gradient added
    /// to the store's sum.
    fn backward(&self, layout: &L, pass: &BackwardPass<'_>, saved: Self::Saved) -> Result<Act>;
}

impl<L: ?Sized> EmbeddingOn<L> for Unsplit {
    type Saved = Unsplit;

    fn params(&self) -> Vec<TensorId> {
        match *self {}
    }

    fn forward(
        &self,
        _: &L,
        _: &ForwardPass<'_>,
        _: &[i32],
        _: [usize; 3],
    ) -> Result<(Act, Unsplit)> {
        match *self {}
    }

    fn backward(&self, _: &L, _: &BackwardPass<'_>, _: Unsplit, _: &Act) -> Result<()> {
        match *self {}
    }
}

impl<L: ?Sized> HeadOn<L> for Unsplit {
    type Saved = Unsplit;

    fn params(&self) -> [TensorId; 3] {
        match *self {}
    }

    fn forward(
        &self,
        _: &L,
        _: &ForwardPass<'_>,
        _: &Act,
        _: &[i32],
        _: f32,
    ) -> Result<(f32, Unsplit)> {
        match *self {}
    }

    fn backward(&self, _: &L, _: &BackwardPass<'_>, _: Unsplit) -> Result<Act> {
        match *self {}
    }
}

/// Split ends asked of a layout whose ends are whole.
fn unsplit() -> crate::error::Error {
    crate::error::Error::Internal {
        what: "split ends on a layout whose ends are whole".into(),
    }
}

impl Layout for Serial {
    type Linear = Linear;
    type Norm = LayerNorm;
    const WHOLE: bool = true;
    type Embedding = Unsplit;
    type Head = Unsplit;

    fn cols(&self, features: usize) -> usize {
        features
    }

    fn heads(&self, heads: usize) -> usize {
        heads
    }

    fn check_ends(&self, _: [usize; 3]) -> Result<()> {
        Err(unsplit())
    }

    fn register_embedding<S: ParamStore>(
        &self,
        _: &mut S,
        _: [usize; 3],
        _: [&Init; 2],
        _: WeightUse,
    ) -> Result<Unsplit> {
        Err(unsplit())
    }

    fn register_head<S: ParamStore>(
        &self,
        _: &mut S,
        _: [usize; 2],
        _: f32,
        _: [&Init; 3],
        _: i32,
        _: Option<&Unsplit>,
    ) -> Result<Unsplit> {
        Err(unsplit())
    }

    fn check_split(&self, name: &str, channels: usize, heads: usize) -> Result<()> {
        super::check_heads(&format!("attention '{name}'"), channels, heads)
    }

    fn attention(
        &self,
        rows: usize,
        [batch, seq]: [usize; 2],
        heads: usize,
        head_dim: usize,
    ) -> Result<Attention> {
        super::check_rows(rows, batch, seq)?;
        Ok(Attention::new(Heads::new(batch, seq, heads, head_dim)))
    }

    fn register_norm<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        features: usize,
        eps: f32,
        [gamma, beta]: [&Init; 2],
    ) -> Result<LayerNorm> {
        LayerNorm::register_with(store, name, features, eps, gamma.clone(), beta.clone())
    }

    fn register_linear<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        [inputs, outputs]: [usize; 2],
        _: Pair,
        [weight, bias]: [&Init; 2],
    ) -> Result<Linear> {
        Linear::register_with(
            store,
            name,
            inputs,
            outputs,
            weight.clone(),
            Some(bias.clone()),
        )
    }
}
