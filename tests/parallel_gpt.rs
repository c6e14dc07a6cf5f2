//! A GPT split over a 1D tensor-parallel group (the blocks Megatron's way, the vocabulary split
//! for the embedding and the tied head) trains like the serial GPT: 10 AdamW steps on 2
//! and 4 in-process ranks give the serial losses within 1e-4 relative (the all-reduces sum the
//! shards' partial products in another order), and on a device small enough that shards are
//! evicted and reloaded the same bits as with everything resident.

mod common;

use tidemem::comm::Communicator;
use tidemem::models::gpt::{
    default_init, train_step, train_two_bw_stream, EndsLayout, Gpt, GptBatch, GptConfig, Plan,
};
use tidemem::parallel::pipeline::Schedule;
use tidemem::parallel::{GridSpec, OneD, Placement, ProcessGrid, Summa, TensorMode};
use tidemem::prelude::*;

const B: usize = 4;
const T: usize = 16;
const STEPS: u64 = 10;
/// Chunk elements: small, so that even a quarter of the model spans several chunks.
const CHUNK: usize = 1024;

fn config() -> GptConfig {
    GptConfig {
        layers: 2,
        channels: 32,
        heads: 4,
        vocab: 64,
        max_seq: T,
        eps: 1e-5,
    }
}

fn batch(k: u64) -> (Vec<i32>, Vec<i32>) {
    let v = config().vocab as u64;
    let tok = |r: usize, t: usize| ((k * 7 + r as u64 * 3 + t as u64 * 5) % v) as i32;
    let tokens = (0..B)
        .flat_map(|r| (0..T).map(move |t| tok(r, t)))
        .collect();
    let targets = (0..B)
        .flat_map(|r| (0..T).map(move |t| tok(r, t + 1)))
        .collect();
    (tokens, targets)
}

fn adam() -> HybridAdam {
    HybridAdam::new(HybridConfig {
        // small enough that every step clips: the norm must be the global one
        max_grad_norm: Some(0.05),
        placement: tidemem::optim::DevicePlacement::HostOnly,
        ..HybridConfig::new(AdamConfig::adamw(3e-3, 0.01))
    })
    .unwrap()
}

fn manager(dev: Device, capacity: u64) -> ChunkManager {
    let mut cfg = ManagerConfig::new(CHUNK, Policy::Tide);
    cfg.param_dtype = DType::F32;
    cfg.scheduler.capacity = capacity;
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 0.3;
    let mut m = ChunkManager::new(dev.clone(), cfg).unwrap();
    m.set_non_model_allocator(CachingAllocator::new(dev));
    m
}

/// Losses (bits) and gradient norms of `STEPS` steps, and the run's non-model peak,
/// parameter chunk bytes and steady h2d bytes.
type Trained = (Vec<u32>, Vec<f64>, u64, u64, u64);

/// This rank's part of the model with [`Gpt::register`]'s masters for seed 3, as `plan`
/// places it.
fn seeded<P: Placement>(store: &mut impl ParamStore, plan: &Plan<'_>) -> tidemem::Result<Gpt<P>> {
    let cfg = config();
    Gpt::register_on(store, plan, &cfg, |n, _| Ok(default_init(&cfg, n, 3)))
}

/// A grid of one tensor-parallel group of `c`'s ranks.
fn tensor_grid(c: &Communicator, tensor: TensorMode) -> ProcessGrid {
    let spec = GridSpec {
        data: 1,
        pipeline: 1,
        sequence: 1,
        tensor,
    };
    ProcessGrid::new(c, spec).unwrap()
}

fn train<P: Placement>(m: &mut ChunkManager, gpt: &Gpt<P>, plan: &Plan<'_>, ckpt: bool) -> Trained {
    let plan = Plan {
        checkpoint: ckpt,
        ..plan.clone()
    };
    let mut opt = adam();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    let mut h2d = 0;
    for k in 0..STEPS {
        let (t, g) = batch(k);
        let b = GptBatch {
            tokens: &t,
            targets: &g,
            batch: B,
            seq: T,
        };
        let r = train_step(gpt, m, &plan, &mut opt, &[b]).unwrap();
        losses.push(r.loss.to_bits());
        norms.push(r.report.grad_norm);
        assert!(r.report.clip_coef < 1.0, "step {k} clips");
        if k >= 2 {
            h2d += m.last_iteration().h2d_bytes;
        }
    }
    (losses, norms, m.non_model_peak(), m.param_footprint(), h2d)
}

