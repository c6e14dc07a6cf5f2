//! Checkpoints of the chunk manager and HybridAdam: resuming changes no bit under every policy
//! and tier, a checkpoint does not depend on chunk size or registration order, and a bad file
//! changes nothing.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use tidemem::chunk::{ChunkManager, ManagerConfig, Usage};

use tidemem::demo::{ToyIds, ToyMlp};
use tidemem::device::CachingAllocator;
use tidemem::optim::{AdamConfig, DevicePlacement, HybridAdam, HybridConfig};
use tidemem::tensor::ChunkKind;
use tidemem::tensor::{Init, Stage, TensorId};
use tidemem::tide::{MoveStats, Policy};
use tidemem::{DType, Error};

use common::{DEEP, TOY};

fn adam(scaled: bool) -> HybridAdam {
    common::hybrid_adam(scaled, DevicePlacement::HostOnly)
}

/// A manager for the toy model: `capacity` bytes of device, the file tier when `host_budget`.
fn manager(
    toy: &ToyMlp,
    policy: Policy,
    capacity: usize,
    host_budget: Option<(u64, &Path)>,
) -> (ChunkManager, CachingAllocator, ToyIds) {
    manager_on(toy, policy, common::sim(capacity), capacity, host_budget)
}

/// [`manager`] on `dev`, planning for `capacity` bytes of it.
fn manager_on(
    toy: &ToyMlp,
    policy: Policy,
    dev: tidemem::device::Device,
    capacity: usize,
    host_budget: Option<(u64, &Path)>,
) -> (ChunkManager, CachingAllocator, ToyIds) {
    let mut cfg = ManagerConfig::new(toy.chunk_elems(), policy);
    cfg.scheduler.capacity = capacity as u64;
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 0.3;
    if let Some((b, dir)) = host_budget {
        cfg.host_budget = Some(b);
        cfg.file_dir = Some(dir.to_path_buf());
    }
    let mut m = ChunkManager::new(dev.clone(), cfg).unwrap();
    let pool = CachingAllocator::new(dev);
    m.set_non_model_allocator(pool.clone());
    let ids = toy.register(&mut m).unwrap();
    (m, pool, ids)
}

/// Steps `steps` of the toy model's training on `m`.
fn train(
    toy: &ToyMlp,
    m: &mut ChunkManager,
    ids: &ToyIds,
    opt: &mut HybridAdam,
    steps: std::ops::Range<u64>,
) {
    for s in steps {
        toy.forward_backward(m, ids, s, opt.loss_scale(), (0, 1))
            .unwrap();
        opt.step(m).unwrap();
    }
}

/// Every tensor's four lists, as f32 (the parameter decoded), in tensor order.
fn everything(m: &mut ChunkManager) -> Vec<[Vec<f32>; 4]> {
    let path = tempfile::NamedTempFile::new().unwrap();
    m.save_checkpoint(path.path(), &BTreeMap::new()).unwrap();
    let st_bytes = std::fs::read(path.path()).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
    (0..m.num_tensors() as u32)
        .map(|t| {
            let name = m.tensor_info(TensorId(t)).unwrap().0.to_string();
            ChunkKind::ALL.map(|k| {
                let v = st.tensor(&format!("{}/{name}", k.name())).unwrap();
                let dt = match v.dtype() {
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::BF16 => DType::BF16,
                    _ => DType::F32,
                };
                tidemem::chunk::decode(v.data(), dt)
            })
        })
        .collect()
}

fn masters(m: &mut ChunkManager) -> Vec<Vec<f32>> {
    (0..m.num_tensors() as u32)
        .map(|t| m.master(TensorId(t)).unwrap())
        .collect()
}

/// Moves of the roomy runs the small-device ones are compared with, for `placement`: 6 steps
/// from scratch, and 3 steps resumed from the checkpoint at `path` (saved after 3 steps).
fn roomy_moves(placement: DevicePlacement, path: &Path) -> (MoveStats, MoveStats) {
    let (mut r, _, ids) = manager(&DEEP, Policy::Tide, 1 << 20, None);
    let mut opt = common::hybrid_adam(true, placement);
    train(&DEEP, &mut r, &ids, &mut opt, 0..6);
    let (mut rb, _, ids) = manager(&DEEP, Policy::Tide, 1 << 20, None);
    let mut opt = common::hybrid_adam(true, placement);
    opt.load_checkpoint(&mut rb, path).unwrap();
    train(&DEEP, &mut rb, &ids, &mut opt, 3..6);
    (r.stats(), rb.stats())
}

