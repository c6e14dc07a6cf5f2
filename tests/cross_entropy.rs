//! Fused softmax cross-entropy on every backend present (the simulated device, and CUDA when
//! there is one): losses and gradients against an f64 reference (GPT-2's padded vocabulary
//! included), the gradient against central finite differences of the f64 loss, f32/f16/bf16
//! logits, ignored rows, targets out of range, and bad input refused with a typed error and
//! nothing written.
//!
//! Tolerances, on the f64 reference computed from the logits as stored:
//! - loss (f32 whatever the storage): `|loss − ref| ≤ 2e-6 + 2e-6·|ref|`;
//! - gradient: `|g − ref| ≤ abs + 1e-7·s + rel·|ref|` (`s` the gradient scale) with (abs, rel)
//!   = f32 (0, 1e-5), f16 (2⁻²⁵, 6e-4), bf16 (0, 5e-3): f32 arithmetic plus one rounding to the
//!   storage type (half of f16's subnormal spacing);
//! - the f32 op against finite differences of `s · loss`: `|g − fd| ≤ 1e-6·s + 1e-4·|fd|`.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::{HostOperand, Operand, TwinArgs};
use tidemem::ops::{cross_entropy_forward, cross_entropy_forward_backward, CrossEntropy};
use tidemem::{DType, Error};

/// The f64 loss of one row's `V` logits and its gradient (unscaled).
fn row64(x: &[f64], t: usize) -> (f64, Vec<f64>) {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
    let loss = s.ln() - (x[t] - m);
    let g = x
        .iter()
        .enumerate()
        .map(|(j, v)| (v - m).exp() / s - if j == t { 1.0 } else { 0.0 })
        .collect();
    (loss, g)
}

/// (abs, rel): one rounding to the storage type (f16's subnormal spacing is 2⁻²⁴) on f32
/// arithmetic.
fn grad_tol(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (0.0, 1e-5),
        DType::F16 => (2f64.powi(-25), 6e-4),
        _ => (0.0, 5e-3),
    }
}

const IGNORE: i32 = -100;

/// Logits `[n, vp]` (the padding a marker value) and targets (every fourth row ignored).
fn inputs(
    r: &mut SplitMix64,
    n: usize,
    v: usize,
    vp: usize,
    spread: f64,
    d: DType,
) -> (Vec<f64>, Vec<i32>) {
    let mut x = vec![];
    for _ in 0..n {
        x.extend(r.vals(v, spread, 0.0, d));
        x.extend(round(&vec![1234.0; vp - v], d));
    }
    let t = (0..n)
        .map(|i| {
            if i % 4 == 2 {
                IGNORE
            } else {
                r.below(v as u64) as i32
            }
        })
        .collect();
    (x, t)
}

