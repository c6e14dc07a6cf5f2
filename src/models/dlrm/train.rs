//! One training step of a DLRM: the cached embedding's forward, the MLPs' forward and backward,
//! the embedding's backward and row optimizer, the store's optimizer step.

use super::bags::{bag_offsets, table_batches};
use super::device::order_after;
use super::hybrid::{hybrid_step, Path};
use super::{Dlrm, DlrmStep};
use crate::data::criteo::Batch;
use crate::embedding::{CachedEmbeddingCollection, ShardedEmbedding};
use crate::error::{Error, Result};
use crate::optim::{HybridAdam, StepOutcome};
use crate::store::ParamStore;

/// The embedding tables a DLRM step trains: cached on this rank's device (rows moved in and
/// out of a cache under a policy), or sharded over the ranks table-wise.
pub enum Tables<'a> {
    /// A [`CachedEmbeddingCollection`].
    Cached(&'a mut CachedEmbeddingCollection),
    /// A [`ShardedEmbedding`] over the ranks (hybrid parallel: the MLPs data parallel).
    Sharded(&'a mut ShardedEmbedding),
}

impl<'a> From<&'a mut CachedEmbeddingCollection> for Tables<'a> {
    fn from(t: &'a mut CachedEmbeddingCollection) -> Tables<'a> {
        Tables::Cached(t)
    }
}

impl<'a> From<&'a mut ShardedEmbedding> for Tables<'a> {
    fn from(t: &'a mut ShardedEmbedding) -> Tables<'a> {
        Tables::Sharded(t)
    }
}

/// How a DLRM step runs, besides its batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepPlan<'a> {
    /// The batch the following step will train on: cached tables make its rows resident while
    /// the device computes this step (see [`train_step`]).
    pub next: Option<&'a Batch>,
    /// Sharded tables only: the pooled vectors and their gradients through host memory (the
    /// reference the device path is tested against; the same bits, slower).
    pub host_vectors: bool,
}

/// One optimizer step of `model` on `batch`, the tables cached or sharded ([`Tables`]).
///
/// - **Cached tables**: the collection's sample-major device forward
///   ([`CachedEmbeddingCollection::forward_device_interleaved`]), the MLPs' forward and
///   backward with the collection's backward ([`Dlrm::forward_backward_device`] at `adam`'s
///   loss scale; the pooled vectors and their gradient stay on the device), the store's
///   [`step`](ParamStore::step) and the collection's row optimizer. The same bits as the host
///   path ([`CachedEmbeddingCollection::forward`], [`Dlrm::forward_backward_scaled`],
///   [`CachedEmbeddingCollection::backward`]).
/// - **Sharded tables** (hybrid parallel: every rank of the tables' group runs it on the same
///   global batch): the tables' forward (this rank's samples' pooled vectors, by an all-to-all
///   on the device, or through the host with [`StepPlan::host_vectors`]), the MLPs' forward
///   and backward on this rank's [`batch_slice`](crate::embedding::batch_slice) of the
///   samples, the store's step (it must average the MLP gradients over the ranks, as a
///   [`ZeroManager`](crate::zero::ZeroManager) over them does), then the tables' backward and
///   row optimizer. The step equals one rank's on the whole batch up to the order of the sums;
///   the returned [`DlrmStep`] holds the mean loss over the whole batch and the probabilities
///   of this rank's samples. Bad input is an error on every rank before anything changes.
///
/// `adam` must not accumulate micro-batches. When it skips the step on an overflowed gradient
/// ([`StepOutcome::Skipped`]), the embedding rows are not stepped either. The batch's shape is
/// checked against the model before anything runs.
pub fn train_step<'t, S: ParamStore + ?Sized>(
    model: &Dlrm,
    store: &mut S,
    adam: &mut HybridAdam,
    tables: impl Into<Tables<'t>>,
    batch: &Batch,
    plan: StepPlan<'_>,
) -> Result<DlrmStep> {
    match (tables.into(), plan) {
        (
            Tables::Cached(emb),
            StepPlan {
                next,
                host_vectors: false,
            },
        ) => cached_step(model, store, adam, emb, batch, next),
        (
            Tables::Sharded(emb),
            StepPlan {
                next: None,
                host_vectors,
            },
        ) => {
            let path = match host_vectors {
                true => Path::Host,
                false => Path::Device,
            };
            hybrid_step(model, store, adam, emb, batch, path)
        }
        (Tables::Cached(_), _) => Err(Error::Conflict {
            what: "cached tables".into(),
            with: "host_vectors (it is for sharded tables; cached tables step on the device)"
                .into(),
        }),
        (Tables::Sharded(_), _) => Err(Error::Conflict {
            what: "sharded tables".into(),
            with: "a next batch (next is for cached tables; sharded tables prepare none)".into(),
        }),
    }
}

