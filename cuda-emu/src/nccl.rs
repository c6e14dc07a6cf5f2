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
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::*;

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

/// Element types, as `ncclDataType_t` numbers them.
#[derive(Clone, Copy, PartialEq)]
enum Dt {
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
    F16,
    F32,
    F64,
    Bf16,
}

impl Dt {
    fn from(v: c_int) -> Option<Dt> {
        Some(match v {
            0 => Dt::I8,
            1 => Dt::U8,
            2 => Dt::I32,
            3 => Dt::U32,
            4 => Dt::I64,
            5 => Dt::U64,
            6 => Dt::F16,
            7 => Dt::F32,
            8 => Dt::F64,
            9 => Dt::Bf16,
            _ => return None,
        })
    }

    fn size(self) -> usize {
        match self {
            Dt::I8 | Dt::U8 => 1,
            Dt::F16 | Dt::Bf16 => 2,
            Dt::I32 | Dt::U32 | Dt::F32 => 4,
            Dt::I64 | Dt::U64 | Dt::F64 => 8,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, Dt::F16 | Dt::F32 | Dt::F64 | Dt::Bf16)
    }
}

/// Reductions, as `ncclRedOp_t` numbers them.
#[derive(Clone, Copy, PartialEq)]
enum Red {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl Red {
    fn from(v: c_int) -> Option<Red> {
        Some(match v {
            0 => Red::Sum,
            1 => Red::Prod,
            2 => Red::Max,
            3 => Red::Min,
            4 => Red::Avg,
            _ => return None,
        })
    }
}

fn word<const N: usize>(c: &[u8]) -> [u8; N] {
    c.try_into().expect("chunks of the element size")
}

fn decode_f(dt: Dt, p: &[u8]) -> Vec<f64> {
    let n = dt.size();
    p.chunks_exact(n)
        .map(|c| match dt {
            Dt::F16 => f16::from_le_bytes(word(c)).to_f64(),
            Dt::Bf16 => bf16::from_le_bytes(word(c)).to_f64(),
            Dt::F32 => f32::from_le_bytes(word(c)) as f64,
            _ => f64::from_le_bytes(word(c)),
        })
        .collect()
}

fn decode_i(dt: Dt, p: &[u8]) -> Vec<i128> {
    let n = dt.size();
    p.chunks_exact(n)
        .map(|c| match dt {
            Dt::I8 => c[0] as i8 as i128,
            Dt::U8 => c[0] as i128,
            Dt::I32 => i32::from_le_bytes(word(c)) as i128,
            Dt::U32 => u32::from_le_bytes(word(c)) as i128,
            Dt::I64 => i64::from_le_bytes(word(c)) as i128,
            _ => u64::from_le_bytes(word(c)) as i128,
        })
        .collect()
}

/// Wraps `a` into `dt` and back (integer sums and products wrap, as in NCCL).
fn wrap(dt: Dt, a: i128) -> i128 {
    match dt {
        Dt::I8 => a as i8 as i128,
        Dt::U8 => a as u8 as i128,
        Dt::I32 => a as i32 as i128,
        Dt::U32 => a as u32 as i128,
        Dt::I64 => a as i64 as i128,
        _ => a as u64 as i128,
    }
}

/// Element-wise reduction of equal-length `parts` in rank order: exact (f64, or 128-bit
/// integers wrapped after each product), rounded once.
fn reduce(dt: Dt, op: Red, parts: &[&[u8]]) -> Vec<u8> {
    let world = parts.len();
    if dt.is_float() {
        let mut acc = decode_f(dt, parts[0]);
        for p in &parts[1..] {
            for (a, v) in acc.iter_mut().zip(decode_f(dt, p)) {
                *a = match op {
                    Red::Sum | Red::Avg => *a + v,
                    Red::Prod => *a * v,
                    _ if a.is_nan() || v.is_nan() => f64::NAN,
                    Red::Max => a.max(v),
                    Red::Min => a.min(v),
                };
            }
        }
        if op == Red::Avg {
            acc.iter_mut().for_each(|a| *a /= world as f64);
        }
        acc.iter()
            .flat_map(|&a| match dt {
                Dt::F16 => f16::from_f64(a).to_le_bytes().to_vec(),
                Dt::Bf16 => bf16::from_f64(a).to_le_bytes().to_vec(),
                Dt::F32 => (a as f32).to_le_bytes().to_vec(),
                _ => a.to_le_bytes().to_vec(),
            })
            .collect()
    } else {
        let mut acc = decode_i(dt, parts[0]);
        for p in &parts[1..] {
            for (a, v) in acc.iter_mut().zip(decode_i(dt, p)) {
                *a = match op {
                    Red::Sum | Red::Avg => *a + v,
                    Red::Prod => wrap(dt, a.wrapping_mul(v)),
                    Red::Max => (*a).max(v),
                    Red::Min => (*a).min(v),
                };
            }
        }
        if op == Red::Avg {
            acc.iter_mut()
                .for_each(|a| *a = wrap(dt, *a) / world as i128);
        }
        acc.iter()
            .flat_map(|&a| {
                let b = (wrap(dt, a) as u128).to_le_bytes();
                b[..dt.size()].to_vec()
            })
            .collect()
    }
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
    let shared = Shared {
        dir,
        rank: rank as usize,
        world: world as usize,
        issued: AtomicU64::new(0),
        completed: AtomicU64::new(0),
        last: Mutex::new(None),
        sent: Mutex::new(HashMap::new()),
        received: Mutex::new(HashMap::new()),
        splits: AtomicU64::new(0),
        joined: AtomicBool::new(false),
        aborted: AtomicBool::new(false),
        error: AtomicI32::new(NCCL_SUCCESS),
    };
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
    let child = Shared {
        dir: parent
            .dir
            .with_file_name(format!("{name}-{prefix}c{color}")),
        rank,
        world: members.len(),
        issued: AtomicU64::new(0),
        completed: AtomicU64::new(0),
        last: Mutex::new(None),
        sent: Mutex::new(HashMap::new()),
        received: Mutex::new(HashMap::new()),
        splits: AtomicU64::new(0),
        joined: AtomicBool::new(true),
        aborted: AtomicBool::new(false),
        error: AtomicI32::new(NCCL_SUCCESS),
    };
    if let Err(e) = fs::create_dir_all(&child.dir) {
        set_last_error(&e.to_string());
        return NCCL_SYSTEM_ERROR;
    }
    *out = Box::into_raw(Box::new(ncclComm(Arc::new(child))));
    NCCL_SUCCESS
}

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
        if c.aborted.load(Ordering::Acquire) || c.error.load(Ordering::Acquire) != NCCL_SUCCESS {
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
    if !c.joined.load(Ordering::Acquire) && !c.joined() {
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

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    buf: *const c_void,
    count: usize,
    dt: c_int,
    peer: c_int,
    c: Comm,
    s: *mut c_void,
) -> NcclResult {
    let (Some(c), Some(dt)) = (comm(c), Dt::from(dt)) else {
        return NCCL_INVALID_ARGUMENT;
    };
    if peer < 0 || peer as usize >= c.world {
        return NCCL_INVALID_ARGUMENT;
    }
    let (peer, len, at) = (peer as usize, count * dt.size(), buf as usize);
    let name = format!("p{}.{peer}.{}", c.rank, next_message(&c.sent, peer));
    let c = Arc::clone(c);
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
    let (Some(c), Some(dt)) = (comm(c), Dt::from(dt)) else {
        return NCCL_INVALID_ARGUMENT;
    };
    if peer < 0 || peer as usize >= c.world {
        return NCCL_INVALID_ARGUMENT;
    }
    let (peer, len, at) = (peer as usize, count * dt.size(), buf as usize);
    let name = format!("p{peer}.{}.{}", c.rank, next_message(&c.received, peer));
    let c = Arc::clone(c);
    let poll = move || {
        if c.aborted.load(Ordering::Acquire) || c.error.load(Ordering::Acquire) != NCCL_SUCCESS {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_are_exact_and_rounded_once() {
        let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (a, b, c) = (f(&[1e8, 1.0]), f(&[1.0, 2.0]), f(&[-1e8, 4.0]));
        // in f32 step by step, 1e8 + 1 - 1e8 is 0; exact, it is 1
        assert_eq!(reduce(Dt::F32, Red::Sum, &[&a, &b, &c]), f(&[1.0, 7.0]));
        assert_eq!(reduce(Dt::F32, Red::Avg, &[&b, &b]), f(&[1.0, 2.0]));
        let i = |v: i32| v.to_le_bytes();
        assert_eq!(
            reduce(Dt::I32, Red::Sum, &[&i(i32::MAX), &i(1)]),
            i(i32::MIN),
            "integer sums wrap"
        );
        assert_eq!(reduce(Dt::I32, Red::Avg, &[&i(-3), &i(0)]), i(-1));
        assert_eq!(reduce(Dt::U8, Red::Max, &[&[200], &[7]]), vec![200]);
        assert_eq!(reduce(Dt::I8, Red::Min, &[&[200], &[7]]), vec![200]);
        let nan = f(&[f32::NAN]);
        let got = reduce(Dt::F32, Red::Max, &[&nan, &f(&[1.0])]);
        assert!(f32::from_le_bytes(word(&got)).is_nan());
    }
}
