//! [`OneD`]: Megatron's 1D split as a [`Layout`], its ends included.

use std::sync::Arc;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nn::{Act, Block, EmbeddingOn, HeadOn, LayerNorm, LayerNormSaved, Layout, Linear};
use crate::nn::{LinearOn, Pair};
use crate::nn::{Serial, WeightUse};
use crate::ops::attention::Attention;
use crate::parallel::ends::check_rows_ends;
use crate::parallel::one_d::all_reduces;
use crate::parallel::split;
use crate::parallel::{ColumnLinear, Cost, RowLinear, Shard};
use crate::parallel::{
    NormHead, VocabEmbedding1D, VocabEmbedding1DSaved, VocabHead1D, VocabHead1DSaved,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// 1D (Megatron) tensor parallelism over a group of `P` ranks: column- and row-parallel
/// linears and the transformer block built from them.
///
/// Each rank registers only its shard of every weight, under the serial layer's name, in its
/// own store, and computes with the [`nn`](crate::nn) layers on it; the layers here add the
/// collectives, on the pass's stream:
///
/// - [`ColumnLinear`]: `W_r` holds output rows `r·out/P ..` (with `parts > 1`, that slice of
///   each of `parts` stacked outputs, e.g. attention's q, k, v), the bias the same rows; `X` is
///   replicated and `Y_r = X·W_rᵀ + b_r` needs no collective. Backward: `dX = Σ_r dY_r·W_r`,
///   one all-reduce.
/// - [`RowLinear`]: `W_r` holds input columns `r·in/P ..`; `Y = Σ_r X_r·W_rᵀ + b`, one
///   all-reduce. The bias lives on the group's first rank only and is added there before the
///   reduction, so its gradient (`Σ dY`) is computed once. Backward needs no collective.
/// - [`OneD`]: the layout of GPT-2's [`Block`](crate::nn::Block) with `c_attn` and `c_fc` column-parallel,
///   `c_proj`s row-parallel, `H/P` heads a rank, LayerNorms replicated: two all-reduces of
///   `rows × C` in forward and two in backward.
///
/// Shapes that do not divide by `P` are refused at registration.
///
/// Megatron's 1D layout as a [`Layout`]: the transformer [`Block`](crate::nn::Block) split over a group of `P`
/// ranks, column linears ([`Pair::Column`], `c_attn` and `c_fc`) as [`ColumnLinear`]s, row
/// linears (the `c_proj`s) as [`RowLinear`]s, `H/P` heads a rank, LayerNorms replicated (each
/// counting `1/P` of its gradients' squared norm): two all-reduces of `rows × C` forward and
/// two backward ([`Block::collectives`](crate::nn::Block#method.collectives-1)). Activations are whole
/// on every rank.
#[derive(Clone, Debug)]
pub struct OneD {
    /// The rank's place.
    pub shard: Shard,
    group: Arc<Communicator>,
}

impl PartialEq for OneD {
    fn eq(&self, other: &OneD) -> bool {
        self.shard == other.shard && Arc::ptr_eq(&self.group, &other.group)
    }
}

impl OneD {
    /// The layout of `group`'s rank, running on `group`.
    pub fn of(group: &Arc<Communicator>) -> OneD {
        OneD {
            shard: Shard::of(group),
            group: Arc::clone(group),
        }
    }
}

/// A linear of a [`OneD`] layout: this rank's shard and which side of its pair it is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Linear1D {
    /// Output features split ([`Pair::Column`]).
    Column(ColumnLinear),
    /// Input features split ([`Pair::Row`]).
    Row(RowLinear),
}

impl Linear1D {
    /// The shard as a serial layer.
    pub fn linear(&self) -> &Linear {
        match self {
            Linear1D::Column(l) => &l.linear,
            Linear1D::Row(l) => &l.linear,
        }
    }
}

impl Layout for OneD {
    type Linear = Linear1D;
    type Norm = LayerNorm;
    type Embedding = VocabEmbedding1D;
    type Head = NormHead<LayerNorm, VocabHead1D>;

    fn cols(&self, features: usize) -> usize {
        features
    }

    fn heads(&self, heads: usize) -> usize {
        heads / self.shard.size.max(1)
    }

    fn check_split(&self, name: &str, channels: usize, heads: usize) -> Result<()> {
        self.shard.split(name, "heads", heads)?;
        split(name, "channels", channels, heads, "heads").map(drop)
    }

    fn attention(
        &self,
        rows: usize,
        batch_seq: [usize; 2],
        heads: usize,
        head_dim: usize,
    ) -> Result<Attention> {
        Serial.attention(rows, batch_seq, heads, head_dim)
    }

    fn check_ends(&self, [vocab, ..]: [usize; 3]) -> Result<()> {
        check_rows_ends(self.shard.size, vocab)
    }

    fn register_embedding<S: ParamStore>(
        &self,
        store: &mut S,
        [v, t, c]: [usize; 3],
        [te, pe]: [&Init; 2],
        _: WeightUse,
    ) -> Result<VocabEmbedding1D> {
        let e = VocabEmbedding1D::register(store, v, t, c, te, pe, self.shard)?;
        store.set_norm_share(e.wpe, 1.0 / self.shard.size as f64)?;
        Ok(e)
    }

