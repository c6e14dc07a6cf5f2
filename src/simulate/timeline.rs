//! How long a step takes: the simulator's moves and moments on a timeline of resources with
//! rates.
//!
//! [`timeline`] replays the last steady iteration of [`simulate`](super::simulate) (the same
//! scheduler decisions, moment by moment) three times back to back on five resources: the
//! device's compute, the link each way, the host's optimizer and the file tier. Each resource
//! runs one thing at a time, in the order the manager issues them; a thing starts once its
//! resource is free and its inputs are ready:
//!
//! * a **load** after the chunk's host copy is current (its write-back done, its host step done,
//!   its file read done) and after the memory the moment's evictions free;
//! * a **write-back** after the last compute that used the chunk;
//! * an op's **compute** after the loads of the chunks it reads, for its FLOPs at
//!   [`Rates::compute`]; a device optimizer group for its elements at [`Rates::device_adam`];
//! * a **host optimizer group** after its gradients are down, for its elements at
//!   [`Rates::host_stats`] (the gradient statistics' pass) then [`Rates::host_adam`]: under [`StepSchedule::Serial`] only once the whole backward has run (the
//!   global norm and the overflow flag decide the step), and the training thread, which steps
//!   it once the next group's moves are issued, issues nothing more until it is done; under
//!   [`StepSchedule::Overlapped`] on worker threads
//!   as soon as its own gradients are final (its optimizer moment moved to just after the
//!   group's last backward use, as a speculative step validated after backward would run;
//!   under [`SimOverlap::Redone`](super::SimOverlap::Redone) that step is thrown away and the
//!   group steps again after backward), for the groups [`SimOptions::overlap`] steps early (with
//!   shadows, those within the budget; none under a clip that binds,
//!   [`SimOverlap::Clipped`](super::SimOverlap::Clipped)); the others step after backward and
//!   the gradient statistics, on the worker beside the next forward, whose load of a group's
//!   parameters waits for that group's step only. The statistics of a group stepped during
//!   backward are taken ahead of its step: the optimizer pass waits for the last of them, not
//!   for the steps.
//!
//! The step is the third iteration's span; [`StepTime`] gives it with each resource's busy time
//! and the step divided by the busiest resource (1 for a step as long as its slowest resource).
//!
//! ```
//! use tidemem::models::gpt::GptConfig;
//! use tidemem::simulate::{timeline, Rates, StepSchedule, SimOptions};
//! use tidemem::tide::Policy;
//! # fn main() -> tidemem::Result<()> {
//! let model = GptConfig::preset("gpt2").unwrap().spec(8, 1024, true)?;
//! let rates = Rates::profile("h100-pcie5").unwrap();
//! let opts = SimOptions::new(4 << 30, 64 << 30);
//! let serial = timeline(&model, Policy::Tide, &opts, &rates, StepSchedule::Serial)?;
//! let overlapped = timeline(&model, Policy::Tide, &opts, &rates, StepSchedule::Overlapped)?;
//! assert!(overlapped.step <= serial.step);
//! assert!(serial.over_slowest() >= 1.0);
//! # Ok(()) }
//! ```

use serde::Serialize;

use super::{moment_flops, run, ModelSpec, MomentMoves, Recorded, SimOptions, SimOverlap};
use crate::chunk::{ChunkKind, MomentStorage};
use crate::error::{Error, Result};
use crate::tensor::Stage;
use crate::tide::{Access, Move, Policy, Target};

