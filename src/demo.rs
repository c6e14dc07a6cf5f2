//! The small MLP the examples train (and the tests and benches with them), written against
//! the trainer API of [`crate::store`]: a user of the crate, not a part of the memory layer.
//! It is public because the examples are users too; it is not a layer library.
//!
//! `layers` blocks `h ← GELU(W h + b)` of width `width`, a mean-squared-error loss against a
//! fixed target, Adam on the host. With `tied`, the last block reuses the first block's weight
//! (a shared parameter with two forward uses, whose gradient is written once, at its last
//! backward use).
//!
//! Every op computes on the device, in the store's parameter type, with the op layer: the bias
//! is broadcast into the output ([`ops::bias_rows`]) and the product `h·Wᵀ` added to it by a
//! GEMM with β = 1 ([`ops::gemm`]), then GELU; backward runs GELU's backward, the bias gradient
//! ([`ops::bias_grad`], straight into the bias's gradient slot), `dW = dzᵀ·h` (a GEMM into the
//! weight's slot) and `dh = dz·W`. Weights are read through the fetch guards, gradients written
//! into their slots, and every activation and temporary comes from the store's non-model pool,
//! so the tide sees it: each forward op keeps its pre-activation and output until its backward
//! op, and the non-model memory rises through forward and falls through backward.
//! [`ToyMlp::spec`] models every byte of it. The tied weight's two shares are summed on the
//! device (the last block's share waits in a pool buffer for the first block's). The host sees
//! the batch (uploaded once) and the loss (the output's difference from the target, read back
//! once per step).
//!
//! [`ops::bias_rows`]: crate::ops::bias_rows
//! [`ops::gemm`]: crate::ops::gemm()
//! [`ops::bias_grad`]: crate::ops::bias_grad()
//!
//! ```
//! use tidemem::chunk::{ChunkManager, ManagerConfig};
//! use tidemem::demo::ToyMlp;
//! use tidemem::device::{Device, SimConfig};
//! use tidemem::tide::Policy;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let toy = ToyMlp { layers: 4, width: 16, batch: 4, tied: true, lr: 1e-2 };
//! let mut m = ChunkManager::new(dev, ManagerConfig::new(toy.chunk_elems(), Policy::Tide))?;
//! let ids = toy.register(&mut m)?;
//! let first = toy.step(&mut m, &ids, 0)?;
//! let mut last = first;
//! for s in 1..20 {
//!     last = toy.step(&mut m, &ids, s)?;
//! }
//! assert!(last < first);
//! # Ok(()) }
//! ```

use crate::chunk::{ChunkManager, GroupSlices};
use crate::data::regression::regression_samples;
use crate::device::pool::round_size;
use crate::device::{DeviceView, HostBuffer, PoolBlock};
use crate::dtype::{decode_f32, encode_f32, DType};
use crate::error::{Error, Result};
use crate::ops::{self, Axpby, BiasGrad, Gemm};
use crate::simulate::{ModelSpec, OpSpec};
use crate::store::{BackwardPass, ForwardPass, Guard, ParamStore, PassKind};
use crate::tensor::{Init, TensorId};

/// Shape and hyper-parameters of the toy MLP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ToyMlp {
    /// Blocks.
    pub layers: usize,
    /// Width of every block.
    pub width: usize,
    /// Samples per batch.
    pub batch: usize,
    /// The last block reuses the first block's weight.
    pub tied: bool,
    /// Adam learning rate.
    pub lr: f32,
}

/// Parameter ids of a registered [`ToyMlp`]: per block, its weight and bias.
#[derive(Clone, Debug)]
pub struct ToyIds {
    /// `(weight, bias)` of every block (the last block's weight is the first's when tied).
    pub blocks: Vec<(TensorId, TensorId)>,
}

const BETA1: f32 = 0.9;
const BETA2: f32 = 0.999;
const EPS: f32 = 1e-8;