    fn register_head<S: ParamStore>(
        &self,
        store: &mut S,
        [v, c]: [usize; 2],
        eps: f32,
        [te, g, b]: [&Init; 3],
        ignore: i32,
        tied: Option<&VocabEmbedding1D>,
    ) -> Result<Self::Head> {
        // over its own copy of the rows (registered first) or the embedding's
        let head = match tied {
            None => VocabHead1D::register(store, v, c, te, ignore, self.shard)?,
            Some(e) => VocabHead1D::tied(&*store, e, ignore)?,
        };
        // ln_f whole on every rank
        let ln_f = self.register_norm(store, "ln_f", c, eps, [g, b])?;
        Ok(NormHead { ln_f, head })
    }

    fn register_norm<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        features: usize,
        eps: f32,
        init: [&Init; 2],
    ) -> Result<LayerNorm> {
        let ln = Serial.register_norm(store, name, features, eps, init)?;
        for id in [ln.gamma, ln.beta] {
            store.set_norm_share(id, 1.0 / self.shard.size as f64)?;
        }
        Ok(ln)
    }

    fn register_linear<S: ParamStore>(
        &self,
        store: &mut S,
        name: &str,
        [inputs, outputs]: [usize; 2],
        pair: Pair,
        [w, b]: [&Init; 2],
    ) -> Result<Linear1D> {
        let shard = self.shard;
        Ok(match pair {
            Pair::Column { parts } => Linear1D::Column(ColumnLinear::register(
                store,
                name,
                inputs,
                outputs,
                parts,
                w,
                Some(b),
                shard,
            )?),
            Pair::Row => Linear1D::Row(RowLinear::register(
                store,
                name,
                inputs,
                outputs,
                w,
                Some(b),
                shard,
            )?),
        })
    }
}

impl Block<OneD> {
    /// The collectives of one forward and backward over `rows` rows of parameters of `dtype`.
    pub fn collectives(&self, rows: usize, dtype: crate::DType) -> Cost {
        let bytes = (rows * self.channels * dtype.size()) as u64;
        all_reduces([2, 2 * bytes], [2, 2 * bytes])
    }
}

impl EmbeddingOn<OneD> for VocabEmbedding1D {
    type Saved = VocabEmbedding1DSaved;

    fn params(&self) -> Vec<TensorId> {
        vec![self.wte, self.wpe]
    }

    fn forward(
        &self,
        layout: &OneD,
        pass: &ForwardPass<'_>,
        tokens: &[i32],
        [batch, seq, first]: [usize; 3],
    ) -> Result<(Act, VocabEmbedding1DSaved)> {
        self.forward_at(pass, &layout.group, tokens, batch, seq, first)
    }

    fn backward(
        &self,
        _: &OneD,
        pass: &BackwardPass<'_>,
        saved: VocabEmbedding1DSaved,
        dx: &Act,
    ) -> Result<()> {
        VocabEmbedding1D::backward(self, pass, &saved, dx)
    }
}

impl HeadOn<OneD> for NormHead<LayerNorm, VocabHead1D> {
    type Saved = (LayerNormSaved, VocabHead1DSaved);

    fn params(&self) -> [TensorId; 3] {
        [self.ln_f.gamma, self.ln_f.beta, self.head.proj.weight]
    }

    fn forward(
        &self,
        layout: &OneD,
        pass: &ForwardPass<'_>,
        x: &Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(f32, Self::Saved)> {
        let (y, ln) = self.ln_f.forward(pass, x, None)?;
        let (loss, hs) = self.head.forward(pass, &layout.group, &y, targets, scale)?;
        Ok((loss, (ln, hs)))
    }

    fn backward(
        &self,
        layout: &OneD,
        pass: &BackwardPass<'_>,
        (ln, hs): Self::Saved,
    ) -> Result<Act> {
        let dy = self.head.backward(pass, &layout.group, &hs)?;
        drop(hs);
        self.ln_f.backward(pass, &ln, &dy, None)
    }
}

impl LinearOn<OneD> for Linear1D {
    type Saved = Act;

    fn params(&self) -> Vec<TensorId> {
        self.linear().params()
    }

    fn forward_on(&self, layout: &OneD, pass: &ForwardPass<'_>, x: &Act) -> Result<(Act, Act)> {
        let y = match self {
            Linear1D::Column(l) => l.forward(pass, x)?,
            Linear1D::Row(l) => l.forward(pass, &layout.group, x)?,
        };
        Ok((y, x.clone()))
    }

    fn backward_on(
        &self,
        layout: &OneD,
        pass: &BackwardPass<'_>,
        x: &Act,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act> {
        let dx = match self {
            Linear1D::Column(l) => {
                let l = ColumnLinear {
                    linear: l.linear.with_uses(uses),
                    ..*l
                };
                l.backward(pass, &layout.group, x, dy, true)?
            }
            Linear1D::Row(l) => l.linear.with_uses(uses).backward(pass, x, dy, true)?,
        };
        dx.ok_or_else(|| Error::Internal {
            what: "a linear's backward asked for dx gave none".into(),
        })
    }
}
