//! 1D tensor parallelism against the serial layer: GPT-2's block split over 2 and 4 in-process
//! ranks gives the serial f64 reference's output, input gradient and **every** weight and bias
//! gradient shard (f32 within 1e-5 of the tensor's scale), and the collectives the formulas
//! say.

mod common;
mod nn_ref;

use std::sync::Arc;
use tidemem::comm::Communicator;
use tidemem::nn::{Block, BlockOn};

use tidemem::parallel::{OneD, Shard};
use tidemem::prelude::*;

use nn_ref::*;

const B: usize = 2;
const T: usize = 4;
const C: usize = 16;
const NH: usize = 4;
const N: usize = B * T;
const EPS: f32 = 1e-5;
const TOL: f64 = 1e-5;

/// The full master of every parameter, from its name.
fn master(name: &str) -> Init {
    let seed = name
        .bytes()
        .fold(11u64, |h, b| h.wrapping_mul(131) ^ u64::from(b));
    let (lo, hi) = if name.contains("ln_") && name.ends_with("weight") {
        (0.5, 1.5)
    } else if name.ends_with("bias") {
        (-0.2, 0.2)
    } else {
        (-0.3, 0.3)
    };
    Init::Uniform { seed, lo, hi }
}

/// The block's parameters in registration order: name and full shape.
fn params() -> Vec<(String, Vec<usize>)> {
    let p = |s: &str| format!("h.0.{s}");
    vec![
        (p("ln_1.weight"), vec![C]),
        (p("ln_1.bias"), vec![C]),
        (p("attn.c_attn.weight"), vec![3 * C, C]),
        (p("attn.c_attn.bias"), vec![3 * C]),
        (p("attn.c_proj.weight"), vec![C, C]),
        (p("attn.c_proj.bias"), vec![C]),
        (p("ln_2.weight"), vec![C]),
        (p("ln_2.bias"), vec![C]),
        (p("mlp.c_fc.weight"), vec![4 * C, C]),
        (p("mlp.c_fc.bias"), vec![4 * C]),
        (p("mlp.c_proj.weight"), vec![C, 4 * C]),
        (p("mlp.c_proj.bias"), vec![C]),
    ]
}

fn full(name: &str, shape: &[usize]) -> Vec<f64> {
    let init = master(name);
    (0..shape.iter().product())
        .map(|i| f64::from(init.value(i)))
        .collect()
}

/// Rank `r` of `p`'s share of a full tensor, written from the layouts (not the crate's code):
/// column-parallel weights and biases keep their output rows (per q/k/v block for `c_attn`),
/// row-parallel weights their input columns, the row-parallel bias stays on rank 0, the
/// LayerNorms are whole.
fn shard_of(name: &str, shape: &[usize], v: &[f64], r: usize, p: usize) -> Option<Vec<f64>> {
    let rows_of = |blocks: usize, width: usize| {
        let (out, blk) = (shape[0], shape[0] / blocks);
        let local = blk / p;
        (0..out)
            .filter(|o| (o % blk) / local == r)
            .flat_map(|o| v[o * width..(o + 1) * width].to_vec())
            .collect::<Vec<f64>>()
    };
    if name.contains("ln_") {
        Some(v.to_vec())
    } else if name.ends_with("c_attn.weight") {
        Some(rows_of(3, C))
    } else if name.ends_with("c_attn.bias") {
        Some(rows_of(3, 1))
    } else if name.ends_with("c_fc.weight") {
        Some(rows_of(1, C))
    } else if name.ends_with("c_fc.bias") {
        Some(rows_of(1, 1))
    } else if name.ends_with("c_proj.weight") {
        let (out, inp) = (shape[0], shape[1]);
        let local = inp / p;
        Some(
            (0..out)
                .flat_map(|o| v[o * inp + r * local..o * inp + (r + 1) * local].to_vec())
                .collect(),
        )
    } else {
        // the row-parallel biases
        (r == 0).then(|| v.to_vec())
    }
}

