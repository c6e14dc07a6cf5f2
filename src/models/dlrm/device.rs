//! The DLRM with its pooled embedding vectors kept on the device: the collection's
//! sample-major output is cast to the parameter dtype for the interaction, and the
//! interaction's gradient is cast back to f32, unscaled and handed to the collection's backward,
//! all on the device.
//!
//! Two streams take part: the embedding's (the cache's, [`DeviceEmbeddings::stream`]) and the
//! store's pass stream. The pass stream waits for an event recorded after the embedding's
//! forward before it reads the vectors; the embedding's stream waits for one recorded after the
//! gradient is written before its backward reads it; and the pass stream waits for one
//! recorded after that backward, so the gradient's memory (from the pass's pool) is reused
//! only once the backward has read it, and the next forward's write of the vectors comes after
//! this iteration's reads.

use super::model::Outputs;
use super::Dlrm;
use crate::device::{Device, DeviceView, Stream};
use crate::dtype::DType;
use crate::embedding::{CachedEmbeddingCollection, ShardedEmbedding};
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::cast;
use crate::ops::elementwise::scale;
use crate::store::ParamStore;

/// Pooled embedding vectors on the device with their backward, as
/// [`Dlrm::forward_backward_device`] and [`Dlrm::predict_device`] take them.
/// [`CachedEmbeddingCollection`] implements it after
/// [`forward_device_interleaved`](CachedEmbeddingCollection::forward_device_interleaved).
pub trait DeviceEmbeddings {
    /// The stream the vectors are written on and their gradient is read on.
    fn stream(&self) -> &Stream;

    /// The vectors: `[batch·tables, dim]` f32, sample-major (row `b·tables + t` is sample
    /// `b`'s vector of table `t`), written on [`DeviceEmbeddings::stream`].
    fn vectors(&self) -> Result<DeviceView<'_>>;

    /// The backward from the vectors' gradient (f32, their layout, of the unscaled loss),
    /// enqueued on [`DeviceEmbeddings::stream`], which is ordered after the gradient's
    /// writes. Returns the number of distinct rows.
    fn backward(&mut self, grad: DeviceView<'_>) -> Result<usize>;
}

impl DeviceEmbeddings for CachedEmbeddingCollection {
    fn stream(&self) -> &Stream {
        CachedEmbeddingCollection::stream(self)
    }

    fn vectors(&self) -> Result<DeviceView<'_>> {
        self.output()
    }

    fn backward(&mut self, grad: DeviceView<'_>) -> Result<usize> {
        self.backward_device(grad)
    }
}

/// The sharded tables after [`forward_device`](ShardedEmbedding::forward_device): this rank's
/// samples' vectors, and the backward that sends their gradient back to the ranks holding the
/// rows (every rank must call it).
impl DeviceEmbeddings for ShardedEmbedding {
    fn stream(&self) -> &Stream {
        ShardedEmbedding::stream(self)
    }

    fn vectors(&self) -> Result<DeviceView<'_>> {
        self.output()
    }

    fn backward(&mut self, grad: DeviceView<'_>) -> Result<usize> {
        self.backward_device(grad)
    }
}

/// `b` waits on the host-invisible completion of what is enqueued on `a` so far.
pub(super) fn order_after(dev: &Device, a: &Stream, b: &Stream) -> Result<()> {
    let ev = dev.new_event()?;
    dev.record(a, &ev)?;
    dev.wait_event(b, &ev)
}

/// Whether `x * (1 / s)` equals `x / s` for every f32 `x`: `s` a normal power of two, whose
/// reciprocal (at least 2⁻¹²⁷) is exact, so both round the same real number once.
fn exact_reciprocal(s: f32) -> bool {
    let bits = s.to_bits();
    s > 0.0 && s.is_normal() && bits & 0x007f_ffff == 0
}

impl Dlrm {
    /// The number of embedding values in `emb`'s view, which must hold whole f32s.
    fn device_emb_len(emb: &impl DeviceEmbeddings) -> Result<usize> {
        let len = emb.vectors()?.len();
        if !len.is_multiple_of(4) {
            // the bytes of the embedding vectors are whole f32 values
            return Err(Error::Misaligned {
                what: "bytes of embedding vectors (whole f32 values)",
                value: len,
                align: 4,
            });
        }
        Ok(len / 4)
    }

