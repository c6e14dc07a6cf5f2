//! Many tables in one module.
//!
//! [`CachedEmbeddingCollection`] concatenates its tables into one id space (table `t`'s id `i`
//! is row `offsets[t] + i`) sharing one cache, so hot rows of every table compete for the same
//! slots, as in a DLRM with 26 Criteo tables. Their placement over ranks is
//! [`ShardedEmbedding`](super::ShardedEmbedding).

use super::bag::CachedEmbeddingBag;
use super::cache::CacheConfig;
use super::index::CachePlan;
use crate::ops::embedding::EmbeddingOptimizer;

use crate::device::{Device, DeviceView, Stream};
use crate::error::{Error, Result};
use crate::ops::embedding::BagMode;

/// One table's part of a batch: `indices` of every bag concatenated, `offsets` (bags + 1
/// entries, from 0 to `indices.len()`) and optional per-sample weights.
#[derive(Clone, Copy, Debug)]
pub struct TableBatch<'a> {
    /// Ids, `< rows` of the table.
    pub indices: &'a [u32],
    /// Start of each bag, with the total length appended.
    pub offsets: &'a [u32],
    /// Per-sample weights (one per index), or `None` for 1.0.
    pub weights: Option<&'a [f32]>,
}

/// Tables sharing one cache; outputs are table-major: `[tables, bags, dim]`.
#[derive(Debug)]
pub struct CachedEmbeddingCollection {
    offsets: Vec<u64>,
    bag: CachedEmbeddingBag,
    last_bags: Vec<usize>,
}

