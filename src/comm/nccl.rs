//! The NCCL backend: NCCL's C API (types from cudarc's bindings) loaded at run time.
//!
//! The library is `TIDEMEM_NCCL_LIB` (a path) when set, and then only that; else `libnccl.so.2` (NCCL's
//! soname, the only name the `libnccl2` package and the `nvidia-nccl` wheels ship) or
//! `libnccl.so` on the loader's search path (`LD_LIBRARY_PATH`). Functions newer NCCL releases
//! added (`ncclGetLastError`, 2.13; `ncclCommSplit`, 2.18) are optional: without them errors
//! carry NCCL's generic message and `split` is an error.
//!
//! Calls go through [`Device::enqueue_foreign`], so NCCL's reads and writes are ordered with the
//! device layer's other work on the buffers. One communicator serves one thread at a time (NCCL
//! does not allow concurrent calls on one communicator): calls are serialized by a lock.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

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
    /// A call failed: NCCL may have work that never completes, so drop aborts instead of
    /// destroying (which waits for it).
    failed: AtomicBool,
}

/// `ncclResult_t` as the C ABI returns it: an `int`, since a newer NCCL may return codes a
/// Rust enum does not hold.
type R = c_int;
const SUCCESS: R = 0;
const IN_PROGRESS: R = 7;
type Comm = sys::ncclComm_t;
type Dt = sys::ncclDataType_t;
type Op = sys::ncclRedOp_t;
type St = sys::cudaStream_t;

/// The NCCL functions this backend calls.
struct Lib {
    path: String,
    get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> R,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, sys::ncclUniqueId, c_int) -> R,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, Dt, Comm, St) -> R,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, Dt, Op, Comm, St) -> R,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, Dt, Op, Comm, St) -> R,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, Dt, c_int, Comm, St) -> R,
    reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, Dt, Op, c_int, Comm, St) -> R,
    send: unsafe extern "C" fn(*const c_void, usize, Dt, c_int, Comm, St) -> R,
    recv: unsafe extern "C" fn(*mut c_void, usize, Dt, c_int, Comm, St) -> R,
    group_start: unsafe extern "C" fn() -> R,
    group_end: unsafe extern "C" fn() -> R,
    comm_user_rank: unsafe extern "C" fn(Comm, *mut c_int) -> R,
    comm_count: unsafe extern "C" fn(Comm, *mut c_int) -> R,
    comm_destroy: unsafe extern "C" fn(Comm) -> R,
    comm_abort: unsafe extern "C" fn(Comm) -> R,
    get_error_string: unsafe extern "C" fn(R) -> *const c_char,
    get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
    comm_split:
        Option<unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut sys::ncclConfig_t) -> R>,
    // Last: the functions above point into it.
    _lib: libloading::Library,
}

/// Loads NCCL from the first candidate that opens and resolves every required function.
fn load() -> std::result::Result<Lib, String> {
    if let Some(p) = std::env::var_os("TIDEMEM_NCCL_LIB") {
        // An explicit choice: that library or none.
        let name = p.to_string_lossy().into_owned();
        // SAFETY: loading NCCL runs its initializers, which only set up its own state.
        return match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => resolve(lib, &name),
            Err(e) => Err(format!("TIDEMEM_NCCL_LIB={name} cannot be loaded: {e}")),
        };
    }
    let mut names: Vec<String> = vec!["libnccl.so.2".into()];
    names.extend(cudarc::get_lib_name_candidates("nccl"));
    let mut tried = Vec::new();
    for name in &names {
        // SAFETY: loading NCCL runs its initializers, which only set up its own state.
        let Ok(lib) = (unsafe { libloading::Library::new(name) }) else {
            tried.push(name.clone());
            continue;
        };
        match resolve(lib, name) {
            Ok(l) => return Ok(l),
            Err(e) => tried.push(e),
        }
    }
    Err(format!(
        "the NCCL library cannot be loaded (tried {}); set TIDEMEM_NCCL_LIB to the path of \
         libnccl.so.2 (for a pip install: site-packages/nvidia/nccl/lib/libnccl.so.2) or add \
         its directory to LD_LIBRARY_PATH",
        tried.join(", ")
    ))
}

