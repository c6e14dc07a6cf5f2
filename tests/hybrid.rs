//! HybridAdam over the chunk manager on the simulated device: placement never changes a bit,
//! steps equal the CPU kernel on flat arrays, overflow skips and restores, clipping and
//! accumulation fold into the kernel's gradient scale, and optimizer state may live on the file
//! tier.

mod common;

use half::f16;
use tidemem::chunk::{ChunkManager, ManagerConfig};
use tidemem::demo::ToyIds;
use tidemem::device::{Device, SimConfig};
use tidemem::ops::{CpuAdam, Grad, ParamCopy};
use tidemem::optim::{
    AdamConfig, DevicePlacement, HybridAdam, HybridConfig, LossScaler, ScaleUpdate, ScalerConfig,
    StepOutcome, StepReport,
};
use tidemem::tensor::ChunkKind;
use tidemem::tensor::{Init, Stage, TensorId};
use tidemem::tide::Policy;
use tidemem::DType;

use common::{toy_setup as setup, TOY};

fn hybrid(placement: DevicePlacement) -> HybridAdam {
    HybridAdam::new(HybridConfig {
        placement,
        loss_scale: Some(ScalerConfig {
            init_scale: 1024.0,
            growth_interval: 3,
            ..ScalerConfig::default()
        }),
        max_grad_norm: Some(0.3),
        ..HybridConfig::new(AdamConfig::adamw(1e-2, 0.01))
    })
    .unwrap()
}

/// Trains `steps` iterations; returns the reports, then every tensor's fp16 parameter bits
/// and fp32 master bits.
fn train(
    m: &mut ChunkManager,
    ids: &ToyIds,
    opt: &mut HybridAdam,
    steps: u64,
) -> (Vec<StepReport>, Vec<u16>, Vec<u32>) {
    let mut reports = Vec::new();
    for s in 0..steps {
        TOY.forward_backward(m, ids, s, opt.loss_scale(), (0, 1))
            .unwrap();
        reports.push(opt.step(m).unwrap());
    }
    let (mut params, mut masters) = (Vec::new(), Vec::new());
    for t in 0..m.num_tensors() as u32 {
        let id = TensorId(t);
        params.extend(
            m.read(id)
                .unwrap()
                .iter()
                .map(|&x| f16::from_f32(x).to_bits()),
        );
        masters.extend(m.master(id).unwrap().iter().map(|x| x.to_bits()));
    }
    (reports, params, masters)
}

const BIG: usize = 1 << 20;
/// Room for about three 544-byte parameter chunks beside the activations, and for one group's
/// four chunks (3808 bytes) at an optimizer moment.
/// Device bytes for model data besides the toy's peak non-model memory: about three fp16
/// chunks, so chunks must move.
const CHUNK_ROOM: usize = 1928;

/// A device where chunks must move: the toy's non-model peak and [`CHUNK_ROOM`].
fn small() -> usize {
    TOY.non_model_peak(DType::F16) + CHUNK_ROOM
}

#[test]
fn placement_never_changes_the_arithmetic() {
    let (mut m, _, ids) = setup(Policy::Tide, BIG, None);
    let mut opt = hybrid(DevicePlacement::Auto { fraction: 0.8 });
    let (reports, params, masters) = train(&mut m, &ids, &mut opt, 6);
    // warm-up steps on the host; then everything fits and every group steps on the device
    assert_eq!(reports[0].device_groups, 0);
    assert!(reports[1..].iter().all(|r| r.device_groups == m.groups()));
    assert!(reports.iter().all(|r| r.outcome == StepOutcome::Stepped));
    assert!(
        reports.iter().any(|r| r.clip_coef < 1.0),
        "clipping is exercised: {reports:?}"
    );
    assert!(reports
        .iter()
        .any(|r| r.scale_update == Some(ScaleUpdate::Grew)));
    for (policy, capacity, placement, host_budget) in [
        (
            Policy::Tide,
            small(),
            DevicePlacement::Auto { fraction: 0.8 },
            None,
        ),
        (Policy::Tide, small(), DevicePlacement::HostOnly, None),
        (Policy::Tide, small(), DevicePlacement::Groups(2), None),
        (
            Policy::PatrickStar,
            small(),
            DevicePlacement::Groups(1),
            None,
        ),
        (Policy::Lru, small(), DevicePlacement::Groups(3), None),
        (
            Policy::Static {
                device_fraction: 0.5,
            },
            BIG,
            DevicePlacement::HostOnly,
            None,
        ),
        (Policy::Tide, BIG, DevicePlacement::HostOnly, None),
        // optimizer state spills to the file tier
        (
            Policy::Tide,
            small(),
            DevicePlacement::Groups(1),
            Some(8 * 1024),
        ),
    ] {
        let (mut m2, _, ids2) = setup(policy, capacity, host_budget);
        let mut opt2 = hybrid(placement);
        let (r2, p2, ma2) = train(&mut m2, &ids2, &mut opt2, 6);
        let what = format!("{policy:?} on {capacity} bytes, {placement:?}, host {host_budget:?}");
        assert!(p2 == params, "fp16 parameters differ: {what}");
        assert!(ma2 == masters, "fp32 masters differ: {what}");
        let norms = |r: &[StepReport]| r.iter().map(|r| r.grad_norm).collect::<Vec<_>>();
        assert_eq!(norms(&r2), norms(&reports), "{what}");
        // host groups step during backward, kept where the step's scalars were the armed ones
        // (a step after a clipped one is not speculated; the redone steps of a clip that follows
        // a clean step are overlapped_steps_equal_serial_ones_through_clips_and_overflows')
        let o = m2.overlap_stats();
        let host_groups = !matches!(placement, DevicePlacement::Auto { .. }) || capacity == small();
        if host_groups {
            assert!(
                o.kept > 0 && o.kept + o.redone == o.started,
                "{what}: {o:?}"
            );
        }
        if host_budget.is_some() {
            let u = m2.usage();
            let on_file = u.file[ChunkKind::Momentum.index()] + u.file[ChunkKind::Variance.index()];
            assert!(on_file > 0, "optimizer state on the file tier: {u:?}");
        }
        if capacity == small() && placement == (DevicePlacement::Auto { fraction: 0.8 }) {
            assert!(r2[5].device_groups < m2.groups(), "{:?}", r2[5]);
        }
    }
}

