//! The ends of a model on the 3D cube against the serial f64 reference, on 8 in-process ranks
//! (q = 2), in both layouts: the token embedding with the vocabulary split
//! (`VocabEmbedding3D`) plus the position embedding (`Embedding3D`), the LM head tied to the
//! token embedding and an untied classifier with a bias (`Classifier3D`, some targets the
//! ignore index). Every rank's output tile, the loss, the input-gradient tile and every weight
//! and bias gradient shard (the tied `wte`'s: the embedding's share plus the head's) within
//! 1e-5 of the tensor's scale; the collectives of every layer, by group, equal to
//! `collectives()` and to the formulas; shapes that do not split and grids that are not 3D fail
//! on every rank before any collective.

mod common;
mod nn_ref;

use std::time::Duration;

use tidemem::comm::{CommStats, Communicator, Tally};
use tidemem::parallel::{
    Classifier3D, Cost, Embedding3D, GridSpec, Layout3D, PassCost, ProcessGrid, VocabEmbedding3D,
};
use tidemem::parallel::{GridClassifier, GridLookup};
use tidemem::prelude::*;

use nn_ref::{close, f64s, linear, linear_bwd, manager};

const Q: usize = 2;
const WORLD: usize = Q * Q * Q;
const B: usize = 2;
const T: usize = 4;
const C: usize = 8;
const NH: usize = 2;
const N: usize = B * T;
const EPS: f32 = 1e-5;
/// Rows of the whole batch.
const R: usize = N;
/// The vocabulary, and the classes of the untied classifier.
const V: usize = 16;
const K: usize = 8;
const IGNORE: i32 = -100;
const TOL: f64 = 1e-5;

fn master(seed: u64, lo: f32, hi: f32) -> Init {
    Init::Uniform { seed, lo, hi }
}

fn values(init: &Init, n: usize) -> Vec<f64> {
    (0..n).map(|e| f64::from(init.value(e))).collect()
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

/// Rank `t`'s [`Linear3D`](tidemem::parallel::Linear3D) shard `[in/q², out/q]` of the master
/// `[out, in]` for input rows by `j` (`rows_j`): `(r, s)` is `M[a·out/q + s, c·in/q + i·in/q²
/// + r]`.
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

/// Rank `t`'s piece of an `Embedding3D` table `[rows, cols]`: rows `i·rows/q ..`, columns
/// `c·cols/q ..`.
fn table_piece(m: &[f64], rows: usize, cols: usize, t: usize, rows_j: bool) -> Vec<f64> {
    let (i, _, c) = axes(t, rows_j);
    let (rq, cq) = (rows / Q, cols / Q);
    (i * rq..(i + 1) * rq)
        .flat_map(|r| m[r * cols + c * cq..r * cols + (c + 1) * cq].to_vec())
        .collect()
}

// ---- the serial f64 reference ----

/// `table[ids[n]]`, `[ids.len(), cols]`.
fn lookup(table: &[f64], ids: &[i32], cols: usize) -> Vec<f64> {
    ids.iter()
        .flat_map(|&t| table[t as usize * cols..(t as usize + 1) * cols].to_vec())
        .collect()
}

/// The lookup's backward: `dout` scattered into a table of `rows`.
fn lookup_bwd(dout: &[f64], ids: &[i32], rows: usize, cols: usize) -> Vec<f64> {
    let mut d = vec![0.0; rows * cols];
    for (n, &t) in ids.iter().enumerate() {
        for c in 0..cols {
            d[t as usize * cols + c] += dout[n * cols + c];
        }
    }
    d
}

/// The mean softmax cross-entropy of `logits` `[R, v]` over the rows whose target is not
/// [`IGNORE`], and its gradient.
fn ce_ref(logits: &[f64], targets: &[i32], v: usize) -> (f64, Vec<f64>) {
    let counted = targets.iter().filter(|&&t| t != IGNORE).count() as f64;
    let (mut loss, mut d) = (0.0, vec![0.0; logits.len()]);
    for (n, &t) in targets.iter().enumerate() {
        if t == IGNORE {
            continue;
        }
        let lg = &logits[n * v..(n + 1) * v];
        let m = lg.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let z: f64 = lg.iter().map(|l| (l - m).exp()).sum();
        loss += z.ln() - (lg[t as usize] - m);
        for k in 0..v {
            let hot = if k == t as usize { 1.0 } else { 0.0 };
            d[n * v + k] = ((lg[k] - m).exp() / z - hot) / counted;
        }
    }
    (loss / counted, d)
}

// ---- the ranks ----

fn on_ranks<Out: Send>(
    spec: &str,
    world: usize,
    f: impl Fn(&ProcessGrid) -> Out + Sync,
) -> Vec<Out> {
    let devs = (0..world).map(|_| common::sim(16 << 20)).collect();
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
        g.tensor().stats(),
        g.plane().unwrap().stats(),
    ]
}

