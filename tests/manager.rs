//! The chunk manager end to end on the simulated device: placement never changes the arithmetic,
//! the simulator predicts the manager's moves, and misuse is a typed error.

mod common;

use tidemem::chunk::{ChunkManager, ManagerConfig, TensorView, Usage};

use tidemem::demo::ToyIds;
use tidemem::device::{Device, SimConfig};
use tidemem::optim::{AdamConfig, DevicePlacement, HybridAdam, HybridConfig};
use tidemem::simulate::{simulate, SimOptions};
use tidemem::tensor::ChunkKind;
use tidemem::tensor::{Init, Stage, TensorState};
use tidemem::tide::{Policy, Scheduler};
use tidemem::DType;
use tidemem::Error;

use common::{toy_setup as setup, TOY};

/// Trains `steps` iterations; returns losses, then every tensor's fp16 parameter bits and fp32
/// master bits.
fn train(m: &mut ChunkManager, ids: &ToyIds, steps: u64) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut losses = Vec::new();
    for s in 0..steps {
        losses.push(TOY.step(m, ids, s).unwrap().to_bits());
    }
    let mut params = Vec::new();
    let mut masters = Vec::new();
    for t in 0..m.num_tensors() as u32 {
        let id = tidemem::tensor::TensorId(t);
        params.extend(m.read(id).unwrap().iter().map(|x| x.to_bits()));
        masters.extend(m.master(id).unwrap().iter().map(|x| x.to_bits()));
    }
    (losses, params, masters)
}

const BIG: usize = 1 << 20;
/// Peak activations are 6 × 512 B; this leaves room for about three 544-byte chunks there.
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
    let reference = train(&mut m, &ids, 5);
    let roomy = m.stats();
    // everything stays resident; only the parameters rewritten by the host step are reloaded,
    // once each (six groups of 272 fp16 elements)
    assert_eq!(m.last_iteration().h2d_bytes, 6 * 272 * 2);
    assert_eq!(
        m.last_iteration().d2h_bytes,
        6 * 272 * 2,
        "gradients go to the host once"
    );
    for policy in [
        Policy::Tide,
        Policy::PatrickStar,
        Policy::Lru,
        Policy::Static {
            device_fraction: 0.0,
        },
        Policy::Static {
            device_fraction: 0.15,
        },
    ] {
        let (mut m, _, ids) = setup(policy, small(), None);
        let got = train(&mut m, &ids, 5);
        assert_eq!(got.0, reference.0, "{policy:?}: losses differ");
        assert_eq!(got.1, reference.1, "{policy:?}: fp16 parameters differ");
        assert_eq!(got.2, reference.2, "{policy:?}: fp32 masters differ");
        common::assert_evicts(&m.stats(), &roomy, &format!("{policy:?} on {} B", small()));
        assert!(m.scheduler().unwrap().device_peak() <= m.scheduler().unwrap().config().capacity);
    }
}

/// The same training through the manager on CUDA (its memory, copies and events; the Sim
/// device of the test above answers for the host arithmetic) gives the same bits and, with
/// the same plan, the same moves under every policy. Placement changes no bit on CUDA either:
/// every policy on the small device gives a roomy device's bits.
#[test]
fn the_manager_on_cuda_trains_like_on_the_sim_device() {
    let Some(gpu) = common::cuda("the_manager_on_cuda_trains_like_on_the_sim_device") else {
        return;
    };
    let roomy = {
        let (mut g, _, gids) = common::toy_setup_on(gpu.clone(), Policy::Tide, BIG, None);
        train(&mut g, &gids, 5)
    };
    for policy in [
        Policy::Tide,
        Policy::PatrickStar,
        Policy::Lru,
        Policy::Static {
            device_fraction: 0.15,
        },
    ] {
        let (mut m, _, ids) = setup(policy, small(), None);
        let reference = train(&mut m, &ids, 5);
        let (mut g, _, gids) = common::toy_setup_on(gpu.clone(), policy, small(), None);
        let got = train(&mut g, &gids, 5);
        assert_eq!(
            got,
            roomy,
            "{policy:?} on {}: placement changed a bit",
            gpu.name()
        );
        for (g, r, what) in [
            (&got.0, &reference.0, "losses"),
            (&got.1, &reference.1, "fp16 parameters"),
            (&got.2, &reference.2, "fp32 masters"),
        ] {
            common::assert_same_arithmetic(&gpu, g, r, 1e-3, &format!("{policy:?}: {what}"));
        }
        let (a, b) = (m.stats(), g.stats());
        assert_eq!(
            (a.h2d_bytes, a.d2h_bytes),
            (b.h2d_bytes, b.d2h_bytes),
            "{policy:?}: moves differ"
        );
        assert!(g.scheduler().unwrap().device_peak() <= small() as u64);
    }
}

