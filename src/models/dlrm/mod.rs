//! DLRM (facebookresearch/dlrm's `dot` model) on the memory layer, its embedding tables in a
//! [`CachedEmbeddingCollection`](crate::embedding::CachedEmbeddingCollection).
//!
//! [`DlrmConfig`] is the shape (the Criteo Kaggle and TorchRec presets, a tiny one for tests);
//! [`Dlrm`] registers the bottom and top MLPs as [`Linear`](crate::nn::Linear) layers in any
//! [`ParamStore`](crate::store::ParamStore) and runs one batch:
//!
//! 1. the dense features `[B, 13]` through the bottom MLP (Linear + ReLU after every layer) to
//!    the dense vector `[B, d]`;
//! 2. the pooled embedding vectors `[B, tables, d]`, sample-major, from the collection's
//!    [`forward_device_interleaved`](crate::embedding::CachedEmbeddingCollection::forward_device_interleaved),
//!    cast on the device to the parameter dtype ([`Dlrm::forward_backward_device`]; the
//!    host-vector entry [`Dlrm::forward_backward`] takes them table-major, `[tables, B, d]`
//!    as [`CachedEmbeddingCollection::forward`](crate::embedding::CachedEmbeddingCollection::forward)
//!    returns them, and uploads them sample-major);
//! 3. the dot interaction ([`ops::interaction`](crate::ops::interaction_forward)): the dense vector,
//!    then the strict lower triangle of `T·Tᵀ` over the `F = tables + 1` stacked vectors;
//! 4. the top MLP (ReLU between layers), its logit through the fused sigmoid + BCE
//!    ([`ops::bce`](crate::ops::bce)), the loss the mean over the batch;
//! 5. the backward: the MLP gradients into the store's slots, the embedding vectors' gradient
//!    cast to f32 and unscaled on the device and handed to the collection's
//!    [`backward_device`](crate::embedding::CachedEmbeddingCollection::backward_device) (or,
//!    from [`Dlrm::forward_backward`], returned to the host table-major for
//!    [`CachedEmbeddingCollection::backward`](crate::embedding::CachedEmbeddingCollection::backward)).
//!    The two paths give the same bits.
//!
//! [`train_step`] is the one training entry, for either kind of [`Tables`]: on cached tables
//! it glues one step on the device path (the collection's forward,
//! [`Dlrm::forward_backward_device`] with the collection's backward, the store's optimizer
//! step, the collection's row optimizer), the next batch's rows made resident meanwhile
//! ([`StepPlan::next`]); on tables sharded over many ranks (a
//! [`ShardedEmbedding`](crate::embedding::ShardedEmbedding)) it runs the hybrid-parallel step,
//! the MLPs data-parallel ([`predict_hybrid`] predicts the same way).
//!
//! # Example
//!
//! ```
//! use tidemem::models::dlrm::{Dlrm, DlrmConfig};
//! use tidemem::prelude::*;
//!
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(16 << 20))?;
//! let mut cfg = ManagerConfig::new(1 << 16, Policy::Tide);
//! cfg.param_dtype = DType::F32;
//! let mut store = ChunkManager::new(dev, cfg)?;
//! let config = DlrmConfig::tiny();
//! let model = Dlrm::register(&mut store, &config, 0)?;
//! let batch = 2;
//! let emb = vec![0.1f32; config.tables * batch * config.dim];
//! let dense = vec![1.0f32; batch * config.dense_features];
//! let labels = [1.0, 0.0];
//! let (loss, emb_grad, probs) = model.forward_backward(&mut store, &emb, &dense, &labels, batch)?;
//! assert!(loss.is_finite() && emb_grad.len() == emb.len() && probs.len() == batch);
//! store.skip_step()?;
//! # Ok(()) }
//! ```

mod bags;
mod config;
mod device;
mod hybrid;
mod model;
mod train;

pub use bags::{bag_offsets, table_batches};
pub use config::DlrmConfig;
pub use device::DeviceEmbeddings;
pub use hybrid::{predict_hybrid, predict_hybrid_host};
pub use model::{default_init, Dlrm, DlrmStep};
pub use train::{predict, train_step, StepPlan, Tables};
