use serde::Serialize;

use super::{Cost, PassCost};
use crate::comm::{CommStats, Communicator, ReduceOp, Tally};
use crate::error::{Error, Result};
use crate::nn::{Act, Linear};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::Init;

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
    pub(crate) fn split(&self, layer: &str, what: &'static str, n: usize) -> Result<usize> {
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

/// A column-parallel linear layer (see [`OneD`](crate::parallel::OneD)).
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

/// A row-parallel linear layer (see [`OneD`](crate::parallel::OneD)).
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
