//! GPT-2's LayerNorm and block on the 2D (SUMMA) and 2.5D (Tesseract) layouts against the
//! serial f64 reference: on 4 ranks (2×2) and 8 ranks (2×2×2), every rank's output block,
//! input-gradient block and **every** parameter-gradient shard (f32 within 1e-5 of the
//! tensor's scale); shapes that do not split are refused on every rank.

mod common;

use common::summa::{linear_formula, q_depth, tally};
mod nn_ref;

use std::time::Duration;

use tidemem::comm::Communicator;
use tidemem::nn::{Block, BlockOn};
use tidemem::parallel::GridNorm;
use tidemem::parallel::{Cost, GridSpec, LayerNorm2D, PassCost, ProcessGrid, Summa, TensorMode};
use tidemem::prelude::*;

use nn_ref::*;

const B: usize = 4;
const T: usize = 3;
const C: usize = 8;
const NH: usize = 2;
const N: usize = B * T;
const EPS: f32 = 1e-5;
const TOL: f64 = 1e-5;

const TWO_D: TensorMode = TensorMode::TwoD { q: 2 };
const TWO_HALF_D: TensorMode = TensorMode::TwoHalfD { q: 2, depth: 2 };

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

/// The block's parameters in registration order: name and full shape `[outputs, inputs]`
/// (`[n, 1]` for vectors).
fn params() -> Vec<(String, [usize; 2])> {
    let p = |s: &str| format!("h.0.{s}");
    vec![
        (p("ln_1.weight"), [C, 1]),
        (p("ln_1.bias"), [C, 1]),
        (p("attn.c_attn.weight"), [3 * C, C]),
        (p("attn.c_attn.bias"), [3 * C, 1]),
        (p("attn.c_proj.weight"), [C, C]),
        (p("attn.c_proj.bias"), [C, 1]),
        (p("ln_2.weight"), [C, 1]),
        (p("ln_2.bias"), [C, 1]),
        (p("mlp.c_fc.weight"), [4 * C, C]),
        (p("mlp.c_fc.bias"), [4 * C, 1]),
        (p("mlp.c_proj.weight"), [C, 4 * C]),
        (p("mlp.c_proj.bias"), [C, 1]),
    ]
}

fn full(init: &Init, n: usize) -> Vec<f64> {
    (0..n).map(|i| f64::from(init.value(i))).collect()
}

/// `(row, col, batch row block, row blocks)` of tensor rank `t`, from the layouts.
fn place(mode: TensorMode, t: usize) -> (usize, usize, usize, usize) {
    match mode {
        TensorMode::TwoD { q } => (t / q, t % q, t / q, q),
        TensorMode::TwoHalfD { q, depth } => {
            let (col, row, dep) = (t % q, t / q % q, t / (q * q));
            (row, col, row + q * dep, q * depth)
        }
        m => panic!("{m}"),
    }
}

/// Block `(rb of nrb, cb of ncb)` of a row-major `[rows, cols]` matrix.
fn block<T: Copy>(v: &[T], cols: usize, [rb, nrb]: [usize; 2], [cb, ncb]: [usize; 2]) -> Vec<T> {
    let (r, c) = (v.len() / cols / nrb, cols / ncb);
    (0..r)
        .flat_map(|k| {
            let s = (rb * r + k) * cols + cb * c;
            v[s..s + c].to_vec()
        })
        .collect()
}

/// Serial output `o` of the permuted `c_attn` output `o'` (column block `j` = `[q_j|k_j|v_j]`).
fn qkv_of(o: usize) -> usize {
    let cl = C / 2;
    (o % (3 * cl)) / cl * C + o / (3 * cl) * cl + o % cl
}

/// Rank `(i, j)`'s shard of a full serial tensor `[out, inp]`, written from the layouts:
/// vectors piece `j·q + i` of `q²`; matrices the block `[out/q, inp/q]` at output block `j`,
/// input block `i`; `c_attn`'s outputs permuted first.
fn shard_of(name: &str, [out, inp]: [usize; 2], v: &[f64], (i, j): (usize, usize)) -> Vec<f64> {
    let q = 2;
    let v: Vec<f64> = if name.contains("c_attn") {
        (0..out)
            .flat_map(|o| v[qkv_of(o) * inp..(qkv_of(o) + 1) * inp].to_vec())
            .collect()
    } else {
        v.to_vec()
    };
    if inp == 1 {
        let n = out / (q * q);
        return v[j * out / q + i * n..][..n].to_vec();
    }
    let (ol, il) = (out / q, inp / q);
    (0..ol)
        .flat_map(|a| {
            let s = (j * ol + a) * inp + i * il;
            v[s..s + il].to_vec()
        })
        .collect()
}

