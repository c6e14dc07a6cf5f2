//! One optimizer step of a GPT over any store: micro-batches, loss scaling, the step.

use super::{Gpt, GptBatch, Plan, TrainStep, Variant};
use crate::error::{Error, Result};
use crate::nn::Loss;
use crate::optim::{HybridAdam, StepOutcome};
use crate::parallel::Placement;
use crate::store::ParamStore;

/// One optimizer step of `gpt` (this rank's part, registered with the same `plan`) over the
/// micro-batches `micro`, the same on every rank of the tensor group and of the pipeline.
///
/// - Outside a pipeline, a forward and backward per micro-batch
///   ([`Gpt::forward_backward`], checkpointed as the plan says), each followed by the store's
///   step: the optimizer must accumulate over exactly `micro.len()` micro-batches
///   ([`HybridConfig::accumulation_steps`](crate::optim::HybridConfig)), averaging their
///   gradients and stepping at the last.
/// - In a pipeline, the stage's forwards and backwards run in the plan's schedule within one
///   store iteration, each micro-batch's loss gradient scaled by the loss scale over
///   `micro.len()`; the optimizer steps at every call. `wte` is used at both ends, so the
///   first and the last stage hold a copy each: their shares of its gradient are summed in
///   f32 through the step, apart from its slot, swapped between the two stages at the end of
///   the backward pass and added in one order on both, so the copies stay bit for bit the
///   same. [`Schedule::TwoBW`](crate::parallel::pipeline::Schedule) (PipeDream-2BW) needs an
///   optimizer with [`delayed_params`](crate::optim::HybridConfig::delayed_params) and a
///   version per step (`every = micro.len() ≥ P`); [`train_two_bw_stream`](super::train_two_bw_stream)
///   runs it with no flush.
///
/// Each micro-batch's loss gradient carries the optimizer's loss scale; the gradient
/// statistics are all-reduced over the tensor group and the pipeline, so every rank clips by
/// the global norm (replicated parameters counted once) and skips an overflow together. With
/// a sequence ring each micro-batch holds this rank's positions of its sequences, and the
/// store must sum the gradients over the ring (a [`ZeroManager`](crate::zero::ZeroManager)
/// over [`replicas`](crate::parallel::ProcessGrid::replicas)).
///
/// Fails before anything runs if the micro-batches do not match the optimizer or the plan.
pub fn train_step<P: Placement, V: Variant, S: ParamStore + ?Sized>(
    gpt: &Gpt<P, V>,
    store: &mut S,
    plan: &Plan<'_>,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
) -> Result<TrainStep> {
    if gpt.stages > 1 {
        let (mut step, report) = super::pipe::pipeline_step(gpt, store, plan, adam, micro)?;
        step.stage = Some(report);
        return Ok(step);
    }
    micro_steps(store, plan, adam, micro, |store, b, loss_scale| {
        gpt.forward_backward_loss(store, plan, b, loss_scale)
    })
}

/// The micro-batch loop every GPT trainer shares: `fb` runs one micro-batch's forward and
/// backward with the loss scale given and returns its loss; the store's step follows each,
/// with the gradient statistics all-reduced over the plan's groups ([`Plan::step`]). The
/// losses are read after the last step, whose read of the gradient statistics has seen them
/// arrive: the step's one blocking wait.
pub(super) fn micro_steps<S: ParamStore + ?Sized>(
    store: &mut S,
    plan: &Plan<'_>,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
    mut fb: impl FnMut(&mut S, &GptBatch<'_>, f32) -> Result<Loss>,
) -> Result<TrainStep> {
    let want = adam.config().accumulation_steps as usize;
    if micro.len() != want {
        return Err(Error::MicroBatches {
            got: micro.len(),
            accumulates: want,
        });
    }
    let mut losses = Vec::with_capacity(micro.len());
    let mut tokens = 0;
    let mut last = None;
    for (k, b) in micro.iter().enumerate() {
        losses.push(fb(store, b, adam.loss_scale())?);
        tokens += b.tokens.len();
        let r = plan.step(store, adam)?;
        let expected_last = k + 1 == micro.len();
        if (r.outcome == StepOutcome::Accumulated) == expected_last {
            // the optimizer stepped (or not) off its count of micro-batches: it was
            // mid-accumulation when the step began, stepped elsewhere
            return Err(Error::OutOfOrder {
                call: "train_step",
                needs: "the optimizer's accumulation of micro-batches begun elsewhere to end",
            });
        }
        last = Some(r);
    }
    let report = last.ok_or_else(|| Error::Empty {
        what: "a training step's micro-batches".into(),
    })?;
    let mut sum = 0.0f64;
    for l in losses {
        sum += f64::from(l.read()?);
    }
    Ok(TrainStep {
        loss: (sum / micro.len() as f64) as f32,
        report,
        tokens,
        stage: None,
    })
}
