//! The optimizer: Adam/AdamW settings and scalars ([`adam`]), the SIMD CPU kernel
//! (`ops::adam`), dynamic loss scaling ([`scaler`]), and [`HybridAdam`], which steps every chunk
//! group of a [`crate::chunk::ChunkManager`] on the device where its gradients are.

pub mod adam;
mod chunk_stats;
#[cfg(test)]
mod cpu_adam_tests;
pub mod hybrid;
#[cfg(test)]
mod overlap_tests;
pub mod scaler;

pub use crate::ops::adam::{CpuAdam, Grad, GradInPlace, Isa, ParamCopy};
pub use crate::ops::grad_stats::{grad_stats_host as grad_stats, GradStats};
pub use adam::{AdamConfig, AdamScalars, WeightDecay};
pub use hybrid::{DevicePlacement, HybridAdam, HybridConfig, StepOutcome, StepReport};
pub use scaler::{LossScaler, ScaleUpdate, ScalerConfig};
