//! Embedding bags over a cached table ([`CachedEmbeddingBag`]) and over a fully resident host
//! table ([`EmbeddingBag`], the reference the cached bag must equal).
//!
//! A batch is given PyTorch-style: `indices` (ids of every bag, concatenated), `offsets` (where
//! each bag starts, with the total length appended: `bags + 1` entries) and optional
//! per-sample weights. Forward sums (or averages) each bag's rows; backward produces one
//! gradient per distinct row (sparse); the optimizer updates only those rows, each with the
//! optimizer state stored in its own row, so the state moves with the row between host and
//! device.

use super::cache::{CacheConfig, EmbeddingCache};
use super::index::CachePlan;
use crate::checkpoint::Written;
use crate::device::{Device, DeviceBuffer, HostBuffer, HostPhase, Pending, Stream};
use crate::error::{Error, Result};
use crate::ops::embedding::{
    bag_backward, bag_forward, plan_backward, row_step, BagMode, EmbeddingOptimizer, SparseGradPlan,
};

/// Checks a batch's shape before anything changes: offsets non-decreasing from 0 to
/// `indices.len()`, one weight per index, weights only with sum mode.
fn check_batch(indices: &[u32], offsets: &[u32], weights: Option<&[f32]>) -> Result<usize> {
    if offsets.is_empty() {
        return Err(Error::BadOffsets {
            table: None,
            at: 0,
            why: "there are none; they need bags + 1 entries, the number of indices last",
        });
    }
    if offsets[0] != 0 || *offsets.last().expect("non-empty") as usize != indices.len() {
        return Err(if offsets[0] != 0 {
            Error::BadOffsets {
                table: None,
                at: 0,
                why: "the first must be 0",
            }
        } else {
            Error::BadOffsets {
                table: None,
                at: offsets.len() - 1,
                why: "the last must be the number of indices",
            }
        });
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::BadOffsets {
            table: None,
            at: i + 1,
            why: "they must not decrease",
        });
    }
    if let Some(w) = weights {
        if w.len() != indices.len() {
            return Err(Error::Length {
                what: "per-sample weights for the indices".into(),
                got: w.len(),
                expected: indices.len(),
            });
        }
    }
    Ok(offsets.len() - 1)
}

/// A bag over a fully resident host table: the reference for [`CachedEmbeddingBag`], and the
/// "everything resident" baseline.
#[derive(Clone, Debug)]
pub struct EmbeddingBag {
    table: Vec<f32>,
    rows: usize,
    dim: usize,
    stride: usize,
    mode: BagMode,
    optimizer: EmbeddingOptimizer,
    step: u64,
    last: Option<(SparseGradPlan, usize)>,
    grads: Vec<f32>,
}

impl EmbeddingBag {
    /// A bag over `weights` (`rows × dim`, row-major by id).
    pub fn new(
        weights: &[f32],
        dim: usize,
        mode: BagMode,
        optimizer: EmbeddingOptimizer,
    ) -> Result<Self> {
        if dim == 0 || weights.is_empty() || !weights.len().is_multiple_of(dim) {
            return Err(if dim == 0 {
                Error::TooFew {
                    what: "dim of an embedding bag".into(),
                    got: dim,
                    need: 1,
                }
            } else if weights.is_empty() {
                Error::Empty {
                    what: "the weights of an embedding bag".into(),
                }
            } else {
                Error::NotMultiple {
                    what: "weights",
                    value: weights.len(),
                    of: "the embedding dim",
                    divisor: dim,
                }
            });
        }
        let rows = weights.len() / dim;
        let stride = dim + optimizer.state_len(dim);
        let mut table = vec![0f32; rows * stride];
        for (r, w) in table
            .chunks_exact_mut(stride)
            .zip(weights.chunks_exact(dim))
        {
            r[..dim].copy_from_slice(w);
        }
        Ok(Self {
            table,
            rows,
            dim,
            stride,
            mode,
            optimizer,
            step: 0,
            last: None,
            grads: Vec::new(),
        })
    }