/// HybridAdam on CUDA: the groups placed on the device step with the CUDA kernels (Adam and the
/// gradient statistics), the others on the host, and the result is the Sim device's (bit for
/// bit on the emulator, within a rounding tolerance on a GPU), with the same outcomes.
#[test]
fn hybrid_adam_on_cuda_equals_the_sim_device() {
    let Some(gpu) = common::cuda("hybrid_adam_on_cuda_equals_the_sim_device") else {
        return;
    };
    for (policy, capacity, placement) in [
        (Policy::Tide, BIG, DevicePlacement::Auto { fraction: 0.8 }),
        (Policy::Tide, small(), DevicePlacement::Groups(2)),
        (Policy::PatrickStar, small(), DevicePlacement::HostOnly),
    ] {
        let (mut m, _, ids) = setup(policy, capacity, None);
        let mut opt = hybrid(placement);
        let reference = train(&mut m, &ids, &mut opt, 6);
        let (mut g, _, gids) = common::toy_setup_on(gpu.clone(), policy, capacity, None);
        let mut gopt = hybrid(placement);
        let got = train(&mut g, &gids, &mut gopt, 6);
        let what = format!("{policy:?} on {capacity} bytes, {placement:?}");
        let wide = |p: &[u16]| {
            p.iter()
                .map(|&b| f16::from_bits(b).to_f32().to_bits())
                .collect()
        };
        let norms = |r: &[StepReport]| r.iter().map(|r| (r.grad_norm as f32).to_bits()).collect();
        for (g, r, part) in [
            (wide(&got.1), wide(&reference.1), "fp16 parameters"),
            (got.2.clone(), reference.2.clone(), "fp32 masters"),
            (norms(&got.0), norms(&reference.0), "gradient norms"),
        ] {
            common::assert_same_arithmetic(&gpu, &g, &r, 1e-3, &format!("{what}: {part}"));
        }
        if common::is_emulated(&gpu) {
            let exact =
                |r: &[StepReport]| r.iter().map(|r| r.grad_norm.to_bits()).collect::<Vec<_>>();
            assert_eq!(exact(&got.0), exact(&reference.0), "{what}: gradient norms");
        }
        let key = |r: &[StepReport]| {
            r.iter()
                .map(|r| (r.outcome, r.device_groups))
                .collect::<Vec<_>>()
        };
        assert_eq!(key(&got.0), key(&reference.0), "{what}");
        // host groups stepped during backward there too, kept and redone alike
        assert_eq!(g.overlap_stats(), m.overlap_stats(), "{what}");
        if placement == DevicePlacement::Groups(2) {
            assert!(
                g.overlap_stats().kept > 0,
                "{what}: {:?}",
                g.overlap_stats()
            );
        }
        if placement != DevicePlacement::HostOnly {
            assert!(
                got.0.iter().any(|r| r.device_groups > 0),
                "{what}: {:?}",
                got.0
            );
        }
    }
}

/// A manager with one tensor of `n` elements per group, on a Sim device of 1 MiB.
fn single(n: usize, groups: usize) -> (ChunkManager, Vec<TensorId>) {
    single_of(n, groups, DType::F16)
}

/// [`single`] with parameters of `dtype`.
fn single_of(n: usize, groups: usize, dtype: DType) -> (ChunkManager, Vec<TensorId>) {
    let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
    single_on(dev, Policy::Tide, None, n, groups, dtype)
}

