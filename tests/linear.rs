//! `ops::linear` (bias broadcast + GEMM forward; dX, dW, db backward) on every device against
//! an f64 reference, whose backward is checked against central finite differences of its
//! forward; overwrite and accumulate; f32, f16 and bf16.

mod common;
mod ops_util;

use ops_util::{central_diff, downv, stored, upf, widen};
use tidemem::ops::bias_grad_scratch_bytes;
use tidemem::ops::linear::{
    linear_backward, linear_forward, BiasGradOut, LinearGrads, LinearShape,
};
use tidemem::DType;

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let z = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `y = x·wᵀ + b` in f64.
fn forward(s: LinearShape, x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let mut y = vec![0.0; s.rows * s.outputs];
    for r in 0..s.rows {
        for o in 0..s.outputs {
            y[r * s.outputs + o] = b[o]
                + (0..s.inputs)
                    .map(|i| x[r * s.inputs + i] * w[o * s.inputs + i])
                    .sum::<f64>();
        }
    }
    y
}

/// (dx, dw, db) of Σ dy·y in f64.
fn backward(s: LinearShape, x: &[f64], w: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dx, mut dw, mut db) = (
        vec![0.0; s.rows * s.inputs],
        vec![0.0; s.outputs * s.inputs],
        vec![0.0; s.outputs],
    );
    for r in 0..s.rows {
        for o in 0..s.outputs {
            let g = dy[r * s.outputs + o];
            db[o] += g;
            for i in 0..s.inputs {
                dx[r * s.inputs + i] += g * w[o * s.inputs + i];
                dw[o * s.inputs + i] += g * x[r * s.inputs + i];
            }
        }
    }
    (dx, dw, db)
}

#[test]
fn the_reference_backward_matches_finite_differences() {
    let s = LinearShape {
        rows: 3,
        inputs: 4,
        outputs: 2,
    };
    let (x, w, b, dy) = (
        widen(&values(12, 1)),
        widen(&values(8, 2)),
        widen(&values(2, 3)),
        widen(&values(6, 4)),
    );
    let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
        forward(s, x, w, b)
            .iter()
            .zip(&dy)
            .map(|(y, g)| y * g)
            .sum()
    };
    let (dx, dw, db) = backward(s, &x, &w, &dy);
    let h = 1e-6;
    let fd = |v: &[f64], i: usize, which: usize| {
        central_diff(v, i, h, |p| match which {
            0 => loss(p, &w, &b),
            1 => loss(&x, p, &b),
            _ => loss(&x, &w, p),
        })
    };
    for (grad, v, which) in [(&dx, &x, 0), (&dw, &w, 1), (&db, &b, 2)] {
        for (i, g) in grad.iter().enumerate() {
            assert!((g - fd(v, i, which)).abs() < 1e-8, "grad {which}[{i}]");
        }
    }
}

/// |got − want| ≤ tol·(Σ|terms|), element by element (`scale`: the sum of absolute terms).
fn close(what: &str, got: &[f64], want: &[f64], scale: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + s), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn forward_and_backward_match_the_reference_on_every_device() {
    for dev in common::devices("linear") {
        let st = dev.new_stream().unwrap();
        for (rows, inputs, outputs) in [(1, 1, 1), (3, 5, 7), (33, 17, 9), (64, 48, 96)] {
            let s = LinearShape {
                rows,
                inputs,
                outputs,
            };
            for d in [DType::F32, DType::F16, DType::BF16] {
                // f32: sums of up to `inputs` or `rows` products; 16-bit storage: one rounding of
                // the result (2⁻¹¹ / 2⁻⁸ relative) on top
                let tol = match d {
                    DType::F32 => 1e-6,
                    DType::F16 => 2e-3,
                    _ => 1.6e-2,
                };
                let (xv, wv, bv, dyv) = (
                    values(rows * inputs, 1),
                    values(outputs * inputs, 2),
                    values(outputs, 3),
                    values(rows * outputs, 4),
                );
                let (x, w, b, dy) = (
                    stored(&xv, d),
                    stored(&wv, d),
                    stored(&bv, d),
                    stored(&dyv, d),
                );
                let (xb, wb, bb, dyb) = (
                    upf(&dev, &st, &xv, d),
                    upf(&dev, &st, &wv, d),
                    upf(&dev, &st, &bv, d),
                    upf(&dev, &st, &dyv, d),
                );
                let y = dev.alloc(rows * outputs * d.size()).unwrap();
                linear_forward(&dev, &st, s, &xb, &wb, Some((&bb).into()), &y, d).unwrap();
                let abs = |v: &[f64]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
                let scale = forward(s, &abs(&x), &abs(&w), &abs(&b));
                close(
                    "y",
                    &downv(&dev, &st, &y, d),
                    &forward(s, &x, &w, &b),
                    &scale,
                    tol,
                );

                let (dx0, dw0) = (values(rows * inputs, 5), values(outputs * inputs, 6));
                let dxb = upf(&dev, &st, &dx0, d);
                let dwb = upf(&dev, &st, &dw0, d);
                let dbb = dev
                    .upload(&st, bytemuck::cast_slice(&vec![1.0f32; outputs]))
                    .unwrap();
                let scratch = dev
                    .alloc(bias_grad_scratch_bytes(rows, outputs).max(4))
                    .unwrap();
                let grads = LinearGrads {
                    dx: Some(((&dxb).into(), true)),
                    dw: Some(((&dwb).into(), false)),
                    db: Some(BiasGradOut {
                        db: (&dbb).into(),
                        dtype: DType::F32,
                        accumulate: true,
                        scratch: (&scratch).into(),
                    }),
                };
                linear_backward(&dev, &st, s, &xb, &wb, &dyb, grads, d).unwrap();
                let (dx, dw, db) = backward(s, &x, &w, &dy);
                let (sx, sw, sb) = backward(s, &abs(&x), &abs(&w), &abs(&dy));
                let dx_want: Vec<f64> =
                    dx.iter().zip(stored(&dx0, d)).map(|(a, b)| a + b).collect();
                let sx: Vec<f64> = sx
                    .iter()
                    .zip(stored(&dx0, d))
                    .map(|(a, b)| a + b.abs())
                    .collect();
                close("dx (+=)", &downv(&dev, &st, &dxb, d), &dx_want, &sx, tol);
                close("dw", &downv(&dev, &st, &dwb, d), &dw, &sw, tol);
                let db_want: Vec<f64> = db.iter().map(|g| g + 1.0).collect();
                let sb: Vec<f64> = sb.iter().map(|g| g + 1.0).collect();
                close(
                    "db (+=)",
                    &downv(&dev, &st, &dbb, DType::F32),
                    &db_want,
                    &sb,
                    1e-6,
                );
            }
        }
    }
}

#[test]
fn a_bad_shape_is_a_typed_error_naming_it() {
    let dev = common::sim(1 << 20);
    let st = dev.new_stream().unwrap();
    let s = LinearShape {
        rows: 2,
        inputs: 3,
        outputs: 4,
    };
    let x = dev.alloc(2 * 3 * 4).unwrap();
    let w = dev.alloc(4 * 3 * 4 - 4).unwrap(); // one element short
    let y = dev.upload(&st, &[7u8; 32]).unwrap();
    let b = dev.alloc(16).unwrap();
    for bias in [None, Some((&b).into())] {
        let e = linear_forward(&dev, &st, s, &x, &w, bias, &y, DType::F32).unwrap_err();
        assert!(e.to_string().contains("`w` [4, 3]"), "{e}");
        let after = dev.download(&st, &y).unwrap();
        assert_eq!(after, vec![7u8; 32], "nothing written");
    }
}
