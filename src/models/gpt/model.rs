//! The GPT-2 model over a store: registration, one training iteration's forward and backward
//! (with or without activation checkpointing), and an evaluation forward.

use std::collections::BTreeMap;

use serde::Serialize;

use super::blocks::{Blocks, Keep, Kept, On, Shape, StageSplit};
use super::ends::{EmbKept, Ends, HeadKept};
use super::GptConfig;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::nn::{Embedding, HeadsCore, LayerNorm, LmHead, Loss};
use crate::parallel::{RingAttention, RingCore, Shard};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::{Init, TensorId};

/// GPT-2's σ = 0.02, as the bound of a uniform of that deviation.
const INIT_BOUND: f32 = 0.034_641_016;

/// Targets equal to it count for nothing (PyTorch's default).
pub const IGNORE_INDEX: i32 = -100;

/// A GPT-2 model whose parameters live in a store: the token and position [`Embedding`],
/// `L` pre-LayerNorm [`Block`](crate::nn::Block)s, the final LayerNorm and the [`LmHead`] tied to `wte` (one
/// parameter with two uses: the store sums their gradient shares).
///
/// # Example
///
/// Two iterations of `gpt2-tiny` shrunk to 2 blocks, each block checkpointed:
///
/// ```
/// use tidemem::models::gpt::{Gpt, GptConfig, GptBatch, RunOptions};
/// use tidemem::prelude::*;
///
/// # fn main() -> tidemem::Result<()> {
/// let mut cfg = GptConfig::preset("gpt2-tiny").unwrap();
/// cfg.layers = 2;
/// let dev = Device::sim(SimConfig::with_capacity(64 << 20))?;
/// let mut m = ChunkManager::new(dev, ManagerConfig::new(1 << 16, Policy::Tide))?;
/// let gpt = Gpt::register(&mut m, &cfg, 0)?;
/// let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adamw(1e-3, 0.0)))?;
/// let tokens: Vec<i32> = (0..32).map(|i| i % 7).collect();
/// let targets: Vec<i32> = (1..33).map(|i| i % 7).collect();
/// let batch = GptBatch { tokens: &tokens, targets: &targets, batch: 2, seq: 16 };
/// let opts = RunOptions { checkpoint: true, loss_scale: 1.0 };
/// let first = gpt.forward_backward(&mut m, &batch, opts)?;
/// m.step(&mut adam)?;
/// let second = gpt.forward_backward(&mut m, &batch, opts)?;
/// m.step(&mut adam)?;
/// assert!(second < first);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt {
    /// The shape.
    pub config: GptConfig,
    /// The token and position embedding and the LM head tied to `wte`.
    pub ends: Ends,
    /// The transformer blocks `h.0 … h.{L-1}`.
    pub(super) blocks: Blocks,
    /// `ln_f`.
    pub ln_f: LayerNorm,
    /// For a model split over a 1D tensor-parallel group ([`Gpt::register_1d`]): this rank's
    /// place; the blocks hold its shards.
    pub tensor: Option<Shard>,
    pub(super) params: Vec<(String, TensorId)>,
}

/// One micro-batch: `batch` rows of `seq` tokens (row-major) and their next-token targets
/// (targets equal to [`IGNORE_INDEX`] count for nothing).
#[derive(Clone, Copy, Debug)]
pub struct GptBatch<'a> {
    /// Input tokens `[batch·seq]`.
    pub tokens: &'a [i32],
    /// Targets `[batch·seq]`.
    pub targets: &'a [i32],
    /// Rows.
    pub batch: usize,
    /// Tokens per row (at most the model's positions).
    pub seq: usize,
}

/// How [`Gpt::forward_backward`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RunOptions {
    /// Keep only each block's input through the forward pass and recompute the block in the
    /// backward pass (activation checkpointing): the activations held shrink from `L` blocks'
    /// to one block's plus `L` inputs, for one more forward of each block. The parameters
    /// come out bitwise the same either way.
    pub checkpoint: bool,
    /// The loss gradient's scale (the optimizer's loss scale; 1 without one).
    pub loss_scale: f32,
}

