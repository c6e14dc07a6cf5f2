//! GPT-2's variant ([`Gpt2`]): its block ([`Block`]) and its two ends, the token and
//! position embedding (on the first stage) and `ln_f` with the LM head tied to `wte` (on the
//! last), whole on every rank or split over the tensor group as the layout splits them
//! ([`Layout::Embedding`], [`Layout::Head`]).

use super::variant::{ModelEnds, RegisterAt, Tie, Variant};
use super::{GptConfig, IGNORE_INDEX};
use crate::error::{Error, Result};
use crate::nn::{
    Act, Block, Embedding, EmbeddingOn, EmbeddingSaved, HeadOn, LayerNorm, LayerNormSaved, Layout,
    LmHead, LmHeadSaved, Loss, WeightUse,
};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::TensorId;

/// GPT-2: pre-LayerNorm blocks ([`Block`]) between the token and position embedding and
/// `ln_f` with the LM head tied to `wte`. The default variant of [`Gpt`](super::Gpt).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gpt2;

/// GPT-2's ends a model (or a pipeline stage) holds, on its layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Ends<L: Layout> {
    layout: L,
    /// Whole ends' `wte` on an end stage (registered before the blocks).
    wte: Option<TensorId>,
    embedding: Option<Embed<L>>,
    head: Option<Head<L>>,
}

/// The embedding: `wte` and `wpe`, whole or split by the layout.
#[derive(Clone, Debug, PartialEq)]
enum Embed<L: Layout> {
    Whole(Embedding),
    Split(L::Embedding),
}

/// `ln_f` and the head over a copy of `wte`, whole or split by the layout.
#[derive(Clone, Debug, PartialEq)]
enum Head<L: Layout> {
    Whole { ln_f: LayerNorm, head: LmHead },
    Split(L::Head),
}

/// What the embedding keeps for its backward.
#[allow(clippy::large_enum_variant)] // one a micro-batch, not worth a box
pub enum EmbKept<L: Layout> {
    Whole(EmbeddingSaved),
    Split(<L::Embedding as EmbeddingOn<L>>::Saved),
}

/// What `ln_f` and the head keep for their backward.
#[allow(clippy::large_enum_variant)] // one a micro-batch, not worth a box
pub enum HeadKept<L: Layout> {
    Whole(LayerNormSaved, LmHeadSaved),
    Split(<L::Head as HeadOn<L>>::Saved),
}

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

impl Variant for Gpt2 {
    type Block<L: Layout> = Block<L>;
    type Ends<L: Layout> = Ends<L>;

    fn param_shapes(&self, cfg: &GptConfig) -> Vec<(String, Vec<usize>)> {
        cfg.param_shapes()
    }

    fn register_block<L: Layout, S: ParamStore>(
        &self,
        store: &mut S,
        layout: L,
        name: &str,
        at: &RegisterAt<'_>,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<Block<L>> {
        let (cfg, shape) = (at.cfg, [at.cfg.channels, at.cfg.heads]);
        let b = Block::register(store, layout, name, shape, cfg.eps, at.master)?;
        params.extend(b.named_params(name));
        Ok(match at.uses {
            WeightUse::Once => b,
            WeightUse::Shared => b.shared(),
        })
    }

