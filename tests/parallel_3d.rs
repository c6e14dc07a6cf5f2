//! 3D tensor parallelism against the serial layer: on a cube of 8 in-process ranks (q = 2),
//! each rank's output, input-gradient, weight-gradient and bias-gradient tiles equal the
//! serial f64 reference's (f32 within 1e-5 of the tensor's scale), for one linear and for two
//! consecutive ones with the input and output roles swapped; the collectives are those of the
//! formulas; shapes that do not split and grids that are not 3D fail on every rank.

mod common;

use std::time::Duration;

use tidemem::comm::{CommStats, Communicator, Tally};
use tidemem::parallel::{
    gather_3d, split_3d, Cost, GridSpec, Layout3D, Linear3D, PassCost, ProcessGrid,
};
use tidemem::prelude::*;

const Q: usize = 2;
const WORLD: usize = Q * Q * Q;
/// Rows of the whole batch, split q² ways.
const R: usize = 12;
const TOL: f64 = 1e-5;

fn master(seed: u64, lo: f32, hi: f32) -> Init {
    Init::Uniform { seed, lo, hi }
}

fn weight_init(l: usize) -> Init {
    master(100 + l as u64, -0.4, 0.4)
}

fn bias_init(l: usize) -> Init {
    master(200 + l as u64, -0.2, 0.2)
}

fn values(init: &Init, n: usize) -> Vec<f64> {
    (0..n).map(|e| f64::from(init.value(e))).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// `|got − want| ≤ tol·(max|want| + |want|)` elementwise; returns the worst ratio.
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let mut worst = 0.0f64;
    for (e, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs() / (scale + w.abs()).max(f64::MIN_POSITIVE);
        assert!(
            err <= tol,
            "{what}[{e}]: {g} vs {w} ({err:.2e} > {tol:.0e})"
        );
        worst = worst.max(err);
    }
    worst
}

// ---- the serial f64 reference: y = x·Mᵀ + b, M [out, in] ----

fn linear_ref(x: &[f64], m: &[f64], b: &[f64], inp: usize, out: usize) -> Vec<f64> {
    let rows = x.len() / inp;
    let mut y = vec![0.0; rows * out];
    for n in 0..rows {
        for o in 0..out {
            y[n * out + o] = b[o]
                + (0..inp)
                    .map(|i| x[n * inp + i] * m[o * inp + i])
                    .sum::<f64>();
        }
    }
    y
}

