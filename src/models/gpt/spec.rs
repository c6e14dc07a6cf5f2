//! The GPT as the placement simulator sees it: its tensors and the moments its layers fetch.

use super::Gpt;
use crate::simulate::{BackwardOp, ModelSpec, OpSpec};

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
    /// `embed`. The non-model bytes are zero: set them with
    /// [`ModelSpec::set_tide`] (e.g. from the warm-up trace of a manager, whose
    /// moments are these).
    pub fn spec(&self, checkpoint: bool) -> ModelSpec {
        let tensors: Vec<(String, usize)> = self
            .config
            .param_shapes()
            .into_iter()
            .map(|(n, s)| (n, s.iter().product()))
            .collect();
        // FLOPs depend on the batch, which this spec does not fix
        let op = |name: String, tensors: Vec<usize>| OpSpec {
            name,
            tensors,
            fwd_non_model: 0,
            bwd_non_model: 0,
            flops: 0,
            bwd_flops: 0,
        };
        let mut ops = vec![op("embed".into(), vec![0, 1])];
        for l in 0..self.config.layers {
            for (k, name) in BLOCK_OPS.iter().enumerate() {
                let t = 2 + 12 * l + 2 * k;
                ops.push(op(format!("h.{l}.{name}"), vec![t, t + 1]));
            }
        }
        let lf = 2 + 12 * self.config.layers;
        ops.push(op("ln_f".into(), vec![lf, lf + 1]));
        ops.push(op("lm_head".into(), vec![0]));
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
