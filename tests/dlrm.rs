//! `models::dlrm` against an f64 reference written here (not the crate's code path, itself
//! checked against finite differences): the loss, the probabilities, every MLP parameter's
//! gradient and the embedding vectors' gradient of the tiny DLRM in f32, f16 and bf16 (on CUDA
//! too when present); cached and full-table training bitwise equal for each row optimizer; and
//! a few training steps with a `CachedEmbeddingCollection` on synthetic Criteo-like data make
//! the loss fall and the held-out AUC rise above 0.5; the device path (the pooled vectors and
//! their gradient kept on the device) and the host path train alike, bit for bit. The
//! reference, cached-vs-full and device-vs-host tests run on CUDA too when it is present
//! (required under `TIDEMEM_REQUIRE_CUDA=1`).

mod common;

use tidemem::data::criteo::{Batch, Dataset, Synthetic, SyntheticConfig};
use tidemem::embedding::CachedEmbeddingCollection;
use tidemem::metrics::auc;
use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
use tidemem::ops::embedding::BagMode;
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::optim::{ScalerConfig, StepOutcome};
use tidemem::prelude::*;
use tidemem::rng::{Rng, SplitMix64};

/// Tolerance of the f32 model against the f64 reference, as `rel_err` measures it (the largest
/// difference over the tensor's largest magnitude).
const TOL: f64 = 1e-5;

fn manager(dev: Device) -> ChunkManager {
    manager_of(dev, DType::F32)
}

fn manager_of(dev: Device, dtype: DType) -> ChunkManager {
    let mut cfg = ManagerConfig::new(1 << 16, Policy::Tide);
    cfg.param_dtype = dtype;
    ChunkManager::new(dev, cfg).unwrap()
}

fn uniform(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    (0..n)
        .map(|_| (lo + (hi - lo) * (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64) as f32)
        .collect()
}

fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1e-30);
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()));
    diff / scale
}

/// One linear layer's parameters, f64: `w` `[n, m]`, `b` `[n]`.
struct Layer {
    w: Vec<f64>,
    b: Vec<f64>,
    m: usize,
    n: usize,
}

fn linear(l: &Layer, x: &[f64], rows: usize) -> Vec<f64> {
    let mut y = vec![0.0; rows * l.n];
    for r in 0..rows {
        for o in 0..l.n {
            let mut s = l.b[o];
            for i in 0..l.m {
                s += x[r * l.m + i] * l.w[o * l.m + i];
            }
            y[r * l.n + o] = s;
        }
    }
    y
}

/// `dx`, `dw`, `db` of a linear layer from its input and the output's gradient.
fn linear_back(l: &Layer, x: &[f64], dy: &[f64], rows: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dx, mut dw, mut db) = (vec![0.0; rows * l.m], vec![0.0; l.n * l.m], vec![0.0; l.n]);
    for r in 0..rows {
        for o in 0..l.n {
            let g = dy[r * l.n + o];
            db[o] += g;
            for i in 0..l.m {
                dw[o * l.m + i] += g * x[r * l.m + i];
                dx[r * l.m + i] += g * l.w[o * l.m + i];
            }
        }
    }
    (dx, dw, db)
}

fn relu(v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| x.max(0.0)).collect()
}

/// The reference's outputs: loss, probabilities, per-layer (dw, db) bottom then top, and the
/// embedding gradient table-major.
struct RefOut {
    loss: f64,
    probs: Vec<f64>,
    grads: Vec<(Vec<f64>, Vec<f64>)>,
    emb_grad: Vec<f64>,
}

