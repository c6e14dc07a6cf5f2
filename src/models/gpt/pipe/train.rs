//! One optimizer step of a GPT pipeline stage, and the pieces the 2BW stream shares with it:
//! the checks, the ring attention, the step with the gradient statistics reduced over the
//! stages, and the mean loss.

use std::cell::{Cell, RefCell};

use super::step::StageStep;
use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::models::gpt::TrainStep;
use crate::models::gpt::{Gpt, GptBatch, Plan, Variant};
use crate::optim::{HybridAdam, StepOutcome, StepReport};
use crate::parallel::pipeline::{PipelineStage, Schedule, StageReport};
use crate::parallel::Placement;
use crate::store::ParamStore;

/// One optimizer step of a pipeline stage over the micro-batches `micro` (all the step's, the
/// same on every stage), as [`train_step`](crate::models::gpt::train_step) describes: the
/// stage's ops in the plan's schedule within one store iteration, then the store's step with
/// the gradient statistics all-reduced over the pipeline and tensor groups. Returns the mean
/// of the micro-batches' losses on every stage, and the stage's report.
pub(in crate::models::gpt) fn pipeline_step<P: Placement, V: Variant, S: ParamStore + ?Sized>(
    gpt: &Gpt<P, V>,
    store: &mut S,
    plan: &Plan<'_>,
    adam: &mut HybridAdam,
    micro: &[GptBatch<'_>],
) -> Result<(TrainStep, StageReport)> {
    let pipeline = check_step(gpt, plan, adam, micro.len())?;
    for b in micro {
        b.check(&gpt.config)?;
    }
    // 2BW: a new weight version every `every` micro-batches (a step's), each taken at the
    // version before (the optimizer's delayed parameters); within a version the ops run in
    // 1F1B order
    let order = match plan.schedule {
        Schedule::TwoBW { every } => {
            if !adam.config().delayed_params {
                return Err(Error::Conflict {
                    what: format!("PipeDream-2BW (a new version every {every} micro-batches)"),
                    with: "an optimizer that does not keep the parameters one version behind \
                           (HybridConfig::delayed_params off)"
                        .into(),
                });
            }
            if every != micro.len() {
                return Err(Error::Length {
                    what: format!(
                        "micro-batches of a PipeDream-2BW step (a step holds a version's, \
                         {every})"
                    ),
                    got: micro.len(),
                    expected: every,
                });
            }
            if every < gpt.stages {
                return Err(Error::TooFew {
                    what: format!(
                        "micro-batches of a PipeDream-2BW version over {} stages",
                        gpt.stages
                    ),
                    got: every,
                    need: gpt.stages,
                });
            }
            Schedule::OneFOneB
        }
        s => s,
    };
    let step = StageStep {
        gpt,
        micro,
        plan,
        ring: ring_of(gpt, plan, micro)?,
        scale: Cell::new(adam.loss_scale() / micro.len() as f32),
        acc: RefCell::new(None),
    };
    let report = PipelineStage::new(pipeline, order, micro.len())?.run(store, &step)?;
    let r = step_reduced(store, adam, plan)?;
    let step = finish_step(pipeline, r, &report, micro)?;
    Ok((step, report))
}

/// Checks that the optimizer steps at every call, that the stage runs as its pipeline
/// group's rank and that no block is checkpointed; returns the pipeline.
pub(super) fn check_step<'a, P: Placement, V: Variant>(
    gpt: &Gpt<P, V>,
    plan: &Plan<'a>,
    adam: &HybridAdam,
    n: usize,
) -> Result<&'a Communicator> {
    let pipeline = plan.pipeline().ok_or_else(|| Error::WrongPlace {
        what: "a GPT pipeline stage",
        registered: format!("as stage {} of {}", gpt.stage, gpt.stages),
        run: "on a grid of one pipeline stage (a pipeline step needs the pipeline group)".into(),
    })?;
    if plan.checkpoint {
        return Err(Error::Conflict {
            what: "checkpointing (Plan::checkpoint)".into(),
            with: "a pipeline step: a stage keeps its blocks' activations".into(),
        });
    }
    if adam.config().accumulation_steps != 1 {
        return Err(Error::Conflict {
            what: format!(
                "an optimizer that accumulates {} micro-batches",
                adam.config().accumulation_steps
            ),
            with: format!(
                "a pipeline step (of {n} micro-batches): the micro-batches are the pipeline's"
            ),
        });
    }
    if n == 0 {
        return Err(Error::Empty {
            what: "a pipeline step's micro-batches".into(),
        });
    }
    if pipeline.world() != gpt.stages || pipeline.rank() != gpt.stage {
        return Err(Error::WrongPlace {
            what: "a GPT",
            registered: format!("as stage {} of {}", gpt.stage, gpt.stages),
            run: format!(
                "as rank {} of a pipeline of {}",
                pipeline.rank(),
                pipeline.world()
            ),
        });
    }
    Ok(pipeline)
}

/// The ring attention of a stage whose positions are split over a sequence group.
pub(super) fn ring_of<'a, P: Placement, V: Variant>(
    gpt: &Gpt<P, V>,
    plan: &Plan<'a>,
    micro: &[GptBatch<'_>],
) -> Result<Option<crate::parallel::RingCore<'a>>> {
    match micro.first() {
        Some(b) => gpt.ring(plan, b),
        None => Ok(None),
    }
}

/// The store's step ([`Plan::step`]), which at the end of a pipeline step must step.
pub(super) fn step_reduced<S: ParamStore + ?Sized>(
    store: &mut S,
    adam: &mut HybridAdam,
    plan: &Plan<'_>,
) -> Result<StepReport> {
    let r = plan.step(store, adam)?;
    if r.outcome == StepOutcome::Accumulated {
        return Err(Error::Internal {
            what: "the optimizer accumulated a pipeline step (it was checked to accumulate 1)"
                .into(),
        });
    }
    Ok(r)
}

/// A step's [`TrainStep`]: the last stage's mean loss over `micro`, on every stage.
pub(super) fn finish_step(
    pipeline: &Communicator,
    r: StepReport,
    report: &StageReport,
    micro: &[GptBatch<'_>],
) -> Result<TrainStep> {
    // the last stage's mean loss, to every stage
    let mut loss = [report.losses.iter().map(|&l| f64::from(l)).sum::<f64>()];
    pipeline.all_reduce_host(&mut loss, ReduceOp::Sum)?;
    Ok(TrainStep {
        loss: (loss[0] / micro.len() as f64) as f32,
        report: r,
        tokens: micro.iter().map(|b| b.tokens.len()).sum(),
        stage: None,
    })
}