#[test]
fn gpt_1d_trains_like_the_serial_gpt() {
    let mut m = manager(common::sim(256 << 20), 256 << 20);
    let gpt = Gpt::register(&mut m, &config(), 3).unwrap();
    let (serial, serial_norms, _, _, _) = train(&mut m, &gpt, &Plan::default(), false);
    let f = |b: &u32| f64::from(f32::from_bits(*b));
    for world in [2, 4] {
        let devs = (0..world).map(|_| common::sim(256 << 20)).collect();
        let comms = Communicator::local(devs).unwrap();
        let runs: Vec<(Vec<u32>, Vec<u32>, Vec<f64>)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let grid = tensor_grid(&c, TensorMode::OneD { size: world });
                        let plan = Plan::on(&grid);
                        let mut m = manager(c.device().clone(), 256 << 20);
                        let gpt: Gpt<OneD> = seeded(&mut m, &plan).unwrap();
                        let (resident, norms, peak, chunks, res_h2d) =
                            train(&mut m, &gpt, &plan, true);
                        // room for the non-model peak and a fifth of the shards' chunks (at
                        // least the three chunks one op may use)
                        let room = (chunks / 5).max(3 * CHUNK as u64 * 4);
                        let mut small = manager(c.device().clone(), peak + room);
                        let gpt: Gpt<OneD> = seeded(&mut small, &plan).unwrap();
                        let (streamed, _, _, _, h2d) = train(&mut small, &gpt, &plan, true);
                        assert!(
                            h2d > res_h2d,
                            "rank {}: shards were evicted and reloaded",
                            c.rank()
                        );
                        (resident, streamed, norms)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (resident, streamed, norms)) in runs.iter().enumerate() {
            // the global norm: sharded gradients summed over the group, replicated ones once
            for (k, (a, b)) in serial_norms.iter().zip(norms).enumerate() {
                let e = (a - b).abs() / a;
                assert!(
                    e < 1e-5,
                    "{world} ranks, rank {r}, step {k}: norm {b} vs serial {a}"
                );
            }
            assert_eq!(
                resident, streamed,
                "{world} ranks, rank {r}: placement changed bits"
            );
            assert_eq!(
                resident, &runs[0].0,
                "{world} ranks: every rank has the same loss"
            );
        }
        let worst = serial
            .iter()
            .zip(&runs[0].0)
            .map(|(a, b)| (f(a) - f(b)).abs() / f(a).abs())
            .fold(0.0, f64::max);
        assert!(
            worst < 1e-4,
            "{world} ranks: losses within {worst:.2e} of the serial ones"
        );
        assert!(f(&serial[9]) < f(&serial[0]), "the loss falls");
        eprintln!(
            "1D GPT on {world} ranks: worst relative loss error {worst:.2e} over {STEPS} steps"
        );
    }
}

#[test]
fn a_split_model_needs_its_group() {
    let spec = GridSpec {
        data: 1,
        pipeline: 1,
        sequence: 1,
        tensor: TensorMode::OneD { size: 2 },
    };
    on_grid(spec, |c, grid| {
        let plan = Plan::on(grid);
        let mut m = manager(c.device().clone(), 64 << 20);
        let gpt: Gpt<OneD> = seeded(&mut m, &plan).unwrap();
        let (t, g) = batch(0);
        let b = GptBatch {
            tokens: &t,
            targets: &g,
            batch: B,
            seq: T,
        };
        let alone = Plan::default();
        assert!(
            gpt.forward_backward(&mut m, &alone, &b, 1.0).is_err(),
            "no group"
        );
        assert_eq!(m.stage(), None, "nothing ran");
        let mut bad = config();
        bad.heads = 3;
        bad.channels = 33;
        let mut m = manager(c.device().clone(), 64 << 20);
        let init = |n: &str, _: &[usize]| Ok(default_init(&bad, n, 3));
        assert!(Gpt::<OneD>::register_on(&mut m, &plan, &bad, init).is_err());
    });
}

/// One process on the whole batch: the losses (bits) and gradient norms the split runs match.
fn serial() -> (Vec<u32>, Vec<f64>) {
    let mut m = manager(common::sim(256 << 20), 256 << 20);
    let gpt = Gpt::register(&mut m, &config(), 3).unwrap();
    let (losses, norms, _, _, _) = train(&mut m, &gpt, &Plan::default(), false);
    (losses, norms)
}

