//! Ends of host groups' early steps: waiting for them, their gradient statistics, and
//! settling each (kept: the group's chunks take its results; thrown away: the originals and
//! the gradients go back), at the optimizer's pass, the end of the iteration or whenever
//! something needs a lent chunk first.

use super::{Early, EarlyStats, Job0};
use crate::chunk::manager::{ChunkManager, HostSlot, LISTS};
use crate::chunk::plan::ChunkPlan;
use crate::device::HostPhase;
use crate::error::{Error, Result};
use crate::ops::grad_stats::GradStats;

use super::worker::Finished;

/// How a kept step counts in [`OverlapStats`](super::OverlapStats).
enum Count {
    /// An early step, done: the group's turn in the optimizer's pass is skipped.
    Kept,
    /// A step after backward.
    Deferred,
    /// An early step the optimizer's pass kept (and counted) while it still ran.
    Counted,
}

impl ChunkManager {
    /// Waits for group `g`'s early step to finish, if one is running; steps that finish
    /// meanwhile have their parameters uploaded as they do.
    fn join_early(&mut self, g: usize) -> Result<()> {
        let _span = self.device.host_span(HostPhase::Optimizer);
        loop {
            // a deferred step is waited for alone (the others are polled as they finish)
            let only = self.deferred_step(g);
            let running: Vec<usize> = (0..self.overlap.jobs.len())
                .filter(|&i| {
                    (!only || i == g)
                        && matches!(
                            self.overlap.jobs[i],
                            Some(Job0 {
                                state: Early::Running(_),
                                ..
                            })
                        )
                })
                .collect();
            if !running.contains(&g) {
                return Ok(());
            }
            let (i, fin) = {
                let mut sel = crossbeam::channel::Select::new();
                for &i in &running {
                    if let Some(Job0 {
                        state: Early::Running(rx),
                        ..
                    }) = &self.overlap.jobs[i]
                    {
                        sel.recv(rx);
                    }
                }
                let op = sel.select();
                let i = running[op.index()];
                let Some(Job0 {
                    state: Early::Running(rx),
                    ..
                }) = &self.overlap.jobs[i]
                else {
                    unreachable!("selected among the running")
                };
                (i, op.recv(rx))
            };
            let Ok(fin) = fin else {
                // the worker died holding the group's buffers: its chunks are lost
                self.overlap.jobs[i] = None;
                let why = format!("the host-step thread stopped holding group {i}'s chunks");
                self.broken = Some(why.clone());
                return Err(Error::Poisoned {
                    what: "chunk manager",
                    reason: why,
                });
            };
            if let Some(j) = self.overlap.jobs[i].as_mut() {
                j.state = Early::Finished(Box::new(fin));
            }
            if self.uploads_ahead() {
                self.upload_early(i)?;
            }
        }
    }

    /// Waits for every early step still running.
    #[cfg(test)]
    pub(crate) fn join_early_steps(&mut self) -> Result<()> {
        for g in 0..self.overlap.jobs.len() {
            self.join_early(g)?;
        }
        Ok(())
    }

    /// Waits for every early step still running that sends no statistics ahead of its step
    /// (a fold): the gradient statistics read the others' as they come.
    pub(crate) fn join_stateless_steps(&mut self) -> Result<()> {
        for g in 0..self.overlap.jobs.len() {
            let stated = self.overlap.jobs[g]
                .as_ref()
                .is_some_and(|j| j.deferred || !matches!(j.stats, EarlyStats::None));
            if !stated {
                self.join_early(g)?;
            }
        }
        Ok(())
    }

    /// The gradient statistics of group `g`'s ranges (its gradient ranges, then its partial
    /// shares) if its early step took them (the worker does, before it steps), waiting for
    /// them, not for the step.
    pub(crate) fn early_grad_stats(&mut self, g: usize) -> Result<Option<Vec<GradStats>>> {
        if let Some(j) = self.overlap.jobs.get_mut(g).and_then(Option::as_mut) {
            if let EarlyStats::Coming(rx) = &j.stats {
                let _span = self.device.host_span(HostPhase::Optimizer);
                j.stats = match rx.recv() {
                    Ok(st) => EarlyStats::Here(st),
                    // none taken (the gradients' copy failed): the step's end says why
                    Err(_) => EarlyStats::None,
                };
            }
            if let EarlyStats::Here(st) = &j.stats {
                return Ok(Some(st.clone()));
            }
        }
        self.join_early(g)?;
        Ok(match self.overlap.jobs.get(g).and_then(Option::as_ref) {
            Some(Job0 {
                state: Early::Finished(fin),
                ..
            }) if fin.copied && !fin.stats.is_empty() => Some(fin.stats.clone()),
            _ => self.overlap.early_stats.get(g).cloned().flatten(),
        })
    }

