//! The handles a user holds: device buffers and views of them, kernel operands, streams,
//! events, and pending asynchronous copies.

use std::fmt;

use parking_lot::Mutex;

use super::order::{AccessRecord, Clock};
use super::{Device, DeviceId, RawBuffer, RawEvent, RawStream};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A region of device memory.
pub struct DeviceBuffer {
    pub(super) raw: RawBuffer,
    pub(super) len: usize,
    pub(super) device: DeviceId,
    pub(super) id: u64,
    pub(super) access: Mutex<AccessRecord>,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("device", &self.device)
            .finish()
    }
}

impl DeviceBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device that owns this buffer.
    pub fn device(&self) -> DeviceId {
        self.device
    }
    /// A number unique among this device's buffers (used in error messages).
    pub fn id(&self) -> u64 {
        self.id
    }
    /// A view of `len` bytes starting at `offset`.
    pub fn view(&self, offset: usize, len: usize) -> Result<DeviceView<'_>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                buffer_len: self.len,
            });
        }
        Ok(DeviceView {
            buf: self,
            offset,
            len,
        })
    }
    /// The backend's handle (for backend implementors and kernels).
    pub fn raw(&self) -> &RawBuffer {
        &self.raw
    }
}

/// A byte range of a [`DeviceBuffer`]; `&DeviceBuffer` converts to a view of the whole buffer.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a> {
    pub(super) buf: &'a DeviceBuffer,
    pub(super) offset: usize,
    pub(super) len: usize,
}

impl<'a> DeviceView<'a> {
    /// The underlying buffer.
    pub fn buffer(&self) -> &'a DeviceBuffer {
        self.buf
    }
    /// Offset in bytes within the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether the two views share at least one byte (same buffer, intersecting ranges; an
    /// empty view overlaps nothing).
    pub(crate) fn overlaps(&self, other: &DeviceView<'_>) -> bool {
        std::ptr::eq(self.buf, other.buf)
            && self.len > 0
            && other.len > 0
            && self.offset < other.offset + other.len
            && other.offset < self.offset + self.len
    }
    /// The sub-view of `len` bytes at `offset` within this view.
    pub(crate) fn slice(&self, offset: usize, len: usize) -> Result<DeviceView<'a>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                buffer_len: self.len,
            });
        }
        Ok(DeviceView {
            buf: self.buf,
            offset: self.offset + offset,
            len,
        })
    }
}

impl<'a> From<&'a DeviceBuffer> for DeviceView<'a> {
    fn from(buf: &'a DeviceBuffer) -> Self {
        DeviceView {
            buf,
            offset: 0,
            len: buf.len,
        }
    }
}

/// A device range a kernel only reads: what the typed ops take for their inputs. A
/// [`DeviceView`] or a buffer converts into one; a read-only view of a parameter
/// (`store::ReadView`) converts into this and nothing else, so a parameter can be read in
/// place by any op but written by none.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    pub(super) view: DeviceView<'a>,
}

impl<'a> Input<'a> {
    /// A read-only range over `view` (for types above the device layer that hand out ranges
    /// only for reading).
    pub fn new(view: DeviceView<'a>) -> Self {
        Input { view }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.view.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.view.len == 0
    }
    /// Offset in bytes within its buffer.
    pub fn offset(&self) -> usize {
        self.view.offset
    }
    /// Whether this range shares a byte with `other`.
    pub fn overlaps(&self, other: &DeviceView<'_>) -> bool {
        self.view.overlaps(other)
    }
    /// The bytes `offset .. offset + len` of this range, still read-only; an error if they
    /// do not lie inside it.
    pub(crate) fn slice(&self, offset: usize, len: usize) -> Result<Input<'a>> {
        Ok(Input {
            view: self.view.slice(offset, len)?,
        })
    }
}

impl<'a> From<DeviceView<'a>> for Input<'a> {
    fn from(view: DeviceView<'a>) -> Self {
        Input { view }
    }
}

impl<'a> From<&'a DeviceBuffer> for Input<'a> {
    fn from(buf: &'a DeviceBuffer) -> Self {
        Input { view: buf.into() }
    }
}

/// One operand of [`Device::launch`]: a device range, its element type, and whether it may only
/// be read.
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    pub(super) view: DeviceView<'a>,
    pub(super) dtype: DType,
    pub(super) read_only: bool,
}

