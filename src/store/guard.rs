//! The guard of one op's fetched tensors: views of their memory, gradient writes and shares,
//! and the release when it drops.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;

use super::host::{Backward, Host, PassKind, Sum};
use super::view::{GradView, ReadView};
use super::TOKEN;
use crate::chunk::TensorView;
use crate::device::{DeviceView, PoolBlock};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::TensorId;

/// Tensors fetched for one op, from [`Pass::fetch`](super::Pass::fetch); dropping the guard releases them (an
/// error from that release is returned by the pass's next call; [`Guard::release`] returns it
/// directly). Tensors are numbered in the order they were fetched.
///
/// Views borrow the guard, so none outlives the release:
///
/// ```compile_fail,E0597
/// # use tidemem::prelude::*;
/// # fn f(pass: &ForwardPass<'_>, w: TensorId) -> Result<()> {
/// let view = {
///     let guard = pass.fetch(&[w])?;
///     guard.param(0)?
/// }; // error: `guard` dropped here while still borrowed
/// view.to_f32()?;
/// # Ok(()) }
/// ```
///
/// A forward guard has no gradient to write:
///
/// ```compile_fail,E0599
/// # use tidemem::prelude::*;
/// # fn f(pass: &ForwardPass<'_>, w: TensorId) -> Result<()> {
/// let guard = pass.fetch(&[w])?;
/// guard.grad(0)?; // error: no method `grad` on a forward guard
/// # Ok(()) }
/// ```
pub struct Guard<'p, K: PassKind> {
    pub(super) host: &'p dyn Host,
    pub(super) ids: Vec<TensorId>,
    pub(super) views: Vec<TensorView>,
    pub(super) shapes: Vec<Vec<usize>>,
    /// Tensors whose gradient was written over their parameter through this guard.
    pub(super) overwritten: RefCell<Vec<bool>>,
    pub(super) open: bool,
    pub(super) _kind: PhantomData<fn() -> K>,
}

impl<K: PassKind> fmt::Debug for Guard<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("stage", &K::STAGE)
            .field("ids", &self.ids)
            .field("shapes", &self.shapes)
            .finish()
    }
}

impl<K: PassKind> Guard<'_, K> {
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the guard holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The tensors, in fetch order.
    pub fn ids(&self) -> &[TensorId] {
        &self.ids
    }

    /// The parameter of tensor `i`, read-only, in place on the device. In backward, read it
    /// before writing the gradient ([`Guard::grad`]), which overwrites it: afterwards this is
    /// an error.
    pub fn param(&self, i: usize) -> Result<ReadView<'_>> {
        let i = self.index(i)?;
        if self.overwritten.borrow()[i] {
            return Err(Error::Conflict {
                what: format!("reading the parameter of tensor {}", self.ids[i]),
                with: format!(
                    "its gradient, written over it in this guard: read param({i}) before writing \
                     grad({i})"
                ),
            });
        }
        Ok(ReadView::new(
            self.views[i].view(),
            self.views[i].dtype,
            &self.shapes[i],
            self.host,
        ))
    }

    /// Releases the tensors now, returning what the release says (dropping the guard does
    /// the same and hands an error to the pass).
    pub fn release(mut self) -> Result<()> {
        self.close()
    }

    fn index(&self, i: usize) -> Result<usize> {
        if i < self.ids.len() {
            Ok(i)
        } else {
            Err(Error::IndexOutOfRange {
                what: "guard tensor".into(),
                index: i,
                len: self.ids.len(),
            })
        }
    }

    fn close(&mut self) -> Result<()> {
        self.open = false;
        // the views go first: the store refuses a release while one is alive
        self.views.clear();
        match self.host.try_store() {
            Some(mut store) => store.release(&self.ids, self.host.release_stage()),
            None => Err(Error::Conflict {
                what: "the release of a dropped guard".into(),
                with: "its store, in use when the guard was dropped".into(),
            }),
        }
    }
}

impl<K: PassKind> Drop for Guard<'_, K> {
    fn drop(&mut self) {
        if self.open {
            if let Err(e) = self.close() {
                self.host.defer(e);
            }
        }
    }
}