/// Training 3 steps, saving, and training 3 more equals loading the save into a new manager
/// and optimizer and training the same 3 steps: bit for bit, under every policy, on a device
/// that holds about a third of the model's chunks (both runs evict and reload, more than a
/// roomy device's runs), and with the file tier.
#[test]
fn resuming_from_a_checkpoint_changes_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toy.safetensors");
    let capacity = common::DEEP_DEVICE;
    // a roomy device's moves, by the groups stepped on the device (the same for every policy
    // and tier: the runs are the same bits, and a roomy device moves what they hold)
    let mut roomy = std::collections::HashMap::new();
    for policy in Policy::all() {
        // with the file tier (the host holds about 80% of the model data), on a slow link,
        // and with two groups stepped on the device
        for (file_tier, slow, device) in [
            (false, false, 0),
            (true, false, 0),
            (false, true, 0),
            (false, false, 2),
        ] {
            let budget = file_tier.then_some((200_000u64, dir.path()));
            // a slow link: a read or write that did not wait for its copy shows
            let dev = match slow {
                true => common::slow_sim(capacity),
                false => common::sim(capacity),
            };
            let (mut a, _, ids) = manager_on(&DEEP, policy, dev, capacity, budget);
            let placement = DevicePlacement::Groups(device);
            let mut opt = common::hybrid_adam(true, placement);
            train(&DEEP, &mut a, &ids, &mut opt, 0..3);
            opt.save_checkpoint(&mut a, &path).unwrap();
            train(&DEEP, &mut a, &ids, &mut opt, 3..6);

            let (mut b, _, ids_b) = manager(&DEEP, policy, capacity, budget);
            let mut opt_b = common::hybrid_adam(true, placement);
            opt_b.load_checkpoint(&mut b, &path).unwrap();
            assert_eq!(opt_b.steps(), 3);
            train(&DEEP, &mut b, &ids_b, &mut opt_b, 3..6);
            let what = format!(
                "{}, file tier {file_tier}, slow {slow}, device groups {device}",
                policy.name()
            );
            assert_eq!(opt_b.device_groups(&b), device.min(b.groups()), "{what}");
            assert_eq!(masters(&mut a), masters(&mut b), "{what}");
            assert_eq!(everything(&mut a), everything(&mut b), "{what}");
            assert_eq!(opt.loss_scale(), opt_b.loss_scale(), "{what}");
            assert_eq!(opt.steps(), opt_b.steps(), "{what}");
            let (roomy, roomy_resumed) = *roomy
                .entry(device)
                .or_insert_with(|| roomy_moves(placement, &path));
            common::assert_evicts(&a.stats(), &roomy, &format!("{what}: trained"));
            common::assert_evicts(&b.stats(), &roomy_resumed, &format!("{what}: resumed"));
            if file_tier {
                assert!(
                    Usage::total(&b.usage().file) > 0,
                    "{what}: the file tier holds some"
                );
            }
            // back into the manager that saved it, whose device holds newer chunks
            let after = masters(&mut a);
            opt.load_checkpoint(&mut a, &path).unwrap();
            train(&DEEP, &mut a, &ids, &mut opt, 3..6);
            assert_eq!(masters(&mut a), after, "{what}: loaded over newer chunks");
        }
    }
}

