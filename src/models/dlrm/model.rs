//! The DLRM over a [`ParamStore`]: registration, the forward and backward of one batch.

use super::DlrmConfig;
use crate::device::{HostBuffer, Pending};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Act, Linear};
use crate::ops::bce::{bce_with_logits, BceOutputs};
use crate::ops::interaction::{interaction_backward, interaction_forward};
use crate::ops::{relu_backward, relu_forward};
use crate::optim::StepReport;
use crate::store::{BackwardPass, ForwardPass, ParamStore, Pass, PassKind};
use crate::tensor::Init;

/// What [`train_step`](super::train_step) did.
#[derive(Clone, Debug, PartialEq)]
pub struct DlrmStep {
    /// The mean BCE over the batch, before the step.
    pub loss: f32,
    /// The click probabilities, before the step.
    pub probs: Vec<f32>,
    /// The MLP optimizer's report.
    pub report: StepReport,
    /// Distinct embedding rows the batch touched and the row optimizer updated (0 when the MLP
    /// optimizer skipped the step on an overflow: the rows are then left as they were too).
    pub rows: usize,
}

/// A DLRM's MLPs registered in a [`ParamStore`] (see [the module](super)): the bottom MLP
/// `bottom.{i}` and the top MLP `top.{i}`, each a [`Linear`] with a bias. The embedding tables
/// live outside the store (a [`CachedEmbeddingCollection`](crate::embedding::CachedEmbeddingCollection)):
/// their pooled vectors come in as an input and their gradient goes back out.
#[derive(Clone, Debug)]
pub struct Dlrm {
    config: DlrmConfig,
    bottom: Vec<Linear>,
    top: Vec<Linear>,
}

/// What the forward keeps for the backward: each layer's input (the previous layer's ReLU
/// output, which is positive exactly where its input is, so it serves the ReLU's backward
/// too), the embedding vectors, the interaction's output and the logit's gradient.
pub(super) struct Saved {
    bottom_in: Vec<Act>,
    dense: Act,
    emb: Act,
    top_in: Vec<Act>,
    dlogits: Act,
}

/// The outputs of [`Dlrm::forward`].
pub(super) struct Forward {
    /// The samples' losses and probabilities, on their way to the host.
    pub(super) outputs: Outputs,
    pub(super) saved: Saved,
}

/// The losses and click probabilities of a batch, copied to the host in one piece without the
/// host waiting; read once the trainer wants them (after the optimizer step, whose read of the
/// gradient statistics has seen them arrive).
pub(crate) struct Outputs {
    /// `batch` losses then `batch` probabilities (f32).
    copy: Pending<HostBuffer>,
    batch: usize,
}

impl Outputs {
    /// The sum of the samples' losses and their probabilities.
    pub(crate) fn read(self) -> Result<(f64, Vec<f32>)> {
        let bytes = self.copy.wait()?;
        let v: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
        let sum = v[..self.batch].iter().map(|&l| f64::from(l)).sum::<f64>();
        Ok((sum, v[self.batch..].to_vec()))
    }
}

impl Dlrm {
    /// Registers the MLPs of `config` in `store` with facebookresearch/dlrm's scales, drawn
    /// uniformly (the store's initialisers are uniform): each weight of an `m → n` layer
    /// uniform with the standard deviation `√(2/(m+n))` of the reference's normal (bounds
    /// `±√3·√(2/(m+n))`), each bias with the standard deviation `√(1/n)`. Seeded by the name
    /// and `seed`: the same seed, the same model.
    pub fn register(store: &mut impl ParamStore, config: &DlrmConfig, seed: u64) -> Result<Dlrm> {
        Dlrm::register_with(store, config, |name, inputs, outputs| {
            default_init(name, inputs, outputs, seed)
        })
    }

