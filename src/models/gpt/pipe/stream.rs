//! PipeDream-2BW for a GPT stage as one stream of steps with no flush.

use std::cell::{Cell, RefCell};

use super::step::StageStep;
use super::train::{check_step, finish_step, ring_of, step_reduced};
use crate::error::{Error, Result};
use crate::models::gpt::TrainStep;
use crate::models::gpt::{Gpt, GptBatch, Plan, Variant};
use crate::optim::HybridAdam;
use crate::parallel::pipeline::{PipelineStage, Schedule};
use crate::parallel::Placement;
use crate::store::ParamStore;

/// PipeDream-2BW over `batches` (each one optimizer step's micro-batches, `every ≥ P` of
/// them) as one stream with no flush ([`PipelineStage::run_two_bw`]): stage `s` runs the next
/// step's first `P − s − 1` forwards between this step's last backwards, on the other weight
/// version, so the pipeline fills and drains once for the whole stream instead of once a
/// step. `versions` are the stage registered twice in `store` with the same arguments
/// ([`Gpt::register_on`] with the same plan), each after [`ParamStore::align_to_ranks`] (so that on ZeRO a
/// tensor's two versions lie on one rank and their state copies stay local): step `b` computes on `versions[b % 2]`, which holds
/// `W(b − 1)`, and makes `W(b + 1) = W(b) − Adam(∇f(W(b − 1)))` in it (the other version's
/// masters and moments copied in first), the arithmetic of [`train_step`]'s per-step 2BW
/// with [`delayed_params`](crate::optim::HybridConfig::delayed_params), bit for bit.
///
/// The optimizer must not delay its parameters itself (the versions do it). Each step's
/// gradient statistics are all-reduced over the pipeline and tensor groups, and the loss scale
/// the last stage's loss gradient takes is the optimizer's at that step's first forward there.
/// On a [`ZeroManager`](crate::zero::ZeroManager) (data parallel stages) both versions are
/// sharded over the replicas. The newest weights end in `versions[(batches.len() − 1) % 2]`.
/// Returns each step's [`TrainStep`] (the mean loss on every stage, and the stage's report of
/// its ops).
///
/// [`train_step`]: crate::models::gpt::train_step
pub fn train_two_bw_stream<P: Placement, V: Variant, S: ParamStore + ?Sized>(
    versions: [&Gpt<P, V>; 2],
    store: &mut S,
    plan: &Plan<'_>,
    adam: &mut HybridAdam,
    batches: &[Vec<GptBatch<'_>>],
) -> Result<Vec<TrainStep>> {
    let every = batches.first().map_or(0, Vec::len);
    let gpt = versions[0];
    let pipeline = check_step(gpt, plan, adam, every)?;
    if versions[1].stage != gpt.stage || versions[1].layers != gpt.layers {
        // the two versions are one stage registered twice
        return Err(Error::WrongPlace {
            what: "PipeDream-2BW's second version",
            registered: format!(
                "as stage {} (blocks {:?})",
                versions[1].stage, versions[1].layers
            ),
            run: format!(
                "with a first version of stage {} (blocks {:?})",
                gpt.stage, gpt.layers
            ),
        });
    }
    if adam.config().delayed_params {
        return Err(Error::Conflict {
            what: "a PipeDream-2BW stream".into(),
            with: "an optimizer that delays its parameters (HybridConfig::delayed_params): \
                   the two versions do"
                .into(),
        });
    }
    if let Some((k, b)) = batches.iter().enumerate().find(|(_, b)| b.len() != every) {
        return Err(Error::Length {
            what: format!(
                "micro-batches of step {k} of a PipeDream-2BW stream (every step needs the \
                 first's number)"
            ),
            got: b.len(),
            expected: every,
        });
    }
    if every < gpt.stages {
        return Err(Error::TooFew {
            what: format!(
                "micro-batches a step of a PipeDream-2BW stream over {} stages",
                gpt.stages
            ),
            got: every,
            need: gpt.stages,
        });
    }
    let micro: Vec<GptBatch<'_>> = batches.iter().flatten().copied().collect();
    for b in &micro {
        b.check(&gpt.config)?;
    }
    let scale = adam.loss_scale() / every as f32;
    let steps = versions.map(|v| -> Result<StageStep<'_, P, V>> {
        Ok(StageStep {
            gpt: v,
            micro: &micro,
            plan,
            ring: ring_of(v, plan, &micro)?,
            scale: Cell::new(scale),
            acc: RefCell::new(None),
        })
    });
    let [a, b] = steps;
    let (a, b) = (a?, b?);
    let stage = PipelineStage::new(pipeline, Schedule::TwoBW { every }, every)?;
    let mut done = Vec::with_capacity(batches.len());
    let reports = stage.run_two_bw(store, [&a, &b], batches.len(), |store, _| {
        let r = step_reduced(store, adam, plan)?;
        let scale = adam.loss_scale() / every as f32;
        a.scale.set(scale);
        b.scale.set(scale);
        done.push(r);
        Ok(())
    })?;
    done.into_iter()
        .zip(reports)
        .zip(batches)
        .map(|((r, report), micro)| {
            let mut step = finish_step(pipeline, r, &report, micro)?;
            step.stage = Some(report);
            Ok(step)
        })
        .collect()
}
