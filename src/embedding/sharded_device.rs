//! The device-resident all-to-all of [`ShardedEmbedding`]: the forward and backward of
//! [`ShardedEmbedding::forward_device`] and [`ShardedEmbedding::backward_device`].
//!
//! The local collection's output is sample-major ([`CachedEmbeddingCollection::forward_device_interleaved`]),
//! `[bags, local tables, local width]`, so rank `q`'s samples are one contiguous block of it,
//! `[n_q, local tables, local width]`: it is sent as it lies. Each received block is put into
//! this rank's output `[my_bags·tables, dim]` (sample-major) by [`copy_rows`]: table-wise into
//! rows `s·tables + t` of the sender's tables, column-wise into the sender's columns
//! `[c0, c1)` of every row. The backward packs the gradient per peer with the inverse copy and
//! receives each peer's part straight into its samples' block of the local gradient.
//!
//! Streams: the exchange runs on the embedding's own stream ([`ShardedEmbedding::stream`]).
//! It waits (an event) for the local forward on the cache's stream before sending the local
//! output, and the cache's stream waits for the exchange before the next forward rewrites
//! that output; the local backward waits for the gradient's arrival, and the next exchange
//! waits for the backward before it rewrites the local gradient. Pairs exchange in rank order
//! (the lower rank sends first), as the host all-to-all does.

use super::{batch_slice, ShardedEmbedding, Sharding};
use crate::comm::Elem;
use crate::device::{Device, DeviceBuffer, DeviceView, Stream};
use crate::embedding::{CachedEmbeddingCollection, TableBatch};
use crate::error::{Error, Result};
use crate::ops::copy_rows::{copy_rows, CopyRows, RowIndex};

/// What the device exchange keeps between calls.
pub(super) struct DeviceState {
    /// The stream the exchange runs on.
    stream: Stream,
    /// This rank's output, `[my_bags·tables, dim]`, and its length in bytes.
    out: Option<DeviceBuffer>,
    out_len: usize,
    /// One peer's block in flight (forward: received; backward: packed).
    stage: Option<DeviceBuffer>,
    /// The local collection's output gradient, `[bags, local tables, local width]`.
    grad: Option<DeviceBuffer>,
    /// Table-wise: for the batch size it was made for, each rank's rows `s·tables + t` of
    /// this rank's output (its tables, sample-major).
    rows: Option<(usize, Vec<RowIndex>)>,
    /// The buffer the model writes this rank's output gradient into, lent out by
    /// [`ShardedEmbedding::take_grad_buffer`] and given back by
    /// [`ShardedEmbedding::keep_grad_buffer`], so a step allocates none.
    lent: Option<DeviceBuffer>,
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceState")
            .field("out_len", &self.out_len)
            .finish_non_exhaustive()
    }
}

impl DeviceState {
    pub(super) fn new(dev: &Device) -> Result<Self> {
        Ok(Self {
            stream: dev.new_stream()?,
            out: None,
            out_len: 0,
            stage: None,
            grad: None,
            rows: None,
            lent: None,
        })
    }

    pub(super) fn stream(&self) -> &Stream {
        &self.stream
    }
}

/// `b` waits for what is enqueued on `a` so far.
fn order_after(dev: &Device, a: &Stream, b: &Stream) -> Result<()> {
    let ev = dev.new_event()?;
    dev.record(a, &ev)?;
    dev.wait_event(b, &ev)
}

/// A buffer of at least `bytes` (one of at least 4 bytes is kept, so none is empty).
fn at_least<'a>(
    dev: &Device,
    buf: &'a mut Option<DeviceBuffer>,
    bytes: usize,
) -> Result<&'a DeviceBuffer> {
    if buf.as_ref().is_none_or(|b| b.len() < bytes) {
        *buf = None;
        *buf = Some(dev.alloc(bytes.max(4))?);
    }
    Ok(buf.as_ref().expect("just set"))
}

/// Which phase of the last forward the backward has to follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Last {
    /// No forward yet.
    None,
    /// [`ShardedEmbedding::forward`].
    Host,
    /// [`ShardedEmbedding::forward_device`].
    Device,
}

impl ShardedEmbedding {
    /// A device buffer of at least `bytes` (f32 gradients of [`ShardedEmbedding::output`],
    /// which a model writes while it still reads the output), lent to the caller: the one
    /// [`ShardedEmbedding::keep_grad_buffer`] gave back when it is large enough, else a new
    /// one. Steps that give it back allocate nothing.
    pub fn take_grad_buffer(&mut self, bytes: usize) -> Result<DeviceBuffer> {
        match self.device.lent.take() {
            Some(b) if b.len() >= bytes.max(4) => Ok(b),
            _ => self.comm.device().alloc(bytes.max(4)),
        }
    }