impl ToyMlp {
    /// Checks the shape before any work: at least one block, of width at least 1, and a
    /// batch of at least one sample; a finite, positive learning rate; the model data (fp16
    /// parameters and fp32 master, momentum and variance) and a batch's inputs and targets
    /// within what the machine holds. [`ToyMlp::register`] and
    /// [`ToyMlp::forward_backward`] check it too.
    ///
    /// # Errors
    /// [`Error::TooFew`] naming a zero size, [`Error::BadValue`] for the learning rate;
    /// [`Error::TooLarge`] with the bytes and the limit.
    ///
    /// ```
    /// use tidemem::demo::ToyMlp;
    /// let toy = ToyMlp { layers: 4, width: 16, batch: 4, tied: true, lr: 1e-2 };
    /// assert!(toy.validate().is_ok());
    /// assert!(ToyMlp { batch: 0, ..toy }.validate().is_err());
    /// assert!(ToyMlp { lr: f32::NAN, ..toy }.validate().is_err());
    /// let wide = ToyMlp { width: 1 << 40, ..toy };
    /// assert!(matches!(wide.validate(), Err(tidemem::Error::TooLarge { .. })));
    /// ```
    pub fn validate(&self) -> Result<()> {
        for (what, n) in [
            ("layers", self.layers),
            ("width", self.width),
            ("batch", self.batch),
        ] {
            if n == 0 {
                return Err(Error::TooFew {
                    what: format!("a toy MLP's {what}"),
                    got: 0,
                    need: 1,
                });
            }
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(Error::BadValue {
                what: "a toy MLP's learning rate".into(),
                value: self.lr.into(),
                want: "finite and above 0",
            });
        }
        crate::limits::host_bytes(
            || {
                format!(
                    "bytes of the model data of {} blocks of width {}",
                    self.layers, self.width
                )
            },
            &[self.layers, self.width, self.width.saturating_add(1), 14],
        )?;
        crate::limits::host_bytes(
            || {
                format!(
                    "bytes of a batch of {} samples of width {} (inputs and targets)",
                    self.batch, self.width
                )
            },
            &[self.batch, self.width, 8],
        )?;
        Ok(())
    }

    /// Chunk size holding exactly one block (weight and bias); `usize::MAX` for a width whose
    /// block does not fit a `usize` (which [`ToyMlp::validate`] refuses).
    pub fn chunk_elems(&self) -> usize {
        self.width
            .saturating_mul(self.width)
            .saturating_add(self.width)
    }

    /// Bytes of what one block keeps from forward to backward in parameters of `dtype`: its
    /// pre-activation and output (`2 × batch × width` values, in one pool buffer).
    pub(crate) fn activation_bytes(&self, dtype: DType) -> usize {
        2 * self.batch * self.width * dtype.size()
    }

    /// The most non-model bytes (the pool's rounded sizes) any op holds with parameters of
    /// `dtype`: what a device needs besides the model data it keeps.
    pub fn non_model_peak(&self, dtype: DType) -> usize {
        (0..self.layers)
            .map(|l| {
                let (f, b) = self.non_model(l, dtype);
                f.max(b) as usize
            })
            .max()
            .unwrap_or(0)
    }

    /// Whether a weight is shared (the first block's, reused by the last).
    fn shares(&self) -> bool {
        self.tied && self.layers > 1
    }

    /// The non-model bytes (the pool's rounded sizes) at the peak of forward op `l` and of
    /// backward op `l`, as [`Self::forward_backward`] allocates them with one micro-batch.
    fn non_model(&self, l: usize, dtype: DType) -> (u64, u64) {
        let r = |bytes: usize| round_size(bytes) as u64;
        let values = self.batch * self.width * dtype.size();
        // the batch (input and target) and one pair per block so far
        let (io, pair) = (r(2 * values), r(self.activation_bytes(dtype)));
        let kept = io + pair * (l as u64 + 1);
        // backward adds the incoming gradient (in the last block's pair, kept once that
        // block is done), dz, the bias gradient's scratch, and the tied weight's pending share
        let incoming = if l + 1 < self.layers { pair } else { 0 };
        let scratch = r(ops::bias_grad_scratch_bytes(self.batch, self.width));
        let pending = if self.shares() {
            r(self.width * self.width * dtype.size())
        } else {
            0
        };
        (kept, kept + incoming + r(values) + scratch + pending)
    }