/// The collectives since `before`, by group; the plane must have done nothing.
fn delta(g: &ProcessGrid, before: &[CommStats; 5]) -> PassCost {
    let now = snapshot(g);
    let d: Vec<CommStats> = now.iter().zip(before).map(|(n, b)| n.since(b)).collect();
    assert_eq!(d[4], CommStats::default(), "collectives on the plane");
    PassCost {
        input: d[0],
        weight: d[1],
        output: d[2],
        tensor: d[3],
        ..PassCost::default()
    }
}

/// `(calls, f32 elements)` of the all-gathers, reduce-scatters and all-reduces on one group.
type Calls = [(u64, usize); 3];

fn stats(ag: (u64, usize), rs: (u64, usize), ar: (u64, usize)) -> CommStats {
    let t = |(calls, elems): (u64, usize)| Tally {
        calls,
        bytes: (elems * 4) as u64,
    };
    CommStats {
        all_gather: t(ag),
        reduce_scatter: t(rs),
        all_reduce: t(ar),
        ..CommStats::default()
    }
}

/// The calls on the layout's row group `A`, the weight group, its column group `G` and, with
/// `tensor`, one f64 all-reduce on the tensor group, by the grid's groups: the formulas.
fn groups(rows_j: bool, a: Calls, w: Calls, c: Calls, tensor: bool) -> PassCost {
    let [a, w, c] = [a, w, c].map(|[ag, rs, ar]| stats(ag, rs, ar));
    let (input, output) = if rows_j { (a, c) } else { (c, a) };
    let mut tensor_stats = CommStats::default();
    if tensor {
        tensor_stats.all_reduce = Tally { calls: 1, bytes: 8 };
    }
    PassCost {
        input,
        weight: w,
        output,
        tensor: tensor_stats,
        ..PassCost::default()
    }
}

const NONE: (u64, usize) = (0, 0);

/// The formulas, f32, `n = R/q²` rows a tile.
fn formula_vocab(rows_j: bool) -> Cost {
    let (n, cq, vq) = (R / (Q * Q), C / Q, V / Q);
    let z = [NONE; 3];
    Cost {
        // W̃ all-gather; the partial lookups' reduce-scatter
        forward: groups(
            rows_j,
            [NONE, (1, Q * n * cq), NONE],
            [(1, cq * vq), NONE, NONE],
            z,
            false,
        ),
        // the tile gradient's all-gather; the shard's reduce-scatter
        backward: groups(
            rows_j,
            [(1, Q * n * cq), NONE, NONE],
            [NONE, (1, cq * vq), NONE],
            z,
            false,
        ),
    }
}

fn formula_positions(rows_j: bool) -> Cost {
    let cq = C / Q;
    let z = [NONE; 3];
    Cost {
        forward: groups(rows_j, z, [(1, T * cq), NONE, NONE], z, false),
        backward: groups(
            rows_j,
            [NONE, NONE, (1, T / Q * cq)],
            [NONE, (1, T * cq), NONE],
            z,
            false,
        ),
    }
}