    /// Gives back a buffer from [`ShardedEmbedding::take_grad_buffer`] for the next step (the
    /// work queued on it stays ordered: a device buffer's accesses are tracked).
    pub fn keep_grad_buffer(&mut self, buf: DeviceBuffer) {
        self.device.lent = Some(buf);
    }

    /// [`ShardedEmbedding::forward`] kept on the device: this rank's samples
    /// ([`batch_slice`]) of every table in [`ShardedEmbedding::output`], sample-major
    /// `[my_bags·tables, dim]` f32 (row `s·tables + t` is this rank's sample `s`'s vector of
    /// table `t`), the layout of a DLRM's interaction input. Returns this rank's number of
    /// samples. The output is written on [`ShardedEmbedding::stream`]; work on another stream
    /// orders itself after it with an event, and the next forward (on that stream) must be
    /// ordered after its readers. The values are those of [`ShardedEmbedding::forward`], bit
    /// for bit, in the other layout. Checked and agreed as [`ShardedEmbedding::forward`] is: a
    /// rank whose own tables' forward fails makes every rank fail. Every rank must call it.
    pub fn forward_device(&mut self, batch: &[TableBatch<'_>]) -> Result<usize> {
        let bags = self.check_global_batch(batch)?;
        let out = match self.local.as_mut() {
            Some(local) => {
                let mine: Vec<TableBatch<'_>> =
                    self.local_tables.iter().map(|&t| batch[t]).collect();
                local.forward_device_interleaved(&mine).map(drop)
            }
            None => Ok(()),
        };
        self.comm.agree(out.is_ok())?;
        out?;
        self.bags = bags;
        self.last = Last::None;
        let (a, b) = batch_slice(bags, self.comm.world(), self.comm.rank());
        self.exchange_forward()?;
        self.last = Last::Device;
        Ok(b - a)
    }

    /// This rank's output of the last [`ShardedEmbedding::forward_device`]: `[my_bags·tables,
    /// dim]` f32, sample-major, written on [`ShardedEmbedding::stream`].
    pub fn output(&self) -> Result<DeviceView<'_>> {
        match (&self.device.out, self.last) {
            (Some(b), Last::Device) => b.view(0, self.device.out_len),
            _ => Err(Error::OutOfOrder {
                call: "output",
                needs: "forward_device",
            }),
        }
    }

    /// The stream the device forward writes [`ShardedEmbedding::output`] on and the device
    /// backward reads its gradient on.
    pub fn stream(&self) -> &Stream {
        self.device.stream()
    }

    /// The backward of the last [`ShardedEmbedding::forward_device`] from the gradient of its
    /// output (f32, `[my_bags·tables, dim]` sample-major), read on [`ShardedEmbedding::stream`]:
    /// it must be written there or behind an event that stream waits for (the view may be
    /// dropped after the call; its buffer is freed only after the reads). The gradients travel
    /// back on the device to the ranks holding the rows, whose collections compute their
    /// sparse gradients from the same values as after [`ShardedEmbedding::backward`]. Returns
    /// the distinct rows of this rank's collection (0 without one). A gradient of the wrong
    /// size ([`Error::Length`]), or no device forward before ([`Error::OutOfOrder`]), fails before
    /// anything is sent. Every rank must call it.
    pub fn backward_device(&mut self, grad: DeviceView<'_>) -> Result<usize> {
        if self.last != Last::Device {
            return Err(Error::OutOfOrder {
                call: "backward_device",
                needs: "forward_device (the host forward's layout differs)",
            });
        }
        let (a, b) = batch_slice(self.bags, self.comm.world(), self.comm.rank());
        let want = self.owner.len() * (b - a) * self.dim * 4;
        if grad.len() != want {
            return Err(Error::Length {
                what: format!(
                    "bytes of gradient for {} tables × {} samples × {} f32",
                    self.owner.len(),
                    b - a,
                    self.dim
                ),
                got: grad.len(),
                expected: want,
            });
        }
        self.exchange_backward(grad)?;
        let dev = self.comm.device().clone();
        let Some(local) = self.local.as_mut() else {
            return Ok(0);
        };
        let len = self.bags * self.local_tables.len() * local_width(local) * 4;
        let g = self
            .device
            .grad
            .as_ref()
            .expect("allocated by the exchange");
        order_after(&dev, &self.device.stream, local.stream())?;
        let rows = local.backward_device(g.view(0, len)?);
        // the next exchange rewrites the local gradient after the backward's reads
        order_after(&dev, local.stream(), &self.device.stream)?;
        rows
    }

