//! DLRM's dot interaction on every backend present (the simulated device always, CUDA when
//! there is one): forward and backward against an f64 reference on f32, f16 and bf16 storage,
//! the backward against central finite differences of the f64 forward, and bad input refused
//! with a typed error before any byte is written.
//!
//! Tolerances (per element; `u = 2^-24`, `S` the sum of the absolute values of the terms the
//! element sums, `D`/`n` the terms of one chain): the f64 reference is computed from the stored
//! (rounded) inputs, so only the op's own rounding counts: `γ·S + r·|ref| + a`, with
//! `γ = (terms + 1)·u` (a chain of fmas in f32), `r` the output's rounding (f32: 0, f16: 2^-11,
//! bf16: 2^-8) and `a` its absolute floor (f16 subnormals: 2^-25; else 0). The pass-through part
//! of the forward output is exact.

mod common;
mod ops_util;

use half::{bf16, f16};
use ops_util::*;
use tidemem::device::DeviceBuffer;
use tidemem::ops::{interaction_backward, interaction_forward, InteractionShape};
use tidemem::DType;

fn shape(batch: usize, features: usize, dim: usize) -> InteractionShape {
    InteractionShape {
        batch,
        features,
        dim,
    }
}

/// Shapes: one sample, no features, dim 1, odd sizes, Criteo's 26 features, and one whose
/// sample does not fit in shared memory on CUDA (the kernels' global path).
fn shapes() -> Vec<InteractionShape> {
    vec![
        shape(1, 0, 1),
        shape(1, 1, 1),
        shape(3, 5, 7),
        shape(2, 26, 16),
        shape(4, 3, 33),
        shape(2, 26, 64),
        shape(1, 63, 200),
    ]
}

fn row(x: &[f64], e: &[f64], s: InteractionShape, b: usize, r: usize) -> Vec<f64> {
    let d = s.dim;
    if r == 0 {
        x[b * d..][..d].to_vec()
    } else {
        e[(b * s.features + r - 1) * d..][..d].to_vec()
    }
}

/// The f64 forward, and for each interaction the sum of |products| (0 for the pass-through).
fn forward64(x: &[f64], e: &[f64], s: InteractionShape) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut mag) = (vec![], vec![]);
    for b in 0..s.batch {
        out.extend(row(x, e, s, b, 0));
        mag.extend(vec![0.0; s.dim]);
        for i in 1..s.rows() {
            for j in 0..i {
                let (a, c) = (row(x, e, s, b, i), row(x, e, s, b, j));
                out.push(a.iter().zip(&c).map(|(p, q)| p * q).sum());
                mag.push(a.iter().zip(&c).map(|(p, q)| (p * q).abs()).sum());
            }
        }
    }
    (out, mag)
}

/// The f64 gradients (d_dense, d_emb) and the sums of |terms| of each.
#[allow(clippy::type_complexity, clippy::needless_range_loop)]
fn backward64(
    x: &[f64],
    e: &[f64],
    dy: &[f64],
    s: InteractionShape,
) -> ((Vec<f64>, Vec<f64>), (Vec<f64>, Vec<f64>)) {
    let (n, d, w) = (s.rows(), s.dim, s.out_width());
    let (mut dx, mut de, mut mx, mut me) = (vec![], vec![], vec![], vec![]);
    for b in 0..s.batch {
        let dy = &dy[b * w..][..w];
        let g = |k: usize, m: usize| match k.cmp(&m) {
            std::cmp::Ordering::Equal => 0.0,
            std::cmp::Ordering::Greater => dy[d + k * (k - 1) / 2 + m],
            std::cmp::Ordering::Less => dy[d + m * (m - 1) / 2 + k],
        };
        for k in 0..n {
            for c in 0..d {
                let (mut v, mut mag) = if k == 0 {
                    (dy[c], dy[c].abs())
                } else {
                    (0.0, 0.0)
                };
                for m in 0..n {
                    let t = g(k, m) * row(x, e, s, b, m)[c];
                    v += t;
                    mag += t.abs();
                }
                if k == 0 {
                    dx.push(v);
                    mx.push(mag);
                } else {
                    de.push(v);
                    me.push(mag);
                }
            }
        }
    }
    ((dx, de), (mx, me))
}

/// `got` within `γ·mag + r·|want| + a` of `want`, element by element.
fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], terms: usize, d: DType) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (r, a) = out_rounding(d);
    let gamma = (terms + 1) as f64 * U;
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = gamma * m * (1.0 + r) + r * w.abs() + a;
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}: element {i}: {g} vs {w} (tolerance {tol:e})"
        );
    }
}