/// [`single_of`] on `dev` under `policy`, planning for `capacity` bytes of it when given.
fn single_on(
    dev: Device,
    policy: Policy,
    capacity: Option<u64>,
    n: usize,
    groups: usize,
    dtype: DType,
) -> (ChunkManager, Vec<TensorId>) {
    let mut cfg = ManagerConfig::new(n, policy);
    cfg.param_dtype = dtype;
    if let Some(c) = capacity {
        cfg.scheduler.capacity = c;
        cfg.scheduler.overall_fraction = 1.0;
        cfg.scheduler.warmup_chunk_fraction = 1.0;
    }
    let mut m = ChunkManager::new(dev, cfg).unwrap();
    let ids = (0..groups)
        .map(|g| {
            m.register(
                &format!("w{g}"),
                &[n],
                Init::Uniform {
                    seed: g as u64,
                    lo: -1.0,
                    hi: 1.0,
                },
            )
            .unwrap()
        })
        .collect();
    (m, ids)
}

/// One iteration writing `grads[i]` into tensor `ids[i]`.
fn iterate(m: &mut ChunkManager, ids: &[TensorId], grads: &[Vec<f32>]) {
    for &id in ids {
        m.fetch(&[id], Stage::Forward).unwrap();
        m.release(&[id], Stage::Forward).unwrap();
    }
    m.end_forward().unwrap();
    for (i, &id) in ids.iter().enumerate().rev() {
        m.fetch(&[id], Stage::Backward).unwrap();
        m.write_grad(id, &grads[i]).unwrap();
        m.release(&[id], Stage::Backward).unwrap();
    }
    m.end_backward().unwrap();
}

fn grads(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = tidemem::rng::splitmix64(seed * 1_000_003 + i as u64);
            // exactly representable in fp16 once scaled by a power of two
            f16::from_f32(((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale).to_f32()
        })
        .collect()
}

#[test]
fn steps_equal_the_cpu_kernel_on_flat_arrays_with_clipping_folded_in() {
    let n = 1000;
    for placement in [DevicePlacement::Groups(1), DevicePlacement::HostOnly] {
        let (mut m, ids) = single(n, 2);
        let adam = AdamConfig::adam(1e-2);
        let mut opt = HybridAdam::new(HybridConfig {
            placement,
            loss_scale: Some(ScalerConfig::fixed(256.0)),
            max_grad_norm: Some(1.0),
            ..HybridConfig::new(adam)
        })
        .unwrap();
        let mut p: Vec<Vec<f32>> = ids.iter().map(|&id| m.master(id).unwrap()).collect();
        let mut mo = vec![vec![0f32; n]; 2];
        let mut va = vec![vec![0f32; n]; 2];
        for step in 1..=5u64 {
            let g: Vec<Vec<f32>> = (0..2).map(|i| grads(step * 2 + i, n, 256.0)).collect();
            iterate(&mut m, &ids, &g);
            let r = opt.step(&mut m).unwrap();
            assert_eq!(r.outcome, StepOutcome::Stepped);
            let on_device = placement != DevicePlacement::HostOnly && step > 1;
            assert_eq!(r.device_groups, usize::from(on_device), "step {step}");
            // the same step on flat arrays
            let sum: f64 = g.iter().flatten().map(|&x| (x as f64) * (x as f64)).sum();
            let norm = sum.sqrt() / 256.0;
            assert!(
                (r.grad_norm - norm).abs() <= 1e-12 * norm,
                "{} vs {norm}",
                r.grad_norm
            );
            let clip = if norm > 1.0 {
                (1.0 / (norm + 1e-6)) as f32
            } else {
                1.0
            };
            assert_eq!(r.clip_coef, clip);
            assert!(clip < 1.0, "clipping is exercised");
            let s = adam.scalars(step, clip / 256.0).unwrap();
            for i in 0..2 {
                let g16: Vec<f16> = g[i].iter().map(|&x| f16::from_f32(x)).collect();
                let mut c = vec![f16::ZERO; n];
                CpuAdam::new()
                    .step(
                        &s,
                        &mut p[i],
                        &mut mo[i],
                        &mut va[i],
                        Grad::F16(&g16),
                        ParamCopy::F16(&mut c),
                    )
                    .unwrap();
                assert_eq!(m.master(ids[i]).unwrap(), p[i], "{placement:?} step {step}");
                let want: Vec<f32> = c.iter().map(|x| x.to_f32()).collect();
                assert_eq!(m.read(ids[i]).unwrap(), want);
            }
        }
    }
}

/// One step's outcome, clip coefficient, loss scale and every tensor's master and parameter
/// bits.
type Trail = Vec<(StepOutcome, f32, f32, Vec<u32>)>;

/// Every tensor's master and parameter values, as bits.
fn state_bits(m: &mut ChunkManager, ids: &[TensorId]) -> Vec<u32> {
    ids.iter()
        .flat_map(|&id| {
            let mut v = m.master(id).unwrap();
            v.extend(m.read(id).unwrap());
            v
        })
        .map(f32::to_bits)
        .collect()
}

