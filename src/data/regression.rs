//! Regression samples: uniform inputs and a fixed target per feature, what the
//! toy trainer (`demo`) fits.

use std::ops::Range;

use super::rng::{splitmix64, unit_f32};

/// A uniform value in `[0, 1)` for element `i` of stream `s`.
fn unit(s: u64, i: usize) -> f32 {
    unit_f32(splitmix64(s ^ (i as u64).wrapping_mul(0x9E37)))
}

/// Samples `samples` of batch `seed`, `width` features each, row-major: inputs uniform in
/// `[-1, 1)`, and targets in `[-0.25, 0.25)` that depend only on the feature, the same for
/// every sample and batch. Returns `(inputs, targets)`, each `samples.len() · width` values.
///
/// Deterministic, and sample `i` does not depend on which other samples are asked for.
///
/// ```
/// use tidemem::data::regression::regression_samples;
/// let (x, y) = regression_samples(4, 0, 0..8);
/// assert_eq!((x.len(), y.len()), (32, 32));
/// assert!(x.iter().all(|v| (-1.0..1.0).contains(v)));
/// assert_eq!(&y[..4], &y[4..8]); // the target is per feature
/// let (x2, _) = regression_samples(4, 0, 2..3);
/// assert_eq!(&x2[..], &x[8..12]);
/// ```
pub fn regression_samples(width: usize, seed: u64, samples: Range<usize>) -> (Vec<f32>, Vec<f32>) {
    let elems = samples.start.saturating_mul(width)..samples.end.saturating_mul(width);
    let stream = seed.wrapping_mul(2).wrapping_add(1);
    let x = elems.clone().map(|i| unit(stream, i) * 2.0 - 1.0).collect();
    let y = elems.map(|i| (unit(7, i % width) - 0.5) * 0.5).collect();
    (x, y)
}
