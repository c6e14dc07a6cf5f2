//! The GPT-2 family on the memory layer: [`GptConfig`] (the presets and any shape),
//! [`Gpt`] (the model over any [`ParamStore`](crate::store::ParamStore), with per-block
//! activation checkpointing) and [`train_step`] (micro-batches, loss scaling, the optimizer
//! step).

mod config;
mod model;
mod spec;
mod train;

pub use config::GptConfig;
pub use model::{default_init, Gpt, GptBatch, RunOptions, IGNORE_INDEX};
pub use train::{train_step, TrainStep};
