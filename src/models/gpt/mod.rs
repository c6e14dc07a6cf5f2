//! The GPT-2 family on the memory layer: [`GptConfig`] (the presets and any shape),
//! [`Gpt`] (the model over any [`ParamStore`](crate::store::ParamStore), with per-block
//! activation checkpointing), [`train_step`] (micro-batches, loss scaling, the optimizer
//! step), Hugging Face GPT-2 checkpoints in and out ([`read_hf`], [`write_hf`]), and the
//! model split over a 1D tensor-parallel group ([`Gpt::register_1d`]: the blocks Megatron's
//! way, the vocabulary split for the [`Ends`]).

mod blocks;
mod config;
mod ends;
mod generate;
mod grid;
mod grid_ends;
mod hf;
mod model;
mod pipe;
mod spec;
mod split;
mod split_ends;
mod train;

pub use blocks::StageSplit;
pub use config::GptConfig;
pub use ends::Ends;
pub use grid::{train_step_grid, GptGrid};
pub use grid_ends::{EndsLayout, GridEnds};
pub use hf::{read_hf, write_hf, HfWeights};
pub use model::{default_init, Gpt, GptBatch, RunOptions, IGNORE_INDEX};
pub use pipe::{
    train_step_pipe, train_two_bw_stream, GptStage, StageEmbedding, StageGroups, StageHead,
};
pub use split_ends::{SplitEmbedding, SplitHead};
pub use train::{train_step, train_step_in, train_step_sp, TrainStep};
