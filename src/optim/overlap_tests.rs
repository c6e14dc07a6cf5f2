//! Host groups stepped during backward, seen from outside the step: reads of a host group's
//! parameter slot between backward and the step give its gradients, a step thrown away
//! leaves the device copy of a chunk its parameters went up into as it was, a step nothing
//! can invalidate runs in place with no shadow, shadows come out of their budget, a
//! non-finite gradient without a loss scaler stops the run, and a host group not stepped during
//! backward steps after it, beside the next forward, which waits for that group only.

use crate::chunk::{
    overlap_group_bytes, ChunkKind, ChunkManager, GroupChunks, ManagerConfig, MomentStorage,
};
use crate::device::{Device, SimConfig};
use crate::optim::{
    AdamConfig, DevicePlacement, HybridAdam, HybridConfig, ScalerConfig, ShadowBudget, StepOutcome,
};
use crate::tensor::{Init, Stage, TensorId};
use crate::tide::{Policy, Target};
use crate::Error;

const N: usize = 4096;
const GROUPS: usize = 4;

fn grads(step: u64) -> Vec<Vec<f32>> {
    (0..GROUPS)
        .map(|g| {
            (0..N)
                .map(|i| {
                    half::f16::from_f32(((i * 7 + g * 3 + step as usize) % 17) as f32 / 64.0 - 0.1)
                        .to_f32()
                })
                .collect()
        })
        .collect()
}

/// Forward and backward of one tensor a group, writing `grads`.
fn backward(m: &mut ChunkManager, ids: &[TensorId], grads: &[Vec<f32>]) {
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

/// A manager of `GROUPS` groups of one tensor each, on a small simulated device.
fn manager() -> (ChunkManager, Vec<TensorId>) {
    let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
    let mut m = ChunkManager::new(dev, ManagerConfig::new(N, Policy::Tide)).unwrap();
    let ids = (0..GROUPS)
        .map(|g| {
            let init = Init::Uniform {
                seed: g as u64,
                lo: -1.0,
                hi: 1.0,
            };
            m.register(&format!("w{g}"), &[N], init).unwrap()
        })
        .collect();
    (m, ids)
}

/// Every host setting of `cfg`'s optimizer over `steps` steps; the masters and the step
/// results.
fn train(cfg: HybridConfig, steps: u64) -> (ChunkManager, Vec<Vec<u32>>, HybridAdam) {
    let (mut m, ids) = manager();
    let mut adam = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        ..cfg
    })
    .unwrap();
    for step in 0..steps {
        backward(&mut m, &ids, &grads(step));
        assert_eq!(adam.step(&mut m).unwrap().outcome, StepOutcome::Stepped);
    }
    let bits = ids
        .iter()
        .map(|&id| m.master(id).unwrap().iter().map(|x| x.to_bits()).collect())
        .collect();
    (m, bits, adam)
}

fn cfg(overlap: bool) -> HybridConfig {
    HybridConfig {
        overlap,
        ..HybridConfig::new(AdamConfig::adam(1e-3))
    }
}

#[test]
fn a_step_nothing_can_invalidate_runs_in_place_with_no_shadow() {
    let (_, serial, _) = train(cfg(false), 4);
    let (m, overlapped, _) = train(cfg(true), 4);
    assert_eq!(overlapped, serial, "the serial step's bits");
    let st = m.overlap_stats();
    assert_eq!((st.started, st.kept, st.redone), (12, 12, 0), "{st:?}");
    // no copy of the optimizer state, no buffer beside the chunks' own
    assert_eq!(overlap_group_bytes(N, 2, MomentStorage::F32, false), 0);
    assert_eq!(st.host_bytes, 0, "{st:?}");
    // with a clip the step can be invalidated: shadows
    let clipped = HybridConfig {
        max_grad_norm: Some(1e9),
        ..cfg(true)
    };
    let (m, bits, _) = train(clipped, 4);
    let (_, serial, _) = train(
        HybridConfig {
            overlap: false,
            ..clipped
        },
        4,
    );
    assert_eq!(bits, serial);
    let st = m.overlap_stats();
    assert!(st.host_bytes >= GROUPS as u64 * 12 * N as u64, "{st:?}");
}

