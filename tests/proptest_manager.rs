//! Random event sequences, legal and illegal, on random models and budgets: every accepted event
//! takes tensors along legal edges only, a refused one changes nothing, no byte of any tensor is
//! lost or corrupted (checked against a shadow copy), not even through a checkpoint saved and
//! loaded back, the device never holds more chunk bytes than its capacity, and a chunk with a
//! COMPUTE tensor never moves.

#![allow(clippy::needless_range_loop)] // index loops mirror the shadow model element by element
use proptest::prelude::*;
use tidemem::chunk::{decode, encode, ChunkManager, ManagerConfig};
use tidemem::device::{Device, SimConfig};
use tidemem::tensor::ChunkKind;
use tidemem::tensor::{next_state, Init, Stage, TensorId, TensorState, TrainEvent};
use tidemem::tide::Policy;
use tidemem::DType;

#[derive(Clone, Debug)]
enum Op {
    Fetch(Stage, Vec<usize>),
    Release(Stage, Vec<usize>),
    WriteGrad(usize, u32),
    EndForward,
    EndBackward,
    Step,
    Skip,
    /// Save a checkpoint and go on with a new manager that loads it (between iterations only).
    Checkpoint,
}

fn op(n: usize) -> impl Strategy<Value = Op> {
    let set = proptest::collection::btree_set(0..n, 1..=n.min(3))
        .prop_map(|s| s.into_iter().collect::<Vec<_>>());
    let stage = prop_oneof![Just(Stage::Forward), Just(Stage::Backward)];
    prop_oneof![
        4 => (stage.clone(), set.clone()).prop_map(|(s, t)| Op::Fetch(s, t)),
        4 => (stage, set).prop_map(|(s, t)| Op::Release(s, t)),
        2 => (0..n, any::<u32>()).prop_map(|(t, s)| Op::WriteGrad(t, s)),
        1 => Just(Op::EndForward),
        1 => Just(Op::EndBackward),
        1 => Just(Op::Step),
        1 => Just(Op::Skip),
        1 => Just(Op::Checkpoint),
    ]
}

/// Turns a random choice into the next event of a plausible training loop, so that sequences
/// reach backward and the optimizer, not only the first refusals.
#[derive(Default)]
struct Driver {
    stage: u8, // 0 forward, 1 backward, 2 optimizer
    fetched: Vec<usize>,
    fwd: Vec<u32>,
    bwd: Vec<u32>,
}

impl Driver {
    fn next(&self, c: u8, set: &[usize], seed: u32, n: usize) -> Vec<Op> {
        let free: Vec<usize> = set
            .iter()
            .copied()
            .filter(|&i| i < n && !self.fetched.contains(&i))
            .collect();
        match self.stage {
            0 if self.fwd.iter().all(|&f| f == 0) && c < 12 => vec![Op::Checkpoint],
            0 if !self.fetched.is_empty() && (c < 140 || free.is_empty()) => {
                vec![Op::Release(Stage::Forward, self.fetched.clone())]
            }
            0 if c > 225 || free.is_empty() => vec![Op::EndForward],
            0 => vec![Op::Fetch(Stage::Forward, free)],
            1 if !self.fetched.is_empty() => {
                let mut ops: Vec<Op> = self
                    .fetched
                    .iter()
                    .filter(|&&i| self.bwd[i] >= self.fwd[i])
                    .map(|&i| Op::WriteGrad(i, seed ^ i as u32))
                    .collect();
                ops.push(Op::Release(Stage::Backward, self.fetched.clone()));
                ops
            }
            1 => {
                let want: Vec<usize> = free
                    .into_iter()
                    .filter(|&i| self.bwd[i] < self.fwd[i])
                    .collect();
                if want.is_empty() || c > 235 {
                    vec![Op::EndBackward]
                } else {
                    vec![Op::Fetch(Stage::Backward, want)]
                }
            }
            _ if c > 240 => vec![Op::Skip],
            _ => vec![Op::Step],
        }
    }

    fn applied(&mut self, op: &Op, n: usize) {
        if self.fwd.len() != n {
            self.fwd = vec![0; n];
            self.bwd = vec![0; n];
        }
        match op {
            Op::Fetch(s, t) => {
                for &i in t {
                    if *s == Stage::Forward {
                        self.fwd[i] += 1
                    } else {
                        self.bwd[i] += 1
                    }
                }
                self.fetched = t.clone();
            }
            Op::Release(..) => self.fetched.clear(),
            Op::EndForward => self.stage = 1,
            Op::EndBackward => self.stage = 2,
            Op::Step | Op::Skip => {
                *self = Driver::default();
            }
            Op::WriteGrad(..) | Op::Checkpoint => {}
        }
    }
}

