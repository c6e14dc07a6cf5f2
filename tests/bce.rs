//! The fused sigmoid + binary cross-entropy on every backend present (the simulated device
//! always, CUDA when there is one): loss, gradient and probabilities against an f64 reference on
//! f32, f16 and bf16 logits, the gradient against central finite differences of the f64 loss,
//! every combination of optional outputs, and bad input refused with a typed error before any
//! byte is written.
//!
//! Tolerances (per element, `u = 2^-24`; the reference uses the stored, rounded logits):
//! - loss: `4e-7·|ref|` (a few ulp, relative even where the loss is tiny), plus
//!   `2u·(|x·y| + max(x, 0))` for soft labels, where `max(x, 0) − x·y` cancels;
//! - σ(x): `4e-7·σ`;
//! - dlogits: `|scale|·(4e-7·σ + 2u·|σ − y|)` in f32, plus the storage's rounding of the result
//!   (f16: `2^-11·|ref| + 2^-25`, bf16: `2^-8·|ref|`).

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::{DeviceBuffer, Operand};
use tidemem::ops::{abi::BceParams, abi::BCE_WITH_LOGITS, bce_with_logits, BceOutputs};
use tidemem::DType;

fn loss64(x: f64, y: f64) -> f64 {
    x.max(0.0) - x * y + (-x.abs()).exp().ln_1p()
}

fn sigmoid64(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        x.exp() / (1.0 + x.exp())
    }
}

/// Logits in [-scale, scale) as stored in `d`, and labels: 0, 1 or soft.
fn inputs(r: &mut SplitMix64, n: usize, scale: f32, d: DType) -> (Vec<f32>, Vec<f32>) {
    let x = r.vals_f32(n, scale, d);
    let y = (0..n)
        .map(|_| match r.below(3) {
            0 => 0.0,
            1 => 1.0,
            _ => r.next_f32(),
        })
        .collect();
    (x, y)
}

/// Checks one run's outputs against the f64 reference.
#[allow(clippy::too_many_arguments)]
fn check(
    what: &str,
    x: &[f32],
    y: &[f32],
    scale: f32,
    dt: DType,
    loss: &[f32],
    dl: Option<&[f32]>,
    pr: Option<&[f32]>,
) {
    let (r_out, a_out) = out_rounding(dt);
    for i in 0..x.len() {
        let (xi, yi) = (x[i] as f64, y[i] as f64);
        let (wl, ws) = (loss64(xi, yi), sigmoid64(xi));
        let soft = yi != 0.0 && yi != 1.0;
        let tol = 4e-7 * wl.abs()
            + if soft {
                2.0 * U * ((xi * yi).abs() + xi.max(0.0))
            } else {
                0.0
            };
        assert!(
            (loss[i] as f64 - wl).abs() <= tol,
            "{what}: loss {i} (x {xi}, y {yi}): {} vs {wl}",
            loss[i]
        );
        if let Some(pr) = pr {
            assert!(
                (pr[i] as f64 - ws).abs() <= 4e-7 * ws,
                "{what}: sigma {i} (x {xi}): {} vs {ws}",
                pr[i]
            );
        }
        if let Some(dl) = dl {
            let s = scale as f64;
            let want = (ws - yi) * s;
            let tol = s.abs() * (4e-7 * ws + 2.0 * U * (ws - yi).abs()) * (1.0 + r_out)
                + r_out * want.abs()
                + a_out;
            assert!(
                (dl[i] as f64 - want).abs() <= tol,
                "{what}: dlogit {i} (x {xi}, y {yi}): {} vs {want}",
                dl[i]
            );
        }
    }
}

#[test]
fn every_output_matches_the_f64_reference() {
    for dev in common::devices("bce f64 reference") {
        let st = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(17);
        for dt in FLOATS {
            for n in [0usize, 1, 7, 64, 1000, 4099] {
                for (with_grad, with_probs) in
                    [(true, true), (true, false), (false, true), (false, false)]
                {
                    let what = format!(
                        "{} {dt} n={n} grad {with_grad} probs {with_probs}",
                        dev.name()
                    );
                    let (x, y) = inputs(&mut r, n, 25.0, dt);
                    let scale = 1.0 / n.max(1) as f32;
                    let (xb, yb) = (upf(&dev, &st, &x, dt), upf(&dev, &st, &y, DType::F32));
                    let loss = dev.alloc(4 * n).unwrap();
                    let dl = dev.alloc(dt.size() * n).unwrap();
                    let pr = dev.alloc(4 * n).unwrap();
                    let out = BceOutputs {
                        loss: (&loss).into(),
                        dlogits: with_grad.then(|| (&dl).into()),
                        probs: with_probs.then(|| (&pr).into()),
                    };
                    bce_with_logits(&dev, &st, &xb, &yb, dt, scale, out).unwrap();
                    let got_l = downf(&dev, &st, &loss, DType::F32);
                    let got_d = with_grad.then(|| downf(&dev, &st, &dl, dt));
                    let got_p = with_probs.then(|| downf(&dev, &st, &pr, DType::F32));
                    check(
                        &what,
                        &x,
                        &y,
                        scale,
                        dt,
                        &got_l,
                        got_d.as_deref(),
                        got_p.as_deref(),
                    );
                }
            }
        }
        dev.sync_stream(&st).unwrap();
    }
}

