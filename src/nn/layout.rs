//! [`Layout`]: what differs between the serial layers and their tensor-parallel layouts, and
//! [`Serial`], the layers on whole tensors.

use std::fmt::Debug;

use super::act::Act;
use super::layernorm::{LayerNorm, LayerNormSaved};
use super::linear::{Linear, WeightUse};
use crate::error::Result;
use crate::ops::attention::Attention;
use crate::ops::heads::Heads;
use crate::store::{BackwardPass, ForwardPass, ParamStore};
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
    type Linear: Copy + Debug + PartialEq + Send + Sync;
    /// What a linear's forward keeps for its backward.
    type LinearSaved: Debug + Send + Sync;
    /// This rank's part of a LayerNorm.
    type Norm: Copy + Debug + PartialEq + Send + Sync;
    /// What a LayerNorm's forward keeps for its backward.
    type NormSaved: Debug + Send + Sync;

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
    /// A LayerNorm's parameters, in registration order.
    fn norm_params(norm: &Self::Norm) -> Vec<TensorId>;
    /// A linear's parameters, in registration order.
    fn linear_params(linear: &Self::Linear) -> Vec<TensorId>;

    /// The LayerNorm of this rank's part `x`, or of `x + residual`: its output and what the
    /// backward needs.
    fn norm_forward(
        &self,
        pass: &ForwardPass<'_>,
        norm: &Self::Norm,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, Self::NormSaved)>;
    /// The normalised input a LayerNorm's forward kept: `x + residual` with a residual.
    fn norm_input(saved: &Self::NormSaved) -> &Act;
    /// The backward of a LayerNorm from `dy`: its input's gradient added into `dx_into`, its
    /// parameters' gradients written.
    fn norm_backward(
        &self,
        pass: &BackwardPass<'_>,
        norm: &Self::Norm,
        saved: &Self::NormSaved,
        dy: &Act,
        dx_into: &Act,
    ) -> Result<()>;
    /// A linear on this rank's part `x`: its output and what the backward needs.
    fn linear_forward(
        &self,
        pass: &ForwardPass<'_>,
        linear: &Self::Linear,
        x: &Act,
    ) -> Result<(Act, Self::LinearSaved)>;
    /// The backward of a linear from `dy`: its weights' gradients written as `uses` says, its
    /// input's gradient returned.
    fn linear_backward(
        &self,
        pass: &BackwardPass<'_>,
        linear: &Self::Linear,
        saved: &Self::LinearSaved,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act>;
}

/// The layers on whole tensors, on one rank: [`LayerNorm`] and [`Linear`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Serial;

impl Layout for Serial {
    type Linear = Linear;
    type LinearSaved = Act;
    type Norm = LayerNorm;
    type NormSaved = LayerNormSaved;

    fn cols(&self, features: usize) -> usize {
        features
    }

    fn heads(&self, heads: usize) -> usize {
        heads
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

    fn norm_params(norm: &LayerNorm) -> Vec<TensorId> {
        vec![norm.gamma, norm.beta]
    }

    fn linear_params(linear: &Linear) -> Vec<TensorId> {
        linear.params()
    }

    fn norm_forward(
        &self,
        pass: &ForwardPass<'_>,
        norm: &LayerNorm,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, LayerNormSaved)> {
        norm.forward(pass, x, residual)
    }

    fn norm_input(saved: &LayerNormSaved) -> &Act {
        saved.h()
    }

    fn norm_backward(
        &self,
        pass: &BackwardPass<'_>,
        norm: &LayerNorm,
        saved: &LayerNormSaved,
        dy: &Act,
        dx_into: &Act,
    ) -> Result<()> {
        norm.backward(pass, saved, dy, Some(dx_into)).map(drop)
    }

    fn linear_forward(
        &self,
        pass: &ForwardPass<'_>,
        linear: &Linear,
        x: &Act,
    ) -> Result<(Act, Act)> {
        Ok((linear.forward(pass, x)?, x.clone()))
    }

    fn linear_backward(
        &self,
        pass: &BackwardPass<'_>,
        linear: &Linear,
        x: &Act,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act> {
        let dx = linear.with_uses(uses).backward(pass, x, dy, true)?;
        super::asked_dx(dx)
    }
}
