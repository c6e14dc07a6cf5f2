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
    /// One more call of `bytes` bytes.
    pub(super) fn count(&mut self, bytes: usize) {
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

impl std::ops::Add for Tally {
    type Output = Tally;

    fn add(self, o: Tally) -> Tally {
        Tally {
            calls: self.calls + o.calls,
            bytes: self.bytes + o.bytes,
        }
    }
}

impl std::ops::Add for CommStats {
    type Output = CommStats;

    fn add(self, o: CommStats) -> CommStats {
        CommStats {
            all_gather: self.all_gather + o.all_gather,
            reduce_scatter: self.reduce_scatter + o.reduce_scatter,
            all_reduce: self.all_reduce + o.all_reduce,
            broadcast: self.broadcast + o.broadcast,
            reduce: self.reduce + o.reduce,
            send: self.send + o.send,
            recv: self.recv + o.recv,
            barrier: self.barrier + o.barrier,
        }
    }
}

impl std::ops::AddAssign for CommStats {
    fn add_assign(&mut self, o: CommStats) {
        *self = *self + o;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_bytes_follow_the_ring_factors() {
        let mut s = CommStats::default();
        s.all_gather.count(400);
        s.reduce_scatter.count(400);
        s.all_reduce.count(100);
        assert_eq!(s.bus_bytes(4), 0.75 * 800.0 + 1.5 * 100.0);
        assert_eq!(s.bus_bytes(1), 0.0);
    }

    #[test]
    fn stats_add_per_kind() {
        let mut a = CommStats::default();
        a.send.count(8);
        let mut b = CommStats::default();
        b.send.count(4);
        b.barrier.count(0);
        let c = a + b;
        assert_eq!((c.send.calls, c.send.bytes, c.barrier.calls), (2, 12, 1));
        a += b;
        assert_eq!(a, c);
    }
}