fn reference(
    cfg: &DlrmConfig,
    bottom: &[Layer],
    top: &[Layer],
    emb: &[f64],
    dense: &[f64],
    labels: &[f32],
    bsz: usize,
) -> RefOut {
    let (tables, d) = (cfg.tables, cfg.dim);
    let f = tables + 1;
    // bottom MLP, ReLU after every layer
    let mut bin = vec![dense.to_vec()];
    for l in bottom {
        let z = linear(l, bin.last().unwrap(), bsz);
        bin.push(relu(&z));
    }
    let x = bin.last().unwrap().clone();
    // T[b][k]: the dense vector, then table k − 1's vector
    let t_at = |b: usize, k: usize, c: usize| -> f64 {
        if k == 0 {
            x[b * d + c]
        } else {
            emb[((k - 1) * bsz + b) * d + c]
        }
    };
    let width = d + f * (f - 1) / 2;
    assert_eq!(width, cfg.top_inputs());
    let mut inter = vec![0.0; bsz * width];
    for b in 0..bsz {
        let row = &mut inter[b * width..(b + 1) * width];
        row[..d].copy_from_slice(&x[b * d..(b + 1) * d]);
        let mut p = d;
        for i in 1..f {
            for j in 0..i {
                row[p] = (0..d).map(|c| t_at(b, i, c) * t_at(b, j, c)).sum();
                p += 1;
            }
        }
    }
    // top MLP, ReLU between layers
    let mut tin = vec![inter];
    let mut logits = vec![];
    for (i, l) in top.iter().enumerate() {
        let z = linear(l, tin.last().unwrap(), bsz);
        if i + 1 < top.len() {
            tin.push(relu(&z));
        } else {
            logits = z;
        }
    }
    let probs: Vec<f64> = logits.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect();
    let loss = logits
        .iter()
        .zip(labels)
        .map(|(&z, &y)| z.max(0.0) - z * y as f64 + (-z.abs()).exp().ln_1p())
        .sum::<f64>()
        / bsz as f64;
    // backward
    let mut dy: Vec<f64> = probs
        .iter()
        .zip(labels)
        .map(|(&p, &y)| (p - y as f64) / bsz as f64)
        .collect();
    let mut top_grads = vec![];
    for i in (0..top.len()).rev() {
        if i + 1 < top.len() {
            dy = dy
                .iter()
                .zip(&tin[i + 1])
                .map(|(&g, &h)| if h > 0.0 { g } else { 0.0 })
                .collect();
        }
        let (dx, dw, db) = linear_back(&top[i], &tin[i], &dy, bsz);
        top_grads.push((dw, db));
        dy = dx;
    }
    top_grads.reverse();
    let mut d_dense = vec![0.0; bsz * d];
    let mut emb_grad = vec![0.0; emb.len()];
    for b in 0..bsz {
        let dout = &dy[b * width..(b + 1) * width];
        let mut dt = vec![0.0; f * d];
        let mut p = d;
        for i in 1..f {
            for j in 0..i {
                for c in 0..d {
                    dt[i * d + c] += dout[p] * t_at(b, j, c);
                    dt[j * d + c] += dout[p] * t_at(b, i, c);
                }
                p += 1;
            }
        }
        for c in 0..d {
            d_dense[b * d + c] = dout[c] + dt[c];
        }
        for t in 0..tables {
            for c in 0..d {
                emb_grad[(t * bsz + b) * d + c] = dt[(t + 1) * d + c];
            }
        }
    }
    let mut dy = d_dense;
    let mut bottom_grads = vec![];
    for i in (0..bottom.len()).rev() {
        dy = dy
            .iter()
            .zip(&bin[i + 1])
            .map(|(&g, &h)| if h > 0.0 { g } else { 0.0 })
            .collect();
        let (dx, dw, db) = linear_back(&bottom[i], &bin[i], &dy, bsz);
        bottom_grads.push((dw, db));
        dy = dx;
    }
    bottom_grads.reverse();
    bottom_grads.extend(top_grads);
    RefOut {
        loss,
        probs,
        grads: bottom_grads,
        emb_grad,
    }
}

fn read_layers(m: &mut ChunkManager, layers: &[tidemem::nn::Linear]) -> Vec<Layer> {
    layers
        .iter()
        .map(|l| Layer {
            w: m.read(l.weight)
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect(),
            b: m.read(l.bias.unwrap())
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect(),
            m: l.inputs,
            n: l.outputs,
        })
        .collect()
}