    /// Registers the parameters in block order, after [`ToyMlp::validate`].
    pub fn register(&self, m: &mut impl ParamStore) -> Result<ToyIds> {
        self.validate()?;
        let w = self.width;
        let scale = 1.0 / (w as f32).sqrt();
        let mut blocks: Vec<(TensorId, TensorId)> = Vec::new();
        for l in 0..self.layers {
            let weight = if self.tied && l + 1 == self.layers && l > 0 {
                blocks[0].0
            } else {
                m.register(
                    &format!("block{l}.weight"),
                    &[w, w],
                    Init::Uniform {
                        seed: 1000 + l as u64,
                        lo: -scale,
                        hi: scale,
                    },
                )?
            };
            let bias = m.register(&format!("block{l}.bias"), &[w], Init::Constant(0.01))?;
            blocks.push((weight, bias));
        }
        Ok(ToyIds { blocks })
    }

    /// The model as the simulator sees it (same tensors, ops and non-model bytes) with fp16
    /// parameters (the stores' default).
    pub fn spec(&self) -> ModelSpec {
        self.spec_for(DType::F16)
    }

    /// The model as the simulator sees it with parameters of `dtype`.
    pub fn spec_for(&self, dtype: DType) -> ModelSpec {
        let w = self.width;
        let mut tensors = Vec::new();
        let mut ops = Vec::new();
        let mut first_w = 0;
        for l in 0..self.layers {
            let wi = if self.tied && l + 1 == self.layers && l > 0 {
                first_w
            } else {
                tensors.push((format!("block{l}.weight"), w * w));
                tensors.len() - 1
            };
            if l == 0 {
                first_w = wi;
            }
            tensors.push((format!("block{l}.bias"), w));
            let (fwd_non_model, bwd_non_model) = self.non_model(l, dtype);
            let flops = 2 * (self.batch * w * w) as u64;
            ops.push(OpSpec {
                name: format!("block{l}"),
                tensors: vec![wi, tensors.len() - 1],
                fwd_non_model,
                bwd_non_model,
                flops,
                bwd_flops: 2 * flops,
            });
        }
        ModelSpec {
            name: format!("toy-mlp-{}x{}", self.layers, self.width),
            tensors,
            ops,
            backward: None,
        }
    }

    /// One training iteration (forward, backward, Adam step on the host) on batch `seed`;
    /// returns the loss.
    pub fn step(&self, m: &mut ChunkManager, ids: &ToyIds, seed: u64) -> Result<f32> {
        let loss = self.forward_backward(m, ids, seed, 1.0, (0, 1))?;
        let t = m.iterations_done() as i32 + 1;
        m.step_host(|g| {
            adam(g, self.lr, t);
            Ok(())
        })?;
        m.end_step()?;
        Ok(loss)
    }

