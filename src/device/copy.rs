//! Stream-ordered copies and fills, and foreign (library) work: how every operation is stamped
//! with the stream-ordering clocks and handed to the backend.

use std::sync::atomic::Ordering;

use super::order::{Access, AccessRecord, Clock};
use super::{
    Device, DeviceBuffer, DeviceView, ForeignCall, HostBuffer, Input, Op, Pending, RawBuffer,
    RawEvent, Stream,
};
use crate::error::{Error, Result};

/// Detached copies ([`Device::upload_to`]) the device keeps in flight at most.
const MAX_DETACHED: usize = 256;

/// Bytes of staging buffers the device keeps for later uploads at most.
const MAX_STAGING: usize = 64 << 20;

impl Device {
    /// Stamps and enqueues an op touching `accesses` under the clock lock, so the stamp order
    /// equals the enqueue order.
    pub(super) fn submit(
        &self,
        stream: &Stream,
        accesses: &[(&DeviceBuffer, Access)],
        op: Op<'_>,
    ) -> Result<Clock> {
        self.check("stream", stream.device)?;
        for (b, _) in accesses {
            self.check("buffer", b.device)?;
        }
        let mut clocks = self.inner.clocks.lock();
        // Lock each distinct buffer once (a buffer may be both read and written).
        let mut distinct: Vec<(&DeviceBuffer, Access)> = Vec::with_capacity(accesses.len());
        for &(b, a) in accesses {
            match distinct.iter_mut().find(|(d, _)| std::ptr::eq(*d, b)) {
                Some(d) if a == Access::Write => d.1 = Access::Write,
                Some(_) => {}
                None => distinct.push((b, a)),
            }
        }
        let mut guards: Vec<_> = distinct.iter().map(|(b, _)| b.access.lock()).collect();
        let mut recs: Vec<(&mut AccessRecord, u64, Access)> = guards
            .iter_mut()
            .zip(&distinct)
            .map(|(g, (b, a))| (&mut **g, b.id, *a))
            .collect();
        clocks.stamp(stream.slot, &mut recs)?;
        // SAFETY: callers pass host pointers owned by a `Pending` that outlives the copy (its
        // event is recorded right after, and it blocks on that event before releasing them),
        // or by a detached copy the device frees only once the host has seen it finish.
        unsafe { self.inner.backend.enqueue(&stream.raw, op)? };
        Ok(clocks.snapshot(stream.slot))
    }

    /// Records a private event after the last op of `stream` for a `Pending`.
    fn pending<T>(&self, stream: &Stream, value: T, clock: Clock) -> Result<Pending<T>> {
        let (value, event) = self.record_after(stream, value)?;
        Ok(Pending {
            value: Some(value),
            event,
            clock,
            device: self.clone(),
        })
    }

    /// Records a private event after the last op of `stream`, which reads or writes `value`'s
    /// host memory; returns both. On a failure the stream is drained before `value` goes (or
    /// `value` is leaked if even that fails).
    fn record_after<T>(&self, stream: &Stream, value: T) -> Result<(T, RawEvent)> {
        let event = match self
            .inner
            .backend
            .new_event()
            .and_then(|e| self.inner.backend.record(&stream.raw, &e).map(|_| e))
        {
            Ok(e) => e,
            Err(err) => {
                // without an event the copy cannot be awaited
                self.release_drained(stream, value);
                return Err(err);
            }
        };
        Ok((value, event))
    }

    /// Lets go of `value`, host memory work on `stream` may still touch, once the stream is
    /// drained (or leaks it if even that fails).
    fn release_drained<T>(&self, stream: &Stream, value: T) {
        match self.inner.backend.sync_stream(&stream.raw) {
            Ok(()) => drop(value),
            Err(_) => std::mem::forget(value),
        }
    }