/// `steps` (at least 7) steps of `m`'s groups (one tensor each) through a clean start, a clip
/// (step 4), an overflow in a host group (step 6) and the scale's growths (every 3 clean
/// steps), overlapped with backward or not: the trail, what the overlap did, and the chunk
/// moves.
fn clip_and_overflow_run(
    (mut m, ids): (ChunkManager, Vec<TensorId>),
    placement: DevicePlacement,
    overlap: bool,
    steps: u64,
) -> (
    Trail,
    tidemem::chunk::OverlapStats,
    tidemem::tide::MoveStats,
) {
    let groups = ids.len();
    let n = m.tensor_info(ids[0]).unwrap().1[0];
    let grads_at = |step: u64| -> Vec<Vec<f32>> {
        let scale = if step == 4 { 4096.0 } else { 4.0 };
        let mut g: Vec<Vec<f32>> = (0..groups as u64)
            .map(|i| grads(step * 10 + i, n, scale))
            .collect();
        if step == 6 {
            g[groups - 1][123] = f32::INFINITY;
        }
        g
    };
    let mut opt = HybridAdam::new(HybridConfig {
        placement,
        overlap,
        loss_scale: Some(ScalerConfig {
            init_scale: 64.0,
            growth_interval: 3,
            hysteresis: 1,
            ..ScalerConfig::default()
        }),
        max_grad_norm: Some(8.0),
        ..HybridConfig::new(AdamConfig::adamw(1e-2, 0.01))
    })
    .unwrap();
    let mut trail = Vec::new();
    for step in 1..=steps {
        let scale = opt.loss_scale();
        let g: Vec<Vec<f32>> = grads_at(step)
            .into_iter()
            .map(|v| v.into_iter().map(|x| x * scale / 64.0).collect())
            .collect();
        iterate(&mut m, &ids, &g);
        let r = opt.step(&mut m).unwrap();
        trail.push((
            r.outcome,
            r.clip_coef,
            r.loss_scale,
            state_bits(&mut m, &ids),
        ));
    }
    (trail, m.overlap_stats(), m.stats())
}

/// The serial and the overlapped trail agree step for step, the serial one clipped and
/// skipped an overflow, and the overlap kept what it could: every step after the first starts
/// every host group early (step 1 is warm-up); the clip, the overflow and the scale's growths
/// are redone, the rest kept.
fn assert_overlap_exact(
    serial: &Trail,
    overlapped: &Trail,
    o: &tidemem::chunk::OverlapStats,
    host: u64,
    what: &str,
) {
    for (step, (a, b)) in serial.iter().zip(overlapped).enumerate() {
        assert!(a == b, "{what}: step {} differs", step + 1);
    }
    let outcomes: Vec<_> = serial.iter().map(|t| (t.0, t.1 < 1.0)).collect();
    assert!(
        outcomes.contains(&(StepOutcome::Skipped, false)),
        "{what}: {outcomes:?}"
    );
    assert!(
        outcomes.contains(&(StepOutcome::Stepped, true)),
        "{what}: {outcomes:?}"
    );
    // every step after the first is speculated but one that follows a clipped step
    let mut speculated = 0;
    let mut clipped = false;
    for (i, t) in serial.iter().enumerate() {
        speculated += u64::from(i > 0 && !clipped);
        if t.0 == StepOutcome::Stepped {
            clipped = t.1 < 1.0;
        }
    }
    let steps = serial.len() as u64;
    assert_eq!(o.started, speculated * host, "{what}: {o:?}");
    assert!(
        o.redone > 0,
        "{what}: a clip after a clean step is redone: {o:?}"
    );
    assert!(o.kept >= (steps - 6) * host, "{what}: {o:?}");
    assert_eq!(o.kept + o.redone, o.started, "{what}: {o:?}");
    // a host group not kept from backward steps on the worker after it (the first step is
    // warm-up; a skipped step steps nothing)
    let stepped = serial[1..]
        .iter()
        .filter(|t| t.0 == StepOutcome::Stepped)
        .count() as u64;
    assert_eq!(o.kept + o.deferred, stepped * host, "{what}: {o:?}");
}

/// Host groups stepped during backward keep the serial step's bits through clean steps (kept),
/// a clip, an overflow and a grown loss scale (redone), for every placement; fp16, bf16 and
/// f32 parameters.
#[test]
fn overlapped_steps_equal_serial_ones_through_clips_and_overflows() {
    let (n, groups) = (5000, 5);
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for placement in [DevicePlacement::HostOnly, DevicePlacement::Groups(2)] {
            let run = |overlap| {
                clip_and_overflow_run(single_of(n, groups, dtype), placement, overlap, 10)
            };
            let (serial, none, _) = run(false);
            let (overlapped, o, _) = run(true);
            let what = format!("{dtype:?} {placement:?}");
            assert_eq!(none, Default::default(), "{what}");
            let host = groups
                - if placement == DevicePlacement::HostOnly {
                    0
                } else {
                    2
                };
            assert_overlap_exact(&serial, &overlapped, &o, host as u64, &what);
        }
    }
}

