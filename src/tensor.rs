//! Stateful tensors: the state machine every managed tensor runs.
//!
//! Each parameter tensor has a [`TensorState`] per chunk list ([`ChunkKind`]) it lives in (fp16
//! parameter/gradient, fp32 master, momentum, variance). Training events ([`TrainEvent`]) move it
//! along the edges of one table, [`TRANSITIONS`], which reads like the state diagram of the
//! PatrickStar paper:
//!
//! ```text
//!            BeforeFwdOp                AfterFwdOp                 EndForward
//!   FREE ───────────────► COMPUTE ───────────────► HOLD_AFTER_FWD ───────────► HOLD
//!     │  (zero-fill or      ▲ │                          │ BeforeFwdOp (shared)    │
//!     │   initializer)      │ └──────────────◄───────────┘                         │
//!     │                     │ BeforeBwdOp                                          │
//!     │                     └───────────────────────────────◄──────────────────────┘
//!     │                 COMPUTE ── AfterBwdOp (uses left) ──► HOLD
//!     │                 COMPUTE ── AfterLastBwdOp ──────────► HOLD_AFTER_BWD  (gradient in the fp16 slot)
//!     │                 HOLD_AFTER_BWD ── EndStep ───────────► HOLD           (optimizer wrote the param)
//!     └── BeforeOptim ─► COMPUTE ── AfterOptim ─► HOLD                       (fp32 / momentum / variance)
//! ```
//!
//! Anything not in the table is an [`Error::IllegalTransition`](crate::Error::IllegalTransition)
//! naming the tensor, its state and the event: unlike systems that silently ignore an unknown edge,
//! a wrong call sequence is reported where it happens.
//!
//! ```
//! use tidemem::tensor::{TensorState, TrainEvent, next_state};
//! assert_eq!(next_state(TensorState::Free, TrainEvent::BeforeFwdOp), Some(TensorState::Compute));
//! assert_eq!(next_state(TensorState::HoldAfterFwd, TrainEvent::EndForward), Some(TensorState::Hold));
//! assert_eq!(next_state(TensorState::Free, TrainEvent::AfterBwdOp), None);
//! ```

use std::fmt;
use std::sync::Arc;

use crate::rng::{splitmix64, unit_f32};

/// The state of one tensor in one chunk list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum TensorState {
    /// No payload: the memory may be reused. Leaving FREE zero-fills or runs the initializer.
    Free,
    /// In use by an op: the chunk holding it must not move.
    Compute,
    /// Holds data that must be kept; may move.
    Hold,
    /// Used in the current forward pass and released; may move.
    HoldAfterFwd,
    /// Its gradient has been written (after its last backward use); may move.
    HoldAfterBwd,
}

impl TensorState {
    /// Upper-case name as in the paper (`HOLD_AFTER_FWD`).
    pub fn name(self) -> &'static str {
        match self {
            TensorState::Free => "FREE",
            TensorState::Compute => "COMPUTE",
            TensorState::Hold => "HOLD",
            TensorState::HoldAfterFwd => "HOLD_AFTER_FWD",
            TensorState::HoldAfterBwd => "HOLD_AFTER_BWD",
        }
    }

    /// Priority used to derive a chunk's state from its tensors: the chunk takes the state of
    /// highest priority among its tensors (COMPUTE > HOLD > HOLD_AFTER_FWD > HOLD_AFTER_BWD > FREE).
    pub(crate) fn priority(self) -> u8 {
        match self {
            TensorState::Compute => 4,
            TensorState::Hold => 3,
            TensorState::HoldAfterFwd => 2,
            TensorState::HoldAfterBwd => 1,
            TensorState::Free => 0,
        }
    }

    /// All states.
    pub const ALL: [TensorState; 5] = [
        TensorState::Free,
        TensorState::Compute,
        TensorState::Hold,
        TensorState::HoldAfterFwd,
        TensorState::HoldAfterBwd,
    ];
}

impl fmt::Display for TensorState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A training event that moves a tensor's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum TrainEvent {
    /// An op of the forward pass is about to use the tensor.
    BeforeFwdOp,
    /// That op finished.
    AfterFwdOp,
    /// The forward pass ended (guards recomputation under activation checkpointing).
    EndForward,
    /// An op of the backward pass is about to use the tensor.
    BeforeBwdOp,
    /// A backward op finished and the tensor still has backward uses left (shared parameter).
    AfterBwdOp,
    /// The tensor's last backward use finished: its gradient is in its fp16 slot.
    AfterLastBwdOp,
    /// The optimizer is about to update the tensor (fp32 master, momentum, variance).
    BeforeOptim,
    /// The optimizer finished with it.
    AfterOptim,
    /// The step ended: parameters rewritten by the optimizer hold data again.
    EndStep,
    /// The payload is dropped (a released remote shard): back to FREE.
    Release,
}

