//! Chunks: fixed-size containers of tensors in four lists, and the [`ChunkManager`] that
//! places them.

mod layout;

pub use layout::{search_chunk_size, ChunkKind, Layout, SizeChoice, SizeSearch, Slot};

mod checkpoint;
mod manager;
pub(crate) use manager::{check_distinct, grad_ranges, numel_of, ViewBuf};

pub use manager::{
    decode, encode, ChunkManager, GroupChunks, GroupSlices, GroupVisit, LogEntry, ManagerConfig,
    TensorView, TideSample, Usage,
};