    /// Registers the MLPs with `init(name, inputs, outputs)` for every parameter
    /// (`bottom.{i}.weight`, `bottom.{i}.bias`, `top.{i}.weight`, `top.{i}.bias`).
    pub(crate) fn register_with(
        store: &mut impl ParamStore,
        config: &DlrmConfig,
        mut init: impl FnMut(&str, usize, usize) -> Init,
    ) -> Result<Dlrm> {
        config.check()?;
        let (bottom_shapes, top_shapes) = config.layer_shapes();
        let mut layers = |prefix: &str, shapes: &[(usize, usize)]| -> Result<Vec<Linear>> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, &(m, n))| {
                    let name = format!("{prefix}.{i}");
                    let w = init(&format!("{name}.weight"), m, n);
                    let b = init(&format!("{name}.bias"), m, n);
                    Linear::register_with(store, &name, m, n, w, Some(b))
                })
                .collect()
        };
        let bottom = layers("bottom", &bottom_shapes)?;
        let top = layers("top", &top_shapes)?;
        Ok(Dlrm {
            config: config.clone(),
            bottom,
            top,
        })
    }

    /// The shape.
    pub fn config(&self) -> &DlrmConfig {
        &self.config
    }

    /// The bottom MLP's layers, input first.
    pub fn bottom(&self) -> &[Linear] {
        &self.bottom
    }

    /// The top MLP's layers, input first.
    pub fn top(&self) -> &[Linear] {
        &self.top
    }

    /// Every parameter with its name, bottom then top, each layer's weight then bias.
    pub fn named_params(&self) -> Vec<(String, crate::tensor::TensorId)> {
        let mut out = Vec::new();
        for (prefix, layers) in [("bottom", &self.bottom), ("top", &self.top)] {
            for (i, l) in layers.iter().enumerate() {
                out.push((format!("{prefix}.{i}.weight"), l.weight));
                if let Some(b) = l.bias {
                    out.push((format!("{prefix}.{i}.bias"), b));
                }
            }
        }
        out
    }

    /// Checks a batch's lengths: `emb_len` values of the embedding vectors `[tables, batch,
    /// dim]` (either layout), `dense` `[batch, dense_features]`, `labels` `[batch]`.
    pub(super) fn check(
        &self,
        emb_len: usize,
        dense: &[f32],
        labels: Option<&[f32]>,
        batch: usize,
    ) -> Result<()> {
        let c = &self.config;
        let want = |what: &str, got: usize, shape: [usize; 3]| match shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
        {
            Some(n) if n == got => Ok(()),
            Some(n) => Err(Error::Length {
                what: format!("{what} values of a DLRM batch of {batch} ({shape:?})"),
                got,
                expected: n,
            }),
            None => Err(Error::Overflow {
                what: format!("the {what} values of a DLRM batch of {batch} ({shape:?})"),
            }),
        };
        if batch == 0 {
            return Err(Error::Empty {
                what: "the DLRM batch".into(),
            });
        }
        want("embedding", emb_len, [c.tables, batch, c.dim])?;
        want("dense", dense.len(), [batch, c.dense_features, 1])?;
        if let Some(l) = labels {
            want("label", l.len(), [batch, 1, 1])?;
        }
        Ok(())
    }

    /// One iteration's forward and backward: every MLP parameter's gradient (of the mean BCE
    /// over the batch) written into its slot, and returned: the mean loss, the gradient of the
    /// embedding vectors in `emb`'s layout (for
    /// [`CachedEmbeddingCollection::backward`](crate::embedding::CachedEmbeddingCollection::backward))
    /// and the click probabilities `σ(logit)`.
    ///
    /// `emb` holds the pooled embedding vectors table-major, `[tables, batch, dim]`, as
    /// [`CachedEmbeddingCollection::forward`](crate::embedding::CachedEmbeddingCollection::forward)
    /// returns them; `dense` is `[batch, dense_features]` row-major, `labels` `[batch]` (0/1
    /// or soft). The store is then in its optimizer stage: run [`ParamStore::step`] (or
    /// [`ParamStore::skip_step`]). Lengths are checked before anything runs.
    pub fn forward_backward<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &[f32],
        dense: &[f32],
        labels: &[f32],
        batch: usize,
    ) -> Result<(f32, Vec<f32>, Vec<f32>)> {
        self.forward_backward_scaled(store, emb, dense, labels, batch, 1.0)
    }

    /// [`Dlrm::forward_backward`] with the MLP gradients of the loss times `loss_scale` (an
    /// optimizer's loss scale, [`HybridAdam::loss_scale`](crate::optim::HybridAdam::loss_scale));
    /// the embedding gradient returned is of the unscaled loss, for the embedding optimizer.
    pub fn forward_backward_scaled<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &[f32],
        dense: &[f32],
        labels: &[f32],
        batch: usize,
        loss_scale: f32,
    ) -> Result<(f32, Vec<f32>, Vec<f32>)> {
        check_loss_scale(loss_scale)?;
        let (sum, grad, probs) = self.forward_backward_parts(
            store,
            emb,
            dense,
            labels,
            batch,
            loss_scale / batch as f32,
            loss_scale,
        )?;
        Ok(((sum / batch as f64) as f32, grad, probs))
    }

    /// [`Dlrm::forward_backward`] with the loss's normalisation explicit, for a step whose
    /// batch is split over ranks: each sample's logit gradient is `grad_scale · ∂ℓᵢ/∂zᵢ`, so
    /// the MLP gradients written are those of `grad_scale · Σᵢ ℓᵢ` over these `batch`
    /// samples; the embedding gradient returned is that one divided by `emb_div`. Returns the
    /// sum of the samples' losses (not the mean), the embedding gradient and the
    /// probabilities. `grad_scale` and `emb_div` must be positive and finite.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_backward_parts<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &[f32],
        dense: &[f32],
        labels: &[f32],
        batch: usize,
        grad_scale: f32,
        emb_div: f32,
    ) -> Result<(f64, Vec<f32>, Vec<f32>)> {
        self.check(emb.len(), dense, Some(labels), batch)?;
        check_scales(grad_scale, emb_div)?;
        let fwd = store.forward()?;
        let emb = self.upload_emb(&fwd, emb, batch)?;
        let f = self.forward(&fwd, emb, dense, labels, batch, grad_scale)?;
        let (sum, probs) = f.outputs.read()?;
        fwd.finish()?;
        let bwd = store.backward()?;
        let d_emb = self.backward(&bwd, f.saved)?.to_f32(bwd.stream())?;
        bwd.finish()?;
        let mut grad = to_table_major(&d_emb, batch, self.config.tables, self.config.dim);
        if emb_div != 1.0 {
            grad.iter_mut().for_each(|g| *g /= emb_div);
        }
        Ok((sum, grad, probs))
    }

    /// The click probabilities of a batch without gradients (evaluation): a forward pass, an
    /// empty backward pass and the iteration ended without a step
    /// ([`ParamStore::skip_step`]). `emb` and `dense` as for [`Dlrm::forward_backward`].
    pub fn predict<S: ParamStore + ?Sized>(
        &self,
        store: &mut S,
        emb: &[f32],
        dense: &[f32],
        batch: usize,
    ) -> Result<Vec<f32>> {
        self.check(emb.len(), dense, None, batch)?;
        let labels = vec![0.0f32; batch];
        let fwd = store.forward()?;
        let emb = self.upload_emb(&fwd, emb, batch)?;
        let f = self.forward(&fwd, emb, dense, &labels, batch, 0.0)?;
        let (_, probs) = f.outputs.read()?;
        drop(f.saved);
        fwd.finish()?;
        store.backward()?.finish()?;
        store.skip_step()?;
        Ok(probs)
    }

    /// Table-major host vectors `[tables, batch, dim]` uploaded sample-major in the parameter
    /// dtype.
    fn upload_emb(&self, fwd: &ForwardPass<'_>, emb: &[f32], batch: usize) -> Result<Act> {
        let c = &self.config;
        let sample_major = to_sample_major(emb, batch, c.tables, c.dim);
        let (d, pool, s) = (fwd.param_dtype(), fwd.pool(), fwd.stream());
        Act::upload(pool, s, batch * c.tables, c.dim, d, &sample_major)
    }

    /// The forward from the embedding vectors on the device (`[batch·tables, dim]` of the
    /// parameter dtype, sample-major): bottom MLP, interaction, top MLP, fused BCE (its
    /// gradient scaled by `scale`).
    pub(super) fn forward(
        &self,
        fwd: &ForwardPass<'_>,
        emb: Act,
        dense: &[f32],
        labels: &[f32],
        batch: usize,
        scale: f32,
    ) -> Result<Forward> {
        let c = &self.config;
        let (d, pool, s) = (fwd.param_dtype(), fwd.pool(), fwd.stream());
        let x = Act::upload(pool, s, batch, c.dense_features, d, dense)?;
        let (bottom_in, dense_vec) = mlp_forward(fwd, &self.bottom, x, true)?;
        emb.expect("embedding vectors", Some(batch * c.tables), c.dim, d)?;
        let shape = c.interaction(batch);
        let inter = Act::alloc(pool, batch, shape.out_width(), d)?;
        let (dev, s) = (fwd.device(), fwd.stream());
        interaction_forward(
            dev,
            s,
            dense_vec.input(),
            emb.input(),
            inter.view(),
            shape,
            d,
        )?;
        let (top_in, logits) = mlp_forward(fwd, &self.top, inter, false)?;
        let labels = Act::upload(pool, s, batch, 1, DType::F32, labels)?;
        // the losses and the probabilities side by side, for one copy to the host
        let loss_probs = Act::alloc(pool, 2, batch, DType::F32)?;
        let dlogits = Act::alloc(pool, batch, 1, d)?;
        let out = BceOutputs {
            loss: loss_probs.view().slice(0, batch * 4)?,
            dlogits: Some(dlogits.view()),
            probs: Some(loss_probs.view().slice(batch * 4, batch * 4)?),
        };
        bce_with_logits(dev, s, logits.input(), labels.input(), d, scale, out)?;
        let copy = dev.copy_d2h(s, loss_probs.input(), dev.alloc_host(batch * 8)?)?;
        Ok(Forward {
            outputs: Outputs { copy, batch },
            saved: Saved {
                bottom_in,
                dense: dense_vec,
                emb,
                top_in,
                dlogits,
            },
        })
    }

    /// The backward from the logits' gradient: the MLP gradients into their slots, the
    /// embedding vectors' gradient returned on the device, sample-major, `[batch·tables, dim]`
    /// of the parameter dtype (written on the pass's stream).
    pub(super) fn backward(&self, bwd: &BackwardPass<'_>, saved: Saved) -> Result<Act> {
        let c = &self.config;
        let batch = saved.dense.rows();
        let (d, pool) = (bwd.param_dtype(), bwd.pool());
        let d_inter = mlp_backward(bwd, &self.top, &saved.top_in, saved.dlogits, true, false)?
            .ok_or_else(|| Error::Internal {
                what: "the top MLP asked for its input gradient gave none".into(),
            })?;
        let shape = c.interaction(batch);
        let d_dense = Act::alloc(pool, batch, c.dim, d)?;
        let d_emb = Act::alloc(pool, batch * c.tables, c.dim, d)?;
        interaction_backward(
            bwd.device(),
            bwd.stream(),
            saved.dense.input(),
            saved.emb.input(),
            d_inter.input(),
            d_dense.view(),
            d_emb.view(),
            shape,
            d,
        )?;
        drop(d_inter);
        // the bottom MLP ends in a ReLU: its output (`dense`) is the last ReLU's
        let mut bottom_in = saved.bottom_in;
        bottom_in.push(saved.dense);
        mlp_backward(bwd, &self.bottom, &bottom_in, d_dense, false, true)?;
        Ok(d_emb)
    }
}