/// Resolves every function from an opened library (the optional ones if present).
fn resolve(lib: libloading::Library, name: &str) -> std::result::Result<Lib, String> {
    macro_rules! f {
        ($sym:literal) => {
            // SAFETY: the symbol is declared with its C signature from nccl.h (as in cudarc's
            // bindings); the pointer stays valid while the library is loaded, which is as long
            // as the `Lib` that owns it.
            unsafe { *lib.get($sym).map_err(|e| format!("{name}: {e}"))? }
        };
    }
    macro_rules! opt {
        ($sym:literal) => {
            // SAFETY: as above.
            unsafe { lib.get($sym).ok().map(|s| *s) }
        };
    }
    Ok(Lib {
        path: name.to_string(),
        get_unique_id: f!(b"ncclGetUniqueId\0"),
        comm_init_rank: f!(b"ncclCommInitRank\0"),
        all_gather: f!(b"ncclAllGather\0"),
        reduce_scatter: f!(b"ncclReduceScatter\0"),
        all_reduce: f!(b"ncclAllReduce\0"),
        broadcast: f!(b"ncclBroadcast\0"),
        reduce: f!(b"ncclReduce\0"),
        send: f!(b"ncclSend\0"),
        recv: f!(b"ncclRecv\0"),
        group_start: f!(b"ncclGroupStart\0"),
        group_end: f!(b"ncclGroupEnd\0"),
        comm_user_rank: f!(b"ncclCommUserRank\0"),
        comm_count: f!(b"ncclCommCount\0"),
        comm_destroy: f!(b"ncclCommDestroy\0"),
        comm_abort: f!(b"ncclCommAbort\0"),
        get_error_string: f!(b"ncclGetErrorString\0"),
        get_last_error: opt!(b"ncclGetLastError\0"),
        comm_split: opt!(b"ncclCommSplit\0"),
        _lib: lib,
    })
}

fn lib() -> Result<&'static Lib> {
    static LIB: OnceLock<std::result::Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(load)
        .as_ref()
        .map_err(|reason| Error::BackendUnavailable {
            kind: BackendKind::Cuda,
            reason: reason.clone(),
        })
}

/// Where NCCL was loaded from.
pub(crate) fn library_path() -> Result<&'static str> {
    lib().map(|l| l.path.as_str())
}

/// NCCL's name for a result code.
fn code_name(r: R) -> String {
    let name = match r {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => return format!("ncclResult {r}"),
    };
    name.to_string()
}

