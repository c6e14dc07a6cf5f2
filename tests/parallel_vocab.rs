//! The vocabulary split over a 1D group: the embedding and the tied head with the
//! cross-entropy, on 2 and 3 in-process ranks (11 tokens over 3 ranks: uneven shards), against
//! the serial f64 reference: the embedding's output, the loss, `dh`, and every rank's rows of
//! `wte`'s gradient (the head's share plus the embedding's) and `wpe`'s; and the collectives.

mod common;
mod nn_ref;

use tidemem::comm::Communicator;
use tidemem::nn::Act;
use tidemem::ops::vocab_parallel::VocabShard;
use tidemem::parallel::{Classifier1D, Shard, VocabEmbedding1D, VocabHead1D};
use tidemem::prelude::*;

use nn_ref::*;

const B: usize = 2;
const T: usize = 4;
const C: usize = 8;
const NH: usize = 2;
const N: usize = B * T;
const EPS: f32 = 1e-5;
const V: usize = 11;
const TOL: f64 = 1e-5;

fn master(name: &str) -> Init {
    let seed = name
        .bytes()
        .fold(5u64, |h, b| h.wrapping_mul(131) ^ u64::from(b));
    Init::Uniform {
        seed,
        lo: -0.5,
        hi: 0.5,
    }
}

fn full(name: &str, rows: usize) -> Vec<f64> {
    let init = master(name);
    (0..rows * C).map(|i| f64::from(init.value(i))).collect()
}

