//! GPT-2 split into pipeline stages ([`crate::parallel::pipeline`]): a stage holds a run of
//! blocks, the first stage also the embedding and the last `ln_f` and the head. `wte` is used
//! at both ends, so the first and the last stage each hold a copy: their shares of its
//! gradient are kept apart from the store through the step's micro-batches, swapped between
//! the two stages at the end of the backward pass and added in one order on both, so the two
//! copies stay bit for bit the same. Within a stage the blocks may be split over a 1D tensor
//! group and the positions over a sequence ring (the ends stay whole on every rank).

use std::cell::RefCell;
use std::ops::Range;

use super::model::{default_init, GptBatch, IGNORE_INDEX};
use super::train::TrainStep;
use super::GptConfig;
use crate::comm::{Communicator, ReduceOp};
use crate::device::Block as PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{
    Act, Block, BlockHooks, BlockSaved, CausalSelfAttention, EmbSaved, Embedding, HeadsCore,
    LayerNorm, Linear, LmHead, LmSaved, LnSaved, Mlp, WeightUse,
};
use crate::ops::{add, add_in_place, cast, Axpby};
use crate::optim::{GradStats, HybridAdam, StepOutcome};
use crate::parallel::pipeline::{partition, PipelineStage, Schedule, StageModel};
use crate::parallel::{Block1D, RingAttention, RingCore, Shard};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::TensorId;

/// One pipeline stage of a GPT-2: a run of blocks, the embedding on the first stage, `ln_f`
/// and the head on the last, each end with its copy of `wte` (see [`train_step_pipe`]).
#[derive(Clone, Debug, PartialEq)]
pub struct GptStage {
    /// The whole model's shape.
    pub config: GptConfig,
    /// This stage.
    pub stage: usize,
    /// Stages in the pipeline.
    pub stages: usize,
    /// The blocks this stage holds (their indices in the model).
    pub layers: Range<usize>,
    /// Those blocks (their linears write gradient shares: a stage runs each once per
    /// micro-batch).
    pub blocks: Vec<Block>,
    /// `wte` and `wpe`, on the first stage.
    pub embedding: Option<Embedding>,
    /// `ln_f`, on the last stage.
    pub ln_f: Option<LayerNorm>,
    /// The head over the last stage's copy of `wte`.
    pub head: Option<LmHead>,
    /// The 1D tensor-parallel place of the blocks, if split.
    pub tensor: Option<Shard>,
}

/// The groups one stage's step runs over.
#[derive(Clone, Copy, Debug)]
pub struct StageGroups<'a> {
    /// The stages, ranked by stage.
    pub pipeline: &'a Communicator,
    /// The 1D tensor-parallel group of the blocks (as registered), if any.
    pub tensor: Option<&'a Communicator>,
    /// The sequence ring, if the positions are split.
    pub sequence: Option<&'a Communicator>,
}

/// Parameters of each block and of the two ends, for a balanced partition.
fn block_params(cfg: &GptConfig) -> (u64, u64, u64) {
    let c = cfg.channels as u64;
    let block = 12 * c * c + 13 * c;
    let first = (cfg.vocab as u64 + cfg.max_seq as u64) * c;
    let last = cfg.vocab as u64 * c + 2 * c;
    (block, first, last)
}

impl GptStage {
    /// The blocks of each of `stages` stages, balanced by parameters (the embedding counted on
    /// the first, `ln_f` and the head on the last). Fails when there are fewer blocks than
    /// stages.
    pub fn balanced(cfg: &GptConfig, stages: usize) -> Result<Vec<Range<usize>>> {
        let (block, first, last) = block_params(cfg);
        let p = partition(&vec![block; cfg.layers], first, last, stages)?;
        Ok(p.stages)
    }