fn check(during: &'static str, r: R, comm: Option<sys::ncclComm_t>) -> Result<()> {
    match r {
        SUCCESS | IN_PROGRESS => Ok(()),
        _ => {
            // SAFETY: NCCL returns static NUL-terminated strings (or null).
            let text = |p: *const std::ffi::c_char| {
                (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            };
            let (last, generic) = match lib() {
                Ok(l) => (
                    // SAFETY: a live communicator (or null, which NCCL accepts).
                    l.get_last_error
                        .and_then(|f| unsafe { text(f(comm.unwrap_or(std::ptr::null_mut()))) }),
                    // SAFETY: any result code.
                    unsafe { text((l.get_error_string)(r)) },
                ),
                Err(_) => (None, None),
            };
            let message = match (last, generic) {
                (Some(l), Some(g)) if !l.is_empty() => format!("{g}: {l}"),
                (_, Some(g)) => g,
                (Some(l), None) => l,
                (None, None) => String::new(),
            };
            Err(Error::Nccl {
                during,
                code: r,
                code_name: code_name(r),
                message,
            })
        }
    }
}

pub(crate) fn unique_id() -> Result<[u8; 128]> {
    let l = lib()?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer.
    check(
        "ncclGetUniqueId",
        unsafe { (l.get_unique_id)(&mut id) },
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
        let l = lib()?;
        device.backend().bind_to_thread()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer; blocks until every rank of the id has joined.
        let r = unsafe { (l.comm_init_rank)(&mut comm, world as i32, id, rank as i32) };
        check("ncclCommInitRank", r, None)?;
        Ok(NcclComm {
            raw: Mutex::new(Raw(comm)),
            rank,
            world,
            failed: AtomicBool::new(false),
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
        f: impl Fn(&Lib, Comm, &[u64], St) -> R,
    ) -> Result<()> {
        if views.iter().all(|(v, _)| v.is_empty()) {
            // NCCL does nothing for zero elements; empty buffers have no device address
            return Ok(());
        }
        let l = lib()?;
        let raw = self.raw.lock();
        let comm = raw.0;
        let r = device.enqueue_foreign(stream, views, &mut |ptrs: &[u64], s: *mut c_void| {
            check(during, f(l, comm, ptrs, s.cast()), Some(comm))
        });
        if r.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        r
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
        self.call(device, "ncclAllGather", stream, &views, |l, c, p, s| {
            // SAFETY: `p` are device addresses of ranges of the checked lengths (n and world·n
            // elements), ordered on `s` by the device layer.
            unsafe {
                (l.all_gather)(
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
        self.call(device, "ncclReduceScatter", stream, &views, |l, c, p, s| {
            // SAFETY: device ranges of world·n and n elements, ordered on `s`.
            unsafe {
                (l.reduce_scatter)(
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
        self.call(device, "ncclAllReduce", stream, &views, |l, c, p, s| {
            // SAFETY: two device ranges of n elements, ordered on `s`.
            unsafe {
                (l.all_reduce)(
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
        self.call(device, "ncclBroadcast", stream, &views, |l, c, p, s| {
            // SAFETY: one device range of n elements (in place), ordered on `s`.
            unsafe {
                (l.broadcast)(
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
        self.call(device, "ncclReduce", stream, &views, |l, c, p, s| {
            // SAFETY: two device ranges of n elements, ordered on `s`.
            unsafe {
                (l.reduce)(
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
        self.call(device, "ncclSend", stream, &views, |l, c, p, s| {
            // SAFETY: a device range of n elements, ordered on `s`.
            unsafe { (l.send)(p[0] as *const c_void, n, dtype(elem), peer as i32, c, s) }
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
        self.call(device, "ncclRecv", stream, &views, |l, c, p, s| {
            // SAFETY: a device range of n elements, ordered on `s`.
            unsafe { (l.recv)(p[0] as *mut c_void, n, dtype(elem), peer as i32, c, s) }
        })
    }

    /// `ncclSend` and `ncclRecv` in one group.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_recv(
        &self,
        device: &Device,
        stream: &Stream,
        send: DeviceView<'_>,
        n: usize,
        to: usize,
        recv: DeviceView<'_>,
        m: usize,
        from: usize,
        elem: Elem,
    ) -> Result<()> {
        let views = [(send, false), (recv, true)];
        self.call(device, "ncclSend/ncclRecv", stream, &views, |l, c, p, s| {
            // SAFETY: device ranges of n and m elements, ordered on `s`; the group makes NCCL
            // post both before waiting on either. Every started group is ended.
            unsafe {
                let r = (l.group_start)();
                if r != SUCCESS {
                    return r;
                }
                // An empty side is left out on every rank alike (the two ends of a message
                // have equal counts), as `send` and `recv` leave out empty messages.
                let a = if n > 0 {
                    (l.send)(p[0] as *const c_void, n, dtype(elem), to as c_int, c, s)
                } else {
                    SUCCESS
                };
                let b = if m > 0 {
                    (l.recv)(p[1] as *mut c_void, m, dtype(elem), from as c_int, c, s)
                } else {
                    SUCCESS
                };
                let e = (l.group_end)();
                [a, b, e].into_iter().find(|&r| r != SUCCESS).unwrap_or(e)
            }
        })
    }

    pub(crate) fn split(
        &self,
        device: &Device,
        color: Option<u32>,
        key: u32,
    ) -> Result<Option<NcclComm>> {
        let l = lib()?;
        let split = l.comm_split.ok_or_else(|| Error::BackendUnavailable {
            kind: BackendKind::Cuda,
            reason: format!(
                "{} has no ncclCommSplit (NCCL 2.18 or later needed)",
                l.path
            ),
        })?;
        let (c, key) = match (color.map(i32::try_from), i32::try_from(key)) {
            (Some(Err(_)), _) | (_, Err(_)) => {
                return Err(Error::InvalidArgument(format!(
                    "NCCL takes colors and keys up to {}, got color {color:?} and key {key}",
                    i32::MAX
                )))
            }
            // NCCL_SPLIT_NOCOLOR is -1
            (c, Ok(k)) => (c.map_or(Ok(-1), |c| c).unwrap_or(-1), k),
        };
        device.backend().bind_to_thread()?;
        let raw = self.raw.lock();
        let mut out: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a live communicator and a valid out-pointer; a null config means defaults.
        let r = unsafe { split(raw.0, c, key, &mut out, std::ptr::null_mut()) };
        if let Err(e) = check("ncclCommSplit", r, Some(raw.0)) {
            self.failed.store(true, Ordering::Relaxed);
            return Err(e);
        }
        if out.is_null() {
            return Ok(None);
        }
        // Owned from here: a failure below aborts it on drop.
        let mut sub = NcclComm {
            raw: Mutex::new(Raw(out)),
            rank: 0,
            world: 0,
            failed: AtomicBool::new(true),
        };
        let mut rank: c_int = 0;
        let mut world: c_int = 0;
        // SAFETY: `out` is a live communicator; valid out-pointers.
        unsafe {
            check(
                "ncclCommUserRank",
                (l.comm_user_rank)(out, &mut rank),
                Some(out),
            )?;
            check("ncclCommCount", (l.comm_count)(out, &mut world), Some(out))?;
        }
        sub.rank = rank as usize;
        sub.world = world as usize;
        *sub.failed.get_mut() = false;
        Ok(Some(sub))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let abort = *self.failed.get_mut() || std::thread::panicking();
        let raw = self.raw.get_mut();
        if raw.0.is_null() {
            return;
        }
        if let Ok(l) = lib() {
            // SAFETY: the communicator is live and no call is being enqueued (we own it
            // mutably). Destroy waits for NCCL's outstanding work; after a failure (or while
            // unwinding) that work may never finish, so abort instead.
            unsafe {
                let _ = if abort {
                    (l.comm_abort)(raw.0)
                } else {
                    (l.comm_destroy)(raw.0)
                };
            }
        }
    }
}