/// In place, the gradients of a host group are gone once its step ran and its master is the
/// step's: reading either before the optimizer's step is refused, naming the tensor, and the
/// step's statistics are the ones the worker took before overwriting them (the same norm as
/// the serial step).
#[test]
fn a_gradient_taken_in_place_is_not_read_and_its_norm_is_the_serial_ones() {
    let mut norms = Vec::new();
    for overlap in [false, true] {
        let (mut m, _, mut adam) = train(cfg(overlap), 3);
        let ids: Vec<TensorId> = (0..GROUPS as u32).map(TensorId).collect();
        backward(&mut m, &ids, &grads(3));
        let read = m.read(ids[GROUPS - 1]);
        let master = m.master(ids[GROUPS - 1]);
        match overlap {
            true => {
                for r in [read.map(drop), master.map(drop)] {
                    assert!(
                        matches!(&r, Err(Error::Conflict { what, .. }) if what.contains("'w3'")),
                        "{r:?}"
                    );
                }
            }
            false => {
                assert_eq!(read.unwrap(), grads(3)[GROUPS - 1]);
                assert!(master.is_ok());
            }
        }
        norms.push(adam.step(&mut m).unwrap().grad_norm.to_bits());
        // after the step, the parameter
        assert!(m.read(ids[GROUPS - 1]).is_ok());
    }
    assert_eq!(norms[0], norms[1]);
}

#[test]
fn shadows_come_out_of_their_budget_and_the_rest_steps_after_backward() {
    let scaled = HybridConfig {
        loss_scale: Some(ScalerConfig::default()),
        ..cfg(true)
    };
    let (_, serial, _) = train(
        HybridConfig {
            overlap: false,
            ..scaled
        },
        4,
    );
    let one = overlap_group_bytes(N, 2, MomentStorage::F32, true);
    for (budget, early) in [(0, 0), (one, 1), (2 * one + one / 2, 2), (u64::MAX, GROUPS)] {
        let c = HybridConfig {
            overlap_budget: ShadowBudget::Bytes(budget),
            ..scaled
        };
        let (m, bits, _) = train(c, 4);
        assert_eq!(bits, serial, "budget {budget}");
        let st = m.overlap_stats();
        // the last groups in order: the first whose gradients are final
        assert_eq!(st.kept, 3 * early as u64, "budget {budget}: {st:?}");
        // the others on the worker after backward
        assert_eq!(
            st.deferred,
            3 * (GROUPS - early) as u64,
            "budget {budget}: {st:?}"
        );
        assert!(st.host_bytes <= budget, "budget {budget}: {st:?}");
    }
    assert_eq!(ShadowBudget::Auto.bytes(Some(100), 60), 20);
    assert_eq!(ShadowBudget::Auto.bytes(None, 60), u64::MAX);
    assert_eq!(ShadowBudget::Auto.bytes(Some(50), 60), 0);
}

#[test]
fn a_non_finite_gradient_without_a_loss_scaler_stops_the_run_naming_the_step() {
    for overlap in [false, true] {
        let (mut m, _, mut adam) = train(cfg(overlap), 3);
        let ids: Vec<TensorId> = (0..GROUPS as u32).map(TensorId).collect();
        let before: Vec<Vec<f32>> = ids.iter().map(|&id| m.master(id).unwrap()).collect();
        let path = std::env::temp_dir().join(format!(
            "tidemem-nonfinite-{}-{overlap}.ckpt",
            std::process::id()
        ));
        adam.save_checkpoint(&mut m, &path).unwrap();
        let mut g = grads(3);
        g[GROUPS - 1][5] = f32::NAN;
        backward(&mut m, &ids, &g);
        let e = adam.step(&mut m).unwrap_err();
        // overlapped, the last group stepped in place during backward
        assert!(
            matches!(e, Error::NonFiniteGradients { step: 4, in_place } if in_place == overlap),
            "{e}"
        );
        if !overlap {
            let now: Vec<Vec<f32>> = ids.iter().map(|&id| m.master(id).unwrap()).collect();
            assert_eq!(now, before, "the serial step touched nothing");
        }
        // the run stops; the checkpoint brings it back
        backward(&mut m, &ids, &grads(4));
        assert!(matches!(adam.step(&mut m), Err(Error::Poisoned { .. })));
        m.skip_step().unwrap();
        adam.load_checkpoint(&mut m, &path).unwrap();
        let now: Vec<Vec<f32>> = ids.iter().map(|&id| m.master(id).unwrap()).collect();
        assert_eq!(now, before);
        backward(&mut m, &ids, &grads(3));
        assert_eq!(adam.step(&mut m).unwrap().outcome, StepOutcome::Stepped);
        std::fs::remove_file(&path).ok();
    }
}