/// The rates of the resources a step uses.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rates {
    /// Where the figures come from.
    pub name: String,
    /// Device FLOP/s the ops achieve.
    pub compute: f64,
    /// Host → device bytes/s.
    pub h2d: f64,
    /// Device → host bytes/s.
    pub d2h: f64,
    /// The host optimizer's elements/s (CPU Adam).
    pub host_adam: f64,
    /// The host's gradient statistics' elements/s (the sum of squares and the finiteness of a
    /// host group's gradients, in the device kernel's order, before its step).
    pub host_stats: f64,
    /// The device optimizer's elements/s.
    pub device_adam: f64,
    /// The host optimizer's elements/s on 8-bit moments (`SimOptions::moments`,
    /// `CpuAdam::step8`).
    pub host_adam8: f64,
    /// The device optimizer's elements/s on 8-bit moments (`ops::adam8`).
    pub device_adam8: f64,
    /// The file tier's bytes/s, each way.
    pub file: f64,
    /// Collective bus bytes/s between ranks (NCCL's bus bandwidth), for ZeRO
    /// ([`SimOptions::ranks`](super::SimOptions::ranks)).
    pub bus: f64,
}

/// Bytes a mixed-precision Adam step reads and writes an element: the 16-bit gradient and
/// parameter, the fp32 master, momentum and variance each read and written.
pub const ADAM_BYTES_PER_ELEMENT: f64 = 28.0;

/// Bytes the step on 8-bit moments reads and writes an element: the 16-bit gradient and
/// parameter, the fp32 master, the two codes (and their scales, 0.03).
pub const ADAM8_BYTES_PER_ELEMENT: f64 = 16.0;

impl Rates {
    /// The named profiles [`Rates::profile`] knows.
    pub const PROFILES: [&'static str; 2] = ["h100-pcie5", "h100-server"];

    /// A named profile:
    ///
    /// * `h100-pcie5`: figures this crate measured on one H100 — the link at 54.9 GB/s each way
    ///   (pinned, 256 MiB), cuBLAS bf16 at 575 TFLOP/s (the low end of 575–868 at GPT-2
    ///   shapes), CUDA Adam at 2.9 TB/s ([`ADAM_BYTES_PER_ELEMENT`] an element) — with the
    ///   host's CPU Adam at 44.1 GB/s (measured on this crate's 2-core CI machine kind; the
    ///   H100 host's was not measured) and its gradient statistics at 2.87 G f16 elements/s
    ///   (measured on the same machine kind, 2 threads: about half a CPU Adam element's time,
    ///   as they sum in f64 in the kernel's order), the file tier at 3 GB/s (assumed: one
    ///   PCIe 4 NVMe drive, not measured) and the collectives' bus at 360 GB/s (assumed:
    ///   NVLink 4 between H100 SXM5s, as NCCL reports for all-gather; not measured).
    /// * `h100-server`: `h100-pcie5` with a server's host: the CPU Adam at 307 GB/s, half the
    ///   614 GB/s peak of the two sockets of 8 DDR5-4800 channels each of a DGX H100 (two Xeon
    ///   Platinum 8480C, 112 cores), assumed and not measured: this crate's Adam moved 44.1 GB/s
    ///   on 2 cores, and a bandwidth-bound step on a server reaches about half of peak; the
    ///   gradient statistics at the same 307 GB/s over 2-byte gradients (at 1.4 G elements/s a
    ///   core measured here, 112 cores would exceed it).
    ///
    /// On 8-bit moments the host's step is bound by its arithmetic, not its bytes: `h100-pcie5`
    /// takes the 0.59 G elements/s measured on the 2-core machine kind (100M elements in 169 ms,
    /// 2 threads); `h100-server` the lower of 112 cores at the 0.33 G elements/s a core measured
    /// here and 307 GB/s over the step's 16 bytes an element (19.2 G elements/s, assumed). The
    /// device's 8-bit step is taken as bound by its 16 bytes an element at the f32 kernel's
    /// 2.9 TB/s (assumed, not measured on a GPU).
    pub fn profile(name: &str) -> Option<Rates> {
        match name {
            "h100-server" => Some(Rates {
                name: name.into(),
                host_adam: 307e9 / ADAM_BYTES_PER_ELEMENT,
                host_stats: 307e9 / 2.0,
                host_adam8: (112.0 * 0.331e9f64).min(307e9 / ADAM8_BYTES_PER_ELEMENT),
                ..Rates::profile("h100-pcie5")?
            }),
            "h100-pcie5" => Some(Rates {
                name: name.into(),
                compute: 575e12,
                h2d: 54.9e9,
                d2h: 54.9e9,
                host_adam: 44.1e9 / ADAM_BYTES_PER_ELEMENT,
                host_stats: 2.87e9,
                device_adam: 2.9e12 / ADAM_BYTES_PER_ELEMENT,
                host_adam8: 0.592e9,
                device_adam8: 2.9e12 / ADAM8_BYTES_PER_ELEMENT,
                file: 3e9,
                bus: 360e9,
            }),
            _ => None,
        }
    }

    /// Checks that every rate is finite and above zero.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("compute", self.compute),
            ("h2d", self.h2d),
            ("d2h", self.d2h),
            ("host_adam", self.host_adam),
            ("host_stats", self.host_stats),
            ("device_adam", self.device_adam),
            ("host_adam8", self.host_adam8),
            ("device_adam8", self.device_adam8),
            ("file", self.file),
            ("bus", self.bus),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::BadValue {
                    what: format!("rate {what}"),
                    value: v,
                    want: "finite and above 0",
                });
            }
        }
        Ok(())
    }
}

