//! The settings and reports of [`HybridAdam`](super::HybridAdam): where groups step, the
//! overlap's shadow budget, the optimizer's configuration, and what a step did.

use serde::Serialize;

use crate::chunk::{overlap_group_bytes, MomentStorage};
use crate::optim::adam::AdamConfig;
use crate::optim::scaler::{ScaleUpdate, ScalerConfig};
use crate::optim::Isa;
use crate::tide::SchedulerConfig;

#[cfg(doc)]
use super::HybridAdam;
#[cfg(doc)]
use crate::error::Error;

/// How many chunk groups step on the device.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum DevicePlacement {
    /// Every group on the host.
    HostOnly,
    /// The first `n` groups on the device.
    Groups(usize),
    /// From the device margin (see the module docs), scaled by `fraction` (PatrickStar: 0.8).
    Auto {
        /// Share of the margin used.
        fraction: f64,
    },
}

impl DevicePlacement {
    /// How many chunk groups (of `group_elems` elements each, in order) step on the device
    /// under scheduler settings `sc`, with `non_model_peak` bytes of non-model data at the
    /// tightest moment and `param_footprint` bytes of parameter chunks: for
    /// [`DevicePlacement::Auto`], the groups in order while their fp32 master, momentum and
    /// variance (12 bytes per element, 6.03 with 8-bit moments) fit in `fraction` of the margin
    /// `capacity · overall_fraction − reserve − non_model_peak − param_footprint`.
    pub(crate) fn groups(
        &self,
        sc: &SchedulerConfig,
        non_model_peak: u64,
        param_footprint: u64,
        group_elems: &[usize],
        moments: MomentStorage,
    ) -> usize {
        match *self {
            DevicePlacement::HostOnly => 0,
            DevicePlacement::Groups(n) => n.min(group_elems.len()),
            DevicePlacement::Auto { fraction } => {
                let share =
                    ((sc.capacity as f64 * sc.overall_fraction) as u64).saturating_sub(sc.reserve);
                let margin = share
                    .saturating_sub(non_model_peak)
                    .saturating_sub(param_footprint);
                // a tensor larger than a chunk makes a larger group
                let mut room = (margin as f64 * fraction) as u64;
                let mut k = 0;
                for &elems in group_elems {
                    // the fp32 master and the two moments
                    let need = 4 * elems as u64 + 2 * moments.bytes(elems);
                    if need > room {
                        break;
                    }
                    room -= need;
                    k += 1;
                }
                k
            }
        }
    }
}

/// Host bytes the overlapped step may hold for the shadows of the groups it steps early where
/// a step can be invalidated (a loss scaler or a clip): the shadows of the last host groups
/// in order (the first whose gradients are final in backward) while they fit; the rest step
/// after backward. Where nothing can invalidate a step, the groups step in place and no budget
/// applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ShadowBudget {
    /// Half of what the host holds beside the model data:
    /// `(host memory − model data) / 2`, with host memory as
    /// [`limits::host_memory`](crate::limits::host_memory) reads it (no limit where it
    /// cannot be read).
    Auto,
    /// At most this many bytes (0: every host group steps after backward).
    Bytes(u64),
}

impl ShadowBudget {
    /// The budget in bytes beside `model_data` bytes of model data on a host of `host`
    /// bytes (`None`: unknown).
    pub(crate) fn bytes(&self, host: Option<u64>, model_data: u64) -> u64 {
        match *self {
            ShadowBudget::Bytes(n) => n,
            ShadowBudget::Auto => host.map_or(u64::MAX, |h| h.saturating_sub(model_data) / 2),
        }
    }

    /// The first of the host groups `first_host..` (of `group_elems` elements of
    /// `param_bytes` bytes each, the moments held as `moments` says) stepped early under this
    /// budget: from the last group down while their overlap bytes ([`overlap_group_bytes`],
    /// shadowed) fit in `budget` bytes.
    pub(crate) fn first_early(
        budget: u64,
        first_host: usize,
        group_elems: &[usize],
        param_bytes: usize,
        moments: MomentStorage,
    ) -> usize {
        let mut used = 0u64;
        let mut first = group_elems.len();
        while first > first_host {
            used += overlap_group_bytes(group_elems[first - 1], param_bytes, moments, true);
            if used > budget {
                break;
            }
            first -= 1;
        }
        first
    }
}

