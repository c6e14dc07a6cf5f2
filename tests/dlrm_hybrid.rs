//! Hybrid-parallel DLRM training (`models::dlrm::train_step` on sharded tables: tables sharded over the
//! ranks, MLPs data-parallel in a `ZeroManager`) on 2 and 4 in-process ranks, table-wise and
//! column-wise, against one rank training on the whole batch (`train_step` with a
//! `ChunkManager` and a `CachedEmbeddingCollection`): the losses, the probabilities, the MLP
//! parameters and the embedding rows after a few steps, with a batch that no world size
//! divides. Two wrong normalisations run through the same comparison fail it, so it can fail;
//! and a rank-inconsistent or bad call is an error on every rank, not a hang.

mod common;

use std::time::Duration;

use tidemem::data::criteo::{Batch, Dataset, Synthetic, SyntheticConfig};
use tidemem::embedding::{batch_slice, CachedEmbeddingCollection, ShardedEmbedding, Sharding};
use tidemem::models::dlrm::{self, bag_offsets, table_batches, Dlrm, DlrmConfig};
use tidemem::ops::embedding::BagMode;
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::prelude::*;
use tidemem::rng::{Rng, SplitMix64};

/// Samples per batch: 37 = 18 + 19 over 2 ranks, 9 + 9 + 9 + 10 over 4.
const BSZ: usize = 37;
const STEPS: u64 = 4;
/// Tolerance of every comparison, as [`rel_err`] measures it (largest difference over the
/// reference's largest magnitude). The only differences from one rank are the order of the
/// MLP gradients' sums (per rank, then averaged over ranks) and of the loss's; the embedding
/// gradient per sample is bitwise the one-rank one. Measured: see the test's output (about
/// 1e-7).
const TOL: f64 = 1e-5;

fn config(dtype: DType) -> ManagerConfig {
    // small chunks, so that the MLP's chunk groups are spread over the ranks
    let mut cfg = ManagerConfig::new(32, Policy::Tide);
    cfg.param_dtype = dtype;
    cfg
}

/// The MLP optimizer: Adam with an `eps` large next to the gradients, so that the update
/// depends on the gradient's scale (with a tiny `eps` Adam's first steps hardly see a gradient
/// off by a constant factor, and the comparison would not catch a wrong `1/world`).
fn mlp_adam() -> HybridAdam {
    let adam = AdamConfig {
        eps: 1e-3,
        ..AdamConfig::adam(1e-2)
    };
    HybridAdam::new(HybridConfig::new(adam)).unwrap()
}

fn generator() -> Synthetic {
    Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.0002)
            .with_seed(7),
    )
    .unwrap()
}

fn rows_of(gen: &Synthetic) -> Vec<usize> {
    gen.cardinalities().iter().map(|&n| n as usize).collect()
}

