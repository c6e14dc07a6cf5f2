//! Hybrid-parallel DLRM training: the embedding tables model-parallel over the ranks of a
//! [`ShardedEmbedding`] (table-wise or column-wise), the MLPs data-parallel (each rank runs them
//! on its [`batch_slice`] of the samples, a data-parallel store such as a
//! [`ZeroManager`](crate::zero::ZeroManager) over the same ranks averages their gradients).
//!
//! Every rank is given the same global batch of `B` samples. The one-rank loss is the mean over
//! `B`; the store averages the ranks' gradients over the `W` ranks, so each rank's logit
//! gradient is scaled by `W / B` (not by the `1 / n_r` of its own `n_r` samples, which would
//! weigh the samples of a smaller slice more when `B` does not divide by `W`): the average is
//! then the gradient of the global mean exactly. The embedding vectors' gradient is that of the
//! global mean too (`1 / B` per sample); with `W` and the loss scale powers of two it is
//! bit-identical, sample for sample, to the one-rank path's.
//!
//! Before any collective each rank checks the batch against the model, the tables and the
//! optimizer; the ranks then agree (one all-reduce) that every check passed and that they were
//! given the same batch (its size and a hash of its contents), so a bad or rank-inconsistent
//! call is a typed error on every rank, never a hang. The ranks agree again after each stage
//! that can fail on one rank only.
//!
//! # Example
//!
//! One rank (any store works there); on `W` ranks, run the same code on each with a
//! [`ZeroManager`](crate::zero::ZeroManager) over the same communicator's ranks.
//!
//! ```
//! use tidemem::comm::Communicator;
//! use tidemem::data::criteo::{Dataset, Synthetic, SyntheticConfig};
//! use tidemem::embedding::{ShardedEmbedding, Sharding};
//! use tidemem::ops::embedding::EmbeddingOptimizer;
//! use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
//! use tidemem::ops::embedding::BagMode;
//! use tidemem::prelude::*;
//!
//! # fn main() -> tidemem::Result<()> {
//! let gen = Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.0002))?;
//! let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
//! let dev = Device::sim(SimConfig::with_capacity(64 << 20))?;
//! let comm = Communicator::local(vec![dev.clone()])?.remove(0);
//! let config = DlrmConfig::tiny();
//! let sgd = EmbeddingOptimizer::Sgd { lr: 0.1 };
//! let mut emb = ShardedEmbedding::new(
//!     comm, Sharding::TableWise, &rows, config.dim, 1024, BagMode::Sum, sgd,
//!     |_, _, row| row.fill(0.01),
//! )?;
//! let mut cfg = ManagerConfig::new(1 << 16, Policy::Tide);
//! cfg.param_dtype = DType::F32;
//! let mut store = ChunkManager::new(dev, cfg)?;
//! let model = Dlrm::register(&mut store, &config, 0)?;
//! let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-2)))?;
//! let batch = gen.batch(0, 16);
//! let step = dlrm::train_step(&model, &mut store, &mut adam, &mut emb, &batch, Default::default())?;
//! assert!(step.loss.is_finite() && step.probs.len() == 16);
//! # Ok(()) }
//! ```

use super::bags::{bag_offsets, table_batches};
use super::{Dlrm, DlrmStep};
use crate::comm::ReduceOp;
use crate::data::criteo::Batch;
use crate::device::DeviceBuffer;
use crate::embedding::{batch_slice, ShardedEmbedding};
use crate::error::{Error, Result};
use crate::optim::{HybridAdam, StepOutcome};
use crate::store::ParamStore;
use crate::tensor::Stage;

/// Where the pooled vectors of a hybrid step live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Path {
    Host,
    Device,
}

/// The embedding vectors' gradient of a hybrid step, for the tables' backward.
enum EmbGrad {
    Host(Vec<f32>),
    /// The f32 gradient and its length in bytes.
    Device(DeviceBuffer, usize),
}

