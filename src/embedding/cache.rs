//! The storage of the embedding cache: the full table in host memory, `capacity` rows on the
//! device, and the moves a [`CachePlan`] orders between them through bounded staging buffers.
//!
//! A row is `stride = dim + state` f32: the embedding, then its optimizer state, so a row's
//! state travels with it on eviction and admission. The host table is in host-row order (after
//! [`EmbeddingCache::reorder`], row 0 is the hottest id); everything the user sees (reads,
//! checkpoints) is in the original id order.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::index::{CacheIndex, CachePlan, IndexStats};
use super::policy::CachePolicy;
use crate::checkpoint::Written;
use crate::device::{Device, DeviceBuffer, Event, FileStore, HostBuffer, Pending, Stream};
use crate::error::{Error, Result};

/// Which host tier holds the full table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostTier {
    /// Ordinary pageable memory.
    Paged,
    /// Page-locked memory of the cache's device (pageable on the simulated device).
    Pinned,
    /// A memory-mapped file in this directory, for tables larger than RAM.
    Mapped(PathBuf),
}

/// The shape and placement of an [`EmbeddingCache`].
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// Rows of the table (ids `0..rows`).
    pub rows: usize,
    /// Floats per embedding.
    pub dim: usize,
    /// Floats of optimizer state per row, stored after the embedding
    /// ([`crate::ops::embedding::EmbeddingOptimizer::state_len`]).
    pub state: usize,
    /// Rows cached on the device.
    pub capacity: usize,
    /// Eviction policy.
    pub policy: CachePolicy,
    /// Where the full table lives.
    pub host: HostTier,
    /// Rows per host↔device transfer: the staging buffers hold this many rows.
    pub(crate) staging_rows: usize,
    /// The state holds bits, not floats (8-bit moments): checkpoints store it as `U32`.
    pub(crate) state_bits: bool,
}

impl CacheConfig {
    /// `rows × dim` with `capacity` cached rows, no optimizer state, the frequency policy, paged
    /// host memory and 4,096 staging rows.
    pub fn new(rows: usize, dim: usize, capacity: usize) -> Self {
        Self {
            rows,
            dim,
            state: 0,
            capacity,
            policy: CachePolicy::Frequency,
            host: HostTier::Paged,
            staging_rows: 4096,
            state_bits: false,
        }
    }

    /// Sets the floats of optimizer state per row.
    pub(crate) fn state(mut self, state: usize) -> Self {
        self.state = state;
        self
    }

    /// Marks the state as bits ([`CacheConfig::state_bits`]).
    pub(crate) fn state_bits(mut self, bits: bool) -> Self {
        self.state_bits = bits;
        self
    }

    /// Sets the eviction policy.
    pub fn policy(mut self, policy: CachePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the host tier.
    pub fn host(mut self, host: HostTier) -> Self {
        self.host = host;
        self
    }

    /// Sets the rows per transfer.
    pub fn staging_rows(mut self, rows: usize) -> Self {
        self.staging_rows = rows;
        self
    }
}

/// Rows and bytes moved by an [`EmbeddingCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheMoves {
    /// Rows copied host → device.
    pub h2d_rows: u64,
    /// Rows copied device → host.
    pub d2h_rows: u64,
    /// Bytes of rows (embedding and optimizer state) copied host → device.
    pub h2d_bytes: u64,
    /// Bytes of rows copied device → host.
    pub d2h_bytes: u64,
}

/// A table of `rows × dim` f32 (plus per-row optimizer state) in host memory with its hottest
/// rows cached on a device.
///
/// Bad input fails and changes nothing. A device failure while rows move (after the index
/// has decided the moves) leaves index and data out of step, so the cache then refuses every
/// call that moves or reads rows, with an error naming the failure.
pub struct EmbeddingCache {
    // Dropped first: dropping a copy in flight waits for it.
    write_back_in_flight: Option<WriteBackInFlight>,
    admit_in_flight: Option<AdmitInFlight>,
    device: Device,
    stream: Stream,
    copy_in: Stream,
    copy_out: Stream,
    on_compute: Event,
    on_copy_in: Event,
    on_copy_out: Event,
    index: CacheIndex,
    rows: usize,
    dim: usize,
    stride: usize,
    staging_rows: usize,
    host: HostBuffer,
    _store: Option<FileStore>,
    cache: DeviceBuffer,
    out: Staging,
    inn: Staging,
    moved: CacheMoves,
    /// Why the cache is unusable: a transfer failed after the index had changed, so the index
    /// may name rows the device or host copy does not hold.
    broken: Option<String>,
    /// The rows' state holds bits (8-bit moments): checkpoints store it as `U32`.
    state_bits: bool,
}