/// Tolerances per parameter dtype, as `rel_err` measures them. f32: [`TOL`]. f16 (2⁻¹¹ per
/// rounding) and bf16 (2⁻⁸): the inputs, every activation and gradient are rounded at each
/// stage. Measured: f32 1.6e-7, f16 1.0e-3, bf16 4.8e-3.
const CASES: [(DType, f64); 3] = [(DType::F32, TOL), (DType::F16, 5e-3), (DType::BF16, 2e-2)];

#[test]
fn tiny_dlrm_matches_the_f64_reference() {
    let cfg = DlrmConfig::tiny();
    let bsz = 8;
    for dev in common::devices("dlrm::reference") {
        for (dtype, tol) in CASES {
            let mut m = manager_of(dev.clone(), dtype);
            let model = Dlrm::register(&mut m, &cfg, 3).unwrap();
            let bottom = read_layers(&mut m, model.bottom());
            let top = read_layers(&mut m, model.top());
            let emb = uniform(cfg.tables * bsz * cfg.dim, 1, -0.6, 0.6);
            let dense = uniform(bsz * cfg.dense_features, 2, 0.0, 2.0);
            let labels: Vec<f32> = (0..bsz).map(|i| (i % 3 == 0) as u8 as f32).collect();
            let (loss, emb_grad, probs) = model
                .forward_backward(&mut m, &emb, &dense, &labels, bsz)
                .unwrap();
            let want = reference(
                &cfg,
                &bottom,
                &top,
                &wide(&emb),
                &wide(&dense),
                &labels,
                bsz,
            );
            let mut errs = vec![
                ("loss", ((loss as f64) - want.loss).abs() / want.loss.abs()),
                ("probs", rel_err(&probs, &want.probs)),
                ("emb_grad", rel_err(&emb_grad, &want.emb_grad)),
            ];
            let layers: Vec<_> = model.bottom().iter().chain(model.top()).copied().collect();
            for (k, (l, (dw, db))) in layers.iter().zip(&want.grads).enumerate() {
                let gw = m.read(l.weight).unwrap();
                let gb = m.read(l.bias.unwrap()).unwrap();
                assert!(
                    dw.iter().any(|&v| v != 0.0),
                    "layer {k}: a zero gradient tests nothing"
                );
                errs.push(("dw", rel_err(&gw, dw)));
                errs.push(("db", rel_err(&gb, db)));
            }
            m.skip_step().unwrap();
            let worst = errs.iter().fold(0.0f64, |w, e| w.max(e.1));
            eprintln!(
                "tiny DLRM vs f64 on {} in {dtype}: worst {worst:.2e} {errs:?}",
                dev.name()
            );
            for (what, e) in errs {
                assert!(e <= tol, "{dtype} {what}: {e:e}");
            }
        }
    }
}

