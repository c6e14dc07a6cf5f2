//! The process grid: every group of every scheme holds the ranks the layout formulas say, in
//! their order; bad grids fail on every rank without hanging; tensor modes parse and print.

mod common;

use std::time::{Duration, Instant};

use tidemem::comm::{Communicator, ReduceOp};
use tidemem::parallel::{GridSpec, ProcessGrid, TensorMode};
use tidemem::Error;

fn on_ranks<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let devs = (0..world).map(|_| common::sim(1 << 20)).collect();
    let comms = Communicator::local_with_timeout(devs, timeout).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(c))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

fn spec(data: usize, pipeline: usize, mode: &str) -> GridSpec {
    spec4(data, pipeline, 1, mode)
}

fn spec4(data: usize, pipeline: usize, sequence: usize, mode: &str) -> GridSpec {
    GridSpec {
        data,
        pipeline,
        sequence,
        tensor: mode.parse().unwrap(),
    }
}

/// A global rank's place, straight from the layout: `(dp, pp, sp, t, [a, b, c])` where the
/// scheme coordinates are (row, col, 0) in 2D, (row, col, dep) in 2.5D and (i, j, k) in 3D.
fn coords(s: &GridSpec, g: usize) -> (usize, usize, usize, usize, [usize; 3]) {
    let t_size = s.tensor.size();
    let st = s.sequence * t_size;
    let (dp, pp, sp, t) = (
        g / (s.pipeline * st),
        g / st % s.pipeline,
        g / t_size % s.sequence,
        g % t_size,
    );
    let sc = match s.tensor {
        TensorMode::TwoD { q } => [t / q, t % q, 0],
        TensorMode::TwoHalfD { q, .. } => [t / q % q, t % q, t / (q * q)],
        TensorMode::ThreeD { q } => [t % q, t / q % q, t / (q * q)],
        _ => [0; 3],
    };
    (dp, pp, sp, t, sc)
}

/// A group by name: what its members share with each other, and each member's local rank.
fn key(s: &GridSpec, name: &str, g: usize) -> (Vec<usize>, usize) {
    let (dp, pp, sp, t, [a, b, c]) = coords(s, g);
    let q = match s.tensor {
        TensorMode::TwoD { q } | TensorMode::TwoHalfD { q, .. } | TensorMode::ThreeD { q } => q,
        _ => 0,
    };
    match (name, s.tensor) {
        ("data", _) => (vec![pp, sp, t], dp),
        ("pipeline", _) => (vec![dp, sp, t], pp),
        ("sequence", _) => (vec![dp, pp, t], sp),
        ("replicas", _) => (vec![pp, t], dp * s.sequence + sp),
        ("tensor", _) => (vec![dp, pp, sp], t),
        ("row", _) => (vec![dp, pp, sp, c, a], b),
        ("col", _) => (vec![dp, pp, sp, c, b], a),
        ("dep", _) => (vec![dp, pp, sp, a, b], c),
        ("xz", _) => (vec![dp, pp, sp, b], a + q * c),
        ("input", _) => (vec![dp, pp, sp, a, c], b),
        ("weight", _) => (vec![dp, pp, sp, b, c], a),
        ("output", _) => (vec![dp, pp, sp, a, b], c),
        ("plane", _) => (vec![dp, pp, sp, b], a + q * c),
        _ => unreachable!("{name}"),
    }
}

/// Each member puts `local rank + 1` at its global rank and the group sums: the result is the
/// group's members and their order, compared with the formulas.
fn check_group(grid: &ProcessGrid, me: usize, world: usize, name: &str, comm: &Communicator) {
    let s = grid.spec();
    let (shared, local) = key(&s, name, me);
    assert_eq!(comm.rank(), local, "{s} rank {me}: local rank in {name}");
    let mut v = vec![0i64; world];
    v[me] = comm.rank() as i64 + 1;
    comm.all_reduce_host(&mut v, ReduceOp::Sum).unwrap();
    let expect: Vec<i64> = (0..world)
        .map(|g| {
            let (sh, l) = key(&s, name, g);
            if sh == shared {
                l as i64 + 1
            } else {
                0
            }
        })
        .collect();
    assert_eq!(v, expect, "{s} rank {me}: members of {name}");
    assert_eq!(comm.world(), expect.iter().filter(|&&x| x > 0).count());
}