/// When the host steps its chunk groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum StepSchedule {
    /// After the whole backward (ZeRO-Offload's and PatrickStar's order).
    Serial,
    /// Each group as soon as its gradients are final, while backward goes on.
    Overlapped,
}

/// A steady step on the timeline: its length and each resource's busy time in it, in seconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTime {
    /// The schedule.
    pub schedule: StepSchedule,
    /// The step.
    pub step: f64,
    /// Device compute (ops and device optimizer groups).
    pub compute: f64,
    /// The host → device link.
    pub h2d: f64,
    /// The device → host link.
    pub d2h: f64,
    /// The host optimizer (its gradient statistics included).
    pub host_adam: f64,
    /// The file tier.
    pub file: f64,
    /// The collectives between ranks (0 for one).
    pub collective: f64,
}

impl StepTime {
    /// The busiest resource and its busy time.
    pub fn slowest(&self) -> (&'static str, f64) {
        [
            ("compute", self.compute),
            ("h2d", self.h2d),
            ("d2h", self.d2h),
            ("host optimizer", self.host_adam),
            ("file", self.file),
            ("collectives", self.collective),
        ]
        .into_iter()
        .fold(("compute", 0.0), |a, b| if b.1 > a.1 { b } else { a })
    }

    /// The step divided by the busiest resource's time (1: the step is as long as its slowest
    /// resource; infinite for a step that keeps nothing busy).
    pub fn over_slowest(&self) -> f64 {
        match self.slowest().1 {
            s if s > 0.0 => self.step / s,
            _ => f64::INFINITY,
        }
    }
}

/// The steady step of `spec` under `policy` and `opts` (as [`simulate`](super::simulate) runs
/// it) at `rates`, on `schedule`.
pub fn timeline(
    spec: &ModelSpec,
    policy: Policy,
    opts: &SimOptions,
    rates: &Rates,
    schedule: StepSchedule,
) -> Result<StepTime> {
    rates.validate()?;
    let (_, rec) = run(spec, policy, opts)?;
    let flops = moment_flops(spec);
    let redone = matches!(opts.overlap, SimOverlap::Redone(_));
    let order = moment_order(&rec, schedule, redone);
    let rates = rates_over(rec.ranks as f64, rates, opts.moments);
    let mut t = Timeline::new(&rec, &rates, schedule, policy.keeps_host_copy());
    let mut ends = [0.0; 3];
    for end in &mut ends {
        t.busy = Busy::default();
        for &(m, turn) in &order {
            if turn == Turn::ThrownAway {
                t.thrown_away(&rec.moments[m]);
                continue;
            }
            t.moment(m, flops.get(m).copied().unwrap_or(0), turn == Turn::Early)?;
        }
        *end = t.end();
    }
    let b = t.busy;
    Ok(StepTime {
        schedule,
        step: ends[2] - ends[1],
        compute: b.compute,
        h2d: b.h2d,
        d2h: b.d2h,
        host_adam: b.host_adam,
        file: b.file,
        collective: b.collective,
    })
}

