//! Frequency-aware cached embedding bags for tables far larger than device memory.
//!
//! The full table lives in host memory (pageable, pinned or a memory-mapped file); the hottest
//! rows are cached on the device.
//!
//! - [`CacheIndex`] holds the index maps (8 bytes per table row) and decides, per batch, which
//!   rows miss, which cached rows to evict (never one the batch uses) and which evicted rows are
//!   dirty and must be written back, under one of the [`CachePolicy`] variants.
//! - [`EmbeddingCache`] owns the memory and carries out those decisions through bounded staging
//!   buffers; it reorders rows by frequency, warms up, flushes and checkpoints (safetensors, in
//!   the user's id order).
//! - [`CachedEmbeddingBag`] runs bags (sum, mean, per-sample weights), the sparse backward and
//!   SGD, row-wise Adagrad or Adam on the cached rows, with each row's optimizer state stored in
//!   the row so it travels with it. [`EmbeddingBag`] is the fully resident reference.
//! - [`CachedEmbeddingCollection`] puts many tables behind one cache; [`ShardedEmbedding`]
//!   places them over ranks, table-wise or column-wise, with the all-to-all that returns
//!   batch-split outputs.
//! - [`replay`] measures hit rates and bytes moved of a policy on an id trace, such as the
//!   Criteo-like synthetic ones of [`crate::data::criteo`].

mod bag;
mod cache;
mod checkpoint;
mod index;
mod policy;
mod replay;
mod sharded;
mod tables;

pub use bag::{CachedEmbeddingBag, EmbeddingBag};
pub use cache::{bincount, CacheConfig, CacheMoves, EmbeddingCache, HostTier};
pub use index::{CacheIndex, CachePlan, IndexStats, NONE};
pub use policy::{CachePolicy, OptimalTrace};
pub use replay::{replay, ReplayConfig, ReplayStats};
pub use sharded::{batch_slice, table_owners, ShardedEmbedding, Sharding};
pub use tables::{CachedEmbeddingCollection, TableBatch};