#[test]
fn vocab_parallel_embedding_and_head_equal_the_serial_ones() {
    let tokens: Vec<i32> = (0..N).map(|i| (i * 5 % V) as i32).collect();
    let mut targets: Vec<i32> = (0..N).map(|i| ((i * 3 + 1) % V) as i32).collect();
    targets[2] = -100;
    let (wte, wpe) = (full("wte.weight", V), full("wpe.weight", T));
    let x = embed_ref(&wte, &wpe, &tokens);
    let head = lm_head_ref(&x, &wte, &targets, V);
    let mut dwte = head.dwte.clone();
    let dwpe = embed_bwd(&head.dh, &tokens, &mut dwte, T);
    for world in [2, 3] {
        let devs = (0..world).map(|_| common::sim(64 << 20)).collect();
        let comms = Communicator::local(devs).unwrap();
        let outs: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let (tokens, targets) = (&tokens, &targets);
                    s.spawn(move || {
                        let mut m = manager(c.device().clone(), DType::F32);
                        let shard = Shard::of(&c);
                        let (te, pe) = (master("wte.weight"), master("wpe.weight"));
                        let emb =
                            VocabEmbedding1D::register(&mut m, V, T, C, &te, &pe, shard).unwrap();
                        let lm = VocabHead1D::tied(&m, &emb, -100).unwrap();
                        let s0 = c.stats();
                        let fwd = m.forward().unwrap();
                        let (xa, es) = emb.forward(&fwd, &c, tokens, B, T).unwrap();
                        let xh = xa.to_f32(fwd.stream()).unwrap();
                        let (loss, hs) = lm.forward(&fwd, &c, &xa, targets, 1.0).unwrap();
                        fwd.finish().unwrap();
                        let s1 = c.stats();
                        let bwd = m.backward().unwrap();
                        let dh = lm.backward(&bwd, &c, &hs).unwrap();
                        let dhh = dh.to_f32(bwd.stream()).unwrap();
                        emb.backward(&bwd, &es, &dh).unwrap();
                        drop((dh, hs, es, xa));
                        bwd.finish().unwrap();
                        let s2 = c.stats();
                        let g = (m.read(emb.wte).unwrap(), m.read(emb.wpe).unwrap());
                        (xh, loss, dhh, g, emb.vocab, s1.since(&s0), s2.since(&s1))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (xh, loss, dh, (gte, gpe), vs, fwd, bwd)) in outs.iter().enumerate() {
            let what = format!("{world} ranks, rank {r}");
            assert_eq!(*vs, VocabShard::of_rank(V, r, world).unwrap());
            close(&format!("{what}: embedding"), xh, &x, TOL);
            close(&format!("{what}: loss"), &[*loss], &[head.loss], TOL);
            close(&format!("{what}: dh"), dh, &head.dh, TOL);
            let rows = &dwte[vs.start * C..(vs.start + vs.rows) * C];
            close(&format!("{what}: wte rows' grad"), gte, rows, TOL);
            close(&format!("{what}: wpe grad"), gpe, &dwpe, TOL);
            // forward: the embedding's sum (N·C), the row max (N), the sums and target logits
            // (2N); backward: dh (N·C)
            let f32s = |n: usize| (n * 4) as u64;
            assert_eq!(fwd.all_reduce.calls, 3, "{what}");
            assert_eq!(fwd.all_reduce.bytes, f32s(N * C + 3 * N), "{what}");
            assert_eq!(
                (bwd.all_reduce.calls, bwd.all_reduce.bytes),
                (1, f32s(N * C)),
                "{what}"
            );
        }
    }
}

/// The untied 1D classifier (classes split over 2 and 4 ranks, with a bias and an ignored row)
/// against the serial f64 softmax cross-entropy: the loss, `dX`, and every rank's rows of the
/// weight's and the bias's gradients (loss scale 2).
#[test]
fn classifier_1d_equals_the_serial_classifier() {
    const K: usize = 8;
    let x: Vec<f64> = full("x", N);
    let w: Vec<f64> = full("cls.weight", K);
    let b: Vec<f64> = (0..K)
        .map(|i| f64::from(master("cls.bias").value(i)))
        .collect();
    let mut targets: Vec<i32> = (0..N).map(|i| ((i * 5 + 2) % K) as i32).collect();
    targets[3] = -100;
    // the serial reference
    let counted = targets.iter().filter(|&&t| t >= 0).count() as f64;
    let (mut loss, mut dlogits) = (0.0, vec![0.0; N * K]);
    for r in 0..N {
        let z: Vec<f64> = (0..K)
            .map(|k| b[k] + (0..C).map(|c| x[r * C + c] * w[k * C + c]).sum::<f64>())
            .collect();
        if targets[r] < 0 {
            continue;
        }
        let m = z.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = z.iter().map(|v| (v - m).exp()).sum();
        loss += sum.ln() + m - z[targets[r] as usize];
        for k in 0..K {
            let p = (z[k] - m).exp() / sum;
            let hot = if k == targets[r] as usize { 1.0 } else { 0.0 };
            dlogits[r * K + k] = 2.0 * (p - hot) / counted;
        }
    }
    loss /= counted;
    let dx: Vec<f64> = (0..N * C)
        .map(|i| {
            (0..K)
                .map(|k| dlogits[i / C * K + k] * w[k * C + i % C])
                .sum()
        })
        .collect();
    let dw: Vec<f64> = (0..K * C)
        .map(|i| {
            (0..N)
                .map(|r| dlogits[r * K + i / C] * x[r * C + i % C])
                .sum()
        })
        .collect();
    let db: Vec<f64> = (0..K)
        .map(|k| (0..N).map(|r| dlogits[r * K + k]).sum())
        .collect();
    let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    for world in [2, 4] {
        let devs = (0..world).map(|_| common::sim(64 << 20)).collect();
        let comms = Communicator::local(devs).unwrap();
        std::thread::scope(|s| {
            for c in comms {
                let (xf, targets, dx, dw, db) = (&xf, &targets, &dx, &dw, &db);
                s.spawn(move || {
                    let mut m = manager(c.device().clone(), DType::F32);
                    let shard = Shard::of(&c);
                    let (wi, bi) = (master("cls.weight"), master("cls.bias"));
                    let cls =
                        Classifier1D::register(&mut m, "cls", C, K, &wi, Some(&bi), -100, shard)
                            .unwrap();
                    let fwd = m.forward().unwrap();
                    let xa = Act::upload(fwd.pool(), fwd.stream(), N, C, DType::F32, xf).unwrap();
                    let s0 = c.stats();
                    let (l, saved) = cls.forward(&fwd, &c, &xa, targets, 2.0).unwrap();
                    let fwd_stats = c.stats().since(&s0);
                    drop(xa);
                    fwd.finish().unwrap();
                    let bwd = m.backward().unwrap();
                    let s1 = c.stats();
                    let dxa = cls.backward(&bwd, &c, &saved).unwrap();
                    let bwd_stats = c.stats().since(&s1);
                    let want = cls.collectives(N, DType::F32);
                    assert_eq!(
                        fwd_stats.all_reduce.calls,
                        want.forward.tensor.all_reduce.calls
                    );
                    assert_eq!(
                        fwd_stats.all_reduce.bytes,
                        want.forward.tensor.all_reduce.bytes
                    );
                    assert_eq!(
                        bwd_stats.all_reduce.calls,
                        want.backward.tensor.all_reduce.calls
                    );
                    assert_eq!(
                        bwd_stats.all_reduce.bytes,
                        want.backward.tensor.all_reduce.bytes
                    );
                    let got_dx = dxa.to_f32(bwd.stream()).unwrap();
                    drop((dxa, saved));
                    bwd.finish().unwrap();
                    let what = format!("{world} ranks, rank {}", c.rank());
                    assert!(
                        ((f64::from(l) - loss) / loss).abs() < TOL,
                        "{what}: loss {l} vs {loss}"
                    );
                    close(&format!("{what}: dx"), &got_dx, dx, TOL);
                    let rows = K / world;
                    let lin = cls.proj.linear;
                    let gw = m.read(lin.weight).unwrap();
                    let gb = m.read(lin.bias.unwrap()).unwrap();
                    let r0 = c.rank() * rows;
                    close(
                        &format!("{what}: dW"),
                        &gw,
                        &dw[r0 * C..(r0 + rows) * C],
                        TOL,
                    );
                    close(&format!("{what}: db"), &gb, &db[r0..r0 + rows], TOL);
                });
            }
        });
    }
}
