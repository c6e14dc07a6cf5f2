//! The [`Communicator`]: a member of a group of ranks, its backends, and the calls that are not
//! data collectives (waiting, barriers, splitting, agreeing).

use std::fmt;
use std::time::Duration;

use parking_lot::Mutex;

use super::local::{self, Kind};
use super::nccl;
use super::rendezvous::{self, LaunchEnv};
use super::{CommStats, Elem, HostElem, ReduceOp, DEFAULT_TIMEOUT};
use crate::device::{Device, DeviceView, HostBuffer, Pending, Stream};
use crate::error::{Error, Result};

pub(super) enum Imp {
    Local(local::Member),
    Nccl(nccl::NcclComm),
}

/// A member of a group of ranks that run collectives together. See the [module docs](crate::comm).
pub struct Communicator {
    pub(super) rank: usize,
    pub(super) world: usize,
    // Dropped before the device: an NCCL communicator is destroyed while its context lives.
    pub(super) imp: Imp,
    pub(super) device: Device,
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

impl Communicator {
    /// One in-process communicator per device (rank `i` on `devices[i]`), to be moved to one
    /// thread each; ranks wait at most [`DEFAULT_TIMEOUT`] for each other. At most
    /// [`MAX_LOCAL_RANKS`](super::MAX_LOCAL_RANKS) devices ([`Error::TooLarge`] beyond).
    pub fn local(devices: Vec<Device>) -> Result<Vec<Communicator>> {
        Self::local_with_timeout(devices, DEFAULT_TIMEOUT)
    }

    /// Like [`Communicator::local`] with a given timeout.
    pub fn local_with_timeout(
        devices: Vec<Device>,
        timeout: Duration,
    ) -> Result<Vec<Communicator>> {
        if devices.is_empty() {
            return Err(Error::TooFew {
                what: "ranks of a communicator".into(),
                got: 0,
                need: 1,
            });
        }
        let world = devices.len();
        if world > super::MAX_LOCAL_RANKS {
            return Err(Error::TooLarge {
                what: "in-process ranks".into(),
                requested: world as u128,
                limit: super::MAX_LOCAL_RANKS as u64,
            });
        }
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
    /// others through [`exchange_id`](super::exchange_id) within `timeout`. The same timeout bounds
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
    ///
    /// [`nccl_unique_id`]: super::nccl_unique_id
    pub fn nccl_with_id(
        device: Device,
        id: &[u8; 128],
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Communicator> {
        if world == 0 || rank >= world {
            return Err(Error::IndexOutOfRange {
                what: "rank of a communicator".into(),
                index: rank,
                len: world,
            });
        }
        let c = nccl::NcclComm::init(&device, id, rank, world, timeout)?;
        Ok(Communicator::from_imp(rank, world, device, Imp::Nccl(c)))
    }

    /// The in-process group of this rank, to break for every rank at once
    /// ([`local::Shared::abort`]); `None` for NCCL.
    pub(super) fn local_group(&self) -> Option<std::sync::Arc<local::Shared>> {
        match &self.imp {
            Imp::Local(m) => Some(m.group()),
            Imp::Nccl(_) => None,
        }
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

    pub(super) fn tally(&self, f: impl FnOnce(&mut CommStats)) {
        f(&mut self.stats.lock());
    }

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
        self.tally(|s| s.barrier.count(0));
        Ok(())
    }

    /// A sub-communicator of the ranks that pass the same `color`, ranked by `(key, rank)`;
    /// `None` for ranks that pass no color (they get no communicator). Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>> {
        if color == Some(u32::MAX) {
            return Err(Error::BadValue {
                what: "a split's color".into(),
                value: f64::from(u32::MAX),
                want: "below u32::MAX, which is reserved (pass None for no color)",
            });
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

    /// Agrees on `ok` across the ranks (a four-byte all-reduce): `Ok` on every rank if all were
    /// ok; otherwise a rank that was ok gets [`Error::RankFailed`] naming the lowest rank that
    /// failed (and one that was not gets `Ok`, to return its own error, the one a user should
    /// see: [`launch`](crate::comm::launch) prefers it). Every rank must call it: the step that
    /// lets ranks fail together instead of going on apart.
    pub fn agree(&self, ok: bool) -> Result<()> {
        let mut first_failed = [if ok { i32::MAX } else { self.rank() as i32 }];
        self.all_reduce_host(&mut first_failed, ReduceOp::Min)?;
        if ok && first_failed[0] != i32::MAX {
            return Err(Error::RankFailed {
                rank: first_failed[0] as usize,
            });
        }
        Ok(())
    }

    /// All-reduces a host slice in place (through a device buffer on a private stream, waiting
    /// for the result): for flags and norms.
    pub fn all_reduce_host<T: HostElem>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let s = self.device.new_stream()?;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.is_empty() {
            return Err(Error::Empty {
                what: "the values of all_reduce_host".into(),
            });
        }
        let b = self.device.upload(&s, bytes)?;
        self.all_reduce(&s, (&b).into(), (&b).into(), T::ELEM, op)?;
        self.wait(&s)?;
        let out = self.device.download(&s, &b)?;
        bytemuck::cast_slice_mut::<T, u8>(data).copy_from_slice(&out);
        Ok(())
    }

    pub(super) fn upload(&self, stream: &Stream, data: &[u8], dst: DeviceView<'_>) -> Result<()> {
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
