//! The trainer API over both stores: passes, guards, device-side gradient writes, typed errors.

mod common;

use tidemem::prelude::*;
use tidemem::store::{GradView, Guard, ReadView};
use tidemem::tensor::TensorState;

const N: usize = 16;

/// The model both stores train: `w` (used twice, tied) and `b`, one chunk group each.
fn register(s: &mut impl ParamStore) -> Result<(TensorId, TensorId)> {
    let w = s.register("w", &[4, 4], Init::Constant(0.5))?;
    let b = s.register("b", &[N], Init::Constant(-0.25))?;
    Ok((w, b))
}

/// One iteration, generic over the store: forward reads `w` twice and `b` once into pool
/// buffers (a device copy stands in for the GEMM that reads them in place); backward writes
/// `dw = y1 + y2` (tied, accumulated on the device) and `db = yb` (straight into the slot).
/// Returns the gradients as the store holds them after backward, for the tensors this rank
/// can read, and the step's report.
fn iteration<S: ParamStore>(
    s: &mut S,
    (w, b): (TensorId, TensorId),
    adam: &mut HybridAdam,
) -> Result<(Vec<Option<Vec<f32>>>, StepReport)> {
    let dtype = s.param_dtype();
    let fwd = s.forward()?;
    let mut saved = Vec::new();
    for ids in [&[w, b][..], &[w][..]] {
        let g = fwd.fetch(ids)?;
        for i in 0..g.len() {
            let p: ReadView<'_> = g.param(i)?;
            assert_eq!(p.dtype(), dtype);
            assert_eq!(p.numel(), N);
            let shape: &[usize] = if g.ids()[i] == w { &[4, 4] } else { &[N] };
            assert_eq!(p.shape(), shape);
            let y = fwd.pool().alloc(p.len_bytes())?;
            p.copy_to(y.view(0, p.len_bytes())?)?;
            saved.push(y);
        }
    }
    fwd.finish()?;
    let bwd = s.backward()?;
    let yw2 = saved.pop().expect("second use of w");
    let yb = saved.pop().expect("b");
    let yw1 = saved.pop().expect("first use of w");
    let bytes = N * dtype.size();
    {
        let g = bwd.fetch(&[w])?;
        g.accumulate_grad(0, yw2.view(0, bytes)?, dtype)?;
    }
    {
        let g: Guard<'_, Backward> = bwd.fetch(&[b, w])?;
        let db: GradView<'_> = g.grad(0)?;
        assert_eq!(db.shape(), &[N]);
        bwd.device()
            .copy_d2d(bwd.stream(), yb.view(0, bytes)?, db)?;
        g.accumulate_grad(1, yw1.view(0, bytes)?, dtype)?;
    }
    bwd.finish()?;
    let grads = [w, b].iter().map(|&id| s.read(id).ok()).collect();
    Ok((grads, s.step(adam)?))
}

fn adam() -> HybridAdam {
    HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1))).unwrap()
}

fn chunk_manager() -> ChunkManager {
    ChunkManager::new(common::sim(1 << 20), ManagerConfig::new(N, Policy::Tide)).unwrap()
}

