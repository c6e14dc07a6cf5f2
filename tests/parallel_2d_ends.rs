//! The ends of a model on the 2D (SUMMA) and 2.5D (Tesseract) layouts against the serial f64
//! reference, on 4 ranks (2×2), 8 ranks (2×2×2) and 4 ranks of one depth layer (2×2×1, equal
//! to 2D bit for bit): the vocab-parallel `wte` and the position table `wpe` with the LM head
//! tied to `wte`, and an untied classifier with a bias. Every rank's forward tiles, the loss,
//! `dh` and **every** gradient shard (f32 within 1e-5 of the tensor's scale; `wte`'s is the
//! embedding's share plus the head's), and each layer's collectives per group against its
//! formulas. Shapes that do not split, other grids and other places are refused on every rank
//! before any collective.

mod common;
mod nn_ref;

use std::time::Duration;

use tidemem::comm::Communicator;
use tidemem::nn::Act;
use tidemem::parallel::{
    Classifier2D, Cost, Embedding2D, GridSpec, PassCost, ProcessGrid, SummaLinear, TensorMode,
    VocabEmbedding2D,
};
use tidemem::parallel::{GridClassifier, GridLookup};
use tidemem::prelude::*;

use common::summa::{linear_formula, q_depth, tally};
use nn_ref::*;

const B: usize = 2;
const T: usize = 4;
const C: usize = 8;
const NH: usize = 2;
const N: usize = B * T;
const EPS: f32 = 1e-5;
const V: usize = 16;
const CLASSES: usize = 8;
const IGNORE: i32 = -100;
const TOL: f64 = 1e-5;

const TWO_D: TensorMode = TensorMode::TwoD { q: 2 };
const TWO_HALF_D: TensorMode = TensorMode::TwoHalfD { q: 2, depth: 2 };
const ONE_LAYER: TensorMode = TensorMode::TwoHalfD { q: 2, depth: 1 };

fn master(name: &str) -> Init {
    let seed = name
        .bytes()
        .fold(7u64, |h, b| h.wrapping_mul(131) ^ u64::from(b));
    let (lo, hi) = if name.ends_with("bias") {
        (-0.2, 0.2)
    } else {
        (-0.5, 0.5)
    };
    Init::Uniform { seed, lo, hi }
}

fn full(name: &str, n: usize) -> Vec<f64> {
    let init = master(name);
    (0..n).map(|i| f64::from(init.value(i))).collect()
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

fn pattern(mul: usize, modulo: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * mul % modulo) as f32 / (modulo / 2) as f32) - 1.0)
        .collect()
}

/// What the ROW, COL, DEP and tensor groups have counted so far.
fn group_stats(grid: &ProcessGrid) -> PassCost {
    PassCost {
        row: grid.row().unwrap().stats(),
        col: grid.col().unwrap().stats(),
        dep: grid.dep().map(|d| d.stats()).unwrap_or_default(),
        tensor: grid.tensor().stats(),
        ..PassCost::default()
    }
}

fn since(a: PassCost, b: PassCost) -> PassCost {
    PassCost {
        row: a.row.since(&b.row),
        col: a.col.since(&b.col),
        dep: a.dep.since(&b.dep),
        tensor: a.tensor.since(&b.tensor),
        ..PassCost::default()
    }
}

/// Runs `f` and returns its result with what it did on the groups.
fn counted<R>(grid: &ProcessGrid, f: impl FnOnce() -> R) -> (R, PassCost) {
    let s0 = group_stats(grid);
    let r = f();
    (r, since(group_stats(grid), s0))
}

fn tokens() -> Vec<i32> {
    (0..N).map(|i| (i * 5 % V) as i32).collect()
}

/// Targets over `classes`, two of them ignored.
fn targets(classes: usize) -> Vec<i32> {
    let mut t: Vec<i32> = (0..N).map(|i| ((i * 3 + 1) % classes) as i32).collect();
    t[2] = IGNORE;
    t[5] = IGNORE;
    t
}

