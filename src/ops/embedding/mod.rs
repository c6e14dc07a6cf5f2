//! Embedding-bag arithmetic on the CPU: the twins of `kernels/embedding.cu`, used by the
//! simulated device and by the fully resident reference bag.
//!
//! A table is f32 rows of `stride` floats: the first `dim` are the embedding, the rest the row's
//! optimizer state. Sums run from 0.0 in index order as separate multiply and add (no fused
//! multiply-add), the order the CUDA kernels keep with `__fmul_rn`/`__fadd_rn`, so both give
//! the same bits (NaN results excepted: a GPU writes the canonical NaN where the CPU may keep
//! an input NaN's payload). Index values out of range are skipped by every function and kernel
//! (the device cannot report them); the cache checks ids before they reach a device.

pub mod device;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::{Error, Result};
use crate::ops::Quant8Map;

/// A multiplicative hash for `u32` keys (ids are not adversarial here: they were checked
/// against the table and come from the trainer).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u32(&mut self, x: u32) {
        self.0 = (x as u64 ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        self.0 ^= self.0 >> 29;
    }
}

/// How a bag reduces its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BagMode {
    /// Weighted sum.
    Sum,
    /// Weighted sum divided by the bag's length (an empty bag gives zeros).
    Mean,
}

/// An optimizer of embedding rows; state per row is [`EmbeddingOptimizer::state_len`] floats,
/// stored after the row's weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EmbeddingOptimizer {
    /// `w = w - lr·g`.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Row-wise Adagrad: `s = s + Σg²/dim; w = w - lr·g / (√s + eps)`, one accumulator `s`
    /// per row at float `dim`.
    RowwiseAdagrad {
        /// Learning rate.
        lr: f32,
        /// Added to `√s`.
        eps: f32,
    },
    /// Adam with per-element moments, updated only for rows in the batch (sparse, "lazy"
    /// Adam): `m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²; w = w - lr·(m/bias1) /
    /// (√(v/bias2) + eps)` with `bias = 1 - β^t` of the global step `t`; `m` at floats
    /// `dim..2·dim`, `v` at `2·dim..3·dim`.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root of the corrected second moment.
        eps: f32,
    },
    /// [`EmbeddingOptimizer::Adam`] with 8-bit moments: each moment a byte an element in the
    /// dynamic maps of [`Quant8Map`] (signed for `m`, unsigned for
    /// `v`), each scaled by the row's largest magnitude (a row is one block, however wide it
    /// is: no scale spans two rows, which move alone). The codes of `m` then `v` fill floats
    /// `dim..dim + ⌈2·dim / 4⌉` (little-endian bytes), the two scales follow: `⌈dim / 2⌉ + 2`
    /// floats of state, not `2·dim` (66 against 256 at `dim` 128). The step's arithmetic is
    /// Adam's on the dequantized moments.
    Adam8 {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root of the corrected second moment.
        eps: f32,
    },
}

impl EmbeddingOptimizer {
    /// Floats of state per row for embeddings of `dim` floats: 0, 1, `2·dim` or, 8-bit,
    /// `⌈2·dim / 4⌉ + 2`.
    pub fn state_len(&self, dim: usize) -> usize {
        self.at_step(1).state_len(dim)
    }

    /// The scalars of step `t` (1-based).
    pub(crate) fn at_step(&self, t: u64) -> RowStep {
        match *self {
            EmbeddingOptimizer::Sgd { lr } => RowStep::Sgd { lr },
            EmbeddingOptimizer::RowwiseAdagrad { lr, eps } => RowStep::RowwiseAdagrad { lr, eps },
            EmbeddingOptimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            }
            | EmbeddingOptimizer::Adam8 {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let t = t.clamp(1, i32::MAX as u64) as i32;
                RowStep::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    bias1: (1.0 - (beta1 as f64).powi(t)) as f32,
                    bias2: (1.0 - (beta2 as f64).powi(t)) as f32,
                    packed: self.packed_state(),
                }
            }
        }
    }

    /// Whether a row's state holds 8-bit codes (bits, not floats).
    pub(crate) fn packed_state(&self) -> bool {
        matches!(self, EmbeddingOptimizer::Adam8 { .. })
    }
}

