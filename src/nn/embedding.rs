//! GPT-2's token plus position embedding over the store: `out[b·T + t] = wte[tokens[b, t]] +
//! wpe[t]`.

use super::act::Act;
use super::check_param;
use crate::device::{Input, PoolBlock};
use crate::error::{Error, Result};
use crate::ops::{encoder_backward, encoder_forward, EncoderPlan, EncoderShape};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// The default initialisation's bound: a uniform of σ 0.02 (GPT-2's).
const INIT_BOUND: f32 = 0.034_641_016;

/// The token embedding `wte` `[V, C]` and the position embedding `wpe` `[maxT, C]` of GPT-2,
/// run by [`ops::encoder_forward`](crate::ops::encoder_forward) and its deterministic backward.
///
/// `wte` is usually tied to the [`LmHead`](super::LmHead): both uses add their gradient shares
/// through [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad), and the store writes
/// the sum at the last backward use. `wpe`'s gradient goes the same way (its only share is the
/// gradient), so the layer needs no knowledge of who else uses its tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding {
    /// `[vocab, channels]` (`wte.weight`).
    pub wte: TensorId,
    /// `[max_seq, channels]` (`wpe.weight`).
    pub wpe: TensorId,
    /// `V`: tokens.
    pub vocab: usize,
    /// `maxT`: the longest sequence.
    pub max_seq: usize,
    /// `C`: channels.
    pub channels: usize,
}

/// What [`Embedding::forward`] keeps for the backward: the batch's [`EncoderPlan`] (built on
/// the host from the tokens) and its words on the device.
#[derive(Debug)]
pub struct EmbeddingSaved {
    plan: EncoderPlan,
    words: PoolBlock,
    shape: EncoderShape,
    /// The position of the tokens' first column.
    first: usize,
}

impl EmbeddingSaved {
    /// The shape of the batch.
    pub fn shape(&self) -> &EncoderShape {
        &self.shape
    }
}

impl Embedding {
    /// Registers `wte.weight` `[vocab, channels]` and `wpe.weight` `[max_seq, channels]`, both
    /// with `init` (or uniform of GPT-2's σ 0.02, `±0.02·√3`, seeded by name).
    pub fn register(
        store: &mut impl ParamStore,
        vocab: usize,
        max_seq: usize,
        channels: usize,
        init: Option<Init>,
    ) -> Result<Embedding> {
        for (what, n) in [
            ("tokens", vocab),
            ("positions", max_seq),
            ("channels", channels),
        ] {
            if n == 0 {
                return Err(Error::TooFew {
                    what: format!("{what} of an embedding"),
                    got: 0,
                    need: 1,
                });
            }
        }
        if vocab > i32::MAX as usize {
            return Err(Error::TooLarge {
                what: "tokens of an embedding (token ids are i32)".into(),
                requested: vocab as u128,
                limit: i32::MAX as u64,
            });
        }
        let init_for = |name: &str| {
            init.clone().unwrap_or(Init::Uniform {
                seed: super::hash_name(name),
                lo: -INIT_BOUND,
                hi: INIT_BOUND,
            })
        };
        let wte = store.register("wte.weight", &[vocab, channels], init_for("wte.weight"))?;
        let wpe = store.register("wpe.weight", &[max_seq, channels], init_for("wpe.weight"))?;
        Ok(Embedding {
            wte,
            wpe,
            vocab,
            max_seq,
            channels,
        })
    }

    /// The parameters, in fetch order: `wte`, `wpe`.
    pub fn params(&self) -> Vec<TensorId> {
        vec![self.wte, self.wpe]
    }

    /// The op's shape for tokens from position `first` on: `wpe` seen from row `first`.
    fn shape_at(&self, batch: usize, seq: usize, first: usize) -> EncoderShape {
        EncoderShape {
            batch,
            seq,
            channels: self.channels,
            vocab: self.vocab,
            max_seq: self.max_seq - first,
        }
    }

