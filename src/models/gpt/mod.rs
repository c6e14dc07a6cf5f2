//! The GPT-2 family on the memory layer.

mod config;
mod hf;

pub use config::GptConfig;
pub use hf::{read_hf, write_hf, HfWeights};