/// The scalars of one optimizer step on embedding rows ([`EmbeddingOptimizer::at_step`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum RowStep {
    /// `w = w - lr·g`.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Row-wise Adagrad: `s = s + Σg²/dim; w = w - lr·g / (√s + eps)`, `s` at float `dim`.
    RowwiseAdagrad {
        /// Learning rate.
        lr: f32,
        /// Added to `√s`.
        eps: f32,
    },
    /// Adam: `m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²; w = w - lr·(m/bias1) / (√(v/bias2) + eps)`,
    /// `m` at floats `dim..2·dim`, `v` at `2·dim..3·dim`.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root of the corrected second moment.
        eps: f32,
        /// `1 - β1^t`.
        bias1: f32,
        /// `1 - β2^t`.
        bias2: f32,
        /// The moments in 8 bits ([`EmbeddingOptimizer::Adam8`]).
        packed: bool,
    },
}

impl RowStep {
    /// Floats of state per row: 0, 1, `2·dim` or `⌈2·dim / 4⌉ + 2`.
    pub fn state_len(&self, dim: usize) -> usize {
        match self {
            RowStep::Sgd { .. } => 0,
            RowStep::RowwiseAdagrad { .. } => 1,
            RowStep::Adam { packed: false, .. } => 2 * dim,
            RowStep::Adam { packed: true, .. } => (2 * dim).div_ceil(4) + 2,
        }
    }
}

/// The backward of one batch in compressed-row form: for distinct row `rows[u]`, the bags that
/// use it are `entries[row_ptr[u]..row_ptr[u + 1]]` (in occurrence order), each with the factor
/// `scale[e]` (per-sample weight, divided by the bag length for [`BagMode::Mean`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseGradPlan {
    /// Distinct index values in first-occurrence order.
    pub rows: Vec<u32>,
    /// `rows.len() + 1` starts into `entries`.
    pub row_ptr: Vec<u32>,
    /// Bag of each occurrence.
    pub entries: Vec<u32>,
    /// Factor of each occurrence.
    pub scale: Vec<f32>,
}

fn check_offsets(n: usize, offsets: &[u32], weights: Option<&[f32]>) -> Result<usize> {
    let bags = offsets.len().checked_sub(1).ok_or(Error::Empty {
        what: "bag offsets (bags + 1 entries)".into(),
    })?;
    if let Some(at) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::BadOffsets {
            table: None,
            at: at + 1,
            why: "an offset below the one before it",
        });
    }
    if offsets[bags] as usize > n {
        return Err(Error::BadOffsets {
            table: None,
            at: bags,
            why: "the last offset past the number of indices",
        });
    }
    if let Some(w) = weights.filter(|w| w.len() != n) {
        return Err(Error::Length {
            what: "per-sample weights for the indices".into(),
            got: w.len(),
            expected: n,
        });
    }
    Ok(bags)
}

/// The [`SparseGradPlan`] of a batch.
pub fn plan_backward(
    indices: &[u32],
    offsets: &[u32],
    weights: Option<&[f32]>,
    mode: BagMode,
) -> Result<SparseGradPlan> {
    let bags = check_offsets(indices.len(), offsets, weights)?;
    // Indices after the last offset belong to no bag.
    let used = offsets[bags] as usize;
    let (indices, weights) = (&indices[..used], weights.map(|w| &w[..used]));
    // Distinct rows in first-occurrence order (`which[i]` numbers the row of index i), then
    // their number of occurrences.
    let mut rows: Vec<u32> = Vec::new();
    let mut which = vec![0u32; indices.len()];
    let max = indices.iter().copied().max().unwrap_or(0) as usize;
    if max < 4 * indices.len() + (1 << 16) {
        // A small index space (cache slots): a dense map.
        let mut first = vec![u32::MAX; max + 1];
        for (w, &r) in which.iter_mut().zip(indices) {
            let f = &mut first[r as usize];
            if *f == u32::MAX {
                *f = rows.len() as u32;
                rows.push(r);
            }
            *w = *f;
        }
    } else {
        let mut first: HashMap<u32, u32, BuildHasherDefault<IdHasher>> =
            HashMap::with_capacity_and_hasher(indices.len(), Default::default());
        for (w, &r) in which.iter_mut().zip(indices) {
            *w = *first.entry(r).or_insert_with(|| {
                rows.push(r);
                (rows.len() - 1) as u32
            });
        }
    }
    let mut count = vec![0u32; rows.len()];
    for &u in &which {
        count[u as usize] += 1;
    }
    let mut row_ptr = Vec::with_capacity(rows.len() + 1);
    row_ptr.push(0u32);
    for c in &count {
        row_ptr.push(row_ptr.last().expect("non-empty") + c);
    }
    let mut fill: Vec<u32> = row_ptr[..rows.len()].to_vec();
    let mut entries = vec![0u32; indices.len()];
    let mut scale = vec![0f32; indices.len()];
    for b in 0..bags {
        let (s, e) = (offsets[b] as usize, offsets[b + 1] as usize);
        for i in s..e {
            let u = which[i] as usize;
            let slot = fill[u] as usize;
            fill[u] += 1;
            entries[slot] = b as u32;
            let w = weights.map_or(1.0, |w| w[i]);
            scale[slot] = match mode {
                BagMode::Sum => w,
                BagMode::Mean => w / (e - s) as f32,
            };
        }
    }
    Ok(SparseGradPlan {
        rows,
        row_ptr,
        entries,
        scale,
    })
}