#[test]
fn forward_and_backward_match_the_f64_reference() {
    for dev in common::devices("interaction f64 reference") {
        let st = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(5);
        for dt in FLOATS {
            for s in shapes() {
                let what = format!("{} {dt} {s:?}", dev.name());
                let x = r.vals_f32(s.batch * s.dim, 1.0, dt);
                let e = r.vals_f32(s.batch * s.features * s.dim, 1.0, dt);
                let (xb, eb) = (upf(&dev, &st, &x, dt), upf(&dev, &st, &e, dt));
                let out = dev.alloc(s.batch * s.out_width() * dt.size()).unwrap();
                interaction_forward(&dev, &st, &xb, &eb, &out, s, dt).unwrap();
                let got = downf(&dev, &st, &out, dt);
                let (want, mag) = forward64(&widen(&x), &widen(&e), s);
                assert_close(&format!("forward {what}"), &got, &want, &mag, s.dim, dt);
                for b in 0..s.batch {
                    let w = s.out_width();
                    assert_eq!(&got[b * w..][..s.dim], &x[b * s.dim..][..s.dim], "{what}");
                }

                let dy = r.vals_f32(s.batch * s.out_width(), 1.0, dt);
                let dyb = upf(&dev, &st, &dy, dt);
                let dx = dev.alloc(x.len() * dt.size()).unwrap();
                let de = dev.alloc(e.len() * dt.size()).unwrap();
                interaction_backward(&dev, &st, &xb, &eb, &dyb, &dx, &de, s, dt).unwrap();
                let ((wx, we), (mx, me)) = backward64(&widen(&x), &widen(&e), &widen(&dy), s);
                let n = s.rows();
                let gx = downf(&dev, &st, &dx, dt);
                assert_close(&format!("d_dense {what}"), &gx, &wx, &mx, n + 1, dt);
                let ge = downf(&dev, &st, &de, dt);
                assert_close(&format!("d_emb {what}"), &ge, &we, &me, n, dt);
            }
        }
        dev.sync_stream(&st).unwrap();
    }
}

/// `L = Σ dout · out`, in f64.
fn objective(x: &[f64], e: &[f64], dy: &[f64], s: InteractionShape) -> f64 {
    forward64(x, e, s)
        .0
        .iter()
        .zip(dy)
        .map(|(o, g)| o * g)
        .sum()
}

#[test]
fn backward_matches_finite_differences() {
    let dev = common::sim(16 << 20);
    let st = dev.new_stream().unwrap();
    let mut r = SplitMix64::new(9);
    for dt in FLOATS {
        for s in [shape(1, 1, 1), shape(2, 4, 5), shape(3, 9, 17)] {
            let x = r.vals_f32(s.batch * s.dim, 1.0, dt);
            let e = r.vals_f32(s.batch * s.features * s.dim, 1.0, dt);
            let dy = r.vals_f32(s.batch * s.out_width(), 1.0, dt);
            let (x64, e64, dy64) = (widen(&x), widen(&e), widen(&dy));
            let ((wx, we), (mx, me)) = backward64(&x64, &e64, &dy64, s);
            let (xb, eb, dyb) = (
                upf(&dev, &st, &x, dt),
                upf(&dev, &st, &e, dt),
                upf(&dev, &st, &dy, dt),
            );
            let dx = dev.alloc(x.len() * dt.size()).unwrap();
            let de = dev.alloc(e.len() * dt.size()).unwrap();
            interaction_backward(&dev, &st, &xb, &eb, &dyb, &dx, &de, s, dt).unwrap();
            let (gx, ge) = (downf(&dev, &st, &dx, dt), downf(&dev, &st, &de, dt));
            // L is quadratic in each input, so the central difference is exact but for rounding.
            let h = 1e-3;
            let fd = |dense: bool, i: usize| {
                let (mut xp, mut ep) = (x64.clone(), e64.clone());
                let v = if dense { &mut xp[i] } else { &mut ep[i] };
                *v += h;
                let plus = objective(&xp, &ep, &dy64, s);
                let v = if dense { &mut xp[i] } else { &mut ep[i] };
                *v -= 2.0 * h;
                (plus - objective(&xp, &ep, &dy64, s)) / (2.0 * h)
            };
            let (r_out, a_out) = out_rounding(dt);
            let n = s.rows();
            for (dense, want, mag, got) in [(true, &wx, &mx, &gx), (false, &we, &me, &ge)] {
                for i in 0..want.len() {
                    let f = fd(dense, i);
                    // The f64 backward against the differences: rounding of L only.
                    assert!((want[i] - f).abs() <= 1e-9 * (1.0 + mag[i]), "{s:?} {i}");
                    // The op against them: its own rounding (see the file's head).
                    let tol = (n + 2) as f64 * U * mag[i] * (1.0 + r_out)
                        + r_out * f.abs()
                        + a_out
                        + 1e-9;
                    assert!(
                        (got[i] as f64 - f).abs() <= tol,
                        "{dt} {s:?} dense {dense} {i}: {} vs {f}",
                        got[i]
                    );
                }
            }
        }
    }
}

