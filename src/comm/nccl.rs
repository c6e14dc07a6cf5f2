//! The NCCL backend: NCCL's C API (types from cudarc's bindings) loaded at run time.
//!
//! The library is `TIDEMEM_NCCL_LIB` (a path) when set, and then only that; else `libnccl.so.2` (NCCL's
//! soname, the only name the `libnccl2` package and the `nvidia-nccl` wheels ship) or
//! `libnccl.so` on the loader's search path (`LD_LIBRARY_PATH`). Functions newer NCCL releases
//! added (`ncclGetLastError`, 2.13; `ncclCommInitRankConfig`, `ncclCommFinalize`, 2.14;
//! `ncclCommSplit`, 2.18) are optional: without them errors carry NCCL's generic message,
//! communicators are blocking and `split` is an error.
//!
//! Calls go through [`Device::enqueue_foreign`], so NCCL's reads and writes are ordered with the
//! device layer's other work on the buffers. One communicator serves one thread at a time (NCCL
//! does not allow concurrent calls on one communicator): calls are serialized by a lock.
//!
//! # Nothing waits forever
//!
//! With many ranks on many nodes, a rank that dies or never comes would leave the others blocked
//! in NCCL. So, where the library has `ncclCommInitRankConfig` (NCCL 2.14), communicators are
//! created *non-blocking*: initialization, and any call NCCL answers with `ncclInProgress`, are
//! polled through `ncclCommGetAsyncError` up to the communicator's timeout (a collective's poll
//! runs inside its enqueue, so the device layer records the buffers' use after NCCL's kernels).
//! Waits for a stream ([`NcclComm::wait`]) poll the stream and the communicator's asynchronous
//! error together. On a timeout or an asynchronous error the communicator is aborted at once
//! (which also stops its kernels spinning on the device), and every later call fails with
//! [`Error::CommAborted`]. The price: NCCL launches a non-blocking communicator's kernels from a
//! thread of its own, some microseconds per collective, small against chunk-sized messages.
//! `TIDEMEM_NCCL_BLOCKING=1` (or an NCCL older than 2.14) gives blocking communicators: the same
//! calls, but initialization and NCCL's own enqueueing can block without a timeout.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use parking_lot::Mutex;

use super::{Elem, ReduceOp};
use crate::device::{BackendKind, Device, DeviceView, Event, Stream};
use crate::error::{Error, Result};

/// The communicator handle, null once aborted (with the reason).
struct Raw {
    comm: sys::ncclComm_t,
    aborted: Option<String>,
    /// Where NCCL stores the children of this communicator's splits, at the end of each split's
    /// job: kept while the communicator lives, as a job may store (a null child, for a rank
    /// with no color) after the split returned. Boxed so that they stay where NCCL was told
    /// they are when the vector grows.
    #[allow(clippy::vec_box)]
    split_outs: Vec<Box<AtomicPtr<sys::ncclComm>>>,
}

// SAFETY: an NCCL communicator may be used from any thread; `NcclComm` serializes the calls.
unsafe impl Send for Raw {}
// SAFETY: as above, every use goes through the mutex in `NcclComm`.
unsafe impl Sync for Raw {}

pub(crate) struct NcclComm {
    raw: Mutex<Raw>,
    rank: usize,
    world: usize,
    /// The longest any poll waits.
    timeout: Duration,
    /// A call failed: NCCL may have work that never completes, so drop aborts instead of
    /// destroying (which waits for it).
    failed: AtomicBool,
}