/// Bag `b` of `out` (`bags × dim`) = Σ weight·row over `indices[offsets[b]..offsets[b + 1]]`,
/// divided by the bag length for [`BagMode::Mean`].
#[allow(clippy::too_many_arguments)]
pub fn bag_forward(
    table: &[f32],
    stride: usize,
    dim: usize,
    indices: &[u32],
    offsets: &[u32],
    weights: Option<&[f32]>,
    mode: BagMode,
    out: &mut [f32],
) -> Result<()> {
    check_offsets(indices.len(), offsets, weights)?;
    bag_forward_clamped(table, stride, dim, indices, offsets, weights, mode, out)
}

/// [`bag_forward`] as the kernel runs it on data it cannot check: each bag's range is clamped
/// to the indices (`e = min(offsets[b + 1], n)`, `s = min(offsets[b], e)`). The same as
/// `bag_forward` on valid offsets.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bag_forward_clamped(
    table: &[f32],
    stride: usize,
    dim: usize,
    indices: &[u32],
    offsets: &[u32],
    weights: Option<&[f32]>,
    mode: BagMode,
    out: &mut [f32],
) -> Result<()> {
    let bags = offsets.len().saturating_sub(1);
    let n = indices.len();
    if offsets.is_empty()
        || dim == 0
        || stride < dim
        || out.len() != bags * dim
        || weights.is_some_and(|w| w.len() != n)
    {
        return Err(Error::InvalidArgument(format!(
            "bag forward: stride {stride}, dim {dim}, {} outputs for {bags} bags",
            out.len()
        )));
    }
    let rows = table.len() / stride;
    for (b, o) in out.chunks_exact_mut(dim).enumerate() {
        o.fill(0.0);
        let e = (offsets[b + 1] as usize).min(n);
        let s = (offsets[b] as usize).min(e);
        for i in s..e {
            let r = indices[i] as usize;
            if r >= rows {
                continue;
            }
            let w = weights.map_or(1.0, |w| w[i]);
            let row = &table[r * stride..r * stride + dim];
            for (acc, &x) in o.iter_mut().zip(row) {
                *acc += w * x;
            }
        }
        if mode == BagMode::Mean && e > s {
            let n = (e - s) as f32;
            for acc in o.iter_mut() {
                *acc /= n;
            }
        }
    }
    Ok(())
}

/// `grads[u]` (`dim` floats per distinct row) = Σ `scale[e]·grad_out[entries[e]]` over the
/// row's entries, in entry order.
pub fn bag_backward(
    grad_out: &[f32],
    dim: usize,
    row_ptr: &[u32],
    entries: &[u32],
    scale: &[f32],
    grads: &mut [f32],
) -> Result<()> {
    if let Some(at) = row_ptr.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::BadOffsets {
            table: None,
            at: at + 1,
            why: "a row start below the one before it (bag backward)",
        });
    }
    if row_ptr.last().is_some_and(|&l| l as usize > entries.len()) {
        return Err(Error::BadOffsets {
            table: None,
            at: row_ptr.len() - 1,
            why: "the last row start past the entries (bag backward)",
        });
    }
    bag_backward_clamped(grad_out, dim, row_ptr, entries, scale, grads)
}