fn spec(tensor: TensorMode) -> GridSpec {
    GridSpec {
        data: 1,
        pipeline: 1,
        sequence: 1,
        tensor,
    }
}

fn on_ranks<R: Send>(world: usize, f: impl Fn(&Communicator) -> R + Sync) -> Vec<R> {
    let devs = (0..world).map(|_| common::sim(64 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, Duration::from_secs(20)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn pattern(mul: usize, modulo: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * mul % modulo) as f32 / (modulo / 2) as f32) - 1.0)
        .collect()
}

fn id_of(m: &ChunkManager, name: &str) -> TensorId {
    (0..m.num_tensors() as u32)
        .map(TensorId)
        .find(|&id| m.tensor_info(id).unwrap().0 == name)
        .unwrap_or_else(|| panic!("{name} not registered"))
}

/// A LayerNorm2D's collectives over N rows of C f32 values, derived here from its algorithm:
/// each rank holds `rl = N/(q·d)` rows and `C/q` columns. Forward, ROW all-gathers the row
/// block `h` (`rl·C`) and `γ`, `β` (`C` each); COL all-gathers this column's `γ`, `β`
/// blocks (`C/q` each). Backward, ROW all-gathers `h` and `dY` (`rl·C` each) and `γ` (`C`);
/// COL all-gathers `γ`'s block and reduce-scatters `dγ`, `dβ` packed in one call (`C/q` f32
/// each); with depth, DEP all-reduces the two pieces in one call (`C/q²` f32 each).
fn layer_norm_formula(mode: TensorMode) -> Cost {
    let (q, d) = q_depth(mode);
    let (rl, e) = (N / (q * d), 4);
    let mut c = Cost::default();
    c.forward.row.all_gather = tally(3, (rl * C + 2 * C) * e);
    c.forward.col.all_gather = tally(2, 2 * (C / q) * e);
    c.backward.row.all_gather = tally(3, (2 * rl * C + C) * e);
    c.backward.col.all_gather = tally(1, (C / q) * e);
    c.backward.col.reduce_scatter = tally(1, 2 * (C / q) * 4);
    if d > 1 {
        c.backward.dep.all_reduce = tally(1, 2 * (C / (q * q)) * 4);
    }
    c
}

/// The block's: its two LayerNorms and four linears (`C → 3C`, `C → C`, `C → 4C`, `4C → C`);
/// the attention itself is local.
fn block_formula(mode: TensorMode) -> Cost {
    let mut c = layer_norm_formula(mode);
    c += layer_norm_formula(mode);
    for (inp, out) in [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)] {
        c += linear_formula(mode, N, inp, out, true);
    }
    c
}

/// One rank's results: output, `dx`, the gradient of each parameter, and the collectives
/// its groups counted beside the layer's formulas.
type RankOut = (Vec<f32>, Vec<f32>, Vec<Vec<f32>>, [Cost; 2]);

/// What the ROW, COL and DEP groups have counted so far.
fn group_stats(grid: &ProcessGrid) -> PassCost {
    PassCost {
        row: grid.row().unwrap().stats(),
        col: grid.col().unwrap().stats(),
        dep: grid.dep().map(|d| d.stats()).unwrap_or_default(),
        ..PassCost::default()
    }
}

fn since(a: PassCost, b: PassCost) -> PassCost {
    PassCost {
        row: a.row.since(&b.row),
        col: a.col.since(&b.col),
        dep: a.dep.since(&b.dep),
        ..PassCost::default()
    }
}

