use super::*;
use crate::chunk::{ChunkKind, ManagerConfig};
use crate::device::SimConfig;
use crate::error::Error;
use crate::tensor::TensorState;
use crate::tide::Policy;

fn manager(dtype: DType) -> ChunkManager {
    let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
    let mut cfg = ManagerConfig::new(64, Policy::Tide);
    cfg.param_dtype = dtype;
    ChunkManager::new(dev, cfg).unwrap()
}

fn state(m: &ChunkManager, id: TensorId) -> TensorState {
    m.state(id, ChunkKind::Param).unwrap()
}

/// A layer body that fails after its fetch, as a kernel error would.
fn failing_op(pass: &ForwardPass<'_>, w: TensorId) -> Result<()> {
    let g = pass.fetch(&[w])?;
    let _w = g.param(0)?;
    g.param(7)?; // out of range: an error with the guard alive
    unreachable!("param(7) of a guard holding 1 tensor fails")
}

#[test]
fn a_guard_dropped_on_an_error_path_releases() {
    let mut m = manager(DType::F16);
    let w = m.register("w", &[8], Init::Constant(1.0)).unwrap();
    let fwd = m.forward().unwrap();
    assert!(matches!(
        failing_op(&fwd, w),
        Err(Error::IndexOutOfRange {
            index: 7,
            len: 1,
            ..
        })
    ));
    fwd.finish().unwrap();
    assert_eq!(
        state(&m, w),
        TensorState::Hold,
        "released, then end_forward"
    );
}

#[test]
fn a_release_that_fails_in_drop_surfaces_at_the_next_call() {
    let dev = Device::sim(SimConfig::with_capacity(1 << 20)).unwrap();
    let mut m = ChunkManager::new(dev.clone(), ManagerConfig::new(256, Policy::Tide)).unwrap();
    let w = m.register("w", &[256], Init::Constant(1.0)).unwrap();
    let x = m.register("x", &[256], Init::Constant(1.0)).unwrap();
    let fwd = m.forward().unwrap();
    let g = fwd.fetch(&[w]).unwrap();
    // the device fills up behind the manager's back: loading x fails and poisons it
    let hog = dev.alloc(dev.mem_info().unwrap().free).unwrap();
    assert!(matches!(fwd.fetch(&[x]), Err(Error::OutOfMemory { .. })));
    drop(g); // its release fails: the pass keeps the error
    let e = fwd.finish().unwrap_err();
    assert!(
        matches!(&e, Error::Poisoned { what: "chunk manager", reason } if reason.contains("out of")),
        "{e}"
    );
    drop(hog);
    assert!(m.forward().is_ok(), "stage checks need no usable manager");
    assert!(matches!(m.read(w), Err(Error::Poisoned { .. })));
}

#[test]
fn passes_carry_their_stage() {
    let mut m = manager(DType::F16);
    let w = m.register("w", &[8], Init::Constant(1.0)).unwrap();
    assert!(matches!(
        m.backward(),
        Err(Error::WrongStage { stage: "idle", .. })
    ));
    let fwd = m.forward().unwrap();
    drop(fwd.fetch(&[w]).unwrap());
    assert_eq!(fwd.stage(), Stage::Forward);
    fwd.finish().unwrap();
    assert!(matches!(
        m.forward(),
        Err(Error::WrongStage {
            stage: "backward",
            ..
        })
    ));
    let bwd = m.backward().unwrap();
    assert!(matches!(
        bwd.fetch(&[TensorId(9)]),
        Err(Error::UnknownTensor { id: 9 })
    ));
    let g = bwd.fetch(&[w]).unwrap();
    g.grad(0).unwrap().upload_f32(&[2.0; 8]).unwrap();
    assert!(
        matches!(g.param(0), Err(Error::Conflict { what, .. }) if what.starts_with("reading the parameter")),
        "the gradient overwrote the parameter"
    );
    drop(g);
    bwd.finish().unwrap();
    assert!(matches!(
        m.forward(),
        Err(Error::WrongStage {
            stage: "optimizer",
            ..
        })
    ));
    assert_eq!(m.read(w).unwrap(), vec![2.0; 8]);
}