#[test]
fn spilled_optimizer_state_gives_the_same_result() {
    let (mut m, _, ids) = setup(Policy::Tide, BIG, None);
    let reference = train(&mut m, &ids, 3);
    // host memory for about half the model data: optimizer state goes to the file tier
    let total: u64 = {
        let u = m.usage();
        Usage::total(&u.host) + Usage::total(&u.file)
    };
    let (mut m, _, ids) = setup(Policy::Tide, small(), Some(total / 2));
    let got = train(&mut m, &ids, 3);
    assert_eq!(got, reference);
    let u = m.usage();
    assert!(Usage::total(&u.file) >= total / 2 - 1100 * 4, "{u:?}");
    assert_eq!(
        u.file[ChunkKind::Param.index()],
        0,
        "parameters stay in host memory: {u:?}"
    );
    assert!(
        u.file[ChunkKind::Variance.index()] > 0,
        "variance spills first: {u:?}"
    );
}

/// The manager's moves of its last iteration equal the simulator's steady prediction.
fn same_moves(got: &tidemem::tide::MoveStats, sim: &tidemem::simulate::SimReport, p: Policy) {
    assert_eq!(
        (got.h2d_bytes, got.d2h_bytes, got.loads, got.write_backs),
        (
            sim.steady.h2d_bytes,
            sim.steady.d2h_bytes,
            sim.steady.loads,
            sim.steady.write_backs
        ),
        "{p:?}"
    );
}

#[test]
fn simulator_agrees_with_the_manager() {
    for policy in Policy::all() {
        let (mut m, _, ids) = setup(policy, small(), None);
        for s in 0..3 {
            TOY.step(&mut m, &ids, s).unwrap();
        }
        let got = m.last_iteration();
        let mut opts = SimOptions::new(small() as u64, u64::MAX / 4);
        opts.chunk_elems = Some(TOY.chunk_elems());
        opts.scheduler = *m.scheduler().unwrap().config();
        opts.param_bytes = 2;
        let spec = TOY.spec();
        let sim = simulate(&spec, policy, &opts).unwrap();
        same_moves(&got, &sim, policy);
        // the recorded tide is the one the model predicts
        let trace = m.trace().unwrap();
        let fwd: Vec<u64> = trace
            .moments
            .iter()
            .take(TOY.layers)
            .map(|x| x.non_model)
            .collect();
        let want: Vec<u64> = spec.ops.iter().map(|o| o.fwd_non_model).collect();
        assert_eq!(fwd, want, "{policy:?}");
        if policy == Policy::Tide {
            assert!(got.h2d_bytes >= sim.bound.h2d_bytes);
            assert!(got.d2h_bytes >= sim.bound.d2h_bytes);
        }
    }
}

/// With HybridAdam stepping the first chunk groups on the device (PatrickStar's margin rule),
/// the simulator picks the same groups and predicts the same moves.
#[test]
fn simulator_agrees_with_the_manager_on_device_adam() {
    let placement = DevicePlacement::Auto { fraction: 0.8 };
    let capacity = TOY.non_model_peak(DType::F16) + 12_928;
    for policy in [Policy::Tide, Policy::PatrickStar, Policy::Lru] {
        let (mut m, _, ids) = setup(policy, capacity, None);
        let mut opt = HybridAdam::new(HybridConfig {
            placement,
            ..HybridConfig::new(AdamConfig::adam(1e-3))
        })
        .unwrap();
        for s in 0..4 {
            TOY.forward_backward(&mut m, &ids, s, opt.loss_scale(), (0, 1))
                .unwrap();
            opt.step(&mut m).unwrap();
        }
        let k = opt.device_groups(&m);
        assert!(k > 0 && k < m.groups(), "{k} of {} groups", m.groups());
        let got = m.last_iteration();
        let mut opts = SimOptions::new(capacity as u64, u64::MAX / 4);
        opts.chunk_elems = Some(TOY.chunk_elems());
        opts.scheduler = *m.scheduler().unwrap().config();
        opts.optimizer = placement;
        opts.iterations = 3;
        let sim = simulate(&TOY.spec(), policy, &opts).unwrap();
        assert_eq!(sim.device_adam_groups, k, "{policy:?}");
        same_moves(&got, &sim, policy);
        // which is not what the host-only optimizer moves
        opts.optimizer = DevicePlacement::HostOnly;
        let host = simulate(&TOY.spec(), policy, &opts).unwrap();
        assert_ne!(host.steady, sim.steady, "{policy:?}");
    }
}

