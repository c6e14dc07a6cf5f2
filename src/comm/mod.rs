//! Collectives with NCCL's semantics: all-gather, reduce-scatter, all-reduce, broadcast, reduce,
//! send/recv, barrier, and sub-communicators by [`Communicator::split`].
//!
//! Two backends sit behind one [`Communicator`]:
//! - **In-process** ([`Communicator::local`]): ranks are threads of one process, each with its
//!   own [`Device`]. Every collective checks that all ranks issued the same call (kind, element
//!   type, count, root, operation) at the same position of their sequence and returns
//!   [`Error::CommMismatch`] otherwise; a rank that waits longer than the timeout gets
//!   [`Error::CommTimeout`] naming the ranks that never came. Either error breaks the
//!   communicator for every rank, so no test hangs. Reductions run in rank order with f64 (or
//!   128-bit integer) accumulation and one rounding, so results are deterministic and identical
//!   on every rank. A call returns once every rank has posted its input; the output's copy
//!   into device memory is enqueued on the caller's stream and the host does not wait for it,
//!   so, as with NCCL, work on another stream must wait for an event recorded after the call
//!   (the simulated device reports the race otherwise).
//! - **NCCL** ([`Communicator::nccl`]): one rank per GPU, in one process per GPU or one thread
//!   per GPU. Calls are enqueued on the caller's stream and return at once, as in NCCL; the
//!   buffers follow the device layer's stream-ordering rules. Ranks meet through
//!   [`rendezvous`]: rank 0 creates the NCCL unique id and serves it over TCP on
//!   `MASTER_ADDR:MASTER_PORT`. NCCL failures become [`Error::Nccl`] with NCCL's code and message.
//!
//! Buffers are device views of bytes; the element type is given with each call
//! ([`Elem`]), and lengths must be whole elements. In-place calls follow NCCL: an all-gather
//! whose input is the caller's slot of the output (`recv[rank·n..(rank+1)·n]`), a
//! reduce-scatter whose output is the caller's slot of the input, an all-reduce with the same
//! view twice.
//!
//! ```
//! use tidemem::comm::{Communicator, Elem, ReduceOp};
//! use tidemem::device::{Device, SimConfig};
//! # fn main() -> tidemem::Result<()> {
//! let devices = (0..4)
//!     .map(|_| Device::sim(SimConfig::with_capacity(1 << 20)))
//!     .collect::<tidemem::Result<Vec<_>>>()?;
//! let comms = Communicator::local(devices)?;
//! let sums = std::thread::scope(|s| {
//!     let handles: Vec<_> = comms
//!         .iter()
//!         .map(|c| {
//!             s.spawn(move || -> tidemem::Result<Vec<f32>> {
//!                 let mut x = vec![c.rank() as f32; 3];
//!                 c.all_reduce_host(&mut x, ReduceOp::Sum)?;
//!                 Ok(x)
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
//! });
//! for s in sums {
//!     assert_eq!(s?, vec![6.0; 3]); // 0 + 1 + 2 + 3 on every rank
//! }
//! # Ok(()) }
//! ```

mod local;
mod nccl;
pub mod rendezvous;

use std::fmt;
use std::time::Duration;

use half::{bf16, f16};
use parking_lot::Mutex;
use serde::Serialize;

use crate::device::{Device, DeviceView, HostBuffer, Pending, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

pub use rendezvous::LaunchEnv;

/// Element type of a collective's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Elem {
    /// Unsigned bytes.
    U8,
    /// 32-bit signed integers.
    I32,
    /// 64-bit signed integers.
    I64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
}

impl Elem {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::F16 | Elem::BF16 => 2,
            Elem::I32 | Elem::F32 => 4,
            Elem::I64 | Elem::F64 => 8,
        }
    }

    /// Short lowercase name.
    pub const fn name(self) -> &'static str {
        match self {
            Elem::U8 => "u8",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
            Elem::F16 => "f16",
            Elem::BF16 => "bf16",
            Elem::F32 => "f32",
            Elem::F64 => "f64",
        }
    }
}

