//! The GPT as the placement simulator sees it: its tensors and the moments its layers fetch.

use super::Gpt;
use crate::simulate::{BackwardOp, ModelSpec};
use serde::Serialize;

use super::GptConfig;
use crate::error::{Error, Result};
use crate::simulate::{largest_fitting, OpSpec, SimOptions, SimReport};
use crate::tide::Policy;

/// The numbers [`GptConfig::spec`] computes with.
#[derive(Clone, Debug, PartialEq, Serialize)]
struct SimShape {
    name: String,
    layers: usize,
    hidden: usize,
    heads: usize,
    vocab: usize,
    seq: usize,
    batch: usize,
    checkpoint: bool,
}

impl GptConfig {
    /// The shape the simulator counts with, after checking that every byte count fits in
    /// `u64` with room to add them up.
    fn sim_shape(&self, batch: usize, seq: usize, checkpoint: bool) -> Result<SimShape> {
        self.validate()?;
        let c = SimShape {
            name: format!(
                "GPT L{} C{} H{} V{}",
                self.layers, self.channels, self.heads, self.vocab
            ),
            layers: self.layers,
            hidden: self.channels,
            heads: self.heads,
            vocab: self.vocab,
            seq,
            batch,
            checkpoint,
        };
        let (h, s, b, a, v) = (
            c.hidden as u64,
            c.seq as u64,
            c.batch as u64,
            c.heads as u64,
            c.vocab as u64,
        );
        let fits = |xs: &[u64]| {
            xs.iter()
                .try_fold(1u64, |acc, &x| acc.checked_mul(x))
                .is_some_and(|p| p > 0 && p < 1 << 56)
        };
        let l = c.layers as u64;
        if !(fits(&[s, b, h, 64, l])
            && fits(&[a, s, s, b, 8])
            && fits(&[s, b, v, 8])
            && fits(&[v.saturating_add(s), h, 16])
            && fits(&[h, h, 16, l]))
        {
            // the shape's own dimensions are positive (validated): a zero is the step's
            if batch == 0 || seq == 0 {
                return Err(Error::Empty {
                    what: format!("a simulated step of {batch} × {seq} tokens"),
                });
            }
            return Err(Error::Overflow {
                what: format!(
                    "the byte counts (kept below 2^56) of a step of {batch} × {seq} tokens of \
                     GPT shape {self:?}"
                ),
            });
        }
        Ok(c)
    }

    /// The most layers of this shape (its channels, heads and vocabulary kept) whose model
    /// data fits in host memory (plus `file_mem` on the file tier) and whose every moment fits
    /// on the device under `policy`, for steps of `batch × seq` tokens
    /// ([`simulate::largest_fitting`](crate::simulate::largest_fitting)): the shape and its
    /// report, or `None` if not even one layer fits.
    pub fn largest_fitting(
        &self,
        [batch, seq]: [usize; 2],
        checkpoint: bool,
        policy: Policy,
        opts: &SimOptions,
        file_mem: u64,
    ) -> Result<Option<(GptConfig, SimReport)>> {
        let with = |layers| GptConfig {
            layers,
            ..self.clone()
        };
        let spec_of = |layers| with(layers).spec(batch, seq, checkpoint);
        let found = largest_fitting(spec_of, policy, opts, file_mem)?;
        Ok(found.map(|(layers, r)| (with(layers), r)))
    }