/// A checkpoint saved by a manager on CUDA (chunks on the GPU, two groups stepped by the CUDA
/// Adam) resumes on the Sim device, and one saved there resumes on CUDA: the state loads bit for
/// bit, and training on from it matches the saving device's (bit for bit on the emulator, within
/// rounding on a GPU; bit for bit when resumed on the saving device). Both plan for a device
/// that holds about a third of the model's chunks, so both evict and reload.
#[test]
fn checkpoints_move_between_cuda_and_the_sim_device() {
    let Some(gpu) = common::cuda("checkpoints_move_between_cuda_and_the_sim_device") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toy.safetensors");
    let capacity = common::DEEP_DEVICE;
    let on = |cuda: bool, policy| {
        let dev = if cuda {
            gpu.clone()
        } else {
            common::sim(capacity)
        };
        manager_on(&DEEP, policy, dev, capacity, None)
    };
    for policy in [Policy::Tide, Policy::PatrickStar] {
        for saved_on_cuda in [true, false] {
            let placement = DevicePlacement::Groups(2);
            let (mut a, _, ids) = on(saved_on_cuda, policy);
            let mut opt = common::hybrid_adam(true, placement);
            train(&DEEP, &mut a, &ids, &mut opt, 0..3);
            opt.save_checkpoint(&mut a, &path).unwrap();
            let saved = everything(&mut a);
            train(&DEEP, &mut a, &ids, &mut opt, 3..6);
            let what = format!("{}, saved on CUDA: {saved_on_cuda}", policy.name());

            // Resumed on the other device: what it loads is what was saved, bit for bit.
            let (mut b, _, ids_b) = on(!saved_on_cuda, policy);
            let mut opt_b = common::hybrid_adam(true, placement);
            opt_b.load_checkpoint(&mut b, &path).unwrap();
            assert!(everything(&mut b) == saved, "{what}: loaded state differs");
            train(&DEEP, &mut b, &ids_b, &mut opt_b, 3..6);
            // Its training then differs from the saving device's by the devices' rounding alone.
            let flat =
                |v: Vec<Vec<f32>>| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (ma, mb) = (flat(masters(&mut a)), flat(masters(&mut b)));
            let (cuda_side, sim_side) = if saved_on_cuda {
                (&ma, &mb)
            } else {
                (&mb, &ma)
            };
            common::assert_same_arithmetic(&gpu, cuda_side, sim_side, 1e-3, &what);
            if common::is_emulated(&gpu) {
                assert_eq!(everything(&mut a), everything(&mut b), "{what}");
            }
            assert_eq!(opt.loss_scale(), opt_b.loss_scale(), "{what}");

            // Resumed on the saving device: the same bits as training on.
            let (mut c, _, ids_c) = on(saved_on_cuda, policy);
            let mut opt_c = common::hybrid_adam(true, placement);
            opt_c.load_checkpoint(&mut c, &path).unwrap();
            train(&DEEP, &mut c, &ids_c, &mut opt_c, 3..6);
            assert!(
                everything(&mut a) == everything(&mut c),
                "{what}: resumed in place"
            );
            let (roomy, roomy_resumed) = roomy_moves(placement, &path);
            common::assert_evicts(&a.stats(), &roomy, &format!("{what}: trained"));
            for (side, m) in [("other", &b), ("saving", &c)] {
                let what = format!("{what}: resumed on the {side} device");
                common::assert_evicts(&m.stats(), &roomy_resumed, &what);
            }
        }
    }
}

/// A checkpoint names tensors: another chunk size and another registration order read it the
/// same, a parameter saved in f32 is converted into bf16, and a save before any training holds
/// the initial values and zero moments.
#[test]
fn a_checkpoint_does_not_depend_on_the_layout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.safetensors");
    let make = |chunk: usize, dtype: DType, reverse: bool| {
        let mut cfg = ManagerConfig::new(chunk, Policy::Tide);
        cfg.param_dtype = dtype;
        let mut m = ChunkManager::new(common::sim(1 << 20), cfg).unwrap();
        let mut specs = vec![
            ("a", vec![3, 5], Init::Constant(0.25)),
            (
                "b",
                vec![40],
                Init::Uniform {
                    seed: 7,
                    lo: -1.0,
                    hi: 1.0,
                },
            ),
            ("c", vec![2, 2, 2], Init::Constant(-3.0)),
        ];
        if reverse {
            specs.reverse();
        }
        for (n, s, i) in specs {
            m.register(n, &s, i).unwrap();
        }
        m
    };
    let mut a = make(16, DType::F32, false);
    let before = everything(&mut a);
    for t in &before {
        assert!(t[2].iter().chain(&t[3]).all(|&x| x == 0.0), "zero moments");
        assert_eq!(t[0], t[1], "parameters start as their masters");
    }
    // train a step so that every list holds something
    let mut opt = adam(false);
    for id in 0..3u32 {
        a.fetch(&[TensorId(id)], Stage::Forward).unwrap();
        a.release(&[TensorId(id)], Stage::Forward).unwrap();
    }
    a.end_forward().unwrap();
    for id in (0..3u32).rev() {
        let n = a.tensor_info(TensorId(id)).unwrap().2.numel;
        a.fetch(&[TensorId(id)], Stage::Backward).unwrap();
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - 3.0) * 0.1).collect();
        a.write_grad(TensorId(id), &g).unwrap();
        a.release(&[TensorId(id)], Stage::Backward).unwrap();
    }
    a.end_backward().unwrap();
    opt.step(&mut a).unwrap();
    a.save_checkpoint(&path, &BTreeMap::new()).unwrap();
    let saved = everything(&mut a);

    let mut b = make(64, DType::F32, true);
    b.load_checkpoint(&path).unwrap();
    let mut got = everything(&mut b);
    got.reverse();
    assert_eq!(got, saved, "another chunk size and order");

    let mut c = make(16, DType::BF16, false);
    c.load_checkpoint(&path).unwrap();
    let got = everything(&mut c);
    for (g, s) in got.iter().zip(&saved) {
        assert_eq!(g[1..], s[1..], "f32 lists exact");
        let want = tidemem::chunk::decode(&tidemem::chunk::encode(&s[0], DType::BF16), DType::BF16);
        assert_eq!(g[0], want, "parameters converted to bf16");
    }
}

