//! Stream ordering: vector clocks that decide whether an access to a device buffer is ordered
//! after every conflicting earlier access.
//!
//! Every stream of a device has a slot. Each enqueued operation gets a stamp `(stream, seq)`.
//! A stream *knows* the stamps it is ordered after: its own earlier operations, those covered by
//! events it waited on, and those the host has observed complete (host synchronisation orders
//! everything enqueued afterwards). An access is legal when every conflicting earlier access
//! (write–read, read–write, write–write) is known to its stream. This is exactly the ordering a
//! GPU guarantees; anything else is a race, which the device layer reports as
//! [`crate::Error::UnorderedAccess`] instead of enqueuing.

use crate::error::{Error, Result};

/// A vector clock: for each stream slot, the highest sequence number known complete or ordered.
pub(crate) type Clock = Vec<u64>;

fn get(c: &Clock, i: usize) -> u64 {
    c.get(i).copied().unwrap_or(0)
}

fn join(into: &mut Clock, other: &Clock) {
    if into.len() < other.len() {
        into.resize(other.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(other) {
        *a = (*a).max(*b);
    }
}

/// One enqueued operation: the stream slot and its sequence number on that stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub stream: usize,
    pub seq: u64,
}

/// How an operation touches a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

impl Access {
    fn name(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
        }
    }
}

/// The accesses of one buffer that later accesses must be ordered after.
#[derive(Debug, Default)]
pub(crate) struct AccessRecord {
    write: Option<Stamp>,
    /// Latest read per stream since the last write.
    reads: Vec<Stamp>,
}

/// The clocks of one device.
#[derive(Debug, Default)]
pub(crate) struct Clocks {
    /// Operations enqueued so far, per stream.
    seq: Vec<u64>,
    /// The last operation that touches a buffer, per stream (event records and waits do not):
    /// what a wait for the stream waits for.
    work: Vec<u64>,
    /// What each stream is ordered after.
    known: Vec<Clock>,
    /// What the host has observed complete.
    host: Clock,
}

impl Clocks {
    /// Registers a new stream and returns its slot.
    pub(crate) fn add_stream(&mut self) -> usize {
        self.seq.push(0);
        self.work.push(0);
        self.known.push(Vec::new());
        self.seq.len() - 1
    }

    fn ordered(&self, stream: usize, s: Stamp) -> bool {
        s.stream == stream
            || get(&self.known[stream], s.stream) >= s.seq
            || get(&self.host, s.stream) >= s.seq
    }

    fn conflict(
        &self,
        stream: usize,
        rec: &AccessRecord,
        access: Access,
    ) -> Option<(Stamp, Access)> {
        if let Some(w) = rec.write {
            if !self.ordered(stream, w) {
                return Some((w, Access::Write));
            }
        }
        if access == Access::Write {
            if let Some(r) = rec.reads.iter().find(|r| !self.ordered(stream, **r)) {
                return Some((*r, Access::Read));
            }
        }
        None
    }

    /// Checks that every access is ordered, then stamps a new operation on `stream` and records
    /// the accesses. On a conflict nothing is recorded.
    pub(crate) fn stamp(
        &mut self,
        stream: usize,
        accesses: &mut [(&mut AccessRecord, u64, Access)],
    ) -> Result<Stamp> {
        for (rec, id, access) in accesses.iter() {
            if let Some((earlier, kind)) = self.conflict(stream, rec, *access) {
                return Err(Error::UnorderedAccess {
                    buffer: *id,
                    access: access.name(),
                    stream,
                    earlier: kind.name(),
                    other_stream: earlier.stream,
                });
            }
        }
        self.seq[stream] += 1;
        self.work[stream] = self.seq[stream];
        let stamp = Stamp {
            stream,
            seq: self.seq[stream],
        };
        for (rec, _, access) in accesses.iter_mut() {
            match access {
                Access::Write => {
                    rec.write = Some(stamp);
                    rec.reads.clear();
                }
                Access::Read => match rec.reads.iter_mut().find(|r| r.stream == stream) {
                    Some(r) => *r = stamp,
                    None => rec.reads.push(stamp),
                },
            }
        }
        Ok(stamp)
    }

