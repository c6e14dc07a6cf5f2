//! Replays a model's training trace through the placement policies without allocating its memory.
//!
//! A [`ModelSpec`] lists parameter tensors and the ops of the forward pass (which tensors each op
//! uses and how much non-model memory it needs); backward runs the ops in reverse. [`simulate`]
//! packs the tensors into chunks exactly as the chunk manager does, produces the accesses the
//! manager would make (one moment per op; the optimizer steps every chunk group on the host), and
//! feeds them to the same [`Scheduler`]: warm-up iteration first, then steady iterations under the
//! recorded tide. A GPT's spec comes from its shape
//! ([`GptConfig::spec`](crate::models::gpt::GptConfig::spec)).
//!
//! ```
//! use tidemem::models::gpt::GptConfig;
//! use tidemem::simulate::{simulate, SimOptions};
//! use tidemem::tide::Policy;
//! # fn main() -> tidemem::Result<()> {
//! // GPT-2 124M, 8 sequences of 1024 tokens, every block checkpointed
//! let model = GptConfig::preset("gpt2").unwrap().spec(8, 1024, true)?;
//! let opts = SimOptions::new(4 << 30, 64 << 30);
//! let r = simulate(&model, Policy::Tide, &opts)?;
//! assert!(r.steady.h2d_bytes >= r.bound.h2d_bytes);
//! # Ok(()) }
//! ```

use serde::Serialize;

mod plan;
mod timeline;
mod zero;

pub use plan::{plan, StepPlan};
pub use timeline::{timeline, Rates, StepSchedule, StepTime, ADAM_BYTES_PER_ELEMENT};
pub use zero::shard;

use crate::chunk::{
    optimizer_accesses, overlap_group_bytes, push_access, search_chunk_size, ChunkKind,
    ChunkLayout, ChunkPlan, MomentStorage, SizeSearch,
};
use crate::error::{Error, Result};
use crate::optim::{DevicePlacement, ShadowBudget};
use crate::tensor::Stage;
use crate::tide::{
    lower_bound, spill_to_file, Access, Bound, ChunkNo, MoveStats, Policy, Scheduler,
    SchedulerConfig, Sizing, Target, Trace, Tracer,
};

/// One op of the forward pass.
#[derive(Clone, Debug, Serialize)]
pub struct OpSpec {
    /// Name (for traces).
    pub name: String,
    /// Parameter tensors it uses (indices into [`ModelSpec::tensors`]).
    pub tensors: Vec<usize>,
    /// Non-model device bytes (activations, workspace) at its forward moment.
    pub fwd_non_model: u64,
    /// Non-model device bytes at its backward moment.
    pub(crate) bwd_non_model: u64,
    /// Device FLOPs of its forward (0 where unknown): what [`timeline`] charges the device.
    pub flops: u64,
    /// Device FLOPs of its backward moment (twice the forward's for a matrix product, plus a
    /// forward recomputed in the same moment).
    pub bwd_flops: u64,
}

/// One moment of an explicit backward pass ([`ModelSpec::backward`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BackwardOp {
    /// The forward op whose tensors it fetches (an index into [`ModelSpec::ops`]).
    pub op: usize,
    /// A recomputation of the op's forward (activation checkpointing): one more use of its
    /// tensors on each side, never a gradient write.
    pub recompute: bool,
    /// Non-model device bytes at this moment.
    pub non_model: u64,
}

/// A model as the memory manager sees it.
#[derive(Clone, Debug, Serialize)]
pub struct ModelSpec {
    /// Name.
    pub name: String,
    /// Parameter tensors: name and element count, in registration order.
    pub tensors: Vec<(String, usize)>,
    /// Forward ops in order; backward is the reverse unless [`ModelSpec::backward`] says
    /// otherwise.
    pub ops: Vec<OpSpec>,
    /// The backward pass moment by moment, when it is not the forward ops reversed (e.g. with
    /// recomputed segments); `None`: the reverse, at each op's `bwd_non_model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backward: Option<Vec<BackwardOp>>,
}

impl ModelSpec {
    /// Number of parameters.
    pub fn params(&self) -> u64 {
        self.tensors.iter().map(|t| t.1 as u64).sum()
    }

