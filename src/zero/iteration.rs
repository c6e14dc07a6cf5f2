//! One iteration of a [`ZeroManager`]: fetches and releases, reads, gradient writes, and the
//! ends of the forward and backward stages.

use std::sync::Arc;

use super::{stage_name, ZeroManager};
use crate::chunk::{encode, TensorView, ViewBuf};
use crate::device::HostBuffer;
use crate::error::{Error, Result};
use crate::tensor::{next_state, Stage, TensorId, TensorState, TrainEvent};

impl ZeroManager {
    /// Fetches tensors for an op of `stage`, gathering their communication groups first; the
    /// views point into the gather buffers and stay valid until [`ZeroManager::release`].
    pub fn fetch(&mut self, ids: &[TensorId], stage: Stage) -> Result<Vec<TensorView>> {
        let ev = match stage {
            Stage::Forward => TrainEvent::BeforeFwdOp,
            Stage::Backward => TrainEvent::BeforeBwdOp,
            Stage::Optimizer => {
                return Err(Error::WrongStage {
                    call: "fetch for the optimizer (fetch is for forward and backward; the \
                           optimizer runs in step)"
                        .into(),
                    stage: stage_name(self.stage),
                })
            }
        };
        match (self.stage, stage) {
            (None, Stage::Forward) | (Some(Stage::Forward), Stage::Forward) => {}
            (Some(Stage::Backward), Stage::Backward) => {}
            (s, _) => {
                return Err(Error::WrongStage {
                    call: format!("a {stage} fetch (call end_forward / end_backward / step first)"),
                    stage: stage_name(s),
                })
            }
        }
        self.check(ids, ev)?;
        self.close()?;
        if self.stage.is_none() {
            // a mark that fails is left out: profiling never fails a step
            let _ = self
                .comm
                .device()
                .mark_phase(&self.stream, crate::device::Phase::Forward);
            // a new iteration: record the forward order until the tide is steady
            let p = &mut self.prefetch;
            p.recording = p.depth > 0 && !p.all_steady;
            if p.recording {
                p.order.iter_mut().for_each(Vec::clear);
            }
            p.cursor = 0;
            p.on_order = true;
        }
        let mut groups: Vec<usize> = ids.iter().map(|&id| self.comm_group(id)).collect();
        groups.dedup();
        for j in groups {
            let first_use = match &self.gathers[j] {
                None => {
                    self.gather(j, stage, false)?;
                    true
                }
                Some(g) => !g.used,
            };
            if let Some(ev) = self.gathers[j].as_mut().and_then(|g| g.ready.take()) {
                self.comm.device().wait_event(&self.stream, &ev)?;
            }
            if first_use {
                if stage == Stage::Backward {
                    self.hold_owned(j)?;
                }
                self.first_use(j, stage)?;
            }
            // used only once the owned chunk is held: a failed fetch is a first use again
            self.gathers[j].as_mut().expect("gathered above").used = true;
        }
        self.stage = Some(stage);
        for &id in ids {
            self.apply(id, ev);
            let t = &mut self.tensors[id.index()];
            match stage {
                Stage::Forward => t.fwd_uses += 1,
                _ => t.bwd_uses += 1,
            }
        }
        ids.iter().map(|&id| self.view_tensor(id)).collect()
    }

    /// Gathers the groups of a fetch ahead that are not gathered yet, the owned values copied
    /// without a use (as a gather made ahead does), after checking the transition.
    fn gather_ahead(&mut self, ids: &[TensorId]) -> Result<()> {
        self.check(ids, TrainEvent::BeforeBwdOp)?;
        let mut groups: Vec<usize> = ids.iter().map(|&id| self.comm_group(id)).collect();
        groups.dedup();
        for j in groups {
            if self.gathers[j].is_none() {
                self.gather(j, Stage::Backward, true)?;
            }
            self.wait_ready(j)?;
        }
        Ok(())
    }