impl GptBatch<'_> {
    /// Checks the batch against a model of shape `cfg`: `batch × seq` tokens and as many
    /// targets, at most `maxT` positions, targets in the vocabulary or ignored.
    pub fn check(&self, cfg: &GptConfig) -> Result<()> {
        let n = self.batch.checked_mul(self.seq).filter(|&n| n > 0);
        if n != Some(self.tokens.len()) || self.targets.len() != self.tokens.len() {
            return Err(Error::InvalidArgument(format!(
                "a batch of {} × {} with {} tokens and {} targets",
                self.batch,
                self.seq,
                self.tokens.len(),
                self.targets.len()
            )));
        }
        if self.seq > cfg.max_seq {
            return Err(Error::InvalidArgument(format!(
                "sequences of {} tokens; the model has {} positions",
                self.seq, cfg.max_seq
            )));
        }
        crate::ops::check_targets(self.targets, cfg.vocab, IGNORE_INDEX)
    }
}

impl RunOptions {
    /// Checks the options before a pass: the loss scale must be positive and finite.
    pub fn check(&self) -> Result<()> {
        let s = self.loss_scale;
        if !(s > 0.0 && s.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "a loss scale of {s} (it must be positive and finite)"
            )));
        }
        Ok(())
    }

    /// Checkpointing on for models of 12 or more blocks (GPT-2 124M and up), loss scale 1.
    pub fn for_config(cfg: &GptConfig) -> RunOptions {
        RunOptions {
            checkpoint: cfg.layers >= 12,
            loss_scale: 1.0,
        }
    }
}

impl Gpt {
    /// Registers the model's parameters in `store` (names and order of
    /// [`GptConfig::param_shapes`]) with GPT-2's initialisation drawn from `seed`: weights of
    /// σ 0.02 (uniform), the residual projections' (`c_proj`) scaled by `1/√(2L)`, biases zero,
    /// LayerNorms γ 1, β 0.
    pub fn register(store: &mut impl ParamStore, cfg: &GptConfig, seed: u64) -> Result<Gpt> {
        Gpt::register_with(store, cfg, |name, _| Ok(default_init(cfg, name, seed)))
    }