impl From<DType> for Elem {
    fn from(d: DType) -> Self {
        match d {
            DType::F32 => Elem::F32,
            DType::F16 => Elem::F16,
            DType::BF16 => Elem::BF16,
            DType::F64 => Elem::F64,
            DType::U8 => Elem::U8,
            DType::I32 | DType::U32 => Elem::I32,
            DType::I64 | DType::U64 => Elem::I64,
        }
    }
}

impl fmt::Display for Elem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction of a reducing collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum (NaN wins on the in-process backend).
    Max,
    /// Minimum (NaN wins on the in-process backend).
    Min,
    /// Sum divided by the world size (integer types truncate).
    Avg,
}

/// Host element types the host helpers ([`Communicator::all_reduce_host`]) accept.
pub trait HostElem: bytemuck::Pod {
    /// The collective element type.
    const ELEM: Elem;
}

impl HostElem for u8 {
    const ELEM: Elem = Elem::U8;
}
impl HostElem for i32 {
    const ELEM: Elem = Elem::I32;
}
impl HostElem for i64 {
    const ELEM: Elem = Elem::I64;
}
impl HostElem for f32 {
    const ELEM: Elem = Elem::F32;
}
impl HostElem for f64 {
    const ELEM: Elem = Elem::F64;
}

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
    fn add(&mut self, bytes: usize) {
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

enum Imp {
    Local(local::Member),
    Nccl(nccl::NcclComm),
}

/// A member of a group of ranks that run collectives together. See the [module docs](self).
pub struct Communicator {
    rank: usize,
    world: usize,
    // Dropped before the device: an NCCL communicator is destroyed while its context lives.
    imp: Imp,
    device: Device,
    stats: Mutex<CommStats>,
    /// Output copies of in-process collectives not yet known complete (their staging buffers).
    uploads: Mutex<Vec<Pending<HostBuffer>>>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("backend", &self.backend_name())
            .finish()
    }
}

