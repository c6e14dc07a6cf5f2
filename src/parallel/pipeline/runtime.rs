//! The pipeline runtime: one stage's micro-batches on its rank's store, in a schedule's order,
//! within one store iteration.

use std::collections::HashMap;

use super::schedule::{PipeOp, Schedule};
use crate::comm::Communicator;
use crate::device::CachingAllocator;
use crate::device::Stream;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::store::{BackwardPass, ForwardPass, ParamStore};
use crate::tensor::TensorId;

/// One pipeline stage's computation, as [`PipelineStage::run`] drives it.
///
/// Layers whose parameters the stage holds must add their gradients as shares
/// ([`WeightUse::Shared`](crate::nn::WeightUse::Shared)): an iteration uses them once per
/// micro-batch. The last stage's [`forward`](StageModel::forward) returns the micro-batch's
/// loss as a one-element activation, and its backward starts from that loss (scale it by
/// `1/M` for the mean over the step's micro-batches).
pub trait StageModel {
    /// What a forward keeps for its backward (activations from the pass's pool).
    type Saved;

    /// Every parameter one micro-batch's forward fetches, once for each fetch (a tensor fetched
    /// twice is listed twice). [`PipelineStage::run`] declares the uses of the forwards it runs
    /// inside the backward pass with them.
    fn params(&self) -> Vec<TensorId>;

    /// The shape `[rows, cols]` of micro-batch `micro`'s input from the previous stage (not
    /// asked on the first stage). Its element type is the store's parameter dtype.
    fn input_shape(&self, micro: usize) -> Result<[usize; 2]>;

    /// The forward of micro-batch `micro`: `input` is the previous stage's output (`None` on
    /// the first stage, which reads its own data). Returns the output for the next stage (on
    /// the last stage, the loss: one element) and what the backward needs.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        micro: usize,
        input: Option<&Act>,
    ) -> Result<(Act, Self::Saved)>;

    /// The backward of micro-batch `micro` from what its forward saved and its output's
    /// gradient (`None` on the last stage): adds the parameters' gradient shares and returns
    /// the input's gradient (required on every stage but the first, ignored there).
    fn backward(
        &self,
        pass: &mut BackwardPass<'_>,
        micro: usize,
        saved: Self::Saved,
        dout: Option<&Act>,
    ) -> Result<Option<Act>>;

    /// Parameters [`StageModel::finish_backward`] fetches (once each); their uses are
    /// declared in the forward pass. None by default.
    fn finish_params(&self) -> Vec<TensorId> {
        Vec::new()
    }

    /// Runs once at the end of the step's backward pass, after every micro-batch's backward
    /// and the last message: e.g. the sum of a weight's gradient shares over the stages that
    /// hold copies of it (a GPT's `wte`, on the first and the last stage). Its messages on the
    /// pipeline group go between the first and the last stage. Nothing by default.
    fn finish_backward(&self, pass: &BackwardPass<'_>) -> Result<()> {
        let _ = pass;
        Ok(())
    }
}

/// What one [`PipelineStage::run`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageReport {
    /// The most micro-batches whose saved state was alive at once.
    pub peak_in_flight: usize,
    /// The schedule's bound on it ([`Schedule::in_flight_bound`]).
    pub in_flight_bound: usize,
    /// Each micro-batch's loss, on the last stage (empty elsewhere).
    pub losses: Vec<f32>,
    /// The pool's allocated bytes after each op (in op order).
    pub pool_bytes: Vec<usize>,
    /// Forwards run inside the backward pass (in recompute passes).
    pub late_forwards: usize,
    /// Forwards of the next batch run inside the backward pass, on the other weight version
    /// (in [`ahead`](crate::store::BackwardPass::ahead) passes; PipeDream-2BW without a flush).
    pub ahead_forwards: usize,
    /// Messages sent to the next stage and to the previous one, and received from the
    /// previous stage and from the next one (activations forward, their gradients back): each
    /// stage's sends to a neighbour in an iteration are that neighbour's receives in the same
    /// iteration, so no message waits across an optimizer step.
    pub messages: StageMessages,
    /// Plain sends (a send with no receive after it to pair with).
    pub(crate) sends: usize,
    /// Plain receives.
    pub(crate) recvs: usize,
    /// Grouped send-receives (a send paired with the receive that follows it).
    pub(crate) send_recvs: usize,
    /// Seconds of the run spent in messages, the stage's own enqueued work done first: waiting
    /// for a neighbour and moving activations (the stage's share of the bubble, plus the
    /// transfers).
    pub wait_seconds: f64,
    /// Seconds of the whole run.
    pub total_seconds: f64,
}

