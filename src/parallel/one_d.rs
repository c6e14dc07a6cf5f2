use std::sync::Arc;

use serde::Serialize;

use super::{Cost, PassCost};
use crate::comm::{CommStats, Communicator, ReduceOp, Tally};
use crate::error::{Error, Result};
use crate::nn::{Act, Block, LayerNorm, LayerNormSaved, Layout, Linear, Pair, Serial, WeightUse};
use crate::ops::attention::Attention;
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// A rank's place in its tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shard {
    /// The rank in the group.
    pub rank: usize,
    /// The group's size `P`.
    pub size: usize,
}

impl Shard {
    /// The place of `group`'s rank.
    pub fn of(group: &Communicator) -> Shard {
        Shard {
            rank: group.rank(),
            size: group.world(),
        }
    }

    /// `n / P`, or [`Error::NotSplit`] naming `layer`'s dimension `what` when `n` does not
    /// divide.
    fn split(&self, layer: &str, what: &'static str, n: usize) -> Result<usize> {
        if self.size == 0 || self.rank >= self.size {
            return Err(Error::IndexOutOfRange {
                what: "tensor-parallel rank".into(),
                index: self.rank,
                len: self.size,
            });
        }
        super::split(layer, what, n, self.size, "tensor-parallel ranks")
    }
}

/// The initialiser of a shard: element `i` of the shard is element `map(i)` of the master.
fn shard_init(master: &Init, map: impl Fn(usize) -> usize + Send + Sync + 'static) -> Init {
    let master = master.clone();
    Init::Fn(std::sync::Arc::new(move |i| master.value(map(i))))
}

/// All-reduces an activation in place (SUM over the group) on the pass's stream.
fn all_reduce(group: &Communicator, stream: &crate::device::Stream, a: &Act) -> Result<()> {
    group.all_reduce(stream, a.view(), a.view(), a.dtype(), ReduceOp::Sum)
}

/// A column-parallel linear layer (see [`OneD`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColumnLinear {
    /// This rank's shard: `[out/P, in]` and bias `[out/P]`.
    pub linear: Linear,
    /// The full layer's outputs.
    pub outputs: usize,
    /// Stacked outputs split each on its own (3 for attention's q, k, v).
    pub parts: usize,
    /// The rank's place.
    pub shard: Shard,
}

impl ColumnLinear {
    /// Registers `{name}.weight` (this rank's rows of the master `[outputs, inputs]`, whose
    /// values `weight` gives element by element, row-major) and `{name}.bias` (its rows of
    /// `bias`'s `[outputs]`). With `parts`, the outputs are `parts` stacked blocks each split
    /// over the ranks. Fails if a block does not split over `P`.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        inputs: usize,
        outputs: usize,
        parts: usize,
        weight: &Init,
        bias: Option<&Init>,
        shard: Shard,
    ) -> Result<ColumnLinear> {
        if parts == 0 || !outputs.is_multiple_of(parts) {
            return Err(Error::NotSplit {
                layer: name.to_string(),
                what: "outputs",
                value: outputs,
                parts,
                by: "fused blocks",
            });
        }
        let block = outputs / parts;
        let local = shard.split(name, "an output block", block)?;
        let r = shard.rank;
        // local row q of part p is master row p·block + r·local + q
        let row = move |lr: usize| (lr / local) * block + r * local + lr % local;
        let w = shard_init(weight, move |i| row(i / inputs) * inputs + i % inputs);
        let b = bias.map(|b| shard_init(b, row));
        let linear = Linear::register_with(store, name, inputs, local * parts, w, b)?;
        Ok(ColumnLinear {
            linear,
            outputs,
            parts,
            shard,
        })
    }

    /// `Y_r = X·W_rᵀ + b_r` (this rank's output columns); no collective.
    pub fn forward(&self, pass: &ForwardPass<'_>, x: &Act) -> Result<Act> {
        self.linear.forward(pass, x)
    }

    /// Writes the shard's gradients; with `need_dx`, returns `dX`, all-reduced over `group`.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        group: &Communicator,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        let dx = self.linear.backward(pass, x, dy, need_dx)?;
        if let Some(dx) = &dx {
            all_reduce(group, pass.stream(), dx)?;
        }
        Ok(dx)
    }
}

/// A row-parallel linear layer (see [`OneD`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowLinear {
    /// This rank's shard: `[out, in/P]`; the bias `[out]` on the group's first rank only.
    pub linear: Linear,
    /// The full layer's inputs.
    pub inputs: usize,
    /// The rank's place.
    pub shard: Shard,
}

