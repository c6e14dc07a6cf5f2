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
//! **In place.** Where nothing can invalidate the step (no loss scaler, no clip: a
//! non-finite gradient then stops the run rather than skipping the step), the optimizer arms
//! the plan [`in_place`](OverlapPlan::in_place): the gradients come down into the chunk's own
//! host copy (where no upload still reads it), the worker takes their statistics for the
//! optimizer ([`ChunkManager::early_grad_stats`]) and then steps the group's own master,
//! momentum and variance, writing the new parameters over the gradients; the step is kept
//! whatever the verdict's timing.
//!
//! **The statistics ahead of the step.** The worker sends a group's gradient statistics as
//! soon as it has taken them, before it steps: the optimizer's verdict waits for the last
//! group's statistics, not for the steps. A kept step the optimizer's pass finds still running
//! is counted as done and outlives the iteration, as a deferred step (`deferred`) does.
//!
//! Cost ([`overlap_group_bytes`], reported by [`OverlapStats::host_bytes`]): in place, none;
//! with shadows, a second copy of a host group's master, momentum and variance (12 bytes an
//! element, 6.03 with 8-bit moments) and two parameter-sized buffers (the gradients' copy and the new parameters); a
//! redone step costs the early one's CPU time again (the counts are [`OverlapStats`]).

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};
use serde::Serialize;

use super::{grad_ranges, ChunkManager, HostMoments, HostSlot, LogKind, LISTS};
use crate::chunk::plan::{ChunkPlan, MomentStorage};
use crate::device::{Event, HostBuffer, HostPhase};
use crate::error::Result;
use crate::ops::grad_stats::GradStats;
use crate::tensor::{ChunkKind, TensorState};

mod deferred;
mod settle;
mod upload;
mod worker;

use worker::{run_job, Finished, Grads, Job};

/// One block of a host group, handed to an armed step: where it is (the group, and the
/// offset of its first element in the group's chunks), the gradients in the parameter dtype
/// (`None` between gradient ranges, which only a fold is handed, and in place), the buffer for
/// the new parameters (holding the chunk's bytes as they came down: in place, the gradients),
/// and the fp32 state: for a step, the master, momentum and variance to update (copies, or in
/// place the group's own); for a fold, the master, to read (momentum and variance empty).
pub(crate) struct HostBlock<'a> {
    pub(crate) group: usize,
    pub(crate) offset: usize,
    pub(crate) grad: Option<&'a [u8]>,
    /// `param` holds the gradients (`grad` is `None`): the step overwrites them.
    pub(crate) in_place: bool,
    pub(crate) param: &'a mut [u8],
    pub(crate) master: &'a mut [f32],
    /// The moments as the manager holds them (empty f32 slices for a fold).
    pub(crate) moments: HostMoments<'a>,
}

/// The step of one [`HostBlock`], called from worker threads.
pub(crate) type BlockStep = Arc<dyn Fn(HostBlock<'_>) -> Result<()> + Send + Sync>;

/// What an optimizer arms the manager with (see the module docs).
pub(crate) struct OverlapPlan {
    /// Groups from this one on step early (the host groups, or the last of them whose
    /// shadows fit a budget).
    pub(crate) first_host: usize,
    /// Steps the group's own state, with no shadow: nothing may invalidate the step.
    pub(crate) in_place: bool,
    /// Threads a group's step may use.
    pub(crate) threads: usize,
    /// Identifies the step: an early step is kept only under the same key.
    pub(crate) key: Vec<u8>,
    /// The step of one block.
    pub(crate) step: BlockStep,
    /// A fold rather than a step (gradient accumulation's micro-batches): the group lends
    /// only its master, which the fold reads; every block is handed over; the pass it
    /// replaces visits the parameter and master chunks.
    pub(crate) fold: bool,
}

impl OverlapPlan {
    /// The chunk lists the armed pass visits, and so the lists a group lends.
    fn lists(&self) -> &'static [ChunkKind] {
        if self.fold {
            &[ChunkKind::Param, ChunkKind::Master]
        } else {
            &ChunkKind::ALL
        }
    }
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
    /// Host bytes the overlap holds between iterations: the shadows and the parameter-sized
    /// buffers of the groups stepped early (on the file tier where chunks spill there).
    pub host_bytes: u64,
    /// Host steps taken after backward on the worker, overlapped with the next forward (see
    /// the module docs): groups that did not step during backward.
    pub deferred: u64,
}