#[test]
fn bad_input_is_refused_and_writes_nothing() {
    for dev in common::devices("interaction bad input") {
        let st = dev.new_stream().unwrap();
        let s = shape(3, 4, 5);
        let dt = DType::F32;
        let mut r = SplitMix64::new(3);
        let buf = |n: usize, r: &mut SplitMix64| dev.upload(&st, &r.bytes(n * 4)).unwrap();
        let (x, e) = (buf(15, &mut r), buf(60, &mut r));
        let out = buf(3 * s.out_width(), &mut r);
        let short = buf(14, &mut r);
        let fwd = |x: &DeviceBuffer, e: &DeviceBuffer, o: &DeviceBuffer, s, dt| {
            interaction_forward(&dev, &st, x, e, o, s, dt)
        };
        refused_run(&dev, &st, "short dense", &[&out], || {
            fwd(&short, &e, &out, s, dt)
        });
        refused_run(&dev, &st, "emb for 3 features", &[&out], || {
            fwd(&x, &e, &out, shape(3, 3, 5), dt)
        });
        let long = buf(3 * s.out_width() + 1, &mut r);
        refused_run(&dev, &st, "out too long", &[&long], || {
            fwd(&x, &e, &long, s, dt)
        });
        refused_run(&dev, &st, "u32 elements", &[&out], || {
            fwd(&x, &e, &out, s, DType::U32)
        });
        refused_run(&dev, &st, "dim over the limit", &[&out], || {
            fwd(&x, &e, &out, shape(0, 1, 1 << 20), dt)
        });
        refused_run(&dev, &st, "overflow", &[&out], || {
            fwd(&x, &e, &out, shape(usize::MAX / 2, 3, 5), dt)
        });
        // Mixed types, through the descriptor (the wrapper takes one type).
        let ops = [
            Some(tidemem::device::Operand::new(&x, DType::F32)),
            Some(tidemem::device::Operand::new(&e, DType::F32)),
            Some(tidemem::device::Operand::new(&out, DType::F16)),
        ];
        let p = s.params();
        refused_run(&dev, &st, "mixed types", &[&out], || {
            dev.launch(
                &st,
                &tidemem::ops::abi::INTERACTION_FORWARD,
                &ops,
                bytemuck::bytes_of(&p),
            )
        });
        // The output over an input.
        let both = buf(15 + 3 * s.out_width(), &mut r);
        let xs = both.view(0, 60).unwrap();
        let os = both.view(56, 4 * 3 * s.out_width()).unwrap();
        refused_run(&dev, &st, "out overlapping dense", &[&both], || {
            interaction_forward(&dev, &st, xs, &e, os, s, dt)
        });

        let dy = buf(3 * s.out_width(), &mut r);
        let (dx, de) = (buf(15, &mut r), buf(60, &mut r));
        let bwd = |dy: &DeviceBuffer, dx: &DeviceBuffer, de: &DeviceBuffer, s| {
            interaction_backward(&dev, &st, &x, &e, dy, dx, de, s, dt)
        };
        refused_run(&dev, &st, "short dout", &[&dx, &de], || {
            bwd(&short, &dx, &de, s)
        });
        refused_run(&dev, &st, "short d_dense", &[&de, &short], || {
            bwd(&dy, &short, &de, s)
        });
        refused_run(&dev, &st, "d_emb for another dim", &[&dx, &de], || {
            bwd(&dy, &dx, &de, shape(3, 4, 4))
        });
        refused_run(&dev, &st, "d_dense over d_emb", &[&de], || {
            let whole = de.view(0, 60).unwrap();
            interaction_backward(&dev, &st, &x, &e, &dy, whole, &de, s, dt)
        });
        dev.sync_stream(&st).unwrap();
    }
}

#[test]
fn the_storage_types_round_like_the_f32_result() {
    // f16 and bf16 results are the f32 chain rounded once: check against the f32 op.
    let dev = common::sim(16 << 20);
    let st = dev.new_stream().unwrap();
    let mut r = SplitMix64::new(21);
    let s = shape(2, 26, 16);
    let x = r.vals_f32(s.batch * s.dim, 1.0, DType::BF16);
    let e = r.vals_f32(s.batch * s.features * s.dim, 1.0, DType::BF16);
    let mut outs = vec![];
    for dt in FLOATS {
        let (xb, eb) = (upf(&dev, &st, &x, dt), upf(&dev, &st, &e, dt));
        let out = dev.alloc(s.batch * s.out_width() * dt.size()).unwrap();
        interaction_forward(&dev, &st, &xb, &eb, &out, s, dt).unwrap();
        outs.push(dev.download(&st, &out).unwrap());
    }
    let f32s: &[f32] = bytemuck::cast_slice(&outs[0]);
    let h: Vec<f16> = f32s.iter().map(|&v| f16::from_f32(v)).collect();
    let b: Vec<bf16> = f32s.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(outs[1], bytemuck::cast_slice::<f16, u8>(&h));
    assert_eq!(outs[2], bytemuck::cast_slice::<bf16, u8>(&b));
}
