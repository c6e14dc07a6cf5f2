//! PipeDream-2BW without a flush: a stream of batches whose ops cross the optimizer steps,
//! on two registrations of a stage's parameters (the two weight versions).

use std::collections::HashMap;

use super::runtime::{PipelineStage, Run, StageModel, StageReport};
use super::schedule::{two_bw, PipeOp, Schedule};
use crate::error::{Error, Result};
use crate::store::{check_params_clean, rewarm, ParamStore};
use crate::tensor::{ChunkKind, TensorId};

/// The optimizer's lists: what the set stepped next takes over from the other.
const OPTIMIZER_LISTS: [ChunkKind; 3] =
    [ChunkKind::Master, ChunkKind::Momentum, ChunkKind::Variance];

impl PipelineStage<'_> {
    /// Runs `batches` batches of PipeDream-2BW (`Schedule::TwoBW { every }`, a batch of
    /// `every` micro-batches per optimizer step) as one stream with no flush: stage `s` starts
    /// batch `b + 1`'s first `P − s − 1` forwards between batch `b`'s last backwards, before
    /// batch `b`'s step, as the schedule's op order ([`two_bw`]) has it; only the pipeline's
    /// fill and drain at the ends of the stream idle.
    ///
    /// The stage's parameters are registered twice, each time after
    /// [`ParamStore::align_to_ranks`] (on ZeRO this puts each tensor's two versions on one rank,
    /// so the state copies need no message; without it they go by broadcast where the owners
    /// differ): `versions[0]` and `versions[1]` list the
    /// same parameters in the same order ([`StageModel::params`] and
    /// [`StageModel::finish_params`], of the same shapes). Batch `b` runs on
    /// `versions[b % 2]`, which holds `W(b − 1)` (`W(−1) = W(0)`): `versions[1]` starts as a
    /// copy of `versions[0]` ([`ParamStore::copy_state`], every list). Store iteration `b`
    /// holds the ops between step `b − 1` and step `b`: batch `b`'s forwards not run yet
    /// (the first in the forward pass, the others in recompute passes), all of its backwards,
    /// and batch `b + 1`'s early forwards in [`ahead`](crate::store::BackwardPass::ahead)
    /// passes, which read the other version and touch no gradient. Then batch `b`'s version
    /// takes the other's masters and moments (the newest, `W(b)`), and `step(store, b)` runs
    /// the optimizer: it makes `W(b + 1) = W(b) − Adam(∇f(W(b − 1)))` in batch `b`'s version,
    /// for batch `b + 2`, while the other keeps `W(b)` for batch `b + 1`. A step may skip only
    /// as `HybridAdam` does on an overflow, restoring the parameters from the masters; a step
    /// that leaves gradients in the parameter slots (`skip_step`) is an error here, before they
    /// are read as weights. After the last step `versions[0]` holds the newest weights and
    /// optimizer state (copied from `versions[1]` when that one stepped last), so a later call
    /// goes on from them; its first batch computes on them, as the first batch of a stream
    /// does.
    ///
    /// The stream's first iteration (the pipeline's fill) differs from the steady ones after
    /// it, so with more than two batches the store's warm-up (the tide's trace, a ZeRO rank's
    /// prefetch order) records the second iteration instead.
    ///
    /// Micro-batch `j` of the stream is micro-batch `j % every` of batch `j / every`: the
    /// models' `forward`, `backward` and `input_shape` get `j`. Returns a report per batch
    /// (its iteration's ops; the last stage's losses are the batch's). On a
    /// [`ZeroManager`](crate::zero::ZeroManager) the state copy moves a tensor's state between
    /// the ranks that own the two versions of it, and the ahead fetches gather without reducing.
    /// Errors return at once, as [`PipelineStage::run`]'s.
    pub fn run_two_bw<S, M>(
        &self,
        store: &mut S,
        versions: [&M; 2],
        batches: usize,
        mut step: impl FnMut(&mut S, usize) -> Result<()>,
    ) -> Result<Vec<StageReport>>
    where
        S: ParamStore + ?Sized,
        M: StageModel,
    {
        let Schedule::TwoBW { every } = self.schedule else {
            return Err(Error::Conflict {
                what: "run_two_bw".into(),
                with: format!(
                    "the {} schedule (it runs PipeDream-2BW only)",
                    self.schedule.name()
                ),
            });
        };
        let pairs = version_pairs(versions)?;
        let total = match batches.checked_mul(every) {
            None => {
                return Err(Error::Overflow {
                    what: format!("the micro-batches of {batches} batches of {every}"),
                })
            }
            Some(0) => {
                return Err(Error::TooFew {
                    what: format!("micro-batches in {batches} batches of {every}"),
                    got: 0,
                    need: 1,
                })
            }
            Some(n) => n,
        };
        let ops = two_bw(self.stages, self.stage, total, every)?;
        store.copy_state(&pairs, &ChunkKind::ALL)?;
        let swapped: Vec<(TensorId, TensorId)> = pairs.iter().map(|&(a, b)| (b, a)).collect();
        let mut run = Run::<M::Saved> {
            saved: HashMap::new(),
            pending: None,
            report: StageReport::default(),
        };
        let bound = self
            .schedule
            .in_flight_bound(self.stages, self.stage, every)?;
        let mut reports = Vec::with_capacity(batches);
        let mut at = 0;
        for b in 0..batches {
            // iteration b: up to batch b's last backward
            let end = ops[at..]
                .iter()
                .position(|v| v.op == PipeOp::Backward(b * every + every - 1))
                .map(|k| at + k + 1)
                .ok_or_else(|| Error::Internal {
                    what: format!(
                        "stage {}: the 2BW op list has no end of batch {b}",
                        self.stage
                    ),
                })?;
            run.report = StageReport {
                in_flight_bound: bound,
                ..StageReport::default()
            };
            let ops_b: Vec<PipeOp> = ops[at..end].iter().map(|v| v.op).collect();
            self.iteration(store, versions, b, every, &ops_b, &mut run)?;
            at = end;
            reports.push(std::mem::take(&mut run.report));
            // batch b's version takes the newest masters and moments, then steps
            let to_current = if b % 2 == 0 { &swapped } else { &pairs };
            store.copy_state(to_current, &OPTIMIZER_LISTS)?;
            step(store, b)?;
            let stepped: Vec<TensorId> = to_current.iter().map(|&(_, to)| to).collect();
            check_params_clean(store, &stepped)?;
            if b == 0 && batches > 2 {
                // the first iteration, the pipeline's fill, is unlike the steady ones after it:
                // the store's warm-up records the next one
                rewarm(store)?;
            }
        }
        // the newest version into versions[0], where the next call starts
        if batches.is_multiple_of(2) {
            store.copy_state(&swapped, &ChunkKind::ALL)?;
        }
        Ok(reports)
    }

    /// Store iteration `b` over its ops (see [`PipelineStage::run_two_bw`]): batch `b`'s ops on
    /// `versions[b % 2]`, batch `b + 1`'s forwards ahead on the other. [`PipelineStage::run`]
    /// runs one batch's ops through it with the model as both versions.
    pub(super) fn iteration<S, M>(
        &self,
        store: &mut S,
        versions: [&M; 2],
        b: usize,
        every: usize,
        ops: &[PipeOp],
        run: &mut Run<M::Saved>,
    ) -> Result<()>
    where
        S: ParamStore + ?Sized,
        M: StageModel,
    {
        let started = std::time::Instant::now();
        let (now, next) = (versions[b % 2], versions[(b + 1) % 2]);
        let batch = |op: PipeOp| op.micro() / every;
        let first_b = ops
            .iter()
            .position(|o| !o.is_forward())
            .unwrap_or(ops.len());
        let (early, late) = ops.split_at(first_b);
        if early.iter().any(|&o| batch(o) != b) {
            return Err(Error::BadSchedule {
                stage: self.stage,
                reason: format!(
                    "a forward of batch {} before batch {b}'s first backward",
                    b + 1
                ),
            });
        }
        run.report.late_forwards = late
            .iter()
            .filter(|&&o| o.is_forward() && batch(o) == b)
            .count();
        let fwd = store.forward()?;
        for &op in early {
            self.forward_op(&fwd, now, op.micro(), run)?;
        }
        // the uses of batch b's other forwards, run before this iteration (ahead, on this
        // version) or in its recompute passes
        let declared = every - early.len();
        if declared > 0 {
            let times = u32::try_from(declared).map_err(|_| Error::TooLarge {
                what: "forwards in one step whose uses are declared".into(),
                requested: declared as u128,
                limit: u64::from(u32::MAX),
            })?;
            fwd.declare_uses(&now.params(), times)?;
        }
        for id in now.finish_params() {
            fwd.fetch(&[id])?.release()?;
        }
        fwd.finish()?;
        let mut bwd = store.backward()?;
        // The next stage runs one forward of batch b + 1 fewer ahead than this one, so it takes
        // the output of this stage's last ahead forward in the next iteration, after the
        // optimizer step and its collectives over the pipeline group: that message waits for
        // the next iteration here too, rather than sit in a send across the step (with two
        // stages it also keeps the order of the end-of-pass messages between the first and the
        // last stage, [`StageModel::finish_backward`], on their one channel).
        let ahead_total = late
            .iter()
            .filter(|&&o| o.is_forward() && batch(o) != b)
            .count();
        let mut held = None;
        for &op in late {
            match op {
                PipeOp::Forward(j) if batch(op) == b => {
                    let re = bwd.recompute()?;
                    self.forward_op(&re, now, j, run)?;
                    re.finish()?;
                }
                PipeOp::Forward(j) => {
                    let ahead = bwd.ahead()?;
                    self.forward_op(&ahead, next, j, run)?;
                    ahead.finish()?;
                    run.report.ahead_forwards += 1;
                    if run.report.ahead_forwards == ahead_total && self.stage + 1 < self.stages {
                        held = run.pending.take();
                    }
                }
                PipeOp::Backward(j) => self.backward_op(&mut bwd, now, j, run)?,
            }
        }
        self.exchange(bwd.stream(), bwd.pool(), run, None)?;
        now.finish_backward(&bwd)?;
        bwd.finish()?;
        run.pending = held;
        run.report.total_seconds = started.elapsed().as_secs_f64();
        Ok(())
    }
}

/// The `(versions[0], versions[1])` pairs of each parameter, in the models' order, each once.
fn version_pairs<M: StageModel>(versions: [&M; 2]) -> Result<Vec<(TensorId, TensorId)>> {
    let list = |m: &M| {
        let mut seen = std::collections::HashSet::new();
        let mut v = m.params();
        v.extend(m.finish_params());
        v.retain(|id| seen.insert(*id));
        v
    };
    let (a, b) = (list(versions[0]), list(versions[1]));
    let overlap = a.iter().any(|x| b.contains(x));
    if a.len() != b.len() {
        return Err(Error::Length {
            what: "parameters of PipeDream-2BW's second version (the first's, registered again)"
                .into(),
            got: b.len(),
            expected: a.len(),
        });
    }
    if overlap {
        return Err(Error::Conflict {
            what: "PipeDream-2BW's second version".into(),
            with: "its first (they share a parameter: the two list the same parameters, \
                   registered twice)"
                .into(),
        });
    }
    Ok(a.into_iter().zip(b).collect())
}