/// Runs `f` on every rank of a grid of `spec` over in-process ranks (one thread each).
fn on_grid<R: Send>(spec: GridSpec, f: impl Fn(&Communicator, &ProcessGrid) -> R + Sync) -> Vec<R> {
    let devs = (0..spec.world()).map(|_| common::sim(256 << 20)).collect();
    let comms = Communicator::local(devs).unwrap();
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
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A ZeRO store (f32) over the ranks holding this rank's shards (data × sequence).
fn zero_store(c: &Communicator, grid: &ProcessGrid) -> ZeroManager {
    let mut cfg = ManagerConfig::new(CHUNK, Policy::Tide);
    cfg.param_dtype = DType::F32;
    ZeroManager::new(grid.split_replicas(c).unwrap(), cfg).unwrap()
}

/// A batch's tokens and targets as 4 micro-batches of `B / 4` sequences.
fn quarters<'a>(t: &'a [i32], g: &'a [i32]) -> Vec<GptBatch<'a>> {
    let quarter = B / 4 * T;
    (0..4)
        .map(|j| GptBatch {
            tokens: &t[j * quarter..(j + 1) * quarter],
            targets: &g[j * quarter..(j + 1) * quarter],
            batch: B / 4,
            seq: T,
        })
        .collect()
}

/// The `rows` batch rows of data rank `dp` of step `k`'s batch.
fn rows_of(k: u64, dp: usize, rows: usize) -> (Vec<i32>, Vec<i32>) {
    let (t, g) = batch(k);
    let r = dp * rows * T..(dp + 1) * rows * T;
    (t[r.clone()].to_vec(), g[r].to_vec())
}

/// The mean of a loss over every rank of `c` (each tensor group's ranks hold the same loss,
/// so it is the mean over the data ranks' rows: the whole batch's).
fn mean_loss(c: &Communicator, loss: f32) -> f32 {
    let mut l = [f64::from(loss) / c.world() as f64];
    c.all_reduce_host(&mut l, tidemem::comm::ReduceOp::Sum)
        .unwrap();
    l[0] as f32
}

/// Every rank's losses within 1e-4 relative of the serial ones and its gradient norms within
/// 1e-5; returns the worst loss error.
fn like_serial(what: &str, serial: &(Vec<u32>, Vec<f64>), runs: &[(Vec<f32>, Vec<f64>)]) -> f64 {
    let f = |b: &u32| f64::from(f32::from_bits(*b));
    let mut worst = 0.0f64;
    for (r, (losses, norms)) in runs.iter().enumerate() {
        for k in 0..STEPS as usize {
            let want = f(&serial.0[k]);
            let e = (want - f64::from(losses[k])).abs() / want;
            worst = worst.max(e);
            assert!(
                e < 1e-4,
                "{what}, rank {r}, step {k}: loss {} vs {want}",
                losses[k]
            );
            let n = (serial.1[k] - norms[k]).abs() / serial.1[k];
            assert!(
                n < 1e-5,
                "{what}, rank {r}, step {k}: norm {} vs {}",
                norms[k],
                serial.1[k]
            );
        }
    }
    eprintln!("{what}: worst relative loss error {worst:.2e} over {STEPS} steps");
    worst
}

/// Tensor × data parallelism on 8 ranks: 1D groups of 2, ZeRO over the 4 data-parallel ranks
/// (one batch row each), against one process on the whole batch: the losses within 1e-4
/// relative and the gradient norms within 1e-5 (ZeRO averages the gradients in another order).
#[test]
fn gpt_1d_with_zero_on_8_ranks_trains_like_the_serial_gpt() {
    let spec = GridSpec {
        data: 4,
        pipeline: 1,
        sequence: 1,
        tensor: TensorMode::OneD { size: 2 },
    };
    let runs = on_grid(spec, |c, grid| {
        let mut z = zero_store(c, grid);
        let plan = Plan::on(grid);
        let gpt: Gpt<OneD> = seeded(&mut z, &plan).unwrap();
        let mut opt = adam();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for k in 0..STEPS {
            let (t, g) = rows_of(k, grid.data_rank(), 1);
            let b = GptBatch {
                tokens: &t,
                targets: &g,
                batch: 1,
                seq: T,
            };
            let plan = Plan {
                checkpoint: k % 2 == 0,
                ..plan.clone()
            };
            let r = train_step(&gpt, &mut z, &plan, &mut opt, &[b]).unwrap();
            losses.push(mean_loss(c, r.loss));
            norms.push(r.report.grad_norm);
        }
        (losses, norms)
    });
    like_serial("1D × ZeRO on 8 ranks", &serial(), &runs);
}

/// A GPT on the 2D (4 ranks), 2.5D (8 ranks as 2×2×2) and 3D (8 ranks) blocks trains 10
/// clipped AdamW steps to the serial losses (within 1e-4 relative) with the serial gradient
/// norms (within 1e-5), every rank alike, with its ends split and with them whole; on a device small enough that shards are evicted
/// and reloaded, and with every block checkpointed, the same loss bits as all resident.
#[test]
fn gpt_on_2d_25d_3d_grids_trains_like_the_serial_gpt() {
    let serial = serial();
    let modes = [
        TensorMode::TwoD { q: 2 },
        TensorMode::TwoHalfD { q: 2, depth: 2 },
        TensorMode::ThreeD { q: 2 },
    ];
    for mode in modes {
        let spec = GridSpec {
            data: 1,
            pipeline: 1,
            sequence: 1,
            tensor: mode,
        };
        let runs = on_grid(spec, |c, grid| {
            tidemem::with_placement!(mode, |P| {
                // all resident, then on a device of the non-model peak and a fifth of the shards'
                // chunks (at least three): the same bits, chunks moving
                let run = |capacity: u64, checkpoint: bool, ends: EndsLayout| {
                    let mut m = manager(c.device().clone(), capacity);
                    let plan = Plan {
                        ends,
                        checkpoint,
                        ..Plan::on(grid)
                    };
                    let gpt: Gpt<P> = seeded(&mut m, &plan).unwrap();
                    let mut opt = adam();
                    let (mut losses, mut norms, mut h2d) = (Vec::new(), Vec::new(), 0);
                    for k in 0..STEPS {
                        let (t, g) = batch(k);
                        let b = GptBatch {
                            tokens: &t,
                            targets: &g,
                            batch: B,
                            seq: T,
                        };
                        let r = train_step(&gpt, &mut m, &plan, &mut opt, &[b]).unwrap();
                        losses.push(r.loss);
                        norms.push(r.report.grad_norm);
                        if k >= 2 {
                            h2d += m.last_iteration().h2d_bytes;
                        }
                    }
                    let room = (m.param_footprint() / 5).max(3 * CHUNK as u64 * 4);
                    (losses, norms, h2d, m.non_model_peak() + room)
                };
                // checkpointing and streaming: neither changes a bit
                let split = EndsLayout::Split;
                let (losses, norms, _, whole) = run(256 << 20, false, split);
                let (checkpointed, _, resident_h2d, small) = run(256 << 20, true, split);
                assert!(small < whole, "{mode}: checkpointing holds less");
                let (streamed, _, h2d, _) = run(small, true, split);
                let (whole_ends, whole_norms, _, _) = run(256 << 20, false, EndsLayout::Whole);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&losses),
                    bits(&checkpointed),
                    "{mode}: checkpointing changed bits"
                );
                assert_eq!(
                    bits(&losses),
                    bits(&streamed),
                    "{mode}: placement changed bits"
                );
                assert!(
                    h2d > resident_h2d,
                    "{mode}: shards were evicted and reloaded"
                );
                (losses, norms, whole_ends, whole_norms)
            })
        });
        let (split, whole): (Vec<_>, Vec<_>) = runs
            .into_iter()
            .map(|(a, b, c, d)| ((a, b), (c, d)))
            .unzip();
        let w = like_serial(&format!("GPT on {mode}"), &serial, &split);
        let v = like_serial(&format!("GPT on {mode}, ends whole"), &serial, &whole);
        eprintln!("GPT on {mode}: worst loss error {w:.1e} (ends split), {v:.1e} (whole)");
    }
}

