//! The plan of a run: which rank of which process grid (the tensor split, the sequence ring,
//! the pipeline stage), how the ends are held, the pipeline's schedule and partition, and
//! activation checkpointing. One value, given to [`Gpt::register_on`](super::Gpt::register_on)
//! and to [`train_step`](super::train_step) alike.

use std::ops::Range;

use super::blocks::TensorSplit;
use super::ends::EndsLayout;
use super::split_ends::{Over, Place};
use super::GptConfig;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::parallel::pipeline::{partition, Schedule};
use crate::parallel::{ProcessGrid, Shard, TensorMode};

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

    /// How the blocks are split.
    pub(super) fn split(&self) -> TensorSplit<'a> {
        match (self.grid, self.mode()) {
            (Some(g), TensorMode::OneD { .. }) => TensorSplit::OneD(g.tensor()),
            (Some(g), TensorMode::TwoD { .. } | TensorMode::TwoHalfD { .. })
            | (Some(g), TensorMode::ThreeD { .. }) => TensorSplit::Grid(g),
            _ => TensorSplit::None,
        }
    }

    /// Where split ends are registered, if the ends are split.
    pub(super) fn ends_place(&self) -> Option<Place<'a>> {
        match (self.ends, self.split()) {
            (EndsLayout::Whole, _) | (_, TensorSplit::None) => None,
            (EndsLayout::Split, TensorSplit::OneD(c)) => Some(Place::OneD(Shard::of(c))),
            (EndsLayout::Split, TensorSplit::Grid(g)) => Some(Place::Grid(g)),
        }
    }

    /// The group split ends run over.
    pub(super) fn over(&self) -> Option<Over<'a>> {
        match self.split() {
            TensorSplit::None => None,
            TensorSplit::OneD(_) => self.grid.map(|g| Over::OneD(g.tensor())),
            TensorSplit::Grid(g) => Some(Over::Grid(g)),
        }
    }

    /// The grid whose tiles the blocks' activations are (none when they are whole).
    pub(super) fn tiles(&self) -> Option<&'a ProcessGrid> {
        match self.split() {
            TensorSplit::Grid(g) => Some(g),
            _ => None,
        }
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