    /// Forward and backward on micro-batch `part.0` of `part.1` of batch `seed` (an equal share
    /// of its samples), through the end of the backward pass, with the gradients of the mean
    /// loss over the micro-batch multiplied by `loss_scale`; returns the (unscaled) sum of
    /// squared errors / 2. The optimizer step is the caller's.
    pub fn forward_backward(
        &self,
        m: &mut impl ParamStore,
        ids: &ToyIds,
        seed: u64,
        loss_scale: f32,
        part: (usize, usize),
    ) -> Result<f32> {
        self.validate()?;
        let (k, parts) = part;
        if k >= parts {
            return Err(Error::IndexOutOfRange {
                what: "micro-batch".into(),
                index: k,
                len: parts,
            });
        }
        if !self.batch.is_multiple_of(parts) {
            return Err(Error::NotSplit {
                layer: "a toy MLP".into(),
                what: "batch",
                value: self.batch,
                parts,
                by: "micro-batches",
            });
        }
        let bsz = self.batch / parts;
        let (x, y) = regression_samples(self.width, seed, k * bsz..(k + 1) * bsz);
        let fwd = m.forward()?;
        let (io, blocks) = self.forward(&fwd, ids, &x, &y)?;
        let loss = self.loss(&fwd, &io, &blocks, loss_scale)?;
        fwd.finish()?;
        let bwd = m.backward()?;
        self.backward(&bwd, ids, io, blocks)?;
        bwd.finish()?;
        Ok(loss)
    }

