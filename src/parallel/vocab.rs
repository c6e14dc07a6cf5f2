use super::one_d::Shard;
use super::{BatchRows, ShardedCrossEntropy};
use crate::comm::{Communicator, ReduceOp};
use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Act, Linear, WeightUse};
use crate::ops::{
    add_in_place, check_targets, vocab_embedding_backward, vocab_embedding_forward, Axpby,
    VocabPlan, VocabShard,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// The vocabulary split over a 1D group (Megatron's): the token embedding and the LM head tied
/// to it, each rank holding the rows `VocabShard::of_rank` gives it of `wte`.
///
/// - [`VocabEmbedding1D`]: a masked lookup of the rank's rows
///   ([`crate::ops::vocab_embedding_forward`]), summed over the group
///   by one all-reduce, plus the replicated position embedding. Backward writes the rank's rows'
///   gradient; no collective.
/// - [`VocabHead1D`]: `logits_r = h·wte_rᵀ` (`[N, V_r]`), then the cross-entropy over the whole
///   vocabulary ([`ShardedCrossEntropy`]: three steps around all-reduces of `N` f32 each).
///   Backward: `dh = Σ_r dlogits_r·wte_r`, one all-reduce of `N × C`.
///
/// The token embedding with the vocabulary split over a 1D group, and the position embedding
/// replicated (see [`VocabEmbedding1D`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabEmbedding1D {
    /// This rank's rows of `wte` (`[V_r, C]`, `wte.weight`).
    pub wte: TensorId,
    /// `wpe` `[maxT, C]`, whole on every rank.
    pub wpe: TensorId,
    /// The rows this rank owns.
    pub vocab: VocabShard,
    /// `maxT`.
    pub max_seq: usize,
    /// `C`.
    pub channels: usize,
    /// The rank's place.
    pub shard: Shard,
}

/// What [`VocabEmbedding1D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct VocabEmbedding1DSaved {
    tokens: VocabPlan,
    token_words: PoolBlock,
    positions: VocabPlan,
    position_words: PoolBlock,
}

impl VocabEmbedding1D {
    /// Registers `wte.weight` (this rank's rows of the master `[vocab, channels]`) and
    /// `wpe.weight` (`[max_seq, channels]`, whole). Uneven shards are fine (`V` need not
    /// divide by `P`).
    pub fn register(
        store: &mut impl ParamStore,
        vocab: usize,
        max_seq: usize,
        channels: usize,
        wte: &Init,
        wpe: &Init,
        shard: Shard,
    ) -> Result<VocabEmbedding1D> {
        if channels == 0 || max_seq == 0 {
            return Err(Error::TooFew {
                what: format!(
                    "the smaller of a vocab-parallel embedding's {channels} channels and \
                     {max_seq} positions"
                ),
                got: 0,
                need: 1,
            });
        }
        if max_seq > i32::MAX as usize {
            return Err(Error::TooLarge {
                what: "positions of a vocab-parallel embedding (position ids are i32)".into(),
                requested: max_seq as u128,
                limit: i32::MAX as u64,
            });
        }
        let (te, vs) = register_rows(store, vocab, channels, wte, shard)?;
        let pe = store.register("wpe.weight", &[max_seq, channels], wpe.clone())?;
        Ok(VocabEmbedding1D {
            wte: te,
            wpe: pe,
            vocab: vs,
            max_seq,
            channels,
            shard,
        })
    }

    /// The embedding of `tokens` (`[batch·seq]`, the same on every rank): `[batch·seq, C]`,
    /// the same on every rank, after one all-reduce over `group`. Tokens are checked on the
    /// host before anything runs.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        group: &Communicator,
        tokens: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<(Act, VocabEmbedding1DSaved)> {
        self.forward_at(pass, group, tokens, batch, seq, 0)
    }

