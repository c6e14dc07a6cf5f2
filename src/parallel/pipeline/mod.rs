//! Pipeline parallelism: the layers cut into `P` contiguous **stages**, one a rank of the
//! grid's pipeline group ([`ProcessGrid::pipeline`](super::ProcessGrid::pipeline)), an
//! optimizer step's batch cut into `M` **micro-batches** that flow through the stages.
//!
//! # Schedules ([`Schedule`])
//!
//! Stage `s` runs forward `F(m)` after stage `s − 1` ran it (it needs its output), and backward
//! `B(m)` after stage `s + 1` ran it (it needs the output's gradient) and after its own `F(m)`.
//! A schedule is the order of `F` and `B` on each stage:
//!
//! - [`Schedule::GPipe`]: all forwards, then all backwards (the flush baseline): stage `s` keeps
//!   every micro-batch's activations until its backwards start (`M` at once).
//! - [`Schedule::OneFOneB`] (PipeDream-Flush, Megatron's default): `min(P − s − 1, M)` warm-up
//!   forwards, then one forward and one backward in turn, then the remaining backwards. Its
//!   bubble is GPipe's, `(P − 1)/(M + P − 1)` of the time with equal stages, but stage `s` holds
//!   at most `min(P − s, M)` micro-batches' activations.
//! - [`Schedule::TwoBW`] (PipeDream-2BW): 1F1B's order with no flush between optimizer steps, a
//!   new weight version every `m ≥ P` micro-batches, each micro-batch's forward and backward on
//!   one version ([`two_bw`]): `W(t+1) = W(t) − ν·∇f(W(t−1))` ([`TwoBwSgd`] runs it serially).
//!
//! [`simulate`] runs every stage's op list against those dependencies with a forward and a
//! backward time per stage, and reports the makespan, each stage's idle time and the bubble
//! fraction; an order that cannot proceed is [`PipelineError::Deadlock`]. [`partition`] cuts `L`
//! layers into stages balanced by parameter count.
//!
//! # The runtime ([`PipelineStage`])
//!
//! [`PipelineStage::run`] runs one optimizer step's `M` micro-batches of this rank's stage
//! ([`StageModel`]) on its store in **one** store iteration, in the schedule's order: the
//! forwards before the first backward in the [`ForwardPass`](crate::store::ForwardPass), then
//! every later forward in a [`recompute`](crate::store::BackwardPass::recompute) pass of the
//! [`BackwardPass`](crate::store::BackwardPass) (so the store still sees forward, then
//! backward), each backward adding its gradient share with
//! [`accumulate_grad`](crate::store::Guard::accumulate_grad) (a stage's parameters are used `M`
//! times an iteration: [`WeightUse::Shared`](crate::nn::WeightUse::Shared)). A forward run in a
//! recompute pass counts one use on each side, so the store would see the last backward use
//! of each parameter too early; the driver declares those forwards' uses in the forward pass
//! ([`declare_uses`](crate::store::ForwardPass::declare_uses), after the early forwards: no
//! moment, no chunk moved, nothing gathered), which makes the store write
//! each gradient at its `M`-th backward. Activations go to the next stage and their gradients
//! back by point-to-point messages on the pipeline group, a send paired with the receive that
//! follows it in one grouped [`send_recv`](crate::comm::Communicator::send_recv).
//!
//! ```
//! use tidemem::parallel::pipeline::{simulate_schedule, Schedule};
//!
//! # fn main() -> Result<(), tidemem::parallel::pipeline::PipelineError> {
//! // 4 stages, 8 micro-batches, a backward twice a forward
//! let r = simulate_schedule(Schedule::OneFOneB, 4, 8, 1.0, 2.0)?;
//! assert_eq!(r.makespan, (8.0 + 3.0) * 3.0);
//! assert!((r.bubble_fraction - 3.0 / 11.0).abs() < 1e-12);
//! # Ok(()) }
//! ```

mod flush_free;
mod partition;
mod runtime;
mod schedule;
mod simulate;
mod two_bw;