    /// Registers the model with each parameter's initial values from `init(name, shape)`
    /// (shapes as the crate holds them, linear weights `[outputs, inputs]`), e.g. from an
    /// imported checkpoint. An error from `init` stops the registration.
    pub fn register_with(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        mut init: impl FnMut(&str, &[usize]) -> Result<Init>,
    ) -> Result<Gpt> {
        cfg.validate()?;
        // every initialiser first, so that a failing one registers nothing
        let inits = cfg
            .param_shapes()
            .iter()
            .map(|(n, s)| Ok((n.clone(), init(n, s)?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let master = |n: &str| inits.get(n).cloned().unwrap_or(Init::Zeros);
        let c = cfg.channels;
        fn named<S: ParamStore>(
            s: &mut S,
            n: &str,
            shape: &[usize],
            i: Init,
        ) -> Result<(String, TensorId)> {
            s.register(n, shape, i).map(|id| (n.to_string(), id))
        }
        let reg = |store: &mut _, n: &str, shape: &[usize]| named(store, n, shape, master(n));
        let wte = reg(store, "wte.weight", &[cfg.vocab, c])?;
        let wpe = reg(store, "wpe.weight", &[cfg.max_seq, c])?;
        let blocks = Blocks::register(store, cfg, 0..cfg.layers, StageSplit::None, &master)?;
        let gamma = reg(store, "ln_f.weight", &[c])?;
        let beta = reg(store, "ln_f.bias", &[c])?;
        let ln_f = LayerNorm {
            gamma: gamma.1,
            beta: beta.1,
            cols: c,
            eps: cfg.eps,
        };
        let embedding = Embedding {
            wte: wte.1,
            wpe: wpe.1,
            vocab: cfg.vocab,
            max_seq: cfg.max_seq,
            channels: c,
        };
        let head = LmHead::tied(&*store, embedding.wte, IGNORE_INDEX)?;
        let mut params = vec![wte, wpe];
        params.extend(blocks.named_params(0));
        params.extend([gamma, beta]);
        Ok(Gpt {
            config: cfg.clone(),
            blocks,
            ln_f,
            ends: Ends::Whole { embedding, head },
            tensor: None,
            params,
        })
    }

    /// Registers the model with the values of an imported Hugging Face checkpoint
    /// ([`read_hf`](super::read_hf)): its shape and every parameter.
    pub fn register_hf(store: &mut impl ParamStore, weights: &super::HfWeights) -> Result<Gpt> {
        Gpt::register_with(store, weights.config(), |name, _| {
            weights.init(name).ok_or_else(|| {
                Error::InvalidArgument(format!("the imported weights have no '{name}'"))
            })
        })
    }

    /// Writes the model's fp32 master weights as a Hugging Face GPT-2 `safetensors` file
    /// ([`write_hf`](super::write_hf)), between iterations.
    pub fn save_hf(
        &self,
        m: &mut crate::chunk::ChunkManager,
        path: impl AsRef<std::path::Path>,
    ) -> Result<()> {
        if self.tensor.is_some() {
            return Err(Error::InvalidArgument(
                "a tensor-parallel rank holds shards: export the serial model".into(),
            ));
        }
        super::write_hf(path, &self.config, |name| {
            let id = self
                .param(name)
                .ok_or_else(|| Error::InvalidArgument(format!("the model has no '{name}'")))?;
            m.master(id)
        })
    }

    /// Every parameter's name and id, in registration order.
    pub fn named_params(&self) -> &[(String, TensorId)] {
        &self.params
    }

    /// The id of the parameter named `name` (e.g. `h.0.attn.c_attn.weight`).
    pub fn param(&self, name: &str) -> Option<TensorId> {
        self.params.iter().find(|(n, _)| n == name).map(|p| p.1)
    }

    fn check(&self, b: &GptBatch<'_>) -> Result<()> {
        b.check(&self.config)
    }

    /// One iteration's forward and backward on `b`: every parameter's gradient (of the mean
    /// loss times `opts.loss_scale`) written into its slot, the loss (unscaled) returned. The
    /// store is then in its optimizer stage: run [`ParamStore::step`]. Shapes, tokens and
    /// targets are checked before anything runs.
    pub fn forward_backward<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        b: &GptBatch<'_>,
        opts: RunOptions,
    ) -> Result<f32> {
        self.forward_backward_in(store, None, b, opts)
    }

    /// [`Gpt::forward_backward`] of a model split over the tensor-parallel group `tp`
    /// ([`Gpt::register_1d`]; `None` for a serial model). Every rank of the group runs it on
    /// the same batch.
    pub fn forward_backward_in<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        tp: Option<&Communicator>,
        b: &GptBatch<'_>,
        opts: RunOptions,
    ) -> Result<f32> {
        self.forward_backward_sp(store, tp, None, b, opts)
    }

    /// [`Gpt::forward_backward_in`] with the sequence split over the ring `sp` as well
    /// (sequence parallelism): `b` holds this rank's block of every sequence, positions
    /// `sp.rank()·seq .. (sp.rank() + 1)·seq` of `batch` sequences of `seq · sp.world()`
    /// tokens, and the attention runs over the ring
    /// ([`RingAttention`](crate::parallel::RingAttention)); everything else is local. The
    /// loss and gradients are this rank's (the mean over its tokens): the store must sum the
    /// gradients over the ring (a [`ZeroManager`](crate::zero::ZeroManager) over
    /// [`ProcessGrid::replicas`](crate::parallel::ProcessGrid::replicas), which averages the
    /// ranks' means). Every rank of `tp` and `sp` runs it.
    pub fn forward_backward_sp<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        tp: Option<&Communicator>,
        sp: Option<&Communicator>,
        b: &GptBatch<'_>,
        opts: RunOptions,
    ) -> Result<f32> {
        self.forward_backward_loss(store, tp, sp, b, opts)?.read()
    }

