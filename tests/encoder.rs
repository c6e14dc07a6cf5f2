//! The GPT encoder on every backend present (the simulated device, and CUDA when there is one):
//! forward and backward against an f64 reference, the backward against central finite
//! differences of the f64 forward, f32/f16/bf16 storage, deterministic backward (the same bits
//! on every run, though the emulator runs blocks in another order each launch), token ids out
//! of range, and bad input refused with a typed error and nothing written.
//!
//! Tolerances, on the f64 reference computed from the values as stored:
//! - forward: one f32 addition then one rounding to the storage type, `|out − ref| ≤ rel·|ref|`
//!   with rel = 2⁻²³ (f32), 2⁻¹⁰ (f16, + 2⁻²⁴ absolute), 2⁻⁷ (bf16);
//! - backward: `|g − ref| ≤ rel·(|g₀| + Σ|dout|)` (`g₀` the gradient before) with rel = 1e-6
//!   (f32), 1e-3 (f16, + 2⁻²⁴ absolute), 8e-3 (bf16);
//! - the f32 backward against finite differences of `Σ dout·out`: `|g − fd| ≤ 1e-6·(1 + Σ|dout|)`.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::{HostOperand, Operand, TwinArgs};
use tidemem::ops::{abi::EncoderBackwardParams, abi::ENCODER_BACKWARD, abi::ENCODER_FORWARD};
use tidemem::ops::{encoder_backward, encoder_forward, EncoderPlan, EncoderShape};
use tidemem::{DType, Error};

/// (rel, abs) of one rounding to the storage type.
fn tol(d: DType, f32_rel: f64, f16_rel: f64, bf16_rel: f64) -> (f64, f64) {
    match d {
        DType::F32 => (f32_rel, 0.0),
        DType::F16 => (f16_rel, 2f64.powi(-24)),
        _ => (bf16_rel, 0.0),
    }
}

/// (B, T, C, V, maxT).
const SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (1, 1, 1, 1, 1),
    (2, 5, 7, 11, 8),
    (3, 17, 33, 50, 20),
    (4, 64, 130, 97, 64),
    (1, 200, 3, 1000, 256),
];

/// Tokens drawn from a few ids, so most repeat.
fn tokens(r: &mut SplitMix64, n: usize, v: usize) -> Vec<i32> {
    let ids: Vec<i32> = (0..7).map(|_| r.below(v as u64) as i32).collect();
    (0..n).map(|_| ids[r.below(7) as usize]).collect()
}