/// A classifier `C → classes` on input tiles in the layout: Linear3D's, the cross-entropy's
/// all-reduces of `n` and `2n` f32 on `A`, the loss's f64 on the tensor group.
fn formula_classifier(rows_j: bool, classes: usize, bias: bool) -> Cost {
    let (n, iq, oq) = (R / (Q * Q), C / Q, classes / Q);
    let db = if bias { (1, oq) } else { NONE };
    Cost {
        forward: groups(
            rows_j,
            [(1, Q * n * iq), NONE, (2, 3 * n)],
            [(1, iq * oq), NONE, NONE],
            [NONE, (1, Q * n * oq), NONE],
            true,
        ),
        backward: groups(
            rows_j,
            [NONE, (1, Q * n * iq), NONE],
            [NONE, (1, iq * oq), db],
            [(1, Q * n * oq), NONE, NONE],
            false,
        ),
    }
}

fn tokens() -> Vec<i32> {
    (0..R).map(|r| ((r * 7 + 3) % V) as i32).collect()
}

fn positions() -> Vec<i32> {
    (0..R).map(|r| (r % T) as i32).collect()
}

/// Targets in `0..classes`, two of them the ignore index.
fn targets(classes: usize) -> Vec<i32> {
    let mut t: Vec<i32> = (0..R).map(|r| ((r * 5 + 1) % classes) as i32).collect();
    t[2] = IGNORE;
    t[R - 1] = IGNORE;
    t
}

/// What a rank gives of the tied model: token tile, position tile, loss, dh tile, wte and
/// wpe gradient shards, the measured and expected collectives of (wte, wpe, head).
struct TiedOut {
    tok: Vec<f32>,
    pos: Vec<f32>,
    loss: f32,
    dh: Vec<f32>,
    dwte: Vec<f32>,
    dwpe: Vec<f32>,
    measured: [Cost; 3],
    expected: [Cost; 3],
}

fn tied_rank(grid: &ProcessGrid, layout: Layout3D, wte: &Init, wpe: &Init) -> TiedOut {
    let mut m = manager(grid.tensor().device().clone(), DType::F32);
    let emb = VocabEmbedding3D::register(&mut m, grid, "wte", V, C, layout, wte).unwrap();
    let pe = Embedding3D::register(&mut m, grid, "wpe", T, C, layout, wpe).unwrap();
    let head = Classifier3D::tied(&m, &emb, IGNORE).unwrap();
    let (d, n) = (DType::F32, R / (Q * Q));
    let mut measured = [Cost::default(); 3];
    let fwd = m.forward().unwrap();
    let s0 = snapshot(grid);
    let (tok, es) = emb.forward(&fwd, grid, &tokens()).unwrap();
    measured[0].forward = delta(grid, &s0);
    let s1 = snapshot(grid);
    let (pos, ps) = pe.forward(&fwd, grid, &positions()).unwrap();
    measured[1].forward = delta(grid, &s1);
    let (tok, pos) = (
        tok.to_f32(fwd.stream()).unwrap(),
        pos.to_f32(fwd.stream()).unwrap(),
    );
    let x: Vec<f32> = tok.iter().zip(&pos).map(|(a, b)| a + b).collect();
    let h = Act::upload(fwd.pool(), fwd.stream(), n, C / Q, d, &x).unwrap();
    let s2 = snapshot(grid);
    let (loss, hs) = head.forward(&fwd, grid, &h, &targets(V), 1.0).unwrap();
    measured[2].forward = delta(grid, &s2);
    drop(h);
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let s3 = snapshot(grid);
    let dh = head.backward(&bwd, grid, &hs).unwrap();
    measured[2].backward = delta(grid, &s3);
    let s4 = snapshot(grid);
    emb.backward(&bwd, grid, &es, &dh).unwrap();
    measured[0].backward = delta(grid, &s4);
    let s5 = snapshot(grid);
    pe.backward(&bwd, grid, &ps, &dh).unwrap();
    measured[1].backward = delta(grid, &s5);
    let dhh = dh.to_f32(bwd.stream()).unwrap();
    drop((dh, hs, es, ps));
    bwd.finish().unwrap();
    TiedOut {
        tok,
        pos,
        loss,
        dh: dhh,
        dwte: m.read(emb.weight).unwrap(),
        dwpe: m.read(pe.weight).unwrap(),
        measured,
        expected: [
            emb.collectives(n, d),
            pe.collectives(d),
            head.collectives(n, d),
        ],
    }
}

