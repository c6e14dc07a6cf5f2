//! The optimizer: Adam/AdamW settings and scalars ([`adam`]), the SIMD CPU kernel
//! ([`cpu_adam`]), dynamic loss scaling ([`scaler`]), and [`HybridAdam`], which steps every chunk
//! group of a [`crate::chunk::ChunkManager`] on the device where its gradients are.

pub mod adam;
mod chunk_stats;
pub mod cpu_adam;
pub mod hybrid;
pub mod scaler;
pub mod stream;

pub use adam::{AdamConfig, AdamScalars, WeightDecay};
pub use cpu_adam::{grad_stats, CpuAdam, Grad, GradInPlace, GradStats, Isa, ParamCopy};
pub use hybrid::{DevicePlacement, HybridAdam, HybridConfig, StepOutcome, StepReport};
pub use scaler::{LossScaler, ScaleUpdate, ScalerConfig};