    /// The model as the [simulator](crate::simulate) sees it from its shape alone, for a step
    /// of `batch` sequences of `seq` tokens (every block checkpointed with `checkpoint`): the
    /// token and position embeddings (`seq` positions), `layers` blocks of
    /// (LayerNorm, attention, LayerNorm, MLP), a final LayerNorm and an LM head tied to the token
    /// embedding (a shared parameter: two forward uses).
    ///
    /// Non-model bytes follow the fp16 activation sizes of a transformer layer,
    /// `s·b·h·(34 + 5·a·s/h)` bytes while a layer computes, plus `2·s·b·h` per checkpointed layer
    /// input kept until backward, plus fp16 and fp32 logits at the head.
    pub fn spec(&self, batch: usize, seq: usize, checkpoint: bool) -> Result<ModelSpec> {
        let c = self.sim_shape(batch, seq, checkpoint)?;
        let (h, s, b, a, v) = (
            c.hidden as u64,
            c.seq as u64,
            c.batch as u64,
            c.heads as u64,
            c.vocab as u64,
        );
        let sbh = s * b * h;
        let layer_act = sbh * 34 + 5 * a * s * s * b;
        let ckpt = 2 * sbh;
        let logits = s * b * v * 6;
        let mut tensors: Vec<(String, usize)> = Vec::new();
        let mut add = |name: String, n: usize| {
            tensors.push((name, n));
            tensors.len() - 1
        };
        let wte = add("wte".into(), c.vocab * c.hidden);
        let wpe = add("wpe".into(), c.seq * c.hidden);
        let mut ops = vec![OpSpec {
            name: "embed".into(),
            tensors: vec![wte, wpe],
            fwd_non_model: 2 * sbh,
            bwd_non_model: 4 * sbh,
            flops: 0,
            bwd_flops: 0,
        }];
        // matrix products only: 2 FLOPs a multiply-add, the backward twice the forward, plus the
        // forward again where a checkpointed layer is recomputed
        let t = s * b;
        let back = |f: u64| if c.checkpoint { 3 * f } else { 2 * f };
        let hd = c.hidden;
        for l in 0..c.layers {
            let kept = if c.checkpoint {
                (l as u64 + 1) * ckpt
            } else {
                l as u64 * layer_act
            };
            let work = layer_act;
            let mut op = |name: &str, ts: Vec<(String, usize)>, frac: f64, flops: u64| {
                let ids = ts
                    .into_iter()
                    .map(|(n, k)| add(format!("h{l}.{name}.{n}"), k))
                    .collect();
                ops.push(OpSpec {
                    name: format!("h{l}.{name}"),
                    tensors: ids,
                    fwd_non_model: kept + (work as f64 * frac) as u64,
                    bwd_non_model: kept + work + (work as f64 * frac) as u64 / 2 + 2 * sbh,
                    flops,
                    bwd_flops: back(flops),
                });
            };
            op("ln_1", vec![("w".into(), hd), ("b".into(), hd)], 0.1, 0);
            op(
                "attn",
                vec![
                    ("qkv.w".into(), 3 * hd * hd),
                    ("qkv.b".into(), 3 * hd),
                    ("proj.w".into(), hd * hd),
                    ("proj.b".into(), hd),
                ],
                0.6,
                // q, k, v and the projection; the scores and their weighted sum
                8 * t * h * h + 4 * t * s * h,
            );
            op("ln_2", vec![("w".into(), hd), ("b".into(), hd)], 0.7, 0);
            op(
                "mlp",
                vec![
                    ("fc.w".into(), 4 * hd * hd),
                    ("fc.b".into(), 4 * hd),
                    ("proj.w".into(), 4 * hd * hd),
                    ("proj.b".into(), hd),
                ],
                1.0,
                16 * t * h * h,
            );
        }
        let kept = if c.checkpoint {
            c.layers as u64 * ckpt
        } else {
            c.layers as u64 * layer_act
        };
        let lnf_w = add("ln_f.w".into(), hd);
        let lnf_b = add("ln_f.b".into(), hd);
        ops.push(OpSpec {
            name: "ln_f".into(),
            tensors: vec![lnf_w, lnf_b],
            fwd_non_model: kept + 2 * sbh,
            bwd_non_model: kept + 4 * sbh,
            flops: 0,
            bwd_flops: 0,
        });
        ops.push(OpSpec {
            name: "lm_head".into(),
            tensors: vec![wte],
            fwd_non_model: kept + logits,
            bwd_non_model: kept + logits + 2 * sbh,
            flops: 2 * t * h * v,
            // the head is not checkpointed
            bwd_flops: 4 * t * h * v,
        });
        Ok(ModelSpec {
            name: c.name.clone(),
            tensors,
            ops,
            backward: None,
        })
    }
}

