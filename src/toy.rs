//! A small reference trainer: an MLP with plain CPU ops whose parameters live in a
//! [`ChunkManager`].
//!
//! It is what the examples, tests and benches train: `layers` blocks `h ← tanh(W h + b)` of width
//! `width`, a mean-squared-error loss against a fixed target, Adam on the host. With `tied`, the
//! last block reuses the first block's weight (a shared parameter with two forward uses, whose
//! gradient is written once, at its last backward use). Every forward op keeps one activation
//! block of `batch · width · 4` bytes on the device until its backward op, so the non-model memory
//! rises through forward and falls through backward: a tide.
//!
//! ```
//! use tidemem::chunk::{ChunkManager, ManagerConfig};
//! use tidemem::device::{CachingAllocator, Device, SimConfig};
//! use tidemem::tide::Policy;
//! use tidemem::toy::ToyMlp;
//! # fn main() -> tidemem::Result<()> {
//! let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
//! let toy = ToyMlp { layers: 4, width: 16, batch: 4, tied: true, lr: 1e-2 };
//! let mut m = ChunkManager::new(dev.clone(), ManagerConfig::new(toy.chunk_elems(), Policy::Tide))?;
//! let pool = CachingAllocator::new(dev);
//! m.set_non_model_allocator(pool.clone());
//! let ids = toy.register(&mut m)?;
//! let first = toy.step(&mut m, &pool, &ids, 0)?;
//! let mut last = first;
//! for s in 1..20 {
//!     last = toy.step(&mut m, &pool, &ids, s)?;
//! }
//! assert!(last < first);
//! # Ok(()) }
//! ```

use crate::chunk::{ChunkManager, GroupSlices, ParamStore};
use crate::data::regression::regression_samples;
use crate::device::CachingAllocator;
use crate::error::Result;
use crate::simulate::{ModelSpec, OpSpec};
use crate::tensor::{Init, Stage, TensorId};

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
    pub fn step(
        &self,
        m: &mut ChunkManager,
        pool: &CachingAllocator,
        ids: &ToyIds,
        seed: u64,
    ) -> Result<f32> {
        let loss = self.forward_backward(m, pool, ids, seed, 1.0, (0, 1))?;
        let t = m.iterations_done() as i32 + 1;
        m.step_host(|g| {
            adam(g, self.lr, t);
            Ok(())
        })?;
        m.end_step()?;
        Ok(loss)
    }

    /// Forward and backward on micro-batch `part.0` of `part.1` of batch `seed` (an equal share
    /// of its samples), through [`ChunkManager::end_backward`], with the gradients of the mean
    /// loss over the micro-batch multiplied by `loss_scale`; returns the (unscaled) sum of
    /// squared errors / 2. The optimizer step is the caller's.
    pub fn forward_backward(
        &self,
        m: &mut impl ParamStore,
        pool: &CachingAllocator,
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
        let (w, bsz) = (self.width, self.batch / parts);
        let (x, y) = regression_samples(self.width, seed, k * bsz..(k + 1) * bsz);
        let mut acts = vec![x];
        let mut blocks = Vec::new();
        for &(wi, bi) in &ids.blocks {
            m.fetch(&[wi, bi], Stage::Forward)?;
            let wv = m.read(wi)?;
            let bv = m.read(bi)?;
            for (got, want) in [(wv.len(), w * w), (bv.len(), w)] {
                if got != want {
                    return Err(crate::Error::SizeMismatch {
                        src: got,
                        dst: want,
                    });
                }
            }
            blocks.push(pool.alloc(self.activation_bytes())?);
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
            m.release(&[wi, bi], Stage::Forward)?;
        }
        m.end_forward()?;
        let out = acts.last().expect("output");
        let mut loss = 0.0f32;
        let mut dh: Vec<f32> = out
            .iter()
            .zip(&y)
            .map(|(o, t)| {
                loss += 0.5 * (o - t) * (o - t);
                (o - t) / bsz as f32 * loss_scale
            })
            .collect();
        let mut pending_shared: Option<Vec<f32>> = None;
        for l in (0..ids.blocks.len()).rev() {
            let (wi, bi) = ids.blocks[l];
            m.fetch(&[wi, bi], Stage::Backward)?;
            let wv = m.read(wi)?;
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
                pending_shared = Some(dw);
            } else {
                if shared {
                    if let Some(p) = pending_shared.take() {
                        dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
                    }
                }
                m.write_grad(wi, &dw)?;
            }
            m.write_grad(bi, &db)?;
            m.release(&[wi, bi], Stage::Backward)?;
            drop(blocks.pop());
            dh = dprev;
        }
        m.end_backward()?;
        Ok(loss)
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