/// An embedding row: uniform in `±√(1/1000)`, from a hash of the table and id.
fn table_init(t: usize, id: u32, row: &mut [f32]) {
    let b = (1.0f64 / 1000.0).sqrt();
    let mut r = SplitMix64::new(((t as u64) << 32 | u64::from(id)) ^ 0xd1e5);
    for x in row {
        *x = (-b + 2.0 * b * (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64) as f32;
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, &w| m.max(f64::from(w).abs()));
    let diff = got.iter().zip(want).fold(0.0f64, |m, (&g, &w)| {
        m.max((f64::from(g) - f64::from(w)).abs())
    });
    diff / scale.max(1e-30)
}

/// What a run ends with: every step's loss, every step's probabilities of the whole batch,
/// the MLP parameters (in `named_params` order), the embedding rows of every table
/// (`[Σ rows, dim]`, global id order), and every step's touched-row count.
#[derive(Debug)]
struct Run {
    losses: Vec<f32>,
    probs: Vec<f32>,
    params: Vec<Vec<f32>>,
    table: Vec<f32>,
    rows: Vec<usize>,
    /// `predict_hybrid` (or its host twin) on the first batch after training, the ranks'
    /// slices in rank order (empty for one rank's run).
    pred: Vec<f32>,
}

fn single(batches: &[Batch], rows: &[usize], opt: EmbeddingOptimizer) -> Run {
    let cfg = DlrmConfig::tiny();
    let dev = common::sim(256 << 20);
    let mut m = ChunkManager::new(dev.clone(), config(DType::F32)).unwrap();
    let model = Dlrm::register(&mut m, &cfg, 2).unwrap();
    let mut emb = CachedEmbeddingCollection::new(
        dev,
        rows,
        cfg.dim,
        BSZ * cfg.tables,
        BagMode::Sum,
        opt,
        |c| c,
        table_init,
    )
    .unwrap();
    let mut adam = mlp_adam();
    let (mut losses, mut probs, mut touched) = (vec![], vec![], vec![]);
    for b in batches {
        let s =
            dlrm::train_step(&model, &mut m, &mut adam, &mut emb, b, Default::default()).unwrap();
        losses.push(s.loss);
        probs.extend(s.probs);
        touched.push(s.rows);
    }
    let params = model
        .named_params()
        .iter()
        .map(|(_, id)| m.read(*id).unwrap())
        .collect();
    let table = emb.bag_mut().cache_mut().to_vecs().unwrap().0;
    Run {
        losses,
        probs,
        params,
        table,
        rows: touched,
        pred: vec![],
    }
}

/// How the ranks normalise their loss: right, or two wrong ways (for the comparison's own
/// check).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// `train_step` on sharded tables.
    Hybrid,
    /// `train_step` with `StepPlan::host_vectors`: the pooled vectors through the host (the device path's
    /// reference).
    HybridHost,
    /// Each rank's MLP loss the mean over its own samples, and the embedding gradient of it
    /// (what a one-rank step run on each slice would do).
    LocalMean,
    /// The one-rank scale `1/B` on each rank's MLP gradients, forgetting that the store
    /// averages over the ranks (the gradients `world` times too small); the embedding gradient
    /// right.
    ForgotWorld,
}

/// One rank's step in a wrong `mode`, through the public pieces.
fn wrong_step(
    model: &Dlrm,
    z: &mut ZeroManager,
    adam: &mut HybridAdam,
    emb: &mut ShardedEmbedding,
    b: &Batch,
    mode: Mode,
) -> (f32, Vec<f32>) {
    let (world, rank) = (emb.comm().world(), emb.comm().rank());
    let (s0, s1) = batch_slice(b.size, world, rank);
    let n = s1 - s0;
    let offsets = bag_offsets(b.size).unwrap();
    let pooled = emb.forward(&table_batches(b, &offsets).unwrap()).unwrap();
    let f = model.config().dense_features;
    let k = match mode {
        Mode::LocalMean => 1.0,
        _ => n as f32 / b.size as f32,
    };
    let (loss, mut grad, probs) = model
        .forward_backward_scaled(
            z,
            &pooled,
            &b.dense[s0 * f..s1 * f],
            &b.labels[s0..s1],
            n,
            adam.loss_scale() * k,
        )
        .unwrap();
    if mode == Mode::ForgotWorld {
        // the embedding gradient of the global mean
        grad.iter_mut().for_each(|g| *g *= n as f32 / b.size as f32);
    }
    z.step(adam).unwrap();
    emb.backward(&grad).unwrap();
    emb.step().unwrap();
    (loss, probs)
}

/// What one rank returns: its losses and probabilities, its owned MLP parameters, its
/// tables (or columns) and their rows, and the touched-row counts.
struct RankOut {
    losses: Vec<f32>,
    probs: Vec<f32>,
    owned: Vec<(usize, Vec<f32>)>,
    local_tables: Vec<usize>,
    table: Vec<f32>,
    rows: Vec<usize>,
    pred: Vec<f32>,
}

fn hybrid(
    batches: &[Batch],
    rows: &[usize],
    world: usize,
    sharding: Sharding,
    opt: EmbeddingOptimizer,
    mode: Mode,
) -> Run {
    let devs = (0..world).map(|_| common::sim(256 << 20)).collect();
    hybrid_on(devs, batches, rows, sharding, opt, mode)
}

