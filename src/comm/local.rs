//! The in-process backend: ranks are threads that meet in shared memory.
//!
//! Every collective a rank issues takes the next sequence number of its communicator and posts
//! its description and input bytes in that number's slot. The first description posted is the
//! reference: a different one breaks the communicator with [`Error::CommMismatch`]. Once all
//! ranks have posted, each takes every input (in rank order) and computes its own output; the
//! last to leave frees the slot. A rank that waits past the timeout breaks the communicator with
//! [`Error::CommTimeout`]. A broken communicator fails every later call at once, on every rank.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::{Elem, ReduceOp};
use crate::error::{Error, Result};

/// Kinds of calls, as named in mismatch errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast,
    Reduce,
    Barrier,
    Split,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::Barrier => "barrier",
            Kind::Split => "split",
        }
    }
}

/// What a rank asked for; every rank of a collective must ask for the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    kind: Kind,
    elem: Elem,
    count: usize,
    op: Option<ReduceOp>,
    root: Option<usize>,
}

impl Desc {
    pub(crate) fn new(kind: Kind, elem: Elem, count: usize) -> Self {
        Desc {
            kind,
            elem,
            count,
            op: None,
            root: None,
        }
    }

    pub(crate) fn op(mut self, op: ReduceOp) -> Self {
        self.op = Some(op);
        self
    }

    pub(crate) fn root(mut self, root: usize) -> Self {
        self.root = Some(root);
        self
    }
}

impl std::fmt::Display for Desc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}({} x {}", self.kind.name(), self.count, self.elem)?;
        if let Some(op) = self.op {
            write!(f, ", {op:?}")?;
        }
        if let Some(r) = self.root {
            write!(f, ", root {r}")?;
        }
        f.write_str(")")
    }
}

struct Slot {
    desc: Vec<Option<Desc>>,
    data: Vec<Arc<[u8]>>,
    left: usize,
}

struct Mail {
    elem: Elem,
    count: usize,
    data: Vec<u8>,
}

#[derive(Default)]
struct State {
    slots: HashMap<u64, Slot>,
    mail: HashMap<(usize, usize), VecDeque<Mail>>,
    splits: HashMap<(u64, u32), Arc<Shared>>,
    broken: Option<Error>,
}

/// The meeting place of one group of ranks.
pub(crate) struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn deadline(&self) -> Instant {
        super::deadline_after(self.timeout)
    }

    pub(crate) fn new(world: usize, timeout: Duration) -> Arc<Shared> {
        Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        })
    }

    /// Breaks the group, and every group split from it, for every rank: calls waiting now and
    /// every later call return [`Error::CommAborted`] with `reason` (unless an earlier error
    /// broke the group first, which they keep returning).
    pub(crate) fn abort(&self, reason: &str) {
        let splits: Vec<Arc<Shared>> = {
            let mut st = self.state.lock();
            if st.broken.is_none() {
                st.broken = Some(Error::CommAborted {
                    reason: reason.to_string(),
                });
            }
            self.cv.notify_all();
            st.splits.values().cloned().collect()
        };
        for s in splits {
            s.abort(reason);
        }
    }

    pub(crate) fn member(self: &Arc<Self>, rank: usize) -> Member {
        Member {
            rank,
            shared: Arc::clone(self),
            seq: AtomicU64::new(0),
        }
    }
}

/// One rank's handle.
pub(crate) struct Member {
    rank: usize,
    shared: Arc<Shared>,
    seq: AtomicU64,
}

fn copy_err(e: &Error) -> Error {
    match e {
        Error::CommMismatch { seq, detail } => Error::CommMismatch {
            seq: *seq,
            detail: detail.clone(),
        },
        Error::CommTimeout {
            what,
            waited_ms,
            missing,
        } => Error::CommTimeout {
            what: what.clone(),
            waited_ms: *waited_ms,
            missing: missing.clone(),
        },
        Error::CommAborted { reason } => Error::CommAborted {
            reason: reason.clone(),
        },
        other => Error::InvalidArgument(other.to_string()),
    }
}

impl Member {
    fn fail(&self, st: &mut MutexGuard<'_, State>, e: Error) -> Error {
        let out = copy_err(&e);
        if st.broken.is_none() {
            st.broken = Some(e);
        }
        self.shared.cv.notify_all();
        out
    }

    fn check_broken(st: &MutexGuard<'_, State>) -> Result<()> {
        match &st.broken {
            Some(e) => Err(copy_err(e)),
            None => Ok(()),
        }
    }

