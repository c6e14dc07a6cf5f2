//! `models::gpt` against an f64 reference written here (not the crate's code path): the loss and
//! every parameter gradient of a 2-block GPT (C = 64, 4 heads, T = 32, V = 256) in f32, f16 and
//! bf16, with and without activation checkpointing, and the losses of 10 AdamW steps, on the
//! simulated device and on CUDA when present (the emulator in CI, with `TIDEMEM_REQUIRE_CUDA=1`).

mod common;
mod nn_ref;

use tidemem::models::gpt::{Gpt, GptBatch, GptConfig, Plan};
use tidemem::optim::reference_step;
use tidemem::prelude::*;

use nn_ref::*;

const B: usize = 2;
const T: usize = 32;
const C: usize = 64;
const NH: usize = 4;
const V: usize = 256;
const L: usize = 2;
const N: usize = B * T;
const EPS: f32 = 1e-5;

// Tolerances, as `close` measures them (relative to the element plus the tensor's largest
// magnitude). f32: 1e-5 (measured ~1e-6). f16 (2⁻¹¹ per rounding) 5e-3; bf16 (2⁻⁸) 3e-2: every
// activation, the logits and their gradients are rounded at each stage.
const CASES: [(DType, f64); 3] = [(DType::F32, 1e-5), (DType::F16, 5e-3), (DType::BF16, 3e-2)];

fn config() -> GptConfig {
    GptConfig {
        layers: L,
        channels: C,
        heads: NH,
        vocab: V,
        max_seq: T,
        eps: EPS,
    }
}

/// Every parameter random (biases and LayerNorms too, so every path carries a signal).
fn init(name: &str, shape: &[usize]) -> Result<Init> {
    let seed = name
        .bytes()
        .fold(7u64, |h, b| h.wrapping_mul(31) ^ u64::from(b));
    let (lo, hi) = if name.contains("ln_") && name.ends_with("weight") {
        (0.5, 1.5)
    } else if name.ends_with("bias") {
        (-0.1, 0.1)
    } else {
        let fan_in = if shape.len() == 2 && !name.starts_with("w") {
            shape[1]
        } else {
            16
        };
        let b = 1.0 / (fan_in as f32).sqrt();
        (-b, b)
    };
    Ok(Init::Uniform { seed, lo, hi })
}

fn data(seed: u64) -> (Vec<i32>, Vec<i32>) {
    let mut s = seed;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) % V as u64) as i32
    };
    let stream: Vec<i32> = (0..N + 1).map(|_| next()).collect();
    let mut targets = stream[1..].to_vec();
    targets[5] = tidemem::models::gpt::IGNORE_INDEX;
    (stream[..N].to_vec(), targets)
}

/// The f64 model from parameters in registration order: `(loss, grads)`.
fn gpt_ref(p: &[Vec<f64>], tokens: &[i32], targets: &[i32]) -> (f64, Vec<Vec<f64>>) {
    let (loss, grads, _) = gpt_ref_all(p, tokens, targets);
    (loss, grads)
}

/// `(loss, grads, logits [N, V])`.
fn gpt_ref_all(p: &[Vec<f64>], tokens: &[i32], targets: &[i32]) -> (f64, Vec<Vec<f64>>, Vec<f64>) {
    let lf = 2 + 12 * L;
    let (wte, wpe, gf, bf) = (&p[0], &p[1], &p[lf], &p[lf + 1]);
    let zeros = vec![0.0; N * C];
    let mut inputs = vec![embed_ref(wte, wpe, tokens)];
    for l in 0..L {
        let (out, _, _) = block_ref(&p[2 + 12 * l..14 + 12 * l], &inputs[l], &zeros);
        inputs.push(out);
    }
    let (hf, nf, rf) = ln(&inputs[L], gf, bf);
    let head = lm_head_ref(&hf, wte, targets, V);
    let [mut dx, dgf, dbf] = ln_bwd(&head.dh, &nf, &rf, gf);
    let mut block_grads = vec![Vec::new(); L];
    for l in (0..L).rev() {
        let (_, dxl, g) = block_ref(&p[2 + 12 * l..14 + 12 * l], &inputs[l], &dx);
        dx = dxl;
        block_grads[l] = g;
    }
    let mut dwte = head.dwte;
    let dwpe = embed_bwd(&dx, tokens, &mut dwte, T);
    let mut grads = vec![dwte, dwpe];
    grads.extend(block_grads.into_iter().flatten());
    grads.extend([dgf, dbf]);
    (head.loss, grads, head.logits)
}

fn ids(gpt: &Gpt) -> Vec<TensorId> {
    gpt.named_params().iter().map(|p| p.1).collect()
}

#[test]
fn loss_and_every_gradient_match_an_f64_reference() {
    let (tokens, targets) = data(1);
    let batch = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: B,
        seq: T,
    };
    for dev in common::devices("gpt::reference") {
        for (d, tol) in CASES {
            for checkpoint in [false, true] {
                let mut m = manager(dev.clone(), d);
                let gpt = Gpt::register_with(&mut m, &config(), init).unwrap();
                let ids = ids(&gpt);
                assert_eq!(ids.len(), 4 + 12 * L);
                let p = read_all(&mut m, &ids);
                let (want_loss, want) = gpt_ref(&p, &tokens, &targets);
                let plan = Plan {
                    checkpoint,
                    ..Plan::default()
                };
                let loss = gpt.forward_backward(&mut m, &plan, &batch, 1.0).unwrap();
                let name = format!("{} {d} checkpoint={checkpoint}", dev.name());
                let mut worst = close(&format!("{name}: loss"), &[loss], &[want_loss], tol);
                for ((n, id), w) in gpt.named_params().iter().zip(&want) {
                    let g = m.read(*id).unwrap();
                    worst = worst.max(close(&format!("{name}: grad {n}"), &g, w, tol));
                }
                eprintln!("{name}: loss {loss}, worst error {worst:.2e} (bound {tol:.0e})");
            }
        }
    }
}