/// The vocab-parallel token embedding's (`V × C`), derived here: each rank holds a
/// `V/q × C/q` block; forward, ROW reduce-scatters the partial lookups of its row block's ids
/// (`q` tiles of `r·C/q`, `r = N/(q·d)`) and the tensor group moves the tile to its place (one
/// send and receive of `r·C/q`); backward moves it back, ROW all-gathers the tiles' gradients,
/// and with depth DEP all-reduces the block's gradient.
fn vocab_formula(mode: TensorMode) -> Cost {
    let (q, d) = q_depth(mode);
    let (r, e) = (N / (q * d), 4);
    let tile = r * (C / q) * e;
    let mut c = Cost::default();
    c.forward.row.reduce_scatter = tally(1, q * tile);
    for g in [&mut c.forward, &mut c.backward] {
        g.tensor.send = tally(1, tile);
        g.tensor.recv = tally(1, tile);
    }
    c.backward.row.all_gather = tally(1, q * tile);
    if d > 1 {
        c.backward.dep.all_reduce = tally(1, V / q * (C / q) * e);
    }
    c
}

/// The position table's (`T × C`, columns split over COL), derived here: forward COL
/// all-gathers the `T × C/q` block; backward COL reduce-scatters its gradient, and with depth
/// DEP all-reduces this rank's `T/q × C/q` share.
fn position_formula(mode: TensorMode) -> Cost {
    let (q, d) = q_depth(mode);
    let e = 4;
    let mut c = Cost::default();
    c.forward.col.all_gather = tally(1, T * (C / q) * e);
    c.backward.col.reduce_scatter = tally(1, T * (C / q) * e);
    if d > 1 {
        c.backward.dep.all_reduce = tally(1, T / q * (C / q) * e);
    }
    c
}

/// A classifier's (`C → outputs`): its SUMMA linear's, plus forward ROW's two all-reduces of
/// the cross-entropy (the row maxima, `r` f32, then the sums and target logits, `2r`) and the
/// tensor group's all-reduce of the loss (one f64).
fn classifier_formula(mode: TensorMode, outputs: usize, bias: bool) -> Cost {
    let (q, d) = q_depth(mode);
    let r = N / (q * d);
    let mut c = linear_formula(mode, N, C, outputs, bias);
    c.forward.row.all_reduce = tally(2, 3 * r * 4);
    c.forward.tensor.all_reduce = tally(1, 8);
    c
}

/// One rank of the GPT ends: tiles of `wte` and `wpe`, the loss, `dh`, the gradients of `wte`
/// and `wpe`, and `[counted, formula]` for the three layers.
struct GptOut {
    te: Vec<f32>,
    pe: Vec<f32>,
    loss: f32,
    dh: Vec<f32>,
    grads: [Vec<f32>; 2],
    stats: [[Cost; 2]; 3],
}

fn gpt_rank(c: &Communicator, mode: TensorMode) -> GptOut {
    let grid = ProcessGrid::new(c, spec(mode)).unwrap();
    let mut m = manager(c.device().clone(), DType::F32);
    let (te, pe) = (master("wte.weight"), master("wpe.weight"));
    let wte = VocabEmbedding2D::register(&mut m, &grid, "wte", V, C, &te).unwrap();
    let wpe = Embedding2D::register(&mut m, &grid, "wpe", T, C, &pe).unwrap();
    let head = Classifier2D::tied(&m, &wte, IGNORE).unwrap();
    let (tok, tgt) = (tokens(), targets(V));
    let pos: Vec<i32> = (0..N).map(|n| (n % T) as i32).collect();
    let fwd = m.forward().unwrap();
    let s = fwd.stream();
    let ((xt, te_saved), f_te) = counted(&grid, || wte.forward(&fwd, &grid, &tok).unwrap());
    let ((xp, pe_saved), f_pe) = counted(&grid, || wpe.forward(&fwd, &grid, &pos).unwrap());
    let (te_h, pe_h) = (xt.to_f32(s).unwrap(), xp.to_f32(s).unwrap());
    let sum: Vec<f32> = te_h.iter().zip(&pe_h).map(|(a, b)| a + b).collect();
    let x = Act::upload(fwd.pool(), s, xt.rows(), xt.cols(), DType::F32, &sum).unwrap();
    drop((xt, xp));
    let ((loss, saved), f_head) =
        counted(&grid, || head.forward(&fwd, &grid, &x, &tgt, 1.0).unwrap());
    drop(x);
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let (dh, b_head) = counted(&grid, || head.backward(&bwd, &grid, &saved).unwrap());
    let dh_h = dh.to_f32(bwd.stream()).unwrap();
    let ((), b_pe) = counted(&grid, || wpe.backward(&bwd, &grid, &pe_saved, &dh).unwrap());
    let ((), b_te) = counted(&grid, || wte.backward(&bwd, &grid, &te_saved, &dh).unwrap());
    drop((dh, saved, te_saved, pe_saved));
    bwd.finish().unwrap();
    let grads = [m.read(wte.weight).unwrap(), m.read(wpe.weight).unwrap()];
    let pair = |f, b| Cost {
        forward: f,
        backward: b,
    };
    let stats = [
        [pair(f_te, b_te), wte.collectives(N, DType::F32).unwrap()],
        [pair(f_pe, b_pe), wpe.collectives(N, DType::F32).unwrap()],
        [
            pair(f_head, b_head),
            head.collectives(N, DType::F32).unwrap(),
        ],
    ];
    GptOut {
        te: te_h,
        pe: pe_h,
        loss,
        dh: dh_h,
        grads,
        stats,
    }
}