#[test]
fn vocab_embedding_and_tied_head_equal_the_serial_ones() {
    let (wte_i, wpe_i) = (master(31, -0.5, 0.5), master(32, -0.5, 0.5));
    let (wte, wpe) = (values(&wte_i, V * C), values(&wpe_i, T * C));
    let (tok, pos, tgt) = (tokens(), positions(), targets(V));
    let (te, pe) = (lookup(&wte, &tok, C), lookup(&wpe, &pos, C));
    let x: Vec<f64> = te.iter().zip(&pe).map(|(a, b)| a + b).collect();
    let logits = linear(&x, &wte, &[0.0; V], C, V);
    let (loss, dlogits) = ce_ref(&logits, &tgt, V);
    let [dh, dwte_head, _] = linear_bwd(&x, &wte, &dlogits, C, V);
    let dwte: Vec<f64> = lookup_bwd(&dh, &tok, V, C)
        .iter()
        .zip(&dwte_head)
        .map(|(a, b)| a + b)
        .collect();
    let dwpe = lookup_bwd(&dh, &pos, T, C);
    for layout in [Layout3D::RowsJColsK, Layout3D::RowsKColsJ] {
        let rows_j = layout == Layout3D::RowsJColsK;
        let outs = on_ranks("3d:2", WORLD, |g| tied_rank(g, layout, &wte_i, &wpe_i));
        let mut worst = [0.0f64; 5];
        for (t, o) in outs.iter().enumerate() {
            let what = format!("{layout:?}, rank {t}");
            let tile = |v: &[f64]| tile_of(v, R, C, t, rows_j);
            worst[0] = worst[0].max(close(&format!("{what}: wte tile"), &o.tok, &tile(&te), TOL));
            worst[0] = worst[0].max(close(&format!("{what}: wpe tile"), &o.pos, &tile(&pe), TOL));
            worst[1] = worst[1].max(close(&format!("{what}: loss"), &[o.loss], &[loss], TOL));
            worst[2] = worst[2].max(close(&format!("{what}: dh"), &o.dh, &tile(&dh), TOL));
            let want = weight_shard(&dwte, C, V, t, rows_j);
            worst[3] = worst[3].max(close(&format!("{what}: dwte"), &o.dwte, &want, TOL));
            let want = table_piece(&dwpe, T, C, t, rows_j);
            worst[4] = worst[4].max(close(&format!("{what}: dwpe"), &o.dwpe, &want, TOL));
            let formulas = [
                formula_vocab(rows_j),
                formula_positions(rows_j),
                formula_classifier(rows_j, V, false),
            ];
            for (l, name) in ["wte", "wpe", "head"].iter().enumerate() {
                assert_eq!(o.expected[l], formulas[l], "{what}: {name}: collectives()");
                assert_eq!(o.measured[l], formulas[l], "{what}: {name}: measured");
            }
        }
        eprintln!(
            "3D ends, tied, {layout:?}: worst error embeddings {:.2e}, loss {:.2e}, dh {:.2e}, \
             dwte {:.2e}, dwpe {:.2e} (bound {TOL:.0e})",
            worst[0], worst[1], worst[2], worst[3], worst[4]
        );
    }
}

/// What a rank gives of the untied classifier: loss, dh tile, weight and bias gradient
/// shards, measured and expected collectives.
type UntiedOut = (f32, Vec<f32>, Vec<f32>, Vec<f32>, Cost, Cost);

