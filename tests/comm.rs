//! The conformance suite every communicator backend passes: the in-process backend at world
//! sizes 1–8, NCCL at world size 1 on CUDA device 0 and across 2 and 4 processes when NCCL can
//! run (a GPU, or the emulator with its NCCL stand-in; skipped otherwise).
//! Values are small integers, so every reduction order gives the same bits.

mod common;

use std::time::Duration;

use tidemem::comm::{Communicator, Elem, ReduceOp, DEFAULT_TIMEOUT};
use tidemem::device::{Device, Stream};
use tidemem::Error;

/// Runs `f` on every rank, one thread each, and returns the results in rank order.
fn on_ranks<R: Send>(comms: &[Communicator], f: impl Fn(&Communicator) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

fn local(world: usize) -> Vec<Communicator> {
    let devs = (0..world).map(|_| common::sim(64 << 20)).collect();
    Communicator::local(devs).unwrap()
}

/// Little-endian bytes of `v` as `elem` (v are small integers, exact in every type).
fn enc(v: &[i64], elem: Elem) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match elem {
            Elem::U8 => vec![x as u8],
            Elem::I32 => (x as i32).to_le_bytes().to_vec(),
            Elem::U32 => (x as u32).to_le_bytes().to_vec(),
            Elem::I64 => x.to_le_bytes().to_vec(),
            Elem::U64 => (x as u64).to_le_bytes().to_vec(),
            Elem::F16 => half::f16::from_f64(x as f64).to_le_bytes().to_vec(),
            Elem::BF16 => half::bf16::from_f64(x as f64).to_le_bytes().to_vec(),
            Elem::F32 => (x as f32).to_le_bytes().to_vec(),
            Elem::F64 => (x as f64).to_le_bytes().to_vec(),
        })
        .collect()
}

fn value(rank: usize, i: usize, salt: i64) -> i64 {
    ((rank as i64 * 7 + i as i64 * 3 + salt) % 13) - 4
}

fn expect_reduce(world: usize, n: usize, salt: i64, op: ReduceOp, elem: Elem) -> Vec<i64> {
    (0..n)
        .map(|i| {
            let vals = (0..world).map(|r| value(r, i, salt));
            match op {
                ReduceOp::Sum => vals.sum(),
                ReduceOp::Max => vals.max().unwrap(),
                ReduceOp::Min => vals.min().unwrap(),
                ReduceOp::Avg => {
                    let s: i64 = vals.sum();
                    match elem {
                        Elem::U8 | Elem::I32 | Elem::I64 => s / world as i64,
                        // exact halves/quarters only when representable: compare in f64 below
                        _ => s,
                    }
                }
            }
        })
        .collect()
}

fn stream(c: &Communicator) -> Stream {
    c.device().new_stream().unwrap()
}

fn up(d: &Device, s: &Stream, b: &[u8]) -> tidemem::device::DeviceBuffer {
    if b.is_empty() {
        return d.alloc(0).unwrap();
    }
    d.upload(s, b).unwrap()
}

fn floats(b: &[u8], elem: Elem) -> Vec<f64> {
    b.chunks_exact(elem.size())
        .map(|c| match elem {
            Elem::U8 => c[0] as f64,
            Elem::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            Elem::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            Elem::U32 => u32::from_le_bytes(c.try_into().unwrap()) as f64,
            Elem::U64 => u64::from_le_bytes(c.try_into().unwrap()) as f64,
            Elem::F16 => half::f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            Elem::BF16 => half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            Elem::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            Elem::F64 => f64::from_le_bytes(c.try_into().unwrap()),
        })
        .collect()
}

const ELEMS: [Elem; 5] = [Elem::F32, Elem::F16, Elem::BF16, Elem::I32, Elem::F64];
const COUNTS: [usize; 3] = [1, 7, 1001];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg];

fn check_avg(got: &[f64], sums: &[i64], world: usize, elem: Elem) {
    for (g, &s) in got.iter().zip(sums) {
        let want = s as f64 / world as f64;
        let tol = match elem {
            Elem::F16 => 1e-3 * want.abs().max(1.0),
            Elem::BF16 => 1e-2 * want.abs().max(1.0),
            _ => 1e-6,
        };
        assert!((g - want).abs() <= tol, "avg {g} vs {want} ({elem})");
    }
}

/// The whole suite on one group of communicators, a thread per rank.
fn conformance(comms: &[Communicator]) {
    on_ranks(comms, conformance_rank);
}