#[test]
fn tide_keeps_host_copies_and_evicts_clean_chunks_for_free() {
    let (mut m, _, ids) = setup(Policy::Tide, small(), None);
    for s in 0..3 {
        TOY.step(&mut m, &ids, s).unwrap();
    }
    let tide = m.last_iteration();
    let (mut m, _, ids) = setup(Policy::PatrickStar, small(), None);
    for s in 0..3 {
        TOY.step(&mut m, &ids, s).unwrap();
    }
    let ps = m.last_iteration();
    assert!(tide.clean_drops > 0);
    assert_eq!(tide.h2d_bytes, ps.h2d_bytes, "same victims");
    assert!(
        tide.d2h_bytes < ps.d2h_bytes,
        "tide {tide:?} vs patrickstar {ps:?}"
    );
}

#[test]
fn misuse_is_a_typed_error() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 16)).unwrap();
    let mut m = ChunkManager::new(dev, ManagerConfig::new(64, Policy::Tide)).unwrap();
    let a = m.register("a", &[8, 4], Init::Zeros).unwrap();
    let b = m.register("b", &[4], Init::Zeros).unwrap();
    assert!(matches!(
        m.register("empty", &[0, 3], Init::Zeros),
        Err(Error::Empty { .. })
    ));
    // backward before forward: FREE has no backward edge
    match m.fetch(&[a], Stage::Backward) {
        Err(Error::IllegalTransition { tensor, state, .. }) => {
            assert_eq!(tensor, "a");
            assert_eq!(state, TensorState::Free);
        }
        other => panic!("{other:?}"),
    }
    let v: Vec<TensorView> = m.fetch(&[a, b], Stage::Forward).unwrap();
    assert_eq!(m.state(a, ChunkKind::Param).unwrap(), TensorState::Compute);
    assert_eq!(
        m.chunk_state(0, ChunkKind::Param),
        Some(TensorState::Compute)
    );
    assert_eq!(v[0].view().len(), 64);
    // a view still alive at release is refused; the chunk stays COMPUTE
    assert!(matches!(
        m.release(&[a, b], Stage::Forward),
        Err(Error::ViewAlive { .. })
    ));
    drop(v);
    // using a tensor twice at once is illegal
    assert!(matches!(
        m.fetch(&[a], Stage::Forward),
        Err(Error::IllegalTransition { .. })
    ));
    assert!(matches!(
        m.fetch(&[a, a], Stage::Forward),
        Err(Error::Conflict { what, .. }) if what == format!("tensor {a}")
    ));
    m.release(&[a, b], Stage::Forward).unwrap();
    assert!(matches!(
        m.release(&[a], Stage::Forward),
        Err(Error::IllegalTransition { .. })
    ));
    // no gradient in forward
    assert!(matches!(
        m.write_grad(a, &[0.0; 32]),
        Err(Error::WrongStage {
            stage: "forward",
            ..
        })
    ));
    assert!(
        matches!(
            m.register("late", &[2], Init::Zeros),
            Err(Error::Conflict { what, .. }) if what == "registering 'late'"
        ),
        "registration is closed"
    );
    m.fetch(&[a], Stage::Forward).unwrap(); // second forward use: shared
    m.release(&[a], Stage::Forward).unwrap();
    m.end_forward().unwrap();
    assert_eq!(m.state(a, ChunkKind::Param).unwrap(), TensorState::Hold);
    m.fetch(&[a], Stage::Backward).unwrap();
    // first of two backward uses: no gradient yet
    assert!(matches!(
        m.write_grad(a, &[1.0; 32]),
        Err(Error::Conflict { what, .. }) if what.contains("at backward use 1 of 2")
    ));
    m.release(&[a], Stage::Backward).unwrap();
    assert_eq!(m.state(a, ChunkKind::Param).unwrap(), TensorState::Hold);
    m.fetch(&[a], Stage::Backward).unwrap();
    assert!(matches!(
        m.write_grad(a, &[1.0; 3]),
        Err(Error::SizeMismatch { .. })
    ));
    m.write_grad(a, &[1.0; 32]).unwrap();
    m.release(&[a], Stage::Backward).unwrap();
    assert_eq!(
        m.state(a, ChunkKind::Param).unwrap(),
        TensorState::HoldAfterBwd
    );
    // b was used in forward but got no backward: an unused gradient is not an error
    m.end_backward().unwrap();
    m.step_host(|g| {
        assert_eq!(g.tensors.len(), 2);
        assert!(g.tensors[0].3 && !g.tensors[1].3);
        Ok(())
    })
    .unwrap();
    m.end_step().unwrap();
    assert!(m.is_steady());
    assert_eq!(m.state(a, ChunkKind::Param).unwrap(), TensorState::Hold);
    assert_eq!(m.state(a, ChunkKind::Master).unwrap(), TensorState::Hold);
}

