//! Loss layers for a model of one's own: softmax cross-entropy for a classifier
//! ([`CrossEntropyLoss`]), mean squared error for a regressor ([`MseLoss`]) and binary
//! cross-entropy on logits ([`BceWithLogitsLoss`]).
//!
//! Each runs in the forward pass, fused with its gradient, and returns the loss on its way to
//! the host ([`Loss`]) and the gradient of the model's output, which the backward starts from.
//! The gradient is that of the mean loss times the optimizer's loss scale and divided by the
//! micro-batches it accumulates ([`HybridAdam::loss_scale`],
//! [`HybridConfig::accumulation_steps`](crate::optim::HybridConfig::accumulation_steps)): taken
//! from the optimizer the step will use, so an f16 model cannot be trained with the scale
//! forgotten. The loss returned is not scaled.

use super::act::Act;
use super::loss::Loss;
use crate::dtype::{encode_f32, DType};
use crate::error::{Error, Result};
use crate::ops::{
    add, bce_with_logits, check_targets, cross_entropy_forward_backward, grad_stats, scale, Axpby,
    BceOutputs, CrossEntropy, GRAD_STATS_BYTES, MAX_VOCAB,
};
use crate::optim::HybridAdam;
use crate::store::ForwardPass;

/// The factor of a loss's gradient: the optimizer's loss scale over `count` terms and its
/// micro-batches.
fn grad_scale(opt: &HybridAdam, count: usize) -> f32 {
    let micro = opt.config().accumulation_steps.max(1) as f64;
    (f64::from(opt.loss_scale()) / (count.max(1) as f64 * micro)) as f32
}

/// Checks that `y` is a model float and `targets` has one value per element of it.
fn check_elements(what: &str, y: &Act, targets: usize) -> Result<()> {
    if !y.dtype().is_model_float() {
        return Err(Error::WrongDType {
            what: format!("{what}'s input"),
            dtype: y.dtype(),
            expected: "a model float (F32, F16 or BF16)",
        });
    }
    if targets != y.numel() {
        return Err(Error::Length {
            what: format!(
                "{what}: targets for an output of [{}, {}]",
                y.rows(),
                y.cols()
            ),
            got: targets,
            expected: y.numel(),
        });
    }
    Ok(())
}

/// Softmax cross-entropy over `classes` logits a row, averaged over the rows whose target is
/// not `ignore_index`: `loss = mean(logsumexp(x) − x[target])`, gradient
/// `(softmax(x) − onehot(target)) · scale / counted`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossEntropyLoss {
    /// Logits a row (`1 ≤ classes ≤` [`MAX_VOCAB`]).
    pub classes: usize,
    /// Rows whose target is this value count for nothing (PyTorch's default -100).
    pub ignore_index: i32,
}

impl CrossEntropyLoss {
    /// The loss over `classes` classes, ignoring targets of -100.
    pub fn new(classes: usize) -> Result<CrossEntropyLoss> {
        if classes == 0 {
            return Err(Error::TooFew {
                what: "classes of a cross-entropy loss".into(),
                got: 0,
                need: 1,
            });
        }
        if classes > MAX_VOCAB {
            return Err(Error::TooLarge {
                what: "classes of a cross-entropy loss".into(),
                requested: classes as u128,
                limit: MAX_VOCAB as u64,
            });
        }
        Ok(CrossEntropyLoss {
            classes,
            ignore_index: -100,
        })
    }

    /// The loss of `logits` `[N, classes]` (a model float) for `targets` (`N` class indices or
    /// the ignore index), and the logits' gradient, written over the logits (which the layer
    /// takes). A target outside `0..classes` is [`Error::TokenOutOfRange`].
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        opt: &HybridAdam,
        logits: Act,
        targets: &[i32],
    ) -> Result<(Loss, Act)> {
        let what = "a cross-entropy loss";
        if !logits.dtype().is_model_float() {
            return Err(Error::WrongDType {
                what: format!("{what}'s logits"),
                dtype: logits.dtype(),
                expected: "a model float (F32, F16 or BF16)",
            });
        }
        logits.expect("logits", Some(targets.len()), self.classes, logits.dtype())?;
        check_targets(targets, self.classes, self.ignore_index)?;
        let counted = targets.iter().filter(|&&t| t != self.ignore_index).count();
        let scale = grad_scale(opt, counted);
        let loss = fused_cross_entropy(pass, &logits, targets, self.ignore_index, scale)?;
        Ok((loss, logits))
    }
}

