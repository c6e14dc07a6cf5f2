//! Typed views of fetched tensors: read-only parameters and writable gradient slots.

use std::fmt;

use super::host::Host;
use super::TOKEN;
use crate::chunk::{decode, encode};
use crate::device::{DeviceView, HostBuffer, Input};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A fetched parameter on the device, read-only, with its shape and element type; it borrows
/// its [`Guard`](super::Guard), so it cannot outlive the release.
///
/// Read-only by construction: it converts into an [`Input`] — what every typed op takes for the
/// operands it reads (`ops::gelu_forward(dev, stream, &w, y, dtype)`) and what
/// [`Operand::input`](crate::device::Operand::input) makes a launch refuse in a written slot —
/// and into no [`DeviceView`], the type ops take for what they write, so no op can be handed it
/// as a destination. It also reads itself on the pass's compute stream: [`ReadView::copy_to`],
/// [`ReadView::cast_to`], [`ReadView::download`]. (A write into a parameter during forward
/// would be lost: the chunk counts as clean and may be dropped without a write-back.)
///
/// ```compile_fail,E0277
/// # use tidemem::prelude::*;
/// # fn f(pass: &ForwardPass<'_>, w: TensorId, out: &Block) -> Result<()> {
/// let guard = pass.fetch(&[w])?;
/// let dst: DeviceView<'_> = guard.param(0)?.into(); // error: no writable view of a parameter
/// pass.device().memset(pass.stream(), dst, 0)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct ReadView<'g> {
    view: DeviceView<'g>,
    dtype: DType,
    shape: &'g [usize],
    host: &'g dyn Host,
}

impl fmt::Debug for ReadView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadView")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

impl<'g> ReadView<'g> {
    pub(super) fn new(
        view: DeviceView<'g>,
        dtype: DType,
        shape: &'g [usize],
        host: &'g dyn Host,
    ) -> Self {
        ReadView {
            view,
            dtype,
            shape,
            host,
        }
    }

    /// Element type (the store's parameter dtype).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape the tensor was registered with.
    pub fn shape(&self) -> &'g [usize] {
        self.shape
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.view.len() / self.dtype.size()
    }

    /// Bytes.
    pub fn len_bytes(&self) -> usize {
        self.view.len()
    }

    /// The memory as a read operand, for the crate's device ops.
    pub(crate) fn device_view(&self) -> DeviceView<'g> {
        self.view
    }

    /// Copies the parameter into `dst` (of [`ReadView::len_bytes`]) on the compute stream.
    pub fn copy_to<'b>(&self, dst: impl Into<DeviceView<'b>>) -> Result<()> {
        let h = self.host.handles();
        h.device.copy_d2d(&h.stream, self.device_view(), dst)
    }

    /// Converts the parameter into `dst`, of element type `to`, on the compute stream.
    pub fn cast_to<'b>(&self, dst: impl Into<DeviceView<'b>>, to: DType) -> Result<()> {
        let h = self.host.handles();
        crate::ops::cast(
            &h.device,
            &h.stream,
            self.device_view(),
            self.dtype,
            dst,
            to,
        )
    }

    /// The parameter's bytes on the host (after the work enqueued on the compute stream).
    pub fn download(&self) -> Result<Vec<u8>> {
        self.host.store().wait_compute(TOKEN)?;
        let h = self.host.handles();
        h.device.download(&h.stream, self.device_view())
    }

    /// The parameter's values as f32 on the host.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        Ok(decode(&self.download()?, self.dtype))
    }
}

impl<'g> From<ReadView<'g>> for Input<'g> {
    fn from(v: ReadView<'g>) -> Self {
        Input::new(v.view)
    }
}

impl<'g> From<&ReadView<'g>> for Input<'g> {
    fn from(v: &ReadView<'g>) -> Self {
        Input::new(v.view)
    }
}

/// The gradient slot of a fetched parameter at its last backward use, for a kernel to write
/// into, with its shape and element type (the parameter dtype); from [`Guard::grad`], which
/// counted the gradient written. It is the parameter's own memory.
///
/// [`Guard::grad`]: super::Guard::grad
#[derive(Clone, Copy)]
pub struct GradView<'g> {
    view: DeviceView<'g>,
    dtype: DType,
    shape: &'g [usize],
    host: &'g dyn Host,
}

impl fmt::Debug for GradView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GradView")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

impl<'g> GradView<'g> {
    pub(super) fn new(
        view: DeviceView<'g>,
        dtype: DType,
        shape: &'g [usize],
        host: &'g dyn Host,
    ) -> Self {
        GradView {
            view,
            dtype,
            shape,
            host,
        }
    }

    /// The slot's memory, the destination of the kernel that computes the gradient.
    pub fn view(&self) -> DeviceView<'g> {
        self.view
    }

    /// Element type (the store's parameter dtype).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape the tensor was registered with.
    pub fn shape(&self) -> &'g [usize] {
        self.shape
    }

    /// Elements.
    pub(crate) fn numel(&self) -> usize {
        self.view.len() / self.dtype.size()
    }

    /// Bytes.
    pub fn len_bytes(&self) -> usize {
        self.view.len()
    }

    /// Writes the gradient from host values (converted to the parameter dtype) on the compute
    /// stream, and waits for the copy: for gradients computed on the host.
    pub fn upload_f32(&self, grad: &[f32]) -> Result<()> {
        if grad.len() != self.numel() {
            return Err(Error::SizeMismatch {
                src: grad.len(),
                dst: self.numel(),
            });
        }
        upload(self.host, &encode(grad, self.dtype), self.view)
    }
}

impl<'g> From<GradView<'g>> for DeviceView<'g> {
    fn from(g: GradView<'g>) -> Self {
        g.view
    }
}

impl<'g> From<&GradView<'g>> for DeviceView<'g> {
    fn from(g: &GradView<'g>) -> Self {
        g.view
    }
}

/// Copies host `bytes` into `dst` on the compute stream and waits for the copy.
pub(super) fn upload(host: &dyn Host, bytes: &[u8], dst: DeviceView<'_>) -> Result<()> {
    let h = host.handles();
    let copy = h
        .device
        .copy_h2d(&h.stream, HostBuffer::from_slice(bytes)?, dst)?;
    host.store().wait_compute(TOKEN)?;
    copy.wait()?;
    Ok(())
}

/// `acc += src` elementwise, `acc` f32 and `src` of `dtype`, both on the device, on the compute
/// stream ([`crate::ops::accumulate()`]).
pub(super) fn add_into(
    host: &dyn Host,
    acc: DeviceView<'_>,
    src: DeviceView<'_>,
    dtype: DType,
) -> Result<()> {
    let h = host.handles();
    crate::ops::accumulate(&h.device, &h.stream, src, dtype, acc)
}
