//! The op order of each stage under each schedule, and PipeDream-2BW's weight versions.

use std::fmt;

use super::check_shape;
use crate::{Error, Result};

/// One op of a stage: the forward or the backward of a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PipeOp {
    /// The forward of micro-batch `m`.
    Forward(usize),
    /// The backward of micro-batch `m`.
    Backward(usize),
}

impl PipeOp {
    /// The micro-batch.
    pub fn micro(self) -> usize {
        match self {
            PipeOp::Forward(m) | PipeOp::Backward(m) => m,
        }
    }

    /// Whether it is a forward.
    pub(crate) fn is_forward(self) -> bool {
        matches!(self, PipeOp::Forward(_))
    }
}

impl fmt::Display for PipeOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PipeOp::Forward(m) => write!(f, "F{m}"),
            PipeOp::Backward(m) => write!(f, "B{m}"),
        }
    }
}

/// A pipeline schedule (see the [module docs](super)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// One forward, one backward (PipeDream-Flush): `min(P − s − 1, M)` warm-up forwards, then
    /// a forward and a backward in turn, then the remaining backwards.
    #[default]
    OneFOneB,
    /// All forwards, then all backwards (GPipe's flush baseline).
    GPipe,
    /// PipeDream-2BW: 1F1B's order over a stream of micro-batches with no flush, a new weight
    /// version every `every ≥ P` micro-batches (see [`two_bw`] for the versions).
    TwoBW {
        /// Micro-batches per weight version (`m` in the paper).
        every: usize,
    },
}

impl Schedule {
    /// The schedule's name.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::OneFOneB => "1F1B",
            Schedule::GPipe => "GPipe",
            Schedule::TwoBW { .. } => "2BW",
        }
    }

    /// The op order of stage `stage` of `stages` for `micro` micro-batches.
    ///
    /// Fails with [`Error::TooFew`] for no stage or no micro-batch,
    /// [`Error::IndexOutOfRange`] for a stage past the last, and for 2BW with
    /// [`Error::TooFew`] when `every < stages`.
    ///
    /// ```
    /// use tidemem::parallel::pipeline::{PipeOp::*, Schedule};
    ///
    /// // stage 0 of 3, 4 micro-batches: 2 warm-up forwards, steady 1F1B, then the drain
    /// let ops = Schedule::OneFOneB.ops(3, 0, 4).unwrap();
    /// assert_eq!(
    ///     ops,
    ///     [Forward(0), Forward(1), Forward(2), Backward(0), Forward(3), Backward(1), Backward(2), Backward(3)]
    /// );
    /// ```
    pub fn ops(self, stages: usize, stage: usize, micro: usize) -> Result<Vec<PipeOp>> {
        check_shape(stages, stage, micro)?;
        match self {
            Schedule::GPipe => Ok((0..micro)
                .map(PipeOp::Forward)
                .chain((0..micro).map(PipeOp::Backward))
                .collect()),
            Schedule::OneFOneB => Ok(one_f_one_b(stages, stage, micro)),
            Schedule::TwoBW { every } => {
                check_every(stages, every)?;
                Ok(one_f_one_b(stages, stage, micro))
            }
        }
    }

    /// The most micro-batches whose activations stage `stage` holds at once under this
    /// schedule: `min(P − s, M)` for 1F1B and 2BW, `M` for GPipe (the same checks as
    /// [`Schedule::ops`]).
    pub fn in_flight_bound(self, stages: usize, stage: usize, micro: usize) -> Result<usize> {
        check_shape(stages, stage, micro)?;
        match self {
            Schedule::GPipe => Ok(micro),
            Schedule::OneFOneB => Ok((stages - stage).min(micro)),
            Schedule::TwoBW { every } => {
                check_every(stages, every)?;
                Ok((stages - stage).min(micro))
            }
        }
    }
}

fn check_every(stages: usize, every: usize) -> Result<()> {
    if every < stages {
        return Err(Error::TooFew {
            what: format!("micro-batches per PipeDream-2BW weight version with {stages} stages"),
            got: every,
            need: stages,
        });
    }
    Ok(())
}

fn one_f_one_b(stages: usize, stage: usize, micro: usize) -> Vec<PipeOp> {
    let warm = (stages - stage - 1).min(micro);
    let mut ops: Vec<PipeOp> = (0..warm).map(PipeOp::Forward).collect();
    for i in 0..micro - warm {
        ops.push(PipeOp::Forward(warm + i));
        ops.push(PipeOp::Backward(i));
    }
    ops.extend((micro - warm..micro).map(PipeOp::Backward));
    ops
}