    /// Whether group `g`'s gradients are taken by an early step in place (running, finished
    /// or kept this iteration): the parameter chunk's host copy holds, or will, the new
    /// parameters.
    pub(crate) fn grads_taken(&self, g: usize) -> bool {
        let running = self
            .overlap
            .jobs
            .get(g)
            .and_then(Option::as_ref)
            .is_some_and(|j| j.in_place && !j.deferred);
        running || self.overlap.early_stats.get(g).is_some_and(Option::is_some)
    }

    /// Group `g`'s gradients while its early step holds them (they stay untouched), waiting
    /// for the step to finish; `None` if no step holds them, or one in place took them.
    pub(in crate::chunk::manager) fn lent_grads(&mut self, g: usize) -> Result<Option<&[u8]>> {
        self.join_early(g)?;
        Ok(match self.overlap.jobs.get(g).and_then(Option::as_ref) {
            Some(Job0 {
                state: Early::Finished(fin),
                ..
            }) => fin.grads.as_deref(),
            _ => None,
        })
    }

    /// Ends group `g`'s early step if there is one: kept (the group's chunks take its results)
    /// when the optimizer's verdict says so and nothing touched the group since it started,
    /// else thrown away (the originals and the gradients go back). Returns whether it was kept.
    pub(in crate::chunk::manager) fn settle_early(&mut self, g: usize) -> Result<bool> {
        self.join_early(g)?;
        let keep = match self.overlap.jobs.get(g).and_then(Option::as_ref) {
            None => return Ok(false),
            Some(Job0 {
                state: Early::Finished(fin),
                version,
                in_place,
                deferred,
                ..
            }) => {
                // a deferred step was decided before it started
                let current = *deferred || *version == self.overlap.version[g];
                let valid = fin.result.is_ok() && fin.copied && current;
                // a step taken in place is kept unless the step is abandoned
                let decided = match *in_place {
                    _ if *deferred => true,
                    true => self.overlap.keep != Some(false),
                    false => self.overlap.keep == Some(true),
                };
                valid && decided
            }
            Some(_) => unreachable!("joined above"),
        };
        let deferred = self.deferred_step(g);
        let counted = self.overlap.jobs[g].as_ref().is_some_and(|j| j.counted);
        if counted && !keep {
            // an early step the optimizer's pass counted as done failed after it
            let why = format!("group {g}'s host step, kept while it ran, failed");
            self.broken = Some(why.clone());
            return Err(Error::Poisoned {
                what: "chunk manager",
                reason: why,
            });
        }
        if keep && !deferred && !self.overlap.uploaded[g] {
            // the new parameters up now, so that the chunk may stay on the device
            self.upload_early(g)?;
        }
        let Some(Job0 {
            state: Early::Finished(fin),
            in_place,
            ..
        }) = self.overlap.jobs[g].take()
        else {
            unreachable!("joined above")
        };
        let stepped = fin.copied;
        if in_place && stepped && !deferred {
            self.overlap.early_stats[g] = Some(fin.stats.clone());
        }
        let count = match (counted, deferred) {
            (true, _) => Count::Counted,
            (false, true) => Count::Deferred,
            (false, false) => Count::Kept,
        };
        self.put_back(g, *fin, keep, count)?;
        if in_place && stepped && !keep {
            if !self.overlap.abandon {
                // its state holds a step the serial pass would take again
                let why = format!(
                    "group {g}'s host step ran in place during backward and was not kept (a \
                     gradient written after it, or another step's scalars)"
                );
                self.broken = Some(why.clone());
                return Err(Error::Poisoned {
                    what: "chunk manager",
                    reason: why,
                });
            }
            self.overlap.abandoned_in_place = true;
        }
        Ok(keep)
    }

