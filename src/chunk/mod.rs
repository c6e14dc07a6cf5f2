//! Chunks: fixed-size containers of tensors in four lists, and the [`ChunkManager`] that
//! places them.

mod layout;

pub(crate) use crate::tensor::ChunkKind;
pub use layout::{
    search_chunk_size, search_layer_chunk_size, ChunkLayout, LayerSizeChoice, SizeChoice,
    SizeSearch, Slot,
};

mod plan;

pub(crate) use plan::push_access;
pub use plan::{optimizer_accesses, ChunkPlan, MomentStorage};

mod checkpoint;
mod manager;
mod moments;

pub(crate) use moments::scales_at;
mod tensors;

pub(crate) use manager::{grad_ranges, overlap_group_bytes, HostBlock, OverlapPlan};
pub use manager::{
    ChunkManager, DeviceMoments, GroupChunks, GroupSlices, GroupVisit, HostMoments, LogEntry,
    LogKind, ManagerConfig, OverlapStats, TideSample, Usage,
};
pub(crate) use tensors::{
    add_forward_uses, check_copy, check_distinct, check_unused, numel_of, ViewBuf,
};
pub use tensors::{decode, encode, TensorView};