    /// Forward: `bags × dim` outputs.
    pub fn forward(
        &mut self,
        indices: &[u32],
        offsets: &[u32],
        weights: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let bags = check_batch(indices, offsets, weights)?;
        if let Some((i, &id)) = indices
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= self.rows)
        {
            return Err(Error::IdOutOfRange {
                table: None,
                id: u64::from(id),
                position: i,
                rows: self.rows,
            });
        }
        let mut out = vec![0f32; bags * self.dim];
        bag_forward(
            &self.table,
            self.stride,
            self.dim,
            indices,
            offsets,
            weights,
            self.mode,
            &mut out,
        )?;
        self.last = Some((plan_backward(indices, offsets, weights, self.mode)?, bags));
        Ok(out)
    }

    /// Backward of the last forward: the distinct ids (first-occurrence order) and their
    /// gradients (`dim` floats each).
    pub fn backward(&mut self, grad_out: &[f32]) -> Result<(Vec<u32>, Vec<f32>)> {
        let (plan, bags) = self.last.as_ref().ok_or(Error::OutOfOrder {
            call: "backward",
            needs: "a forward",
        })?;
        if grad_out.len() != bags * self.dim {
            return Err(Error::Length {
                what: format!("output gradients for {bags} bags of {}", self.dim),
                got: grad_out.len(),
                expected: bags * self.dim,
            });
        }
        self.grads = vec![0f32; plan.rows.len() * self.dim];
        bag_backward(
            grad_out,
            self.dim,
            &plan.row_ptr,
            &plan.entries,
            &plan.scale,
            &mut self.grads,
        )?;
        Ok((plan.rows.clone(), self.grads.clone()))
    }

    /// Applies the optimizer to the rows of the last backward.
    pub fn step(&mut self) -> Result<()> {
        let (plan, _) = self.last.take().ok_or(Error::OutOfOrder {
            call: "step",
            needs: "a backward",
        })?;
        if self.grads.len() != plan.rows.len() * self.dim {
            return Err(Error::OutOfOrder {
                call: "step",
                needs: "a backward",
            });
        }
        self.step += 1;
        row_step(
            &mut self.table,
            self.stride,
            self.dim,
            &plan.rows,
            &self.grads,
            &self.optimizer,
            self.step,
        )?;
        self.grads.clear();
        Ok(())
    }

    /// The table in id order: `rows × dim` embeddings and `rows × state` optimizer state.
    pub fn to_vecs(&self) -> (Vec<f32>, Vec<f32>) {
        let mut w = Vec::with_capacity(self.rows * self.dim);
        let mut s = Vec::new();
        for r in self.table.chunks_exact(self.stride) {
            w.extend_from_slice(&r[..self.dim]);
            s.extend_from_slice(&r[self.dim..]);
        }
        (w, s)
    }
}

/// A device buffer reused across batches, grown when a batch needs more, filled from a
/// page-locked staging buffer whose copy is left in flight on the stream (work enqueued after
/// it on the same stream sees the data; the host does not wait).
#[derive(Debug, Default)]
struct Scratch {
    buf: Option<DeviceBuffer>,
    host: Option<HostBuffer>,
    in_flight: Option<Pending<HostBuffer>>,
}

impl Scratch {
    /// Copies `data` to the start of the buffer (growing it) on `stream`.
    fn put(&mut self, device: &Device, stream: &Stream, data: &[u8]) -> Result<()> {
        // The last copy has long completed in the usual case: its staging comes back at once.
        if let Some(p) = self.in_flight.take() {
            self.host = Some(p.wait()?);
        }
        self.reserve(device, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let mut host = match self.host.take() {
            Some(h) if h.len() >= data.len() => h,
            _ => device.alloc_host(data.len().next_power_of_two())?,
        };
        host.typed_mut::<u8>()?[..data.len()].copy_from_slice(data);
        let buf = self.buf.as_ref().expect("reserved");
        self.in_flight = Some(device.copy_h2d_part(stream, host, 0, buf.view(0, data.len())?)?);
        Ok(())
    }

    fn reserve(&mut self, device: &Device, bytes: usize) -> Result<()> {
        let have = self.buf.as_ref().map_or(0, |b| b.len());
        if have < bytes.max(4) {
            self.buf = None;
            self.buf = Some(device.alloc(bytes.max(4).next_power_of_two())?);
        }
        Ok(())
    }

    fn device_bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    fn view(&self, bytes: usize) -> Result<crate::device::DeviceView<'_>> {
        self.buf
            .as_ref()
            .ok_or_else(|| Error::Internal {
                what: "a scratch buffer used before it was reserved".into(),
            })?
            .view(0, bytes)
    }
}