fn round(v: &[f32]) -> Vec<f32> {
    decode(&encode(v, DType::F16), DType::F16)
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Tide),
        Just(Policy::PatrickStar),
        Just(Policy::Lru),
        (0.0f64..=1.0).prop_map(|device_fraction| Policy::Static { device_fraction }),
    ]
}

/// Which event an op applies to its tensors (for checking that state changes are legal edges).
fn events(op: &Op) -> Vec<TrainEvent> {
    match op {
        Op::Fetch(Stage::Forward, _) => vec![TrainEvent::BeforeFwdOp],
        Op::Fetch(_, _) => vec![TrainEvent::BeforeBwdOp],
        Op::Release(Stage::Forward, _) => vec![TrainEvent::AfterFwdOp],
        Op::Release(_, _) => vec![TrainEvent::AfterBwdOp, TrainEvent::AfterLastBwdOp],
        Op::EndForward => vec![TrainEvent::EndForward],
        Op::Step | Op::Skip => vec![
            TrainEvent::EndStep,
            TrainEvent::BeforeOptim,
            TrainEvent::AfterOptim,
        ],
        _ => vec![],
    }
}

fn legal_path(from: TensorState, to: TensorState, evs: &[TrainEvent]) -> bool {
    if from == to {
        return true;
    }
    // one edge, or BeforeOptim then AfterOptim (the optimizer lists)
    evs.iter().any(|&e| next_state(from, e) == Some(to))
        || evs.iter().any(|&a| {
            next_state(from, a)
                .is_some_and(|mid| evs.iter().any(|&b| next_state(mid, b) == Some(to)))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_event_sequences_keep_every_invariant(
        sizes in proptest::collection::vec(1usize..40, 1..8),
        chunk_elems in 16usize..64,
        capacity_chunks in 1u64..6,
        pol in policy(),
        raw in proptest::collection::vec((0u8..10, any::<u8>(), op(8), any::<u32>()), 1..80),
    ) {
        let n = sizes.len();
        let capacity = capacity_chunks * chunk_elems as u64 * 2 + 64;
        let dev = Device::sim(SimConfig::with_capacity(capacity as usize)).unwrap();
        let mut cfg = ManagerConfig::new(chunk_elems, pol);
        cfg.scheduler.overall_fraction = 1.0;
        cfg.scheduler.warmup_chunk_fraction = 1.0;
        let new_manager = || {
            let mut m = ChunkManager::new(dev.clone(), cfg.clone()).unwrap();
            for (i, &s) in sizes.iter().enumerate() {
                // initial values that a lost load would show
                m.register(&format!("t{i}"), &[s], Init::Constant(7.0)).unwrap();
            }
            m
        };
        let mut m = ChunkManager::new(dev.clone(), cfg.clone()).unwrap();
        let mut master: Vec<Vec<f32>> = Vec::new();
        let mut param: Vec<Vec<f32>> = Vec::new();
        for (i, &s) in sizes.iter().enumerate() {
            let init = Init::Uniform { seed: i as u64, lo: -1.0, hi: 1.0 };
            m.register(&format!("t{i}"), &[s], init.clone()).unwrap();
            let mut v = vec![0.0; s];
            init.fill(&mut v);
            param.push(round(&v));
            master.push(v);
        }
        let mut grad = vec![false; n];
        let mut driver = Driver::default();
        let file = tempfile::NamedTempFile::new().unwrap();
        for (kind, c, random, seed) in raw {
          // one step in ten is an arbitrary (mostly illegal) event
          let set: Vec<usize> = match &random { Op::Fetch(_, t) | Op::Release(_, t) => t.clone(), _ => vec![0] };
          let planned = if kind == 0 { vec![random] } else { driver.next(c, &set, seed, n) };
          for op in planned {
            // tensors beyond the model are clipped away
            let op = match op {
                Op::Fetch(s, t) => Op::Fetch(s, t.into_iter().filter(|&i| i < n).collect()),
                Op::Release(s, t) => Op::Release(s, t.into_iter().filter(|&i| i < n).collect()),
                Op::WriteGrad(t, s) if t >= n => Op::WriteGrad(0, s),
                o => o,
            };
            let before: Vec<[TensorState; 4]> = (0..n)
                .map(|i| ChunkKind::ALL.map(|k| m.state(TensorId(i as u32), k).unwrap()))
                .collect();
            // buffers of chunks with COMPUTE tensors
            let pinned: Vec<(usize, Option<u64>)> = (0..n)
                .filter(|&i| before[i][0] == TensorState::Compute)
                .map(|i| {
                    let g = m.tensor_info(TensorId(i as u32)).unwrap().2.group as usize;
                    (g, m.device_buffer_id(g, ChunkKind::Param))
                })
                .collect();
            let ids = |t: &[usize]| t.iter().map(|&i| TensorId(i as u32)).collect::<Vec<_>>();
            let result = match &op {
                Op::Fetch(s, t) => m.fetch(&ids(t), *s).map(drop),
                Op::Release(s, t) => m.release(&ids(t), *s),
                Op::WriteGrad(t, seed) => {
                    let g: Vec<f32> = (0..sizes[*t]).map(|j| ((seed.wrapping_add(j as u32) % 1000) as f32 - 500.0) / 256.0).collect();
                    let r = m.write_grad(TensorId(*t as u32), &g);
                    if r.is_ok() {
                        param[*t] = round(&g);
                        grad[*t] = true;
                    }
                    r
                }
                Op::EndForward => m.end_forward(),
                Op::EndBackward => m.end_backward(),
                Op::Step => {
                    let r = m.step_host(|mut g| {
                        let p = g.param_f32();
                        for &(_, off, len, has) in &g.tensors {
                            if has {
                                for j in off..off + len {
                                    g.master[j] -= 0.5 * p[j];
                                    g.momentum[j] += 1.0;
                                }
                            }
                        }
                        g.store_params();
                        Ok(())
                    });
                    let r = r.and_then(|_| m.end_step());
                    if r.is_ok() {
                        for i in 0..n {
                            if grad[i] {
                                for j in 0..sizes[i] {
                                    master[i][j] -= 0.5 * param[i][j];
                                }
                            }
                            param[i] = round(&master[i]);
                        }
                        grad = vec![false; n];
                    }
                    r
                }
                Op::Skip => {
                    let r = m.skip_step();
                    if r.is_ok() {
                        grad = vec![false; n];
                    }
                    r
                }
                Op::Checkpoint => m.save_checkpoint(file.path(), &Default::default()).map(|()| {
                    // the old manager's device memory goes back before the new one loads
                    m = new_manager();
                    m.load_checkpoint(file.path()).unwrap();
                }),
            };
            if result.is_ok() {
                driver.applied(&op, n);
            }
            let after: Vec<[TensorState; 4]> = (0..n)
                .map(|i| ChunkKind::ALL.map(|k| m.state(TensorId(i as u32), k).unwrap()))
                .collect();
            let evs = events(&op);
            for i in 0..n {
                for k in 0..4 {
                    if matches!(op, Op::Checkpoint) && result.is_ok() {
                        // a loaded tensor has a payload: FREE ones are HOLD
                        let held = before[i][k] == TensorState::Free && after[i][k] == TensorState::Hold;
                        prop_assert!(before[i][k] == after[i][k] || held,
                            "a checkpoint took t{} list {} {} -> {}", i, k, before[i][k], after[i][k]);
                    } else if result.is_err() && !matches!(op, Op::Step) {
                        prop_assert_eq!(before[i][k], after[i][k], "refused {:?} changed t{} list {}", &op, i, k);
                    } else {
                        prop_assert!(legal_path(before[i][k], after[i][k], &evs),
                            "{:?}: t{} list {} went {} -> {}", &op, i, k, before[i][k], after[i][k]);
                    }
                }
            }
            for (g, id) in pinned {
                let still = (0..n).any(|i| after[i][0] == TensorState::Compute
                    && m.tensor_info(TensorId(i as u32)).unwrap().2.group as usize == g);
                if still {
                    prop_assert_eq!(m.device_buffer_id(g, ChunkKind::Param), id, "a COMPUTE chunk moved");
                }
            }
            let used = m.scheduler().map_or(0, |s| s.device_used());
            prop_assert!(used <= capacity);
            { let mi = dev.mem_info().unwrap(); prop_assert!(mi.free <= mi.total && mi.total as u64 == capacity); }
            prop_assert_eq!(used, m.usage().device.iter().sum::<u64>());
            for i in 0..n {
                let id = TensorId(i as u32);
                prop_assert_eq!(m.read(id).unwrap(), param[i].clone(), "t{} param after {:?}", i, &op);
                prop_assert_eq!(m.master(id).unwrap(), master[i].clone(), "t{} master after {:?}", i, &op);
            }
          }
        }
    }
}
