//! A stand-in for NCCL (`libnccl.so.2`): the calls tidemem makes, across the processes (and
//! threads) of one machine, so that many ranks run without a GPU.
//!
//! `libnccl.so.2`, a symbolic link to the emulator's `libcuda.so` (`.ci/run`), is the same file
//! to the dynamic loader, so NCCL's calls share the driver's state: a collective is an op of the
//! stream it is given, **run in stream order** like a kernel (late, when something waits for
//! it), reading its input when it runs. An input written on another stream without a wait for it
//! is read stale, as on a GPU.
//!
//! **How ranks meet.** A unique id names a directory (under `/dev/shm`, or
//! `TIDEMEM_EMU_NCCL_DIR`). When a rank's collective runs, it writes its part there (a file per
//! collective and rank, renamed into place whole), then waits for every rank's part of the same
//! collective and computes its own result from them. The wait releases the driver's lock: the
//! stream stops at the collective and is polled again (the driver's synchronisations poll, its
//! queries answer "not ready"), so other threads of the process go on. Sends are files taken by
//! the receiver; a send never waits for its receive, so the group calls only have to pair.
//!
//! **Arithmetic.** Reductions are exact in rank order and rounded once (f64 or 128-bit
//! integers), integer sums wrap and averages divide the wrapped sum toward zero: the in-process
//! backend's arithmetic, so that a launched job is bitwise an in-process one. A real NCCL reduces
//! in its own order and rounds at each step.
//!
//! **Communicators** are non-blocking when made with `ncclCommInitRankConfig` (made at once;
//! `ncclCommGetAsyncError` answers "in progress" until every rank has joined) and blocking with
//! `ncclCommInitRank`. `ncclCommGetAsyncError` reports a peer that aborted (`ncclRemoteError`);
//! one that died is a collective that never completes, which the caller's wait times out.
//! After `ncclCommAbort` the communicator's pending collectives complete without computing.
//! `ncclCommSplit` meets the parent's ranks on the host (blocking) and makes the children.
//! Integer, floating and 8-bit types; sum, product, max, min and average.
#![allow(non_camel_case_types)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;

mod ops;
mod reduce;

pub use ops::*;
use reduce::word;

type NcclResult = c_int;
const NCCL_SUCCESS: NcclResult = 0;
const NCCL_SYSTEM_ERROR: NcclResult = 2;
const NCCL_INVALID_ARGUMENT: NcclResult = 4;
const NCCL_INVALID_USAGE: NcclResult = 5;
const NCCL_REMOTE_ERROR: NcclResult = 6;
const NCCL_IN_PROGRESS: NcclResult = 7;

/// The version reported: the API of NCCL 2.19 (`ncclCommSplit`, non-blocking communicators).
const VERSION: c_int = 21_900;
/// The first bytes of every unique id the stand-in makes.
const MAGIC: &[u8; 8] = b"tmemnccl";

/// `ncclUniqueId`: 128 bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; 128],
}

/// The head of `ncclConfig_t` the stand-in reads (size, magic, version, blocking).
#[repr(C)]
pub struct ncclConfig_t {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
}

/// What one rank of one communicator shares with the ops it enqueued.
struct Shared {
    dir: PathBuf,
    rank: usize,
    world: usize,
    /// Collectives enqueued, and run to their end, in the communicator's order.
    issued: AtomicU64,
    completed: AtomicU64,
    /// The stream and op of the latest collective enqueued.
    last: Mutex<Option<(usize, u64)>>,
    /// Sends enqueued to each peer, receives enqueued from each.
    sent: Mutex<HashMap<usize, u64>>,
    received: Mutex<HashMap<usize, u64>>,
    splits: AtomicU64,
    joined: AtomicBool,
    aborted: AtomicBool,
    /// The asynchronous error (`ncclSuccess` while none).
    error: AtomicI32,
}