#[test]
fn reads_before_the_step_see_the_gradients_and_a_thrown_away_upload_is_undone() {
    let (mut m, ids) = manager();
    // a clip: a step that can be thrown away, so early steps run on shadows
    let mut adam = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        max_grad_norm: Some(1e9),
        ..HybridConfig::new(AdamConfig::adam(1e-3))
    })
    .unwrap();
    // warm-up, then steps whose early steps are kept: the next ones upload ahead
    for step in 0..3 {
        backward(&mut m, &ids, &grads(step));
        assert_eq!(adam.step(&mut m).unwrap().outcome, StepOutcome::Stepped);
    }
    assert_eq!(m.overlap_stats().kept, 2 * GROUPS as u64);
    let g = grads(3);
    backward(&mut m, &ids, &g);
    // every early step is done, its parameters gone up into the device copies
    m.join_early_steps().unwrap();
    assert!((0..GROUPS).all(|i| m.uploaded_early(i)));
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(m.read(id).unwrap(), g[i], "group {i}: the gradients");
    }
    // the step is thrown away: the device copies hold its parameters until something reads
    // them there, which brings back the gradients
    m.overlap_verdict(None).unwrap();
    assert!((0..GROUPS).all(|i| m.device_param_differs(i) && !m.uploaded_early(i)));
    let mut seen = Vec::new();
    m.visit_groups(
        &[ChunkKind::Param],
        |_| Target::Device,
        |v| {
            if let GroupChunks::Device {
                device,
                stream,
                param,
                ..
            } = v.chunks
            {
                let bytes = device.download(stream, param).unwrap();
                seen.push(crate::chunk::decode(&bytes, crate::DType::F16));
            }
            Ok(())
        },
    )
    .unwrap();
    for (i, (a, b)) in seen.iter().zip(&g).enumerate() {
        assert!(
            a == b,
            "group {i}: the device copy holds {:?}…, not the gradients {:?}…",
            &a[..4],
            &b[..4]
        );
    }
    assert!((0..GROUPS).all(|i| !m.device_param_differs(i)));
    assert_eq!(m.overlap_stats().redone, GROUPS as u64);
}

/// A checkpoint's step count past what Adam's bias correction counts is refused (it raises β
/// to the count as an i32), the largest it counts accepted.
#[test]
fn a_step_count_past_the_bias_correction_is_refused() {
    let adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-3))).unwrap();
    let meta = |steps: u64| {
        std::collections::BTreeMap::from([("adam.steps".to_string(), steps.to_string())])
    };
    assert_eq!(
        adam.checkpoint_steps(&meta(i32::MAX as u64 - 1)).unwrap(),
        i32::MAX as u64 - 1
    );
    for steps in [i32::MAX as u64, u64::MAX - 1, u64::MAX] {
        let e = adam.checkpoint_steps(&meta(steps)).unwrap_err();
        assert!(
            matches!(e, crate::Error::TooLarge { requested, .. } if requested == u128::from(steps)),
            "{steps}: {e}"
        );
    }
}

#[test]
fn a_binding_clip_steps_the_host_groups_after_backward_with_the_serial_bits() {
    let clipped = HybridConfig {
        max_grad_norm: Some(1e-6),
        ..cfg(true)
    };
    let (_, serial, _) = train(
        HybridConfig {
            overlap: false,
            ..clipped
        },
        5,
    );
    let (m, bits, _) = train(clipped, 5);
    assert_eq!(bits, serial);
    let st = m.overlap_stats();
    // every step follows a clip (warm-up's too) and is not speculated: every host group of
    // steps 1 to 4 steps on the worker after backward, in place, holding no shadow
    assert_eq!((st.started, st.redone), (0, 0), "{st:?}");
    assert_eq!(st.deferred, 4 * GROUPS as u64, "{st:?}");
    assert_eq!(st.host_bytes, 0, "{st:?}");
}

/// A manager of [`manager`]'s after its warm-up step (serial, in place).
fn warmed_up() -> (ChunkManager, Vec<TensorId>) {
    let (mut m, ids) = manager();
    let mut adam = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
        ..cfg(false)
    })
    .unwrap();
    backward(&mut m, &ids, &grads(0));
    adam.step(&mut m).unwrap();
    (m, ids)
}