/// The point-to-point messages of a stage's run, by direction (see [`StageReport::messages`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageMessages {
    /// Activations sent to the next stage.
    pub to_next: usize,
    /// Input gradients sent to the previous stage.
    pub to_prev: usize,
    /// Activations received from the previous stage.
    pub from_prev: usize,
    /// Output gradients received from the next stage.
    pub from_next: usize,
}

impl StageMessages {
    fn sent(&mut self, stage: usize, to: usize) {
        if to > stage {
            self.to_next += 1;
        } else {
            self.to_prev += 1;
        }
    }

    fn received(&mut self, stage: usize, from: usize) {
        if from < stage {
            self.from_prev += 1;
        } else {
            self.from_next += 1;
        }
    }
}

/// One rank's stage of a pipeline over the pipeline group: stage `group.rank()` of
/// `group.world()` (see the [module docs](super)).
///
/// ```no_run
/// # use tidemem::prelude::*;
/// # use tidemem::parallel::pipeline::{PipelineStage, Schedule, StageModel};
/// # fn f(grid: &tidemem::parallel::ProcessGrid, store: &mut ChunkManager,
/// #      model: &impl StageModel, adam: &mut HybridAdam) -> Result<()> {
/// let stage = PipelineStage::new(grid.pipeline(), Schedule::OneFOneB, 8)?;
/// let report = stage.run(store, model)?; // forward and backward of 8 micro-batches
/// store.step(adam)?;
/// assert!(report.peak_in_flight <= report.in_flight_bound);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PipelineStage<'c> {
    pub(super) group: &'c Communicator,
    pub(super) stage: usize,
    pub(super) stages: usize,
    pub(super) micro: usize,
    pub(super) schedule: Schedule,
    ops: Vec<PipeOp>,
}

/// A message held back to pair with the receive of the next op: the activation and its peer.
pub(super) type Pending = Option<(Act, usize)>;

/// The state of one run: saved micro-batches, the held-back send, the report.
pub(super) struct Run<S> {
    pub(super) saved: HashMap<usize, (S, [usize; 2])>,
    pub(super) pending: Pending,
    pub(super) report: StageReport,
}

impl<'c> PipelineStage<'c> {
    /// Stage `group.rank()` of `group.world()` under `schedule` for `micro` micro-batches a
    /// step. [`Schedule::TwoBW`] runs with [`PipelineStage::run_two_bw`], a version a step
    /// (`every == micro`): another `every` is [`Error::Length`]; the schedule's shape errors
    /// are [`Schedule::ops`]'.
    pub fn new(group: &'c Communicator, schedule: Schedule, micro: usize) -> Result<Self> {
        if let Schedule::TwoBW { every } = schedule {
            if every != micro {
                return Err(Error::Length {
                    what: "micro-batches per PipeDream-2BW weight version (a version is an \
                           optimizer step here, of the step's micro-batches)"
                        .into(),
                    got: every,
                    expected: micro,
                });
            }
        }
        let (stage, stages) = (group.rank(), group.world());
        let ops = schedule.ops(stages, stage, micro)?;
        Ok(PipelineStage {
            group,
            stage,
            stages,
            micro,
            schedule,
            ops,
        })
    }

    /// This stage's index.
    pub fn stage(&self) -> usize {
        self.stage
    }

    /// The number of stages.
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// This stage's op order.
    pub fn ops(&self) -> &[PipeOp] {
        &self.ops
    }

    /// Runs the forwards and backwards of the step's micro-batches on `store` in the
    /// schedule's order, as one iteration: the forwards before the first backward in the
    /// forward pass, the rest in recompute passes of the backward pass. Returns with the
    /// backward pass finished; the caller steps the optimizer (`store.step`) or skips.
    ///
    /// Every stage of the group must call it with the same schedule and micro-batches. An
    /// error (the model's, a store's, a message's) returns at once; the other stages then fail
    /// when their messages time out, never hang. The store is then left mid-iteration.
    pub fn run<S, M>(&self, store: &mut S, model: &M) -> Result<StageReport>
    where
        S: ParamStore + ?Sized,
        M: StageModel,
    {
        if let Schedule::TwoBW { .. } = self.schedule {
            return Err(Error::Conflict {
                what: "PipelineStage::run".into(),
                with: "PipeDream-2BW (it runs its micro-batches across optimizer steps: use \
                       run_two_bw)"
                    .into(),
            });
        }
        let mut run = Run::<M::Saved> {
            saved: HashMap::new(),
            pending: None,
            report: StageReport {
                in_flight_bound: self.schedule.in_flight_bound(
                    self.stages,
                    self.stage,
                    self.micro,
                )?,
                ..StageReport::default()
            },
        };
        // one iteration of one batch: both "versions" the model, no forward of a next batch
        self.iteration(store, [model, model], 0, self.micro, &self.ops, &mut run)?;
        Ok(run.report)
    }