/// [`hybrid`] on the given devices, one rank each.
fn hybrid_on(
    devs: Vec<Device>,
    batches: &[Batch],
    rows: &[usize],
    sharding: Sharding,
    opt: EmbeddingOptimizer,
    mode: Mode,
) -> Run {
    let cfg = DlrmConfig::tiny();
    let world = devs.len();
    let comms = Communicator::local_with_timeout(devs, Duration::from_secs(60)).unwrap();
    let outs: Vec<RankOut> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let cfg = &cfg;
                s.spawn(move || {
                    let ec = comm.split(Some(0), comm.rank() as u32).unwrap().unwrap();
                    let mut z = ZeroManager::new(comm, config(DType::F32)).unwrap();
                    let model = Dlrm::register(&mut z, cfg, 2).unwrap();
                    let mut emb = ShardedEmbedding::new(
                        ec,
                        sharding,
                        rows,
                        cfg.dim,
                        BSZ * cfg.tables,
                        BagMode::Sum,
                        opt,
                        table_init,
                    )
                    .unwrap();
                    let mut adam = mlp_adam();
                    let (mut losses, mut probs, mut touched) = (vec![], vec![], vec![]);
                    for b in batches {
                        if matches!(mode, Mode::Hybrid | Mode::HybridHost) {
                            let st = if mode == Mode::Hybrid {
                                dlrm::train_step(
                                    &model,
                                    &mut z,
                                    &mut adam,
                                    &mut emb,
                                    b,
                                    Default::default(),
                                )
                            } else {
                                dlrm::train_step(
                                    &model,
                                    &mut z,
                                    &mut adam,
                                    &mut emb,
                                    b,
                                    dlrm::StepPlan {
                                        host_vectors: true,
                                        ..Default::default()
                                    },
                                )
                            }
                            .unwrap();
                            assert_eq!(st.report.outcome, StepOutcome::Stepped);
                            losses.push(st.loss);
                            probs.push(st.probs);
                            touched.push(st.rows);
                        } else {
                            let (l, p) = wrong_step(&model, &mut z, &mut adam, &mut emb, b, mode);
                            losses.push(l);
                            probs.push(p);
                        }
                    }
                    let pred = match mode {
                        Mode::Hybrid => {
                            dlrm::predict_hybrid(&model, &mut z, &mut emb, &batches[0]).unwrap()
                        }
                        Mode::HybridHost => {
                            dlrm::predict_hybrid_host(&model, &mut z, &mut emb, &batches[0])
                                .unwrap()
                        }
                        _ => vec![],
                    };
                    let mut owned = vec![];
                    for (k, (_, id)) in model.named_params().into_iter().enumerate() {
                        if z.owns(id) {
                            owned.push((k, z.master(id).unwrap()));
                        }
                    }
                    let local_tables = emb.local_tables().to_vec();
                    let table = match emb.local_mut() {
                        Some(l) => l.bag_mut().cache_mut().to_vecs().unwrap().0,
                        None => vec![],
                    };
                    RankOut {
                        losses,
                        probs: probs.concat(),
                        owned,
                        local_tables,
                        table,
                        rows: touched,
                        pred,
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if matches!(mode, Mode::Hybrid | Mode::HybridHost) {
        for o in &outs[1..] {
            assert_eq!(
                o.losses, outs[0].losses,
                "every rank returns the global loss"
            );
        }
    }
    assemble(outs, batches, rows, world, sharding)
}

/// The ranks' parts put together as one rank holds them.
fn assemble(
    outs: Vec<RankOut>,
    batches: &[Batch],
    rows: &[usize],
    world: usize,
    sharding: Sharding,
) -> Run {
    let cfg = DlrmConfig::tiny();
    let d = cfg.dim;
    let n_params = cfg.bottom.len() * 2 + cfg.top.len() * 2;
    let mut params = vec![None; n_params];
    for o in &outs {
        for (k, v) in &o.owned {
            assert!(params[*k].is_none(), "parameter {k} owned twice");
            params[*k] = Some(v.clone());
        }
    }
    let params = params.into_iter().map(|p| p.expect("an owner")).collect();
    let start: Vec<usize> = std::iter::once(0)
        .chain(rows.iter().scan(0, |a, &r| {
            *a += r;
            Some(*a)
        }))
        .collect();
    let mut table = vec![f32::NAN; start[rows.len()] * d];
    for (r, o) in outs.iter().enumerate() {
        match sharding {
            Sharding::TableWise => {
                let mut at = 0;
                for &t in &o.local_tables {
                    let n = rows[t] * d;
                    table[start[t] * d..start[t] * d + n].copy_from_slice(&o.table[at..at + n]);
                    at += n;
                }
                assert_eq!(at, o.table.len());
            }
            Sharding::ColumnWise => {
                let (c0, c1) = batch_slice(d, world, r);
                let w = c1 - c0;
                for (i, row) in o.table.chunks(w).enumerate() {
                    table[i * d + c0..i * d + c1].copy_from_slice(row);
                }
            }
        }
    }
    assert!(table.iter().all(|x| !x.is_nan()), "every row gathered");
    // the probabilities of every step, the ranks' slices in rank order
    let mut probs = vec![];
    for step in 0..batches.len() {
        for (r, o) in outs.iter().enumerate() {
            let (a, b) = batch_slice(BSZ, world, r);
            let n = b - a;
            probs.extend_from_slice(&o.probs[step * n..(step + 1) * n]);
        }
    }
    let pred = outs.iter().flat_map(|o| o.pred.iter().copied()).collect();
    Run {
        losses: outs[0].losses.clone(),
        probs,
        params,
        table,
        rows: outs[0].rows.clone(),
        pred,
    }
}

/// The worst of the comparisons of `got` against `want`, with each one's name.
fn compare(got: &Run, want: &Run) -> Vec<(&'static str, f64)> {
    let mut errs = vec![
        ("loss", rel_err(&got.losses, &want.losses)),
        ("probs", rel_err(&got.probs, &want.probs)),
        ("table", rel_err(&got.table, &want.table)),
    ];
    let mlp = got
        .params
        .iter()
        .zip(&want.params)
        .fold(0.0f64, |m, (g, w)| m.max(rel_err(g, w)));
    errs.push(("mlp", mlp));
    errs
}

const ADAM_ROWS: EmbeddingOptimizer = EmbeddingOptimizer::Adam {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
};

#[test]
fn hybrid_training_equals_one_rank_on_the_whole_batch() {
    let gen = generator();
    let rows = rows_of(&gen);
    let batches: Vec<Batch> = (0..STEPS).map(|i| gen.batch(i, BSZ)).collect();
    let cases = [
        (Sharding::TableWise, EmbeddingOptimizer::Sgd { lr: 0.5 }),
        (
            Sharding::TableWise,
            EmbeddingOptimizer::RowwiseAdagrad { lr: 0.1, eps: 1e-8 },
        ),
        (Sharding::ColumnWise, EmbeddingOptimizer::Sgd { lr: 0.5 }),
        (Sharding::ColumnWise, ADAM_ROWS),
    ];
    for (sharding, opt) in cases {
        let want = single(&batches, &rows, opt);
        for world in [2, 4] {
            let got = hybrid(&batches, &rows, world, sharding, opt, Mode::Hybrid);
            assert_eq!(got.rows, want.rows, "touched rows");
            let errs = compare(&got, &want);
            eprintln!("{sharding:?} {opt:?} on {world} ranks: {errs:?}");
            for (what, e) in errs {
                assert!(
                    e <= TOL,
                    "{sharding:?} {opt:?} {world} ranks: {what} off by {e:e}"
                );
            }
        }
    }
}

/// The comparison catches a wrong normalisation: each rank's loss the mean of its own slice
/// (the embedding gradient about `world` times too large, and unequal slices weighed
/// unequally), or the MLP gradients missing the factor `world` the store's average divides
/// by. Each is off by far more than [`TOL`].
#[test]
fn a_wrong_normalisation_fails_the_comparison() {
    let gen = generator();
    let rows = rows_of(&gen);
    let batches: Vec<Batch> = (0..STEPS).map(|i| gen.batch(i, BSZ)).collect();
    let opt = EmbeddingOptimizer::Sgd { lr: 0.5 };
    let want = single(&batches, &rows, opt);
    for (mode, what) in [(Mode::LocalMean, "table"), (Mode::ForgotWorld, "mlp")] {
        let got = hybrid(&batches, &rows, 2, Sharding::TableWise, opt, mode);
        let errs = compare(&got, &want);
        eprintln!("{mode:?}: {errs:?}");
        let e = errs.iter().find(|(w, _)| *w == what).unwrap().1;
        assert!(e > 100.0 * TOL, "{mode:?}: {what} off by only {e:e}");
    }
}

/// Runs `f` on two in-process ranks with a short timeout; the results in rank order.
fn two_ranks<R: Send>(f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    let devs = (0..2).map(|_| common::sim(256 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, Duration::from_secs(10)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A rank given another batch (another size, or other contents), a batch that does not fit the
/// model, ids out of range, fewer samples than ranks: an error on every rank (the typed one on
/// a rank that found it, "another rank refused" on the others), well within the
/// communicator's timeout, with nothing stepped; the ranks then train on.
#[test]
fn inconsistent_or_bad_calls_fail_on_every_rank() {
    let gen = generator();
    let rows = rows_of(&gen);
    let cfg = DlrmConfig::tiny();
    let good = gen.batch(0, BSZ);
    let bigger = gen.batch(0, BSZ + 1);
    let mut other = good.clone();
    other.labels[3] = 1.0 - other.labels[3];
    let mut out_of_range = good.clone();
    out_of_range.ids[5][2] = rows[5] as u32;
    let mut short = good.clone();
    short.dense.pop();
    let tiny = gen.batch(0, 1);
    // (what rank 0 passes, what rank 1 passes)
    let cases: [(&str, &Batch, &Batch); 5] = [
        ("size", &good, &bigger),
        ("contents", &good, &other),
        ("id range", &out_of_range, &out_of_range),
        ("dense on one rank", &short, &good),
        ("fewer samples than ranks", &tiny, &tiny),
    ];
    let results = two_ranks(|comm| {
        let ec = comm.split(Some(0), comm.rank() as u32).unwrap().unwrap();
        let r = comm.rank();
        let mut z = ZeroManager::new(comm, config(DType::F32)).unwrap();
        let model = Dlrm::register(&mut z, &cfg, 2).unwrap();
        let mut emb = ShardedEmbedding::new(
            ec,
            Sharding::TableWise,
            &rows,
            cfg.dim,
            BSZ * cfg.tables,
            BagMode::Sum,
            EmbeddingOptimizer::Sgd { lr: 0.5 },
            table_init,
        )
        .unwrap();
        let mut adam = mlp_adam();
        let mut seen = vec![];
        for (what, b0, b1) in cases {
            let b = if r == 0 { b0 } else { b1 };
            let t = std::time::Instant::now();
            let step = dlrm::train_step(&model, &mut z, &mut adam, &mut emb, b, Default::default());
            let pred = dlrm::predict_hybrid(&model, &mut z, &mut emb, b);
            assert!(t.elapsed() < Duration::from_secs(5), "{what}: no timeout");
            assert_eq!(z.stage(), None, "{what}");
            seen.push((what, step.map(|_| ()), pred.map(|_| ())));
        }
        assert_eq!(adam.steps(), 0, "nothing stepped");
        // the ranks are still in step
        let st = dlrm::train_step(
            &model,
            &mut z,
            &mut adam,
            &mut emb,
            &good,
            Default::default(),
        )
        .unwrap();
        assert!(st.loss.is_finite());
        seen
    });
    let id = u64::from(out_of_range.ids[5][2]);
    let typed = |what: &str, r: usize, e: &Error| match (what, r) {
        ("size" | "contents", _) => matches!(e, Error::Conflict { .. }),
        ("id range", _) => matches!(
            e,
            Error::IdOutOfRange { table: Some(5), id: i, position: 2, .. } if *i == id
        ),
        ("dense on one rank", 0) => matches!(e, Error::Length { .. }),
        ("dense on one rank", _) => {
            matches!(e, Error::InvalidArgument(m) if m.contains("another rank"))
        }
        ("fewer samples than ranks", _) => matches!(
            e,
            Error::TooFew {
                got: 1,
                need: 2,
                ..
            }
        ),
        _ => false,
    };
    for (r, seen) in results.iter().enumerate() {
        for (what, step, pred) in seen {
            assert!(
                matches!(step, Err(e) if typed(what, r, e)),
                "rank {r} {what}: {step:?}"
            );
            assert!(
                matches!(pred, Err(e) if typed(what, r, e)),
                "rank {r} {what}: {pred:?}"
            );
        }
    }
}

/// On one rank the hybrid step is the one-rank step: the same bits.
#[test]
fn one_rank_is_bitwise_the_one_rank_step() {
    let gen = generator();
    let rows = rows_of(&gen);
    let batches: Vec<Batch> = (0..STEPS).map(|i| gen.batch(i, BSZ)).collect();
    let want = single(&batches, &rows, ADAM_ROWS);
    let got = hybrid(
        &batches,
        &rows,
        1,
        Sharding::ColumnWise,
        ADAM_ROWS,
        Mode::Hybrid,
    );
    assert_eq!(got.losses, want.losses);
    assert_eq!(got.probs, want.probs);
    assert_eq!(got.params, want.params);
    assert!(got.table == want.table);
}

/// The bits of every value of a run.
fn run_bits(r: &Run) -> Vec<Vec<u32>> {
    let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut out = vec![b(&r.losses), b(&r.probs), b(&r.table), b(&r.pred)];
    out.extend(r.params.iter().map(|p| b(p)));
    out
}

/// The device hybrid step (`train_step` on sharded tables, `predict_hybrid`: the pooled vectors and their
/// gradients stay on the device, the all-to-all moves them there) equals the host one
/// (`StepPlan::host_vectors`, `predict_hybrid_host`) bit for bit in f32: the losses, the
/// probabilities of every step, the predictions after training, the MLP parameters and every
/// embedding row, table-wise and column-wise on 2 ranks, on Sim devices and, where there is
/// one, with both ranks on the CUDA device.
#[test]
fn device_hybrid_step_equals_the_host_one_bitwise() {
    let gen = generator();
    let rows = rows_of(&gen);
    let batches: Vec<Batch> = (0..STEPS).map(|i| gen.batch(i, BSZ)).collect();
    let gpu = common::cuda("device_hybrid_step_equals_the_host_one_bitwise");
    let cases = [
        (Sharding::TableWise, EmbeddingOptimizer::Sgd { lr: 0.5 }),
        (
            Sharding::TableWise,
            EmbeddingOptimizer::RowwiseAdagrad { lr: 0.1, eps: 1e-8 },
        ),
        (Sharding::ColumnWise, ADAM_ROWS),
    ];
    for (sharding, opt) in cases {
        // both ranks on Sim devices, or both on the CUDA device
        let devs = |g: Option<&Device>| match g {
            Some(g) => vec![g.clone(), g.clone()],
            None => vec![common::sim(256 << 20), common::sim(256 << 20)],
        };
        let groups = std::iter::once(("sim", None)).chain(gpu.as_ref().map(|g| ("cuda", Some(g))));
        for (name, g) in groups {
            let t = std::time::Instant::now();
            let host = hybrid_on(devs(g), &batches, &rows, sharding, opt, Mode::HybridHost);
            let t_host = t.elapsed();
            let t = std::time::Instant::now();
            let dev = hybrid_on(devs(g), &batches, &rows, sharding, opt, Mode::Hybrid);
            let t_dev = t.elapsed();
            eprintln!("{name} {sharding:?} {opt:?}: host {t_host:?}, device {t_dev:?}");
            assert_eq!(dev.rows, host.rows, "{name} {sharding:?}: touched rows");
            assert_eq!(dev.pred.len(), BSZ);
            let (d, h) = (run_bits(&dev), run_bits(&host));
            for (i, what) in ["loss", "probs", "table", "pred"].iter().enumerate() {
                assert!(d[i] == h[i], "{name} {sharding:?} {opt:?}: {what} differs");
            }
            assert!(
                d[4..] == h[4..],
                "{name} {sharding:?} {opt:?}: MLP parameters differ"
            );
        }
    }
}

/// An f16 step whose scaled gradients overflow is skipped on every rank alike: no MLP master
/// and no embedding row moves, the step reports no touched rows; the scale backs off until
/// a step goes through, on every rank at the same step, and then the rows do move.
#[test]
fn an_overflowing_step_is_skipped_on_every_rank() {
    let gen = generator();
    let rows = rows_of(&gen);
    let cfg = DlrmConfig::tiny();
    let scaler = tidemem::optim::ScalerConfig {
        init_scale: 16_777_216.0,
        backoff: 0.25,
        hysteresis: 1,
        ..Default::default()
    };
    for sharding in [Sharding::TableWise, Sharding::ColumnWise] {
        let per_rank = two_ranks(|comm| {
            let ec = comm.split(Some(0), comm.rank() as u32).unwrap().unwrap();
            let mut z = ZeroManager::new(comm, config(DType::F16)).unwrap();
            let model = Dlrm::register(&mut z, &cfg, 2).unwrap();
            let opt = EmbeddingOptimizer::Sgd { lr: 0.5 };
            let mut emb = ShardedEmbedding::new(
                ec,
                sharding,
                &rows,
                cfg.dim,
                BSZ * cfg.tables,
                BagMode::Sum,
                opt,
                table_init,
            )
            .unwrap();
            let mut hc = HybridConfig::new(AdamConfig::adam(1e-2));
            hc.loss_scale = Some(scaler);
            let mut adam = HybridAdam::new(hc).unwrap();
            let snapshot = |z: &mut ZeroManager, emb: &mut ShardedEmbedding| {
                let mut masters: Vec<Vec<f32>> = vec![];
                for (_, id) in model.named_params() {
                    if z.owns(id) {
                        masters.push(z.master(id).unwrap());
                    }
                }
                let table = match emb.local_mut() {
                    Some(l) => l.bag_mut().cache_mut().to_vecs().unwrap().0,
                    None => vec![],
                };
                (masters, table)
            };
            // a prediction first: it closes the store's registration, so masters can be read
            dlrm::predict_hybrid(&model, &mut z, &mut emb, &gen.batch(99, BSZ)).unwrap();
            let mut outcomes = vec![];
            for step in 0..12 {
                let before = snapshot(&mut z, &mut emb);
                let b = gen.batch(step, BSZ);
                let st =
                    dlrm::train_step(&model, &mut z, &mut adam, &mut emb, &b, Default::default())
                        .unwrap();
                let after = snapshot(&mut z, &mut emb);
                if st.report.outcome == StepOutcome::Skipped {
                    assert_eq!(st.rows, 0, "a skipped step touches no row");
                    assert!(before == after, "a skipped step changed the model");
                } else {
                    assert!(st.rows > 0);
                    assert!(before.1 != after.1 || before.1.is_empty(), "rows moved");
                    assert!(before.0 != after.0 || before.0.is_empty(), "masters moved");
                }
                outcomes.push(st.report.outcome);
            }
            outcomes
        });
        assert_eq!(per_rank[0], per_rank[1], "{sharding:?}: the ranks agree");
        eprintln!("{sharding:?}: {:?}", per_rank[0]);
        let o = &per_rank[0];
        assert_eq!(
            o[0],
            StepOutcome::Skipped,
            "{sharding:?}: 2^24 overflows f16"
        );
        assert!(
            o.contains(&StepOutcome::Stepped),
            "{sharding:?}: the scale backs off until a step goes through: {o:?}"
        );
    }
}