    /// Registers stage `stage` of `stages`, holding blocks `layers`, with
    /// [`Gpt::register`](super::Gpt::register)'s masters for `seed` (the blocks split over a
    /// 1D group at `tensor`, if given): the first stage also registers `wte` and `wpe`, the
    /// last `ln_f` and its own copy of `wte`. Replicated parameters count their share of the
    /// squared gradient norm (`1/T` over the tensor group, `1/2` for `wte`'s two copies).
    pub fn register(
        store: &mut impl ParamStore,
        cfg: &GptConfig,
        seed: u64,
        (stage, stages): (usize, usize),
        layers: Range<usize>,
        tensor: Option<Shard>,
    ) -> Result<GptStage> {
        cfg.validate()?;
        if stage >= stages || layers.end > cfg.layers || layers.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "stage {stage} of {stages} with blocks {layers:?} of {}",
                cfg.layers
            )));
        }
        let init = |name: &str| default_init(cfg, name, seed);
        let (c, first, last) = (cfg.channels, stage == 0, stage + 1 == stages);
        let t = tensor.map_or(1, |s| s.size);
        let replicated = 1.0 / t as f64;
        let wte_share = replicated / if stages > 1 { 2.0 } else { 1.0 };
        // `wte` on the first stage and on the last (one tensor when they are the same)
        let wte = if first || last {
            let id = store.register("wte.weight", &[cfg.vocab, c], init("wte.weight"))?;
            store.set_norm_share(id, wte_share)?;
            Some(id)
        } else {
            None
        };
        let held = |w: Option<TensorId>| {
            w.ok_or_else(|| Error::InvalidArgument("an end stage without wte".into()))
        };
        let embedding = if first {
            let wte = held(wte)?;
            let wpe = store.register("wpe.weight", &[cfg.max_seq, c], init("wpe.weight"))?;
            store.set_norm_share(wpe, replicated)?;
            Some(Embedding {
                wte,
                wpe,
                vocab: cfg.vocab,
                max_seq: cfg.max_seq,
                channels: c,
            })
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let name = format!("h.{i}");
            let b = match tensor {
                Some(shard) => {
                    Block1D::register(store, &name, c, cfg.heads, cfg.eps, &init, shard)?.block
                }
                None => serial_block(store, cfg, &name, &init)?,
            };
            for id in [b.ln_1.gamma, b.ln_1.beta, b.ln_2.gamma, b.ln_2.beta] {
                store.set_norm_share(id, replicated)?;
            }
            blocks.push(shared(b));
        }
        let (ln_f, head) = if last {
            let ln_f = LayerNorm {
                gamma: store.register("ln_f.weight", &[c], init("ln_f.weight"))?,
                beta: store.register("ln_f.bias", &[c], init("ln_f.bias"))?,
                cols: c,
                eps: cfg.eps,
            };
            store.set_norm_share(ln_f.gamma, replicated)?;
            store.set_norm_share(ln_f.beta, replicated)?;
            let head = LmHead::tied(&*store, held(wte)?, IGNORE_INDEX)?;
            (Some(ln_f), Some(head))
        } else {
            (None, None)
        };
        Ok(GptStage {
            config: cfg.clone(),
            stage,
            stages,
            layers,
            blocks,
            embedding,
            ln_f,
            head,
            tensor,
        })
    }

    fn wte(&self) -> Option<TensorId> {
        self.embedding
            .map(|e| e.wte)
            .or_else(|| self.head.map(|h| h.proj.weight))
    }

    /// Whether this stage holds one of `wte`'s two copies.
    fn ties(&self) -> bool {
        self.stages > 1 && (self.embedding.is_some() || self.head.is_some())
    }
}

/// A serial block from the model's masters.
fn serial_block(
    store: &mut impl ParamStore,
    cfg: &GptConfig,
    name: &str,
    init: &dyn Fn(&str) -> crate::tensor::Init,
) -> Result<Block> {
    let c = cfg.channels;
    let mut reg = |n: &str, shape: &[usize]| {
        let full = format!("{name}.{n}");
        store.register(&full, shape, init(&full))
    };
    let ln = |g: TensorId, b: TensorId| LayerNorm {
        gamma: g,
        beta: b,
        cols: c,
        eps: cfg.eps,
    };
    let ln_1 = ln(reg("ln_1.weight", &[c])?, reg("ln_1.bias", &[c])?);
    let qkv = (
        reg("attn.c_attn.weight", &[3 * c, c])?,
        reg("attn.c_attn.bias", &[3 * c])?,
    );
    let proj = (
        reg("attn.c_proj.weight", &[c, c])?,
        reg("attn.c_proj.bias", &[c])?,
    );
    let ln_2 = ln(reg("ln_2.weight", &[c])?, reg("ln_2.bias", &[c])?);
    let fc = (
        reg("mlp.c_fc.weight", &[4 * c, c])?,
        reg("mlp.c_fc.bias", &[4 * c])?,
    );
    let out = (
        reg("mlp.c_proj.weight", &[c, 4 * c])?,
        reg("mlp.c_proj.bias", &[c])?,
    );
    let linear =
        |(w, b): (TensorId, TensorId)| Linear::from_ids(&*store, w, Some(b), WeightUse::Once);
    Ok(Block {
        ln_1,
        attn: CausalSelfAttention {
            c_attn: linear(qkv)?,
            c_proj: linear(proj)?,
            heads: cfg.heads,
        },
        ln_2,
        mlp: Mlp {
            c_fc: linear(fc)?,
            c_proj: linear(out)?,
        },
    })
}