    /// The forward pass: every block's pre-activation and output (kept for backward), and the
    /// batch on the device.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        ids: &ToyIds,
        x: &[f32],
        y: &[f32],
    ) -> Result<(Batch, Vec<PoolBlock>)> {
        let w = self.width;
        let n = x.len();
        let bsz = n / w;
        let d = pass.param_dtype();
        let (dev, s) = (pass.device(), pass.stream());
        let mut io: Option<Batch> = None;
        let mut blocks: Vec<PoolBlock> = Vec::new();
        for &(wi, bi) in &ids.blocks {
            let g = pass.fetch(&[wi, bi])?;
            let (wp, bp) = (g.param(0)?, g.param(1)?);
            check_shapes(&g, w, d)?;
            // the batch arrives inside the first op, so the tide counts it there
            let batch = match &io {
                Some(b) => b,
                None => io.insert(Batch::upload(pass, x, y, d)?),
            };
            let zh = pass.pool().alloc(2 * n * d.size())?;
            let h_in = match blocks.last() {
                Some(prev) => half(prev, 1, n, d)?,
                None => half(&batch.block, 0, n, d)?,
            };
            let z = half(&zh, 0, n, d)?;
            ops::bias_rows(dev, s, bp, z, bsz, w, d)?;
            let xw = Gemm::new(bsz, w, w).trans_b(true).beta(1.0);
            ops::gemm(dev, s, &xw, h_in, wp, z, d)?;
            ops::gelu_forward(dev, s, z, half(&zh, 1, n, d)?, d)?;
            blocks.push(zh);
        }
        let io = io.ok_or_else(|| Error::Empty {
            what: "a toy MLP's blocks".into(),
        })?;
        Ok((io, blocks))
    }

    /// The loss (sum of squared errors / 2, unscaled); turns the last output into the loss's
    /// gradient `(out − target)·loss_scale/bsz`, in place.
    fn loss(
        &self,
        pass: &ForwardPass<'_>,
        io: &Batch,
        blocks: &[PoolBlock],
        loss_scale: f32,
    ) -> Result<f32> {
        let (dev, s, d) = (pass.device(), pass.stream(), pass.param_dtype());
        let n = io.values;
        let last = blocks.last().ok_or_else(|| Error::Empty {
            what: "a toy MLP's blocks".into(),
        })?;
        let out = half(last, 1, n, d)?;
        let diff = Axpby {
            alpha: 1.0,
            beta: -1.0,
        };
        ops::add_in_place(dev, s, diff, out, half(&io.block, 1, n, d)?, d)?;
        let loss = decode_f32(&dev.download(s, out)?, d)
            .iter()
            .map(|e| 0.5 * e * e)
            .sum();
        ops::scale(dev, s, loss_scale / (n / self.width) as f32, out, d)?;
        Ok(loss)
    }

    /// The backward pass, from the loss's gradient in the last block's output, writing every
    /// parameter's gradient.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        ids: &ToyIds,
        io: Batch,
        mut blocks: Vec<PoolBlock>,
    ) -> Result<()> {
        let w = self.width;
        let d = pass.param_dtype();
        let n = io.values;
        let bsz = n / w;
        let (dev, s) = (pass.device(), pass.stream());
        // the incoming gradient lives in the last block's output half (the loss put it there);
        // each block writes its outgoing gradient over it
        let mut dh: Option<PoolBlock> = None;
        let mut pending: Option<PoolBlock> = None; // the tied weight's last-block share
        for l in (0..ids.blocks.len()).rev() {
            let (wi, bi) = ids.blocks[l];
            let g = pass.fetch(&[wi, bi])?;
            check_shapes(&g, w, d)?;
            let db = g.grad(1)?;
            if db.dtype() != d {
                return Err(Error::WrongDType {
                    what: format!("toy MLP: the gradients of block {l}"),
                    dtype: db.dtype(),
                    expected: "the store's type",
                });
            }
            let wp = g.param(0)?;
            let zh = blocks.pop().expect("one activation pair per block");
            let dz_block = pass.pool().alloc(n * d.size())?;
            let dz = half(&dz_block, 0, n, d)?;
            {
                let dh_view = half(dh.as_ref().unwrap_or(&zh), 1, n, d)?;
                ops::gelu_backward(dev, s, half(&zh, 0, n, d)?, dh_view, dz, d)?;
            }
            let scratch_bytes = ops::bias_grad_scratch_bytes(bsz, w);
            let scratch = pass.pool().alloc(scratch_bytes)?;
            let bias = BiasGrad {
                dy: dz.into(),
                db: db.view(),
                db_dtype: d,
                accumulate: false,
                scratch: scratch.view(0, scratch_bytes)?,
            };
            ops::bias_grad(dev, s, bias, bsz, w, d)?;
            // the block below's output (or the batch's input) is this block's input
            let h_in = match blocks.last() {
                Some(prev) => half(prev, 1, n, d)?,
                None => half(&io.block, 0, n, d)?,
            };
            // dh_in = dz·W ([bsz, w]·[w, w]) over dh, before dW: the weight's gradient slot
            // is the weight's own memory (nothing below the first block needs it)
            if dh.is_none() {
                dh = Some(zh);
            }
            if l > 0 {
                let dh_view = half(dh.as_ref().expect("set above"), 1, n, d)?;
                ops::gemm(dev, s, &Gemm::new(bsz, w, w), dz, wp, dh_view, d)?;
            }
            // dW = dzᵀ·h_in, [w, bsz]·[bsz, w]
            let dw = Gemm::new(w, w, bsz).trans_a(true);
            let shared = self.shares() && (l == 0 || l + 1 == self.layers);
            if shared && l > 0 {
                let p = pass.pool().alloc(w * w * d.size())?;
                ops::gemm(dev, s, &dw, dz, h_in, p.view(0, w * w * d.size())?, d)?;
                pending = Some(p);
            } else if shared {
                let p = pending.take().ok_or_else(|| Error::Internal {
                    what: "a tied share missing".into(),
                })?;
                let pv = p.view(0, w * w * d.size())?;
                ops::gemm(dev, s, &dw.beta(1.0), dz, h_in, pv, d)?;
                dev.copy_d2d(s, pv, g.grad(0)?.view())?;
            } else {
                ops::gemm(dev, s, &dw, dz, h_in, g.grad(0)?.view(), d)?;
            }
            g.release()?;
        }
        Ok(())
    }
}

/// The batch on the device: the input, then the target, `values` elements each.
struct Batch {
    block: PoolBlock,
    values: usize,
}

impl Batch {
    fn upload(pass: &ForwardPass<'_>, x: &[f32], y: &[f32], dtype: DType) -> Result<Self> {
        let block = pass.pool().alloc(2 * x.len() * dtype.size())?;
        for (i, v) in [x, y].into_iter().enumerate() {
            let bytes = encode_f32(v, dtype);
            let dst = half(&block, i, x.len(), dtype)?;
            pass.device()
                .copy_h2d(pass.stream(), HostBuffer::from_slice(&bytes)?, dst)?
                .wait()?;
        }
        Ok(Batch {
            block,
            values: x.len(),
        })
    }
}