/// The most micro-batches an op list holds at once: forwarded on this stage and not yet
/// backwarded, at the worst point of the list.
pub fn max_in_flight(ops: &[PipeOp]) -> usize {
    let (mut now, mut peak) = (0usize, 0usize);
    for op in ops {
        if op.is_forward() {
            now += 1;
            peak = peak.max(now);
        } else {
            now = now.saturating_sub(1);
        }
    }
    peak
}

/// An op and the weight version it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VersionedOp {
    /// The op.
    pub op: PipeOp,
    /// The weight version: 0 the initial weights, `v` the weights after `v` updates.
    pub(crate) version: usize,
}

/// PipeDream-2BW's op order of stage `stage` of `stages` over `micro` micro-batches, a new
/// weight version every `every` micro-batches, with the version each op runs on.
///
/// Micro-batch `j` belongs to batch `b = j / every`; the stage makes version `b + 1` once it
/// ran the backwards of batch `b` (`W(b+1) = W(b) − ν·g_b`), and batch `b` runs (forward and
/// backward, on every stage) on version `max(b − 1, 0)`: the newest version every stage has
/// when the batch's first micro-batch enters stage 0, since with `every ≥ stages` stage 0 has
/// then finished the backwards of batch `b − 2` but not of batch `b − 1`. So
/// `g_b = ∇f(W(b − 1))` and `W(t+1) = W(t) − ν·∇f(W(t−1))`; a stage stashes at most two
/// versions. The same checks as [`Schedule::ops`].
pub fn two_bw(stages: usize, stage: usize, micro: usize, every: usize) -> Result<Vec<VersionedOp>> {
    let ops = Schedule::TwoBW { every }.ops(stages, stage, micro)?;
    Ok(ops
        .into_iter()
        .map(|op| VersionedOp {
            op,
            version: (op.micro() / every).saturating_sub(1),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_orders_and_bounds() {
        for p in 1..7 {
            for m in 1..13 {
                for s in 0..p {
                    let ops = Schedule::OneFOneB.ops(p, s, m).unwrap();
                    assert_eq!(ops.len(), 2 * m);
                    let warm = ops.iter().take_while(|o| o.is_forward()).count();
                    assert_eq!(
                        warm,
                        (p - s).min(m),
                        "warm-up plus the first steady forward"
                    );
                    let bound = Schedule::OneFOneB.in_flight_bound(p, s, m).unwrap();
                    assert_eq!(max_in_flight(&ops), bound);
                    let g = Schedule::GPipe.ops(p, s, m).unwrap();
                    assert_eq!(max_in_flight(&g), m);
                }
            }
        }
    }

    #[test]
    fn typed_errors() {
        assert!(matches!(
            Schedule::OneFOneB.ops(0, 0, 1),
            Err(Error::TooFew {
                got: 0,
                need: 1,
                ..
            })
        ));
        assert!(matches!(
            Schedule::GPipe.ops(2, 0, 0),
            Err(Error::TooFew { ref what, got: 0, need: 1 }) if what.contains("micro-batches")
        ));
        assert!(matches!(
            Schedule::OneFOneB.ops(2, 2, 1),
            Err(Error::IndexOutOfRange {
                index: 2,
                len: 2,
                ..
            })
        ));
        assert!(matches!(
            two_bw(4, 0, 8, 3),
            Err(Error::TooFew {
                got: 3,
                need: 4,
                ..
            })
        ));
        assert!(Schedule::TwoBW { every: 4 }.ops(4, 3, 8).is_ok());
    }

    /// Every 2BW forward finds its version made already (the backwards of the batches before
    /// it ran on this stage), and a stage never holds more than two versions.
    #[test]
    fn two_bw_versions_are_available_and_at_most_two() {
        for p in 1..6 {
            for every in p..p + 3 {
                for s in 0..p {
                    let micro = 5 * every + 1;
                    let ops = two_bw(p, s, micro, every).unwrap();
                    let mut done = 0; // backwards run on this stage
                    let mut live: Vec<usize> = Vec::new(); // versions of in-flight micro-batches
                    for v in &ops {
                        let made = done / every; // the newest version this stage has
                        match v.op {
                            PipeOp::Forward(_) => {
                                assert!(v.version <= made, "p {p} every {every} s {s}: {v:?}");
                                live.push(v.version);
                            }
                            PipeOp::Backward(j) => {
                                let f = ops.iter().find(|o| o.op == PipeOp::Forward(j)).unwrap();
                                assert_eq!(v.version, f.version);
                                let k = live.iter().position(|&x| x == v.version).unwrap();
                                live.swap_remove(k);
                                done += 1;
                            }
                        }
                        let mut versions = live.clone();
                        versions.push(done / every);
                        versions.sort_unstable();
                        versions.dedup();
                        assert!(
                            versions.len() <= 2,
                            "p {p} every {every} s {s}: {versions:?}"
                        );
                    }
                }
            }
        }
    }
}