/// Settings of a [`HybridAdam`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HybridConfig {
    /// Adam / AdamW settings.
    pub adam: AdamConfig,
    /// Threads of the CPU kernel (0: one per core).
    pub threads: usize,
    /// Instruction-set path of the CPU kernel (`None`: the fastest this CPU runs).
    pub isa: Option<Isa>,
    /// Which groups step on the device.
    pub placement: DevicePlacement,
    /// Dynamic loss scaling, which skips a step whose gradients overflow (`None`: a scale of
    /// 1, and an infinite or NaN gradient stops the run with
    /// [`Error::NonFiniteGradients`]).
    pub loss_scale: Option<ScalerConfig>,
    /// Clip gradients to this global L2 norm.
    pub max_grad_norm: Option<f32>,
    /// Micro-batches per step (≥ 1).
    pub accumulation_steps: u32,
    /// PipeDream-2BW's second weight version: each step writes the parameters the model
    /// computes with from the fp32 masters as they were *before* the step's update, so the
    /// next step's gradient is taken at `W(t−1)` while the masters hold `W(t)`:
    /// `W(t+1) = W(t) − Adam(∇f(W(t−1)))`. The masters are the second set of chunks. An
    /// overflow's skipped step restores the parameters from the masters (the lag restarts).
    /// Refused with `accumulation_steps > 1`, whose restores between micro-batches would end
    /// the lag.
    pub delayed_params: bool,
    /// Step host groups during backward, as soon as each group's gradients are final, on a
    /// worker thread (see "Overlap" in the module docs). Bitwise the serial step. Where nothing
    /// can invalidate a step (no loss scaler, no clip) the groups step in place, at no memory
    /// cost; otherwise on shadows, a second copy of the group's optimizer state and two
    /// parameter-sized buffers a group (12 + 2 × parameter bytes an element; 6.03 + 2 × with 8-bit moments) within `overlap_budget` (on
    /// the file tier when chunks spill there). With accumulation, the micro-batches but the
    /// last fold during backward instead. Not with delayed parameters.
    pub overlap: bool,
    /// The host bytes of the overlap's shadows.
    pub overlap_budget: ShadowBudget,
    /// Host groups that step after backward, beside the next forward, rather than during it:
    /// the first `overlap_tail` host groups in order (the first layers: the last whose
    /// gradients are final, the first the next forward needs). Where the host's Adam is the
    /// slowest resource, stepping them first after backward lets the next forward start while
    /// the rest step; `examples/simulate --overlap-tail best` finds the count whose step is
    /// the shortest. 0 by default.
    pub overlap_tail: usize,
}

impl HybridConfig {
    /// `adam` with automatic placement (fraction 0.8), no loss scaling, no clipping, no
    /// accumulation.
    pub fn new(adam: AdamConfig) -> Self {
        HybridConfig {
            adam,
            threads: 0,
            isa: None,
            placement: DevicePlacement::Auto { fraction: 0.8 },
            loss_scale: None,
            max_grad_norm: None,
            accumulation_steps: 1,
            delayed_params: false,
            overlap: true,
            overlap_budget: ShadowBudget::Auto,
            overlap_tail: 0,
        }
    }
}

/// What [`HybridAdam::step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum StepOutcome {
    /// The parameters were updated.
    Stepped,
    /// Gradients were folded into the accumulators (not the last micro-batch).
    Accumulated,
    /// A gradient overflowed: nothing was updated and the parameters were restored.
    Skipped,
}

/// The report of one [`HybridAdam::step`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepReport {
    /// What happened.
    pub outcome: StepOutcome,
    /// Optimizer steps taken so far.
    pub steps: u64,
    /// The loss scale the gradients were computed under.
    pub loss_scale: f32,
    /// Global L2 norm of the (unscaled, averaged) gradients before clipping; 0 for an
    /// accumulated micro-batch, not finite on an overflow.
    pub grad_norm: f64,
    /// Clipping coefficient applied (1 without clipping).
    pub clip_coef: f32,
    /// Chunk groups stepped on the device.
    pub device_groups: usize,
    /// What the loss scaler did (`None` without one, or for an accumulated micro-batch).
    pub scale_update: Option<ScaleUpdate>,
}