impl<'a> Operand<'a> {
    /// An operand of `dtype` elements over `view`, for any slot of a signature.
    pub fn new(view: impl Into<DeviceView<'a>>, dtype: DType) -> Self {
        Operand {
            view: view.into(),
            dtype,
            read_only: false,
        }
    }
    /// A read-only operand of `dtype` elements: [`Device::launch`] refuses it in a slot the
    /// kernel writes.
    pub fn input(input: impl Into<Input<'a>>, dtype: DType) -> Self {
        Operand {
            view: input.into().view,
            dtype,
            read_only: true,
        }
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.view.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.view.len == 0
    }
}

/// An ordered queue of device work. Operations on one stream run in order; different streams
/// run concurrently and are ordered only through [`Event`]s or host synchronisation.
pub struct Stream {
    pub(super) raw: RawStream,
    pub(super) device: DeviceId,
    pub(super) slot: usize,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("slot", &self.slot)
            .field("device", &self.device)
            .finish()
    }
}

impl Stream {
    /// Index of this stream on its device (as named in ordering errors).
    pub fn index(&self) -> usize {
        self.slot
    }
    /// The backend's handle (on CUDA a `CudaRawStream`).
    pub fn raw(&self) -> &RawStream {
        &self.raw
    }
}

/// A marker in a stream: completes when the work enqueued before it completes.
pub struct Event {
    pub(super) raw: RawEvent,
    pub(super) device: DeviceId,
    pub(super) clock: Mutex<Clock>,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device)
            .finish()
    }
}

/// The result of an asynchronous copy: it holds the host buffer the copy reads or writes, and
/// gives it back only once the copy has completed. Dropping a `Pending` blocks until the copy is
/// done (if the device fails, the buffer is leaked rather than freed under a running copy).
#[must_use = "a pending copy must be waited on to get its host buffer back"]
pub struct Pending<T> {
    pub(super) value: Option<T>,
    pub(super) event: RawEvent,
    pub(super) clock: Clock,
    pub(super) device: Device,
}

impl<T> fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("device", &self.device.id())
            .finish()
    }
}

impl<T> Pending<T> {
    /// The value the copy hands back, without waiting (for its size, not its contents).
    pub(crate) fn value(&self) -> Option<&T> {
        self.value.as_ref()
    }

    /// Whether the copy has completed (then [`Pending::wait`] does not block).
    pub fn is_ready(&self) -> Result<bool> {
        let done = self.device.inner.backend.query_event(&self.event)?;
        if done {
            // the host has seen it finish: waiting for it now does not block
            self.device.inner.clocks.lock().observe(&self.clock);
        }
        Ok(done)
    }

    /// Counts the wait for this copy as a blocking one unless the host has seen it finish.
    fn count_wait(&self) {
        if !self.device.inner.clocks.lock().observed(&self.clock) {
            super::Counters::add(&self.device.inner.counters.pending_waits);
        }
    }

    /// Blocks until the copy completes and returns the host buffer, on a thread other than the
    /// training thread: the wait is not counted as one of the host's blocking waits, not timed
    /// as a host phase, and does not mark the copy as seen (so the training thread's counts do
    /// not depend on when this thread ran).
    pub(crate) fn wait_quiet(mut self) -> Result<T> {
        self.device.inner.backend.bind_to_thread()?;
        match self.device.inner.backend.sync_event(&self.event) {
            Ok(()) => Ok(self.value.take().expect("value present until waited")),
            Err(e) => {
                // The copy may still touch the buffer: leak it rather than free it.
                std::mem::forget(self.value.take());
                Err(e)
            }
        }
    }

    /// Blocks until the copy completes and returns the host buffer.
    pub fn wait(mut self) -> Result<T> {
        self.count_wait();
        let span = self.device.host_span(super::HostPhase::Waits);
        let done = self.device.inner.backend.sync_event(&self.event);
        drop(span);
        match done {
            Ok(()) => {
                self.device.inner.clocks.lock().observe(&self.clock);
                Ok(self.value.take().expect("value present until waited"))
            }
            Err(e) => {
                // The copy may still touch the buffer: leak it rather than free it.
                std::mem::forget(self.value.take());
                Err(e)
            }
        }
    }
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        if let Some(v) = self.value.take() {
            self.count_wait();
            let span = self.device.host_span(super::HostPhase::Waits);
            let done = self.device.inner.backend.sync_event(&self.event);
            drop(span);
            match done {
                Ok(()) => {
                    self.device.inner.clocks.lock().observe(&self.clock);
                    drop(v)
                }
                Err(_) => std::mem::forget(v),
            }
        }
    }
}