/// `(dx, dM, db)`.
fn linear_bwd(x: &[f64], m: &[f64], dy: &[f64], inp: usize, out: usize) -> [Vec<f64>; 3] {
    let rows = x.len() / inp;
    let (mut dx, mut dm, mut db) = (vec![0.0; rows * inp], vec![0.0; out * inp], vec![0.0; out]);
    for n in 0..rows {
        for o in 0..out {
            let g = dy[n * out + o];
            db[o] += g;
            for i in 0..inp {
                dx[n * inp + i] += g * m[o * inp + i];
                dm[o * inp + i] += g * x[n * inp + i];
            }
        }
    }
    [dx, dm, db]
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

/// Rank `t`'s weight shard `[in/q², out/q]` of the master `[out, in]` of a layer whose input
/// rows go by `j` (`rows_j`): element `(r, s)` is `M[a·out/q + s, c·in/q + i·in/q² + r]`.
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

// ---- the ranks ----

fn on_ranks<R: Send>(spec: &str, f: impl Fn(&Communicator, &ProcessGrid) -> R + Sync) -> Vec<R> {
    let devs = (0..WORLD).map(|_| common::sim(16 << 20)).collect();
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
                s.spawn(move || {
                    let grid = ProcessGrid::new(&c, spec).unwrap();
                    f(&c, &grid)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

fn manager(dev: Device) -> ChunkManager {
    let mut cfg = ManagerConfig::new(1024, Policy::Tide);
    cfg.param_dtype = DType::F32;
    ChunkManager::new(dev, cfg).unwrap()
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
    assert_eq!(
        d[4],
        CommStats::default(),
        "collectives on the tensor group"
    );
    PassCost {
        input: d[0],
        weight: d[1],
        output: d[2],
        ..PassCost::default()
    }
}

struct RankOut {
    /// The input tile split_3d gave.
    x: Vec<f32>,
    /// The last layer's output tile, and the full output gather_3d gave.
    y: Vec<f32>,
    y_full: Vec<f32>,
    dx: Vec<f32>,
    /// Per layer: weight and bias gradient shards.
    grads: Vec<(Vec<f32>, Vec<f32>)>,
    /// Per layer: measured forward and backward collectives, and the expected.
    measured: Vec<Cost>,
    expected: Vec<Cost>,
}

/// Layers `dims[l] → dims[l+1]`, the first taking rows by `j`, each next one the previous's
/// output; `x` `[R, dims[0]]` whole on every rank, `dy` the last output's gradient whole.
fn run_rank(grid: &ProcessGrid, dims: &[usize], x: &[f32], dy: &[f32]) -> RankOut {
    let dev = grid.tensor().device().clone();
    let mut m = manager(dev);
    let mut layout = Layout3D::RowsJColsK;
    let mut layers = Vec::new();
    for l in 0..dims.len() - 1 {
        let (w, b) = (weight_init(l), bias_init(l));
        let name = format!("fc{l}");
        let layer = Linear3D::register(
            &mut m,
            grid,
            &name,
            dims[l],
            dims[l + 1],
            layout,
            &w,
            Some(&b),
        )
        .unwrap();
        layout = layer.output_layout();
        layers.push(layer);
    }
    let (d, n) = (DType::F32, R / (Q * Q));
    let mut measured = vec![Cost::default(); layers.len()];
    let fwd = m.forward().unwrap();
    let xa = Act::upload(fwd.pool(), fwd.stream(), R, dims[0], d, x).unwrap();
    let mut h = split_3d(&fwd, grid, Layout3D::RowsJColsK, &xa).unwrap();
    let x_tile = h.to_f32(fwd.stream()).unwrap();
    let mut saved = Vec::new();
    for (l, layer) in layers.iter().enumerate() {
        let before = snapshot(grid);
        let (y, s) = layer.forward(&fwd, grid, &h).unwrap();
        measured[l].forward = delta(grid, &before);
        saved.push(s);
        h = y;
    }
    let y = h.to_f32(fwd.stream()).unwrap();
    let y_full = gather_3d(&fwd, grid, layout, &h).unwrap();
    let y_full = y_full.to_f32(fwd.stream()).unwrap();
    drop((xa, h));
    fwd.finish().unwrap();

    let bwd = m.backward().unwrap();
    let last = *dims.last().unwrap();
    let rows_j = layout == Layout3D::RowsJColsK;
    let dy_tile = f32s(&tile_of(&f64s(dy), R, last, grid.tensor_rank(), rows_j));
    let mut g = Act::upload(bwd.pool(), bwd.stream(), n, last / Q, d, &dy_tile).unwrap();
    for (l, layer) in layers.iter().enumerate().rev() {
        let before = snapshot(grid);
        g = layer
            .backward(&bwd, grid, &saved[l], &g, true)
            .unwrap()
            .unwrap();
        measured[l].backward = delta(grid, &before);
    }
    let dx = g.to_f32(bwd.stream()).unwrap();
    drop((g, saved));
    bwd.finish().unwrap();
    let grads = layers
        .iter()
        .map(|l| (m.read(l.weight).unwrap(), m.read(l.bias.unwrap()).unwrap()))
        .collect();
    RankOut {
        x: x_tile,
        y,
        y_full,
        dx,
        grads,
        measured,
        expected: layers.iter().map(|l| l.collectives(n, d, true)).collect(),
    }
}

/// The collectives the formulas give layer `l` (`inp → out`) on input tiles of `n = R/q²`
/// rows, f32: its row group is the grid's input group when its input rows go by `j` (even
/// layers), else the output group.
fn formula(l: usize, inp: usize, out: usize) -> Cost {
    let n = R / (Q * Q);
    let t = |bytes: usize| Tally {
        calls: 1,
        bytes: (bytes * 4) as u64,
    };
    let (mut fa, mut fw, mut fc) = (
        CommStats::default(),
        CommStats::default(),
        CommStats::default(),
    );
    fa.all_gather = t(n * inp); // X̃ = [q·n, in/q]
    fw.all_gather = t(inp * out / (Q * Q)); // W̃ = [in/q, out/q]
    fc.reduce_scatter = t(n * out); // X̃·W̃ = [q·n, out/q]
    let (mut ba, mut bw, mut bc) = (
        CommStats::default(),
        CommStats::default(),
        CommStats::default(),
    );
    bc.all_gather = t(n * out); // dỸ
    ba.reduce_scatter = t(n * inp); // dỸ·W̃ᵀ
    bw.reduce_scatter = t(inp * out / (Q * Q)); // X̃ᵀ·dỸ
    bw.all_reduce = t(out / Q); // db
    let by = |a, w, c| {
        if l.is_multiple_of(2) {
            PassCost {
                input: a,
                weight: w,
                output: c,
                ..PassCost::default()
            }
        } else {
            PassCost {
                input: c,
                weight: w,
                output: a,
                ..PassCost::default()
            }
        }
    };
    Cost {
        forward: by(fa, fw, fc),
        backward: by(ba, bw, bc),
    }
}

/// Runs layers `dims` on the cube and checks every rank against the serial f64 chain.
fn check_chain(dims: &[usize], seed: u64) {
    let x = f32s(&values(&master(seed, -1.0, 1.0), R * dims[0]));
    let last = *dims.last().unwrap();
    let dy = f32s(&values(&master(seed + 1, -1.0, 1.0), R * last));
    // the serial reference
    let ms: Vec<Vec<f64>> = (0..dims.len() - 1)
        .map(|l| values(&weight_init(l), dims[l + 1] * dims[l]))
        .collect();
    let bs: Vec<Vec<f64>> = (0..dims.len() - 1)
        .map(|l| values(&bias_init(l), dims[l + 1]))
        .collect();
    let mut xs = vec![f64s(&x)];
    for l in 0..ms.len() {
        xs.push(linear_ref(&xs[l], &ms[l], &bs[l], dims[l], dims[l + 1]));
    }
    let mut g = f64s(&dy);
    let mut grads = vec![(Vec::new(), Vec::new()); ms.len()];
    for l in (0..ms.len()).rev() {
        let [dx, dm, db] = linear_bwd(&xs[l], &ms[l], &g, dims[l], dims[l + 1]);
        grads[l] = (dm, db);
        g = dx;
    }
    let y_rows_j = ms.len().is_multiple_of(2);
    let outs = on_ranks("3d:2", |_, grid| run_rank(grid, dims, &x, &dy));
    let mut worst = [0.0f64; 4];
    for (t, o) in outs.iter().enumerate() {
        let what = format!("{dims:?}, rank {t}");
        close(
            &format!("{what}: split x"),
            &o.x,
            &tile_of(&xs[0], R, dims[0], t, true),
            0.0,
        );
        let y = &xs[ms.len()];
        worst[0] = worst[0].max(close(
            &format!("{what}: y"),
            &o.y,
            &tile_of(y, R, last, t, y_rows_j),
            TOL,
        ));
        worst[0] = worst[0].max(close(&format!("{what}: gathered y"), &o.y_full, y, TOL));
        worst[1] = worst[1].max(close(
            &format!("{what}: dx"),
            &o.dx,
            &tile_of(&g, R, dims[0], t, true),
            TOL,
        ));
        for (l, (dw, db)) in o.grads.iter().enumerate() {
            let rows_j = l.is_multiple_of(2);
            let (inp, out) = (dims[l], dims[l + 1]);
            let want = weight_shard(&grads[l].0, inp, out, t, rows_j);
            worst[2] = worst[2].max(close(&format!("{what}: layer {l} dW"), dw, &want, TOL));
            let want = bias_shard(&grads[l].1, out, t, rows_j);
            worst[3] = worst[3].max(close(&format!("{what}: layer {l} db"), db, &want, TOL));
            let f = formula(l, inp, out);
            assert_eq!(
                o.expected[l], f,
                "{what}: layer {l}: collectives() against the formulas"
            );
            assert_eq!(
                o.measured[l], f,
                "{what}: layer {l}: the communicators' counts"
            );
        }
    }
    eprintln!(
        "3D {dims:?} on {WORLD} ranks: worst error y {:.2e}, dx {:.2e}, dW {:.2e}, db {:.2e} \
         (bound {TOL:.0e})",
        worst[0], worst[1], worst[2], worst[3]
    );
}

#[test]
fn linear_3d_equals_the_serial_layer() {
    // rows 12, inputs 8, outputs 16
    check_chain(&[8, 16], 7);
}

#[test]
fn two_consecutive_layers_swap_the_roles() {
    // 8 → 16 → 6: the second takes the first's output tiles as they are
    check_chain(&[8, 16, 6], 11);
}

/// Every rank's error, which must name `want`; no collective ran on the 3D groups.
fn refused_everywhere<T: std::fmt::Debug>(errs: Vec<Result<T>>, want: &str) {
    for (t, e) in errs.into_iter().enumerate() {
        let e = e.expect_err("refused").to_string();
        assert!(e.contains(want), "rank {t}: {e:?} should name {want:?}");
    }
}

#[test]
fn shapes_that_do_not_split_fail_on_every_rank_before_any_collective() {
    let w = weight_init(0);
    let lay = Layout3D::RowsJColsK;
    // inputs 6 do not split by q² = 4; outputs 5 not by q = 2
    let errs = on_ranks("3d:2", |_, g| {
        let mut m = manager(g.tensor().device().clone());
        Linear3D::register(&mut m, g, "fc", 6, 8, lay, &w, None)
    });
    refused_everywhere(errs, "fc: inputs = 6 does not split into 4 (q²)");
    let errs = on_ranks("3d:2", |_, g| {
        let mut m = manager(g.tensor().device().clone());
        Linear3D::register(&mut m, g, "fc", 8, 5, lay, &w, None)
    });
    refused_everywhere(errs, "fc: outputs = 5 does not split into 2 (q)");
    // rows 6 of a batch do not split by q²; an input tile of the wrong width
    let errs = on_ranks("3d:2", |_, g| -> Result<()> {
        let mut m = manager(g.tensor().device().clone());
        let layer = Linear3D::register(&mut m, g, "fc", 8, 4, lay, &w, None)?;
        let before = snapshot(g);
        let fwd = m.forward()?;
        let full = Act::upload(fwd.pool(), fwd.stream(), 6, 8, DType::F32, &[0.5; 48])?;
        let e = split_3d(&fwd, g, lay, &full).expect_err("6 rows");
        assert!(
            e.to_string()
                .contains("rows = 6 does not split into 4 (q²)"),
            "{e}"
        );
        let x = Act::upload(fwd.pool(), fwd.stream(), 3, 8, DType::F32, &[0.5; 24])?;
        let e = layer.forward(&fwd, g, &x).expect_err("8 columns");
        assert!(
            e.to_string()
                .contains("`x` is [3, 8] f32; expected [N, 4] f32"),
            "{e}"
        );
        assert_eq!(delta(g, &before), PassCost::default());
        Err(e)
    });
    refused_everywhere(errs, "expected [N, 4]");
}

#[test]
fn a_grid_that_is_not_3d_is_refused_on_every_rank() {
    let w = weight_init(0);
    for spec in ["2.5d:2x2", "1d:8"] {
        let errs = on_ranks(spec, |_, g| {
            let mut m = manager(g.tensor().device().clone());
            Linear3D::register(&mut m, g, "fc", 8, 8, Layout3D::RowsJColsK, &w, None)
        });
        refused_everywhere(
            errs,
            &format!("cannot be used with a grid of tensor mode {spec} (it needs a 3D grid"),
        );
    }
}