    /// Element counts of the tensors, in registration order.
    pub fn numels(&self) -> Vec<usize> {
        self.tensors.iter().map(|t| t.1).collect()
    }

    /// Forward uses of every tensor.
    pub fn uses(&self) -> Vec<u32> {
        let mut u = vec![0u32; self.tensors.len()];
        for op in &self.ops {
            for &t in &op.tensors {
                if let Some(x) = u.get_mut(t) {
                    *x += 1;
                }
            }
        }
        u
    }

    /// Forward moments (one per op) and backward moments of one iteration.
    pub fn moments(&self) -> (usize, usize) {
        let bwd = self.backward.as_ref().map_or(self.ops.len(), Vec::len);
        (self.ops.len(), bwd)
    }

    /// Sets the non-model bytes of every forward and backward moment, in the order they run
    /// (e.g. the tide a manager recorded in its warm-up iteration, so that the simulator
    /// replays a model whose activations are not modelled byte for byte).
    pub fn set_tide(&mut self, non_model: &[u64]) -> Result<()> {
        let (f, b) = self.moments();
        if non_model.len() != f + b {
            return Err(Error::Length {
                what: format!(
                    "non-model values for the {f} forward and {b} backward moments of '{}'",
                    self.name
                ),
                got: non_model.len(),
                expected: f + b,
            });
        }
        for (op, &nm) in self.ops.iter_mut().zip(non_model) {
            op.fwd_non_model = nm;
        }
        match self.backward.as_mut() {
            Some(bwd) => {
                for (x, &nm) in bwd.iter_mut().zip(&non_model[f..]) {
                    x.non_model = nm;
                }
            }
            None => {
                for (op, &nm) in self.ops.iter_mut().rev().zip(&non_model[f..]) {
                    op.bwd_non_model = nm;
                }
            }
        }
        Ok(())
    }

    fn validate(&self) -> Result<()> {
        if self.tensors.is_empty() {
            return Err(Error::Empty {
                what: format!("the tensors of model '{}'", self.name),
            });
        }
        for op in &self.ops {
            if let Some(&t) = op.tensors.iter().find(|&&t| t >= self.tensors.len()) {
                return Err(Error::IndexOutOfRange {
                    what: format!("tensor of op '{}'", op.name),
                    index: t,
                    len: self.tensors.len(),
                });
            }
        }
        if let Some(b) = self
            .backward
            .as_ref()
            .and_then(|b| b.iter().find(|b| b.op >= self.ops.len()))
        {
            return Err(Error::IndexOutOfRange {
                what: format!("op of a backward moment of '{}'", self.name),
                index: b.op,
                len: self.ops.len(),
            });
        }
        Ok(())
    }
}

/// The accesses of one iteration, moment by moment, as the chunk manager makes them: a forward
/// moment per op (param chunks on the device, read), a backward moment per op in reverse (param
/// chunks on the device, written where a tensor's last backward use writes its gradient), and an
/// optimizer moment per chunk group (all four chunks on the host, written).
pub(crate) fn iteration_accesses(
    spec: &ModelSpec,
    layout: &ChunkLayout,
) -> Vec<(Stage, Vec<Access>, u64)> {
    let group_of = |t: usize| layout.slots[t].group;
    let uses = spec.uses();
    let mut left = uses.clone();
    let mut out = Vec::with_capacity(spec.ops.len() * 2 + layout.groups());
    for op in &spec.ops {
        let mut acc: Vec<Access> = Vec::new();
        for &t in &op.tensors {
            push_access(
                &mut acc,
                ChunkPlan::chunk_no(group_of(t), ChunkKind::Param),
                Target::Device,
                false,
            );
        }
        out.push((Stage::Forward, acc, op.fwd_non_model));
    }
    let reversed: Vec<BackwardOp> = (0..spec.ops.len())
        .rev()
        .map(|op| BackwardOp {
            op,
            recompute: false,
            non_model: spec.ops[op].bwd_non_model,
        })
        .collect();
    for b in spec.backward.as_deref().unwrap_or(&reversed) {
        let mut acc: Vec<Access> = Vec::new();
        for &t in &spec.ops[b.op].tensors {
            // a recompute adds a use on each side: never the last
            if !b.recompute {
                left[t] = left[t].saturating_sub(1);
            }
            let last = !b.recompute && left[t] == 0;
            push_access(
                &mut acc,
                ChunkPlan::chunk_no(group_of(t), ChunkKind::Param),
                Target::Device,
                last,
            );
        }
        out.push((Stage::Backward, acc, b.non_model));
    }
    for g in 0..layout.groups() as u32 {
        out.push((Stage::Optimizer, optimizer_accesses(g), 0));
    }
    out
}

