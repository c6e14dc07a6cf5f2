//! What a pass is to its guards and views: its kind (forward or backward), the handles it
//! opened with, and the calls they make on it ([`Host`]).

use std::cell::RefMut;
use std::sync::Arc;

use super::ParamStore;
use crate::device::{CachingAllocator, Device, PoolBlock, Stream};
use crate::dtype::DType;
use crate::error::Error;
use crate::tensor::{Stage, TensorId};

mod kind {
    /// Only [`super::Forward`] and [`super::Backward`] are pass kinds.
    pub trait Sealed {}
}

/// The stage a [`Pass`](super::Pass) runs: [`Forward`] or [`Backward`] (the optimizer stage has no pass; it
/// runs in [`ParamStore::step`](super::ParamStore::step)).
pub trait PassKind: kind::Sealed {
    /// The stage.
    const STAGE: Stage;
}

/// The forward stage (see [`ForwardPass`](super::ForwardPass)).
#[derive(Debug)]
pub enum Forward {}

/// The backward stage (see [`BackwardPass`](super::BackwardPass)).
#[derive(Debug)]
pub enum Backward {}

impl kind::Sealed for Forward {}
impl kind::Sealed for Backward {}
impl PassKind for Forward {
    const STAGE: Stage = Stage::Forward;
}
impl PassKind for Backward {
    const STAGE: Stage = Stage::Backward;
}

/// What views and guards need of their pass: the store's device, compute stream, pool and
/// parameter dtype, taken when the pass opens.
pub(crate) struct Handles {
    pub(crate) device: Device,
    pub(crate) stream: Arc<Stream>,
    pub(crate) pool: CachingAllocator,
    pub(crate) dtype: DType,
}

/// The running gradient sum (f32, in the pool) of a parameter used more than once in backward.
pub(crate) struct Sum {
    pub(super) id: TensorId,
    pub(super) buf: PoolBlock,
    pub(super) uses: u32,
}

/// A pass seen from its guards and views, without the store's lifetime.
pub(crate) trait Host {
    fn handles(&self) -> &Handles;
    /// The store, borrowed for one call (never held across another).
    fn store(&self) -> RefMut<'_, dyn ParamStore + '_>;
    /// The store unless it is borrowed (a guard dropped while unwinding from inside a call).
    fn try_store(&self) -> Option<RefMut<'_, dyn ParamStore + '_>>;
    /// Keeps an error a drop could not return, for the pass's next call.
    fn defer(&self, e: Error);
    fn sums(&self) -> RefMut<'_, Vec<Sum>>;
    /// The stage guards release in: the pass's, or backward for a recompute pass.
    fn release_stage(&self) -> Stage;
}
