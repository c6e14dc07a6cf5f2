//! The linear-layer bias ops on every backend here: `bias_rows` (exact: a copy of the stored
//! bias), `add_bias_rows` and `bias_grad` against f64 references on shapes of one row and
//! column, odd widths and more rows than the 256 chunks of the column sums; `bias_grad` against
//! central differences of the f64 forward `Σ w·(y + b)`; bad operands refused with nothing
//! written.
//!
//! Tolerances (u: unit roundoff of the stored type, 2⁻²⁴ f32, 2⁻¹¹ f16, 2⁻⁸ bf16):
//! - `add_bias_rows`: |Δ| ≤ u·|y + b| + t (one f32 add, then one rounding to storage; t half
//!   the type's smallest subnormal);
//! - `bias_grad`: |Δ| ≤ (k + m + 2)·2⁻²⁴·(Σ|dy| + |db₀|) + u_db·|db|, for k rows per chunk and
//!   m chunks (the f32 additions of the chunked sum, then one rounding to db's type).

mod common;
mod ops_util;

use ops_util::*;
use tidemem::ops::rows::column_chunks;
use tidemem::ops::{add_bias_rows, bias_grad, bias_grad_scratch_bytes, bias_rows, BiasGrad};
use tidemem::DType;

const SHAPES: [(usize, usize); 7] = [
    (0, 3),
    (1, 1),
    (3, 7),
    (8, 33),
    (257, 5),
    (1000, 3),
    (40, 600),
];

#[test]
fn bias_rows_copies_and_adds() {
    let mut rng = SplitMix64::new(7);
    for dev in common::devices("bias_rows") {
        let s = dev.new_stream().unwrap();
        for d in FLOATS {
            for (n, c) in SHAPES {
                let b = rng.vals(c, 2.0, 0.0, d);
                let y0 = rng.vals(n * c, 3.0, 0.0, d);
                let bb = upv(&dev, &s, &b, d);
                let yb = up(&dev, &s, &vec![0x5a; n * c * d.size()]);
                bias_rows(&dev, &s, &bb, &yb, n, c, d).unwrap();
                let want: Vec<f64> = (0..n * c).map(|i| b[i % c]).collect();
                assert_eq!(downv(&dev, &s, &yb, d), want, "{d} [{n}, {c}] bias_rows");
                let yb = upv(&dev, &s, &y0, d);
                add_bias_rows(&dev, &s, &bb, &yb, n, c, d).unwrap();
                let want: Vec<f64> = (0..n * c).map(|i| y0[i] + b[i % c]).collect();
                close(
                    &format!("{d} [{n}, {c}] add_bias_rows"),
                    &downv(&dev, &s, &yb, d),
                    &want,
                    tiny(d),
                    unit(d),
                );
            }
        }
    }
}

/// `db` after a device `bias_grad` (db of type `g`, starting at `db0` when accumulating).
#[allow(clippy::too_many_arguments)]
fn run_grad(
    dev: &tidemem::device::Device,
    s: &tidemem::device::Stream,
    d: DType,
    g: DType,
    dy: &[f64],
    db0: Option<&[f64]>,
    n: usize,
    c: usize,
) -> Vec<f64> {
    let dyb = upv(dev, s, dy, d);
    let dbb = match db0 {
        Some(v) => upv(dev, s, v, g),
        None => up(dev, s, &vec![0x5a; c * g.size()]),
    };
    let scratch = up(dev, s, &vec![0x77; bias_grad_scratch_bytes(n, c) + 4]);
    let ops = BiasGrad {
        dy: (&dyb).into(),
        db: (&dbb).into(),
        db_dtype: g,
        accumulate: db0.is_some(),
        scratch: (&scratch).into(),
    };
    bias_grad(dev, s, ops, n, c, d).unwrap();
    downv(dev, s, &dbb, g)
}

