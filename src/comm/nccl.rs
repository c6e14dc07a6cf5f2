//! The NCCL backend, through cudarc's NCCL bindings loaded at run time.
//!
//! Calls go through [`Device::enqueue_foreign`], so NCCL's reads and writes are ordered with the
//! device layer's other work on the buffers. One communicator serves one thread at a time (NCCL
//! does not allow concurrent calls on one communicator): calls are serialized by a lock.

use std::ffi::{c_void, CStr};

use cudarc::nccl::sys;
use parking_lot::Mutex;

use super::{Elem, ReduceOp};
use crate::device::{BackendKind, Device, DeviceView, Stream};
use crate::error::{Error, Result};

struct Raw(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread; `NcclComm` serializes the calls.
unsafe impl Send for Raw {}
// SAFETY: as above, every use goes through the mutex in `NcclComm`.
unsafe impl Sync for Raw {}

pub(crate) struct NcclComm {
    raw: Mutex<Raw>,
    rank: usize,
    world: usize,
}

fn available() -> Result<()> {
    // SAFETY: only tries to load the NCCL library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::BackendUnavailable {
            kind: BackendKind::Cuda,
            reason: "the NCCL library (libnccl.so.2) cannot be loaded".into(),
        })
    }
}

fn check(during: &'static str, r: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> Result<()> {
    match r {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        _ => {
            // SAFETY: NCCL returns static NUL-terminated strings (or null).
            let text = |p: *const std::ffi::c_char| {
                (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            };
            // SAFETY: a live communicator (or null, which NCCL accepts) and a result code.
            let last = unsafe { text(sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()))) };
            // SAFETY: as above.
            let generic = unsafe { text(sys::ncclGetErrorString(r)) };
            let message = match (last, generic) {
                (Some(l), Some(g)) if !l.is_empty() => format!("{g}: {l}"),
                (_, Some(g)) => g,
                (Some(l), None) => l,
                (None, None) => String::new(),
            };
            Err(Error::Nccl {
                during,
                code: r as i32,
                code_name: format!("{r:?}"),
                message,
            })
        }
    }
}

pub(crate) fn unique_id() -> Result<[u8; 128]> {
    available()?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer.
    check(
        "ncclGetUniqueId",
        unsafe { sys::ncclGetUniqueId(&mut id) },
        None,
    )?;
    Ok(id.internal.map(|c| c as u8))
}

fn dtype(e: Elem) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match e {
        Elem::U8 => T::ncclUint8,
        Elem::I32 => T::ncclInt32,
        Elem::I64 => T::ncclInt64,
        Elem::F16 => T::ncclFloat16,
        Elem::BF16 => T::ncclBfloat16,
        Elem::F32 => T::ncclFloat32,
        Elem::F64 => T::ncclFloat64,
    }
}

fn red(op: ReduceOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t as R;
    match op {
        ReduceOp::Sum => R::ncclSum,
        ReduceOp::Max => R::ncclMax,
        ReduceOp::Min => R::ncclMin,
        ReduceOp::Avg => R::ncclAvg,
    }
}

fn cuda_only(device: &Device) -> Result<()> {
    if device.kind() != BackendKind::Cuda {
        return Err(Error::InvalidArgument(format!(
            "NCCL needs a CUDA device, not {}",
            device.name()
        )));
    }
    Ok(())
}