impl RowLinear {
    /// Registers `{name}.weight` (this rank's columns of the master `[outputs, inputs]`) and,
    /// on the group's first rank, `{name}.bias` (`[outputs]`). Fails if the inputs do not split
    /// over `P`.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        inputs: usize,
        outputs: usize,
        weight: &Init,
        bias: Option<&Init>,
        shard: Shard,
    ) -> Result<RowLinear> {
        let local = shard.split(name, "inputs", inputs)?;
        let first = shard.rank * local;
        let w = shard_init(weight, move |i| (i / local) * inputs + first + i % local);
        let b = bias.filter(|_| shard.rank == 0).cloned();
        let linear = Linear::register_with(store, name, local, outputs, w, b)?;
        Ok(RowLinear {
            linear,
            inputs,
            shard,
        })
    }

    /// `Y = Σ_r X_r·W_rᵀ + b`: the local product (plus the bias on the first rank), then an
    /// all-reduce over `group`.
    pub fn forward(&self, pass: &ForwardPass<'_>, group: &Communicator, x: &Act) -> Result<Act> {
        let y = self.linear.forward(pass, x)?;
        all_reduce(group, pass.stream(), &y)?;
        Ok(y)
    }

    /// Writes the shard's gradients (and the bias's on the first rank); with `need_dx`,
    /// returns this rank's `dX_r = dY·W_r`. No collective.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        x: &Act,
        dy: &Act,
        need_dx: bool,
    ) -> Result<Option<Act>> {
        self.linear.backward(pass, x, dy, need_dx)
    }
}

/// GPT-2's token and position embedding split over a 1D group along the channels: rank `r`
/// holds columns `r·C/P ..` of `wte` `[V, C]` and `wpe` `[maxT, C]`, looks its columns up with
/// the serial layer ([`nn::Embedding`](crate::nn::Embedding) over `C/P` channels), and one
/// all-gather (then a permute) makes the full `[N, C]` output on every rank. Backward takes the
/// rank's columns of the (replicated) output gradient: no collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding1D {
    /// This rank's columns.
    pub local: crate::nn::Embedding,
    /// The full channels `C`.
    pub channels: usize,
    /// The rank's place.
    pub shard: Shard,
}

/// What [`Embedding1D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct Embedding1DSaved {
    local: crate::nn::EmbeddingSaved,
    rows: usize,
}