/// One hybrid-parallel step ([`train_step`](super::train_step) on sharded tables) on the global
/// `batch` (the same on every rank; every rank must call it): the sharded tables' forward (this rank's samples' pooled vectors), the MLPs'
/// forward and backward on this rank's [`batch_slice`] of the samples, the store's
/// [`step`](ParamStore::step), then the tables' backward and row optimizer, skipped on every
/// rank when the step was ([`StepOutcome::Skipped`]).
///
/// `store` must average the MLP gradients over the ranks of `emb`'s communicator, as a
/// [`ZeroManager`](crate::zero::ZeroManager) over the same ranks does (on one rank any store
/// will do); `adam` must not accumulate micro-batches. The batch needs at least one sample per
/// rank. Each rank scales its samples' logit gradients by `world / batch.size` (times `adam`'s
/// loss scale), so that the store's average is the gradient of the mean loss over the whole
/// batch however unevenly it splits; the embedding rows get the gradient of that mean too, so
/// the step equals one rank's [`train_step`](super::train_step) on the whole batch up to the
/// order of the sums.
///
/// The returned [`DlrmStep`] holds the mean loss over the whole global batch (the same on every
/// rank), the probabilities of **this rank's samples only** (`batch_slice(batch.size, world,
/// rank)`), this rank's store report, and the distinct rows the global batch touched (as one
/// rank's [`train_step`](super::train_step) counts them; 0 when the step was skipped).
///
/// Bad input (a batch that does not fit the model or the tables, out-of-range ids, fewer
/// samples than ranks, ranks given different batches) is an error on every rank before
/// anything changes: the typed error ([`Error::Length`], [`Error::IdOutOfRange`],
/// [`Error::TooFew`], [`Error::Conflict`]) on a rank that found it, an
/// [`Error::InvalidArgument`] saying another rank refused the batch on the others. A failure of one rank later in the step is an error on
/// every rank; with a store other than a `ZeroManager`, ranks whose stores disagree on skipping
/// the step get an error too, after their stores stepped.
///
/// The pooled vectors and their gradients stay on the device: the tables' forward and backward
/// all-to-all run there ([`ShardedEmbedding::forward_device`],
/// [`ShardedEmbedding::backward_device`]), and the vectors reach the interaction, and its
/// gradient the tables, without a host round trip. [`Path::Host`] is the same step through
/// host vectors; both give the same bits.
pub(super) fn hybrid_step<S: ParamStore + ?Sized>(
    model: &Dlrm,
    store: &mut S,
    adam: &mut HybridAdam,
    emb: &mut ShardedEmbedding,
    batch: &Batch,
    path: Path,
) -> Result<DlrmStep> {
    let local = check_batch(model, emb, batch).and_then(|()| {
        if adam.config().accumulation_steps != 1 {
            // a DLRM step takes an optimizer that does not accumulate micro-batches
            return Err(Error::MicroBatches {
                got: 1,
                accumulates: adam.config().accumulation_steps as usize,
            });
        }
        Ok(())
    });
    agree_on_batch(emb, batch, local)?;
    let (world, rank) = (emb.comm().world(), emb.comm().rank());
    let (s0, s1) = batch_slice(batch.size, world, rank);
    let n = s1 - s0;
    let offsets = bag_offsets(batch.size)?;
    let tables = table_batches(batch, &offsets)?;
    let c = model.config();
    let features = c.dense_features;
    let (dense, labels) = (
        &batch.dense[s0 * features..s1 * features],
        &batch.labels[s0..s1],
    );
    // the logit gradient of the global mean, times `world` for the store's average; the
    // embedding gradient divided back to the global mean's (exact for powers of two)
    let scaled = adam.loss_scale() * world as f32;
    let grad_scale = scaled / batch.size as f32;
    let fb = match path {
        Path::Host => {
            let pooled = emb.forward(&tables)?;
            model
                .forward_backward_parts(store, &pooled, dense, labels, n, grad_scale, scaled)
                .map(|(sum, grad, probs)| (sum, EmbGrad::Host(grad), probs))
        }
        Path::Device => {
            emb.forward_device(&tables)?;
            let len = n * c.tables * c.dim * 4;
            // an allocation that fails on one rank is agreed on with the pass below
            emb.take_grad_buffer(len).and_then(|buf| {
                let (sum, probs) = model.forward_backward_device_parts(
                    store,
                    &*emb,
                    dense,
                    labels,
                    n,
                    grad_scale,
                    scaled,
                    buf.view(0, len)?,
                )?;
                Ok((sum, EmbGrad::Device(buf, len), probs))
            })
        }
    };
    let mut v = [f64::from(u8::from(fb.is_err())), 0.0];
    if let Ok((sum, _, _)) = &fb {
        v[1] = *sum;
    }
    let reduced = emb.comm().all_reduce_host(&mut v, ReduceOp::Sum);
    if reduced.is_err() || v[0] != 0.0 {
        // leave this rank's store between iterations if its part went through
        if store.stage() == Some(Stage::Optimizer) {
            let _ = store.skip_step();
        }
        reduced?;
        fb?;
        return Err(Error::InvalidArgument(
            "another rank failed its DLRM forward or backward: every rank reports it".into(),
        ));
    }
    let (_, grad, probs) = fb?;
    let loss = (v[1] / batch.size as f64) as f32;
    let report = store.step(adam);
    let skipped = matches!(&report, Ok(r) if r.outcome == StepOutcome::Skipped);
    let mut flags = [u8::from(report.is_err()), u8::from(skipped)];
    emb.comm().all_reduce_host(&mut flags, ReduceOp::Max)?;
    let report = report?;
    if flags[0] != 0 {
        return Err(Error::InvalidArgument(
            "another rank failed its MLP optimizer step: every rank reports it".into(),
        ));
    }
    let mut lo = [u8::from(skipped)];
    emb.comm().all_reduce_host(&mut lo, ReduceOp::Min)?;
    if lo[0] != flags[1] {
        return Err(Error::Conflict {
            what: "a store whose optimizer skips a step on its own rank's overflow check".into(),
            with: "a DLRM step over several ranks: the ranks' MLP optimizers disagree on \
                   skipping the step; use a store that reduces the overflow check over the \
                   ranks (a ZeroManager)"
                .into(),
        });
    }
    let rows = if skipped {
        0
    } else {
        let back = match &grad {
            EmbGrad::Host(g) => emb.backward(g),
            EmbGrad::Device(buf, len) => buf
                .view(0, *len)
                .and_then(|g| emb.backward_device(g))
                .map(drop),
        };
        if let EmbGrad::Device(buf, _) = grad {
            emb.keep_grad_buffer(buf);
        }
        emb.comm().agree(back.is_ok())?;
        back?;
        let step = emb.step();
        emb.comm().agree(step.is_ok())?;
        step?;
        distinct_rows(batch)
    };
    Ok(DlrmStep {
        loss,
        probs,
        report,
        rows,
    })
}