    /// [`Gpt::forward_backward_sp`] with the loss left on its way to the host ([`Loss`]), so
    /// a trainer reads it after the optimizer step without a wait of its own.
    pub(super) fn forward_backward_loss<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        tp: Option<&Communicator>,
        sp: Option<&Communicator>,
        b: &GptBatch<'_>,
        opts: RunOptions,
    ) -> Result<Loss> {
        self.check(b)?;
        opts.check()?;
        self.check_group(tp)?;
        let g = Groups::new(self, tp, sp, b)?;
        let fwd = store.forward()?;
        let (loss, saved) = self.forward(&fwd, &g, b, opts)?;
        fwd.finish()?;
        let mut bwd = store.backward()?;
        self.backward(&mut bwd, &g, b, saved, opts)?;
        bwd.finish()?;
        Ok(loss)
    }

    /// Checks that `tp` is the group the model was split over (none for a serial model).
    fn check_group(&self, tp: Option<&Communicator>) -> Result<()> {
        let got = tp.map(Shard::of);
        if got != self.tensor {
            return Err(Error::InvalidArgument(format!(
                "a model registered for tensor-parallel place {:?} run with {:?}",
                self.tensor, got
            )));
        }
        Ok(())
    }

    /// The mean loss on `b` without gradients: a forward pass, an empty backward pass, and
    /// the iteration ended without a step ([`ParamStore::skip_step`]).
    pub fn loss<S: ParamStore + ?Sized>(&self, store: &mut S, b: &GptBatch<'_>) -> Result<f32> {
        self.loss_in(store, None, b)
    }

    /// [`Gpt::loss`] of a model split over the tensor-parallel group `tp`.
    pub fn loss_in<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        tp: Option<&Communicator>,
        b: &GptBatch<'_>,
    ) -> Result<f32> {
        self.check(b)?;
        self.check_group(tp)?;
        let g = Groups::new(self, tp, None, b)?;
        let fwd = store.forward()?;
        let (x, _) = self.ends.embed(&fwd, tp, b.tokens, [b.batch, b.seq, 0])?;
        let (x, _) = self
            .blocks
            .forward(&fwd, g.on(), x, g.shape(b), Keep::Nothing)?;
        let (h, _) = self.ln_f.forward(&fwd, &x, None)?;
        drop(x);
        let (loss, _) = self.ends.head_forward(&fwd, tp, &h, b.targets, 1.0)?;
        fwd.finish()?;
        store.backward()?.finish()?;
        store.skip_step()?;
        loss.read()
    }

    /// The logits `[batch·seq, V]` (f32, row-major) of `tokens` `[batch·seq]`, without a loss
    /// or gradients: a forward pass, an empty backward pass and the iteration ended without a
    /// step ([`ParamStore::skip_step`]). For evaluation and generation.
    pub fn logits<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        tokens: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<Vec<f32>> {
        let none = vec![IGNORE_INDEX; tokens.len()];
        self.check(&GptBatch {
            tokens,
            targets: &none,
            batch,
            seq,
        })?;
        let fwd = store.forward()?;
        let Ends::Whole { embedding, head } = &self.ends else {
            return Err(Error::InvalidArgument(
                "logits of a vocab-split model: each rank holds its share".into(),
            ));
        };
        let (x, _) = embedding.forward(&fwd, tokens, batch, seq)?;
        let b = GptBatch {
            tokens,
            targets: &none,
            batch,
            seq,
        };
        self.check_group(None)?;
        let g = Groups::new(self, None, None, &b)?;
        let (x, _) = self
            .blocks
            .forward(&fwd, g.on(), x, g.shape(&b), Keep::Nothing)?;
        let (h, _) = self.ln_f.forward(&fwd, &x, None)?;
        drop(x);
        let logits = head.proj.forward(&fwd, &h)?;
        let out = logits.to_f32(fwd.stream())?;
        drop((h, logits));
        fwd.finish()?;
        store.backward()?.finish()?;
        store.skip_step()?;
        Ok(out)
    }

    fn forward(
        &self,
        fwd: &ForwardPass<'_>,
        g: &Groups<'_>,
        b: &GptBatch<'_>,
        opts: RunOptions,
    ) -> Result<(Loss, Saved)> {
        let tp = g.tp;
        let at = [b.batch, b.seq, g.first_position(b)];
        let (x, emb) = self.ends.embed(fwd, tp, b.tokens, at)?;
        let keep = match opts.checkpoint {
            true => Keep::Inputs,
            false => Keep::Saved,
        };
        let (x, kept) = self.blocks.forward(fwd, g.on(), x, g.shape(b), keep)?;
        let (h, ln_f) = self.ln_f.forward(fwd, &x, None)?;
        drop(x);
        let (loss, head) = self
            .ends
            .head_forward(fwd, tp, &h, b.targets, opts.loss_scale)?;
        drop(h);
        Ok((
            loss,
            Saved {
                emb,
                blocks: kept,
                ln_f,
                head,
            },
        ))
    }

    fn backward(
        &self,
        bwd: &mut BackwardPass<'_>,
        g: &Groups<'_>,
        b: &GptBatch<'_>,
        saved: Saved,
        _opts: RunOptions,
    ) -> Result<()> {
        let tp = g.tp;
        let Saved {
            emb,
            blocks,
            ln_f,
            head,
        } = saved;
        let dh = self.ends.head_backward(bwd, tp, &head)?;
        drop(head);
        let dx = self.ln_f.backward(bwd, &ln_f, &dh, None)?;
        drop((dh, ln_f));
        let dx = self.blocks.backward(bwd, g.on(), blocks, dx, g.shape(b))?;
        self.ends.embed_backward(bwd, &emb, &dx)
    }
}

