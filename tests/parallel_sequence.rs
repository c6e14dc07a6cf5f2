//! Ring self-attention (sequence parallelism) on 1, 2, 4 and 8 in-process ranks equals the
//! serial causal attention of the whole sequence: each rank's output rows and its rows of the
//! gradients of Q, K and V against an f64 reference (fp32, ≤ 1e-5 relative to the largest
//! element). Colossal-AI's ring divides dQ, dK and dV by the ring's size; these comparisons
//! fail by that factor if the gradients are scaled so. The messages equal the formula exactly,
//! and one rank is the serial attention op bit for bit.

mod common;
mod nn_ref;

use tidemem::comm::{CommStats, Communicator};
use tidemem::nn::Act;
use tidemem::ops::attention::{Attention, AttentionForward};
use tidemem::ops::heads::Heads;
use tidemem::parallel::RingAttention;
use tidemem::prelude::*;

use nn_ref::{attention, attention_bwd, close, f64s, D};

pub const B: usize = 2;
pub const T: usize = 16;
pub const C: usize = 16;
pub const NH: usize = 2;
pub const N: usize = B * T;
pub const EPS: f32 = 1e-5;

/// Values in [-1, 1) from a seed.
fn values(len: usize, seed: u64) -> Vec<f32> {
    common::pattern(len * 4, seed)
        .chunks(4)
        .map(|b| (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64 / 2f64.powi(31) - 1.0) as f32)
        .collect()
}

/// The rows of positions `r·L ..` of every sequence of a `[B·T, cols]` matrix.
fn rows_of(full: &[f32], cols: usize, r: usize, ranks: usize) -> Vec<f32> {
    let l = T / ranks;
    (0..B)
        .flat_map(|b| {
            let at = (b * T + r * l) * cols;
            full[at..at + l * cols].to_vec()
        })
        .collect()
}

fn manager(dev: Device) -> ChunkManager {
    let mut cfg = ManagerConfig::new(1024, Policy::Tide);
    cfg.param_dtype = DType::F32;
    let mut m = ChunkManager::new(dev, cfg).unwrap();
    m.register("unused", &[4], Init::Zeros).unwrap();
    m
}

struct RankOut {
    out: Vec<f32>,
    dqkv: Vec<f32>,
    forward: CommStats,
    backward: CommStats,
    expected: tidemem::parallel::Cost,
}