/// One rank's part of the suite.
fn conformance_rank(c: &Communicator) {
    let world = c.world();
    {
        let (d, s, r) = (c.device(), stream(c), c.rank());
        for elem in ELEMS {
            for n in COUNTS {
                let es = elem.size();
                let mine: Vec<i64> = (0..n).map(|i| value(r, i, 1)).collect();
                let all: Vec<i64> = (0..world)
                    .flat_map(|q| (0..n).map(move |i| value(q, i, 1)))
                    .collect();
                // all-gather, out of place and in place
                let send = up(d, &s, &enc(&mine, elem));
                let recv = d.alloc(n * es * world).unwrap();
                c.all_gather(&s, (&send).into(), (&recv).into(), elem)
                    .unwrap();
                assert_eq!(
                    d.download(&s, &recv).unwrap(),
                    enc(&all, elem),
                    "all_gather {elem} x {n}"
                );
                let buf = d.alloc(n * es * world).unwrap();
                d.memset(&s, &buf, 0xAB).unwrap();
                d.copy_d2d(&s, &send, buf.view(r * n * es, n * es).unwrap())
                    .unwrap();
                c.all_gather(
                    &s,
                    buf.view(r * n * es, n * es).unwrap(),
                    (&buf).into(),
                    elem,
                )
                .unwrap();
                assert_eq!(
                    d.download(&s, &buf).unwrap(),
                    enc(&all, elem),
                    "in-place all_gather"
                );

                for op in OPS {
                    // all-reduce out of place and in place
                    let want = expect_reduce(world, n, 1, op, elem);
                    let out = d.alloc(n * es).unwrap();
                    c.all_reduce(&s, (&send).into(), (&out).into(), elem, op)
                        .unwrap();
                    let got = d.download(&s, &out).unwrap();
                    let inplace = up(d, &s, &enc(&mine, elem));
                    c.all_reduce(&s, (&inplace).into(), (&inplace).into(), elem, op)
                        .unwrap();
                    assert_eq!(
                        d.download(&s, &inplace).unwrap(),
                        got,
                        "in-place all_reduce"
                    );
                    if op == ReduceOp::Avg && !matches!(elem, Elem::I32 | Elem::I64 | Elem::U8) {
                        check_avg(&floats(&got, elem), &want, world, elem);
                    } else {
                        assert_eq!(got, enc(&want, elem), "all_reduce {op:?} {elem} x {n}");
                    }

                    // reduce-scatter of world·n elements, out of place and in place
                    let big: Vec<i64> = (0..world * n).map(|i| value(r, i, 2)).collect();
                    let want_all = expect_reduce(world, world * n, 2, op, elem);
                    let want = &want_all[r * n..(r + 1) * n];
                    let src = up(d, &s, &enc(&big, elem));
                    let out = d.alloc(n * es).unwrap();
                    c.reduce_scatter(&s, (&src).into(), (&out).into(), elem, op)
                        .unwrap();
                    let got = d.download(&s, &out).unwrap();
                    c.reduce_scatter(
                        &s,
                        (&src).into(),
                        src.view(r * n * es, n * es).unwrap(),
                        elem,
                        op,
                    )
                    .unwrap();
                    let whole = d.download(&s, &src).unwrap();
                    assert_eq!(
                        &whole[r * n * es..(r + 1) * n * es],
                        &got[..],
                        "in-place reduce_scatter"
                    );
                    if op == ReduceOp::Avg && !matches!(elem, Elem::I32 | Elem::I64 | Elem::U8) {
                        check_avg(&floats(&got, elem), want, world, elem);
                    } else {
                        assert_eq!(got, enc(want, elem), "reduce_scatter {op:?} {elem} x {n}");
                    }
                }

                // broadcast and reduce from every root
                for root in 0..world {
                    let b = up(
                        d,
                        &s,
                        &enc(&(0..n).map(|i| value(r, i, 3)).collect::<Vec<_>>(), elem),
                    );
                    c.broadcast(&s, (&b).into(), elem, root).unwrap();
                    let want: Vec<i64> = (0..n).map(|i| value(root, i, 3)).collect();
                    assert_eq!(
                        d.download(&s, &b).unwrap(),
                        enc(&want, elem),
                        "broadcast root {root}"
                    );
                    let out = up(d, &s, &vec![0x5Au8; n * es]);
                    c.reduce(&s, (&send).into(), (&out).into(), elem, ReduceOp::Sum, root)
                        .unwrap();
                    let got = d.download(&s, &out).unwrap();
                    if r == root {
                        assert_eq!(
                            got,
                            enc(&expect_reduce(world, n, 1, ReduceOp::Sum, elem), elem)
                        );
                    } else {
                        assert_eq!(got, vec![0x5Au8; n * es], "reduce wrote a non-root rank");
                    }
                }
            }
        }
        // send/recv around the ring, two messages per pair, in order
        if world > 1 {
            let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
            for k in 0..2i64 {
                let m = up(d, &s, &enc(&[r as i64, k, 9], Elem::I32));
                c.send(&s, (&m).into(), Elem::I32, next).unwrap();
            }
            for k in 0..2i64 {
                let b = d.alloc(12).unwrap();
                c.recv(&s, (&b).into(), Elem::I32, prev).unwrap();
                assert_eq!(
                    d.download(&s, &b).unwrap(),
                    enc(&[prev as i64, k, 9], Elem::I32)
                );
            }
        }
        // send_recv: to itself (every world size, NCCL included), then around the ring with
        // every rank sending before it receives, which only a group makes safe on NCCL
        for &(to, from) in &[(r, r), ((r + 1) % world, (r + world - 1) % world)] {
            if world == 1 && to != r {
                continue;
            }
            let m = up(d, &s, &enc(&[r as i64, 7, -3], Elem::I32));
            let b = up(d, &s, &[0u8; 12]);
            c.send_recv(&s, (&m).into(), to, (&b).into(), from, Elem::I32)
                .unwrap();
            assert_eq!(
                d.download(&s, &b).unwrap(),
                enc(&[from as i64, 7, -3], Elem::I32),
                "send_recv to {to} from {from}"
            );
        }
        if world > 1 {
            let m = up(d, &s, &[0u8; 12]);
            assert!(c
                .send_recv(&s, (&m).into(), r, (&m).into(), (r + 1) % world, Elem::I32)
                .is_err());
        }
        c.barrier(&s).unwrap();

        // host helpers: the overflow flag (MAX) and a norm (SUM)
        let mut flag = [u8::from(r == world - 1)];
        c.all_reduce_host(&mut flag, ReduceOp::Max).unwrap();
        assert_eq!(flag, [1]);
        let mut sq = [r as f64 + 0.5];
        c.all_reduce_host(&mut sq, ReduceOp::Sum).unwrap();
        assert_eq!(sq[0], (0..world).map(|q| q as f64 + 0.5).sum::<f64>());

        // split: even and odd ranks, keys reversed; the last rank opts out
        let color = (r + 1 < world || world == 1).then_some((r % 2) as u32);
        let sub = c.split(color, (world - r) as u32).unwrap();
        match (color, sub) {
            (None, None) => {}
            (Some(col), Some(sub)) => {
                let members: Vec<usize> = (0..world)
                    .filter(|&q| (q + 1 < world || world == 1) && (q % 2) as u32 == col)
                    .rev()
                    .collect();
                assert_eq!(sub.world(), members.len());
                assert_eq!(members[sub.rank()], r, "ranked by key");
                let mut x = [r as i32];
                sub.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x[0], members.iter().sum::<usize>() as i32);
            }
            (col, sub) => panic!("color {col:?} gave {sub:?}"),
        }
        let st = c.stats();
        assert!(st.all_gather.calls > 0 && st.reduce_scatter.calls > 0 && st.barrier.calls == 1);
    }
}