/// The click probabilities of **this rank's samples** (`batch_slice(batch.size, world, rank)`)
/// of the global `batch` (the same on every rank; every rank must call it), without training:
/// the sharded tables' forward and [`Dlrm::predict`] on this rank's slice. Concatenated in rank
/// order, the ranks' results are the probabilities of the whole batch. Checked and agreed as
/// [`train_step`](super::train_step) on sharded tables is; the vectors stay on the device ([`Dlrm::predict_device`]).
pub fn predict_hybrid<S: ParamStore + ?Sized>(
    model: &Dlrm,
    store: &mut S,
    emb: &mut ShardedEmbedding,
    batch: &Batch,
) -> Result<Vec<f32>> {
    hybrid_predict(model, store, emb, batch, Path::Device)
}

/// [`predict_hybrid`] through host vectors ([`ShardedEmbedding::forward`], [`Dlrm::predict`]):
/// the reference of the device path, the same bits.
pub fn predict_hybrid_host<S: ParamStore + ?Sized>(
    model: &Dlrm,
    store: &mut S,
    emb: &mut ShardedEmbedding,
    batch: &Batch,
) -> Result<Vec<f32>> {
    hybrid_predict(model, store, emb, batch, Path::Host)
}

fn hybrid_predict<S: ParamStore + ?Sized>(
    model: &Dlrm,
    store: &mut S,
    emb: &mut ShardedEmbedding,
    batch: &Batch,
    path: Path,
) -> Result<Vec<f32>> {
    let local = check_batch(model, emb, batch);
    agree_on_batch(emb, batch, local)?;
    let (s0, s1) = batch_slice(batch.size, emb.comm().world(), emb.comm().rank());
    let offsets = bag_offsets(batch.size)?;
    let tables = table_batches(batch, &offsets)?;
    let features = model.config().dense_features;
    let dense = &batch.dense[s0 * features..s1 * features];
    let probs = match path {
        Path::Host => {
            let pooled = emb.forward(&tables)?;
            model.predict(store, &pooled, dense, s1 - s0)
        }
        Path::Device => {
            emb.forward_device(&tables)?;
            model.predict_device(store, &*emb, dense, s1 - s0)
        }
    };
    emb.comm().agree(probs.is_ok())?;
    probs
}