/// Host bytes the overlap holds for a host group of `elems` elements of `param_bytes` bytes
/// each stepped early: with `shadowed`, a copy of its fp32 master, its momentum and variance
/// (held as `moments` says) and two parameter-sized buffers (the gradients' copy and the new
/// parameters); in place, none (the gradients come down into the chunk's own host copy and the
/// step overwrites them).
pub(crate) fn overlap_group_bytes(
    elems: usize,
    param_bytes: usize,
    moments: MomentStorage,
    shadowed: bool,
) -> u64 {
    match shadowed {
        true => (elems * (4 + 2 * param_bytes)) as u64 + 2 * moments.bytes(elems),
        false => 0,
    }
}

enum Early {
    Running(Receiver<Finished>),
    Finished(Box<Finished>),
}

/// A group's early step and the backward releases of the group it started after.
struct Job0 {
    state: Early,
    version: u64,
    /// Stepped the group's own state (no shadow): it cannot be thrown away.
    in_place: bool,
    /// Decided, and may outlive the iteration: a step after backward with the step's real
    /// scalars ([`ChunkManager::defer_host_steps`]), or an early step the optimizer's pass
    /// kept while it still ran.
    deferred: bool,
    /// Counted as kept by the optimizer's pass (an early step that outlives the iteration).
    counted: bool,
    /// The statistics the step takes of the group's gradients before it steps.
    stats: EarlyStats,
    /// Recorded on the write-back stream after the gradients' copy: an upload into the chunk
    /// waits for it.
    read: Event,
}

/// The gradient statistics of an early step: on their way from the worker, or here.
enum EarlyStats {
    /// None are taken (a fold, a deferred step), or they did not come.
    None,
    Coming(Receiver<Vec<GradStats>>),
    Here(Vec<GradStats>),
}