/// Staging for one direction of transfers: `staging_rows` rows and their slot numbers, in
/// pinned host memory and on the device. A host buffer is `None` while a copy holds it.
struct Staging {
    host: Option<HostBuffer>,
    idx: Option<HostBuffer>,
    dev: DeviceBuffer,
    idx_dev: DeviceBuffer,
}

impl Staging {
    fn new(device: &Device, rows: usize, row_bytes: usize) -> Result<Self> {
        Ok(Self {
            host: Some(device.alloc_host(rows * row_bytes)?),
            idx: Some(device.alloc_host(rows * 4)?),
            dev: device.alloc(rows * row_bytes)?,
            idx_dev: device.alloc(rows * 4)?,
        })
    }

    fn device_bytes(&self) -> usize {
        self.dev.len() + self.idx_dev.len()
    }

    /// Writes `slots` into the host index buffer and returns it.
    fn fill_slots(&mut self, slots: impl Iterator<Item = u32>) -> Result<HostBuffer> {
        let mut idx = take(&mut self.idx)?;
        for (d, s) in idx.typed_mut::<u32>()?.iter_mut().zip(slots) {
            *d = s;
        }
        Ok(idx)
    }
}

/// A staging buffer a failed copy kept (it is leaked rather than freed under the copy).
fn take(buf: &mut Option<HostBuffer>) -> Result<HostBuffer> {
    buf.take().ok_or_else(|| Error::Poisoned {
        what: "embedding cache",
        reason: "a staging buffer was lost to an earlier device failure".into(),
    })
}

/// The last write-backs of a prefetch: copying device → host on the copy stream.
struct WriteBackInFlight {
    rows: Vec<u32>,
    data: Pending<HostBuffer>,
    idx: Pending<HostBuffer>,
}

/// The last admissions of a prefetch: copying host → device on the copy stream; their scatter
/// into the cache is enqueued by the next [`EmbeddingCache::settle`].
struct AdmitInFlight {
    rows: usize,
    scattered: bool,
    data: Pending<HostBuffer>,
    idx: Pending<HostBuffer>,
}

impl std::fmt::Debug for EmbeddingCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingCache")
            .field("rows", &self.rows)
            .field("dim", &self.dim)
            .field("stride", &self.stride)
            .field("capacity", &self.index.capacity())
            .field("policy", &self.index.policy().name())
            .finish()
    }
}

/// Counts of every id in `0..rows`, for [`EmbeddingCache::reorder`]. Fails on an id out of
/// range, and with [`Error::TooLarge`] when `rows` counts would not fit in the machine's
/// memory.
pub fn bincount<'a>(rows: usize, batches: impl IntoIterator<Item = &'a [u32]>) -> Result<Vec<u64>> {
    crate::limits::host_bytes(|| format!("bytes of the counts of {rows} rows"), &[rows, 8])?;
    let mut counts = vec![0u64; rows];
    let mut position = 0;
    for ids in batches {
        for &id in ids {
            *counts.get_mut(id as usize).ok_or(Error::IdOutOfRange {
                table: None,
                id: u64::from(id),
                position,
                rows,
            })? += 1;
            position += 1;
        }
    }
    Ok(counts)
}

