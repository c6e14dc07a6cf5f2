//! A pipeline simulator: every stage's op list run against the pipeline's dependencies.

use super::no_stages;
use super::schedule::{PipeOp, Schedule};
use crate::{Error, Result};

/// The time one op of a stage takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageCost {
    /// A forward.
    pub forward: f64,
    /// A backward.
    pub backward: f64,
}

/// When one op ran.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpTiming {
    /// The op.
    pub op: PipeOp,
    /// Its start.
    pub start: f64,
    /// Its end.
    pub end: f64,
}

/// What [`simulate`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleReport {
    /// From the first op's start (0) to the last op's end.
    pub makespan: f64,
    /// Each stage's time without an op within the makespan.
    pub(crate) idle: Vec<f64>,
    /// Each stage's time running ops.
    pub busy: Vec<f64>,
    /// The idle share of all stages' time: `Σ idle / (P · makespan)` (0 for an empty run).
    pub bubble_fraction: f64,
    /// Each stage's ops in its order, with their times.
    pub timeline: Vec<Vec<OpTiming>>,
}

/// Runs each stage's op list (`ops[s]`, one op at a time, in order) as early as the
/// dependencies allow: `F(m)` on stage `s` after `F(m)` on `s − 1`; `B(m)` on `s` after `B(m)`
/// on `s + 1` and after `F(m)` on `s`. Communication takes no time.
///
/// Every stage's list must hold `F(m)` and `B(m)` exactly once for each `m` of the same
/// `0..M` ([`Error::BadSchedule`] otherwise); `costs` gives one [`StageCost`] per stage
/// ([`Error::Length`] otherwise), finite and non-negative ([`Error::BadValue`]). No op list at
/// all is [`Error::TooFew`]. Lists whose ops wait on each other in a cycle are
/// [`Error::Deadlock`].
pub fn simulate(ops: &[Vec<PipeOp>], costs: &[StageCost]) -> Result<ScheduleReport> {
    let p = ops.len();
    if p == 0 {
        return Err(no_stages("stages (op lists) to simulate"));
    }
    if costs.len() != p {
        return Err(Error::Length {
            what: "stage costs for the op lists of the stages".into(),
            got: costs.len(),
            expected: p,
        });
    }
    for (s, c) in costs.iter().enumerate() {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !ok(c.forward) || !ok(c.backward) {
            let (which, value) = if ok(c.forward) {
                ("backward", c.backward)
            } else {
                ("forward", c.forward)
            };
            return Err(Error::BadValue {
                what: format!("the {which} cost of stage {s}"),
                value,
                want: "finite and non-negative",
            });
        }
    }
    let micro = ops[0].len() / 2;
    for (s, list) in ops.iter().enumerate() {
        check_list(s, list, micro)?;
    }
    // end times of F(m) and B(m) per stage, once run
    let mut f_end = vec![vec![None::<f64>; micro]; p];
    let mut b_end = vec![vec![None::<f64>; micro]; p];
    let mut next = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut timeline: Vec<Vec<OpTiming>> = vec![Vec::with_capacity(2 * micro); p];
    let total = 2 * micro * p;
    let mut done = 0;
    while done < total {
        let mut progress = false;
        for s in 0..p {
            while let Some(&op) = ops[s].get(next[s]) {
                let ready = match op {
                    PipeOp::Forward(m) => match s {
                        0 => Some(0.0),
                        _ => f_end[s - 1][m],
                    },
                    PipeOp::Backward(m) => {
                        let down = if s + 1 == p {
                            Some(0.0)
                        } else {
                            b_end[s + 1][m]
                        };
                        match (down, f_end[s][m]) {
                            (Some(a), Some(b)) => Some(a.max(b)),
                            _ => None,
                        }
                    }
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free[s]);
                let (end, slot) = match op {
                    PipeOp::Forward(m) => (start + costs[s].forward, &mut f_end[s][m]),
                    PipeOp::Backward(m) => (start + costs[s].backward, &mut b_end[s][m]),
                };
                *slot = Some(end);
                free[s] = end;
                timeline[s].push(OpTiming { op, start, end });
                next[s] += 1;
                done += 1;
                progress = true;
            }
        }
        if !progress {
            let stuck = (0..p)
                .filter_map(|s| ops[s].get(next[s]).map(|op| (s, op.to_string())))
                .collect();
            return Err(Error::Deadlock { done, total, stuck });
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let busy: Vec<f64> = (0..p)
        .map(|s| micro as f64 * (costs[s].forward + costs[s].backward))
        .collect();
    let idle: Vec<f64> = busy.iter().map(|b| makespan - b).collect();
    let bubble_fraction = if makespan > 0.0 {
        idle.iter().sum::<f64>() / (p as f64 * makespan)
    } else {
        0.0
    };
    Ok(ScheduleReport {
        makespan,
        idle,
        busy,
        bubble_fraction,
        timeline,
    })
}

/// [`simulate`] of `schedule`'s op lists for `stages` equal stages (each forward `t_f`, each
/// backward `t_b`) and `micro` micro-batches.
pub fn simulate_schedule(
    schedule: Schedule,
    stages: usize,
    micro: usize,
    t_f: f64,
    t_b: f64,
) -> Result<ScheduleReport> {
    if stages == 0 {
        return Err(no_stages("stages of a pipeline"));
    }
    let ops = (0..stages)
        .map(|s| schedule.ops(stages, s, micro))
        .collect::<Result<Vec<_>>>()?;
    let cost = StageCost {
        forward: t_f,
        backward: t_b,
    };
    simulate(&ops, &vec![cost; stages])
}

fn check_list(stage: usize, list: &[PipeOp], micro: usize) -> Result<()> {
    let bad = |reason: String| Error::BadSchedule { stage, reason };
    if list.len() != 2 * micro {
        return Err(bad(format!(
            "{} ops, stage 0 has {} ({micro} micro-batches)",
            list.len(),
            2 * micro
        )));
    }
    let mut seen = vec![[false; 2]; micro];
    for &op in list {
        let m = op.micro();
        if m >= micro {
            return Err(bad(format!("{op} of {micro} micro-batches")));
        }
        let k = usize::from(!op.is_forward());
        if std::mem::replace(&mut seen[m][k], true) {
            return Err(bad(format!("{op} twice")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::pipeline::max_in_flight;
    use proptest::prelude::*;

    fn formula(p: usize, m: usize) -> f64 {
        (p - 1) as f64 / (m + p - 1) as f64
    }

    #[test]
    fn flush_schedules_have_the_textbook_bubble() {
        for sched in [Schedule::OneFOneB, Schedule::GPipe] {
            for p in [1, 2, 3, 4, 8] {
                for m in [1, 2, 4, 7, 8, 16] {
                    for (tf, tb) in [(1.0, 1.0), (1.0, 2.0), (3.0, 6.0)] {
                        let r = simulate_schedule(sched, p, m, tf, tb).unwrap();
                        let span = (m + p - 1) as f64 * (tf + tb);
                        assert_eq!(r.makespan, span, "{sched:?} p {p} m {m}");
                        for s in 0..p {
                            assert_eq!(r.idle[s], (p - 1) as f64 * (tf + tb));
                        }
                        let want = formula(p, m);
                        assert!(
                            (r.bubble_fraction - want).abs() < 1e-15,
                            "{sched:?} p {p} m {m}: {} vs {want}",
                            r.bubble_fraction
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_broken_order_deadlocks() {
        // stage 1 wants F1 first, which stage 0 runs only after B0, which needs stage 1's B0
        let ops = vec![
            vec![
                PipeOp::Forward(0),
                PipeOp::Backward(0),
                PipeOp::Forward(1),
                PipeOp::Backward(1),
            ],
            vec![
                PipeOp::Forward(1),
                PipeOp::Forward(0),
                PipeOp::Backward(0),
                PipeOp::Backward(1),
            ],
        ];
        let c = StageCost {
            forward: 1.0,
            backward: 2.0,
        };
        match simulate(&ops, &[c, c]) {
            Err(Error::Deadlock { done, total, stuck }) => {
                assert_eq!((done, total), (1, 8));
                assert_eq!(stuck, vec![(0, "B0".to_string()), (1, "F1".to_string())]);
            }
            r => panic!("{r:?}"),
        }
        // a backward before its own forward
        let ops = vec![vec![PipeOp::Backward(0), PipeOp::Forward(0)]];
        assert!(matches!(
            simulate(&ops, &[c]),
            Err(Error::Deadlock {
                done: 0,
                total: 2,
                ..
            })
        ));
        // not a schedule
        let ops = vec![vec![PipeOp::Forward(0), PipeOp::Forward(0)]];
        assert!(matches!(
            simulate(&ops, &[c]),
            Err(Error::BadSchedule { stage: 0, .. })
        ));
        let bad = StageCost {
            forward: -1.0,
            backward: 1.0,
        };
        assert!(matches!(
            simulate(&[vec![]], &[bad]),
            Err(Error::BadValue { ref what, value, .. })
                if what == "the forward cost of stage 0" && value == -1.0
        ));
        assert!(matches!(
            simulate(&[vec![]], &[c, c]),
            Err(Error::Length {
                got: 2,
                expected: 1,
                ..
            })
        ));
        assert!(matches!(
            simulate(&[], &[]),
            Err(Error::TooFew {
                got: 0,
                need: 1,
                ..
            })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Every schedule completes; the flush schedules' bubble is the formula's with equal
        /// stages; 1F1B never holds more than min(P − s, M) micro-batches on any stage.
        #[test]
        fn schedules_complete(p in 1usize..6, m in 1usize..12, tf in 1u32..4, k in 1u32..3) {
            let (tf, tb) = (f64::from(tf), f64::from(tf * k));
            for sched in [Schedule::OneFOneB, Schedule::GPipe, Schedule::TwoBW { every: p }] {
                let r = simulate_schedule(sched, p, m, tf, tb).unwrap();
                prop_assert!(r.timeline.iter().all(|t| t.len() == 2 * m));
                let min = (m + p - 1) as f64 * (tf + tb);
                prop_assert!(r.makespan >= min);
                if sched != (Schedule::TwoBW { every: p }) {
                    prop_assert!((r.bubble_fraction - formula(p, m)).abs() < 1e-12);
                }
                for s in 0..p {
                    let ops = sched.ops(p, s, m).unwrap();
                    let bound = sched.in_flight_bound(p, s, m).unwrap();
                    prop_assert!(max_in_flight(&ops) <= bound);
                    // ops run in list order, one at a time, after their dependencies
                    let t = &r.timeline[s];
                    prop_assert!(t.windows(2).all(|w| w[0].end <= w[1].start));
                }
            }
        }
    }
}
