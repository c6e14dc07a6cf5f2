//! Host groups stepped during backward: a host group's optimizer step runs on a worker thread
//! as soon as its gradients are final, while the device goes on with backward.
//!
//! An optimizer arms the manager between iterations with an [`OverlapPlan`]: which groups step
//! on the host, the step of one block of elements, and a key (the step's scalars). During
//! backward, once every tensor of an armed group has had its last backward use, the manager
//! writes the group's parameter chunk (its gradients) back to the host at once — the
//! scheduler's own write-back, moved earlier, so the chunk's later eviction moves no byte —
//! and lends the gradients and the group's master, momentum and variance chunks to the
//! worker. The worker steps copies of the state (block by block: each block is copied to a
//! shadow buffer and stepped there while it is in cache, so the step reads and writes no more
//! memory than an in-place one) and writes the new parameters to a buffer of their own; the
//! gradients stay as they were.
//!
//! The step is speculative: the optimizer decides after backward
//! ([`ChunkManager::overlap_verdict`]) with the key of the step it would take. If it matches
//! the armed key (no overflow, no clip, the same loss scale and learning rate) each early step
//! is kept: the shadows become the group's chunks and the new parameters its parameter chunk.
//! Otherwise — or if a gradient of the group was written after its step started, or anything
//! needed the lent chunks first — the originals and the gradients go back untouched and the
//! group steps serially. Either way the bits are those of the serial step, and the link
//! carries the gradients once.
//!
//! Cost: host memory for a second copy of every host group's master, momentum and variance
//! (12 bytes an element) and of its parameter chunk; a redone step costs the early one's CPU
//! time again (the counts are [`OverlapStats`]).

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};
use serde::Serialize;

use super::{grad_ranges, ChunkManager, HostSlot, LogKind, LISTS};
use crate::chunk::plan::ChunkPlan;
use crate::device::{Event, HostBuffer, HostPhase, Pending};
use crate::error::{Error, Result};
use crate::tensor::TensorState;

/// Elements a worker copies to the shadows and steps at a time (192 KiB of fp32 state).
const BLOCK: usize = 16 << 10;
/// Fewest elements worth a thread of their own.
const MIN_PER_THREAD: usize = 1 << 15;

/// One block of a host group, handed to an armed step: the gradients in the parameter dtype,
/// the buffer for the new parameters, and the fp32 state to update in place.
pub(crate) struct HostBlock<'a> {
    pub(crate) grad: &'a [u8],
    pub(crate) param: &'a mut [u8],
    pub(crate) master: &'a mut [f32],
    pub(crate) momentum: &'a mut [f32],
    pub(crate) variance: &'a mut [f32],
}

/// The step of one [`HostBlock`], called from worker threads.
pub(crate) type BlockStep = Arc<dyn Fn(HostBlock<'_>) -> Result<()> + Send + Sync>;

/// What an optimizer arms the manager with (see the module docs).
pub(crate) struct OverlapPlan {
    /// Groups from this one on step on the host.
    pub(crate) first_host: usize,
    /// Threads a group's step may use.
    pub(crate) threads: usize,
    /// Identifies the step: an early step is kept only under the same key.
    pub(crate) key: Vec<u8>,
    /// The step of one block.
    pub(crate) step: BlockStep,
}

/// Counts of host groups stepped during backward, since the manager was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OverlapStats {
    /// Steps started during backward.
    pub started: u64,
    /// Steps kept: the group's step was done when the optimizer reached it.
    pub kept: u64,
    /// Steps thrown away, the group stepped again serially: a clip, an overflow, a changed
    /// scale or learning rate, a gradient written after the step started, or a use of the
    /// group's chunks before the step was decided.
    pub redone: u64,
}

/// The gradients as the worker gets them: on their way down, or on the host.
enum Grads {
    Copy(Pending<HostBuffer>),
    Host(HostBuffer),
}

struct Job {
    grads: Grads,
    out: HostBuffer,
    orig: [HostBuffer; 3],
    shadow: [HostBuffer; 3],
    ranges: Vec<Range<usize>>,
    elem_bytes: usize,
    threads: usize,
    step: BlockStep,
    done: Sender<Finished>,
}