/// The reference's analytic gradients against central differences of its own loss (so the
/// reference the model is held to is itself right): a sample of embedding values and of each
/// layer's weights and biases, within 1e-6 of the tensor's largest gradient.
#[test]
fn the_reference_backward_matches_finite_differences() {
    let cfg = DlrmConfig::tiny();
    let bsz = 4;
    let mut m = manager(common::sim(64 << 20));
    let model = Dlrm::register(&mut m, &cfg, 9).unwrap();
    let mut layers = read_layers(&mut m, model.bottom());
    let nb = layers.len();
    layers.extend(read_layers(&mut m, model.top()));
    let mut emb = wide(&uniform(cfg.tables * bsz * cfg.dim, 3, -0.6, 0.6));
    let dense = wide(&uniform(bsz * cfg.dense_features, 4, 0.0, 2.0));
    let labels = [1.0f32, 0.0, 0.0, 1.0];
    let run = |layers: &[Layer], emb: &[f64]| {
        reference(
            &cfg,
            &layers[..nb],
            &layers[nb..],
            emb,
            &dense,
            &labels,
            bsz,
        )
    };
    let want = run(&layers, &emb);
    let h = 1e-6;
    let scale = |g: &[f64]| g.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    let picks = |n: usize, seed: u64| {
        let mut r = SplitMix64::new(seed);
        (0..12).map(move |_| (r.next_u64() % n as u64) as usize)
    };
    let emb_scale = scale(&want.emb_grad);
    for i in picks(emb.len(), 1) {
        let v = emb[i];
        emb[i] = v + h;
        let up = run(&layers, &emb).loss;
        emb[i] = v - h;
        let down = run(&layers, &emb).loss;
        emb[i] = v;
        let fd = (up - down) / (2.0 * h);
        assert!(
            (fd - want.emb_grad[i]).abs() <= 1e-6 * emb_scale,
            "emb {i}: {fd} vs {}",
            want.emb_grad[i]
        );
    }
    for k in 0..layers.len() {
        let (dw, db) = &want.grads[k];
        for (bias, grad) in [(false, dw), (true, db)] {
            let sc = scale(grad);
            let n = grad.len();
            for i in picks(n, 10 + k as u64) {
                let at = |layers: &mut Vec<Layer>, dv: f64| {
                    let t = if bias {
                        &mut layers[k].b
                    } else {
                        &mut layers[k].w
                    };
                    t[i] += dv;
                };
                at(&mut layers, h);
                let up = run(&layers, &emb).loss;
                at(&mut layers, -2.0 * h);
                let down = run(&layers, &emb).loss;
                at(&mut layers, h);
                let fd = (up - down) / (2.0 * h);
                assert!(
                    (fd - grad[i]).abs() <= 1e-6 * sc,
                    "layer {k} bias {bias} {i}: {fd} vs {}",
                    grad[i]
                );
            }
        }
    }
}

#[test]
fn bad_inputs_are_refused_before_anything_runs() {
    let cfg = DlrmConfig::tiny();
    let mut m = manager(common::sim(64 << 20));
    let model = Dlrm::register(&mut m, &cfg, 0).unwrap();
    let emb = vec![0.0; cfg.tables * 2 * cfg.dim];
    let dense = vec![0.0; 2 * cfg.dense_features];
    let n_emb = emb.len();
    for (e, d, l, b, want) in [
        (
            &emb[1..],
            &dense[..],
            &[0.0f32, 1.0][..],
            2,
            Some((n_emb - 1, n_emb)),
        ),
        (
            &emb[..],
            &dense[1..],
            &[0.0, 1.0][..],
            2,
            Some((dense.len() - 1, dense.len())),
        ),
        (&emb[..], &dense[..], &[0.0][..], 2, Some((1, 2))),
        (&emb[..], &dense[..], &[][..], 0, None),
    ] {
        let r = model.forward_backward(&mut m, e, d, l, b);
        let typed = match want {
            Some((g, x)) => {
                matches!(r, Err(Error::Length { got, expected, .. }) if (got, expected) == (g, x))
            }
            None => matches!(r, Err(Error::Empty { .. })),
        };
        assert!(typed, "{r:?}");
        assert_eq!(m.stage(), None);
    }
    let bad = DlrmConfig {
        dim: 5,
        ..DlrmConfig::tiny()
    };
    assert!(Dlrm::register(&mut m, &bad, 0).is_err());
}

/// An embedding row: uniform in `±√(1/rows)` (facebookresearch/dlrm's scale), from a hash.
fn table_init(rows: usize) -> impl FnMut(usize, u32, &mut [f32]) {
    move |t, id, row| {
        let b = (1.0 / rows as f64).sqrt();
        let seed = (t as u64) << 32 | u64::from(id);
        row.copy_from_slice(&uniform(row.len(), seed ^ 0xd1e5, -b, b));
    }
}

