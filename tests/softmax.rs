//! Causal softmax on every backend present (the simulated device, and CUDA when there is one):
//! forward and backward against an f64 reference, the backward against central finite
//! differences of the f64 forward, f32/f16/bf16 storage, and bad input refused with a typed
//! error and nothing written; the same for blocks of rows `[BH, rows, cols]` at an offset (ring
//! self-attention), and the row blocks of a square giving the square's rows bit for bit.
//!
//! Tolerances, on the f64 reference computed from the values as stored:
//! - forward: `|y − ref| ≤ abs + rel·|ref|` with (abs, rel) = f32 (1e-7, 1e-5), f16 (1e-6, 6e-4),
//!   bf16 (1e-6, 5e-3): f32 arithmetic (2-ulp `exp`, a 32-lane sum) plus one rounding to the
//!   storage type (2⁻¹¹ for f16, 2⁻⁸ for bf16);
//! - backward: `|dx − ref| ≤ 1e-7 + rel·s·|y|·(|dy| + |d| + Σ|dy·y|)` (`d = Σ dy·y`, the size of
//!   the terms that cancel), rel = 1e-5 (f32), 1e-3 (f16), 8e-3 (bf16);
//! - the f32 ops (forward then backward) against finite differences of the f64 forward:
//!   `|dx − fd| ≤ 2e-6 + 1e-4·|fd|`.
//!
//! The blocks are held to the same tolerances.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::Operand;
use tidemem::ops::{
    softmax_backward, softmax_block_backward, softmax_block_forward, softmax_forward, SoftmaxBlock,
};
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
        let p = tidemem::ops::abi::SoftmaxParams {
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
            &tidemem::ops::abi::SOFTMAX_FORWARD,
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

/// A block `(bh, rows, cols, offset)`.
type Blk = (usize, usize, usize, usize);

fn block(&(bh, rows, cols, offset): &Blk, scale: f64) -> SoftmaxBlock {
    SoftmaxBlock {
        bh,
        rows,
        cols,
        offset,
        scale: scale as f32,
    }
}

/// The live elements of the block's row `row` (counted over all matrices).
fn live(&(_, rows, cols, offset): &Blk, row: usize) -> usize {
    (offset + row % rows + 1).min(cols)
}

/// Checks a block's `y` and `dx` (downloaded, of type `d`) against the f64 reference from its
/// `x` and `dy`, with the square's tolerances; past the live elements, exactly +0.
fn check_block(d: DType, b: &Blk, scale: f64, x: &[f64], dy: &[f64], y: &[f64], dx: &[f64]) {
    let &(bh, rows, cols, offset) = b;
    let (abs, rel) = forward_tol(d);
    for row in 0..bh * rows {
        let (n, o) = (live(b, row), row * cols);
        let what = |j: usize| format!("{d} [{bh},{rows},{cols}] offset {offset} row {row} col {j}");
        let want = row64(&x[o..o + n], scale);
        for j in 0..cols {
            if j >= n {
                assert_eq!(y[o + j].to_bits(), 0, "{}: y past the live ones", what(j));
                assert_eq!(dx[o + j].to_bits(), 0, "{}: dx past the live ones", what(j));
                continue;
            }
            let got = y[o + j];
            let ok = (got - want[j]).abs() <= abs + rel * want[j];
            assert!(ok, "{}: {got} vs {}", what(j), want[j]);
        }
        let (yr, dyr) = (&y[o..o + n], &dy[o..o + n]);
        let dref = row_grad64(yr, dyr, scale);
        let dsum: f64 = yr.iter().zip(dyr).map(|(a, b)| a * b).sum();
        let mag: f64 = yr.iter().zip(dyr).map(|(a, b)| (a * b).abs()).sum();
        for j in 0..n {
            let bound = scale * yr[j] * (dyr[j].abs() + dsum.abs() + mag);
            let tol = 1e-7 + backward_rel(d) * bound;
            let got = dx[o + j];
            assert!(
                (got - dref[j]).abs() <= tol,
                "{}: dx {got} vs {}",
                what(j),
                dref[j]
            );
        }
    }
}

/// Blocks of rows: one row, rows < cols at an offset, rows running past the columns
/// (`offset + rows > cols`), an offset past every column, sizes off any multiple of 32, a
/// square.
const BLOCKS: [Blk; 9] = [
    (1, 1, 1, 0),
    (2, 1, 100, 57),
    (1, 1, 40, 90),
    (2, 3, 10, 4),
    (3, 33, 70, 20),
    (2, 20, 40, 30),
    (1, 5, 8, 100),
    (2, 40, 130, 64),
    (2, 7, 7, 0),
];

#[test]
fn block_forward_and_backward_match_the_f64_reference() {
    for dev in common::devices("softmax block reference") {
        let s = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(3);
        for d in DType::FLOATS {
            for b in BLOCKS {
                let n = b.0 * b.1 * b.2;
                let scale = (1.0 / ((b.2 % 5 + 1) as f64).sqrt()) as f32 as f64;
                let (x, dy) = (r.vals(n, 6.0, 0.0, d), r.vals(n, 1.0, 0.0, d));
                let (xb, dyb) = (upv(&dev, &s, &x, d), upv(&dev, &s, &dy, d));
                let y = up(&dev, &s, &vec![0x5a; n * d.size()]);
                let dx = up(&dev, &s, &vec![0x5a; n * d.size()]);
                let blk = block(&b, scale);
                softmax_block_forward(&dev, &s, &xb, &y, &blk, d).unwrap();
                softmax_block_backward(&dev, &s, &y, &dyb, &dx, &blk, d).unwrap();
                let (yv, dxv) = (downv(&dev, &s, &y, d), downv(&dev, &s, &dx, d));
                check_block(d, &b, scale, &x, &dy, &yv, &dxv);
            }
        }
    }
}

/// The rows `a..b` of every matrix of `bh` matrices of `t × t` elements of `size` bytes.
fn rows_of(bytes: &[u8], bh: usize, t: usize, (a, b): (usize, usize), size: usize) -> Vec<u8> {
    let row = t * size;
    (0..bh)
        .flat_map(|m| &bytes[(m * t + a) * row..(m * t + b) * row])
        .copied()
        .collect()
}

#[test]
fn row_blocks_of_a_square_are_its_rows_bit_for_bit() {
    for dev in common::devices("softmax row blocks") {
        let s = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(4);
        for d in DType::FLOATS {
            // Even splits of T into N blocks of T/N rows (rank r at offset r·T/N), and an
            // uneven one.
            let splits: [(usize, usize, Vec<usize>); 4] = [
                (2, 12, vec![0, 4, 8, 12]),
                (1, 64, vec![0, 16, 32, 48, 64]),
                (3, 66, vec![0, 33, 66]),
                (2, 37, vec![0, 1, 10, 36, 37]),
            ];
            for (bh, t, cuts) in splits {
                let (n, sz, scale) = (bh * t * t, d.size(), 0.125);
                let (x, dy) = (r.vals(n, 8.0, 0.0, d), r.vals(n, 1.0, 0.0, d));
                let (xb, dyb) = (upv(&dev, &s, &x, d), upv(&dev, &s, &dy, d));
                let (y, dx) = (
                    up(&dev, &s, &vec![0x5a; n * sz]),
                    up(&dev, &s, &vec![0x5a; n * sz]),
                );
                softmax_forward(&dev, &s, &xb, &y, bh, t, scale, d).unwrap();
                softmax_backward(&dev, &s, &y, &dyb, &dx, bh, t, scale, d).unwrap();
                let (xs, dys) = (down(&dev, &s, &xb), down(&dev, &s, &dyb));
                let (ys, dxs) = (down(&dev, &s, &y), down(&dev, &s, &dx));
                for w in cuts.windows(2) {
                    let (a, b) = (w[0], w[1]);
                    let blk = SoftmaxBlock {
                        bh,
                        rows: b - a,
                        cols: t,
                        offset: a,
                        scale,
                    };
                    let part = |v: &[u8]| rows_of(v, bh, t, (a, b), sz);
                    let m = bh * (b - a) * t * sz;
                    let (by, bdx) = (up(&dev, &s, &vec![0x5a; m]), up(&dev, &s, &vec![0x5a; m]));
                    let (bx, bdy) = (up(&dev, &s, &part(&xs)), up(&dev, &s, &part(&dys)));
                    softmax_block_forward(&dev, &s, &bx, &by, &blk, d).unwrap();
                    // The backward from the square's y rows, so each step is compared alone.
                    let sy = up(&dev, &s, &part(&ys));
                    softmax_block_backward(&dev, &s, &sy, &bdy, &bdx, &blk, d).unwrap();
                    let what = format!("{d} [{bh},{t},{t}] rows {a}..{b}");
                    assert!(down(&dev, &s, &by) == part(&ys), "{what}: y");
                    assert!(down(&dev, &s, &bdx) == part(&dxs), "{what}: dx");
                }
            }
        }
    }
}

#[test]
fn block_backward_matches_finite_differences_of_the_f64_forward() {
    let h = 1e-6;
    let mut r = SplitMix64::new(5);
    for dev in common::devices("softmax block finite differences") {
        let s = dev.new_stream().unwrap();
        for b in [
            (2usize, 9usize, 50usize, 30usize),
            (1, 1, 37, 12),
            (1, 6, 20, 17),
        ] {
            let (n, scale, f) = (b.0 * b.1 * b.2, 0.125f64, DType::F32);
            let (x, dy) = (r.vals(n, 8.0, 0.0, f), r.vals(n, 1.0, 0.0, f));
            let (xb, dyb) = (upv(&dev, &s, &x, f), upv(&dev, &s, &dy, f));
            let (y, dx) = (dev.alloc(n * 4).unwrap(), dev.alloc(n * 4).unwrap());
            let blk = block(&b, scale);
            softmax_block_forward(&dev, &s, &xb, &y, &blk, f).unwrap();
            softmax_block_backward(&dev, &s, &y, &dyb, &dx, &blk, f).unwrap();
            let dxv = downv(&dev, &s, &dx, f);
            for row in 0..b.0 * b.1 {
                let (k, o) = (live(&b, row), row * b.2);
                let (xr, dyr) = (&x[o..o + k], &dy[o..o + k]);
                for j in 0..k {
                    let fd = central_diff(xr, j, h, |x| row_loss(x, dyr, scale));
                    let got = dxv[o + j];
                    assert!(
                        (got - fd).abs() <= 2e-6 + 1e-4 * fd.abs(),
                        "{b:?} row {row} col {j}: {got} vs {fd}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_blocks_are_typed_errors_and_nothing_is_written() {
    for dev in common::devices("softmax block bad input") {
        let s = dev.new_stream().unwrap();
        let good = SoftmaxBlock {
            bh: 2,
            rows: 3,
            cols: 8,
            offset: 5,
            scale: 0.5,
        };
        let n = 2 * 3 * 8;
        let x = up(&dev, &s, &vec![0u8; n * 4]);
        let dy = up(&dev, &s, &vec![0u8; n * 4]);
        let y = up(&dev, &s, &vec![0x77; n * 4]);
        let short = up(&dev, &s, &vec![0x77; (n - 1) * 4]);
        let before = dev.download(&s, &y).unwrap();
        let f = DType::F32;
        let fwd = |b: SoftmaxBlock| softmax_block_forward(&dev, &s, &x, &y, &b, f);
        let bwd = |b: SoftmaxBlock| softmax_block_backward(&dev, &s, &x, &dy, &y, &b, f);
        // Wrong lengths: y one element short, x the wrong shape, dx short.
        let r = softmax_block_forward(&dev, &s, &x, &short, &good, f);
        invalid(r, &["`y`", "[2, 3, 8]", "offset 5"]);
        invalid(fwd(SoftmaxBlock { cols: 9, ..good }), &["`x`", "54"]);
        let r = softmax_block_backward(&dev, &s, &x, &dy, &short, &good, f);
        invalid(r, &["`dx`"]);
        // Rows without columns.
        invalid(fwd(SoftmaxBlock { cols: 0, ..good }), &["0 columns"]);
        invalid(bwd(SoftmaxBlock { cols: 0, ..good }), &["0 columns"]);
        // Sizes that overflow; positions past the largest.
        let huge = SoftmaxBlock {
            bh: usize::MAX,
            rows: 1 << 40,
            ..good
        };
        invalid(fwd(huge), &["overflows"]);
        invalid(bwd(huge), &["overflows"]);
        let far = SoftmaxBlock {
            offset: usize::MAX - 1,
            ..good
        };
        invalid(fwd(far), &["offset + rows overflows"]);
        // A scale that is not finite.
        for scale in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            invalid(fwd(SoftmaxBlock { scale, ..good }), &["scale"]);
            invalid(bwd(SoftmaxBlock { scale, ..good }), &["scale"]);
        }
        // A dtype the op does not take.
        let r = softmax_block_forward(&dev, &s, &x, &y, &good, DType::U32);
        assert!(matches!(r, Err(Error::Launch { .. })), "{r:?}");
        dev.sync_stream(&s).unwrap();
        assert_eq!(dev.download(&s, &y).unwrap(), before, "y was written");
        assert_eq!(dev.download(&s, &short).unwrap(), vec![0x77; (n - 1) * 4]);
        // Empty blocks launch nothing.
        let e = dev.alloc(0).unwrap();
        let g = dev.alloc(0).unwrap();
        softmax_block_forward(&dev, &s, &e, &g, &SoftmaxBlock { bh: 0, ..good }, f).unwrap();
        let none = SoftmaxBlock { rows: 0, ..good };
        softmax_block_backward(&dev, &s, &e, &e, &g, &none, f).unwrap();
        dev.sync_stream(&s).unwrap();
        assert_eq!(good.elements(), Some(n));
        assert_eq!(huge.elements(), None);
        assert_eq!(SoftmaxBlock::square(2, 5, 0.5).elements(), Some(50));
    }
}