fn run(ranks: usize, qkv: &[f32], dout: &[f32]) -> Vec<RankOut> {
    let devs = (0..ranks).map(|_| common::sim(64 << 20)).collect();
    let comms = Communicator::local(devs).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let r = c.rank();
                    let ring = RingAttention::new(&c, B, T, NH, D).unwrap();
                    let mut m = manager(c.device().clone());
                    let rows = ring.rows();
                    let fwd = m.forward().unwrap();
                    let (st, pool) = (fwd.stream(), fwd.pool());
                    let x = rows_of(qkv, 3 * C, r, ranks);
                    let x = Act::upload(pool, st, rows, 3 * C, DType::F32, &x).unwrap();
                    let s0 = c.stats();
                    let (out, saved) = ring.forward(&fwd, &c, &x).unwrap();
                    let forward = c.stats().since(&s0);
                    let out_host = out.to_f32(st).unwrap();
                    drop((out, x));
                    fwd.finish().unwrap();
                    let bwd = m.backward().unwrap();
                    let dy = rows_of(dout, C, r, ranks);
                    let dy = Act::upload(bwd.pool(), bwd.stream(), rows, C, DType::F32, &dy);
                    let dy = dy.unwrap();
                    let s1 = c.stats();
                    let dqkv = ring.backward(&bwd, &c, &saved, &dy).unwrap();
                    let backward = c.stats().since(&s1);
                    let dqkv_host = dqkv.to_f32(bwd.stream()).unwrap();
                    drop((dqkv, dy, saved));
                    bwd.finish().unwrap();
                    RankOut {
                        out: out_host,
                        dqkv: dqkv_host,
                        forward,
                        backward,
                        expected: ring.collectives(DType::F32),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ring_attention_equals_serial_causal_attention_on_1_2_4_8_ranks() {
    let qkv = values(N * 3 * C, 1);
    let dout = values(N * C, 2);
    let (out_ref, att) = attention(&f64s(&qkv));
    let dqkv_ref = attention_bwd(&f64s(&qkv), &att, &f64s(&dout));
    let mut worst = 0.0f64;
    for ranks in [1, 2, 4, 8] {
        for (r, o) in run(ranks, &qkv, &dout).into_iter().enumerate() {
            let want_out: Vec<f64> = rows_of_f64(&out_ref, C, r, ranks);
            let want_d: Vec<f64> = rows_of_f64(&dqkv_ref, 3 * C, r, ranks);
            let what = format!("{ranks} ranks, rank {r}");
            worst = worst.max(close(&format!("{what}: out"), &o.out, &want_out, 1e-5));
            worst = worst.max(close(&format!("{what}: dqkv"), &o.dqkv, &want_d, 1e-5));
            assert_eq!(
                o.forward, o.expected.forward.sequence,
                "{what}: forward messages"
            );
            assert_eq!(
                o.backward, o.expected.backward.sequence,
                "{what}: backward messages"
            );
        }
    }
    eprintln!("ring attention: worst relative error {worst:.2e}");
}

fn rows_of_f64(full: &[f64], cols: usize, r: usize, ranks: usize) -> Vec<f64> {
    let l = T / ranks;
    (0..B)
        .flat_map(|b| {
            let at = (b * T + r * l) * cols;
            full[at..at + l * cols].to_vec()
        })
        .collect()
}

/// On one rank the ring is the serial attention op: the same products, the same bits.
#[test]
fn one_rank_is_the_serial_attention_op_bit_for_bit() {
    let qkv = values(N * 3 * C, 3);
    let got = run(1, &qkv, &values(N * C, 4)).remove(0).out;
    let dev = common::sim(64 << 20);
    let s = dev.new_stream().unwrap();
    let a = Attention::new(Heads::new(B, T, NH, D));
    let f = DType::F32;
    let x = dev.upload(&s, bytemuck::cast_slice(&qkv)).unwrap();
    let [q, k, v, y] = [(); 4].map(|_| dev.alloc(a.head_bytes(f)).unwrap());
    let [scores, att] = [(); 2].map(|_| dev.alloc(a.scores_bytes(f)).unwrap());
    let out = dev.alloc(a.out_bytes(f)).unwrap();
    let bufs = AttentionForward {
        qkv: (&x).into(),
        q: (&q).into(),
        k: (&k).into(),
        v: (&v).into(),
        scores: (&scores).into(),
        att: (&att).into(),
        y: (&y).into(),
        out: (&out).into(),
    };
    a.forward(&dev, &s, bufs, f).unwrap();
    let want: Vec<f32> = bytemuck::pod_collect_to_vec(&dev.download(&s, &out).unwrap());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want));
}

/// A sequence that does not split over the ring is refused on every rank, before any message.
#[test]
fn positions_that_do_not_split_are_refused_on_every_rank() {
    let devs = (0..3).map(|_| common::sim(1 << 20)).collect();
    let comms = Communicator::local(devs).unwrap();
    for c in &comms {
        let e = RingAttention::new(c, B, T, NH, D).unwrap_err();
        assert!(
            matches!(
                e,
                tidemem::Error::NotSplit {
                    what: "positions",
                    value: 16,
                    parts: 3,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(c.stats(), CommStats::default());
    }
    let c = &Communicator::local(vec![common::sim(1 << 20)]).unwrap()[0];
    assert!(matches!(
        RingAttention::new(c, 0, T, NH, D),
        Err(tidemem::Error::TooFew {
            got: 0,
            need: 1,
            ..
        })
    ));
}

/// A ring rank that never posts its block: every other rank gets an error within the
/// communicator's timeout, never a hang.
#[test]
fn a_rank_that_never_posts_is_an_error_on_every_other_rank() {
    let devs = (0..4).map(|_| common::sim(64 << 20)).collect();
    let comms =
        Communicator::local_with_timeout(devs, std::time::Duration::from_millis(300)).unwrap();
    let qkv = values(N * 3 * C, 5);
    let t0 = std::time::Instant::now();
    let results: Vec<Option<bool>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let qkv = &qkv;
                s.spawn(move || {
                    let ring = RingAttention::new(&c, B, T, NH, D).unwrap();
                    if c.rank() == 2 {
                        return None; // this rank never posts
                    }
                    let mut m = manager(c.device().clone());
                    let fwd = m.forward().unwrap();
                    let x = rows_of(qkv, 3 * C, c.rank(), 4);
                    let rows = ring.rows();
                    let x = Act::upload(fwd.pool(), fwd.stream(), rows, 3 * C, DType::F32, &x);
                    Some(ring.forward(&fwd, &c, &x.unwrap()).is_err())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < std::time::Duration::from_secs(20));
    for (r, failed) in results.into_iter().enumerate() {
        if r != 2 {
            assert_eq!(failed, Some(true), "rank {r} returned an error");
        }
    }
}