/// Options of a simulation.
#[derive(Clone, Debug, Serialize)]
pub struct SimOptions {
    /// Device bytes.
    pub device_mem: u64,
    /// Host bytes for model data; chunks beyond it spill to the file tier.
    pub host_mem: u64,
    /// Chunk size in elements; `None` searches the size with least padding.
    pub chunk_elems: Option<usize>,
    /// Bytes per parameter element in the param list.
    pub param_bytes: u64,
    /// Scheduler settings (its `capacity` is overwritten with `device_mem`).
    pub scheduler: SchedulerConfig,
    /// Steady iterations after warm-up; the last is reported.
    pub iterations: usize,
    /// Where Adam steps each chunk group after warm-up, as [`crate::optim::HybridAdam`]
    /// decides it (host only by default): device groups bring their fp32 master, momentum
    /// and variance chunks to the device.
    pub optimizer: DevicePlacement,
    /// Data-parallel ZeRO ranks, one device each, sharing one host (1: a single process): the
    /// simulation is of one rank ([`shard`]), `device_mem` is each device's, `host_mem` the
    /// host's, shared by the ranks.
    pub ranks: usize,
    /// The host memory of the overlapped step, as [`crate::optim::HybridAdam`] holds it.
    pub overlap: SimOverlap,
    /// Host groups that step after backward rather than during it, the first in order
    /// ([`HybridConfig::overlap_tail`](crate::optim::HybridConfig::overlap_tail)).
    pub overlap_tail: usize,
    /// How the momentum and variance chunks hold their values (fp32 by default; 8-bit
    /// block-wise moments are a layout the simulator counts ahead of the chunk manager).
    pub moments: MomentStorage,
}

/// Which overlapped step's host memory a simulation counts ([`SimReport::overlap_host_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SimOverlap {
    /// The serial step: none.
    Serial,
    /// Nothing can invalidate a step (no loss scaler, no clip): every host group steps during
    /// backward, in place: none.
    InPlace,
    /// A loss scaler or a clip: shadows of the host groups' optimizer state within the budget
    /// for the groups that step during backward; the rest step after it.
    Shadowed(ShadowBudget),
    /// A step whose early steps are thrown away (an overflow, or a clip that binds after a
    /// step where it did not): the groups within the budget step during backward with shadows
    /// as under [`SimOverlap::Shadowed`], and the optimizer's pass steps every host group again,
    /// after backward, beside the next forward. The host memory is
    /// [`SimOverlap::Shadowed`]'s; the time is such a step's, the host's work of the early
    /// groups done twice.
    Redone(ShadowBudget),
    /// A clip that binds every step: a step after a clipped one is not speculated, so no host
    /// group steps during backward; each steps after it, with the real coefficient, beside the
    /// next forward: none.
    Clipped,
}

impl SimOverlap {
    /// The first of the host groups `first_host..` (of `group_elems` elements, `param_bytes`
    /// bytes each, the moments held as `moments` says) that steps during backward, and the host
    /// bytes the overlapped step holds, beside `model_data` bytes on a host of `host` bytes.
    pub(crate) fn early_groups(
        &self,
        group_elems: &[usize],
        moments: MomentStorage,
        first_host: usize,
        param_bytes: usize,
        host: u64,
        model_data: u64,
    ) -> (usize, u64) {
        let (first, shadowed) = match *self {
            SimOverlap::Serial | SimOverlap::Clipped => return (group_elems.len(), 0),
            SimOverlap::InPlace => (first_host, false),
            SimOverlap::Shadowed(b) | SimOverlap::Redone(b) => {
                let budget = b.bytes(Some(host), model_data);
                let first = ShadowBudget::first_early(
                    budget,
                    first_host,
                    group_elems,
                    param_bytes,
                    moments,
                );
                (first, true)
            }
        };
        let first = first.min(group_elems.len());
        let bytes = group_elems[first..]
            .iter()
            .map(|&e| overlap_group_bytes(e, param_bytes, moments, shadowed))
            .sum();
        (first, bytes)
    }
}

