//! ReLU forward and backward on every backend here: against the f64 definition (exact: values
//! are kept or become +0, never rounded) for f32, f16 and bf16 on sizes from 0 past one block,
//! the backward against central differences of the f64 forward away from the kink, and bad
//! operands refused with nothing written.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::ops::{relu_backward, relu_forward};
use tidemem::DType;

const SIZES: [usize; 6] = [0, 1, 31, 33, 1000, 70_001];

#[test]
fn forward_and_backward_match_the_definition_exactly() {
    let mut rng = SplitMix64::new(5);
    for dev in common::devices("relu") {
        let s = dev.new_stream().unwrap();
        for d in FLOATS {
            for n in SIZES {
                let mut x = rng.vals(n, 3.0, 0.0, d);
                for (i, z) in [0.0, -0.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY]
                    .into_iter()
                    .enumerate()
                {
                    if let Some(e) = x.get_mut(i * 7) {
                        *e = z;
                    }
                }
                let dy = rng.vals(n, 2.0, 0.0, d);
                let (xb, dyb) = (upv(&dev, &s, &x, d), upv(&dev, &s, &dy, d));
                let yb = up(&dev, &s, &vec![0x5a; n * d.size()]);
                let dxb = up(&dev, &s, &vec![0x5a; n * d.size()]);
                relu_forward(&dev, &s, &xb, &yb, d).unwrap();
                relu_backward(&dev, &s, &xb, &dyb, &dxb, d).unwrap();
                let pos = |v: f64| v > 0.0;
                let want_y: Vec<f64> = x.iter().map(|&v| if pos(v) { v } else { 0.0 }).collect();
                let want_dx: Vec<f64> = x
                    .iter()
                    .zip(&dy)
                    .map(|(&v, &g)| if pos(v) { g } else { 0.0 })
                    .collect();
                let what = format!("{d} n={n}");
                // +0, not -0: compare the bytes.
                assert_eq!(down(&dev, &s, &yb), enc(&want_y, d), "{what}: y");
                assert_eq!(down(&dev, &s, &dxb), enc(&want_dx, d), "{what}: dx");
                // The backward given the forward's output instead of its input: the same.
                let dx2 = up(&dev, &s, &vec![0x5a; n * d.size()]);
                relu_backward(&dev, &s, &yb, &dyb, &dx2, d).unwrap();
                assert_eq!(down(&dev, &s, &dx2), enc(&want_dx, d), "{what}: dx from y");
            }
        }
    }
}

#[test]
fn backward_matches_finite_differences() {
    let dev = common::sim(16 << 20);
    let s = dev.new_stream().unwrap();
    let mut rng = SplitMix64::new(6);
    let n = 200;
    // Away from the kink at 0, where the derivative does not exist.
    let x: Vec<f64> = rng
        .vals(n, 2.0, 0.0, DType::F32)
        .into_iter()
        .map(|v| if v.abs() < 0.01 { 0.5 } else { v })
        .collect();
    let w = rng.vals(n, 1.0, 0.0, DType::F32);
    let relu = |v: f64| v.max(0.0);
    let step = 1e-6;
    let fd: Vec<f64> = x
        .iter()
        .zip(&w)
        .map(|(&v, &w)| (w * relu(v + step) - w * relu(v - step)) / (2.0 * step))
        .collect();
    let (xb, wb) = (upv(&dev, &s, &x, DType::F32), upv(&dev, &s, &w, DType::F32));
    let dxb = dev.alloc(n * 4).unwrap();
    relu_backward(&dev, &s, &xb, &wb, &dxb, DType::F32).unwrap();
    close("dx", &downv(&dev, &s, &dxb, DType::F32), &fd, 1e-9, 1e-9);
}

#[test]
fn bad_operands_are_refused_and_nothing_is_written() {
    for dev in common::devices("relu refusals") {
        let s = dev.new_stream().unwrap();
        let x = up(&dev, &s, &[0x11; 40]);
        let y = up(&dev, &s, &[0x22; 40]);
        let short = up(&dev, &s, &[0x33; 36]);
        let bufs = [(&y, &[0x22u8; 40][..]), (&short, &[0x33u8; 36][..])];
        refused(
            "y too short",
            relu_forward(&dev, &s, &x, &short, DType::F32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "y overlaps x",
            relu_forward(
                &dev,
                &s,
                x.view(0, 20).unwrap(),
                x.view(16, 20).unwrap(),
                DType::F32,
            ),
            &dev,
            &s,
            &[(&x, &[0x11u8; 40][..])],
        );
        refused(
            "dx too short",
            relu_backward(&dev, &s, &x, &y, &short, DType::F32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "misaligned",
            relu_forward(
                &dev,
                &s,
                x.view(2, 20).unwrap(),
                y.view(0, 20).unwrap(),
                DType::F32,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "not a model float",
            relu_forward(&dev, &s, &x, &y, DType::I32),
            &dev,
            &s,
            &bufs,
        );
        relu_forward(&dev, &s, &x, &y, DType::F16).unwrap();
    }
}