/// 2D × ZeRO on 8 ranks (data 2 × 2d:2, two batch rows a data rank) against one process on
/// the whole batch.
#[test]
fn gpt_2d_with_zero_on_8_ranks_trains_like_the_serial_gpt() {
    let spec = GridSpec {
        data: 2,
        pipeline: 1,
        sequence: 1,
        tensor: TensorMode::TwoD { q: 2 },
    };
    let runs = on_grid(spec, |c, grid| {
        let mut z = zero_store(c, grid);
        let plan = Plan::on(grid);
        let gpt: Gpt<Summa> = seeded(&mut z, &plan).unwrap();
        let mut opt = adam();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for k in 0..STEPS {
            let (t, g) = rows_of(k, grid.data_rank(), 2);
            let b = GptBatch {
                tokens: &t,
                targets: &g,
                batch: 2,
                seq: T,
            };
            let r = train_step(&gpt, &mut z, &plan, &mut opt, &[b]).unwrap();
            losses.push(mean_loss(c, r.loss));
            norms.push(r.report.grad_norm);
        }
        (losses, norms)
    });
    like_serial("2D × ZeRO on 8 ranks", &serial(), &runs);
}

/// Gradient accumulation on a 2D grid: each step's batch as two micro-batches of two rows
/// (checkpointed) trains to the serial losses and norms on the whole batch.
#[test]
fn gpt_2d_accumulating_two_micro_batches_trains_like_the_serial_gpt() {
    let spec = GridSpec {
        data: 1,
        pipeline: 1,
        sequence: 1,
        tensor: TensorMode::TwoD { q: 2 },
    };
    let runs = on_grid(spec, |c, grid| {
        let mut m = manager(c.device().clone(), 256 << 20);
        let plan = Plan {
            checkpoint: true,
            ..Plan::on(grid)
        };
        let gpt: Gpt<Summa> = seeded(&mut m, &plan).unwrap();
        let mut opt = HybridAdam::new(HybridConfig {
            max_grad_norm: Some(0.05),
            placement: tidemem::optim::DevicePlacement::HostOnly,
            accumulation_steps: 2,
            ..HybridConfig::new(AdamConfig::adamw(3e-3, 0.01))
        })
        .unwrap();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for k in 0..STEPS {
            let (t, g) = batch(k);
            let half = B / 2 * T;
            let micro = [0, 1].map(|h| GptBatch {
                tokens: &t[h * half..(h + 1) * half],
                targets: &g[h * half..(h + 1) * half],
                batch: B / 2,
                seq: T,
            });
            let r = train_step(&gpt, &mut m, &plan, &mut opt, &micro).unwrap();
            losses.push(r.loss);
            norms.push(r.report.grad_norm);
        }
        (losses, norms)
    });
    like_serial("2D accumulating 2 micro-batches", &serial(), &runs);
}

/// Sequence parallelism: each sequence's positions split over a ring of 2 and 4 ranks, and on
/// 8 ranks as data 2 × sequence 2 × `1d:2`, with ZeRO over the ranks that hold the same shards
/// (data × sequence), checkpointing every other step: the losses (the mean over the ranks'
/// tokens) and gradient norms of one process on the whole batch.
#[test]
fn gpt_with_the_sequence_split_trains_like_the_serial_gpt() {
    let serial = serial();
    let shapes = [
        (1, 2, TensorMode::None),
        (1, 4, TensorMode::None),
        (2, 2, TensorMode::OneD { size: 2 }),
    ];
    for (data, sequence, tensor) in shapes {
        let spec = GridSpec {
            data,
            pipeline: 1,
            sequence,
            tensor,
        };
        let runs = on_grid(spec, |c, grid| {
            tidemem::with_placement!(tensor, |P| ring_steps::<P>(c, grid, 0))
        });
        like_serial(&format!("GPT over {spec}"), &serial, &runs);
    }
}

/// `STEPS` steps of a rank of `grid` (a sequence ring), ZeRO over the data × sequence replicas:
/// each rank trains on its data rank's rows and its place's positions of each, checkpointing
/// the steps `k` with `k % 2 == parity`; the mean losses over the ranks and the norms.
fn ring_steps<P: Placement>(
    c: &Communicator,
    grid: &ProcessGrid,
    parity: u64,
) -> (Vec<f32>, Vec<f64>) {
    let spec = grid.spec();
    let mut z = zero_store(c, grid);
    let gpt: Gpt<P> = seeded(&mut z, &Plan::on(grid)).unwrap();
    let mut opt = adam();
    let (rows, l, r) = (B / spec.data, T / spec.sequence, grid.sequence_rank());
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for k in 0..STEPS {
        let (t, g) = rows_of(k, grid.data_rank(), rows);
        // this rank's positions of each sequence
        let block = |v: &[i32]| -> Vec<i32> {
            (0..rows)
                .flat_map(|i| v[i * T + r * l..i * T + (r + 1) * l].to_vec())
                .collect()
        };
        let (t, g) = (block(&t), block(&g));
        let b = GptBatch {
            tokens: &t,
            targets: &g,
            batch: rows,
            seq: l,
        };
        let plan = Plan {
            checkpoint: k % 2 == parity,
            ..Plan::on(grid)
        };
        let s = train_step(&gpt, &mut z, &plan, &mut opt, &[b]).unwrap();
        losses.push(mean_loss(c, s.loss));
        norms.push(s.report.grad_norm);
    }
    (losses, norms)
}

