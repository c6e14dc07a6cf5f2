//! Frequency-aware cached embedding bags for tables far larger than device memory.
//!
//! [`data`] generates Criteo-like synthetic traces (Zipf ids over published table
//! cardinalities) for tests, benches and the evaluation example.

pub mod data;