/// A loss scale must be a positive finite number.
pub(super) fn check_loss_scale(loss_scale: f32) -> Result<()> {
    crate::nn::check_scale("the loss scale", loss_scale)
}

/// The explicit normalisation of a split batch: a gradient scale and a divisor, each positive
/// and finite.
pub(super) fn check_scales(grad_scale: f32, emb_div: f32) -> Result<()> {
    for (what, v) in [("the gradient scale", grad_scale), ("the divisor", emb_div)] {
        crate::nn::check_scale(what, v)?;
    }
    Ok(())
}

/// `layers` with a ReLU after each (after the last too when `last_relu`): the input of each
/// layer kept (for the backward), and the output.
fn mlp_forward(
    fwd: &ForwardPass<'_>,
    layers: &[Linear],
    mut x: Act,
    last_relu: bool,
) -> Result<(Vec<Act>, Act)> {
    let mut kept = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let z = l.forward(fwd, &x)?;
        kept.push(x);
        x = if i + 1 < layers.len() || last_relu {
            relu(fwd, &z)?
        } else {
            z
        };
    }
    Ok((kept, x))
}

/// The backward of [`mlp_forward`]: `inputs[i]` is layer `i`'s input (with the ReLU'd output
/// appended when `last_relu`), `dy` the output's gradient. Returns the input's gradient when
/// `need_dx`.
fn mlp_backward(
    bwd: &BackwardPass<'_>,
    layers: &[Linear],
    inputs: &[Act],
    mut dy: Act,
    need_dx: bool,
    last_relu: bool,
) -> Result<Option<Act>> {
    let n = layers.len();
    for i in (0..n).rev() {
        // the ReLU after layer i, from its output (layer i + 1's input)
        if i + 1 < n || last_relu {
            dy = relu_grad(bwd, &inputs[i + 1], &dy)?;
        }
        let dx = layers[i].backward(bwd, &inputs[i], &dy, i > 0 || need_dx)?;
        match dx {
            Some(dx) => dy = dx,
            None => return Ok(None),
        }
    }
    Ok(Some(dy))
}

