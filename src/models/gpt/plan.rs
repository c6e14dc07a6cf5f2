//! The plan of a run: which rank of which process grid (the tensor split, the sequence ring,
//! the pipeline stage), how the ends are held, the pipeline's schedule and partition, and
//! activation checkpointing. One value, given to [`Gpt::register_on`](super::Gpt::register_on)
//! and to [`train_step`](super::train_step) alike.

use std::ops::Range;

use super::GptConfig;
use crate::comm::{reduce_grad_stats, Communicator};
use crate::error::{Error, Result};
use crate::optim::{HybridAdam, StepReport};
use crate::parallel::pipeline::{partition, Schedule};
use crate::parallel::{ProcessGrid, TensorMode};
use crate::store::ParamStore;

/// How a model split over a tensor-parallel group holds its ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EndsLayout {
    /// Split over the tensor group as the layout splits them ([`Layout::Embedding`],
    /// [`Layout::Head`](crate::nn::Layout::Head)): on a 1D group `wte`'s rows (the tied
    /// head's cross-entropy over the whole vocabulary), `wpe` and `ln_f` whole; on a 2D, 2.5D
    /// or 3D grid `wte` by vocabulary and channels, `wpe` and `ln_f` in the blocks' layout.
    /// On a grid the vocabulary and the positions must split by `q` and the channels by `q²`
    /// (pad the vocabulary, as GPT-2's 50257 to 50304).
    ///
    /// [`Layout::Embedding`]: crate::nn::Layout::Embedding
    #[default]
    Split,
    /// Whole on every rank: on a grid the embedding's output cut into the rank's tile, the
    /// last block's tiles gathered for `ln_f` and the head. Any vocabulary.
    Whole,
}

/// How one rank runs a GPT: every combination of data, pipeline, tensor (1D, 2D, 2.5D, 3D)
/// and sequence parallelism is a grid ([`ProcessGrid`]), whose groups the model and the
/// training step take from here. Data parallelism is the store's
/// ([`ZeroManager`](crate::zero::ZeroManager) over [`ProcessGrid::replicas`]); gradient
/// accumulation is the optimizer's (as many micro-batches as it accumulates), or, in a
/// pipeline, the pipeline's micro-batches.
///
/// ```
/// use tidemem::models::gpt::Plan;
///
/// let plan = Plan { checkpoint: true, ..Plan::default() };
/// assert!(plan.grid.is_none()); // one rank, the whole model
/// ```
#[derive(Clone, Debug, Default)]
pub struct Plan<'a> {
    /// This rank's grid; `None`: one rank holding the whole model.
    pub grid: Option<&'a ProcessGrid>,
    /// How the ends are held over a tensor-parallel group (whole without one).
    pub ends: EndsLayout,
    /// The blocks of each pipeline stage (`None`: balanced by parameters,
    /// [`Plan::balanced`]).
    pub stages: Option<Vec<Range<usize>>>,
    /// The pipeline's schedule, with more than one stage.
    pub schedule: Schedule,
    /// Keep only each block's input through the forward pass and recompute the block in the
    /// backward pass: fewer activations held, the same bits (not in a pipeline).
    pub checkpoint: bool,
}

impl<'a> Plan<'a> {
    /// The plan of a rank of `grid`, the ends split, the stages balanced, 1F1B.
    pub fn on(grid: &'a ProcessGrid) -> Plan<'a> {
        Plan {
            grid: Some(grid),
            ..Plan::default()
        }
    }

    /// The blocks of each of `stages` stages, balanced by parameters (the embedding counted on
    /// the first, `ln_f` and the head on the last). Fails when there are fewer blocks than
    /// stages.
    pub fn balanced(cfg: &GptConfig, stages: usize) -> Result<Vec<Range<usize>>> {
        let c = cfg.channels as u64;
        let block = 12 * c * c + 13 * c;
        let first = (cfg.vocab as u64 + cfg.max_seq as u64) * c;
        let last = cfg.vocab as u64 * c + 2 * c;
        Ok(partition(&vec![block; cfg.layers], first, last, stages)?.stages)
    }

    /// The tensor mode (none without a grid).
    fn mode(&self) -> TensorMode {
        self.grid.map_or(TensorMode::None, |g| g.spec().tensor)
    }

    /// Ranks in the tensor group.
    pub(super) fn tensor_size(&self) -> usize {
        self.mode().size()
    }

    /// The tensor-parallel group, with more than one rank.
    pub(super) fn tensor(&self) -> Option<&'a Communicator> {
        self.grid
            .filter(|g| g.spec().tensor.size() > 1)
            .map(|g| &**g.tensor())
    }

    /// The sequence ring, with more than one rank.
    pub(super) fn sequence(&self) -> Option<&'a Communicator> {
        self.grid
            .filter(|g| g.spec().sequence > 1)
            .map(|g| g.sequence())
    }

    /// This rank's place in the sequence ring.
    pub(super) fn sequence_rank(&self) -> usize {
        self.grid.map_or(0, |g| g.sequence_rank())
    }

    /// `(stage, stages)` of this rank's pipeline.
    pub(super) fn stage(&self) -> (usize, usize) {
        self.grid
            .map_or((0, 1), |g| (g.pipeline_rank(), g.spec().pipeline))
    }

    /// The pipeline, with more than one stage.
    /// The store's step with the gradient statistics all-reduced over the groups that split
    /// the model (the pipeline and the tensor group, where the grid has them), so that every
    /// rank clips by the global norm (replicated parameters counted once) and skips an
    /// overflow together: the one reduction of every training step.
    pub(super) fn step<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        adam: &mut HybridAdam,
    ) -> Result<StepReport> {
        let groups: Vec<&Communicator> = [self.pipeline(), self.tensor()]
            .into_iter()
            .flatten()
            .collect();
        if groups.is_empty() {
            return store.step(adam);
        }
        store.step_reducing(adam, &mut |st| {
            reduce_grad_stats(groups.iter().copied(), st)
        })
    }

    pub(super) fn pipeline(&self) -> Option<&'a Communicator> {
        self.grid
            .filter(|g| g.spec().pipeline > 1)
            .map(|g| g.pipeline())
    }

    /// The blocks of this rank's stage of a model of shape `cfg`.
    pub(super) fn layers(&self, cfg: &GptConfig) -> Result<Range<usize>> {
        let (stage, stages) = self.stage();
        let all = match &self.stages {
            Some(v) => v.clone(),
            None if stages == 1 => std::iter::once(0..cfg.layers).collect(),
            None => Plan::balanced(cfg, stages)?,
        };
        if all.len() != stages {
            return Err(Error::Length {
                what: format!(
                    "block ranges of the partition {all:?} of {} blocks over the pipeline stages",
                    cfg.layers
                ),
                got: all.len(),
                expected: stages,
            });
        }
        let Some(r) = all.get(stage) else {
            return Err(Error::IndexOutOfRange {
                what: format!("pipeline stage (of the partition {all:?})"),
                index: stage,
                len: all.len(),
            });
        };
        if r.is_empty() {
            return Err(Error::Empty {
                what: format!("the blocks {r:?} of stage {stage} of {stages} (partition {all:?})"),
            });
        }
        if r.end > cfg.layers {
            return Err(Error::IndexOutOfRange {
                what: format!("block (the last of stage {stage}'s {r:?} in the partition {all:?})"),
                index: r.end - 1,
                len: cfg.layers,
            });
        }
        Ok(r.clone())
    }
}