impl SimOptions {
    /// Defaults for a device and host of the given sizes.
    pub fn new(device_mem: u64, host_mem: u64) -> SimOptions {
        SimOptions {
            device_mem,
            host_mem,
            chunk_elems: None,
            param_bytes: 2,
            scheduler: SchedulerConfig::new(device_mem),
            iterations: 2,
            optimizer: DevicePlacement::HostOnly,
            ranks: 1,
            overlap: SimOverlap::Shadowed(ShadowBudget::Auto),
            overlap_tail: 0,
            moments: MomentStorage::F32,
        }
    }
}

/// What one policy did on one model.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// Policy name.
    pub policy: String,
    /// Moves of the warm-up iteration.
    pub warmup: MoveStats,
    /// Moves of the last steady iteration.
    pub steady: MoveStats,
    /// Offline lower bound for a steady iteration.
    pub bound: Bound,
    /// Chunk size used, in elements.
    pub chunk_elems: usize,
    /// Number of chunk groups.
    pub groups: usize,
    /// Model data bytes (all four lists, with padding).
    pub model_data_bytes: u64,
    /// Parameter-list bytes (what visits the device).
    pub param_chunk_bytes: u64,
    /// Bytes spilled to the file tier.
    pub file_bytes: u64,
    /// Peak non-model bytes of the iteration.
    pub peak_non_model: u64,
    /// Smallest chunk budget over the moments of an iteration.
    pub min_budget: u64,
    /// Peak chunk bytes on the device.
    pub device_peak: u64,
    /// Moments per iteration.
    pub moments: usize,
    /// Chunk groups Adam steps on the device after warm-up.
    pub device_adam_groups: usize,
    /// Host bytes the overlapped step holds beside the model data ([`SimOptions::overlap`]):
    /// on the file tier where chunks spill there.
    pub overlap_host_bytes: u64,
}

/// Chunk size used for `spec` under `opts`.
pub(crate) fn chunk_size_for(spec: &ModelSpec, opts: &SimOptions) -> Result<usize> {
    match opts.chunk_elems {
        Some(c) => Ok(c),
        None => {
            let numels = spec.numels();
            let biggest_common = numels.iter().copied().max().unwrap_or(1);
            let start = (16usize << 20).min(biggest_common.max(1 << 16));
            Ok(search_chunk_size(
                &numels,
                SizeSearch {
                    start,
                    range: start * 3,
                    interval: (start / 16).max(1),
                    multiple_of: 1024,
                },
            )?
            .chunk_elems)
        }
    }
}

/// The device sizing of one iteration of `spec` in chunks of `chunk_elems` elements with
/// `param_bytes` bytes a parameter element ([`Sizing`]: the largest single moment, the
/// smallest device under a policy): what [`ChunkManager::sizing`](crate::chunk::ChunkManager)
/// measures on a real iteration, from the spec's own trace (the optimizer on the host).
pub fn sizing(spec: &ModelSpec, chunk_elems: usize, param_bytes: u64) -> Result<Sizing> {
    spec.validate()?;
    let plan = ChunkPlan::new(&spec.numels(), chunk_elems, param_bytes)?;
    let mut tracer = Tracer::new();
    for (stage, acc, nm) in iteration_accesses(spec, &plan.layout) {
        tracer.tick(stage, acc, nm);
    }
    let trace = tracer.finish().ok_or_else(|| Error::Empty {
        what: "the model's forward ops".into(),
    })?;
    Sizing::new(trace, plan.chunks)
}