/// The instant `timeout` from now; a timeout too long to add (say `Duration::MAX`) is a
/// century, which no wait reaches.
pub(crate) fn deadline_after(timeout: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Default time an in-process rank waits for the others.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

impl Communicator {
    /// One in-process communicator per device (rank `i` on `devices[i]`), to be moved to one
    /// thread each; ranks wait at most [`DEFAULT_TIMEOUT`] for each other.
    pub fn local(devices: Vec<Device>) -> Result<Vec<Communicator>> {
        Self::local_with_timeout(devices, DEFAULT_TIMEOUT)
    }

    /// Like [`Communicator::local`] with a given timeout.
    pub fn local_with_timeout(
        devices: Vec<Device>,
        timeout: Duration,
    ) -> Result<Vec<Communicator>> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument(
                "a communicator needs at least one rank".into(),
            ));
        }
        let world = devices.len();
        let shared = local::Shared::new(world, timeout);
        Ok(devices
            .into_iter()
            .enumerate()
            .map(|(rank, device)| {
                Communicator::from_imp(rank, world, device, Imp::Local(shared.member(rank)))
            })
            .collect())
    }

    /// The NCCL rank `env.rank` of `env.world_size` on `device` (a CUDA device), meeting the
    /// others through [`rendezvous::exchange_id`] within `timeout`. The same timeout bounds
    /// NCCL's initialization and every [`Communicator::wait`].
    pub fn nccl(device: Device, env: &LaunchEnv, timeout: Duration) -> Result<Communicator> {
        let id = if env.rank == 0 {
            Some(nccl::unique_id()?)
        } else {
            None
        };
        let id = rendezvous::exchange_id(env, id, timeout)?;
        Self::nccl_with_id(device, &id, env.rank, env.world_size, timeout)
    }

    /// The NCCL rank `rank` of `world` on `device`, given the group's unique id (from
    /// [`nccl_unique_id`] on one rank, shared by any means). `timeout` bounds the
    /// initialization and every [`Communicator::wait`].
    pub fn nccl_with_id(
        device: Device,
        id: &[u8; 128],
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Communicator> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        let c = nccl::NcclComm::init(&device, id, rank, world, timeout)?;
        Ok(Communicator::from_imp(rank, world, device, Imp::Nccl(c)))
    }

    fn from_imp(rank: usize, world: usize, device: Device, imp: Imp) -> Communicator {
        Communicator {
            rank,
            world,
            device,
            imp,
            stats: Mutex::new(CommStats::default()),
            uploads: Mutex::new(Vec::new()),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The device this rank's buffers live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `"local"` or `"nccl"`.
    pub fn backend_name(&self) -> &'static str {
        match self.imp {
            Imp::Local(_) => "local",
            Imp::Nccl(_) => "nccl",
        }
    }

    /// Calls and bytes so far.
    pub fn stats(&self) -> CommStats {
        *self.stats.lock()
    }

    fn count(&self, v: &DeviceView<'_>, elem: Elem, what: &'static str) -> Result<usize> {
        if !v.len().is_multiple_of(elem.size()) {
            return Err(Error::Misaligned {
                what,
                value: v.len(),
                align: elem.size(),
            });
        }
        Ok(v.len() / elem.size())
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(Error::InvalidArgument(format!(
                "root {root} of a world of {}",
                self.world
            )));
        }
        Ok(())
    }

    fn tally(&self, f: impl FnOnce(&mut CommStats)) {
        f(&mut self.stats.lock());
    }

    /// Every rank's `send` (n elements) concatenated in rank order into every rank's `recv`
    /// (`world · n` elements).
    pub fn all_gather(
        &self,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        elem: Elem,
    ) -> Result<()> {
        let n = self.count(&send, elem, "all_gather send length")?;
        let m = self.count(&recv, elem, "all_gather recv length")?;
        if m != n * self.world {
            return Err(Error::SizeMismatch {
                src: send.len() * self.world,
                dst: recv.len(),
            });
        }
        in_place(
            "all_gather",
            &send,
            &recv,
            recv.offset() + self.rank * send.len(),
        )?;
        match &self.imp {
            Imp::Local(l) => {
                let input = self.device.download(stream, send)?;
                let all = l.exchange(local::Desc::new(Kind::AllGather, elem, n), input)?;
                let out: Vec<u8> = all.iter().flat_map(|b| b.iter().copied()).collect();
                self.upload(stream, &out, recv)?;
            }
            Imp::Nccl(c) => c.all_gather(&self.device, stream, send, recv, n, elem)?,
        }
        self.tally(|s| s.all_gather.add(m * elem.size()));
        Ok(())
    }

    /// The element-wise reduction of every rank's `send` (`world · n` elements); rank `r` gets
    /// elements `r·n..(r+1)·n` of it in `recv` (n elements).
    pub fn reduce_scatter(
        &self,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        elem: Elem,
        op: ReduceOp,
    ) -> Result<()> {
        let m = self.count(&send, elem, "reduce_scatter send length")?;
        let n = self.count(&recv, elem, "reduce_scatter recv length")?;
        if m != n * self.world {
            return Err(Error::SizeMismatch {
                src: send.len(),
                dst: recv.len() * self.world,
            });
        }
        in_place(
            "reduce_scatter",
            &recv,
            &send,
            send.offset() + self.rank * recv.len(),
        )?;
        match &self.imp {
            Imp::Local(l) => {
                let input = self.device.download(stream, send)?;
                let all =
                    l.exchange(local::Desc::new(Kind::ReduceScatter, elem, m).op(op), input)?;
                let b = n * elem.size();
                let parts: Vec<&[u8]> = all
                    .iter()
                    .map(|x| &x[self.rank * b..(self.rank + 1) * b])
                    .collect();
                let out = reduce(elem, op, &parts, self.world);
                self.upload(stream, &out, recv)?;
            }
            Imp::Nccl(c) => c.reduce_scatter(&self.device, stream, send, recv, n, elem, op)?,
        }
        self.tally(|s| s.reduce_scatter.add(m * elem.size()));
        Ok(())
    }

    /// The element-wise reduction of every rank's `send` into every rank's `recv` (same length;
    /// the same view for in place).
    pub fn all_reduce(
        &self,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        elem: Elem,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.count(&send, elem, "all_reduce send length")?;
        if recv.len() != send.len() {
            return Err(Error::SizeMismatch {
                src: send.len(),
                dst: recv.len(),
            });
        }
        in_place("all_reduce", &send, &recv, recv.offset())?;
        match &self.imp {
            Imp::Local(l) => {
                let input = self.device.download(stream, send)?;
                let all = l.exchange(local::Desc::new(Kind::AllReduce, elem, n).op(op), input)?;
                let parts: Vec<&[u8]> = all.iter().map(|x| &x[..]).collect();
                let out = reduce(elem, op, &parts, self.world);
                self.upload(stream, &out, recv)?;
            }
            Imp::Nccl(c) => c.all_reduce(&self.device, stream, send, recv, n, elem, op)?,
        }
        self.tally(|s| s.all_reduce.add(n * elem.size()));
        Ok(())
    }

    /// Rank `root`'s `buf` into every rank's `buf` (in place).
    pub fn broadcast(
        &self,
        stream: &Stream,
        buf: DeviceView<'_>,
        elem: Elem,
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let n = self.count(&buf, elem, "broadcast length")?;
        match &self.imp {
            Imp::Local(l) => {
                let input = if self.rank == root {
                    self.device.download(stream, buf)?
                } else {
                    Vec::new()
                };
                let all =
                    l.exchange(local::Desc::new(Kind::Broadcast, elem, n).root(root), input)?;
                if self.rank != root {
                    self.upload(stream, &all[root], buf)?;
                }
            }
            Imp::Nccl(c) => c.broadcast(&self.device, stream, buf, n, elem, root)?,
        }
        self.tally(|s| s.broadcast.add(n * elem.size()));
        Ok(())
    }

    /// The element-wise reduction of every rank's `send` into `recv` on rank `root` (other
    /// ranks' `recv` is left alone; it must still have `send`'s length).
    pub fn reduce(
        &self,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        elem: Elem,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let n = self.count(&send, elem, "reduce send length")?;
        if recv.len() != send.len() {
            return Err(Error::SizeMismatch {
                src: send.len(),
                dst: recv.len(),
            });
        }
        in_place("reduce", &send, &recv, recv.offset())?;
        match &self.imp {
            Imp::Local(l) => {
                let input = self.device.download(stream, send)?;
                let desc = local::Desc::new(Kind::Reduce, elem, n).op(op).root(root);
                let all = l.exchange(desc, input)?;
                if self.rank == root {
                    let parts: Vec<&[u8]> = all.iter().map(|x| &x[..]).collect();
                    let out = reduce(elem, op, &parts, self.world);
                    self.upload(stream, &out, recv)?;
                }
            }
            Imp::Nccl(c) => c.reduce(&self.device, stream, send, recv, n, elem, op, root)?,
        }
        self.tally(|s| s.reduce.add(n * elem.size()));
        Ok(())
    }

    /// Sends `buf` to rank `peer`, which receives it with [`Communicator::recv`]. Messages between
    /// two ranks arrive in the order they were sent. The in-process backend buffers the message
    /// and returns; NCCL's send completes on the stream once the peer receives.
    pub fn send(
        &self,
        stream: &Stream,
        buf: DeviceView<'_>,
        elem: Elem,
        peer: usize,
    ) -> Result<()> {
        self.check_peer(peer)?;
        let n = self.count(&buf, elem, "send length")?;
        match &self.imp {
            Imp::Local(l) => {
                let data = self.device.download(stream, buf)?;
                l.send(peer, elem, n, data)?;
            }
            Imp::Nccl(c) => c.send(&self.device, stream, buf, n, elem, peer)?,
        }
        self.tally(|s| s.send.add(n * elem.size()));
        Ok(())
    }

    /// Receives into `buf` the next message rank `peer` sent to this rank; its element type and
    /// count must match.
    pub fn recv(
        &self,
        stream: &Stream,
        buf: DeviceView<'_>,
        elem: Elem,
        peer: usize,
    ) -> Result<()> {
        self.check_peer(peer)?;
        let n = self.count(&buf, elem, "recv length")?;
        match &self.imp {
            Imp::Local(l) => {
                let data = l.recv(peer, elem, n)?;
                self.upload(stream, &data, buf)?;
            }
            Imp::Nccl(c) => c.recv(&self.device, stream, buf, n, elem, peer)?,
        }
        self.tally(|s| s.recv.add(n * elem.size()));
        Ok(())
    }

    /// Sends `send` to rank `to` and receives into `recv` the next message rank `from` sent to
    /// this rank, as one NCCL group: a ring or all-to-all in which every rank sends before it
    /// receives cannot deadlock, as it would with [`Communicator::send`] then
    /// [`Communicator::recv`] on NCCL. `to` and `from` may both be this rank (the data is
    /// copied); otherwise neither may be.
    pub fn send_recv(
        &self,
        stream: &Stream,
        send: DeviceView<'_>,
        to: usize,
        recv: DeviceView<'_>,
        from: usize,
        elem: Elem,
    ) -> Result<()> {
        let me = self.rank;
        if to >= self.world || from >= self.world || ((to == me) != (from == me)) {
            return Err(Error::InvalidArgument(format!(
                "send_recv to {to} and from {from} on rank {me} of {}: peers are other ranks, \
                 or both this rank",
                self.world
            )));
        }
        let n = self.count(&send, elem, "send_recv send length")?;
        let m = self.count(&recv, elem, "send_recv recv length")?;
        if overlap(&send, &recv) {
            return Err(Error::InvalidArgument(
                "send_recv: the send and receive views overlap".into(),
            ));
        }
        if to == me && n != m {
            return Err(Error::SizeMismatch {
                src: send.len(),
                dst: recv.len(),
            });
        }
        match &self.imp {
            Imp::Local(_) if to == me => self.device.copy_d2d(stream, send, recv)?,
            Imp::Local(l) => {
                let data = self.device.download(stream, send)?;
                l.send(to, elem, n, data)?;
                let data = l.recv(from, elem, m)?;
                self.upload(stream, &data, recv)?;
            }
            Imp::Nccl(c) => c.send_recv(&self.device, stream, send, n, to, recv, m, from, elem)?,
        }
        self.tally(|s| {
            s.send.add(n * elem.size());
            s.recv.add(m * elem.size());
        });
        Ok(())
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.world || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "peer {peer} of rank {} in a world of {}",
                self.rank, self.world
            )));
        }
        Ok(())
    }

    /// Waits for the work enqueued on `stream` so far, collectives included. On NCCL it watches
    /// the communicator's asynchronous error meanwhile and gives up after the communicator's
    /// timeout (which bounds all of the stream's earlier work, so call it often enough): a peer
    /// that failed or never comes is an error ([`Error::Nccl`] or [`Error::CommTimeout`]) and
    /// the communicator is aborted, instead of a wait without end.
    /// On the in-process backend the collectives themselves time out; this syncs the stream.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        match &self.imp {
            Imp::Local(_) => self.device.sync_stream(stream),
            Imp::Nccl(c) => c.wait(&self.device, stream),
        }
    }

    /// An error some rank's failure left on the communicator, without waiting: NCCL's
    /// asynchronous error (the communicator is aborted after one), or the in-process
    /// communicator's mismatch or timeout. `Ok` while there is none; for a watchdog.
    pub fn check(&self) -> Result<()> {
        match &self.imp {
            Imp::Local(l) => l.check(),
            Imp::Nccl(c) => c.check_async(),
        }
    }

    /// Returns once every rank has called it (and, on NCCL, the stream's earlier work is done).
    pub fn barrier(&self, stream: &Stream) -> Result<()> {
        match &self.imp {
            Imp::Local(l) => {
                self.device.sync_stream(stream)?;
                l.exchange(local::Desc::new(Kind::Barrier, Elem::U8, 0), Vec::new())?;
            }
            Imp::Nccl(c) => {
                let b = self.device.alloc(4)?;
                self.device.memset(stream, &b, 0)?;
                c.all_reduce(
                    &self.device,
                    stream,
                    (&b).into(),
                    (&b).into(),
                    1,
                    Elem::F32,
                    ReduceOp::Sum,
                )?;
                c.wait(&self.device, stream)?;
            }
        }
        self.tally(|s| s.barrier.add(0));
        Ok(())
    }

    /// A sub-communicator of the ranks that pass the same `color`, ranked by `(key, rank)`;
    /// `None` for ranks that pass no color (they get no communicator). Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>> {
        if color == Some(u32::MAX) {
            return Err(Error::InvalidArgument(
                "color u32::MAX is reserved; pass None for no color".into(),
            ));
        }
        match &self.imp {
            Imp::Local(l) => Ok(l.split(color, key)?.map(|(m, rank, world)| {
                Communicator::from_imp(rank, world, self.device.clone(), Imp::Local(m))
            })),
            Imp::Nccl(c) => Ok(c.split(&self.device, color, key)?.map(|c| {
                let (rank, world) = (c.rank(), c.world());
                Communicator::from_imp(rank, world, self.device.clone(), Imp::Nccl(c))
            })),
        }
    }

    /// Agrees on `ok` across the ranks (a one-byte all-reduce): `Ok` on every rank if all were
    /// ok; otherwise a rank that was ok gets an error saying another rank failed (and one that
    /// was not gets `Ok`, to return its own error). Every rank must call it: the step that lets
    /// ranks fail together instead of going on apart.
    pub fn agree(&self, ok: bool) -> Result<()> {
        let mut flag = [u8::from(ok)];
        self.all_reduce_host(&mut flag, ReduceOp::Min)?;
        if ok && flag[0] == 0 {
            return Err(Error::InvalidArgument(
                "another rank failed: every rank reports it".into(),
            ));
        }
        Ok(())
    }

    /// All-reduces a host slice in place (through a device buffer on a private stream, waiting
    /// for the result): for flags and norms.
    pub fn all_reduce_host<T: HostElem>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let s = self.device.new_stream()?;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.is_empty() {
            return Err(Error::InvalidArgument("all_reduce_host of nothing".into()));
        }
        let b = self.device.upload(&s, bytes)?;
        self.all_reduce(&s, (&b).into(), (&b).into(), T::ELEM, op)?;
        self.wait(&s)?;
        let out = self.device.download(&s, &b)?;
        bytemuck::cast_slice_mut::<T, u8>(data).copy_from_slice(&out);
        Ok(())
    }

    fn upload(&self, stream: &Stream, data: &[u8], dst: DeviceView<'_>) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let h = HostBuffer::from_slice(data)?;
        let copy = self.device.copy_h2d(stream, h, dst)?;
        // Keep the copy in flight; free the staging of earlier ones that have completed.
        let mut q = self.uploads.lock();
        let mut still = Vec::with_capacity(q.len() + 1);
        for p in q.drain(..) {
            if p.is_ready()? {
                p.wait()?;
            } else {
                still.push(p);
            }
        }
        still.push(copy);
        *q = still;
        Ok(())
    }
}

