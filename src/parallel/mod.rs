//! Tensor parallelism on the memory layer: a process grid over a [`Communicator`] and layers
//! whose weight shards are tensors of the rank's store, fetched, placed and stepped like any
//! other.
//!
//! [`Communicator`]: crate::comm::Communicator

mod grid;
pub use grid::{GridSpec, ProcessGrid, TensorMode};