#[test]
fn vocab_embedding_position_table_and_tied_head_equal_the_serial_ones() {
    let (tok, tgt) = (tokens(), targets(V));
    let (wte, wpe) = (full("wte.weight", V * C), full("wpe.weight", T * C));
    let zeros = vec![0.0; T * C];
    let te = embed_ref(&wte, &zeros, &tok);
    let pe = embed_ref(&vec![0.0; V * C], &wpe, &tok);
    let x = embed_ref(&wte, &wpe, &tok);
    let head = lm_head_ref(&x, &wte, &tgt, V);
    let mut dwte = head.dwte.clone();
    let dwpe = embed_bwd(&head.dh, &tok, &mut dwte, T);
    for (mode, world) in [(TWO_D, 4), (TWO_HALF_D, 8)] {
        let outs = on_ranks(world, |c| gpt_rank(c, mode));
        let mut worst = 0.0f64;
        for (t, o) in outs.iter().enumerate() {
            let (row, col, rb, nrb) = place(mode, t);
            let what = format!("{mode}, rank {t}");
            let tile = |v: &[f64]| block(v, C, [rb, nrb], [col, 2]);
            let want = [
                vocab_formula(mode),
                position_formula(mode),
                classifier_formula(mode, V, false),
            ];
            for (k, ([got, formula], want)) in o.stats.iter().zip(want).enumerate() {
                assert_eq!(*got, want, "{what}: counted collectives of layer {k}");
                assert_eq!(*formula, want, "{what}: collectives() of layer {k}");
            }
            let mut chk = |w: &str, got: &[f32], want: &[f64]| {
                worst = worst.max(close(&format!("{what}: {w}"), got, want, TOL));
            };
            chk("wte tile", &o.te, &tile(&te));
            chk("wpe tile", &o.pe, &tile(&pe));
            chk("loss", &[o.loss], &[head.loss]);
            chk("dh", &o.dh, &tile(&head.dh));
            // wte: vocabulary block col, channel block row; wpe: row piece row, column block col
            chk(
                "wte grad",
                &o.grads[0],
                &block(&dwte, C, [col, 2], [row, 2]),
            );
            chk(
                "wpe grad",
                &o.grads[1],
                &block(&dwpe, C, [row, 2], [col, 2]),
            );
        }
        eprintln!("GPT ends on {mode}: worst error {worst:.2e} (bound {TOL:.0e})");
    }
}

/// The softmax cross-entropy's mean loss over the counted rows and the logits' gradient.
fn ce_ref(logits: &[f64], targets: &[i32], classes: usize) -> (f64, Vec<f64>) {
    let counted = targets.iter().filter(|&&t| t != IGNORE).count() as f64;
    let (mut loss, mut dl) = (0.0, vec![0.0; logits.len()]);
    for (n, &t) in targets.iter().enumerate() {
        if t == IGNORE {
            continue;
        }
        let lg = &logits[n * classes..(n + 1) * classes];
        let m = lg.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let z: f64 = lg.iter().map(|l| (l - m).exp()).sum();
        loss += z.ln() - (lg[t as usize] - m);
        for k in 0..classes {
            let hot = if k == t as usize { 1.0 } else { 0.0 };
            dl[n * classes + k] = ((lg[k] - m).exp() / z - hot) / counted;
        }
    }
    (loss / counted, dl)
}