/// Runs a trainer written once on every rank of a job, however it was started:
/// - with `WORLD_SIZE` set by a launcher (see [`LaunchEnv`]), this process is one NCCL rank on
///   `device_for(LOCAL_RANK)`, meeting the others within `timeout`; the result holds its value;
/// - otherwise `default_world` in-process ranks run on threads, rank `r` on `device_for(r)`; the
///   result holds every rank's value in rank order (the first error wins).
///
/// ```
/// use tidemem::comm::{launch, ReduceOp};
/// use tidemem::device::{Device, SimConfig};
/// # fn main() -> tidemem::Result<()> {
/// # if std::env::var_os("WORLD_SIZE").is_some() { return Ok(()); }
/// let out = launch(
///     3,
///     |_| Device::sim(SimConfig::with_capacity(1 << 20)),
///     std::time::Duration::from_secs(60),
///     |c| {
///         let mut x = [1i32];
///         c.all_reduce_host(&mut x, ReduceOp::Sum)?;
///         Ok(x[0])
///     },
/// )?;
/// assert_eq!(out, vec![3, 3, 3]);
/// # Ok(()) }
/// ```
pub fn launch<R: Send>(
    default_world: usize,
    device_for: impl Fn(usize) -> Result<Device> + Sync,
    timeout: Duration,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    if let Some(env) = LaunchEnv::from_env()? {
        let device = device_for(env.local_rank)?;
        let c = Communicator::nccl(device, &env, timeout)?;
        return Ok(vec![f(c)?]);
    }
    let devices = (0..default_world)
        .map(&device_for)
        .collect::<Result<Vec<_>>>()?;
    let comms = Communicator::local_with_timeout(devices, timeout)?;
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(c))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::InvalidArgument("a rank panicked".into())))
            })
            .collect()
    })
}