/// `STEPS` steps of GPT-2's two blocks over the two stages of `grid` (its tensor mode the
/// blocks' split, the ends as `ends` says), `m` micro-batches a step: every rank's losses and
/// gradient norms, and the elements of its copy of `wte`. Without data or sequence
/// replicas, checks that the first and the last stage's copies of wte hold the same bits.
fn train_stages<P: Placement>(
    c: &Communicator,
    grid: &ProcessGrid,
    schedule: Schedule,
    m: usize,
    ends: EndsLayout,
) -> ((Vec<f32>, Vec<f64>), usize) {
    let spec = grid.spec();
    let (data, sequence) = (spec.data, spec.sequence);
    let mut z = zero_store(c, grid);
    let plan = Plan {
        ends,
        schedule,
        ..Plan::on(grid)
    };
    let gpt: Gpt<P> = seeded(&mut z, &plan).unwrap();
    let mut opt = adam();
    let (rows, l, r) = (B / data, T / sequence, grid.sequence_rank());
    let per = rows / m;
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for k in 0..STEPS {
        let (t, g) = rows_of(k, grid.data_rank(), rows);
        // micro-batch j: rows j·per .., this rank's positions of each
        let block = |v: &[i32], j: usize| -> Vec<i32> {
            (j * per..(j + 1) * per)
                .flat_map(|i| v[i * T + r * l..i * T + (r + 1) * l].to_vec())
                .collect()
        };
        let data: Vec<(Vec<i32>, Vec<i32>)> =
            (0..m).map(|j| (block(&t, j), block(&g, j))).collect();
        let micro: Vec<GptBatch> = data
            .iter()
            .map(|(t, g)| GptBatch {
                tokens: t,
                targets: g,
                batch: per,
                seq: l,
            })
            .collect();
        let s = train_step(&gpt, &mut z, &plan, &mut opt, &micro).unwrap();
        let rep = s.stage.as_ref().expect("a pipeline stage's report");
        assert!(rep.peak_in_flight <= rep.in_flight_bound);
        losses.push(mean_loss(c, s.loss));
        norms.push(s.report.grad_norm);
    }
    let wte = gpt.param("wte.weight").unwrap();
    if data * sequence == 1 {
        // the first and the last stage's copies of wte: the same bits
        let bits = z.read(wte).unwrap().iter().fold(0i64, |h, x| {
            h.wrapping_mul(31).wrapping_add(i64::from(x.to_bits()))
        });
        let mut both = [bits, -bits];
        grid.pipeline()
            .all_reduce_host(&mut both, tidemem::comm::ReduceOp::Max)
            .unwrap();
        assert_eq!(both[0], -both[1], "{spec}: wte's two copies differ");
    }
    let numel = z.tensor_shape(wte).unwrap().iter().product();
    ((losses, norms), numel)
}

/// Pipeline parallelism: GPT-2's two blocks over two stages (`wte` on both ends, its gradient
/// summed between them), 1F1B and GPipe with 2 and 4 micro-batches a step; on 8 ranks as
/// pipeline 2 × sequence 2 × `1d:2`, as data 2 × pipeline 2 × sequence 2 and as pipeline 2 ×
/// `2d:2`; and on 16 as pipeline 2 × `3d:2`, with ZeRO over the ranks holding the same
/// shards: the losses and gradient norms of one process on the whole batch. The ends are whole
/// on every tensor rank here ([`EndsLayout::Whole`]).
#[test]
fn gpt_in_pipeline_stages_trains_like_the_serial_gpt() {
    let serial = serial();
    let one_d = TensorMode::OneD { size: 2 };
    let cases = [
        (1, 1, TensorMode::None, Schedule::OneFOneB, 2),
        (1, 1, TensorMode::None, Schedule::GPipe, 4),
        (1, 2, one_d, Schedule::OneFOneB, 2),
        (2, 2, TensorMode::None, Schedule::OneFOneB, 2),
        (1, 1, TensorMode::TwoD { q: 2 }, Schedule::OneFOneB, 2),
        (1, 1, TensorMode::ThreeD { q: 2 }, Schedule::OneFOneB, 1),
    ];
    for (data, sequence, tensor, schedule, m) in cases {
        let spec = GridSpec {
            data,
            pipeline: 2,
            sequence,
            tensor,
        };
        let runs = on_grid(spec, |c, grid| {
            let (run, wte) = tidemem::with_placement!(tensor, |P| {
                train_stages::<P>(c, grid, schedule, m, EndsLayout::Whole)
            });
            let cfg = config();
            assert_eq!(
                wte,
                cfg.vocab * cfg.channels,
                "{spec}: a whole wte on every rank"
            );
            run
        });
        like_serial(
            &format!("GPT over {spec}, {} × {m}", schedule.name()),
            &serial,
            &runs,
        );
    }
}

