//! The vocab-parallel embedding and cross-entropy on every backend present (the simulated
//! device, and CUDA when there is one), with P = 1, 2 and 3 "ranks" simulated in one process:
//! one full table / logit matrix cut into P vocabulary shards (uneven when P does not divide V),
//! each shard's op run on its own buffers, and the all-reduces done on the host in f32 in rank
//! order (MAX for the row maxima, SUM for the rest).
//!
//! What must hold, on values as stored:
//! - embedding forward: each shard's rows are the table's row (its bytes) where it owns the
//!   token and +0 elsewhere, so the sum over the shards is the full lookup exactly (bitwise
//!   except that a −0 element sums to +0, as with any all-reduce SUM);
//! - embedding backward: each shard's gradient is bitwise the full-vocabulary backward's rows
//!   (each row sums the same positions in the same order), written or accumulated; the full one
//!   against f64, `|g − ref| ≤ abs + rel·(|g₀| + Σ|dout|)` with rel = 1e-6 (f32), 1e-3 (f16,
//!   abs 2⁻²⁴), 8e-3 (bf16), and against central finite differences of `Σ dout·out` within
//!   `1e-6·(1 + Σ|dout|)` (f32);
//! - cross-entropy: with P = 1 the three steps are bitwise the fused op
//!   (`cross_entropy_forward_backward`); for every P the losses (the same bits on every rank)
//!   within `2e-6 + 2e-6·|ref|` of the f64 reference and the gradient shards within `abs +
//!   1e-7·s + rel·|ref|` (s the gradient scale) with (abs, rel) = f32 (0, 1e-5), f16 (2⁻²⁵,
//!   6e-4), bf16 (0, 5e-3); the f32 gradient within `1e-6·s + 1e-4·|fd|` of central finite
//!   differences of the f64 loss. Ignored rows: loss 0 and gradient 0; padding 0;
//! - bad input (`vocab_parallel/bad_input.rs`): a typed error and no byte written.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::device::{Device, DeviceBuffer, Stream};
use tidemem::ops::abi::{
    VocabCeParams, VocabEmbeddingBackwardParams, VocabEmbeddingParams, VOCAB_CE_GRAD,
    VOCAB_CE_SUMS, VOCAB_EMBEDDING_BACKWARD, VOCAB_EMBEDDING_FORWARD,
};
use tidemem::ops::{cross_entropy_forward_backward, CrossEntropy};
use tidemem::ops::{
    vocab_parallel::vocab_ce_grad, vocab_parallel::vocab_ce_max, vocab_parallel::vocab_ce_sums,
    vocab_parallel::vocab_embedding_backward, vocab_parallel::vocab_embedding_forward,
    vocab_parallel::VocabCeGrad, vocab_parallel::VocabCeSums, vocab_parallel::VocabCrossEntropy,
    vocab_parallel::VocabPlan, vocab_parallel::VocabShard,
};
use tidemem::DType;

const IGNORE: i32 = -100;

fn pod<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn garbage(dev: &Device, s: &Stream, bytes: usize, seed: u64) -> DeviceBuffer {
    up(dev, s, &common::pattern(bytes, seed))
}

fn f32s(dev: &Device, s: &Stream, b: &DeviceBuffer) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(&down(dev, s, b))
}

/// Tokens drawn from a few ids (so most repeat) and from the whole vocabulary.
fn tokens(r: &mut SplitMix64, n: usize, v: usize) -> Vec<i32> {
    let ids: Vec<i32> = (0..5).map(|_| r.below(v as u64) as i32).collect();
    (0..n)
        .map(|i| {
            if i % 3 == 0 {
                r.below(v as u64) as i32
            } else {
                ids[r.below(5) as usize]
            }
        })
        .collect()
}

/// (rel, abs) of the embedding backward (see the file's head).
fn emb_tol(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (1e-6, 0.0),
        DType::F16 => (1e-3, 2f64.powi(-24)),
        _ => (8e-3, 0.0),
    }
}

/// The backward into `init` (bytes of `[rows, C]`), written or accumulated.
#[allow(clippy::too_many_arguments)]
fn backward(
    dev: &Device,
    s: &Stream,
    tok: &[i32],
    shard: &VocabShard,
    dout: &DeviceBuffer,
    init: &[u8],
    c: usize,
    acc: bool,
    d: DType,
) -> Vec<u8> {
    let plan = VocabPlan::new(tok, shard).unwrap();
    let pw = up(dev, s, pod(&plan.to_words()));
    let g = up(dev, s, init);
    vocab_embedding_backward(dev, s, dout, &plan, &pw, &g, c, acc, d).unwrap();
    down(dev, s, &g)
}