#[test]
fn training_on_synthetic_data_lowers_the_loss_and_moves_the_auc() {
    let cfg = DlrmConfig::tiny();
    let gen = Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.0005)
            .with_seed(11),
    )
    .unwrap();
    let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
    let bsz = 256;
    for opt in [
        EmbeddingOptimizer::Sgd { lr: 0.5 },
        EmbeddingOptimizer::Adam {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
    ] {
        let dev = common::sim(256 << 20);
        let mut m = manager(dev.clone());
        let model = Dlrm::register(&mut m, &cfg, 1).unwrap();
        let max_rows = *rows.iter().max().unwrap();
        let mut emb = CachedEmbeddingCollection::new(
            dev,
            &rows,
            cfg.dim,
            bsz * cfg.tables,
            BagMode::Sum,
            opt,
            |c| c,
            table_init(max_rows),
        )
        .unwrap();
        let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-2))).unwrap();
        let held_out: Vec<_> = (0..4).map(|i| gen.batch(1_000_000 + i, bsz)).collect();
        let eval = |m: &mut ChunkManager, emb: &mut CachedEmbeddingCollection| {
            let (mut p, mut y) = (vec![], vec![]);
            for b in &held_out {
                p.extend(dlrm::predict(&model, m, emb, b).unwrap());
                y.extend_from_slice(&b.labels);
            }
            auc(&p, &y).unwrap().unwrap()
        };
        let auc0 = eval(&mut m, &mut emb);
        let mut losses = vec![];
        for step in 0..60 {
            let b = gen.batch(step, bsz);
            let s = dlrm::train_step(&model, &mut m, &mut adam, &mut emb, &b, Default::default())
                .unwrap();
            assert!(s.loss.is_finite() && s.rows > 0);
            losses.push(s.loss);
        }
        let auc1 = eval(&mut m, &mut emb);
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        let (first, last) = (mean(&losses[..10]), mean(&losses[50..]));
        let (mut t, mut y) = (vec![], vec![]);
        for b in &held_out {
            t.extend((0..b.size).map(|s| gen.true_logit(b, s) as f32));
            y.extend_from_slice(&b.labels);
        }
        let ceiling = auc(&t, &y).unwrap().unwrap();
        eprintln!(
            "{opt:?}: loss {first:.4} -> {last:.4}, held-out AUC {auc0:.4} -> {auc1:.4} \
             (hidden model {ceiling:.4})"
        );
        assert!(last < first - 0.02, "{first} -> {last}");
        assert!(auc1 > 0.6 && auc1 > auc0 + 0.05, "{auc0} -> {auc1}");
    }
}

