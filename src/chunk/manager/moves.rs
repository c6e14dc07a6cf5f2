//! The move executor: carries out the scheduler's moves with real allocations and copies, and
//! gives host-side access to chunks (for checkpoints) without a moment passing.

use std::sync::Arc;

use super::{ChunkManager, HostSlot, LogKind, Spare, LISTS};
use crate::chunk::tensors::encode;
use crate::device::{DeviceBuffer, HostBuffer, HostPhase};
use crate::error::{Error, Result};
use crate::tensor::{ChunkKind, TensorState};
use crate::tide::{ChunkNo, Move};

impl ChunkManager {
    /// Carries out the scheduler's moves; a failure makes the manager unusable.
    pub(super) fn execute(&mut self, moves: &[Move]) -> Result<()> {
        let span = (!moves.is_empty()).then(|| self.device().host_span(HostPhase::ChunkMoves));
        let r = self.execute_moves(moves);
        drop(span);
        if let Err(e) = &r {
            self.broken = Some(format!("a chunk move the scheduler ordered failed: {e}"));
        }
        r
    }

    fn execute_moves(&mut self, moves: &[Move]) -> Result<()> {
        // retire finished host frees
        self.retiring.retain(|p| !p.is_ready().unwrap_or(false));
        for mv in moves {
            let t0 = self.now_us();
            // a host copy lent to a host group's early step comes back before a move uses it;
            // a load waits for a deferred step (on the device, not here)
            let c = super::optimizer::move_chunk(mv) as usize;
            match mv {
                Move::Drop { .. } => {}
                Move::Load { .. } if self.load_waits(c) => {}
                _ => {
                    self.issue_load(c)?;
                    self.reclaim_lent(c)?;
                }
            }
            match *mv {
                Move::Materialize { chunk } => {
                    self.materialize(chunk as usize)?;
                    self.note(LogKind::Materialize, chunk as u64, 0, t0);
                }
                Move::Load { chunk, prefetch } => {
                    let bytes = self.load(chunk as usize)?;
                    let kind = if prefetch {
                        LogKind::Prefetch
                    } else {
                        LogKind::Load
                    };
                    self.note(kind, chunk as u64, bytes as u64, t0);
                }
                Move::WriteBack { chunk } => {
                    let bytes = self.write_back(chunk as usize)?;
                    self.note(LogKind::WriteBack, chunk as u64, bytes as u64, t0);
                }
                Move::Drop { chunk } => {
                    self.drop_device(chunk as usize)?;
                    self.note(LogKind::Drop, chunk as u64, 0, t0);
                }
                Move::FreeHost { chunk } => {
                    let c = chunk as usize;
                    match std::mem::take(&mut self.payload[c].host) {
                        HostSlot::InFlight(p) => self.retiring.push(p),
                        HostSlot::Ready(_) | HostSlot::None | HostSlot::Lent => {}
                    }
                    self.note(LogKind::FreeHost, chunk as u64, 0, t0);
                }
            }
        }
        Ok(())
    }

    /// Loads chunk `c` to a new device copy on the copy stream; returns its bytes.
    pub(super) fn load(&mut self, c: usize) -> Result<usize> {
        let bytes = self.chunk_bytes(c);
        if self.load_waits(c) {
            self.load_after_step(c);
            return Ok(bytes);
        }
        let buf = self.load_buffer(bytes)?;
        let pending = match std::mem::take(&mut self.payload[c].host) {
            HostSlot::Ready(h) => self.device.copy_h2d(&self.copy, h, &buf)?,
            // loaded again while written back: after that copy, on the device
            HostSlot::InFlight(p) => self.device.copy_h2d_after(&self.copy, p, &buf)?,
            HostSlot::None | HostSlot::Lent => {
                return Err(Error::Internal {
                    what: format!("chunk {c} is loaded but has no host copy"),
                })
            }
        };
        let ev = self.device.new_event()?;
        self.device.record(&self.copy, &ev)?;
        self.payload[c].host = HostSlot::InFlight(pending);
        self.payload[c].device = Some(Arc::new(buf));
        self.payload[c].ready = Some(ev);
        Ok(bytes)
    }

    /// Copies chunk `c`'s device copy back to its host copy on the copy stream, after everything
    /// compute did to it; returns its bytes.
    fn write_back(&mut self, c: usize) -> Result<usize> {
        self.write_back_to(c, None).map(|(bytes, _)| bytes)
    }