/// The mean cross-entropy of `logits` `[N, V]` for `targets` (each in `0..V` or
/// `ignore_index`, checked by the caller before any work), on its way to the host, and the
/// logits' gradient times `grad_scale` written over them (the fused op).
pub(crate) fn fused_cross_entropy(
    pass: &ForwardPass<'_>,
    logits: &Act,
    targets: &[i32],
    ignore_index: i32,
    grad_scale: f32,
) -> Result<Loss> {
    let v = logits.cols();
    let counted = targets.iter().filter(|&&t| t != ignore_index).count();
    let n = targets.len();
    let (dev, s) = (pass.device(), pass.stream());
    let tgt = pass.upload(bytemuck::cast_slice(targets))?;
    let losses = pass.pool().alloc(n * 4)?;
    let ce = CrossEntropy {
        vocab: v,
        padded_vocab: v,
        ignore_index,
        grad_scale,
    };
    let lv = losses.view(0, n * 4)?;
    let d = logits.dtype();
    cross_entropy_forward_backward(dev, s, logits.view(), tgt.view(0, n * 4)?, lv, &ce, d)?;
    let host = dev.alloc_host(n * 4)?;
    let copy = dev.copy_d2h(s, lv, host)?;
    Ok(Loss::copying(copy, counted))
}

/// Mean squared error over every element: `loss = mean((y − t)²)`, gradient
/// `2·(y − t) · scale / elements`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MseLoss;

impl MseLoss {
    /// The loss of `y` `[N, K]` (a model float) against `targets` (`N·K` values, row-major),
    /// and `y`'s gradient (a new activation).
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        opt: &HybridAdam,
        y: &Act,
        targets: &[f32],
    ) -> Result<(Loss, Act)> {
        check_elements("a mean squared error", y, targets.len())?;
        let (dev, s, d) = (pass.device(), pass.stream(), y.dtype());
        let t = pass.upload(&encode_f32(targets, d))?;
        let diff = Act::alloc(pass.pool(), y.rows(), y.cols(), d)?;
        let minus = Axpby {
            alpha: 1.0,
            beta: -1.0,
        };
        add(
            dev,
            s,
            minus,
            y.input(),
            t.view(0, y.len_bytes())?,
            diff.view(),
            d,
        )?;
        // Σ (y − t)², before the difference becomes the gradient
        let stats = pass.pool().alloc(GRAD_STATS_BYTES)?;
        let sv = stats.view(0, GRAD_STATS_BYTES)?;
        grad_stats(dev, s, diff.input(), d, sv)?;
        let host = dev.alloc_host(GRAD_STATS_BYTES)?;
        let copy = dev.copy_d2h(s, sv, host)?;
        let n = y.numel();
        scale(dev, s, 2.0 * grad_scale(opt, n), diff.view(), d)?;
        Ok((Loss::sum_of_squares(copy, n), diff))
    }
}

/// Sigmoid and binary cross-entropy on logits, averaged over every element:
/// `loss = mean(max(x, 0) − x·y + ln(1 + e^{−|x|}))`, gradient `(σ(x) − y) · scale / elements`
/// ([`bce_with_logits`](crate::ops::bce_with_logits)); labels are 0/1 or soft.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BceWithLogitsLoss;

impl BceWithLogitsLoss {
    /// The loss of `logits` `[N, K]` (a model float) for `labels` (`N·K` values in `[0, 1]`),
    /// and the logits' gradient (a new activation).
    pub fn forward(
        &self,
        pass: &ForwardPass<'_>,
        opt: &HybridAdam,
        logits: &Act,
        labels: &[f32],
    ) -> Result<(Loss, Act)> {
        check_elements("a binary cross-entropy", logits, labels.len())?;
        if let Some(i) = labels.iter().position(|l| !(0.0..=1.0).contains(l)) {
            return Err(Error::BadValue {
                what: format!("binary cross-entropy label {i}"),
                value: f64::from(labels[i]),
                want: "in [0, 1]",
            });
        }
        let (dev, s, d) = (pass.device(), pass.stream(), logits.dtype());
        let n = logits.numel();
        let y = pass.upload(&encode_f32(labels, DType::F32))?;
        let losses = pass.pool().alloc(n * 4)?;
        let lv = losses.view(0, n * 4)?;
        let dlogits = Act::alloc(pass.pool(), logits.rows(), logits.cols(), d)?;
        let out = BceOutputs {
            loss: lv,
            dlogits: Some(dlogits.view()),
            probs: None,
        };
        let yv = y.view(0, n * 4)?;
        bce_with_logits(dev, s, logits.input(), yv, d, grad_scale(opt, n), out)?;
        let host = dev.alloc_host(n * 4)?;
        let copy = dev.copy_d2h(s, lv, host)?;
        Ok((Loss::copying(copy, n), dlogits))
    }
}