/// A small cache (a batch's rows) and the whole table on the device train identically: the
/// same losses, MLP parameters, embedding rows and optimizer state, bit for bit, for each row
/// optimizer.
#[test]
fn cached_and_full_table_training_agree_bitwise() {
    let cfg = DlrmConfig::tiny();
    let gen = Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.0002)
            .with_seed(5),
    )
    .unwrap();
    let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
    let total: usize = rows.iter().sum();
    let bsz = 64;
    let opts = [
        EmbeddingOptimizer::Sgd { lr: 0.3 },
        EmbeddingOptimizer::RowwiseAdagrad { lr: 0.1, eps: 1e-8 },
        EmbeddingOptimizer::Adam {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
    ];
    for (dev, opt) in common::devices("dlrm::cached_vs_full")
        .into_iter()
        .flat_map(|d| opts.map(|o| (d.clone(), o)))
    {
        // `ahead`: each step prepares the cache for the next batch while the device computes
        let run = |capacity: usize, ahead: bool| {
            let dev = dev.clone();
            let mut m = manager(dev.clone());
            let model = Dlrm::register(&mut m, &cfg, 2).unwrap();
            let mut emb = CachedEmbeddingCollection::new(
                dev,
                &rows,
                cfg.dim,
                capacity,
                BagMode::Sum,
                opt,
                |c| c,
                table_init(1000),
            )
            .unwrap();
            let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-2))).unwrap();
            let mut losses = vec![];
            let batches: Vec<_> = (0..8).map(|i| gen.batch(i, bsz)).collect();
            for (i, b) in batches.iter().enumerate() {
                let next = batches.get(i + 1).filter(|_| ahead);
                let s = dlrm::train_step(
                    &model,
                    &mut m,
                    &mut adam,
                    &mut emb,
                    b,
                    dlrm::StepPlan {
                        next,
                        ..Default::default()
                    },
                )
                .unwrap();
                losses.push(s.loss.to_bits());
            }
            let prefetched = emb.bag().cache().stats().prefetched;
            let probs = dlrm::predict(&model, &mut m, &mut emb, &gen.batch(99, bsz)).unwrap();
            let params: Vec<Vec<f32>> = model
                .named_params()
                .iter()
                .map(|(_, id)| m.read(*id).unwrap())
                .collect();
            let evicted = emb.bag().cache().moved().d2h_rows;
            let table = emb.bag_mut().cache_mut().to_vecs().unwrap();
            (losses, probs, params, table, evicted, prefetched)
        };
        // a cache of the largest batch's distinct rows: rows are evicted between batches
        let largest = (0..8)
            .map(|i| {
                let mut ids = gen.concat_ids(&gen.batch(i, bsz)).unwrap();
                ids.sort_unstable();
                ids.dedup();
                ids.len()
            })
            .max()
            .unwrap();
        let cached = run(largest, false);
        let full = run(total, false);
        // rows of the next batch prepared while the device computes: two batches fit, or
        // (at the largest batch's rows) they do not and each step prepares its own
        let ahead = run(2 * largest, true);
        let ahead_tight = run(largest, true);
        eprintln!("cached vs full on {}, {opt:?}", dev.name());
        for (name, r) in [
            ("cached", &cached),
            ("ahead", &ahead),
            ("ahead, tight", &ahead_tight),
        ] {
            assert_eq!(r.0, full.0, "{opt:?} {name}: losses");
            assert_eq!(r.1, full.1, "{opt:?} {name}: held-out probabilities");
            assert_eq!(r.2, full.2, "{opt:?} {name}: MLP parameters");
            assert!(r.3 == full.3, "{opt:?} {name}: embedding rows and state");
        }
        // the small cache did evict (and write back) rows; the full table never did
        assert!(cached.4 > 0 && full.4 == 0, "{} {}", cached.4, full.4);
        // the roomy cache was prepared ahead and still evicted; the tight one could not be
        // (two batches' rows never fit in one batch's), and fell back to one batch at a time
        assert!(ahead.5 > 0 && ahead.4 > 0, "{} {}", ahead.5, ahead.4);
        assert_eq!(
            ahead_tight.5, 0,
            "prepared ahead in a cache of one batch's rows"
        );
    }
}

/// The loss scale multiplies the MLP gradients and not the embedding gradient returned (the
/// row optimizer knows nothing of it).
#[test]
fn the_loss_scale_reaches_the_mlp_gradients_only() {
    let cfg = DlrmConfig::tiny();
    let bsz = 4;
    let emb = uniform(cfg.tables * bsz * cfg.dim, 7, -0.5, 0.5);
    let dense = uniform(bsz * cfg.dense_features, 8, 0.0, 2.0);
    let labels = [1.0, 0.0, 0.0, 1.0];
    let run = |scale: f32| {
        let mut m = manager(common::sim(64 << 20));
        let model = Dlrm::register(&mut m, &cfg, 4).unwrap();
        let (loss, g, p) = model
            .forward_backward_scaled(&mut m, &emb, &dense, &labels, bsz, scale)
            .unwrap();
        let grads: Vec<Vec<f32>> = model
            .named_params()
            .iter()
            .map(|(_, id)| m.read(*id).unwrap())
            .collect();
        m.skip_step().unwrap();
        (loss, g, p, grads)
    };
    let (one, four) = (run(1.0), run(4.0));
    assert_eq!((one.0, &one.1, &one.2), (four.0, &four.1, &four.2));
    for (a, b) in one.3.iter().zip(&four.3) {
        // a power of two: exact
        assert!(a.iter().zip(b).all(|(&a, &b)| a * 4.0 == b));
    }
    let mut m = manager(common::sim(64 << 20));
    let model = Dlrm::register(&mut m, &cfg, 4).unwrap();
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let r = model.forward_backward_scaled(&mut m, &emb, &dense, &labels, bsz, bad);
        assert!(matches!(r, Err(Error::BadValue { .. })), "{r:?}");
    }
}

