//! One training iteration as a trainer drives it: fetches and releases of forward and backward,
//! gradient writes, reads of parameters and masters, and the ends of the stages.

use std::sync::Arc;

use super::{ChunkManager, HostSlot, LogKind};
use crate::chunk::plan::{push_access, ChunkPlan};
use crate::chunk::tensors::{check_distinct, decode, encode, TensorView, ViewBuf};
use crate::device::{DeviceBuffer, DeviceView, HostBuffer, Phase};
use crate::error::{Error, Result};
use crate::tensor::{ChunkKind, Stage, TensorId, TensorState, TrainEvent};
use crate::tide::{Access, ChunkNo, Move, Target};

impl ChunkManager {
    /// Opens a moment: folds the non-model peak into the tracer and ticks the scheduler.
    pub(super) fn tick(&mut self, stage: Stage, accesses: &[Access]) -> usize {
        let (peak, now) = match &self.non_model {
            Some(p) => {
                let (peak, now) = p.take_peak();
                (peak as u64, now as u64)
            }
            None => (0, 0),
        };
        self.non_model_now = now;
        if let Some(last) = self.samples.last_mut() {
            last.non_model = last.non_model.max(peak);
        }
        if self.warm {
            self.tracer.non_model(peak);
            self.tracer.tick(stage, accesses.to_vec(), now);
        }
        let m = self.sched().tick();
        let t = self.now_us();
        self.note(LogKind::Moment, m as u64, 0, t);
        m
    }

    /// Fetches tensors for an op of `stage` (forward or backward) on the device and returns views
    /// of their memory, ready on [`ChunkManager::compute_stream`]. Their chunks will not move
    /// until [`ChunkManager::release`].
    pub fn fetch(&mut self, ids: &[TensorId], stage: Stage) -> Result<Vec<TensorView>> {
        self.fetch_as(ids, stage, false)
    }

    /// [`ChunkManager::fetch`], or with `ahead` a backward-stage fetch that counts no use.
    fn fetch_as(&mut self, ids: &[TensorId], stage: Stage, ahead: bool) -> Result<Vec<TensorView>> {
        self.usable()?;
        self.poll_deferred()?;
        let t0 = self.now_us();
        let ev = match stage {
            Stage::Forward => TrainEvent::BeforeFwdOp,
            Stage::Backward => TrainEvent::BeforeBwdOp,
            Stage::Optimizer => {
                return Err(Error::WrongStage {
                    call: "fetch for the optimizer (fetch is for forward and backward; the \
                           optimizer visits groups)"
                        .into(),
                    stage: self.stage.map_or("idle", Stage::name),
                })
            }
        };
        self.check_stage(stage)?;
        check_distinct(ids)?;
        self.check_transition(ids, ChunkKind::Param, ev)?;
        self.close()?;
        // One access per tensor (a chunk stays in use until each of its tensors is released);
        // the trace records one per chunk.
        let mut uses = Vec::with_capacity(ids.len());
        let mut acc = Vec::new();
        for &id in ids {
            let t = &self.tensors[id.index()];
            let last = stage == Stage::Backward && !ahead && t.bwd_uses + 1 >= t.fwd_uses;
            let chunk = self.chunk_of(id, ChunkKind::Param);
            uses.push(Access {
                chunk,
                target: Target::Device,
                write: last,
            });
            push_access(&mut acc, chunk, Target::Device, last);
        }
        if self.stage.is_none() {
            self.mark(Phase::Forward);
        }
        self.tick(stage, &acc);
        let moves = self.fetch_moment(&uses).map_err(|mut e| {
            if let Error::BudgetExceeded { tensors, .. } = &mut e {
                *tensors = ids
                    .iter()
                    .map(|id| self.tensors[id.index()].name.clone())
                    .collect();
            }
            e
        })?;
        self.execute(&moves)?;
        self.stage = Some(stage);
        for &id in ids {
            self.apply(id, ChunkKind::Param, ev);
            let t = &mut self.tensors[id.index()];
            match stage {
                Stage::Forward => t.fwd_uses += 1,
                _ if ahead => t.ahead += 1,
                _ => {
                    t.bwd_uses += 1;
                    let g = t.slot.group as usize;
                    self.grads_in[g] = true;
                }
            }
        }
        // Compute waits for the loads of its chunks.
        let mut views = Vec::with_capacity(ids.len());
        for a in &acc {
            self.issue_load(a.chunk as usize)?;
            if let Some(ev) = self.payload[a.chunk as usize].ready.take() {
                self.device.wait_event(&self.compute, &ev)?;
            }
        }
        for &id in ids {
            let c = self.chunk_of(id, ChunkKind::Param) as usize;
            let t = &self.tensors[id.index()];
            let buf = self.payload[c]
                .device
                .clone()
                .ok_or_else(|| Error::Internal {
                    what: format!("fetched chunk {c} has no device copy"),
                })?;
            views.push(TensorView::new(
                id,
                self.cfg.param_dtype,
                t.slot.numel,
                ViewBuf::Chunk(buf),
                t.slot.offset * self.cfg.param_dtype.size(),
            ));
        }
        let pre = self.sched().prefetch();
        self.execute(&pre)?;
        self.sample();
        self.note(LogKind::Fetch, ids.len() as u64, 0, t0);
        Ok(views)
    }

