//! Synthetic data, generated deterministically from a seed: nothing to download; and the
//! queue that prepares batches ahead of the step.
//!
//! - [`Ahead`]: batches built on worker threads while the trainer steps, delivered in order
//!   through a bounded queue.
//! - [`criteo`]: Criteo-like click logs (dense features, Zipf-distributed categorical ids over
//!   published table cardinalities, labels from a hidden logistic model), for the embedding
//!   cache; and a streaming reader of the Criteo TSV format into the same batches.
//! - [`regression`]: the inputs and targets the toy trainer (`demo`) fits.
//! - [`text`]: text for a language model: a byte-level or Hugging Face tokenizer, a generated
//!   English-like corpus, and next-token batches that depend only on the step.
//! - [`rng`]: the generators behind them (one SplitMix64, and xoshiro256**), which tests and
//!   benches use too.
//!
//! The generators depend on nothing above them in the crate: the memory and embedding layers use
//! them, not the other way round.

mod ahead;
pub mod criteo;
mod permutation;
pub mod regression;
pub(crate) use crate::rng;
pub mod text;
mod zipf;

pub use ahead::{Ahead, AheadStats};