/// The full-vocabulary backward (written, accumulated into `g0`) against f64.
fn check_full_backward(
    (tok, dout, g0): (&[i32], &[f64], &[f64]),
    (gw, ga): (&[f64], &[f64]),
    c: usize,
    d: DType,
    what: &str,
) {
    let mut want = vec![0.0; g0.len()];
    let mut mag = vec![0.0; g0.len()];
    for (pos, &t) in tok.iter().enumerate() {
        for k in 0..c {
            want[t as usize * c + k] += dout[pos * c + k];
            mag[t as usize * c + k] += dout[pos * c + k].abs();
        }
    }
    let (rel, abs) = emb_tol(d);
    for i in 0..g0.len() {
        assert!(
            (gw[i] - want[i]).abs() <= abs + rel * mag[i],
            "{what} {i}: written"
        );
        let (wa, ma) = (want[i] + g0[i], mag[i] + g0[i].abs());
        assert!(
            (ga[i] - wa).abs() <= abs + rel * ma,
            "{what} {i}: accumulated"
        );
    }
}

#[test]
fn embedding_shards_add_up_to_the_full_table() {
    // (N, C, V).
    let shapes = [
        (1usize, 1usize, 3usize),
        (9, 7, 50),
        (40, 33, 97),
        (130, 300, 11),
    ];
    for dev in common::devices("vocab embedding") {
        let s = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(21);
        for d in DType::FLOATS {
            let es = d.size();
            for (n, c, v) in shapes {
                let tok = tokens(&mut r, n, v);
                let wte = r.vals(v * c, 2.0, 0.0, d);
                let (dout, g0) = (r.vals(n * c, 2.0, 0.0, d), r.vals(v * c, 2.0, 0.0, d));
                let (wte_b, g0_b) = (enc(&wte, d), enc(&g0, d));
                let tb = up(&dev, &s, pod(&tok));
                let db = upv(&dev, &s, &dout, d);
                let what = format!("{d} N {n} C {c} V {v}");
                let full = VocabShard::new(v, 0, v).unwrap();
                let gb = common::pattern(v * c * es, 3);
                let full_w = backward(&dev, &s, &tok, &full, &db, &gb, c, false, d);
                let full_a = backward(&dev, &s, &tok, &full, &db, &g0_b, c, true, d);
                let got = (&dec(&full_w, d)[..], &dec(&full_a, d)[..]);
                check_full_backward((&tok, &dout, &g0), got, c, d, &what);
                for p in 1..=3.min(v) {
                    let mut sum = vec![0.0f64; n * c];
                    for rank in 0..p {
                        let sh = VocabShard::of_rank(v, rank, p).unwrap();
                        let what = format!("{what} rank {rank} of {p}");
                        let rows = sh.start * c * es..sh.end() * c * es;
                        let table = up(&dev, &s, &wte_b[rows.clone()]);
                        let out = garbage(&dev, &s, n * c * es, 5);
                        vocab_embedding_forward(&dev, &s, &tb, &table, &out, &sh, c, d).unwrap();
                        let got = down(&dev, &s, &out);
                        for (pos, &t) in tok.iter().enumerate() {
                            let row = &got[pos * c * es..][..c * es];
                            if sh.owns(t) {
                                let want = &wte_b[t as usize * c * es..][..c * es];
                                assert_eq!(row, want, "{what}");
                            } else {
                                assert!(row.iter().all(|&b| b == 0), "{what}: not zeros");
                            }
                        }
                        for (a, b) in sum.iter_mut().zip(dec(&got, d)) {
                            *a += b;
                        }
                        // Backward shards: the full backward's rows, bitwise.
                        let gb = common::pattern(sh.rows * c * es, 4);
                        let w = backward(&dev, &s, &tok, &sh, &db, &gb, c, false, d);
                        assert_eq!(w, full_w[rows.clone()], "{what}: written");
                        let init = &g0_b[rows.clone()];
                        let a = backward(&dev, &s, &tok, &sh, &db, init, c, true, d);
                        assert_eq!(a, full_a[rows], "{what}: accumulated");
                    }
                    for (pos, &t) in tok.iter().enumerate() {
                        let want = &wte[t as usize * c..][..c];
                        assert_eq!(&sum[pos * c..][..c], want, "{d} P {p} pos {pos}");
                    }
                }
            }
        }
    }
}

