//! Frequency-aware cached embedding bags for tables far larger than device memory.
//!
//! The full table lives in host memory; the hottest rows are cached on the device.
//! [`CacheIndex`] holds the index maps and decides, per batch, which rows miss, which cached
//! rows to evict (never one the batch uses) and which evicted rows are dirty and must be written
//! back, under one of the [`Policy`] variants. [`data`] generates Criteo-like synthetic traces
//! (Zipf ids over published table cardinalities) for tests, benches and the evaluation example.

pub mod data;
mod index;
mod policy;

pub use index::{CacheIndex, IndexStats, Plan, NONE};
pub use policy::{OptimalTrace, Policy};