impl EmbeddingCache {
    /// A cache on `device`, every row's embedding set by `init(id, row)` and its optimizer
    /// state zeroed. A table in paged or pinned host memory larger than the machine's memory
    /// is refused with [`Error::TooLarge`]; on the file tier, a disk too small for it with
    /// [`Error::FileTierFull`].
    pub fn new(
        device: Device,
        config: CacheConfig,
        mut init: impl FnMut(u32, &mut [f32]),
    ) -> Result<Self> {
        let CacheConfig {
            rows,
            dim,
            state,
            capacity,
            policy,
            host,
            staging_rows,
            state_bits,
        } = config;
        if dim == 0 || staging_rows == 0 {
            let (what, got) = if dim == 0 {
                ("dim of an embedding cache", dim)
            } else {
                ("staging rows of an embedding cache", staging_rows)
            };
            return Err(Error::TooFew {
                what: what.into(),
                got,
                need: 1,
            });
        }
        let index = CacheIndex::new(rows, capacity, policy)?;
        let row_bytes = dim
            .checked_add(state)
            .and_then(|s| s.checked_mul(4))
            .ok_or_else(|| Error::Overflow {
                what: format!("bytes of a row of {dim} + {state} floats"),
            })?;
        let stride = dim + state;
        let table_bytes = rows.checked_mul(row_bytes).ok_or_else(|| Error::Overflow {
            what: format!("a table of {rows} rows of {row_bytes} bytes"),
        })?;
        // the file tier may hold more than the machine's memory; the others may not
        let in_memory = || {
            crate::limits::host_bytes(
                || format!("bytes of a host table of {rows} rows of {row_bytes} bytes"),
                &[table_bytes],
            )
        };
        let (mut host, store) = match host {
            HostTier::Paged => (HostBuffer::paged(in_memory()?)?, None),
            HostTier::Pinned => (device.alloc_host(in_memory()?)?, None),
            HostTier::Mapped(dir) => {
                let store = FileStore::new(dir)?;
                (store.alloc(table_bytes)?, Some(store))
            }
        };
        {
            let t = host.typed_mut::<f32>()?;
            for (id, row) in t.chunks_exact_mut(stride).enumerate() {
                init(id as u32, &mut row[..dim]);
                row[dim..].fill(0.0);
            }
        }
        let staging_rows = staging_rows.min(index.capacity());
        Ok(Self {
            stream: device.new_stream()?,
            copy_in: device.new_stream()?,
            copy_out: device.new_stream()?,
            on_compute: device.new_event()?,
            on_copy_in: device.new_event()?,
            on_copy_out: device.new_event()?,
            cache: device.alloc(index.capacity() * row_bytes)?,
            out: Staging::new(&device, staging_rows, row_bytes)?,
            inn: Staging::new(&device, staging_rows, row_bytes)?,
            device,
            index,
            rows,
            dim,
            stride,
            staging_rows,
            host,
            _store: store,
            write_back_in_flight: None,
            admit_in_flight: None,
            moved: CacheMoves::default(),
            broken: None,
            state_bits,
        })
    }

