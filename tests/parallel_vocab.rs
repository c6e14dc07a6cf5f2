//! The vocabulary split over a 1D group: the embedding and the tied head with the
//! cross-entropy, on 2 and 3 in-process ranks (11 tokens over 3 ranks: uneven shards), against
//! the serial f64 reference: the embedding's output, the loss, `dh`, and every rank's rows of
//! `wte`'s gradient (the head's share plus the embedding's) and `wpe`'s; and the collectives.

mod common;
mod nn_ref;

use tidemem::comm::Communicator;
use tidemem::ops::VocabShard;
use tidemem::parallel::{Shard, VocabEmbedding1D, VocabHead1D};
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