/// The step on cached tables; with `next` (the batch the following step will train on) the
/// cache is prepared for it while the device computes this one: once this step's forward and backward
/// are enqueued, and before the step reads its gradient statistics (the one wait of a
/// step), `next`'s rows are made resident
/// ([`CachedEmbeddingCollection::prefetch_interleaved`], this batch's rows kept), so its
/// decisions and row moves overlap the device's work and the next step's forward moves
/// nothing. The same losses, bit for bit, as without `next` on the same batches: rows move,
/// their values do not change. When the two batches' rows do not fit in the cache together,
/// `next` is prepared by its own step as without it. `next` is checked against the model
/// before anything runs.
///
/// ```
/// use tidemem::data::criteo::{Dataset, Synthetic, SyntheticConfig};
/// use tidemem::embedding::CachedEmbeddingCollection;
/// use tidemem::ops::embedding::EmbeddingOptimizer;
/// use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
/// use tidemem::ops::embedding::BagMode;
/// use tidemem::prelude::*;
///
/// let cfg = DlrmConfig::tiny();
/// let dev = Device::sim(SimConfig::with_capacity(64 << 20))?;
/// let mut mc = ManagerConfig::new(1 << 16, Policy::Tide);
/// mc.param_dtype = DType::F32;
/// let mut store = ChunkManager::new(dev.clone(), mc)?;
/// let model = Dlrm::register(&mut store, &cfg, 7)?;
/// let gen = Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.0002))?;
/// let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
/// let total: usize = rows.iter().sum();
/// let mut emb = CachedEmbeddingCollection::new(
///     dev, &rows, cfg.dim, total / 2, BagMode::Sum,
///     EmbeddingOptimizer::Sgd { lr: 0.05 }, |c| c, |_, _, row| row.fill(0.01),
/// )?;
/// let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3)))?;
/// let batches: Vec<_> = (0..3).map(|i| gen.batch(i, 16)).collect();
/// for (i, b) in batches.iter().enumerate() {
///     let next = batches.get(i + 1);
///     let plan = dlrm::StepPlan { next, ..Default::default() };
///     let step = dlrm::train_step(&model, &mut store, &mut adam, &mut emb, b, plan)?;
///     assert!(step.loss.is_finite());
/// }
/// # Ok::<(), tidemem::Error>(())
/// ```
fn cached_step<S: ParamStore + ?Sized>(
    model: &Dlrm,
    store: &mut S,
    adam: &mut HybridAdam,
    emb: &mut CachedEmbeddingCollection,
    batch: &Batch,
    next: Option<&Batch>,
) -> Result<DlrmStep> {
    let c = model.config();
    for b in std::iter::once(batch).chain(next) {
        if b.ids.len() != c.tables {
            return Err(Error::Length {
                what: "tables of a batch for the DLRM".into(),
                got: b.ids.len(),
                expected: c.tables,
            });
        }
        if emb.tables() != c.tables {
            return Err(Error::Length {
                what: "tables of the embedding collection for the DLRM".into(),
                got: emb.tables(),
                expected: c.tables,
            });
        }
    }
    if adam.config().accumulation_steps != 1 {
        // a DLRM step takes an optimizer that does not accumulate micro-batches
        return Err(Error::MicroBatches {
            got: 1,
            accumulates: adam.config().accumulation_steps as usize,
        });
    }
    let offsets = bag_offsets(batch.size)?;
    let tables = table_batches(batch, &offsets)?;
    let next_offsets = next.map(|n| bag_offsets(n.size)).transpose()?;
    let next_tables = match (next, &next_offsets) {
        (Some(n), Some(o)) => Some(table_batches(n, o)?),
        _ => None,
    };
    if let Some(t) = &next_tables {
        emb.check_batch(t)?;
    }
    emb.forward_device_interleaved(&tables)?;
    let (outputs, rows) = model.forward_backward_deferred(
        store,
        emb,
        &batch.dense,
        &batch.labels,
        batch.size,
        adam.loss_scale(),
    )?;
    if let Some(t) = &next_tables {
        match emb.prefetch_interleaved(t) {
            // the step's one read sees the moves done, so the next step waits for none
            Ok(_) => order_after(store.device(), emb.stream(), store.compute_stream())?,
            // the two batches' rows do not fit together: the next step prepares its own
            Err(Error::CacheTooSmall { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let report = store.step(adam)?;
    // read after the step, whose read of the gradient statistics has seen them arrive
    let (sum, probs) = outputs.read()?;
    let loss = (sum / batch.size as f64) as f32;
    // an overflow the MLP optimizer skips skips the embedding rows' step too
    let rows = if report.outcome == StepOutcome::Skipped {
        0
    } else {
        emb.step()?;
        rows
    };
    Ok(DlrmStep {
        loss,
        probs,
        report,
        rows,
    })
}

/// The click probabilities of `batch` without training: the collection's sample-major device
/// forward and [`Dlrm::predict_device`].
pub fn predict<S: ParamStore + ?Sized>(
    model: &Dlrm,
    store: &mut S,
    emb: &mut CachedEmbeddingCollection,
    batch: &Batch,
) -> Result<Vec<f32>> {
    let offsets = bag_offsets(batch.size)?;
    let tables = table_batches(batch, &offsets)?;
    emb.forward_device_interleaved(&tables)?;
    model.predict_device(store, emb, &batch.dense, batch.size)
}