/// This rank's checks of a batch against the model and the tables (nothing collective).
fn check_batch(model: &Dlrm, emb: &ShardedEmbedding, batch: &Batch) -> Result<()> {
    let c = model.config();
    let world = emb.comm().world();
    let length = |what: String, got: usize, expected: usize| {
        if got == expected {
            Ok(())
        } else {
            Err(Error::Length {
                what,
                got,
                expected,
            })
        }
    };
    length(
        "tables of the sharded tables for the DLRM".into(),
        emb.rows().len(),
        c.tables,
    )?;
    length(
        "columns of the sharded tables for the DLRM's dim".into(),
        emb.dim(),
        c.dim,
    )?;
    length(
        "tables of a batch for the DLRM".into(),
        batch.ids.len(),
        c.tables,
    )?;
    if batch.size < world {
        return Err(Error::TooFew {
            what: format!("samples of a batch over {world} ranks (a rank needs one)"),
            got: batch.size,
            need: world,
        });
    }
    length(
        format!(
            "dense values of a batch of {} samples ({} dense features)",
            batch.size, c.dense_features
        ),
        batch.dense.len(),
        batch.size.saturating_mul(c.dense_features),
    )?;
    length(
        format!("labels of a batch of {} samples", batch.size),
        batch.labels.len(),
        batch.size,
    )?;
    for (t, (ids, &rows)) in batch.ids.iter().zip(emb.rows()).enumerate() {
        length(
            format!("table {t}: ids for a batch of {} samples", batch.size),
            ids.len(),
            batch.size,
        )?;
        if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= rows) {
            return Err(Error::IdOutOfRange {
                table: Some(t),
                id: u64::from(id),
                position: i,
                rows,
            });
        }
    }
    Ok(())
}

/// Agrees over `emb`'s ranks (one all-reduce) that every rank's checks passed and that all
/// were given the same batch: its size and a hash of its ids, dense values and labels.
fn agree_on_batch(emb: &ShardedEmbedding, batch: &Batch, local: Result<()>) -> Result<()> {
    let (size, hash) = if local.is_ok() {
        (batch.size as i64, batch_hash(batch))
    } else {
        (0, 0)
    };
    let mut v = [i64::from(local.is_err()), size, -size, hash, -hash];
    emb.comm().all_reduce_host(&mut v, ReduceOp::Max)?;
    local?;
    if v[0] != 0 {
        return Err(Error::InvalidArgument(
            "another rank refused its DLRM batch: every rank reports it".into(),
        ));
    }
    if v[1] != -v[2] {
        return Err(Error::Conflict {
            what: format!("batches of {} to {} samples on the ranks", -v[2], v[1]),
            with: "one DLRM step: every rank needs the same global batch".into(),
        });
    }
    if v[3] != -v[4] {
        return Err(Error::Conflict {
            what: "different batches of the same size on the ranks".into(),
            with: "one DLRM step: every rank needs the same global batch".into(),
        });
    }
    Ok(())
}

/// FNV-1a over a batch's size, ids, dense values and labels, in 62 bits (so that its
/// negation is an `i64` too).
fn batch_hash(batch: &Batch) -> i64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(batch.size as u64);
    batch.ids.iter().flatten().for_each(|&i| eat(u64::from(i)));
    batch
        .dense
        .iter()
        .for_each(|&x| eat(u64::from(x.to_bits())));
    batch
        .labels
        .iter()
        .for_each(|&x| eat(u64::from(x.to_bits())));
    (h >> 2) as i64
}

/// Distinct `(table, id)` pairs of a batch: the rows one collection of every table would
/// update.
fn distinct_rows(batch: &Batch) -> usize {
    batch
        .ids
        .iter()
        .map(|ids| {
            let mut v = ids.clone();
            v.sort_unstable();
            v.dedup();
            v.len()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_sees_every_part_of_a_batch() {
        let b = Batch {
            size: 2,
            dense: vec![0.5; 4],
            ids: vec![vec![1, 2], vec![3, 3]],
            labels: vec![1.0, 0.0],
        };
        let h = batch_hash(&b);
        assert!(h >= 0);
        let mut c = b.clone();
        c.ids[1][0] = 4;
        assert_ne!(batch_hash(&c), h);
        let mut c = b.clone();
        c.dense[3] = 0.25;
        assert_ne!(batch_hash(&c), h);
        let mut c = b.clone();
        c.labels[0] = 0.0;
        assert_ne!(batch_hash(&c), h);
        assert_eq!(distinct_rows(&b), 3);
    }
}