#[test]
fn embedding_backward_matches_finite_differences_and_is_deterministic() {
    let (n, c, v, p) = (12usize, 5usize, 10usize, 3usize);
    let mut r = SplitMix64::new(22);
    let tok = tokens(&mut r, n, v);
    let (wte, dout) = (
        r.vals(v * c, 2.0, 0.0, DType::F32),
        r.vals(n * c, 2.0, 0.0, DType::F32),
    );
    // L = Σ dout · out, out the f64 lookup of the full table.
    let loss = |w: &[f64]| -> f64 {
        (0..n * c)
            .map(|i| dout[i] * w[tok[i / c] as usize * c + i % c])
            .sum()
    };
    let bound = 1e-6 * (1.0 + dout.iter().map(|x| x.abs()).sum::<f64>());
    for dev in common::devices("vocab embedding finite differences") {
        let s = dev.new_stream().unwrap();
        let db = upv(&dev, &s, &dout, DType::F32);
        for rank in 0..p {
            let sh = VocabShard::of_rank(v, rank, p).unwrap();
            let zeros = vec![0u8; sh.rows * c * 4];
            let runs: Vec<Vec<u8>> = (0..3)
                .map(|_| backward(&dev, &s, &tok, &sh, &db, &zeros, c, false, DType::F32))
                .collect();
            assert!(runs.iter().all(|x| *x == runs[0]), "changed between runs");
            let g = dec(&runs[0], DType::F32);
            for (i, &g) in g.iter().enumerate() {
                let fd = central_diff(&wte, sh.start * c + i, 1e-3, loss);
                assert!((g - fd).abs() <= bound, "rank {rank} {i}: {g} vs {fd}");
            }
        }
    }
}

/// The f64 loss of one row's logits and its unscaled gradient.
fn row64(x: &[f64], t: usize) -> (f64, Vec<f64>) {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
    let g = x
        .iter()
        .enumerate()
        .map(|(j, v)| (v - m).exp() / s - if j == t { 1.0 } else { 0.0 })
        .collect();
    (s.ln() - (x[t] - m), g)
}

/// What the three steps give on each of `p` ranks.
struct Ranks {
    shards: Vec<VocabShard>,
    /// Per rank: the `[N, V_r + pad]` gradient as stored, decoded.
    grads: Vec<Vec<f64>>,
    /// Per rank: the losses' bytes.
    losses: Vec<Vec<u8>>,
}

/// Each rank's shard, cross-entropy settings and local logits `[N, V_r + pad]` (the padding a
/// marker value the steps must not read).
fn shard_logits(
    dev: &Device,
    s: &Stream,
    x: &[f64],
    (v, p, pad): (usize, usize, usize),
    scale: f32,
    d: DType,
) -> Vec<(VocabCrossEntropy, DeviceBuffer)> {
    (0..p)
        .map(|rank| {
            let sh = VocabShard::of_rank(v, rank, p).unwrap();
            let ce = VocabCrossEntropy {
                shard: sh,
                padded_rows: sh.rows + pad,
                ignore_index: IGNORE,
                grad_scale: scale,
            };
            let mut local = vec![];
            for row in x.chunks_exact(v) {
                local.extend_from_slice(&row[sh.start..sh.end()]);
                local.extend(std::iter::repeat_n(1234.0, pad));
            }
            (ce, upv(dev, s, &local, d))
        })
        .collect()
}

