//! Adam's moments held in 8 bits (`ManagerConfig::moments = MomentStorage::Int8`): the chunk
//! manager holds a byte an element and a scale a block, `HybridAdam` steps them with the
//! 8-bit step on the host (`CpuAdam::step8`) and on the device (`ops::adam8`), and every
//! placement, policy and tier gives the same bits, which are those of the 8-bit step on flat
//! arrays. Checkpoints carry the moments as f32 values and load into either storage.

mod common;

use std::collections::BTreeMap;

use half::f16;
use tidemem::chunk::{ChunkManager, ManagerConfig, MomentStorage};
use tidemem::demo::ToyIds;
use tidemem::device::{CachingAllocator, Device};
use tidemem::ops::{CpuAdam, Grad, Moments8, ParamCopy, Quant8Map, QUANT8_BLOCK};
use tidemem::optim::{AdamConfig, DevicePlacement, HybridAdam, HybridConfig, StepOutcome};
use tidemem::tensor::{ChunkKind, Init, Stage, TensorId};
use tidemem::tide::Policy;
use tidemem::DType;

use common::TOY;

const BIG: usize = 1 << 20;

/// A manager for the toy model on `dev` with `moments`, planning for `capacity` bytes.
fn toy(
    dev: Device,
    policy: Policy,
    capacity: usize,
    host_budget: Option<u64>,
    moments: MomentStorage,
) -> (ChunkManager, ToyIds) {
    let mut cfg = ManagerConfig::new(TOY.chunk_elems(), policy);
    cfg.scheduler.capacity = capacity as u64;
    cfg.scheduler.overall_fraction = 1.0;
    cfg.scheduler.warmup_chunk_fraction = 0.3;
    cfg.host_budget = host_budget;
    cfg.moments = moments;
    let mut m = ChunkManager::new(dev.clone(), cfg).unwrap();
    m.set_non_model_allocator(CachingAllocator::new(dev));
    let ids = TOY.register(&mut m).unwrap();
    (m, ids)
}

/// AdamW with a loss scaler and a clip (the suites' optimizer).
fn hybrid(placement: DevicePlacement) -> HybridAdam {
    common::hybrid_adam(true, placement)
}