    /// The vectors cast on the device to the parameter dtype, on the pass's stream after the
    /// embedding's.
    fn cast_emb(
        &self,
        fwd: &crate::store::ForwardPass<'_>,
        emb: &impl DeviceEmbeddings,
        batch: usize,
    ) -> Result<Act> {
        let c = self.config();
        let (dev, s, d) = (fwd.device(), fwd.stream(), fwd.param_dtype());
        order_after(dev, emb.stream(), s)?;
        let act = Act::alloc(fwd.pool(), batch * c.tables, c.dim, d)?;
        cast(dev, s, emb.vectors()?, DType::F32, act.view(), d)?;
        Ok(act)
    }

    /// [`Dlrm::forward_backward_scaled`] with the embedding vectors on the device: `emb`'s
    /// vectors (`[batch, tables, dim]` f32, sample-major, see [`DeviceEmbeddings`]) are cast
    /// there to the parameter dtype, and their gradient cast back to f32, divided by
    /// `loss_scale` and handed to `emb`'s backward, without leaving the device. Returns the
    /// mean loss, the click probabilities and the rows `emb`'s backward reported. The store is
    /// then in its optimizer stage. Lengths and the loss scale are checked before anything
    /// runs.
    ///
    /// With `emb` a [`CachedEmbeddingCollection`] after
    /// [`forward_device_interleaved`](CachedEmbeddingCollection::forward_device_interleaved),
    /// the losses, probabilities, MLP gradients and the collection's row gradients are those of
    /// the host path ([`CachedEmbeddingCollection::forward`], [`Dlrm::forward_backward_scaled`],
    /// [`CachedEmbeddingCollection::backward`]) bit for bit: the same values reach the same
    /// kernels. The division by a loss scale that is a power of two is a multiplication by its
    /// exact reciprocal on the device; any other scale's division runs on the host (the
    /// gradient goes down and back up).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_device<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &mut impl DeviceEmbeddings,
        dense: &[f32],
        labels: &[f32],
        batch: usize,
        loss_scale: f32,
    ) -> Result<(f32, Vec<f32>, usize)> {
        let (out, rows) =
            self.forward_backward_deferred(store, emb, dense, labels, batch, loss_scale)?;
        let (sum, probs) = out.read()?;
        Ok(((sum / batch as f64) as f32, probs, rows))
    }

    /// [`Dlrm::forward_backward_device`] with the losses and probabilities left on their way to
    /// the host, for a trainer that reads them after the optimizer step.
    pub(crate) fn forward_backward_deferred<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &mut impl DeviceEmbeddings,
        dense: &[f32],
        labels: &[f32],
        batch: usize,
        loss_scale: f32,
    ) -> Result<(Outputs, usize)> {
        self.check(Self::device_emb_len(emb)?, dense, Some(labels), batch)?;
        super::model::check_loss_scale(loss_scale)?;
        let fwd = store.forward()?;
        let vectors = self.cast_emb(&fwd, emb, batch)?;
        let f = self.forward(
            &fwd,
            vectors,
            dense,
            labels,
            batch,
            loss_scale / batch as f32,
        )?;
        fwd.finish()?;
        let bwd = store.backward()?;
        let d_emb = self.backward(&bwd, f.saved)?;
        let (dev, s) = (bwd.device(), bwd.stream());
        let grad = Act::alloc(bwd.pool(), d_emb.rows(), d_emb.cols(), DType::F32)?;
        cast(
            dev,
            s,
            d_emb.input(),
            d_emb.dtype(),
            grad.view(),
            DType::F32,
        )?;
        drop(d_emb);
        unscale(dev, s, grad.view(), loss_scale)?;
        order_after(dev, s, emb.stream())?;
        let rows = emb.backward(grad.view());
        // the gradient's block goes back to the pool only after the backward has read it (an
        // error above may have enqueued nothing: the wait is then harmless)
        order_after(dev, emb.stream(), s)?;
        drop(grad);
        let rows = rows?;
        bwd.finish()?;
        Ok((f.outputs, rows))
    }

    /// [`Dlrm::forward_backward_parts`] with the embedding vectors on the device, for a step
    /// whose batch is split over ranks: `emb`'s vectors (as for
    /// [`Dlrm::forward_backward_device`]) are cast there to the parameter dtype; each sample's
    /// logit gradient is `grad_scale · ∂ℓᵢ/∂zᵢ`; the vectors' gradient, cast to f32 and
    /// divided by `emb_div`, is written into `grad` (f32, `[batch·tables, dim]`, sample-major)
    /// and `emb`'s stream is ordered after it; `emb`'s backward is not called (the caller runs
    /// it once the ranks agree). Returns the sum of the samples' losses and the probabilities.
    /// The store is then in its optimizer stage. Lengths and the scales are checked before
    /// anything runs. The values are those of [`Dlrm::forward_backward_parts`] bit for bit (the
    /// gradient in the sample-major layout).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_backward_device_parts<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &impl DeviceEmbeddings,
        dense: &[f32],
        labels: &[f32],
        batch: usize,
        grad_scale: f32,
        emb_div: f32,
        grad: DeviceView<'_>,
    ) -> Result<(f64, Vec<f32>)> {
        let len = Self::device_emb_len(emb)?;
        self.check(len, dense, Some(labels), batch)?;
        super::model::check_scales(grad_scale, emb_div)?;
        if grad.len() != len * 4 {
            return Err(Error::Length {
                what: format!("bytes of gradient for {len} f32 embedding values"),
                got: grad.len(),
                expected: len * 4,
            });
        }
        let fwd = store.forward()?;
        let vectors = self.cast_emb(&fwd, emb, batch)?;
        let f = self.forward(&fwd, vectors, dense, labels, batch, grad_scale)?;
        fwd.finish()?;
        let bwd = store.backward()?;
        let d_emb = self.backward(&bwd, f.saved)?;
        let (dev, s) = (bwd.device(), bwd.stream());
        cast(dev, s, d_emb.input(), d_emb.dtype(), grad, DType::F32)?;
        drop(d_emb);
        unscale(dev, s, grad, emb_div)?;
        order_after(dev, s, emb.stream())?;
        bwd.finish()?;
        f.outputs.read()
    }

    /// [`Dlrm::predict`] with the embedding vectors on the device (as for
    /// [`Dlrm::forward_backward_device`]); `emb`'s backward is not called.
    pub fn predict_device<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &impl DeviceEmbeddings,
        dense: &[f32],
        batch: usize,
    ) -> Result<Vec<f32>> {
        self.check(Self::device_emb_len(emb)?, dense, None, batch)?;
        let labels = vec![0.0f32; batch];
        let fwd = store.forward()?;
        let vectors = self.cast_emb(&fwd, emb, batch)?;
        // the embedding's next forward rewrites the vectors after this read
        order_after(fwd.device(), fwd.stream(), emb.stream())?;
        let f = self.forward(&fwd, vectors, dense, &labels, batch, 0.0)?;
        drop(f.saved);
        fwd.finish()?;
        store.backward()?.finish()?;
        store.skip_step()?;
        Ok(f.outputs.read()?.1)
    }
}