/// One rank of the untied classifier: loss, `dh`, weight and bias gradients, collectives.
type ClsOut = (f32, Vec<f32>, [Vec<f32>; 2], [Cost; 2]);

fn classifier_rank(c: &Communicator, mode: TensorMode, h: &[f32], scale: f32) -> ClsOut {
    let grid = ProcessGrid::new(c, spec(mode)).unwrap();
    let mut m = manager(c.device().clone(), DType::F32);
    let (w, b) = (master("cls.weight"), master("cls.bias"));
    let cls =
        Classifier2D::register(&mut m, &grid, "cls", C, CLASSES, &w, Some(&b), IGNORE).unwrap();
    let (_, col, rb, nrb) = place(mode, c.rank());
    let tgt = targets(CLASSES);
    let fwd = m.forward().unwrap();
    let hb = block(h, C, [rb, nrb], [col, 2]);
    let ha = Act::upload(fwd.pool(), fwd.stream(), N / nrb, C / 2, DType::F32, &hb).unwrap();
    let ((loss, saved), f) = counted(&grid, || {
        cls.forward(&fwd, &grid, &ha, &tgt, scale).unwrap()
    });
    drop(ha);
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let (dh, b_) = counted(&grid, || cls.backward(&bwd, &grid, &saved).unwrap());
    let dh = dh.to_f32(bwd.stream()).unwrap();
    drop(saved);
    bwd.finish().unwrap();
    let l = cls.linear.slice();
    let grads = [m.read(l.weight).unwrap(), m.read(l.bias.unwrap()).unwrap()];
    let got = Cost {
        forward: f,
        backward: b_,
    };
    (
        loss,
        dh,
        grads,
        [got, cls.collectives(N, DType::F32).unwrap()],
    )
}

#[test]
fn classifier_with_a_bias_equals_the_serial_one() {
    let h = pattern(37, 101, N * C);
    let scale = 4.0;
    let (w, b) = (full("cls.weight", CLASSES * C), full("cls.bias", CLASSES));
    let logits = linear(&f64s(&h), &w, &b, C, CLASSES);
    let (loss, dl) = ce_ref(&logits, &targets(CLASSES), CLASSES);
    let dl: Vec<f64> = dl.iter().map(|g| g * f64::from(scale)).collect();
    let [dh, dw, db] = linear_bwd(&f64s(&h), &w, &dl, C, CLASSES);
    for (mode, world) in [(TWO_D, 4), (TWO_HALF_D, 8)] {
        let outs = on_ranks(world, |c| classifier_rank(c, mode, &h, scale));
        let mut worst = 0.0f64;
        for (t, (l, odh, [gw, gb], [got, formula])) in outs.iter().enumerate() {
            let (row, col, rb, nrb) = place(mode, t);
            let what = format!("{mode}, rank {t}");
            let want = classifier_formula(mode, CLASSES, true);
            assert_eq!(*got, want, "{what}: counted collectives");
            assert_eq!(*formula, want, "{what}: collectives()");
            let mut chk = |w: &str, got: &[f32], want: &[f64]| {
                worst = worst.max(close(&format!("{what}: {w}"), got, want, TOL));
            };
            chk("loss", &[*l], &[loss]);
            chk("dh", odh, &block(&dh, C, [rb, nrb], [col, 2]));
            // the 2D linear's layouts: weight block (output block col, input block row), bias
            // piece col·q + row of q²
            chk("weight grad", gw, &block(&dw, C, [col, 2], [row, 2]));
            let n = CLASSES / 4;
            chk("bias grad", gb, &db[(col * 2 + row) * n..][..n]);
        }
        eprintln!("Classifier2D on {mode}: worst error {worst:.2e} (bound {TOL:.0e})");
    }
}