    /// [`ChunkManager::write_back`] into `dest` when given (the host copy's buffer is then not
    /// waited for, and comes back: in flight if an upload still reads it), else into the host
    /// copy's own buffer.
    pub(super) fn write_back_to(
        &mut self,
        c: usize,
        dest: Option<HostBuffer>,
    ) -> Result<(usize, HostSlot)> {
        self.issue_load(c)?;
        let buf = self.payload[c]
            .device
            .clone()
            .ok_or_else(|| Error::Internal {
                what: format!("write-back of chunk {c} without a device copy"),
            })?;
        let old = std::mem::take(&mut self.payload[c].host);
        let (h, old) = match (dest, old) {
            (Some(d), old) => (d, old),
            (None, HostSlot::Ready(h)) => (h, HostSlot::None),
            (None, HostSlot::InFlight(p)) => (p.wait()?, HostSlot::None),
            (None, HostSlot::None | HostSlot::Lent) => (self.alloc_host(c)?, HostSlot::None),
        };
        // the copy engine reads the chunk after everything compute did to it
        let ev = self.device.new_event()?;
        self.device.record(&self.compute, &ev)?;
        self.device.wait_event(&self.down, &ev)?;
        if let Some(r) = self.payload[c].ready.take() {
            self.device.wait_event(&self.down, &r)?;
        }
        let p = self.device.copy_d2h(&self.down, &*buf, h)?;
        self.payload[c].host = HostSlot::InFlight(p);
        Ok((buf.len(), old))
    }

    /// Drops chunk `c`'s device copy, which no view may still hold.
    fn drop_device(&mut self, c: usize) -> Result<()> {
        self.forget_load(c);
        if let Some(buf) = self.payload[c].device.take() {
            let buf = Arc::try_unwrap(buf).map_err(|_| Error::ViewAlive {
                what: format!("chunk {c}"),
                during: "eviction",
            })?;
            // kept for a later load: the load's copy waits for the compute work enqueued so far
            let free_after = self.device.new_event()?;
            self.device.record(&self.compute, &free_after)?;
            let read_after = self.device.new_event()?;
            self.device.record(&self.down, &read_after)?;
            self.spares.lock().push(Spare {
                buf,
                free_after,
                read_after,
            });
        }
        self.payload[c].ready = None;
        self.dropped_early(c);
        Ok(())
    }

    /// A device buffer for a chunk load: a spare of `bytes` when there is one (the copy stream
    /// ordered after the compute work of the chunk it held), else a new one.
    fn load_buffer(&mut self, bytes: usize) -> Result<DeviceBuffer> {
        // the oldest spare of the size: its copy's waits are the likeliest done (a spare
        // evicted after a write-back queued behind others waits for all of them)
        let spare = {
            let mut spares = self.spares.lock();
            let at = spares.iter().position(|s| s.buf.len() == bytes);
            at.map(|i| spares.remove(i))
        };
        match spare {
            Some(s) => {
                self.device.wait_event(&self.copy, &s.free_after)?;
                self.device.wait_event(&self.copy, &s.read_after)?;
                Ok(s.buf)
            }
            None => self.alloc_device(bytes),
        }
    }