/// Whether two views share bytes of one buffer.
fn overlap(a: &DeviceView<'_>, b: &DeviceView<'_>) -> bool {
    a.buffer().id() == b.buffer().id()
        && a.offset() < b.offset() + b.len()
        && b.offset() < a.offset() + a.len()
}

/// NCCL runs a call in place only when the smaller view `part` sits exactly at byte `at` of the
/// buffer of `whole`; any other overlap of the two would silently corrupt data there, so it is
/// an error on every backend.
fn in_place(call: &str, part: &DeviceView<'_>, whole: &DeviceView<'_>, at: usize) -> Result<()> {
    if overlap(part, whole) && part.offset() != at {
        return Err(Error::InvalidArgument(format!(
            "{call}: the views overlap but not in NCCL's in-place layout (the input at byte {at} \
             of its buffer, found at {})",
            part.offset()
        )));
    }
    Ok(())
}

/// A fresh NCCL unique id (for [`Communicator::nccl_with_id`]); fails without the NCCL library
/// ([`Error::BackendUnavailable`]).
pub fn nccl_unique_id() -> Result<[u8; 128]> {
    nccl::unique_id()
}

/// The NCCL library the backend loads: `TIDEMEM_NCCL_LIB` (a path) when set, else
/// `libnccl.so.2` or `libnccl.so` on the loader's search path. [`Error::BackendUnavailable`]
/// lists what was tried when none loads.
pub fn nccl_library() -> Result<&'static str> {
    nccl::library_path()
}