/// Half `i` (0 or 1) of a pool buffer holding two runs of `n` values of `dtype`.
fn half(b: &PoolBlock, i: usize, n: usize, dtype: DType) -> Result<DeviceView<'_>> {
    b.view(i * n * dtype.size(), n * dtype.size())
}

/// The fetched weight and bias have the block's shapes and the store's parameter type.
fn check_shapes<K: PassKind>(g: &Guard<'_, K>, w: usize, d: DType) -> Result<()> {
    for (i, want) in [(0, w * w), (1, w)] {
        let p = g.param(i)?;
        if p.numel() != want {
            return Err(Error::SizeMismatch {
                src: p.numel(),
                dst: want,
            });
        }
        if p.dtype() != d {
            return Err(Error::WrongDType {
                what: format!("toy MLP: parameter {i}"),
                dtype: p.dtype(),
                expected: "the store's type",
            });
        }
    }
    Ok(())
}

/// Adam over the tensors of a group that received a gradient, then the new parameters into the
/// parameter chunk.
fn adam(mut g: GroupSlices<'_>, lr: f32, t: i32) {
    let grad = g.param_f32();
    let c1 = 1.0 - BETA1.powi(t);
    let c2 = 1.0 - BETA2.powi(t);
    for &(_, off, n, has) in &g.tensors {
        if !has {
            continue;
        }
        let r = off..off + n;
        let (m, v) = (&mut g.momentum[r.clone()], &mut g.variance[r.clone()]);
        for (((x, &gi), m), v) in g.master[r.clone()].iter_mut().zip(&grad[r]).zip(m).zip(v) {
            *m = BETA1 * *m + (1.0 - BETA1) * gi;
            *v = BETA2 * *v + (1.0 - BETA2) * gi * gi;
            let mh = *m / c1;
            let vh = *v / c2;
            *x -= lr * mh / (vh.sqrt() + EPS);
        }
    }
    g.store_params();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::ManagerConfig;
    use crate::device::{Device, SimConfig};
    use crate::dtype::DType;
    use crate::tide::Policy;

    fn gelu(z: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * z * (1.0 + (k * (z + 0.044715 * z * z * z)).tanh())
    }

    fn gelu_grad(z: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let t = (k * (z + 0.044715 * z * z * z)).tanh();
        0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)
    }

    /// Gradients of one batch computed on plain vectors in f64, the tied weight's as the sum
    /// of its two uses: `(weights, biases)` per registered tensor order.
    fn reference(toy: &ToyMlp, ids: &ToyIds, init: &[Vec<f32>], seed: u64) -> Vec<Vec<f64>> {
        let (w, bsz) = (toy.width, toy.batch);
        let (x, y) = regression_samples(toy.width, seed, 0..bsz);
        let mut pre: Vec<Vec<f64>> = vec![];
        let mut acts: Vec<Vec<f64>> = vec![x.iter().map(|&v| v as f64).collect()];
        for &(wi, bi) in &ids.blocks {
            let (wv, bv) = (&init[wi.index()], &init[bi.index()]);
            let h = acts.last().unwrap();
            let out = (0..bsz * w)
                .map(|k| {
                    let (s, o) = (k / w, k % w);
                    bv[o] as f64
                        + (0..w)
                            .map(|i| wv[o * w + i] as f64 * h[s * w + i])
                            .sum::<f64>()
                })
                .collect::<Vec<f64>>();
            acts.push(out.iter().map(|&z| gelu(z)).collect());
            pre.push(out);
        }
        let out = acts.last().unwrap();
        let mut dh: Vec<f64> = out
            .iter()
            .zip(&y)
            .map(|(o, &t)| (o - t as f64) / bsz as f64)
            .collect();
        let mut grads: Vec<Vec<f64>> = init.iter().map(|v| vec![0.0; v.len()]).collect();
        for l in (0..ids.blocks.len()).rev() {
            let (wi, bi) = ids.blocks[l];
            let wv = &init[wi.index()];
            let dz: Vec<f64> = dh
                .iter()
                .zip(&pre[l])
                .map(|(d, &z)| d * gelu_grad(z))
                .collect();
            let mut dprev = vec![0.0f64; bsz * w];
            for s in 0..bsz {
                for o in 0..w {
                    let g = dz[s * w + o];
                    grads[bi.index()][o] += g;
                    for i in 0..w {
                        grads[wi.index()][o * w + i] += g * acts[l][s * w + i];
                        dprev[s * w + i] += wv[o * w + i] as f64 * g;
                    }
                }
            }
            dh = dprev;
        }
        grads
    }

    #[test]
    fn shapes_that_train_nothing_are_refused() {
        let toy = ToyMlp {
            layers: 2,
            width: 4,
            batch: 4,
            tied: false,
            lr: 1e-2,
        };
        let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
        let mut m =
            ChunkManager::new(dev, ManagerConfig::new(toy.chunk_elems(), Policy::Tide)).unwrap();
        let ids = toy.register(&mut m).unwrap();
        // a batch of no samples "trains" to a loss of 0 without a word
        let empty = ToyMlp { batch: 0, ..toy };
        let r = empty.forward_backward(&mut m, &ids, 0, 1.0, (0, 1));
        assert!(
            matches!(&r, Err(Error::TooFew { what, .. }) if what.contains("batch")),
            "{r:?}"
        );
        for bad in [
            ToyMlp { layers: 0, ..toy },
            ToyMlp { width: 0, ..toy },
            ToyMlp { lr: 0.0, ..toy },
            ToyMlp { lr: -1.0, ..toy },
            ToyMlp {
                lr: f32::INFINITY,
                ..toy
            },
        ] {
            assert!(
                matches!(
                    bad.validate(),
                    Err(Error::TooFew { .. } | Error::BadValue { .. })
                ),
                "{bad:?}"
            );
        }
        for bad in [
            ToyMlp {
                width: usize::MAX,
                ..toy
            },
            ToyMlp {
                layers: usize::MAX,
                ..toy
            },
            ToyMlp {
                batch: usize::MAX / 2,
                ..toy
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::TooLarge { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(
            ToyMlp {
                width: usize::MAX,
                ..toy
            }
            .chunk_elems(),
            usize::MAX
        );
        toy.forward_backward(&mut m, &ids, 0, 1.0, (0, 1)).unwrap();
    }

    #[test]
    fn gradients_match_a_host_reference() {
        for tied in [false, true] {
            let toy = ToyMlp {
                layers: 3,
                width: 4,
                batch: 2,
                tied,
                lr: 1e-2,
            };
            let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
            let mut cfg = ManagerConfig::new(toy.chunk_elems(), Policy::Tide);
            cfg.param_dtype = DType::F32;
            let mut m = ChunkManager::new(dev, cfg).unwrap();
            let ids = toy.register(&mut m).unwrap();
            let init: Vec<Vec<f32>> = (0..m.num_tensors() as u32)
                .map(|t| m.read(TensorId(t)).unwrap())
                .collect();
            toy.forward_backward(&mut m, &ids, 3, 1.0, (0, 1)).unwrap();
            let want = reference(&toy, &ids, &init, 3);
            for (t, want) in want.iter().enumerate() {
                let got = m.read(TensorId(t as u32)).unwrap();
                // f32 storage and math against f64: GEMM sums of 2-4 products and GELU's
                // few-ulp error, carried through three blocks
                for (g, w) in got.iter().zip(want) {
                    let g = *g as f64;
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "tied {tied}, tensor {t}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