/// The rates a rank's timeline runs at: the optimizers' on the moments as `moments` holds
/// them, and the host's CPU optimizer and file tier shared by `ranks` ranks (each has its own
/// device and link).
fn rates_over(ranks: f64, rates: &Rates, moments: MomentStorage) -> Rates {
    let (host_adam, device_adam) = match moments {
        MomentStorage::F32 => (rates.host_adam, rates.device_adam),
        MomentStorage::Int8 => (rates.host_adam8, rates.device_adam8),
    };
    Rates {
        host_adam: host_adam / ranks,
        device_adam,
        host_stats: rates.host_stats / ranks,
        file: rates.file / ranks,
        ..rates.clone()
    }
}

/// When a moment runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Turn {
    /// Where it was recorded.
    Recorded,
    /// A host group's step, moved to just after its last gradient.
    Early,
    /// A host group's step during backward that the optimizer's pass throws away (the
    /// recorded one steps it again).
    ThrownAway,
}

/// The order the manager runs the moments in, each with its [`Turn`]: as recorded, or with
/// each host group's optimizer moment moved to just after the backward moment that writes its
/// parameter chunk's last gradient; where the early steps are `redone`, each also runs where
/// it was recorded, its early turn thrown away.
fn moment_order(rec: &Recorded, schedule: StepSchedule, redone: bool) -> Vec<(usize, Turn)> {
    let n = rec.moments.len();
    if schedule == StepSchedule::Serial {
        return (0..n).map(|i| (i, Turn::Recorded)).collect();
    }
    let is_param = |c: u32| rec.chunks[c as usize].kind == ChunkKind::Param;
    let host_step = |m: &MomentMoves| {
        m.stage == Stage::Optimizer
            && m.accesses
                .iter()
                .any(|a| a.target == Target::Host && is_param(a.chunk))
    };
    let last_write = last_writes(rec);
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut order = Vec::with_capacity(n);
    let mut moved = vec![false; n];
    for (i, m) in rec.moments.iter().enumerate() {
        if host_step(m) {
            let param = m
                .accesses
                .iter()
                .find(|a| is_param(a.chunk))
                .map(|a| a.chunk as usize);
            // (the groups the overlap's budget leaves out step after backward)
            let early = param.is_some_and(|c| rec.chunks[c].group as usize >= rec.first_early);
            if let Some(w) = param.filter(|_| early).and_then(|c| last_write[c]) {
                after[w].push(i);
                moved[i] = !redone;
            }
        }
    }
    let early = match redone {
        true => Turn::ThrownAway,
        false => Turn::Early,
    };
    for i in 0..n {
        if moved[i] {
            continue;
        }
        order.push((i, Turn::Recorded));
        order.extend(after[i].iter().map(|&j| (j, early)));
    }
    order
}

/// The backward moment writing each chunk's last gradient.
fn last_writes(rec: &Recorded) -> Vec<Option<usize>> {
    let mut last = vec![None; rec.chunks.len()];
    for (i, m) in rec.moments.iter().enumerate() {
        if m.stage == Stage::Backward {
            for a in m.accesses.iter().filter(|a| a.write) {
                last[a.chunk as usize] = Some(i);
            }
        }
    }
    last
}

/// Busy seconds per resource.
#[derive(Clone, Copy, Debug, Default)]
struct Busy {
    compute: f64,
    h2d: f64,
    d2h: f64,
    host_adam: f64,
    file: f64,
    collective: f64,
}