#[test]
fn logits_match_the_reference() {
    let (tokens, targets) = data(4);
    for dev in common::devices("gpt::logits") {
        for (d, tol) in CASES {
            let mut m = manager(dev.clone(), d);
            let gpt = Gpt::register_with(&mut m, &config(), init).unwrap();
            let p = read_all(&mut m, &ids(&gpt));
            let (_, _, want) = gpt_ref_all(&p, &tokens, &targets);
            let got = gpt.logits(&mut m, &tokens, B, T).unwrap();
            let name = format!("{} {d}: logits", dev.name());
            let worst = close(&name, &got, &want, tol);
            eprintln!("{name}: worst error {worst:.2e} (bound {tol:.0e})");
            // the store is between iterations again: training goes on
            assert_eq!(m.stage(), None);
        }
    }
}

/// Ten AdamW steps (lr 1e-3, β 0.9/0.999, decay 0.01) through the manager against the same
/// steps in f64: the losses agree within 1e-6 relative (measured 4e-8: the crate keeps
/// fp32 masters and computes in f32).
#[test]
fn ten_adamw_steps_match_the_reference_losses() {
    let cfg = AdamConfig::adamw(1e-3, 0.01);
    for dev in common::devices("gpt::adamw") {
        let mut m = manager(dev.clone(), DType::F32);
        let gpt = Gpt::register_with(&mut m, &config(), init).unwrap();
        let ids = ids(&gpt);
        let mut p = read_all(&mut m, &ids);
        let mut mom: Vec<Vec<f64>> = p.iter().map(|t| vec![0.0; t.len()]).collect();
        let mut var = mom.clone();
        let mut adam = HybridAdam::new(HybridConfig::new(cfg)).unwrap();
        let mut worst = 0.0f64;
        for step in 1..=10u64 {
            let (tokens, targets) = data(step);
            let batch = GptBatch {
                tokens: &tokens,
                targets: &targets,
                batch: B,
                seq: T,
            };
            let plan = Plan {
                checkpoint: step % 2 == 0,
                ..Plan::default()
            };
            let loss = gpt.forward_backward(&mut m, &plan, &batch, 1.0).unwrap();
            m.step(&mut adam).unwrap();
            let (want, grads) = gpt_ref(&p, &tokens, &targets);
            for k in 0..p.len() {
                reference_step(
                    &cfg,
                    step,
                    1.0,
                    &mut p[k],
                    &mut mom[k],
                    &mut var[k],
                    &grads[k],
                )
                .unwrap();
            }
            let err = (loss as f64 - want).abs() / want.abs();
            assert!(
                err < 1e-6,
                "{}: step {step}: loss {loss} vs {want}",
                dev.name()
            );
            worst = worst.max(err);
        }
        eprintln!(
            "{}: 10 AdamW steps, worst loss error {worst:.2e}",
            dev.name()
        );
    }
}

#[test]
fn bad_batches_are_refused_before_anything_runs() {
    let mut m = manager(common::sim(64 << 20), DType::F32);
    let gpt = Gpt::register_with(&mut m, &config(), init).unwrap();
    let (tokens, targets) = data(3);
    let mut bad = tokens.clone();
    bad[3] = V as i32;
    let cases: [(&[i32], &[i32], usize, usize); 4] = [
        (&bad, &targets, B, T),
        (&tokens[..N - 1], &targets, B, T),
        (&tokens, &targets, 1, N),
        (&tokens, &[V as i32; N], B, T),
    ];
    // What a refusal must leave as it was: the registrations, every parameter's bits, the stage.
    let ids: Vec<TensorId> = gpt.named_params().iter().map(|p| p.1).collect();
    let state = |m: &mut ChunkManager| {
        let params: Vec<Vec<u32>> = ids
            .iter()
            .map(|&id| m.read(id).unwrap().iter().map(|x| x.to_bits()).collect())
            .collect();
        (m.num_tensors(), params, m.stage())
    };
    let before = state(&mut m);
    for (tok, tgt, b, t) in cases {
        let batch = GptBatch {
            tokens: tok,
            targets: tgt,
            batch: b,
            seq: t,
        };
        let r = gpt.forward_backward(&mut m, &Plan::default(), &batch, 1.0);
        let typed = matches!(
            r,
            Err(Error::TokenOutOfRange { .. }
                | Error::BatchShape { .. }
                | Error::SeqTooLong { .. })
        );
        assert!(typed, "{r:?}");
        assert_eq!(m.stage(), None, "nothing ran");
        assert!(state(&mut m) == before, "a refused batch changes nothing");
    }
    let nan = f32::NAN;
    let batch = GptBatch {
        tokens: &tokens,
        targets: &targets,
        batch: B,
        seq: T,
    };
    assert!(matches!(
        gpt.forward_backward(&mut m, &Plan::default(), &batch, nan),
        Err(Error::BadValue { .. })
    ));
    assert_eq!(m.stage(), None, "nothing ran");
    assert!(
        state(&mut m) == before,
        "a refused loss scale changes nothing"
    );
}