/// A job's buffers back from the worker.
struct Finished {
    /// The gradients, untouched (`None` if their copy failed).
    grads: Option<HostBuffer>,
    /// The new parameters (in flight while an upload reads them).
    out: HostSlot,
    orig: [HostBuffer; 3],
    shadow: [HostBuffer; 3],
    result: Result<()>,
}

enum Early {
    Running(Receiver<Finished>),
    Finished(Box<Finished>),
}

/// A group's early step and the backward releases of the group it started after.
struct Job0 {
    state: Early,
    version: u64,
    /// Recorded on the write-back stream after the gradients' copy: an upload into the chunk
    /// waits for it.
    read: Event,
}

/// The manager's overlap state.
#[derive(Default)]
pub(super) struct Overlap {
    plan: Option<OverlapPlan>,
    /// The optimizer's decision this iteration: `Some(true)` keeps early steps.
    keep: Option<bool>,
    /// The last decision.
    kept_last: bool,
    jobs: Vec<Option<Job0>>,
    /// Backward releases per group this iteration.
    version: Vec<u64>,
    /// Groups whose early step was kept this iteration.
    done: Vec<bool>,
    /// Groups whose parameter chunk's device copy holds their early step's new parameters,
    /// uploaded before the step was decided (the host copy holds the gradients until then).
    uploaded: Vec<bool>,
    /// Groups whose parameter chunk's device copy holds a thrown-away step's parameters: it is
    /// evicted by the group's serial step, or brought back to the host copy
    /// ([`ChunkManager::refresh_device_param`]) before anything reads it.
    stale: Vec<bool>,
    spare_shadow: Vec<Option<[HostBuffer; 3]>>,
    /// Parameter-sized buffers per group: for the gradients' copy and the new parameters.
    spare_param: Vec<Vec<HostSlot>>,
    worker: Option<(Sender<Box<Job>>, JoinHandle<()>)>,
    stats: OverlapStats,
}

impl Drop for Overlap {
    fn drop(&mut self) {
        // the copies the jobs wait for read chunks the manager is about to free
        for j in self.jobs.iter_mut().filter_map(Option::take) {
            if let Early::Running(rx) = j.state {
                let _ = rx.recv();
            }
        }
        if let Some((tx, handle)) = self.worker.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}

impl ChunkManager {
    /// Arms (or, with `None`, disarms) host groups' steps during backward from the next
    /// iteration on. Between iterations only.
    pub(crate) fn arm_overlap(&mut self, plan: Option<OverlapPlan>) {
        let n = self.layout.groups();
        let o = &mut self.overlap;
        o.jobs.resize_with(n, || None);
        o.version.resize(n, 0);
        o.done.resize(n, false);
        o.uploaded.resize(n, false);
        o.stale.resize(n, false);
        o.spare_shadow.resize_with(n, || None);
        o.spare_param.resize_with(n, Vec::new);
        o.plan = plan;
    }

    /// Counts of host groups stepped during backward.
    pub fn overlap_stats(&self) -> OverlapStats {
        self.overlap.stats
    }

    /// The optimizer's decision after backward: early steps are kept if `key` is the armed
    /// one; with `None` (or another key) they are thrown away now.
    pub(crate) fn overlap_verdict(&mut self, key: Option<&[u8]>) -> Result<()> {
        let keep = matches!((&self.overlap.plan, key), (Some(p), Some(k)) if p.key == k);
        self.overlap.keep = Some(keep);
        self.overlap.kept_last = keep;
        if !keep {
            self.cancel_overlap()?;
        }
        Ok(())
    }

    /// The optimizer's decision this iteration, if it made one.
    pub(super) fn overlap_keeps(&self) -> Option<bool> {
        self.overlap.keep
    }

    /// Whether group `g`'s step was done early and kept this iteration.
    pub(super) fn stepped_early(&self, g: usize) -> bool {
        self.overlap.done.get(g).copied().unwrap_or(false)
    }