    /// The group this rank belongs to.
    pub(crate) fn group(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    /// The error that broke the group, if any.
    pub(crate) fn check(&self) -> Result<()> {
        Self::check_broken(&self.shared.state.lock())
    }

    /// Posts this rank's part of the next collective and returns every rank's part, in rank
    /// order, once all have posted.
    pub(crate) fn exchange(&self, desc: Desc, data: Vec<u8>) -> Result<Vec<Arc<[u8]>>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let world = self.shared.world;
        let mut st = self.shared.state.lock();
        Self::check_broken(&st)?;
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            desc: vec![None; world],
            data: vec![Arc::from(Vec::new()); world],
            left: world,
        });
        if let Some((r, d)) = slot
            .desc
            .iter()
            .enumerate()
            .find_map(|(r, d)| d.map(|d| (r, d)))
        {
            if d != desc {
                let detail = format!("rank {} called {desc} where rank {r} called {d}", self.rank);
                return Err(self.fail(&mut st, Error::CommMismatch { seq, detail }));
            }
        }
        slot.desc[self.rank] = Some(desc);
        slot.data[self.rank] = Arc::from(data);
        self.shared.cv.notify_all();
        let deadline = self.shared.deadline();
        loop {
            Self::check_broken(&st)?;
            let slot = st
                .slots
                .get(&seq)
                .expect("a slot lives until every rank left it");
            if slot.desc.iter().all(Option::is_some) {
                break;
            }
            if self.shared.cv.wait_until(&mut st, deadline).timed_out() {
                Self::check_broken(&st)?;
                let slot = st.slots.get(&seq).expect("slot");
                if slot.desc.iter().all(Option::is_some) {
                    break;
                }
                let missing = (0..world).filter(|&r| slot.desc[r].is_none()).collect();
                let e = Error::CommTimeout {
                    what: format!("{desc} (call #{seq}) on rank {}", self.rank),
                    waited_ms: self.shared.timeout.as_millis() as u64,
                    missing,
                };
                return Err(self.fail(&mut st, e));
            }
        }
        let slot = st.slots.get_mut(&seq).expect("slot");
        let out = slot.data.clone();
        slot.left -= 1;
        if slot.left == 0 {
            st.slots.remove(&seq);
        }
        Ok(out)
    }

    pub(crate) fn send(&self, peer: usize, elem: Elem, count: usize, data: Vec<u8>) -> Result<()> {
        let mut st = self.shared.state.lock();
        Self::check_broken(&st)?;
        st.mail
            .entry((self.rank, peer))
            .or_default()
            .push_back(Mail { elem, count, data });
        self.shared.cv.notify_all();
        Ok(())
    }

    pub(crate) fn recv(&self, peer: usize, elem: Elem, count: usize) -> Result<Vec<u8>> {
        let mut st = self.shared.state.lock();
        let deadline = self.shared.deadline();
        loop {
            Self::check_broken(&st)?;
            if let Some(m) = st
                .mail
                .get_mut(&(peer, self.rank))
                .and_then(VecDeque::pop_front)
            {
                if m.elem != elem || m.count != count {
                    let detail = format!(
                        "rank {} receives {count} x {elem} from rank {peer}, which sent {} x {}",
                        self.rank, m.count, m.elem
                    );
                    let seq = self.seq.load(Ordering::Relaxed);
                    return Err(self.fail(&mut st, Error::CommMismatch { seq, detail }));
                }
                return Ok(m.data);
            }
            if self.shared.cv.wait_until(&mut st, deadline).timed_out() {
                let e = Error::CommTimeout {
                    what: format!(
                        "recv({count} x {elem}) from rank {peer} on rank {}",
                        self.rank
                    ),
                    waited_ms: self.shared.timeout.as_millis() as u64,
                    missing: vec![peer],
                };
                return Err(self.fail(&mut st, e));
            }
        }
    }

    /// The sub-group of ranks with this rank's color: `(member, rank, world)`.
    pub(crate) fn split(
        &self,
        color: Option<u32>,
        key: u32,
    ) -> Result<Option<(Member, usize, usize)>> {
        let seq = self.seq.load(Ordering::Relaxed);
        let c = color.unwrap_or(u32::MAX);
        let mut mine = c.to_le_bytes().to_vec();
        mine.extend_from_slice(&key.to_le_bytes());
        let all = self.exchange(Desc::new(Kind::Split, Elem::U8, 8), mine)?;
        let Some(color) = color else {
            return Ok(None);
        };
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let mut members: Vec<(u32, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, b)| word(b) == color)
            .map(|(r, b)| (word(&b[4..]), r))
            .collect();
        members.sort_unstable();
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank has its own color");
        let world = members.len();
        let mut st = self.shared.state.lock();
        let shared = Arc::clone(
            st.splits
                .entry((seq, color))
                .or_insert_with(|| Shared::new(world, self.shared.timeout)),
        );
        Ok(Some((shared.member(rank), rank, world)))
    }
}
