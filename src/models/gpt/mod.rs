//! The GPT-2 family on the memory layer: [`GptConfig`] (the presets and any shape), [`Gpt`]
//! (the model, or a rank's part of it, over any [`ParamStore`](crate::store::ParamStore), with
//! per-block activation checkpointing), [`Plan`] (where a rank stands: its process grid's
//! tensor split on any layout, sequence ring and pipeline stage, how the ends are held),
//! [`train_step`] (one optimizer step for every plan: micro-batches, loss scaling, the
//! pipeline's schedule) and Hugging Face GPT-2 checkpoints in and out ([`read_hf`],
//! [`write_hf`]).

mod blocks;
mod config;
mod ends;
mod generate;
mod hf;
mod model;
mod pipe;
mod plan;
mod run;
mod spec;
mod train;
mod variant;

pub use config::{GptConfig, IGNORE_INDEX};
pub use ends::Gpt2;
pub use hf::{read_hf, write_hf, HfWeights};
pub use model::{default_init, Gpt, GptBatch, TrainStep};
pub use pipe::train_two_bw_stream;
pub use plan::{EndsLayout, Plan};
pub use train::train_step;
pub use variant::{ModelEnds, RegisterAt, Tie, Variant};