/// What a forward leaves for its backward and step.
#[derive(Debug)]
struct Saved {
    plan: SparseGradPlan,
    bags: usize,
    backward_done: bool,
}

/// An embedding bag whose table lives in host memory with its hottest rows cached on a device
/// (see [`EmbeddingCache`]). Forward, backward and the optimizer run on the cache's device;
/// rows updated by the optimizer are dirty and reach the host when evicted or flushed.
///
/// On the simulated device the results are bitwise those of [`EmbeddingBag`] over the whole
/// table, for every optimizer (same kernels, same order of accumulation).
#[derive(Debug)]
pub struct CachedEmbeddingBag {
    cache: EmbeddingCache,
    mode: BagMode,
    optimizer: EmbeddingOptimizer,
    step: u64,
    saved: Option<Saved>,
    slots: Scratch,
    offsets: Scratch,
    weights: Scratch,
    out: Scratch,
    grad_out: Scratch,
    row_ptr: Scratch,
    entries: Scratch,
    scale: Scratch,
    unique: Scratch,
    grads: Scratch,
}

/// The metadata key of a bag checkpoint's step count.
const STEPS_KEY: &str = "bag.steps";

/// A bag checkpoint read and checked, not yet in place.
pub(crate) struct BagCheckpoint {
    weights: Vec<f32>,
    state: Vec<f32>,
    steps: u64,
    /// The file's metadata.
    pub meta: std::collections::BTreeMap<String, String>,
}

impl BagCheckpoint {
    /// The step count it holds.
    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }
}

impl CachedEmbeddingBag {
    /// A bag on `device` over a table set by `init(id, row)`; `config.state` is set from the
    /// optimizer.
    pub fn new(
        device: Device,
        config: CacheConfig,
        mode: BagMode,
        optimizer: EmbeddingOptimizer,
        init: impl FnMut(u32, &mut [f32]),
    ) -> Result<Self> {
        let state = optimizer.state_len(config.dim);
        let config = config.state(state).state_bits(optimizer.packed_state());
        let cache = EmbeddingCache::new(device, config, init)?;
        Ok(Self {
            cache,
            mode,
            optimizer,
            step: 0,
            saved: None,
            slots: Scratch::default(),
            offsets: Scratch::default(),
            weights: Scratch::default(),
            out: Scratch::default(),
            grad_out: Scratch::default(),
            row_ptr: Scratch::default(),
            entries: Scratch::default(),
            scale: Scratch::default(),
            unique: Scratch::default(),
            grads: Scratch::default(),
        })
    }

    /// Bytes of device memory the bag holds: the cache's rows and staging, and the buffers of
    /// the last batch (indices, offsets, weights, output, output gradient, backward plan and
    /// row gradients; grown to the largest batch so far).
    pub fn device_bytes(&self) -> usize {
        self.cache.device_bytes()
            + [
                &self.slots,
                &self.offsets,
                &self.weights,
                &self.out,
                &self.grad_out,
                &self.row_ptr,
                &self.entries,
                &self.scale,
                &self.unique,
                &self.grads,
            ]
            .iter()
            .map(|s| s.device_bytes())
            .sum::<usize>()
    }

    /// The cache (index, moves, reorder, checkpoints).
    pub fn cache(&self) -> &EmbeddingCache {
        &self.cache
    }

    /// The cache, mutably. Reordering or clearing it between a forward and its step discards
    /// the pending gradient.
    pub fn cache_mut(&mut self) -> &mut EmbeddingCache {
        self.saved = None;
        &mut self.cache
    }

