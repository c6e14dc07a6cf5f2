//! Causal softmax on every backend present (the simulated device, and CUDA when there is one):
//! forward and backward against an f64 reference, the backward against central finite
//! differences of the f64 forward, f32/f16/bf16 storage, and bad input refused with a typed
//! error and nothing written.
//!
//! Tolerances, on the f64 reference computed from the values as stored:
//! - forward: `|y − ref| ≤ abs + rel·|ref|` with (abs, rel) = f32 (1e-7, 1e-5), f16 (1e-6, 6e-4),
//!   bf16 (1e-6, 5e-3): f32 arithmetic (2-ulp `exp`, a 32-lane sum) plus one rounding to the
//!   storage type (2⁻¹¹ for f16, 2⁻⁸ for bf16);
//! - backward: `|dx − ref| ≤ 1e-7 + rel·s·|y|·(|dy| + |d| + Σ|dy·y|)` (`d = Σ dy·y`, the size of
//!   the terms that cancel), rel = 1e-5 (f32), 1e-3 (f16), 8e-3 (bf16);
//! - the f32 ops (forward then backward) against finite differences of the f64 forward:
//!   `|dx − fd| ≤ 2e-6 + 1e-4·|fd|`.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::Operand;
use tidemem::ops::{softmax_backward, softmax_forward};
use tidemem::{DType, Error};

/// The f64 forward of one row's live elements.
fn row64(x: &[f64], scale: f64) -> Vec<f64> {
    let m = x
        .iter()
        .map(|v| v * scale)
        .fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v * scale - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// The f64 backward of one row's live elements.
fn row_grad64(y: &[f64], dy: &[f64], scale: f64) -> Vec<f64> {
    let d: f64 = y.iter().zip(dy).map(|(a, b)| a * b).sum();
    y.iter()
        .zip(dy)
        .map(|(y, dy)| scale * y * (dy - d))
        .collect()
}

fn forward_tol(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (1e-7, 1e-5),
        DType::F16 => (1e-6, 6e-4),
        _ => (1e-6, 5e-3),
    }
}

fn backward_rel(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 1e-3,
        _ => 8e-3,
    }
}

const SHAPES: [(usize, usize); 6] = [(1, 1), (2, 7), (1, 32), (3, 33), (1, 100), (2, 130)];

#[test]
fn forward_and_backward_match_the_f64_reference() {
    for dev in common::devices("softmax reference") {
        let s = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(1);
        for d in DType::FLOATS {
            for (bh, t) in SHAPES {
                let n = bh * t * t;
                let scale = 1.0 / ((t % 5 + 1) as f64).sqrt();
                let scale = scale as f32 as f64;
                let (x, dy) = (r.vals(n, 6.0, 0.0, d), r.vals(n, 1.0, 0.0, d));
                let (xb, dyb) = (upv(&dev, &s, &x, d), upv(&dev, &s, &dy, d));
                let y = up(&dev, &s, &vec![0x5a; n * d.size()]);
                let dx = up(&dev, &s, &vec![0x5a; n * d.size()]);
                softmax_forward(&dev, &s, &xb, &y, bh, t, scale as f32, d).unwrap();
                softmax_backward(&dev, &s, &y, &dyb, &dx, bh, t, scale as f32, d).unwrap();
                let (yv, dxv) = (downv(&dev, &s, &y, d), downv(&dev, &s, &dx, d));
                let (abs, rel) = forward_tol(d);
                for row in 0..bh * t {
                    let (i, o) = (row % t, row * t);
                    let want = row64(&x[o..=o + i], scale);
                    for j in 0..t {
                        let (got, what) = (yv[o + j], format!("{d} [{bh},{t}] row {row} col {j}"));
                        if j > i {
                            assert_eq!(got.to_bits(), 0, "{what}: above the diagonal");
                            assert_eq!(dxv[o + j].to_bits(), 0, "{what}: dx above the diagonal");
                            continue;
                        }
                        assert!(
                            (got - want[j]).abs() <= abs + rel * want[j],
                            "{what}: {got} vs {}",
                            want[j]
                        );
                    }
                    // The backward from the y the device wrote, as stored.
                    let (yr, dyr) = (&yv[o..=o + i], &dy[o..=o + i]);
                    let dref = row_grad64(yr, dyr, scale);
                    let dsum: f64 = yr.iter().zip(dyr).map(|(a, b)| a * b).sum();
                    let mag: f64 = yr.iter().zip(dyr).map(|(a, b)| (a * b).abs()).sum();
                    for j in 0..=i {
                        let bound = scale * yr[j] * (dyr[j].abs() + dsum.abs() + mag);
                        let tol = 1e-7 + backward_rel(d) * bound;
                        assert!(
                            (dxv[o + j] - dref[j]).abs() <= tol,
                            "{d} [{bh},{t}] row {row} col {j}: dx {} vs {}",
                            dxv[o + j],
                            dref[j]
                        );
                    }
                }
            }
        }
    }
}

/// `L = Σ_j dy_j · softmax(x)_j` of one row, in f64.
fn row_loss(x: &[f64], dy: &[f64], scale: f64) -> f64 {
    row64(x, scale).iter().zip(dy).map(|(a, b)| a * b).sum()
}