    /// Stamps an operation that touches no buffer (an event record, a wait).
    pub(crate) fn stamp_plain(&mut self, stream: usize) -> Stamp {
        self.seq[stream] += 1;
        Stamp {
            stream,
            seq: self.seq[stream],
        }
    }

    /// Everything `stream` is ordered after, including all of its own enqueued operations
    /// that touch a buffer (only those are ever checked for order, so records and waits, which
    /// touch none, are left out: a wait for an idle stream the host has seen finish does not
    /// block).
    pub(crate) fn snapshot(&self, stream: usize) -> Clock {
        let mut c = self.known[stream].clone();
        if c.len() <= stream {
            c.resize(stream + 1, 0);
        }
        c[stream] = c[stream].max(self.work[stream]);
        c
    }

    /// `stream` waits on an event that captured `clock`.
    pub fn wait(&mut self, stream: usize, clock: &Clock) {
        join(&mut self.known[stream], clock);
    }

    /// Whether the host has already observed everything in `clock` complete (a wait for it
    /// would not block).
    pub(crate) fn observed(&self, clock: &Clock) -> bool {
        clock
            .iter()
            .enumerate()
            .all(|(i, &c)| c <= get(&self.host, i))
    }

    /// The host has observed everything in `clock` complete.
    pub(crate) fn observe(&mut self, clock: &Clock) {
        join(&mut self.host, clock);
    }

    /// The host has observed every stream idle.
    #[cfg(test)]
    pub(crate) fn observe_all(&mut self) {
        for s in 0..self.seq.len() {
            let c = self.snapshot(s);
            join(&mut self.host, &c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_stream_is_always_ordered() {
        let mut c = Clocks::default();
        let s = c.add_stream();
        let mut r = AccessRecord::default();
        c.stamp(s, &mut [(&mut r, 1, Access::Write)]).unwrap();
        c.stamp(s, &mut [(&mut r, 1, Access::Read)]).unwrap();
        c.stamp(s, &mut [(&mut r, 1, Access::Write)]).unwrap();
    }

    #[test]
    fn cross_stream_needs_an_event_or_host_sync() {
        let mut c = Clocks::default();
        let a = c.add_stream();
        let b = c.add_stream();
        let mut r = AccessRecord::default();
        c.stamp(a, &mut [(&mut r, 7, Access::Write)]).unwrap();
        let err = c.stamp(b, &mut [(&mut r, 7, Access::Read)]).unwrap_err();
        assert!(
            matches!(err, Error::UnorderedAccess { buffer: 7, .. }),
            "{err}"
        );
        // An event recorded on `a` after the write and waited on by `b` orders the read.
        let ev = c.snapshot(a);
        c.wait(b, &ev);
        c.stamp(b, &mut [(&mut r, 7, Access::Read)]).unwrap();
        // A write on `a` must now be ordered after b's read: it is not.
        assert!(c.stamp(a, &mut [(&mut r, 7, Access::Write)]).is_err());
        // Host synchronisation with `b` orders it.
        let snap = c.snapshot(b);
        c.observe(&snap);
        c.stamp(a, &mut [(&mut r, 7, Access::Write)]).unwrap();
    }

    #[test]
    fn concurrent_reads_are_fine() {
        let mut c = Clocks::default();
        let a = c.add_stream();
        let b = c.add_stream();
        let mut r = AccessRecord::default();
        c.stamp(a, &mut [(&mut r, 1, Access::Read)]).unwrap();
        c.stamp(b, &mut [(&mut r, 1, Access::Read)]).unwrap();
        assert!(c.stamp(b, &mut [(&mut r, 1, Access::Write)]).is_err());
        c.observe_all();
        c.stamp(b, &mut [(&mut r, 1, Access::Write)]).unwrap();
    }

    #[test]
    fn a_rejected_access_records_nothing() {
        let mut c = Clocks::default();
        let a = c.add_stream();
        let b = c.add_stream();
        let mut r1 = AccessRecord::default();
        let mut r2 = AccessRecord::default();
        c.stamp(a, &mut [(&mut r1, 1, Access::Write)]).unwrap();
        assert!(c
            .stamp(
                b,
                &mut [(&mut r2, 2, Access::Write), (&mut r1, 1, Access::Read)]
            )
            .is_err());
        assert!(r2.write.is_none());
        // stream b's sequence did not advance
        assert_eq!(c.snapshot(b)[b], 0);
    }
}