pub use partition::{check_partition, partition, Partition};
pub use runtime::{PipelineStage, StageModel, StageReport};
pub use schedule::{max_in_flight, two_bw, PipeOp, Schedule, VersionedOp};
pub use simulate::{simulate, simulate_schedule, OpTiming, ScheduleReport, StageCost};
pub use two_bw::{TwoBwSgd, WeightDelay};

/// What is wrong with a pipeline's shape, schedule, op lists, costs or partition.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// A pipeline of no stage.
    #[error("a pipeline needs at least one stage")]
    NoStages,
    /// A step of no micro-batch.
    #[error("a pipeline step needs at least one micro-batch")]
    NoMicroBatches,
    /// A stage index past the last stage.
    #[error("stage {stage} of a pipeline of {stages} stages")]
    StageOutOfRange {
        /// The index asked for.
        stage: usize,
        /// Stages in the pipeline.
        stages: usize,
    },
    /// PipeDream-2BW's versions come too often: every `every` micro-batches with `stages`
    /// stages (it needs `every ≥ stages`).
    #[error(
        "PipeDream-2BW makes a weight version every {every} micro-batches; with {stages} \
         stages it needs at least {stages}"
    )]
    UpdateTooFrequent {
        /// Micro-batches per weight version.
        every: usize,
        /// Stages in the pipeline.
        stages: usize,
    },
    /// An op list that is not a schedule of `micro` micro-batches (a missing, repeated or
    /// out-of-range op).
    #[error("the op list of stage {stage} is not a schedule: {reason}")]
    BadOpList {
        /// The stage.
        stage: usize,
        /// What is wrong.
        reason: String,
    },
    /// The op lists cannot all run: each stuck stage's next op waits for an op that waits,
    /// directly or not, for it.
    #[error("the schedule deadlocks after {done} of {total} ops; stuck: {stuck:?}")]
    Deadlock {
        /// Ops that ran.
        done: usize,
        /// Ops in all.
        total: usize,
        /// `(stage, its next op)` of every unfinished stage.
        stuck: Vec<(usize, PipeOp)>,
    },
    /// A cost that is negative or not finite, or a cost list of the wrong length.
    #[error("bad stage costs: {0}")]
    BadCost(String),
    /// Fewer layers than stages (a stage would be empty).
    #[error("{layers} layers cannot fill {stages} stages")]
    TooFewLayers {
        /// Layers.
        layers: usize,
        /// Stages.
        stages: usize,
    },
    /// A given partition whose sizes do not add up to the layers.
    #[error("stage sizes {sizes:?} add up to {sum}, not the {layers} layers")]
    SizesMismatch {
        /// The sizes given.
        sizes: Vec<usize>,
        /// Their sum.
        sum: usize,
        /// The layers.
        layers: usize,
    },
    /// A given partition with an empty stage.
    #[error("stage {stage} of the partition is empty")]
    EmptyStage {
        /// The empty stage.
        stage: usize,
    },
    /// A parameter total past `u64::MAX`.
    #[error("the parameter counts overflow")]
    Overflow,
    /// The serial 2BW reference needs whole batches of `every` micro-batches.
    #[error("{micro} micro-batches are not whole batches of {every}")]
    PartialBatch {
        /// Micro-batches.
        micro: usize,
        /// Micro-batches per weight version.
        every: usize,
    },
    /// A gradient of another length than the weights.
    #[error("a gradient of {got} elements for {want} weights")]
    GradLength {
        /// The gradient's length.
        got: usize,
        /// The weights' length.
        want: usize,
    },
}

impl From<PipelineError> for crate::Error {
    fn from(e: PipelineError) -> Self {
        crate::Error::InvalidArgument(e.to_string())
    }
}

/// Checks `stages ≥ 1`, `micro ≥ 1` and `stage < stages`.
fn check_shape(stages: usize, stage: usize, micro: usize) -> Result<(), PipelineError> {
    if stages == 0 {
        return Err(PipelineError::NoStages);
    }
    if micro == 0 {
        return Err(PipelineError::NoMicroBatches);
    }
    if stage >= stages {
        return Err(PipelineError::StageOutOfRange { stage, stages });
    }
    Ok(())
}
