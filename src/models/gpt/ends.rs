//! The two ends of a GPT: the token and position embedding (on the first stage) and `ln_f`
//! with the LM head tied to `wte` (on the last), whole on every rank or split over the tensor
//! group as the layout splits them ([`Layout::Embedding`], [`Layout::Head`]).

use super::{GptConfig, IGNORE_INDEX};
use crate::device::PoolBlock;
use crate::error::{Error, Result};
use crate::nn::{
    Act, Embedding, EmbeddingOn, EmbeddingSaved, HeadOn, LayerNorm, LayerNormSaved, Layout, LmHead,
    LmHeadSaved, Loss, WeightUse,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// The ends a model (or a pipeline stage) holds, on its layout.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Ends<L: Layout> {
    pub(super) layout: L,
    pub(super) embedding: Option<Embed<L>>,
    pub(super) head: Option<Head<L>>,
}

/// The embedding: `wte` and `wpe`, whole or split by the layout.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Embed<L: Layout> {
    Whole(Embedding),
    Split(L::Embedding),
}

/// `ln_f` and the head over a copy of `wte`, whole or split by the layout.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Head<L: Layout> {
    Whole { ln_f: LayerNorm, head: LmHead },
    Split(L::Head),
}

/// What the embedding keeps for its backward.
#[allow(clippy::large_enum_variant)] // one a micro-batch, not worth a box
pub(super) enum EmbKept<L: Layout> {
    Whole(EmbeddingSaved),
    Split(<L::Embedding as EmbeddingOn<L>>::Saved),
}

/// What `ln_f` and the head keep for their backward.
#[allow(clippy::large_enum_variant)] // one a micro-batch, not worth a box
pub(super) enum HeadKept<L: Layout> {
    Whole(LayerNormSaved, LmHeadSaved),
    Split(<L::Head as HeadOn<L>>::Saved),
}

/// What happens to a tied `wte`'s gradient share: added to the store as it comes, or handed
/// to `keep` (a pipeline's end stages sum their shares over the step apart from the slot).
pub(super) type Keep<'a> = Option<&'a dyn Fn(&BackwardPass<'_>, &PoolBlock) -> Result<()>>;

/// The ends' saved state of another kind (whole or split).
fn mismatch() -> Error {
    Error::SavedMismatch {
        layer: "the GPT ends".into(),
    }
}

/// A stage without the end it is asked to run.
fn absent(what: &'static str, registered: &str) -> Error {
    Error::WrongPlace {
        what,
        registered: registered.into(),
        run: "on a stage that holds none".into(),
    }
}

/// The masters' values and the registration of the ends, as [`Gpt::register_on`] runs it.
pub(super) struct EndsInit<'a> {
    pub(super) cfg: &'a GptConfig,
    pub(super) master: &'a dyn Fn(&str) -> Init,
    /// How often `wpe` is used a step.
    pub(super) uses: WeightUse,
    /// The norm share of a parameter every rank of the tensor group holds.
    pub(super) replicated: f64,
    /// `wte`'s copies (2 in a pipeline).
    pub(super) copies: f64,
}