/// LayerNorm of `x + r` (the fused residual form), its backward added into a given `dx`.
fn ln_rank(c: &Communicator, mode: TensorMode, data: &[Vec<f32>; 4]) -> (RankOut, Vec<f32>) {
    let grid = ProcessGrid::new(c, spec(mode)).unwrap();
    let mut m = manager(c.device().clone(), DType::F32);
    let (g, b) = (master("ln_2.weight"), master("ln_2.bias"));
    let ln = LayerNorm2D::register(&mut m, &grid, "ln_2", C, EPS, &g, &b).unwrap();
    let (row, col, rb, nrb) = place(mode, c.rank());
    assert_eq!((ln.place.row, ln.place.col), (row, col));
    let mine = |v: &Vec<f32>| block(v, C, [rb, nrb], [col, 2]);
    let [x, r, dy, d0] = data.each_ref().map(mine);
    let (rl, cl) = (N / nrb, C / 2);
    let fwd = m.forward().unwrap();
    let up = |v: &[f32]| Act::upload(fwd.pool(), fwd.stream(), rl, cl, DType::F32, v).unwrap();
    let (xa, ra) = (up(&x), up(&r));
    let s0 = group_stats(&grid);
    let (y, saved) = ln.forward(&fwd, &grid, &xa, Some(&ra)).unwrap();
    let s1 = group_stats(&grid);
    let y = y.to_f32(fwd.stream()).unwrap();
    let h = saved.h().to_f32(fwd.stream()).unwrap();
    drop((xa, ra));
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let up = |v: &[f32]| Act::upload(bwd.pool(), bwd.stream(), rl, cl, DType::F32, v).unwrap();
    let (dya, into) = (up(&dy), up(&d0));
    let s2 = group_stats(&grid);
    let dx = ln.backward(&bwd, &grid, &saved, &dya, Some(&into)).unwrap();
    let s3 = group_stats(&grid);
    assert!(dx.same_memory(&into));
    let dx = dx.to_f32(bwd.stream()).unwrap();
    drop((saved, dya, into));
    bwd.finish().unwrap();
    let grads = vec![m.read(ln.gamma).unwrap(), m.read(ln.beta).unwrap()];
    let counted = Cost {
        forward: since(s1, s0),
        backward: since(s3, s2),
    };
    let stats = [counted, ln.collectives(N, DType::F32).unwrap()];
    ((y, dx, grads, stats), h)
}

#[test]
fn layer_norm_2d_equals_the_serial_layer_norm_on_2x2_and_2x2x2() {
    let data = [
        pattern(37, 101, N * C),
        pattern(41, 89, N * C),
        pattern(53, 97, N * C),
        pattern(29, 83, N * C),
    ];
    let (g, b) = (
        full(&master("ln_2.weight"), C),
        full(&master("ln_2.bias"), C),
    );
    let h = add(&f64s(&data[0]), &f64s(&data[1]));
    let (y, nrm, rstd) = ln(&h, &g, &b);
    let [dx, dg, db] = ln_bwd(&f64s(&data[2]), &nrm, &rstd, &g);
    let dx = add(&dx, &f64s(&data[3]));
    for (mode, world) in [(TWO_D, 4), (TWO_HALF_D, 8)] {
        let outs = on_ranks(world, |c| ln_rank(c, mode, &data));
        let mut worst = 0.0f64;
        for (t, ((oy, odx, og, [counted, formula]), oh)) in outs.iter().enumerate() {
            let (row, col, rb, nrb) = place(mode, t);
            let mine = |v: &[f64]| block(v, C, [rb, nrb], [col, 2]);
            let what = format!("{mode}, rank {t}");
            assert_eq!(
                *counted,
                layer_norm_formula(mode),
                "{what}: counted collectives"
            );
            assert_eq!(*formula, layer_norm_formula(mode), "{what}: collectives()");
            // ROW: h, γ, β gathered forward; h, dY, γ backward
            let (e, rl) = (4, N / nrb);
            let row_f = formula.forward.row.all_gather;
            assert_eq!(
                (row_f.calls, row_f.bytes),
                (3, ((rl * C + 2 * C) * e) as u64)
            );
            let row_b = formula.backward.row.all_gather;
            assert_eq!(
                (row_b.calls, row_b.bytes),
                (3, ((2 * rl * C + C) * e) as u64)
            );
            worst = worst.max(close(&format!("{what}: y"), oy, &mine(&y), TOL));
            worst = worst.max(close(&format!("{what}: h"), oh, &mine(&h), TOL));
            worst = worst.max(close(&format!("{what}: dx"), odx, &mine(&dx), TOL));
            for (k, want) in [&dg, &db].into_iter().enumerate() {
                let w = shard_of("ln", [C, 1], want, (row, col));
                worst = worst.max(close(&format!("{what}: grad {k}"), &og[k], &w, TOL));
            }
        }
        eprintln!("LayerNorm2D on {mode}: worst error {worst:.2e} (bound {TOL:.0e})");
    }
}

