//! What a trainer needs, in one import: `use tidemem::prelude::*;`.
//!
//! The stores ([`ChunkManager`], [`ZeroManager`]) and the [`ParamStore`] trait with its passes,
//! guards and views; registration ([`TensorId`], [`Init`]); the device handles a layer uses
//! ([`Device`], [`Stream`], [`CachingAllocator`], [`PoolBlock`], [`DeviceView`], [`Input`]); the
//! device ops ([`ops`]); the optimizer ([`HybridAdam`]); and the crate's [`Error`] and [`Result`] (whose error type defaults to
//! [`Error`], so `Result<T, E>` still names any other).

pub use crate::chunk::{ChunkManager, ManagerConfig};
pub use crate::comm::Communicator;
pub use crate::device::{
    CachingAllocator, Device, DeviceView, Input, PoolBlock, SimConfig, Stream,
};
pub use crate::nn::{self, Act};
pub use crate::ops;
pub use crate::optim::{AdamConfig, HybridAdam, HybridConfig, StepOutcome, StepReport};
pub use crate::store::{
    Backward, BackwardPass, Forward, ForwardPass, GradView, Guard, ParamStore, ReadView,
};
pub use crate::tensor::{Init, Stage, TensorId};
pub use crate::tide::Policy;
pub use crate::zero::ZeroManager;
pub use crate::{DType, Error, Result};