    /// A view of a tensor in its group's gather buffer.
    fn view_tensor(&self, id: TensorId) -> Result<TensorView> {
        let (n, es, dt) = (self.world(), self.es(), self.local.param_dtype());
        let t = &self.tensors[id.index()];
        let j = t.slot.group as usize / n;
        let q = t.slot.group as usize % n;
        let g = self.gathers[j].as_ref().expect("gathered");
        let off = q * self.slot_elems(j) * es + t.slot.offset * es;
        Ok(TensorView::new(
            id,
            dt,
            t.slot.numel,
            ViewBuf::Pooled(Arc::clone(&g.buf)),
            off,
        ))
    }

    /// Counts `times` more forward uses of each of `ids` without fetching them (see
    /// [`crate::chunk::ChunkManager`]'s declared uses): no gather, no moment. Only in the
    /// forward stage, for tensors this forward pass has fetched already.
    pub(crate) fn declare_forward_uses(&mut self, ids: &[TensorId], times: u32) -> Result<()> {
        if self.stage != Some(Stage::Forward) {
            return Err(Error::WrongStage {
                call: "declaring forward uses (after the forward pass's first fetch of them)"
                    .into(),
                stage: stage_name(self.stage),
            });
        }
        crate::chunk::add_forward_uses(&mut self.tensors, ids, times, |t| {
            (&t.name, &mut t.fwd_uses)
        })
    }

