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
//! fraction; an order that cannot proceed is [`Error::Deadlock`](crate::Error::Deadlock). [`partition`] cuts `L`
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
//! # fn main() -> tidemem::Result<()> {
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

/// Checks `stages ≥ 1`, `micro ≥ 1` and `stage < stages`.
fn check_shape(stages: usize, stage: usize, micro: usize) -> crate::Result<()> {
    if stages == 0 {
        return Err(no_stages("stages of a pipeline"));
    }
    if micro == 0 {
        return Err(crate::Error::TooFew {
            what: "micro-batches of a pipeline step".into(),
            got: 0,
            need: 1,
        });
    }
    if stage >= stages {
        return Err(crate::Error::IndexOutOfRange {
            what: "pipeline stage".into(),
            index: stage,
            len: stages,
        });
    }
    Ok(())
}

/// A pipeline of no stage: [`Error::TooFew`](crate::Error::TooFew) of `what`, 0 of at least 1.
fn no_stages(what: &str) -> crate::Error {
    crate::Error::TooFew {
        what: what.into(),
        got: 0,
        need: 1,
    }
}