impl NcclComm {
    pub(crate) fn init(device: &Device, id: &[u8; 128], rank: usize, world: usize) -> Result<Self> {
        cuda_only(device)?;
        available()?;
        device.backend().bind_to_thread()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer; blocks until every rank of the id has joined.
        let r = unsafe { sys::ncclCommInitRank(&mut comm, world as i32, id, rank as i32) };
        check("ncclCommInitRank", r, None)?;
        Ok(NcclComm {
            raw: Mutex::new(Raw(comm)),
            rank,
            world,
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// Enqueues `f(comm, pointers, stream)` on `stream` with the views' device addresses.
    fn call(
        &self,
        device: &Device,
        during: &'static str,
        stream: &Stream,
        views: &[(DeviceView<'_>, bool)],
        f: impl Fn(sys::ncclComm_t, &[u64], sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let raw = self.raw.lock();
        let comm = raw.0;
        device.enqueue_foreign(stream, views, &mut |ptrs: &[u64], s: *mut c_void| {
            check(during, f(comm, ptrs, s.cast()), Some(comm))
        })
    }

    pub(crate) fn all_gather(
        &self,
        device: &Device,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        n: usize,
        elem: Elem,
    ) -> Result<()> {
        let views = [(send, false), (recv, true)];
        self.call(device, "ncclAllGather", stream, &views, |c, p, s| {
            // SAFETY: `p` are device addresses of ranges of the checked lengths (n and world·n
            // elements), ordered on `s` by the device layer.
            unsafe {
                sys::ncclAllGather(
                    p[0] as *const c_void,
                    p[1] as *mut c_void,
                    n,
                    dtype(elem),
                    c,
                    s,
                )
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reduce_scatter(
        &self,
        device: &Device,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        n: usize,
        elem: Elem,
        op: ReduceOp,
    ) -> Result<()> {
        let views = [(send, false), (recv, true)];
        self.call(device, "ncclReduceScatter", stream, &views, |c, p, s| {
            // SAFETY: device ranges of world·n and n elements, ordered on `s`.
            unsafe {
                sys::ncclReduceScatter(
                    p[0] as *const c_void,
                    p[1] as *mut c_void,
                    n,
                    dtype(elem),
                    red(op),
                    c,
                    s,
                )
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn all_reduce(
        &self,
        device: &Device,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        n: usize,
        elem: Elem,
        op: ReduceOp,
    ) -> Result<()> {
        let views = [(send, false), (recv, true)];
        self.call(device, "ncclAllReduce", stream, &views, |c, p, s| {
            // SAFETY: two device ranges of n elements, ordered on `s`.
            unsafe {
                sys::ncclAllReduce(
                    p[0] as *const c_void,
                    p[1] as *mut c_void,
                    n,
                    dtype(elem),
                    red(op),
                    c,
                    s,
                )
            }
        })
    }

    pub(crate) fn broadcast(
        &self,
        device: &Device,
        stream: &Stream,
        buf: DeviceView<'_>,
        n: usize,
        elem: Elem,
        root: usize,
    ) -> Result<()> {
        let views = [(buf, true)];
        self.call(device, "ncclBroadcast", stream, &views, |c, p, s| {
            // SAFETY: one device range of n elements (in place), ordered on `s`.
            unsafe {
                sys::ncclBroadcast(
                    p[0] as *const c_void,
                    p[0] as *mut c_void,
                    n,
                    dtype(elem),
                    root as i32,
                    c,
                    s,
                )
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reduce(
        &self,
        device: &Device,
        stream: &Stream,
        send: DeviceView<'_>,
        recv: DeviceView<'_>,
        n: usize,
        elem: Elem,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let views = [(send, false), (recv, true)];
        self.call(device, "ncclReduce", stream, &views, |c, p, s| {
            // SAFETY: two device ranges of n elements, ordered on `s`.
            unsafe {
                sys::ncclReduce(
                    p[0] as *const c_void,
                    p[1] as *mut c_void,
                    n,
                    dtype(elem),
                    red(op),
                    root as i32,
                    c,
                    s,
                )
            }
        })
    }

    pub(crate) fn send(
        &self,
        device: &Device,
        stream: &Stream,
        buf: DeviceView<'_>,
        n: usize,
        elem: Elem,
        peer: usize,
    ) -> Result<()> {
        let views = [(buf, false)];
        self.call(device, "ncclSend", stream, &views, |c, p, s| {
            // SAFETY: a device range of n elements, ordered on `s`.
            unsafe { sys::ncclSend(p[0] as *const c_void, n, dtype(elem), peer as i32, c, s) }
        })
    }

    pub(crate) fn recv(
        &self,
        device: &Device,
        stream: &Stream,
        buf: DeviceView<'_>,
        n: usize,
        elem: Elem,
        peer: usize,
    ) -> Result<()> {
        let views = [(buf, true)];
        self.call(device, "ncclRecv", stream, &views, |c, p, s| {
            // SAFETY: a device range of n elements, ordered on `s`.
            unsafe { sys::ncclRecv(p[0] as *mut c_void, n, dtype(elem), peer as i32, c, s) }
        })
    }

    pub(crate) fn split(
        &self,
        device: &Device,
        color: Option<u32>,
        key: u32,
    ) -> Result<Option<NcclComm>> {
        device.backend().bind_to_thread()?;
        let raw = self.raw.lock();
        // NCCL_SPLIT_NOCOLOR is -1
        let c = color.map_or(-1, |c| c as i32);
        let mut out: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a live communicator and a valid out-pointer; a null config means defaults.
        let r = unsafe { sys::ncclCommSplit(raw.0, c, key as i32, &mut out, std::ptr::null_mut()) };
        check("ncclCommSplit", r, Some(raw.0))?;
        if out.is_null() {
            return Ok(None);
        }
        let mut rank = 0i32;
        let mut world = 0i32;
        // SAFETY: `out` is a live communicator; valid out-pointers.
        unsafe {
            check(
                "ncclCommUserRank",
                sys::ncclCommUserRank(out, &mut rank),
                Some(out),
            )?;
            check(
                "ncclCommCount",
                sys::ncclCommCount(out, &mut world),
                Some(out),
            )?;
        }
        Ok(Some(NcclComm {
            raw: Mutex::new(Raw(out)),
            rank: rank as usize,
            world: world as usize,
        }))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let raw = self.raw.get_mut();
        if !raw.0.is_null() {
            // SAFETY: the communicator is live and no call is in flight (we own it mutably).
            unsafe {
                let _ = sys::ncclCommDestroy(raw.0);
            }
        }
    }
}