fn on_ranks<R: Send>(world: usize, f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    let devs = (0..world).map(|_| common::sim(64 << 20)).collect();
    let comms = Communicator::local(devs).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

struct RankOut {
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
    fwd: tidemem::comm::CommStats,
    bwd: tidemem::comm::CommStats,
    expected: tidemem::parallel::Cost,
}

fn run_rank(c: Communicator, x: &[f32], dout: &[f32]) -> RankOut {
    let mut m = manager(c.device().clone(), DType::F32);
    let c = Arc::new(c);
    let blk = Block::register(&mut m, OneD::of(&c), "h.0", [C, NH], EPS, &master).unwrap();
    let ids: Vec<(String, TensorId)> = params()
        .iter()
        .filter_map(|(n, _)| {
            let id = (0..m.num_tensors() as u32)
                .map(TensorId)
                .find(|&id| m.tensor_info(id).unwrap().0 == n)?;
            Some((n.clone(), id))
        })
        .collect();
    let s0 = c.stats();
    let fwd = m.forward().unwrap();
    let xa = Act::upload(fwd.pool(), fwd.stream(), N, C, DType::F32, x).unwrap();
    let (y, saved) = blk.forward(&fwd, &xa, [B, T], None).unwrap();
    let y = y.to_f32(fwd.stream()).unwrap();
    fwd.finish().unwrap();
    let s1 = c.stats();
    let mut bwd = m.backward().unwrap();
    let da = Act::upload(bwd.pool(), bwd.stream(), N, C, DType::F32, dout).unwrap();
    let dx = blk.backward(&mut bwd, &saved, &da, None).unwrap();
    let dx = dx.to_f32(bwd.stream()).unwrap();
    drop((saved, da, xa));
    bwd.finish().unwrap();
    let s2 = c.stats();
    let grads = ids
        .into_iter()
        .map(|(n, id)| (n, m.read(id).unwrap()))
        .collect();
    RankOut {
        y,
        dx,
        grads,
        fwd: s1.since(&s0),
        bwd: s2.since(&s1),
        expected: blk.collectives(N, DType::F32),
    }
}

#[test]
fn block_1d_equals_the_serial_block_on_2_and_4_ranks() {
    let xin: Vec<f32> = (0..N * C)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let dout: Vec<f32> = (0..N * C)
        .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
        .collect();
    let p64: Vec<Vec<f64>> = params().iter().map(|(n, s)| full(n, s)).collect();
    let (want_y, want_dx, want_g) = block_ref(&p64, &f64s(&xin), &f64s(&dout));
    for world in [2, 4] {
        let outs = on_ranks(world, |c| run_rank(c, &xin, &dout));
        let mut worst = 0.0f64;
        for (r, o) in outs.iter().enumerate() {
            let what = format!("{world} ranks, rank {r}");
            worst = worst.max(close(&format!("{what}: output"), &o.y, &want_y, TOL));
            worst = worst.max(close(&format!("{what}: dx"), &o.dx, &want_dx, TOL));
            let mut held = 0;
            for (k, (name, shape)) in params().iter().enumerate() {
                let want = shard_of(name, shape, &want_g[k], r, world);
                let got = o.grads.iter().find(|g| &g.0 == name);
                match (want, got) {
                    (Some(w), Some((_, g))) => {
                        worst = worst.max(close(&format!("{what}: grad {name}"), g, &w, TOL));
                        held += 1;
                    }
                    (None, None) => {}
                    (w, g) => panic!(
                        "{what}: {name}: shard expected {} held {}",
                        w.is_some(),
                        g.is_some()
                    ),
                }
            }
            assert_eq!(held, if r == 0 { 12 } else { 10 }, "{what}: tensors held");
            // Megatron's block: forward, the attention's and the MLP's row-parallel outputs
            // are all-reduced (`g`); backward, the gradients of their column-parallel inputs
            // (`f`): two all-reduces of N·C f32 values each way
            let want = (2, (2 * N * C * 4) as u64);
            let e = o.expected;
            let (f, b) = (e.forward.tensor.all_reduce, e.backward.tensor.all_reduce);
            assert_eq!((f.calls, f.bytes), want, "formula");
            assert_eq!((b.calls, b.bytes), want, "formula");
            assert_eq!(
                (o.fwd.all_reduce.calls, o.fwd.all_reduce.bytes),
                want,
                "{what}: forward collectives"
            );
            assert_eq!(
                (o.bwd.all_reduce.calls, o.bwd.all_reduce.bytes),
                want,
                "{what}: backward collectives"
            );
            let others =
                o.fwd.all_gather.calls + o.bwd.all_gather.calls + o.bwd.reduce_scatter.calls;
            assert_eq!(others, 0, "{what}: nothing but all-reduces");
        }
        eprintln!("1D block on {world} ranks: worst error {worst:.2e} (bound {TOL:.0e})");
    }
}

#[test]
fn shapes_that_do_not_split_are_refused_at_registration() {
    // 4 heads over 3 ranks
    let errs = on_ranks(3, |c| {
        let mut m = manager(c.device().clone(), DType::F32);
        Block::register(&mut m, OneD::of(&Arc::new(c)), "h.0", [C, NH], EPS, &master).err()
    });
    for e in errs {
        let e = e.expect("refused").to_string();
        assert!(e.contains("heads") && e.contains("3"), "{e}");
    }
}

/// The embedding split along the channels: every rank's output is the serial one, every rank's
/// `wte`/`wpe` gradients are its columns of the serial ones; one all-gather forward, nothing
/// backward.
#[test]
fn embedding_1d_equals_the_serial_embedding() {
    const V: usize = 11;
    let tokens: Vec<i32> = (0..N).map(|i| (i * 7 % V) as i32).collect();
    let dout: Vec<f32> = (0..N * C)
        .map(|i| ((i * 29 % 83) as f32 / 40.0) - 1.0)
        .collect();
    let (wte, wpe) = (full("wte.weight", &[V, C]), full("wpe.weight", &[T, C]));
    let want = embed_ref(&wte, &wpe, &tokens);
    let mut dwte = vec![0.0; V * C];
    let dwpe = embed_bwd(&f64s(&dout), &tokens, &mut dwte, T);
    let cols = |v: &[f64], r: usize, p: usize| -> Vec<f64> {
        let l = C / p;
        v.chunks(C)
            .flat_map(|row| row[r * l..(r + 1) * l].to_vec())
            .collect()
    };
    for world in [2, 4] {
        let outs = on_ranks(world, |c| {
            let mut m = manager(c.device().clone(), DType::F32);
            let emb = tidemem::parallel::Embedding1D::register(
                &mut m,
                V,
                T,
                C,
                &master("wte.weight"),
                &master("wpe.weight"),
                Shard::of(&c),
            )
            .unwrap();
            let s0 = c.stats();
            let fwd = m.forward().unwrap();
            let (y, saved) = emb.forward(&fwd, &c, &tokens, B, T).unwrap();
            let y = y.to_f32(fwd.stream()).unwrap();
            fwd.finish().unwrap();
            let s1 = c.stats();
            let bwd = m.backward().unwrap();
            let d = Act::upload(bwd.pool(), bwd.stream(), N, C, DType::F32, &dout).unwrap();
            emb.backward(&bwd, &saved, &d).unwrap();
            drop((d, saved));
            bwd.finish().unwrap();
            let s2 = c.stats();
            let g = (
                m.read(emb.local.wte).unwrap(),
                m.read(emb.local.wpe).unwrap(),
            );
            (y, g, s1.since(&s0), s2.since(&s1))
        });
        for (r, (y, (gte, gpe), fwd, bwd)) in outs.iter().enumerate() {
            let what = format!("{world} ranks, rank {r}");
            close(&format!("{what}: output"), y, &want, TOL);
            close(
                &format!("{what}: wte grad"),
                gte,
                &cols(&dwte, r, world),
                TOL,
            );
            close(
                &format!("{what}: wpe grad"),
                gpe,
                &cols(&dwpe, r, world),
                TOL,
            );
            assert_eq!(
                (fwd.all_gather.calls, fwd.all_gather.bytes),
                (1, (N * C * 4) as u64),
                "{what}: one all-gather of the output"
            );
            assert_eq!(bwd.all_gather.calls + bwd.all_reduce.calls, 0, "{what}");
        }
    }
}
