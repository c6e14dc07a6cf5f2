//! The data collectives of a [`Communicator`] and the checks every backend makes of their
//! arguments first: whole elements, roots and peers in the world, NCCL's in-place layouts.

use super::communicator::Imp;
use super::local::{self, Kind};
use super::reduce::reduce;
use super::{Communicator, Elem, ReduceOp};
use crate::device::{DeviceView, Stream};
use crate::error::{Error, Result};

impl Communicator {
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
            return Err(Error::IndexOutOfRange {
                what: "root rank".into(),
                index: root,
                len: self.world,
            });
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.world {
            return Err(Error::IndexOutOfRange {
                what: "peer rank".into(),
                index: peer,
                len: self.world,
            });
        }
        if peer == self.rank {
            return Err(Error::Conflict {
                what: format!("peer {peer}"),
                with: "a send or receive of this rank (the peer is another rank)".into(),
            });
        }
        Ok(())
    }

    /// Waits for the work enqueued on `stream` so far, collectives included. On NCCL it watches
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
        self.tally(|s| s.all_gather.count(m * elem.size()));
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
        self.tally(|s| s.reduce_scatter.count(m * elem.size()));
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
        self.tally(|s| s.all_reduce.count(n * elem.size()));
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
        self.tally(|s| s.broadcast.count(n * elem.size()));
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
        self.tally(|s| s.reduce.count(n * elem.size()));
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
        self.tally(|s| s.send.count(n * elem.size()));
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
        self.tally(|s| s.recv.count(n * elem.size()));
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
        for peer in [to, from] {
            if peer >= self.world {
                return Err(Error::IndexOutOfRange {
                    what: "send_recv peer rank".into(),
                    index: peer,
                    len: self.world,
                });
            }
        }
        if (to == me) != (from == me) {
            return Err(Error::Conflict {
                what: format!("send_recv to {to} and from {from} on rank {me}"),
                with: "its rule that peers are other ranks, or both this rank".into(),
            });
        }
        let n = self.count(&send, elem, "send_recv send length")?;
        let m = self.count(&recv, elem, "send_recv recv length")?;
        if overlap(&send, &recv) {
            return Err(Error::Conflict {
                what: "send_recv's send view".into(),
                with: "a receive view that overlaps it".into(),
            });
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
            s.send.count(n * elem.size());
            s.recv.count(m * elem.size());
        });
        Ok(())
    }
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
        return Err(Error::Conflict {
            what: format!("{call}'s views, which overlap"),
            with: format!(
                "NCCL's in-place layout (the input at byte {at} of its buffer, found at {})",
                part.offset()
            ),
        });
    }
    Ok(())
}
