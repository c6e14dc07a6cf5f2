//! The small MLP the examples train (and the tests and benches with them), written against
//! the trainer API of [`crate::store`]: a user of the crate, not a part of the memory layer.
//! It is public because the examples are users too; it is not a layer library.
//!
//! `layers` blocks `h ← tanh(W h + b)` of width `width`, a mean-squared-error loss against a
//! fixed target, Adam on the host. With `tied`, the last block reuses the first block's weight
//! (a shared parameter with two forward uses, whose gradient is written once, at its last
//! backward use). Every forward op keeps one activation block of `batch · width · 4` bytes from
//! the store's non-model pool until its backward op, so the non-model memory rises through
//! forward and falls through backward: a tide.
//!
//! Parameters are fetched through guards and gradients written into the guards' gradient slots
//! on the device, but the arithmetic runs on the host: each op downloads its weight view,
//! computes, and uploads the gradient into the slot ([`GradView::upload_f32`]). The tied
//! weight's two shares add up on the host too, where they are computed (a trainer computing on
//! the device adds them with [`Guard::accumulate_grad`], whose running sum takes non-model
//! memory that [`ToyMlp::spec`] does not model). The arithmetic moves onto the device when the
//! op layer has a GEMM.
//!
//! [`Guard::accumulate_grad`]: crate::store::Guard::accumulate_grad
//!
//! [`GradView::upload_f32`]: crate::store::GradView::upload_f32
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
use crate::error::Result;
use crate::simulate::{ModelSpec, OpSpec};
use crate::store::{BackwardPass, ForwardPass, ParamStore};
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
    /// Chunk size holding exactly one block (weight and bias).
    pub fn chunk_elems(&self) -> usize {
        self.width * self.width + self.width
    }

    /// Bytes of one activation block.
    pub fn activation_bytes(&self) -> usize {
        self.batch * self.width * 4
    }

    /// Registers the parameters in block order.
    pub fn register(&self, m: &mut impl ParamStore) -> Result<ToyIds> {
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

    /// The model as the simulator sees it (same tensors, ops and non-model bytes).
    pub fn spec(&self) -> ModelSpec {
        let w = self.width;
        let a = self.activation_bytes() as u64;
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
            ops.push(OpSpec {
                name: format!("block{l}"),
                tensors: vec![wi, tensors.len() - 1],
                fwd_non_model: a * (l as u64 + 1),
                bwd_non_model: a * (l as u64 + 1),
            });
        }
        ModelSpec {
            name: format!("toy-mlp-{}x{}", self.layers, self.width),
            tensors,
            ops,
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
        let (k, parts) = part;
        if parts == 0 || k >= parts || !self.batch.is_multiple_of(parts) {
            return Err(crate::Error::InvalidArgument(format!(
                "micro-batch {k} of {parts} of a batch of {}",
                self.batch
            )));
        }
        let bsz = self.batch / parts;
        let (x, y) = regression_samples(self.width, seed, k * bsz..(k + 1) * bsz);
        let fwd = m.forward()?;
        let (acts, blocks) = self.forward(&fwd, ids, x)?;
        fwd.finish()?;
        let out = acts.last().expect("output");
        let mut loss = 0.0f32;
        let dh: Vec<f32> = out
            .iter()
            .zip(&y)
            .map(|(o, t)| {
                loss += 0.5 * (o - t) * (o - t);
                (o - t) / bsz as f32 * loss_scale
            })
            .collect();
        let bwd = m.backward()?;
        self.backward(&bwd, ids, &acts, blocks, dh)?;
        bwd.finish()?;
        Ok(loss)
    }

    /// The forward pass from input `x`: every block's output, and the activation blocks held
    /// for backward.
    fn forward(
        &self,
        pass: &ForwardPass<'_>,
        ids: &ToyIds,
        x: Vec<f32>,
    ) -> Result<(Vec<Vec<f32>>, Vec<crate::device::Block>)> {
        let w = self.width;
        let bsz = x.len() / w;
        let mut acts = vec![x];
        let mut blocks = Vec::new();
        for &(wi, bi) in &ids.blocks {
            let g = pass.fetch(&[wi, bi])?;
            let (wp, bp) = (g.param(0)?, g.param(1)?);
            for (got, want) in [(wp.numel(), w * w), (bp.numel(), w)] {
                if got != want {
                    return Err(crate::Error::SizeMismatch {
                        src: got,
                        dst: want,
                    });
                }
            }
            let (wv, bv) = (wp.to_f32()?, bp.to_f32()?);
            blocks.push(pass.pool().alloc(self.activation_bytes())?);
            let h = acts.last().expect("input");
            let mut out = vec![0.0f32; bsz * w];
            for s in 0..bsz {
                for o in 0..w {
                    let mut z = bv[o];
                    for i in 0..w {
                        z += wv[o * w + i] * h[s * w + i];
                    }
                    out[s * w + o] = z.tanh();
                }
            }
            acts.push(out);
        }
        Ok((acts, blocks))
    }

    /// The backward pass from the loss gradient `dh`, writing every parameter's gradient.
    fn backward(
        &self,
        pass: &BackwardPass<'_>,
        ids: &ToyIds,
        acts: &[Vec<f32>],
        mut blocks: Vec<crate::device::Block>,
        mut dh: Vec<f32>,
    ) -> Result<()> {
        let w = self.width;
        let bsz = dh.len() / w;
        let mut pending_shared: Option<Vec<f32>> = None;
        for l in (0..ids.blocks.len()).rev() {
            let (wi, bi) = ids.blocks[l];
            let g = pass.fetch(&[wi, bi])?;
            let wv = g.param(0)?.to_f32()?;
            let (h_in, h_out) = (&acts[l], &acts[l + 1]);
            let dz: Vec<f32> = dh
                .iter()
                .zip(h_out)
                .map(|(d, o)| d * (1.0 - o * o))
                .collect();
            let mut dw = vec![0.0f32; w * w];
            let mut db = vec![0.0f32; w];
            let mut dprev = vec![0.0f32; bsz * w];
            for s in 0..bsz {
                for o in 0..w {
                    let g = dz[s * w + o];
                    db[o] += g;
                    for i in 0..w {
                        dw[o * w + i] += g * h_in[s * w + i];
                        dprev[s * w + i] += wv[o * w + i] * g;
                    }
                }
            }
            let shared = self.tied && self.layers > 1 && (l == 0 || l + 1 == self.layers);
            if shared && l + 1 == self.layers {
                // the tied weight's first backward use: its share waits on the host
                pending_shared = Some(dw);
            } else {
                if shared {
                    if let Some(p) = pending_shared.take() {
                        dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
                    }
                }
                g.grad(0)?.upload_f32(&dw)?;
            }
            g.grad(1)?.upload_f32(&db)?;
            drop(g);
            drop(blocks.pop());
            dh = dprev;
        }
        Ok(())
    }
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

    /// Gradients of one batch computed on plain vectors, the tied weight's as the sum of its
    /// two uses: `(weights, biases)` per registered tensor order.
    fn reference(toy: &ToyMlp, ids: &ToyIds, init: &[Vec<f32>], seed: u64) -> Vec<Vec<f32>> {
        let (w, bsz) = (toy.width, toy.batch);
        let (x, y) = regression_samples(toy.width, seed, 0..bsz);
        let mut acts = vec![x];
        for &(wi, bi) in &ids.blocks {
            let (wv, bv) = (&init[wi.index()], &init[bi.index()]);
            let h = acts.last().unwrap();
            let out = (0..bsz * w)
                .map(|k| {
                    let (s, o) = (k / w, k % w);
                    let z: f32 = bv[o] + (0..w).map(|i| wv[o * w + i] * h[s * w + i]).sum::<f32>();
                    z.tanh()
                })
                .collect();
            acts.push(out);
        }
        let out = acts.last().unwrap();
        let mut dh: Vec<f32> = out
            .iter()
            .zip(&y)
            .map(|(o, t)| (o - t) / bsz as f32)
            .collect();
        let mut grads: Vec<Vec<f32>> = init.iter().map(|v| vec![0.0; v.len()]).collect();
        for l in (0..ids.blocks.len()).rev() {
            let (wi, bi) = ids.blocks[l];
            let wv = &init[wi.index()];
            let dz: Vec<f32> = dh
                .iter()
                .zip(&acts[l + 1])
                .map(|(d, o)| d * (1.0 - o * o))
                .collect();
            let mut dprev = vec![0.0f32; bsz * w];
            for s in 0..bsz {
                for o in 0..w {
                    let g = dz[s * w + o];
                    grads[bi.index()][o] += g;
                    for i in 0..w {
                        grads[wi.index()][o * w + i] += g * acts[l][s * w + i];
                        dprev[s * w + i] += wv[o * w + i] * g;
                    }
                }
            }
            dh = dprev;
        }
        grads
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
                for (g, w) in got.iter().zip(want) {
                    assert!(
                        (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                        "tied {tied}, tensor {t}"
                    );
                }
            }
        }
    }
}
