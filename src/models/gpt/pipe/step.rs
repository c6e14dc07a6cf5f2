//! One step of a [`GptStage`]: its micro-batches, as the pipeline runtime drives them.

use std::cell::{Cell, RefCell};

use super::{GptStage, StageEmbedding, StageGroups, StageHead};
use crate::device::Block as PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::models::gpt::blocks::{Keep, Kept, On, Shape};
use crate::models::gpt::grid_ends::{gather, split, EmbKept, HeadKept};
use crate::models::gpt::split_ends::Over;
use crate::models::gpt::GptBatch;
use crate::nn::{Act, HeadsCore};
use crate::ops::{add, add_in_place, cast, Axpby};
use crate::parallel::pipeline::StageModel;
use crate::parallel::{ProcessGrid, RingCore};
use crate::store::{BackwardPass, ForwardPass, Pass, PassKind};
use crate::tensor::TensorId;

/// What one micro-batch's forward keeps on a stage.
pub(super) struct StageSaved {
    emb: Option<EmbKept>,
    blocks: Kept,
    head: Option<HeadKept>,
}

/// One step of a stage: its micro-batches and groups.
pub(super) struct StageStep<'a> {
    pub(super) gpt: &'a GptStage,
    pub(super) micro: &'a [GptBatch<'a>],
    pub(super) groups: StageGroups<'a>,
    pub(super) ring: Option<RingCore<'a>>,
    /// The loss gradient's scale: the optimizer's loss scale over the step's micro-batches
    /// (a stream of steps sets it after each step).
    pub(super) scale: Cell<f32>,
    /// `wte`'s shares over the step (f32), on a stage holding a copy.
    pub(super) acc: RefCell<Option<PoolBlock>>,
}

const ONE: Axpby = Axpby {
    alpha: 1.0,
    beta: 1.0,
};