/// The block with every linear writing gradient shares.
fn shared(mut b: Block) -> Block {
    let s = |l: Linear| l.with_uses(WeightUse::Shared);
    b.attn.c_attn = s(b.attn.c_attn);
    b.attn.c_proj = s(b.attn.c_proj);
    b.mlp.c_fc = s(b.mlp.c_fc);
    b.mlp.c_proj = s(b.mlp.c_proj);
    b
}

/// What one micro-batch's forward keeps on a stage.
pub struct StageSaved {
    emb: Option<EmbSaved>,
    blocks: Vec<BlockSaved>,
    ln_f: Option<LnSaved>,
    head: Option<LmSaved>,
}

/// One step of a stage: its micro-batches and groups, as the pipeline runtime drives it.
struct StageStep<'a> {
    gpt: &'a GptStage,
    micro: &'a [GptBatch<'a>],
    groups: StageGroups<'a>,
    ring: Option<RingCore<'a>>,
    scale: f32,
    /// `wte`'s shares over the step (f32), on a stage holding a copy.
    acc: RefCell<Option<PoolBlock>>,
}

impl StageStep<'_> {
    fn sum(&self, pass_stream: &crate::device::Stream, a: &Act) -> Result<()> {
        match self.groups.tensor {
            Some(g) => g.all_reduce(pass_stream, a.view(), a.view(), a.dtype(), ReduceOp::Sum),
            None => Ok(()),
        }
    }

    fn first_position(&self, b: &GptBatch<'_>) -> usize {
        self.ring.as_ref().map_or(0, |r| r.attn.rank * b.seq)
    }

    /// Adds a share of `wte`'s gradient (the parameter dtype) to the step's f32 sum.
    fn keep(&self, pass: &BackwardPass<'_>, share: &PoolBlock) -> Result<()> {
        let (dev, s, d) = (pass.device(), pass.stream(), pass.param_dtype());
        let n = self.gpt.config.vocab * self.gpt.config.channels;
        let src = share.view(0, n * d.size())?;
        let mut acc = self.acc.borrow_mut();
        match acc.as_ref() {
            None => {
                let b = pass.pool().alloc(n * 4)?;
                cast(dev, s, src, d, b.view(0, n * 4)?, DType::F32)?;
                *acc = Some(b);
            }
            Some(b) => {
                let tmp = pass.pool().alloc(n * 4)?;
                cast(dev, s, src, d, tmp.view(0, n * 4)?, DType::F32)?;
                let one = Axpby {
                    alpha: 1.0,
                    beta: 1.0,
                };
                add_in_place(
                    dev,
                    s,
                    one,
                    b.view(0, n * 4)?,
                    tmp.view(0, n * 4)?,
                    DType::F32,
                )?;
            }
        }
        Ok(())
    }
}