impl Guard<'_, Backward> {
    /// The gradient slot of tensor `i`, for a kernel to write the gradient into, in the
    /// parameter dtype; the gradient counts as written. It is the parameter's own memory:
    /// enqueue every read of [`Guard::param`] first. Only at the tensor's last backward use
    /// (a parameter used more than once takes [`Guard::accumulate_grad`]).
    pub fn grad(&self, i: usize) -> Result<GradView<'_>> {
        let i = self.index(i)?;
        let id = self.ids[i];
        if self.host.sums().iter().any(|s| s.id == id) {
            return Err(Error::Conflict {
                what: format!("grad() of tensor {id}"),
                with: "a gradient accumulated over earlier uses: write its last share with \
                       accumulate_grad too"
                    .into(),
            });
        }
        self.host.store().mark_grad(id, TOKEN)?;
        self.overwritten.borrow_mut()[i] = true;
        Ok(GradView::new(
            self.views[i].view(),
            self.views[i].dtype,
            &self.shapes[i],
            self.host,
        ))
    }

    /// Adds this use's share of tensor `i`'s gradient (`src`: its elements, of type `dtype`)
    /// for a parameter used more than once (tied weights). Before the last backward use the
    /// shares add up in an f32 buffer from the pool; at the last, the sum goes into the
    /// gradient slot in the parameter dtype (so read [`Guard::param`] first) and counts as
    /// written. A parameter used once may take it too: its share is the gradient.
    /// Every step runs on the device, on the compute stream ([`crate::ops::accumulate()`] adds
    /// the shares, [`crate::ops::cast()`] converts).
    pub fn accumulate_grad<'a>(
        &self,
        i: usize,
        src: impl Into<DeviceView<'a>>,
        dtype: DType,
    ) -> Result<()> {
        let i = self.index(i)?;
        let (id, src) = (self.ids[i], src.into());
        let numel = self.views[i].numel;
        if src.len() != numel * dtype.size() {
            return Err(Error::SizeMismatch {
                src: src.len(),
                dst: numel * dtype.size(),
            });
        }
        let last = self.host.store().grad_use(id, TOKEN)?;
        let h = self.host.handles();
        let taken = {
            let mut sums = self.host.sums();
            let k = sums.iter().position(|s| s.id == id);
            k.map(|k| sums.swap_remove(k))
        };
        let Some(mut sum) = taken else {
            if last {
                // the only share: straight into the slot
                crate::ops::cast(
                    &h.device,
                    &h.stream,
                    src,
                    dtype,
                    self.views[i].view(),
                    h.dtype,
                )?;
                return self.written(i);
            }
            let buf = h.pool.alloc(numel * 4)?;
            crate::ops::cast(
                &h.device,
                &h.stream,
                src,
                dtype,
                buf.view(0, numel * 4)?,
                DType::F32,
            )?;
            self.host.sums().push(Sum { id, buf, uses: 1 });
            return Ok(());
        };
        let r = super::view::add_into(self.host, sum.buf.view(0, numel * 4)?, src, dtype);
        sum.uses += 1;
        if !last || r.is_err() {
            // kept for the next use (or for the pass to report)
            self.host.sums().push(sum);
            return r;
        }
        let sum_view = sum.buf.view(0, numel * 4)?;
        crate::ops::cast(
            &h.device,
            &h.stream,
            sum_view,
            DType::F32,
            self.views[i].view(),
            h.dtype,
        )?;
        self.written(i)
    }

    /// Takes the f32 sum of tensor `i`'s gradient shares that [`Guard::accumulate_grad`] added
    /// at earlier uses (a pool block of its elements as f32), leaving none: for a weight whose
    /// shares are combined with another process's copy (tied across pipeline stages) before
    /// its last share is written. `None` when no share was added.
    pub(crate) fn take_shares(&self, i: usize) -> Result<Option<PoolBlock>> {
        let i = self.index(i)?;
        let id = self.ids[i];
        let mut sums = self.host.sums();
        let k = sums.iter().position(|s| s.id == id);
        Ok(k.map(|k| sums.swap_remove(k).buf))
    }

    /// [`Guard::accumulate_grad`] from host values (uploaded into a pool buffer first).
    pub fn accumulate_grad_f32(&self, i: usize, grad: &[f32]) -> Result<()> {
        let h = self.host.handles();
        let bytes: &[u8] = bytemuck::cast_slice(grad);
        let buf = h.pool.alloc(bytes.len())?;
        let dst = buf.view(0, bytes.len())?;
        super::view::upload(self.host, bytes, dst)?;
        self.accumulate_grad(i, dst, DType::F32)
    }

    fn written(&self, i: usize) -> Result<()> {
        self.host.store().mark_grad(self.ids[i], TOKEN)?;
        self.overwritten.borrow_mut()[i] = true;
        Ok(())
    }
}
