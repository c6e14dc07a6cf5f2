//! The softmax cross-entropy over logits whose classes are split over a group of ranks that
//! share the rows: each rank holds `[n, V_r]`, the columns [`VocabShard`] gives it of the same
//! `n` rows. Three steps around all-reduces of `n` f32 each in the row group: the row max
//! (MAX), then the sums of `exp(z − m)` and the target's logit (SUM, one call), then the
//! gradient over the local logits, in place. The 1D head ([`super::VocabHead1D`]) and the 2D,
//! 2.5D and 3D classifiers share it; they differ only in which group shares a row.

use crate::comm::{Communicator, ReduceOp};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Act;
use crate::ops::{
    check_targets, vocab_ce_grad, vocab_ce_max, vocab_ce_sums, VocabCeGrad, VocabCeSums,
    VocabCrossEntropy, VocabShard,
};
use crate::store::ForwardPass;

/// The cross-entropy of `n` rows whose classes are split over a row group: three steps around
/// all-reduces of `n` f32 each in the row group (the row max, then the sums of `exp(z − m)`
/// and the target's logit in one call, then the gradient over the local logits, in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardedCrossEntropy {
    /// The classes this rank holds, out of all of them.
    pub classes: VocabShard,
    /// Rows whose target is this value count for nothing.
    pub ignore_index: i32,
}

impl ShardedCrossEntropy {
    /// Runs the loss over this rank's `logits` (`[n, classes.rows]`, the pass's parameter
    /// dtype) against `targets` (host, `n` ids over all the classes), with `group` the ranks
    /// holding the other classes of the same rows. `logits` is overwritten by its gradient times
    /// `grad_scale` (for a mean loss, the loss scale over the rows counted in the whole batch).
    /// Returns the sum of the `n` rows' losses, the same on every rank of the group. Targets,
    /// shapes and the scale are checked on the host before anything runs.
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        group: &Communicator,
        logits: &Act,
        targets: &[i32],
        grad_scale: f32,
    ) -> Result<f64> {
        let (dev, s, d) = (pass.device(), pass.stream(), pass.param_dtype());
        let n = targets.len();
        logits.expect("logits", Some(n), self.classes.rows, d)?;
        check_targets(targets, self.classes.vocab, self.ignore_index)?;
        if !grad_scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "a sharded cross-entropy with gradient scale {grad_scale}"
            )));
        }
        let ce = VocabCrossEntropy::new(self.classes, self.ignore_index, grad_scale);
        let tgt = pass.upload(bytemuck::cast_slice(targets))?;
        let stats = pass.pool().alloc(4 * n * 4)?;
        let part = |k: usize| stats.view(k * n * 4, n * 4);
        let (max, sum, target, losses) = (part(0)?, part(1)?, part(2)?, part(3)?);
        vocab_ce_max(dev, s, logits.input(), max, &ce, d)?;
        group.all_reduce(s, max, max, DType::F32, ReduceOp::Max)?;
        let tv = tgt.view(0, n * 4)?;
        let sums = VocabCeSums {
            logits: logits.input(),
            targets: tv.into(),
            global_max: max.into(),
            sum_exp: sum,
            target_logit: target,
        };
        vocab_ce_sums(dev, s, sums, &ce, d)?;
        // the sums and the target logits in one all-reduce
        let both = stats.view(n * 4, 2 * n * 4)?;
        group.all_reduce(s, both, both, DType::F32, ReduceOp::Sum)?;
        let grad = VocabCeGrad {
            logits: logits.view(),
            targets: tv.into(),
            global_max: max.into(),
            global_sum: sum.into(),
            global_target: Some(target.into()),
            losses: Some(losses),
        };
        vocab_ce_grad(dev, s, grad, &ce, d)?;
        let bytes = dev.download(s, losses)?;
        Ok(bytemuck::pod_collect_to_vec::<u8, f32>(&bytes)
            .iter()
            .map(|&l| f64::from(l))
            .sum())
    }
}