/// [`bag_backward`] as the kernel runs it on data it cannot check: each row's entries are
/// clamped (`e1 = min(row_ptr[u + 1], entries)`, `e0 = min(row_ptr[u], e1)`).
pub(crate) fn bag_backward_clamped(
    grad_out: &[f32],
    dim: usize,
    row_ptr: &[u32],
    entries: &[u32],
    scale: &[f32],
    grads: &mut [f32],
) -> Result<()> {
    let u = row_ptr.len().saturating_sub(1);
    if dim == 0 || row_ptr.is_empty() || grads.len() != u * dim || scale.len() != entries.len() {
        return Err(Error::InvalidArgument(format!(
            "bag backward: {} row starts, {} entries, {} scales, {} gradients of {dim}",
            row_ptr.len(),
            entries.len(),
            scale.len(),
            grads.len()
        )));
    }
    let bags = grad_out.len() / dim;
    for (r, g) in grads.chunks_exact_mut(dim).enumerate() {
        g.fill(0.0);
        let e1 = (row_ptr[r + 1] as usize).min(entries.len());
        let e0 = (row_ptr[r] as usize).min(e1);
        for e in e0..e1 {
            let b = entries[e] as usize;
            if b >= bags {
                continue;
            }
            let s = scale[e];
            for (acc, &x) in g.iter_mut().zip(&grad_out[b * dim..(b + 1) * dim]) {
                *acc += s * x;
            }
        }
    }
    Ok(())
}

/// Step `step` (1-based: Adam's bias correction) of `opt` on row `rows[u]` with gradient
/// `grads[u]` for every `u`. Rows must be distinct: here a repeated row is updated twice in
/// order, but on a GPU the two updates race (the callers pass the distinct rows of a
/// [`SparseGradPlan`]).
pub fn row_step(
    table: &mut [f32],
    stride: usize,
    dim: usize,
    rows: &[u32],
    grads: &[f32],
    opt: &EmbeddingOptimizer,
    step: u64,
) -> Result<()> {
    step_rows(table, stride, dim, rows, grads, &opt.at_step(step))
}

/// [`row_step`] with the step's scalars resolved.
pub(crate) fn step_rows(
    table: &mut [f32],
    stride: usize,
    dim: usize,
    rows: &[u32],
    grads: &[f32],
    opt: &RowStep,
) -> Result<()> {
    if dim == 0 {
        return Err(Error::Empty {
            what: "row step: a row's weights".into(),
        });
    }
    let need = dim + opt.state_len(dim);
    if stride < need {
        return Err(Error::TooFew {
            what: format!(
                "row step: floats in a row of {dim} weights and {} of optimizer state",
                opt.state_len(dim)
            ),
            got: stride,
            need,
        });
    }
    if grads.len() != rows.len() * dim {
        return Err(Error::Length {
            what: format!("row step: gradients for {} rows of {dim}", rows.len()),
            got: grads.len(),
            expected: rows.len() * dim,
        });
    }
    let n = table.len() / stride;
    for (&r, g) in rows.iter().zip(grads.chunks_exact(dim)) {
        let r = r as usize;
        if r >= n {
            continue;
        }
        let row = &mut table[r * stride..(r + 1) * stride];
        step_one(row, dim, g, opt);
    }
    Ok(())
}

