//! The stand-in's stream ops: collectives (each rank's part a file, the result computed when
//! every part is there) and point-to-point messages (a file the receiver takes).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::fs;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::reduce::{reduce, Dt, Red};
use super::*;

/// The collectives, as one rank sees them.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    AllGather,
    AllReduce,
    ReduceScatter,
    Broadcast,
    Reduce,
}

/// A collective of rank `c.rank`: sends `send_len` bytes at `send` (when it has a part),
/// receives `recv_len` bytes at `recv`.
struct Collective {
    c: Arc<Shared>,
    seq: u64,
    kind: Kind,
    dt: Dt,
    op: Red,
    root: usize,
    send: usize,
    send_len: usize,
    recv: usize,
    recv_len: usize,
    published: bool,
}

impl Collective {
    fn name(&self, rank: usize) -> String {
        format!("c{}.r{rank}", self.seq)
    }

    /// Does what can be done now; whether the collective is done.
    fn poll(&mut self) -> bool {
        let c = Arc::clone(&self.c);
        if c.ended() {
            return true; // an aborted or failed communicator's work ends without computing
        }
        // the communicator's collectives run in the order they were enqueued
        if c.completed.load(Ordering::Acquire) + 1 != self.seq {
            return false;
        }
        if !self.published {
            let has_part = self.kind != Kind::Broadcast || c.rank == self.root;
            // SAFETY: `send` lies inside a live allocation (checked at the enqueue) whose free
            // is ordered after this op.
            let part: &[u8] = if has_part && self.send_len > 0 {
                unsafe { std::slice::from_raw_parts(self.send as *const u8, self.send_len) }
            } else {
                &[]
            };
            if let Err(e) = c.publish(&self.name(c.rank), part) {
                c.fail(NCCL_SYSTEM_ERROR, &e.to_string());
                return true;
            }
            self.published = true;
            // Every rank read collective seq - 2 before it ran seq - 1, which this rank's run
            // of seq - 1 waited for: its part of seq - 2 is no longer read.
            if self.seq > 2 {
                let _ = fs::remove_file(c.file(&format!("c{}.r{}", self.seq - 2, c.rank)));
            }
        }
        let prefix = format!("c{}", self.seq);
        if !c.all_present(&prefix) {
            // a lost peer fails the communicator: this collective ends without computing
            return c.peer_lost(&prefix);
        }
        if let Err(e) = self.compute() {
            c.fail(NCCL_SYSTEM_ERROR, &e.to_string());
        }
        c.completed.store(self.seq, Ordering::Release);
        true
    }

    fn compute(&self) -> std::io::Result<()> {
        let c = &self.c;
        let read = |r: usize| fs::read(c.file(&self.name(r)));
        let out: Vec<u8> = match self.kind {
            Kind::Broadcast => read(self.root)?,
            Kind::AllGather => {
                let mut all = Vec::with_capacity(self.recv_len);
                for r in 0..c.world {
                    all.extend(read(r)?);
                }
                all
            }
            Kind::Reduce if c.rank != self.root => return Ok(()),
            Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter => {
                let parts = (0..c.world)
                    .map(read)
                    .collect::<std::io::Result<Vec<_>>>()?;
                let at = if self.kind == Kind::ReduceScatter {
                    c.rank * self.recv_len
                } else {
                    0
                };
                let slices: Vec<&[u8]> = parts
                    .iter()
                    .map(|p| p.get(at..at + self.recv_len).unwrap_or(&[]))
                    .collect();
                if slices.iter().any(|s| s.len() != self.recv_len) {
                    return Err(std::io::Error::other("the ranks' parts differ in length"));
                }
                reduce(self.dt, self.op, &slices)
            }
        };
        if out.len() != self.recv_len {
            return Err(std::io::Error::other(format!(
                "{} bytes arrived where {} were expected",
                out.len(),
                self.recv_len
            )));
        }
        // SAFETY: `recv` lies inside a live allocation (checked at the enqueue) whose free is
        // ordered after this op.
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), self.recv as *mut u8, out.len()) };
        Ok(())
    }
}

