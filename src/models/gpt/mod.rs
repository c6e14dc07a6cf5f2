//! The GPT-2 family on the memory layer.

mod config;
mod model;

pub use config::GptConfig;
pub use model::{default_init, Gpt, GptBatch, RunOptions, IGNORE_INDEX};