fn step_one(row: &mut [f32], dim: usize, g: &[f32], opt: &RowStep) {
    match *opt {
        RowStep::Sgd { lr } => {
            for (w, &g) in row[..dim].iter_mut().zip(g) {
                *w -= lr * g;
            }
        }
        RowStep::RowwiseAdagrad { lr, eps } => {
            let mut sq = 0f32;
            for &x in g {
                sq += x * x;
            }
            let s = row[dim] + sq / dim as f32;
            row[dim] = s;
            let denom = s.sqrt() + eps;
            for (w, &g) in row[..dim].iter_mut().zip(g) {
                *w -= lr * g / denom;
            }
        }
        RowStep::Adam {
            lr,
            beta1,
            beta2,
            eps,
            bias1,
            bias2,
            packed: false,
        } => {
            let (w, state) = row.split_at_mut(dim);
            let (m, v) = state.split_at_mut(dim);
            for k in 0..dim {
                let gk = g[k];
                m[k] = beta1 * m[k] + (1.0 - beta1) * gk;
                v[k] = beta2 * v[k] + (1.0 - beta2) * (gk * gk);
                let mhat = m[k] / bias1;
                let vhat = v[k] / bias2;
                w[k] -= lr * mhat / (vhat.sqrt() + eps);
            }
        }
        RowStep::Adam {
            lr,
            beta1,
            beta2,
            eps,
            bias1,
            bias2,
            packed: true,
        } => {
            let (w, state) = row.split_at_mut(dim);
            let (codes, scales) = state.split_at_mut((2 * dim).div_ceil(4));
            let codes: &mut [u8] = bytemuck::cast_slice_mut(codes);
            let (mc, vc) = codes.split_at_mut(dim);
            let (ms, vs) = (scales[0], scales[1]);
            let (sm, um) = (Quant8Map::Signed, Quant8Map::Unsigned);
            // the moments of element k after the step, from the codes before it
            let moments = |mc: &[u8], vc: &[u8], k: usize| {
                let (m, v) = (sm.value(mc[k]) * ms, um.value(vc[k]) * vs);
                let gk = g[k];
                (
                    beta1 * m + (1.0 - beta1) * gk,
                    beta2 * v + (1.0 - beta2) * (gk * gk),
                )
            };
            // the step and the new largest magnitudes, then the codes under them
            let (mut bm, mut bv) = (0u32, 0u32);
            for (k, w) in w.iter_mut().enumerate() {
                let (m, v) = moments(mc, vc, k);
                let mhat = m / bias1;
                let vhat = v / bias2;
                *w -= lr * mhat / (vhat.sqrt() + eps);
                bm = bm.max(m.to_bits() & 0x7fff_ffff);
                bv = bv.max(v.to_bits() & 0x7fff_ffff);
            }
            let (am, av) = (f32::from_bits(bm), f32::from_bits(bv));
            let im = if am > 0.0 { 1.0 / am } else { 0.0 };
            let iv = if av > 0.0 { 1.0 / av } else { 0.0 };
            for k in 0..dim {
                let (m, v) = moments(mc, vc, k);
                mc[k] = Quant8Map::Signed.code(m * im);
                vc[k] = Quant8Map::Unsigned.code(v * iv);
            }
            scales[0] = am;
            scales[1] = av;
        }
    }
}

/// Row `i` of `dst` = row `index[i]` of `src` (rows of `row_bytes`; out-of-range rows skipped).
pub fn gather_rows(src: &[u8], row_bytes: usize, index: &[u32], dst: &mut [u8]) {
    if row_bytes == 0 {
        return;
    }
    let n = src.len() / row_bytes;
    for (d, &r) in dst.chunks_exact_mut(row_bytes).zip(index) {
        if (r as usize) < n {
            d.copy_from_slice(&src[r as usize * row_bytes..(r as usize + 1) * row_bytes]);
        }
    }
}