#[test]
fn a_chunk_larger_than_the_budget_is_a_budget_error() {
    let dev = Device::sim(SimConfig::with_capacity(4096)).unwrap();
    let mut cfg = ManagerConfig::new(256, Policy::Tide);
    cfg.scheduler.warmup_chunk_fraction = 0.5;
    let mut m = ChunkManager::new(dev, cfg).unwrap();
    let big = m.register("big", &[2048], Init::Zeros).unwrap(); // 4 KiB of fp16: its own chunk
    match m.fetch(&[big], Stage::Forward) {
        Err(Error::BudgetExceeded {
            requested,
            budget,
            capacity,
            ..
        }) => {
            assert_eq!(requested, 4096);
            assert!(budget < requested);
            assert_eq!(capacity, 4096);
        }
        other => panic!("{other:?}"),
    }
    // nothing changed: the tensor is still FREE and the device holds no chunk
    assert_eq!(m.state(big, ChunkKind::Param).unwrap(), TensorState::Free);
    assert_eq!(m.scheduler().unwrap().device_used(), 0);
}

#[test]
fn skipped_warmup_is_discarded() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 16)).unwrap();
    let mut m = ChunkManager::new(dev, ManagerConfig::new(64, Policy::Tide)).unwrap();
    let a = m.register("a", &[16], Init::Zeros).unwrap();
    let run = |m: &mut ChunkManager, skip: bool| {
        m.fetch(&[a], Stage::Forward).unwrap();
        m.release(&[a], Stage::Forward).unwrap();
        m.end_forward().unwrap();
        m.fetch(&[a], Stage::Backward).unwrap();
        m.write_grad(a, &[0.5; 16]).unwrap();
        m.release(&[a], Stage::Backward).unwrap();
        m.end_backward().unwrap();
        if skip {
            m.skip_step().unwrap();
        } else {
            m.step_host(|_| Ok(())).unwrap();
            m.end_step().unwrap();
        }
    };
    run(&mut m, true);
    assert!(!m.is_steady(), "a skipped step does not finish warm-up");
    run(&mut m, false);
    assert!(m.is_steady());
    assert_eq!(m.trace().unwrap().len(), 3);
}

#[test]
fn public_types_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ChunkManager>();
    check::<TensorView>();
    check::<Scheduler>();
    check::<tidemem::tide::Trace>();
}

#[test]
fn a_chunk_stays_put_until_its_last_fetched_tensor_is_released() {
    // Tensors 1 and 2 share a chunk; releasing one of them must not make the chunk evictable.
    let dev = Device::sim(SimConfig::with_capacity(80)).unwrap();
    let mut cfg = ManagerConfig::new(16, Policy::Tide);
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 1.0;
    let mut m = ChunkManager::new(dev, cfg).unwrap();
    let big = m.register("big", &[29], Init::Zeros).unwrap(); // own chunk, 58 bytes
    let a = m.register("a", &[2], Init::Zeros).unwrap();
    let b = m.register("b", &[1], Init::Zeros).unwrap();
    m.fetch(&[a, b], Stage::Forward).unwrap();
    let before = m.device_buffer_id(1, ChunkKind::Param);
    m.release(&[b], Stage::Forward).unwrap();
    // 32 + 58 bytes do not fit in 80 without evicting the shared chunk, which holds a in COMPUTE
    let r = m.fetch(&[big], Stage::Forward);
    assert!(matches!(r, Err(Error::BudgetExceeded { .. })), "{r:?}");
    assert_eq!(m.device_buffer_id(1, ChunkKind::Param), before);
    m.release(&[a], Stage::Forward).unwrap();
    m.fetch(&[big], Stage::Forward).unwrap();
    assert_eq!(
        m.device_buffer_id(1, ChunkKind::Param),
        None,
        "now it may go"
    );
}

