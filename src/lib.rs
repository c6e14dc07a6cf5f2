//! # tidemem
//!
//! A heterogeneous CPU–GPU memory manager for training models larger than device memory, in the
//! style of PatrickStar and ZeRO: model data lives in chunks that move between pinned host
//! memory, device memory and a file-backed tier, placed by a scheduler that knows the "tide" of
//! non-model memory at every moment of an iteration.
//!
//! The crate holds the [`device`] layer (two backends behind one [`device::Backend`] trait,
//! asynchronous stream-ordered copies, host memory tiers, a caching allocator for non-model data,
//! run-time compiled CUDA [`kernels`]), the compute [`ops`] (GEMM through cuBLAS, LayerNorm,
//! attention, cross-entropy, embeddings, DLRM's interaction…, each with a CPU twin that agrees
//! with its kernel) and the memory layer on top:
//! stateful [`tensor`]s, [`chunk`]s and the [`chunk::ChunkManager`], the [`tide`] tracer and
//! placement policies, and a [`simulate`]or that replays a model's trace through the same
//! policies. [`optim`] holds the CPU/CUDA Adam and `HybridAdam`; [`comm`] the collectives
//! (in-process and NCCL) and [`zero`] ZeRO sharding over chunks. [`store`] is what a trainer
//! sees of either kind of store: passes, guards and typed device views of the parameters
//! ([`prelude`] imports it all), and [`nn`] the layers that compute on it in place. `demo`
//! (the `demo` feature, on for the crate's own tests, benches and examples) holds the small MLP
//! they train; [`profile`] writes Chrome traces and tide plots;
//! [`data`] generates synthetic training data (and reads Criteo TSV files), [`metrics`] scores
//! a classifier (exact AUC, log loss); [`limits`] bounds the sizes a caller asks for against
//! what the machine holds, before anything is allocated.
//!
//! ```
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::DType;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let s = dev.new_stream()?;
//! let x: Vec<f32> = vec![0.1, 1.5, -3.0, 65504.0];
//! let src = dev.upload(&s, bytemuck::cast_slice(&x))?;
//! let dst = dev.alloc(x.len() * 2)?;
//! tidemem::ops::cast(&dev, &s, &src, DType::F32, &dst, DType::F16)?;
//! let h: Vec<u8> = dev.download(&s, &dst)?;
//! let h: &[half::f16] = bytemuck::cast_slice(&h);
//! assert_eq!(h[1].to_f32(), 1.5);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

/// An item of the kernel ABI (a `KernelDesc` static or a `*Params` block): public with the
/// `kernel-abi` feature (and then also named in `ops::abi`), crate-private without it.
macro_rules! abi {
    ($(#[$m:meta])* static $($rest:tt)*) => {
        #[cfg(feature = "kernel-abi")]
        $(#[$m])* pub static $($rest)*
        #[cfg(not(feature = "kernel-abi"))]
        $(#[$m])* pub(crate) static $($rest)*
    };
    ($(#[$m:meta])* fn $($rest:tt)*) => {
        #[cfg(feature = "kernel-abi")]
        $(#[$m])* pub fn $($rest)*
        #[cfg(not(feature = "kernel-abi"))]
        $(#[$m])* pub(crate) fn $($rest)*
    };
    ($(#[$m:meta])* struct $($rest:tt)*) => {
        #[cfg(feature = "kernel-abi")]
        $(#[$m])* pub struct $($rest)*
        #[cfg(not(feature = "kernel-abi"))]
        #[allow(dead_code)] // fields the kernels read, not the host
        $(#[$m])* pub(crate) struct $($rest)*
    };
}

pub(crate) mod checkpoint;
pub mod chunk;
pub mod comm;
pub mod data;
#[cfg(feature = "demo")]
pub mod demo;
pub mod device;
pub(crate) mod device_id;
pub(crate) mod dtype;
pub mod embedding;
pub(crate) mod error;
pub mod kernels;
pub mod limits;
pub mod metrics;
pub mod models;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod prelude;
pub mod profile;
pub mod rng;
pub mod simulate;
pub mod store;
pub mod tensor;
pub mod tide;
pub mod units;
pub mod zero;

pub use dtype::{decode_f32, encode_f32, DType};
pub use error::{Error, Result};