/// `ncclConfig_t` as NCCL 2.14 defines it (size, magic, version, blocking). NCCL reads a config
/// by its size, magic and version, so later releases accept it and keep their defaults for the
/// fields added since.
#[repr(C)]
struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.14 with `blocking = 0`.
    fn nonblocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 2 * 10_000 + 14 * 100, // NCCL_VERSION(2, 14, 0)
            blocking: 0,
        }
    }
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
    get_version: unsafe extern "C" fn(*mut c_int) -> R,
    get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> R,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, sys::ncclUniqueId, c_int) -> R,
    comm_init_rank_config:
        Option<unsafe extern "C" fn(*mut Comm, c_int, sys::ncclUniqueId, c_int, *mut Config) -> R>,
    comm_get_async_error: Option<unsafe extern "C" fn(Comm, *mut R) -> R>,
    comm_finalize: Option<unsafe extern "C" fn(Comm) -> R>,
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
        get_version: f!(b"ncclGetVersion\0"),
        get_unique_id: f!(b"ncclGetUniqueId\0"),
        comm_init_rank: f!(b"ncclCommInitRank\0"),
        comm_init_rank_config: opt!(b"ncclCommInitRankConfig\0"),
        comm_get_async_error: opt!(b"ncclCommGetAsyncError\0"),
        comm_finalize: opt!(b"ncclCommFinalize\0"),
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