    /// Puts a finished step's buffers in place: its results if `keep`, else the originals;
    /// a kept step counted as `count` says.
    fn put_back(&mut self, g: usize, fin: Finished, keep: bool, count: Count) -> Result<()> {
        let cs: [usize; 4] = LISTS.map(|k| ChunkPlan::chunk_no(g as u32, k) as usize);
        let Finished {
            grads,
            copied,
            out,
            orig,
            shadow,
            result,
            ..
        } = fin;
        // (a fold's master comes back as it was, and it has no copies)
        let (state, spare) = if keep && !shadow.is_empty() {
            (shadow, orig)
        } else {
            (orig, shadow)
        };
        for (i, b) in state.into_iter().enumerate() {
            self.payload[cs[i + 1]].host = HostSlot::Ready(b);
        }
        if !spare.is_empty() {
            self.overlap.spare_shadow[g] = Some(spare);
        }
        if !copied {
            // the gradients' copy failed, so the host copy of the chunk is lost
            self.payload[cs[0]].host = HostSlot::None;
            let e = result.err().unwrap_or_else(|| Error::Internal {
                what: format!("group {g}'s gradients never reached the host, with no error"),
            });
            self.broken = Some(format!("a gradient copy to the host failed: {e}"));
            return Err(e);
        }
        let (host, spare) = match (keep, grads) {
            (true, grads) => (out, grads.map(HostSlot::Ready)),
            (false, Some(grads)) => (HostSlot::Ready(grads), Some(out)),
            // an abandoned step taken in place: its parameters, restored from the masters
            (false, None) => (out, None),
        };
        self.payload[cs[0]].host = host;
        if let Some(spare) = spare {
            self.put_spare_param(g, spare);
        }
        if !keep && self.overlap.uploaded[g] {
            // the device copy holds the thrown-away parameters: the group's serial step evicts
            // it, or it is refreshed before anything reads it there
            self.overlap.uploaded[g] = false;
            self.overlap.stale[g] = true;
        }
        if keep {
            match count {
                Count::Kept => {
                    self.overlap.done[g] = true;
                    self.overlap.stats.kept += 1;
                }
                Count::Deferred => self.overlap.stats.deferred += 1,
                Count::Counted => {}
            }
            Ok(())
        } else {
            self.overlap.stats.redone += 1;
            result
        }
    }

    /// [`ChunkManager::settle_early`] once the optimizer has decided to keep early steps;
    /// before, nothing.
    pub(in crate::chunk::manager) fn settle_kept(&mut self, g: usize) -> Result<bool> {
        if self.overlap.keep != Some(true) {
            return Ok(false);
        }
        if self.outlive(g) {
            return Ok(true);
        }
        self.settle_early(g)
    }

    /// Keeps group `g`'s early step if it still runs and nothing touched the group since it
    /// started: counted as kept and done now, it goes on past the end of the iteration as a
    /// deferred step does (what needs its chunks waits for it). Returns whether it did.
    fn outlive(&mut self, g: usize) -> bool {
        let version = self.overlap.version[g];
        // (a fold's results are the accumulators the optimizer's pass swaps in)
        if self.overlap.plan.as_ref().is_none_or(|p| p.fold) {
            return false;
        }
        let Some(j) = self.overlap.jobs.get_mut(g).and_then(Option::as_mut) else {
            return false;
        };
        let running = matches!(j.state, Early::Running(ref rx) if rx.is_empty());
        if !running || j.deferred || j.version != version {
            return false;
        }
        j.deferred = true;
        j.counted = true;
        self.overlap.done[g] = true;
        self.overlap.stats.kept += 1;
        // its parameters go up into the chunk's device copy once the step is done, as a
        // finished step's do at the pass (the same moves, whenever the step ends)
        self.upload_after_step(g);
        true
    }

    /// Throws away every early step not yet settled (the originals go back); deferred steps
    /// go on.
    pub(in crate::chunk::manager) fn cancel_overlap(&mut self) -> Result<()> {
        let keep = self.overlap.keep.replace(false);
        let mut result = Ok(());
        for g in 0..self.overlap.jobs.len() {
            if self.deferred_step(g) {
                continue;
            }
            if let Err(e) = self.settle_early(g) {
                result = Err(e);
            }
        }
        self.overlap.keep = keep;
        result
    }

    /// Ends the iteration's overlap: steps not kept are thrown away, the verdict is cleared.
    pub(in crate::chunk::manager) fn end_overlap(&mut self) -> Result<()> {
        let mut r = self.cancel_overlap();
        for g in 0..self.overlap.stale.len() {
            if let Err(e) = self.refresh_device_param(g) {
                r = Err(e);
            }
        }
        self.overlap.keep = None;
        self.overlap.deferred = None;
        self.overlap.abandon = false;
        self.overlap.abandoned_in_place = false;
        self.overlap.early_stats.iter_mut().for_each(|s| *s = None);
        self.overlap.done.iter_mut().for_each(|d| *d = false);
        // a kept step's parameters on the device are the chunk's own now
        self.overlap.uploaded.iter_mut().for_each(|u| *u = false);
        self.overlap.version.iter_mut().for_each(|v| *v = 0);
        r
    }

    /// Settles the early step holding chunk `c`'s host copy, if one does.
    pub(in crate::chunk::manager) fn reclaim_lent(&mut self, c: usize) -> Result<()> {
        if matches!(self.payload[c].host, HostSlot::Lent) {
            self.settle_early(c / 4)?;
        }
        Ok(())
    }
}