#[test]
fn local_backend_conforms_at_every_world_size() {
    for world in 1..=8 {
        conformance(&local(world));
    }
}

#[test]
fn nccl_backend_conforms_at_world_size_one() {
    let Some(dev) = common::nccl_device("nccl_backend_conforms_at_world_size_one") else {
        return;
    };
    let Some(id) = common::nccl_id("nccl_backend_conforms_at_world_size_one") else {
        return;
    };
    eprintln!(
        "nccl_backend_conforms_at_world_size_one: NCCL from {}",
        tidemem::comm::nccl_library().unwrap()
    );
    let c = Communicator::nccl_with_id(dev, &id, 0, 1, DEFAULT_TIMEOUT).unwrap();
    assert_eq!(c.backend_name(), "nccl");
    conformance(&[c]);
}

/// NCCL across processes (the emulator's stand-in in CI): this test relaunched as 2 and then 4
/// processes with a launcher's variables, each one rank on the CUDA device of its `LOCAL_RANK`,
/// meeting through the rendezvous, each running its part of the suite.
#[test]
fn nccl_conforms_across_processes_at_world_sizes_two_and_four() {
    const TEST: &str = "nccl_conforms_across_processes_at_world_sizes_two_and_four";
    if let Some(env) = tidemem::comm::LaunchEnv::from_env().unwrap() {
        // a launched rank
        let dev = Device::cuda(env.local_rank).unwrap();
        let c = Communicator::nccl(dev, &env, DEFAULT_TIMEOUT).unwrap();
        assert_eq!((c.rank(), c.world()), (env.rank, env.world_size));
        conformance_rank(&c);
        return;
    }
    for world in [2, 4] {
        if common::nccl_ranks(TEST, world) {
            common::launch_self(TEST, world, Duration::from_secs(300));
        }
    }
}

