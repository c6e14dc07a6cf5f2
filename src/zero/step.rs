//! The end of an iteration of a [`ZeroManager`]: the reduce-scatter of a communication
//! group's gradients, and the optimizer step on this rank's chunks.

use super::{stage_name, ZeroManager};
use crate::comm::{reduce_grad_stats, Elem, ReduceOp};
use crate::error::{Error, Result};
use crate::optim::{GradStats, HybridAdam, StepReport};
use crate::tensor::{next_state, Stage, TensorId, TrainEvent};

impl ZeroManager {
    /// Averages the gradients of communication group `j` into their owners' chunks and frees
    /// the gather buffer.
    pub(super) fn reduce_scatter(&mut self, j: usize) -> Result<()> {
        let g = self.take_gather(j)?;
        let (n, r, es) = (self.world(), self.comm.rank(), self.es());
        let slot = self.slot_elems(j) * es;
        let elem = Elem::from(self.local.param_dtype());
        self.comm.reduce_scatter(
            &self.stream,
            g.buf.view(0, n * slot)?,
            g.buf.view(r * slot, slot)?,
            elem,
            ReduceOp::Avg,
        )?;
        if g.held {
            let owned = self.owned_local(j);
            for &(t, id) in &owned {
                let zt = &self.tensors[t as usize];
                if zt.grad {
                    let src = g
                        .buf
                        .view(r * slot + zt.slot.offset * es, zt.slot.numel * es)?;
                    self.local.write_grad_device(id, src)?;
                }
            }
            let ids: Vec<TensorId> = owned.iter().map(|&(_, id)| id).collect();
            self.local.release(&ids, Stage::Backward)?;
        }
        self.stats.reduce_scatters += 1;
        self.stats.scattered_bytes += (n * slot) as u64;
        Ok(())
    }
    /// Ends an iteration after its backward pass without an optimizer step (an evaluation
    /// forward, or a step the trainer drops): the gradients written are discarded, the
    /// parameters stay as they were, and a warm-up iteration is run again. Every rank must
    /// do the same.
    pub fn skip_step(&mut self) -> Result<()> {
        if self.stage != Some(Stage::Optimizer) {
            return Err(Error::WrongStage {
                call: "ZeroManager::skip_step (it runs after end_backward)".into(),
                stage: stage_name(self.stage),
            });
        }
        self.local.skip_step()?;
        for t in &mut self.tensors {
            t.state = next_state(t.state, TrainEvent::EndStep).unwrap_or(t.state);
            t.fwd_uses = 0;
            t.bwd_uses = 0;
            t.grad = false;
        }
        self.stage = None;
        Ok(())
    }

    /// The optimizer step on this rank's chunks, with gradient statistics all-reduced so that
    /// every rank clips by the global norm and skips an overflow together; ends the iteration.
    /// A step that fails on a collective (a peer failed or timed out) leaves the group of no
    /// further use: start new communicators and managers and load the ranks' checkpoints
    /// ([`ZeroManager::load_checkpoint`]).
    pub fn step(&mut self, adam: &mut HybridAdam) -> Result<StepReport> {
        self.step_reducing(adam, &mut Ok)
    }

    /// [`ZeroManager::step`] with the statistics, once all-reduced over the data-parallel
    /// group, passed through `reduce` too (e.g. over a tensor-parallel group).
    pub(crate) fn step_reducing(
        &mut self,
        adam: &mut HybridAdam,
        reduce: &mut dyn FnMut(GradStats) -> Result<GradStats>,
    ) -> Result<StepReport> {
        if self.stage != Some(Stage::Optimizer) {
            return Err(Error::WrongStage {
                call: "ZeroManager::step (it runs after end_backward)".into(),
                stage: stage_name(self.stage),
            });
        }
        let comm = &self.comm;
        let report = adam.step_reducing(&mut self.local, &mut |st: GradStats| {
            reduce(reduce_grad_stats([comm], st)?)
        })?;
        // the iteration is over whatever follows (the rank's manager ended it)
        for id in 0..self.tensors.len() {
            let t = &mut self.tensors[id];
            t.state = next_state(t.state, TrainEvent::EndStep).unwrap_or(t.state);
            t.fwd_uses = 0;
            t.bwd_uses = 0;
            t.grad = false;
        }
        self.stage = None;
        if self.prefetch.depth > 0 && !self.prefetch.all_steady {
            // A rank's manager may finish warm-up later than another's (say, one whose chunks
            // had no backward use): prefetch starts when all have, on every rank alike.
            let mut steady = [u8::from(self.local.is_steady())];
            self.comm.all_reduce_host(&mut steady, ReduceOp::Min)?;
            if steady[0] == 1 {
                self.prefetch.all_steady = true;
                // every tide has the reserve's room at every moment; prefetched buffers use it
                self.prefetch.reserve.clear();
            }
        }
        Ok(report)
    }
}
