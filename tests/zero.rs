//! ZeRO over chunks on in-process ranks: equivalence with single-process training, shard sizes,
//! communication volume against its formula, overflow handling and misuse.

mod common;

use tidemem::chunk::{ChunkManager, ManagerConfig, MomentStorage, OverlapStats};

use tidemem::comm::{Communicator, ReduceOp};
use tidemem::demo::{ToyIds, ToyMlp};
use tidemem::device::CachingAllocator;
use tidemem::optim::{
    AdamConfig, DevicePlacement, HybridAdam, HybridConfig, ScalerConfig, StepOutcome, StepReport,
};
use tidemem::tensor::ChunkKind;
use tidemem::tensor::{Init, Stage, TensorId};
use tidemem::tide::{MoveStats, Policy};
use tidemem::zero::ZeroManager;
use tidemem::{DType, Error};

use common::{DEEP, DEEP_UNTIED, TOY};

fn adam() -> HybridAdam {
    common::hybrid_adam(true, DevicePlacement::HostOnly)
}

fn config(toy: &ToyMlp, dtype: DType) -> ManagerConfig {
    let mut cfg = ManagerConfig::new(toy.chunk_elems(), Policy::Tide);
    cfg.param_dtype = dtype;
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 0.3;
    cfg
}

/// Masters of every tensor by name, and the step reports, after `steps` single-process steps.
fn single(toy: &ToyMlp, dtype: DType, steps: u64) -> (Vec<(String, Vec<f32>)>, Vec<StepReport>) {
    single_with(config(toy, dtype), toy, steps)
}

/// [`single`] on a manager of `cfg`.
fn single_with(
    cfg: ManagerConfig,
    toy: &ToyMlp,
    steps: u64,
) -> (Vec<(String, Vec<f32>)>, Vec<StepReport>) {
    let dev = common::sim(1 << 20);
    let mut m = ChunkManager::new(dev.clone(), cfg).unwrap();
    let pool = CachingAllocator::new(dev);
    m.set_non_model_allocator(pool.clone());
    let ids = toy.register(&mut m).unwrap();
    let mut opt = adam();
    let mut reports = Vec::new();
    for s in 0..steps {
        toy.forward_backward(&mut m, &ids, s, opt.loss_scale(), (0, 1))
            .unwrap();
        reports.push(opt.step(&mut m).unwrap());
    }
    let masters = (0..m.num_tensors() as u32)
        .map(|t| {
            let id = TensorId(t);
            (
                m.tensor_info(id).unwrap().0.to_string(),
                m.master(id).unwrap(),
            )
        })
        .collect();
    (masters, reports)
}

struct RankResult {
    owned: Vec<(String, Vec<f32>)>,
    reports: Vec<StepReport>,
    zero: ZeroManager,
}

/// Trains `steps` steps on `world` in-process ranks, rank r on share r of every batch.
fn zero(toy: &ToyMlp, dtype: DType, world: usize, capacity: usize, steps: u64) -> Vec<RankResult> {
    zero_prefetch(toy, dtype, world, capacity, steps, 0)
}

/// [`zero`] gathering `prefetch` communication groups ahead in forward.
fn zero_prefetch(
    toy: &ToyMlp,
    dtype: DType,
    world: usize,
    capacity: usize,
    steps: u64,
    prefetch: usize,
) -> Vec<RankResult> {
    zero_with(
        toy,
        dtype,
        world,
        capacity,
        steps,
        prefetch,
        *adam().config(),
    )
}

/// [`zero_prefetch`] with an optimizer of settings `opt`.
fn zero_with(
    toy: &ToyMlp,
    dtype: DType,
    world: usize,
    capacity: usize,
    steps: u64,
    prefetch: usize,
    opt: HybridConfig,
) -> Vec<RankResult> {
    on_ranks(world, capacity, |c| {
        let (r, n) = (c.rank(), c.world());
        let mut z = ZeroManager::new(c, config(toy, dtype)).unwrap();
        z.set_prefetch(prefetch).unwrap();
        let ids = toy.register(&mut z).unwrap();
        let mut opt = HybridAdam::new(opt).unwrap();
        let mut reports = Vec::new();
        for step in 0..steps {
            toy.forward_backward(&mut z, &ids, step, opt.loss_scale(), (r, n))
                .unwrap();
            reports.push(z.step(&mut opt).unwrap());
        }
        let mine: Vec<TensorId> = (0..z.layout().slots.len() as u32)
            .map(TensorId)
            .filter(|&id| z.owns(id))
            .collect();
        let owned = mine
            .into_iter()
            .map(|id| (id.0.to_string(), z.master(id).unwrap()))
            .collect();
        RankResult {
            owned,
            reports,
            zero: z,
        }
    })
}

/// Runs `f` on `world` in-process ranks, each on a simulated device of `capacity` bytes and a
/// thread of its own; the results in rank order.
fn on_ranks<R: Send>(
    world: usize,
    capacity: usize,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    on_devices((0..world).map(|_| common::sim(capacity)).collect(), f)
}