#[test]
fn losses_and_gradients_match_the_f64_reference() {
    let shapes = [
        (1usize, 1usize, 1usize),
        (3, 7, 9),
        (5, 300, 320),
        (4, 1000, 1000),
        (3, 50257, 50304),
    ];
    for dev in common::devices("cross-entropy reference") {
        let s = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(3);
        for d in DType::FLOATS {
            for (n, v, vp) in shapes {
                let (x, t) = inputs(&mut r, n, v, vp, 10.0, d);
                let counted = t.iter().filter(|&&t| t != IGNORE).count();
                let ce = CrossEntropy {
                    vocab: v,
                    padded_vocab: vp,
                    ignore_index: IGNORE,
                    grad_scale: 1.0 / counted.max(1) as f32,
                };
                let scale = ce.grad_scale as f64;
                let xb = upv(&dev, &s, &x, d);
                let tb = up(&dev, &s, bytemuck::cast_slice(&t));
                let (l1, l2) = (
                    up(&dev, &s, &[0x5a; 1].repeat(n * 4)),
                    up(&dev, &s, &[0x5a; 1].repeat(n * 4)),
                );
                // Forward only: the logits stay as they are.
                cross_entropy_forward(&dev, &s, &xb, &tb, &l1, &ce, d).unwrap();
                assert_eq!(downv(&dev, &s, &xb, d), x, "{d}: logits touched");
                cross_entropy_forward_backward(&dev, &s, &xb, &tb, &l2, &ce, d).unwrap();
                let (f1, f2) = (
                    dev.download(&s, &l1).unwrap(),
                    dev.download(&s, &l2).unwrap(),
                );
                assert_eq!(f1, f2, "{d}: the two ops' losses differ");
                let loss = dec(&f1, DType::F32);
                let g = downv(&dev, &s, &xb, d);
                let (abs, rel) = grad_tol(d);
                for row in 0..n {
                    let what = format!("{d} [{n}, {v} of {vp}] row {row}");
                    let gr = &g[row * vp..(row + 1) * vp];
                    assert!(gr[v..].iter().all(|&x| x.to_bits() == 0), "{what}: padding");
                    if t[row] == IGNORE {
                        assert_eq!(loss[row].to_bits(), 0, "{what}: ignored loss");
                        assert!(
                            gr.iter().all(|&x| x.to_bits() == 0),
                            "{what}: ignored gradient"
                        );
                        continue;
                    }
                    let (want, wg) = row64(&x[row * vp..row * vp + v], t[row] as usize);
                    assert!(
                        (loss[row] - want).abs() <= 2e-6 + 2e-6 * want.abs(),
                        "{what}: loss {} vs {want}",
                        loss[row]
                    );
                    for j in 0..v {
                        let w = wg[j] * scale;
                        assert!(
                            (gr[j] - w).abs() <= abs + 1e-7 * scale + rel * w.abs(),
                            "{what} col {j}: {} vs {w}",
                            gr[j]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gradient_matches_finite_differences_of_the_f64_loss() {
    let h = 1e-6;
    let mut r = SplitMix64::new(4);
    let loss = |x: &[f64], t: usize| row64(x, t).0;
    // The reference gradient itself.
    for v in [1usize, 2, 17, 300] {
        let x = r.uniform(v, 5.0);
        let t = v / 2;
        let (_, g) = row64(&x, t);
        for (j, &g) in g.iter().enumerate() {
            let fd = central_diff(&x, j, h, |x| loss(x, t));
            assert!(
                (g - fd).abs() <= 1e-8 + 1e-6 * fd.abs(),
                "{v} {j}: {g} vs {fd}"
            );
        }
    }
    // The f32 op.
    for dev in common::devices("cross-entropy finite differences") {
        let s = dev.new_stream().unwrap();
        let (n, v, vp) = (3usize, 70usize, 72usize);
        let (x, mut t) = inputs(&mut r, n, v, vp, 6.0, DType::F32);
        t[2] = 5;
        let ce = CrossEntropy {
            vocab: v,
            padded_vocab: vp,
            ignore_index: IGNORE,
            grad_scale: 0.25,
        };
        let xb = upv(&dev, &s, &x, DType::F32);
        let tb = up(&dev, &s, bytemuck::cast_slice(&t));
        let lb = dev.alloc(n * 4).unwrap();
        cross_entropy_forward_backward(&dev, &s, &xb, &tb, &lb, &ce, DType::F32).unwrap();
        let g = downv(&dev, &s, &xb, DType::F32);
        for row in 0..n {
            let xr = &x[row * vp..row * vp + v];
            let tr = t[row] as usize;
            for j in 0..v {
                let fd = 0.25 * central_diff(xr, j, h, |x| loss(x, tr));
                let got = g[row * vp + j];
                assert!(
                    (got - fd).abs() <= 1e-6 * 0.25 + 1e-4 * fd.abs(),
                    "row {row} col {j}: {got} vs {fd}"
                );
            }
        }
    }
}

#[test]
fn extreme_logits_stay_finite() {
    for dev in common::devices("cross-entropy extremes") {
        let s = dev.new_stream().unwrap();
        for d in DType::FLOATS {
            // One huge logit (f16's largest), the rest far below: probabilities 1 and 0.
            let big = if d == DType::F16 { 65504.0 } else { 1e30 };
            let x = vec![big, -big, 0.0, big];
            let ce = CrossEntropy {
                vocab: 4,
                padded_vocab: 4,
                ignore_index: IGNORE,
                grad_scale: 1.0,
            };
            let xb = upv(&dev, &s, &x, d);
            let tb = up(&dev, &s, bytemuck::cast_slice(&[1i32]));
            let lb = dev.alloc(4).unwrap();
            cross_entropy_forward_backward(&dev, &s, &xb, &tb, &lb, &ce, d).unwrap();
            let loss = downv(&dev, &s, &lb, DType::F32)[0];
            let g = downv(&dev, &s, &xb, d);
            let want = (2.0f64).ln() + 2.0 * round(&[big], d)[0];
            assert!(
                (loss - want).abs() <= 1e-6 * want,
                "{d}: loss {loss} vs {want}"
            );
            assert_eq!(g, [0.5, -1.0, 0.0, 0.5], "{d}");
        }
    }
}

#[test]
fn a_target_out_of_range_is_an_error_on_the_simulator_and_nan_on_cuda() {
    for dev in common::devices("cross-entropy bad target") {
        let s = dev.new_stream().unwrap();
        let (n, v, vp) = (3usize, 5usize, 6usize);
        let x: Vec<f64> = (0..n * vp).map(|i| (i % 7) as f64 * 0.5).collect();
        let xbytes = enc(&x, DType::F32);
        let xb = up(&dev, &s, &xbytes);
        let tb = up(&dev, &s, bytemuck::cast_slice(&[1i32, 5, IGNORE]));
        let lb = up(&dev, &s, &[0x33; 12]);
        let ce = CrossEntropy {
            vocab: v,
            padded_vocab: vp,
            ignore_index: IGNORE,
            grad_scale: 1.0,
        };
        cross_entropy_forward_backward(&dev, &s, &xb, &tb, &lb, &ce, DType::F32).unwrap();
        if ran_past_bad_index(&dev, &s, "target 5 of row 1") {
            let (g, l) = (
                dev.download(&s, &xb).unwrap(),
                dev.download(&s, &lb).unwrap(),
            );
            let (g, l) = (dec(&g, DType::F32), dec(&l, DType::F32));
            assert!(l[0].is_finite() && l[1].is_nan() && l[2] == 0.0, "{l:?}");
            assert!(
                g[vp..vp + v].iter().all(|x| x.is_nan()) && g[vp + v] == 0.0,
                "{g:?}"
            );
            assert!(g[..vp].iter().all(|x| x.is_finite()));
        }
        // The twin (what the simulated device runs) checks every target before it writes.
        let mut logits = xbytes.clone();
        let mut losses = vec![0x33u8; 12];
        let targets: Vec<u8> = bytemuck::cast_slice(&[1i32, 5, IGNORE]).to_vec();
        let p = tidemem::ops::abi::CrossEntropyParams {
            n: n as u64,
            v: v as u64,
            vp: vp as u64,
            ignore_index: IGNORE,
            grad_scale: 1.0,
        };
        let desc = &tidemem::ops::abi::CROSS_ENTROPY_FORWARD_BACKWARD;
        let ops = vec![
            HostOperand::Write(&mut logits, DType::F32),
            HostOperand::Read(&targets, DType::I32),
            HostOperand::Write(&mut losses, DType::F32),
        ];
        let mut args = TwinArgs::new(desc, ops, bytemuck::bytes_of(&p)).unwrap();
        assert!(matches!(
            (desc.twin)(&mut args),
            Err(Error::Operands { .. })
        ));
        assert_eq!(
            (logits, losses),
            (xbytes, vec![0x33; 12]),
            "written before the error"
        );
    }
}

#[test]
fn bad_input_is_a_typed_error_and_nothing_is_written() {
    for dev in common::devices("cross-entropy bad input") {
        let s = dev.new_stream().unwrap();
        let (n, v, vp) = (4usize, 10usize, 12usize);
        let xbytes = enc(
            &(0..n * vp).map(|i| i as f64).collect::<Vec<_>>(),
            DType::F32,
        );
        let xb = up(&dev, &s, &xbytes);
        let tb = up(&dev, &s, bytemuck::cast_slice(&[0i32; 4]));
        let lb = up(&dev, &s, &[0x44; 16]);
        let ce = CrossEntropy {
            vocab: v,
            padded_vocab: vp,
            ignore_index: IGNORE,
            grad_scale: 1.0,
        };
        let f32s = DType::F32;
        // Vocabulary shapes.
        for bad in [
            CrossEntropy { vocab: 0, ..ce },
            CrossEntropy {
                padded_vocab: v - 1,
                ..ce
            },
            CrossEntropy {
                vocab: usize::MAX,
                padded_vocab: usize::MAX,
                ..ce
            },
        ] {
            invalid(
                cross_entropy_forward_backward(&dev, &s, &xb, &tb, &lb, &bad, f32s),
                &["V"],
            );
            invalid(
                cross_entropy_forward(&dev, &s, &xb, &tb, &lb, &bad, f32s),
                &["V"],
            );
        }
        // Logits of another padding; losses one short; targets one short.
        let wide = CrossEntropy {
            padded_vocab: vp + 1,
            ..ce
        };
        invalid(
            cross_entropy_forward_backward(&dev, &s, &xb, &tb, &lb, &wide, f32s),
            &["`logits`", "[N, Vp]"],
        );
        let short = lb.view(0, 12).unwrap();
        invalid(
            cross_entropy_forward_backward(&dev, &s, &xb, &tb, short, &ce, f32s),
            &["`losses`"],
        );
        let t3 = tb.view(0, 12).unwrap();
        invalid(
            cross_entropy_forward(&dev, &s, &xb, t3, &lb, &ce, f32s),
            &["`logits`"],
        );
        // Losses inside the logits.
        let inside = xb.view(0, 16).unwrap();
        let r = cross_entropy_forward_backward(&dev, &s, &xb, &tb, inside, &ce, f32s);
        invalid(r, &["overlaps"]);
        // Targets of the wrong type (a direct launch: the wrappers fix it).
        let p = tidemem::ops::abi::CrossEntropyParams {
            n: n as u64,
            v: v as u64,
            vp: vp as u64,
            ignore_index: IGNORE,
            grad_scale: 1.0,
        };
        let ops = [
            Some(Operand::new(&xb, f32s)),
            Some(Operand::new(&tb, DType::U32)),
            Some(Operand::new(&lb, f32s)),
        ];
        let desc = &tidemem::ops::abi::CROSS_ENTROPY_FORWARD_BACKWARD;
        let r = dev.launch(&s, desc, &ops, bytemuck::bytes_of(&p));
        assert!(matches!(r, Err(Error::Launch { .. })), "{r:?}");
        // Host-side target checks.
        assert!(tidemem::ops::check_targets(&[0, 9, IGNORE], v, IGNORE).is_ok());
        assert!(tidemem::ops::check_targets(&[0, 10], v, IGNORE).is_err());
        dev.sync_stream(&s).unwrap();
        assert_eq!(dev.download(&s, &xb).unwrap(), xbytes);
        assert_eq!(dev.download(&s, &lb).unwrap(), vec![0x44; 16]);
    }
}