/// Resource clocks and chunk readiness.
struct Timeline<'a> {
    rec: &'a Recorded,
    rates: &'a Rates,
    schedule: StepSchedule,
    /// When each resource is next free.
    compute: f64,
    h2d: f64,
    d2h: f64,
    host: f64,
    file: f64,
    /// The collectives' bus between ranks.
    bus: f64,
    /// The stage each parameter chunk was last gathered in (gathered once a stage).
    gathered: Vec<Option<Stage>>,
    /// The backward moment writing each chunk's last gradient (its reduce-scatter).
    last_write: Vec<Option<usize>>,
    /// When each chunk's device copy is loaded.
    ready: Vec<f64>,
    /// When the last compute using each chunk ends.
    last_use: Vec<f64>,
    /// When each chunk's host copy is current.
    host_ok: Vec<f64>,
    /// When the backward in progress (or last run) ended: the serial host step's barrier.
    backward_end: f64,
    /// Whether a chunk on the device keeps its host copy (the policy), so that a host group
    /// stepped during backward can upload its parameters into it and keep it there.
    keeps_host: bool,
    /// Chunks whose parameters went up from a host step during backward: their next load is
    /// that upload.
    uploaded: Vec<bool>,
    /// Serial: when the host thread, which steps its groups itself, issues the next work.
    issue: f64,
    /// When the statistics of the last host group stepped during backward are taken.
    stats_at: f64,
    /// The stage of the moment before.
    last: Option<Stage>,
    in_backward: bool,
    busy: Busy,
}

impl<'a> Timeline<'a> {
    fn new(rec: &'a Recorded, rates: &'a Rates, schedule: StepSchedule, keeps_host: bool) -> Self {
        let n = rec.chunks.len();
        Timeline {
            rec,
            rates,
            schedule,
            compute: 0.0,
            h2d: 0.0,
            d2h: 0.0,
            host: 0.0,
            file: 0.0,
            bus: 0.0,
            gathered: vec![None; n],
            last_write: last_writes(rec),
            ready: vec![0.0; n],
            last_use: vec![0.0; n],
            host_ok: vec![0.0; n],
            backward_end: 0.0,
            keeps_host,
            uploaded: vec![false; n],
            issue: 0.0,
            stats_at: 0.0,
            last: None,
            in_backward: false,
            busy: Busy::default(),
        }
    }

    fn end(&self) -> f64 {
        [
            self.compute,
            self.h2d,
            self.d2h,
            self.host,
            self.file,
            self.bus,
        ]
        .into_iter()
        .fold(0.0, f64::max)
    }

    fn bytes(&self, c: u32) -> f64 {
        self.rec.chunks[c as usize].bytes as f64
    }