    /// The embedding of `tokens` `[batch, seq]` (host i32, batch-major): returns `out`
    /// `[batch·seq, C]` of the store's parameter dtype and what the backward needs. A token
    /// outside `0..V` ([`Error::TokenOutOfRange`]), `seq > max_seq` ([`Error::SeqTooLong`]) or
    /// `tokens.len() ≠ batch·seq` ([`Error::Length`]) is refused before anything runs.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        tokens: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<(Act, EmbeddingSaved)> {
        self.forward_at(pass, tokens, batch, seq, 0)
    }

    /// [`Embedding::forward`] of tokens at positions `first .. first + seq` of their
    /// sequences (a sequence-parallel rank's block): row `b·seq + t` gets `wpe[first + t]`.
    /// `first + seq` must not pass `max_seq`.
    pub fn forward_at(
        &self,
        pass: &ForwardPass<'_>,
        tokens: &[i32],
        batch: usize,
        seq: usize,
        first: usize,
    ) -> Result<(Act, EmbeddingSaved)> {
        let Some(rows) = batch.checked_mul(seq) else {
            return Err(Error::Overflow {
                what: format!("the tokens of a batch of {batch} × {seq}"),
            });
        };
        if rows == 0 {
            return Err(Error::Empty {
                what: format!("an embedding's batch of {batch} × {seq} tokens"),
            });
        }
        if rows != tokens.len() {
            return Err(Error::Length {
                what: format!("tokens for a batch of {batch} × {seq}"),
                got: tokens.len(),
                expected: rows,
            });
        }
        if first.checked_add(seq).is_none_or(|l| l > self.max_seq) {
            // positions `first .. first + seq`
            return Err(Error::SeqTooLong {
                seq: first.saturating_add(seq),
                max: self.max_seq,
            });
        }
        // checks every token against the vocabulary
        let plan = EncoderPlan::new(tokens, self.vocab)?;
        let (dev, s, pool, d) = (
            pass.device(),
            pass.stream(),
            pass.pool(),
            pass.param_dtype(),
        );
        let g = pass.fetch(&self.params())?;
        check_param(&g, 0, &[self.vocab, self.channels], d)?;
        check_param(&g, 1, &[self.max_seq, self.channels], d)?;
        let tok = pass.upload(bytemuck::cast_slice(tokens))?;
        let words = pass.upload(bytemuck::cast_slice(&plan.to_words()))?;
        let out = Act::alloc(pool, tokens.len(), self.channels, d)?;
        let shape = self.shape_at(batch, seq, first);
        let tok_view = tok.view(0, tokens.len() * 4)?;
        // wpe from row `first` on
        let row = self.channels * d.size();
        let wpe = Input::from(g.param(1)?).slice(first * row, shape.max_seq * row)?;
        encoder_forward(dev, s, tok_view, g.param(0)?, wpe, out.view(), &shape, d)?;
        let saved = EmbeddingSaved {
            plan,
            words,
            shape,
            first,
        };
        Ok((out, saved))
    }

    /// The backward of [`Embedding::forward`] from the output's gradient `dout`
    /// `[batch·seq, C]`: `dwte` and `dwpe` are summed into zeroed pool buffers of the parameter
    /// dtype, then added through [`Guard::accumulate_grad`](crate::store::Guard::accumulate_grad)
    /// (the LM head's share of `wte` goes the same way, in either order).
    pub fn backward(
        &self,
        pass: &BackwardPass<'_>,
        saved: &EmbeddingSaved,
        dout: &Act,
    ) -> Result<()> {
        self.backward_to(pass, saved, dout, false).map(drop)
    }

    /// [`Embedding::backward`] with `wte`'s share returned (`[V, C]`, the parameter dtype)
    /// instead of added to the store (`wpe`'s is added): for a `wte` whose shares are summed
    /// elsewhere (tied across pipeline stages).
    pub fn backward_returning(
        &self,
        pass: &BackwardPass<'_>,
        saved: &EmbeddingSaved,
        dout: &Act,
    ) -> Result<PoolBlock> {
        self.backward_to(pass, saved, dout, true)
    }

    fn backward_to(
        &self,
        pass: &BackwardPass<'_>,
        saved: &EmbeddingSaved,
        dout: &Act,
        keep_wte: bool,
    ) -> Result<PoolBlock> {
        let (dev, s, pool, d) = (
            pass.device(),
            pass.stream(),
            pass.pool(),
            pass.param_dtype(),
        );
        let sh = &saved.shape;
        dout.expect("dout", Some(sh.batch * sh.seq), self.channels, d)?;
        if *sh != self.shape_at(sh.batch, sh.seq, saved.first) {
            return Err(Error::SavedMismatch {
                layer: "an embedding".into(),
            });
        }
        let g = pass.fetch(&self.params())?;
        check_param(&g, 0, &[self.vocab, self.channels], d)?;
        check_param(&g, 1, &[self.max_seq, self.channels], d)?;
        let te_bytes = self.vocab * self.channels * d.size();
        let pe_bytes = self.max_seq * self.channels * d.size();
        let dwte = pool.alloc(te_bytes)?;
        let dwpe = pool.alloc(pe_bytes)?;
        let (te, pe) = (dwte.view(0, te_bytes)?, dwpe.view(0, pe_bytes)?);
        dev.memset(s, te, 0)?;
        dev.memset(s, pe, 0)?;
        let words = saved.words.view(0, saved.plan.words() * 4)?;
        let row = self.channels * d.size();
        let pe_at = pe.slice(saved.first * row, sh.max_seq * row)?;
        encoder_backward(dev, s, dout.input(), &saved.plan, words, te, pe_at, sh, d)?;
        if !keep_wte {
            g.accumulate_grad(0, te, d)?;
        }
        g.accumulate_grad(1, pe, d)?;
        Ok(dwte)
    }
}