    /// [`VocabEmbedding1D::forward`] of tokens at positions `first .. first + seq` of their
    /// sequences (a sequence-parallel rank's block).
    pub(crate) fn forward_at(
        &self,
        pass: &ForwardPass<'_>,
        group: &Communicator,
        tokens: &[i32],
        batch: usize,
        seq: usize,
        first: usize,
    ) -> Result<(Act, VocabEmbedding1DSaved)> {
        let last = first.checked_add(seq);
        match batch.checked_mul(seq) {
            None => {
                return Err(Error::Overflow {
                    what: format!("the tokens of a batch of {batch} × {seq}"),
                })
            }
            Some(n) if n != tokens.len() => {
                return Err(Error::Length {
                    what: format!("tokens for a batch of {batch} × {seq}"),
                    got: tokens.len(),
                    expected: n,
                })
            }
            Some(_) => {}
        }
        if tokens.is_empty() {
            return Err(Error::Empty {
                what: format!("a batch of {batch} × {seq} tokens"),
            });
        }
        if last.is_none_or(|l| l > self.max_seq) {
            return Err(Error::TooLarge {
                what: format!(
                    "the end of {seq} positions from position {first} of a vocab-parallel \
                     embedding"
                ),
                requested: last.map_or(u128::MAX, |l| l as u128),
                limit: self.max_seq as u64,
            });
        }
        check_shard("a vocab-parallel embedding", self.shard, group)?;
        let plan = VocabPlan::new(tokens, &self.vocab)?;
        let pos: Vec<i32> = (0..tokens.len())
            .map(|n| (first + n % seq) as i32)
            .collect();
        let all_positions = VocabShard::new(self.max_seq, 0, self.max_seq)?;
        let pos_plan = VocabPlan::new(&pos, &all_positions)?;
        let (dev, s, d, c) = (
            pass.device(),
            pass.stream(),
            pass.param_dtype(),
            self.channels,
        );
        let g = pass.fetch(&[self.wte, self.wpe])?;
        let tok = pass.upload(bytemuck::cast_slice(tokens))?;
        let pos_dev = pass.upload(bytemuck::cast_slice(&pos))?;
        let n = tokens.len();
        let out = Act::alloc(pass.pool(), n, c, d)?;
        let pe = Act::alloc(pass.pool(), n, c, d)?;
        let (tv, pv) = (tok.view(0, n * 4)?, pos_dev.view(0, n * 4)?);
        vocab_embedding_forward(dev, s, tv, g.param(0)?, out.view(), &self.vocab, c, d)?;
        vocab_embedding_forward(dev, s, pv, g.param(1)?, pe.view(), &all_positions, c, d)?;
        drop(g);
        group.all_reduce(s, out.view(), out.view(), d, ReduceOp::Sum)?;
        let one = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        add_in_place(dev, s, one, out.view(), pe.input(), d)?;
        let token_words = pass.upload(bytemuck::cast_slice(&plan.to_words()))?;
        let position_words = pass.upload(bytemuck::cast_slice(&pos_plan.to_words()))?;
        Ok((
            out,
            VocabEmbedding1DSaved {
                tokens: plan,
                token_words,
                positions: pos_plan,
                position_words,
            },
        ))
    }

    /// Adds the gradients of this rank's `wte` rows and of `wpe` from `dout` (`[N, C]`, the
    /// same on every rank) through
    /// [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad) (so the tied head's share
    /// adds to `wte`'s); no collective.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &VocabEmbedding1DSaved,
        dout: &Act,
    ) -> Result<()> {
        let (dev, s, d, c) = (
            pass.device(),
            pass.stream(),
            pass.param_dtype(),
            self.channels,
        );
        dout.expect("dout", Some(saved.tokens.positions()), c, d)?;
        let g = pass.fetch(&[self.wte, self.wpe])?;
        let parts = [
            (&saved.tokens, &saved.token_words, self.vocab.rows),
            (&saved.positions, &saved.position_words, self.max_seq),
        ];
        for (i, (plan, words, rows)) in parts.into_iter().enumerate() {
            let bytes = rows * c * d.size();
            let buf = pass.pool().alloc(bytes)?;
            let wv = words.view(0, plan.words() * 4)?;
            vocab_embedding_backward(
                dev,
                s,
                dout.input(),
                plan,
                wv,
                buf.view(0, bytes)?,
                c,
                false,
                d,
            )?;
            g.accumulate_grad(i, buf.view(0, bytes)?, d)?;
        }
        Ok(())
    }
}

/// The LM head tied to a [`VocabEmbedding1D`]'s `wte` rows, fused with the cross-entropy over
/// the whole vocabulary (see [`VocabEmbedding1D`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabHead1D {
    /// The projection over this rank's `wte` rows (a shared weight: two uses).
    pub proj: Linear,
    /// The rows this rank owns.
    pub vocab: VocabShard,
    /// Targets equal to it count for nothing.
    pub ignore_index: i32,
    /// The rank's place.
    pub shard: Shard,
}