impl StageModel for StageStep<'_> {
    type Saved = StageSaved;

    fn params(&self) -> Vec<TensorId> {
        let g = self.gpt;
        let mut v = Vec::new();
        if let Some(e) = &g.embedding {
            v.extend([e.wte, e.wpe]);
        }
        for b in &g.blocks {
            v.extend(b.params());
        }
        if let (Some(ln), Some(h)) = (&g.ln_f, &g.head) {
            v.extend([ln.gamma, ln.beta, h.proj.weight]);
        }
        v
    }

    fn input_shape(&self, micro: usize) -> Result<[usize; 2]> {
        let b = self.micro.get(micro).ok_or_else(|| {
            Error::InvalidArgument(format!("micro-batch {micro} of {}", self.micro.len()))
        })?;
        Ok([b.batch * b.seq, self.gpt.config.channels])
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        micro: usize,
        input: Option<&Act>,
    ) -> Result<(Act, StageSaved)> {
        let g = self.gpt;
        let b = &self.micro[micro];
        let (mut x, emb) = match (&g.embedding, input) {
            (Some(e), _) => {
                let (x, s) =
                    e.forward_at(pass, b.tokens, b.batch, b.seq, self.first_position(b))?;
                (x, Some(s))
            }
            (None, Some(x)) => (x.clone(), None),
            (None, None) => {
                return Err(Error::InvalidArgument(
                    "a stage after the first ran without an input".into(),
                ))
            }
        };
        let sum = |a: &Act| self.sum(pass.stream(), a);
        let hooks = BlockHooks {
            sum: &sum,
            core: self.ring.as_ref().map(|r| r as &dyn HeadsCore),
        };
        let mut blocks = Vec::with_capacity(g.blocks.len());
        for block in &g.blocks {
            let (out, s) = block.forward_ext(pass, &x, b.batch, b.seq, hooks)?;
            blocks.push(s);
            x = out;
        }
        let mut saved = StageSaved {
            emb,
            blocks,
            ln_f: None,
            head: None,
        };
        match (&g.ln_f, &g.head) {
            (Some(ln_f), Some(head)) => {
                let (h, ln) = ln_f.forward(pass, &x, None)?;
                let (loss, hs) = head.forward_scaled(pass, &h, b.targets, self.scale)?;
                saved.ln_f = Some(ln);
                saved.head = Some(hs);
                let out = Act::upload(pass.pool(), pass.stream(), 1, 1, DType::F32, &[loss])?;
                Ok((out, saved))
            }
            _ => Ok((x, saved)),
        }
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        micro: usize,
        saved: StageSaved,
        dout: Option<&Act>,
    ) -> Result<Option<Act>> {
        let g = self.gpt;
        let StageSaved {
            emb,
            mut blocks,
            ln_f,
            head,
        } = saved;
        let mut dx = match (&g.ln_f, &g.head, ln_f, head, dout) {
            (Some(lf), Some(h), Some(ln), Some(hs), _) => {
                let dh = if g.ties() {
                    let (dh, share) = h.backward_returning(pass, &hs)?;
                    self.keep(pass, &share)?;
                    dh
                } else {
                    h.backward(pass, &hs)?
                };
                drop(hs);
                lf.backward(pass, &ln, &dh, None)?
            }
            (None, None, None, None, Some(d)) => d.clone(),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "stage {}: micro-batch {micro}'s backward without its output's gradient",
                    g.stage
                )))
            }
        };
        let sum = |a: &Act| self.sum(pass.stream(), a);
        let hooks = BlockHooks {
            sum: &sum,
            core: self.ring.as_ref().map(|r| r as &dyn HeadsCore),
        };
        for block in g.blocks.iter().rev() {
            let s = blocks
                .pop()
                .ok_or_else(|| Error::InvalidArgument("a block's saved state is gone".into()))?;
            dx = block.backward_ext(pass, &s, &dx, hooks)?;
        }
        match (&g.embedding, emb) {
            (Some(e), Some(s)) => {
                if g.ties() {
                    let share = e.backward_returning(pass, &s, &dx)?;
                    self.keep(pass, &share)?;
                } else {
                    e.backward(pass, &s, &dx)?;
                }
                Ok(None)
            }
            _ => Ok(Some(dx)),
        }
    }

    fn finish_params(&self) -> Vec<TensorId> {
        match (self.gpt.ties(), self.gpt.wte()) {
            (true, Some(w)) => vec![w],
            _ => Vec::new(),
        }
    }

    fn finish_backward(&self, pass: &BackwardPass<'_>) -> Result<()> {
        let (true, Some(wte)) = (self.gpt.ties(), self.gpt.wte()) else {
            return Ok(());
        };
        let (dev, s) = (pass.device(), pass.stream());
        let n = self.gpt.config.vocab * self.gpt.config.channels;
        let acc = self.acc.borrow_mut().take().ok_or_else(|| {
            Error::InvalidArgument("no share of wte's gradient in this step".into())
        })?;
        let other = pass.pool().alloc(n * 4)?;
        let pipe = self.groups.pipeline;
        let peer = if self.gpt.stage == 0 {
            pipe.world() - 1
        } else {
            0
        };
        let mine = acc.view(0, n * 4)?;
        pipe.send_recv(s, mine, peer, other.view(0, n * 4)?, peer, DType::F32)?;
        // the first stage's sum plus the last's, on both
        let (a, b) = if self.gpt.stage == 0 {
            (mine, other.view(0, n * 4)?)
        } else {
            (other.view(0, n * 4)?, mine)
        };
        let total = pass.pool().alloc(n * 4)?;
        let one = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        add(dev, s, one, a, b, total.view(0, n * 4)?, DType::F32)?;
        let g = pass.fetch(&[wte])?;
        g.accumulate_grad(0, total.view(0, n * 4)?, DType::F32)
    }
}

