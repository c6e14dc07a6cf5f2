//! One optimizer step of a GPT over any store: micro-batches, loss scaling, the step.

use serde::Serialize;

use super::{Gpt, GptBatch, RunOptions};
use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::nn::Loss;
use crate::optim::{GradStats, HybridAdam, StepOutcome, StepReport};
use crate::store::ParamStore;

/// What [`train_step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TrainStep {
    /// The mean loss over the micro-batches.
    pub loss: f32,
    /// The optimizer's report of the last micro-batch (the step proper).
    pub report: StepReport,
    /// Tokens seen (targets counted or not).
    pub tokens: usize,
}

/// One optimizer step: a forward and backward per micro-batch, each followed by the store's
/// [`step`](ParamStore::step). The optimizer must accumulate over exactly `micro.len()`
/// micro-batches ([`HybridConfig::accumulation_steps`](crate::optim::HybridConfig)): it averages
/// their gradients and steps at the last. Each micro-batch's loss gradient carries the
/// optimizer's loss scale; clipping and overflow skips are the optimizer's.
///
/// Fails before anything runs if the micro-batches do not match the optimizer's accumulation.
pub fn train_step<S: ParamStore + ?Sized>(
    gpt: &Gpt,
    store: &mut S,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
    checkpoint: bool,
) -> Result<TrainStep> {
    train_step_in(gpt, store, None, adam, micro, checkpoint)
}

/// [`train_step`] of a model split over the tensor-parallel group `tp`
/// ([`Gpt::register_1d`]); every rank of the group runs it on the same micro-batches.
pub fn train_step_in<S: ParamStore + ?Sized>(
    gpt: &Gpt,
    store: &mut S,
    tp: Option<&Communicator>,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
    checkpoint: bool,
) -> Result<TrainStep> {
    train_step_sp(gpt, store, tp, None, adam, micro, checkpoint)
}

/// [`train_step_in`] with each sequence split over the ring `sp` too
/// ([`Gpt::forward_backward_sp`]: each micro-batch holds this rank's positions of its
/// sequences). The store must sum the gradients over the ring (a
/// [`ZeroManager`](crate::zero::ZeroManager) over the grid's
/// [`replicas`](crate::parallel::ProcessGrid::replicas)); every rank of `tp` and `sp` runs it.
pub fn train_step_sp<S: ParamStore + ?Sized>(
    gpt: &Gpt,
    store: &mut S,
    tp: Option<&Communicator>,
    sp: Option<&Communicator>,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
    checkpoint: bool,
) -> Result<TrainStep> {
    micro_steps(store, tp, adam, micro, |store, b, loss_scale| {
        let opts = RunOptions {
            checkpoint,
            loss_scale,
        };
        gpt.forward_backward_loss(store, tp, sp, b, opts)
    })
}

/// The micro-batch loop every GPT trainer shares: `fb` runs one micro-batch's forward and
/// backward with the loss scale given and returns its loss; the store's step follows each,
/// with the gradient statistics all-reduced over `tp` when given (every rank clips by the
/// global norm, the replicated parameters counted once, and skips an overflow together). The
/// losses are read after the last step, whose read of the gradient statistics has seen them
/// arrive: the step's one blocking wait.
pub(super) fn micro_steps<S: ParamStore + ?Sized>(
    store: &mut S,
    tp: Option<&Communicator>,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
    mut fb: impl FnMut(&mut S, &GptBatch<'_>, f32) -> Result<Loss>,
) -> Result<TrainStep> {
    let want = adam.config().accumulation_steps as usize;
    if micro.len() != want {
        return Err(Error::InvalidArgument(format!(
            "{} micro-batches for an optimizer that accumulates {want}",
            micro.len()
        )));
    }
    let mut losses = Vec::with_capacity(micro.len());
    let mut tokens = 0;
    let mut last = None;
    for (k, b) in micro.iter().enumerate() {
        losses.push(fb(store, b, adam.loss_scale())?);
        tokens += b.tokens.len();
        let r = match tp {
            Some(g) => store.step_reducing(adam, &mut |st: GradStats| {
                let mut sq = [st.sum_sq];
                g.all_reduce_host(&mut sq, ReduceOp::Sum)?;
                let mut flag = [u8::from(st.nonfinite)];
                g.all_reduce_host(&mut flag, ReduceOp::Max)?;
                Ok(GradStats {
                    sum_sq: sq[0],
                    nonfinite: flag[0] != 0,
                })
            })?,
            None => store.step(adam)?,
        };
        let expected_last = k + 1 == micro.len();
        if (r.outcome == StepOutcome::Accumulated) == expected_last {
            return Err(Error::InvalidArgument(format!(
                "micro-batch {k} of {}: the optimizer reported {:?}",
                micro.len(),
                r.outcome
            )));
        }
        last = Some(r);
    }
    let report = last.ok_or_else(|| Error::InvalidArgument("no micro-batch".into()))?;
    let mut sum = 0.0f64;
    for l in losses {
        sum += f64::from(l.read()?);
    }
    Ok(TrainStep {
        loss: (sum / micro.len() as f64) as f32,
        report,
        tokens,
    })
}
