//! 2D (SUMMA) and 2.5D (Tesseract) linear layers against the serial layer: on 4 ranks (2×2)
//! and 8 ranks (2×2×2), every rank's output, input-gradient, weight-gradient and
//! bias-gradient shard equals the serial f64 reference of `Y = X·W + b` (f32 within 1e-5 of
//! the tensor's scale), the collectives each group counts are the formulas', 2.5D with one
//! depth layer is the 2D layer bit for bit, and shapes that do not split are refused on every
//! rank before any collective.

mod common;

use std::time::Duration;

use tidemem::comm::{CommStats, Communicator};
use tidemem::nn::Act;
use tidemem::parallel::{
    gather_batch_2d, split_batch_2d, split_batch_2d_act, Cost, GridSpec, Linear2D, Linear2p5D,
    PassCost, ProcessGrid, TensorMode,
};
use tidemem::prelude::*;

const ROWS: usize = 8;
const IN: usize = 12;
const OUT: usize = 16;
const TOL: f64 = 1e-5;

fn uniform(seed: u64, lo: f32, hi: f32) -> Init {
    Init::Uniform { seed, lo, hi }
}

/// The masters: the weight `[OUT, IN]` (the serial layer's layout), the bias, the input and
/// the output gradient, from one seed each.
fn w_init() -> Init {
    uniform(7, -0.5, 0.5)
}
fn b_init() -> Init {
    uniform(8, -0.2, 0.2)
}
fn values(init: &Init, n: usize) -> Vec<f32> {
    (0..n).map(|i| init.value(i)).collect()
}
fn x_full() -> Vec<f32> {
    values(&uniform(9, -1.0, 1.0), ROWS * IN)
}
fn dy_full() -> Vec<f32> {
    values(&uniform(10, -1.0, 1.0), ROWS * OUT)
}

/// `(y, dx, dM, db)` of `y = x·Mᵀ + b` in f64, `M` `[OUT, IN]`.
fn reference() -> [Vec<f64>; 4] {
    let f = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<f64>>();
    let (m, b, x, dy) = (
        f(values(&w_init(), OUT * IN)),
        f(values(&b_init(), OUT)),
        f(x_full()),
        f(dy_full()),
    );
    let (mut y, mut dx) = (vec![0.0; ROWS * OUT], vec![0.0; ROWS * IN]);
    let (mut dm, mut db) = (vec![0.0; OUT * IN], vec![0.0; OUT]);
    for n in 0..ROWS {
        for o in 0..OUT {
            let g = dy[n * OUT + o];
            y[n * OUT + o] = b[o] + (0..IN).map(|i| x[n * IN + i] * m[o * IN + i]).sum::<f64>();
            db[o] += g;
            for i in 0..IN {
                dx[n * IN + i] += g * m[o * IN + i];
                dm[o * IN + i] += g * x[n * IN + i];
            }
        }
    }
    [y, dx, dm, db]
}

/// `|got − want| ≤ tol·(max|want| + |want|)` elementwise; returns the worst ratio.
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let mut worst = 0.0f64;
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs() / (scale + w.abs()).max(f64::MIN_POSITIVE);
        assert!(
            err <= tol,
            "{what}[{k}]: {g} vs {w} ({err:.2e} > {tol:.0e})"
        );
        worst = worst.max(err);
    }
    worst
}

/// Block `(rb of nrb, cb of ncb)` of a row-major `[rows, cols]` matrix.
fn block<T: Copy>(
    v: &[T],
    [rows, cols]: [usize; 2],
    [rb, nrb]: [usize; 2],
    [cb, ncb]: [usize; 2],
) -> Vec<T> {
    let (r, c) = (rows / nrb, cols / ncb);
    (0..r)
        .flat_map(|k| {
            let s = (rb * r + k) * cols + cb * c;
            v[s..s + c].to_vec()
        })
        .collect()
}

/// Tensor rank `t`'s place, written from the layouts: `(row, col, batch row block, row
/// blocks)`; 2D `t = row·q + col`, 2.5D `t = col + q·row + q²·dep`.
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