#[test]
fn backward_matches_finite_differences_of_the_f64_forward() {
    let h = 1e-6;
    let mut r = SplitMix64::new(2);
    // The reference backward itself.
    for n in [1usize, 5, 40] {
        let (x, dy) = (r.uniform(n, 4.0), r.uniform(n, 1.0));
        let g = row_grad64(&row64(&x, 0.7), &dy, 0.7);
        for (j, &g) in g.iter().enumerate() {
            let fd = central_diff(&x, j, h, |x| row_loss(x, &dy, 0.7));
            assert!(
                (g - fd).abs() <= 1e-8 + 1e-6 * fd.abs(),
                "{n} {j}: {g} vs {fd}"
            );
        }
    }
    // The f32 ops.
    for dev in common::devices("softmax finite differences") {
        let s = dev.new_stream().unwrap();
        let (bh, t, scale) = (2usize, 37usize, 0.125f64);
        let n = bh * t * t;
        let x = r.vals(n, 8.0, 0.0, DType::F32);
        let dy = r.vals(n, 1.0, 0.0, DType::F32);
        let (xb, dyb) = (
            upv(&dev, &s, &x, DType::F32),
            upv(&dev, &s, &dy, DType::F32),
        );
        let (y, dx) = (dev.alloc(n * 4).unwrap(), dev.alloc(n * 4).unwrap());
        softmax_forward(&dev, &s, &xb, &y, bh, t, scale as f32, DType::F32).unwrap();
        softmax_backward(&dev, &s, &y, &dyb, &dx, bh, t, scale as f32, DType::F32).unwrap();
        let dxv = downv(&dev, &s, &dx, DType::F32);
        for row in 0..bh * t {
            let (i, o) = (row % t, row * t);
            let (xr, dyr) = (&x[o..=o + i], &dy[o..=o + i]);
            for j in 0..=i {
                let fd = central_diff(xr, j, h, |x| row_loss(x, dyr, scale));
                let got = dxv[o + j];
                assert!(
                    (got - fd).abs() <= 2e-6 + 1e-4 * fd.abs(),
                    "row {row} col {j}: {got} vs {fd}"
                );
            }
        }
    }
}

#[test]
fn bad_input_is_a_typed_error_and_nothing_is_written() {
    for dev in common::devices("softmax bad input") {
        let s = dev.new_stream().unwrap();
        let (bh, t) = (2usize, 5usize);
        let n = bh * t * t;
        let x = up(&dev, &s, &vec![0u8; n * 4]);
        let dy = up(&dev, &s, &vec![0u8; n * 4]);
        let y = up(&dev, &s, &vec![0x77; n * 4]);
        let short = up(&dev, &s, &vec![0x77; (n - 1) * 4]);
        let before = dev.download(&s, &y).unwrap();
        // y one element short; x one matrix short.
        invalid(
            softmax_forward(&dev, &s, &x, &short, bh, t, 1.0, DType::F32),
            &["`y`", "[2, 5, 5]"],
        );
        invalid(
            softmax_forward(&dev, &s, &x, &y, bh + 1, t, 1.0, DType::F32),
            &["`x`", "75"],
        );
        invalid(
            softmax_backward(&dev, &s, &short, &dy, &y, bh, t, 1.0, DType::F32),
            &["`y`"],
        );
        // Shapes that overflow.
        invalid(
            softmax_forward(&dev, &s, &x, &y, usize::MAX, 1 << 40, 1.0, DType::F32),
            &["overflows"],
        );
        // The output overlapping the input.
        let whole = up(&dev, &s, &vec![0u8; 2 * n * 4]);
        let (a, b) = (whole.view(0, n * 4).unwrap(), whole.view(4, n * 4).unwrap());
        invalid(
            softmax_forward(&dev, &s, a, b, bh, t, 1.0, DType::F32),
            &["overlaps"],
        );
        invalid(
            softmax_backward(&dev, &s, &x, a, b, bh, t, 1.0, DType::F32),
            &["overlaps"],
        );
        // Mixed element types (only through a direct launch: the wrappers take one type).
        let half = up(&dev, &s, &vec![0u8; n * 2]);
        let p = tidemem::ops::softmax::SoftmaxParams {
            bh: bh as u64,
            rows: t as u64,
            cols: t as u64,
            offset: 0,
            scale: 1.0,
            pad: 0,
        };
        let ops = [
            Some(Operand::new(&half, DType::F16)),
            Some(Operand::new(&y, DType::F32)),
        ];
        let r = dev.launch(
            &s,
            &tidemem::ops::softmax::SOFTMAX_FORWARD,
            &ops,
            bytemuck::bytes_of(&p),
        );
        invalid(r, &["one type"]);
        // A dtype the op does not take.
        let r = softmax_forward(&dev, &s, &x, &y, bh, t, 1.0, DType::U32);
        assert!(matches!(r, Err(Error::Launch { .. })), "{r:?}");
        dev.sync_stream(&s).unwrap();
        assert_eq!(dev.download(&s, &y).unwrap(), before, "y was written");
        assert_eq!(dev.download(&s, &short).unwrap(), vec![0x77; (n - 1) * 4]);
    }
}

#[test]
fn empty_shapes_launch_nothing() {
    for dev in common::devices("softmax empty") {
        let s = dev.new_stream().unwrap();
        let e = dev.alloc(0).unwrap();
        let f = dev.alloc(0).unwrap();
        softmax_forward(&dev, &s, &e, &f, 0, 9, 1.0, DType::BF16).unwrap();
        softmax_backward(&dev, &s, &e, &e, &f, 3, 0, 1.0, DType::F16).unwrap();
        dev.sync_stream(&s).unwrap();
    }
}