fn check_grid(s: GridSpec) {
    let world = s.world();
    on_ranks(world, Duration::from_secs(20), |c| {
        let me = c.rank();
        let grid = ProcessGrid::new(&c, s).unwrap();
        let (dp, pp, sp, t, [a, b, cc]) = coords(&s, me);
        assert_eq!(grid.spec(), s);
        assert_eq!(
            (
                grid.data_rank(),
                grid.pipeline_rank(),
                grid.sequence_rank(),
                grid.tensor_rank()
            ),
            (dp, pp, sp, t)
        );
        // the replicas split again, as a store that owns its group takes them
        let split = grid.split_replicas(&c).unwrap();
        let mut groups = vec![
            ("data", grid.data()),
            ("pipeline", grid.pipeline()),
            ("sequence", grid.sequence()),
            ("replicas", grid.replicas()),
            ("replicas", &split),
            ("tensor", grid.tensor()),
        ];
        let absent: &[&str] = match s.tensor {
            TensorMode::None | TensorMode::OneD { .. } => {
                assert!(matches!(grid.q(), Err(Error::Conflict { .. })));
                &["row", "dep", "input", "plane"]
            }
            TensorMode::TwoD { q } => {
                assert_eq!(grid.q().unwrap(), q);
                assert_eq!(
                    (grid.row_index().unwrap(), grid.col_index().unwrap()),
                    (a, b)
                );
                groups.push(("row", grid.row().unwrap()));
                groups.push(("col", grid.col().unwrap()));
                &["dep", "xz", "input", "weight", "output", "plane"]
            }
            TensorMode::TwoHalfD { q, depth } => {
                assert_eq!((grid.q().unwrap(), grid.depth().unwrap()), (q, depth));
                let idx = (grid.row_index(), grid.col_index(), grid.dep_index());
                assert_eq!((idx.0.unwrap(), idx.1.unwrap(), idx.2.unwrap()), (a, b, cc));
                for n in ["row", "col", "dep", "xz"] {
                    let g = match n {
                        "row" => grid.row(),
                        "col" => grid.col(),
                        "dep" => grid.dep(),
                        _ => grid.xz(),
                    };
                    groups.push((n, g.unwrap()));
                }
                &["input", "plane"]
            }
            TensorMode::ThreeD { q } => {
                assert_eq!(grid.q().unwrap(), q);
                let ijk = (grid.i().unwrap(), grid.j().unwrap(), grid.k().unwrap());
                assert_eq!(ijk, (a, b, cc));
                groups.push(("input", grid.input().unwrap()));
                groups.push(("weight", grid.weight().unwrap()));
                groups.push(("output", grid.output().unwrap()));
                groups.push(("plane", grid.plane().unwrap()));
                &["row", "col", "dep", "xz"]
            }
        };
        for (name, comm) in groups {
            check_group(&grid, me, world, name, comm);
        }
        for name in absent {
            let r = match *name {
                "row" => grid.row(),
                "col" => grid.col(),
                "dep" => grid.dep(),
                "xz" => grid.xz(),
                "input" => grid.input(),
                "weight" => grid.weight(),
                "output" => grid.output(),
                _ => grid.plane(),
            };
            match r {
                Err(Error::Conflict { what, with }) => {
                    assert!(what.contains(name), "{what}");
                    assert!(with.contains(&s.tensor.to_string()), "{with}")
                }
                other => panic!("{s}: {name} gave {other:?}"),
            }
        }
    });
}

#[test]
fn one_d_groups() {
    check_grid(spec(1, 1, "1d:2"));
    check_grid(spec(1, 1, "1d:4"));
}

#[test]
fn two_d_groups() {
    check_grid(spec(1, 1, "2d:2"));
}

#[test]
fn two_and_a_half_d_groups() {
    check_grid(spec(1, 1, "2.5d:2x2"));
    check_grid(spec(1, 1, "2.5d:2x1"));
}

#[test]
fn three_d_groups() {
    check_grid(spec(1, 1, "3d:2"));
}

#[test]
fn sequence_factors() {
    check_grid(spec4(2, 1, 2, "1d:2"));
    check_grid(spec4(1, 2, 2, "none"));
    check_grid(spec4(1, 1, 2, "2d:2"));
}

#[test]
fn data_and_pipeline_factors() {
    check_grid(spec(2, 1, "1d:2"));
    check_grid(spec(1, 2, "2d:2"));
    check_grid(spec(2, 2, "none"));
}

/// Every rank gets the error `kind` accepts at once (no collective runs: far inside the
/// timeout), its message with `needle`.
fn fails_everywhere(world: usize, s: GridSpec, needle: &str, kind: fn(&Error) -> bool) {
    let t0 = Instant::now();
    let res = on_ranks(world, Duration::from_secs(3), |c| ProcessGrid::new(&c, s));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "{s}: took {:?}",
        t0.elapsed()
    );
    for r in res {
        match r {
            Err(e) if kind(&e) => assert!(e.to_string().contains(needle), "{e}"),
            other => panic!("{s} on {world} ranks: {other:?}"),
        }
    }
}

