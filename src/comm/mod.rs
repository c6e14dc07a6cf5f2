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
//!   [`exchange_id`] ([`LaunchEnv`]): rank 0 creates the NCCL unique id and serves it over TCP on
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

mod collectives;
mod communicator;
mod elem;
mod local;
mod nccl;
mod reduce;
pub(crate) mod rendezvous;
mod stats;

use std::time::Duration;

use crate::device::Device;
use crate::error::{Error, Result};

pub use communicator::Communicator;
pub use elem::{Elem, HostElem, ReduceOp};
pub use rendezvous::{exchange_id, LaunchEnv};
pub use stats::{CommStats, Tally};

/// The instant `timeout` from now; a timeout too long to add (say `Duration::MAX`) is a
/// century, which no wait reaches.
/// Gradient statistics over `groups`, one after another (the squares summed, a non-finite
/// value on any rank on every rank): every rank of them clips by the global norm and skips
/// an overflow together. The one reduction every trainer runs (data, tensor and pipeline
/// groups alike).
pub(crate) fn reduce_grad_stats<'a>(
    groups: impl IntoIterator<Item = &'a Communicator>,
    st: crate::ops::GradStats,
) -> Result<crate::ops::GradStats> {
    let mut sq = [st.sum_sq];
    let mut flag = [u8::from(st.nonfinite)];
    for g in groups {
        g.all_reduce_host(&mut sq, ReduceOp::Sum)?;
        g.all_reduce_host(&mut flag, ReduceOp::Max)?;
    }
    Ok(crate::ops::GradStats {
        sum_sq: sq[0],
        nonfinite: flag[0] != 0,
    })
}

pub(crate) fn deadline_after(timeout: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Default time an in-process rank waits for the others.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The most in-process ranks a [`Communicator::local`] group (and so [`launch`]) has. Each
/// rank is a thread, and each rank's device starts a copy-engine thread per stream, so a rank
/// costs a handful of threads and their stacks: the cap keeps a group well inside the threads
/// a process is commonly allowed. More is [`Error::TooLarge`], refused before any device is
/// made.
pub const MAX_LOCAL_RANKS: usize = 1024;

/// Runs a trainer written once on every rank of a job, however it was started:
/// - started by a launcher (`torchrun`'s `WORLD_SIZE`, or an `srun` task: see [`LaunchEnv`]),
///   this process is one NCCL rank on
///   `device_for(LOCAL_RANK)`, meeting the others within `timeout`; the result holds its value;
/// - otherwise `default_world` in-process ranks run on threads, rank `r` on `device_for(r)`; the
///   result holds every rank's value in rank order.
///
/// In-process, the first rank to fail (an error, a panic) breaks the group for the others:
/// their waiting collectives return [`Error::CommAborted`] at once instead of waiting out
/// `timeout`, and the result is the failed rank's own error. A rank whose thread cannot start
/// stops the ranks already started the same way, and the result is [`Error::ThreadSpawn`].
/// `default_world` is at most [`MAX_LOCAL_RANKS`] ([`Error::TooLarge`], before any device is
/// made). An [`Error::RankFailed`] (a rank that only learned from an agreement that another
/// failed) is the result only when no rank reports anything else.
///
/// ```
/// use tidemem::comm::{launch, ReduceOp};
/// use tidemem::device::{Device, SimConfig};
/// # fn main() -> tidemem::Result<()> {
/// # if tidemem::comm::LaunchEnv::from_env()?.is_some() { return Ok(()); }
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
    if default_world > MAX_LOCAL_RANKS {
        return Err(Error::TooLarge {
            what: "in-process ranks".into(),
            requested: default_world as u128,
            limit: MAX_LOCAL_RANKS as u64,
        });
    }
    let devices = (0..default_world)
        .map(&device_for)
        .collect::<Result<Vec<_>>>()?;
    let comms = Communicator::local_with_timeout(devices, timeout)?;
    run_local(
        comms,
        |r| std::thread::Builder::new().name(format!("rank{r}")),
        f,
    )
}