/// The same under every policy, on the simulated device and on CUDA, on a roomy device and on
/// a small one (two of the five chunks, or a device group's optimizer state beside one chunk:
/// it evicts, more chunk evictions and more bytes up than the roomy device): overlap off and
/// on give the same bits through the clip, the overflow and the scale's growths, and the
/// device's bits are the simulated device's.
#[test]
fn overlap_keeps_the_bits_under_every_policy_and_device() {
    let (n, groups) = (1000, 5);
    let chunk = (n * 2) as u64;
    let mut reference: Option<Trail> = None;
    // a roomy device's moves, by policy and placement (the simulated device runs first; the
    // schedule is the device's whatever backend runs it)
    let mut roomy_of = std::collections::HashMap::new();
    for dev in common::devices("hybrid::overlap_keeps_the_bits_under_every_policy_and_device") {
        // on CUDA (minutes on the emulator for all of it): every policy on the small device
        // with Adam on the host, and the device's Adam beside the host's under the tide
        let sim = dev.kind() == tidemem::device::BackendKind::Sim;
        for policy in Policy::all() {
            let placements = match sim || policy == Policy::Tide {
                true => vec![DevicePlacement::HostOnly, DevicePlacement::Groups(2)],
                false => vec![DevicePlacement::HostOnly],
            };
            for placement in placements {
                let run = |capacity, overlap| {
                    let m = single_on(dev.clone(), policy, capacity, n, groups, DType::F16);
                    clip_and_overflow_run(m, placement, overlap, 7)
                };
                let key = (policy.name(), placement == DevicePlacement::HostOnly);
                let roomy = *roomy_of.entry(key).or_insert_with(|| run(None, false).2);
                let sizes: &[bool] = if sim { &[false, true] } else { &[true] };
                for &small in sizes {
                    // two parameter chunks, or one device group's state (its fp16 chunk and
                    // the fp32 master and moments) beside one chunk
                    let least = match placement {
                        DevicePlacement::HostOnly => 2 * chunk,
                        _ => 8 * chunk,
                    };
                    let capacity = small.then_some(least + 4096);
                    let what = format!(
                        "{}, {}, {placement:?}, {}",
                        dev.name(),
                        policy.name(),
                        if small { "small" } else { "roomy" }
                    );
                    let (serial, _, moved) = run(capacity, false);
                    let (overlapped, o, moved_o) = run(capacity, true);
                    let host = groups
                        - if placement == DevicePlacement::HostOnly {
                            0
                        } else {
                            2
                        };
                    assert_overlap_exact(&serial, &overlapped, &o, host as u64, &what);
                    if small
                        && policy
                            != (Policy::Static {
                                device_fraction: 0.0,
                            })
                    {
                        common::assert_evicts(&moved, &roomy, &format!("{what}, serial"));
                        common::assert_evicts(&moved_o, &roomy, &format!("{what}, overlapped"));
                    }
                    // one placement's bits are every policy's, device's and size's
                    if placement == DevicePlacement::HostOnly {
                        let r = reference.get_or_insert_with(|| serial.clone());
                        assert!(*r == serial, "{what}: the bits of the first run");
                    }
                }
            }
        }
    }
}

/// With a clip that binds every step the host groups step after backward, beside the next
/// forward: a checkpoint saved and loaded while those steps may still run holds the stepped
/// state, and the steps from it repeat the uninterrupted run's bits.
#[test]
fn a_checkpoint_between_steps_after_backward_keeps_the_bits() {
    let (n, groups) = (2000, 3);
    let (mut m, ids) = single(n, groups);
    let mut opt = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        max_grad_norm: Some(1e-3),
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    })
    .unwrap();
    let step = |m: &mut ChunkManager, opt: &mut HybridAdam, i: u64| {
        let g: Vec<Vec<f32>> = (0..groups as u64)
            .map(|k| grads(i * 7 + k, n, 0.5))
            .collect();
        iterate(m, &ids, &g);
        assert!(opt.step(m).unwrap().clip_coef < 1.0);
    };
    for i in 0..4 {
        step(&mut m, &mut opt, i);
    }
    let path = std::env::temp_dir().join(format!(
        "tidemem-deferred-load-{}.safetensors",
        std::process::id()
    ));
    opt.save_checkpoint(&mut m, &path).unwrap();
    for i in 4..6 {
        step(&mut m, &mut opt, i);
    }
    let once = state_bits(&mut m, &ids);
    opt.load_checkpoint(&mut m, &path).unwrap();
    for i in 4..6 {
        step(&mut m, &mut opt, i);
    }
    assert!(
        state_bits(&mut m, &ids) == once,
        "the same two steps from the save"
    );
    assert!(m.overlap_stats().deferred > 0, "{:?}", m.overlap_stats());
    std::fs::remove_file(&path).ok();
}