fn untied_rank(grid: &ProcessGrid, layout: Layout3D, x: &[f64], w: &Init, b: &Init) -> UntiedOut {
    let mut m = manager(grid.tensor().device().clone(), DType::F32);
    let rows_j = layout == Layout3D::RowsJColsK;
    let cls =
        Classifier3D::register(&mut m, grid, "cls", C, K, layout, w, Some(b), IGNORE).unwrap();
    let (d, n) = (DType::F32, R / (Q * Q));
    let mut measured = Cost::default();
    let fwd = m.forward().unwrap();
    let xt = f32s(&tile_of(x, R, C, grid.tensor_rank(), rows_j));
    let h = Act::upload(fwd.pool(), fwd.stream(), n, C / Q, d, &xt).unwrap();
    let s0 = snapshot(grid);
    let (loss, saved) = cls.forward(&fwd, grid, &h, &targets(K), 2.0).unwrap();
    measured.forward = delta(grid, &s0);
    drop(h);
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let s1 = snapshot(grid);
    let dh = cls.backward(&bwd, grid, &saved).unwrap();
    measured.backward = delta(grid, &s1);
    let dhh = dh.to_f32(bwd.stream()).unwrap();
    drop((dh, saved));
    bwd.finish().unwrap();
    let dw = m.read(cls.linear.weight).unwrap();
    let db = m.read(cls.linear.bias.unwrap()).unwrap();
    (loss, dhh, dw, db, measured, cls.collectives(n, d))
}

#[test]
fn an_untied_classifier_with_a_bias_equals_the_serial_one() {
    let (w_i, b_i) = (master(41, -0.5, 0.5), master(42, -0.3, 0.3));
    let (w, b) = (values(&w_i, K * C), values(&b_i, K));
    let x = values(&master(43, -1.0, 1.0), R * C);
    let x = f64s(&f32s(&x));
    let tgt = targets(K);
    let (loss, dlogits) = ce_ref(&linear(&x, &w, &b, C, K), &tgt, K);
    // the loss scale 2 doubles every gradient, not the loss
    let dlogits: Vec<f64> = dlogits.iter().map(|g| 2.0 * g).collect();
    let [dh, dw, db] = linear_bwd(&x, &w, &dlogits, C, K);
    for layout in [Layout3D::RowsJColsK, Layout3D::RowsKColsJ] {
        let rows_j = layout == Layout3D::RowsJColsK;
        let outs = on_ranks("3d:2", WORLD, |g| untied_rank(g, layout, &x, &w_i, &b_i));
        let mut worst = [0.0f64; 4];
        for (t, (l, gdh, gdw, gdb, measured, expected)) in outs.iter().enumerate() {
            let what = format!("{layout:?}, rank {t}");
            worst[0] = worst[0].max(close(&format!("{what}: loss"), &[*l], &[loss], TOL));
            let want = tile_of(&dh, R, C, t, rows_j);
            worst[1] = worst[1].max(close(&format!("{what}: dh"), gdh, &want, TOL));
            let want = weight_shard(&dw, C, K, t, rows_j);
            worst[2] = worst[2].max(close(&format!("{what}: dW"), gdw, &want, TOL));
            let want = bias_shard(&db, K, t, rows_j);
            worst[3] = worst[3].max(close(&format!("{what}: db"), gdb, &want, TOL));
            let f = formula_classifier(rows_j, K, true);
            assert_eq!(*expected, f, "{what}: collectives()");
            assert_eq!(*measured, f, "{what}: measured");
        }
        eprintln!(
            "3D classifier, {layout:?}: worst error loss {:.2e}, dh {:.2e}, dW {:.2e}, \
             db {:.2e} (bound {TOL:.0e})",
            worst[0], worst[1], worst[2], worst[3]
        );
    }
}

/// Every rank's error, which must name `want`.
fn refused_everywhere<X: std::fmt::Debug>(errs: Vec<Result<X>>, want: &str) {
    for (t, e) in errs.into_iter().enumerate() {
        let e = e.expect_err("refused").to_string();
        assert!(e.contains(want), "rank {t}: {e:?} should name {want:?}");
    }
}