#[test]
fn forward_and_backward_match_the_f64_reference() {
    for dev in common::devices("encoder reference") {
        let s = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(5);
        for d in DType::FLOATS {
            for (b, t, c, v, max_t) in SHAPES {
                let shape = EncoderShape {
                    batch: b,
                    seq: t,
                    channels: c,
                    vocab: v,
                    max_seq: max_t,
                };
                let n = b * t;
                let tok = tokens(&mut r, n, v);
                let (wte, wpe, dout) = (
                    r.vals(v * c, 2.0, 0.0, d),
                    r.vals(max_t * c, 2.0, 0.0, d),
                    r.vals(n * c, 2.0, 0.0, d),
                );
                let (g0, p0) = (r.vals(v * c, 2.0, 0.0, d), r.vals(max_t * c, 2.0, 0.0, d));
                let tb = up(&dev, &s, bytemuck::cast_slice(&tok));
                let (wteb, wpeb) = (upv(&dev, &s, &wte, d), upv(&dev, &s, &wpe, d));
                let out = up(&dev, &s, &vec![0x5a; n * c * d.size()]);
                encoder_forward(&dev, &s, &tb, &wteb, &wpeb, &out, &shape, d).unwrap();
                let got = downv(&dev, &s, &out, d);
                let (rel, abs) = tol(d, 2f64.powi(-23), 2f64.powi(-10), 2f64.powi(-7));
                for pos in 0..n {
                    for k in 0..c {
                        let want = wte[tok[pos] as usize * c + k] + wpe[(pos % t) * c + k];
                        let g = got[pos * c + k];
                        assert!(
                            (g - want).abs() <= abs + rel * want.abs(),
                            "{d} {shape:?} {pos} {k}: {g} vs {want}"
                        );
                    }
                }
                // Backward, accumulated into g0 and p0.
                let plan = EncoderPlan::new(&tok, v).unwrap();
                let pw = up(&dev, &s, bytemuck::cast_slice(&plan.to_words()));
                let db = upv(&dev, &s, &dout, d);
                let (dwte, dwpe) = (upv(&dev, &s, &g0, d), upv(&dev, &s, &p0, d));
                encoder_backward(&dev, &s, &db, &plan, &pw, &dwte, &dwpe, &shape, d).unwrap();
                let (gw, gp) = (downv(&dev, &s, &dwte, d), downv(&dev, &s, &dwpe, d));
                let (mut want_w, mut mag_w) =
                    (g0.clone(), g0.iter().map(|x| x.abs()).collect::<Vec<_>>());
                let (mut want_p, mut mag_p) =
                    (p0.clone(), p0.iter().map(|x| x.abs()).collect::<Vec<_>>());
                for pos in 0..n {
                    for k in 0..c {
                        let x = dout[pos * c + k];
                        want_w[tok[pos] as usize * c + k] += x;
                        mag_w[tok[pos] as usize * c + k] += x.abs();
                        want_p[(pos % t) * c + k] += x;
                        mag_p[(pos % t) * c + k] += x.abs();
                    }
                }
                let (rel, abs) = tol(d, 1e-6, 1e-3, 8e-3);
                for (what, got, want, mag) in [
                    ("dwte", &gw, &want_w, &mag_w),
                    ("dwpe", &gp, &want_p, &mag_p),
                ] {
                    for i in 0..got.len() {
                        assert!(
                            (got[i] - want[i]).abs() <= abs + rel * mag[i],
                            "{d} {shape:?} {what}[{i}]: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                }
                // Rows of wpe past T are untouched.
                assert_eq!(gp[t * c..], p0[t * c..]);
            }
        }
    }
}

#[test]
fn backward_matches_finite_differences_and_is_deterministic() {
    let (b, t, c, v, max_t) = (3usize, 4usize, 5usize, 6usize, 5usize);
    let shape = EncoderShape {
        batch: b,
        seq: t,
        channels: c,
        vocab: v,
        max_seq: max_t,
    };
    let n = b * t;
    let mut r = SplitMix64::new(6);
    let tok = tokens(&mut r, n, v);
    let (wte, wpe, dout) = (
        r.vals(v * c, 2.0, 0.0, DType::F32),
        r.vals(max_t * c, 2.0, 0.0, DType::F32),
        r.vals(n * c, 2.0, 0.0, DType::F32),
    );
    // L = Σ dout · out, out from the f64 forward.
    let loss = |wte: &[f64], wpe: &[f64]| -> f64 {
        (0..n * c)
            .map(|i| {
                let (pos, k) = (i / c, i % c);
                dout[i] * (wte[tok[pos] as usize * c + k] + wpe[(pos % t) * c + k])
            })
            .sum()
    };
    let h = 1e-3;
    let fd = |which: usize, i: usize| {
        let (mut a, mut bb) = ([wte.clone(), wpe.clone()], [wte.clone(), wpe.clone()]);
        a[which][i] += h;
        bb[which][i] -= h;
        (loss(&a[0], &a[1]) - loss(&bb[0], &bb[1])) / (2.0 * h)
    };
    let bound = 1e-6 * (1.0 + dout.iter().map(|x| x.abs()).sum::<f64>());
    for dev in common::devices("encoder finite differences") {
        let s = dev.new_stream().unwrap();
        let plan = EncoderPlan::new(&tok, v).unwrap();
        let pw = up(&dev, &s, bytemuck::cast_slice(&plan.to_words()));
        let db = upv(&dev, &s, &dout, DType::F32);
        let mut runs = vec![];
        for _ in 0..3 {
            let (dwte, dwpe) = (
                up(&dev, &s, &[0u8; 1].repeat(v * c * 4)),
                up(&dev, &s, &[0u8; 1].repeat(max_t * c * 4)),
            );
            encoder_backward(&dev, &s, &db, &plan, &pw, &dwte, &dwpe, &shape, DType::F32).unwrap();
            runs.push((
                dev.download(&s, &dwte).unwrap(),
                dev.download(&s, &dwpe).unwrap(),
            ));
        }
        assert!(
            runs.iter().all(|x| *x == runs[0]),
            "the backward changed between runs"
        );
        let (gw, gp) = (dec(&runs[0].0, DType::F32), dec(&runs[0].1, DType::F32));
        for (which, g) in [(0, &gw), (1, &gp)] {
            for (i, &g) in g.iter().enumerate() {
                let f = fd(which, i);
                assert!((g - f).abs() <= bound, "{which} {i}: {g} vs {f}");
            }
        }
    }
}

#[test]
fn a_token_out_of_range_is_an_error_on_the_simulator_and_nan_on_cuda() {
    assert!(matches!(
        EncoderPlan::new(&[0, 3], 3),
        Err(Error::TokenOutOfRange {
            token: 3,
            position: 1,
            vocab: 3
        })
    ));
    assert!(matches!(
        EncoderPlan::new(&[-1], 3),
        Err(Error::TokenOutOfRange {
            token: -1,
            position: 0,
            vocab: 3
        })
    ));
    let shape = EncoderShape {
        batch: 1,
        seq: 3,
        channels: 2,
        vocab: 3,
        max_seq: 3,
    };
    let tok = [0i32, 7, 2];
    for dev in common::devices("encoder bad token") {
        let s = dev.new_stream().unwrap();
        let tb = up(&dev, &s, bytemuck::cast_slice(&tok));
        let w = upv(&dev, &s, &[1.0; 6], DType::F32);
        let out = up(&dev, &s, &[0x5a; 24]);
        encoder_forward(&dev, &s, &tb, &w, &w, &out, &shape, DType::F32).unwrap();
        if ran_past_bad_index(&dev, &s, "token 7 at position 1") {
            let o = downv(&dev, &s, &out, DType::F32);
            assert!(o[2].is_nan() && o[3].is_nan(), "{o:?}");
            assert_eq!([o[0], o[1], o[4], o[5]], [2.0; 4]);
        }
    }
    // The twin checks every token before it writes.
    let tok_b: Vec<u8> = bytemuck::cast_slice(&tok).to_vec();
    let w = enc(&[1.0; 6], DType::F32);
    let mut out = vec![0x5au8; 24];
    let p = tidemem::ops::abi::EncoderParams {
        n: 3,
        t: 3,
        c: 2,
        v: 3,
        max_t: 3,
    };
    let ops = vec![
        HostOperand::Read(&tok_b, DType::I32),
        HostOperand::Read(&w, DType::F32),
        HostOperand::Read(&w, DType::F32),
        HostOperand::Write(&mut out, DType::F32),
    ];
    let mut args = TwinArgs::new(&ENCODER_FORWARD, ops, bytemuck::bytes_of(&p)).unwrap();
    assert!((ENCODER_FORWARD.twin)(&mut args).is_err());
    assert_eq!(out, vec![0x5a; 24]);
}

#[test]
fn a_malformed_plan_is_refused_by_the_twin_before_it_writes() {
    // Tokens [1, 1, 0]: rows [1, 0], starts [0, 2, 3], entries [0, 1, 2].
    let good = EncoderPlan::new(&[1, 1, 0], 2).unwrap().to_words();
    assert_eq!(good, [1, 0, 0, 2, 3, 0, 1, 2]);
    let dout = enc(&[1.0; 3], DType::F32);
    let p = EncoderBackwardParams {
        n: 3,
        t: 3,
        c: 1,
        v: 2,
        max_t: 3,
        distinct: 2,
    };
    let mut bad_plans = vec![];
    for (i, w) in [(0usize, 0u32), (1, 2), (3, 4), (4, 4), (7, 3)] {
        // A repeated row, a row out of range, decreasing starts, starts past the entries, a
        // position out of range.
        let mut b = good.clone();
        b[i] = w;
        bad_plans.push(b);
    }
    for plan in bad_plans {
        let words: Vec<u8> = bytemuck::cast_slice(&plan).to_vec();
        let (mut dwte, mut dwpe) = (vec![7u8; 8], vec![9u8; 12]);
        let ops = vec![
            HostOperand::Read(&dout, DType::F32),
            HostOperand::Read(&words, DType::U32),
            HostOperand::Write(&mut dwte, DType::F32),
            HostOperand::Write(&mut dwpe, DType::F32),
        ];
        let mut args = TwinArgs::new(&ENCODER_BACKWARD, ops, bytemuck::bytes_of(&p)).unwrap();
        let r = (ENCODER_BACKWARD.twin)(&mut args);
        assert!(matches!(r, Err(Error::Operands { .. })), "{plan:?}: {r:?}");
        assert_eq!((dwte, dwpe), (vec![7u8; 8], vec![9u8; 12]), "{plan:?}");
    }
}

#[test]
fn bad_input_is_a_typed_error_and_nothing_is_written() {
    let shape = EncoderShape {
        batch: 2,
        seq: 3,
        channels: 4,
        vocab: 5,
        max_seq: 3,
    };
    let tok = [0i32, 1, 2, 3, 4, 0];
    let plan = EncoderPlan::new(&tok, 5).unwrap();
    let f32s = DType::F32;
    for dev in common::devices("encoder bad input") {
        let s = dev.new_stream().unwrap();
        let tb = up(&dev, &s, bytemuck::cast_slice(&tok));
        let wte = up(&dev, &s, &[0u8; 80]);
        let wpe = up(&dev, &s, &[0u8; 48]);
        let out = up(&dev, &s, &[0x11; 96]);
        let pw = up(&dev, &s, bytemuck::cast_slice(&plan.to_words()));
        let dout = up(&dev, &s, &[0u8; 96]);
        let dwte = up(&dev, &s, &[0x22; 80]);
        let dwpe = up(&dev, &s, &[0x33; 48]);
        // Operands of the wrong size, each named with its expected shape.
        let wte_small = wte.view(0, 76).unwrap();
        invalid(
            encoder_forward(&dev, &s, &tb, wte_small, &wpe, &out, &shape, f32s),
            &["`wte`", "[V, C] = 20"],
        );
        let long = EncoderShape {
            max_seq: 4,
            ..shape
        };
        invalid(
            encoder_forward(&dev, &s, &tb, &wte, &wpe, &out, &long, f32s),
            &["`wpe`", "[maxT, C] = 16"],
        );
        let out_small = out.view(0, 64).unwrap();
        invalid(
            encoder_forward(&dev, &s, &tb, &wte, &wpe, out_small, &shape, f32s),
            &["`out`", "[B·T, C] = 24"],
        );
        let tb_small = tb.view(0, 20).unwrap();
        invalid(
            encoder_forward(&dev, &s, tb_small, &wte, &wpe, &out, &shape, f32s),
            &["`tokens`"],
        );
        invalid(
            encoder_backward(
                &dev,
                &s,
                &dout,
                &plan,
                &pw,
                &dwte,
                dwpe.view(0, 32).unwrap(),
                &shape,
                f32s,
            ),
            &["`dwpe`"],
        );
        invalid(
            encoder_backward(
                &dev,
                &s,
                &dout,
                &plan,
                pw.view(0, 4).unwrap(),
                &dwte,
                &dwpe,
                &shape,
                f32s,
            ),
            &["`plan`"],
        );
        // T past maxT, T = 0, C = 0, a plan of another batch, overflowing shapes.
        for bad in [
            EncoderShape {
                seq: 4,
                batch: 1,
                max_seq: 3,
                ..shape
            },
            EncoderShape {
                seq: 0,
                batch: 0,
                ..shape
            },
            EncoderShape {
                channels: 0,
                ..shape
            },
        ] {
            invalid(
                encoder_forward(&dev, &s, &tb, &wte, &wpe, &out, &bad, f32s),
                &["T ≥ 1"],
            );
        }
        let other = EncoderShape {
            batch: 1,
            seq: 6,
            max_seq: 6,
            ..shape
        };
        invalid(
            encoder_backward(
                &dev,
                &s,
                &dout,
                &EncoderPlan::new(&tok[..3], 5).unwrap(),
                &pw,
                &dwte,
                &dwpe,
                &other,
                f32s,
            ),
            &["plan covers 3"],
        );
        let huge = EncoderShape {
            batch: usize::MAX,
            ..shape
        };
        invalid(
            encoder_forward(&dev, &s, &tb, &wte, &wpe, &out, &huge, f32s),
            &["overflows"],
        );
        // dwte and dwpe overlapping; out overlapping wte.
        let both = up(&dev, &s, &[0u8; 128]);
        let (a, b) = (both.view(0, 80).unwrap(), both.view(64, 48).unwrap());
        invalid(
            encoder_backward(&dev, &s, &dout, &plan, &pw, a, b, &shape, f32s),
            &["overlaps"],
        );
        let big = up(&dev, &s, &[0u8; 200]);
        let w = big.view(0, 80).unwrap();
        invalid(
            encoder_forward(
                &dev,
                &s,
                &tb,
                w,
                &wpe,
                big.view(40, 96).unwrap(),
                &shape,
                f32s,
            ),
            &["overlaps"],
        );
        // Mixed float types (a direct launch).
        let p = tidemem::ops::abi::EncoderParams {
            n: 6,
            t: 3,
            c: 4,
            v: 5,
            max_t: 3,
        };
        let half = up(&dev, &s, &[0u8; 48]);
        let ops = [
            Some(Operand::new(&tb, DType::I32)),
            Some(Operand::new(&wte, f32s)),
            Some(Operand::new(&wpe, f32s)),
            Some(Operand::new(&half, DType::F16)),
        ];
        invalid(
            dev.launch(&s, &ENCODER_FORWARD, &ops, bytemuck::bytes_of(&p)),
            &["`out`", "one float type"],
        );
        dev.sync_stream(&s).unwrap();
        assert_eq!(dev.download(&s, &out).unwrap(), vec![0x11; 96]);
        assert_eq!(dev.download(&s, &dwte).unwrap(), vec![0x22; 80]);
        assert_eq!(dev.download(&s, &dwpe).unwrap(), vec![0x33; 48]);
    }
}