impl TrainEvent {
    /// Name of the event.
    pub fn name(self) -> &'static str {
        match self {
            TrainEvent::BeforeFwdOp => "before-forward-op",
            TrainEvent::AfterFwdOp => "after-forward-op",
            TrainEvent::EndForward => "end-forward",
            TrainEvent::BeforeBwdOp => "before-backward-op",
            TrainEvent::AfterBwdOp => "after-backward-op",
            TrainEvent::AfterLastBwdOp => "after-last-backward-op",
            TrainEvent::BeforeOptim => "before-optimizer",
            TrainEvent::AfterOptim => "after-optimizer",
            TrainEvent::EndStep => "end-step",
            TrainEvent::Release => "release",
        }
    }
}

impl fmt::Display for TrainEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

use TensorState as S;
use TrainEvent as E;

/// Every legal edge: `(from, event, to)`. Anything else is illegal.
pub const TRANSITIONS: &[(TensorState, TrainEvent, TensorState)] = &[
    // forward
    (S::Free, E::BeforeFwdOp, S::Compute),
    (S::Hold, E::BeforeFwdOp, S::Compute),
    (S::HoldAfterFwd, E::BeforeFwdOp, S::Compute), // shared parameter, second forward use
    (S::HoldAfterBwd, E::BeforeFwdOp, S::Compute), // forward without an optimizer step
    (S::Compute, E::AfterFwdOp, S::HoldAfterFwd),
    // end of forward: everything used goes back to HOLD, unused tensors keep their state
    (S::HoldAfterFwd, E::EndForward, S::Hold),
    (S::Hold, E::EndForward, S::Hold),
    (S::Free, E::EndForward, S::Free),
    (S::HoldAfterBwd, E::EndForward, S::HoldAfterBwd),
    // backward
    (S::Hold, E::BeforeBwdOp, S::Compute),
    (S::Compute, E::AfterBwdOp, S::Hold),
    (S::Compute, E::AfterLastBwdOp, S::HoldAfterBwd),
    // optimizer (fp32 master, momentum, variance)
    (S::Free, E::BeforeOptim, S::Compute),
    (S::Hold, E::BeforeOptim, S::Compute),
    (S::Compute, E::AfterOptim, S::Hold),
    // end of step: parameters rewritten from their masters
    (S::HoldAfterBwd, E::EndStep, S::Hold),
    (S::Hold, E::EndStep, S::Hold),
    (S::Free, E::EndStep, S::Free),
    // dropping a payload
    (S::Hold, E::Release, S::Free),
    (S::HoldAfterFwd, E::Release, S::Free),
    (S::HoldAfterBwd, E::Release, S::Free),
    (S::Free, E::Release, S::Free),
];

/// The state `event` leads to from `state`, or `None` if the edge is illegal.
pub fn next_state(state: TensorState, event: TrainEvent) -> Option<TensorState> {
    TRANSITIONS
        .iter()
        .find(|(from, ev, _)| *from == state && *ev == event)
        .map(|&(_, _, to)| to)
}

/// The four chunk lists. Chunk `i` of every list holds the same tensors at the same offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum ChunkKind {
    /// fp16/bf16 parameters; after a tensor's last backward use its gradient replaces it.
    Param,
    /// fp32 master parameters.
    Master,
    /// Adam first moment (fp32).
    Momentum,
    /// Adam second moment (fp32).
    Variance,
}

impl ChunkKind {
    /// All kinds, in list order.
    pub const ALL: [ChunkKind; 4] = [
        ChunkKind::Param,
        ChunkKind::Master,
        ChunkKind::Momentum,
        ChunkKind::Variance,
    ];

    /// Position in [`ChunkKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Short name (`param`, `master`, `momentum`, `variance`).
    pub fn name(self) -> &'static str {
        match self {
            ChunkKind::Param => "param",
            ChunkKind::Master => "master",
            ChunkKind::Momentum => "momentum",
            ChunkKind::Variance => "variance",
        }
    }

    /// Order in which chunks leave host memory for the file tier when host memory is short:
    /// optimizer state first, parameters last.
    pub(crate) fn spill_rank(self) -> u8 {
        match self {
            ChunkKind::Variance => 0,
            ChunkKind::Momentum => 1,
            ChunkKind::Master => 2,
            ChunkKind::Param => 3,
        }
    }
}

/// Identifier of a registered parameter tensor (dense, in registration order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct TensorId(pub u32);

