//! Models and their trainers, built from the [`nn`](crate::nn) layers on any
//! [`ParamStore`](crate::store::ParamStore): [`gpt`], the GPT-2 family with activation
//! checkpointing, Hugging Face checkpoints in and out, and its training loop; [`dlrm`], the
//! recommendation model over a cached embedding collection.

pub mod dlrm;
pub mod gpt;
