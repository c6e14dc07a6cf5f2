//! The collectives of the 2D / 2.5D embeddings and classifier, per group.

use serde::Serialize;

use crate::comm::{CommStats, Tally};
use crate::parallel::{SummaCollectives, SummaGroups};

/// Collective calls and bytes on each group a 2D / 2.5D end layer uses, as
/// [`Communicator::stats`](crate::comm::Communicator::stats) counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EndsGroups {
    /// The ROW group's.
    pub row: CommStats,
    /// The COL group's.
    pub col: CommStats,
    /// The DEP group's (2.5D with `d > 1` only).
    pub dep: CommStats,
    /// The whole tensor group's ([`ProcessGrid::tensor`](crate::parallel::ProcessGrid::tensor)):
    /// the vocab-parallel embedding's `send_recv`, the classifier's loss.
    pub tensor: CommStats,
}

/// The collectives of one forward and one backward of a 2D / 2.5D end layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EndsCollectives {
    /// The forward pass.
    pub forward: EndsGroups,
    /// The backward pass.
    pub backward: EndsGroups,
}

impl From<SummaGroups> for EndsGroups {
    fn from(g: SummaGroups) -> EndsGroups {
        EndsGroups {
            row: g.row,
            col: g.col,
            dep: g.dep,
            tensor: CommStats::default(),
        }
    }
}

impl From<SummaCollectives> for EndsCollectives {
    fn from(c: SummaCollectives) -> EndsCollectives {
        EndsCollectives {
            forward: c.forward.into(),
            backward: c.backward.into(),
        }
    }
}

/// `calls` calls of `bytes` bytes each.
pub(super) fn tally(calls: usize, bytes: usize) -> Tally {
    Tally {
        calls: calls as u64,
        bytes: (calls * bytes) as u64,
    }
}

/// The sum of two tallies.
pub(super) fn plus(a: Tally, b: Tally) -> Tally {
    Tally {
        calls: a.calls + b.calls,
        bytes: a.bytes + b.bytes,
    }
}