impl CachedEmbeddingCollection {
    /// Tables of `rows[t]` rows of `dim` floats, `capacity` cached rows in all; `init(table,
    /// id, row)` sets each row.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: Device,
        rows: &[usize],
        dim: usize,
        capacity: usize,
        mode: BagMode,
        optimizer: EmbeddingOptimizer,
        configure: impl FnOnce(CacheConfig) -> CacheConfig,
        mut init: impl FnMut(usize, u32, &mut [f32]),
    ) -> Result<Self> {
        if rows.is_empty() || rows.contains(&0) {
            return Err(match rows.iter().position(|&r| r == 0) {
                None => Error::Empty {
                    what: "the tables of a collection".into(),
                },
                Some(t) => Error::TooFew {
                    what: format!("rows of table {t} of a collection"),
                    got: 0,
                    need: 1,
                },
            });
        }
        let mut offsets = vec![0u64];
        for &r in rows {
            offsets.push(offsets.last().expect("non-empty") + r as u64);
        }
        let total = *offsets.last().expect("non-empty") as usize;
        let config = configure(CacheConfig::new(total, dim, capacity));
        let offs = offsets.clone();
        let bag = CachedEmbeddingBag::new(device, config, mode, optimizer, |g, row| {
            let t = offs.partition_point(|&o| o <= g as u64) - 1;
            init(t, (g as u64 - offs[t]) as u32, row)
        })?;
        Ok(Self {
            offsets,
            bag,
            last_bags: Vec::new(),
        })
    }

    /// Number of tables.
    pub fn tables(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Row offset of each table in the shared id space (tables + 1 entries).
    pub fn table_offsets(&self) -> &[u64] {
        &self.offsets
    }

    /// The shared bag and its cache.
    pub fn bag(&self) -> &CachedEmbeddingBag {
        &self.bag
    }

    /// The shared bag, mutably (reorder, warm-up, flush, checkpoints).
    pub fn bag_mut(&mut self) -> &mut CachedEmbeddingBag {
        &mut self.bag
    }

    /// The global ids of a batch of every table, in table order: what the cache sees (for
    /// [`super::bincount`] and frequency reorder).
    pub fn global_ids(&self, batch: &[TableBatch<'_>]) -> Result<Vec<u32>> {
        Ok(self.concat(batch)?.0)
    }

    /// Checks table `t`'s part of a batch: ids within the table, offsets rising from 0 to the
    /// number of ids, one weight per id.
    fn check_table(&self, t: usize, b: &TableBatch<'_>) -> Result<()> {
        let rows = self.offsets[t + 1] - self.offsets[t];
        if let Some((i, id)) = b
            .indices
            .iter()
            .enumerate()
            .find(|(_, &id)| id as u64 >= rows)
        {
            return Err(Error::IdOutOfRange {
                table: Some(t),
                id: u64::from(*id),
                position: i,
                rows: rows as usize,
            });
        }
        if b.offsets.first() != Some(&0)
            || b.offsets.last().map(|&o| o as usize) != Some(b.indices.len())
            || b.offsets.windows(2).any(|w| w[1] < w[0])
        {
            let (at, why) = if b.offsets.is_empty() {
                (
                    0,
                    "there are none; they need bags + 1 entries, the number of indices last",
                )
            } else if b.offsets[0] != 0 {
                (0, "the first must be 0")
            } else if let Some(i) = b.offsets.windows(2).position(|w| w[1] < w[0]) {
                (i + 1, "they must not decrease")
            } else {
                (
                    b.offsets.len() - 1,
                    "the last must be the number of indices",
                )
            };
            return Err(Error::BadOffsets {
                table: Some(t),
                at,
                why,
            });
        }
        if let Some(w) = b.weights {
            if w.len() != b.indices.len() {
                return Err(Error::Length {
                    what: format!("table {t}: per-sample weights for the indices"),
                    got: w.len(),
                    expected: b.indices.len(),
                });
            }
        }
        Ok(())
    }

    /// Checks a batch of every table.
    pub(crate) fn check_batch(&self, batch: &[TableBatch<'_>]) -> Result<()> {
        if batch.len() != self.tables() {
            return Err(Error::Length {
                what: "tables of a batch for the collection".into(),
                got: batch.len(),
                expected: self.tables(),
            });
        }
        batch
            .iter()
            .enumerate()
            .try_for_each(|(t, b)| self.check_table(t, b))
    }

    /// The bags of every table concatenated into one batch of global ids, in the order
    /// `bags` yields `(table, bag)` pairs: table-major for [`Self::forward`], sample-major for
    /// [`Self::forward_device_interleaved`]. The batch must be checked.
    #[allow(clippy::type_complexity)]
    fn concat_bags(
        &self,
        batch: &[TableBatch<'_>],
        bags: impl Iterator<Item = (usize, usize)>,
    ) -> (Vec<u32>, Vec<u32>, Option<Vec<f32>>) {
        let n: usize = batch.iter().map(|b| b.indices.len()).sum();
        let mut ids = Vec::with_capacity(n);
        let mut offs = vec![0u32];
        let any_weights = batch.iter().any(|b| b.weights.is_some());
        let mut weights = any_weights.then(|| Vec::with_capacity(n));
        for (t, i) in bags {
            let b = &batch[t];
            let (s, e) = (b.offsets[i] as usize, b.offsets[i + 1] as usize);
            let base = self.offsets[t];
            ids.extend(b.indices[s..e].iter().map(|&i| (base + i as u64) as u32));
            offs.push(ids.len() as u32);
            if let Some(all) = weights.as_mut() {
                match b.weights {
                    Some(w) => all.extend_from_slice(&w[s..e]),
                    None => all.extend(std::iter::repeat_n(1.0, e - s)),
                }
            }
        }
        (ids, offs, weights)
    }

    #[allow(clippy::type_complexity)]
    fn concat(&self, batch: &[TableBatch<'_>]) -> Result<(Vec<u32>, Vec<u32>, Option<Vec<f32>>)> {
        self.check_batch(batch)?;
        let bags = batch
            .iter()
            .enumerate()
            .flat_map(|(t, b)| (0..b.offsets.len() - 1).map(move |i| (t, i)));
        Ok(self.concat_bags(batch, bags))
    }

    /// Forward of every table: `[tables, bags_t, dim]` floats, table-major.
    pub fn forward(&mut self, batch: &[TableBatch<'_>]) -> Result<Vec<f32>> {
        let (ids, offs, weights) = self.concat(batch)?;
        let out = self.bag.forward(&ids, &offs, weights.as_deref())?;
        self.last_bags = batch.iter().map(|b| b.offsets.len() - 1).collect();
        Ok(out)
    }

    /// Forward of every table left on the device, sample-major: every table has the same
    /// number of bags `samples` (one per sample), and the output ([`Self::output`]) is
    /// `[samples, tables, dim]` f32, row `s·tables + t` sample `s`'s bag of table `t`: the
    /// layout of a DLRM's interaction input, so its gradient needs no reordering either.
    /// Returns `samples`. The kernel runs on the cache's stream ([`Self::stream`]); work on
    /// another stream orders itself after it with an event.
    ///
    /// Each row belongs to one table and meets its bags in sample order in both layouts, so
    /// the backward sums a row's contributions in the same order as after [`Self::forward`]:
    /// the same gradient, bit for bit. Bad input (as for [`Self::forward`], or tables of
    /// different numbers of bags, [`Error::Length`]) fails and changes nothing.
    pub fn forward_device_interleaved(&mut self, batch: &[TableBatch<'_>]) -> Result<usize> {
        let (samples, (ids, offs, weights)) = self.interleaved(batch)?;
        self.bag.forward_device(&ids, &offs, weights.as_deref())?;
        self.last_bags = vec![samples; self.tables()];
        Ok(samples)
    }

    /// Makes the rows of a batch that a later [`Self::forward_device_interleaved`] will run
    /// resident now ([`CachedEmbeddingBag::prefetch`]): called while the device computes the
    /// batch in flight (whose rows stay), the next batch's decisions and row moves overlap it,
    /// and its forward then hits on every id and moves nothing. The compute stream is ordered
    /// after the moves on the device, so a host read of later work finds them done. Checks the
    /// batch as that
    /// forward does; fails, changing nothing, on bad input or when the two batches' rows do
    /// not fit in the cache together ([`Error::CacheTooSmall`]).
    pub fn prefetch_interleaved(&mut self, batch: &[TableBatch<'_>]) -> Result<CachePlan> {
        let (_, (ids, _, _)) = self.interleaved(batch)?;
        let plan = self.bag.prefetch(&[&ids])?;
        // the step's one read (after this) sees the moves done: the next forward waits for none
        self.bag.join_in_flight()?;
        Ok(plan)
    }

    /// A checked batch's samples and its sample-major concatenation.
    #[allow(clippy::type_complexity)]
    fn interleaved(
        &self,
        batch: &[TableBatch<'_>],
    ) -> Result<(usize, (Vec<u32>, Vec<u32>, Option<Vec<f32>>))> {
        self.check_batch(batch)?;
        let samples = batch[0].offsets.len() - 1;
        if let Some(t) = batch.iter().position(|b| b.offsets.len() - 1 != samples) {
            return Err(Error::Length {
                what: format!(
                    "bags of table {t}, as many as table 0 has (a sample-major forward needs one \
                     bag per sample in every table)"
                ),
                got: batch[t].offsets.len() - 1,
                expected: samples,
            });
        }
        let tables = self.tables();
        let bags = (0..samples).flat_map(|s| (0..tables).map(move |t| (t, s)));
        Ok((samples, self.concat_bags(batch, bags)))
    }

    /// The device output of the last forward (f32, in that forward's layout: table-major after
    /// [`Self::forward`], sample-major after [`Self::forward_device_interleaved`]), written on
    /// [`Self::stream`].
    pub fn output(&self) -> Result<DeviceView<'_>> {
        self.bag.output()
    }

    /// The stream the collection's forward, backward and step run on (the cache's).
    pub fn stream(&self) -> &Stream {
        self.bag.cache().stream()
    }

    /// Backward of the last forward from the output gradient (same layout as the output).
    pub fn backward(&mut self, grad_out: &[f32]) -> Result<usize> {
        self.bag.backward(grad_out)
    }

    /// [`Self::backward`] from an output gradient on the device (f32, the layout of
    /// [`Self::output`]), read on [`Self::stream`]: it must be written there or behind an
    /// event that stream waits for, and must live until the backward's kernel completes.
    /// Returns the number of distinct rows.
    pub fn backward_device(&mut self, grad_out: DeviceView<'_>) -> Result<usize> {
        self.bag.backward_device(grad_out)
    }

    /// Applies the optimizer to the rows of the last backward.
    pub fn step(&mut self) -> Result<()> {
        self.bag.step()
    }
}