/// The fetches of one block's forward, each `(name, first tensor)` of a pair: `ln_1`,
/// `attn.c_attn`, `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj` (each a weight and its bias
/// or γ and β, in registration order).
const BLOCK_OPS: [&str; 6] = [
    "ln_1",
    "attn.c_attn",
    "attn.c_proj",
    "ln_2",
    "mlp.c_fc",
    "mlp.c_proj",
];

impl Gpt {
    /// The model as the [simulator](crate::simulate) sees it, moment for moment as
    /// [`Gpt::forward_backward`] fetches: forward `embed`, per block its six layers, `ln_f`, the
    /// head (`wte` again); backward the head, `ln_f`, per block in reverse (with `checkpoint`,
    /// first its six forward fetches again, as recomputations) its layers reversed, and
    /// `embed`. The FLOPs are those of a step of `batch` sequences of `seq` tokens: the
    /// matrix products' (2 a multiply-add, the backward twice the forward) and attention's
    /// two `seq × seq` products. The non-model bytes are zero: set them with
    /// [`ModelSpec::set_tide`] (e.g. from the warm-up trace of a manager, whose
    /// moments are these).
    pub fn spec(&self, batch: usize, seq: usize, checkpoint: bool) -> ModelSpec {
        let tensors: Vec<(String, usize)> = self
            .config
            .param_shapes()
            .into_iter()
            .map(|(n, s)| (n, s.iter().product()))
            .collect();
        let tokens = (batch * seq) as u64;
        let op = |name: String, tensors: Vec<usize>, flops: u64| OpSpec {
            name,
            tensors,
            fwd_non_model: 0,
            bwd_non_model: 0,
            flops,
            bwd_flops: 2 * flops,
        };
        // a matrix product by the weight `t`
        let matmul = |t: usize| 2 * tokens * tensors[t].1 as u64;
        // softmax(q·kᵀ)·v over every head: two products of seq × seq × channels a sequence
        let attention = 4 * (batch * seq * seq * self.config.channels) as u64;
        let mut ops = vec![op("embed".into(), vec![0, 1], 0)];
        for l in 0..self.config.layers {
            for (k, name) in BLOCK_OPS.iter().enumerate() {
                let t = 2 + 12 * l + 2 * k;
                let flops = match *name {
                    "ln_1" | "ln_2" => 0,
                    "attn.c_attn" => matmul(t) + attention,
                    _ => matmul(t),
                };
                ops.push(op(format!("h.{l}.{name}"), vec![t, t + 1], flops));
            }
        }
        let lf = 2 + 12 * self.config.layers;
        ops.push(op("ln_f".into(), vec![lf, lf + 1], 0));
        ops.push(op("lm_head".into(), vec![0], matmul(0)));
        let step = |op: usize, recompute: bool| BackwardOp {
            op,
            recompute,
            non_model: 0,
        };
        let head = ops.len() - 1;
        let mut backward = vec![step(head, false), step(head - 1, false)];
        for l in (0..self.config.layers).rev() {
            let first = 1 + 6 * l;
            if checkpoint {
                backward.extend((first..first + 6).map(|o| step(o, true)));
            }
            backward.extend((first..first + 6).rev().map(|o| step(o, false)));
        }
        backward.push(step(0, false));
        ModelSpec {
            name: format!(
                "gpt-L{}-C{}-V{}",
                self.config.layers, self.config.channels, self.config.vocab
            ),
            tensors,
            ops,
            backward: Some(backward),
        }
    }
}