/// Runs the three steps of the cross-entropy over `p` shards of the logits `x` `[N, V]`, with
/// the all-reduces on the host.
fn ce_ranks(
    dev: &Device,
    s: &Stream,
    (x, t): (&[f64], &[i32]),
    shape: (usize, usize, usize),
    scale: f32,
    d: DType,
) -> Ranks {
    let n = t.len();
    let tb = up(dev, s, pod(t));
    let ranks = shard_logits(dev, s, x, shape, scale, d);
    // Step 1, then all-reduce MAX.
    let mut m = vec![f32::NEG_INFINITY; n];
    for (ce, lb) in &ranks {
        let mb = garbage(dev, s, n * 4, 6);
        vocab_ce_max(dev, s, lb, &mb, ce, d).unwrap();
        for (a, b) in m.iter_mut().zip(f32s(dev, s, &mb)) {
            *a = a.max(b);
        }
    }
    let mb = up(dev, s, pod(&m));
    // Step 2, then all-reduce SUM in rank order.
    let (mut sum, mut pred) = (vec![0f32; n], vec![0f32; n]);
    for (i, (ce, lb)) in ranks.iter().enumerate() {
        let (sb, pb) = (garbage(dev, s, n * 4, 7), garbage(dev, s, n * 4, 8));
        let ops = VocabCeSums {
            logits: lb.into(),
            targets: (&tb).into(),
            global_max: (&mb).into(),
            sum_exp: (&sb).into(),
            target_logit: (&pb).into(),
        };
        vocab_ce_sums(dev, s, ops, ce, d).unwrap();
        let (sv, pv) = (f32s(dev, s, &sb), f32s(dev, s, &pb));
        for r in 0..n {
            (sum[r], pred[r]) = if i == 0 {
                (sv[r], pv[r])
            } else {
                (sum[r] + sv[r], pred[r] + pv[r])
            };
        }
    }
    let (sb, pb) = (up(dev, s, pod(&sum)), up(dev, s, pod(&pred)));
    // Step 3.
    let mut out = Ranks {
        shards: vec![],
        grads: vec![],
        losses: vec![],
    };
    for (ce, lb) in &ranks {
        let lossb = garbage(dev, s, n * 4, 9);
        let ops = VocabCeGrad {
            logits: lb.into(),
            targets: (&tb).into(),
            global_max: (&mb).into(),
            global_sum: (&sb).into(),
            global_target: Some((&pb).into()),
            losses: Some((&lossb).into()),
        };
        vocab_ce_grad(dev, s, ops, ce, d).unwrap();
        out.shards.push(ce.shard);
        out.grads.push(downv(dev, s, lb, d));
        out.losses.push(down(dev, s, &lossb));
    }
    out
}

/// Targets with every shard's tokens among them and every fourth row ignored.
fn targets(r: &mut SplitMix64, n: usize, v: usize, p: usize) -> Vec<i32> {
    (0..n)
        .map(|i| {
            if i % 4 == 2 {
                return IGNORE;
            }
            let sh = VocabShard::of_rank(v, i % p, p).unwrap();
            (sh.start as u64 + r.below(sh.rows as u64)) as i32
        })
        .collect()
}

fn ce_tol(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (0.0, 1e-5),
        DType::F16 => (2f64.powi(-25), 6e-4),
        _ => (0.0, 5e-3),
    }
}

/// P = 1 against the fused op: the same bits.
fn check_fused(
    dev: &Device,
    s: &Stream,
    (x, t): (&[f64], &[i32]),
    run: &Ranks,
    scale: f32,
    d: DType,
) {
    let (n, v) = (t.len(), run.shards[0].vocab);
    let (xb, lb) = (upv(dev, s, x, d), dev.alloc(n * 4).unwrap());
    let tb = up(dev, s, pod(t));
    let ce = CrossEntropy {
        vocab: v,
        padded_vocab: v,
        ignore_index: IGNORE,
        grad_scale: scale,
    };
    cross_entropy_forward_backward(dev, s, &xb, &tb, &lb, &ce, d).unwrap();
    assert_eq!(down(dev, s, &lb), run.losses[0], "{d} V {v}: fused loss");
    let bits = |g: &[f64]| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let fused = downv(dev, s, &xb, d);
    assert_eq!(
        bits(&fused),
        bits(&run.grads[0]),
        "{d} V {v}: fused gradient"
    );
}