/// `copy_param_into` copies a tensor's parameter bytes from wherever its chunk is (device copy,
/// host copy, or its initializer before the first fetch) without a use or a move, and refuses
/// a destination of the wrong size.
#[test]
fn copy_param_into_reads_without_a_use() {
    let dev = common::sim(1 << 20);
    let mut m = ChunkManager::new(dev.clone(), ManagerConfig::new(256, Policy::Tide)).unwrap();
    let a = m.register("a", &[200], Init::Constant(0.75)).unwrap();
    let b = m.register("b", &[200], Init::Constant(-2.0)).unwrap();
    let dst = dev.alloc(200 * 2).unwrap();
    let check = |m: &mut ChunkManager, id, want: f32| {
        m.copy_param_into(id, dst.view(0, dst.len()).unwrap())
            .unwrap();
        let bytes = dev.download(m.compute_stream(), &dst).unwrap();
        let got: Vec<f32> = bytemuck::cast_slice::<u8, half::f16>(&bytes)
            .iter()
            .map(|x| x.to_f32())
            .collect();
        assert_eq!(got, vec![want; 200]);
    };
    check(&mut m, a, 0.75);
    m.fetch(&[a], Stage::Forward).unwrap();
    m.release(&[a], Stage::Forward).unwrap();
    let loads = m.stats().loads;
    let state = m.state(a, ChunkKind::Param).unwrap();
    check(&mut m, a, 0.75);
    check(&mut m, b, -2.0);
    assert_eq!(m.stats().loads, loads, "no move");
    assert_eq!(m.state(a, ChunkKind::Param).unwrap(), state, "no use");
    assert!(matches!(
        m.copy_param_into(a, dst.view(0, 2).unwrap()),
        Err(Error::SizeMismatch { .. })
    ));

    // from the host copy, on a slow link, after the chunk left the device; the host copy is
    // back in place for the next load
    let dev = common::slow_sim(512 + 512 + 400 + 64);
    let mut cfg = ManagerConfig::new(256, Policy::Tide);
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 1.0;
    let mut m = ChunkManager::new(dev.clone(), cfg).unwrap();
    let a = m.register("a", &[200], Init::Constant(0.75)).unwrap();
    let b = m.register("b", &[200], Init::Constant(-2.0)).unwrap();
    let c = m.register("c", &[200], Init::Constant(3.0)).unwrap();
    let dst = dev.alloc(200 * 2).unwrap();
    for id in [a, b, c] {
        m.fetch(&[id], Stage::Forward).unwrap();
        m.release(&[id], Stage::Forward).unwrap();
    }
    assert_eq!(m.device_buffer_id(0, ChunkKind::Param), None, "a left");
    let loads = m.stats().loads;
    m.copy_param_into(a, dst.view(0, dst.len()).unwrap())
        .unwrap();
    let bytes = dev.download(m.compute_stream(), &dst).unwrap();
    assert!(bytemuck::cast_slice::<u8, half::f16>(&bytes)
        .iter()
        .all(|x| x.to_f32() == 0.75));
    assert_eq!(m.stats().loads, loads, "no move");
    m.fetch(&[a], Stage::Forward).unwrap();
    assert_eq!(m.read(a).unwrap(), vec![0.75; 200]);
}

/// A move the scheduler ordered that fails (here: the device is full of memory the manager
/// does not know about) leaves the scheduler's view and the payloads apart, so the manager
/// refuses every later call, naming the failure, instead of serving wrong data.
#[test]
fn a_failed_move_makes_the_manager_unusable() {
    let dev = common::sim(1 << 20);
    let mut m = ChunkManager::new(dev.clone(), ManagerConfig::new(256, Policy::Tide)).unwrap();
    let a = m.register("a", &[200], Init::Constant(1.0)).unwrap();
    let hog = dev.alloc((1 << 20) - 256).unwrap();
    let e = m.fetch(&[a], Stage::Forward).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    for r in [
        m.read(a).map(drop),
        m.master(a).map(drop),
        m.fetch(&[a], Stage::Forward).map(drop),
        m.end_forward(),
    ] {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("unusable") && e.contains("out of"), "{e}");
    }
    drop(hog);
}