    pub(super) fn forward_op<M: StageModel>(
        &self,
        pass: &ForwardPass<'_>,
        model: &M,
        m: usize,
        run: &mut Run<M::Saved>,
    ) -> Result<()> {
        let recv = match self.stage {
            0 => None,
            s => Some((s - 1, model.input_shape(m)?, pass.param_dtype())),
        };
        let input = self.exchange(pass.stream(), pass.pool(), run, recv)?;
        let (out, saved) = model.forward(pass, m, input.as_ref())?;
        drop(input);
        run.saved.insert(m, (saved, out.shape()));
        let alive = run.saved.len();
        run.report.peak_in_flight = run.report.peak_in_flight.max(alive);
        if alive > run.report.in_flight_bound {
            return Err(Error::Internal {
                what: format!(
                    "stage {}: {alive} micro-batches in flight, past the schedule's {}",
                    self.stage, run.report.in_flight_bound
                ),
            });
        }
        if self.stage + 1 == self.stages {
            if out.numel() != 1 {
                let [rows, cols] = out.shape();
                return Err(Error::ActivationShape {
                    what: "the last stage's forward output (the loss, one element)".into(),
                    rows,
                    cols,
                    dtype: out.dtype(),
                    expected_rows: Some(1),
                    expected_cols: 1,
                    expected_dtype: out.dtype(),
                });
            }
            run.report.losses.push(out.to_f32(pass.stream())?[0]);
        } else {
            run.pending = Some((out, self.stage + 1));
        }
        run.report.pool_bytes.push(pass.pool().stats().allocated);
        Ok(())
    }

    pub(super) fn backward_op<M: StageModel>(
        &self,
        pass: &mut BackwardPass<'_>,
        model: &M,
        m: usize,
        run: &mut Run<M::Saved>,
    ) -> Result<()> {
        let (saved, shape) = run.saved.remove(&m).ok_or_else(|| Error::BadSchedule {
            stage: self.stage,
            reason: format!("B{m} before F{m}"),
        })?;
        let recv =
            (self.stage + 1 < self.stages).then(|| (self.stage + 1, shape, pass.param_dtype()));
        let dout = self.exchange(pass.stream(), pass.pool(), run, recv)?;
        let din = model.backward(pass, m, saved, dout.as_ref())?;
        drop(dout);
        if self.stage > 0 {
            let din = din.ok_or_else(|| Error::Empty {
                what: format!(
                    "stage {}: the input gradient the backward of micro-batch {m} returned (a \
                     stage after the first must return one)",
                    self.stage
                ),
            })?;
            run.pending = Some((din, self.stage - 1));
        }
        run.report.pool_bytes.push(pass.pool().stats().allocated);
        Ok(())
    }

    /// Sends the held-back message and receives `recv` (`(peer, shape, dtype)`), as one
    /// grouped `send_recv` when both are there.
    pub(super) fn exchange<S>(
        &self,
        stream: &Stream,
        pool: &CachingAllocator,
        run: &mut Run<S>,
        recv: Option<(usize, [usize; 2], DType)>,
    ) -> Result<Option<Act>> {
        // the stage's own work first, so that the wait holds only the messages
        self.group.device().sync_stream(stream)?;
        let t0 = std::time::Instant::now();
        let out = self.exchange_in(stream, pool, run, recv);
        run.report.wait_seconds += t0.elapsed().as_secs_f64();
        out
    }

    fn exchange_in<S>(
        &self,
        stream: &Stream,
        pool: &CachingAllocator,
        run: &mut Run<S>,
        recv: Option<(usize, [usize; 2], DType)>,
    ) -> Result<Option<Act>> {
        let g = self.group;
        let send = run.pending.take();
        let st = self.stage;
        let Some((from, [rows, cols], dtype)) = recv else {
            if let Some((act, to)) = send {
                g.send(stream, act.view(), act.dtype(), to)?;
                run.report.sends += 1;
                run.report.messages.sent(st, to);
            }
            return Ok(None);
        };
        run.report.messages.received(st, from);
        let buf = Act::alloc(pool, rows, cols, dtype)?;
        match send {
            Some((act, to)) => {
                if act.dtype() != dtype {
                    return Err(Error::WrongDType {
                        what: format!(
                            "stage {}: the activation to send with a {dtype} one to receive",
                            self.stage
                        ),
                        dtype: act.dtype(),
                        expected: dtype.name(),
                    });
                }
                g.send_recv(stream, act.view(), to, buf.view(), from, dtype)?;
                run.report.send_recvs += 1;
                run.report.messages.sent(st, to);
            }
            None => {
                g.recv(stream, buf.view(), dtype, from)?;
                run.report.recvs += 1;
            }
        }
        Ok(Some(buf))
    }
}