/// `wait` returns once the stream's collectives are done, and `check` finds no error on a
/// healthy group, on both backends.
#[test]
fn wait_and_check_on_a_healthy_group() {
    let run = |comms: &[Communicator]| {
        on_ranks(comms, |c| {
            let s = stream(c);
            let b = c.device().alloc(4 * 1000).unwrap();
            c.device().memset(&s, &b, 0).unwrap();
            c.all_reduce(&s, (&b).into(), (&b).into(), Elem::F32, ReduceOp::Sum)
                .unwrap();
            c.wait(&s).unwrap();
            c.check().unwrap();
        });
    };
    run(&local(3));
    let Some(dev) = common::nccl_device("wait_and_check_on_a_healthy_group") else {
        return;
    };
    let Some(id) = common::nccl_id("wait_and_check_on_a_healthy_group") else {
        return;
    };
    run(&[Communicator::nccl_with_id(dev, &id, 0, 1, DEFAULT_TIMEOUT).unwrap()]);
}

#[test]
fn nccl_needs_a_cuda_device() {
    let e = Communicator::nccl_with_id(common::sim(1 << 20), &[0; 128], 0, 1, DEFAULT_TIMEOUT)
        .unwrap_err();
    assert!(
        matches!(e, Error::Conflict { .. } | Error::BackendUnavailable { .. }),
        "{e}"
    );
    assert!(
        Communicator::nccl_with_id(common::sim(1 << 20), &[0; 128], 1, 1, DEFAULT_TIMEOUT).is_err()
    );
}

#[test]
fn mismatched_calls_fail_on_every_rank_without_hanging() {
    // different kinds at the same point
    let comms = local(3);
    let t0 = std::time::Instant::now();
    let errs = on_ranks(&comms, |c| {
        let s = stream(c);
        let b = c.device().alloc(12).unwrap();
        let r = if c.rank() == 1 {
            c.all_reduce(&s, (&b).into(), (&b).into(), Elem::F32, ReduceOp::Sum)
        } else {
            c.broadcast(&s, (&b).into(), Elem::F32, 0)
        };
        let again = c.barrier(&s);
        (r, again, c.check())
    });
    assert!(t0.elapsed() < Duration::from_secs(30));
    let mut mismatches = 0;
    for (r, again, check) in errs {
        // a rank may have finished before the mismatch was seen only if all agreed: never here
        let e = r.unwrap_err();
        assert!(matches!(e, Error::CommMismatch { .. }), "{e}");
        mismatches += 1;
        assert!(again.is_err(), "a broken communicator refuses later calls");
        assert!(
            matches!(check, Err(Error::CommMismatch { .. })),
            "check reports what broke it"
        );
    }
    assert_eq!(mismatches, 3);

    // same kind, different counts and dtypes
    for (n1, e1) in [(4usize, Elem::F32), (3, Elem::F16)] {
        let comms = local(2);
        let errs = on_ranks(&comms, |c| {
            let s = stream(c);
            let (n, e) = if c.rank() == 0 {
                (3, Elem::F32)
            } else {
                (n1, e1)
            };
            let b = c.device().alloc(n * e.size()).unwrap();
            c.all_reduce(&s, (&b).into(), (&b).into(), e, ReduceOp::Sum)
        });
        for e in errs {
            let e = e.unwrap_err();
            assert!(e.to_string().contains("all_reduce"), "{e}");
        }
    }

    // a send and a receive that disagree
    let comms = local(2);
    let out = on_ranks(&comms, |c| {
        let s = stream(c);
        if c.rank() == 0 {
            let b = c.device().alloc(8).unwrap();
            c.send(&s, (&b).into(), Elem::F32, 1)
        } else {
            let b = c.device().alloc(8).unwrap();
            c.recv(&s, (&b).into(), Elem::I32, 0)
        }
    });
    assert!(matches!(out[1], Err(Error::CommMismatch { .. })));
}