/// Trains steps `from..to`; returns the losses, then every tensor's fp16 parameter bits and
/// fp32 master bits, and how many steps had groups on the device.
fn train(
    m: &mut ChunkManager,
    ids: &ToyIds,
    opt: &mut HybridAdam,
    steps: std::ops::Range<u64>,
) -> (Vec<f32>, Vec<u16>, Vec<u32>, usize) {
    let (mut losses, mut on_device) = (Vec::new(), 0);
    for s in steps {
        let loss = TOY
            .forward_backward(m, ids, s, opt.loss_scale(), (0, 1))
            .unwrap();
        let r = opt.step(m).unwrap();
        assert_eq!(r.outcome, StepOutcome::Stepped);
        on_device += usize::from(r.device_groups > 0);
        losses.push(loss);
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
    (losses, params, masters, on_device)
}

fn small() -> usize {
    TOY.non_model_peak(DType::F16) + 1928
}

#[test]
fn every_placement_policy_and_tier_gives_the_same_bits() {
    let int8 = MomentStorage::Int8;
    let (mut m, ids) = toy(common::sim(BIG), Policy::Tide, BIG, None, int8);
    let mut opt = hybrid(DevicePlacement::HostOnly);
    let reference = train(&mut m, &ids, &mut opt, 0..8);
    // the moments' chunks hold a byte an element and a scale a block
    let u = m.usage();
    let bytes: usize = m
        .layout()
        .group_elems
        .iter()
        .map(|&e| e.next_multiple_of(4) + 4 * e.div_ceil(QUANT8_BLOCK))
        .sum();
    let moment_bytes = u.host[ChunkKind::Momentum.index()] + u.host[ChunkKind::Variance.index()];
    assert_eq!(moment_bytes, 2 * bytes as u64, "{u:?}");
    assert!(
        reference.0[7] < reference.0[0],
        "it trains: {:?}",
        reference.0
    );
    for (policy, capacity, placement, host_budget) in [
        (
            Policy::Tide,
            BIG,
            DevicePlacement::Auto { fraction: 0.8 },
            None,
        ),
        (Policy::Tide, small(), DevicePlacement::Groups(2), None),
        (
            Policy::PatrickStar,
            small(),
            DevicePlacement::Groups(1),
            None,
        ),
        (
            Policy::Tide,
            small(),
            DevicePlacement::Groups(1),
            Some(8 * 1024),
        ),
    ] {
        let what = format!("{policy:?} on {capacity} bytes, {placement:?}, host {host_budget:?}");
        let (mut m2, ids2) = toy(common::sim(capacity), policy, capacity, host_budget, int8);
        let mut opt2 = hybrid(placement);
        let got = train(&mut m2, &ids2, &mut opt2, 0..8);
        assert!(got.3 > 0, "{what}: groups stepped on the device");
        assert!(got.1 == reference.1, "fp16 parameters differ: {what}");
        assert!(got.2 == reference.2, "fp32 masters differ: {what}");
        if host_budget.is_some() {
            let u = m2.usage();
            let on_file = u.file[ChunkKind::Momentum.index()] + u.file[ChunkKind::Variance.index()];
            assert!(on_file > 0, "8-bit moments on the file tier: {u:?}");
        }
    }
    // fp32 moments train the same model to other bits: the storage is in effect
    let (mut f, fids) = toy(
        common::sim(BIG),
        Policy::Tide,
        BIG,
        None,
        MomentStorage::F32,
    );
    let mut fopt = hybrid(DevicePlacement::HostOnly);
    let fp32 = train(&mut f, &fids, &mut fopt, 0..8);
    assert!(fp32.2 != reference.2);
    let rel = (fp32.0[7] - reference.0[7]).abs() / fp32.0[7];
    assert!(
        rel < 0.05,
        "losses {} (fp32) and {} (8-bit)",
        fp32.0[7],
        reference.0[7]
    );
}

/// Host groups on 8-bit moments step during backward (on shadows of their codes and scales
/// with a loss scaler and a clip, in place without) and after it, with the serial bits.
#[test]
fn overlapped_eight_bit_steps_equal_serial_ones() {
    let int8 = MomentStorage::Int8;
    let in_place = |overlap| HybridConfig {
        placement: DevicePlacement::Groups(2),
        overlap,
        ..HybridConfig::new(AdamConfig::adamw(1e-2, 0.01))
    };
    let scaled = |overlap| HybridConfig {
        overlap,
        ..*hybrid(DevicePlacement::Groups(2)).config()
    };
    for (what, cfg) in [
        ("in place", &in_place as &dyn Fn(bool) -> HybridConfig),
        ("shadowed", &scaled),
    ] {
        let run = |overlap| {
            let (mut m, ids) = toy(common::sim(small()), Policy::Tide, small(), None, int8);
            let mut opt = HybridAdam::new(cfg(overlap)).unwrap();
            let r = train(&mut m, &ids, &mut opt, 0..8);
            (r, m.overlap_stats())
        };
        let (serial, none) = run(false);
        let (overlapped, o) = run(true);
        assert_eq!(none.started, 0);
        assert!(o.started > 0 && o.kept > 0, "{what}: {o:?}");
        if what == "in place" {
            assert_eq!(o.host_bytes, 0, "{what}: no shadow");
        } else {
            assert!(o.host_bytes > 0, "{what}: shadows {o:?}");
        }
        assert!(overlapped.1 == serial.1, "{what}: fp16 parameters differ");
        assert!(overlapped.2 == serial.2, "{what}: fp32 masters differ");
    }
}

/// A group long enough that its early step splits over threads (on block edges), and
/// tensors that end inside a block: the serial bits.
#[test]
fn an_eight_bit_step_split_over_threads_keeps_the_bits() {
    let run = |overlap: bool| {
        let mut cfg = ManagerConfig::new(1 << 18, Policy::Tide);
        cfg.moments = MomentStorage::Int8;
        let mut m = ChunkManager::new(common::sim(64 << 20), cfg).unwrap();
        // 100,001 + 150,000 elements in one chunk: the second starts at 100,096
        let sizes = [100_001usize, 150_000, 70_000];
        let ids: Vec<TensorId> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let init = Init::Uniform {
                    seed: i as u64,
                    lo: -1.0,
                    hi: 1.0,
                };
                m.register(&format!("w{i}"), &[n], init).unwrap()
            })
            .collect();
        assert_eq!(m.layout().slots[1].offset, 100_096);
        let mut opt = HybridAdam::new(HybridConfig {
            placement: DevicePlacement::HostOnly,
            threads: 2,
            overlap,
            ..HybridConfig::new(AdamConfig::adamw(1e-3, 0.01))
        })
        .unwrap();
        for step in 0..4u64 {
            for &id in &ids {
                m.fetch(&[id], Stage::Forward).unwrap();
                m.release(&[id], Stage::Forward).unwrap();
            }
            m.end_forward().unwrap();
            for (i, &id) in ids.iter().enumerate().rev() {
                let g: Vec<f32> = (0..sizes[i])
                    .map(|k| ((k as f32 * 0.013 + step as f32 + i as f32).sin()) * 1e-2)
                    .collect();
                m.fetch(&[id], Stage::Backward).unwrap();
                m.write_grad(id, &g).unwrap();
                m.release(&[id], Stage::Backward).unwrap();
            }
            m.end_backward().unwrap();
            opt.step(&mut m).unwrap();
        }
        let bits: Vec<u32> = ids
            .iter()
            .flat_map(|&id| m.master(id).unwrap())
            .map(f32::to_bits)
            .collect();
        (bits, m.overlap_stats())
    };
    let (serial, _) = run(false);
    let (overlapped, o) = run(true);
    assert!(o.kept > 0, "{o:?}");
    assert!(overlapped == serial, "an early step split over threads");
}