#[test]
fn gradient_matches_finite_differences_of_the_loss() {
    let dev = common::sim(16 << 20);
    let st = dev.new_stream().unwrap();
    let mut r = SplitMix64::new(4);
    let n = 501;
    let scale = 0.125f32;
    for dt in FLOATS {
        let (x, y) = inputs(&mut r, n, 12.0, dt);
        let (xb, yb) = (upf(&dev, &st, &x, dt), upf(&dev, &st, &y, DType::F32));
        let loss = dev.alloc(4 * n).unwrap();
        let dl = dev.alloc(dt.size() * n).unwrap();
        let out = BceOutputs {
            loss: (&loss).into(),
            dlogits: Some((&dl).into()),
            probs: None,
        };
        bce_with_logits(&dev, &st, &xb, &yb, dt, scale, out).unwrap();
        let got = downf(&dev, &st, &dl, dt);
        let (r_out, a_out) = out_rounding(dt);
        for i in 0..n {
            // The gradient of scale · Σ loss with respect to x[i].
            let (xi, yi, h) = (x[i] as f64, y[i] as f64, 1e-4);
            let fd = scale as f64 * (loss64(xi + h, yi) - loss64(xi - h, yi)) / (2.0 * h);
            let tol = 2e-8 + 1e-6 * fd.abs() + r_out * fd.abs() + a_out;
            assert!(
                (got[i] as f64 - fd).abs() <= tol,
                "{dt} {i} (x {xi}, y {yi}): {} vs {fd}",
                got[i]
            );
        }
    }
}

#[test]
fn bad_input_is_refused_and_writes_nothing() {
    for dev in common::devices("bce bad input") {
        let st = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(8);
        let buf = |bytes: usize, r: &mut SplitMix64| dev.upload(&st, &r.bytes(bytes)).unwrap();
        let n = 10;
        let (x, y) = (buf(4 * n, &mut r), buf(4 * n, &mut r));
        let (loss, dl, pr) = (buf(4 * n, &mut r), buf(4 * n, &mut r), buf(4 * n, &mut r));
        let (short, dl16) = (buf(4 * n - 4, &mut r), buf(2 * n, &mut r));
        let all = [&loss, &dl, &pr];
        let run = |x: &DeviceBuffer,
                   y: &DeviceBuffer,
                   l: &DeviceBuffer,
                   d: Option<&DeviceBuffer>,
                   p: Option<&DeviceBuffer>,
                   scale: f32| {
            let out = BceOutputs {
                loss: l.into(),
                dlogits: d.map(Into::into),
                probs: p.map(Into::into),
            };
            bce_with_logits(&dev, &st, x, y, DType::F32, scale, out)
        };
        refused_run(&dev, &st, "short labels", &all, || {
            run(&x, &short, &loss, Some(&dl), Some(&pr), 1.0)
        });
        refused_run(&dev, &st, "short loss", &[&short, &dl, &pr], || {
            run(&x, &y, &short, Some(&dl), Some(&pr), 1.0)
        });
        refused_run(&dev, &st, "short dlogits", &[&loss, &short, &pr], || {
            run(&x, &y, &loss, Some(&short), Some(&pr), 1.0)
        });
        refused_run(&dev, &st, "short probs", &[&loss, &dl, &short], || {
            run(&x, &y, &loss, Some(&dl), Some(&short), 1.0)
        });
        refused_run(&dev, &st, "a NaN scale", &all, || {
            run(&x, &y, &loss, Some(&dl), Some(&pr), f32::NAN)
        });
        refused_run(&dev, &st, "an infinite scale", &all, || {
            run(&x, &y, &loss, Some(&dl), Some(&pr), f32::INFINITY)
        });
        // dlogits in place over the logits: refused (the gradient has an output of its own).
        refused_run(&dev, &st, "dlogits over the logits", &[&x, &loss], || {
            run(&x, &y, &loss, Some(&x), None, 1.0)
        });
        refused_run(&dev, &st, "probs over the loss", &[&loss], || {
            run(&x, &y, &loss, None, Some(&loss), 1.0)
        });
        // Through the descriptor: f16 gradients of f32 logits, and f16 labels.
        let p = BceParams {
            n: n as u64,
            scale: 1.0,
            pad: 0,
        };
        let launch = |ops: &[Option<Operand<'_>>]| {
            dev.launch(&st, &BCE_WITH_LOGITS, ops, bytemuck::bytes_of(&p))
        };
        refused_run(
            &dev,
            &st,
            "f16 dlogits of f32 logits",
            &[&loss, &dl16],
            || {
                launch(&[
                    Some(Operand::new(&x, DType::F32)),
                    Some(Operand::new(&y, DType::F32)),
                    Some(Operand::new(&loss, DType::F32)),
                    Some(Operand::new(&dl16, DType::F16)),
                    None,
                ])
            },
        );
        refused_run(&dev, &st, "f16 labels", &[&loss], || {
            launch(&[
                Some(Operand::new(&x, DType::F32)),
                Some(Operand::new(&dl16, DType::F16)),
                Some(Operand::new(&loss, DType::F32)),
                None,
                None,
            ])
        });
        refused_run(&dev, &st, "no loss", &[&dl], || {
            launch(&[
                Some(Operand::new(&x, DType::F32)),
                Some(Operand::new(&y, DType::F32)),
                None,
                Some(Operand::new(&dl, DType::F32)),
                None,
            ])
        });
        dev.sync_stream(&st).unwrap();
    }
}
