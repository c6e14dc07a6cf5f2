//! Host groups stepped after backward on the worker, overlapped with the next forward.
//!
//! Where a host group did not step during backward (the step was not speculated, or its
//! speculation was thrown away: a clip that binds, an overflow, a group beyond the shadows'
//! budget), the optimizer's pass hands its step to the worker with the step's real scalars
//! instead of taking it on the training thread ([`ChunkManager::defer_host_steps`]). The step
//! runs in place (its scalars are final, so nothing can invalidate it: no shadow), in the
//! pass's group order, which is the next forward's first-use order. The group's chunks stay
//! lent past the end of the step; whatever needs one of them first (the next forward's load of
//! the parameter chunk, a read, a checkpoint) waits for that group's step only, so the next
//! forward starts after the first group's step, not after all of them.

use std::ops::Range;
use std::sync::Arc;

use crossbeam::channel::bounded;

use super::worker::{Grads, Job};
use super::{BlockStep, Early, EarlyStats, Job0};
use crate::chunk::manager::{ChunkManager, HostSlot, LISTS};
use crate::chunk::plan::ChunkPlan;
use crate::error::Result;
use crate::tensor::ChunkKind;

/// The step the optimizer's next pass hands to the worker for each host group.
pub(in crate::chunk::manager) struct DeferredPlan {
    step: BlockStep,
    threads: usize,
}

impl ChunkManager {
    /// Has the next optimizer pass over every chunk list hand each host group it would step
    /// on the training thread to the worker instead, with `step` on up to `threads` threads
    /// (see the module docs). For this pass only.
    pub(crate) fn defer_host_steps(&mut self, step: BlockStep, threads: usize) {
        self.overlap.deferred = Some(DeferredPlan { step, threads });
    }

    /// The step the pass starting now defers, if the optimizer asked for one: a pass over
    /// every chunk list only.
    pub(in crate::chunk::manager) fn take_deferred(
        &mut self,
        lists: &[ChunkKind],
    ) -> Option<DeferredPlan> {
        let plan = self.overlap.deferred.take();
        plan.filter(|_| lists == ChunkKind::ALL)
    }

    /// Lends host group `g`'s chunks to the worker for its deferred step by `plan` over its
    /// gradient `ranges` (its chunks brought to the host by the pass's moves). Returns whether
    /// it was lent; if not (no worker thread, a chunk without a host copy), nothing changed
    /// and the pass steps the group itself.
    pub(in crate::chunk::manager) fn lend_deferred(
        &mut self,
        g: usize,
        plan: &DeferredPlan,
        ranges: &[Range<usize>],
    ) -> Result<bool> {
        let (step, threads) = (Arc::clone(&plan.step), plan.threads);
        self.settle_deferred(g)?;
        let cs: [usize; 4] = LISTS.map(|k| ChunkPlan::chunk_no(g as u32, k) as usize);
        // the state's copies in flight done first (fallible things before anything is lent)
        for &c in &cs[1..] {
            self.host_ready(c)?;
        }
        let read = self.device.new_event()?;
        let (done, rx) = bounded(1);
        let pc = cs[0];
        let grads = match std::mem::replace(&mut self.payload[pc].host, HostSlot::Lent) {
            HostSlot::Ready(b) => Grads::Host(b),
            HostSlot::InFlight(p) => Grads::Copy(p),
            other => {
                self.payload[pc].host = other;
                return Ok(false);
            }
        };
        let orig = self.lend_ready(&cs[1..]);
        let job = Job {
            group: g,
            grads,
            out: None,
            stat_ranges: Vec::new(),
            dtype: self.cfg.param_dtype,
            orig,
            shadow: Vec::new(),
            ranges: ranges.to_vec(),
            elem_bytes: self.cfg.param_dtype.size(),
            moments: self.cfg.moments,
            threads,
            step,
            every_block: false,
            stats_to: None,
            done,
        };
        if let Err(job) = self.send(Box::new(job)) {
            for (&c, b) in cs[1..].iter().zip(job.orig) {
                self.payload[c].host = HostSlot::Ready(b);
            }
            self.payload[pc].host = match job.grads {
                Grads::Host(b) => HostSlot::Ready(b),
                Grads::Copy(p) => HostSlot::InFlight(p),
            };
            return Ok(false);
        }
        self.overlap.jobs[g] = Some(Job0 {
            state: Early::Running(rx),
            version: 0,
            in_place: true,
            deferred: true,
            counted: false,
            stats: EarlyStats::None,
            read,
        });
        Ok(true)
    }

