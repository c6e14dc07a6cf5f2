//! The GPT-2 family on the memory layer: [`GptConfig`] (the presets and any shape),
//! [`Gpt`] (the model over any [`ParamStore`](crate::store::ParamStore), with per-block
//! activation checkpointing), [`train_step`] (micro-batches, loss scaling, the optimizer
//! step), and Hugging Face GPT-2 checkpoints in and out ([`read_hf`], [`write_hf`]).

mod config;
mod generate;
mod hf;
mod model;
mod spec;
mod train;

pub use config::GptConfig;
pub use hf::{read_hf, write_hf, HfWeights};
pub use model::{default_init, Gpt, GptBatch, RunOptions, IGNORE_INDEX};
pub use train::{train_step, train_step_in, TrainStep};