/// With gradient accumulation, each micro-batch but the last folds its gradients into the
/// accumulators during backward (the last steps after it): the same bits as folding after
/// backward, through an overflow, with fp16 and bf16 parameters, on every group placement.
#[test]
fn folds_during_backward_equal_serial_ones() {
    let (n, groups, micro) = (3000, 4, 3u32);
    for dtype in [DType::F16, DType::BF16] {
        let run = |overlap: bool| {
            let (mut m, ids) = single_of(n, groups, dtype);
            let mut opt = HybridAdam::new(HybridConfig {
                overlap,
                accumulation_steps: micro,
                loss_scale: Some(ScalerConfig {
                    init_scale: 64.0,
                    hysteresis: 1,
                    ..ScalerConfig::default()
                }),
                max_grad_norm: Some(100.0),
                ..HybridConfig::new(AdamConfig::adamw(1e-2, 0.01))
            })
            .unwrap();
            let mut trail = Vec::new();
            for i in 0..15u64 {
                let scale = opt.loss_scale();
                let mut g: Vec<Vec<f32>> = (0..groups as u64)
                    .map(|k| grads(i * 10 + k, n, scale / 16.0))
                    .collect();
                if i == 8 {
                    // an overflow in a fold: the step it ends in is skipped
                    g[1][7] = f32::INFINITY;
                }
                iterate(&mut m, &ids, &g);
                let r = opt.step(&mut m).unwrap();
                trail.push((r.outcome, r.grad_norm.to_bits(), state_bits(&mut m, &ids)));
            }
            (trail, m.overlap_stats())
        };
        let (serial, none) = run(false);
        let (folded, o) = run(true);
        assert_eq!(none.started, 0);
        for (i, (a, b)) in serial.iter().zip(&folded).enumerate() {
            assert!(a == b, "{dtype:?}: micro-batch {i} differs");
        }
        assert!(serial.iter().any(|t| t.0 == StepOutcome::Skipped));
        // two folds of three micro-batches a step, every group, after the warm-up
        assert!(o.kept >= 8 * groups as u64, "{dtype:?}: {o:?}");
        assert_eq!(o.kept + o.redone, o.started, "{o:?}");
    }
}

/// A checkpoint loaded into the same manager and optimizer between steps: the folds armed
/// before the load are not taken for the loaded run's (their accumulators are gone), and
/// training goes on as it did from the save.
#[test]
fn a_load_between_steps_keeps_folds_during_backward_exact() {
    let (n, groups) = (2000, 3);
    let (mut m, ids) = single(n, groups);
    let mut opt = HybridAdam::new(HybridConfig {
        accumulation_steps: 2,
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    })
    .unwrap();
    let micro = |m: &mut ChunkManager, opt: &mut HybridAdam, i: u64| {
        let g: Vec<Vec<f32>> = (0..groups as u64)
            .map(|k| grads(i * 7 + k, n, 0.5))
            .collect();
        iterate(m, &ids, &g);
        opt.step(m).unwrap();
    };
    for i in 0..4 {
        micro(&mut m, &mut opt, i);
    }
    let path = std::env::temp_dir().join(format!(
        "tidemem-fold-load-{}.safetensors",
        std::process::id()
    ));
    opt.save_checkpoint(&mut m, &path).unwrap();
    let state = |m: &mut ChunkManager| -> Vec<u32> {
        ids.iter()
            .flat_map(|&id| m.master(id).unwrap())
            .map(f32::to_bits)
            .collect()
    };
    for i in 4..6 {
        micro(&mut m, &mut opt, i);
    }
    let once = state(&mut m);
    let before = m.overlap_stats();
    opt.load_checkpoint(&mut m, &path).unwrap();
    for i in 4..6 {
        micro(&mut m, &mut opt, i);
    }
    assert_eq!(
        state(&mut m),
        once,
        "the same two micro-batches from the save"
    );
    assert!(before.kept > 0, "{before:?}");
    std::fs::remove_file(&path).ok();
}