/// Runs `f` on an in-process rank a device of `devs`, each on a thread of its own; the results
/// in rank order.
fn on_devices<R: Send>(
    devs: Vec<tidemem::device::Device>,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let comms = Communicator::local(devs).unwrap();
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

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

/// Every rank's owned masters, by tensor number, against the single-process masters.
fn compare(ranks: &[RankResult], reference: &[(String, Vec<f32>)], tol: f64) -> f64 {
    let mut seen = vec![false; reference.len()];
    let mut worst = 0.0f64;
    for r in ranks {
        for (t, m) in &r.owned {
            let t: usize = t.parse().unwrap();
            assert!(!seen[t], "tensor {t} owned twice");
            seen[t] = true;
            let e = rel_err(m, &reference[t].1);
            assert!(
                e <= tol,
                "tensor {} off by {e:e} (tolerance {tol:e})",
                reference[t].0
            );
            worst = worst.max(e);
        }
    }
    assert!(seen.iter().all(|&s| s), "every tensor has an owner");
    worst
}

/// The tolerance of the equivalence: a rank's gradient is the mean over its share of the batch,
/// and the average over ranks rounds differently from the mean over the whole batch, so the fp32
/// masters after 5 Adam steps agree to 1e-6 relative (norm-wise per tensor), not bitwise. One
/// rank rounds exactly as the single process does, so there the match is bitwise.
const TOL: f64 = 1e-6;

#[test]
fn zero_training_equals_single_process_training() {
    let steps = 5;
    let (reference, ref_reports) = single(&TOY, DType::F32, steps);
    // clipping and loss-scale growth both happen in these 5 steps
    assert!(ref_reports.iter().any(|r| r.clip_coef < 1.0));
    assert!(ref_reports
        .iter()
        .any(|r| r.loss_scale != ref_reports[0].loss_scale));
    for world in [1, 2, 4] {
        let ranks = zero(&TOY, DType::F32, world, 1 << 20, steps);
        let tol = if world == 1 { 0.0 } else { TOL };
        let worst = compare(&ranks, &reference, tol);
        eprintln!("world {world}: worst norm-wise relative error {worst:e}");
        for r in &ranks {
            for (a, b) in r.reports.iter().zip(&ref_reports) {
                assert_eq!(a.outcome, b.outcome);
                assert_eq!(a.loss_scale, b.loss_scale);
                assert_eq!(a.clip_coef < 1.0, b.clip_coef < 1.0);
                assert!((a.grad_norm - b.grad_norm).abs() <= 1e-5 * b.grad_norm);
            }
            // every rank sees the same global norm
            assert_eq!(
                r.reports
                    .iter()
                    .map(|x| x.grad_norm.to_bits())
                    .collect::<Vec<_>>(),
                ranks[0]
                    .reports
                    .iter()
                    .map(|x| x.grad_norm.to_bits())
                    .collect::<Vec<_>>()
            );
        }
    }
}

/// 8-bit moments shard as they train on one process: each rank's manager starts every tensor
/// on a block, so the ranks' blocks are the single process's, and one rank gives its bits.
#[test]
fn zero_shards_eight_bit_moments() {
    let steps = 4;
    let cfg = || {
        let mut cfg = config(&TOY, DType::F16);
        cfg.moments = MomentStorage::Int8;
        cfg
    };
    let (reference, _) = single_with(cfg(), &TOY, steps);
    let (fp32, _) = single(&TOY, DType::F16, steps);
    assert!(
        rel_err(&reference[0].1, &fp32[0].1) > 0.0,
        "the storage is in effect"
    );
    for world in [1, 2] {
        let ranks = on_ranks(world, 1 << 20, |c| {
            let (r, n) = (c.rank(), c.world());
            let mut z = ZeroManager::new(c, cfg()).unwrap();
            let ids = TOY.register(&mut z).unwrap();
            let mut opt = adam();
            for step in 0..steps {
                TOY.forward_backward(&mut z, &ids, step, opt.loss_scale(), (r, n))
                    .unwrap();
                z.step(&mut opt).unwrap();
            }
            let mine: Vec<TensorId> = (0..z.layout().slots.len() as u32)
                .map(TensorId)
                .filter(|&id| z.owns(id))
                .collect();
            let owned = mine
                .into_iter()
                .map(|id| (id.0.to_string(), z.master(id).unwrap()))
                .collect();
            RankResult {
                owned,
                reports: Vec::new(),
                zero: z,
            }
        });
        // two ranks average fp16 gradients (5e-4 with f32 moments), and a moment that moves
        // by a rounding can land on the neighbouring code, a percent away: measured 1.5e-3
        let worst = compare(&ranks, &reference, if world == 1 { 0.0 } else { 5e-3 });
        eprintln!("8-bit moments, world {world}: worst norm-wise relative error {worst:e}");
    }
}

/// With fp16 parameters and gradients (the real mixed-precision case), one ZeRO rank rounds
/// exactly as the single process does; 2 and 4 ranks average fp16 gradients (each rank's
/// rounded to fp16 before the average) and agree to 5e-4 relative (measured 1.2e-4; fp16
/// has 11 significant bits).
#[test]
fn zero_training_in_fp16_matches_single_process_training() {
    let steps = 4;
    let (reference, _) = single(&TOY, DType::F16, steps);
    let ranks = zero(&TOY, DType::F16, 1, 1 << 20, steps);
    compare(&ranks, &reference, 0.0);
    for world in [2, 4] {
        let ranks = zero(&TOY, DType::F16, world, 1 << 20, steps);
        let worst = compare(&ranks, &reference, 5e-4);
        eprintln!("fp16, world {world}: worst norm-wise relative error {worst:e}");
    }
}

/// The optimizer of the overlap tests: the first steps overflow (skipped, the scale halved);
/// then norms fall over the steps: the early ones clip (a step after a clipped one is not
/// speculated), the last do not (kept).
fn overlap_config(overlap: bool) -> HybridConfig {
    overlap_scaled(overlap, 1024.0 * 1024.0)
}

/// [`overlap_config`] with the loss scale starting at `init_scale`.
fn overlap_scaled(overlap: bool, init_scale: f32) -> HybridConfig {
    HybridConfig {
        overlap,
        max_grad_norm: Some(0.39),
        loss_scale: Some(tidemem::optim::ScalerConfig {
            init_scale,
            growth_interval: 4,
            hysteresis: 1,
            ..Default::default()
        }),
        ..*adam().config()
    }
}

/// Each rank's host groups stepped during backward (kept on clean steps, redone after a clip
/// or an overflow) give the bits of the step after backward, on 1, 2 and 4 ranks, on a roomy
/// and on a small device (which evicts), and with micro-batches folded during backward; the
/// loss scale starts high enough that the first steps overflow and are skipped on every rank.
#[test]
fn overlapped_host_steps_change_no_bit_on_any_rank() {
    let steps = 8;
    let opt = overlap_config;
    let (mut kept, mut redone) = (0, 0);
    let mut roomy = Vec::new();
    for (toy, world, capacity, accumulate) in [
        (&DEEP, 1, 1 << 20, 1),
        (&DEEP, 2, 1 << 20, 1),
        (&DEEP, 2, 36_000, 1),
        (&TOY, 4, 1 << 20, 1),
        // micro-batches folded during backward
        (&DEEP, 2, 1 << 20, 3),
    ] {
        let opt = |overlap| HybridConfig {
            accumulation_steps: accumulate,
            ..opt(overlap)
        };
        let serial = zero_with(toy, DType::F16, world, capacity, steps, 0, opt(false));
        let overlapped = zero_with(toy, DType::F16, world, capacity, steps, 0, opt(true));
        let mut started = 0;
        // a step is speculated unless the last one stepped was clipped
        let speculable = serial[0]
            .reports
            .windows(2)
            .any(|w| w[0].outcome == StepOutcome::Stepped && w[0].clip_coef == 1.0);
        for (r, (a, b)) in serial.iter().zip(&overlapped).enumerate() {
            let what = format!("rank {r} of {world} on {capacity} B");
            assert!(a.owned == b.owned, "{what}: masters differ");
            let trail = |x: &RankResult| {
                x.reports
                    .iter()
                    .map(|r| (r.outcome, r.grad_norm.to_bits(), r.loss_scale.to_bits()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(trail(a), trail(b), "{what}");
            assert!(
                a.reports.iter().any(|r| r.outcome == StepOutcome::Skipped),
                "{what}: an overflow is skipped"
            );
            assert_eq!(a.zero.local().overlap_stats().started, 0, "{what}");
            let o = b.zero.local().overlap_stats();
            assert_eq!(o.kept + o.redone, o.started, "{what}: {o:?}");
            started += o.started;
            kept += o.kept;
            redone += o.redone;
            // the small device's ranks evict against the same ranks on a roomy one
            let moved = [a, b].map(|x| x.zero.local().stats());
            if world == 2 && accumulate == 1 && capacity == 1 << 20 {
                roomy.push(moved[0]);
            } else if capacity == 36_000 {
                common::assert_evicts(&moved[0], &roomy[r], &format!("{what}, serial"));
                common::assert_evicts(&moved[1], &roomy[r], &format!("{what}, overlapped"));
            }
        }
        assert!(started > 0 || !speculable, "{world} ranks on {capacity} B");
    }
    assert!(kept > 0 && redone > 0, "kept {kept}, redone {redone}");
}

#[test]
fn a_small_device_changes_nothing() {
    // each rank's device holds its non-model peak (activations, a gather buffer) and about half
    // of its 8 owned chunks: the tide scheduler evicts and reloads the shard, the same bits
    let capacity = 36_000;
    let big = zero(&DEEP, DType::F16, 2, 1 << 20, 4);
    let small = zero(&DEEP, DType::F16, 2, capacity, 4);
    for (r, (a, b)) in big.iter().zip(&small).enumerate() {
        assert_eq!(a.owned, b.owned, "rank {r}");
        common::assert_evicts(
            &b.zero.local().stats(),
            &a.zero.local().stats(),
            &format!("rank {r} on {capacity} B"),
        );
    }
}

/// The masters this rank owns, by tensor number, as bits.
fn owned_bits(z: &mut ZeroManager) -> Vec<(String, Vec<u32>)> {
    let mine: Vec<TensorId> = (0..z.layout().slots.len() as u32)
        .map(TensorId)
        .filter(|&id| z.owns(id))
        .collect();
    mine.into_iter()
        .map(|id| {
            let m = z.master(id).unwrap();
            (id.0.to_string(), m.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// The overlapped host steps on 2 ranks sharing the GPU, each planning for a small device (its
/// shard moves), through the overflows and clips of [`overlap_config`]: every rank's masters
/// and steps are the serial steps' bit for bit.
#[test]
fn overlapped_host_steps_on_cuda_change_no_bit() {
    let Some(gpu) = common::cuda("overlapped_host_steps_on_cuda_change_no_bit") else {
        return;
    };
    type Trail = (
        Vec<(String, Vec<u32>)>,
        Vec<(StepOutcome, u64, u32)>,
        OverlapStats,
    );
    let run = |overlap: bool| -> Vec<Trail> {
        on_devices(vec![gpu.clone(), gpu.clone()], |c| {
            let (r, n) = (c.rank(), c.world());
            let mut cfg = config(&DEEP, DType::F16);
            cfg.scheduler.capacity = 36_000;
            let mut z = ZeroManager::new(c, cfg).unwrap();
            let ids = DEEP.register(&mut z).unwrap();
            // one overflow (the scale halved once), then two clips (norms 0.430 and 0.414) and
            // two clean steps (0.407, 0.401), the last speculated (the one after a clip is not)
            let mut opt = HybridAdam::new(HybridConfig {
                max_grad_norm: Some(0.41),
                ..overlap_scaled(overlap, 65536.0 * 4.0)
            })
            .unwrap();
            let mut steps = Vec::new();
            for step in 0..5 {
                DEEP.forward_backward(&mut z, &ids, step, opt.loss_scale(), (r, n))
                    .unwrap();
                let rep = z.step(&mut opt).unwrap();
                steps.push((
                    rep.outcome,
                    rep.grad_norm.to_bits(),
                    rep.loss_scale.to_bits(),
                ));
            }
            (owned_bits(&mut z), steps, z.local().overlap_stats())
        })
    };
    let (serial, overlapped) = (run(false), run(true));
    for (r, (a, b)) in serial.iter().zip(&overlapped).enumerate() {
        assert!(a.0 == b.0, "rank {r}: masters differ");
        assert_eq!(a.1, b.1, "rank {r}: steps differ");
        assert!(
            a.1.iter().any(|s| s.0 == StepOutcome::Skipped),
            "rank {r}: an overflow"
        );
        assert_eq!(a.2.started, 0);
        assert!(
            b.2.started > 0 && b.2.kept + b.2.redone == b.2.started,
            "rank {r}: {:?}",
            b.2
        );
    }
}

/// ZeRO on 2 in-process ranks that share the GPU (collectives through the host, chunks, gather
/// buffers and the device-side Adam on CUDA) gives the same bits as on two Sim devices on the
/// emulator (a GPU's rounding within a tolerance), with a roomy device and the optimizer on it,
/// and with a small one that moves shards.
#[test]
fn zero_on_cuda_equals_the_sim_devices() {
    let Some(gpu) = common::cuda("zero_on_cuda_equals_the_sim_devices") else {
        return;
    };
    // Per rank: the owned masters' bits, the most groups stepped on the device in a step, and
    // the rank's chunk moves.
    type Masters = Vec<(Vec<(String, Vec<u32>)>, usize, MoveStats)>;
    let run = |devs: Vec<tidemem::device::Device>, capacity: u64, placement| -> Masters {
        let comms = Communicator::local(devs).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let (r, n) = (c.rank(), c.world());
                        let mut cfg = config(&DEEP, DType::F16);
                        cfg.scheduler.capacity = capacity;
                        let mut z = ZeroManager::new(c, cfg).unwrap();
                        z.set_prefetch(2).unwrap();
                        let ids = DEEP.register(&mut z).unwrap();
                        let mut opt = common::hybrid_adam(true, placement);
                        let mut on_device = 0;
                        for step in 0..4 {
                            DEEP.forward_backward(&mut z, &ids, step, opt.loss_scale(), (r, n))
                                .unwrap();
                            on_device = on_device.max(z.step(&mut opt).unwrap().device_groups);
                        }
                        let masters = owned_bits(&mut z);
                        (masters, on_device, z.local().stats())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    // Small: each rank plans for its non-model peak and about half of its 8 owned chunks (the
    // ranks share the GPU, which holds both); the roomy HostOnly run is the baseline of moves.
    let small = 36_000;
    let roomy = run(
        vec![common::sim(1 << 20), common::sim(1 << 20)],
        1 << 20,
        DevicePlacement::HostOnly,
    );
    for (capacity, placement) in [
        (1u64 << 20, DevicePlacement::Auto { fraction: 0.8 }),
        (small, DevicePlacement::HostOnly),
    ] {
        let sims = run(
            vec![common::sim(1 << 20), common::sim(1 << 20)],
            capacity,
            placement,
        );
        let gpus = run(vec![gpu.clone(), gpu.clone()], capacity, placement);
        let flat = |m: &Masters| -> Vec<u32> {
            m.iter()
                .flat_map(|(ts, _, _)| ts.iter().flat_map(|(_, bits)| bits.iter().copied()))
                .collect()
        };
        let names = |m: &Masters| -> Vec<Vec<String>> {
            m.iter()
                .map(|(ts, _, _)| ts.iter().map(|(n, _)| n.clone()).collect())
                .collect()
        };
        assert_eq!(
            names(&sims),
            names(&gpus),
            "{capacity} bytes: the ranks own the same"
        );
        let what = format!("{capacity} bytes, {placement:?}: owned masters");
        common::assert_same_arithmetic(&gpu, &flat(&gpus), &flat(&sims), 1e-3, &what);
        if common::is_emulated(&gpu) {
            assert!(sims == gpus, "{capacity} bytes, {placement:?}");
        }
        if capacity == small {
            for (r, roomy) in roomy.iter().enumerate() {
                let what = format!("rank {r} on {capacity} B");
                common::assert_evicts(&sims[r].2, &roomy.2, &format!("{what}, Sim"));
                common::assert_evicts(&gpus[r].2, &roomy.2, &format!("{what}, CUDA"));
            }
        }
        if placement != DevicePlacement::HostOnly {
            assert!(gpus.iter().all(|r| r.1 > 0), "Adam ran on the GPU");
        }
    }
}

/// Gathering ahead in forward and backward changes when groups are gathered, not what: the
/// same bits, the same collective volume, on large and small devices; and it does happen after
/// warm-up, in both stages.
#[test]
fn prefetch_changes_no_bit() {
    // on the small device each rank's chunk budget holds about 5 of its 8 owned chunks beside
    // the gather buffers (the reserve of `depth` of them included), so the shard is evicted
    let small = 40_000;
    let roomy = zero(&DEEP_UNTIED, DType::F16, 2, 1 << 20, 4);
    for (toy, world, capacity) in [
        (&UNTIED, 1, 1 << 20),
        (&UNTIED, 2, 1 << 20),
        (&UNTIED, 4, 1 << 20),
        (&DEEP_UNTIED, 2, small),
    ] {
        let plain = zero(toy, DType::F16, world, capacity, 4);
        for depth in [1, 3] {
            let ahead = zero_prefetch(toy, DType::F16, world, capacity, 4, depth);
            for (r, (a, b)) in plain.iter().zip(&ahead).enumerate() {
                if capacity == small {
                    let what = format!("rank {r} on {capacity} B");
                    let roomy = roomy[r].zero.local().stats();
                    common::assert_evicts(&a.zero.local().stats(), &roomy, &what);
                    let what = format!("{what}, prefetch depth {depth}");
                    common::assert_evicts(&b.zero.local().stats(), &roomy, &what);
                }
                assert_eq!(a.owned, b.owned, "world {world}, depth {depth}");
                let (sa, sb) = (a.zero.stats(), b.zero.stats());
                assert_eq!(sa.gathered_bytes, sb.gathered_bytes);
                assert_eq!(sa.scattered_bytes, sb.scattered_bytes);
                assert_eq!(sa.prefetched, 0);
                // 3 steady forwards and backwards of ceil(layers / N) groups; the first of each
                // stage is on demand
                let per_stage = (toy.layers.div_ceil(world) - 1) as u64;
                assert_eq!(
                    sb.prefetched,
                    3 * 2 * per_stage,
                    "world {world}, depth {depth}"
                );
                // the rank's own chunks moved as without prefetch where the reserve of gather
                // buffers leaves the chunk budget alone (on the small device it takes room)
                assert!(
                    capacity < 1 << 20 || a.zero.local().stats() == b.zero.local().stats(),
                    "world {world}, depth {depth}"
                );
            }
        }
    }
    // set before the first fetch only
    let mut z = ZeroManager::new(
        Communicator::local(vec![common::sim(1 << 20)])
            .unwrap()
            .remove(0),
        config(&UNTIED, DType::F16),
    )
    .unwrap();
    UNTIED.register(&mut z).unwrap();
    z.fetch(&[TensorId(0)], Stage::Forward).unwrap();
    assert!(matches!(
        z.set_prefetch(1),
        Err(Error::Conflict { what, .. }) if what == "set_prefetch"
    ));
    let tied = zero(&TOY, DType::F16, 2, 1 << 20, 3);
    let tied_ahead = zero_prefetch(&TOY, DType::F16, 2, 1 << 20, 3, 2);
    for (a, b) in tied.iter().zip(&tied_ahead) {
        assert_eq!(
            a.owned, b.owned,
            "a shared parameter re-gathered in forward"
        );
        assert!(b.zero.stats().prefetched > 0);
    }
}

/// One tensor per chunk group on 2 ranks (3 communication groups), trained with backward
/// orders that leave the recorded one: groups used out of order, and a group gathered ahead
/// that backward never uses. Returns every rank's owned masters and stats.
fn off_order_backward(depth: usize) -> Vec<(Vec<Vec<f32>>, u64, u64)> {
    // backward orders of communication groups per step: warm-up, steady, then off order
    let orders: [&[usize]; 5] = [&[2, 1, 0], &[2, 1, 0], &[2, 0, 1], &[2, 0], &[2, 1, 0]];
    on_ranks(2, 1 << 20, |c| {
        let r = c.rank();
        let mut z = ZeroManager::new(c, ManagerConfig::new(64, Policy::Tide)).unwrap();
        z.set_prefetch(depth).unwrap();
        let ids: Vec<TensorId> = (0..6)
            .map(|t| {
                z.register(&format!("t{t}"), &[64], Init::Constant(t as f32))
                    .unwrap()
            })
            .collect();
        let mut opt = HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1))).unwrap();
        for (step, order) in orders.iter().enumerate() {
            for &id in &ids {
                z.fetch(&[id], Stage::Forward).unwrap();
                z.release(&[id], Stage::Forward).unwrap();
            }
            z.end_forward().unwrap();
            for &j in order.iter() {
                // a communication group's two tensors, the second one first
                for &id in [ids[2 * j + 1], ids[2 * j]].iter() {
                    z.fetch(&[id], Stage::Backward).unwrap();
                    let g = (step * 7 + id.0 as usize * 3 + r) as f32 * 0.01;
                    z.write_grad(id, &[g; 64]).unwrap();
                    z.release(&[id], Stage::Backward).unwrap();
                }
            }
            z.end_backward().unwrap();
            z.step(&mut opt).unwrap();
        }
        let mine: Vec<TensorId> = ids.into_iter().filter(|&id| z.owns(id)).collect();
        let owned = mine.iter().map(|&id| z.master(id).unwrap()).collect();
        (owned, z.stats().reduce_scatters, z.stats().prefetched)
    })
}

/// A backward that leaves the recorded order gets the same bits and the same reduce-scatters
/// as on-demand gathers: groups gathered ahead are used late or freed unused at the end of
/// backward, on every rank alike.
#[test]
fn backward_off_the_recorded_order_changes_no_bit() {
    let plain = off_order_backward(0);
    let ahead = off_order_backward(1);
    for (a, b) in plain.iter().zip(&ahead) {
        assert_eq!(a.0, b.0);
        assert_eq!(a.1, b.1, "reduce-scatters");
        assert_eq!(a.2, 0);
    }
    // steps 1-4 prefetch in forward (2 each); backward: step 1 two, step 2 one (then off
    // order), step 3 one (never used), step 4 two
    assert_eq!(ahead[0].2, 4 * 2 + 2 + 1 + 1 + 2);
    assert_eq!(ahead[0].2, ahead[1].2);
}

/// A rank of the untied toy model in fp16 that prefetches one group ahead, its ids, its pool
/// and its optimizer.
fn prefetching_rank(c: Communicator) -> (ZeroManager, ToyIds, CachingAllocator, HybridAdam) {
    let mut z = ZeroManager::new(c, config(&UNTIED, DType::F16)).unwrap();
    z.set_prefetch(1).unwrap();
    let ids = UNTIED.register(&mut z).unwrap();
    let pool = z.pool().clone();
    (z, ids, pool, adam())
}

/// Reading a parameter whose group was gathered ahead, on one rank only (say, for logging),
/// changes nothing about which collectives any rank issues: prefetching goes on alike on every
/// rank, and a collective of the model's own in the middle of forward still matches.
#[test]
fn a_read_on_one_rank_keeps_prefetch_in_step() {
    let out: Vec<(u64, u64)> = on_ranks(2, 1 << 20, |c| {
        let (r, n) = (c.rank(), c.world());
        let (mut z, ids, _, mut opt) = prefetching_rank(c);
        for step in 0..3 {
            UNTIED
                .forward_backward(&mut z, &ids, step, opt.loss_scale(), (r, n))
                .unwrap();
            z.step(&mut opt).unwrap();
        }
        assert!(z.local().is_steady());
        let before = z.stats().prefetched;
        for (l, &(w, b)) in ids.blocks.iter().enumerate() {
            z.fetch(&[w, b], Stage::Forward).unwrap();
            if l == 0 && r == 0 {
                // block 2 is in communication group 1, gathered ahead by now
                let v = z.read(ids.blocks[2].0).unwrap();
                assert_eq!(v.len(), UNTIED.width * UNTIED.width);
            }
            z.release(&[w, b], Stage::Forward).unwrap();
            if l == 2 {
                let mut x = [1.0f32];
                z.comm().all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x[0], 2.0);
            }
        }
        z.end_forward().unwrap();
        (before, z.stats().prefetched)
    });
    assert_eq!(out[0], out[1]);
    let per_forward = (UNTIED.layers.div_ceil(2) - 1) as u64;
    assert_eq!(out[0].1 - out[0].0, per_forward);
}

/// Every rank saves its shard after 3 steps; new ranks that load the files train the next 3
/// steps to the same bits as the ranks that went on. A file from another rank is refused.
#[test]
fn shard_checkpoints_resume_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let path = |r: usize| dir.join(format!("rank{r}.safetensors"));
    let run = |load: bool| {
        on_ranks(2, 1 << 20, |c| {
            let (r, n) = (c.rank(), c.world());
            let (mut z, ids, _, mut opt) = prefetching_rank(c);
            let mut steps = 0..6;
            if load {
                let wrong = z.load_checkpoint(&mut opt, path(1 - r)).unwrap_err();
                assert!(wrong.to_string().contains("saved by rank"), "{wrong}");
                z.load_checkpoint(&mut opt, path(r)).unwrap();
                steps = 3..6;
            }
            for step in steps {
                UNTIED
                    .forward_backward(&mut z, &ids, step, opt.loss_scale(), (r, n))
                    .unwrap();
                z.step(&mut opt).unwrap();
                if step == 2 && !load {
                    z.save_checkpoint(&opt, path(r)).unwrap();
                }
            }
            let mine: Vec<TensorId> = (0..z.layout().slots.len() as u32)
                .map(TensorId)
                .filter(|&id| z.owns(id))
                .collect();
            mine.into_iter()
                .map(|id| z.master(id).unwrap())
                .collect::<Vec<_>>()
        })
    };
    let straight = run(false);
    let resumed = run(true);
    assert_eq!(straight, resumed);
    // files of different saves, or one rank's file missing: every rank fails, none loads
    let step1 = |r: usize| dir.join(format!("step1-rank{r}.safetensors"));
    on_ranks(2, 1 << 20, |c| {
        let (r, n) = (c.rank(), c.world());
        let mut z = ZeroManager::new(c, config(&UNTIED, DType::F16)).unwrap();
        let ids = UNTIED.register(&mut z).unwrap();
        let mut opt = adam();
        UNTIED
            .forward_backward(&mut z, &ids, 0, opt.loss_scale(), (r, n))
            .unwrap();
        z.step(&mut opt).unwrap();
        z.save_checkpoint(&opt, step1(r)).unwrap();
        let own = (0..z.layout().slots.len() as u32)
            .map(TensorId)
            .find(|&id| z.owns(id))
            .unwrap();
        let before = z.master(own).unwrap();
        // rank 0 at step 3, rank 1 at step 1
        let mixed = if r == 0 { path(0) } else { step1(1) };
        let e = z.load_checkpoint(&mut opt, mixed).unwrap_err();
        // the newest save both ranks hold is the earlier one, which rank 1 does not
        if r == 1 {
            assert!(matches!(e, Error::SaveMismatch { rank: 1, .. }), "{e}");
        } else {
            assert!(matches!(e, Error::RankFailed { rank: 1 }), "{e}");
        }
        let missing = dir.join(format!("absent{r}.safetensors"));
        let p = if r == 0 { path(0) } else { missing };
        let e = z.load_checkpoint(&mut opt, p).unwrap_err();
        if r == 0 {
            assert!(e.to_string().contains("another rank"), "{e}");
        }
        assert_eq!(z.master(own).unwrap(), before, "nothing loaded");
        assert_eq!(opt.steps(), 1);
    });
    // a save that fails on one rank replaces no rank's earlier file
    let earlier = std::fs::read(path(0)).unwrap();
    on_ranks(2, 1 << 20, |c| {
        let (r, n) = (c.rank(), c.world());
        let (mut z, ids, _, mut opt) = prefetching_rank(c);
        UNTIED
            .forward_backward(&mut z, &ids, 0, opt.loss_scale(), (r, n))
            .unwrap();
        z.step(&mut opt).unwrap();
        let p = match r {
            0 => path(0),
            _ => dir.join("no such directory").join("rank1.safetensors"),
        };
        let e = z.save_checkpoint(&opt, p).unwrap_err();
        if r == 0 {
            assert!(e.to_string().contains("another rank failed"), "{e}");
        } else {
            // its own error, not a wait for a collective the other rank never made
            assert!(matches!(e, Error::FileIo { .. }), "{e}");
        }
        // and the group is still in step
        let mut x = [1.0f32];
        z.comm().all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x[0], 2.0);
    });
    assert_eq!(std::fs::read(path(0)).unwrap(), earlier);
    // a group of another size
    on_ranks(1, 1 << 20, |c| {
        let mut z = ZeroManager::new(c, config(&UNTIED, DType::F16)).unwrap();
        UNTIED.register(&mut z).unwrap();
        let e = z.load_checkpoint(&mut adam(), path(0)).unwrap_err();
        assert!(
            e.to_string().contains("rank 0 of 2, this is rank 0 of 1"),
            "{e}"
        );
    });
}

const UNTIED: ToyMlp = ToyMlp {
    layers: 8,
    width: 16,
    batch: 8,
    tied: false,
    lr: 1e-2,
};

#[test]
fn each_rank_holds_its_share_of_the_model_data() {
    let single_host = {
        let dev = common::sim(1 << 20);
        let mut m = ChunkManager::new(dev.clone(), config(&UNTIED, DType::F16)).unwrap();
        let pool = CachingAllocator::new(dev);
        m.set_non_model_allocator(pool.clone());
        let ids = UNTIED.register(&mut m).unwrap();
        let mut opt = adam();
        UNTIED
            .forward_backward(&mut m, &ids, 0, opt.loss_scale(), (0, 1))
            .unwrap();
        opt.step(&mut m).unwrap();
        let u = m.usage();
        u.host.iter().sum::<u64>() + u.file.iter().sum::<u64>()
    };
    assert!(single_host > 0);
    for world in [2, 4] {
        let ranks = zero(&UNTIED, DType::F16, world, 1 << 20, 1);
        for r in &ranks {
            let u = r.zero.usage();
            let host = u.host.iter().sum::<u64>() + u.file.iter().sum::<u64>();
            // 8 groups over 2 or 4 ranks: exactly 1/N of the model data per rank
            assert_eq!(host * world as u64, single_host, "world {world}");
            // fp32 masters, momentum and variance only for owned chunks
            let k = |c: ChunkKind| u.host[c.index()] + u.file[c.index()];
            assert_eq!(k(ChunkKind::Master), 2 * k(ChunkKind::Param));
            assert_eq!(k(ChunkKind::Momentum), k(ChunkKind::Master));
            assert_eq!(k(ChunkKind::Variance), k(ChunkKind::Master));
            let (per, total) = r.zero.shard_balance();
            assert_eq!(per, vec![total / world as u64; world]);
            // a rank's non-model peak holds at least one gather buffer (N fp16 chunk slots)
            // beside its share of the activations, and is the same on every rank
            let peak = r.zero.non_model_peak();
            let gather = (world * UNTIED.chunk_elems() * 2) as u64;
            assert!(peak >= gather, "world {world}: {peak} < {gather}");
            assert_eq!(peak, ranks[0].zero.non_model_peak(), "world {world}");
        }
    }
}

#[test]
fn communication_volume_matches_the_formula() {
    let world = 2;
    let ranks = zero(&UNTIED, DType::F16, world, 1 << 20, 3);
    // per step: params all-gathered once in forward and once in backward, gradients
    // reduce-scattered once, two scalar all-reduces (norm, overflow flag)
    let groups = UNTIED.layers; // one block per chunk
    let comm_groups = groups.div_ceil(world);
    let slot = UNTIED.chunk_elems() * 2; // fp16
    let per_step_gather = (2 * comm_groups * world * slot) as u64;
    let per_step_scatter = (comm_groups * world * slot) as u64;
    for r in &ranks {
        let st = r.zero.comm().stats();
        assert_eq!(st.all_gather.calls, 3 * 2 * comm_groups as u64);
        assert_eq!(st.all_gather.bytes, 3 * per_step_gather);
        assert_eq!(st.reduce_scatter.calls, 3 * comm_groups as u64);
        assert_eq!(st.reduce_scatter.bytes, 3 * per_step_scatter);
        assert_eq!(st.all_reduce.calls, 3 * 2);
        let z = r.zero.stats();
        assert_eq!(z.gathered_bytes, 3 * per_step_gather);
        assert_eq!(z.scattered_bytes, 3 * per_step_scatter);
        // bus bytes per rank and step: (N-1)/N of 3 model copies of fp16, plus the scalars
        let model_fp16 = (groups * UNTIED.chunk_elems() * 2) as f64;
        let bus = st.bus_bytes(world) / 3.0;
        let expect = 0.5 * 3.0 * model_fp16 + 2.0 * 0.5 * (8.0 + 1.0);
        assert!((bus - expect).abs() < 1e-9, "{bus} vs {expect}");
    }
}

/// A two-tensor model where rank `bad` writes an infinite gradient.
fn overflow_run(world: usize, bad: usize) -> Vec<(StepOutcome, f32, f32)> {
    on_ranks(world, 1 << 20, |c| {
        let r = c.rank();
        let mut z = ZeroManager::new(c, ManagerConfig::new(32, Policy::Tide)).unwrap();
        let ids: Vec<TensorId> = (0..4)
            .map(|i| {
                z.register(&format!("t{i}"), &[32], Init::Constant(1.0))
                    .unwrap()
            })
            .collect();
        let mut opt = HybridAdam::new(HybridConfig {
            loss_scale: Some(ScalerConfig::default()),
            ..HybridConfig::new(AdamConfig::adam(0.1))
        })
        .unwrap();
        z.fetch(&ids, Stage::Forward).unwrap();
        z.release(&ids, Stage::Forward).unwrap();
        z.end_forward().unwrap();
        z.fetch(&ids, Stage::Backward).unwrap();
        for &id in &ids {
            let g = if r == bad && id == ids[3] {
                f32::INFINITY
            } else {
                1.0
            };
            z.write_grad(id, &[g; 32]).unwrap();
        }
        z.release(&ids, Stage::Backward).unwrap();
        z.end_backward().unwrap();
        let rep = z.step(&mut opt).unwrap();
        let own = ids.iter().copied().find(|&id| z.owns(id)).unwrap();
        (rep.outcome, rep.loss_scale, z.master(own).unwrap()[0])
    })
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    for bad in [0, 1] {
        let out = overflow_run(2, bad);
        for (outcome, _, master) in out {
            assert_eq!(outcome, StepOutcome::Skipped);
            assert_eq!(master, 1.0, "a skipped step leaves the masters");
        }
    }
    // without an overflow nobody skips
    let out = overflow_run(2, 9);
    assert!(out.iter().all(|o| o.0 == StepOutcome::Stepped && o.2 < 1.0));
}

/// What a refused call must leave as it was: the stage, the registrations, the collectives and
/// chunk moves so far, and the rank's owned masters.
fn snapshot(z: &mut ZeroManager) -> impl PartialEq + std::fmt::Debug {
    let mine: Vec<TensorId> = (0..z.layout().slots.len() as u32)
        .map(TensorId)
        .filter(|&id| z.owns(id))
        .collect();
    let masters: Vec<Vec<u32>> = mine
        .iter()
        .map(|&id| {
            z.master(id)
                .map(|m| m.iter().map(|x| x.to_bits()).collect())
        })
        .collect::<Result<_, _>>()
        .unwrap_or_default();
    (
        z.stage(),
        z.layout().slots.clone(),
        z.stats(),
        z.local().stats(),
        mine,
        masters,
    )
}

#[test]
fn misuse_is_an_error() {
    on_ranks(2, 1 << 20, |c| {
        let r = c.rank();
        let mut z = ZeroManager::new(c, ManagerConfig::new(16, Policy::Tide)).unwrap();
        let a = z.register("a", &[16], Init::Zeros).unwrap();
        let b = z.register("b", &[16], Init::Zeros).unwrap();
        // Each refusal is an error, which it returns, and changes nothing.
        macro_rules! refused {
            ($call:expr) => {{
                let before = snapshot(&mut z);
                let e = $call;
                assert_eq!(snapshot(&mut z), before, "{}", stringify!($call));
                match e {
                    Err(e) => e,
                    Ok(_) => panic!("{} was accepted", stringify!($call)),
                }
            }};
        }
        refused!(z.register("bad", &[0], Init::Zeros));
        // backward before forward, the optimizer stage, unknown and repeated tensors
        refused!(z.fetch(&[a], Stage::Backward).map(|_| ()));
        refused!(z.fetch(&[a], Stage::Optimizer).map(|_| ()));
        refused!(z.fetch(&[TensorId(9)], Stage::Forward).map(|_| ()));
        refused!(z.fetch(&[a, a], Stage::Forward).map(|_| ()));
        assert_eq!(z.stage(), None, "no stage began");
        // the remote tensor cannot be read before it is gathered
        let remote = if r == 0 { b } else { a };
        refused!(z.read(remote));
        refused!(z.master(remote));
        let v = z.fetch(&[a, b], Stage::Forward).unwrap();
        refused!(z.write_grad(a, &[0.0; 16])); // no gradient in forward
        refused!(z.register("late", &[4], Init::Zeros));
        assert!(
            matches!(
                refused!(z.release(&[a, b], Stage::Forward)),
                Error::ViewAlive { .. }
            ),
            "views still alive"
        );
        drop(v);
        z.release(&[a, b], Stage::Forward).unwrap();
        refused!(z.end_backward());
        z.end_forward().unwrap();
        z.fetch(&[a, b], Stage::Backward).unwrap();
        assert!(matches!(
            refused!(z.write_grad(a, &[0.0; 3])),
            Error::SizeMismatch { .. }
        ));
        z.write_grad(a, &[0.5; 16]).unwrap();
        z.write_grad(b, &[0.5; 16]).unwrap();
        z.release(&[a, b], Stage::Backward).unwrap();
        z.end_backward().unwrap();
        let mut opt = HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1))).unwrap();
        assert_eq!(z.step(&mut opt).unwrap().outcome, StepOutcome::Stepped);
        let steps = opt.steps();
        refused!(z.step(&mut opt).map(|_| ()));
        assert_eq!(opt.steps(), steps, "a second step without backward");
    });
    // more ranks than chunk groups
    on_ranks(4, 1 << 20, |c| {
        let mut z = ZeroManager::new(c, ManagerConfig::new(16, Policy::Tide)).unwrap();
        let a = z.register("a", &[16], Init::Zeros).unwrap();
        let before = snapshot(&mut z);
        assert!(z.fetch(&[a], Stage::Forward).is_err());
        assert_eq!(
            snapshot(&mut z),
            before,
            "a refused first fetch changes nothing"
        );
    });
}