/// Pipeline stages with their ends split over the tensor group ([`EndsLayout::Split`]): the
/// first stage's vocab-parallel `wte` and `wpe`, the last stage's `ln_f` and vocab-parallel
/// head over its own copy of the `wte` shard, each tensor rank swapping its shard's gradient
/// with the same rank of the other end. Pipeline 2 × `1d:2` (4 ranks; and × sequence 2, 8
/// ranks), × `2d:2` (8 ranks), × `2.5d:2x2` and × `3d:2` (16 ranks each; one micro-batch, as a
/// tile there holds whole sequences and the batch has `q·d = q² = 4`): each rank holds `1/T` of `wte` (`1/q²` on 2.5D, whose depth layers hold copies), the two
/// copies keep the same bits, and the losses are the serial ones within 1e-4 relative, the
/// gradient norms within 1e-5.
#[test]
fn gpt_pipeline_stages_with_split_ends_train_like_the_serial_gpt() {
    let serial = serial();
    let one_d = TensorMode::OneD { size: 2 };
    // the last case is every dimension at once: data 2 × pipeline 2 × sequence 2 × 1d:2
    let cases = [
        (1, 1, one_d, Schedule::OneFOneB, 2),
        (1, 2, one_d, Schedule::GPipe, 2),
        (1, 1, TensorMode::TwoD { q: 2 }, Schedule::OneFOneB, 2),
        (
            1,
            1,
            TensorMode::TwoHalfD { q: 2, depth: 2 },
            Schedule::OneFOneB,
            1,
        ),
        (1, 1, TensorMode::ThreeD { q: 2 }, Schedule::OneFOneB, 1),
        (2, 2, one_d, Schedule::OneFOneB, 2),
    ];
    for (data, sequence, tensor, schedule, m) in cases {
        let spec = GridSpec {
            data,
            pipeline: 2,
            sequence,
            tensor,
        };
        let runs = on_grid(spec, |c, grid| {
            let (run, wte) = tidemem::with_placement!(tensor, |P| {
                train_stages::<P>(c, grid, schedule, m, EndsLayout::Split)
            });
            let cfg = config();
            let whole = cfg.vocab * cfg.channels;
            // a 2.5D grid's depth layers each hold the q × q shards
            let shards = match tensor {
                TensorMode::TwoHalfD { q, .. } => q * q,
                t => t.size(),
            };
            assert_eq!(wte * shards, whole, "{spec}: 1/T of wte a rank");
            run
        });
        like_serial(
            &format!("GPT over {spec}, {} × {m}, the ends split", schedule.name()),
            &serial,
            &runs,
        );
    }
}

/// Split ends on a grid need a vocabulary that splits by `q`: with 63 tokens every rank of
/// pipeline 3 × `2d:2` fails, the middle stage (no end of its own) too, before registering
/// anything; whole ends take any vocabulary.
#[test]
fn pipeline_split_ends_need_a_vocabulary_that_splits() {
    let cfg = GptConfig {
        vocab: 63,
        layers: 3,
        ..config()
    };
    let spec = GridSpec {
        data: 1,
        pipeline: 3,
        sequence: 1,
        tensor: TensorMode::TwoD { q: 2 },
    };
    on_grid(spec, |c, grid| {
        let mut m = manager(c.device().clone(), 256 << 20);
        let stage = grid.pipeline_rank();
        let init = |n: &str, _: &[usize]| Ok(default_init(&cfg, n, 3));
        let r = Gpt::<Summa>::register_on(&mut m, &Plan::on(grid), &cfg, init);
        assert!(
            matches!(
                r,
                Err(tidemem::Error::NotSplit {
                    what: "vocabulary",
                    value: 63,
                    parts: 2,
                    ..
                })
            ),
            "stage {stage}: {r:?}"
        );
        assert_eq!(m.num_tensors(), 0, "stage {stage}: nothing registered");
        let whole = Plan {
            ends: EndsLayout::Whole,
            ..Plan::on(grid)
        };
        Gpt::<Summa>::register_on(&mut m, &whole, &cfg, init).unwrap();
    });
}

/// Sequence rings with the 2D, 2.5D and 3D grids: GPT-2's positions over rings of 2 on
/// `2d:2` (8 ranks), `2.5d:2x1` (8 ranks) and `3d:2` (16 ranks), the ends split, ZeRO over the
/// sequence replicas: the serial losses and norms.
#[test]
fn gpt_grid_with_the_sequence_split_trains_like_the_serial_gpt() {
    let serial = serial();
    let modes = [
        TensorMode::TwoD { q: 2 },
        TensorMode::TwoHalfD { q: 2, depth: 1 },
        TensorMode::ThreeD { q: 2 },
    ];
    for tensor in modes {
        let spec = GridSpec {
            data: 1,
            pipeline: 1,
            sequence: 2,
            tensor,
        };
        let runs = on_grid(spec, |c, grid| {
            tidemem::with_placement!(tensor, |P| ring_steps::<P>(c, grid, 1))
        });
        like_serial(&format!("GPT over {spec}"), &serial, &runs);
    }
}