/// Registers this rank's part of block `name` on the grid's 2D or 2.5D layout.
fn block2d(
    m: &mut ChunkManager,
    grid: &ProcessGrid,
    name: &str,
    shape: [usize; 2],
) -> tidemem::Result<Block<Summa>> {
    Block::register(m, Summa::of(grid)?, name, shape, EPS, &master)
}

fn block_rank(c: &Communicator, mode: TensorMode, x: &[f32], dout: &[f32]) -> RankOut {
    let grid = ProcessGrid::new(c, spec(mode)).unwrap();
    let mut m = manager(c.device().clone(), DType::F32);
    let blk = block2d(&mut m, &grid, "h.0", [C, NH]).unwrap();
    assert_eq!(blk.params().len(), 12);
    let ids: Vec<TensorId> = params().iter().map(|(n, _)| id_of(&m, n)).collect();
    assert_eq!(ids, blk.params(), "registration order");
    let (_, col, rb, nrb) = place(mode, c.rank());
    let (rl, cl) = (N / nrb, C / 2);
    let fwd = m.forward().unwrap();
    let xb = block(x, C, [rb, nrb], [col, 2]);
    let xa = Act::upload(fwd.pool(), fwd.stream(), rl, cl, DType::F32, &xb).unwrap();
    let s0 = group_stats(&grid);
    let (y, saved) = blk.forward(&fwd, &xa, [N / T, T], None).unwrap();
    let s1 = group_stats(&grid);
    let y = y.to_f32(fwd.stream()).unwrap();
    drop(xa);
    fwd.finish().unwrap();
    let mut bwd = m.backward().unwrap();
    let db = block(dout, C, [rb, nrb], [col, 2]);
    let da = Act::upload(bwd.pool(), bwd.stream(), rl, cl, DType::F32, &db).unwrap();
    let s2 = group_stats(&grid);
    let dx = blk.backward(&mut bwd, &saved, &da, None).unwrap();
    let s3 = group_stats(&grid);
    let dx = dx.to_f32(bwd.stream()).unwrap();
    drop((saved, da));
    bwd.finish().unwrap();
    let grads = ids.iter().map(|&id| m.read(id).unwrap()).collect();
    let counted = Cost {
        forward: since(s1, s0),
        backward: since(s3, s2),
    };
    (
        y,
        dx,
        grads,
        [counted, blk.collectives(N, DType::F32).unwrap()],
    )
}

#[test]
fn block_2d_and_2p5d_equal_the_serial_block() {
    let x = pattern(37, 101, N * C);
    let dout = pattern(53, 97, N * C);
    let p64: Vec<Vec<f64>> = params()
        .iter()
        .map(|(n, s)| full(&master(n), s[0] * s[1]))
        .collect();
    let (want_y, want_dx, want_g) = block_ref(&p64, &f64s(&x), &f64s(&dout));
    for (mode, world) in [(TWO_D, 4), (TWO_HALF_D, 8)] {
        let outs = on_ranks(world, |c| block_rank(c, mode, &x, &dout));
        let mut worst = 0.0f64;
        for (t, (oy, odx, og, [counted, formula])) in outs.iter().enumerate() {
            let (row, col, rb, nrb) = place(mode, t);
            let mine = |v: &[f64]| block(v, C, [rb, nrb], [col, 2]);
            let what = format!("{mode}, rank {t}");
            assert_eq!(*counted, block_formula(mode), "{what}: counted collectives");
            assert_eq!(*formula, block_formula(mode), "{what}: collectives()");
            worst = worst.max(close(&format!("{what}: out"), oy, &mine(&want_y), TOL));
            worst = worst.max(close(&format!("{what}: dx"), odx, &mine(&want_dx), TOL));
            for (k, (name, shape)) in params().iter().enumerate() {
                let w = shard_of(name, *shape, &want_g[k], (row, col));
                worst = worst.max(close(&format!("{what}: grad {name}"), &og[k], &w, TOL));
            }
        }
        eprintln!("the block on {mode}: worst error {worst:.2e} (bound {TOL:.0e})");
    }
}

