//! Host groups stepped during backward, seen from outside the step: reads of a host group's
//! parameter slot between backward and the step give its gradients, and a step thrown away
//! leaves the device copy of a chunk its parameters went up into as it was.

use crate::chunk::{ChunkKind, ChunkManager, GroupChunks, ManagerConfig};
use crate::device::{Device, SimConfig};
use crate::optim::{AdamConfig, DevicePlacement, HybridAdam, HybridConfig, StepOutcome};
use crate::tensor::{Init, Stage, TensorId};
use crate::tide::{Policy, Target};

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

#[test]
fn reads_before_the_step_see_the_gradients_and_a_thrown_away_upload_is_undone() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
    let mut m = ChunkManager::new(dev.clone(), ManagerConfig::new(N, Policy::Tide)).unwrap();
    let ids: Vec<TensorId> = (0..GROUPS)
        .map(|g| {
            let init = Init::Uniform {
                seed: g as u64,
                lo: -1.0,
                hi: 1.0,
            };
            m.register(&format!("w{g}"), &[N], init).unwrap()
        })
        .collect();
    let mut adam = HybridAdam::new(HybridConfig {
        placement: DevicePlacement::HostOnly,
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