/// PipeDream-2BW: GPT-2 over two stages with a new weight version every 2 micro-batches (a
/// step), each step's gradient taken at the version before (`delayed_params`), trains to the
/// losses and gradient norms of one process running the same rule serially (the whole batch a
/// step, parameters one version behind the masters), step by step; and those differ from
/// plain training once the lag shows.
#[test]
fn gpt_pipedream_2bw_equals_the_serial_2bw_rule() {
    let two_bw = || {
        HybridAdam::new(HybridConfig {
            max_grad_norm: Some(0.05),
            placement: tidemem::optim::DevicePlacement::HostOnly,
            delayed_params: true,
            ..HybridConfig::new(AdamConfig::adamw(3e-3, 0.01))
        })
        .unwrap()
    };
    let halves = |k: u64| {
        let (t, g) = batch(k);
        let half = B / 2 * T;
        (0..2)
            .map(|h| {
                (
                    t[h * half..(h + 1) * half].to_vec(),
                    g[h * half..(h + 1) * half].to_vec(),
                )
            })
            .collect::<Vec<_>>()
    };
    // the serial rule: the whole batch a step (its mean gradient is the two halves'), the
    // parameters one version behind
    let mut m = manager(common::sim(256 << 20), 256 << 20);
    let gpt = Gpt::register(&mut m, &config(), 3).unwrap();
    let mut opt = two_bw();
    let mut want = Vec::new();
    for k in 0..STEPS {
        let (t, g) = batch(k);
        let b = GptBatch {
            tokens: &t,
            targets: &g,
            batch: B,
            seq: T,
        };
        let r = train_step(&gpt, &mut m, &Plan::default(), &mut opt, &[b]).unwrap();
        want.push((r.loss, r.report.grad_norm));
    }
    let plain = serial();
    let lagged = want
        .iter()
        .zip(&plain.0)
        .any(|((l, _), p)| l.to_bits() != *p);
    assert!(lagged, "the lag changes the losses");
    let spec = GridSpec {
        data: 1,
        pipeline: 2,
        sequence: 1,
        tensor: TensorMode::None,
    };
    let runs = on_grid(spec, |c, grid| {
        let mut z = manager(c.device().clone(), 256 << 20);
        let plan = Plan {
            schedule: Schedule::TwoBW { every: 2 },
            ..Plan::on(grid)
        };
        let gpt: Gpt = seeded(&mut z, &plan).unwrap();
        let mut opt = two_bw();
        let mut got = Vec::new();
        for k in 0..STEPS {
            let d = halves(k);
            let micro: Vec<GptBatch> = d
                .iter()
                .map(|(t, g)| GptBatch {
                    tokens: t,
                    targets: g,
                    batch: B / 2,
                    seq: T,
                })
                .collect();
            let s = train_step(&gpt, &mut z, &plan, &mut opt, &micro).unwrap();
            got.push((s.loss, s.report.grad_norm));
        }
        got
    });
    for (r, got) in runs.iter().enumerate() {
        for (k, ((l, n), (wl, wn))) in got.iter().zip(&want).enumerate() {
            let e = (f64::from(*l) - f64::from(*wl)).abs() / f64::from(*wl);
            assert!(
                e < 1e-5,
                "stage {r}, step {k}: loss {l} vs the serial rule's {wl}"
            );
            assert!(
                (n - wn).abs() <= 1e-5 * wn.abs().max(1.0),
                "stage {r}, step {k}: norm"
            );
        }
    }
}

/// PipeDream-2BW with no flush: GPT-2 over two stages as one stream of steps (the next step's
/// first forward on stage 0 between this step's last backwards, on the stage's second
/// registration) gives the per-step 2BW's losses and gradient norms bit for bit, on every
/// stage, with one process a stage and with two data-parallel replicas a stage on ZeRO (each
/// registration aligned to the ranks, so each tensor's versions lie on one rank).
#[test]
fn gpt_pipedream_2bw_stream_equals_the_per_step_2bw() {
    let opt = |delayed_params| {
        HybridAdam::new(HybridConfig {
            max_grad_norm: Some(0.05),
            placement: tidemem::optim::DevicePlacement::HostOnly,
            delayed_params,
            ..HybridConfig::new(AdamConfig::adamw(3e-3, 0.01))
        })
        .unwrap()
    };
    let data: Vec<_> = (0..STEPS).map(batch).collect();
    let micro = |k: usize| -> Vec<GptBatch<'_>> {
        let (t, g) = &data[k];
        let half = B / 2 * T;
        (0..2)
            .map(|h| GptBatch {
                tokens: &t[h * half..(h + 1) * half],
                targets: &g[h * half..(h + 1) * half],
                batch: B / 2,
                seq: T,
            })
            .collect()
    };
    // one process a stage, and two data-parallel replicas a stage (ZeRO over them)
    for data in [1, 2] {
        let spec = GridSpec {
            data,
            pipeline: 2,
            sequence: 1,
            tensor: TensorMode::None,
        };
        let runs = on_grid(spec, |c, grid| match data {
            1 => two_bw_runs(
                grid,
                || manager(c.device().clone(), 256 << 20),
                &opt,
                &micro,
            ),
            _ => two_bw_runs(grid, || zero_store(c, grid), &opt, &micro),
        });
        for (r, (per_step, stream, ahead)) in runs.iter().enumerate() {
            // bit for bit: on ZeRO each version's tensors are owned as the per-step run's are,
            // so the norm's partial sums group alike too
            assert_eq!(stream, per_step, "{spec}, rank {r}");
            // stage 0 runs one forward of each next step ahead, the last stage none
            let s = r % 2;
            let want = if s == 0 { STEPS as usize - 1 } else { 0 };
            assert_eq!(*ahead, want, "{spec}, rank {r}");
        }
    }
}

