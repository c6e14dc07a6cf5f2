//! One iteration of a GPT outside a pipeline: the forward and backward of a micro-batch (with
//! or without activation checkpointing), the evaluation loss and the logits.

use super::blocks::{self, Shape};
use super::model::{Gpt, GptBatch};
use super::plan::Plan;
use super::variant::{ModelEnds, Variant};
use super::IGNORE_INDEX;
use crate::error::{Error, Result};
use crate::nn::{BlockOn, Checkpointed, HeadsCore, Loss};
use crate::parallel::{Placement, RingAttention, RingCore};
use crate::store::ParamStore;

/// The groups one iteration runs over, with the sequence ring's attention for its batch.
struct Run<'p, 'a> {
    plan: &'p Plan<'a>,
    ring: Option<RingCore<'a>>,
}

impl<P: Placement, V: Variant> Gpt<P, V> {
    /// The sequences and heads a rank's attention runs over, for micro-batch `b`: its tile's
    /// sequences, and its heads.
    fn attention_shape(&self, b: &GptBatch<'_>) -> Result<[usize; 2]> {
        let [rows, _] = self.tile_shape(b)?;
        Ok([
            rows / b.seq.max(1),
            self.ends.layout().heads(self.config.heads),
        ])
    }

    /// The shape of micro-batch `b`'s activation between the blocks on this rank: the whole
    /// `[batch·seq, C]`, or the rank's tile.
    pub(super) fn tile_shape(&self, b: &GptBatch<'_>) -> Result<[usize; 2]> {
        self.ends
            .layout()
            .tile_shape([b.batch * b.seq, self.config.channels])
    }