/// Enqueues `poll` on `stream` using the device ranges `ranges` (each inside one live
/// allocation); a collective (`ordered`) after the communicator's previous one.
fn enqueue_external(
    stream: *mut c_void,
    ranges: Vec<(usize, usize)>,
    ordered: Option<&Shared>,
    poll: Box<dyn FnMut() -> bool + Send>,
) -> NcclResult {
    let r = with(|st| {
        let Some(id) = st.stream_id(stream) else {
            return INVALID_HANDLE;
        };
        for &(p, len) in &ranges {
            if len > 0 && !st.device_range(p, len) {
                eprintln!(
                    "tidemem-cuda-emu: NCCL: {len} bytes at {p:#x} are not inside one live \
                     allocation"
                );
                return INVALID_VALUE;
            }
        }
        let Some(c) = ordered else {
            let after = None;
            return st.enqueue(
                id,
                Op::External {
                    poll,
                    after,
                    ranges,
                },
            );
        };
        let mut last = c.last.lock().unwrap_or_else(|p| p.into_inner());
        let after = last.filter(|&(s, _)| s != id);
        let r = st.enqueue(
            id,
            Op::External {
                poll,
                after,
                ranges,
            },
        );
        if r == SUCCESS {
            *last = Some((id, st.streams[&id].last));
        }
        r
    });
    match r {
        SUCCESS => NCCL_SUCCESS,
        INVALID_VALUE | INVALID_HANDLE => NCCL_INVALID_ARGUMENT,
        _ => 1, // ncclUnhandledCudaError
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn collective(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: c_int,
    op: c_int,
    root: c_int,
    c: Comm,
    stream: *mut c_void,
) -> NcclResult {
    let (Some(c), Some(dt)) = (comm(c), Dt::from(dt)) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let op = match kind {
        Kind::AllReduce | Kind::ReduceScatter | Kind::Reduce => Red::from(op),
        Kind::AllGather | Kind::Broadcast => Some(Red::Sum),
    };
    let Some(op) = op else {
        return NCCL_INVALID_ARGUMENT;
    };
    if root < 0 || root as usize >= c.world {
        return NCCL_INVALID_ARGUMENT;
    }
    if !c.joined() {
        set_last_error("a collective before every rank joined");
        return NCCL_INVALID_USAGE;
    }
    let bytes = count * dt.size();
    let (send_len, recv_len) = match kind {
        Kind::AllGather => (bytes, bytes * c.world),
        Kind::ReduceScatter => (bytes * c.world, bytes),
        _ => (bytes, bytes),
    };
    let root = root as usize;
    let recv_len = if kind == Kind::Reduce && c.rank != root {
        0
    } else {
        recv_len
    };
    let send_len = if kind == Kind::Broadcast && c.rank != root {
        0
    } else {
        send_len
    };
    let seq = c.issued.fetch_add(1, Ordering::AcqRel) + 1;
    let mut op = Collective {
        c: Arc::clone(c),
        seq,
        kind,
        dt,
        op,
        root,
        send: send as usize,
        send_len,
        recv: recv as usize,
        recv_len,
        published: false,
    };
    let ranges = vec![(send as usize, send_len), (recv as usize, recv_len)];
    enqueue_external(stream, ranges, Some(c), Box::new(move || op.poll()))
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    collective(Kind::AllGather, send, recv, count, dt, -1, 0, c, s)
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: c_int,
    op: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    collective(Kind::AllReduce, send, recv, count, dt, op, 0, c, s)
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: c_int,
    op: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    collective(Kind::ReduceScatter, send, recv, count, dt, op, 0, c, s)
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: c_int,
    root: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    collective(Kind::Broadcast, send, recv, count, dt, -1, root, c, s)
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: c_int,
    op: c_int,
    root: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    collective(Kind::Reduce, send, recv, count, dt, op, root, c, s)
}

/// The next message number between this rank and `peer` in `table`.
fn next_message(table: &Mutex<HashMap<usize, u64>>, peer: usize) -> u64 {
    let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
    let n = t.entry(peer).or_insert(0);
    *n += 1;
    *n
}

/// A message's communicator, length in bytes, address and file (the next message from this
/// rank to `peer` when `sending`, else from `peer` to it); `None` for a bad argument.
unsafe fn message(
    c: Comm,
    dt: c_int,
    peer: c_int,
    count: usize,
    buf: usize,
    sending: bool,
) -> Option<(Arc<Shared>, usize, usize, String)> {
    let (c, dt) = (comm(c)?, Dt::from(dt)?);
    let peer = usize::try_from(peer).ok().filter(|&p| p < c.world)?;
    let (from, to, table) = if sending {
        (c.rank, peer, &c.sent)
    } else {
        (peer, c.rank, &c.received)
    };
    let name = format!("p{from}.{to}.{}", next_message(table, peer));
    Some((Arc::clone(c), count * dt.size(), buf, name))
}

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    buf: *const c_void,
    count: usize,
    dt: c_int,
    peer: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    let Some((c, len, at, name)) = message(c, dt, peer, count, buf as usize, true) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let poll = move || {
        if !c.aborted.load(Ordering::Acquire) {
            // SAFETY: inside a live allocation (checked at the enqueue), freed after this op.
            let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, len) };
            if let Err(e) = c.publish(&name, bytes) {
                c.fail(NCCL_SYSTEM_ERROR, &e.to_string());
            }
        }
        true
    };
    enqueue_external(s, vec![(at, len)], None, Box::new(poll))
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    buf: *mut c_void,
    count: usize,
    dt: c_int,
    peer: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    let Some((c, len, at, name)) = message(c, dt, peer, count, buf as usize, false) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let poll = move || {
        if c.ended() {
            return true;
        }
        let path = c.file(&name);
        let Ok(bytes) = fs::read(&path) else {
            c.peer_aborted();
            return false;
        };
        let _ = fs::remove_file(&path);
        if bytes.len() != len {
            c.fail(
                NCCL_SYSTEM_ERROR,
                &format!("a message of {} bytes for a receive of {len}", bytes.len()),
            );
            return true;
        }
        // SAFETY: inside a live allocation (checked at the enqueue), freed after this op.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, len) };
        true
    };
    enqueue_external(s, vec![(at, len)], None, Box::new(poll))
}