/// One step on the host path: the collection's table-major forward downloaded, the MLPs'
/// forward and backward from host vectors, the gradient back on the host for the collection's
/// backward (what `train_step` did before the vectors stayed on the device).
fn host_step(
    model: &Dlrm,
    m: &mut ChunkManager,
    adam: &mut HybridAdam,
    emb: &mut CachedEmbeddingCollection,
    b: &Batch,
) -> (f32, Vec<f32>) {
    let offsets = dlrm::bag_offsets(b.size).unwrap();
    let tables = dlrm::table_batches(b, &offsets).unwrap();
    let pooled = emb.forward(&tables).unwrap();
    let (loss, grad, probs) = model
        .forward_backward_scaled(m, &pooled, &b.dense, &b.labels, b.size, adam.loss_scale())
        .unwrap();
    if m.step(adam).unwrap().outcome != StepOutcome::Skipped {
        emb.backward(&grad).unwrap();
        emb.step().unwrap();
    }
    (loss, probs)
}

fn host_predict(
    model: &Dlrm,
    m: &mut ChunkManager,
    emb: &mut CachedEmbeddingCollection,
    b: &Batch,
) -> Vec<f32> {
    let offsets = dlrm::bag_offsets(b.size).unwrap();
    let tables = dlrm::table_batches(b, &offsets).unwrap();
    let pooled = emb.forward(&tables).unwrap();
    model.predict(m, &pooled, &b.dense, b.size).unwrap()
}

/// The largest difference over the largest magnitude of two runs' values.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let want = wide(b);
    rel_err(a, &want)
}

/// `train_step` and `predict` (the vectors and their gradient on the device) against the host
/// path, on every device, with a cache smaller than the data (rows are evicted), for a loss
/// scale that is a power of two (unscaled on the device) and one that is not (unscaled on the
/// host): in f32 the losses, probabilities, MLP parameters and embedding rows with their
/// optimizer state are the same bits. In f16 they are too (the casts round as the host's
/// conversion does).
#[test]
fn device_path_equals_host_path() {
    let cfg = DlrmConfig::tiny();
    let gen = Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.0002)
            .with_seed(8),
    )
    .unwrap();
    let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
    let bsz = 32;
    let opt = EmbeddingOptimizer::Adam {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    // the largest batch's distinct rows (the held-out one's included): rows are evicted
    let capacity = (0..6)
        .chain([77])
        .map(|i| {
            let mut ids = gen.concat_ids(&gen.batch(i, bsz)).unwrap();
            ids.sort_unstable();
            ids.dedup();
            ids.len()
        })
        .max()
        .unwrap();
    for dev in common::devices("dlrm::device_vs_host") {
        for dtype in [DType::F32, DType::F16] {
            for scaler in [ScalerConfig::fixed(1024.0), ScalerConfig::fixed(1000.0)] {
                let run = |device_path: bool| {
                    let mut m = manager_of(dev.clone(), dtype);
                    let model = Dlrm::register(&mut m, &cfg, 6).unwrap();
                    let mut emb = CachedEmbeddingCollection::new(
                        dev.clone(),
                        &rows,
                        cfg.dim,
                        capacity,
                        BagMode::Sum,
                        opt,
                        |c| c,
                        table_init(1000),
                    )
                    .unwrap();
                    let mut adam = HybridAdam::new(HybridConfig {
                        loss_scale: Some(scaler),
                        ..HybridConfig::new(AdamConfig::adam(1e-2))
                    })
                    .unwrap();
                    let (mut losses, mut probs) = (vec![], vec![]);
                    for step in 0..6 {
                        let b = gen.batch(step, bsz);
                        let (loss, p) = if device_path {
                            let s = dlrm::train_step(
                                &model,
                                &mut m,
                                &mut adam,
                                &mut emb,
                                &b,
                                Default::default(),
                            )
                            .unwrap();
                            assert_eq!(s.report.outcome, StepOutcome::Stepped);
                            (s.loss, s.probs)
                        } else {
                            host_step(&model, &mut m, &mut adam, &mut emb, &b)
                        };
                        losses.push(loss);
                        probs.extend(p);
                    }
                    let held_out = gen.batch(77, bsz);
                    probs.extend(if device_path {
                        dlrm::predict(&model, &mut m, &mut emb, &held_out).unwrap()
                    } else {
                        host_predict(&model, &mut m, &mut emb, &held_out)
                    });
                    let params: Vec<f32> = model
                        .named_params()
                        .iter()
                        .flat_map(|(_, id)| m.read(*id).unwrap())
                        .collect();
                    let evicted = emb.bag().cache().moved().d2h_rows;
                    let (w, state) = emb.bag_mut().cache_mut().to_vecs().unwrap();
                    (losses, probs, params, w, state, evicted)
                };
                let (dev_run, host_run) = (run(true), run(false));
                let what = format!("{} {dtype} scale {}", dev.name(), scaler.init_scale);
                assert!(dev_run.5 > 0, "{what}: the cache evicted nothing");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let pairs = [
                    ("losses", &dev_run.0, &host_run.0),
                    ("probs", &dev_run.1, &host_run.1),
                    ("params", &dev_run.2, &host_run.2),
                    ("rows", &dev_run.3, &host_run.3),
                    ("state", &dev_run.4, &host_run.4),
                ];
                for (name, d, h) in pairs {
                    let diff = rel_diff(d, h);
                    assert_eq!(
                        bits(d),
                        bits(h),
                        "{what} {name}: the same bits ({diff:e} apart)"
                    );
                }
            }
        }
    }
}