#[test]
fn shapes_that_do_not_split_fail_on_every_rank_before_any_collective() {
    let w = master(51, -0.5, 0.5);
    let lay = Layout3D::RowsJColsK;
    let reg = |v: usize, c: usize| {
        on_ranks("3d:2", WORLD, |g| {
            let mut m = manager(g.tensor().device().clone(), DType::F32);
            VocabEmbedding3D::register(&mut m, g, "wte", v, c, lay, &w)
        })
    };
    refused_everywhere(
        reg(15, C),
        "wte: vocabulary = 15 does not split into 2 (q ranks of a 3D cube",
    );
    refused_everywhere(reg(V, 6), "wte: channels = 6 does not split into 4 (q²)");
    let errs = on_ranks("3d:2", WORLD, |g| {
        let mut m = manager(g.tensor().device().clone(), DType::F32);
        Embedding3D::register(&mut m, g, "wpe", 5, C, lay, &w)
    });
    refused_everywhere(errs, "wpe: table rows = 5 does not split into 2 (q)");
    let errs = on_ranks("3d:2", WORLD, |g| {
        let mut m = manager(g.tensor().device().clone(), DType::F32);
        Classifier3D::register(&mut m, g, "cls", C, 5, lay, &w, None, IGNORE)
    });
    refused_everywhere(errs, "cls: classes = 5 does not split into 2 (q)");
    // 6 rows do not split by q² = 4: every forward refuses them, with no collective
    let errs = on_ranks("3d:2", WORLD, |g| -> Result<()> {
        let mut m = manager(g.tensor().device().clone(), DType::F32);
        let emb = VocabEmbedding3D::register(&mut m, g, "wte", V, C, lay, &w)?;
        let pe = Embedding3D::register(&mut m, g, "wpe", T, C, lay, &w)?;
        let head = Classifier3D::tied(&m, &emb, IGNORE)?;
        let before = snapshot(g);
        let fwd = m.forward()?;
        let ids = [1i32; 6];
        let rows = "rows = 6 does not split into 4 (q²)";
        let e = emb
            .forward(&fwd, g, &ids)
            .expect_err("6 tokens")
            .to_string();
        assert!(e.contains(rows), "{e}");
        let e = pe.forward(&fwd, g, &ids).expect_err("6 ids").to_string();
        assert!(e.contains(rows), "{e}");
        let h = Act::upload(fwd.pool(), fwd.stream(), 2, C / Q, DType::F32, &[0.5; 8])?;
        let e = head.forward(&fwd, g, &h, &ids, 1.0).expect_err("6 targets");
        assert!(e.to_string().contains(rows), "{e}");
        // a token out of the vocabulary, on every rank, whichever tile holds it
        let mut bad = [1i32; R];
        bad[R - 1] = V as i32;
        let e = emb.forward(&fwd, g, &bad).expect_err("token 16");
        assert!(
            matches!(
                e,
                Error::TokenOutOfRange {
                    token: 16,
                    position: 7,
                    vocab: 16
                }
            ),
            "{e:?}"
        );
        assert_eq!(delta(g, &before), PassCost::default());
        Err(e)
    });
    refused_everywhere(errs, "token 16 at position 7 is outside 0..16");
}

#[test]
fn a_grid_that_is_not_3d_is_refused_on_every_rank() {
    let w = master(61, -0.5, 0.5);
    let lay = Layout3D::RowsJColsK;
    for (spec, world) in [("2d:2", 4), ("2.5d:2x2", 8)] {
        let want = format!("cannot be used with a grid of tensor mode {spec} (it needs a 3D grid");
        let errs = on_ranks(spec, world, |g| {
            let mut m = manager(g.tensor().device().clone(), DType::F32);
            VocabEmbedding3D::register(&mut m, g, "wte", V, C, lay, &w)
        });
        refused_everywhere(errs, &want);
        let errs = on_ranks(spec, world, |g| {
            let mut m = manager(g.tensor().device().clone(), DType::F32);
            Embedding3D::register(&mut m, g, "wpe", T, C, lay, &w)
        });
        refused_everywhere(errs, &want);
        let errs = on_ranks(spec, world, |g| {
            let mut m = manager(g.tensor().device().clone(), DType::F32);
            Classifier3D::register(&mut m, g, "cls", C, K, lay, &w, None, IGNORE)
        });
        refused_everywhere(errs, &want);
    }
}
