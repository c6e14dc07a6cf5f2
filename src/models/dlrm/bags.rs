//! A batch's bags as the embedding collection takes them: one id per sample and table.

use crate::data::criteo::Batch;
use crate::embedding::TableBatch;
use crate::error::{Error, Result};

/// The bags' offsets of a batch with one id per sample and table: `0, 1, …, samples`.
pub fn bag_offsets(samples: usize) -> Result<Vec<u32>> {
    let n = u32::try_from(samples).map_err(|_| Error::TooLarge {
        what: "bags of a batch (u32 offsets, one bag a sample)".into(),
        requested: samples as u128,
        limit: u64::from(u32::MAX),
    })?;
    Ok((0..=n).collect())
}

/// The collection's input of a Criteo [`Batch`] (one id per sample and table, so each bag is
/// one row), over `offsets` from [`bag_offsets`]`(batch.size)`.
pub fn table_batches<'a>(batch: &'a Batch, offsets: &'a [u32]) -> Result<Vec<TableBatch<'a>>> {
    if offsets.len() != batch.size + 1 {
        return Err(Error::Length {
            what: format!("offsets for a batch of {} samples", batch.size),
            got: offsets.len(),
            expected: batch.size + 1,
        });
    }
    batch
        .ids
        .iter()
        .enumerate()
        .map(|(t, ids)| {
            if ids.len() != batch.size {
                return Err(Error::Length {
                    what: format!("table {t}: ids for a batch of {} samples", batch.size),
                    got: ids.len(),
                    expected: batch.size,
                });
            }
            Ok(TableBatch {
                indices: ids,
                offsets,
                weights: None,
            })
        })
        .collect()
}