#[test]
fn cuda_steps_eight_bit_moments_as_the_sim_device_does() {
    let Some(gpu) = common::cuda("cuda_steps_eight_bit_moments_as_the_sim_device_does") else {
        return;
    };
    let int8 = MomentStorage::Int8;
    let (mut m, ids) = toy(common::sim(small()), Policy::Tide, small(), None, int8);
    let reference = train(&mut m, &ids, &mut hybrid(DevicePlacement::Groups(2)), 0..6);
    let (mut g, gids) = toy(gpu.clone(), Policy::Tide, small(), None, int8);
    let got = train(&mut g, &gids, &mut hybrid(DevicePlacement::Groups(2)), 0..6);
    assert!(got.3 > 0);
    let wide = |p: &[u16]| {
        p.iter()
            .map(|&b| f16::from_bits(b).to_f32().to_bits())
            .collect::<Vec<_>>()
    };
    common::assert_same_arithmetic(&gpu, &wide(&got.1), &wide(&reference.1), 1e-3, "params");
    common::assert_same_arithmetic(&gpu, &got.2, &reference.2, 1e-3, "masters");
}

#[test]
fn a_checkpoint_carries_the_moments_between_storages() {
    let int8 = MomentStorage::Int8;
    let dir = tempfile::tempdir().unwrap();
    let (mut m, ids) = toy(common::sim(BIG), Policy::Tide, BIG, None, int8);
    let mut opt = hybrid(DevicePlacement::Groups(1));
    let whole = train(&mut m, &ids, &mut opt, 0..6);
    // three steps, a checkpoint, three more in a new manager: the same bits
    let path = dir.path().join("a.safetensors");
    let (mut a, aids) = toy(common::sim(BIG), Policy::Tide, BIG, None, int8);
    let mut aopt = hybrid(DevicePlacement::Groups(1));
    train(&mut a, &aids, &mut aopt, 0..3);
    aopt.save_checkpoint(&mut a, &path).unwrap();
    let (mut b, bids) = toy(common::sim(BIG), Policy::Tide, BIG, None, int8);
    let mut bopt = hybrid(DevicePlacement::Groups(1));
    bopt.load_checkpoint(&mut b, &path).unwrap();
    let resumed = train(&mut b, &bids, &mut bopt, 3..6);
    assert!(
        resumed.1 == whole.1 && resumed.2 == whole.2,
        "resumed from a checkpoint"
    );
    // the file holds the codes and their scales; an fp32 run loads them as their values
    let (mut f, _) = toy(
        common::sim(BIG),
        Policy::Tide,
        BIG,
        None,
        MomentStorage::F32,
    );
    f.load_checkpoint(&path).unwrap();
    let back = dir.path().join("b.safetensors");
    f.save_checkpoint(&back, &BTreeMap::new()).unwrap();
    let (x, y) = (tensors(&path), tensors(&back));
    let mut nonzero = 0;
    for (map, kind) in [
        (Quant8Map::Signed, "momentum"),
        (Quant8Map::Unsigned, "variance"),
    ] {
        let table = map.table();
        for (name, codes) in x.iter().filter(|(n, _)| n.starts_with(&format!("{kind}/"))) {
            let tensor = &name[kind.len() + 1..];
            let scales: Vec<f32> = floats(&x, &format!("{kind}_scales/{tensor}"));
            let values: Vec<f32> = floats(&y, name);
            assert_eq!(codes.len(), values.len(), "{name}: a byte an element");
            for (i, (&c, &v)) in codes.iter().zip(&values).enumerate() {
                assert_eq!(
                    v,
                    table[c as usize] * scales[i / QUANT8_BLOCK],
                    "{name} [{i}]"
                );
                nonzero += usize::from(v != 0.0);
            }
        }
    }
    assert!(
        nonzero > 100,
        "the moments were trained: {nonzero} nonzero values"
    );
    // and an 8-bit run quantizes f32 moments, each value to within its map's precision
    let (mut c, _) = toy(common::sim(BIG), Policy::Tide, BIG, None, int8);
    c.load_checkpoint(&back).unwrap();
    let again = dir.path().join("c.safetensors");
    c.save_checkpoint(&again, &BTreeMap::new()).unwrap();
    let z = tensors(&again);
    let (codes, scales) = (
        &z[index(&z, "momentum/block0.weight")].1,
        floats(&z, "momentum_scales/block0.weight"),
    );
    let want = floats(&y, "momentum/block0.weight");
    let table = Quant8Map::Signed.table();
    for (i, (&c, &w)) in codes.iter().zip(&want).enumerate() {
        let got = table[c as usize] * scales[i / QUANT8_BLOCK];
        assert!(
            (got - w).abs() <= 0.02 * w.abs() + 1e-3 * scales[i / QUANT8_BLOCK],
            "{got} {w}"
        );
    }
}