#[test]
fn bad_grids_fail_on_every_rank() {
    let too_few = |e: &Error| {
        matches!(
            e,
            Error::TooFew {
                got: 0,
                need: 1,
                ..
            }
        )
    };
    fails_everywhere(
        6,
        spec(1, 1, "2d:2"),
        "2d:2 needs q² = 4 ranks per tensor group × data 1 × pipeline 1 = 4: 6 given, \
         4 expected",
        |e| {
            matches!(
                e,
                Error::Length {
                    got: 6,
                    expected: 4,
                    ..
                }
            )
        },
    );
    fails_everywhere(4, spec(1, 1, "3d:2"), "q³ = 8", |e| {
        matches!(
            e,
            Error::Length {
                got: 4,
                expected: 8,
                ..
            }
        )
    });
    fails_everywhere(
        6,
        spec(1, 1, "2.5d:2x2"),
        "2.5d:2x2 needs q²·d = 8 ranks per tensor group × data 1 × pipeline 1 = 8: 6 given, \
         8 expected",
        |e| {
            matches!(
                e,
                Error::Length {
                    got: 6,
                    expected: 8,
                    ..
                }
            )
        },
    );
    fails_everywhere(6, spec(2, 1, "1d:2"), "data 2 × pipeline 1 = 4", |e| {
        matches!(
            e,
            Error::Length {
                got: 6,
                expected: 4,
                ..
            }
        )
    });
    fails_everywhere(4, spec(0, 1, "1d:4"), "at least 1", too_few);
    fails_everywhere(4, spec(1, 0, "1d:4"), "at least 1", too_few);
    fails_everywhere(4, spec4(1, 1, 0, "1d:4"), "sequence 0", too_few);
    fails_everywhere(
        6,
        spec4(1, 1, 2, "1d:2"),
        "pipeline 1 × sequence 2 = 4",
        |e| {
            matches!(
                e,
                Error::Length {
                    got: 6,
                    expected: 4,
                    ..
                }
            )
        },
    );
    let zero_q = GridSpec {
        tensor: TensorMode::TwoD { q: 0 },
        ..spec(1, 1, "none")
    };
    fails_everywhere(4, zero_q, "at least 1", too_few);
}

#[test]
fn ranks_with_different_specs_all_fail() {
    let res = on_ranks(4, Duration::from_secs(3), |c| {
        let mode = if c.rank() == 0 { "1d:4" } else { "2d:2" };
        ProcessGrid::new(&c, spec(1, 1, mode))
    });
    for r in res {
        assert!(matches!(r, Err(Error::Conflict { .. })), "{r:?}");
    }
}

#[test]
fn modes_parse_and_print() {
    let good = [
        ("none", TensorMode::None, 1),
        ("1d:1", TensorMode::OneD { size: 1 }, 1),
        ("1d:6", TensorMode::OneD { size: 6 }, 6),
        ("2d:2", TensorMode::TwoD { q: 2 }, 4),
        ("2.5d:2x2", TensorMode::TwoHalfD { q: 2, depth: 2 }, 8),
        ("2.5d:3x1", TensorMode::TwoHalfD { q: 3, depth: 1 }, 9),
        ("3d:2", TensorMode::ThreeD { q: 2 }, 8),
    ];
    for (s, m, n) in good {
        assert_eq!(s.parse::<TensorMode>().unwrap(), m, "{s}");
        assert_eq!(m.to_string(), s);
        assert_eq!(m.size(), n);
    }
    let bad = [
        "",
        "None",
        "1D:2",
        "1d",
        "1d:",
        "1d:0",
        "1d:-1",
        "1d:+2",
        "2d:2x2",
        "2d: 2",
        " 2d:2",
        "4d:2",
        "2.5d:2",
        "2.5d:2x",
        "2.5d:0x2",
        "2.5d:2x0",
        "2.5d:2X2",
        "3d:1.5",
        "none:1",
        "3d:99999999999999999999999",
    ];
    for s in bad {
        match s.parse::<TensorMode>() {
            Err(Error::Parse {
                what: "tensor mode",
                input,
                ..
            }) => assert_eq!(input, s),
            other => panic!("{s:?} parsed as {other:?}"),
        }
    }
    assert_eq!(spec(2, 3, "2d:2").world(), 24);
}

#[test]
fn grid_is_send() {
    fn send<T: Send>() {}
    send::<ProcessGrid>();
}