impl TensorId {
    /// Index into per-tensor tables.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// How a parameter gets its values when it first leaves FREE.
///
/// Every initializer is a pure function of the element index (and a seed), so the fp16 payload and
/// the fp32 master of a tensor can be filled independently and agree, and a run is reproducible
/// whatever the placement.
#[derive(Clone)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// Every element the same value.
    Constant(f32),
    /// Uniform in `[lo, hi)`, from a counter-based generator seeded by `seed`.
    Uniform {
        /// Seed.
        seed: u64,
        /// Lower bound.
        lo: f32,
        /// Upper bound.
        hi: f32,
    },
    /// Any function of the element index.
    Fn(Arc<dyn Fn(usize) -> f32 + Send + Sync>),
}

impl fmt::Debug for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Zeros => f.write_str("Zeros"),
            Init::Constant(v) => write!(f, "Constant({v})"),
            Init::Uniform { seed, lo, hi } => {
                write!(f, "Uniform {{ seed: {seed}, lo: {lo}, hi: {hi} }}")
            }
            Init::Fn(_) => f.write_str("Fn(..)"),
        }
    }
}

impl Init {
    /// Value of element `i`.
    pub fn value(&self, i: usize) -> f32 {
        match self {
            Init::Zeros => 0.0,
            Init::Constant(v) => *v,
            Init::Uniform { seed, lo, hi } => {
                // SplitMix64 is counter-based: element `i` needs no state from element `i - 1`.
                let r = splitmix64(seed.wrapping_mul(0x1000_0000_01B3) ^ i as u64);
                lo + (hi - lo) * unit_f32(r)
            }
            Init::Fn(f) => f(i),
        }
    }

    /// Fill `out` with elements `0..out.len()`.
    pub fn fill(&self, out: &mut [f32]) {
        match self {
            Init::Zeros => out.fill(0.0),
            Init::Constant(v) => out.fill(*v),
            _ => out
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = self.value(i)),
        }
    }
}

/// Training stage an access belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Stage {
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
    /// Optimizer step.
    Optimizer,
}

impl Stage {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Forward => "forward",
            Stage::Backward => "backward",
            Stage::Optimizer => "optimizer",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_a_function() {
        for (i, a) in TRANSITIONS.iter().enumerate() {
            for b in &TRANSITIONS[i + 1..] {
                assert!(!(a.0 == b.0 && a.1 == b.1), "duplicate edge {a:?} / {b:?}");
            }
        }
    }

    #[test]
    fn compute_is_left_only_by_after_events() {
        let exits: Vec<_> = TRANSITIONS
            .iter()
            .filter(|t| t.0 == S::Compute)
            .map(|t| t.1)
            .collect();
        assert_eq!(
            exits,
            vec![
                E::AfterFwdOp,
                E::AfterBwdOp,
                E::AfterLastBwdOp,
                E::AfterOptim
            ]
        );
        // and COMPUTE cannot be entered twice (no nested use of one tensor).
        for e in [
            E::BeforeFwdOp,
            E::BeforeBwdOp,
            E::BeforeOptim,
            E::Release,
            E::EndForward,
        ] {
            assert_eq!(next_state(S::Compute, e), None, "{e}");
        }
    }

    #[test]
    fn training_iteration_walk() {
        let walk = [
            E::BeforeFwdOp,
            E::AfterFwdOp,
            E::BeforeFwdOp, // shared
            E::AfterFwdOp,
            E::EndForward,
            E::BeforeBwdOp,
            E::AfterBwdOp,
            E::BeforeBwdOp,
            E::AfterLastBwdOp,
            E::EndStep,
        ];
        let mut s = S::Free;
        for e in walk {
            s = next_state(s, e).unwrap_or_else(|| panic!("{s} --{e}--> illegal"));
        }
        assert_eq!(s, S::Hold);
        // a backward use without a forward is illegal
        assert_eq!(next_state(S::Free, E::BeforeBwdOp), None);
        assert_eq!(next_state(S::HoldAfterFwd, E::BeforeBwdOp), None);
    }

    #[test]
    fn init_is_deterministic_and_in_range() {
        let init = Init::Uniform {
            seed: 7,
            lo: -0.5,
            hi: 0.5,
        };
        let mut a = vec![0.0; 1000];
        init.fill(&mut a);
        assert!(a.iter().all(|&x| (-0.5..0.5).contains(&x)));
        assert_eq!(a[123], init.value(123));
        let mean: f32 = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.05, "{mean}");
        let other = Init::Uniform {
            seed: 8,
            lo: -0.5,
            hi: 0.5,
        };
        assert_ne!(other.value(123), a[123]);
    }
}