/// `grad /= loss_scale` (f32) on `s`, as the host path's division rounds it.
fn unscale(dev: &Device, s: &Stream, grad: DeviceView<'_>, loss_scale: f32) -> Result<()> {
    if loss_scale == 1.0 {
        Ok(())
    } else if exact_reciprocal(loss_scale) {
        scale(dev, s, 1.0 / loss_scale, grad, DType::F32)
    } else {
        let mut g: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(s, grad)?);
        g.iter_mut().for_each(|v| *v /= loss_scale);
        let host = crate::device::HostBuffer::from_slice(bytemuck::cast_slice(&g))?;
        dev.copy_h2d(s, host, grad)?.wait()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reciprocals_of_powers_of_two_divide_exactly() {
        for s in [
            1.0f32,
            2.0,
            1024.0,
            65536.0,
            2f32.powi(24),
            2f32.powi(127),
            0.5,
        ] {
            assert!(exact_reciprocal(s), "{s}");
            let r = 1.0 / s;
            for x in [
                1.0f32,
                3.0e-38,
                1.17e-38,
                7.3e-40,
                1.0e-45,
                3.4e38,
                -0.1,
                1.0 / 3.0,
            ] {
                assert_eq!((x * r).to_bits(), (x / s).to_bits(), "{x} / {s}");
            }
        }
        for s in [
            3.0f32,
            1000.0,
            f32::MIN_POSITIVE / 2.0,
            0.0,
            -2.0,
            f32::INFINITY,
        ] {
            assert!(!exact_reciprocal(s), "{s}");
        }
    }
}
