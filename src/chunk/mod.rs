//! Chunks: fixed-size containers of tensors in four lists, and the [`ChunkManager`] that
//! places them.

mod layout;

pub use crate::tensor::ChunkKind;
pub use layout::{search_chunk_size, Layout, SizeChoice, SizeSearch, Slot};

mod plan;

pub use plan::{optimizer_accesses, plan_chunks, push_access, ChunkPlan};

mod checkpoint;
mod manager;
pub(crate) use manager::{check_distinct, grad_ranges, numel_of, ViewBuf};

pub use manager::{
    decode, encode, ChunkManager, GroupChunks, GroupSlices, GroupVisit, LogEntry, ManagerConfig,
    ParamStore, TensorView, TideSample, Usage,
};