/// `max(x, 0)` into a new activation.
fn relu<K: PassKind>(pass: &Pass<'_, K>, x: &Act) -> Result<Act> {
    let y = Act::alloc(pass.pool(), x.rows(), x.cols(), x.dtype())?;
    relu_forward(pass.device(), pass.stream(), x.input(), y.view(), x.dtype())?;
    Ok(y)
}

/// The ReLU's input gradient from its output `y` (positive exactly where its input is).
fn relu_grad(pass: &BackwardPass<'_>, y: &Act, dy: &Act) -> Result<Act> {
    dy.expect("dy", Some(y.rows()), y.cols(), y.dtype())?;
    let dx = Act::alloc(pass.pool(), y.rows(), y.cols(), y.dtype())?;
    let (dev, s) = (pass.device(), pass.stream());
    relu_backward(dev, s, y.input(), dy.input(), dx.view(), y.dtype())?;
    Ok(dx)
}

/// `[tables, batch, dim]` → `[batch, tables, dim]`.
fn to_sample_major(v: &[f32], batch: usize, tables: usize, dim: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for t in 0..tables {
        for b in 0..batch {
            let src = (t * batch + b) * dim;
            let dst = (b * tables + t) * dim;
            out[dst..dst + dim].copy_from_slice(&v[src..src + dim]);
        }
    }
    out
}