/// Runs `f` on every in-process rank of `comms`, rank `r` on a thread made by `thread(r)`;
/// see [`launch`] for how a failure stops the others.
fn run_local<R: Send>(
    comms: Vec<Communicator>,
    thread: impl Fn(usize) -> std::thread::Builder,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let world = comms.len();
    let group = comms.first().and_then(Communicator::local_group);
    // the rank that failed first: the others' errors are the abort it caused
    let first = parking_lot::Mutex::new(None::<usize>);
    let fail = |rank: usize, why: &dyn std::fmt::Display| {
        first.lock().get_or_insert(rank);
        if let Some(g) = &group {
            g.abort(&format!("rank {rank} of {world} failed: {why}"));
        }
    };
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(world);
        for c in comms {
            let rank = c.rank();
            let (f, fail) = (&f, &fail);
            let spawned = thread(rank).spawn_scoped(s, move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(c)))
                    .unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|m| m.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_default();
                        Err(Error::Panicked {
                            what: format!("rank {rank}"),
                            message: msg,
                        })
                    });
                // a rank told by an agreement that another failed is not the first failure
                if let Err(e) = &r {
                    if !matches!(e, Error::RankFailed { .. }) {
                        fail(rank, e);
                    }
                }
                r
            });
            match spawned {
                Ok(h) => handles.push(h),
                Err(source) => {
                    fail(rank, &format_args!("its thread did not start: {source}"));
                    for h in handles {
                        // their results are the abort; a panic was caught in the thread
                        let _ = h.join();
                    }
                    return Err(Error::ThreadSpawn {
                        what: format!("the thread of in-process rank {rank} of {world}"),
                        source,
                    });
                }
            }
        }
        let mut results: Vec<Result<R>> = handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Panicked {
                        what: "a rank".into(),
                        message: String::new(),
                    })
                })
            })
            .collect();
        // `first` names a rank only once its result is an error of its own; without one, any
        // error is an agreement's report that another rank failed
        let failed = *first.lock();
        if let Some(Err(e)) = failed.map(|r| results.swap_remove(r)) {
            return Err(e);
        }
        results.into_iter().collect()
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimConfig;

    fn ranks(n: usize, timeout: Duration) -> Vec<Communicator> {
        let devices = (0..n)
            .map(|_| Device::sim(SimConfig::with_capacity(1 << 20)).unwrap())
            .collect();
        Communicator::local_with_timeout(devices, timeout).unwrap()
    }

    #[test]
    fn a_rank_that_cannot_start_stops_the_started_ones() {
        let t0 = std::time::Instant::now();
        // rank 2 asks for a stack no machine has: its thread does not start, while ranks 0
        // and 1 wait in a collective for it
        let r = run_local(
            ranks(4, Duration::from_secs(60)),
            |r| match r {
                2 => std::thread::Builder::new().stack_size(1 << 60),
                _ => std::thread::Builder::new(),
            },
            |c| c.all_reduce_host(&mut [1.0f32], ReduceOp::Sum),
        );
        match r {
            Err(Error::ThreadSpawn { what, .. }) => assert!(what.contains("rank 2 of 4"), "{what}"),
            other => panic!("{other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    }

    #[test]
    fn the_first_failure_is_the_answer_and_releases_the_others() {
        let t0 = std::time::Instant::now();
        let r = run_local(
            ranks(3, Duration::from_secs(60)),
            |_| std::thread::Builder::new(),
            |c| match c.rank() {
                1 => Err(Error::InvalidArgument("rank 1 gives up".into())),
                _ => c.all_reduce_host(&mut [1.0f32], ReduceOp::Sum),
            },
        );
        assert!(
            matches!(&r, Err(Error::InvalidArgument(m)) if m == "rank 1 gives up"),
            "{r:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        let r = run_local(
            ranks(2, Duration::from_secs(60)),
            |_| std::thread::Builder::new(),
            |c| match c.rank() {
                0 => panic!("rank 0 falls over"),
                _ => c.all_reduce_host(&mut [1.0f32], ReduceOp::Sum),
            },
        );
        assert!(
            matches!(&r, Err(Error::Panicked { message, .. }) if message.contains("rank 0 falls over")),
            "{r:?}"
        );
    }

    #[test]
    fn a_ranks_own_error_wins_over_one_that_points_at_it() {
        let io = || Error::Io {
            during: "writing",
            source: std::io::Error::other("disk full"),
        };
        let run = |f: &(dyn Fn(usize) -> Result<u8> + Sync)| {
            run_local(
                ranks(2, Duration::from_secs(60)),
                |_| std::thread::Builder::new(),
                |c| f(c.rank()),
            )
        };
        let got = run(&|r| match r {
            0 => Err(Error::RankFailed { rank: 1 }),
            _ => Err(io()),
        });
        assert!(matches!(got, Err(Error::Io { .. })), "{got:?}");
        let got = run(&|r| match r {
            0 => Ok(1),
            _ => Err(Error::RankFailed { rank: 0 }),
        });
        assert!(matches!(got, Err(Error::RankFailed { rank: 0 })), "{got:?}");
        assert_eq!(run(&|r| Ok(r as u8 + 1)).unwrap(), vec![1, 2]);
    }
}
