//! Optimizer passes: every chunk group visited once, on the host or on the device, between the
//! end of backward and the end of the step.

use std::ops::Range;
use std::sync::Arc;

use super::{ChunkManager, HostSlot, LogKind, LISTS};
use crate::chunk::moments::split8;
use crate::chunk::plan::{ChunkPlan, MomentStorage};
use crate::chunk::tensors::{decode, encode};
use crate::device::{Device, DeviceBuffer, HostBuffer, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::Moments8;
use crate::tensor::{ChunkKind, Stage, TensorId, TrainEvent};
use crate::tide::{Access, ChunkNo, Move, Target};

/// The four chunks of one group on the host, for an optimizer step.
pub struct GroupSlices<'a> {
    /// Group index.
    pub group: usize,
    /// Tensors of the group: id, offset and length in elements, and whether a gradient was written
    /// into its parameter slot this iteration.
    pub tensors: Vec<(TensorId, usize, usize, bool)>,
    /// Parameter chunk (gradients where written), raw bytes of the parameter dtype.
    pub param: &'a mut [u8],
    /// Parameter dtype.
    pub param_dtype: DType,
    /// fp32 masters.
    pub master: &'a mut [f32],
    /// Momentum.
    pub momentum: &'a mut [f32],
    /// Variance.
    pub variance: &'a mut [f32],
}

impl GroupSlices<'_> {
    /// The parameter chunk decoded to f32 (gradients where written).
    pub fn param_f32(&self) -> Vec<f32> {
        decode(self.param, self.param_dtype)
    }

    /// Writes the masters, rounded to the parameter dtype, into the parameter chunk (the last
    /// thing an optimizer step does).
    pub fn store_params(&mut self) {
        let es = self.param_dtype.size();
        for (i, x) in self.master.iter().enumerate() {
            let b = encode(std::slice::from_ref(x), self.param_dtype);
            self.param[i * es..(i + 1) * es].copy_from_slice(&b);
        }
    }
}

/// The chunks of one group as an optimizer pass sees them (see
/// [`ChunkManager::visit_groups`]).
pub struct GroupVisit<'a> {
    /// Group index.
    pub group: usize,
    /// Tensors of the group: id, offset and length in elements, and whether a gradient was written
    /// into its parameter slot this iteration.
    pub tensors: Vec<(TensorId, usize, usize, bool)>,
    /// Element ranges of the chunk that hold gradients: runs of consecutive tensors with a
    /// gradient (padding between them included; padding is zero in every list).
    pub(crate) ranges: Vec<Range<usize>>,
    /// Parameter dtype.
    pub param_dtype: DType,
    /// The chunks, where they are.
    pub chunks: GroupChunks<'a>,
}

/// The chunks of a visited group, on the host or on the device; the lists not asked for are
/// `None` (the moments are there when both the momentum and the variance are asked for).
pub enum GroupChunks<'a> {
    /// Host memory.
    Host {
        /// Parameter chunk (gradients where written), raw bytes of the parameter dtype.
        param: &'a mut [u8],
        /// fp32 masters.
        master: Option<&'a mut [f32]>,
        /// Adam's momentum and variance.
        moments: Option<HostMoments<'a>>,
    },
    /// Device memory: enqueue work on `stream`.
    Device {
        /// The device.
        device: &'a Device,
        /// The stream to enqueue on (the manager's compute stream).
        stream: &'a Stream,
        /// Parameter chunk.
        param: &'a DeviceBuffer,
        /// fp32 masters.
        master: Option<&'a DeviceBuffer>,
        /// Adam's momentum and variance.
        moments: Option<DeviceMoments<'a>>,
    },
}

/// Adam's two moment chunks of a group on the host, as
/// [`ManagerConfig::moments`](super::ManagerConfig::moments) holds them.
pub enum HostMoments<'a> {
    /// fp32, a value an element.
    F32 {
        /// Momentum.
        momentum: &'a mut [f32],
        /// Variance.
        variance: &'a mut [f32],
    },
    /// 8-bit codes and block scales.
    Int8(Moments8<'a>),
}