#[test]
fn tied_gradients_add_up() {
    for dtype in [DType::F32, DType::F16] {
        let mut m = manager(dtype);
        let w = m.register("w", &[4], Init::Constant(1.0)).unwrap();
        let b = m.register("b", &[4], Init::Constant(1.0)).unwrap();
        let fwd = m.forward().unwrap();
        for _ in 0..3 {
            drop(fwd.fetch(&[w, b]).unwrap());
        }
        fwd.finish().unwrap();
        let bwd = m.backward().unwrap();
        let shares = [
            [0.5f32, 1.0, -2.0, 0.25],
            [1.5, 2.0, 4.0, 0.25],
            [1.0, 0.0, 0.5, 8.0],
        ];
        for (k, share) in shares.iter().enumerate() {
            let g = bwd.fetch(&[w, b]).unwrap();
            // the parameter is intact until the last share is written
            assert_eq!(g.param(0).unwrap().to_f32().unwrap(), vec![1.0; 4]);
            if k < 2 {
                assert!(g.grad(0).is_err(), "not the last use");
            }
            // shares from the device in the parameter dtype, or from the host in f32
            if k == 1 {
                let buf = bwd.pool().alloc(4 * dtype.size()).unwrap();
                let view = buf.view(0, 4 * dtype.size()).unwrap();
                let bytes = crate::chunk::encode(share, dtype);
                bwd.device()
                    .copy_h2d(
                        bwd.stream(),
                        crate::device::HostBuffer::from_slice(&bytes).unwrap(),
                        view,
                    )
                    .unwrap()
                    .wait()
                    .unwrap();
                g.accumulate_grad(0, view, dtype).unwrap();
            } else {
                g.accumulate_grad_f32(0, share).unwrap();
            }
            g.accumulate_grad_f32(1, share).unwrap();
            if k < 2 {
                assert!(
                    g.grad(1).is_err(),
                    "accumulated shares end with accumulate_grad"
                );
            }
        }
        bwd.finish().unwrap();
        let sum: Vec<f32> = (0..4).map(|i| shares.iter().map(|s| s[i]).sum()).collect();
        assert_eq!(m.read(w).unwrap(), sum, "{dtype}");
        assert_eq!(m.read(b).unwrap(), sum, "{dtype}");
        assert_eq!(state(&m, w), TensorState::HoldAfterBwd);
    }
}

#[test]
fn a_pass_reports_a_gradient_left_unfinished() {
    let mut m = manager(DType::F32);
    let w = m.register("w", &[4], Init::Constant(1.0)).unwrap();
    let fwd = m.forward().unwrap();
    drop(fwd.fetch(&[w]).unwrap());
    drop(fwd.fetch(&[w]).unwrap());
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    let g = bwd.fetch(&[w]).unwrap();
    g.accumulate_grad_f32(0, &[1.0; 4]).unwrap();
    assert!(matches!(
        g.accumulate_grad_f32(0, &[1.0; 3]),
        Err(Error::SizeMismatch { .. })
    ));
    drop(g);
    assert!(matches!(
        bwd.finish(),
        Err(Error::Conflict { what, .. }) if what == "finishing the backward pass"
    ));
}

#[test]
fn shares_taken_back_leave_the_last_use_to_write_the_total() {
    let mut m = manager(DType::F32);
    let w = m.register("w", &[4], Init::Constant(1.0)).unwrap();
    let fwd = m.forward().unwrap();
    for _ in 0..3 {
        drop(fwd.fetch(&[w]).unwrap());
    }
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    for share in [[1.0f32, 2.0, 3.0, 4.0], [0.5; 4]] {
        let g = bwd.fetch(&[w]).unwrap();
        g.accumulate_grad_f32(0, &share).unwrap();
    }
    let g = bwd.fetch(&[w]).unwrap();
    let sum = g.take_shares(0).unwrap().expect("two shares");
    let bytes = bwd
        .device()
        .download(bwd.stream(), sum.view(0, 16).unwrap())
        .unwrap();
    let got: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
    assert_eq!(got, [1.5, 2.5, 3.5, 4.5], "the f32 sum of the shares");
    assert!(g.take_shares(0).unwrap().is_none(), "taken once");
    // the last use writes what the caller makes of the sum, here twice it
    g.accumulate_grad_f32(0, &[3.0, 5.0, 7.0, 9.0]).unwrap();
    drop(g);
    bwd.finish().unwrap();
    assert_eq!(m.read(w).unwrap(), [3.0, 5.0, 7.0, 9.0]);
}

/// Uses declared in the forward pass hold the gradient back to the last backward use, as
/// fetches would, without a moment of their own; declaring before the pass fetched the tensor,
/// or in a recompute pass, is refused.
#[test]
fn declared_forward_uses_hold_the_gradient_to_the_last_backward_use() {
    let run = |declare: bool| {
        let mut m = manager(DType::F32);
        let w = m.register("w", &[4], Init::Constant(1.0)).unwrap();
        let fwd = m.forward().unwrap();
        if declare {
            assert!(fwd.declare_uses(&[w], 2).is_err(), "not fetched yet");
            drop(fwd.fetch(&[w]).unwrap());
            fwd.declare_uses(&[w], 2).unwrap();
        } else {
            for _ in 0..3 {
                drop(fwd.fetch(&[w]).unwrap());
            }
        }
        fwd.finish().unwrap();
        let mut bwd = m.backward().unwrap();
        let re = bwd.recompute().unwrap();
        assert!(re.declare_uses(&[w], 1).is_err(), "not in a recompute pass");
        re.finish().unwrap();
        for share in [[1.0f32, 2.0, 3.0, 4.0], [0.5; 4], [0.25; 4]] {
            let g = bwd.fetch(&[w]).unwrap();
            g.accumulate_grad_f32(0, &share).unwrap();
        }
        bwd.finish().unwrap();
        let grad = m.read(w).unwrap();
        m.skip_step().unwrap();
        (grad, m.tide_points().len())
    };
    let (fetched, fetched_moments) = run(false);
    let (declared, declared_moments) = run(true);
    assert_eq!(
        fetched,
        [1.75, 2.75, 3.75, 4.75],
        "the sum of the three shares"
    );
    assert_eq!(declared, fetched, "declared uses write at the same use");
    assert_eq!(
        declared_moments + 2,
        fetched_moments,
        "no moment per declared use"
    );
}