/// The device FLOPs of each moment of [`iteration_accesses`]: an op's forward, its backward (a
/// recomputation: its forward again), nothing for the optimizer's moments.
pub(crate) fn moment_flops(spec: &ModelSpec) -> Vec<u64> {
    let mut out: Vec<u64> = spec.ops.iter().map(|o| o.flops).collect();
    match &spec.backward {
        Some(b) => out.extend(b.iter().map(|b| match b.recompute {
            true => spec.ops[b.op].flops,
            false => spec.ops[b.op].bwd_flops,
        })),
        None => out.extend(spec.ops.iter().rev().map(|o| o.bwd_flops)),
    }
    out
}

/// One moment of a steady iteration as the scheduler ran it: what it accessed and the moves it
/// made (the fetch's, the prefetches', the release's, in order).
#[derive(Clone, Debug)]
pub(crate) struct MomentMoves {
    pub(crate) stage: Stage,
    pub(crate) accesses: Vec<Access>,
    pub(crate) moves: Vec<crate::tide::Move>,
}

/// A simulation's chunks and its last steady iteration, moment by moment.
pub(crate) struct Recorded {
    /// Ranks (1 of which this is).
    pub(crate) ranks: usize,
    pub(crate) chunks: Vec<crate::tide::ChunkDesc>,
    pub(crate) file: Vec<bool>,
    pub(crate) group_elems: Vec<usize>,
    pub(crate) moments: Vec<MomentMoves>,
    /// The first group stepped during backward by an overlapped step ([`SimOptions::overlap`]).
    pub(crate) first_early: usize,
}

/// Runs warm-up and steady iterations of `spec` under `policy`.
pub fn simulate(spec: &ModelSpec, policy: Policy, opts: &SimOptions) -> Result<SimReport> {
    run(spec, policy, opts).map(|(r, _)| r)
}

/// [`simulate`], with the last steady iteration's moments.
pub(crate) fn run(
    spec: &ModelSpec,
    policy: Policy,
    opts: &SimOptions,
) -> Result<(SimReport, Recorded)> {
    spec.validate()?;
    let ranks = opts.ranks.max(1);
    let sharded;
    let spec = if ranks > 1 {
        sharded = shard(spec, ranks, opts.param_bytes)?;
        &sharded
    } else {
        spec
    };
    let host_mem = opts.host_mem / ranks as u64;
    let chunk_elems = chunk_size_for(spec, opts)?;
    let plan =
        ChunkPlan::with_moments(&spec.numels(), chunk_elems, opts.param_bytes, opts.moments)?;
    let mut cfg = opts.scheduler;
    cfg.capacity = opts.device_mem;
    let file = spill_to_file(&plan.chunks, Some(host_mem));
    let file_bytes = plan
        .chunks
        .iter()
        .zip(&file)
        .filter(|(_, f)| **f)
        .map(|(c, _)| c.bytes)
        .sum();
    let mut sched = Scheduler::new(policy, cfg, plan.chunks.clone())?;
    let mut iter = iteration_accesses(spec, &plan.layout);
    let mut device_adam_groups = 0;
    let mut tracer = Tracer::new();
    let mut warmup = MoveStats::default();
    let mut steady = MoveStats::default();
    let mut moments = Vec::new();
    for it in 0..=opts.iterations.max(1) {
        let before = sched.stats();
        sched.start_iteration();
        moments.clear();
        for (stage, acc, nm) in &iter {
            sched.tick();
            if it == 0 {
                tracer.tick(*stage, acc.clone(), *nm);
            }
            let mut moves = sched.fetch(acc)?;
            moves.extend(sched.prefetch());
            let chunks: Vec<ChunkNo> = acc.iter().map(|a| a.chunk).collect();
            moves.extend(sched.release(&chunks)?);
            moments.push(MomentMoves {
                stage: *stage,
                accesses: acc.clone(),
                moves,
            });
        }
        let d = sched.stats().since(&before);
        if it == 0 {
            warmup = d;
            let mut trace = tracer.finish().ok_or_else(|| Error::Empty {
                what: "the model's forward ops".into(),
            })?;
            // the optimizer's placement once warm, decided and planned as HybridAdam does
            let k = opts.optimizer.groups(
                &cfg,
                trace.peak_non_model(),
                plan.kind_bytes(ChunkKind::Param),
                &plan.layout.group_elems,
                opts.moments,
            );
            let place = |c: ChunkNo| match (ChunkPlan::group_of(c) as usize) < k {
                true => Target::Device,
                false => Target::Host,
            };
            trace.place_optimizer(place);
            for (stage, acc, _) in &mut iter {
                if *stage == Stage::Optimizer {
                    acc.iter_mut().for_each(|a| a.target = place(a.chunk));
                }
            }
            device_adam_groups = k;
            sched.install_trace(trace);
        } else {
            steady = d;
        }
    }
    let trace: Trace = sched.trace().cloned().unwrap_or_default();
    let bound = lower_bound(&trace, &plan.chunks, &cfg)?;
    let min_budget = (0..trace.len())
        .map(|m| sched.budget_at(m))
        .min()
        .unwrap_or(0);
    let (first_early, overlap_host_bytes) = opts.overlap.early_groups(
        &plan.layout.group_elems,
        opts.moments,
        device_adam_groups + opts.overlap_tail,
        opts.param_bytes as usize,
        host_mem,
        plan.total_bytes(),
    );
    let report = SimReport {
        policy: policy.name(),
        warmup,
        steady,
        bound,
        chunk_elems,
        groups: plan.layout.groups(),
        model_data_bytes: plan.total_bytes(),
        param_chunk_bytes: plan.kind_bytes(ChunkKind::Param),
        file_bytes,
        peak_non_model: trace.peak_non_model(),
        min_budget,
        device_peak: sched.device_peak(),
        moments: trace.len(),
        device_adam_groups,
        overlap_host_bytes,
    };
    let recorded = Recorded {
        ranks,
        chunks: plan.chunks.clone(),
        file,
        group_elems: plan.layout.group_elems.clone(),
        moments,
        first_early,
    };
    Ok((report, recorded))
}