impl Embedding1D {
    /// Registers `wte.weight` and `wpe.weight`, this rank's columns of the masters `wte`
    /// (`[vocab, channels]`) and `wpe` (`[max_seq, channels]`). Fails if the channels do not
    /// split over `P`.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        vocab: usize,
        max_seq: usize,
        channels: usize,
        wte: &Init,
        wpe: &Init,
        shard: Shard,
    ) -> Result<Embedding1D> {
        let local = shard.split("the embedding", "channels", channels)?;
        let first = shard.rank * local;
        let cols = move |i: usize| (i / local) * channels + first + i % local;
        let te = store.register("wte.weight", &[vocab, local], shard_init(wte, cols))?;
        let pe = store.register("wpe.weight", &[max_seq, local], shard_init(wpe, cols))?;
        Ok(Embedding1D {
            local: crate::nn::Embedding {
                wte: te,
                wpe: pe,
                vocab,
                max_seq,
                channels: local,
            },
            channels,
            shard,
        })
    }

    /// The embedding of `tokens` (`[batch·seq]`, the same on every rank): `[batch·seq, C]` on
    /// every rank, after one all-gather over `group`.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        group: &Communicator,
        tokens: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<(Act, Embedding1DSaved)> {
        let p = self.shard.size;
        let (mine, local) = self.local.forward(pass, tokens, batch, seq)?;
        let (rows, c) = (mine.rows(), self.local.channels);
        let all = Act::alloc(pass.pool(), p * rows, c, mine.dtype())?;
        group.all_gather(pass.stream(), mine.view(), all.view(), mine.dtype())?;
        drop(mine);
        // [P, N, C/P] as the heads of one sequence of N tokens: merged, [N, C]
        let out = Act::alloc(pass.pool(), rows, self.channels, all.dtype())?;
        let shape = crate::ops::heads::Heads::new(1, rows, p, c);
        crate::ops::heads::heads_merge(
            pass.device(),
            pass.stream(),
            shape,
            all.input(),
            out.view(),
            all.dtype(),
        )?;
        Ok((out, Embedding1DSaved { local, rows }))
    }

    /// Adds this rank's columns of `dout` (`[N, C]`, replicated) to the shards' gradients.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &Embedding1DSaved,
        dout: &Act,
    ) -> Result<()> {
        let (p, rows, c) = (self.shard.size, saved.rows, self.local.channels);
        dout.expect("dout", Some(rows), self.channels, pass.param_dtype())?;
        let parts = Act::alloc(pass.pool(), p * rows, c, dout.dtype())?;
        let shape = crate::ops::heads::Heads::new(1, rows, p, c);
        crate::ops::heads::heads_split(
            pass.device(),
            pass.stream(),
            shape,
            dout.input(),
            parts.view(),
            dout.dtype(),
        )?;
        let mine = Act::alloc(pass.pool(), rows, c, dout.dtype())?;
        let bytes = rows * c * dout.dtype().size();
        pass.device().copy_d2d(
            pass.stream(),
            parts.view().slice(self.shard.rank * bytes, bytes)?,
            mine.view(),
        )?;
        drop(parts);
        self.local.backward(pass, &saved.local, &mine)
    }
}

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
/// - [`OneD`]: the layout of GPT-2's [`Block`] with `c_attn` and `c_fc` column-parallel,
///   `c_proj`s row-parallel, `H/P` heads a rank, LayerNorms replicated: two all-reduces of
///   `rows × C` in forward and two in backward.
///
/// Shapes that do not divide by `P` are refused at registration.
///
/// Megatron's 1D layout as a [`Layout`]: the transformer [`Block`] split over a group of `P`
/// ranks, column linears ([`Pair::Column`], `c_attn` and `c_fc`) as [`ColumnLinear`]s, row
/// linears (the `c_proj`s) as [`RowLinear`]s, `H/P` heads a rank, LayerNorms replicated (each
/// counting `1/P` of its gradients' squared norm): two all-reduces of `rows × C` forward and
/// two backward ([`Block::collectives`](Block#method.collectives-1)). Activations are whole
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
    type LinearSaved = Act;
    type Norm = LayerNorm;
    type NormSaved = LayerNormSaved;

    fn cols(&self, features: usize) -> usize {
        features
    }

    fn heads(&self, heads: usize) -> usize {
        heads / self.shard.size.max(1)
    }

    fn check_split(&self, name: &str, channels: usize, heads: usize) -> Result<()> {
        self.shard.split(name, "heads", heads)?;
        if channels == 0 || !channels.is_multiple_of(heads) {
            return Err(Error::NotSplit {
                layer: name.to_string(),
                what: "channels",
                value: channels,
                parts: heads,
                by: "heads",
            });
        }
        Ok(())
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

    fn norm_params(norm: &LayerNorm) -> Vec<TensorId> {
        Serial::norm_params(norm)
    }

    fn linear_params(linear: &Linear1D) -> Vec<TensorId> {
        linear.linear().params()
    }

    fn norm_forward(
        &self,
        pass: &ForwardPass<'_>,
        norm: &LayerNorm,
        x: &Act,
        residual: Option<&Act>,
    ) -> Result<(Act, LayerNormSaved)> {
        Serial.norm_forward(pass, norm, x, residual)
    }

    fn norm_input(saved: &LayerNormSaved) -> &Act {
        Serial::norm_input(saved)
    }

    fn norm_backward(
        &self,
        pass: &BackwardPass<'_>,
        norm: &LayerNorm,
        saved: &LayerNormSaved,
        dy: &Act,
        dx_into: &Act,
    ) -> Result<()> {
        Serial.norm_backward(pass, norm, saved, dy, dx_into)
    }

    fn linear_forward(
        &self,
        pass: &ForwardPass<'_>,
        linear: &Linear1D,
        x: &Act,
    ) -> Result<(Act, Act)> {
        let y = match linear {
            Linear1D::Column(l) => l.forward(pass, x)?,
            Linear1D::Row(l) => l.forward(pass, &self.group, x)?,
        };
        Ok((y, x.clone()))
    }

    fn linear_backward(
        &self,
        pass: &BackwardPass<'_>,
        linear: &Linear1D,
        x: &Act,
        dy: &Act,
        uses: WeightUse,
    ) -> Result<Act> {
        let dx = match linear {
            Linear1D::Column(l) => {
                let l = ColumnLinear {
                    linear: l.linear.with_uses(uses),
                    ..*l
                };
                l.backward(pass, &self.group, x, dy, true)?
            }
            Linear1D::Row(l) => l.linear.with_uses(uses).backward(pass, x, dy, true)?,
        };
        dx.ok_or_else(|| Error::Internal {
            what: "a linear's backward asked for dx gave none".into(),
        })
    }
}

/// The cost of `[calls, bytes]` all-reduces over the tensor group forward and backward.
pub(super) fn all_reduces([fc, fb]: [u64; 2], [bc, bb]: [u64; 2]) -> Cost {
    let on_group = |calls, bytes| PassCost {
        tensor: CommStats {
            all_reduce: Tally { calls, bytes },
            ..CommStats::default()
        },
        ..PassCost::default()
    };
    Cost {
        forward: on_group(fc, fb),
        backward: on_group(bc, bb),
    }
}

impl Block<OneD> {
    /// The collectives of one forward and backward over `rows` rows of parameters of `dtype`.
    pub fn collectives(&self, rows: usize, dtype: crate::DType) -> Cost {
        let bytes = (rows * self.channels * dtype.size()) as u64;
        all_reduces([2, 2 * bytes], [2, 2 * bytes])
    }
}
