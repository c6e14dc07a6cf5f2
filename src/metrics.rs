//! Evaluation metrics of a binary classifier: the exact ROC AUC and the log loss.
//!
//! [`auc`] sorts the scores once (O(n log n)) and gives tied scores their average rank (the
//! midrank rule), so it equals the Mann–Whitney statistic `U / (n_pos · n_neg)`: the fraction
//! of (positive, negative) pairs in which the positive scores higher, a tie counting 1/2. The
//! rank sums are kept in integers, so the result is exact up to the final division.
//!
//! Labels are anything [`BinaryLabel`]: `f32`/`f64` 0.0 or 1.0 (as in a
//! [`Batch`](crate::data::criteo::Batch)), `u8` 0 or 1, or `bool`.
//!
//! ```
//! use tidemem::metrics::{auc, log_loss};
//! # fn main() -> tidemem::Result<()> {
//! let scores = [0.1f32, 0.4, 0.35, 0.8];
//! let labels = [0.0f32, 0.0, 1.0, 1.0];
//! assert_eq!(auc(&scores, &labels)?, Some(0.75));
//! assert_eq!(auc(&scores, &[1u8; 4])?, None); // one class only
//! assert!(auc(&[f32::NAN, 0.0], &[0u8, 1]).is_err());
//!
//! let loss = log_loss(&[0.5, 0.5], &[0u8, 1])?;
//! assert!((loss - std::f64::consts::LN_2).abs() < 1e-12);
//! # Ok(()) }
//! ```

use std::cmp::Ordering;

use crate::error::{Error, Result};

/// Probabilities are clamped to `[LOG_LOSS_EPS, 1 - LOG_LOSS_EPS]` in [`log_loss`].
pub const LOG_LOSS_EPS: f64 = 1e-7;

/// A label of a binary classification: negative or positive, or not a valid label.
pub trait BinaryLabel: Copy {
    /// `Some(true)` for the positive class, `Some(false)` for the negative one, `None` for a
    /// value that is neither.
    fn positive(self) -> Option<bool>;

    /// The label as a number, for the [`Error::BadValue`] that names a label that is not
    /// binary (NaN where the type has no such number).
    fn as_f64(self) -> f64 {
        f64::NAN
    }
}

impl BinaryLabel for f32 {
    /// 1.0 is positive, 0.0 (or -0.0) negative.
    fn positive(self) -> Option<bool> {
        f64::from(self).positive()
    }

    fn as_f64(self) -> f64 {
        f64::from(self)
    }
}

impl BinaryLabel for f64 {
    /// 1.0 is positive, 0.0 (or -0.0) negative.
    fn positive(self) -> Option<bool> {
        if self == 1.0 {
            Some(true)
        } else if self == 0.0 {
            Some(false)
        } else {
            None
        }
    }

    fn as_f64(self) -> f64 {
        self
    }
}