    /// Fetches tensors in the backward stage to recompute a forward op (activation
    /// checkpointing): a moment like any fetch, but the use counts once on each side (one more
    /// forward use, one backward use), so it is never the tensor's last backward use and its
    /// release takes it back to HOLD. A tensor whose gradient is already written cannot be
    /// fetched again ([`Error::IllegalTransition`]).
    pub(crate) fn fetch_recompute(&mut self, ids: &[TensorId]) -> Result<Vec<TensorView>> {
        self.usable()?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "a recompute fetch (it belongs to the backward pass)".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        check_distinct(ids)?;
        self.check_transition(ids, ChunkKind::Param, TrainEvent::BeforeBwdOp)?;
        for &id in ids {
            self.tensors[id.index()].fwd_uses += 1;
        }
        let r = self.fetch(ids, Stage::Backward);
        if r.is_err() {
            for &id in ids {
                let t = &mut self.tensors[id.index()];
                t.fwd_uses -= 1;
            }
        }
        r
    }

    /// Fetches tensors in the backward stage for a forward whose backward runs in a later
    /// iteration (a pipeline's next-version forwards under PipeDream-2BW): a moment that only
    /// reads, and counts no use on either side, so it touches no gradient; the release takes
    /// the tensors back to HOLD. Only for tensors this iteration has not used (their slots hold
    /// parameters, and no backward of this iteration will write them); others are
    /// [`Error::Conflict`].
    pub(crate) fn fetch_ahead(&mut self, ids: &[TensorId]) -> Result<Vec<TensorView>> {
        self.usable()?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "a fetch ahead (it belongs to the backward pass)".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        crate::chunk::check_unused(&self.tensors, ids, |t| (&t.name, t.fwd_uses, t.bwd_uses))?;
        // a tensor never used yet gets its initial payload with this fetch, as in a forward
        let fresh: Vec<TensorId> = ids
            .iter()
            .copied()
            .filter(|id| {
                self.tensors[id.index()].state[ChunkKind::Param.index()] == TensorState::Free
            })
            .collect();
        let state = |m: &mut Self, s| {
            for id in &fresh {
                m.tensors[id.index()].state[ChunkKind::Param.index()] = s;
            }
        };
        state(self, TensorState::Hold);
        let r = self.fetch_as(ids, Stage::Backward, true);
        if r.is_err() {
            state(self, TensorState::Free);
        }
        r
    }