/// `[batch, tables, dim]` → `[tables, batch, dim]`.
fn to_table_major(v: &[f32], batch: usize, tables: usize, dim: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for b in 0..batch {
        for t in 0..tables {
            let src = (b * tables + t) * dim;
            let dst = (t * batch + b) * dim;
            out[dst..dst + dim].copy_from_slice(&v[src..src + dim]);
        }
    }
    out
}

/// facebookresearch/dlrm's scales, uniform (see [`Dlrm::register`]) for parameter `name` of an
/// `inputs → outputs` layer.
pub fn default_init(name: &str, inputs: usize, outputs: usize, seed: u64) -> Init {
    let std = if name.ends_with(".bias") {
        (1.0 / outputs as f64).sqrt()
    } else {
        (2.0 / (inputs + outputs) as f64).sqrt()
    };
    let bound = (3.0f64.sqrt() * std) as f32;
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    Init::Uniform {
        seed: h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        lo: -bound,
        hi: bound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_round_trip() {
        let v: Vec<f32> = (0..2 * 3 * 4).map(|i| i as f32).collect();
        let s = to_sample_major(&v, 3, 2, 4);
        // sample 1, table 1: sample-major row 1·2 + 1, table-major row 1·3 + 1
        assert_eq!(&s[3 * 4..4 * 4], &v[4 * 4..5 * 4]);
        assert_eq!(to_table_major(&s, 3, 2, 4), v);
    }

    #[test]
    fn init_scales_follow_the_reference() {
        let Init::Uniform { lo, hi, .. } = default_init("top.0.weight", 367, 512, 0) else {
            panic!("uniform");
        };
        let want = (3.0f64 * 2.0 / 879.0).sqrt() as f32;
        assert!((hi - want).abs() < 1e-7 && lo == -hi);
        let Init::Uniform { hi, .. } = default_init("top.0.bias", 367, 512, 0) else {
            panic!("uniform");
        };
        assert!((hi - (3.0f32 / 512.0).sqrt()).abs() < 1e-7);
    }
}
