//! The new parameters of a host group stepped during backward, uploaded into its parameter
//! chunk's device copy before the step is decided, and what keeps that device copy from being
//! read while it differs from the host copy.

use super::{Early, Job0};
use crate::chunk::manager::{ChunkManager, HostSlot};
use crate::chunk::plan::ChunkPlan;
use crate::device::DeviceBuffer;
use crate::error::Result;

impl ChunkManager {
    /// Uploads the new parameters of every early step that has finished into its group's
    /// parameter chunk on the device, so that the next forward finds them there; the host copy
    /// keeps the gradients until the step is decided.
    pub(in crate::chunk::manager) fn upload_finished(&mut self) -> Result<()> {
        for g in 0..self.overlap.jobs.len() {
            let finished = match self.overlap.jobs[g].as_mut() {
                Some(Job0 {
                    state: Early::Running(rx),
                    ..
                }) => rx.try_recv().ok(),
                _ => None,
            };
            if let Some(fin) = finished {
                if let Some(j) = self.overlap.jobs[g].as_mut() {
                    j.state = Early::Finished(Box::new(fin));
                }
                if self.uploads_ahead() {
                    self.upload_early(g)?;
                }
            }
        }
        Ok(())
    }

    /// Whether a finished early step's parameters go up before the step is decided: once it
    /// is decided to keep them, or, undecided, when the last decision kept (a step that clips
    /// or overflows every time would otherwise send its parameters up for nothing).
    pub(super) fn uploads_ahead(&self) -> bool {
        let in_place = self.overlap.plan.as_ref().is_some_and(|p| p.in_place);
        match self.overlap.keep {
            Some(keep) => keep,
            None => self.overlap.kept_last || in_place,
        }
    }

    /// Uploads group `g`'s finished early step's new parameters into its parameter chunk's
    /// device copy, where there is one nobody uses and the step is still valid.
    pub(super) fn upload_early(&mut self, g: usize) -> Result<()> {
        let pc = ChunkPlan::chunk_no(g as u32, crate::tensor::ChunkKind::Param);
        let idle = self.param_copy_idle(pc);
        let version = self.overlap.version[g];
        let Some(Job0 {
            state: Early::Finished(fin),
            version: v,
            read,
            deferred: false,
            ..
        }) = self.overlap.jobs[g].as_mut()
        else {
            // (a deferred step's parameters go up with the next forward's load)
            return Ok(());
        };
        let Some(buf) = self.payload[pc as usize].device.clone() else {
            return Ok(());
        };
        // (under move semantics the optimizer's host access evicts the chunk anyway)
        if !idle || *v != version || fin.result.is_err() || !fin.copied {
            return Ok(());
        }
        let HostSlot::Ready(out) = std::mem::take(&mut fin.out) else {
            return Ok(());
        };
        // after the gradients' copy down, itself after the chunk's last backward use: nothing
        // on the device reads the gradients there afterwards (the statistics read the host's)
        self.device.wait_event(&self.copy, read)?;
        fin.out = HostSlot::InFlight(self.device.copy_h2d(&self.copy, out, &*buf)?);
        let ready = self.device.new_event()?;
        self.device.record(&self.copy, &ready)?;
        self.payload[pc as usize].ready = Some(ready);
        self.overlap.uploaded[g] = true;
        self.sched().count_upload(pc)
    }

    /// Whether group `g`'s parameter chunk on the device may hold other values than its host
    /// copy's, now or before anything enqueued now would run: an early step's parameters,
    /// uploaded before the step was decided or thrown away after, or a step in hand whose
    /// parameters may go up at any time (on the upload stream, ordered after the gradients'
    /// copy down but not after later reads on the compute stream). Its gradients are read from
    /// the host then.
    pub(crate) fn device_param_differs(&self, g: usize) -> bool {
        self.overlap.uploaded.get(g).copied().unwrap_or(false)
            || self.overlap.stale.get(g).copied().unwrap_or(false)
            || self.overlap.jobs.get(g).is_some_and(Option::is_some)
    }

    /// Whether group `g`'s parameter chunk on the device holds its (undecided or kept) early
    /// step's parameters.
    pub(crate) fn uploaded_early(&self, g: usize) -> bool {
        self.overlap.uploaded.get(g).copied().unwrap_or(false)
    }

    /// Brings group `g`'s parameter chunk on the device back to its host copy if it holds a
    /// thrown-away step's parameters, for whatever reads it there.
    pub(in crate::chunk::manager) fn refresh_device_param(&mut self, g: usize) -> Result<()> {
        if !self.overlap.stale.get(g).copied().unwrap_or(false) {
            return Ok(());
        }
        self.overlap.stale[g] = false;
        let c = ChunkPlan::chunk_no(g as u32, crate::tensor::ChunkKind::Param) as usize;
        let Some(buf) = self.payload[c].device.clone() else {
            return Ok(());
        };
        self.upload_host_copy(c, &buf)?;
        self.sched().count_upload(c as u32)
    }

    /// Copies chunk `c`'s host copy up into its device copy `buf` on the upload stream; work
    /// that reads the device copy waits for it (the chunk's ready event).
    pub(super) fn upload_host_copy(&mut self, c: usize, buf: &DeviceBuffer) -> Result<()> {
        self.host_ready(c)?;
        let HostSlot::Ready(h) = std::mem::take(&mut self.payload[c].host) else {
            unreachable!("host_ready leaves the slot ready")
        };
        let p = self.device.copy_h2d(&self.copy, h, buf)?;
        self.payload[c].host = HostSlot::InFlight(p);
        let ready = self.device.new_event()?;
        self.device.record(&self.copy, &ready)?;
        self.payload[c].ready = Some(ready);
        Ok(())
    }

    /// Whether parameter chunk `pc` has a device copy nobody uses, under a policy that keeps
    /// host copies: one a host step's new parameters may go up into and stay.
    pub(super) fn param_copy_idle(&self, pc: u32) -> bool {
        let idle = self
            .sched
            .as_ref()
            .and_then(|s| s.status(pc))
            .is_some_and(|s| s.on_device && !s.dirty() && s.in_use == 0);
        idle && self.payload[pc as usize].device.is_some() && self.cfg.policy.keeps_host_copy()
    }

    /// The device copy of chunk `c` is gone.
    pub(in crate::chunk::manager) fn dropped_early(&mut self, c: usize) {
        if c.is_multiple_of(4) {
            let g = c / 4;
            if let Some(u) = self.overlap.uploaded.get_mut(g) {
                *u = false;
            }
            if let Some(s) = self.overlap.stale.get_mut(g) {
                *s = false;
            }
        }
    }
}