impl Shared {
    fn new(dir: PathBuf, rank: usize, world: usize, joined: bool) -> Shared {
        Shared {
            dir,
            rank,
            world,
            issued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            last: Mutex::new(None),
            sent: Mutex::new(HashMap::new()),
            received: Mutex::new(HashMap::new()),
            splits: AtomicU64::new(0),
            joined: AtomicBool::new(joined),
            aborted: AtomicBool::new(false),
            error: AtomicI32::new(NCCL_SUCCESS),
        }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `bytes` as `name` whole: peers see the file complete or not at all.
    fn publish(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        let tmp = self.file(&format!("{name}.tmp"));
        fs::write(&tmp, bytes)?;
        fs::rename(&tmp, self.file(name))
    }

    /// Whether every rank's `{prefix}.r{rank}` exists.
    fn all_present(&self, prefix: &str) -> bool {
        (0..self.world).all(|r| self.file(&format!("{prefix}.r{r}")).exists())
    }

    /// Records a peer's abort as the asynchronous error; whether one aborted.
    fn peer_aborted(&self) -> bool {
        let gone = (0..self.world).any(|r| self.file(&format!("abort.r{r}")).exists());
        if gone {
            self.fail(NCCL_REMOTE_ERROR, "a peer aborted its communicator");
        }
        gone
    }

    /// For a part `{prefix}.r{rank}` still missing: records (as [`Shared::peer_aborted`]) a peer
    /// that aborted, or that left the communicator without the part, which will not come;
    /// whether either happened.
    fn peer_lost(&self, prefix: &str) -> bool {
        if self.peer_aborted() {
            return true;
        }
        let left = (0..self.world).any(|r| self.file(&format!("gone.r{r}")).exists());
        // a peer writes its parts before it leaves: seen gone, its parts are seen too
        if left && !self.all_present(prefix) {
            self.fail(
                NCCL_REMOTE_ERROR,
                "a peer left the communicator before its part of a collective",
            );
            return true;
        }
        false
    }

    fn fail(&self, code: NcclResult, why: &str) {
        let _ =
            self.error
                .compare_exchange(NCCL_SUCCESS, code, Ordering::AcqRel, Ordering::Acquire);
        set_last_error(why);
    }

    /// Whether the communicator was aborted here or failed: its work ends without computing.
    fn ended(&self) -> bool {
        self.aborted.load(Ordering::Acquire) || self.error.load(Ordering::Acquire) != NCCL_SUCCESS
    }

    fn joined(&self) -> bool {
        if !self.joined.load(Ordering::Acquire) && self.all_present("joined") {
            self.joined.store(true, Ordering::Release);
        }
        self.joined.load(Ordering::Acquire)
    }
}

/// A communicator: what `ncclComm_t` points to (made by the init calls and the split, freed
/// by destroy or abort).
pub struct ncclComm(Arc<Shared>);

/// The communicator handle.
pub type ncclComm_t = *mut ncclComm;
type Comm = ncclComm_t;

/// The communicator behind a handle.
unsafe fn comm<'a>(c: Comm) -> Option<&'a Arc<Shared>> {
    c.as_ref().map(|c| &c.0)
}

static LAST_ERROR: Mutex<Option<CString>> = Mutex::new(None);

fn set_last_error(why: &str) {
    let text = CString::new(why.replace('\0', " ")).unwrap_or_default();
    *LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
}

fn base_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TIDEMEM_EMU_NCCL_DIR") {
        return PathBuf::from(d);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn dir_of(id: &ncclUniqueId) -> Option<PathBuf> {
    let b: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    if &b[..8] != MAGIC {
        return None;
    }
    let hex: String = b[8..24].iter().map(|x| format!("{x:02x}")).collect();
    Some(base_dir().join(format!("tidemem-nccl-{hex}")))
}

/// Waits on the host (for a blocking init or a split) until `ready`, running the process's
/// streams meanwhile as a GPU would (a peer may need this rank's pending collectives first);
/// false after the driver's wait limit.
fn host_wait(mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut nap = Duration::from_micros(20);
    while !ready() {
        if start.elapsed() > wait_limit() {
            return false;
        }
        let _ = with(|st| st.run_everything());
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(1));
    }
    true
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    if v.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    *v = VERSION;
    NCCL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut ncclUniqueId) -> NcclResult {
    if id.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let mut nonce = [0u8; 16];
    let random = fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut nonce));
    if random.is_err() {
        set_last_error("/dev/urandom cannot be read");
        return NCCL_SYSTEM_ERROR;
    }
    let mut out = [0 as c_char; 128];
    for (o, &b) in out.iter_mut().zip(MAGIC.iter().chain(nonce.iter())) {
        *o = b as c_char;
    }
    (*id).internal = out;
    NCCL_SUCCESS
}