/// Adam's two moment chunks of a group on the device.
#[derive(Clone, Copy)]
pub enum DeviceMoments<'a> {
    /// fp32, a value an element.
    F32 {
        /// Momentum.
        momentum: &'a DeviceBuffer,
        /// Variance.
        variance: &'a DeviceBuffer,
    },
    /// 8-bit: each chunk holds its `elems` codes, then from byte
    /// `elems.next_multiple_of(4)` its block scales.
    Int8 {
        /// Momentum.
        momentum: &'a DeviceBuffer,
        /// Variance.
        variance: &'a DeviceBuffer,
        /// Elements of the group.
        elems: usize,
    },
}

/// A host group's visit waiting for its step (see [`ChunkManager::visit_groups`]).
struct HostVisit {
    g: usize,
    tensors: Vec<(TensorId, usize, usize, bool)>,
    ranges: Vec<Range<usize>>,
}

/// The chunk a move is about.
pub(super) fn move_chunk(m: &Move) -> ChunkNo {
    match *m {
        Move::Materialize { chunk }
        | Move::Load { chunk, .. }
        | Move::WriteBack { chunk }
        | Move::Drop { chunk }
        | Move::FreeHost { chunk } => chunk,
    }
}

/// Runs of consecutive tensors (by offset) that hold a gradient, as element ranges.
pub(crate) fn grad_ranges(tensors: &[(TensorId, usize, usize, bool)]) -> Vec<Range<usize>> {
    let mut by_offset: Vec<&(TensorId, usize, usize, bool)> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.1);
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut open = false;
    for &&(_, off, n, has) in &by_offset {
        if !has {
            open = false;
            continue;
        }
        match out.last_mut() {
            Some(r) if open => r.end = off + n,
            _ => out.push(off..off + n),
        }
        open = true;
    }
    out
}

