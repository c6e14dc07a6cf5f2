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

/// The cross-entropy of `n` rows whose classes are split over a row group: three steps
/// around all-reduces of `n` f32 each in the group (the row max, then the sums of
/// `exp(z − m)` and the target's logit, then the gradient over the local logits, in place).
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
            return Err(Error::BadValue {
                what: "the gradient scale of a sharded cross-entropy".into(),
                value: f64::from(grad_scale),
                want: "finite",
            });
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

/// Where a rank's logits sit in the whole batch, for [`ShardedCrossEntropy::batch_mean`].
#[derive(Clone, Copy, Debug)]
pub struct BatchRows<'g> {
    /// The whole batch's targets (every rank has them).
    pub targets: &'g [i32],
    /// The first of this rank's rows in the batch.
    pub first: usize,
    /// The ranks of which the row blocks tile the batch once, and whether this rank is the
    /// one of its row group that counts its rows' losses there; `None` when every rank holds
    /// every row (the loss is then the row group's).
    pub(crate) owners: Option<(&'g Communicator, bool)>,
}

impl ShardedCrossEntropy {
    /// The mean loss over the rows of the whole batch that are not ignored, of this rank's
    /// `logits` (rows `rows.first ..` of the batch, this rank's classes): [`forward`]
    /// over `group` with the gradient scaled by `loss_scale / counted`, then the rows' sums
    /// added over the owners (an `f64` host all-reduce). Every rank gets the same loss.
    ///
    /// [`forward`]: ShardedCrossEntropy::forward
    pub fn batch_mean(
        &self,
        pass: &ForwardPass<'_>,
        group: &Communicator,
        logits: &Act,
        rows: BatchRows<'_>,
        loss_scale: f32,
    ) -> Result<f32> {
        let n = logits.rows();
        let mine = rows
            .first
            .checked_add(n)
            .and_then(|end| rows.targets.get(rows.first..end))
            .ok_or_else(|| Error::TooFew {
                what: format!(
                    "targets in the batch for logits of {n} rows from row {}",
                    rows.first
                ),
                got: rows.targets.len(),
                need: rows.first.saturating_add(n),
            })?;
        if !(loss_scale > 0.0 && loss_scale.is_finite()) {
            return Err(Error::BadValue {
                what: "the loss scale of a sharded cross-entropy".into(),
                value: f64::from(loss_scale),
                want: "finite and above 0",
            });
        }
        let counted = rows
            .targets
            .iter()
            .filter(|&&t| t != self.ignore_index)
            .count()
            .max(1) as f64;
        let scale = (f64::from(loss_scale) / counted) as f32;
        let sum = self.forward(pass, group, logits, mine, scale)?;
        let total = match rows.owners {
            None => sum,
            Some((owners, counts)) => {
                let mut t = [if counts { sum } else { 0.0 }];
                owners.all_reduce_host(&mut t, ReduceOp::Sum)?;
                t[0]
            }
        };
        Ok((total / counted) as f32)
    }
}