impl EndsInit<'_> {
    /// Registers whole ends' `wte` (on an end stage: before the blocks), named in `params`.
    pub(super) fn whole_wte(
        &self,
        store: &mut impl ParamStore,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<TensorId> {
        let id = self.named(
            store,
            params,
            "wte.weight",
            &[self.cfg.vocab, self.cfg.channels],
        )?;
        store.set_norm_share(id, self.replicated / self.copies)?;
        Ok(id)
    }

    /// Registers the embedding (`wpe` beside the whole `wte`, or both split), each named in
    /// `params`.
    pub(super) fn embedding<L: Layout>(
        &self,
        store: &mut impl ParamStore,
        layout: &L,
        wte: Option<TensorId>,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<Embed<L>> {
        let (cfg, m) = (self.cfg, self.master);
        let names = ["wte.weight", "wpe.weight"];
        let Some(wte) = wte else {
            let dims = [cfg.vocab, cfg.max_seq, cfg.channels];
            let inits = names.map(m);
            let e = layout.register_embedding(store, dims, [&inits[0], &inits[1]], self.uses)?;
            let ids = e.params();
            store.set_norm_share(ids[0], layout.wte_share() / self.copies)?;
            params.extend(names.into_iter().map(String::from).zip(ids));
            return Ok(Embed::Split(e));
        };
        let wpe = self.named(store, params, "wpe.weight", &[cfg.max_seq, cfg.channels])?;
        store.set_norm_share(wpe, self.replicated)?;
        Ok(Embed::Whole(Embedding {
            wte,
            wpe,
            vocab: cfg.vocab,
            max_seq: cfg.max_seq,
            channels: cfg.channels,
        }))
    }

    /// Registers `ln_f` and the head: whole, tied to the whole `wte`; split, tied to
    /// `embedding`'s `wte` part or to a part of its own registered first. Each named in
    /// `params`.
    pub(super) fn head<L: Layout>(
        &self,
        store: &mut impl ParamStore,
        layout: &L,
        (embedding, wte): (Option<&Embed<L>>, Option<TensorId>),
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<Head<L>> {
        let (cfg, m) = (self.cfg, self.master);
        let (c, v) = (cfg.channels, cfg.vocab);
        let Some(wte) = wte else {
            let tied = match embedding {
                Some(Embed::Split(e)) => Some(e),
                None => None,
                Some(Embed::Whole(_)) => return Err(mismatch()),
            };
            let [te, g, b] = ["wte.weight", "ln_f.weight", "ln_f.bias"].map(m);
            let h =
                layout.register_head(store, [v, c], cfg.eps, [&te, &g, &b], IGNORE_INDEX, tied)?;
            let [gamma, beta, wte] = h.params();
            if tied.is_none() {
                store.set_norm_share(wte, layout.wte_share() / self.copies)?;
                params.push(("wte.weight".into(), wte));
            }
            params.push(("ln_f.weight".into(), gamma));
            params.push(("ln_f.bias".into(), beta));
            return Ok(Head::Split(h));
        };
        let gamma = self.named(store, params, "ln_f.weight", &[c])?;
        let beta = self.named(store, params, "ln_f.bias", &[c])?;
        for id in [gamma, beta] {
            store.set_norm_share(id, self.replicated)?;
        }
        let ln_f = LayerNorm {
            gamma,
            beta,
            cols: c,
            eps: cfg.eps,
        };
        let head = LmHead::tied(&*store, wte, IGNORE_INDEX)?;
        Ok(Head::Whole { ln_f, head })
    }

    /// Registers `name` of `shape` whole with its master, named in `params`.
    fn named(
        &self,
        store: &mut impl ParamStore,
        params: &mut Vec<(String, TensorId)>,
        name: &str,
        shape: &[usize],
    ) -> Result<TensorId> {
        let id = store.register(name, shape, (self.master)(name))?;
        params.push((name.to_string(), id));
        Ok(id)
    }
}

impl<L: Layout> Ends<L> {
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
            Some(Head::Split(h)) => h.params().to_vec(),
            None => Vec::new(),
        };
        (first, last)
    }

    /// This end's copy of `wte` (its part, split): the embedding's, else the head's.
    pub(super) fn wte(&self) -> Option<TensorId> {
        let (first, last) = self.params();
        first.first().or(last.last()).copied()
    }

    /// The embedding of `tokens` at positions `first .. first + seq` of their sequences, in
    /// the blocks' layout.
    pub(super) fn embed(
        &self,
        fwd: &ForwardPass<'_>,
        tokens: &[i32],
        [batch, seq, first]: [usize; 3],
    ) -> Result<(Act, EmbKept<L>)> {
        match &self.embedding {
            Some(Embed::Whole(e)) => {
                let (x, s) = e.forward_at(fwd, tokens, batch, seq, first)?;
                Ok((self.layout.to_tile(fwd, x)?, EmbKept::Whole(s)))
            }
            Some(Embed::Split(e)) => {
                let (x, s) = e.forward(&self.layout, fwd, tokens, [batch, seq, first])?;
                Ok((x, EmbKept::Split(s)))
            }
            None => Err(absent("a GPT's embedding", "on the first pipeline stage")),
        }
    }

    /// `ln_f` and the head on the last block's output: the mean loss over the batch, the
    /// loss gradient kept scaled by `scale`.
    pub(super) fn head_forward(
        &self,
        fwd: &ForwardPass<'_>,
        x: Act,
        targets: &[i32],
        scale: f32,
    ) -> Result<(Loss, HeadKept<L>)> {
        match &self.head {
            Some(Head::Whole { ln_f, head }) => {
                let full = self.layout.to_full(fwd, x)?;
                let (h, ln) = ln_f.forward(fwd, &full, None)?;
                drop(full);
                let (loss, hs) = head.forward_deferred(fwd, &h, targets, scale)?;
                Ok((loss, HeadKept::Whole(ln, hs)))
            }
            Some(Head::Split(h)) => {
                let (loss, k) = h.forward(&self.layout, fwd, &x, targets, scale)?;
                Ok((Loss::ready(loss), HeadKept::Split(k)))
            }
            None => Err(absent("a GPT's head", "on the last pipeline stage")),
        }
    }

    /// The gradient of the last block's output, from what the head kept; `wte`'s share as
    /// `keep` says (a split head adds it to the store's sum).
    pub(super) fn head_backward(
        &self,
        bwd: &BackwardPass<'_>,
        kept: HeadKept<L>,
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
                self.layout.to_tile(bwd, dfull)
            }
            (Some(Head::Split(h)), HeadKept::Split(k)) => h.backward(&self.layout, bwd, k),
            _ => Err(mismatch()),
        }
    }

    /// The embeddings' gradients from the first block's input gradient `dx`; `wte`'s share
    /// as `keep` says (a split embedding adds it to the store's sum).
    pub(super) fn embed_backward(
        &self,
        bwd: &BackwardPass<'_>,
        kept: EmbKept<L>,
        dx: Act,
        keep: Keep<'_>,
    ) -> Result<()> {
        match (&self.embedding, kept) {
            (Some(Embed::Whole(e)), EmbKept::Whole(s)) => {
                let dfull = self.layout.to_full(bwd, dx)?;
                match keep {
                    Some(keep) => keep(bwd, &e.backward_returning(bwd, &s, &dfull)?),
                    None => e.backward(bwd, &s, &dfull),
                }
            }
            (Some(Embed::Split(e)), EmbKept::Split(k)) => e.backward(&self.layout, bwd, k, &dx),
            _ => Err(mismatch()),
        }
    }
}
