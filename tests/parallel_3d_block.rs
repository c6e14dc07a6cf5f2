//! The 3D LayerNorm and GPT-2 block against the serial layers: on a cube of 8 in-process ranks
//! (q = 2), in both layouts, each rank's output tile, input-gradient tile and **every**
//! parameter-gradient shard equal the serial f64 reference's (f32 within 1e-5 of the tensor's
//! scale); the collectives are those of the formulas; shapes that do not split and grids that
//! are not 3D fail on every rank before any collective.

mod common;
mod nn_ref;

use std::time::Duration;

use tidemem::comm::{CommStats, Communicator, Tally};
use tidemem::nn::{Block, BlockOn};
use tidemem::parallel::GridNorm;
use tidemem::parallel::{
    split_3d, Cost, Cube, GridSpec, LayerNorm3D, Layout3D, PassCost, ProcessGrid,
};
use tidemem::prelude::*;

use nn_ref::*;

/// Sequences: 4 = q², one a tile.
const B: usize = 4;
const T: usize = 3;
const C: usize = 16;
const NH: usize = 4;
const N: usize = B * T;
const EPS: f32 = 1e-5;
const TOL: f64 = 1e-5;
const Q: usize = 2;
const WORLD: usize = Q * Q * Q;
/// Rows of a tile.
const NT: usize = N / (Q * Q);

/// The full master of every parameter, from its name.
fn master(name: &str) -> Init {
    let seed = name
        .bytes()
        .fold(17u64, |h, b| h.wrapping_mul(131) ^ u64::from(b));
    let (lo, hi) = if name.contains("ln_") && name.ends_with("weight") {
        (0.5, 1.5)
    } else if name.ends_with("bias") {
        (-0.2, 0.2)
    } else {
        (-0.3, 0.3)
    };
    Init::Uniform { seed, lo, hi }
}

fn values(init: &Init, n: usize) -> Vec<f64> {
    (0..n).map(|e| f64::from(init.value(e))).collect()
}