/// A step of one block that waits, for the groups `held` picks, until the gate opens (at most
/// 10 s) and counts them then; the gate's key, and the count.
#[allow(clippy::type_complexity)]
fn gated(
    held: fn(usize) -> bool,
    step: fn(crate::chunk::HostBlock<'_>),
) -> (
    std::sync::Arc<dyn Fn(crate::chunk::HostBlock<'_>) -> crate::Result<()> + Send + Sync>,
    crossbeam::channel::Sender<()>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let (open, gate) = crossbeam::channel::unbounded::<()>();
    let gate = parking_lot::Mutex::new(gate);
    let late = Arc::new(AtomicUsize::new(0));
    let done = Arc::clone(&late);
    let f = move |b: crate::chunk::HostBlock<'_>| {
        if held(b.group) {
            let _ = gate.lock().recv_timeout(std::time::Duration::from_secs(10));
            done.fetch_add(1, Ordering::SeqCst);
        }
        step(b);
        Ok(())
    };
    (Arc::new(f), open, late)
}

#[test]
fn the_next_forward_waits_for_a_groups_own_deferred_step_only() {
    use std::sync::atomic::Ordering;

    let (mut m, ids) = warmed_up();
    backward(&mut m, &ids, &grads(1));
    // the steps of groups 1.. wait for the gate; group 0's does not
    let (step, open, late) = gated(|g| g > 0, |_| {});
    m.defer_host_steps(step, 1);
    m.visit_groups(
        &ChunkKind::ALL,
        |_| Target::Host,
        |_| panic!("every host group is deferred"),
    )
    .unwrap();
    m.end_step().unwrap();
    // the next forward's first group goes ahead while the others still step
    m.fetch(&[ids[0]], Stage::Forward).unwrap();
    m.release(&[ids[0]], Stage::Forward).unwrap();
    assert_eq!(
        late.load(Ordering::SeqCst),
        0,
        "group 0 waited for a later group"
    );
    for _ in 1..GROUPS {
        open.send(()).unwrap();
    }
    for &id in &ids[1..] {
        m.fetch(&[id], Stage::Forward).unwrap();
        m.release(&[id], Stage::Forward).unwrap();
    }
    assert_eq!(late.load(Ordering::SeqCst), GROUPS - 1);
    assert_eq!(m.overlap_stats().deferred, GROUPS as u64);
}

#[test]
fn the_statistics_and_the_pass_wait_for_no_early_step_still_running() {
    use std::sync::atomic::Ordering;

    let (mut m, ids) = warmed_up();
    let before: Vec<Vec<f32>> = ids.iter().map(|&id| m.master(id).unwrap()).collect();
    // in place, every group early; group 0's step (the last to start) waits for the gate
    let (step, open, late) = gated(|g| g == 0, |b| b.master.iter_mut().for_each(|x| *x += 1.0));
    m.arm_overlap(Some(crate::chunk::OverlapPlan {
        first_host: 0,
        in_place: true,
        threads: 1,
        key: b"step".to_vec(),
        step,
        fold: false,
    }));
    backward(&mut m, &ids, &grads(1));
    // the statistics come ahead of the steps, the pass counts the running step as kept
    let st = m.grad_stats().unwrap();
    assert!(st.sum_sq > 0.0 && !st.nonfinite);
    m.overlap_verdict(Some(b"step")).unwrap();
    m.visit_groups(
        &ChunkKind::ALL,
        |_| Target::Host,
        |_| panic!("every host group stepped early"),
    )
    .unwrap();
    m.end_step().unwrap();
    assert_eq!(late.load(Ordering::SeqCst), 0, "a wait for group 0's step");
    assert_eq!(m.overlap_stats().kept, GROUPS as u64);
    open.send(()).unwrap();
    // a read waits for the step, which ran once
    for (i, &id) in ids.iter().enumerate() {
        let want: Vec<f32> = before[i].iter().map(|x| x + 1.0).collect();
        assert_eq!(m.master(id).unwrap(), want, "group {i}");
    }
    assert_eq!(late.load(Ordering::SeqCst), 1);
}

#[test]
fn the_first_host_groups_of_the_tail_step_after_backward() {
    let (_, serial, _) = train(cfg(false), 4);
    for tail in [1, 3, GROUPS + 2] {
        let (m, bits, _) = train(
            HybridConfig {
                overlap_tail: tail,
                ..cfg(true)
            },
            4,
        );
        assert_eq!(bits, serial, "tail {tail}");
        let st = m.overlap_stats();
        let late = tail.min(GROUPS) as u64;
        assert_eq!(st.kept, 3 * (GROUPS as u64 - late), "tail {tail}: {st:?}");
        assert_eq!(st.deferred, 3 * late, "tail {tail}: {st:?}");
    }
}