    fn moment(&mut self, i: usize, flops: u64, moved: bool) -> Result<()> {
        let rec = self.rec;
        let m = &rec.moments[i];
        if !moved {
            if self.last == Some(Stage::Optimizer)
                && m.stage == Stage::Forward
                && self.schedule == StepSchedule::Serial
            {
                // the last host group steps before the next iteration is issued (overlapped,
                // the next forward's loads wait for their own groups' steps)
                self.issue = self.issue.max(self.host);
            }
            self.last = Some(m.stage);
            match (m.stage, self.in_backward) {
                (Stage::Backward, false) => self.in_backward = true,
                (Stage::Optimizer, true) => {
                    self.in_backward = false;
                    self.backward_end = self.compute;
                    // the optimizer pass starts once the gradient statistics are read: after
                    // backward, and after the statistics of every host group stepped during it
                    // (each taken ahead of its step, which goes on beside the pass and the next
                    // forward)
                    self.issue = self.issue.max(self.backward_end);
                    if self.schedule == StepSchedule::Overlapped {
                        self.issue = self.issue.max(self.stats_at);
                    }
                }
                (Stage::Forward, true) => self.in_backward = false,
                _ => {}
            }
        }
        // the moment's evictions free memory its loads go into
        let mut freed = 0.0f64;
        for mv in &m.moves {
            match *mv {
                Move::WriteBack { chunk } => {
                    let c = chunk as usize;
                    let bytes = self.bytes(chunk);
                    let start = self.d2h.max(self.last_use[c]).max(self.issue);
                    let dt = bytes / self.rates.d2h;
                    self.d2h = start + dt;
                    self.busy.d2h += dt;
                    self.host_ok[c] = self.d2h;
                    if self.rec.file[c] {
                        let dt = bytes / self.rates.file;
                        self.file = self.file.max(self.d2h) + dt;
                        self.busy.file += dt;
                        self.host_ok[c] = self.file;
                    }
                    freed = freed.max(self.d2h);
                }
                Move::Drop { chunk } => freed = freed.max(self.last_use[chunk as usize]),
                Move::Load { chunk, .. } if self.uploaded[chunk as usize] => {
                    // it went up when its group stepped
                    self.uploaded[chunk as usize] = false;
                }
                Move::Load { chunk, .. } => {
                    let c = chunk as usize;
                    let bytes = self.bytes(chunk);
                    let mut src = self.host_ok[c];
                    if self.rec.file[c] {
                        let dt = bytes / self.rates.file;
                        self.file = self.file.max(src) + dt;
                        self.busy.file += dt;
                        src = self.file;
                    }
                    let dt = bytes / self.rates.h2d;
                    self.h2d = self.h2d.max(src).max(freed).max(self.issue) + dt;
                    self.busy.h2d += dt;
                    self.ready[c] = self.h2d;
                }
                Move::Materialize { .. } | Move::FreeHost { .. } => {}
            }
        }
        let on_device = m.accesses.iter().filter(|a| a.target == Target::Device);
        let inputs = on_device
            .map(|a| self.ready[a.chunk as usize])
            .fold(self.issue, f64::max);
        match m.stage {
            Stage::Forward | Stage::Backward => {
                let inputs = self.gather(m, inputs);
                let dt = flops as f64 / self.rates.compute;
                self.compute = self.compute.max(inputs) + dt;
                self.busy.compute += dt;
                for a in &m.accesses {
                    self.last_use[a.chunk as usize] = self.compute;
                }
                self.reduce_scatter(m, i);
            }
            Stage::Optimizer => self.optimizer(m, inputs, moved)?,
        }
        Ok(())
    }

    /// ZeRO: the parameters of the moment's chunks gathered from every rank (once a stage),
    /// after the local shard is loaded; returns when the op's inputs are ready.
    fn gather(&mut self, m: &MomentMoves, inputs: f64) -> f64 {
        if self.rec.ranks < 2 {
            return inputs;
        }
        let mut ready = inputs;
        for a in m.accesses.iter().filter(|a| a.target == Target::Device) {
            let c = a.chunk as usize;
            if self.rec.chunks[c].kind != ChunkKind::Param || self.gathered[c] == Some(m.stage) {
                continue;
            }
            self.gathered[c] = Some(m.stage);
            let dt = self.collective_time(a.chunk);
            self.bus = self.bus.max(self.ready[c]).max(self.issue) + dt;
            self.busy.collective += dt;
            ready = ready.max(self.bus);
        }
        ready
    }

    /// ZeRO: the gradients of the chunks whose last gradient moment `i` is reduce-scattered to
    /// their owners after the op; the chunk's later moves wait for it.
    fn reduce_scatter(&mut self, m: &MomentMoves, i: usize) {
        if self.rec.ranks < 2 || m.stage != Stage::Backward {
            return;
        }
        for a in &m.accesses {
            let c = a.chunk as usize;
            if self.last_write[c] == Some(i) {
                let dt = self.collective_time(a.chunk);
                self.bus = self.bus.max(self.compute) + dt;
                self.busy.collective += dt;
                self.last_use[c] = self.bus;
            }
        }
    }

    /// A ring's time for a collective over chunk `c`'s shards: `ranks − 1` shards each way.
    fn collective_time(&self, c: u32) -> f64 {
        (self.rec.ranks - 1) as f64 * self.bytes(c) / self.rates.bus
    }