#[test]
fn overflow_skips_the_step_restores_parameters_and_backs_off() {
    let n = 300;
    // group 0 steps on the device, group 1 on the host; the overflow is in each in turn
    for bad in 0..2 {
        let (mut m, ids) = single(n, 2);
        let mut opt = HybridAdam::new(HybridConfig {
            placement: DevicePlacement::Groups(1),
            loss_scale: Some(ScalerConfig {
                init_scale: 1024.0,
                hysteresis: 1,
                ..ScalerConfig::default()
            }),
            ..HybridConfig::new(AdamConfig::adam(1e-2))
        })
        .unwrap();
        iterate(&mut m, &ids, &[grads(1, n, 64.0), grads(2, n, 64.0)]);
        assert_eq!(opt.step(&mut m).unwrap().outcome, StepOutcome::Stepped);
        let masters: Vec<Vec<f32>> = ids.iter().map(|&id| m.master(id).unwrap()).collect();
        let params: Vec<Vec<f32>> = ids.iter().map(|&id| m.read(id).unwrap()).collect();
        let mut g = vec![grads(3, n, 64.0), grads(4, n, 64.0)];
        g[bad][17] = f32::INFINITY;
        iterate(&mut m, &ids, &g);
        let r = opt.step(&mut m).unwrap();
        assert_eq!(r.outcome, StepOutcome::Skipped, "overflow in group {bad}");
        assert_eq!(r.scale_update, Some(ScaleUpdate::BackedOff));
        assert_eq!(opt.loss_scale(), 512.0);
        assert_eq!(opt.steps(), 1);
        for i in 0..2 {
            assert_eq!(m.master(ids[i]).unwrap(), masters[i], "masters untouched");
            assert_eq!(m.read(ids[i]).unwrap(), params[i], "parameters restored");
        }
        // training goes on, and the skipped step left no trace in the optimizer state: the next
        // step equals a run that never saw the overflow
        iterate(&mut m, &ids, &[grads(5, n, 32.0), grads(6, n, 32.0)]);
        assert_eq!(opt.step(&mut m).unwrap().outcome, StepOutcome::Stepped);
        let (mut m2, ids2) = single(n, 2);
        let mut opt2 = HybridAdam::new(HybridConfig {
            placement: DevicePlacement::Groups(1),
            loss_scale: Some(ScalerConfig::fixed(1024.0)),
            ..HybridConfig::new(AdamConfig::adam(1e-2))
        })
        .unwrap();
        iterate(&mut m2, &ids2, &[grads(1, n, 64.0), grads(2, n, 64.0)]);
        opt2.step(&mut m2).unwrap();
        // the same unscaled gradients under the fixed scale
        iterate(&mut m2, &ids2, &[grads(5, n, 64.0), grads(6, n, 64.0)]);
        opt2.step(&mut m2).unwrap();
        for i in 0..2 {
            assert_eq!(m.master(ids[i]).unwrap(), m2.master(ids2[i]).unwrap());
        }
    }
}

#[test]
fn accumulation_steps_with_the_mean_gradient() {
    let n = 257;
    // multiples of 1/64 in [-4, 4]: x ± y and their mean are exact in fp16
    let grid = |seed: u64| -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = tidemem::rng::splitmix64(seed * 7919 + i as u64);
                ((h % 513) as f32 - 256.0) / 64.0
            })
            .collect()
    };
    let (x, y) = (grid(1), grid(2));
    let g1: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    let g2: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a - b).collect();
    let mean = x;
    let cfg = HybridConfig {
        placement: DevicePlacement::HostOnly,
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    };
    let (mut a, ida) = single(n, 1);
    let mut acc = HybridAdam::new(HybridConfig {
        accumulation_steps: 2,
        ..cfg
    })
    .unwrap();
    let before = a.read(ida[0]).unwrap();
    iterate(&mut a, &ida, &[g1]);
    assert_eq!(acc.step(&mut a).unwrap().outcome, StepOutcome::Accumulated);
    assert_eq!(
        a.read(ida[0]).unwrap(),
        before,
        "parameters restored between micro-batches"
    );
    iterate(&mut a, &ida, &[g2]);
    assert_eq!(acc.step(&mut a).unwrap().outcome, StepOutcome::Stepped);
    let (mut b, idb) = single(n, 1);
    let mut one = HybridAdam::new(cfg).unwrap();
    iterate(&mut b, &idb, &[mean]);
    one.step(&mut b).unwrap();
    assert_eq!(a.master(ida[0]).unwrap(), b.master(idb[0]).unwrap());
    assert_eq!(a.read(ida[0]).unwrap(), b.read(idb[0]).unwrap());
    assert_eq!((acc.steps(), one.steps()), (1, 1));
}