    /// Allocates a chunk's device copy. If the device is full, gives back what the budget does
    /// not count (the spares, the non-model pool's cached blocks) and tries again; if it is
    /// still full (memory of evicted chunks released only once their copies finish), waits for
    /// the streams and tries once more.
    pub(super) fn alloc_device(&mut self, bytes: usize) -> Result<DeviceBuffer> {
        match self.device.alloc(bytes) {
            Ok(b) => Ok(b),
            Err(Error::OutOfMemory { .. }) => {
                // what the budget does not count: the spares, then the pool's cached blocks
                self.spares.lock().clear();
                let free = self.device.mem_info()?.free;
                if let (Some(p), true) = (&self.non_model, free < bytes) {
                    p.release(bytes - free);
                }
                match self.device.alloc(bytes) {
                    Err(Error::OutOfMemory { .. }) => {
                        // a device that frees memory only once the work on it is done
                        self.device.sync_stream(&self.copy)?;
                        self.device.sync_stream(&self.down)?;
                        self.device.sync_stream(&self.compute)?;
                        if let Some(p) = &self.non_model {
                            p.empty_cache();
                        }
                        self.device.alloc(bytes)
                    }
                    r => r,
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Makes the host slot of chunk `c` ready (waiting for a copy in flight) and returns it.
    pub(super) fn host_ready(&mut self, c: usize) -> Result<&mut HostBuffer> {
        self.reclaim_lent(c)?;
        if let HostSlot::InFlight(_) = &self.payload[c].host {
            let HostSlot::InFlight(p) = std::mem::take(&mut self.payload[c].host) else {
                unreachable!()
            };
            self.payload[c].host = HostSlot::Ready(p.wait()?);
        }
        match &mut self.payload[c].host {
            HostSlot::Ready(b) => Ok(b),
            _ => Err(Error::Internal {
                what: format!("chunk {c} has no host copy"),
            }),
        }
    }

    pub(super) fn alloc_host(&mut self, c: usize) -> Result<HostBuffer> {
        let bytes = self.chunk_bytes(c);
        if self.file_tier[c] {
            if let Some(f) = &self.file {
                return f.alloc(bytes);
            }
        }
        self.device.alloc_host(bytes)
    }

    fn materialize(&mut self, c: usize) -> Result<()> {
        let mut h = self.alloc_host(c)?;
        self.fill_initial(c, &mut h);
        self.payload[c].host = HostSlot::Ready(h);
        Ok(())
    }

    /// Chunk `c`'s bytes before any use: its tensors' initial values (zeros for the moments and
    /// the padding).
    fn fill_initial(&self, c: usize, h: &mut [u8]) {
        h.fill(0);
        let (g, k) = (c / 4, LISTS[c % 4]);
        if let Some(map) = self.moment_map(k) {
            crate::chunk::moments::fill_zeros8(map, h, self.layout.group_elems[g]);
        }
        if matches!(k, ChunkKind::Momentum | ChunkKind::Variance) {
            return;
        }
        let (es, dt) = (self.elem_bytes(k), self.list_dtype(k));
        for &t in &self.layout.group_tensors[g] {
            let t = &self.tensors[t as usize];
            let mut v = vec![0.0f32; t.slot.numel];
            t.init.fill(&mut v);
            let bytes = encode(&v, dt);
            h[t.slot.offset * es..t.slot.offset * es + bytes.len()].copy_from_slice(&bytes);
        }
    }

    /// Waits for every copy in flight, and for the host steps of the last optimizer step
    /// still running beside the next forward.
    pub fn synchronize(&mut self) -> Result<()> {
        self.usable()?;
        for g in 0..self.layout.groups() {
            self.settle_deferred(g)?;
        }
        self.device.sync_stream(&self.copy)?;
        self.device.sync_stream(&self.down)?;
        self.device.sync_stream(&self.compute)?;
        for c in 0..self.payload.len() {
            if matches!(self.payload[c].host, HostSlot::InFlight(_)) {
                self.host_ready(c)?;
            }
        }
        for p in self.retiring.drain(..) {
            p.wait()?;
        }
        Ok(())
    }

    /// Refuses `what` (a checkpoint) unless the manager is between iterations: before the
    /// first fetch or after `end_step`/`skip_step`. With `params_only`, also while a parameter
    /// chunk may hold gradients (fetched in backward and not rewritten by an optimizer pass
    /// since, as after a `skip_step` that did not restore the parameters).
    pub(crate) fn check_idle(&self, what: &str, params_only: bool) -> Result<()> {
        self.usable()?;
        if let Some(s) = self.stage {
            return Err(Error::WrongStage {
                call: format!(
                    "{what} (it runs between iterations: before the first fetch or after end_step)"
                ),
                stage: s.name(),
            });
        }
        let dirty: Vec<usize> = (0..self.grads_in.len())
            .filter(|&g| self.grads_in[g])
            .collect();
        if params_only && !dirty.is_empty() {
            return Err(Error::Conflict {
                what: what.to_string(),
                with: format!(
                    "the parameter chunks of groups {dirty:?}, which may hold gradients (a step \
                     skipped or ended without an optimizer pass restoring the parameters, as \
                     HybridAdam does)"
                ),
            });
        }
        Ok(())
    }

    /// After a checkpoint load every parameter chunk holds parameters.
    pub(in crate::chunk) fn params_restored(&mut self) {
        self.grads_in.iter_mut().for_each(|g| *g = false);
    }

    /// Hands `f` chunk `c`'s current bytes on the host: a dirty device copy is written back
    /// first (under move semantics the chunk moves to the host), and a chunk that never had a
    /// payload shows its initial values. No moment passes.
    pub(in crate::chunk) fn read_chunk_host(
        &mut self,
        c: usize,
        f: impl FnOnce(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (g, k) = (c / 4, LISTS[c % 4]);
        if self.sched.is_none() || self.chunk_state(g, k).is_none() {
            let mut h = vec![0u8; self.chunk_bytes(c)];
            self.fill_initial(c, &mut h);
            return f(&h);
        }
        let moves = self.sched().sync_host(c as ChunkNo, false)?;
        self.execute(&moves)?;
        f(self.host_ready(c)?)
    }

    /// After a checkpoint load every tensor has a payload: FREE tensors become HOLD.
    pub(in crate::chunk) fn hold_loaded(&mut self) {
        for t in &mut self.tensors {
            for s in &mut t.state {
                if *s == TensorState::Free {
                    *s = TensorState::Hold;
                }
            }
        }
    }

    /// Makes the manager unusable (every later call fails with [`Error::Poisoned`]) for
    /// `why`: its chunks no longer hold one consistent state.
    pub(in crate::chunk) fn poison(&mut self, why: String) {
        if self.broken.is_none() {
            self.broken = Some(why);
        }
    }

    /// Hands `f` chunk `c`'s host copy to overwrite, after which it is the chunk's only copy:
    /// a chunk without a payload gets one, and a device copy is dropped (written back first if
    /// dirty, as any eviction). Closes registration. No moment passes.
    /// A failure leaves the manager unusable: a load that stopped midway left some chunks
    /// from the checkpoint and some not.
    pub(in crate::chunk) fn write_chunk_host(
        &mut self,
        c: usize,
        f: impl FnOnce(&mut [u8]),
    ) -> Result<()> {
        let r = (|| {
            self.close()?;
            let mut moves = self.sched().materialize_on_host(c as ChunkNo)?;
            moves.extend(self.sched().sync_host(c as ChunkNo, true)?);
            self.execute(&moves)?;
            f(self.host_ready(c)?);
            Ok(())
        })();
        if let Err(e) = &r {
            if self.broken.is_none() {
                self.broken = Some(format!(
                    "a write of chunk {c}'s host copy failed midway: {e}"
                ));
            }
        }
        r
    }
}