/// 2.5D with one depth layer is 2D, bit for bit, collectives included.
#[test]
fn one_depth_layer_is_2d_bit_for_bit() {
    let two = on_ranks(4, |c| gpt_rank(c, TWO_D));
    let half = on_ranks(4, |c| gpt_rank(c, ONE_LAYER));
    for (t, (a, b)) in two.iter().zip(&half).enumerate() {
        assert_eq!(
            (&a.te, &a.pe, &a.dh, &a.grads),
            (&b.te, &b.pe, &b.dh, &b.grads)
        );
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "rank {t}: loss");
        assert_eq!(a.stats, b.stats, "rank {t}: collectives");
    }
    let h = pattern(37, 101, N * C);
    let two = on_ranks(4, |c| classifier_rank(c, TWO_D, &h, 1.0));
    let half = on_ranks(4, |c| classifier_rank(c, ONE_LAYER, &h, 1.0));
    for (t, (a, b)) in two.iter().zip(&half).enumerate() {
        assert_eq!(
            (a.0.to_bits(), &a.1, &a.2),
            (b.0.to_bits(), &b.1, &b.2),
            "rank {t}"
        );
        assert_eq!(a.3, b.3, "rank {t}: collectives");
    }
}

fn err<T>(r: tidemem::Result<T>) -> Error {
    match r {
        Ok(_) => panic!("accepted"),
        Err(e) => e,
    }
}

#[test]
fn shapes_that_do_not_split_are_refused_on_every_rank() {
    for (mode, world) in [(TWO_D, 4), (TWO_HALF_D, 8)] {
        let errs = on_ranks(world, |c| {
            let grid = ProcessGrid::new(c, spec(mode)).unwrap();
            let mut m = manager(c.device().clone(), DType::F32);
            let i = master("x");
            let mut e = vec![
                err(VocabEmbedding2D::register(&mut m, &grid, "a", 15, C, &i)),
                err(VocabEmbedding2D::register(&mut m, &grid, "b", V, 7, &i)),
                err(Embedding2D::register(&mut m, &grid, "c", 5, C, &i)),
                err(Classifier2D::register(
                    &mut m,
                    &grid,
                    "d",
                    C,
                    6,
                    &i,
                    Some(&i),
                    IGNORE,
                )),
                err(Classifier2D::register(
                    &mut m, &grid, "e", C, 7, &i, None, IGNORE,
                )),
            ];
            let wte = VocabEmbedding2D::register(&mut m, &grid, "wte", V, C, &i).unwrap();
            let wpe = Embedding2D::register(&mut m, &grid, "wpe", T, C, &i).unwrap();
            let head = Classifier2D::tied(&m, &wte, IGNORE).unwrap();
            let (_, _, _, nrb) = place(mode, c.rank());
            let fwd = m.forward().unwrap();
            let before = c.stats();
            // 7 ids over the row blocks; an id out of the table
            let seven = vec![0i32; 7];
            e.push(err(wte.forward(&fwd, &grid, &seven)));
            e.push(err(wpe.forward(&fwd, &grid, &seven)));
            let mut bad = tokens();
            bad[N - 1] = V as i32;
            e.push(err(wte.forward(&fwd, &grid, &bad)));
            // a tile whose rows do not match the targets; a target out of the classes
            let z = vec![0.0; N / nrb * C / 2];
            let h = Act::upload(fwd.pool(), fwd.stream(), N / nrb, C / 2, DType::F32, &z).unwrap();
            e.push(err(head.forward(
                &fwd,
                &grid,
                &h,
                &targets(V)[..N - 1],
                1.0,
            )));
            let mut tgt = targets(V);
            tgt[0] = V as i32;
            e.push(err(head.forward(&fwd, &grid, &h, &tgt, 1.0)));
            assert_eq!(c.stats(), before, "no collective before a refusal");
            drop(h);
            fwd.finish().unwrap();
            e
        });
        for e in errs {
            let want = [
                "vocab = 15",
                "channels = 7",
                "rows = 5",
                "classes (with a bias) = 6",
                "classes = 7",
                "ids = 7",
                "ids = 7",
                "outside 0..",
                "targets",
                "outside 0..",
            ];
            assert_eq!(e.len(), want.len());
            for (got, want) in e.iter().zip(want) {
                assert!(got.to_string().contains(want), "{got} (wanted {want})");
            }
            for got in &e[..7] {
                assert!(matches!(got, Error::NotSplit { .. }), "{got:?}");
            }
            assert!(
                matches!(e[7], Error::TokenOutOfRange { token, position, vocab }
                    if token == V as i64 && position == N - 1 && vocab == V),
                "{:?}",
                e[7]
            );
            assert!(
                matches!(e[8], Error::Length { got, expected, .. }
                    if got == N - 1 && expected == N),
                "{:?}",
                e[8]
            );
            assert!(
                matches!(e[9], Error::TokenOutOfRange { position: 0, .. }),
                "{:?}",
                e[9]
            );
        }
    }
}