    /// The sequence ring's attention for micro-batch `b`, when the plan splits the positions.
    pub(super) fn ring<'a>(
        &self,
        plan: &Plan<'a>,
        b: &GptBatch<'_>,
    ) -> Result<Option<RingCore<'a>>> {
        let Some(group) = plan.sequence() else {
            return Ok(None);
        };
        let cfg = &self.config;
        let [seqs, heads] = self.attention_shape(b)?;
        let total = b
            .seq
            .checked_mul(group.world())
            .filter(|&t| t <= cfg.max_seq);
        let Some(seq) = total else {
            // `b.seq` positions a rank over the ring's ranks
            return Err(Error::SeqTooLong {
                seq: b.seq.saturating_mul(group.world()),
                max: cfg.max_seq,
            });
        };
        let attn = RingAttention::new(group, seqs, seq, heads, cfg.channels / cfg.heads)?;
        Ok(Some(RingCore { attn, group }))
    }

    /// Checks that the model was registered for `plan`'s place: its stage and its tensor
    /// place.
    pub(super) fn check_plan(&self, plan: &Plan<'_>) -> Result<()> {
        let (stage, stages) = plan.stage();
        let placed = P::of_grid(plan.grid)?;
        if (stage, stages) != (self.stage, self.stages) || placed != *self.ends.layout() {
            return Err(Error::WrongPlace {
                what: "a GPT",
                registered: format!(
                    "as stage {} of {} at {:?}",
                    self.stage,
                    self.stages,
                    self.ends.layout()
                ),
                run: format!("as stage {stage} of {stages} at {placed:?}"),
            });
        }
        Ok(())
    }

    /// One iteration's forward and backward on `b` (the same batch on every rank of the
    /// plan's tensor group; with a sequence ring, this rank's positions of every sequence):
    /// every parameter's gradient (of the mean loss times `loss_scale`, the optimizer's) written
    /// into its slot, the loss (unscaled) returned. With [`Plan::checkpoint`] each block keeps only its
    /// input and is recomputed in the backward pass, the same bits with fewer activations held.
    /// The store is then in its optimizer stage: run [`ParamStore::step`] (or
    /// [`train_step`](super::train_step), which reduces the gradient statistics over the
    /// tensor group). Shapes, tokens, targets and the plan are checked before anything runs.
    /// Not for a pipeline stage (run [`train_step`](super::train_step)).
    pub fn forward_backward<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        plan: &Plan<'_>,
        b: &GptBatch<'_>,
        loss_scale: f32,
    ) -> Result<f32> {
        self.forward_backward_loss(store, plan, b, loss_scale)?
            .read()
    }

    /// [`Gpt::forward_backward`] with the loss left on its way to the host ([`Loss`]), so a
    /// trainer reads it after the optimizer step without a wait of its own.
    pub(super) fn forward_backward_loss<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        plan: &Plan<'_>,
        b: &GptBatch<'_>,
        loss_scale: f32,
    ) -> Result<Loss> {
        b.check(&self.config)?;
        crate::nn::check_scale("the loss scale", loss_scale)?;
        self.check_plan(plan)?;
        if self.stages > 1 {
            return Err(Error::Conflict {
                what: "forward_backward".into(),
                with: format!(
                    "a pipeline stage (stage {} of {}): it runs its micro-batches through \
                     train_step",
                    self.stage, self.stages
                ),
            });
        }
        let run = Run {
            plan,
            ring: self.ring(plan, b)?,
        };
        match plan.checkpoint {
            true => {
                let blocks: Vec<_> = self.blocks.iter().map(Checkpointed).collect();
                self.iteration(store, &run, b, loss_scale, &blocks)
            }
            false => self.iteration(store, &run, b, loss_scale, &self.blocks),
        }
    }

    /// The mean loss on `b` without gradients: a forward pass, an empty backward pass, and
    /// the iteration ended without a step ([`ParamStore::skip_step`]).
    pub fn loss<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        plan: &Plan<'_>,
        b: &GptBatch<'_>,
    ) -> Result<f32> {
        b.check(&self.config)?;
        self.check_plan(plan)?;
        if self.stages > 1 {
            return Err(Error::Conflict {
                what: "the loss".into(),
                with: format!(
                    "a pipeline stage (stage {} of {}): evaluate the whole model",
                    self.stage, self.stages
                ),
            });
        }
        let run = Run {
            plan,
            ring: self.ring(plan, b)?,
        };
        let fwd = store.forward()?;
        let first = plan.sequence_rank() * b.seq;
        let (x, _) = self.ends.embed(&fwd, b.tokens, [b.batch, b.seq, first])?;
        let (x, _) = blocks::forward(&self.blocks, &fwd, x, run.shape(b), false)?;
        let (loss, _) = self.ends.head_forward(&fwd, x, b.targets, 1.0)?;
        fwd.finish()?;
        store.backward()?.finish()?;
        store.skip_step()?;
        loss.read()
    }

    /// The logits `[batch·seq, V]` (f32, row-major) of `tokens` `[batch·seq]` of a whole
    /// model, without a loss or gradients: a forward pass, an empty backward pass and the
    /// iteration ended without a step ([`ParamStore::skip_step`]). For evaluation and
    /// generation.
    pub fn logits<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        tokens: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<Vec<f32>> {
        let none = vec![IGNORE_INDEX; tokens.len()];
        let b = GptBatch {
            tokens,
            targets: &none,
            batch,
            seq,
        };
        b.check(&self.config)?;
        if !self.whole() {
            return Err(Error::Conflict {
                what: "the logits".into(),
                with: "a split model: a rank holds a part".into(),
            });
        }
        let plan = Plan::default();
        let run = Run {
            plan: &plan,
            ring: None,
        };
        let fwd = store.forward()?;
        let (x, _) = self.ends.embed(&fwd, tokens, [batch, seq, 0])?;
        let (x, _) = blocks::forward(&self.blocks, &fwd, x, run.shape(&b), false)?;
        let logits = self.ends.logits(&fwd, x)?;
        let out = logits.to_f32(fwd.stream())?;
        drop(logits);
        fwd.finish()?;
        store.backward()?.finish()?;
        store.skip_step()?;
        Ok(out)
    }

    /// One iteration's forward and backward on `b` through `blocks` (the model's, or them
    /// checkpointed): the loss.
    fn iteration<S: ParamStore + ?Sized, B: BlockOn<P>>(
        &self,
        store: &mut S,
        run: &Run<'_, '_>,
        b: &GptBatch<'_>,
        loss_scale: f32,
        blocks: &[B],
    ) -> Result<Loss> {
        let fwd = store.forward()?;
        let first = run.plan.sequence_rank() * b.seq;
        let (x, emb) = self.ends.embed(&fwd, b.tokens, [b.batch, b.seq, first])?;
        let (x, kept) = blocks::forward(blocks, &fwd, x, run.shape(b), true)?;
        let (loss, head) = self.ends.head_forward(&fwd, x, b.targets, loss_scale)?;
        fwd.finish()?;
        let mut bwd = store.backward()?;
        let dx = self.ends.head_backward(&bwd, head, None)?;
        let dx = blocks::backward(blocks, &mut bwd, kept, dx, run.shape(b))?;
        self.ends.embed_backward(&bwd, emb, dx, None)?;
        bwd.finish()?;
        Ok(loss)
    }
}

impl Run<'_, '_> {
    fn shape(&self, b: &GptBatch<'_>) -> Shape<'_> {
        Shape {
            batch_seq: [b.batch, b.seq],
            core: self.ring.as_ref().map(|r| r as &dyn HeadsCore),
        }
    }
}