    /// Ends group `g`'s deferred step if one holds its chunks, waiting for it, and issues its
    /// parameter chunk's load if one waits for it.
    pub(crate) fn settle_deferred(&mut self, g: usize) -> Result<()> {
        if self.deferred_step(g) {
            self.settle_early(g)?;
        }
        self.issue_load(ChunkPlan::chunk_no(g as u32, ChunkKind::Param) as usize)
    }

    /// Settles every deferred step that has finished, without a wait, and issues the loads
    /// that waited for them: called at each fetch and release, so that the link carries a
    /// group's parameters as soon as its step is done.
    pub(in crate::chunk::manager) fn poll_deferred(&mut self) -> Result<()> {
        if self.overlap.waiting_loads.is_empty() {
            return Ok(());
        }
        for g in 0..self.overlap.jobs.len() {
            let finished = match &self.overlap.jobs[g] {
                Some(Job0 {
                    state: Early::Running(rx),
                    deferred: true,
                    ..
                }) => !rx.is_empty(),
                Some(Job0 { deferred: true, .. }) => true,
                _ => false,
            };
            if finished {
                self.settle_deferred(g)?;
            }
        }
        Ok(())
    }

    /// Whether a load of chunk `c` waits for a deferred step still running: the load is
    /// noted ([`ChunkManager::load_after_step`]) and made once the step is done, device copy
    /// and all (a device buffer taken now would hold the copy stream to its waits).
    pub(in crate::chunk::manager) fn load_waits(&self, c: usize) -> bool {
        c.is_multiple_of(4)
            && matches!(
                self.overlap.jobs.get(c / 4).and_then(Option::as_ref),
                Some(Job0 {
                    state: Early::Running(_),
                    deferred: true,
                    ..
                })
            )
    }

    /// A load of chunk `c` whose host copy a deferred step holds: made when the step is done
    /// (a poll, or the first use that needs the device copy).
    pub(in crate::chunk::manager) fn load_after_step(&mut self, c: usize) {
        self.overlap.waiting_loads.push(c);
    }

    /// Where group `g`'s parameter chunk has a device copy nobody uses (under a policy that
    /// keeps host copies), notes that the new parameters of its step, still running, go up into
    /// it once the step is done, and counts the upload now: the pass then treats the copy as
    /// current, as it does a finished step's uploaded parameters.
    pub(super) fn upload_after_step(&mut self, g: usize) {
        let pc = ChunkPlan::chunk_no(g as u32, ChunkKind::Param);
        if !self.param_copy_idle(pc) {
            return;
        }
        // the upload, whenever it is issued, after the gradients' copy down (itself after the
        // chunk's last backward use): nothing on the device reads the gradients afterwards
        let ordered = match self.overlap.jobs[g].as_ref() {
            Some(j) => self.device.wait_event(&self.copy, &j.read).is_ok(),
            None => false,
        };
        if !ordered || self.sched().count_upload(pc).is_err() {
            return;
        }
        self.overlap.uploaded[g] = true;
        self.overlap.waiting_loads.push(pc as usize);
    }

    /// Makes chunk `c`'s load (or its upload into the device copy it has) if it waits for its
    /// group's deferred step, waiting for the step; anything that reads or moves the device
    /// copy calls this first.
    pub(in crate::chunk::manager) fn issue_load(&mut self, c: usize) -> Result<()> {
        let Some(i) = self.overlap.waiting_loads.iter().position(|&w| w == c) else {
            return Ok(());
        };
        self.overlap.waiting_loads.swap_remove(i);
        if self.deferred_step(c / 4) {
            self.settle_early(c / 4)?;
        }
        let Some(buf) = self.payload[c].device.clone() else {
            return self.load(c).map(|_| ());
        };
        // an upload into the copy the chunk keeps (counted when it was decided), after
        // whatever its last load was
        if let Some(r) = self.payload[c].ready.take() {
            self.device.wait_event(&self.copy, &r)?;
        }
        self.upload_host_copy(c, &buf)
    }

    /// Chunk `c`'s device copy is dropped before its load was issued.
    pub(in crate::chunk::manager) fn forget_load(&mut self, c: usize) {
        self.overlap.waiting_loads.retain(|&w| w != c);
    }

    /// Whether a deferred step holds group `g`'s chunks.
    pub(super) fn deferred_step(&self, g: usize) -> bool {
        self.overlap
            .jobs
            .get(g)
            .and_then(Option::as_ref)
            .is_some_and(|j| j.deferred)
    }
}