impl ChunkManager {
    /// Runs an optimizer over every chunk group on the host: the group's four chunks are brought
    /// to host memory (dirty device copies written back, stale ones dropped) and handed to `f`,
    /// which updates masters and optimizer state and must leave the new parameter values in the
    /// parameter chunk. One moment per group.
    /// Refused ([`Error::Conflict`]) with 8-bit moments, which `HybridAdam` steps.
    pub fn step_host(&mut self, mut f: impl FnMut(GroupSlices<'_>) -> Result<()>) -> Result<()> {
        self.usable()?;
        if self.cfg.moments != MomentStorage::F32 {
            return Err(Error::Conflict {
                what: "ChunkManager::step_host (an optimizer of f32 moments)".into(),
                with: "8-bit moments (MomentStorage::Int8; HybridAdam steps them)".into(),
            });
        }
        self.visit_groups(
            &ChunkKind::ALL,
            |_| Target::Host,
            |v| match v.chunks {
                GroupChunks::Host {
                    param,
                    master: Some(master),
                    moments: Some(HostMoments::F32 { momentum, variance }),
                } => f(GroupSlices {
                    group: v.group,
                    tensors: v.tensors,
                    param,
                    param_dtype: v.param_dtype,
                    master,
                    momentum,
                    variance,
                }),
                _ => unreachable!("four host chunks were asked for"),
            },
        )
    }

    /// Visits every chunk group once, in order, during the optimizer stage (after
    /// [`ChunkManager::end_backward`]): the chunks of `kinds` (the parameter chunk is always
    /// included) are brought to the tier `place(group)` names and handed to `f`. One moment per
    /// group; every chunk visited counts as written. On the device, `f` enqueues its work on
    /// the stream it is given, which runs after the loads of the group's chunks; later moves of
    /// those chunks run after it. A pass that includes the masters must leave parameters in the
    /// parameter chunk (an optimizer step, or a restore from the masters): afterwards the
    /// group's parameter chunk counts as holding parameters again, not gradients, for
    /// [`ChunkManager::save_checkpoint`].
    pub fn visit_groups(
        &mut self,
        kinds: &[ChunkKind],
        mut place: impl FnMut(usize) -> Target,
        mut f: impl FnMut(GroupVisit<'_>) -> Result<()>,
    ) -> Result<()> {
        self.usable()?;
        if self.stage != Some(Stage::Optimizer) {
            return Err(Error::WrongStage {
                call: "an optimizer pass (between end_backward and end_step)".into(),
                stage: self.stage.map_or("idle", Stage::name),
            });
        }
        let mut lists = vec![ChunkKind::Param];
        lists.extend(kinds.iter().copied().filter(|&k| k != ChunkKind::Param));
        lists.sort_by_key(|k| k.index());
        lists.dedup();
        let opt: Vec<ChunkKind> = lists[1..].to_vec();
        let deferred = self.take_deferred(&lists);
        if !self.overlap_keeps(&lists) {
            // early steps are kept only by the optimizer step that decided so
            self.cancel_overlap()?;
        }
        // A host group steps once the next group's moves are issued, so that the copies of
        // that group's chunks to the host run while this one steps (the same steps, each on
        // the same bytes, in the same order). Moves that touch the group waiting to step wait
        // for its step first.
        let mut waiting: Option<HostVisit> = None;
        for g in 0..self.layout.groups() {
            let t0 = self.now_us();
            let target = place(g);
            let ids: Vec<TensorId> = self.layout.group_tensors[g]
                .iter()
                .map(|&t| TensorId(t))
                .collect();
            for &k in &opt {
                self.check_transition(&ids, k, TrainEvent::BeforeOptim)?;
            }
            // a group stepped during backward is done: its chunks took the step's results, and
            // a parameter chunk that went up with them is as current as its host copy
            let early = match self.settle_kept(g) {
                Ok(kept) => Ok(kept || self.stepped_early(g)),
                Err(e) => Err(e),
            };
            let param_current = matches!(early, Ok(true)) && self.uploaded_early(g);
            let acc: Vec<Access> = lists
                .iter()
                .map(|&k| Access {
                    chunk: ChunkPlan::chunk_no(g as u32, k),
                    target,
                    write: !(k == ChunkKind::Param && param_current),
                })
                .collect();
            self.tick(Stage::Optimizer, &acc);
            let moves = self.fetch_moment(&acc)?;
            self.step_if_touched(&mut waiting, &moves, &lists, &mut f)?;
            self.execute(&moves)?;
            for &id in &ids {
                for &k in &opt {
                    self.apply(id, k, TrainEvent::BeforeOptim);
                }
            }
            let tensors = self.group_tensors(g);
            let ranges = grad_ranges(&tensors);
            let result = match (early, target) {
                (Err(e), _) => Err(e),
                (Ok(true), _) => Ok(()),
                // stepped on the worker, overlapped with the next forward
                (Ok(false), Target::Host)
                    if deferred.is_some()
                        && waiting.is_none()
                        && ranges.iter().any(|r| !r.is_empty()) =>
                {
                    match self.lend_deferred(g, deferred.as_ref().expect("checked"), &ranges) {
                        Ok(true) => Ok(()),
                        Ok(false) => self.visit_host(g, &lists, tensors, ranges, &mut f),
                        Err(e) => Err(e),
                    }
                }
                (Ok(false), Target::Host) => {
                    let previous = waiting.replace(HostVisit { g, tensors, ranges });
                    match previous {
                        Some(v) => self.visit_host(v.g, &lists, v.tensors, v.ranges, &mut f),
                        None => Ok(()),
                    }
                }
                (Ok(false), Target::Device) => match self.refresh_device_param(g) {
                    Ok(()) => self.visit_device(g, &lists, tensors, ranges, &mut f),
                    Err(e) => Err(e),
                },
            };
            for &id in &ids {
                for &k in &opt {
                    self.apply(id, k, TrainEvent::AfterOptim);
                }
            }
            let chunks: Vec<ChunkNo> = acc.iter().map(|a| a.chunk).collect();
            let moves = self.sched().release(&chunks)?;
            if result.is_ok() {
                self.step_if_touched(&mut waiting, &moves, &lists, &mut f)?;
            }
            self.execute(&moves)?;
            self.sample();
            self.note(LogKind::Optimizer, g as u64, 0, t0);
            result?;
            if lists.contains(&ChunkKind::Master) {
                // an optimizer pass (or a restore from the masters) leaves parameters in the
                // parameter chunk
                self.grads_in[g] = false;
            }
        }
        match waiting {
            Some(v) => self.visit_host(v.g, &lists, v.tensors, v.ranges, &mut f),
            None => Ok(()),
        }
    }

    /// Steps the host group waiting for its step if `moves` touch one of its chunks.
    fn step_if_touched(
        &mut self,
        waiting: &mut Option<HostVisit>,
        moves: &[Move],
        lists: &[ChunkKind],
        f: &mut impl FnMut(GroupVisit<'_>) -> Result<()>,
    ) -> Result<()> {
        let touched = waiting.as_ref().is_some_and(|v| {
            moves
                .iter()
                .any(|m| ChunkPlan::group_of(move_chunk(m)) as usize == v.g)
        });
        match waiting.take() {
            Some(v) if touched => self.visit_host(v.g, lists, v.tensors, v.ranges, f),
            w => {
                *waiting = w;
                Ok(())
            }
        }
    }

    fn visit_host(
        &mut self,
        g: usize,
        lists: &[ChunkKind],
        tensors: Vec<(TensorId, usize, usize, bool)>,
        ranges: Vec<Range<usize>>,
        f: &mut impl FnMut(GroupVisit<'_>) -> Result<()>,
    ) -> Result<()> {
        // every copy in place first, so an error cannot leave a chunk taken out of its slot
        for &k in lists {
            self.host_ready(ChunkPlan::chunk_no(g as u32, k) as usize)?;
        }
        let mut bufs: [Option<HostBuffer>; 4] = Default::default();
        for &k in lists {
            let c = ChunkPlan::chunk_no(g as u32, k) as usize;
            match std::mem::take(&mut self.payload[c].host) {
                HostSlot::Ready(b) => bufs[k.index()] = Some(b),
                _ => unreachable!("host_ready leaves the slot ready"),
            }
        }
        let result = {
            let [p, ma, mo, va] = &mut bufs;
            fn f32s(b: &mut Option<HostBuffer>) -> Result<Option<&mut [f32]>> {
                match b {
                    None => Ok(None),
                    Some(b) => bytemuck::try_cast_slice_mut::<u8, f32>(b)
                        .map(Some)
                        .map_err(|_| Error::Misaligned {
                            what: "host chunk",
                            value: 0,
                            align: 4,
                        }),
                }
            }
            let elems = self.layout.group_elems[g];
            let moments = match (self.cfg.moments, mo.as_mut(), va.as_mut()) {
                (MomentStorage::F32, Some(_), Some(_)) => match (f32s(mo), f32s(va)) {
                    (Ok(Some(momentum)), Ok(Some(variance))) => {
                        Ok(Some(HostMoments::F32 { momentum, variance }))
                    }
                    (Err(e), _) | (_, Err(e)) => Err(e),
                    _ => unreachable!("both moments are present"),
                },
                (MomentStorage::Int8, Some(m), Some(v)) => {
                    match (split8(m, elems), split8(v, elems)) {
                        (Ok((momentum, momentum_scales)), Ok((variance, variance_scales))) => {
                            Ok(Some(HostMoments::Int8(Moments8 {
                                momentum,
                                variance,
                                momentum_scales,
                                variance_scales,
                            })))
                        }
                        (Err(e), _) | (_, Err(e)) => Err(e),
                    }
                }
                _ => Ok(None),
            };
            match (f32s(ma), moments) {
                (Ok(master), Ok(moments)) => f(GroupVisit {
                    group: g,
                    tensors,
                    ranges,
                    param_dtype: self.cfg.param_dtype,
                    chunks: GroupChunks::Host {
                        param: p.as_mut().expect("the parameter chunk is always visited"),
                        master,
                        moments,
                    },
                }),
                (Err(e), _) | (_, Err(e)) => Err(e),
            }
        };
        for (i, b) in bufs.into_iter().enumerate() {
            if let Some(b) = b {
                self.payload[ChunkPlan::chunk_no(g as u32, LISTS[i]) as usize].host =
                    HostSlot::Ready(b);
            }
        }
        result
    }

    fn visit_device(
        &mut self,
        g: usize,
        lists: &[ChunkKind],
        tensors: Vec<(TensorId, usize, usize, bool)>,
        ranges: Vec<Range<usize>>,
        f: &mut impl FnMut(GroupVisit<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut bufs: [Option<Arc<DeviceBuffer>>; 4] = Default::default();
        for &k in lists {
            let c = ChunkPlan::chunk_no(g as u32, k) as usize;
            self.issue_load(c)?;
            if let Some(ev) = self.payload[c].ready.take() {
                self.device.wait_event(&self.compute, &ev)?;
            }
            bufs[k.index()] =
                Some(
                    self.payload[c]
                        .device
                        .clone()
                        .ok_or_else(|| Error::Internal {
                            what: format!("chunk {c} was fetched but has no device copy"),
                        })?,
                );
        }
        let [p, ma, mo, va] = &bufs;
        f(GroupVisit {
            group: g,
            tensors,
            ranges,
            param_dtype: self.cfg.param_dtype,
            chunks: GroupChunks::Device {
                device: &self.device,
                stream: &self.compute,
                param: p.as_deref().expect("the parameter chunk is always visited"),
                master: ma.as_deref(),
                moments: match (self.cfg.moments, mo.as_deref(), va.as_deref()) {
                    (MomentStorage::F32, Some(momentum), Some(variance)) => {
                        Some(DeviceMoments::F32 { momentum, variance })
                    }
                    (MomentStorage::Int8, Some(momentum), Some(variance)) => {
                        Some(DeviceMoments::Int8 {
                            momentum,
                            variance,
                            elems: self.layout.group_elems[g],
                        })
                    }
                    _ => None,
                },
            },
        })
    }

    /// Tells the scheduler where the optimizer will run each group from now on: the installed
    /// trace's optimizer moments are rewritten to `place(group)`, so next-use distances and
    /// prefetching count the optimizer's device uses. Without an installed trace (during
    /// warm-up) nothing changes.
    pub fn plan_optimizer(&mut self, mut place: impl FnMut(usize) -> Target) {
        let Some(s) = self.sched.as_mut() else {
            return;
        };
        let Some(mut trace) = s.trace().cloned() else {
            return;
        };
        trace.place_optimizer(|c| place(ChunkPlan::group_of(c) as usize));
        s.install_trace(trace);
    }

    /// The tensors of group `g`, each with whether its gradient was written this iteration.
    pub(crate) fn group_grad_flags(&self, g: usize) -> Vec<(TensorId, bool)> {
        self.group_tensors(g)
            .into_iter()
            .map(|(id, _, _, has)| (id, has))
            .collect()
    }

    /// Element ranges of group `g`'s parameter chunk that hold gradients written this
    /// iteration (see [`GroupVisit::ranges`]).
    pub(crate) fn param_grad_ranges(&self, g: usize) -> Vec<Range<usize>> {
        grad_ranges(&self.group_tensors(g))
    }

    /// Whether group `g`'s parameter chunk has a device copy.
    pub(crate) fn param_on_device(&self, g: usize) -> bool {
        let c = ChunkPlan::chunk_no(g as u32, ChunkKind::Param) as usize;
        // not a device copy that holds an early step's parameters in place of the gradients
        self.payload.get(c).is_some_and(|p| p.device.is_some()) && !self.device_param_differs(g)
    }

    /// Group `g`'s parameter chunk on the host, where it is, without a move (waiting for a
    /// copy in flight).
    pub(crate) fn param_host(&mut self, g: usize) -> Result<&[u8]> {
        let c = ChunkPlan::chunk_no(g as u32, ChunkKind::Param) as usize;
        self.settle_deferred(g)?;
        if matches!(self.payload[c].host, HostSlot::Lent) {
            // an early step holds the gradients, and leaves them as they are
            return self.lent_grads(g)?.ok_or_else(|| Error::Internal {
                what: format!("group {g}'s gradients are lent and lost"),
            });
        }
        Ok(self.host_ready(c)?)
    }

    /// Group `g`'s parameter chunk on the device, where it is, without a move: work on
    /// [`ChunkManager::compute_stream`] after this call runs after its load.
    pub(crate) fn param_device(&mut self, g: usize) -> Result<Arc<DeviceBuffer>> {
        let c = ChunkPlan::chunk_no(g as u32, ChunkKind::Param) as usize;
        self.issue_load(c)?;
        if let Some(ev) = self.payload[c].ready.take() {
            self.device.wait_event(&self.compute, &ev)?;
        }
        self.payload[c]
            .device
            .clone()
            .ok_or_else(|| Error::Internal {
                what: format!("chunk {c} has no device copy"),
            })
    }

    /// Device scratch memory for the optimizer's own work (the gradient statistics), from the
    /// non-model pool, so that a steady step allocates nothing from the device.
    pub(crate) fn alloc_scratch(&mut self, bytes: usize) -> Result<crate::device::PoolBlock> {
        self.pool().alloc(bytes)
    }
}

#[cfg(test)]
mod tests {
    use crate::chunk::{ChunkManager, GroupChunks, ManagerConfig};
    use crate::device::{Device, SimConfig};
    use crate::tensor::{ChunkKind, Init, Stage, TensorId};
    use crate::tide::{Policy, Target};

    /// Alternating host and device groups, the next forward starting from the last group: the
    /// masters of the host groups after three steps, and the bytes moved up.
    fn run(capacity: usize, host: Option<u64>) -> (Vec<Vec<f32>>, u64) {
        let dev = Device::sim(SimConfig::with_capacity(capacity)).unwrap();
        let mut cfg = ManagerConfig::new(1024, Policy::Tide);
        cfg.param_dtype = crate::DType::F32;
        let dir =
            std::env::temp_dir().join(format!("tidemem-wait-{}-{capacity}", std::process::id()));
        if host.is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            cfg.host_budget = host;
            cfg.file_dir = Some(dir.clone());
        }
        let mut m = ChunkManager::new(dev, cfg).unwrap();
        let ids: Vec<TensorId> = (0..8)
            .map(|i| {
                m.register(&format!("t{i}"), &[1024], Init::Constant(i as f32))
                    .unwrap()
            })
            .collect();
        for step in 0..3 {
            // forward from the last group, so the next forward's first chunk is the last
            // group's, which the scheduler may bring back while that group waits for its step
            for &id in ids.iter().rev() {
                m.fetch(&[id], Stage::Forward).unwrap();
                m.release(&[id], Stage::Forward).unwrap();
            }
            m.end_forward().unwrap();
            for (i, &id) in ids.iter().enumerate() {
                m.fetch(&[id], Stage::Backward).unwrap();
                m.write_grad(id, &[(i + step) as f32; 1024]).unwrap();
                m.release(&[id], Stage::Backward).unwrap();
            }
            m.end_backward().unwrap();
            let place = |g: usize| {
                if g % 2 == 1 {
                    Target::Host
                } else {
                    Target::Device
                }
            };
            m.visit_groups(&ChunkKind::ALL, place, |v| {
                if let GroupChunks::Host {
                    param,
                    master: Some(master),
                    ..
                } = v.chunks
                {
                    // master -= gradient (read from the parameter chunk), parameters = masters
                    let grads: &mut [f32] = bytemuck::cast_slice_mut(param);
                    for (p, g) in master.iter_mut().zip(grads.iter_mut()) {
                        *p -= *g;
                        *g = *p;
                    }
                }
                Ok(())
            })
            .unwrap();
            m.end_step().unwrap();
        }
        let masters = ids
            .iter()
            .skip(1)
            .step_by(2)
            .map(|&id| m.master(id).unwrap())
            .collect();
        let up = m.stats().h2d_bytes;
        drop(m);
        std::fs::remove_dir_all(&dir).ok();
        (masters, up)
    }

    /// Host groups step one group late, after the next group's moves (see
    /// [`ChunkManager::visit_groups`]): each still steps exactly once, on its own gradients,
    /// between device groups, on a device that evicts and with the file tier.

    #[test]
    fn host_groups_step_once_each_a_group_late() {
        let (roomy, roomy_up) = run(64 << 20, None);
        // each host group: its initial value less its gradients (i + step) over three steps
        for (k, v) in roomy.iter().enumerate() {
            let i = 2 * k + 1;
            let want = i as f32 - (3 * i + 3) as f32;
            assert!(
                v.iter().all(|&x| x == want),
                "group {i}: {} vs {want}",
                v[0]
            );
        }
        // room for about three groups' chunks: the device groups' loads evict
        let (tight, tight_up) = run(3 * 4 * 4096 + (64 << 10), None);
        assert_eq!(tight, roomy);
        // host memory for a third of the model data: chunks go to the file tier and back
        let (filed, _) = run(3 * 4 * 4096 + (64 << 10), Some(8 * 4 * 4096 / 3));
        assert_eq!(filed, roomy);
        assert!(
            tight_up > roomy_up,
            "the tight device moves more: {tight_up} vs {roomy_up}"
        );
    }
}