    /// The checks every forward makes of the global batch; returns its number of bags.
    pub(super) fn check_global_batch(&self, batch: &[TableBatch<'_>]) -> Result<usize> {
        let tables = self.owner.len();
        if batch.len() != tables {
            return Err(Error::Length {
                what: "tables of a batch for the sharded tables".into(),
                got: batch.len(),
                expected: tables,
            });
        }
        let bags = batch[0].offsets.len().saturating_sub(1);
        if let Some(t) = batch.iter().position(|b| b.offsets.len() != bags + 1) {
            return Err(Error::Length {
                what: format!(
                    "bags of table {t}, as many as table 0 has (one bag per sample in every table)"
                ),
                got: batch[t].offsets.len().saturating_sub(1),
                expected: bags,
            });
        }
        Ok(bags)
    }

    /// Rank `p`'s samples `[a, b)`.
    fn samples(&self, p: usize) -> (usize, usize) {
        batch_slice(self.bags, self.comm.world(), p)
    }

    /// The tables rank `p` holds, in global order.
    fn tables_of(&self, p: usize) -> Vec<usize> {
        match self.sharding {
            Sharding::TableWise => (0..self.owner.len())
                .filter(|&t| self.owner[t] == p)
                .collect(),
            Sharding::ColumnWise => (0..self.owner.len()).collect(),
        }
    }

    /// Table-wise: each rank's rows of this rank's output for the current batch size, uploaded
    /// once per batch size.
    fn output_rows(&mut self) -> Result<()> {
        if self.sharding != Sharding::TableWise
            || self
                .device
                .rows
                .as_ref()
                .is_some_and(|(b, _)| *b == self.bags)
        {
            return Ok(());
        }
        let (a, b) = self.samples(self.comm.rank());
        let tables = self.owner.len();
        let dev = self.comm.device().clone();
        let mut all = Vec::with_capacity(self.comm.world());
        for p in 0..self.comm.world() {
            let mine = self.tables_of(p);
            let rows: Vec<u32> = (0..b - a)
                .flat_map(|s| mine.iter().map(move |&t| (s * tables + t) as u32))
                .collect();
            all.push(RowIndex::upload(&dev, &self.device.stream, &rows)?);
        }
        self.device.rows = Some((self.bags, all));
        Ok(())
    }

    /// The copy between rank `p`'s block (`[n, p's tables, p's width]`, packed) and this
    /// rank's output or gradient (`[n·tables, dim]`): `(plan, column offset)`. `unpack` copies
    /// the block into the output; otherwise the output's rows into the block.
    fn block_copy(&self, p: usize, unpack: bool) -> (CopyRows<'_>, usize) {
        let (a, b) = self.samples(self.comm.rank());
        let n = b - a;
        let tables = self.owner.len();
        match self.sharding {
            Sharding::TableWise => {
                let rows = self.device.rows.as_ref().map(|(_, r)| &r[p]);
                let plan = CopyRows {
                    n: n * self.tables_of(p).len(),
                    width: self.dim,
                    src_stride: self.dim,
                    dst_stride: self.dim,
                    src_index: if unpack { None } else { rows },
                    dst_index: if unpack { rows } else { None },
                };
                (plan, 0)
            }
            Sharding::ColumnWise => {
                let (c0, c1) = self.cols[p];
                let w = c1 - c0;
                let (src_stride, dst_stride) = if unpack { (w, self.dim) } else { (self.dim, w) };
                let plan = CopyRows {
                    n: n * tables,
                    width: w,
                    src_stride,
                    dst_stride,
                    src_index: None,
                    dst_index: None,
                };
                (plan, c0)
            }
        }
    }

    /// Sends every rank its samples of the local output and puts every rank's block into this
    /// rank's output.
    fn exchange_forward(&mut self) -> Result<()> {
        let dev = self.comm.device().clone();
        let (world, me) = (self.comm.world(), self.comm.rank());
        let (a, b) = self.samples(me);
        self.output_rows()?;
        self.device.out_len = (b - a) * self.owner.len() * self.dim * 4;
        at_least(&dev, &mut self.device.out, self.device.out_len)?;
        let stage_len = (0..world)
            .filter(|&p| p != me)
            .map(|p| self.part_len(p, me))
            .max()
            .unwrap_or(0);
        at_least(&dev, &mut self.device.stage, stage_len * 4)?;
        let st = &self.device.stream;
        if let Some(local) = &self.local {
            order_after(&dev, local.stream(), st)?;
        }
        let this = &*self;
        let out = this.device.out.as_ref().expect("allocated");
        let out = out.view(0, this.device.out_len)?;
        let stage = this.device.stage.as_ref().expect("allocated");
        // rank q's samples of the local output: one block of rows
        let local_out = this.local.as_ref().map(|l| l.output()).transpose()?;
        let block = |q: usize| -> Result<Option<DeviceView<'_>>> {
            let (qa, qb) = this.samples(q);
            let row = local_out
                .as_ref()
                .map_or(0, |o| o.len() / (this.bags.max(1) * 4));
            local_out
                .as_ref()
                .filter(|_| qb > qa && row > 0)
                .map(|o| o.slice(qa * row * 4, (qb - qa) * row * 4))
                .transpose()
        };
        let put = |p: usize, src: DeviceView<'_>| -> Result<()> {
            let (plan, c0) = this.block_copy(p, true);
            let dst = out.slice(c0 * 4, out.len().saturating_sub(c0 * 4))?;
            copy_rows(&dev, st, src, dst, &plan)
        };
        for p in 0..world {
            if p == me {
                if let Some(src) = block(me)? {
                    put(me, src)?;
                }
                continue;
            }
            let send = || -> Result<()> {
                match block(p)? {
                    Some(v) => this.comm.send(st, v, Elem::F32, p),
                    None => Ok(()),
                }
            };
            let recv = || -> Result<()> {
                let n = this.part_len(p, me);
                if n == 0 {
                    return Ok(());
                }
                let v = stage.view(0, n * 4)?;
                this.comm.recv(st, v, Elem::F32, p)?;
                put(p, v)
            };
            if me < p {
                send()?;
                recv()?;
            } else {
                recv()?;
                send()?;
            }
        }
        // the next local forward rewrites the local output after these reads
        if let Some(local) = &this.local {
            order_after(&dev, st, local.stream())?;
        }
        Ok(())
    }

    /// Sends every rank its part of this rank's gradient (packed) and receives every rank's
    /// part of the local gradient into its samples' block.
    fn exchange_backward(&mut self, grad: DeviceView<'_>) -> Result<()> {
        let dev = self.comm.device().clone();
        let (world, me) = (self.comm.world(), self.comm.rank());
        self.output_rows()?;
        let row = self
            .local
            .as_ref()
            .map_or(0, |l| self.local_tables.len() * local_width(l));
        at_least(&dev, &mut self.device.grad, self.bags * row * 4)?;
        let stage_len = (0..world)
            .filter(|&p| p != me)
            .map(|p| self.part_len(p, me))
            .max()
            .unwrap_or(0);
        at_least(&dev, &mut self.device.stage, stage_len * 4)?;
        let this = &*self;
        let st = &this.device.stream;
        let local_grad = this.device.grad.as_ref().expect("allocated");
        let stage = this.device.stage.as_ref().expect("allocated");
        // rank p's samples of the local gradient
        let block = |p: usize| -> Result<DeviceView<'_>> {
            let (pa, pb) = this.samples(p);
            local_grad.view(pa * row * 4, (pb - pa) * row * 4)
        };
        let pack = |p: usize, dst: DeviceView<'_>| -> Result<()> {
            let (plan, c0) = this.block_copy(p, false);
            let src = grad.slice(c0 * 4, grad.len().saturating_sub(c0 * 4))?;
            copy_rows(&dev, st, src, dst, &plan)
        };
        for p in 0..world {
            if p == me {
                if row > 0 {
                    pack(me, block(me)?)?;
                }
                continue;
            }
            let send = || -> Result<()> {
                let n = this.part_len(p, me);
                if n == 0 {
                    return Ok(());
                }
                let v = stage.view(0, n * 4)?;
                pack(p, v)?;
                this.comm.send(st, v, Elem::F32, p)
            };
            let recv = || -> Result<()> {
                if this.part_len(me, p) == 0 {
                    return Ok(());
                }
                this.comm.recv(st, block(p)?, Elem::F32, p)
            };
            if me < p {
                send()?;
                recv()?;
            } else {
                recv()?;
                send()?;
            }
        }
        Ok(())
    }
}

/// The width of the local collection's rows.
fn local_width(local: &CachedEmbeddingCollection) -> usize {
    local.bag().cache().dim()
}