    /// Counts `times` more forward uses of each of `ids` (an id listed twice counts twice)
    /// without fetching them: the uses of forward ops that will run later in recompute passes
    /// of the backward pass (a pipeline stage's late forwards), so that each gradient is
    /// written at its last backward use, with no moment, no move and no transition. Only in the
    /// forward stage, for tensors this forward pass has fetched already.
    pub(crate) fn declare_forward_uses(&mut self, ids: &[TensorId], times: u32) -> Result<()> {
        self.usable()?;
        if self.stage != Some(Stage::Forward) {
            return Err(Error::WrongStage {
                call: "declaring forward uses (after the forward pass's first fetch of them)"
                    .into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        crate::chunk::add_forward_uses(&mut self.tensors, ids, times, |t| {
            (&t.name, &mut t.fwd_uses)
        })
    }

    /// The scheduler's moves for the accesses of the moment just ticked; if it refuses, the
    /// moment did not happen and a warm-up in progress starts over.
    pub(super) fn fetch_moment(&mut self, accesses: &[Access]) -> Result<Vec<Move>> {
        let r = self.sched().fetch(accesses);
        if r.is_err() && self.warm {
            self.tracer.discard();
            self.warm_restart();
        }
        r
    }

    fn warm_restart(&mut self) {
        self.samples.clear();
    }

    fn check_stage(&self, stage: Stage) -> Result<()> {
        let ok = match (self.stage, stage) {
            (None, _) => true,
            (Some(Stage::Forward), Stage::Forward) => true,
            (Some(Stage::Forward), Stage::Backward) => false, // end_forward first
            (Some(Stage::Backward), Stage::Backward) => true,
            (Some(Stage::Optimizer), Stage::Forward) => false,
            (Some(a), b) => a == b,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::WrongStage {
                call: format!(
                    "a {stage} access (call end_forward / end_backward / end_step first)"
                ),
                stage: self.stage.map_or("idle", Stage::name),
            })
        }
    }

    /// Ends the use of tensors fetched for an op of `stage`. In backward, a tensor's last use
    /// (as many backward uses as forward uses) takes it to HOLD_AFTER_BWD.
    pub fn release(&mut self, ids: &[TensorId], stage: Stage) -> Result<()> {
        self.usable()?;
        self.poll_deferred()?;
        check_distinct(ids)?;
        let mut events = Vec::with_capacity(ids.len());
        for &id in ids {
            let t = self.meta(id)?;
            let ev = match stage {
                Stage::Forward => TrainEvent::AfterFwdOp,
                Stage::Backward if t.ahead > 0 => TrainEvent::AfterBwdOp,
                Stage::Backward if t.bwd_uses >= t.fwd_uses => TrainEvent::AfterLastBwdOp,
                Stage::Backward => TrainEvent::AfterBwdOp,
                Stage::Optimizer => TrainEvent::AfterOptim,
            };
            if self.stage != Some(stage) {
                return Err(Error::IllegalTransition {
                    tensor: t.name.clone(),
                    list: ChunkKind::Param.name(),
                    state: t.state[0],
                    event: ev,
                });
            }
            self.check_transition(&[id], ChunkKind::Param, ev)?;
            events.push(ev);
        }
        // one release per tensor, matching the one use per tensor of the fetch
        let chunks: Vec<ChunkNo> = ids
            .iter()
            .map(|&id| self.chunk_of(id, ChunkKind::Param))
            .collect();
        for &c in &chunks {
            let times = chunks.iter().filter(|&&d| d == c).count() as u32;
            let idle = self
                .sched
                .as_ref()
                .and_then(|s| s.status(c))
                .is_some_and(|s| s.in_use <= times);
            if let Some(buf) = &self.payload[c as usize].device {
                // views handed out must be gone before the chunk may move
                if idle && Arc::strong_count(buf) > 1 {
                    return Err(Error::ViewAlive {
                        what: format!("chunk {c}"),
                        during: "release",
                    });
                }
            }
        }
        for (&id, &ev) in ids.iter().zip(&events) {
            self.apply(id, ChunkKind::Param, ev);
            let t = &mut self.tensors[id.index()];
            if stage == Stage::Backward && t.ahead > 0 {
                t.ahead -= 1;
            }
        }
        let moves = self.sched().release(&chunks)?;
        self.execute(&moves)?;
        if stage == Stage::Backward {
            let mut groups: Vec<usize> = chunks
                .iter()
                .map(|&c| ChunkPlan::group_of(c) as usize)
                .collect();
            groups.sort_unstable();
            groups.dedup();
            self.released_in_backward(&groups)?;
        }
        Ok(())
    }

    /// Writes the gradient of a tensor into its parameter slot (converted to the parameter dtype).
    /// Allowed only while the tensor is fetched for its last backward use: a shared parameter gets
    /// its gradient once, after all its uses.
    pub fn write_grad(&mut self, id: TensorId, grad: &[f32]) -> Result<()> {
        self.usable()?;
        let (buf, off) = self.grad_slot(id, grad.len())?;
        let bytes = encode(grad, self.cfg.param_dtype);
        let mut h = HostBuffer::paged(bytes.len())?;
        h.copy_from_slice(&bytes);
        self.device
            .copy_h2d(&self.compute, h, buf.view(off, bytes.len())?)?
            .wait()?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }

    /// Like [`ChunkManager::write_grad`], from device memory already in the parameter dtype
    /// (`src` holds the tensor's elements; the copy runs on [`ChunkManager::compute_stream`]).
    pub(crate) fn write_grad_device(&mut self, id: TensorId, src: DeviceView<'_>) -> Result<()> {
        self.usable()?;
        let es = self.cfg.param_dtype.size();
        if !src.len().is_multiple_of(es) {
            return Err(Error::Misaligned {
                what: "gradient length",
                value: src.len(),
                align: es,
            });
        }
        let (buf, off) = self.grad_slot(id, src.len() / es)?;
        self.device
            .copy_d2d(&self.compute, src, buf.view(off, src.len())?)?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }

    /// The device chunk and byte offset a gradient of `len` elements of `id` goes to, after the
    /// checks both gradient writes share.
    fn grad_slot(&self, id: TensorId, len: usize) -> Result<(Arc<DeviceBuffer>, usize)> {
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
        if len != t.slot.numel {
            return Err(Error::SizeMismatch {
                src: len,
                dst: t.slot.numel,
            });
        }
        let c = self.chunk_of(id, ChunkKind::Param) as usize;
        let buf = self.payload[c]
            .device
            .clone()
            .ok_or_else(|| Error::Internal {
                what: format!("fetched chunk {c} has no device copy"),
            })?;
        Ok((buf, t.slot.offset * self.cfg.param_dtype.size()))
    }

    /// Values of a tensor's parameter slot as f32, from wherever the chunk is (a gradient after
    /// the tensor's last backward use). Reads from the device run on the compute stream.
    pub fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        self.usable()?;
        let t = self.meta(id)?;
        let (slot, init_needed) = (t.slot, self.sched.is_none());
        if init_needed
            || self
                .chunk_state(slot.group as usize, ChunkKind::Param)
                .is_none()
        {
            let mut v = vec![0.0; slot.numel];
            t.init.fill(&mut v);
            return Ok(decode(
                &encode(&v, self.cfg.param_dtype),
                self.cfg.param_dtype,
            ));
        }
        let c = self.chunk_of(id, ChunkKind::Param) as usize;
        let es = self.cfg.param_dtype.size();
        let (off, len) = (slot.offset * es, slot.numel * es);
        let dt = self.cfg.param_dtype;
        self.settle_deferred(slot.group as usize)?;
        if self.grads_taken(slot.group as usize) {
            return Err(Error::Conflict {
                what: format!(
                    "reading the gradient of '{}'",
                    self.tensors[id.index()].name
                ),
                with: "its group's step during backward, which took it in place (nothing could \
                       invalidate the step: no loss scaler, no clip); read it after the step \
                       for the parameter, or run the step serially to read gradients"
                    .into(),
            });
        }
        if self.device_param_differs(slot.group as usize) {
            // a host group stepped during backward: the host copy (or the step's) is current
            if let Some(h) = self.lent_grads(slot.group as usize)? {
                return Ok(decode(&h[off..off + len], dt));
            }
        } else if let Some(buf) = self.payload[c].device.clone() {
            self.issue_load(c)?;
            if let Some(ev) = self.payload[c].ready.take() {
                self.device.wait_event(&self.compute, &ev)?;
            }
            let bytes = self.device.download(&self.compute, buf.view(off, len)?)?;
            return Ok(decode(&bytes, self.cfg.param_dtype));
        }
        let h = self.host_ready(c)?;
        Ok(decode(&h[off..off + len], dt))
    }

    /// Copies the parameter of `id` (in the parameter dtype) into `dst` on the compute stream,
    /// from the device copy of its chunk when there is one, else from the host copy, without a
    /// use: no state changes and no moves. The copy may still be in flight on return; work on
    /// the compute stream is ordered after it. For gathers whose use is counted elsewhere (a
    /// shared parameter's second forward gather, a gather made ahead in backward).
    pub fn copy_param_into(&mut self, id: TensorId, dst: DeviceView<'_>) -> Result<()> {
        self.usable()?;
        let t = self.meta(id)?;
        let (slot, es) = (t.slot, self.cfg.param_dtype.size());
        let (off, len) = (slot.offset * es, slot.numel * es);
        if dst.len() != len {
            return Err(Error::SizeMismatch {
                src: len,
                dst: dst.len(),
            });
        }
        let c = self.chunk_of(id, ChunkKind::Param) as usize;
        // (a host group stepped during backward is read from the host, below)
        if self.sched.is_some()
            && self
                .chunk_state(slot.group as usize, ChunkKind::Param)
                .is_some()
            && !self.device_param_differs(slot.group as usize)
        {
            if let Some(buf) = self.payload[c].device.clone() {
                self.issue_load(c)?;
                if let Some(ev) = self.payload[c].ready.take() {
                    self.device.wait_event(&self.compute, &ev)?;
                }
                return self
                    .device
                    .copy_d2d(&self.compute, buf.view(off, len)?, dst);
            }
            // no device copy: the host copy is current; the copy reads it in flight
            self.host_ready(c)?;
            let HostSlot::Ready(h) = std::mem::take(&mut self.payload[c].host) else {
                unreachable!("host_ready leaves the slot ready")
            };
            return match self.device.copy_h2d_part(&self.compute, h, off, dst) {
                Ok(pending) => {
                    self.payload[c].host = HostSlot::InFlight(pending);
                    Ok(())
                }
                Err(e) => {
                    // the host copy went with the failed copy: nothing is left to serve
                    self.broken = Some(format!("a parameter copy out of chunk {c} failed: {e}"));
                    Err(e)
                }
            };
        }
        let bytes = encode(&self.read(id)?, self.cfg.param_dtype);
        let h = HostBuffer::from_slice(&bytes)?;
        self.device.copy_h2d(&self.compute, h, dst)?.wait()?;
        Ok(())
    }

    /// The fp32 master values of a tensor (its initial values before the first step).
    pub fn master(&mut self, id: TensorId) -> Result<Vec<f32>> {
        self.usable()?;
        let t = self.meta(id)?;
        let slot = t.slot;
        let c = self.chunk_of(id, ChunkKind::Master) as usize;
        if self.sched.is_none()
            || self
                .chunk_state(slot.group as usize, ChunkKind::Master)
                .is_none()
        {
            let mut v = vec![0.0; slot.numel];
            t.init.fill(&mut v);
            return Ok(v);
        }
        let name = t.name.clone();
        self.settle_deferred(slot.group as usize)?;
        if self.grads_taken(slot.group as usize) {
            // stepped in place: the master is the step's before the step is taken
            return Err(Error::Conflict {
                what: format!("reading the master of '{name}'"),
                with: "its group's step during backward, which updated it in place (nothing \
                       could invalidate the step: no loss scaler, no clip); read it after the \
                       step"
                    .into(),
            });
        }
        let moves = self.sched().sync_host(c as ChunkNo, false)?;
        self.execute(&moves)?;
        let h = self.host_ready(c)?;
        let f: &[f32] = bytemuck::cast_slice(&h[slot.offset * 4..(slot.offset + slot.numel) * 4]);
        Ok(f.to_vec())
    }

    /// Marks where `phase` begins on the compute stream when the device profiles. A mark that
    /// fails is left out (the profile loses that interval): profiling never fails a step.
    fn mark(&self, phase: Phase) {
        let _ = self.device().mark_phase(self.compute_stream(), phase);
    }

    /// Ends the forward pass: every tensor used in it goes HOLD_AFTER_FWD → HOLD.
    /// An iteration that fetched nothing in forward may end its forward pass too.
    pub fn end_forward(&mut self) -> Result<()> {
        self.usable()?;
        if !matches!(self.stage, None | Some(Stage::Forward)) {
            return Err(Error::WrongStage {
                call: "end_forward".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        // the tiers and the scheduler exist from here on, even if nothing was fetched
        self.close()?;
        let all: Vec<TensorId> = (0..self.tensors.len() as u32).map(TensorId).collect();
        self.check_transition(&all, ChunkKind::Param, TrainEvent::EndForward)?;
        for id in all {
            self.apply(id, ChunkKind::Param, TrainEvent::EndForward);
        }
        self.stage = Some(Stage::Backward);
        self.mark(Phase::Backward);
        Ok(())
    }

    /// Ends the backward pass. Fails if a tensor is still fetched.
    pub fn end_backward(&mut self) -> Result<()> {
        self.usable()?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: "end_backward".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        self.check_nothing_fetched("backward")?;
        self.stage = Some(Stage::Optimizer);
        self.mark(Phase::Optimizer);
        Ok(())
    }

    /// Ends the step: parameters go back to HOLD, use counts restart, and the warm-up trace (if
    /// this was the first complete iteration) is installed.
    pub fn end_step(&mut self) -> Result<()> {
        self.usable()?;
        self.finish_iteration(false)
    }

    /// Ends an iteration whose step was skipped (e.g. a gradient overflow): like
    /// [`ChunkManager::end_step`], but a warm-up iteration is discarded and warm-up runs again.
    pub fn skip_step(&mut self) -> Result<()> {
        self.usable()?;
        self.finish_iteration(true)
    }

    fn finish_iteration(&mut self, skipped: bool) -> Result<()> {
        self.check_nothing_fetched("the step")?;
        self.end_overlap()?;
        let all: Vec<TensorId> = (0..self.tensors.len() as u32).map(TensorId).collect();
        self.check_transition(&all, ChunkKind::Param, TrainEvent::EndStep)?;
        for id in all {
            self.apply(id, ChunkKind::Param, TrainEvent::EndStep);
            let t = &mut self.tensors[id.index()];
            t.fwd_uses = 0;
            t.bwd_uses = 0;
            t.grad = false;
        }
        self.stage = None;
        self.mark(Phase::Between);
        let Some(s) = self.sched.as_mut() else {
            return Ok(());
        };
        if let Some(p) = &self.non_model {
            let (peak, _) = p.take_peak();
            self.tracer.non_model(peak as u64);
            if let Some(l) = self.samples.last_mut() {
                l.non_model = l.non_model.max(peak as u64);
            }
        }
        if self.warm {
            if skipped {
                self.tracer.discard();
            } else if let Some(trace) = self.tracer.finish() {
                s.install_trace(trace);
                self.warm = false;
            }
        }
        s.start_iteration();
        let now = s.stats();
        self.last_iter = now.since(&self.iter_start);
        self.iter_start = now;
        self.iterations += 1;
        self.last_samples = std::mem::take(&mut self.samples);
        Ok(())
    }
}

// --- support for the trainer API (`crate::store`): the non-model pool and gradient marks ---
impl ChunkManager {
    /// The non-model pool: the manager's own unless [`ChunkManager::set_non_model_allocator`]
    /// replaced it. Activations and other non-model buffers should come from it, so that the
    /// tide sees them.
    pub fn pool(&self) -> &crate::device::CachingAllocator {
        self.non_model
            .as_ref()
            .expect("a manager always holds a non-model pool")
    }

    /// Checks that a gradient of `id` may be written now (the backward stage, the tensor
    /// fetched); returns whether this is the tensor's last backward use, the one its gradient
    /// is written at.
    pub(crate) fn grad_use(&self, id: TensorId) -> Result<bool> {
        let t = self.meta(id)?;
        if self.stage != Some(Stage::Backward) {
            return Err(Error::WrongStage {
                call: format!("a gradient write of '{}'", t.name),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        if t.state[0] != TensorState::Compute {
            return Err(Error::Conflict {
                what: format!("a gradient write of '{}'", t.name),
                with: format!(
                    "a tensor not fetched for backward (state {}): write it inside a backward fetch",
                    t.state[0]
                ),
            });
        }
        Ok(t.bwd_uses >= t.fwd_uses)
    }

    /// Marks the gradient of `id` written into its parameter slot (by device work the caller
    /// enqueued on the compute stream), after the checks of [`ChunkManager::write_grad`].
    pub(crate) fn mark_grad(&mut self, id: TensorId) -> Result<()> {
        self.usable()?;
        let numel = self.meta(id)?.slot.numel;
        self.grad_slot(id, numel)?;
        self.tensors[id.index()].grad = true;
        Ok(())
    }
}