/// What [`VocabHead1D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct VocabHead1DSaved {
    h: Act,
    dlogits: Act,
}

/// Registers `wte.weight`, this rank's rows of the master `[vocab, channels]`.
fn register_rows(
    store: &mut impl ParamStore,
    vocab: usize,
    channels: usize,
    wte: &Init,
    shard: Shard,
) -> Result<(TensorId, VocabShard)> {
    let vs = VocabShard::of_rank(vocab, shard.rank, shard.size)?;
    if channels == 0 {
        return Err(Error::TooFew {
            what: "channels of a vocab-parallel embedding".into(),
            got: 0,
            need: 1,
        });
    }
    let (first, master) = (vs.start * channels, wte.clone());
    let rows = Init::Fn(std::sync::Arc::new(move |i| master.value(first + i)));
    let id = store.register("wte.weight", &[vs.rows, channels], rows)?;
    Ok((id, vs))
}

impl VocabHead1D {
    /// A head over its own copy of `wte`'s rows: registers `wte.weight`, this rank's rows of
    /// the master `[vocab, channels]` (the rows [`VocabEmbedding1D::register`] gives the same
    /// rank), for a model whose embedding lives elsewhere (a pipeline's last stage).
    pub fn register(
        store: &mut impl ParamStore,
        vocab: usize,
        channels: usize,
        wte: &Init,
        ignore_index: i32,
        shard: Shard,
    ) -> Result<VocabHead1D> {
        let (id, vs) = register_rows(store, vocab, channels, wte, shard)?;
        Ok(VocabHead1D {
            proj: Linear::from_ids(store, id, None, WeightUse::Shared)?,
            vocab: vs,
            ignore_index,
            shard,
        })
    }

    /// The head over `emb`'s `wte` rows.
    pub fn tied(
        store: &impl ParamStore,
        emb: &VocabEmbedding1D,
        ignore_index: i32,
    ) -> Result<VocabHead1D> {
        Ok(VocabHead1D {
            proj: Linear::from_ids(store, emb.wte, None, WeightUse::Shared)?,
            vocab: emb.vocab,
            ignore_index,
            shard: emb.shard,
        })
    }

    /// The mean cross-entropy over the rows whose target is not the ignore index, of `h`
    /// (`[N, C]`, the same on every rank) against `targets` (host i32, the whole vocabulary's
    /// ids); the gradient kept for the backward is scaled by `scale` (a loss scale). Targets
    /// are checked on the host before anything runs; every rank gets the same loss.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        group: &Communicator,
        h: &Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(f32, VocabHead1DSaved)> {
        let n = targets.len();
        h.expect("h", Some(n), self.proj.inputs, pass.param_dtype())?;
        check_targets(targets, self.vocab.vocab, self.ignore_index)?;
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(Error::BadValue {
                what: "the loss scale of a vocab-parallel head".into(),
                value: f64::from(scale),
                want: "finite and above 0",
            });
        }
        check_shard("a vocab-parallel head", self.shard, group)?;
        let ce = ShardedCrossEntropy {
            classes: self.vocab,
            ignore_index: self.ignore_index,
        };
        let logits = self.proj.forward(pass, h)?;
        let rows = BatchRows {
            targets,
            first: 0,
            owners: None,
        };
        let loss = ce.batch_mean(pass, group, &logits, rows, scale)?;
        Ok((
            loss,
            VocabHead1DSaved {
                h: h.clone(),
                dlogits: logits,
            },
        ))
    }

    /// `dh` (`[N, C]`, the same on every rank, after one all-reduce over `group`); adds this
    /// rank's share of its `wte` rows' gradient.
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        group: &Communicator,
        saved: &VocabHead1DSaved,
    ) -> Result<Act> {
        let dh = self
            .proj
            .backward(pass, &saved.h, &saved.dlogits, true)?
            .ok_or_else(|| Error::Internal {
                what: "the vocab-parallel head's linear asked for dh gave none".into(),
            })?;
        group.all_reduce(
            pass.stream(),
            dh.view(),
            dh.view(),
            dh.dtype(),
            ReduceOp::Sum,
        )?;
        Ok(dh)
    }
}