/// The version of the NCCL library the backend loads, `(major, minor, patch)`. Non-blocking
/// communicators (initialization with a timeout) need 2.14, [`Communicator::split`] 2.18.
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    nccl::version()
}

/// Element-wise reduction of `parts` (equal lengths) in rank order, accumulating in f64 (floats)
/// or i128 (integers) and rounding once.
pub(crate) fn reduce(elem: Elem, op: ReduceOp, parts: &[&[u8]], world: usize) -> Vec<u8> {
    let Some((first, rest)) = parts.split_first() else {
        return Vec::new();
    };
    let w4 = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let w8 = |c: &[u8]| [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
    match elem {
        Elem::F64 | Elem::F32 | Elem::F16 | Elem::BF16 => {
            let dec = |p: &[u8]| -> Vec<f64> {
                match elem {
                    Elem::F64 => p
                        .chunks_exact(8)
                        .map(|c| f64::from_le_bytes(w8(c)))
                        .collect(),
                    Elem::F32 => p
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(w4(c)) as f64)
                        .collect(),
                    Elem::F16 => p
                        .chunks_exact(2)
                        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
                        .collect(),
                    _ => p
                        .chunks_exact(2)
                        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
                        .collect(),
                }
            };
            let mut acc = dec(first);
            for p in rest {
                for (a, v) in acc.iter_mut().zip(dec(p)) {
                    *a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => *a + v,
                        _ if a.is_nan() || v.is_nan() => f64::NAN,
                        ReduceOp::Max => a.max(v),
                        ReduceOp::Min => a.min(v),
                    };
                }
            }
            if op == ReduceOp::Avg {
                acc.iter_mut().for_each(|a| *a /= world as f64);
            }
            match elem {
                Elem::F64 => acc.iter().flat_map(|a| a.to_le_bytes()).collect(),
                Elem::F32 => acc.iter().flat_map(|&a| (a as f32).to_le_bytes()).collect(),
                Elem::F16 => acc
                    .iter()
                    .flat_map(|&a| f16::from_f64(a).to_le_bytes())
                    .collect(),
                _ => acc
                    .iter()
                    .flat_map(|&a| bf16::from_f64(a).to_le_bytes())
                    .collect(),
            }
        }
        Elem::U8 | Elem::I32 | Elem::I64 => {
            let dec = |p: &[u8]| -> Vec<i128> {
                match elem {
                    Elem::U8 => p.iter().map(|&b| b as i128).collect(),
                    Elem::I32 => p
                        .chunks_exact(4)
                        .map(|c| i32::from_le_bytes(w4(c)) as i128)
                        .collect(),
                    _ => p
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(w8(c)) as i128)
                        .collect(),
                }
            };
            let mut acc = dec(first);
            for p in rest {
                for (a, v) in acc.iter_mut().zip(dec(p)) {
                    *a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => *a + v,
                        ReduceOp::Max => (*a).max(v),
                        ReduceOp::Min => (*a).min(v),
                    };
                }
            }
            if op == ReduceOp::Avg {
                // as NCCL: the sum wraps in the element type, then divides (toward zero)
                for a in acc.iter_mut() {
                    let sum = match elem {
                        Elem::U8 => *a as u8 as i128,
                        Elem::I32 => *a as i32 as i128,
                        _ => *a as i64 as i128,
                    };
                    *a = sum / world as i128;
                }
            }
            // integer sums wrap, as in NCCL
            match elem {
                Elem::U8 => acc.iter().map(|&a| a as u8).collect(),
                Elem::I32 => acc.iter().flat_map(|&a| (a as i32).to_le_bytes()).collect(),
                _ => acc.iter().flat_map(|&a| (a as i64).to_le_bytes()).collect(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_average_wraps_the_sum_first_as_nccl_does() {
        assert_eq!(
            reduce(Elem::U8, ReduceOp::Avg, &[&[200], &[100]], 2),
            vec![22]
        );
        let i = |v: i32| v.to_le_bytes();
        let got = reduce(Elem::I32, ReduceOp::Avg, &[&i(i32::MAX), &i(3)], 2);
        assert_eq!(got, i((i32::MAX).wrapping_add(3) / 2).to_vec());
        assert_eq!(
            reduce(Elem::I32, ReduceOp::Avg, &[&i(-7), &i(2)], 2),
            i(-2).to_vec()
        );
    }

    #[test]
    fn reduce_is_exact_in_rank_order() {
        let a: Vec<u8> = [1.0f32, 2.0, f32::NAN]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let b: Vec<u8> = [3.0f32, -5.0, 1.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let f = |v: Vec<u8>| -> Vec<f32> {
            v.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let s = f(reduce(Elem::F32, ReduceOp::Sum, &[&a, &b], 2));
        assert_eq!(&s[..2], &[4.0, -3.0]);
        assert!(s[2].is_nan());
        assert_eq!(
            &f(reduce(Elem::F32, ReduceOp::Avg, &[&a, &b], 2))[..2],
            &[2.0, -1.5]
        );
        let m = f(reduce(Elem::F32, ReduceOp::Max, &[&a, &b], 2));
        assert_eq!(&m[..2], &[3.0, 2.0]);
        assert!(m[2].is_nan());
        assert_eq!(
            &f(reduce(Elem::F32, ReduceOp::Min, &[&a, &b], 2))[..2],
            &[1.0, -5.0]
        );
        // f16 sums round once: 2048 + 1 + 1 is 2050 exactly, pairwise f16 would give 2048
        let h = |x: f32| f16::from_f32(x).to_le_bytes().to_vec();
        let r = reduce(Elem::F16, ReduceOp::Sum, &[&h(2048.0), &h(1.0), &h(1.0)], 3);
        assert_eq!(f16::from_le_bytes([r[0], r[1]]).to_f32(), 2050.0);
        let i = |x: i32| x.to_le_bytes().to_vec();
        let r = reduce(Elem::I32, ReduceOp::Avg, &[&i(7), &i(-2)], 2);
        assert_eq!(i32::from_le_bytes(r.try_into().unwrap()), 2);
    }

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