#[test]
fn bias_grad_sums_columns_within_the_stated_bound() {
    let mut rng = SplitMix64::new(8);
    for dev in common::devices("bias_grad") {
        let s = dev.new_stream().unwrap();
        for d in FLOATS {
            for g in [DType::F32, d] {
                for (n, c) in SHAPES {
                    for acc in [false, true] {
                        let dy = rng.vals(n * c, 2.0, 0.3, d);
                        let db0 = rng.vals(c, 4.0, 0.0, g);
                        let got = run_grad(&dev, &s, d, g, &dy, acc.then_some(&db0), n, c);
                        let (per, chunks) = column_chunks(n);
                        let k = (per + chunks + 2) as f64 * 2f64.powi(-24);
                        for j in 0..c {
                            let col = (0..n).map(|r| dy[r * c + j]);
                            let base = if acc { db0[j] } else { 0.0 };
                            let want = base + col.clone().sum::<f64>();
                            let mass = base.abs() + col.map(f64::abs).sum::<f64>();
                            let tol = k * mass + unit(g) * want.abs();
                            assert!(
                                (got[j] - want).abs() <= tol,
                                "{d} db {g} [{n}, {c}] acc {acc}: column {j}: {} vs {want}",
                                got[j]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn bias_grad_is_the_same_bits_every_run() {
    let mut rng = SplitMix64::new(9);
    let dev = common::devices("bias_grad repeat").pop().unwrap();
    let s = dev.new_stream().unwrap();
    let (n, c) = (3000, 17);
    let dy = rng.vals(n * c, 1.0, 0.0, DType::F32);
    let first = run_grad(&dev, &s, DType::F32, DType::F32, &dy, None, n, c);
    for _ in 0..3 {
        assert_eq!(
            run_grad(&dev, &s, DType::F32, DType::F32, &dy, None, n, c),
            first
        );
    }
}

#[test]
fn bias_grad_matches_finite_differences() {
    let dev = common::sim(16 << 20);
    let s = dev.new_stream().unwrap();
    let mut rng = SplitMix64::new(10);
    let (n, c) = (37, 9);
    let y = rng.vals(n * c, 1.0, 0.0, DType::F32);
    let w = rng.vals(n * c, 1.0, 0.0, DType::F32);
    let b = rng.vals(c, 1.0, 0.0, DType::F32);
    // L(b) = Σ w·(y + b broadcast): dL/db = Σ_rows w.
    let loss = |b: &[f64]| -> f64 { (0..n * c).map(|i| w[i] * (y[i] + b[i % c])).sum() };
    let step = 1e-6;
    let fd: Vec<f64> = (0..c).map(|j| central_diff(&b, j, step, loss)).collect();
    let got = run_grad(&dev, &s, DType::F32, DType::F32, &w, None, n, c);
    close("db", &got, &fd, 1e-6, 1e-6);
}

#[test]
fn bad_operands_are_refused_and_nothing_is_written() {
    for dev in common::devices("bias refusals") {
        let s = dev.new_stream().unwrap();
        let (n, c) = (4usize, 6usize);
        let b = up(&dev, &s, &vec![0x11; c * 4]);
        let y = up(&dev, &s, &vec![0x22; n * c * 4]);
        let db = up(&dev, &s, &vec![0x33; c * 4]);
        let scratch = up(&dev, &s, &vec![0x44; bias_grad_scratch_bytes(n, c)]);
        let keep: Vec<(&tidemem::device::DeviceBuffer, Vec<u8>)> = [&b, &y, &db, &scratch]
            .into_iter()
            .map(|x| (x, down(&dev, &s, x)))
            .collect();
        let bufs: Vec<(&tidemem::device::DeviceBuffer, &[u8])> =
            keep.iter().map(|(b, v)| (*b, &v[..])).collect();
        let f32 = DType::F32;
        refused(
            "rows do not match",
            bias_rows(&dev, &s, &b, &y, n + 1, c, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "b too wide",
            bias_rows(&dev, &s, &y, &y, 1, c, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "no columns",
            add_bias_rows(&dev, &s, &b, &y, n, 0, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "y overlaps b",
            bias_rows(&dev, &s, y.view(0, 24).unwrap(), &y, n, c, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "f64 storage",
            bias_rows(&dev, &s, &b, &y, 2, c / 2, DType::F64),
            &dev,
            &s,
            &bufs,
        );
        let good = || BiasGrad {
            dy: (&y).into(),
            db: (&db).into(),
            db_dtype: f32,
            accumulate: true,
            scratch: (&scratch).into(),
        };
        refused(
            "dy rows",
            bias_grad(&dev, &s, good(), n + 1, c, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "scratch too small",
            bias_grad(
                &dev,
                &s,
                BiasGrad {
                    scratch: scratch.view(0, 8).unwrap(),
                    ..good()
                },
                n,
                c,
                f32,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "db too short",
            bias_grad(
                &dev,
                &s,
                BiasGrad {
                    db: db.view(0, 20).unwrap(),
                    ..good()
                },
                n,
                c,
                f32,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "db is the scratch",
            bias_grad(
                &dev,
                &s,
                BiasGrad {
                    db: scratch.view(0, 24).unwrap(),
                    ..good()
                },
                n,
                c,
                f32,
            ),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "db an integer type",
            bias_grad(
                &dev,
                &s,
                BiasGrad {
                    db_dtype: DType::I32,
                    ..good()
                },
                n,
                c,
                f32,
            ),
            &dev,
            &s,
            &bufs,
        );
        bias_grad(&dev, &s, good(), n, c, f32).unwrap();
    }
}