#[test]
fn both_stores_run_one_generic_trainer() {
    let mut m = chunk_manager();
    let ids = register(&mut m).unwrap();
    let mut opt = adam();
    let (grads, report) = iteration(&mut m, ids, &mut opt).unwrap();
    assert_eq!(report.outcome, StepOutcome::Stepped);
    // tied: the two uses' shares add up; the bias's gradient went straight into its slot
    assert_eq!(grads[0], Some(vec![1.0; N]));
    assert_eq!(grads[1], Some(vec![-0.25; N]));
    let single = [m.master(ids.0).unwrap(), m.master(ids.1).unwrap()];
    assert_eq!(single[0], vec![0.4; N]);

    // the same function on two ZeRO ranks, each owning one group: the averaged gradients and
    // the stepped masters are the single process's
    let devs = (0..2).map(|_| common::sim(1 << 20)).collect();
    let comms = Communicator::local(devs).unwrap();
    let got = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                sc.spawn(move || {
                    let mut z = ZeroManager::new(c, ManagerConfig::new(N, Policy::Tide)).unwrap();
                    let ids = register(&mut z).unwrap();
                    let mut opt = adam();
                    let (grads, report) = iteration(&mut z, ids, &mut opt).unwrap();
                    let own = usize::from(!z.owns(ids.0));
                    let id = [ids.0, ids.1][own];
                    (
                        own,
                        grads[own].clone(),
                        report.outcome,
                        z.master(id).unwrap(),
                    )
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for (own, grad, outcome, master) in got {
        assert_eq!(grad, grads[own], "tensor {own}");
        assert_eq!(outcome, StepOutcome::Stepped);
        assert_eq!(master, single[own], "tensor {own}");
    }
}

#[test]
fn the_trainer_api_runs_alike_on_cuda() {
    let Some(gpu) = common::cuda("the_trainer_api_runs_alike_on_cuda") else {
        return;
    };
    let mut results = Vec::new();
    for dev in [common::sim(1 << 20), gpu] {
        let mut m = ChunkManager::new(dev, ManagerConfig::new(N, Policy::Tide)).unwrap();
        let ids = register(&mut m).unwrap();
        let (grads, _) = iteration(&mut m, ids, &mut adam()).unwrap();
        results.push((grads, m.master(ids.0).unwrap(), m.master(ids.1).unwrap()));
    }
    assert_eq!(results[0], results[1]);
}

/// A layer whose body fails after its fetch (as a kernel launch would), returning early with
/// `?` while its guard is alive.
fn failing_layer(pass: &BackwardPass<'_>, w: TensorId) -> Result<()> {
    let g = pass.fetch(&[w])?;
    let dw = g.grad(0)?;
    let too_short = pass.pool().alloc(4)?;
    pass.device()
        .copy_d2d(pass.stream(), too_short.view(0, 4)?, dw)?;
    unreachable!("the copy sizes differ")
}

#[test]
fn an_error_path_leaves_nothing_fetched() {
    let mut m = chunk_manager();
    let (w, _) = register(&mut m).unwrap();
    let fwd = m.forward().unwrap();
    drop(fwd.fetch(&[w]).unwrap());
    fwd.finish().unwrap();
    let bwd = m.backward().unwrap();
    assert!(matches!(
        failing_layer(&bwd, w),
        Err(Error::SizeMismatch { .. })
    ));
    bwd.finish().unwrap(); // nothing left in COMPUTE
    assert_eq!(
        m.state(w, tidemem::tensor::ChunkKind::Param).unwrap(),
        TensorState::HoldAfterBwd
    );
}

#[test]
fn stage_and_tensor_errors_are_typed_on_both_stores() {
    fn check(s: &mut impl ParamStore, w: TensorId) {
        assert!(matches!(s.backward(), Err(Error::WrongStage { .. })));
        assert!(matches!(
            s.fetch(&[w], Stage::Optimizer),
            Err(Error::WrongStage { .. })
        ));
        assert!(matches!(
            s.forward().unwrap().fetch(&[TensorId(99)]),
            Err(Error::UnknownTensor { id: 99 })
        ));
        assert!(matches!(
            s.read(TensorId(99)),
            Err(Error::UnknownTensor { id: 99 })
        ));
        assert!(matches!(s.end_backward(), Err(Error::WrongStage { .. })));
        // the stage-explicit calls still refuse a release while a view is alive
        let views = s.fetch(&[w], Stage::Forward).unwrap();
        assert!(matches!(
            s.release(&[w], Stage::Forward),
            Err(Error::ViewAlive { .. })
        ));
        drop(views);
        s.release(&[w], Stage::Forward).unwrap();
        s.end_forward().unwrap();
        assert!(matches!(s.forward(), Err(Error::WrongStage { .. })));
        let dyn_store: &mut dyn ParamStore = s;
        let bwd = dyn_store.backward().unwrap();
        assert_eq!(bwd.stage(), Stage::Backward);
    }
    let mut m = chunk_manager();
    let (w, _) = register(&mut m).unwrap();
    check(&mut m, w);

    let comms = Communicator::local(vec![common::sim(1 << 20)]).unwrap();
    let mut z = ZeroManager::new(
        comms.into_iter().next().unwrap(),
        ManagerConfig::new(N, Policy::Tide),
    )
    .unwrap();
    let (w, _) = register(&mut z).unwrap();
    check(&mut z, w);
}

#[test]
fn stores_name_the_same_things_alike() {
    let mut m = chunk_manager();
    register(&mut m).unwrap();
    let comms = Communicator::local(vec![common::sim(1 << 20)]).unwrap();
    let mut z = ZeroManager::new(
        comms.into_iter().next().unwrap(),
        ManagerConfig::new(N, Policy::Tide),
    )
    .unwrap();
    register(&mut z).unwrap();
    // the same calls on either, inherent or through the trait
    assert_eq!(
        m.compute_stream().index(),
        ParamStore::compute_stream(&m).index()
    );
    assert_eq!(z.compute_stream().index(), z.stream().index());
    assert_eq!(z.device().id(), ParamStore::device(&z).id());
    assert_eq!(m.pool().stats().allocated, 0);
    assert_eq!(z.pool().stats().allocated, 0);
    assert_eq!((m.stage(), z.stage()), (None, None));
    assert_eq!(
        m.tensor_info(TensorId(0)).unwrap().1,
        z.tensor_info(TensorId(0)).unwrap().1
    );
}

#[test]
fn public_types_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<ChunkManager>();
    send_sync::<ZeroManager>();
    send_sync::<Error>();
    send_sync::<tidemem::chunk::TensorView>();
    send_sync::<CachingAllocator>();
    send_sync::<Device>();
    // a pass may move to another thread with its store (it is not shared: guards borrow it)
    send::<ForwardPass<'static>>();
    send::<BackwardPass<'static>>();
    send::<Box<dyn ParamStore>>();
}

/// PipeDream-2BW's store calls: an ahead fetch reads a tensor this iteration does not use and
/// counts no use (the step leaves it as it was), and is refused for a tensor in use; a copy of
/// tensor state is refused mid-iteration (the parameter list until the iteration ends), across
/// shapes, onto itself, and from parameter chunks that may hold gradients; a ZeRO rank makes
/// the same checks.
#[test]
fn ahead_fetches_and_state_copies_check_their_moment() {
    use tidemem::tensor::ChunkKind;
    let mut m = chunk_manager();
    let (w, b) = register(&mut m).unwrap();
    let w2 = m.register("w2", &[4, 4], Init::Constant(0.0)).unwrap();
    let lists = ChunkKind::ALL;
    // every list of w into w2, between iterations
    m.copy_state(&[(w, w2)], &lists).unwrap();
    assert_eq!(m.read(w2).unwrap(), vec![0.5; N]);
    assert!(matches!(
        m.copy_state(&[(w, b)], &lists),
        Err(Error::Conflict { what, .. }) if what.starts_with("copy_state from 'w'")
    ));
    assert!(matches!(
        m.copy_state(&[(w, w)], &lists),
        Err(Error::Conflict { what, with }) if what.starts_with("copy_state from 'w'")
            && with.starts_with("'w'")
    ));

    let fwd = m.forward().unwrap();
    fwd.fetch(&[w, b]).unwrap().release().unwrap();
    fwd.finish().unwrap();
    let during = m.copy_state(&[(w, w2)], &[ChunkKind::Master]);
    assert!(
        matches!(during, Err(Error::WrongStage { .. })),
        "{during:?}"
    );
    let mut bwd = m.backward().unwrap();
    {
        let ahead = bwd.ahead().unwrap();
        let in_use = ahead.fetch(&[w]).map(drop);
        assert!(
            matches!(&in_use, Err(Error::Conflict { what, .. }) if what == "a fetch ahead of 'w'"),
            "{in_use:?}"
        );
        // twice: an ahead fetch counts no use
        for _ in 0..2 {
            let g = ahead.fetch(&[w2]).unwrap();
            assert_eq!(g.param(0).unwrap().to_f32().unwrap(), vec![0.5; N]);
            g.release().unwrap();
        }
        ahead.finish().unwrap();
    }
    let g = bwd.fetch(&[w, b]).unwrap();
    g.grad(0).unwrap().upload_f32(&[1.0; N]).unwrap();
    g.grad(1).unwrap().upload_f32(&[1.0; N]).unwrap();
    g.release().unwrap();
    bwd.finish().unwrap();
    assert_eq!(m.state(w2, ChunkKind::Param).unwrap(), TensorState::Hold);
    // after the backward pass: the optimizer lists copy, the parameters do not
    m.copy_state(&[(w2, w)], &[ChunkKind::Master]).unwrap();
    let params = m.copy_state(&[(w2, w)], &[ChunkKind::Param]);
    assert!(
        matches!(params, Err(Error::WrongStage { .. })),
        "{params:?}"
    );
    m.skip_step().unwrap();
    // skipped: the parameter chunks may hold gradients
    let dirty = m.copy_state(&[(w2, w)], &[ChunkKind::Param]);
    assert!(
        matches!(&dirty, Err(Error::Conflict { with, .. }) if with.contains("may hold gradients")),
        "{dirty:?}"
    );

    let comms = Communicator::local(vec![common::sim(1 << 20)]).unwrap();
    let mut z = ZeroManager::new(
        comms.into_iter().next().unwrap(),
        ManagerConfig::new(N, Policy::Tide),
    )
    .unwrap();
    let (w, b) = register(&mut z).unwrap();
    let copy = ParamStore::copy_state(&mut z, &[(w, b)], &lists);
    assert!(
        matches!(&copy, Err(Error::Conflict { what, .. }) if what.starts_with("copy_state from")),
        "{copy:?}"
    );
    let fwd = z.forward().unwrap();
    fwd.fetch(&[w]).unwrap().release().unwrap();
    fwd.finish().unwrap();
    let mut bwd = z.backward().unwrap();
    let ahead = bwd.ahead().unwrap();
    let in_use = ahead.fetch(&[w]).map(drop);
    assert!(
        matches!(&in_use, Err(Error::Conflict { what, .. }) if what == "a fetch ahead of 'w'"),
        "{in_use:?}"
    );
    let g = ahead.fetch(&[b]).unwrap();
    assert_eq!(g.param(0).unwrap().to_f32().unwrap(), vec![-0.25; N]);
    g.release().unwrap();
    ahead.finish().unwrap();
    bwd.finish().unwrap();
}