type Entries = Vec<(String, Vec<u8>)>;

/// Every tensor of a safetensors file, by name.
fn tensors(p: &std::path::Path) -> Entries {
    let bytes = std::fs::read(p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Entries = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect();
    v.sort();
    v
}

fn index(e: &Entries, name: &str) -> usize {
    e.iter()
        .position(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no entry {name}"))
}

fn floats(e: &Entries, name: &str) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(&e[index(e, name)].1)
}

#[test]
fn steps_equal_the_eight_bit_step_on_flat_arrays() {
    // three tensors of 300: two share a chunk of 1024 (at 0 and 512: a tensor starts on a
    // block), the third opens the next
    let n = 300;
    for placement in [DevicePlacement::Groups(1), DevicePlacement::HostOnly] {
        let mut cfg = ManagerConfig::new(1024, Policy::Tide);
        cfg.moments = MomentStorage::Int8;
        let mut m = ChunkManager::new(common::sim(1 << 20), cfg).unwrap();
        let ids: Vec<TensorId> = (0..3)
            .map(|i| {
                let init = Init::Uniform {
                    seed: i,
                    lo: -1.0,
                    hi: 1.0,
                };
                m.register(&format!("w{i}"), &[n], init).unwrap()
            })
            .collect();
        assert_eq!(m.layout().slots[1].offset, 512);
        assert_eq!(m.groups(), 2);
        let adam = AdamConfig::adamw(1e-2, 0.1);
        let mut opt = HybridAdam::new(HybridConfig {
            placement,
            ..HybridConfig::new(adam)
        })
        .unwrap();
        let blocks = n.div_ceil(QUANT8_BLOCK);
        let mut p: Vec<Vec<f32>> = ids.iter().map(|&id| m.master(id).unwrap()).collect();
        let mut codes = vec![(vec![127u8; n], vec![0u8; n]); 3];
        let mut scales = vec![(vec![0f32; blocks], vec![0f32; blocks]); 3];
        for step in 1..=5u64 {
            let g: Vec<Vec<f32>> = (0..3)
                .map(|i| {
                    (0..n)
                        .map(|k| {
                            let h = tidemem::rng::splitmix64(step * 7919 + i * 131 + k as u64);
                            let x = ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                            f16::from_f32(x).to_f32()
                        })
                        .collect()
                })
                .collect();
            for &id in &ids {
                m.fetch(&[id], Stage::Forward).unwrap();
                m.release(&[id], Stage::Forward).unwrap();
            }
            m.end_forward().unwrap();
            for (i, &id) in ids.iter().enumerate().rev() {
                m.fetch(&[id], Stage::Backward).unwrap();
                m.write_grad(id, &g[i]).unwrap();
                m.release(&[id], Stage::Backward).unwrap();
            }
            m.end_backward().unwrap();
            let r = opt.step(&mut m).unwrap();
            let on_device = placement != DevicePlacement::HostOnly && step > 1;
            assert_eq!(r.device_groups, usize::from(on_device), "step {step}");
            let s = adam.scalars(step, 1.0).unwrap();
            for i in 0..3 {
                let g16: Vec<f16> = g[i].iter().map(|&x| f16::from_f32(x)).collect();
                let mut c = vec![f16::ZERO; n];
                let (mc, vc) = &mut codes[i];
                let (ms, vs) = &mut scales[i];
                let moments = Moments8 {
                    momentum: mc,
                    variance: vc,
                    momentum_scales: ms,
                    variance_scales: vs,
                };
                CpuAdam::new()
                    .step8(
                        &s,
                        &mut p[i],
                        moments,
                        Grad::F16(&g16),
                        ParamCopy::F16(&mut c),
                    )
                    .unwrap();
                let what = format!("{placement:?} step {step} tensor {i}");
                assert_eq!(m.master(ids[i]).unwrap(), p[i], "{what}");
                let want: Vec<f32> = c.iter().map(|x| x.to_f32()).collect();
                assert_eq!(m.read(ids[i]).unwrap(), want, "{what}");
            }
        }
    }
}

#[test]
fn step_host_is_refused_with_eight_bit_moments() {
    let mut cfg = ManagerConfig::new(1024, Policy::Tide);
    cfg.moments = MomentStorage::Int8;
    let mut m = ChunkManager::new(common::sim(1 << 20), cfg).unwrap();
    let id = m.register("w", &[100], Init::Zeros).unwrap();
    m.fetch(&[id], Stage::Forward).unwrap();
    m.release(&[id], Stage::Forward).unwrap();
    m.end_forward().unwrap();
    m.fetch(&[id], Stage::Backward).unwrap();
    m.write_grad(id, &[1.0; 100]).unwrap();
    m.release(&[id], Stage::Backward).unwrap();
    m.end_backward().unwrap();
    let e = m.step_host(|_| Ok(())).unwrap_err();
    assert!(matches!(e, tidemem::Error::Conflict { .. }), "{e}");
}
