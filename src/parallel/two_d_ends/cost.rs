//! The collectives of the 2D / 2.5D embeddings and classifier, per group.

use crate::comm::Tally;

/// `calls` calls of `bytes` bytes each.
pub(super) fn tally(calls: usize, bytes: usize) -> Tally {
    Tally {
        calls: calls as u64,
        bytes: (calls * bytes) as u64,
    }
}