/// The layers refuse a 1D or 3D grid at registration, a grid of another mode at a call, and
/// a place they were not registered for, before any collective, on every rank.
#[test]
fn other_grids_and_places_are_refused() {
    for (mode, world) in [
        (TensorMode::OneD { size: 4 }, 4),
        (TensorMode::ThreeD { q: 2 }, 8),
    ] {
        let errs = on_ranks(world, |c| {
            let grid = ProcessGrid::new(c, spec(mode)).unwrap();
            let mut m = manager(c.device().clone(), DType::F32);
            let i = master("x");
            [
                err(VocabEmbedding2D::register(&mut m, &grid, "a", V, C, &i)),
                err(Embedding2D::register(&mut m, &grid, "b", T, C, &i)),
                err(Classifier2D::register(
                    &mut m, &grid, "c", C, CLASSES, &i, None, IGNORE,
                )),
            ]
        });
        for e in errs.into_iter().flatten() {
            match e {
                Error::Conflict { with, .. } => assert!(with.contains(&mode.to_string()), "{with}"),
                other => panic!("{other:?}"),
            }
        }
    }
    let errs = on_ranks(4, |c| {
        let grid = ProcessGrid::new(c, spec(TWO_D)).unwrap();
        let other = ProcessGrid::new(c, spec(ONE_LAYER)).unwrap();
        let mut m = manager(c.device().clone(), DType::F32);
        let i = master("x");
        let wte = VocabEmbedding2D::register(&mut m, &grid, "wte", V, C, &i).unwrap();
        let wpe = Embedding2D::register(&mut m, &grid, "wpe", T, C, &i).unwrap();
        let head = Classifier2D::tied(&m, &wte, IGNORE).unwrap();
        // the same layers moved to the transposed place
        let (mut wte_t, mut wpe_t, mut head_t) = (wte, wpe, head);
        wte_t.place.row = 1 - wte.place.row;
        wpe_t.place.col = 1 - wpe.place.col;
        let SummaLinear::TwoD(ref mut l) = head_t.linear else {
            panic!("a 2D head")
        };
        l.col = 1 - l.col;
        let fwd = m.forward().unwrap();
        let z = vec![0.0; N / 2 * C / 2];
        let h = Act::upload(fwd.pool(), fwd.stream(), N / 2, C / 2, DType::F32, &z).unwrap();
        let (tok, tgt) = (tokens(), targets(V));
        let before = c.stats();
        let e = [
            err(wte.forward(&fwd, &other, &tok)),
            err(wpe.forward(&fwd, &other, &tok[..])),
            err(head.forward(&fwd, &other, &h, &tgt, 1.0)),
            err(wte_t.forward(&fwd, &grid, &tok)),
            err(wpe_t.forward(&fwd, &grid, &tok)),
            err(head_t.forward(&fwd, &grid, &h, &tgt, 1.0)),
        ];
        assert_eq!(c.stats(), before, "no collective before a refusal");
        drop(h);
        fwd.finish().unwrap();
        e
    });
    for e in errs {
        for got in &e {
            assert!(matches!(got, Error::WrongPlace { .. }), "{got:?}");
        }
        for got in &e[..3] {
            assert!(got.to_string().contains("2.5d"), "{got}");
        }
        for got in &e[3..] {
            assert!(got.to_string().contains("registered for"), "{got}");
        }
    }
}