    /// A cache over `weights` (`rows × dim`, row-major by id).
    pub fn from_weights(device: Device, config: CacheConfig, weights: &[f32]) -> Result<Self> {
        let expected = config.rows.checked_mul(config.dim);
        if Some(weights.len()) != expected {
            let table = format!("a table of {} × {}", config.rows, config.dim);
            return Err(match expected {
                None => Error::Overflow {
                    what: format!("the weights of {table}"),
                },
                Some(expected) => Error::Length {
                    what: format!("weights for {table}"),
                    got: weights.len(),
                    expected,
                },
            });
        }
        let dim = config.dim;
        Self::new(device, config, |id, row| {
            let o = id as usize * dim;
            row.copy_from_slice(&weights[o..o + dim]);
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute stream: the cache's kernels (row gathers and scatters) and the bag's run on
    /// it.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The copy streams, host → device and device → host: every transfer of rows runs on
    /// them (the two directions at once), and those a [`EmbeddingCache::prefetch`] leaves in
    /// flight overlap the work of the compute stream.
    pub fn copy_streams(&self) -> (&Stream, &Stream) {
        (&self.copy_in, &self.copy_out)
    }

    /// The index maps and policy.
    pub fn index(&self) -> &CacheIndex {
        &self.index
    }

    /// Rows of the table.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Floats per embedding.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Floats per row: embedding and optimizer state.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Cached rows the device holds.
    pub fn capacity(&self) -> usize {
        self.index.capacity()
    }

    /// The device-side cache: `capacity × stride` f32, slot-major.
    pub fn device_table(&self) -> &DeviceBuffer {
        &self.cache
    }

    /// Rows and bytes moved so far.
    pub fn moved(&self) -> CacheMoves {
        self.moved
    }

    /// Hit and move counters of the index.
    pub fn stats(&self) -> IndexStats {
        self.index.stats()
    }

    /// Bytes of host memory: the table, the index maps and the two staging buffers (one per
    /// direction).
    pub fn host_bytes(&self) -> usize {
        self.host.len() + self.index.map_bytes() + 2 * self.staging_rows * (self.stride * 4 + 4)
    }

    /// Bytes of device memory: the cached rows and the two staging buffers.
    pub fn device_bytes(&self) -> usize {
        self.cache.len() + self.out.device_bytes() + self.inn.device_bytes()
    }

    /// Whether transfers of a [`EmbeddingCache::prefetch`] are still in flight.
    pub fn in_flight(&self) -> bool {
        self.write_back_in_flight.is_some() || self.admit_in_flight.is_some()
    }

    /// Fails once a transfer has failed after the index changed.
    fn usable(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::Poisoned {
                what: "embedding cache",
                reason: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks the cache unusable if `r` (moves ordered by an index change) failed.
    fn poison<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.broken = Some(format!(
                "a row transfer failed after the index changed: {e}"
            ));
        }
        r
    }

    /// The moves of a plan: write-backs, then admissions; with `tail_in_flight`, the last
    /// staging chunk of each is left in flight.
    fn run_moves(
        &mut self,
        write_back: &[(u32, u32)],
        admit: &[(u32, u32)],
        tail_in_flight: bool,
    ) -> Result<()> {
        // Every victim is gathered on the compute stream before any admission is scattered
        // into its slot: write-backs first, then admissions.
        let tail = if tail_in_flight { self.staging_rows } else { 0 };
        let wb = write_back.len().saturating_sub(tail);
        self.write_back(&write_back[..wb])?;
        if wb < write_back.len() {
            self.write_back_async(&write_back[wb..])?;
        }
        let ad = admit.len().saturating_sub(tail);
        self.admit(&admit[..ad])?;
        if ad < admit.len() {
            self.admit_async(&admit[ad..])?;
        }
        Ok(())
    }

    fn check_settled(&self, what: &'static str) -> Result<()> {
        self.usable()?;
        if self.in_flight() {
            return Err(Error::OutOfOrder {
                call: what,
                needs: "the transfers of the last prefetch settled (settle())",
            });
        }
        Ok(())
    }

    /// Renumbers host rows by descending `counts[id]` (see [`bincount`]) so the hottest id is
    /// host row 0, moving the table's rows to match. Writes back and empties the cache first.
    pub fn reorder(&mut self, counts: &[u64]) -> Result<()> {
        if counts.len() != self.rows {
            return Err(Error::Length {
                what: "frequency counts for a reorder (one per row)".into(),
                got: counts.len(),
                expected: self.rows,
            });
        }
        self.flush()?;
        self.index.clear()?;
        let old = self.index.permutation().to_vec();
        let new = self.index.reorder(counts)?.to_vec();
        // Host row `r` moves to `dest[r]`: follow each cycle once.
        let mut dest = vec![0u32; self.rows];
        for (id, &r) in old.iter().enumerate() {
            dest[r as usize] = new[id];
        }
        let stride = self.stride;
        let t = self.host.typed_mut::<f32>()?;
        let mut tmp = vec![0f32; stride];
        let mut done = vec![false; self.rows];
        for start in 0..self.rows {
            if done[start] || dest[start] as usize == start {
                continue;
            }
            // Carry the row at `start` around its cycle.
            tmp.copy_from_slice(&t[start * stride..(start + 1) * stride]);
            let mut at = start;
            loop {
                let to = dest[at] as usize;
                done[at] = true;
                let next = &mut t[to * stride..(to + 1) * stride];
                for (a, b) in next.iter_mut().zip(tmp.iter_mut()) {
                    std::mem::swap(a, b);
                }
                at = to;
                if at == start {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Admits the hottest `ceil(ratio × capacity)` host rows into free slots (after a
    /// [`EmbeddingCache::reorder`], the most frequent ids).
    pub fn warm_up(&mut self, ratio: f64) -> Result<usize> {
        if !(0.0..=1.0).contains(&ratio) {
            return Err(Error::BadValue {
                what: "the warm-up ratio".into(),
                value: ratio,
                want: "in [0, 1]",
            });
        }
        self.settle()?;
        let n = (ratio * self.capacity() as f64).ceil() as usize;
        let admit = self.index.preload(n);
        let r = self.admit(&admit);
        self.poison(r)?;
        Ok(admit.len())
    }

    /// Makes every id of the batch resident and returns the plan, whose `slots` give each id's
    /// row in [`EmbeddingCache::device_table`]. Evicted dirty rows are written back before
    /// their slots are reused. On a bad id or a batch with more distinct rows than slots it
    /// fails and changes nothing.
    pub fn prepare(&mut self, ids: &[u32]) -> Result<CachePlan> {
        let plan = self.prepare_deferred(ids, false)?;
        self.enqueue_admitted()?;
        Ok(plan)
    }

    /// [`EmbeddingCache::prepare`] that leaves the scatter of admitted rows to
    /// [`EmbeddingCache::enqueue_admitted`]. With `in_flight`, the batch's last
    /// `staging_rows` write-backs and admissions stay in flight on the copy streams (as a
    /// prefetch's do), so a batch whose moves fit the staging buffers makes the host wait for
    /// nothing: the next call that needs them settles them.
    pub(crate) fn prepare_deferred(&mut self, ids: &[u32], in_flight: bool) -> Result<CachePlan> {
        self.usable()?;
        let plan = self.index.prepare(ids)?;
        if !plan.write_back.is_empty() || !plan.admit.is_empty() {
            let r = self
                .settle()
                .and_then(|()| self.run_moves(&plan.write_back, &plan.admit, in_flight));
            self.poison(r)?;
        }
        Ok(plan)
    }

    /// Makes every id of the next `batches` resident in one decision (their union must fit),
    /// so that [`EmbeddingCache::prepare`] of each of them afterwards hits on every id and
    /// moves nothing, provided nothing else is prepared in between. The slots in `keep` (those
    /// of a batch still being computed, e.g. its `plan.slots`) are not evicted. Returns the
    /// union's plan (see [`CacheIndex::prefetch`]); on bad input it fails and changes nothing.
    ///
    /// The last `staging_rows` write-backs and the last `staging_rows` admissions are left in
    /// flight on the [copy streams](EmbeddingCache::copy_streams), overlapping whatever the
    /// compute stream runs next (the backward and step of a batch in flight); the rest move
    /// at once. The next call that needs them ([`EmbeddingCache::settle`], which `prepare`,
    /// `prefetch`, `flush` and the other mutating calls run first) waits for them and
    /// enqueues the admitted rows' scatter into the cache. A staging buffer as large as a
    /// prefetch's moves keeps all of them in flight.
    ///
    /// ```
    /// use tidemem::device::{Device, SimConfig};
    /// use tidemem::embedding::{CacheConfig, EmbeddingCache};
    ///
    /// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
    /// let mut cache = EmbeddingCache::new(dev, CacheConfig::new(1000, 8, 64), |id, row| {
    ///     row.fill(id as f32)
    /// })?;
    /// let batches: [&[u32]; 3] = [&[1, 2, 3], &[3, 4, 900], &[5, 1]];
    /// let union = cache.prefetch(&batches, &[])?;
    /// assert_eq!(union.admit.len(), 6);
    /// let before = cache.moved();
    /// for b in batches {
    ///     let plan = cache.prepare(b)?;
    ///     assert_eq!(plan.misses, 0);
    /// }
    /// assert_eq!(cache.moved(), before);
    /// # Ok::<(), tidemem::Error>(())
    /// ```
    pub fn prefetch(&mut self, batches: &[&[u32]], keep: &[u32]) -> Result<CachePlan> {
        self.settle()?;
        let plan = self.index.prefetch(batches, keep)?;
        let r = self.run_moves(&plan.write_back, &plan.admit, true);
        self.poison(r)?;
        Ok(plan)
    }

    /// Waits for the transfers of the last [`EmbeddingCache::prefetch`]: written-back rows
    /// reach the host table, and the scatter of admitted rows into the cache is enqueued on
    /// the compute stream (ordered after their copy). Does nothing when none are in flight.
    pub fn settle(&mut self) -> Result<()> {
        self.usable()?;
        let r = self
            .enqueue_admitted()
            .and_then(|()| self.finish_admit())
            .and_then(|()| self.finish_write_back());
        self.poison(r)
    }

    /// Waits for the copies of the admission in flight (its scatter already enqueued) and
    /// takes its staging back.
    fn finish_admit(&mut self) -> Result<()> {
        if let Some(a) = self.admit_in_flight.take() {
            debug_assert!(a.scattered);
            self.inn.host = Some(a.data.wait()?);
            self.inn.idx = Some(a.idx.wait()?);
        }
        Ok(())
    }

    /// Waits for the write-back in flight and copies its rows into the host table.
    fn finish_write_back(&mut self) -> Result<()> {
        if let Some(w) = self.write_back_in_flight.take() {
            let data = w.data.wait()?;
            let unpacked = self.unpack(&data, &w.rows);
            self.out.host = Some(data);
            self.out.idx = Some(w.idx.wait()?);
            unpacked?;
        }
        Ok(())
    }

    /// Enqueues, once, the scatter of the rows a prefetch is copying on the copy stream into
    /// their slots, on the compute stream after their copy: work enqueued on the compute
    /// stream afterwards sees them, without the host waiting.
    pub(crate) fn enqueue_admitted(&mut self) -> Result<()> {
        let rb = self.stride * 4;
        let Some(a) = self.admit_in_flight.as_mut().filter(|a| !a.scattered) else {
            return Ok(());
        };
        self.device.wait_event(&self.stream, &self.on_copy_in)?;
        crate::ops::embedding::device::scatter_rows(
            &self.device,
            &self.stream,
            self.inn.dev.view(0, a.rows * rb)?,
            rb,
            self.inn.idx_dev.view(0, a.rows * 4)?,
            self.cache.view(0, self.cache.len())?,
        )?;
        a.scattered = true;
        Ok(())
    }

    /// Orders the compute stream after the transfers in flight, without the host waiting: the
    /// admitted rows' scatter is enqueued, and the compute stream waits on the device for the
    /// write-back's copy to the host. The host's next read of the compute stream's work then
    /// sees them done, and the next [`EmbeddingCache::settle`] waits for nothing more.
    pub(crate) fn join_in_flight(&mut self) -> Result<()> {
        self.enqueue_admitted()?;
        if self.write_back_in_flight.is_some() {
            self.device.record(&self.copy_out, &self.on_copy_out)?;
            self.device.wait_event(&self.stream, &self.on_copy_out)?;
        }
        Ok(())
    }

    /// Orders a copy stream after everything enqueued on the compute stream so far.
    fn copy_after_compute(&self, copy: &Stream) -> Result<()> {
        self.device.record(&self.stream, &self.on_compute)?;
        self.device.wait_event(copy, &self.on_compute)
    }

    /// Copies staged rows into their host rows.
    fn unpack(&mut self, stage: &HostBuffer, rows: &[u32]) -> Result<()> {
        let stride = self.stride;
        let src = stage.typed::<f32>()?;
        let host = self.host.typed_mut::<f32>()?;
        for (i, &row) in rows.iter().enumerate() {
            let r = row as usize * stride;
            host[r..r + stride].copy_from_slice(&src[i * stride..(i + 1) * stride]);
        }
        Ok(())
    }

    /// Copies host rows into a staging buffer.
    fn pack(&self, stage: &mut HostBuffer, moves: &[(u32, u32)]) -> Result<()> {
        let stride = self.stride;
        let dst = stage.typed_mut::<f32>()?;
        let host = self.host.typed::<f32>()?;
        for (i, &(_, row)) in moves.iter().enumerate() {
            let r = row as usize * stride;
            dst[i * stride..(i + 1) * stride].copy_from_slice(&host[r..r + stride]);
        }
        Ok(())
    }

    /// Starts the write-back of at most `staging_rows` moves: their slots are uploaded on the
    /// device → host copy stream, the rows gathered on the compute stream and copied to the
    /// host on the copy stream.
    fn write_back_async(&mut self, moves: &[(u32, u32)]) -> Result<()> {
        let (k, rb) = (moves.len(), self.stride * 4);
        self.copy_after_compute(&self.copy_out)?;
        let idx = self.out.fill_slots(moves.iter().map(|m| m.0))?;
        let idx =
            self.device
                .copy_h2d_part(&self.copy_out, idx, 0, self.out.idx_dev.view(0, k * 4)?)?;
        self.device.record(&self.copy_out, &self.on_copy_out)?;
        self.device.wait_event(&self.stream, &self.on_copy_out)?;
        crate::ops::embedding::device::gather_rows(
            &self.device,
            &self.stream,
            self.cache.view(0, self.cache.len())?,
            rb,
            self.out.idx_dev.view(0, k * 4)?,
            self.out.dev.view(0, k * rb)?,
        )?;
        self.copy_after_compute(&self.copy_out)?;
        let host = take(&mut self.out.host)?;
        let data =
            self.device
                .copy_d2h_part(&self.copy_out, self.out.dev.view(0, k * rb)?, host, 0)?;
        self.write_back_in_flight = Some(WriteBackInFlight {
            rows: moves.iter().map(|m| m.1).collect(),
            data,
            idx,
        });
        self.moved.d2h_rows += k as u64;
        self.moved.d2h_bytes += (k * rb) as u64;
        Ok(())
    }

    /// Starts the admission of at most `staging_rows` moves: rows and slots are copied to the
    /// device on the host → device copy stream; [`EmbeddingCache::enqueue_admitted`] scatters
    /// them.
    fn admit_async(&mut self, moves: &[(u32, u32)]) -> Result<()> {
        let (k, rb) = (moves.len(), self.stride * 4);
        self.copy_after_compute(&self.copy_in)?;
        let mut host = take(&mut self.inn.host)?;
        if let Err(e) = self.pack(&mut host, moves) {
            self.inn.host = Some(host);
            return Err(e);
        }
        let data =
            self.device
                .copy_h2d_part(&self.copy_in, host, 0, self.inn.dev.view(0, k * rb)?)?;
        let idx = self.inn.fill_slots(moves.iter().map(|m| m.0))?;
        let idx =
            self.device
                .copy_h2d_part(&self.copy_in, idx, 0, self.inn.idx_dev.view(0, k * 4)?)?;
        self.device.record(&self.copy_in, &self.on_copy_in)?;
        self.admit_in_flight = Some(AdmitInFlight {
            rows: k,
            scattered: false,
            data,
            idx,
        });
        self.moved.h2d_rows += k as u64;
        self.moved.h2d_bytes += (k * rb) as u64;
        Ok(())
    }

    /// Marks the rows in `slots` as changed on the device.
    pub fn mark_dirty(&mut self, slots: &[u32]) -> Result<()> {
        self.index.mark_dirty(slots)
    }

    /// Writes every dirty cached row back to the host table. Returns the rows written.
    pub fn flush(&mut self) -> Result<usize> {
        self.settle()?;
        let dirty = self.index.take_dirty();
        let r = self.write_back(&dirty);
        self.poison(r)?;
        Ok(dirty.len())
    }

    /// Flushes and empties the cache: every slot becomes free.
    pub fn clear(&mut self) -> Result<()> {
        self.flush()?;
        self.index.clear()
    }

    /// The current value of rows `ids` (embedding and state, `stride` floats each), from the
    /// device for cached rows and the host table for the others.
    pub fn read_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.check_settled("reading rows")?;
        let rows = self.index.rows_of(ids)?;
        let host = self.host.typed::<f32>()?;
        let mut out = Vec::with_capacity(ids.len() * self.stride);
        let rb = self.stride * 4;
        for &row in &rows {
            match self.index.slot_of_row(row) {
                Some(slot) => {
                    let bytes = self
                        .device
                        .download(&self.stream, self.cache.view(slot as usize * rb, rb)?)?;
                    out.extend_from_slice(bytemuck::cast_slice(&bytes));
                }
                None => {
                    let o = row as usize * self.stride;
                    out.extend_from_slice(&host[o..o + self.stride]);
                }
            }
        }
        Ok(out)
    }

    /// Flushes, then returns the whole table in id order: `rows × dim` embeddings and
    /// `rows × state` optimizer state.
    pub fn to_vecs(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        self.flush()?;
        let (dim, stride) = (self.dim, self.stride);
        let host = self.host.typed::<f32>()?;
        let mut w = Vec::with_capacity(self.rows * dim);
        let mut s = Vec::with_capacity(self.rows * (stride - dim));
        for &row in self.index.permutation() {
            let r = &host[row as usize * stride..(row as usize + 1) * stride];
            w.extend_from_slice(&r[..dim]);
            s.extend_from_slice(&r[dim..]);
        }
        Ok((w, s))
    }

    /// The host table in host-row order (stale for dirty cached rows until a flush). Fails
    /// while a prefetch's transfers are in flight.
    pub fn host_table(&self) -> Result<&[f32]> {
        self.check_settled("reading the host table")?;
        self.host.typed::<f32>()
    }

    /// Saves the table in id order as safetensors (`weight`: `rows × dim`; `state`:
    /// `rows × state` when the rows carry optimizer state: f32, or `U32` bits where it holds
    /// 8-bit moments), after a flush.
    pub fn save(&mut self, path: impl AsRef<Path>) -> Result<()> {
        self.save_with(path.as_ref(), &BTreeMap::new())?.persist()
    }

    /// [`EmbeddingCache::save`] with `metadata` added to the file's, short of putting the file
    /// in place.
    pub(crate) fn save_with(
        &mut self,
        path: &Path,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Written> {
        self.flush()?;
        let host = self.host.typed::<f32>()?;
        super::checkpoint::save(
            path,
            host,
            self.index.permutation(),
            self.dim,
            self.stride,
            metadata,
            self.state_bits,
        )
    }

    /// Loads a table saved by [`EmbeddingCache::save`] (same rows, dim and state), discarding
    /// the cache's contents.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        self.load_with(path.as_ref(), |_| Ok(())).map(drop)
    }

    /// [`EmbeddingCache::load`], with `check` of the file's metadata run before anything
    /// changes; returns the metadata.
    pub(crate) fn load_with(
        &mut self,
        path: &Path,
        check: impl FnOnce(&BTreeMap<String, String>) -> Result<()>,
    ) -> Result<BTreeMap<String, String>> {
        // Read fully before changing anything.
        let (w, s, meta) = self.read_table(path)?;
        check(&meta)?;
        self.apply_table(&w, &s)?;
        Ok(meta)
    }

    /// Reads and checks a table checkpoint for this cache (rows, dim, state) without changing
    /// anything: weights and state in id order, and the file's metadata.
    pub(crate) fn read_table(&self, path: &Path) -> Result<super::checkpoint::Loaded> {
        super::checkpoint::load(path, self.rows, self.dim, self.stride - self.dim)
    }

    /// Puts weights and state read by [`EmbeddingCache::read_table`] in the host table, after
    /// emptying the cache.
    pub(crate) fn apply_table(&mut self, w: &[f32], s: &[f32]) -> Result<()> {
        let (dim, stride) = (self.dim, self.stride);
        self.settle()?;
        self.index.forget_dirty();
        self.index.clear()?;
        let perm = self.index.permutation().to_vec();
        let host = self.host.typed_mut::<f32>()?;
        for (id, &row) in perm.iter().enumerate() {
            let r = &mut host[row as usize * stride..(row as usize + 1) * stride];
            r[..dim].copy_from_slice(&w[id * dim..(id + 1) * dim]);
            r[dim..].copy_from_slice(&s[id * (stride - dim)..(id + 1) * (stride - dim)]);
        }
        Ok(())
    }

    /// Copies the rows in `moves` (`(slot, host row)`) device → host, `staging_rows` at a
    /// time, waiting for each.
    fn write_back(&mut self, moves: &[(u32, u32)]) -> Result<()> {
        for chunk in moves.chunks(self.staging_rows) {
            self.write_back_async(chunk)?;
            self.finish_write_back()?;
        }
        Ok(())
    }

    /// Copies the rows in `moves` (`(slot, host row)`) host → device, `staging_rows` at a
    /// time, waiting for each.
    fn admit(&mut self, moves: &[(u32, u32)]) -> Result<()> {
        for chunk in moves.chunks(self.staging_rows) {
            self.admit_async(chunk)?;
            self.enqueue_admitted()?;
            self.finish_admit()?;
        }
        Ok(())
    }
}