#[test]
fn misuse_is_an_error_and_changes_nothing() {
    let (mut m, ids) = single(64, 1);
    // the parameters, masters and stage a refused step must leave as they were
    let state = |m: &mut ChunkManager| {
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let t: Vec<_> = ids
            .iter()
            .map(|&id| (bits(m.read(id).unwrap()), bits(m.master(id).unwrap())))
            .collect();
        (t, m.stage(), m.num_tensors())
    };
    let mut opt = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3))).unwrap();
    let before = state(&mut m);
    assert!(opt.step(&mut m).is_err(), "no backward has ended");
    assert_eq!(opt.steps(), 0);
    assert!(state(&mut m) == before, "a refused step changes nothing");
    iterate(&mut m, &ids, &[vec![0.5; 64]]);
    assert_eq!(opt.step(&mut m).unwrap().outcome, StepOutcome::Stepped);
    let stepped = state(&mut m);
    assert!(stepped != before, "the step changed the parameters");
    assert!(opt.step(&mut m).is_err(), "a second step without backward");
    assert_eq!(opt.steps(), 1);
    assert!(
        state(&mut m) == stepped,
        "a refused second step changes nothing"
    );
    for bad in [
        HybridConfig {
            accumulation_steps: 0,
            ..HybridConfig::new(AdamConfig::adam(1e-3))
        },
        HybridConfig {
            max_grad_norm: Some(-1.0),
            ..HybridConfig::new(AdamConfig::adam(1e-3))
        },
        HybridConfig {
            placement: DevicePlacement::Auto { fraction: 2.0 },
            ..HybridConfig::new(AdamConfig::adam(1e-3))
        },
        HybridConfig::new(AdamConfig::adam(-1.0)),
    ] {
        assert!(HybridAdam::new(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn optimizer_types_are_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<HybridAdam>();
    both::<CpuAdam>();
    both::<LossScaler>();
    both::<HybridConfig>();
    both::<tidemem::optim::ShadowBudget>();
    both::<tidemem::chunk::OverlapStats>();
    both::<tidemem::simulate::SimOverlap>();
}

#[test]
fn automatic_placement_counts_the_size_of_oversized_groups() {
    // a tensor sixteen times the chunk gets a group of its own; the margin must be charged for
    // its real size, or its fp32 chunks would not fit on the device
    let dev = Device::sim(SimConfig::with_capacity(128 << 10)).unwrap();
    let mut m = ChunkManager::new(dev, ManagerConfig::new(1024, Policy::Tide)).unwrap();
    let ids = vec![
        m.register("w0", &[1024], Init::Constant(0.5)).unwrap(),
        m.register("w1", &[16384], Init::Constant(0.5)).unwrap(),
    ];
    let mut opt = HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1))).unwrap();
    for _ in 0..3 {
        iterate(&mut m, &ids, &[vec![1.0; 1024], vec![1.0; 16384]]);
        let r = opt.step(&mut m).unwrap();
        assert_eq!(r.outcome, StepOutcome::Stepped);
        assert!(r.device_groups <= 1, "{r:?}");
    }
    for &id in &ids {
        assert!(m
            .master(id)
            .unwrap()
            .iter()
            .all(|&x| (x - 0.2).abs() < 1e-5));
    }
}

/// PipeDream-2BW's weight lag (`delayed_params`): after every step the parameters the model
/// computes with are the masters as they were before that step, and the masters step exactly
/// as without the lag (the same gradients give the same masters), on the host and on the
/// device, for f16 and f32 parameters.
#[test]
fn delayed_params_lag_the_masters_by_one_step() {
    let n = 300;
    let accumulating = HybridConfig {
        delayed_params: true,
        accumulation_steps: 2,
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    };
    assert!(
        HybridAdam::new(accumulating).is_err(),
        "the lag needs one iteration a step"
    );
    for placement in [DevicePlacement::HostOnly, DevicePlacement::Groups(1)] {
        for dtype in [DType::F16, DType::F32] {
            let cfg = HybridConfig {
                placement,
                ..HybridConfig::new(AdamConfig::adam(1e-2))
            };
            let make = || {
                let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
                let mut mc = ManagerConfig::new(n, Policy::Tide);
                mc.param_dtype = dtype;
                let mut m = ChunkManager::new(dev, mc).unwrap();
                let init = Init::Uniform {
                    seed: 9,
                    lo: -1.0,
                    hi: 1.0,
                };
                let id = m.register("w", &[n], init).unwrap();
                (m, id)
            };
            let (mut lag, id) = make();
            let (mut plain, pid) = make();
            let mut a = HybridAdam::new(HybridConfig {
                delayed_params: true,
                ..cfg
            })
            .unwrap();
            let mut b = HybridAdam::new(cfg).unwrap();
            for k in 0..4 {
                let g = grads(k + 1, n, 1.0);
                let before = lag.master(id).unwrap();
                iterate(&mut lag, &[id], std::slice::from_ref(&g));
                iterate(&mut plain, &[pid], std::slice::from_ref(&g));
                a.step(&mut lag).unwrap();
                b.step(&mut plain).unwrap();
                let what = format!("{placement:?} {dtype} step {k}");
                assert_eq!(
                    lag.master(id).unwrap(),
                    plain.master(pid).unwrap(),
                    "{what}"
                );
                let rounded: Vec<f32> = before
                    .iter()
                    .map(|&v| match dtype {
                        DType::F16 => f16::from_f32(v).to_f32(),
                        _ => v,
                    })
                    .collect();
                assert_eq!(lag.read(id).unwrap(), rounded, "{what}: the parameters lag");
                assert_ne!(lag.read(id).unwrap(), plain.read(pid).unwrap(), "{what}");
            }
        }
    }
}