/// The most layers of a model `spec_of(layers)` gives whose model data and the overlapped
/// step's host memory ([`SimOptions::overlap`]) fit in host memory (plus `file_mem` on the
/// file tier) and whose every moment fits on the device under
/// `policy` (ZeRO ranks as `opts` says: one rank's share against its share of the host), by a
/// doubling then a bisection over the layer count; with its report, or `None` if not even one
/// layer fits.
pub fn largest_fitting(
    spec_of: impl Fn(usize) -> Result<ModelSpec>,
    policy: Policy,
    opts: &SimOptions,
    file_mem: u64,
) -> Result<Option<(usize, SimReport)>> {
    let fits = |layers: usize| -> Result<Option<SimReport>> {
        let spec = spec_of(layers)?;
        let mut o = opts.clone();
        o.iterations = 1;
        // (one rank's share, against its share of the host)
        let ranks = opts.ranks.max(1) as u64;
        let local = shard(&spec, ranks as usize, o.param_bytes)?;
        let chunk_elems = chunk_size_for(&local, &o)?;
        o.chunk_elems = Some(chunk_elems);
        let plan = ChunkPlan::with_moments(&local.numels(), chunk_elems, o.param_bytes, o.moments)?;
        if plan.total_bytes() > (opts.host_mem + file_mem) / ranks {
            return Ok(None);
        }
        o.host_mem = opts.host_mem;
        match simulate(&spec, policy, &o) {
            Ok(r)
                if r.model_data_bytes + r.overlap_host_bytes
                    > (opts.host_mem + file_mem) / ranks =>
            {
                Ok(None)
            }
            Ok(r) => Ok(Some(r)),
            Err(Error::BudgetExceeded { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    };
    let mut lo = 0usize; // fits (0 = sentinel)
    let mut best = None;
    let mut hi = 1usize;
    // grow until it does not fit
    while let Some(r) = fits(hi)? {
        lo = hi;
        best = Some(r);
        if hi >= 1 << 16 {
            break;
        }
        hi *= 2;
    }
    if lo == 0 {
        return Ok(None);
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        match fits(mid)? {
            Some(r) => {
                lo = mid;
                best = Some(r);
            }
            None => hi = mid,
        }
    }
    Ok(best.map(|r| (lo, r)))
}