impl StageStep<'_> {
    fn core(&self) -> Option<&dyn HeadsCore> {
        self.ring.as_ref().map(|r| r as &dyn HeadsCore)
    }

    fn grid(&self) -> Result<&ProcessGrid> {
        self.groups
            .grid
            .ok_or_else(|| Error::InvalidArgument("grid blocks run without their grid".into()))
    }

    /// The group split ends run over: the 1D group, or the grid.
    fn over(&self) -> Result<Over<'_>> {
        match (self.gpt.blocks.tiled(), self.groups.tensor) {
            (false, Some(t)) => Ok(Over::OneD(t)),
            (false, None) => Err(Error::InvalidArgument(
                "a stage of split ends run without its tensor group".into(),
            )),
            (true, _) => Ok(Over::Grid(self.grid()?)),
        }
    }

    fn first_position(&self, b: &GptBatch<'_>) -> usize {
        self.ring.as_ref().map_or(0, |r| r.attn.rank * b.seq)
    }

    /// The rank's tile of a whole activation (itself for plain blocks).
    fn to_tile<K: PassKind>(&self, pass: &Pass<'_, K>, full: Act) -> Result<Act> {
        match self.gpt.blocks.tiled() {
            false => Ok(full),
            true => split(pass, self.grid()?, &full),
        }
    }

    /// The whole activation from every rank's tile (itself for plain blocks).
    fn to_full<K: PassKind>(&self, pass: &Pass<'_, K>, tile: Act) -> Result<Act> {
        match self.gpt.blocks.tiled() {
            false => Ok(tile),
            true => gather(pass, self.grid()?, &tile),
        }
    }

    /// The communicators of the blocks, and their run on `b`.
    fn run(&self, b: &GptBatch<'_>) -> (On<'_>, Shape<'_>) {
        let on = On {
            tensor: self.groups.tensor,
            grid: self.groups.grid,
        };
        let shape = Shape {
            batch_seq: [b.batch, b.seq],
            core: self.core(),
        };
        (on, shape)
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
                add_in_place(
                    dev,
                    s,
                    ONE,
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
        match &g.embedding {
            Some(StageEmbedding::Whole(e)) => v.extend([e.wte, e.wpe]),
            Some(StageEmbedding::Split(e)) => v.extend(e.params()),
            None => {}
        }
        v.extend(g.blocks.params());
        match &g.head {
            Some(StageHead::Whole { ln_f, head }) => {
                v.extend([ln_f.gamma, ln_f.beta, head.proj.weight]);
            }
            Some(StageHead::Split(h)) => {
                v.extend(h.ln_f());
                v.push(h.wte());
            }
            None => {}
        }
        v
    }

    fn input_shape(&self, micro: usize) -> Result<[usize; 2]> {
        let b = self.micro.get(micro).ok_or_else(|| {
            Error::InvalidArgument(format!("micro-batch {micro} of {}", self.micro.len()))
        })?;
        match self.groups.grid {
            Some(grid) => self.gpt.tile_shape(grid, b),
            None => Ok([b.batch * b.seq, self.gpt.config.channels]),
        }
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        micro: usize,
        input: Option<&Act>,
    ) -> Result<(Act, StageSaved)> {
        let g = self.gpt;
        let b = &self.micro[micro];
        let (x, emb) = match (&g.embedding, input) {
            (Some(StageEmbedding::Whole(e)), _) => {
                let (x, s) =
                    e.forward_at(pass, b.tokens, b.batch, b.seq, self.first_position(b))?;
                (self.to_tile(pass, x)?, Some(EmbKept::Whole(s)))
            }
            (Some(StageEmbedding::Split(e)), _) => {
                let at = [b.batch, b.seq, self.first_position(b)];
                let (x, s) = e.forward(pass, self.over()?, b.tokens, at)?;
                (x, Some(EmbKept::Split(s)))
            }
            (None, Some(x)) => (x.clone(), None),
            (None, None) => {
                return Err(Error::InvalidArgument(
                    "a stage after the first ran without an input".into(),
                ))
            }
        };
        let (on, shape) = self.run(b);
        let (x, blocks) = g.blocks.forward(pass, on, x, shape, Keep::Saved)?;
        let (loss, head) = match &g.head {
            Some(StageHead::Whole { ln_f, head }) => {
                let full = self.to_full(pass, x)?;
                let (h, ln) = ln_f.forward(pass, &full, None)?;
                drop(full);
                let (loss, hs) = head.forward_scaled(pass, &h, b.targets, self.scale.get())?;
                (loss, HeadKept::Whole(ln, hs))
            }
            Some(StageHead::Split(h)) => {
                let (loss, k) = h.forward(pass, self.over()?, &x, b.targets, self.scale.get())?;
                (loss, HeadKept::Split(k))
            }
            None => {
                let saved = StageSaved {
                    emb,
                    blocks,
                    head: None,
                };
                return Ok((x, saved));
            }
        };
        let out = Act::upload(pass.pool(), pass.stream(), 1, 1, DType::F32, &[loss])?;
        let saved = StageSaved {
            emb,
            blocks,
            head: Some(head),
        };
        Ok((out, saved))
    }

    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        micro: usize,
        saved: StageSaved,
        dout: Option<&Act>,
    ) -> Result<Option<Act>> {
        let g = self.gpt;
        let StageSaved { emb, blocks, head } = saved;
        let dx = match (&g.head, head, dout) {
            (Some(StageHead::Whole { ln_f, head }), Some(HeadKept::Whole(ln, hs)), _) => {
                let dh = if g.ties() {
                    let (dh, share) = head.backward_returning(pass, &hs)?;
                    self.keep(pass, &share)?;
                    dh
                } else {
                    head.backward(pass, &hs)?
                };
                drop(hs);
                let dfull = ln_f.backward(pass, &ln, &dh, None)?;
                self.to_tile(pass, dfull)?
            }
            // the head adds its share of wte's gradient to the store's sum over the step
            (Some(StageHead::Split(h)), Some(HeadKept::Split(k)), _) => {
                h.backward(pass, self.over()?, k)?
            }
            (None, None, Some(d)) => d.clone(),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "stage {}: micro-batch {micro}'s backward without its output's gradient",
                    g.stage
                )))
            }
        };
        let (on, shape) = self.run(&self.micro[micro]);
        let dx = g.blocks.backward_saved(pass, on, blocks, dx, shape)?;
        match (&g.embedding, emb) {
            (Some(StageEmbedding::Whole(e)), Some(EmbKept::Whole(s))) => {
                let dfull = self.to_full(pass, dx)?;
                if g.ties() {
                    let share = e.backward_returning(pass, &s, &dfull)?;
                    self.keep(pass, &share)?;
                } else {
                    e.backward(pass, &s, &dfull)?;
                }
                Ok(None)
            }
            (Some(StageEmbedding::Split(e)), Some(EmbKept::Split(k))) => {
                e.backward(pass, self.over()?, k, &dx)?;
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
        let none = || Error::InvalidArgument("no share of wte's gradient in this step".into());
        if self.gpt.split_ends() {
            // the layers added this stage's shares of the shard's gradient to the store's
            // f32 sum: take it, add the other end's, write the total at this last use
            let g = pass.fetch(&[wte])?;
            let n = g.param(0)?.numel();
            let mine = g.take_shares(0)?.ok_or_else(none)?;
            let total = self.both_ends(pass, &mine, n)?;
            return g.accumulate_grad(0, total.view(0, n * 4)?, DType::F32);
        }
        let n = self.gpt.config.vocab * self.gpt.config.channels;
        let acc = self.acc.borrow_mut().take().ok_or_else(none)?;
        let total = self.both_ends(pass, &acc, n)?;
        let g = pass.fetch(&[wte])?;
        g.accumulate_grad(0, total.view(0, n * 4)?, DType::F32)
    }
}

impl StageStep<'_> {
    /// The sum of this end's f32 sum of `wte`'s shares (`n` elements) and the other end's
    /// (swapped over the pipeline group with the same tensor rank of the other end stage), the
    /// first stage's first on both so that the two copies stay bit for bit the same.
    fn both_ends(&self, pass: &BackwardPass<'_>, acc: &PoolBlock, n: usize) -> Result<PoolBlock> {
        let (dev, s) = (pass.device(), pass.stream());
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
        add(dev, s, ONE, a, b, total.view(0, n * 4)?, DType::F32)?;
        Ok(total)
    }
}