fn data(seed: u64, n: usize) -> Vec<f32> {
    let init = Init::Uniform {
        seed,
        lo: -1.0,
        hi: 1.0,
    };
    (0..n).map(|e| init.value(e)).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

// ---- the layouts, written from the design (not the crate's code) ----

/// `(i, a, c)` of tensor rank `t` for a layout whose rows go by `j` (`rows_j`) or by `k`.
fn axes(t: usize, rows_j: bool) -> (usize, usize, usize) {
    let (i, j, k) = (t % Q, t / Q % Q, t / (Q * Q));
    if rows_j {
        (i, j, k)
    } else {
        (i, k, j)
    }
}

/// Rank `t`'s tile of a `[rows, cols]` activation: rows `(i·q + a)·rows/q²`, columns
/// `c·cols/q`.
fn tile_of(v: &[f64], rows: usize, cols: usize, t: usize, rows_j: bool) -> Vec<f64> {
    let (i, a, c) = axes(t, rows_j);
    let (rl, cl) = (rows / (Q * Q), cols / Q);
    let r0 = (i * Q + a) * rl;
    (r0..r0 + rl)
        .flat_map(|r| v[r * cols + c * cl..r * cols + (c + 1) * cl].to_vec())
        .collect()
}

/// A LayerNorm's γ or β block: columns `c·C/q ..`.
fn ln_shard(v: &[f64], t: usize, rows_j: bool) -> Vec<f64> {
    let (_, _, c) = axes(t, rows_j);
    v[c * C / Q..(c + 1) * C / Q].to_vec()
}

/// Rank `t`'s weight shard `[in/q², out/q]` of the master `[out, in]`: element `(r, s)` is
/// `M[a·out/q + s, c·in/q + i·in/q² + r]`.
fn weight_shard(m: &[f64], inp: usize, out: usize, t: usize, rows_j: bool) -> Vec<f64> {
    let (i, a, c) = axes(t, rows_j);
    let (iq2, oq) = (inp / (Q * Q), out / Q);
    (0..iq2)
        .flat_map(|r| (0..oq).map(move |s| (r, s)))
        .map(|(r, s)| m[(a * oq + s) * inp + c * inp / Q + i * iq2 + r])
        .collect()
}

fn bias_shard(b: &[f64], out: usize, t: usize, rows_j: bool) -> Vec<f64> {
    let (_, a, _) = axes(t, rows_j);
    b[a * out / Q..(a + 1) * out / Q].to_vec()
}

/// `c_attn`'s rows (of `width` elements) reordered by head block: row `a·3C/q + p·C/q + s` is
/// row `p·C + a·C/q + s` (part `p` of q, k, v).
fn by_head_block(m: &[f64], width: usize) -> Vec<f64> {
    let cq = C / Q;
    (0..3 * C)
        .flat_map(|o| {
            let (a, p, s) = (o / (3 * cq), o % (3 * cq) / cq, o % cq);
            let src = p * C + a * cq + s;
            m[src * width..(src + 1) * width].to_vec()
        })
        .collect()
}

// ---- the ranks ----

fn on_ranks<R: Send>(spec: &str, f: impl Fn(&ProcessGrid) -> R + Sync) -> Vec<R> {
    let devs = (0..WORLD).map(|_| common::sim(32 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, Duration::from_secs(20)).unwrap();
    let spec = GridSpec {
        data: 1,
        pipeline: 1,
        sequence: 1,
        tensor: spec.parse().unwrap(),
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(&ProcessGrid::new(&c, spec).unwrap()))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

fn snapshot(g: &ProcessGrid) -> [CommStats; 5] {
    [
        g.input().unwrap().stats(),
        g.weight().unwrap().stats(),
        g.output().unwrap().stats(),
        g.plane().unwrap().stats(),
        g.tensor().stats(),
    ]
}

/// The collectives between two snapshots, by 3D group; the plane and the tensor group must
/// have done nothing.
fn delta(g: &ProcessGrid, before: &[CommStats; 5]) -> PassCost {
    let now = snapshot(g);
    let d: Vec<CommStats> = now.iter().zip(before).map(|(n, b)| n.since(b)).collect();
    assert_eq!(d[3], CommStats::default(), "collectives on the plane");
    assert_eq!(d[4], CommStats::default(), "collectives on the tensor");
    PassCost {
        input: d[0],
        weight: d[1],
        output: d[2],
        ..PassCost::default()
    }
}

fn up<K: tidemem::store::PassKind>(
    pass: &tidemem::store::Pass<'_, K>,
    v: &[f64],
    cols: usize,
) -> Act {
    let v = f32s(v);
    Act::upload(
        pass.pool(),
        pass.stream(),
        v.len() / cols,
        cols,
        DType::F32,
        &v,
    )
    .unwrap()
}

// ---- LayerNorm3D ----

struct LnOut {
    y: Vec<f32>,
    h: Vec<f32>,
    dx: Vec<f32>,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
    measured: Cost,
    expected: Cost,
}

/// The LayerNorm's collectives from the formulas, on tiles of `NT` rows, f32: forward, three
/// all-gathers (`n×C`, γ, β) on the column group; backward three there (`n×C` for `h` and for
/// `dY`, γ) and an all-reduce of `2·C/q` f32 on the weight group and on the row group.
fn ln_formula(rows_j: bool) -> Cost {
    let t = |calls, elems: usize| Tally {
        calls,
        bytes: (elems * 4) as u64,
    };
    let [mut fc, mut ba, mut bw, mut bc] = [CommStats::default(); 4];
    fc.all_gather = t(3, NT * C + 2 * C);
    bc.all_gather = t(3, 2 * NT * C + C);
    bw.all_reduce = t(1, 2 * C / Q);
    ba.all_reduce = t(1, 2 * C / Q);
    let z = CommStats::default();
    Cost {
        forward: by_group(rows_j, z, z, fc),
        backward: by_group(rows_j, ba, bw, bc),
    }
}

/// `(a, w, c)` on a layout's row group, the weight group and its column group, by the grid's
/// groups: rows by `j`, the row group is input() and the column group output().
fn by_group(rows_j: bool, a: CommStats, w: CommStats, c: CommStats) -> PassCost {
    match rows_j {
        true => PassCost {
            input: a,
            weight: w,
            output: c,
            ..PassCost::default()
        },
        false => PassCost {
            input: c,
            weight: w,
            output: a,
            ..PassCost::default()
        },
    }
}

/// A Linear3D's collectives from the design (`inp → out`, input rows by `j` when `rows_j`,
/// tiles of `NT` rows, f32, with its input gradient and a bias).
fn linear_formula(inp: usize, out: usize, rows_j: bool) -> Cost {
    let t = |elems: usize| Tally {
        calls: 1,
        bytes: (elems * 4) as u64,
    };
    let [mut fa, mut fw, mut fc, mut ba, mut bw, mut bc] = [CommStats::default(); 6];
    fa.all_gather = t(NT * inp); // X̃ [q·n, in/q]
    fw.all_gather = t(inp * out / (Q * Q)); // W̃ [in/q, out/q]
    fc.reduce_scatter = t(NT * out); // X̃·W̃ [q·n, out/q]
    bc.all_gather = t(NT * out);
    ba.reduce_scatter = t(NT * inp);
    bw.reduce_scatter = t(inp * out / (Q * Q));
    bw.all_reduce = t(out / Q);
    Cost {
        forward: by_group(rows_j, fa, fw, fc),
        backward: by_group(rows_j, ba, bw, bc),
    }
}

fn sum(a: CommStats, b: CommStats) -> CommStats {
    let t = |x: Tally, y: Tally| Tally {
        calls: x.calls + y.calls,
        bytes: x.bytes + y.bytes,
    };
    CommStats {
        all_gather: t(a.all_gather, b.all_gather),
        reduce_scatter: t(a.reduce_scatter, b.reduce_scatter),
        all_reduce: t(a.all_reduce, b.all_reduce),
        ..CommStats::default()
    }
}

/// The block's: its LayerNorms in its layout, `c_attn` and `c_fc` taking it, the `c_proj`s
/// the swapped one.
fn block_formula(rows_j: bool) -> Cost {
    let parts = [
        ln_formula(rows_j),
        linear_formula(C, 3 * C, rows_j),
        linear_formula(C, C, !rows_j),
        ln_formula(rows_j),
        linear_formula(C, 4 * C, rows_j),
        linear_formula(4 * C, C, !rows_j),
    ];
    let g = |a: PassCost, b: PassCost| PassCost {
        input: sum(a.input, b.input),
        weight: sum(a.weight, b.weight),
        output: sum(a.output, b.output),
        ..PassCost::default()
    };
    parts.into_iter().fold(Cost::default(), |a, b| Cost {
        forward: g(a.forward, b.forward),
        backward: g(a.backward, b.backward),
    })
}

#[allow(clippy::too_many_arguments)]
fn run_ln(
    grid: &ProcessGrid,
    layout: Layout3D,
    x: &[f64],
    r: Option<&[f64]>,
    dy: &[f64],
    dx0: Option<&[f64]>,
) -> LnOut {
    let mut m = manager(grid.tensor().device().clone(), DType::F32);
    let (g, b) = (master("ln.weight"), master("ln.bias"));
    let ln = LayerNorm3D::register(&mut m, grid, "ln", C, EPS, layout, &g, &b).unwrap();
    let (t, rows_j) = (grid.tensor_rank(), layout == Layout3D::RowsJColsK);
    let tile = |v: &[f64]| tile_of(v, N, C, t, rows_j);
    let mut measured = Cost::default();
    let fwd = m.forward().unwrap();
    let xa = up(&fwd, &tile(x), C / Q);
    let ra = r.map(|r| up(&fwd, &tile(r), C / Q));
    let before = snapshot(grid);
    let (y, saved) = ln.forward(&fwd, grid, &xa, ra.as_ref()).unwrap();
    measured.forward = delta(grid, &before);
    let (y, h) = (
        y.to_f32(fwd.stream()).unwrap(),
        saved.h().to_f32(fwd.stream()).unwrap(),
    );
    drop((xa, ra));
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let dya = up(&bwd, &tile(dy), C / Q);
    let into = dx0.map(|v| up(&bwd, &tile(v), C / Q));
    let before = snapshot(grid);
    let dx = ln
        .backward(&bwd, grid, &saved, &dya, into.as_ref())
        .unwrap();
    measured.backward = delta(grid, &before);
    if let Some(into) = &into {
        assert!(dx.same_memory(into), "dx is dx_into");
    }
    let dx = dx.to_f32(bwd.stream()).unwrap();
    drop((dya, into, saved));
    bwd.finish().unwrap();
    LnOut {
        y,
        h,
        dx,
        dgamma: m.read(ln.gamma).unwrap(),
        dbeta: m.read(ln.beta).unwrap(),
        measured,
        expected: ln.collectives(NT, DType::F32),
    }
}

#[test]
fn layer_norm_3d_equals_the_serial_layer_norm() {
    let (g, b) = (
        values(&master("ln.weight"), C),
        values(&master("ln.bias"), C),
    );
    let [x, r, dy, dx0] = [1, 2, 3, 4].map(|s| f64s(&data(s, N * C)));
    // RowsJColsK with the residual and dx added to the residual stream's gradient;
    // RowsKColsJ plain
    for (layout, fused) in [(Layout3D::RowsJColsK, true), (Layout3D::RowsKColsJ, false)] {
        let h = if fused { add(&x, &r) } else { x.clone() };
        let (y, nrm, rstd) = ln(&h, &g, &b);
        let [dx, dg, db] = ln_bwd(&dy, &nrm, &rstd, &g);
        let dx = if fused { add(&dx0, &dx) } else { dx };
        let outs = on_ranks("3d:2", |grid| {
            let (r, dx0) = (fused.then_some(&r[..]), fused.then_some(&dx0[..]));
            run_ln(grid, layout, &x, r, &dy, dx0)
        });
        let rows_j = layout == Layout3D::RowsJColsK;
        let mut worst = [0.0f64; 4];
        for (t, o) in outs.iter().enumerate() {
            let what = format!("{layout:?}, rank {t}");
            let tile = |v: &[f64]| tile_of(v, N, C, t, rows_j);
            worst[0] = worst[0].max(close(&format!("{what}: y"), &o.y, &tile(&y), TOL));
            close(&format!("{what}: h"), &o.h, &tile(&h), TOL);
            worst[1] = worst[1].max(close(&format!("{what}: dx"), &o.dx, &tile(&dx), TOL));
            let (wg, wb) = (ln_shard(&dg, t, rows_j), ln_shard(&db, t, rows_j));
            worst[2] = worst[2].max(close(&format!("{what}: dγ"), &o.dgamma, &wg, TOL));
            worst[3] = worst[3].max(close(&format!("{what}: dβ"), &o.dbeta, &wb, TOL));
            let f = ln_formula(rows_j);
            assert_eq!(o.expected, f, "{what}: collectives() against the formulas");
            assert_eq!(o.measured, f, "{what}: the communicators' counts");
        }
        eprintln!(
            "LayerNorm3D {layout:?} on {WORLD} ranks: worst error y {:.2e}, dx {:.2e}, \
             dγ {:.2e}, dβ {:.2e} (bound {TOL:.0e})",
            worst[0], worst[1], worst[2], worst[3]
        );
    }
}

// ---- the block on the cube ----

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

/// Rank `t`'s shard of parameter `k`'s full gradient `v` in a block taking layout `rows_j`:
/// `c_attn` and `c_fc` take the block's layout, the `c_proj`s the swapped one.
fn block_shard(k: usize, v: &[f64], t: usize, rows_j: bool) -> Vec<f64> {
    match k {
        0 | 1 | 6 | 7 => ln_shard(v, t, rows_j),
        2 => weight_shard(&by_head_block(v, C), C, 3 * C, t, rows_j),
        3 => bias_shard(&by_head_block(v, 1), 3 * C, t, rows_j),
        4 => weight_shard(v, C, C, t, !rows_j),
        5 | 11 => bias_shard(v, C, t, !rows_j),
        8 => weight_shard(v, C, 4 * C, t, rows_j),
        9 => bias_shard(v, 4 * C, t, rows_j),
        _ => weight_shard(v, 4 * C, C, t, !rows_j),
    }
}

struct BlockOut {
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
    measured: Cost,
    expected: Cost,
}

fn run_block(grid: &ProcessGrid, layout: Layout3D, x: &[f32], dout: &[f64]) -> BlockOut {
    let mut m = manager(grid.tensor().device().clone(), DType::F32);
    let blk = Block::register(
        &mut m,
        Cube::of(grid, layout).unwrap(),
        "h.0",
        [C, NH],
        EPS,
        &master,
    )
    .unwrap();
    let rows_j = layout == Layout3D::RowsJColsK;
    let mut measured = Cost::default();
    let fwd = m.forward().unwrap();
    let xa = Act::upload(fwd.pool(), fwd.stream(), N, C, DType::F32, x).unwrap();
    let xt = split_3d(&fwd, grid, layout, &xa).unwrap();
    let before = snapshot(grid);
    let (y, saved) = blk.forward(&fwd, &xt, [B, T], None).unwrap();
    measured.forward = delta(grid, &before);
    let y = y.to_f32(fwd.stream()).unwrap();
    drop((xa, xt));
    fwd.finish().unwrap();
    let mut bwd = m.backward().unwrap();
    let d = up(
        &bwd,
        &tile_of(dout, N, C, grid.tensor_rank(), rows_j),
        C / Q,
    );
    let before = snapshot(grid);
    let dx = blk.backward(&mut bwd, &saved, &d, None).unwrap();
    measured.backward = delta(grid, &before);
    let dx = dx.to_f32(bwd.stream()).unwrap();
    drop((d, saved));
    bwd.finish().unwrap();
    let grads = blk
        .params()
        .into_iter()
        .map(|id| {
            (
                m.tensor_info(id).unwrap().0.to_string(),
                m.read(id).unwrap(),
            )
        })
        .collect();
    BlockOut {
        y,
        dx,
        grads,
        measured,
        expected: blk.collectives(NT, DType::F32),
    }
}

#[test]
fn block_3d_equals_the_serial_block_in_both_layouts() {
    let x = data(5, N * C);
    let dout = f64s(&data(6, N * C));
    let p64: Vec<Vec<f64>> = params()
        .iter()
        .map(|(n, s)| values(&master(n), s.iter().product()))
        .collect();
    let (want_y, want_dx, want_g) = block_ref(&p64, &f64s(&x), &dout);
    for layout in [Layout3D::RowsJColsK, Layout3D::RowsKColsJ] {
        let rows_j = layout == Layout3D::RowsJColsK;
        let outs = on_ranks("3d:2", |grid| run_block(grid, layout, &x, &dout));
        let (mut wy, mut wdx, mut wg) = (0.0f64, 0.0f64, 0.0f64);
        for (t, o) in outs.iter().enumerate() {
            let what = format!("{layout:?}, rank {t}");
            let tile = |v: &[f64]| tile_of(v, N, C, t, rows_j);
            wy = wy.max(close(&format!("{what}: y"), &o.y, &tile(&want_y), TOL));
            wdx = wdx.max(close(&format!("{what}: dx"), &o.dx, &tile(&want_dx), TOL));
            assert_eq!(o.grads.len(), 12, "{what}: parameters");
            for (k, ((name, _), (got_name, got))) in params().iter().zip(&o.grads).enumerate() {
                assert_eq!(name, got_name, "{what}: parameter {k}'s name");
                let want = block_shard(k, &want_g[k], t, rows_j);
                wg = wg.max(close(&format!("{what}: grad {name}"), got, &want, TOL));
            }
            let f = block_formula(rows_j);
            assert_eq!(o.expected, f, "{what}: collectives() against the formulas");
            assert_eq!(o.measured, f, "{what}: the communicators' counts");
        }
        eprintln!(
            "the block {layout:?} on {WORLD} ranks: worst error y {wy:.2e}, dx {wdx:.2e}, \
             parameter gradients {wg:.2e} (bound {TOL:.0e})"
        );
    }
}

/// Every rank's error, which must name `want`.
fn refused_everywhere<T: std::fmt::Debug>(errs: Vec<Result<T>>, want: &str) {
    for (t, e) in errs.into_iter().enumerate() {
        let e = e.expect_err("refused").to_string();
        assert!(e.contains(want), "rank {t}: {e:?} should name {want:?}");
    }
}

/// Registers on a fresh manager; nothing is registered when it fails.
fn register_block(g: &ProcessGrid, c: usize, heads: usize) -> Result<Block<Cube>> {
    let mut m = manager(g.tensor().device().clone(), DType::F32);
    let r = Cube::of(g, Layout3D::RowsJColsK)
        .and_then(|l| Block::register(&mut m, l, "h.0", [c, heads], EPS, &master));
    if r.is_err() {
        assert_eq!(m.num_tensors(), 0, "a refused block registered tensors");
    }
    r
}

#[test]
fn shapes_that_do_not_split_fail_on_every_rank_before_any_collective() {
    let errs = on_ranks("3d:2", |g| {
        let mut m = manager(g.tensor().device().clone(), DType::F32);
        let (w, b) = (master("ln.weight"), master("ln.bias"));
        LayerNorm3D::register(&mut m, g, "ln", 5, EPS, Layout3D::RowsKColsJ, &w, &b)
    });
    refused_everywhere(errs, "ln: columns = 5 does not split into 2 (q)");
    let errs = on_ranks("3d:2", |g| register_block(g, 12, 3));
    refused_everywhere(errs, "h.0: heads = 3 does not split into 2 (q)");
    let errs = on_ranks("3d:2", |g| register_block(g, 6, 2));
    refused_everywhere(errs, "h.0: channels = 6 does not split into 4 (q²)");
    let errs = on_ranks("3d:2", |g| register_block(g, 16, 6));
    refused_everywhere(errs, "h.0: channels = 16 does not split into 6 (heads)");
    // 2 sequences of 6 tokens: 12 rows split, but not into whole sequences; a tile too wide
    let errs = on_ranks("3d:2", |g| -> Result<()> {
        let mut m = manager(g.tensor().device().clone(), DType::F32);
        let lay = Layout3D::RowsJColsK;
        let blk = Block::register(&mut m, Cube::of(g, lay)?, "h.0", [C, NH], EPS, &master)?;
        let before = snapshot(g);
        let fwd = m.forward()?;
        let x = Act::upload(fwd.pool(), fwd.stream(), NT, C / Q, DType::F32, &[0.5; 24])?;
        let e = blk
            .forward(&fwd, &x, [2, 6], None)
            .expect_err("2 sequences");
        assert!(
            e.to_string()
                .contains("sequences = 2 does not split into 4 (q²)"),
            "{e}"
        );
        let wide = Act::upload(fwd.pool(), fwd.stream(), NT, C, DType::F32, &[0.5; 48])?;
        let e = blk
            .forward(&fwd, &wide, [B, T], None)
            .expect_err("16 columns");
        assert!(e.to_string().contains("expected [N, 8] f32"), "{e}");
        let e = blk.forward(&fwd, &x, [B, 2 * T], None).expect_err("rows");
        assert!(
            matches!(e, Error::Length { .. })
                && e.to_string()
                    .contains("rows · q² (q = 2) of a 3D block tile"),
            "{e}"
        );
        assert_eq!(delta(g, &before), PassCost::default());
        Err(e)
    });
    refused_everywhere(errs, "rows · q² (q = 2) of a 3D block tile");
}

#[test]
fn a_grid_that_is_not_3d_is_refused_on_every_rank() {
    for spec in ["2.5d:2x2", "1d:8"] {
        let errs = on_ranks(spec, |g| register_block(g, C, NH));
        refused_everywhere(
            errs,
            &format!("cannot be used with a grid of tensor mode {spec} (it needs a 3D grid"),
        );
    }
}