    /// Fetches tensors in the backward stage to recompute a forward op (activation
    /// checkpointing): one more use on each side, so the fetch is never a tensor's last
    /// backward use (see [`crate::chunk::ChunkManager`]'s recompute fetch).
    pub(crate) fn fetch_recompute(&mut self, ids: &[TensorId]) -> Result<Vec<TensorView>> {
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "a recompute fetch (it belongs to the backward pass)".into(),
                stage: stage_name(self.stage),
            });
        }
        crate::chunk::check_distinct(ids)?;
        self.check(ids, TrainEvent::BeforeBwdOp)?;
        for &id in ids {
            self.tensors[id.index()].fwd_uses += 1;
        }
        let r = self.fetch(ids, Stage::Backward);
        if r.is_err() {
            for &id in ids {
                self.tensors[id.index()].fwd_uses -= 1;
            }
        }
        r
    }

    /// Fetches tensors in the backward stage for a forward whose backward runs in a later
    /// iteration (see [`crate::chunk::ChunkManager`]'s fetch ahead): their communication groups
    /// are gathered if they are not, copying this rank's owned values without a use, and no use
    /// is counted, so no gradient is written or reduced for them. Only for tensors this
    /// iteration has not used.
    pub(crate) fn fetch_ahead(&mut self, ids: &[TensorId]) -> Result<Vec<TensorView>> {
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "a fetch ahead (it belongs to the backward pass)".into(),
                stage: stage_name(self.stage),
            });
        }
        crate::chunk::check_unused(&self.tensors, ids, |t| (&t.name, t.fwd_uses, t.bwd_uses))?;
        // a tensor never used yet gets its values with this gather, as in a forward
        let fresh: Vec<TensorId> = ids
            .iter()
            .copied()
            .filter(|id| self.tensors[id.index()].state == TensorState::Free)
            .collect();
        let state = |z: &mut Self, s| {
            for id in &fresh {
                z.tensors[id.index()].state = s;
            }
        };
        state(self, TensorState::Hold);
        let r = self.gather_ahead(ids);
        if r.is_err() {
            state(self, TensorState::Free);
        }
        r?;
        for &id in ids {
            self.apply(id, TrainEvent::BeforeBwdOp);
            self.tensors[id.index()].ahead += 1;
        }
        ids.iter().map(|&id| self.view_tensor(id)).collect()
    }

    /// Ends an op's use of tensors; frees or reduce-scatters communication groups that are done
    /// with the stage.
    pub fn release(&mut self, ids: &[TensorId], stage: Stage) -> Result<()> {
        if self.stage != Some(stage) || stage == Stage::Optimizer {
            return Err(Error::WrongStage {
                call: format!("a release for {stage}"),
                stage: stage_name(self.stage),
            });
        }
        let evs: Vec<TrainEvent> = ids
            .iter()
            .map(|&id| {
                let t = self.tensors.get(id.index());
                match (stage, t) {
                    (Stage::Forward, _) => TrainEvent::AfterFwdOp,
                    (_, Some(t)) if t.ahead > 0 => TrainEvent::AfterBwdOp,
                    (_, Some(t)) if t.bwd_uses >= t.fwd_uses => TrainEvent::AfterLastBwdOp,
                    _ => TrainEvent::AfterBwdOp,
                }
            })
            .collect();
        for (&id, &ev) in ids.iter().zip(&evs) {
            self.check(&[id], ev)?;
        }
        // the groups this release completes, decided on the states it leads to, so that a
        // refusal (a view still alive) changes nothing
        let after = |t: u32| -> (TensorState, u32) {
            let z = &self.tensors[t as usize];
            match ids.iter().position(|id| id.0 == t) {
                Some(k) => (next_state(z.state, evs[k]).expect("checked"), z.fwd_uses),
                None => (z.state, z.fwd_uses),
            }
        };
        let mut groups: Vec<usize> = ids.iter().map(|&id| self.comm_group(id)).collect();
        groups.sort_unstable();
        groups.dedup();
        let mut done = Vec::new();
        for j in groups {
            let Some(g) = &self.gathers[j] else { continue };
            let ts = self.comm_group_tensors(j);
            let complete = match stage {
                Stage::Forward => ts.iter().all(|&t| after(t).0 == TensorState::HoldAfterFwd),
                _ => ts.iter().all(|&t| {
                    let (s, fwd) = after(t);
                    s == TensorState::HoldAfterBwd || (fwd == 0 && s != TensorState::Compute)
                }),
            };
            if complete {
                if Arc::strong_count(&g.buf) > 1 {
                    return Err(Error::ViewAlive {
                        what: format!("communication group {j}"),
                        during: "release",
                    });
                }
                done.push(j);
            }
        }
        for (&id, &ev) in ids.iter().zip(&evs) {
            self.apply(id, ev);
            let t = &mut self.tensors[id.index()];
            if stage == Stage::Backward && t.ahead > 0 {
                t.ahead -= 1;
            }
        }
        for j in done {
            let used = self.gathers[j].as_ref().is_some_and(|g| g.used);
            match stage {
                // gathered only for fetches ahead: no rank has gradients for it
                Stage::Backward if used => self.reduce_scatter(j)?,
                _ => drop(self.take_gather(j)?),
            }
        }
        Ok(())
    }

    /// A fetched tensor's values as f32 (from the gather buffer), or an owned tensor's from this
    /// rank's manager.
    pub fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        if id.index() >= self.tensors.len() {
            return Err(Error::UnknownTensor { id: id.0 });
        }
        if self.closed && self.gathers[self.comm_group(id)].is_some() {
            self.wait_ready(self.comm_group(id))?;
            let dev = self.comm.device().clone();
            let bytes = dev.download(&self.stream, self.view_of(id)?)?;
            return Ok(crate::chunk::decode(&bytes, self.local.param_dtype()));
        }
        match self.tensors[id.index()].local {
            Some(l) => self.local.read(l),
            None => Err(Error::Conflict {
                what: format!("reading tensor '{}'", self.tensors[id.index()].name),
                with: format!(
                    "rank {}, which neither gathers nor owns it",
                    self.comm.rank()
                ),
            }),
        }
    }

    /// The fp32 master values of a tensor this rank owns.
    pub fn master(&mut self, id: TensorId) -> Result<Vec<f32>> {
        match self.tensors.get(id.index()).and_then(|t| t.local) {
            Some(l) => self.local.master(l),
            None => Err(Error::Conflict {
                what: format!("reading the master of tensor {id}"),
                with: format!("rank {}, which does not own it", self.comm.rank()),
            }),
        }
    }

    /// Writes a tensor's local gradient (of this rank's share of the batch) at its last backward
    /// use; it is averaged over ranks when its communication group is reduce-scattered.
    pub fn write_grad(&mut self, id: TensorId, grad: &[f32]) -> Result<()> {
        if !self.grad_use(id)? {
            let t = &self.tensors[id.index()];
            return Err(Error::Conflict {
                what: format!(
                    "a gradient write of shared tensor '{}' at backward use {} of {}",
                    t.name, t.bwd_uses, t.fwd_uses
                ),
                with: "a backward use before the last; write it at the last".into(),
            });
        }
        let t = &self.tensors[id.index()];
        if grad.len() != t.slot.numel {
            return Err(Error::SizeMismatch {
                src: grad.len(),
                dst: t.slot.numel,
            });
        }
        let bytes = encode(grad, self.local.param_dtype());
        let h = HostBuffer::from_slice(&bytes)?;
        let dev = self.comm.device().clone();
        let copy = dev.copy_h2d(&self.stream, h, self.view_of(id)?)?;
        // the stream may hold collectives: wait through the communicator, which gives up on a
        // peer that failed or never comes
        self.comm.wait(&self.stream)?;
        copy.wait()?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }

    /// Ends the forward pass; frees every gather buffer still held.
    pub fn end_forward(&mut self) -> Result<()> {
        if !matches!(self.stage, None | Some(Stage::Forward)) {
            return Err(Error::WrongStage {
                call: "end_forward".into(),
                stage: stage_name(self.stage),
            });
        }
        self.close()?;
        let all: Vec<TensorId> = (0..self.tensors.len() as u32).map(TensorId).collect();
        for &id in &all {
            let t = &self.tensors[id.index()];
            if next_state(t.state, TrainEvent::EndForward).is_none() {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: "param",
                    state: t.state,
                    event: TrainEvent::EndForward,
                });
            }
        }
        for j in 0..self.gathers.len() {
            if self.gathers[j].is_some() {
                drop(self.take_gather(j)?);
            }
        }
        for id in all {
            self.apply(id, TrainEvent::EndForward);
        }
        self.local.end_forward()?;
        self.stage = Some(Stage::Backward);
        self.prefetch.cursor = 0;
        self.prefetch.on_order = true;
        Ok(())
    }

    /// Ends the backward pass: communication groups still gathered (tensors with forward uses
    /// and fewer backward uses) are reduce-scattered now.
    pub fn end_backward(&mut self) -> Result<()> {
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "end_backward".into(),
                stage: stage_name(self.stage),
            });
        }
        if let Some(t) = self
            .tensors
            .iter()
            .find(|t| t.state == TensorState::Compute)
        {
            return Err(Error::Conflict {
                what: "the end of backward".into(),
                with: format!("tensor '{}', still fetched (release it first)", t.name),
            });
        }
        for j in 0..self.gathers.len() {
            match &self.gathers[j] {
                // gathered ahead but not used: no rank has gradients for it
                Some(g) if !g.used => drop(self.take_gather(j)?),
                Some(_) => self.reduce_scatter(j)?,
                None => {}
            }
        }
        // the reduce-scatters finished (or a peer's failure is an error) before the step's host
        // work reads their results
        self.comm.wait(&self.stream)?;
        self.local.end_backward()?;
        self.stage = Some(Stage::Optimizer);
        Ok(())
    }

    // --- support for the trainer API (`crate::store`): gradient marks ---

    /// Checks that a gradient of `id` may be written now (the backward stage, the tensor
    /// fetched); returns whether this is the tensor's last backward use, the one its gradient
    /// is written at.
    pub(crate) fn grad_use(&self, id: TensorId) -> Result<bool> {
        let t = self
            .tensors
            .get(id.index())
            .ok_or(Error::UnknownTensor { id: id.0 })?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: format!("a gradient write of '{}'", t.name),
                stage: stage_name(self.stage),
            });
        }
        if t.state != TensorState::Compute {
            return Err(Error::Conflict {
                what: format!("a gradient write of '{}'", t.name),
                with: format!(
                    "a tensor not fetched for backward (state {}): write it inside a backward fetch",
                    t.state
                ),
            });
        }
        Ok(t.bwd_uses >= t.fwd_uses)
    }

    /// Marks the gradient of `id` written into its gather buffer (by device work the caller
    /// enqueued on the compute stream), after the checks of [`ZeroManager::write_grad`].
    pub(crate) fn mark_grad(&mut self, id: TensorId) -> Result<()> {
        if !self.grad_use(id)? {
            let t = &self.tensors[id.index()];
            return Err(Error::Conflict {
                what: format!(
                    "a gradient write of shared tensor '{}' at backward use {} of {}",
                    t.name, t.bwd_uses, t.fwd_uses
                ),
                with: "a backward use before the last; write it at the last".into(),
            });
        }
        self.tensors[id.index()].grad = true;
        Ok(())
    }
}