/// An untied classifier over a 1D group: a [`ColumnLinear`](super::ColumnLinear) to this rank's
/// block of the classes (`classes` must split over the group), then
/// [`ShardedCrossEntropy`] over the group, the loss the mean over the rows not ignored.
/// Backward: the shard's weight and bias gradients, and `dX` all-reduced over the group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Classifier1D {
    /// The projection to this rank's classes.
    pub proj: super::ColumnLinear,
    /// Targets equal to it count for nothing.
    pub ignore_index: i32,
}

/// What [`Classifier1D::forward`] keeps for the backward.
#[derive(Debug)]
pub struct Classifier1DSaved {
    x: Act,
    dlogits: Act,
}

impl Classifier1D {
    /// Registers `{name}.weight` (this rank's rows of the master `[classes, inputs]`) and,
    /// with `bias`, `{name}.bias`. Fails when `classes` does not split over the group.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        store: &mut impl ParamStore,
        name: &str,
        inputs: usize,
        classes: usize,
        weight: &Init,
        bias: Option<&Init>,
        ignore_index: i32,
        shard: Shard,
    ) -> Result<Classifier1D> {
        let proj =
            super::ColumnLinear::register(store, name, inputs, classes, 1, weight, bias, shard)?;
        Ok(Classifier1D { proj, ignore_index })
    }

    /// The classes this rank holds.
    pub(crate) fn classes(&self) -> Result<VocabShard> {
        let s = self.proj.shard;
        let rows = self.proj.outputs / s.size;
        VocabShard::new(self.proj.outputs, s.rank * rows, rows)
    }

    /// The mean cross-entropy of `x` (`[N, inputs]`, the same on every rank) against `targets`
    /// (host, `N` class ids); the gradient kept is scaled by `loss_scale`. Every rank gets the
    /// same loss. Targets and the scale are checked on the host before anything runs.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        group: &Communicator,
        x: &Act,
        targets: &[i32],
        loss_scale: f32,
    ) -> Result<(f32, Classifier1DSaved)> {
        let n = targets.len();
        x.expect("x", Some(n), self.proj.linear.inputs, pass.param_dtype())?;
        check_targets(targets, self.proj.outputs, self.ignore_index)?;
        if !(loss_scale > 0.0 && loss_scale.is_finite()) {
            return Err(Error::BadValue {
                what: "the loss scale of a 1D classifier".into(),
                value: f64::from(loss_scale),
                want: "finite and above 0",
            });
        }
        check_shard("a 1D classifier", self.proj.shard, group)?;
        let ce = ShardedCrossEntropy {
            classes: self.classes()?,
            ignore_index: self.ignore_index,
        };
        let logits = self.proj.forward(pass, x)?;
        let rows = BatchRows {
            targets,
            first: 0,
            owners: None,
        };
        let loss = ce.batch_mean(pass, group, &logits, rows, loss_scale)?;
        let saved = Classifier1DSaved {
            x: x.clone(),
            dlogits: logits,
        };
        Ok((loss, saved))
    }

    /// The collectives of one forward and backward over `rows` rows of `dtype`: forward two
    /// all-reduces of `rows` and `2·rows` f32 (the row max, then the sums and target logits),
    /// backward one of `dX` (`rows × inputs`).
    pub fn collectives(&self, rows: usize, dtype: DType) -> super::Cost {
        let dx = (rows * self.proj.linear.inputs * dtype.size()) as u64;
        super::one_d::all_reduces([2, (3 * rows * 4) as u64], [1, dx])
    }

    /// Writes the shard's gradients and returns `dX` (`[N, inputs]`, all-reduced over the
    /// group).
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        group: &Communicator,
        saved: &Classifier1DSaved,
    ) -> Result<Act> {
        self.proj
            .backward(pass, group, &saved.x, &saved.dlogits, true)?
            .ok_or_else(|| Error::Internal {
                what: "the 1D classifier's linear asked for dX gave none".into(),
            })
    }
}

/// [`Error::WrongPlace`] when `group` is not the place of `shard`, where `what` was registered.
fn check_shard(what: &'static str, shard: Shard, group: &Communicator) -> Result<()> {
    let here = Shard::of(group);
    if here != shard {
        return Err(Error::WrongPlace {
            what,
            registered: format!("for rank {} of {}", shard.rank, shard.size),
            run: format!("on rank {} of {}", here.rank, here.size),
        });
    }
    Ok(())
}