    /// Enqueues the copy of `src[src_offset..]` into `dst` (in bounds: the caller checked) and
    /// hands the buffer back as a [`Pending`]. If the copy is refused, `src` goes once `stream`
    /// is drained: work ordered before it on `stream` may still write the buffer.
    fn enqueue_h2d(
        &self,
        stream: &Stream,
        src: HostBuffer,
        src_offset: usize,
        dst: DeviceView<'_>,
    ) -> Result<Pending<HostBuffer>> {
        let op = Op::HostToDevice {
            // SAFETY: the caller checked `src_offset + dst.len <= src.len()`.
            src: unsafe { src.as_ptr().add(src_offset) },
            dst: &dst.buf.raw,
            dst_offset: dst.offset,
            len: dst.len,
        };
        let clock = match self.submit(stream, &[(dst.buf, Access::Write)], op) {
            Ok(c) => c,
            Err(e) => {
                self.release_drained(stream, src);
                return Err(e);
            }
        };
        let c = &self.inner.counters;
        c.h2d_bytes.fetch_add(dst.len as u64, Ordering::Relaxed);
        c.h2d_copies.fetch_add(1, Ordering::Relaxed);
        self.pending(stream, src, clock)
    }

    /// Copies all of `src` into `dst` asynchronously on `stream`. The host buffer comes back from
    /// [`Pending::wait`] once the copy is done.
    pub fn copy_h2d<'a>(
        &self,
        stream: &Stream,
        src: HostBuffer,
        dst: impl Into<DeviceView<'a>>,
    ) -> Result<Pending<HostBuffer>> {
        let dst = dst.into();
        if src.len() != dst.len {
            return Err(Error::SizeMismatch {
                src: src.len(),
                dst: dst.len,
            });
        }
        self.copy_h2d_part(stream, src, 0, dst)
    }

    /// Copies `dst.len()` bytes of `src` starting at `src_offset` into `dst` asynchronously on
    /// `stream`, for staging buffers filled only in part. The host buffer comes back from
    /// [`Pending::wait`] once the copy is done.
    pub(crate) fn copy_h2d_part<'a>(
        &self,
        stream: &Stream,
        src: HostBuffer,
        src_offset: usize,
        dst: impl Into<DeviceView<'a>>,
    ) -> Result<Pending<HostBuffer>> {
        let dst = dst.into();
        if src_offset
            .checked_add(dst.len)
            .is_none_or(|end| end > src.len())
        {
            return Err(Error::OutOfBounds {
                offset: src_offset,
                len: dst.len,
                buffer_len: src.len(),
            });
        }
        self.enqueue_h2d(stream, src, src_offset, dst)
    }

    /// Copies the host buffer of a copy still in flight, `src`, into `dst` on `stream` once that
    /// copy is done, without the host waiting: `stream` waits for it on the device. For a chunk
    /// loaded again while its write-back to that buffer is still under way. The buffer comes
    /// back from the returned [`Pending`].
    pub(crate) fn copy_h2d_after<'a>(
        &self,
        stream: &Stream,
        src: Pending<HostBuffer>,
        dst: impl Into<DeviceView<'a>>,
    ) -> Result<Pending<HostBuffer>> {
        let dst = dst.into();
        // on every refusal before the copy, `src` drops, waiting for its copy
        self.check("pending copy", src.device.id())?;
        self.check("stream", stream.device)?;
        let len = src.value.as_ref().map_or(0, HostBuffer::len);
        if len != dst.len {
            return Err(Error::SizeMismatch {
                src: len,
                dst: dst.len,
            });
        }
        self.wait_raw(stream, &src.event, &src.clock)?;
        let mut src = src;
        let buf = src
            .value
            .take()
            .expect("a pending copy holds its buffer until waited");
        self.enqueue_h2d(stream, buf, 0, dst)
    }

    /// Copies `data` into `dst` on `stream` without waiting: the bytes go into a staging buffer
    /// (pinned on CUDA, where a copy from pageable memory would hold the host until the driver
    /// has staged it) the device keeps until the host has seen the copy finish (at a later wait
    /// that covers it), then reuses for later uploads, so nothing blocks here and a steady
    /// step allocates no host memory for its inputs. For the small inputs of a step (token ids,
    /// targets, plans) whose buffers nobody reads back.
    pub fn upload_to<'a>(
        &self,
        stream: &Stream,
        data: &[u8],
        dst: impl Into<DeviceView<'a>>,
    ) -> Result<()> {
        let dst = dst.into();
        if data.len() != dst.len {
            return Err(Error::SizeMismatch {
                src: data.len(),
                dst: dst.len,
            });
        }
        self.reap_detached()?;
        let mut buf = self.staging_buffer(data.len())?;
        buf[..data.len()].copy_from_slice(data);
        let op = Op::HostToDevice {
            src: buf.as_ptr(),
            dst: &dst.buf.raw,
            dst_offset: dst.offset,
            len: dst.len,
        };
        let clock = self.submit(stream, &[(dst.buf, Access::Write)], op)?;
        let c = &self.inner.counters;
        c.h2d_bytes.fetch_add(dst.len as u64, Ordering::Relaxed);
        c.h2d_copies.fetch_add(1, Ordering::Relaxed);
        let (buf, event) = self.record_after(stream, buf)?;
        self.inner
            .detached
            .lock()
            .push(super::Detached { buf, event, clock });
        Ok(())
    }

    /// A host buffer of at least `len` bytes for an upload: a kept staging buffer (the
    /// smallest that fits, at most twice the size), else a new one from
    /// [`Device::alloc_host`] (pinned on CUDA, so the copy is a DMA the host does not wait
    /// for), of `len` rounded up to a power of two. An upload of more than a quarter of
    /// [`MAX_STAGING`] goes through paged memory, never kept (a pinned buffer that large would
    /// be allocated and freed, with the device synchronisation that costs, for each).
    fn staging_buffer(&self, len: usize) -> Result<HostBuffer> {
        if len > MAX_STAGING / 4 {
            return HostBuffer::paged(len);
        }
        let kept = {
            let mut st = self.inner.staging.lock();
            let at = st
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len && b.len() <= 2 * len.max(4096))
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            at.map(|i| st.remove(i))
        };
        match kept {
            Some(b) => Ok(b),
            None => self.alloc_host(len.max(4096).next_power_of_two()),
        }
    }

    /// Keeps the staging buffers of finished uploads for the next ones, the most recent last,
    /// up to [`MAX_STAGING`] bytes: the least recently kept go first; paged ones (large
    /// uploads) are freed.
    fn keep_staging(&self, bufs: impl IntoIterator<Item = HostBuffer>) {
        let mut st = self.inner.staging.lock();
        for b in bufs {
            if b.len() > MAX_STAGING / 4 {
                continue;
            }
            let mut kept: usize = st.iter().map(|b| b.len()).sum();
            while kept + b.len() > MAX_STAGING && !st.is_empty() {
                kept -= st.remove(0).len();
            }
            st.push(b);
        }
    }

    /// Keeps (or frees) the host buffers of detached copies the host has seen finish; past
    /// [`MAX_DETACHED`] still in flight (a program that uploads and never waits), waits for the
    /// oldest, so their host memory stays bounded.
    fn reap_detached(&self) -> Result<()> {
        let mut d = self.inner.detached.lock();
        if d.is_empty() {
            return Ok(());
        }
        {
            let clocks = self.inner.clocks.lock();
            let (done, live): (Vec<_>, Vec<_>) =
                d.drain(..).partition(|x| clocks.observed(&x.clock));
            *d = live;
            drop(clocks);
            self.keep_staging(done.into_iter().map(|x| x.buf));
        }
        while d.len() >= MAX_DETACHED {
            let oldest = d.remove(0);
            if !self.inner.clocks.lock().observed(&oldest.clock) {
                super::Counters::add(&self.inner.counters.event_syncs);
            }
            let span = self.host_span(super::HostPhase::Waits);
            let done = self.inner.backend.sync_event(&oldest.event);
            drop(span);
            match done {
                Ok(()) => {
                    self.inner.clocks.lock().observe(&oldest.clock);
                    self.keep_staging([oldest.buf]);
                }
                Err(e) => {
                    // the copy may still read the buffer: leak it rather than free it
                    std::mem::forget(oldest.buf);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Copies `src` into all of `dst` asynchronously on `stream`. The filled host buffer comes
    /// back from [`Pending::wait`]; it cannot be read before.
    pub fn copy_d2h<'a>(
        &self,
        stream: &Stream,
        src: impl Into<Input<'a>>,
        dst: HostBuffer,
    ) -> Result<Pending<HostBuffer>> {
        let src: DeviceView<'_> = src.into().view;
        if src.len != dst.len() {
            return Err(Error::SizeMismatch {
                src: src.len,
                dst: dst.len(),
            });
        }
        self.copy_d2h_part(stream, src, dst, 0)
    }

    /// Copies all of `src` into `dst[dst_offset..dst_offset + src.len()]` asynchronously on
    /// `stream`. The host buffer comes back from [`Pending::wait`]; it cannot be read before.
    pub(crate) fn copy_d2h_part<'a>(
        &self,
        stream: &Stream,
        src: impl Into<Input<'a>>,
        mut dst: HostBuffer,
        dst_offset: usize,
    ) -> Result<Pending<HostBuffer>> {
        let src: DeviceView<'_> = src.into().view;
        if dst_offset
            .checked_add(src.len)
            .is_none_or(|end| end > dst.len())
        {
            return Err(Error::OutOfBounds {
                offset: dst_offset,
                len: src.len,
                buffer_len: dst.len(),
            });
        }
        let op = Op::DeviceToHost {
            src: &src.buf.raw,
            src_offset: src.offset,
            // SAFETY: `dst_offset + src.len <= dst.len()` was checked above.
            dst: unsafe { dst.as_mut_ptr().add(dst_offset) },
            len: src.len,
        };
        let clock = self.submit(stream, &[(src.buf, Access::Read)], op)?;
        let c = &self.inner.counters;
        c.d2h_bytes.fetch_add(src.len as u64, Ordering::Relaxed);
        c.d2h_copies.fetch_add(1, Ordering::Relaxed);
        self.pending(stream, dst, clock)
    }

    /// Copies between device ranges of equal length on `stream` (overlap within one buffer is
    /// handled like `memmove`).
    pub fn copy_d2d<'a, 'b>(
        &self,
        stream: &Stream,
        src: impl Into<Input<'a>>,
        dst: impl Into<DeviceView<'b>>,
    ) -> Result<()> {
        let (src, dst): (DeviceView<'_>, DeviceView<'_>) = (src.into().view, dst.into());
        if src.len != dst.len {
            return Err(Error::SizeMismatch {
                src: src.len,
                dst: dst.len,
            });
        }
        let op = Op::DeviceToDevice {
            src: &src.buf.raw,
            src_offset: src.offset,
            dst: &dst.buf.raw,
            dst_offset: dst.offset,
            len: src.len,
        };
        self.submit(
            stream,
            &[(src.buf, Access::Read), (dst.buf, Access::Write)],
            op,
        )?;
        let c = &self.inner.counters;
        c.d2d_bytes.fetch_add(src.len as u64, Ordering::Relaxed);
        c.d2d_copies.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Sets every byte of `dst` to `value` on `stream`.
    pub fn memset<'a>(
        &self,
        stream: &Stream,
        dst: impl Into<DeviceView<'a>>,
        value: u8,
    ) -> Result<()> {
        let dst = dst.into();
        let op = Op::Fill {
            dst: &dst.buf.raw,
            offset: dst.offset,
            len: dst.len,
            value,
        };
        self.submit(stream, &[(dst.buf, Access::Write)], op)?;
        super::Counters::add(&self.inner.counters.fills);
        Ok(())
    }

    /// Enqueues work of a library that takes raw device addresses (NCCL) on `stream`, ordered
    /// like every other op: `run` gets the address of each view (in order) and the backend's
    /// native stream handle. The simulated device has no device addresses and refuses it.
    pub(crate) fn enqueue_foreign(
        &self,
        stream: &Stream,
        views: &[(DeviceView<'_>, bool)],
        run: &mut dyn FnMut(&[u64], *mut std::ffi::c_void) -> Result<()>,
    ) -> Result<()> {
        let operands: Vec<(&RawBuffer, usize, bool)> = views
            .iter()
            .map(|(v, w)| (&v.buf.raw, v.offset, *w))
            .collect();
        let accesses: Vec<(&DeviceBuffer, Access)> = views
            .iter()
            .map(|(v, w)| (v.buf, if *w { Access::Write } else { Access::Read }))
            .collect();
        let op = Op::Foreign {
            operands: &operands,
            run: ForeignCall(run),
        };
        self.submit(stream, &accesses, op)?;
        super::Counters::add(&self.inner.counters.library_calls);
        Ok(())
    }
}