#[test]
fn a_missing_rank_times_out_with_its_number() {
    let devs = (0..3).map(|_| common::sim(1 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, Duration::from_millis(300)).unwrap();
    let out = on_ranks(&comms, |c| {
        if c.rank() == 2 {
            return None; // never calls
        }
        Some(c.barrier(&stream(c)))
    });
    for r in out.into_iter().flatten() {
        match r.unwrap_err() {
            Error::CommTimeout { missing, .. } => assert_eq!(missing, vec![2]),
            Error::CommMismatch { .. } => {} // the other rank's timeout broke the group first
            e => panic!("{e}"),
        }
    }
    // a receive from a rank that never sends
    let comms = Communicator::local_with_timeout(
        vec![common::sim(1 << 20), common::sim(1 << 20)],
        Duration::from_millis(200),
    )
    .unwrap();
    let s = stream(&comms[0]);
    let b = comms[0].device().alloc(4).unwrap();
    let e = comms[0].recv(&s, (&b).into(), Elem::F32, 1).unwrap_err();
    assert!(
        matches!(e, Error::CommTimeout { ref missing, .. } if missing == &vec![1]),
        "{e}"
    );
}

#[test]
fn bad_arguments_are_errors_and_change_nothing() {
    let comms = local(2);
    on_ranks(&comms, |c| {
        let (d, s) = (c.device(), stream(c));
        let b = d.alloc(10).unwrap();
        let b4 = d.alloc(12).unwrap();
        assert!(matches!(
            c.all_reduce(&s, (&b).into(), (&b).into(), Elem::F32, ReduceOp::Sum),
            Err(Error::Misaligned { .. })
        ));
        assert!(matches!(
            c.all_gather(&s, (&b4).into(), (&b4).into(), Elem::F32),
            Err(Error::SizeMismatch { .. })
        ));
        assert!(matches!(
            c.reduce_scatter(&s, (&b4).into(), (&b4).into(), Elem::F32, ReduceOp::Sum),
            Err(Error::SizeMismatch { .. })
        ));
        // overlapping views outside NCCL's in-place layout
        let b16 = d.alloc(16).unwrap();
        let wrong = (1 - c.rank()) * 8;
        assert!(matches!(
            c.all_gather(
                &s,
                b16.view(wrong, 8).unwrap(),
                b16.view(0, 16).unwrap(),
                Elem::F32
            ),
            Err(Error::Conflict { .. })
        ));
        assert!(matches!(
            c.reduce_scatter(
                &s,
                b16.view(0, 16).unwrap(),
                b16.view(wrong, 8).unwrap(),
                Elem::F32,
                ReduceOp::Sum
            ),
            Err(Error::Conflict { .. })
        ));
        assert!(matches!(
            c.all_reduce(
                &s,
                b16.view(0, 8).unwrap(),
                b16.view(4, 8).unwrap(),
                Elem::F32,
                ReduceOp::Sum
            ),
            Err(Error::Conflict { .. })
        ));
        let other = (c.rank() + 1) % 2;
        assert!(matches!(
            c.send_recv(
                &s,
                b16.view(0, 8).unwrap(),
                other,
                b16.view(4, 8).unwrap(),
                other,
                Elem::F32
            ),
            Err(Error::Conflict { .. })
        ));
        assert!(matches!(
            c.broadcast(&s, (&b4).into(), Elem::F32, 2),
            Err(Error::IndexOutOfRange {
                index: 2,
                len: 2,
                ..
            })
        ));
        assert!(matches!(
            c.send(&s, (&b4).into(), Elem::F32, c.rank()),
            Err(Error::Conflict { .. })
        ));
        assert!(matches!(
            c.split(Some(u32::MAX), 0),
            Err(Error::BadValue { .. })
        ));
        // nothing above reached the other rank: the group still works
        let mut x = [1i32];
        c.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, [2]);
    });
}

#[test]
fn communicators_cross_threads() {
    fn check<T: Send + Sync>() {}
    check::<Communicator>();
}

/// `agree` lets ranks fail together: every rank that was ok learns that another failed, and the
/// one that failed goes on to return its own error; all ok is ok everywhere.
#[test]
fn ranks_agree_on_failure() {
    let comms = local(3);
    let got = on_ranks(&comms, |c| (c.agree(true).is_ok(), c.agree(c.rank() != 1)));
    for (r, (all_ok, one_failed)) in got.into_iter().enumerate() {
        assert!(all_ok);
        match r {
            1 => assert!(one_failed.is_ok(), "the failed rank returns its own error"),
            _ => {
                let e = one_failed.unwrap_err();
                assert!(e.to_string().contains("another rank failed"), "{e}");
            }
        }
    }
}