    /// Whole ends' `wte` on an end stage, then the embedding on the first (`wpe` beside the
    /// whole `wte`, or both split).
    fn register_first<L: Layout, S: ParamStore>(
        &self,
        store: &mut S,
        at: &RegisterAt<'_>,
        layout: L,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<Ends<L>> {
        let (cfg, m) = (at.cfg, at.master);
        let [first, last] = at.ends;
        let wte = match !at.split && (first || last) {
            true => {
                let id = named(store, at, params, "wte.weight", &[cfg.vocab, cfg.channels])?;
                store.set_norm_share(id, at.replicated / at.copies)?;
                Some(id)
            }
            false => None,
        };
        let mut ends = Ends {
            layout,
            wte,
            embedding: None,
            head: None,
        };
        if !first {
            return Ok(ends);
        }
        let names = ["wte.weight", "wpe.weight"];
        let Some(wte) = wte else {
            let dims = [cfg.vocab, cfg.max_seq, cfg.channels];
            let inits = names.map(m);
            let layout = &ends.layout;
            let e = layout.register_embedding(store, dims, [&inits[0], &inits[1]], at.uses)?;
            let ids = e.params();
            store.set_norm_share(ids[0], layout.wte_share() / at.copies)?;
            params.extend(names.into_iter().map(String::from).zip(ids));
            ends.embedding = Some(Embed::Split(e));
            return Ok(ends);
        };
        let wpe = named(
            store,
            at,
            params,
            "wpe.weight",
            &[cfg.max_seq, cfg.channels],
        )?;
        store.set_norm_share(wpe, at.replicated)?;
        ends.embedding = Some(Embed::Whole(Embedding {
            wte,
            wpe,
            vocab: cfg.vocab,
            max_seq: cfg.max_seq,
            channels: cfg.channels,
        }));
        Ok(ends)
    }

    /// `ln_f` and the head on the last stage: whole, tied to the whole `wte`; split, tied to
    /// the embedding's `wte` part or to a part of its own registered first.
    fn register_last<L: Layout, S: ParamStore>(
        &self,
        ends: &mut Ends<L>,
        store: &mut S,
        at: &RegisterAt<'_>,
        params: &mut Vec<(String, TensorId)>,
    ) -> Result<()> {
        if !at.ends[1] {
            return Ok(());
        }
        let (cfg, m) = (at.cfg, at.master);
        let (c, v) = (cfg.channels, cfg.vocab);
        let Some(wte) = ends.wte else {
            let tied = match &ends.embedding {
                Some(Embed::Split(e)) => Some(e),
                None => None,
                Some(Embed::Whole(_)) => return Err(mismatch()),
            };
            let [te, g, b] = ["wte.weight", "ln_f.weight", "ln_f.bias"].map(m);
            let l = &ends.layout;
            let h = l.register_head(store, [v, c], cfg.eps, [&te, &g, &b], IGNORE_INDEX, tied)?;
            let [gamma, beta, wte] = h.params();
            if tied.is_none() {
                store.set_norm_share(wte, l.wte_share() / at.copies)?;
                params.push(("wte.weight".into(), wte));
            }
            params.push(("ln_f.weight".into(), gamma));
            params.push(("ln_f.bias".into(), beta));
            ends.head = Some(Head::Split(h));
            return Ok(());
        };
        let gamma = named(store, at, params, "ln_f.weight", &[c])?;
        let beta = named(store, at, params, "ln_f.bias", &[c])?;
        for id in [gamma, beta] {
            store.set_norm_share(id, at.replicated)?;
        }
        let ln_f = LayerNorm {
            gamma,
            beta,
            cols: c,
            eps: cfg.eps,
        };
        let head = LmHead::tied(&*store, wte, IGNORE_INDEX)?;
        ends.head = Some(Head::Whole { ln_f, head });
        Ok(())
    }
}

/// Registers `name` of `shape` whole with its master, named in `params`.
fn named<S: ParamStore>(
    store: &mut S,
    at: &RegisterAt<'_>,
    params: &mut Vec<(String, TensorId)>,
    name: &str,
    shape: &[usize],
) -> Result<TensorId> {
    let id = store.register(name, shape, (at.master)(name))?;
    params.push((name.to_string(), id));
    Ok(id)
}

impl<L: Layout> ModelEnds<L> for Ends<L> {
    type EmbedSaved = EmbKept<L>;
    type HeadSaved = HeadKept<L>;

    fn layout(&self) -> &L {
        &self.layout
    }

    fn has_embedding(&self) -> bool {
        self.embedding.is_some()
    }

    fn has_head(&self) -> bool {
        self.head.is_some()
    }

    fn split(&self) -> bool {
        matches!(self.embedding, Some(Embed::Split(_))) || matches!(self.head, Some(Head::Split(_)))
    }

    /// The embedding's parameters and the head's (`ln_f`'s, then its `wte`).
    fn params(&self) -> (Vec<TensorId>, Vec<TensorId>) {
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
    fn tied(&self) -> Option<TensorId> {
        let (first, last) = self.params();
        first.first().or(last.last()).copied()
    }

    fn embed(
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

    fn embed_backward(
        &self,
        bwd: &BackwardPass<'_>,
        kept: EmbKept<L>,
        dx: Act,
        tie: Tie<'_>,
    ) -> Result<()> {
        match (&self.embedding, kept) {
            (Some(Embed::Whole(e)), EmbKept::Whole(s)) => {
                let dfull = self.layout.to_full(bwd, dx)?;
                match tie {
                    Some(tie) => tie(bwd, &e.backward_returning(bwd, &s, &dfull)?),
                    None => e.backward(bwd, &s, &dfull),
                }
            }
            (Some(Embed::Split(e)), EmbKept::Split(k)) => e.backward(&self.layout, bwd, k, &dx),
            _ => Err(mismatch()),
        }
    }

    fn head_forward(
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
                let (loss, hs) = head.forward_scaled(fwd, &h, targets, scale)?;
                Ok((loss, HeadKept::Whole(ln, hs)))
            }
            Some(Head::Split(h)) => {
                let (loss, k) = h.forward(&self.layout, fwd, &x, targets, scale)?;
                Ok((Loss::ready(loss), HeadKept::Split(k)))
            }
            None => Err(absent("a GPT's head", "on the last pipeline stage")),
        }
    }

    fn head_backward(
        &self,
        bwd: &BackwardPass<'_>,
        kept: HeadKept<L>,
        tie: Tie<'_>,
    ) -> Result<Act> {
        match (&self.head, kept) {
            (Some(Head::Whole { ln_f, head }), HeadKept::Whole(ln, hs)) => {
                let dh = match tie {
                    Some(tie) => {
                        let (dh, share) = head.backward_returning(bwd, &hs)?;
                        tie(bwd, &share)?;
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

    fn logits(&self, fwd: &ForwardPass<'_>, x: Act) -> Result<Act> {
        let Some(Head::Whole { ln_f, head }) = &self.head else {
            return Err(Error::Conflict {
                what: "the logits".into(),
                with: "a split model: a rank holds a part".into(),
            });
        };
        let (h, _) = ln_f.forward(fwd, &x, None)?;
        drop(x);
        head.proj.forward(fwd, &h)
    }
}
