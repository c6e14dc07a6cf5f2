//! One step of a pipeline stage of a [`Gpt`]: its micro-batches, as the pipeline runtime
//! drives them.

use std::cell::{Cell, RefCell};

use crate::device::PoolBlock;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::models::gpt::blocks::{self, Shape};
use crate::models::gpt::{Gpt, GptBatch, ModelEnds, Plan, Variant};
use crate::nn::{Act, BlockOn, HeadsCore};
use crate::ops::{add, add_in_place, cast, Axpby};
use crate::parallel::pipeline::StageModel;
use crate::parallel::{Placement, RingCore};
use crate::store::{BackwardPass, ForwardPass};
use crate::tensor::TensorId;

/// What one micro-batch's forward keeps on a stage.
pub(super) struct StageSaved<P: Placement, V: Variant> {
    emb: Option<<V::Ends<P> as ModelEnds<P>>::EmbedSaved>,
    blocks: Vec<<V::Block<P> as BlockOn<P>>::Saved>,
    head: Option<<V::Ends<P> as ModelEnds<P>>::HeadSaved>,
}

/// One step of a stage: its micro-batches and groups.
pub(super) struct StageStep<'a, P: Placement, V: Variant> {
    pub(super) gpt: &'a Gpt<P, V>,
    pub(super) micro: &'a [GptBatch<'a>],
    pub(super) plan: &'a Plan<'a>,
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

impl<P: Placement, V: Variant> StageStep<'_, P, V> {
    fn first_position(&self, b: &GptBatch<'_>) -> usize {
        self.ring.as_ref().map_or(0, |r| r.attn.rank * b.seq)
    }

    /// The blocks' run on `b`.
    fn shape(&self, b: &GptBatch<'_>) -> Shape<'_> {
        Shape {
            batch_seq: [b.batch, b.seq],
            core: self.ring.as_ref().map(|r| r as &dyn HeadsCore),
        }
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

impl<P: Placement, V: Variant> StageModel for StageStep<'_, P, V> {
    type Saved = StageSaved<P, V>;

    fn params(&self) -> Vec<TensorId> {
        let (mut v, last) = self.gpt.ends.params();
        v.extend(self.gpt.blocks.iter().flat_map(BlockOn::params));
        v.extend(last);
        v
    }

    fn input_shape(&self, micro: usize) -> Result<[usize; 2]> {
        let b = self
            .micro
            .get(micro)
            .ok_or_else(|| Error::IndexOutOfRange {
                what: "micro-batch".into(),
                index: micro,
                len: self.micro.len(),
            })?;
        self.gpt.tile_shape(b)
    }

    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        micro: usize,
        input: Option<&Act>,
    ) -> Result<(Act, StageSaved<P, V>)> {
        let g = self.gpt;
        let b = &self.micro[micro];
        let (x, emb) = match (g.ends.has_embedding(), input) {
            (true, _) => {
                let first = self.first_position(b);
                let (x, s) = g.ends.embed(pass, b.tokens, [b.batch, b.seq, first])?;
                (x, Some(s))
            }
            (false, Some(x)) => (x.clone(), None),
            (false, None) => {
                return Err(Error::Internal {
                    what: format!(
                        "stage {}: micro-batch {micro}'s forward ran without an input (a stage \
                         after the first)",
                        g.stage
                    ),
                })
            }
        };
        let (x, blocks) = blocks::forward(&g.blocks, pass, x, self.shape(b), true)?;
        if !g.ends.has_head() {
            let saved = StageSaved {
                emb,
                blocks,
                head: None,
            };
            return Ok((x, saved));
        }
        let (loss, head) = g.ends.head_forward(pass, x, b.targets, self.scale.get())?;
        let loss = loss.read()?;
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
        pass: &mut BackwardPass<'_>,
        micro: usize,
        saved: StageSaved<P, V>,
        dout: Option<&Act>,
    ) -> Result<Option<Act>> {
        let g = self.gpt;
        let StageSaved { emb, blocks, head } = saved;
        let keep = |p: &BackwardPass<'_>, share: &PoolBlock| self.keep(p, share);
        let tie = g
            .tie()
            .map(|_| &keep as &dyn Fn(&BackwardPass<'_>, &PoolBlock) -> Result<()>);
        let dx = match (head, dout) {
            (Some(kept), _) => g.ends.head_backward(pass, kept, tie)?,
            (None, Some(d)) => d.clone(),
            (None, None) => {
                return Err(Error::Internal {
                    what: format!(
                        "stage {}: micro-batch {micro}'s backward without its output's gradient",
                        g.stage
                    ),
                })
            }
        };
        let b = &self.micro[micro];
        let dx = blocks::backward(&g.blocks, pass, blocks, dx, self.shape(b))?;
        match emb {
            Some(kept) => {
                g.ends.embed_backward(pass, kept, dx, tie)?;
                Ok(None)
            }
            None => Ok(Some(dx)),
        }
    }

    fn finish_params(&self) -> Vec<TensorId> {
        self.gpt.tie().into_iter().collect()
    }

    fn finish_backward(&self, pass: &BackwardPass<'_>) -> Result<()> {
        let Some(wte) = self.gpt.tie() else {
            return Ok(());
        };
        let none = || Error::Internal {
            what: "no share of wte's gradient in this step".into(),
        };
        if self.gpt.ends.split() {
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

impl<P: Placement, V: Variant> StageStep<'_, P, V> {
    /// The sum of this end's f32 sum of `wte`'s shares (`n` elements) and the other end's
    /// (swapped over the pipeline group with the same tensor rank of the other end stage), the
    /// first stage's first on both so that the two copies stay bit for bit the same.
    fn both_ends(&self, pass: &BackwardPass<'_>, acc: &PoolBlock, n: usize) -> Result<PoolBlock> {
        let (dev, s) = (pass.device(), pass.stream());
        let other = pass.pool().alloc(n * 4)?;
        let pipe = self.plan.pipeline().ok_or_else(|| Error::Internal {
            what: "the two copies of wte without a pipeline".into(),
        })?;
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