/// Makes rank `rank` of `world` in the directory of `id` and announces it.
unsafe fn init(out: *mut Comm, world: c_int, id: ncclUniqueId, rank: c_int) -> NcclResult {
    if out.is_null() || world < 1 || rank < 0 || rank >= world {
        return NCCL_INVALID_ARGUMENT;
    }
    let Some(dir) = dir_of(&id) else {
        set_last_error("not a unique id of this NCCL stand-in");
        return NCCL_INVALID_ARGUMENT;
    };
    let shared = Shared::new(dir, rank as usize, world as usize, false);
    let made = fs::create_dir_all(&shared.dir)
        .and_then(|()| shared.publish(&format!("joined.r{rank}"), &[]));
    if let Err(e) = made {
        set_last_error(&format!("{}: {e}", shared.dir.display()));
        return NCCL_SYSTEM_ERROR;
    }
    *out = Box::into_raw(Box::new(ncclComm(Arc::new(shared))));
    NCCL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    out: *mut Comm,
    world: c_int,
    id: ncclUniqueId,
    rank: c_int,
) -> NcclResult {
    let r = init(out, world, id, rank);
    if r != NCCL_SUCCESS {
        return r;
    }
    let c = comm(*out).expect("just made");
    if !host_wait(|| c.joined()) {
        set_last_error("not every rank joined the communicator");
        return NCCL_SYSTEM_ERROR;
    }
    NCCL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    out: *mut Comm,
    world: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> NcclResult {
    let blocking = config.is_null() || (*config).blocking != 0;
    if blocking {
        return ncclCommInitRank(out, world, id, rank);
    }
    match init(out, world, id, rank) {
        NCCL_SUCCESS => NCCL_IN_PROGRESS,
        r => r,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(c: Comm, state: *mut NcclResult) -> NcclResult {
    let (Some(c), false) = (comm(c), state.is_null()) else {
        return NCCL_INVALID_ARGUMENT;
    };
    c.peer_aborted();
    let e = c.error.load(Ordering::Acquire);
    *state = if e != NCCL_SUCCESS {
        e
    } else if c.joined() {
        NCCL_SUCCESS
    } else {
        NCCL_IN_PROGRESS
    };
    NCCL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(c: Comm) -> NcclResult {
    match comm(c) {
        Some(_) => NCCL_SUCCESS,
        None => NCCL_INVALID_ARGUMENT,
    }
}

/// Ends this rank's use of the communicator; the last rank to leave removes the directory.
unsafe fn leave(c: Comm, aborted: bool) -> NcclResult {
    if c.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let shared = Box::from_raw(c).0;
    if aborted {
        shared.aborted.store(true, Ordering::Release);
        let _ = shared.publish(&format!("abort.r{}", shared.rank), &[]);
    }
    let _ = shared.publish(&format!("gone.r{}", shared.rank), &[]);
    if shared.all_present("gone") {
        let _ = fs::remove_dir_all(&shared.dir);
    }
    NCCL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(c: Comm) -> NcclResult {
    leave(c, false)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(c: Comm) -> NcclResult {
    leave(c, true)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(c: Comm, n: *mut c_int) -> NcclResult {
    match (comm(c), n.is_null()) {
        (Some(c), false) => {
            *n = c.world as c_int;
            NCCL_SUCCESS
        }
        _ => NCCL_INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(c: Comm, r: *mut c_int) -> NcclResult {
    match (comm(c), r.is_null()) {
        (Some(c), false) => {
            *r = c.rank as c_int;
            NCCL_SUCCESS
        }
        _ => NCCL_INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    NCCL_SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    NCCL_SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(r: NcclResult) -> *const c_char {
    let s: &'static CStr = match r {
        0 => c"no error",
        1 => c"unhandled cuda error",
        2 => c"unhandled system error",
        3 => c"internal error",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_c: Comm) -> *const c_char {
    let g = LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    // Kept for the process: the caller reads it after the lock is gone.
    let text = g.clone().unwrap_or_default();
    Box::leak(text.into_boxed_c_str()).as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    c: Comm,
    color: c_int,
    key: c_int,
    out: *mut Comm,
    _config: *mut ncclConfig_t,
) -> NcclResult {
    let (Some(parent), false) = (comm(c), out.is_null()) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let n = parent.splits.fetch_add(1, Ordering::AcqRel);
    let prefix = format!("split{n}");
    let mine = [color.to_le_bytes(), key.to_le_bytes()].concat();
    if let Err(e) = parent.publish(&format!("{prefix}.r{}", parent.rank), &mine) {
        set_last_error(&e.to_string());
        return NCCL_SYSTEM_ERROR;
    }
    if !host_wait(|| parent.peer_aborted() || parent.all_present(&prefix)) {
        set_last_error("not every rank came to the split");
        return NCCL_SYSTEM_ERROR;
    }
    if parent.error.load(Ordering::Acquire) != NCCL_SUCCESS {
        return NCCL_REMOTE_ERROR;
    }
    *out = std::ptr::null_mut();
    if color < 0 {
        return NCCL_SUCCESS; // NCCL_SPLIT_NOCOLOR
    }
    // the members of this color, by key and then by parent rank
    let mut members = Vec::new();
    for r in 0..parent.world {
        let b = match fs::read(parent.file(&format!("{prefix}.r{r}"))) {
            Ok(b) if b.len() == 8 => b,
            _ => {
                set_last_error("a split's part cannot be read");
                return NCCL_SYSTEM_ERROR;
            }
        };
        let (col, k) = (
            c_int::from_le_bytes(word(&b[..4])),
            c_int::from_le_bytes(word(&b[4..])),
        );
        if col == color {
            members.push((k, r));
        }
    }
    members.sort_unstable();
    let rank = members
        .iter()
        .position(|&(_, r)| r == parent.rank)
        .expect("a member of its own color");
    let name = parent.dir.file_name().unwrap_or_default().to_string_lossy();
    let dir = parent
        .dir
        .with_file_name(format!("{name}-{prefix}c{color}"));
    let child = Shared::new(dir, rank, members.len(), true);
    if let Err(e) = fs::create_dir_all(&child.dir) {
        set_last_error(&e.to_string());
        return NCCL_SYSTEM_ERROR;
    }
    *out = Box::into_raw(Box::new(ncclComm(Arc::new(child))));
    NCCL_SUCCESS
}