/// Row `index[i]` of `dst` = row `i` of `src` (out-of-range rows skipped).
pub fn scatter_rows(src: &[u8], row_bytes: usize, index: &[u32], dst: &mut [u8]) {
    if row_bytes == 0 {
        return;
    }
    let n = dst.len() / row_bytes;
    for (s, &r) in src.chunks_exact(row_bytes).zip(index) {
        if (r as usize) < n {
            dst[r as usize * row_bytes..(r as usize + 1) * row_bytes].copy_from_slice(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Table of 3 rows, dim 2, stride 3.
    const T: [f32; 9] = [1.0, 2.0, 9.0, 3.0, 4.0, 9.0, 5.0, 6.0, 9.0];

    #[test]
    fn forward_sum_mean_weights_empty_and_out_of_range() {
        let mut out = [0f32; 6];
        bag_forward(
            &T,
            3,
            2,
            &[0, 2, 1, 7],
            &[0, 2, 2, 4],
            None,
            BagMode::Sum,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [6.0, 8.0, 0.0, 0.0, 3.0, 4.0]);
        bag_forward(
            &T,
            3,
            2,
            &[0, 2, 1, 7],
            &[0, 2, 2, 4],
            None,
            BagMode::Mean,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [3.0, 4.0, 0.0, 0.0, 1.5, 2.0]);
        let w = [2.0, -1.0, 0.5, 1.0];
        bag_forward(
            &T,
            3,
            2,
            &[0, 2, 1, 7],
            &[0, 2, 2, 4],
            Some(&w),
            BagMode::Sum,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [-3.0, -2.0, 0.0, 0.0, 1.5, 2.0]);
        assert!(bag_forward(&T, 3, 2, &[0], &[0, 2], None, BagMode::Sum, &mut out[..2]).is_err());
        assert!(bag_forward(
            &T,
            3,
            2,
            &[0, 1],
            &[1, 0],
            None,
            BagMode::Sum,
            &mut out[..2]
        )
        .is_err());
        assert!(bag_forward(&T, 1, 2, &[0], &[0, 1], None, BagMode::Sum, &mut out[..2]).is_err());
    }

    #[test]
    fn adam_rows_on_eight_bit_moments_follow_adam() {
        let dim = 40;
        let (a8, a32) = (
            EmbeddingOptimizer::Adam8 {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
            EmbeddingOptimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
        );
        assert_eq!(a8.state_len(dim), 22);
        assert_eq!(a8.state_len(128), 66);
        let (s8, s32) = (dim + a8.state_len(dim), dim + a32.state_len(dim));
        let init: Vec<f32> = (0..dim).map(|k| (k as f32 * 0.3).sin()).collect();
        let (mut r8, mut r32) = (vec![0f32; s8], vec![0f32; s32]);
        r8[..dim].copy_from_slice(&init);
        r32[..dim].copy_from_slice(&init);
        for t in 1..=30u64 {
            let g: Vec<f32> = (0..dim)
                .map(|k| ((k as f32 * 0.7 + t as f32).cos()) * 10f32.powi(-((k % 3) as i32)))
                .collect();
            row_step(&mut r8, s8, dim, &[0], &g, &a8, t).unwrap();
            row_step(&mut r32, s32, dim, &[0], &g, &a32, t).unwrap();
            if t == 1 {
                // from zero moments the step is Adam's, bit for bit (the codes come after it)
                assert_eq!(r8[..dim], r32[..dim]);
            }
        }
        // the moments: their codes under the row's scales, each near Adam's own
        let codes: &[u8] = bytemuck::cast_slice(&r8[dim..dim + 20]);
        let (ms, vs) = (r8[dim + 20], r8[dim + 21]);
        for k in 0..dim {
            let m = Quant8Map::Signed.value(codes[k]) * ms;
            let v = Quant8Map::Unsigned.value(codes[dim + k]) * vs;
            let (m32, v32) = (r32[dim + k], r32[2 * dim + k]);
            assert!(
                (m - m32).abs() <= 0.05 * m32.abs() + 0.01 * ms,
                "m[{k}] {m} {m32}"
            );
            assert!(
                (v - v32).abs() <= 0.05 * v32 + 0.01 * vs,
                "v[{k}] {v} {v32}"
            );
        }
        // and the weights moved as Adam's did (a value at the bottom of its decade is held to
        // within a quarter of itself, the variance's error halved by the root)
        for k in 0..dim {
            let (d8, d32) = (r8[k] - init[k], r32[k] - init[k]);
            assert!(
                (d8 - d32).abs() <= 0.2 * d32.abs() + 1e-3,
                "w[{k}] {d8} {d32}"
            );
        }
        // an element whose gradients are 10⁻⁵ of the row's largest (its variance below the
        // map's smallest entry) moves no faster than under Adam: its variance is never 0
        let mut r = vec![0f32; s8];
        let g: Vec<f32> = (0..dim).map(|k| if k == 0 { 1.0 } else { 1e-5 }).collect();
        for t in 1..=5 {
            row_step(&mut r, s8, dim, &[0], &g, &a8, t).unwrap();
        }
        // (Adam moves both by about lr a step; a variance of 0 would move it by lr·m/ε, 1)
        assert!(r[1].abs() <= r[0].abs(), "{} {}", r[1], r[0]);
        // a truncating quantizer or a dropped scale would fail these: the scale is the row's
        // largest moment, and its code stands for 1
        let mmax = (0..dim).map(|k| r32[dim + k].abs()).fold(0f32, f32::max);
        assert!((ms - mmax).abs() <= 0.05 * mmax, "{ms} {mmax}");
    }

    #[test]
    fn backward_plan_orders_rows_and_entries_by_occurrence() {
        let p = plan_backward(&[4, 2, 4, 4], &[0, 2, 4], None, BagMode::Mean).unwrap();
        assert_eq!(p.rows, vec![4, 2]);
        assert_eq!(p.row_ptr, vec![0, 3, 4]);
        assert_eq!(p.entries, vec![0, 1, 1, 0]);
        assert_eq!(p.scale, vec![0.5; 4]);
        let go = [1.0, 2.0, 10.0, 20.0];
        let mut g = [0f32; 4];
        bag_backward(&go, 2, &p.row_ptr, &p.entries, &p.scale, &mut g).unwrap();
        assert_eq!(g, [10.5, 21.0, 0.5, 1.0]);
        let p = plan_backward(&[1, 1], &[0, 2], Some(&[2.0, 3.0]), BagMode::Sum).unwrap();
        assert_eq!((p.rows, p.scale), (vec![1], vec![2.0, 3.0]));
        assert!(plan_backward(&[1], &[], None, BagMode::Sum).is_err());
        assert!(plan_backward(&[1], &[0, 1], Some(&[]), BagMode::Sum).is_err());
        assert!(bag_backward(&go, 2, &[0, 5], &[0], &[1.0], &mut g[..2]).is_err());
    }

    #[test]
    fn backward_plan_is_the_same_over_a_large_index_space() {
        // Small indices take the dense map, the same indices spread over 2^32 the hash map.
        let small: Vec<u32> = (0..300u32).map(|i| (i * 7919) % 97).collect();
        let offsets: Vec<u32> = (0..=100u32).map(|b| b * 3).collect();
        let large: Vec<u32> = small.iter().map(|&r| r * 40_000_003 + 11).collect();
        for mode in [BagMode::Sum, BagMode::Mean] {
            let a = plan_backward(&small, &offsets, None, mode).unwrap();
            let b = plan_backward(&large, &offsets, None, mode).unwrap();
            let mapped: Vec<u32> = a.rows.iter().map(|&r| r * 40_000_003 + 11).collect();
            assert_eq!(mapped, b.rows);
            assert_eq!(
                (a.row_ptr, a.entries, a.scale),
                (b.row_ptr, b.entries, b.scale)
            );
        }
    }

    #[test]
    fn optimizer_steps_by_hand() {
        let mut t = T;
        row_step(
            &mut t,
            3,
            2,
            &[1, 9],
            &[1.0, -2.0, 5.0, 5.0],
            &EmbeddingOptimizer::Sgd { lr: 0.5 },
            1,
        )
        .unwrap();
        assert_eq!(&t[3..5], &[2.5, 5.0]);
        // Adagrad: s = 0 + (9 + 16)/2 = 12.5; w -= 1 * g / (√12.5 + 0).
        let mut t = [1.0, 1.0, 0.0];
        let opt = EmbeddingOptimizer::RowwiseAdagrad { lr: 1.0, eps: 0.0 };
        row_step(&mut t, 3, 2, &[0], &[3.0, 4.0], &opt, 1).unwrap();
        assert_eq!(t[2], 12.5);
        assert_eq!(t[0], 1.0 - 3.0 / 12.5f32.sqrt());
        // Adam, first step: m = 0.1 g, v = 0.001 g², corrected m = g, v = g²: w -= lr·sign(g).
        let mut t = [1.0, 0.0, 0.0];
        let opt = EmbeddingOptimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 0.0,
        };
        row_step(&mut t, 3, 1, &[0], &[2.0], &opt, 1).unwrap();
        assert!((t[0] - 0.9).abs() < 1e-6, "{}", t[0]);
        assert!((t[1] - 0.2).abs() < 1e-7 && (t[2] - 0.004).abs() < 1e-7);
        assert!(row_step(&mut t, 2, 1, &[0], &[2.0], &opt, 2).is_err());
    }

    #[test]
    fn gather_scatter_rows() {
        let src: Vec<u8> = (0..12).collect();
        let mut dst = vec![0u8; 8];
        gather_rows(&src, 4, &[2, 9], &mut dst);
        assert_eq!(dst, [8, 9, 10, 11, 0, 0, 0, 0]);
        let mut back = vec![0u8; 12];
        scatter_rows(&dst, 4, &[1, 7], &mut back);
        assert_eq!(back, [0, 0, 0, 0, 8, 9, 10, 11, 0, 0, 0, 0]);
    }
}