#[test]
fn cross_entropy_shards_match_the_f64_reference() {
    // (N, V, padding of each shard).
    let shapes = [
        (1usize, 3usize, 0usize),
        (7, 50, 3),
        (9, 1000, 0),
        (3, 5003, 5),
    ];
    for dev in common::devices("vocab cross-entropy") {
        let s = dev.new_stream().unwrap();
        let mut r = SplitMix64::new(23);
        for d in DType::FLOATS {
            let (mut worst_loss, mut worst_grad) = (0f64, 0f64);
            let (abs, rel) = ce_tol(d);
            for (n, v, pad) in shapes {
                let x = r.vals(n * v, 10.0, 0.0, d);
                for p in 1..=3 {
                    let t = targets(&mut r, n, v, p);
                    let counted = t.iter().filter(|&&t| t != IGNORE).count();
                    let scale = 1.0 / counted.max(1) as f32;
                    let run = ce_ranks(&dev, &s, (&x, &t), (v, p, pad), scale, d);
                    let what = format!("{d} N {n} V {v} P {p}");
                    assert!(run.losses.iter().all(|l| *l == run.losses[0]), "{what}");
                    if p == 1 && pad == 0 {
                        check_fused(&dev, &s, (&x, &t), &run, scale, d);
                    }
                    let loss = dec(&run.losses[0], DType::F32);
                    let s64 = scale as f64;
                    for row in 0..n {
                        let xr = &x[row * v..][..v];
                        if t[row] == IGNORE {
                            assert_eq!(loss[row].to_bits(), 0, "{what} row {row}");
                        } else {
                            let (want, _) = row64(xr, t[row] as usize);
                            let err = (loss[row] - want).abs();
                            let tol = 2e-6 + 2e-6 * want.abs();
                            worst_loss = worst_loss.max(err / tol);
                            assert!(err <= tol, "{what} row {row}");
                        }
                        for (sh, g) in run.shards.iter().zip(&run.grads) {
                            let vp = sh.rows + pad;
                            let gr = &g[row * vp..][..vp];
                            assert!(gr[sh.rows..].iter().all(|x| x.to_bits() == 0), "{what}");
                            if t[row] == IGNORE {
                                assert!(gr.iter().all(|x| x.to_bits() == 0), "{what} ignored");
                                continue;
                            }
                            let (_, wg) = row64(xr, t[row] as usize);
                            for j in 0..sh.rows {
                                let w = wg[sh.start + j] * s64;
                                let err = (gr[j] - w).abs();
                                let tol = abs + 1e-7 * s64 + rel * w.abs();
                                worst_grad = worst_grad.max(err / tol);
                                assert!(
                                    err <= tol,
                                    "{what} row {row} col {}: {} vs {w}",
                                    sh.start + j,
                                    gr[j]
                                );
                            }
                        }
                    }
                }
            }
            eprintln!(
                "{}: {d}: the worst loss error is {worst_loss:.3} of its tolerance, the worst \
                 gradient error {worst_grad:.3} of its",
                dev.name()
            );
        }
    }
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    let h = 1e-6;
    let mut r = SplitMix64::new(24);
    // The reference gradient itself.
    for v in [1usize, 2, 17, 300] {
        let x = r.uniform(v, 5.0);
        let t = v / 2;
        let (_, g) = row64(&x, t);
        for (j, &g) in g.iter().enumerate() {
            let fd = central_diff(&x, j, h, |x| row64(x, t).0);
            assert!((g - fd).abs() <= 1e-8 + 1e-6 * fd.abs(), "{v} {j}");
        }
    }
    // The f32 op on two and three shards.
    let (n, v) = (4usize, 70usize);
    let x = r.vals(n * v, 6.0, 0.0, DType::F32);
    for dev in common::devices("vocab cross-entropy finite differences") {
        let s = dev.new_stream().unwrap();
        for p in [2usize, 3] {
            let t = targets(&mut r, n, v, p);
            let run = ce_ranks(&dev, &s, (&x, &t), (v, p, 2), 0.25, DType::F32);
            for row in 0..n {
                let xr = &x[row * v..][..v];
                for (sh, g) in run.shards.iter().zip(&run.grads) {
                    for j in 0..sh.rows {
                        let got = g[row * (sh.rows + 2) + j];
                        let fd = if t[row] == IGNORE {
                            0.0
                        } else {
                            let tr = t[row] as usize;
                            0.25 * central_diff(xr, sh.start + j, h, |x| row64(x, tr).0)
                        };
                        assert!(
                            (got - fd).abs() <= 1e-6 * 0.25 + 1e-4 * fd.abs(),
                            "P {p} row {row} col {}: {got} vs {fd}",
                            sh.start + j
                        );
                    }
                }
            }
        }
    }
}

#[path = "vocab_parallel/bad_input.rs"]
mod bad_input;