fn q_of(mode: TensorMode) -> usize {
    match mode {
        TensorMode::TwoD { q } | TensorMode::TwoHalfD { q, .. } => q,
        m => panic!("{m}"),
    }
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
    let devs = (0..world).map(|_| common::sim(16 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, Duration::from_secs(20)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn manager(dev: Device) -> ChunkManager {
    let mut cfg = ManagerConfig::new(1024, Policy::Tide);
    cfg.param_dtype = DType::F32;
    ChunkManager::new(dev, cfg).unwrap()
}

#[derive(Clone, Copy)]
enum Layer {
    Two(Linear2D),
    TwoHalf(Linear2p5D),
}

impl Layer {
    fn register(m: &mut ChunkManager, grid: &ProcessGrid, bias: bool) -> Result<Layer> {
        let (w, b) = (w_init(), b_init());
        let b = bias.then_some(&b);
        Ok(match grid.spec().tensor {
            TensorMode::TwoD { .. } => {
                Layer::Two(Linear2D::register(m, grid, "fc", IN, OUT, &w, b)?)
            }
            _ => Layer::TwoHalf(Linear2p5D::register(m, grid, "fc", IN, OUT, &w, b)?),
        })
    }
    fn params(&self) -> Vec<TensorId> {
        match self {
            Layer::Two(l) => l.params(),
            Layer::TwoHalf(l) => l.params(),
        }
    }
    fn forward(&self, p: &ForwardPass<'_>, g: &ProcessGrid, x: &Act) -> Result<Act> {
        match self {
            Layer::Two(l) => l.forward(p, g, x),
            Layer::TwoHalf(l) => l.forward(p, g, x),
        }
    }
    fn backward(
        &self,
        p: &BackwardPass<'_>,
        g: &ProcessGrid,
        x: &Act,
        dy: &Act,
        dx: bool,
    ) -> Result<Option<Act>> {
        match self {
            Layer::Two(l) => l.backward(p, g, x, dy, dx),
            Layer::TwoHalf(l) => l.backward(p, g, x, dy, dx),
        }
    }
    fn collectives(&self, rows: usize, need_dx: bool) -> Result<Cost> {
        match self {
            Layer::Two(l) => l.collectives(rows, DType::F32, need_dx),
            Layer::TwoHalf(l) => l.collectives(rows, DType::F32, need_dx),
        }
    }
}

struct RankOut {
    t: usize,
    y: Vec<f32>,
    dx: Option<Vec<f32>>,
    dw: Vec<f32>,
    db: Option<Vec<f32>>,
    fwd: PassCost,
    bwd: PassCost,
    /// What the world and tensor communicators did meanwhile (nothing).
    others: [CommStats; 2],
    expected: Cost,
}

fn group_stats(grid: &ProcessGrid) -> PassCost {
    PassCost {
        row: grid.row().unwrap().stats(),
        col: grid.col().unwrap().stats(),
        dep: grid.dep().map(|d| d.stats()).unwrap_or_default(),
        ..PassCost::default()
    }
}

fn since(a: &PassCost, b: &PassCost) -> PassCost {
    PassCost {
        row: a.row.since(&b.row),
        col: a.col.since(&b.col),
        dep: a.dep.since(&b.dep),
        ..PassCost::default()
    }
}

fn run_rank(c: &Communicator, mode: TensorMode, bias: bool, need_dx: bool) -> RankOut {
    let grid = ProcessGrid::new(c, spec(mode)).unwrap();
    let mut m = manager(c.device().clone());
    let layer = Layer::register(&mut m, &grid, bias).unwrap();
    let xb = split_batch_2d(&grid, &x_full(), ROWS, IN).unwrap();
    let dyb = split_batch_2d(&grid, &dy_full(), ROWS, OUT).unwrap();
    let q = q_of(mode);
    let rows_l = xb.len() / (IN / q);
    let (w0, t0, s0) = (c.stats(), grid.tensor().stats(), group_stats(&grid));
    let fwd = m.forward().unwrap();
    let xa = Act::upload(fwd.pool(), fwd.stream(), rows_l, IN / q, DType::F32, &xb).unwrap();
    let y = layer.forward(&fwd, &grid, &xa).unwrap();
    let y = y.to_f32(fwd.stream()).unwrap();
    fwd.finish().unwrap();
    let s1 = group_stats(&grid);
    let bwd = m.backward().unwrap();
    let da = Act::upload(bwd.pool(), bwd.stream(), rows_l, OUT / q, DType::F32, &dyb).unwrap();
    let dx = layer.backward(&bwd, &grid, &xa, &da, need_dx).unwrap();
    let dx = dx.map(|d| d.to_f32(bwd.stream()).unwrap());
    drop((da, xa));
    bwd.finish().unwrap();
    let s2 = group_stats(&grid);
    let others = [c.stats().since(&w0), grid.tensor().stats().since(&t0)];
    let ids = layer.params();
    RankOut {
        t: grid.tensor_rank(),
        y,
        dx,
        dw: m.read(ids[0]).unwrap(),
        db: ids.get(1).map(|&b| m.read(b).unwrap()),
        fwd: since(&s1, &s0),
        bwd: since(&s2, &s1),
        others,
        expected: layer.collectives(ROWS, need_dx).unwrap(),
    }
}

/// Runs the layer on every rank and checks every shard and the collectives; returns the
/// outputs.
fn check(world: usize, mode: TensorMode, bias: bool, need_dx: bool) -> Vec<RankOut> {
    let [y, dx, dm, db] = reference();
    let outs = on_ranks(world, |c| run_rank(c, mode, bias, need_dx));
    let q = q_of(mode);
    let mut worst = 0.0f64;
    for o in &outs {
        let (row, col, rb, nrb) = place(mode, o.t);
        let what = format!("{mode} bias {bias}, rank {} (row {row}, col {col})", o.t);
        let want_y = block(&y, [ROWS, OUT], [rb, nrb], [col, q]);
        let want_y = if bias {
            want_y
        } else {
            // the reference without its bias
            let b = block(&reference_bias_rows(), [ROWS, OUT], [rb, nrb], [col, q]);
            want_y.iter().zip(b).map(|(y, b)| y - b).collect()
        };
        worst = worst.max(close(&format!("{what}: y"), &o.y, &want_y, TOL));
        match &o.dx {
            Some(got) => {
                let want = block(&dx, [ROWS, IN], [rb, nrb], [col, q]);
                worst = worst.max(close(&format!("{what}: dx"), got, &want, TOL));
            }
            None => assert!(!need_dx, "{what}: dx missing"),
        }
        let want = block(&dm, [OUT, IN], [col, q], [row, q]);
        worst = worst.max(close(&format!("{what}: dW"), &o.dw, &want, TOL));
        match &o.db {
            Some(got) => {
                let piece = OUT / (q * q);
                let at = col * OUT / q + row * piece;
                worst = worst.max(close(&format!("{what}: db"), got, &db[at..at + piece], TOL));
            }
            None => assert!(!bias, "{what}: bias missing"),
        }
        assert_eq!(o.fwd, o.expected.forward, "{what}: forward collectives");
        assert_eq!(o.bwd, o.expected.backward, "{what}: backward collectives");
        assert_eq!(o.others, [CommStats::default(); 2], "{what}: other groups");
    }
    eprintln!("{mode} on {world} ranks, bias {bias}, dx {need_dx}: worst error {worst:.2e} (bound {TOL:.0e})");
    outs
}

/// The bias broadcast to every row, `[ROWS, OUT]`.
fn reference_bias_rows() -> Vec<f64> {
    let b = values(&b_init(), OUT);
    (0..ROWS * OUT).map(|k| f64::from(b[k % OUT])).collect()
}

#[test]
fn linear_2d_equals_the_serial_layer_on_4_ranks() {
    let outs = check(4, TensorMode::TwoD { q: 2 }, true, true);
    // the formulas, spelled out for one rank: q = 2 broadcasts of X (4×6) in ROW and of W
    // (8×6) in COL, and the bias block (8) gathered in COL
    let e = outs[0].expected;
    assert_eq!(
        (e.forward.row.broadcast.calls, e.forward.row.broadcast.bytes),
        (2, 2 * 24 * 4)
    );
    assert_eq!(
        (e.forward.col.broadcast.calls, e.forward.col.broadcast.bytes),
        (2, 2 * 48 * 4)
    );
    assert_eq!(
        (
            e.forward.col.all_gather.calls,
            e.forward.col.all_gather.bytes
        ),
        (1, 8 * 4)
    );
    assert_eq!(
        (e.backward.col.reduce.calls, e.backward.row.reduce.calls),
        (2, 2)
    );
    assert_eq!(e.backward.col.reduce_scatter.bytes, 8 * 4);
    check(4, TensorMode::TwoD { q: 2 }, false, false);
}

#[test]
fn linear_2p5d_equals_the_serial_layer_on_8_ranks() {
    let outs = check(8, TensorMode::TwoHalfD { q: 2, depth: 2 }, true, true);
    // depth 2: the weight (8×6) and bias piece (4, f32) gradients all-reduced over DEP
    let e = outs[0].expected.backward.dep.all_reduce;
    assert_eq!((e.calls, e.bytes), (2, (48 + 4) * 4));
    // one rank a layer: the batch split four ways, no SUMMA steps to speak of
    check(4, TensorMode::TwoHalfD { q: 1, depth: 4 }, true, false);
}

#[test]
fn linear_2p5d_with_one_depth_layer_is_the_2d_layer_bit_for_bit() {
    let two = check(4, TensorMode::TwoD { q: 2 }, true, true);
    let half = check(4, TensorMode::TwoHalfD { q: 2, depth: 1 }, true, true);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (a, b) in two.iter().zip(&half) {
        assert_eq!(a.t, b.t);
        assert_eq!(bits(&a.y), bits(&b.y), "rank {}: y", a.t);
        assert_eq!(
            bits(a.dx.as_ref().unwrap()),
            bits(b.dx.as_ref().unwrap()),
            "rank {}: dx",
            a.t
        );
        assert_eq!(bits(&a.dw), bits(&b.dw), "rank {}: dW", a.t);
        assert_eq!(
            bits(a.db.as_ref().unwrap()),
            bits(b.db.as_ref().unwrap()),
            "rank {}: db",
            a.t
        );
        assert_eq!((a.fwd, a.bwd), (b.fwd, b.bwd), "rank {}: collectives", a.t);
    }
}

#[test]
fn batch_helpers_split_and_gather_on_the_device() {
    for (world, mode) in [
        (4, TensorMode::TwoD { q: 2 }),
        (8, TensorMode::TwoHalfD { q: 2, depth: 2 }),
    ] {
        let x = x_full();
        on_ranks(world, |c| {
            let grid = ProcessGrid::new(c, spec(mode)).unwrap();
            let mut m = manager(c.device().clone());
            let pass = m.forward().unwrap();
            let (pool, s) = (pass.pool(), pass.stream());
            let full = Act::upload(pool, s, ROWS, IN, DType::F32, &x).unwrap();
            let mine = split_batch_2d_act(pool, s, &grid, &full).unwrap();
            let host = split_batch_2d(&grid, &x, ROWS, IN).unwrap();
            assert_eq!(
                mine.to_f32(s).unwrap(),
                host,
                "{mode}: device split = host split"
            );
            let back = gather_batch_2d(pool, s, &grid, &mine).unwrap();
            assert_eq!(back.shape(), [ROWS, IN]);
            assert_eq!(back.to_f32(s).unwrap(), x, "{mode}: gathered = full");
        });
    }
}

/// Every rank's error, as a string (each must be one).
fn errors<T>(world: usize, f: impl Fn(&Communicator) -> Result<T> + Sync) -> Vec<String> {
    on_ranks(world, |c| f(c).err().map(|e| e.to_string()))
        .into_iter()
        .enumerate()
        .map(|(r, e)| e.unwrap_or_else(|| panic!("rank {r} was not refused")))
        .collect()
}

#[test]
fn shapes_that_do_not_split_are_refused_on_every_rank() {
    let two = TensorMode::TwoD { q: 2 };
    let half = TensorMode::TwoHalfD { q: 2, depth: 2 };
    let reg = |mode, inputs, outputs, bias: bool| {
        move |c: &Communicator| -> Result<()> {
            let grid = ProcessGrid::new(c, spec(mode))?;
            let mut m = manager(c.device().clone());
            let (w, b) = (w_init(), b_init());
            let b = bias.then_some(&b);
            match mode {
                TensorMode::TwoD { .. } => {
                    Linear2D::register(&mut m, &grid, "fc", inputs, outputs, &w, b).map(drop)
                }
                _ => Linear2p5D::register(&mut m, &grid, "fc", inputs, outputs, &w, b).map(drop),
            }
        }
    };
    for e in errors(4, reg(two, 13, OUT, false)) {
        assert!(e.contains("fc: inputs = 13") && e.contains("2 (q)"), "{e}");
    }
    for e in errors(8, reg(half, IN, 15, false)) {
        assert!(e.contains("fc: outputs = 15"), "{e}");
    }
    // 18 outputs split by q = 2, but the bias not into q² = 4 pieces
    for e in errors(4, reg(two, IN, 18, true)) {
        assert!(
            e.contains("outputs (with a bias) = 18") && e.contains("4 (q²)"),
            "{e}"
        );
    }
    // a layer on a grid of another mode
    for e in errors(4, reg(TensorMode::OneD { size: 4 }, IN, OUT, true)) {
        assert!(
            e.contains("Linear2p5D 'fc' cannot be used with a grid of tensor mode 1d:4")
                && e.contains("it runs on a 2.5D grid"),
            "{e}"
        );
    }
    for e in errors(4, |c| {
        let grid = ProcessGrid::new(c, spec(TensorMode::TwoHalfD { q: 2, depth: 1 }))?;
        Linear2D::register(
            &mut manager(c.device().clone()),
            &grid,
            "fc",
            IN,
            OUT,
            &w_init(),
            None,
        )
    }) {
        assert!(
            e.contains("Linear2D 'fc' cannot be used with a grid of tensor mode 2.5d:2x1")
                && e.contains("it runs on a 2D grid"),
            "{e}"
        );
    }
    // rows that do not split over d·q = 4 row blocks
    for e in errors(8, |c| {
        let grid = ProcessGrid::new(c, spec(half))?;
        split_batch_2d(&grid, &vec![0.0; 6 * IN], 6, IN)
    }) {
        assert!(
            e.contains("rows = 6") && e.contains("4 (row blocks)"),
            "{e}"
        );
    }
    for e in errors(8, |c| {
        let grid = ProcessGrid::new(c, spec(half))?;
        let l = Linear2p5D::register(
            &mut manager(c.device().clone()),
            &grid,
            "fc",
            IN,
            OUT,
            &w_init(),
            None,
        )?;
        l.collectives(6, DType::F32, true)
    }) {
        assert!(e.contains("rows = 6"), "{e}");
    }
    // an input of the wrong width, and a layer run on another grid: refused before any collective
    for e in errors(4, |c| {
        let grid = ProcessGrid::new(c, spec(two))?;
        let mut m = manager(c.device().clone());
        let l = Linear2D::register(&mut m, &grid, "fc", IN, OUT, &w_init(), Some(&b_init()))?;
        let pass = m.forward()?;
        let x = Act::upload(
            pass.pool(),
            pass.stream(),
            4,
            IN,
            DType::F32,
            &[0.0; 4 * IN],
        )?;
        l.forward(&pass, &grid, &x)
    }) {
        assert!(e.contains("`x` is [4, 12]") && e.contains("[N, 6]"), "{e}");
    }
    for e in errors(4, |c| {
        let grid = ProcessGrid::new(c, spec(two))?;
        let other = ProcessGrid::new(c, spec(TensorMode::OneD { size: 4 }))?;
        let mut m = manager(c.device().clone());
        let l = Linear2D::register(&mut m, &grid, "fc", IN, OUT, &w_init(), None)?;
        let pass = m.forward()?;
        let x = Act::upload(
            pass.pool(),
            pass.stream(),
            4,
            IN / 2,
            DType::F32,
            &[0.0; 4 * IN / 2],
        )?;
        l.forward(&pass, &other, &x)
    }) {
        assert!(
            e.contains("runs on its 2d:2 grid") && e.contains("1d:4"),
            "{e}"
        );
    }
}