/// The loaded NCCL's version: `(major, minor, patch)`.
pub fn version() -> Result<(u32, u32, u32)> {
    let l = lib()?;
    let mut code: c_int = 0;
    // SAFETY: a valid out-pointer.
    let r = unsafe { (l.get_version)(&mut code) };
    check("ncclGetVersion", r, None)?;
    let code = code.max(0) as u32;
    // NCCL_VERSION: X·1000 + Y·100 + Z up to 2.8, X·10000 + Y·100 + Z since 2.9
    Ok(if code >= 10_000 {
        (code / 10_000, code % 10_000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    })
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
        8 => "ncclTimeout",
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
                (!p.is_null()).then(|| {
                    // SAFETY: as above, and not null.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                })
            };
            let (last, generic) = match lib() {
                Ok(l) => (
                    l.get_last_error.and_then(|f| {
                        // SAFETY: a live communicator (or null, which NCCL accepts).
                        text(unsafe { f(comm.unwrap_or(std::ptr::null_mut())) })
                    }),
                    {
                        // SAFETY: any result code.
                        text(unsafe { (l.get_error_string)(r) })
                    },
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
    let r = unsafe { (l.get_unique_id)(&mut id) };
    check("ncclGetUniqueId", r, None)?;
    Ok(id.internal.map(|c| c as u8))
}

fn dtype(e: Elem) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match e {
        Elem::U8 => T::ncclUint8,
        Elem::I32 => T::ncclInt32,
        Elem::U32 => T::ncclUint32,
        Elem::I64 => T::ncclInt64,
        Elem::U64 => T::ncclUint64,
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
        return Err(Error::Conflict {
            what: "NCCL".into(),
            with: format!("device {}: NCCL needs a CUDA device", device.name()),
        });
    }
    Ok(())
}

/// Calls `done` until it returns true or an error, napping a little longer each time (up to a
/// millisecond); `Ok(false)` once `timeout` has passed without.
fn poll_until(timeout: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<bool> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(10);
    loop {
        if done()? {
            return Ok(true);
        }
        if start.elapsed() >= timeout {
            return Ok(false);
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

/// Whether blocking communicators were asked for (`TIDEMEM_NCCL_BLOCKING=1`).
fn blocking_requested() -> bool {
    std::env::var_os("TIDEMEM_NCCL_BLOCKING").is_some_and(|v| v == "1")
}

/// Polls a non-blocking communicator until NCCL has finished what it was doing (`Ok(true)`),
/// fails, or `timeout` passes (`Ok(false)`).
fn settle(l: &Lib, comm: Comm, during: &'static str, timeout: Duration) -> Result<bool> {
    let get = l
        .comm_get_async_error
        .ok_or_else(|| Error::BackendUnavailable {
            kind: BackendKind::Cuda,
            reason: format!("{} has no ncclCommGetAsyncError", l.path),
        })?;
    poll_until(timeout, || {
        let mut state: R = SUCCESS;
        // SAFETY: a live communicator and a valid out-pointer.
        check(during, unsafe { get(comm, &mut state) }, Some(comm))?;
        check(during, state, Some(comm))?;
        Ok(state != IN_PROGRESS)
    })
}

impl NcclComm {
    pub(crate) fn init(
        device: &Device,
        id: &[u8; 128],
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        cuda_only(device)?;
        let l = lib()?;
        device.backend().bind_to_thread()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let (nonblocking, r) = match (l.comm_init_rank_config, l.comm_get_async_error) {
            (Some(init), Some(_)) if !blocking_requested() => {
                let mut config = Config::nonblocking();
                // SAFETY: valid out-pointers; NCCL copies the config. Returns at once
                // (ncclInProgress) and connects in the background.
                let r = unsafe { init(&mut comm, world as i32, id, rank as i32, &mut config) };
                (true, r)
            }
            // SAFETY: valid out-pointer; blocks until every rank of the id has joined (unless
            // NCCL_COMM_BLOCKING=0 makes it non-blocking after all: polled below).
            _ => (false, unsafe {
                (l.comm_init_rank)(&mut comm, world as i32, id, rank as i32)
            }),
        };
        let during = if nonblocking {
            "ncclCommInitRankConfig"
        } else {
            "ncclCommInitRank"
        };
        if let Err(e) = check(during, r, None) {
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed out before failing; nothing else holds it.
                unsafe {
                    let _ = (l.comm_abort)(comm);
                }
            }
            return Err(e);
        }
        // Owned from here: a failure below aborts it on drop.
        let c = NcclComm {
            raw: Mutex::new(Raw {
                comm,
                aborted: None,
                split_outs: Vec::new(),
            }),
            rank,
            world,
            timeout,
            failed: AtomicBool::new(true),
        };
        if r == IN_PROGRESS && !settle(l, comm, during, timeout)? {
            return Err(c.timed_out(during, timeout));
        }
        c.failed.store(false, Ordering::Relaxed);
        Ok(c)
    }

    /// The timeout error of `during`; the communicator is aborted on drop.
    fn timed_out(&self, during: &str, waited: Duration) -> Error {
        self.failed.store(true, Ordering::Relaxed);
        Error::CommTimeout {
            what: format!("{during} on NCCL rank {} of {}", self.rank, self.world),
            waited_ms: waited.as_millis() as u64,
            missing: Vec::new(),
        }
    }

    /// Aborts the communicator now, after `e`, and returns `e`: NCCL's kernels stop waiting for
    /// peers that will not come, and every later call fails with [`Error::CommAborted`].
    fn abort_after(&self, raw: &mut Raw, e: Error) -> Error {
        self.failed.store(true, Ordering::Relaxed);
        if !raw.comm.is_null() {
            if let Ok(l) = lib() {
                // SAFETY: a live communicator, owned under the lock; null afterwards.
                unsafe {
                    let _ = (l.comm_abort)(raw.comm);
                }
            }
            raw.comm = std::ptr::null_mut();
            raw.aborted = Some(e.to_string());
        }
        e
    }

    /// The live handle, or [`Error::CommAborted`].
    fn live(raw: &Raw) -> Result<Comm> {
        match &raw.aborted {
            Some(reason) => Err(Error::CommAborted {
                reason: reason.clone(),
            }),
            None => Ok(raw.comm),
        }
    }

    /// NCCL's asynchronous error, if any (a peer's failure, a network error): `Ok` while none.
    /// After an error the communicator is aborted.
    pub(crate) fn check_async(&self) -> Result<()> {
        let mut raw = self.raw.lock();
        let comm = Self::live(&raw)?;
        let Some(get) = lib()?.comm_get_async_error else {
            return Ok(());
        };
        let mut state: R = SUCCESS;
        // SAFETY: a live communicator and a valid out-pointer.
        let r = check(
            "ncclCommGetAsyncError",
            unsafe { get(comm, &mut state) },
            Some(comm),
        )
        .and_then(|()| check("ncclCommGetAsyncError", state, Some(comm)));
        r.map_err(|e| self.abort_after(&mut raw, e))
    }

    /// Waits for the work enqueued on `stream` so far, watching NCCL's asynchronous error; on an
    /// error or after the communicator's timeout, aborts the communicator and fails.
    pub(crate) fn wait(&self, device: &Device, stream: &Stream) -> Result<()> {
        let done: Event = device.new_event()?;
        device.record(stream, &done)?;
        let finished = poll_until(self.timeout, || {
            if device.event_done(&done)? {
                return Ok(true);
            }
            self.check_async()?;
            Ok(false)
        })?;
        if finished {
            // done already; tells the device layer the host has seen the stream's work finish
            return device.sync_event(&done);
        }
        let e = self.timed_out("a wait for collectives", self.timeout);
        Err(self.abort_after(&mut self.raw.lock(), e))
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
        let mut raw = self.raw.lock();
        let comm = Self::live(&raw)?;
        let r = device.enqueue_foreign(stream, views, &mut |ptrs: &[u64], s: *mut c_void| {
            let r = f(l, comm, ptrs, s.cast());
            check(during, r, Some(comm))?;
            // "In progress": a non-blocking communicator launches the kernels from a thread of
            // its own. Polled here, inside the enqueue, so that the device layer records the
            // buffers' use after the kernels are on the stream, and so that the communicator
            // takes no other call before.
            if r == IN_PROGRESS && !settle(l, comm, during, self.timeout)? {
                return Err(self.timed_out(during, self.timeout));
            }
            Ok(())
        });
        r.map_err(|e| match e {
            // NCCL failed or never finished: the communicator is of no further use
            Error::Nccl { .. } | Error::CommTimeout { .. } => self.abort_after(&mut raw, e),
            e => {
                self.failed.store(true, Ordering::Relaxed);
                e
            }
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
                return Err(Error::TooLarge {
                    what: format!("an NCCL split's color {color:?} or key {key}"),
                    requested: u128::from(color.unwrap_or(0).max(key)),
                    limit: i32::MAX as u64,
                })
            }
            // NCCL_SPLIT_NOCOLOR is -1
            (c, Ok(k)) => (c.map_or(Ok(-1), |c| c).unwrap_or(-1), k),
        };
        device.backend().bind_to_thread()?;
        let mut raw = self.raw.lock();
        let parent = Self::live(&raw)?;
        // NCCL stores the child into `out` atomically at the end of the split's job, which for a
        // non-blocking parent may run on NCCL's thread after the call has returned.
        let out: Box<AtomicPtr<sys::ncclComm>> = Box::new(AtomicPtr::new(std::ptr::null_mut()));
        let child = || out.load(Ordering::Acquire);
        // SAFETY: a live communicator and a valid out-pointer, which outlives the split: a
        // non-blocking split is polled to its end below. A null config inherits the parent's.
        let r = unsafe { split(parent, c, key, out.as_ptr(), std::ptr::null_mut()) };
        // In progress: the split runs as a job of the parent and writes the child at its end.
        // The parent's state need not show that job, so a member also polls for its child and
        // then for the child's own initialisation.
        let done = check("ncclCommSplit", r, Some(parent)).and_then(|()| {
            let start = Instant::now();
            let left = || self.timeout.saturating_sub(start.elapsed());
            // polling for the child, a failure of the parent's job is reported as it is
            let appeared = || {
                if let Some(get) = l.comm_get_async_error {
                    let mut state: R = SUCCESS;
                    // SAFETY: a live communicator and a valid out-pointer.
                    let r = unsafe { get(parent, &mut state) };
                    check("ncclCommSplit", r, Some(parent))?;
                    check("ncclCommSplit", state, Some(parent))?;
                }
                Ok(!child().is_null())
            };
            Ok(r != IN_PROGRESS
                || (settle(l, parent, "ncclCommSplit", left())?
                    && (color.is_none()
                        || (poll_until(left(), appeared)?
                            && settle(l, child(), "ncclCommSplit", left())?))))
        });
        let failed = match done {
            Ok(true) => None,
            Ok(false) => Some(self.timed_out("ncclCommSplit", self.timeout)),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            // aborting the parent waits for the job, which may still write a child
            let e = self.abort_after(&mut raw, e);
            let child = child();
            if !child.is_null() {
                // SAFETY: read after the job ended; a child it wrote is no one else's.
                unsafe {
                    let _ = (l.comm_abort)(child);
                }
            }
            raw.split_outs.push(out);
            return Err(e);
        }
        let child = child();
        raw.split_outs.push(out);
        drop(raw);
        let out = child;
        if out.is_null() {
            return Ok(None);
        }
        // Owned from here: a failure below aborts it on drop.
        let mut sub = NcclComm {
            raw: Mutex::new(Raw {
                comm: out,
                aborted: None,
                split_outs: Vec::new(),
            }),
            rank: 0,
            world: 0,
            timeout: self.timeout,
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
        let mut abort = *self.failed.get_mut() || std::thread::panicking();
        let timeout = self.timeout;
        let raw = self.raw.get_mut();
        if raw.comm.is_null() {
            return;
        }
        let Ok(l) = lib() else { return };
        if !abort {
            if let Some(finalize) = l.comm_finalize {
                // SAFETY: a live communicator we own mutably. Finalize flushes its work (in the
                // background for a non-blocking one, polled up to the timeout); destroy then
                // frees it without waiting.
                let r = unsafe { finalize(raw.comm) };
                abort = !matches!(r, SUCCESS | IN_PROGRESS)
                    || (r == IN_PROGRESS
                        && !settle(l, raw.comm, "ncclCommFinalize", timeout).unwrap_or(false));
            }
        }
        // SAFETY: the communicator is live and no call is being enqueued (we own it mutably).
        // Destroy waits for NCCL's outstanding work; after a failure (or while unwinding) that
        // work may never finish, so abort instead.
        unsafe {
            let _ = if abort {
                (l.comm_abort)(raw.comm)
            } else {
                (l.comm_destroy)(raw.comm)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_ends_when_done_on_error_or_at_the_timeout() {
        let mut n = 0;
        assert!(poll_until(Duration::from_secs(5), || {
            n += 1;
            Ok(n == 4)
        })
        .unwrap());
        assert_eq!(n, 4);
        let t = Instant::now();
        assert!(!poll_until(Duration::from_millis(20), || Ok(false)).unwrap());
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert!(t.elapsed() < Duration::from_secs(2), "naps stay short");
        let e = poll_until(Duration::from_secs(5), || {
            Err(Error::InvalidArgument("peer gone".into()))
        });
        assert!(matches!(e, Err(Error::InvalidArgument(_))));
    }

    /// With an NCCL installed (CI installs the PyPI wheel and sets `TIDEMEM_REQUIRE_NCCL=1`),
    /// every function resolves, optional ones included on a recent release, and a unique id is
    /// made; none of it needs a GPU.
    #[test]
    fn the_installed_nccl_resolves_every_function() {
        let l = match lib() {
            Ok(l) => l,
            Err(e) if std::env::var_os("TIDEMEM_REQUIRE_NCCL").is_some_and(|v| v == "1") => {
                panic!("TIDEMEM_REQUIRE_NCCL=1 but {e}")
            }
            Err(e) => {
                eprintln!("the_installed_nccl_resolves_every_function: skipping, {e}");
                return;
            }
        };
        let v = version().unwrap();
        eprintln!("NCCL {}.{}.{} from {}", v.0, v.1, v.2, l.path);
        assert!(v >= (2, 0, 0), "{v:?}");
        if v >= (2, 18, 0) {
            assert!(l.get_last_error.is_some() && l.comm_split.is_some());
            assert!(l.comm_init_rank_config.is_some() && l.comm_get_async_error.is_some());
            assert!(l.comm_finalize.is_some());
        }
        let (a, b) = (unique_id().unwrap(), unique_id().unwrap());
        assert_ne!(a, b, "each id is new");
    }

    #[test]
    fn the_config_is_ncclconfig_of_nccl_2_14() {
        // size, magic, version, blocking: the head of every later ncclConfig_t
        assert_eq!(std::mem::size_of::<Config>(), 24);
        assert_eq!(std::mem::offset_of!(Config, blocking), 16);
        let c = Config::nonblocking();
        assert_eq!(
            (c.size, c.magic, c.version, c.blocking),
            (24, 0xcafe_beef, 21_400, 0)
        );
    }
}