    /// Saves the table and every row's optimizer state in id order ([`EmbeddingCache::save`])
    /// with the step count (row-wise Adam's bias correction) in the file's metadata, so that
    /// [`CachedEmbeddingBag::load`] resumes training bit for bit. Between a forward and its
    /// step (or after an evaluation forward) it saves the table as it is before that step.
    pub fn save(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.save_unpersisted(path.as_ref(), &Default::default())?
            .persist()
    }

    /// [`CachedEmbeddingBag::save`] with `metadata` added, short of putting the file in place.
    pub(crate) fn save_unpersisted(
        &mut self,
        path: &std::path::Path,
        metadata: &std::collections::BTreeMap<String, String>,
    ) -> Result<Written> {
        let mut meta = metadata.clone();
        meta.insert(STEPS_KEY.to_string(), self.step.to_string());
        self.cache.save_with(path, &meta)
    }

    /// Loads a checkpoint of [`CachedEmbeddingBag::save`] (same rows, dim and optimizer state),
    /// its step count included, discarding the cache's contents. Checked whole before anything
    /// changes. Between steps only.
    pub fn load(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let read = self.read_checkpoint(path.as_ref())?;
        self.apply_checkpoint(read)
    }

    /// Reads and checks a checkpoint of [`CachedEmbeddingBag::save`] without changing
    /// anything.
    pub(crate) fn read_checkpoint(&self, path: &std::path::Path) -> Result<BagCheckpoint> {
        self.between_steps("load")?;
        let (weights, state, meta) = self.cache.read_table(path)?;
        let steps = meta
            .get(STEPS_KEY)
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| Error::Checkpoint {
                path: path.to_path_buf(),
                what: format!(
                    "no '{STEPS_KEY}' (saved by EmbeddingCache::save rather than the bag? \
                         load it through cache_mut())"
                ),
            })?;
        Ok(BagCheckpoint {
            weights,
            state,
            steps,
            meta,
        })
    }

    /// Puts a checkpoint read by [`CachedEmbeddingBag::read_checkpoint`] in place.
    pub(crate) fn apply_checkpoint(&mut self, c: BagCheckpoint) -> Result<()> {
        self.between_steps("load")?;
        self.cache.apply_table(&c.weights, &c.state)?;
        self.step = c.steps;
        Ok(())
    }

    /// Ready for [`CachedEmbeddingBag::apply_checkpoint`] not to fail: between steps, and the
    /// cache's transfers settled (which fails on a cache a transfer left unusable).
    pub(crate) fn ready_to_load(&mut self) -> Result<()> {
        self.between_steps("load")?;
        self.cache.settle()
    }

    fn between_steps(&self, what: &'static str) -> Result<()> {
        match self.saved {
            Some(_) => Err(Error::OutOfOrder {
                call: what,
                needs: "the step of the last forward (it runs between steps)",
            }),
            None => Ok(()),
        }
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Forward on the device: makes the batch's rows resident, then reduces each bag into the
    /// returned `bags × dim` floats. Bad input (ids out of range, offsets not monotonic,
    /// mismatched lengths, more distinct rows than slots) fails and changes nothing.
    pub fn forward(
        &mut self,
        indices: &[u32],
        offsets: &[u32],
        weights: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let bags = self.forward_device(indices, offsets, weights)?;
        let dim = self.cache.dim();
        let bytes = self
            .cache
            .device()
            .download(self.cache.stream(), self.out.view(bags * dim * 4)?)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Makes the rows of the next `batches` (their indices) resident at once, so that their
    /// forwards, backwards and steps move nothing (provided no other batch runs in between).
    /// May be called between a forward and its step: that batch's rows stay cached. The union
    /// (with a batch in flight) must fit in the cache. Returns the union's plan (see
    /// [`EmbeddingCache::prefetch`]).
    pub fn prefetch(&mut self, batches: &[&[u32]]) -> Result<CachePlan> {
        let keep = self.saved.as_ref().map_or(&[][..], |s| &s.plan.rows[..]);
        let _span = self.cache.device().host_span(HostPhase::Embedding);
        self.cache.prefetch(batches, keep)
    }

    /// Orders the compute stream after the transfers in flight on the device (see
    /// `EmbeddingCache::join_in_flight`); keeps a batch in flight.
    pub(crate) fn join_in_flight(&mut self) -> Result<()> {
        self.cache.join_in_flight()
    }

    /// Waits for the transfers of the last prefetch (see [`EmbeddingCache::settle`]); the next
    /// forward does it anyway. Keeps a batch in flight.
    pub fn settle(&mut self) -> Result<()> {
        self.cache.settle()
    }

    /// [`CachedEmbeddingBag::forward`] leaving the output on the device
    /// ([`CachedEmbeddingBag::output`]); returns the number of bags.
    pub fn forward_device(
        &mut self,
        indices: &[u32],
        offsets: &[u32],
        weights: Option<&[f32]>,
    ) -> Result<usize> {
        let bags = check_batch(indices, offsets, weights)?;
        self.saved = None;
        let span = self.cache.device().host_span(HostPhase::Embedding);
        let plan = self.cache.prepare_deferred(indices, true)?;
        let grad_plan = plan_backward(&plan.slots, offsets, weights, self.mode)?;
        drop(span);
        let (dev, s) = (self.cache.device().clone(), self.cache.stream());
        let dim = self.cache.dim();
        self.slots.put(&dev, s, bytemuck::cast_slice(&plan.slots))?;
        self.offsets.put(&dev, s, bytemuck::cast_slice(offsets))?;
        if let Some(w) = weights {
            self.weights.put(&dev, s, bytemuck::cast_slice(w))?;
        }
        self.out.reserve(&dev, bags * dim * 4)?;
        // Rows a prefetch is still copying reach their slots before the kernel reads them;
        // the uploads above did not wait for them.
        self.cache.enqueue_admitted()?;
        let table = self.cache.device_table();
        crate::ops::embedding::device::embedding_bag(
            &dev,
            self.cache.stream(),
            table.view(0, table.len())?,
            self.cache.stride(),
            dim,
            self.slots.view(indices.len() * 4)?,
            self.offsets.view(offsets.len() * 4)?,
            match weights {
                Some(w) => Some(self.weights.view(w.len() * 4)?),
                None => None,
            },
            self.mode,
            self.out.view(bags * dim * 4)?,
        )?;
        self.saved = Some(Saved {
            plan: grad_plan,
            bags,
            backward_done: false,
        });
        Ok(bags)
    }

    /// The device output of the last forward (`bags × dim` f32).
    pub fn output(&self) -> Result<crate::device::DeviceView<'_>> {
        let bags = self
            .saved
            .as_ref()
            .ok_or(Error::OutOfOrder {
                call: "reading the output",
                needs: "a forward",
            })?
            .bags;
        self.out.view(bags * self.cache.dim() * 4)
    }

    /// Backward of the last forward from the output gradient (`bags × dim`): computes one
    /// gradient per distinct row on the device. Returns the number of distinct rows.
    pub fn backward(&mut self, grad_out: &[f32]) -> Result<usize> {
        let dim = self.cache.dim();
        let bags = self.pending_bags()?;
        if grad_out.len() != bags * dim {
            return Err(Error::Length {
                what: format!("output gradients for {bags} bags of {dim}"),
                got: grad_out.len(),
                expected: bags * dim,
            });
        }
        let dev = self.cache.device().clone();
        self.grad_out
            .put(&dev, self.cache.stream(), bytemuck::cast_slice(grad_out))?;
        self.backward_from_scratch(None)
    }

    /// [`CachedEmbeddingBag::backward`] from an output gradient already on the device
    /// (`bags × dim` f32), e.g. written by the dense part of the model. It must be ordered
    /// before work on the cache's stream (written on that stream, or behind an event it waits
    /// for).
    pub fn backward_device(&mut self, grad_out: crate::device::DeviceView<'_>) -> Result<usize> {
        let dim = self.cache.dim();
        let bags = self.pending_bags()?;
        if grad_out.len() != bags * dim * 4 {
            return Err(Error::Length {
                what: format!("bytes of output gradient for {bags} bags of {dim} f32"),
                got: grad_out.len(),
                expected: bags * dim * 4,
            });
        }
        self.backward_from_scratch(Some(grad_out))
    }

    fn pending_bags(&self) -> Result<usize> {
        Ok(self
            .saved
            .as_ref()
            .ok_or(Error::OutOfOrder {
                call: "backward",
                needs: "a forward",
            })?
            .bags)
    }

    /// The backward kernel from `grad_out`, or from the scratch buffer it was uploaded to.
    fn backward_from_scratch(
        &mut self,
        grad_out: Option<crate::device::DeviceView<'_>>,
    ) -> Result<usize> {
        let dim = self.cache.dim();
        let saved = self.saved.as_mut().expect("checked by the caller");
        let (dev, s) = (self.cache.device().clone(), self.cache.stream());
        let p = &saved.plan;
        let u = p.rows.len();
        self.row_ptr
            .put(&dev, s, bytemuck::cast_slice(&p.row_ptr))?;
        self.entries
            .put(&dev, s, bytemuck::cast_slice(&p.entries))?;
        self.scale.put(&dev, s, bytemuck::cast_slice(&p.scale))?;
        self.unique.put(&dev, s, bytemuck::cast_slice(&p.rows))?;
        self.grads.reserve(&dev, u * dim * 4)?;
        let grad_out = match grad_out {
            Some(g) => g,
            None => self.grad_out.view(saved.bags * dim * 4)?,
        };
        crate::ops::embedding::device::embedding_backward(
            &dev,
            s,
            grad_out,
            dim,
            self.row_ptr.view(p.row_ptr.len() * 4)?,
            self.entries.view(p.entries.len() * 4)?,
            self.scale.view(p.scale.len() * 4)?,
            self.grads.view(u * dim * 4)?,
        )?;
        saved.backward_done = true;
        Ok(u)
    }

    /// The sparse gradient of the last backward, downloaded: the distinct ids in
    /// first-occurrence order and `dim` floats for each.
    pub fn sparse_grad(&self, indices: &[u32]) -> Result<(Vec<u32>, Vec<f32>)> {
        let saved = self
            .saved
            .as_ref()
            .filter(|s| s.backward_done)
            .ok_or(Error::OutOfOrder {
                call: "reading the gradient",
                needs: "a backward",
            })?;
        let mut ids = Vec::with_capacity(saved.plan.rows.len());
        let mut seen = std::collections::HashSet::new();
        for &id in indices {
            if seen.insert(id) {
                ids.push(id);
            }
        }
        if ids.len() != saved.plan.rows.len() {
            return Err(Error::Length {
                what: "distinct ids of the indices, against those of the last forward".into(),
                got: ids.len(),
                expected: saved.plan.rows.len(),
            });
        }
        let bytes = self.cache.device().download(
            self.cache.stream(),
            self.grads.view(ids.len() * self.cache.dim() * 4)?,
        )?;
        Ok((ids, bytemuck::pod_collect_to_vec(&bytes)))
    }

    /// Applies the optimizer to the rows of the last backward, in their cache slots, and marks
    /// them dirty.
    pub fn step(&mut self) -> Result<()> {
        let saved = self
            .saved
            .take()
            .filter(|s| s.backward_done)
            .ok_or(Error::OutOfOrder {
                call: "step",
                needs: "a backward",
            })?;
        debug_assert!(
            {
                let mut r = saved.plan.rows.clone();
                r.sort_unstable();
                r.windows(2).all(|w| w[0] != w[1])
            },
            "the rows of a step are distinct"
        );
        self.step += 1;
        let dim = self.cache.dim();
        let u = saved.plan.rows.len();
        let dev = self.cache.device().clone();
        let table = self.cache.device_table();
        crate::ops::embedding::device::embedding_step(
            &dev,
            self.cache.stream(),
            table.view(0, table.len())?,
            self.cache.stride(),
            dim,
            self.unique.view(u * 4)?,
            self.grads.view(u * dim * 4)?,
            &self.optimizer,
            self.step,
        )?;
        self.cache.mark_dirty(&saved.plan.rows)
    }
}
