//! Tensor parallelism on the memory layer: a process grid over a [`Communicator`]
//! ([`ProcessGrid`]: data × pipeline × tensor groups, the tensor mode 1D, 2D, 2.5D or 3D) and
//! layers whose weight shards are tensors of the rank's store, fetched, placed and stepped like
//! any other ([`one_d`]: Megatron's column- and row-parallel linears and the GPT-2 block).
//!
//! [`Communicator`]: crate::comm::Communicator

mod grid;
pub mod one_d;

pub use grid::{GridSpec, ProcessGrid, TensorMode};
pub use one_d::{Block1D, Collectives, ColumnLinear, RowLinear, Shard};
pub mod two_d;
pub use two_d::{
    gather_batch_2d, split_batch_2d, split_batch_2d_act, BatchBlock, Linear2D, Linear2p5D,
    SummaCollectives, SummaGroups,
};
