//! What a communicator has done: calls and bytes per kind of collective.

use serde::Serialize;

/// Calls and bytes of one kind of collective.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Calls.
    pub calls: u64,
    /// Bytes of the whole collective buffer per call, summed: the gathered output of an
    /// all-gather, the input of a reduce-scatter, the buffer of an all-reduce, broadcast or
    /// reduce, the message of a send or receive.
    pub bytes: u64,
}

impl Tally {
    pub(super) fn add(&mut self, bytes: usize) {
        self.calls += 1;
        self.bytes += bytes as u64;
    }

    fn since(&self, o: &Tally) -> Tally {
        Tally {
            calls: self.calls.saturating_sub(o.calls),
            bytes: self.bytes.saturating_sub(o.bytes),
        }
    }
}

/// What a communicator has done since it was created (see [`Communicator::stats`]).
///
/// [`Communicator::stats`]: super::Communicator::stats
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CommStats {
    /// All-gathers.
    pub all_gather: Tally,
    /// Reduce-scatters.
    pub reduce_scatter: Tally,
    /// All-reduces.
    pub all_reduce: Tally,
    /// Broadcasts.
    pub broadcast: Tally,
    /// Reduces.
    pub reduce: Tally,
    /// Sends.
    pub send: Tally,
    /// Receives.
    pub recv: Tally,
    /// Barriers.
    pub barrier: Tally,
}

impl CommStats {
    /// The calls and bytes since an earlier snapshot (0 where the snapshot is the later one).
    pub fn since(&self, o: &CommStats) -> CommStats {
        CommStats {
            all_gather: self.all_gather.since(&o.all_gather),
            reduce_scatter: self.reduce_scatter.since(&o.reduce_scatter),
            all_reduce: self.all_reduce.since(&o.all_reduce),
            broadcast: self.broadcast.since(&o.broadcast),
            reduce: self.reduce.since(&o.reduce),
            send: self.send.since(&o.send),
            recv: self.recv.since(&o.recv),
            barrier: self.barrier.since(&o.barrier),
        }
    }

    /// Bytes each rank sends over the links with ring algorithms, NCCL's "bus bytes":
    /// `(N−1)/N` of every all-gather and reduce-scatter buffer, `2(N−1)/N` of every all-reduce
    /// buffer, the whole of every broadcast, reduce and send.
    pub fn bus_bytes(&self, world: usize) -> f64 {
        let n = world.max(1) as f64;
        let f = (n - 1.0) / n;
        f * (self.all_gather.bytes + self.reduce_scatter.bytes) as f64
            + 2.0 * f * self.all_reduce.bytes as f64
            + (self.broadcast.bytes + self.reduce.bytes + self.send.bytes) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_bytes_follow_the_ring_factors() {
        let mut s = CommStats::default();
        s.all_gather.add(400);
        s.reduce_scatter.add(400);
        s.all_reduce.add(100);
        assert_eq!(s.bus_bytes(4), 0.75 * 800.0 + 1.5 * 100.0);
        assert_eq!(s.bus_bytes(1), 0.0);
    }
}