/// 2.5D with one depth layer is the 2D block, bit for bit (same ranks, same places).
#[test]
fn block_2p5d_of_depth_1_is_the_2d_block() {
    let x = pattern(37, 101, N * C);
    let dout = pattern(53, 97, N * C);
    let two = on_ranks(4, |c| block_rank(c, TWO_D, &x, &dout));
    let one_layer = TensorMode::TwoHalfD { q: 2, depth: 1 };
    let half = on_ranks(4, |c| block_rank(c, one_layer, &x, &dout));
    for (t, (a, b)) in two.iter().zip(&half).enumerate() {
        assert_eq!((&a.0, &a.1, &a.2), (&b.0, &b.1, &b.2), "rank {t}");
        assert_eq!(a.3, b.3, "rank {t}: collectives");
    }
}

#[test]
fn shapes_that_do_not_split_are_refused_on_every_rank() {
    for (mode, world) in [(TWO_D, 4), (TWO_HALF_D, 8)] {
        let errs = on_ranks(world, |c| {
            let grid = ProcessGrid::new(c, spec(mode)).unwrap();
            let mut m = manager(c.device().clone(), DType::F32);
            // 3 heads over q = 2; 6 channels over q² = 4; LayerNorm of 6 columns
            let heads = block2d(&mut m, &grid, "a", [C, 3]).err();
            let chans = block2d(&mut m, &grid, "b", [6, 2]).err();
            let (g, b) = (master("g"), master("b"));
            let lnc = LayerNorm2D::register(&mut m, &grid, "ln", 6, EPS, &g, &b).err();
            // rows of a row block that are not whole sequences: 3 or 6 local rows, seq 4
            let blk = block2d(&mut m, &grid, "h.0", [C, NH]).unwrap();
            let (_, _, _, nrb) = place(mode, c.rank());
            let fwd = m.forward().unwrap();
            let zeros = vec![0.0; N / nrb * C / 2];
            let xa = Act::upload(fwd.pool(), fwd.stream(), N / nrb, C / 2, DType::F32, &zeros);
            let xa = xa.unwrap();
            let before = c.stats();
            let seq = blk
                .forward(&fwd, &xa, [N / 4, 4], None)
                .err()
                .map(|e| e.to_string());
            assert_eq!(c.stats(), before, "no collective before the refusal");
            drop(xa);
            fwd.finish().unwrap();
            [
                heads.map(|e| e.to_string()),
                chans.map(|e| e.to_string()),
                lnc.map(|e| e.to_string()),
                seq,
            ]
        });
        for [heads, chans, lnc, seq] in errs {
            let heads = heads.expect("3 heads refused");
            assert!(heads.contains("heads = 3"), "{heads}");
            let chans = chans.expect("6 channels refused");
            assert!(chans.contains("channels = 6"), "{chans}");
            let lnc = lnc.expect("6 columns refused");
            assert!(lnc.contains("cols = 6"), "{lnc}");
            let seq = seq.expect("partial sequences refused");
            assert!(seq.contains("whole sequences"), "{seq}");
        }
    }
}

/// The layers refuse a grid of another mode at registration (a block registered on a grid
/// runs on that grid's groups: it cannot be handed another's).
#[test]
fn other_grids_are_refused() {
    let errs = on_ranks(4, |c| {
        let one_d = ProcessGrid::new(c, spec(TensorMode::OneD { size: 4 })).unwrap();
        let mut m = manager(c.device().clone(), DType::F32);
        let (g, b) = (master("g"), master("b"));
        let ln = LayerNorm2D::register(&mut m, &one_d, "ln", C, EPS, &g, &b).err();
        let blk = block2d(&mut m, &one_d, "x", [C, NH]).err();
        [ln, blk].map(|e| e.map(|e| e.to_string()))
    });
    for e in errs.into_iter().flatten() {
        let e = e.expect("refused");
        assert!(e.contains("1d") || e.contains("1D"), "{e}");
    }
}