/// A file that does not fit the model, is not a chunk checkpoint, or does not fit the
/// optimizer is an error naming the problem, and the manager trains on as if nothing happened.
#[test]
fn a_bad_checkpoint_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    let save = |specs: &[(&str, &[usize])], path: &Path| {
        let mut m =
            ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
        for (n, s) in specs {
            m.register(n, s, Init::Constant(9.0)).unwrap();
        }
        adam(true).save_checkpoint(&mut m, path).unwrap();
    };
    let base: &[(&str, &[usize])] = &[("a", &[4]), ("b", &[2, 3])];
    save(base, &good);
    type Spec<'a> = Vec<(&'a str, &'a [usize])>;
    let cases: Vec<(&str, Spec)> = vec![
        ("shape", vec![("a", &[4]), ("b", &[3, 2])]),
        ("missing", vec![("a", &[4])]),
        ("extra", vec![("a", &[4]), ("b", &[2, 3]), ("z", &[1])]),
    ];
    for (what, specs) in cases {
        let p = dir.path().join(format!("{what}.safetensors"));
        save(&specs, &p);
        let mut m2 =
            ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
        let a = m2.register("a", &[4], Init::Constant(1.0)).unwrap();
        m2.register("b", &[2, 3], Init::Constant(2.0)).unwrap();
        let before = everything(&mut m2);
        let e = m2.load_checkpoint(&p).unwrap_err();
        assert!(
            matches!(&e, Error::Checkpoint { .. }) && e.to_string().contains("checkpoint"),
            "{what}: {e}"
        );
        // every list of every tensor as it was, the registrations and the stage too
        assert_eq!(m2.master(a).unwrap(), vec![1.0; 4], "{what}");
        assert_eq!(everything(&mut m2), before, "{what}: nothing changed");
        assert_eq!((m2.num_tensors(), m2.stage()), (2, None), "{what}");
    }
    // not a chunk checkpoint; not a safetensors file at all; no file
    let (mut m, _, ids) = manager(&TOY, Policy::Tide, 1 << 20, None);
    let mut opt = adam(true);
    let table = dir.path().join("table.safetensors");
    m.save_checkpoint(&table, &BTreeMap::new()).unwrap();
    let other = dir.path().join("other.safetensors");
    safetensors::serialize_to_file(
        [(
            "weight",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &[0; 4])
                .unwrap(),
        )],
        &None,
        &other,
    )
    .unwrap();
    // what every refusal below must leave as it was
    let before = everything(&mut m);
    let unchanged = |m: &mut ChunkManager, opt: &HybridAdam, what: &str| {
        assert_eq!(everything(m), before, "{what}: the manager's tensors");
        assert_eq!((m.num_tensors(), m.stage()), (before.len(), None), "{what}");
        assert_eq!(
            (opt.steps(), opt.loss_scale()),
            (0, 1024.0),
            "{what}: the optimizer"
        );
    };
    let e = m.load_checkpoint(&other).unwrap_err();
    assert!(e.to_string().contains("not a chunk checkpoint"), "{e}");
    unchanged(&mut m, &opt, "another safetensors file");
    let junk = dir.path().join("junk");
    std::fs::write(&junk, b"not a checkpoint at all").unwrap();
    assert!(m.load_checkpoint(&junk).is_err());
    unchanged(&mut m, &opt, "junk");
    assert!(m.load_checkpoint(dir.path().join("absent")).is_err());
    unchanged(&mut m, &opt, "no file");
    // the optimizer's side: a save without loss scaling into one with, and no metadata at all
    let unscaled = dir.path().join("unscaled.safetensors");
    adam(false).save_checkpoint(&mut m, &unscaled).unwrap();
    let e = opt.load_checkpoint(&mut m, &unscaled).unwrap_err();
    assert!(e.to_string().contains("loss scaling"), "{e}");
    unchanged(&mut m, &opt, "a save without loss scaling");
    let e = opt.load_checkpoint(&mut m, &table).unwrap_err();
    assert!(e.to_string().contains("adam.steps"), "{e}");
    unchanged(&mut m, &opt, "a save without the optimizer's metadata");
    // after all of that, training is the same as on an untouched manager
    let (mut fresh, _, ids_f) = manager(&TOY, Policy::Tide, 1 << 20, None);
    let mut opt_f = adam(true);
    train(&TOY, &mut m, &ids, &mut opt, 0..3);
    train(&TOY, &mut fresh, &ids_f, &mut opt_f, 0..3);
    assert_eq!(masters(&mut m), masters(&mut fresh));
}

