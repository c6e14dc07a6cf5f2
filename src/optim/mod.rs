//! The optimizer: Adam/AdamW settings ([`AdamConfig`]; the step's scalars are
//! [`crate::ops::AdamScalars`], the SIMD CPU kernel [`crate::ops::CpuAdam`]), dynamic loss
//! scaling ([`LossScaler`]), and [`HybridAdam`], which steps every chunk group of a
//! [`crate::chunk::ChunkManager`] on the device where its gradients are.

pub(crate) mod adam;
mod chunk_stats;
#[cfg(test)]
mod cpu_adam8_tests;
#[cfg(test)]
mod cpu_adam_tests;
pub(crate) mod hybrid;
#[cfg(test)]
mod overlap_tests;
pub(crate) mod scaler;

pub(crate) use crate::ops::{grad_stats_host as grad_stats, GradStats};
pub(crate) use crate::ops::{CpuAdam, Grad, GradInPlace, Isa, ParamCopy};
pub use adam::{reference_step, AdamConfig, WeightDecay};
pub use hybrid::{
    DevicePlacement, HybridAdam, HybridConfig, ShadowBudget, StepOutcome, StepReport,
};
pub use scaler::{LossScaler, ScaleUpdate, ScalerConfig};