impl BinaryLabel for u8 {
    /// 1 is positive, 0 negative.
    fn positive(self) -> Option<bool> {
        match self {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    fn as_f64(self) -> f64 {
        f64::from(self)
    }
}

impl BinaryLabel for bool {
    fn positive(self) -> Option<bool> {
        Some(self)
    }

    fn as_f64(self) -> f64 {
        f64::from(u8::from(self))
    }
}

/// Checks the lengths, the values and the labels; returns the labels as `bool`s.
fn check<L: BinaryLabel>(what: &str, values: &[f32], labels: &[L]) -> Result<Vec<bool>> {
    if values.len() != labels.len() {
        return Err(Error::Length {
            what: format!("{what}: labels for {} values", values.len()),
            got: labels.len(),
            expected: values.len(),
        });
    }
    if let Some(i) = values.iter().position(|x| x.is_nan()) {
        return Err(Error::BadValue {
            what: format!("{what}: value {i}"),
            value: f64::NAN,
            want: "a number (not NaN)",
        });
    }
    labels
        .iter()
        .enumerate()
        .map(|(i, &y)| {
            y.positive().ok_or_else(|| Error::BadValue {
                what: format!("{what}: label {i}"),
                value: y.as_f64(),
                want: "binary (0 or 1)",
            })
        })
        .collect()
}

/// The exact area under the ROC curve of `scores` (higher = more likely positive) against
/// `labels`, ties by the midrank rule (see the [module docs](self)); infinite scores are
/// allowed.
///
/// ```
/// use tidemem::metrics::auc;
/// # fn main() -> tidemem::Result<()> {
/// // One positive ties with one of the two negatives: (1 + 1/2) / 2 pairs.
/// assert_eq!(auc(&[0.2f32, 0.7, 0.7], &[0u8, 0, 1])?, Some(0.75));
/// # Ok(()) }
/// ```
///
/// Returns `Ok(None)` when one class is absent (an empty input included): the AUC is not
/// defined there.
///
/// # Errors
/// [`Error::Length`] if the lengths differ, [`Error::BadValue`] if a score is NaN or a label
/// is not binary.
pub fn auc<L: BinaryLabel>(scores: &[f32], labels: &[L]) -> Result<Option<f64>> {
    let positive = check("auc", scores, labels)?;
    let n_pos = positive.iter().filter(|&&p| p).count() as u128;
    let n_neg = positive.len() as u128 - n_pos;
    if n_pos == 0 || n_neg == 0 {
        return Ok(None);
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // No NaN is left, so `partial_cmp` is total; -0.0 and 0.0 compare (and tie) as equal.
    order.sort_unstable_by(|&a, &b| scores[a].partial_cmp(&scores[b]).unwrap_or(Ordering::Equal));
    // Twice the rank sum of the positives: a group of ties at 0-based positions `start..end`
    // has the average 1-based rank `(start + 1 + end) / 2`.
    let mut rank_sum2: u128 = 0;
    let mut start = 0;
    while start < order.len() {
        let s = scores[order[start]];
        let mut end = start + 1;
        while end < order.len() && scores[order[end]] == s {
            end += 1;
        }
        let pos_in_group = order[start..end].iter().filter(|&&i| positive[i]).count() as u128;
        rank_sum2 += pos_in_group * (start as u128 + 1 + end as u128);
        start = end;
    }
    // 2U = 2R - n_pos (n_pos + 1).
    let u2 = rank_sum2 - n_pos * (n_pos + 1);
    Ok(Some(u2 as f64 / (2 * n_pos * n_neg) as f64))
}

/// The mean binary cross-entropy `-(y ln p + (1 - y) ln(1 - p))` of the probabilities `probs`
/// against `labels`, with `p` clamped to `[1e-7, 1 - 1e-7]` ([`LOG_LOSS_EPS`]); summed in `f64`.
///
/// ```
/// use tidemem::metrics::log_loss;
/// # fn main() -> tidemem::Result<()> {
/// let loss = log_loss(&[0.9f32, 0.2], &[1.0f32, 0.0])?;
/// let want = -(0.9f64.ln() + 0.8f64.ln()) / 2.0;
/// assert!((loss - want).abs() < 1e-6); // the f32 probabilities are not exactly 0.9 and 0.2
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Length`] if the lengths differ, [`Error::Empty`] if the input is empty,
/// [`Error::BadValue`] if a probability is NaN or outside `[0, 1]` or a label is not binary.
pub fn log_loss<L: BinaryLabel>(probs: &[f32], labels: &[L]) -> Result<f64> {
    let positive = check("log_loss", probs, labels)?;
    if probs.is_empty() {
        return Err(Error::Empty {
            what: "the input of log_loss".into(),
        });
    }
    if let Some(i) = probs.iter().position(|p| !(0.0..=1.0).contains(p)) {
        return Err(Error::BadValue {
            what: format!("log_loss: probability {i}"),
            value: f64::from(probs[i]),
            want: "in [0, 1]",
        });
    }
    let sum: f64 = probs
        .iter()
        .zip(&positive)
        .map(|(&p, &y)| {
            let p = f64::from(p).clamp(LOG_LOSS_EPS, 1.0 - LOG_LOSS_EPS);
            if y {
                -p.ln()
            } else {
                -(1.0 - p).ln()
            }
        })
        .sum();
    Ok(sum / probs.len() as f64)
}
