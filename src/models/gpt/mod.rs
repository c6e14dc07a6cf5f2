//! The GPT-2 family on the memory layer.

mod config;

pub use config::GptConfig;