/// The sample-major forward refuses tables of different numbers of bags (and the collection's
/// other bad input) before anything changes.
#[test]
fn the_sample_major_forward_needs_one_bag_per_sample_in_every_table() {
    let dev = common::sim(64 << 20);
    let mut emb = CachedEmbeddingCollection::new(
        dev,
        &[10, 20],
        4,
        16,
        BagMode::Sum,
        EmbeddingOptimizer::Sgd { lr: 0.1 },
        |c| c,
        table_init(20),
    )
    .unwrap();
    let (ids0, two) = ([1u32, 2], [0u32, 1, 2]);
    let batch = |i1: &'static [u32], o1: &'static [u32]| {
        vec![
            tidemem::embedding::TableBatch {
                indices: &ids0,
                offsets: &two,
                weights: None,
            },
            tidemem::embedding::TableBatch {
                indices: i1,
                offsets: o1,
                weights: None,
            },
        ]
    };
    let uneven = batch(&[3, 4, 5], &[0, 1, 2, 3]);
    let r = emb.forward_device_interleaved(&uneven);
    assert!(
        matches!(
            r,
            Err(Error::Length {
                got: 3,
                expected: 2,
                ..
            })
        ),
        "{r:?}"
    );
    let out_of_range = batch(&[3, 40], &[0, 1, 2]);
    let r = emb.forward_device_interleaved(&out_of_range);
    assert!(
        matches!(
            r,
            Err(Error::IdOutOfRange {
                table: Some(1),
                id: 40,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(emb.output().is_err(), "a refused forward left an output");
    assert_eq!(emb.bag().cache().moved().h2d_rows, 0);
    // two samples of two tables: rows sample-major, each the table's row
    let good = batch(&[3, 4], &[0, 1, 2]);
    assert_eq!(emb.forward_device_interleaved(&good).unwrap(), 2);
    let out: Vec<f32> = bytemuck::pod_collect_to_vec(
        &emb.bag()
            .cache()
            .device()
            .download(emb.stream(), emb.output().unwrap())
            .unwrap(),
    );
    let table = emb.forward(&good).unwrap();
    for s in 0..2 {
        for t in 0..2 {
            assert_eq!(
                out[(s * 2 + t) * 4..(s * 2 + t + 1) * 4],
                table[(t * 2 + s) * 4..(t * 2 + s + 1) * 4]
            );
        }
    }
}