/// One optimizer step of a pipeline stage over the micro-batches `micro` (all the step's, the
/// same on every stage). `wte` is used at both ends, so the first and the last stage hold a
/// copy each: their shares of its gradient are kept apart from the store through the step,
/// swapped between the two stages at the end of the backward pass and added in one order on
/// both, so the copies stay bit for bit the same. The stage's forwards and backwards run in
/// `schedule`'s order within one
/// store iteration ([`PipelineStage`]), each micro-batch's loss gradient scaled by the
/// optimizer's loss scale over `micro.len()`, then the store's step with the gradient
/// statistics all-reduced over the pipeline and tensor groups (every stage clips by the global
/// norm). The optimizer steps at every call (no accumulation of its own). Returns the mean of
/// the micro-batches' losses on every stage.
pub fn train_step_pipe<S: ParamStore + ?Sized>(
    gpt: &GptStage,
    store: &mut S,
    groups: StageGroups<'_>,
    schedule: Schedule,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
) -> Result<TrainStep> {
    if adam.config().accumulation_steps != 1 || micro.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "a pipeline step of {} micro-batches for an optimizer that accumulates {}: the \
             micro-batches are the pipeline's",
            micro.len(),
            adam.config().accumulation_steps
        )));
    }
    if groups.pipeline.world() != gpt.stages || groups.pipeline.rank() != gpt.stage {
        return Err(Error::InvalidArgument(format!(
            "stage {} of {} run as rank {} of a pipeline of {}",
            gpt.stage,
            gpt.stages,
            groups.pipeline.rank(),
            groups.pipeline.world()
        )));
    }
    for b in micro {
        b.check(&gpt.config)?;
    }
    let ring = match groups.sequence {
        None => None,
        Some(group) => {
            let cfg = &gpt.config;
            let (b, head_dim) = (&micro[0], cfg.channels / cfg.heads);
            let inner = gpt.blocks[0].attn.inner();
            let attn = RingAttention::new(
                group,
                b.batch,
                b.seq * group.world(),
                inner / head_dim,
                head_dim,
            )?;
            Some(RingCore { attn, group })
        }
    };
    let step = StageStep {
        gpt,
        micro,
        groups,
        ring,
        scale: adam.loss_scale() / micro.len() as f32,
        acc: RefCell::new(None),
    };
    let report = PipelineStage::new(groups.pipeline, schedule, micro.len())?.run(store, &step)?;
    let reduce = |st: GradStats| -> Result<GradStats> {
        let mut sq = [st.sum_sq];
        let mut flag = [u8::from(st.nonfinite)];
        for g in [Some(groups.pipeline), groups.tensor].into_iter().flatten() {
            g.all_reduce_host(&mut sq, ReduceOp::Sum)?;
            g.all_reduce_host(&mut flag, ReduceOp::Max)?;
        }
        Ok(GradStats {
            sum_sq: sq[0],
            nonfinite: flag[0] != 0,
        })
    };
    let r = store.step_reducing(adam, &mut { reduce })?;
    if r.outcome == StepOutcome::Accumulated {
        return Err(Error::InvalidArgument(
            "the optimizer accumulated a pipeline step".into(),
        ));
    }
    // the last stage's mean loss, to every stage
    let mut loss = [report.losses.iter().map(|&l| f64::from(l)).sum::<f64>()];
    groups.pipeline.all_reduce_host(&mut loss, ReduceOp::Sum)?;
    Ok(TrainStep {
        loss: (loss[0] / micro.len() as f64) as f32,
        report: r,
        tokens: micro.iter().map(|b| b.tokens.len()).sum(),
    })
}