/// The 2BW stream on devices holding a quarter of the stage's chunks (both versions) beside the
/// non-model peak: the tide streams the chunks (its warm-up trace the stream's second
/// iteration, after the pipeline's fill), with the loss bits of all resident.
#[test]
fn gpt_2bw_stream_streams_from_a_small_device_with_the_same_bits() {
    let data: Vec<_> = (0..STEPS).map(batch).collect();
    small_device_keeps_the_bits(|m, grid| {
        let plan = Plan::on(grid);
        let (a, b): (Gpt, Gpt) = (seeded(m, &plan).unwrap(), seeded(m, &plan).unwrap());
        let batches: Vec<Vec<GptBatch>> = data.iter().map(|(t, g)| quarters(t, g)).collect();
        let mut opt = adam();
        let out = train_two_bw_stream([&a, &b], m, &plan, &mut opt, &batches).unwrap();
        let losses = out.iter().map(|s| s.loss.to_bits()).collect();
        (losses, m.stats().h2d_bytes)
    });
}

/// Trains with `train` (the losses' bits and the bytes loaded) on two pipeline stages, once
/// on a roomy device and once on one with room for the non-model peak and a quarter of the
/// stage's chunks (at least six: an op of the head holds five at once): the same bits, with
/// chunks evicted and reloaded.
fn small_device_keeps_the_bits(
    train: impl Fn(&mut ChunkManager, &ProcessGrid) -> (Vec<u32>, u64) + Sync,
) {
    let spec = GridSpec {
        data: 1,
        pipeline: 2,
        sequence: 1,
        tensor: TensorMode::None,
    };
    let runs = on_grid(spec, |c, grid| {
        let run = |capacity: u64| {
            let mut m = manager(c.device().clone(), capacity);
            let (losses, h2d) = train(&mut m, grid);
            let room = (m.param_footprint() / 4).max(6 * CHUNK as u64 * 4);
            (losses, h2d, m.non_model_peak() + room)
        };
        let (resident, resident_h2d, small) = run(256 << 20);
        let (streamed, h2d, _) = run(small);
        (resident, streamed, resident_h2d, h2d)
    });
    for (r, (resident, streamed, resident_h2d, h2d)) in runs.into_iter().enumerate() {
        assert_eq!(resident, streamed, "stage {r}: placement changed bits");
        assert!(
            h2d > resident_h2d,
            "stage {r}: chunks were evicted and reloaded"
        );
    }
}

/// Losses and gradient norms of a stage's per-step 2BW and of its stream (stores from
/// `store`), and the stream's forwards run ahead.
type TwoBwRuns = (Vec<(u32, f64)>, Vec<(u32, f64)>, usize);

fn two_bw_runs<'d, S: ParamStore>(
    grid: &ProcessGrid,
    store: impl Fn() -> S,
    opt: &dyn Fn(bool) -> HybridAdam,
    micro: &dyn Fn(usize) -> Vec<GptBatch<'d>>,
) -> TwoBwRuns {
    let plan = Plan {
        schedule: Schedule::TwoBW { every: 2 },
        ..Plan::on(grid)
    };
    let register = |m: &mut S| -> Gpt { seeded(m, &plan).unwrap() };
    let key = |s: &tidemem::models::gpt::TrainStep| (s.loss.to_bits(), s.report.grad_norm);
    // per step: a flush after every step, the parameters one version behind
    let mut m = store();
    let gpt = register(&mut m);
    let mut o = opt(true);
    let per_step: Vec<_> = (0..STEPS as usize)
        .map(|k| key(&train_step(&gpt, &mut m, &plan, &mut o, &micro(k)).unwrap()))
        .collect();
    // one stream on two registrations, each starting on a chunk group rank 0 owns (on ZeRO,
    // each tensor's two versions then lie on one rank)
    let mut m = store();
    let aligned = |m: &mut S| {
        m.align_to_ranks().unwrap();
        register(m)
    };
    let (a, b) = (aligned(&mut m), aligned(&mut m));
    let mut o = opt(false);
    let batches: Vec<_> = (0..STEPS as usize).map(micro).collect();
    let out = train_two_bw_stream([&a, &b], &mut m, &plan, &mut o, &batches).unwrap();
    let reports = out.iter().filter_map(|s| s.stage.as_ref());
    let ahead: usize = reports.map(|r| r.ahead_forwards).sum();
    let stream: Vec<_> = out.iter().map(key).collect();
    (per_step, stream, ahead)
}

/// A pipeline stage larger than its device streams its chunks under the tide scheduler: two
/// stages, 1F1B with 4 micro-batches, on devices with room for the non-model peak and a quarter
/// of the stage's chunks (at least six) give the loss bits of all resident, with chunks
/// reloaded.
#[test]
fn pipeline_stages_stream_from_a_small_device_with_the_same_bits() {
    small_device_keeps_the_bits(|m, grid| {
        let plan = Plan::on(grid);
        let gpt: Gpt = seeded(m, &plan).unwrap();
        let mut opt = adam();
        let (mut losses, mut h2d) = (Vec::new(), 0);
        for k in 0..STEPS {
            let (t, g) = batch(k);
            let micro = quarters(&t, &g);
            let s = train_step(&gpt, m, &plan, &mut opt, &micro).unwrap();
            losses.push(s.loss.to_bits());
            if k >= 2 {
                h2d += m.last_iteration().h2d_bytes;
            }
        }
        (losses, h2d)
    });
}