#[test]
fn gradient_accumulation_composes_with_zero() {
    // 2 micro-batches per step: the single process takes halves of every batch, each of 2
    // ranks takes quarters; both step on the mean gradient of the whole batch
    let cfg = || config(&TOY, DType::F32);
    let acc_adam = || {
        HybridAdam::new(HybridConfig {
            accumulation_steps: 2,
            max_grad_norm: Some(0.5),
            ..HybridConfig::new(AdamConfig::adamw(1e-2, 0.01))
        })
        .unwrap()
    };
    let steps = 3u64;
    let reference: Vec<Vec<f32>> = {
        let dev = common::sim(1 << 20);
        let mut m = ChunkManager::new(dev.clone(), cfg()).unwrap();
        let pool = CachingAllocator::new(dev);
        m.set_non_model_allocator(pool.clone());
        let ids = TOY.register(&mut m).unwrap();
        let mut opt = acc_adam();
        for s in 0..steps {
            for k in 0..2 {
                TOY.forward_backward(&mut m, &ids, s, 1.0, (k, 2)).unwrap();
                opt.step(&mut m).unwrap();
            }
        }
        (0..m.num_tensors() as u32)
            .map(|t| m.master(TensorId(t)).unwrap())
            .collect()
    };
    let owned: Vec<Vec<(usize, Vec<f32>)>> = on_ranks(2, 1 << 20, |c| {
        let r = c.rank();
        let mut z = ZeroManager::new(c, cfg()).unwrap();
        let ids = TOY.register(&mut z).unwrap();
        let mut opt = acc_adam();
        let mut outcomes = Vec::new();
        for s in 0..steps {
            for k in 0..2 {
                TOY.forward_backward(&mut z, &ids, s, 1.0, (2 * r + k, 4))
                    .unwrap();
                outcomes.push(z.step(&mut opt).unwrap().outcome);
            }
        }
        assert_eq!(outcomes[0], StepOutcome::Accumulated);
        assert_eq!(outcomes[1], StepOutcome::Stepped);
        let mine: Vec<TensorId> = (0..z.layout().slots.len() as u32)
            .map(TensorId)
            .filter(|&id| z.owns(id))
            .collect();
        mine.into_iter()
            .map(|id| (id.index(), z.master(id).unwrap()))
            .collect()
    });
    let mut n = 0;
    for (t, m) in owned.into_iter().flatten() {
        let e = rel_err(&m, &reference[t]);
        assert!(e <= TOL, "tensor {t}: {e:e}");
        n += 1;
    }
    assert_eq!(n, reference.len());
}