/// The manager's overlap state.
#[derive(Default)]
pub(super) struct Overlap {
    plan: Option<OverlapPlan>,
    /// The optimizer's decision this iteration: `Some(true)` keeps early steps.
    keep: Option<bool>,
    /// The last decision.
    kept_last: bool,
    /// The step is abandoned (a non-finite gradient without a loss scaler): early steps taken
    /// in place are put back as they are, and counted in `abandoned_in_place`.
    abandon: bool,
    abandoned_in_place: bool,
    /// The gradient statistics of the groups whose early step took their gradients in place
    /// this iteration.
    early_stats: Vec<Option<Vec<GradStats>>>,
    /// Optimizer state is copied between tensors ([`ChunkManager::copy_state`]: a pipeline's
    /// weight versions, between backward and the step): no step runs in place.
    state_copies: bool,
    jobs: Vec<Option<Job0>>,
    /// The step the optimizer's pass hands to the worker for groups it would step itself.
    deferred: Option<deferred::DeferredPlan>,
    /// Chunks whose load waits for their group's deferred step: the device copy is theirs,
    /// the copy not yet issued.
    waiting_loads: Vec<usize>,
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
    spare_shadow: Vec<Option<Vec<HostBuffer>>>,
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
        o.early_stats.resize_with(n, || None);
        o.spare_param.resize_with(n, Vec::new);
        o.plan = plan;
    }

    /// Notes a copy of optimizer state between tensors (`kinds` beyond the parameters): from
    /// now on, host groups step during backward on shadows only, since a copy between backward
    /// and the step would change the state a step in place has already taken.
    pub(crate) fn note_state_copies(&mut self, kinds: &[ChunkKind]) {
        if kinds.iter().any(|&k| k != ChunkKind::Param) {
            self.overlap.state_copies = true;
        }
    }

    /// Whether host groups may step in place during backward (see
    /// [`ChunkManager::note_state_copies`]).
    pub(crate) fn in_place_allowed(&self) -> bool {
        !self.overlap.state_copies
    }

    /// Counts of host groups stepped during backward, and the host bytes the overlap holds.
    pub fn overlap_stats(&self) -> OverlapStats {
        let o = &self.overlap;
        let shadows = o.spare_shadow.iter().flatten().flatten().map(|b| b.len());
        let params = o.spare_param.iter().flatten().map(|s| match s {
            HostSlot::Ready(b) => b.len(),
            HostSlot::InFlight(p) => p.value().map_or(0, |b| b.len()),
            _ => 0,
        });
        OverlapStats {
            host_bytes: (shadows.sum::<usize>() + params.sum::<usize>()) as u64,
            ..o.stats
        }
    }

    /// The optimizer's decision after backward: early steps are kept if `key` is the armed
    /// one; with another key they are thrown away now, and an early step taken in place (which
    /// cannot be) leaves the manager unusable. With `None` the step is abandoned: early steps
    /// are thrown away, those taken in place put back as they are. Returns whether any had
    /// stepped in place and was abandoned.
    pub(crate) fn overlap_verdict(&mut self, key: Option<&[u8]>) -> Result<bool> {
        let keep = matches!((&self.overlap.plan, key), (Some(p), Some(k)) if p.key == k);
        self.overlap.keep = Some(keep);
        self.overlap.kept_last = keep;
        self.overlap.abandon = key.is_none();
        if !keep {
            self.cancel_overlap()?;
        }
        Ok(std::mem::take(&mut self.overlap.abandoned_in_place))
    }

    /// Whether a pass over `lists` may take the early steps the optimizer decided to keep:
    /// the pass they replace.
    pub(super) fn overlap_keeps(&self, lists: &[ChunkKind]) -> bool {
        self.overlap.keep == Some(true)
            && self
                .overlap
                .plan
                .as_ref()
                .is_some_and(|p| p.lists() == lists)
    }

    /// Whether group `g`'s step was done early and kept this iteration.
    pub(crate) fn stepped_early(&self, g: usize) -> bool {
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

    fn start_early(&mut self, g: usize) -> Result<()> {
        let Some(plan) = &self.overlap.plan else {
            return Ok(());
        };
        let (first_host, threads, step, fold) = (
            plan.first_host,
            plan.threads,
            Arc::clone(&plan.step),
            plan.fold,
        );
        let in_place = plan.in_place && !fold;
        let lent = plan.lists().len() - 1;
        if g < first_host || self.warm {
            return Ok(());
        }
        // the last step's, if nothing needed the group since
        self.settle_deferred(g)?;
        if self.overlap.jobs[g].is_some() {
            return Ok(());
        }
        let final_grads = self.layout.group_tensors[g]
            .iter()
            .all(|&t| self.tensors[t as usize].state[0] == TensorState::HoldAfterBwd);
        let ranges = grad_ranges(&self.group_tensors(g));
        let cs: [usize; 4] = LISTS.map(|k| ChunkPlan::chunk_no(g as u32, k) as usize);
        let state = &cs[1..1 + lent];
        let state_ready = state
            .iter()
            .all(|&c| matches!(self.payload[c].host, HostSlot::Ready(_)));
        if !final_grads || ranges.is_empty() || !state_ready {
            return Ok(());
        }
        // the gradients to the host now: the scheduler's write-back, ahead of the eviction
        let pc = cs[0];
        let moves = self.sched().write_back_now(pc as u32)?;
        if !moves.is_empty() {
            // into a buffer of its own where an upload may still read the host copy's (in
            // place, the host copy's own where none does: the step leaves its parameters there)
            let t0 = self.now_us();
            let dest = match in_place && self.host_copy_free(pc)? {
                true => None,
                false => Some(self.take_spare_param(g, pc)?),
            };
            let span = self.device.host_span(HostPhase::ChunkMoves);
            let r = self.write_back_to(pc, dest);
            drop(span);
            match r {
                Ok((bytes, old)) => {
                    match (in_place, old) {
                        // in place, nothing is kept beside the chunk's own copy
                        (true, HostSlot::InFlight(p)) => self.retiring.push(p),
                        (true, _) => {}
                        (false, old) => self.put_spare_param(g, old),
                    }
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
        // an upload into the chunk waits for the gradients' copy down (made fallible things
        // first: nothing is lent yet)
        let read = self.device.new_event()?;
        self.device.record(&self.down, &read)?;
        let out = match in_place {
            true => None,
            false => Some(self.take_spare_param(g, pc)?),
        };
        // (a fold reads the master, an in-place step updates it: neither has copies)
        let shadow = match self.overlap.spare_shadow[g].take() {
            _ if fold || in_place => Vec::new(),
            Some(s) if s.len() == lent => s,
            _ => state
                .iter()
                .map(|&c| self.alloc_shadow(c))
                .collect::<Result<Vec<_>>>()?,
        };
        let grads = match std::mem::replace(&mut self.payload[pc].host, HostSlot::Lent) {
            HostSlot::Ready(b) => Grads::Host(b),
            HostSlot::InFlight(p) => Grads::Copy(p),
            other => {
                self.payload[pc].host = other;
                if let Some(out) = out {
                    self.put_spare_param(g, HostSlot::Ready(out));
                }
                self.overlap.spare_shadow[g] = Some(shadow);
                return Ok(());
            }
        };
        let orig = self.lend_ready(state);
        // the statistics the optimizer reads of the group, taken before the step (off the
        // training thread, and in place before the gradients are gone)
        let mut stat_ranges = Vec::new();
        if !fold {
            stat_ranges.extend(ranges.iter().cloned());
            stat_ranges.extend(self.partial_shares(g, true).into_iter().map(|(r, _)| r));
        }
        let (done, rx) = bounded(1);
        let (stats_to, stats) = match fold {
            true => (None, EarlyStats::None),
            false => {
                let (to, from) = bounded(1);
                (Some(to), EarlyStats::Coming(from))
            }
        };
        let job = Job {
            group: g,
            grads,
            out,
            stat_ranges,
            dtype: self.cfg.param_dtype,
            orig,
            shadow,
            ranges,
            elem_bytes: self.cfg.param_dtype.size(),
            moments: self.cfg.moments,
            threads,
            step,
            every_block: fold,
            stats_to,
            done,
        };
        if let Err(job) = self.send(Box::new(job)) {
            // no worker thread (the system would not start one): everything goes back, and
            // the host groups step after backward from now on
            for (&c, b) in state.iter().zip(job.orig) {
                self.payload[c].host = HostSlot::Ready(b);
            }
            self.payload[pc].host = match job.grads {
                Grads::Host(b) => HostSlot::Ready(b),
                Grads::Copy(p) => HostSlot::InFlight(p),
            };
            self.overlap.plan = None;
            return Ok(());
        }
        self.overlap.jobs[g] = Some(Job0 {
            state: Early::Running(rx),
            version: self.overlap.version[g],
            in_place,
            deferred: false,
            counted: false,
            stats,
            read,
        });
        self.overlap.stats.started += 1;
        Ok(())
    }

    /// The host copies of `chunks`, each ready (checked by the caller), lent: their slots say
    /// so until the step gives them back.
    fn lend_ready(&mut self, chunks: &[usize]) -> Vec<HostBuffer> {
        chunks
            .iter()
            .map(
                |&c| match std::mem::replace(&mut self.payload[c].host, HostSlot::Lent) {
                    HostSlot::Ready(b) => b,
                    _ => unreachable!("a lent chunk's host copy is ready"),
                },
            )
            .collect()
    }

    /// A buffer for a copy of chunk `c`'s host copy: with chunks spilled to the file tier, on
    /// the file tier whatever the chunk's tier (a second copy in host memory would exceed the
    /// host budget: the chunk and its copy trade buffers when a step is kept, so one of the two
    /// is in host memory at any time); else as the chunk's own.
    fn alloc_shadow(&mut self, c: usize) -> Result<HostBuffer> {
        match &self.file {
            Some(f) => f.alloc(self.chunk_bytes(c)),
            None => self.alloc_host(c),
        }
    }

    /// Whether chunk `c`'s host copy may take a write-back now: no upload still reads it.
    fn host_copy_free(&self, c: usize) -> Result<bool> {
        Ok(match &self.payload[c].host {
            HostSlot::Ready(_) | HostSlot::None => true,
            HostSlot::InFlight(p) => p.is_ready()?,
            HostSlot::Lent => false,
        })
    }

    /// Hands `job` to the worker thread, started on first use; gives the job back if there is
    /// no worker.
    fn send(&mut self, job: Box<Job>) -> std::result::Result<(), Box<Job>> {
        if self.overlap.worker.is_none() {
            let (tx, jobs) = unbounded::<Box<Job>>();
            let spawned = std::thread::Builder::new()
                .name("tidemem-host-step".into())
                .spawn(move || {
                    lower_priority();
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
    pub(super) fn put_spare_param(&mut self, g: usize, slot: HostSlot) {
        match slot {
            HostSlot::None | HostSlot::Lent => {}
            HostSlot::InFlight(p) if self.overlap.spare_param[g].len() >= 3 => {
                self.retiring.push(p)
            }
            HostSlot::Ready(_) if self.overlap.spare_param[g].len() >= 3 => {}
            s => self.overlap.spare_param[g].push(s),
        }
    }
}

/// Lowers the calling thread's scheduling priority (Linux: nice 10; elsewhere nothing): the
/// host-step thread yields a core to the training thread, whose few microseconds between
/// waits issue the device's next work, whenever both want it.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid has no preconditions; setpriority on this thread's id changes only its
    // niceness (raising it needs no privilege), and a failure is ignored.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
}