    /// Notes a backward release of tensors in `groups` and starts the step of each armed host
    /// group whose gradients are all final.
    pub(super) fn released_in_backward(&mut self, groups: &[usize]) -> Result<()> {
        if self.overlap.version.len() != self.layout.groups() {
            return Ok(());
        }
        for &g in groups {
            self.overlap.version[g] += 1;
            self.start_early(g)?;
        }
        self.upload_finished()
    }

    /// Uploads the new parameters of every early step that has finished into its group's
    /// parameter chunk on the device, so that the next forward finds them there; the host copy
    /// keeps the gradients until the step is decided.
    pub(super) fn upload_finished(&mut self) -> Result<()> {
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
    fn uploads_ahead(&self) -> bool {
        match self.overlap.keep {
            Some(keep) => keep,
            None => self.overlap.kept_last,
        }
    }

    /// Uploads group `g`'s finished early step's new parameters into its parameter chunk's
    /// device copy, where there is one nobody uses and the step is still valid.
    fn upload_early(&mut self, g: usize) -> Result<()> {
        let pc = ChunkPlan::chunk_no(g as u32, crate::tensor::ChunkKind::Param);
        let idle = self
            .sched
            .as_ref()
            .and_then(|s| s.status(pc))
            .is_some_and(|s| s.on_device && !s.dirty() && s.in_use == 0);
        let version = self.overlap.version[g];
        let Some(Job0 {
            state: Early::Finished(fin),
            version: v,
            read,
        }) = self.overlap.jobs[g].as_mut()
        else {
            return Ok(());
        };
        let Some(buf) = self.payload[pc as usize].device.clone() else {
            return Ok(());
        };
        // under move semantics the optimizer's host access evicts the chunk anyway
        let stays = self.cfg.policy.keeps_host_copy();
        if !stays || !idle || *v != version || fin.result.is_err() || fin.grads.is_none() {
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
    pub(super) fn refresh_device_param(&mut self, g: usize) -> Result<()> {
        if !self.overlap.stale.get(g).copied().unwrap_or(false) {
            return Ok(());
        }
        self.overlap.stale[g] = false;
        let c = ChunkPlan::chunk_no(g as u32, crate::tensor::ChunkKind::Param) as usize;
        let Some(buf) = self.payload[c].device.clone() else {
            return Ok(());
        };
        self.host_ready(c)?;
        let HostSlot::Ready(h) = std::mem::take(&mut self.payload[c].host) else {
            unreachable!("host_ready leaves the slot ready")
        };
        let p = self.device.copy_h2d(&self.copy, h, &*buf)?;
        self.payload[c].host = HostSlot::InFlight(p);
        let ready = self.device.new_event()?;
        self.device.record(&self.copy, &ready)?;
        self.payload[c].ready = Some(ready);
        self.sched().count_upload(c as u32)
    }

    /// The device copy of chunk `c` is gone.
    pub(super) fn dropped_early(&mut self, c: usize) {
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

    fn start_early(&mut self, g: usize) -> Result<()> {
        let Some(plan) = &self.overlap.plan else {
            return Ok(());
        };
        let (first_host, threads, step) = (plan.first_host, plan.threads, Arc::clone(&plan.step));
        if g < first_host || self.warm || self.overlap.jobs[g].is_some() {
            return Ok(());
        }
        let final_grads = self.layout.group_tensors[g]
            .iter()
            .all(|&t| self.tensors[t as usize].state[0] == TensorState::HoldAfterBwd);
        let ranges = grad_ranges(&self.group_tensors(g));
        let cs: [usize; 4] = LISTS.map(|k| ChunkPlan::chunk_no(g as u32, k) as usize);
        let state_ready = cs[1..]
            .iter()
            .all(|&c| matches!(self.payload[c].host, HostSlot::Ready(_)));
        // with chunks spilled to the file tier, only a group whose optimizer state is there: its
        // copies go there too (the worker reads the state ahead of the step and its writes
        // go behind it), where a second copy in host memory would exceed the host budget
        let spilled = self.file.is_some() && !cs[1..].iter().all(|&c| self.file_tier[c]);
        if !final_grads || ranges.is_empty() || spilled || !state_ready {
            return Ok(());
        }
        // the gradients to the host now: the scheduler's write-back, ahead of the eviction
        let pc = cs[0];
        let moves = self.sched().write_back_now(pc as u32)?;
        if !moves.is_empty() {
            // into a buffer of its own: the host copy's may still be read by an upload
            let t0 = self.now_us();
            let dest = self.take_spare_param(g, pc)?;
            let span = self.device.host_span(HostPhase::ChunkMoves);
            let r = self.write_back_to(pc, Some(dest));
            drop(span);
            match r {
                Ok((bytes, old)) => {
                    self.put_spare_param(g, old);
                    self.note(LogKind::WriteBack, pc as u64, bytes as u64, t0);
                }
                Err(e) => {
                    self.broken = Some(format!("a chunk move the scheduler ordered failed: {e}"));
                    return Err(e);
                }
            }
        }
        let device_newer = self
            .sched
            .as_ref()
            .and_then(|s| s.status(pc as u32))
            .is_some_and(|s| s.dirty());
        if device_newer {
            // in use: the serial step will have it written back
            return Ok(());
        }
        let out = self.take_spare_param(g, pc)?;
        let shadow = match self.overlap.spare_shadow[g].take() {
            Some(s) => s,
            None => [
                self.alloc_host(cs[1])?,
                self.alloc_host(cs[2])?,
                self.alloc_host(cs[3])?,
            ],
        };
        let grads = match std::mem::replace(&mut self.payload[pc].host, HostSlot::Lent) {
            HostSlot::Ready(b) => Grads::Host(b),
            HostSlot::InFlight(p) => Grads::Copy(p),
            other => {
                self.payload[pc].host = other;
                self.put_spare_param(g, HostSlot::Ready(out));
                self.overlap.spare_shadow[g] = Some(shadow);
                return Ok(());
            }
        };
        let orig = [1, 2, 3].map(|i| {
            match std::mem::replace(&mut self.payload[cs[i]].host, HostSlot::Lent) {
                HostSlot::Ready(b) => b,
                _ => unreachable!("checked above"),
            }
        });
        let read = self.device.new_event()?;
        self.device.record(&self.down, &read)?;
        let (done, rx) = bounded(1);
        let job = Job {
            grads,
            out,
            orig,
            shadow,
            ranges,
            elem_bytes: self.cfg.param_dtype.size(),
            threads,
            step,
            done,
        };
        if let Err(job) = self.send(Box::new(job)) {
            // no worker: everything goes back
            let fin = Finished {
                grads: match job.grads {
                    Grads::Host(b) => Some(b),
                    Grads::Copy(p) => Some(p.wait()?),
                },
                out: HostSlot::Ready(job.out),
                orig: job.orig,
                shadow: job.shadow,
                result: Ok(()),
            };
            self.put_back(g, fin, false)?;
            return Err(Error::InvalidArgument(
                "the host-step thread could not start".into(),
            ));
        }
        self.overlap.jobs[g] = Some(Job0 {
            state: Early::Running(rx),
            version: self.overlap.version[g],
            read,
        });
        self.overlap.stats.started += 1;
        Ok(())
    }

    /// Hands `job` to the worker thread, started on first use; gives the job back if there is
    /// no worker.
    fn send(&mut self, job: Box<Job>) -> std::result::Result<(), Box<Job>> {
        if self.overlap.worker.is_none() {
            let (tx, jobs) = unbounded::<Box<Job>>();
            let spawned = std::thread::Builder::new()
                .name("tidemem-host-step".into())
                .spawn(move || {
                    for job in jobs {
                        let done = job.done.clone();
                        let _ = done.send(run_job(*job));
                    }
                });
            match spawned {
                Ok(handle) => self.overlap.worker = Some((tx, handle)),
                Err(_) => return Err(job),
            }
        }
        let (tx, _) = self.overlap.worker.as_ref().expect("started above");
        tx.send(job).map_err(|e| e.into_inner())
    }

    /// A buffer of group `g`'s parameter chunk `pc`'s size: a spare whose copies are done, else
    /// a new one.
    fn take_spare_param(&mut self, g: usize, pc: usize) -> Result<HostBuffer> {
        let pool = &mut self.overlap.spare_param[g];
        if let Some(i) = pool.iter().position(|s| matches!(s, HostSlot::Ready(_))) {
            if let HostSlot::Ready(b) = pool.swap_remove(i) {
                return Ok(b);
            }
        }
        for i in 0..pool.len() {
            if let HostSlot::InFlight(p) = &pool[i] {
                if p.is_ready()? {
                    if let HostSlot::InFlight(p) = pool.swap_remove(i) {
                        return p.wait();
                    }
                }
            }
        }
        self.alloc_host(pc)
    }

    /// Keeps a parameter-sized buffer (or one an upload still reads) for group `g`'s later
    /// steps; beyond three, lets it go.
    fn put_spare_param(&mut self, g: usize, slot: HostSlot) {
        match slot {
            HostSlot::None | HostSlot::Lent => {}
            HostSlot::InFlight(p) if self.overlap.spare_param[g].len() >= 3 => {
                self.retiring.push(p)
            }
            HostSlot::Ready(_) if self.overlap.spare_param[g].len() >= 3 => {}
            s => self.overlap.spare_param[g].push(s),
        }
    }

    /// Waits for group `g`'s early step to finish, if one is running; steps that finish
    /// meanwhile have their parameters uploaded as they do.
    fn join_early(&mut self, g: usize) -> Result<()> {
        let _span = self.device.host_span(HostPhase::Optimizer);
        loop {
            let running: Vec<usize> = (0..self.overlap.jobs.len())
                .filter(|&i| {
                    matches!(
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
                let fin = op.recv(rx).map_err(|_| {
                    Error::InvalidArgument(
                        "the host-step thread stopped with a step in hand".into(),
                    )
                })?;
                (i, fin)
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
    pub(crate) fn join_early_steps(&mut self) -> Result<()> {
        for g in 0..self.overlap.jobs.len() {
            self.join_early(g)?;
        }
        Ok(())
    }

    /// Group `g`'s gradients while its early step holds them (they stay untouched), waiting
    /// for the step to finish; `None` if no step holds them.
    pub(super) fn lent_grads(&mut self, g: usize) -> Result<Option<&[u8]>> {
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
    pub(super) fn settle_early(&mut self, g: usize) -> Result<bool> {
        self.join_early(g)?;
        let Some(j) = self.overlap.jobs.get_mut(g).and_then(Option::take) else {
            return Ok(false);
        };
        let Early::Finished(fin) = j.state else {
            unreachable!("joined above")
        };
        let keep = self.overlap.keep == Some(true)
            && fin.result.is_ok()
            && fin.grads.is_some()
            && j.version == self.overlap.version[g];
        let fin = if keep && !self.overlap.uploaded[g] {
            // the new parameters up now, so that the chunk may stay on the device
            self.overlap.jobs[g] = Some(Job0 {
                state: Early::Finished(fin),
                version: j.version,
                read: j.read,
            });
            self.upload_early(g)?;
            match self.overlap.jobs[g].take() {
                Some(Job0 {
                    state: Early::Finished(fin),
                    ..
                }) => fin,
                _ => unreachable!("put back above"),
            }
        } else {
            fin
        };
        self.put_back(g, *fin, keep)?;
        Ok(keep)
    }

    /// Puts a finished step's buffers in place: its results if `keep`, else the originals.
    fn put_back(&mut self, g: usize, fin: Finished, keep: bool) -> Result<()> {
        let cs: [usize; 4] = LISTS.map(|k| ChunkPlan::chunk_no(g as u32, k) as usize);
        let Finished {
            grads,
            out,
            orig,
            shadow,
            result,
        } = fin;
        let (state, spare) = if keep { (shadow, orig) } else { (orig, shadow) };
        for (i, b) in state.into_iter().enumerate() {
            self.payload[cs[i + 1]].host = HostSlot::Ready(b);
        }
        self.overlap.spare_shadow[g] = Some(spare);
        let Some(grads) = grads else {
            // the gradients' copy failed, so the host copy of the chunk is lost
            self.payload[cs[0]].host = HostSlot::None;
            let e = result.err().unwrap_or_else(|| {
                Error::InvalidArgument(format!("group {g}'s gradients never reached the host"))
            });
            self.broken = Some(format!("a gradient copy to the host failed: {e}"));
            return Err(e);
        };
        if keep {
            self.payload[cs[0]].host = out;
            self.put_spare_param(g, HostSlot::Ready(grads));
        } else {
            self.put_spare_param(g, out);
            if self.overlap.uploaded[g] {
                // the device copy holds the thrown-away parameters: the group's serial step
                // evicts it, or it is refreshed before anything reads it there
                self.overlap.uploaded[g] = false;
                self.overlap.stale[g] = true;
            }
            self.payload[cs[0]].host = HostSlot::Ready(grads);
        }
        if keep {
            self.overlap.done[g] = true;
            self.overlap.stats.kept += 1;
            Ok(())
        } else {
            self.overlap.stats.redone += 1;
            result
        }
    }

    /// [`ChunkManager::settle_early`] once the optimizer has decided to keep early steps;
    /// before, nothing.
    pub(super) fn settle_kept(&mut self, g: usize) -> Result<bool> {
        if self.overlap.keep == Some(true) {
            self.settle_early(g)
        } else {
            Ok(false)
        }
    }

    /// Throws away every early step not yet settled (the originals go back).
    pub(super) fn cancel_overlap(&mut self) -> Result<()> {
        let keep = self.overlap.keep.replace(false);
        let mut result = Ok(());
        for g in 0..self.overlap.jobs.len() {
            if let Err(e) = self.settle_early(g) {
                result = Err(e);
            }
        }
        self.overlap.keep = keep;
        result
    }

    /// Ends the iteration's overlap: steps not kept are thrown away, the verdict is cleared.
    pub(super) fn end_overlap(&mut self) -> Result<()> {
        let mut r = self.cancel_overlap();
        for g in 0..self.overlap.stale.len() {
            if let Err(e) = self.refresh_device_param(g) {
                r = Err(e);
            }
        }
        self.overlap.keep = None;
        self.overlap.done.iter_mut().for_each(|d| *d = false);
        // a kept step's parameters on the device are the chunk's own now
        self.overlap.uploaded.iter_mut().for_each(|u| *u = false);
        self.overlap.version.iter_mut().for_each(|v| *v = 0);
        r
    }

    /// Settles the early step holding chunk `c`'s host copy, if one does.
    pub(super) fn reclaim_lent(&mut self, c: usize) -> Result<()> {
        if matches!(self.payload[c].host, HostSlot::Lent) {
            self.settle_early(c / 4)?;
        }
        Ok(())
    }
}

/// A worker's job: waits for the gradients, then steps the shadows block by block.
fn run_job(job: Job) -> Finished {
    let Job {
        grads,
        mut out,
        orig,
        mut shadow,
        ranges,
        elem_bytes,
        threads,
        step,
        done: _,
    } = job;
    let grads = match grads {
        Grads::Copy(p) => p.wait_quiet(),
        Grads::Host(h) => Ok(h),
    };
    let (grads, result) = match grads {
        Err(e) => (None, Err(e)),
        Ok(grads) => {
            let r = step_group(
                &grads,
                &mut out,
                &orig,
                &mut shadow,
                &ranges,
                elem_bytes,
                threads,
                &step,
            );
            (Some(grads), r)
        }
    };
    Finished {
        grads,
        out: HostSlot::Ready(out),
        orig,
        shadow,
        result,
    }
}

fn f32s(b: &[u8]) -> Result<&[f32]> {
    bytemuck::try_cast_slice(b).map_err(|_| Error::Misaligned {
        what: "host chunk",
        value: b.as_ptr() as usize,
        align: 4,
    })
}

fn f32s_mut(b: &mut [u8]) -> Result<&mut [f32]> {
    let p = b.as_ptr() as usize;
    bytemuck::try_cast_slice_mut(b).map_err(|_| Error::Misaligned {
        what: "host chunk",
        value: p,
        align: 4,
    })
}

/// One thread's share of a group: the elements `lo..` of every operand.
struct Part<'a> {
    lo: usize,
    grad: &'a [u8],
    out: &'a mut [u8],
    orig: [&'a [f32]; 3],
    shadow: [&'a mut [f32]; 3],
}

/// Copies the originals to the shadows (and the gradients' chunk to `out`, whose untouched
/// ranges hold parameters) and steps the gradient ranges, split over threads.
#[allow(clippy::too_many_arguments)]
fn step_group(
    grads: &[u8],
    out: &mut [u8],
    orig: &[HostBuffer; 3],
    shadow: &mut [HostBuffer; 3],
    ranges: &[Range<usize>],
    es: usize,
    threads: usize,
    step: &BlockStep,
) -> Result<()> {
    let n = grads.len() / es;
    let orig = [f32s(&orig[0])?, f32s(&orig[1])?, f32s(&orig[2])?];
    let [s0, s1, s2] = shadow;
    let mut shadow = [f32s_mut(s0)?, f32s_mut(s1)?, f32s_mut(s2)?];
    let parts = threads.min(n / MIN_PER_THREAD).max(1);
    // split on 64-element boundaries, as the CPU kernel does
    let per = n.div_ceil(parts).div_ceil(64) * 64;
    let mut split = Vec::with_capacity(parts);
    let mut rest = out;
    let mut lo = 0;
    while lo < n {
        let len = per.min(n - lo);
        let (o, r) = rest.split_at_mut(len * es);
        rest = r;
        let [a, b, c] = shadow;
        let (a0, a1) = a.split_at_mut(len);
        let (b0, b1) = b.split_at_mut(len);
        let (c0, c1) = c.split_at_mut(len);
        shadow = [a1, b1, c1];
        split.push(Part {
            lo,
            grad: &grads[lo * es..(lo + len) * es],
            out: o,
            orig: orig.map(|x| &x[lo..lo + len]),
            shadow: [a0, b0, c0],
        });
        lo += len;
    }
    std::thread::scope(|scope| {
        let mut parts = split.into_iter();
        let first = parts.next();
        let handles: Vec<_> = parts
            .map(|part| scope.spawn(move || step_part(part, ranges, es, step)))
            .collect();
        let mut result = first.map_or(Ok(()), |part| step_part(part, ranges, es, step));
        for h in handles {
            let r = h.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument("a host-step thread panicked".into()))
            });
            result = result.and(r);
        }
        result
    })
}

fn step_part(part: Part<'_>, ranges: &[Range<usize>], es: usize, step: &BlockStep) -> Result<()> {
    let Part {
        lo,
        grad,
        out,
        orig,
        shadow: [ma, mo, va],
    } = part;
    let n = ma.len();
    let mut b = 0;
    while b < n {
        let e = (b + BLOCK).min(n);
        ma[b..e].copy_from_slice(&orig[0][b..e]);
        mo[b..e].copy_from_slice(&orig[1][b..e]);
        va[b..e].copy_from_slice(&orig[2][b..e]);
        out[b * es..e * es].copy_from_slice(&grad[b * es..e * es]);
        for r in ranges {
            // the range in this part's coordinates, cut to the block
            let x = r.start.saturating_sub(lo).max(b);
            let y = r.end.saturating_sub(lo).min(e);
            if x < y {
                step(HostBlock {
                    grad: &grad[x * es..y * es],
                    param: &mut out[x * es..y * es],
                    master: &mut ma[x..y],
                    momentum: &mut mo[x..y],
                    variance: &mut va[x..y],
                })?;
            }
        }
        b = e;
    }
    Ok(())
}