    /// A host group's early step that the optimizer's pass throws away: its statistics and
    /// its step on the host once its gradients are down, with no other effect (its shadows are
    /// dropped and the originals it never touched step again at the pass).
    fn thrown_away(&mut self, m: &MomentMoves) {
        let kind = |a: &&Access| self.rec.chunks[a.chunk as usize].kind;
        let Some(param) = m.accesses.iter().find(|a| kind(a) == ChunkKind::Param) else {
            return;
        };
        let group = self.rec.chunks[param.chunk as usize].group as usize;
        let elems = self.rec.group_elems.get(group).copied().unwrap_or(0) as f64;
        let start = m.accesses.iter().map(|a| self.host_ok[a.chunk as usize]);
        let start = start.fold(self.host, f64::max);
        let stats = elems / self.rates.host_stats;
        let dt = stats + elems / self.rates.host_adam;
        self.stats_at = start + stats;
        self.host = start + dt;
        self.busy.host_adam += dt;
    }

    fn optimizer(&mut self, m: &MomentMoves, inputs: f64, moved: bool) -> Result<()> {
        let param = m
            .accesses
            .iter()
            .find(|a| self.rec.chunks[a.chunk as usize].kind == ChunkKind::Param)
            .ok_or_else(|| Error::Internal {
                what: "an optimizer moment without its group".into(),
            })?;
        let group = self.rec.chunks[param.chunk as usize].group as usize;
        let elems = self.rec.group_elems.get(group).copied().unwrap_or(0) as f64;
        if param.target == Target::Device {
            let dt = elems / self.rates.device_adam;
            self.compute = self.compute.max(inputs) + dt;
            self.busy.compute += dt;
            for a in &m.accesses {
                self.last_use[a.chunk as usize] = self.compute;
            }
            return Ok(());
        }
        // the gradients and the optimizer state on the host: what lives on the file tier is
        // read in first (as soon as the file is free: ahead of the step) and written after it
        let mut start = self.host;
        for a in &m.accesses {
            let c = a.chunk as usize;
            let mut at = self.host_ok[c];
            if self.rec.file[c] {
                let dt = self.bytes(a.chunk) / self.rates.file;
                self.file = self.file.max(at) + dt;
                self.busy.file += dt;
                at = self.file;
            }
            start = start.max(at);
        }
        if self.schedule == StepSchedule::Serial || !moved {
            // after the gradient statistics of the whole backward
            start = start.max(self.backward_end).max(self.issue);
        }
        // the step, and before it the gradient statistics' pass over the group's gradients
        let stats = elems / self.rates.host_stats;
        let dt = stats + elems / self.rates.host_adam;
        if moved {
            self.stats_at = start + stats;
        }
        let previous = self.host;
        self.host = start + dt;
        self.busy.host_adam += dt;
        if self.schedule == StepSchedule::Serial {
            // the host thread steps each group itself, once the next group's moves are issued:
            // those wait for the step before this one
            self.issue = previous;
        }
        let evicted = |c: u32| {
            m.moves.iter().any(
                |mv| matches!(*mv, Move::WriteBack { chunk } | Move::Drop { chunk } if chunk == c),
            )
        };
        if moved && self.keeps_host && evicted(param.chunk) {
            // stepped during backward with its parameter chunk still on the device: the new
            // parameters go up into it at once, and it stays there for the next forward
            let c = param.chunk as usize;
            let dt = self.bytes(param.chunk) / self.rates.h2d;
            self.h2d = self.h2d.max(self.host) + dt;
            self.busy.h2d += dt;
            self.ready[c] = self.h2d;
            self.uploaded[c] = true;
        }
        for a in &m.accesses {
            // the host copies are the new values (the device copies are stale)
            let c = a.chunk as usize;
            self.host_ok[c] = self.host;
            if self.rec.file[c] {
                let dt = self.bytes(a.chunk) / self.rates.file;
                self.file = self.file.max(self.host) + dt;
                self.busy.file += dt;
                self.host_ok[c] = self.file;
            }
        }
        Ok(())
    }
}