/// The groups an iteration runs over: the tensor-parallel group and the sequence ring, with
/// the ring's attention for this batch.
struct Groups<'a> {
    tp: Option<&'a Communicator>,
    ring: Option<RingCore<'a>>,
}

impl<'a> Groups<'a> {
    fn new(
        gpt: &Gpt,
        tp: Option<&'a Communicator>,
        sp: Option<&'a Communicator>,
        b: &GptBatch<'_>,
    ) -> Result<Groups<'a>> {
        let ring = match sp {
            None => None,
            Some(group) => {
                let cfg = &gpt.config;
                let head_dim = cfg.channels / cfg.heads.max(1);
                let inner = gpt.blocks.local_heads(cfg.heads) * head_dim;
                let total = b
                    .seq
                    .checked_mul(group.world())
                    .filter(|&t| t <= cfg.max_seq);
                let Some(seq) = total else {
                    return Err(Error::InvalidArgument(format!(
                        "{} positions a rank over a ring of {} ranks: more than the model's {}",
                        b.seq,
                        group.world(),
                        cfg.max_seq
                    )));
                };
                let attn = RingAttention::new(group, b.batch, seq, inner / head_dim, head_dim)?;
                Some(RingCore { attn, group })
            }
        };
        Ok(Groups { tp, ring })
    }

    /// The position of this rank's first token in its sequences.
    fn first_position(&self, b: &GptBatch<'_>) -> usize {
        self.ring.as_ref().map_or(0, |r| r.attn.rank * b.seq)
    }

    fn core(&self) -> Option<&dyn HeadsCore> {
        self.ring.as_ref().map(|r| r as &dyn HeadsCore)
    }

    /// The communicators of the blocks.
    fn on(&self) -> On<'a> {
        On {
            tensor: self.tp,
            grid: None,
        }
    }

    /// The blocks' run on `b`.
    fn shape(&self, b: &GptBatch<'_>) -> Shape<'_> {
        Shape {
            batch_seq: [b.batch, b.seq],
            core: self.core(),
        }
    }
}

/// What the forward keeps for the backward.
struct Saved {
    emb: EmbKept,
    blocks: Kept,
    ln_f: crate::nn::LnSaved,
    head: HeadKept,
}

/// GPT-2's initialisation of parameter `name` (see [`Gpt::register`]).
pub fn default_init(cfg: &GptConfig, name: &str, seed: u64) -> Init {
    let uniform = |bound: f32| Init::Uniform {
        seed: fnv(name) ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        lo: -bound,
        hi: bound,
    };
    if name.ends_with(".bias") {
        Init::Zeros
    } else if name.starts_with("ln_f") || name.contains(".ln_") {
        Init::Constant(1.0)
    } else if name.ends_with("c_proj.weight") {
        uniform(INIT_BOUND / (2.0 * cfg.layers as f32).sqrt())
    } else {
        uniform(INIT_BOUND)
    }
}

/// 64-bit FNV-1a of a name.
fn fnv(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