/// Checkpoints run between iterations only, and not in the middle of gradient accumulation;
/// two tensors of one name cannot be told apart in a checkpoint.
#[test]
fn checkpoints_run_between_iterations() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.safetensors");
    let (mut m, _, ids) = manager(&TOY, Policy::Tide, 1 << 20, None);
    let w = ids.blocks[0].0;
    m.fetch(&[w], Stage::Forward).unwrap();
    for r in [
        m.save_checkpoint(&p, &BTreeMap::new()),
        m.load_checkpoint(&p).map(drop),
    ] {
        let e = r.unwrap_err();
        assert!(
            matches!(
                e,
                Error::WrongStage {
                    stage: "forward",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("between iterations"), "{e}");
    }
    m.release(&[w], Stage::Forward).unwrap();
    m.end_forward().unwrap();
    let (mut m, _, ids) = manager(&TOY, Policy::Tide, 1 << 20, None);
    let mut acc = HybridAdam::new(HybridConfig {
        accumulation_steps: 2,
        ..HybridConfig::new(AdamConfig::adam(1e-2))
    })
    .unwrap();
    TOY.forward_backward(&mut m, &ids, 0, 1.0, (0, 1)).unwrap();
    acc.step(&mut m).unwrap();
    let e = acc.save_checkpoint(&mut m, &p).unwrap_err();
    assert!(e.to_string().contains("micro-batch"), "{e}");
    let mut twins =
        ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
    twins.register("x", &[4], Init::Zeros).unwrap();
    twins.register("x", &[4], Init::Zeros).unwrap();
    let e = twins.save_checkpoint(&p, &BTreeMap::new()).unwrap_err();
    assert!(matches!(e, Error::Conflict { .. }), "{e:?}");
    assert!(e.to_string().contains("named 'x'"), "{e}");
}

/// A parameter chunk that may hold gradients is not saved as parameters: after a backward
/// whose step was skipped without restoring the parameters the save is refused (a load is
/// still allowed and restores them), while HybridAdam's own skip restores them first.
#[test]
fn gradients_are_never_saved_as_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.safetensors");
    let mut m =
        ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(64, Policy::Tide)).unwrap();
    let w = m.register("w", &[8], Init::Constant(0.5)).unwrap();
    m.save_checkpoint(&p, &BTreeMap::new()).unwrap();
    let backward = |m: &mut ChunkManager, g: f32| {
        m.fetch(&[w], Stage::Forward).unwrap();
        m.release(&[w], Stage::Forward).unwrap();
        m.end_forward().unwrap();
        m.fetch(&[w], Stage::Backward).unwrap();
        m.write_grad(w, &[g; 8]).unwrap();
        m.release(&[w], Stage::Backward).unwrap();
        m.end_backward().unwrap();
    };
    backward(&mut m, 3.0);
    m.skip_step().unwrap();
    let e = m.save_checkpoint(&p, &BTreeMap::new()).unwrap_err();
    assert!(
        matches!(&e, Error::Conflict { what, .. } if what == "save_checkpoint"),
        "{e:?}"
    );
    assert!(e.to_string().contains("may hold gradients"), "{e}");
    m.load_checkpoint(&p).unwrap();
    assert_eq!(m.read(w).unwrap(), vec![0.5; 8]);
    m.save_checkpoint(&p, &BTreeMap::new()).unwrap();
    // HybridAdam skips an overflow by restoring the parameters from the masters
    let mut opt = adam(true);
    backward(&mut m, f32::INFINITY);
    let r = opt.step(&mut m).unwrap();
    assert_eq!(r.outcome, tidemem::optim::StepOutcome::Skipped);
    opt.save_checkpoint(&mut m, &p).unwrap();
    backward(&mut m, 1.0);
    assert_eq!(
        opt.step(&mut m).unwrap().outcome,
        tidemem::optim::StepOutcome::Stepped
    );
    opt.save_checkpoint(&mut m, &p).unwrap();
}
