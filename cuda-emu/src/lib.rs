//! A CUDA driver library that runs on the CPU, for testing tidemem's CUDA backend on machines
//! without a GPU.
//!
//! Built as `libtidemem_cuda_emu.so`, copied as `libcuda.so` into a directory of its own and found
//! before the NVIDIA driver there (`LD_LIBRARY_PATH`), it answers the
//! driver calls cudarc makes: devices of compute capability 9.0 whose memory is host memory
//! (`TIDEMEM_EMU_DEVICES` of them, by default 4, sharing one context and the process's memory,
//! so that each process of a launched job picks its own by `LOCAL_RANK`), non-blocking streams, events, stream-ordered allocation, pinned host memory, copies, memsets,
//! and kernel launches. Modules are the cubins or PTX that NVRTC builds from `kernels/*.cu`; a
//! function is looked up by name in the module's image and run from the same source compiled
//! for the host (`build.rs`; the emulator's own test kernels, `tests/kernels/*.cu`, are built
//! in too), one block after another, the threads of a block as fibers that meet at
//! `__syncthreads()` and at warp operations.
//!
//! **Work runs late.** Nothing enqueued on a stream runs until something waits for it: a stream
//! or event synchronisation, a stream waiting on an event of another stream, a copy to pageable
//! host memory (synchronous in CUDA too), or the second query of an event or stream (the first
//! answers "not ready"). Three calls run every stream: the synchronous copies and frees
//! (`cuMemcpyHtoD_v2`, `cuMemcpyDtoH_v2`, `cuMemFree_v2`, which synchronise in CUDA too), and
//! an allocation that would not fit while frees are pending. A program that reads a result without waiting for it
//! reads stale data here, every time, where a GPU would make it a race that passes most runs.
//! Copies from pageable host memory take their bytes at the call, as CUDA does; copies from and
//! to pinned memory use the memory when they run.
//!
//! **Ordering checks a GPU would not report.** Each stream carries a vector clock (its own
//! order, the events it waited for, and what the host had seen finish when the work was
//! enqueued). Memory used on a stream before its stream-ordered allocation is ordered there, or
//! freed on a stream before every use elsewhere is ordered before the free, is a fault, decided
//! when the work is enqueued, whatever the program synchronises afterwards. Every copy and
//! memset must lie inside one live allocation, every non-null pointer a kernel is given must
//! point into one, and pinned memory may not be freed while a pending copy uses it.
//!
//! **Kernels.** Fresh device memory (allocations up to 256 MiB), and shared memory before each
//! block (outside function templates, whose statics GCC keeps out of the section), is `0xff`
//! bytes. The threads of a block run in passes: each pass runs every thread that can run to its
//! next `__syncthreads()`, warp operation or end, in ascending order of thread index in even
//! passes and descending in odd ones, so a thread that reads another's write with no barrier
//! between sees it missing whenever the reader runs first in that pass; a barrier where some
//! threads end while others wait is a fault (threads waiting at different barriers are not told
//! apart). Blocks run one after another, in ascending order of their linear index in even
//! launches and descending in odd ones (counted over the process), so a result that depends on
//! the order of blocks changes between two launches of the same kernel.
//!
//! **Warps.** Thread `t` of a block (`x + y * Dx + z * Dx * Dy`) is lane `t % 32` of warp
//! `t / 32`, as on a GPU; `warpSize` is 32. `__shfl_sync`, `__shfl_up_sync`, `__shfl_down_sync`
//! and `__shfl_xor_sync` (for `int`, `unsigned`, `long`, `unsigned long`, `long long`,
//! `unsigned long long`, `float`, `double`, `__half` and `__nv_bfloat16`, with `width`),
//! `__syncwarp`, `__ballot_sync`, `__all_sync` and `__any_sync` are warp barriers: a lane waits
//! there until every lane its mask names waits at the same operation (the same intrinsic, the
//! same mask, and for shuffles the same width and the same operand size in 32-bit words; the
//! source lane, delta or lane mask may differ by lane), and then each gets what PTX `shfl.sync`
//! and `vote.sync` give: the low five bits of the source lane or offset count, and a lane whose
//! source falls outside its `width`-lane segment reads its own value (`__shfl_xor_sync` may
//! read earlier segments). Each of these is a fault:
//! - a mask that does not name the calling lane, or a shuffle width that is not 1, 2, 4, 8, 16
//!   or 32 (decided at the call);
//! - a mask naming a lane that has exited, or one past the block's last thread in a partial
//!   warp (CUDA only leaves what is read from them undefined; the emulator refuses the call);
//! - once no thread can run on: a lane waiting at a warp operation for a named lane that waits
//!   at `__syncthreads()`, or for one that waits at a different warp operation. A lane that
//!   makes more or fewer warp calls than the lanes its mask names ends in one of these (or in
//!   an exited lane).
//!
//! Reading a lane that the mask does not name (the upper half of a reduction under a partial
//! mask, say) is no fault: the value is all-ones bits (NaN, -1), as undefined as on a GPU. Not
//! caught: two call sites of the same intrinsic with the same mask meet as one operation (as
//! they do on sm_70 and later). `__activemask()`, no barrier on a GPU, waits here until no lane
//! of the warp can run on and answers the lanes then waiting at `__activemask()`: lanes that
//! returned, or wait at a barrier or another warp operation, are not active. Between warp
//! operations the lanes of a warp run one after another, not in lockstep: code that relies on
//! a warp running in step without `__syncwarp()` sees stale values in one of the passes.
//!
//! **Atomics.** `atomicAdd` (`int`, `unsigned`, `unsigned long long`, `float`, `double`),
//! `atomicSub`, `atomicExch` (also `float`), `atomicMin`/`atomicMax` (`int`, `unsigned`,
//! `long long`, `unsigned long long`; CUDA has no `float` ones and neither has the emulator),
//! `atomicAnd`/`Or`/`Xor`, `atomicInc`/`Dec` and `atomicCAS` (`int`, `unsigned`,
//! `unsigned long long`, `unsigned short`) are plain read-modify-writes, atomic here because
//! threads switch only at barriers and warp operations, and return the old value. The `float`
//! add flushes subnormal operands and results to zero, as PTX documents for `atom.add.f32`.
//! The order of atomics is the order of threads and blocks above, which changes between
//! passes and launches. Memory fences do nothing.
//!
//! **Dynamic shared memory.** `extern __shared__ T name[];`, at file or block scope, is one
//! buffer of the launch's `sharedMemBytes`, starting on a page boundary, `0xff` bytes before
//! each block. A launch asking for more than the function's cap (48 KiB, or what
//! `cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)` set, up to sm_90's
//! 227 KiB) is refused with `CUDA_ERROR_INVALID_VALUE`; static shared memory is not counted
//! against it. Faults: any access in the page before the buffer or from the page boundary
//! after its end (up to the 227 KiB), and a write to the bytes between its end and that page
//! boundary (found after the block: they are no longer `0xff`). A read of those bytes, or a
//! write of `0xff` bytes there, is not caught. A kernel thread that overflows its 64 KiB stack
//! into the guard page below it faults too, when its OS thread has an alternate signal stack
//! (Rust's threads do); otherwise the process dies of the `SIGSEGV`.
//!
//! **cuBLAS.** The library also answers the cuBLAS v2 calls a GEMM needs (`cublasCreate_v2`,
//! `cublasSetStream_v2`, `cublasSetMathMode`, `cublasGemmEx`, `cublasGemmStridedBatchedEx`,
//! `cublasSgemm_v2`, `cublasSgemmStridedBatched` and their companions; fp32, fp16 and bf16,
//! column-major, `alpha` and `beta` on the host). `libcublas.so` and `libcublas.so.13`,
//! symbolic links to `libcuda.so` in its directory (`.ci/run`), make cudarc's cuBLAS open the
//! same file, which the dynamic loader maps once whatever the name, so the two libraries share
//! one state: a GEMM is a CPU matrix product enqueued on the handle's stream like a kernel launch,
//! running late and ordered like all other work, and an operand that does not lie inside one
//! live allocation is a fault. The arithmetic and the limits are described in
//! `src/cublas.rs`.
//!
//! A fault prints what happened and makes every later call fail with
//! `CUDA_ERROR_ILLEGAL_ADDRESS`, as a fault on a GPU poisons its context.
//!
//! Environment: `TIDEMEM_EMU_MEM_MIB` sets the device memory (default 4096 MiB; only what is
//! allocated is used).
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, MutexGuard};

mod cublas;
mod launch;
mod nccl;
pub use cublas::*;
pub use launch::*;
use launch::{run_launch, SHARED_PER_BLOCK, SHARED_PER_BLOCK_OPTIN, SHARED_PER_SM};
pub use nccl::*;

type CUresult = c_int;
const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_IMAGE: CUresult = 200;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_FOUND: CUresult = 500;
const NOT_READY: CUresult = 600;
const ILLEGAL_ADDRESS: CUresult = 700;
const LAUNCH_FAILED: CUresult = 719;
const NOT_SUPPORTED: CUresult = 801;

fn error_name(e: CUresult) -> &'static CStr {
    match e {
        SUCCESS => c"CUDA_SUCCESS",
        INVALID_VALUE => c"CUDA_ERROR_INVALID_VALUE",
        OUT_OF_MEMORY => c"CUDA_ERROR_OUT_OF_MEMORY",
        NOT_INITIALIZED => c"CUDA_ERROR_NOT_INITIALIZED",
        INVALID_DEVICE => c"CUDA_ERROR_INVALID_DEVICE",
        INVALID_IMAGE => c"CUDA_ERROR_INVALID_IMAGE",
        INVALID_CONTEXT => c"CUDA_ERROR_INVALID_CONTEXT",
        INVALID_HANDLE => c"CUDA_ERROR_INVALID_HANDLE",
        NOT_FOUND => c"CUDA_ERROR_NOT_FOUND",
        NOT_READY => c"CUDA_ERROR_NOT_READY",
        ILLEGAL_ADDRESS => c"CUDA_ERROR_ILLEGAL_ADDRESS",
        LAUNCH_FAILED => c"CUDA_ERROR_LAUNCH_FAILED",
        NOT_SUPPORTED => c"CUDA_ERROR_NOT_SUPPORTED",
        _ => c"CUDA_ERROR_UNKNOWN",
    }
}

fn error_string(e: CUresult) -> &'static CStr {
    match e {
        SUCCESS => c"no error",
        INVALID_VALUE => c"invalid argument",
        OUT_OF_MEMORY => c"out of memory",
        NOT_INITIALIZED => c"initialization error",
        INVALID_DEVICE => c"invalid device ordinal",
        INVALID_IMAGE => c"device kernel image is invalid",
        INVALID_CONTEXT => c"invalid device context",
        INVALID_HANDLE => c"invalid resource handle",
        NOT_FOUND => c"named symbol not found",
        NOT_READY => c"device not ready",
        ILLEGAL_ADDRESS => c"an illegal memory access was encountered (emulated)",
        LAUNCH_FAILED => c"unspecified launch failure",
        NOT_SUPPORTED => c"operation not supported by the CUDA emulator",
        _ => c"unknown error",
    }
}

const CTX: usize = 0xC0DE_0000;
const ALIGN: usize = 256;

/// Where a copy takes its bytes from.
enum Src {
    /// Device memory, or pinned host memory read when the copy runs.
    Addr(usize),
    /// Pageable host memory, taken at the call.
    Owned(Vec<u8>),
}

enum Op {
    Copy {
        dst: usize,
        src: Src,
        len: usize,
    },
    Memset {
        dst: usize,
        value: u8,
        len: usize,
    },
    Launch {
        kernel: &'static EmuKernel,
        grid: [c_uint; 3],
        block: [c_uint; 3],
        /// Dynamic shared memory per block, in bytes.
        shared: c_uint,
        /// The parameter values, copied at the launch; `offsets[i]` is where parameter i starts.
        values: Vec<u64>,
        offsets: Vec<usize>,
    },
    /// Run the ops of `stream` up to `seq` first.
    Wait {
        stream: usize,
        seq: u64,
    },
    Free {
        ptr: usize,
    },
    /// A point in the stream's order (a stream-ordered allocation); runs as nothing.
    Mark,
    /// Host code standing in for a library's kernel (cuBLAS): `work` reads and writes device
    /// memory only in `ranges` (address, bytes), each checked inside one live allocation.
    Host {
        work: Box<dyn FnOnce() + Send>,
        ranges: Vec<(usize, usize)>,
    },
    /// Host code that may have to wait for something outside the process (a peer's part of a
    /// collective, `src/nccl/`): `poll` does what it can and answers whether it is done. A
    /// stream whose first op is not done stops there ([`PENDING`]) and is polled again later,
    /// without the driver's lock held meanwhile. `after` (a stream and op) runs first, as a GPU
    /// runs it without being waited for: the communicator's previous collective, which the
    /// peers' part of this one may need. Memory as for `Host`.
    External {
        poll: Box<dyn FnMut() -> bool + Send>,
        after: Option<(usize, u64)>,
        ranges: Vec<(usize, usize)>,
    },
}

impl Op {
    /// Whether the op refers to host memory in `[lo, hi)` (pinned copies).
    fn touches(&self, lo: usize, hi: usize) -> bool {
        let within = |a: usize, len: usize| a < hi && a.saturating_add(len.max(1)) > lo;
        match self {
            Op::Copy { dst, src, len } => {
                within(*dst, *len) || matches!(src, Src::Addr(s) if within(*s, *len))
            }
            _ => false,
        }
    }
}

/// A vector clock: for each stream, the last of its ops known to come before.
type Clock = BTreeMap<usize, u64>;

fn merge(into: &mut Clock, from: &Clock) {
    for (&s, &q) in from {
        let e = into.entry(s).or_insert(0);
        *e = (*e).max(q);
    }
}

fn covers(c: &Clock, stream: usize, seq: u64) -> bool {
    seq == 0 || c.get(&stream).is_some_and(|&q| q >= seq)
}

#[derive(Default)]
struct Stream {
    queue: VecDeque<(u64, Op)>,
    /// Sequence number of the latest op enqueued, and of the latest one run.
    last: u64,
    done: u64,
    /// What comes before the next op enqueued here.
    clock: Clock,
    /// Destroyed by the program: no new work, but what it holds runs only when waited for.
    destroyed: bool,
}

#[derive(Clone, Default)]
struct Event {
    /// The stream and op the latest record marks (`None`: never recorded).
    mark: Option<(usize, u64)>,
    /// The recording stream's clock at the record.
    clock: Clock,
    queried: bool,
    /// When the host recorded it: the emulator runs work lazily, so its timeline is the
    /// host's enqueue order (elapsed times are the program's own, not a GPU's).
    at: Option<std::time::Instant>,
}

struct Alloc {
    size: usize,
    /// A stream-ordered free is enqueued: no new op may use it.
    freeing: bool,
    /// The stream and op after which the allocation exists (stream-ordered allocation).
    born: (usize, u64),
    /// The latest op on each stream that uses the allocation.
    uses: BTreeMap<usize, u64>,
}

struct State {
    capacity: usize,
    used: usize,
    allocs: BTreeMap<usize, Alloc>,
    pinned: BTreeMap<usize, usize>,
    streams: BTreeMap<usize, Stream>,
    events: HashMap<usize, Event>,
    modules: HashMap<usize, Vec<u8>>,
    /// What the host has seen complete (synchronisations, successful queries): every op
    /// enqueued afterwards comes after it.
    host: Clock,
    next: usize,
    fault: Option<String>,
    stream_queried: HashMap<usize, u64>,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` of the functions that set it.
    dynamic_shared_cap: HashMap<usize, c_int>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

thread_local! {
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on the initialised state; a fault poisons every later call.
fn with<F: FnOnce(&mut State) -> CUresult>(f: F) -> CUresult {
    let mut g = state();
    let Some(st) = g.as_mut() else {
        return NOT_INITIALIZED;
    };
    if st.fault.is_some() {
        return ILLEGAL_ADDRESS;
    }
    f(st)
}

/// [`with`] for calls that need the context current on the calling thread.
fn with_ctx<F: FnOnce(&mut State) -> CUresult>(f: F) -> CUresult {
    with(|st| match need_ctx() {
        SUCCESS => f(st),
        e => e,
    })
}

/// What running a stream answers when it stopped at an op waiting for something outside the
/// process ([`Op::External`]); never returned to a caller of the driver.
const PENDING: CUresult = -1;

/// How long a synchronisation waits for stream work that waits outside the process (a
/// collective whose peers never come) before it faults: `TIDEMEM_EMU_WAIT_S` seconds, by
/// default 600.
fn wait_limit() -> std::time::Duration {
    let s = std::env::var("TIDEMEM_EMU_WAIT_S")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(600);
    std::time::Duration::from_secs(s)
}

/// [`with`] (or [`with_ctx`]) for a call that waits for stream work: while `f` answers
/// [`PENDING`], it is called again, the lock released in between so that other threads go on;
/// a fault once [`wait_limit`] has passed.
fn with_waiting(ctx: bool, mut f: impl FnMut(&mut State) -> CUresult) -> CUresult {
    let start = std::time::Instant::now();
    let mut nap = std::time::Duration::from_micros(20);
    loop {
        let r = if ctx { with_ctx(&mut f) } else { with(&mut f) };
        if r != PENDING {
            return r;
        }
        let waited = start.elapsed();
        if waited > wait_limit() {
            return with(|st| {
                st.fault(format!(
                    "a synchronisation waited {} s for stream work that waits outside the \
                     process (a collective whose peers never came)",
                    waited.as_secs()
                ))
            });
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(std::time::Duration::from_millis(1));
    }
}

/// A query's answer for a stream that ran as far as it could.
fn not_ready_if_pending(r: CUresult) -> CUresult {
    if r == PENDING {
        NOT_READY
    } else {
        r
    }
}

fn layout(size: usize) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(size.max(1), ALIGN).ok()
}

impl State {
    fn new() -> Self {
        let mib = std::env::var("TIDEMEM_EMU_MEM_MIB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(4096);
        let mut streams = BTreeMap::new();
        streams.insert(0, Stream::default());
        State {
            capacity: mib.saturating_mul(1 << 20),
            used: 0,
            allocs: BTreeMap::new(),
            pinned: BTreeMap::new(),
            streams,
            events: HashMap::new(),
            modules: HashMap::new(),
            host: Clock::new(),
            next: 0x1000,
            fault: None,
            stream_queried: HashMap::new(),
            dynamic_shared_cap: HashMap::new(),
        }
    }

    /// The most dynamic shared memory a launch of `k` may ask for.
    fn max_dynamic_shared(&self, k: &EmuKernel) -> c_int {
        self.dynamic_shared_cap
            .get(&(k as *const EmuKernel as usize))
            .copied()
            .unwrap_or(SHARED_PER_BLOCK)
    }

    fn id(&mut self) -> usize {
        self.next += 16;
        self.next
    }

    fn fault(&mut self, what: String) -> CUresult {
        eprintln!("tidemem-cuda-emu: fault: {what}");
        self.fault = Some(what);
        ILLEGAL_ADDRESS
    }

    /// The live allocation `[p, p + len)` lies in, if one does (`len` 0: `p` may be its end).
    fn alloc_of(&self, p: usize, len: usize) -> Option<usize> {
        let (&a, al) = self.allocs.range(..=p).next_back()?;
        let end = p.checked_add(len)?;
        (!al.freeing && end <= a + al.size).then_some(a)
    }

    fn device_range(&self, p: usize, len: usize) -> bool {
        self.alloc_of(p, len).is_some()
    }

    fn is_pinned(&self, p: usize, len: usize) -> bool {
        match self.pinned.range(..=p).next_back() {
            Some((&a, &size)) => p.checked_add(len).is_some_and(|e| e <= a + size),
            None => false,
        }
    }

    /// The host has seen everything before `clock` complete.
    fn observe(&mut self, clock: &Clock) {
        merge(&mut self.host, clock);
    }

    fn observe_stream(&mut self, s: usize) {
        if let Some(c) = self.streams.get(&s).map(|st| st.clock.clone()) {
            self.observe(&c);
        }
    }

    /// Enqueues `op` on `stream`, which uses the device allocations starting at `uses`: each
    /// must exist at this point of the stream's order, and a free must come after every use.
    fn enqueue_using(&mut self, stream: usize, op: Op, uses: &[usize]) -> CUresult {
        let host = self.host.clone();
        let Some(s) = self.streams.get_mut(&stream) else {
            return INVALID_HANDLE;
        };
        merge(&mut s.clock, &host);
        s.last += 1;
        let seq = s.last;
        s.clock.insert(stream, seq);
        let clock = s.clock.clone();
        for &a in uses {
            let Some(al) = self.allocs.get(&a) else {
                continue;
            };
            let (bs, bq) = al.born;
            if bs != stream && !covers(&clock, bs, bq) {
                let what = format!(
                    "device memory {a:#x} used on stream {stream:#x} without waiting for its \
                     allocation, ordered on stream {bs:#x}"
                );
                return self.fault(what);
            }
            if let Op::Free { .. } = op {
                let late = al
                    .uses
                    .iter()
                    .find(|&(&u, &q)| u != stream && !covers(&clock, u, q));
                if let Some((&u, _)) = late {
                    let what = format!(
                        "device memory {a:#x} (+{} bytes) freed on stream {stream:#x} while \
                         work on stream {u:#x} that uses it is not ordered before the free",
                        al.size
                    );
                    return self.fault(what);
                }
            }
            let al = self.allocs.get_mut(&a).expect("present");
            al.uses.insert(stream, seq);
        }
        let s = self.streams.get_mut(&stream).expect("present");
        s.queue.push_back((seq, op));
        SUCCESS
    }

    fn enqueue(&mut self, stream: usize, op: Op) -> CUresult {
        let uses: Vec<usize> = match &op {
            Op::Copy { dst, src, len } => {
                let mut v: Vec<usize> = self.alloc_of(*dst, *len).into_iter().collect();
                if let Src::Addr(a) = src {
                    v.extend(self.alloc_of(*a, *len));
                }
                v
            }
            Op::Memset { dst, len, .. } => self.alloc_of(*dst, *len).into_iter().collect(),
            Op::Free { ptr } => vec![*ptr],
            Op::Host { ranges, .. } | Op::External { ranges, .. } => {
                let mut v: Vec<usize> = ranges
                    .iter()
                    .filter_map(|&(p, len)| self.alloc_of(p, len))
                    .collect();
                v.sort_unstable();
                v.dedup();
                v
            }
            Op::Launch { .. } | Op::Wait { .. } | Op::Mark => Vec::new(),
        };
        self.enqueue_using(stream, op, &uses)
    }

    /// Runs the ops of `stream` up to and including `seq`; [`PENDING`] when an op on the way
    /// waits for something outside the process.
    fn run_until(&mut self, stream: usize, seq: u64) -> CUresult {
        loop {
            if self.fault.is_some() {
                return ILLEGAL_ADDRESS;
            }
            let Some(s) = self.streams.get_mut(&stream) else {
                return SUCCESS;
            };
            if s.done >= seq {
                return SUCCESS;
            }
            // An op that may not be done yet stays first in its stream until it is.
            match s.queue.front_mut() {
                Some((_, Op::External { after, .. })) if after.is_some() => {
                    let (other, seq) = after.take().expect("some");
                    let r = self.run_until(other, seq);
                    if r != SUCCESS {
                        // still to run first when the stream is polled again
                        if let Some((_, Op::External { after, .. })) = self
                            .streams
                            .get_mut(&stream)
                            .and_then(|s| s.queue.front_mut())
                        {
                            *after = Some((other, seq));
                        }
                        return r;
                    }
                    continue;
                }
                Some((_, Op::External { poll, .. })) => {
                    let done = poll();
                    if !done {
                        return PENDING;
                    }
                }
                Some((_, Op::Wait { stream: other, seq })) => {
                    let (other, seq) = (*other, *seq);
                    let r = self.run_until(other, seq);
                    if r != SUCCESS {
                        return r;
                    }
                }
                _ => {}
            }
            let s = self.streams.get_mut(&stream).expect("present");
            let Some((n, op)) = s.queue.pop_front() else {
                s.done = s.last;
                return SUCCESS;
            };
            let r = self.run(op);
            if let Some(s) = self.streams.get_mut(&stream) {
                s.done = n;
            }
            if r != SUCCESS {
                return r;
            }
        }
    }

    fn run_all(&mut self, stream: usize) -> CUresult {
        let last = self.streams.get(&stream).map_or(0, |s| s.last);
        self.run_until(stream, last)
    }

    /// Runs every stream; the host has seen all of it complete.
    fn synchronize(&mut self) -> CUresult {
        let r = self.run_everything();
        if r != SUCCESS {
            return r;
        }
        let all: Vec<usize> = self.streams.keys().copied().collect();
        for s in all {
            self.observe_stream(s);
        }
        r
    }

    /// Runs every stream as far as it goes: [`PENDING`] when one stopped at an op waiting for
    /// something outside the process (the others ran on).
    fn run_everything(&mut self) -> CUresult {
        let ids: Vec<usize> = self.streams.keys().copied().collect();
        let mut pending = false;
        for s in ids {
            match self.run_all(s) {
                SUCCESS => {}
                PENDING => pending = true,
                r => return r,
            }
        }
        if pending {
            PENDING
        } else {
            SUCCESS
        }
    }

    fn run(&mut self, op: Op) -> CUresult {
        match op {
            Op::Copy { dst, src, len } => {
                let from = match &src {
                    Src::Addr(a) => *a as *const u8,
                    Src::Owned(v) => v.as_ptr(),
                };
                // SAFETY: both ranges were checked at the call: device ranges inside a live
                // allocation, whose free is ordered after this op (checked when the free was
                // enqueued); host ranges given by the caller, who keeps pinned memory alive
                // until the copy runs (freeing pinned memory a pending copy uses is a fault).
                unsafe { std::ptr::copy(from, dst as *mut u8, len) };
                SUCCESS
            }
            Op::Memset { dst, value, len } => {
                // SAFETY: checked inside one live allocation at the call.
                unsafe { std::ptr::write_bytes(dst as *mut u8, value, len) };
                SUCCESS
            }
            Op::Launch {
                kernel,
                grid,
                block,
                shared,
                values,
                offsets,
            } => run_launch(self, kernel, grid, block, shared, values, &offsets),
            Op::Wait { stream: other, seq } => self.run_until(other, seq),
            Op::Mark => SUCCESS,
            Op::Host { work, .. } => {
                work();
                SUCCESS
            }
            // polled to done before it was taken off its stream (`run_until`)
            Op::External { .. } => SUCCESS,
            Op::Free { ptr } => {
                let Some(al) = self.allocs.remove(&ptr) else {
                    return self.fault(format!("free of {ptr:#x}, not an allocation"));
                };
                self.used -= al.size;
                if let Some(l) = layout(al.size) {
                    // SAFETY: allocated in `alloc` with this layout; the free is ordered after
                    // every use (checked when it was enqueued).
                    unsafe { std::alloc::dealloc(ptr as *mut u8, l) };
                }
                SUCCESS
            }
        }
    }

    /// Allocates `size` bytes that exist after the ops enqueued so far on `stream`.
    fn alloc(&mut self, size: usize, stream: usize) -> Result<usize, CUresult> {
        if size == 0 {
            return Err(INVALID_VALUE);
        }
        let rounded = size.checked_next_multiple_of(ALIGN).ok_or(OUT_OF_MEMORY)?;
        if self.used.saturating_add(rounded) > self.capacity {
            // Pending frees give their memory back when they run (those behind work that
            // waits outside the process do not).
            let r = self.run_everything();
            if r != SUCCESS && r != PENDING {
                return Err(r);
            }
            if self.used.saturating_add(rounded) > self.capacity {
                return Err(OUT_OF_MEMORY);
            }
        }
        let l = layout(rounded).ok_or(OUT_OF_MEMORY)?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc(l) };
        if p.is_null() {
            return Err(OUT_OF_MEMORY);
        }
        // Device memory starts as garbage, not zeros: a kernel or copy that reads memory
        // nobody wrote sees 0xff bytes (NaN as floats).
        if rounded <= 256 << 20 {
            // SAFETY: `rounded` bytes were just allocated.
            unsafe { std::ptr::write_bytes(p, 0xff, rounded) };
        }
        self.used += rounded;
        // A stream-ordered allocation is a point of its stream's order: work elsewhere must be
        // ordered after it (an event recorded before it is not enough).
        let born = if self.streams.contains_key(&stream) {
            let r = self.enqueue(stream, Op::Mark);
            if r != SUCCESS {
                return Err(r);
            }
            (stream, self.streams[&stream].last)
        } else {
            (stream, 0)
        };
        self.allocs.insert(
            p as usize,
            Alloc {
                size: rounded,
                freeing: false,
                born,
                uses: BTreeMap::new(),
            },
        );
        Ok(p as usize)
    }

    fn free_now(&mut self, p: usize) -> CUresult {
        let r = self.run_everything();
        if r != SUCCESS {
            return r;
        }
        let all: Vec<usize> = self.streams.keys().copied().collect();
        for s in all {
            self.observe_stream(s);
        }
        match self.allocs.get_mut(&p) {
            Some(al) if !al.freeing => {
                al.freeing = true;
                let r = self.enqueue(0, Op::Free { ptr: p });
                if r != SUCCESS {
                    return r;
                }
                self.run_all(0)
            }
            _ => INVALID_VALUE,
        }
    }

    /// A live (not destroyed) stream's id.
    fn stream_id(&self, s: *mut c_void) -> Option<usize> {
        let id = s as usize;
        self.streams
            .get(&id)
            .is_some_and(|st| !st.destroyed)
            .then_some(id)
    }

    fn event_complete(&self, e: &Event) -> bool {
        match e.mark {
            None => true,
            Some((s, seq)) => self.streams.get(&s).is_none_or(|st| st.done >= seq),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The driver's entry points. Each `unsafe extern "C"` one has the CUDA driver API's contract:
// its pointer arguments are valid for the reads and writes the API documents (an out-parameter
// for one value of its type, host ranges of the length given), which is what its body relies on
// when it dereferences them. Device addresses are checked against the live allocations.

/// Stores `v` through the out-parameter `p`, or answers `CUDA_ERROR_INVALID_VALUE` when it is
/// null.
unsafe fn put<T>(p: *mut T, v: T) -> CUresult {
    if p.is_null() {
        return INVALID_VALUE;
    }
    *p = v;
    SUCCESS
}

/// How many devices the driver shows: `TIDEMEM_EMU_DEVICES`, by default 4 (at least 1).
fn device_count() -> c_int {
    std::env::var("TIDEMEM_EMU_DEVICES")
        .ok()
        .and_then(|v| v.parse::<c_int>().ok())
        .unwrap_or(4)
        .max(1)
}

/// `f` for a device the driver shows; `CUDA_ERROR_INVALID_DEVICE` for any other.
fn on_device(dev: c_int, f: impl FnOnce() -> CUresult) -> CUresult {
    if !(0..device_count()).contains(&dev) {
        return INVALID_DEVICE;
    }
    f()
}

// Initialisation, devices, contexts.

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    state().get_or_insert_with(State::new);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    put(v, 13000)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    with(|_| put(n, device_count()))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> CUresult {
    with(|_| on_device(ordinal, || put(d, ordinal)))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    with(|_| {
        on_device(dev, || {
            if name.is_null() || len <= 0 {
                return INVALID_VALUE;
            }
            let text = b"tidemem CUDA emulator (CPU)";
            let n = text.len().min(len as usize - 1);
            std::ptr::copy_nonoverlapping(text.as_ptr(), name as *mut u8, n);
            *name.add(n) = 0;
            SUCCESS
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> CUresult {
    let value = match attr {
        1 => 1024,                    // max threads per block
        2 | 3 => 1024,                // max block dims x, y
        4 => 64,                      // max block dim z
        5 => i32::MAX,                // max grid dim x
        6 | 7 => 65535,               // max grid dims y, z
        8 => SHARED_PER_BLOCK,        // shared memory per block
        10 => 32,                     // warp size
        16 => 132,                    // multiprocessors
        41 => 1,                      // unified addressing
        75 => 9,                      // compute capability major
        76 => 0,                      // minor
        81 => SHARED_PER_SM,          // shared memory per multiprocessor
        97 => SHARED_PER_BLOCK_OPTIN, // shared memory per block, opted in
        115 => 1,                     // memory pools supported
        _ => 0,
    };
    with(|_| on_device(dev, || put(v, value)))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CUresult {
    with(|st| on_device(dev, || put(bytes, st.capacity)))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CUresult {
    with(|_| on_device(dev, || put(ctx, CTX as *mut c_void)))
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    with(|_| on_device(dev, || SUCCESS))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    with(|_| put(ctx, CURRENT.with(|c| c.get()) as *mut c_void))
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    with(|_| {
        let c = ctx as usize;
        if c != 0 && c != CTX {
            return INVALID_CONTEXT;
        }
        CURRENT.with(|cur| cur.set(c));
        SUCCESS
    })
}

fn need_ctx() -> CUresult {
    if CURRENT.with(|c| c.get()) == CTX {
        SUCCESS
    } else {
        INVALID_CONTEXT
    }
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    with_waiting(true, |st| st.synchronize())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    with_ctx(|st| {
        if free.is_null() {
            return INVALID_VALUE;
        }
        *free = st.capacity - st.used;
        put(total, st.capacity)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(e: CUresult, s: *mut *const c_char) -> CUresult {
    put(s, error_name(e).as_ptr())
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(e: CUresult, s: *mut *const c_char) -> CUresult {
    put(s, error_string(e).as_ptr())
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

const STREAM_NON_BLOCKING: c_uint = 1;

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(s: *mut *mut c_void, flags: c_uint) -> CUresult {
    with_ctx(|st| {
        if s.is_null() {
            return INVALID_VALUE;
        }
        if flags & STREAM_NON_BLOCKING == 0 {
            // Blocking streams synchronise with the legacy default stream; not emulated.
            return NOT_SUPPORTED;
        }
        let id = st.id();
        st.streams.insert(id, Stream::default());
        *s = id as *mut c_void;
        SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(s: *mut c_void) -> CUresult {
    with(|st| {
        let Some(id) = st.stream_id(s).filter(|&id| id != 0) else {
            return INVALID_HANDLE;
        };
        // Work already enqueued still completes, but nobody waited for it: it runs only when
        // something waits (an event it recorded, a context synchronisation).
        st.streams.get_mut(&id).expect("live").destroyed = true;
        SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(s: *mut c_void) -> CUresult {
    with_waiting(false, |st| match st.stream_id(s) {
        Some(id) => {
            let r = st.run_all(id);
            if r == SUCCESS {
                st.observe_stream(id);
            }
            r
        }
        None => INVALID_HANDLE,
    })
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(s: *mut c_void) -> CUresult {
    with(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        let stream = &st.streams[&id];
        if stream.done < stream.last {
            let last = stream.last;
            if st.stream_queried.get(&id) != Some(&last) {
                st.stream_queried.insert(id, last);
                return NOT_READY;
            }
            let r = st.run_all(id);
            if r != SUCCESS {
                return not_ready_if_pending(r);
            }
        }
        st.observe_stream(id);
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(e: *mut *mut c_void, _flags: c_uint) -> CUresult {
    with_ctx(|st| {
        if e.is_null() {
            return INVALID_VALUE;
        }
        let id = st.id();
        st.events.insert(id, Event::default());
        *e = id as *mut c_void;
        SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(e: *mut c_void) -> CUresult {
    with(|st| match st.events.remove(&(e as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecord(e: *mut c_void, s: *mut c_void) -> CUresult {
    with(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        let host = st.host.clone();
        let stream = st.streams.get_mut(&id).expect("live");
        merge(&mut stream.clock, &host);
        let (last, clock) = (stream.last, stream.clock.clone());
        match st.events.get_mut(&(e as usize)) {
            Some(ev) => {
                ev.mark = Some((id, last));
                ev.clock = clock;
                ev.queried = false;
                ev.at = Some(std::time::Instant::now());
                SUCCESS
            }
            None => INVALID_HANDLE,
        }
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(s: *mut c_void, e: *mut c_void, _flags: c_uint) -> CUresult {
    with(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        let Some(ev) = st.events.get(&(e as usize)).cloned() else {
            return INVALID_HANDLE;
        };
        let r = match ev.mark {
            Some((other, seq)) if other != id && !st.event_complete(&ev) => {
                st.enqueue(id, Op::Wait { stream: other, seq })
            }
            _ => SUCCESS,
        };
        // Everything before the record comes before what is enqueued here from now on.
        merge(&mut st.streams.get_mut(&id).expect("live").clock, &ev.clock);
        r
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(e: *mut c_void) -> CUresult {
    with_waiting(false, |st| {
        let Some(ev) = st.events.get(&(e as usize)).cloned() else {
            return INVALID_HANDLE;
        };
        let r = match ev.mark {
            Some((s, seq)) => st.run_until(s, seq),
            None => SUCCESS,
        };
        if r == SUCCESS {
            st.observe(&ev.clock);
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    a: *mut c_void,
    b: *mut c_void,
) -> CUresult {
    with(|st| {
        let (Some(a), Some(b)) = (st.events.get(&(a as usize)), st.events.get(&(b as usize)))
        else {
            return INVALID_HANDLE;
        };
        let (Some(ta), Some(tb)) = (a.at, b.at) else {
            return INVALID_HANDLE;
        };
        if !st.event_complete(a) || !st.event_complete(b) {
            return NOT_READY;
        }
        put(ms, tb.saturating_duration_since(ta).as_secs_f32() * 1e3)
    })
}

#[no_mangle]
pub extern "C" fn cuEventQuery(e: *mut c_void) -> CUresult {
    with(|st| {
        let Some(ev) = st.events.get(&(e as usize)).cloned() else {
            return INVALID_HANDLE;
        };
        if !st.event_complete(&ev) {
            let (s, seq) = ev.mark.expect("incomplete events are recorded");
            if !ev.queried {
                st.events.get_mut(&(e as usize)).expect("present").queried = true;
                return NOT_READY;
            }
            let r = st.run_until(s, seq);
            if r != SUCCESS {
                return not_ready_if_pending(r);
            }
        }
        st.observe(&ev.clock);
        SUCCESS
    })
}

// ---------------------------------------------------------------------------------------------
// Memory.

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut u64, size: usize) -> CUresult {
    // Not stream-ordered: usable anywhere at once.
    with_ctx(|st| alloc_into(st, p, size, usize::MAX))
}

/// Allocates `size` bytes ordered on `stream` into the out-parameter `p`.
unsafe fn alloc_into(st: &mut State, p: *mut u64, size: usize, stream: usize) -> CUresult {
    if p.is_null() {
        return INVALID_VALUE;
    }
    match st.alloc(size, stream) {
        Ok(a) => put(p, a as u64),
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(p: *mut u64, size: usize, s: *mut c_void) -> CUresult {
    with_ctx(|st| match st.stream_id(s) {
        Some(id) => alloc_into(st, p, size, id),
        None => INVALID_HANDLE,
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(p: u64) -> CUresult {
    with_waiting(true, |st| st.free_now(p as usize))
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(p: u64, s: *mut c_void) -> CUresult {
    with_ctx(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        match st.allocs.get_mut(&(p as usize)) {
            Some(al) if !al.freeing => {
                al.freeing = true;
                st.enqueue(id, Op::Free { ptr: p as usize })
            }
            _ => INVALID_VALUE,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    p: *mut *mut c_void,
    size: usize,
    _flags: c_uint,
) -> CUresult {
    with_ctx(|st| {
        if p.is_null() || size == 0 {
            return INVALID_VALUE;
        }
        // SAFETY: non-zero size.
        let Some(l) = layout(size) else {
            return OUT_OF_MEMORY;
        };
        let a = std::alloc::alloc(l);
        if a.is_null() {
            return OUT_OF_MEMORY;
        }
        st.pinned.insert(a as usize, size);
        *p = a as *mut c_void;
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(p: *mut *mut c_void, size: usize) -> CUresult {
    cuMemHostAlloc(p, size, 0)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    with_ctx(|st| {
        let a = p as usize;
        let Some(&size) = st.pinned.get(&a) else {
            return INVALID_VALUE;
        };
        for (&sid, s) in &st.streams {
            if s.queue.iter().any(|(_, op)| op.touches(a, a + size)) {
                let what = format!(
                    "pinned memory {a:#x} (+{size} bytes) freed while an operation pending on \
                     stream {sid:#x} uses it"
                );
                return st.fault(what);
            }
        }
        st.pinned.remove(&a);
        // SAFETY: allocated by cuMemHostAlloc with this layout; nothing pending uses it.
        if let Some(l) = layout(size) {
            std::alloc::dealloc(a as *mut u8, l);
        }
        SUCCESS
    })
}

fn check_dev(st: &State, p: u64, len: usize, what: &str) -> CUresult {
    if len == 0 || st.device_range(p as usize, len) {
        SUCCESS
    } else {
        eprintln!(
            "tidemem-cuda-emu: {what}: {len} bytes at {p:#x} are not inside one live allocation"
        );
        INVALID_VALUE
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    len: usize,
    s: *mut c_void,
) -> CUresult {
    with_ctx(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        let r = check_dev(st, dst, len, "host-to-device copy");
        if r != SUCCESS || len == 0 {
            return r;
        }
        if src.is_null() {
            return INVALID_VALUE;
        }
        let from = if st.is_pinned(src as usize, len) {
            Src::Addr(src as usize)
        } else {
            // SAFETY: the caller's `len` readable bytes at `src`.
            Src::Owned(std::slice::from_raw_parts(src as *const u8, len).to_vec())
        };
        st.enqueue(
            id,
            Op::Copy {
                dst: dst as usize,
                src: from,
                len,
            },
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    len: usize,
    s: *mut c_void,
) -> CUresult {
    let mut pageable = false;
    let r = with_ctx(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        let r = check_dev(st, src, len, "device-to-host copy");
        if r != SUCCESS || len == 0 {
            return r;
        }
        if dst.is_null() {
            return INVALID_VALUE;
        }
        let op = Op::Copy {
            dst: dst as usize,
            src: Src::Addr(src as usize),
            len,
        };
        pageable = !st.is_pinned(dst as usize, len);
        st.enqueue(id, op)
    });
    if r != SUCCESS || !pageable {
        return r;
    }
    // To pageable memory the copy is synchronous.
    cuStreamSynchronize(s)
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, len: usize, s: *mut c_void) -> CUresult {
    with_ctx(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        for (p, what) in [
            (dst, "device-to-device copy (to)"),
            (src, "device-to-device copy (from)"),
        ] {
            let r = check_dev(st, p, len, what);
            if r != SUCCESS {
                return r;
            }
        }
        if len == 0 {
            return SUCCESS;
        }
        st.enqueue(
            id,
            Op::Copy {
                dst: dst as usize,
                src: Src::Addr(src as usize),
                len,
            },
        )
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: u64, value: u8, len: usize, s: *mut c_void) -> CUresult {
    with_ctx(|st| {
        let Some(id) = st.stream_id(s) else {
            return INVALID_HANDLE;
        };
        let r = check_dev(st, dst, len, "memset");
        if r != SUCCESS || len == 0 {
            return r;
        }
        st.enqueue(
            id,
            Op::Memset {
                dst: dst as usize,
                value,
                len,
            },
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> CUresult {
    let r = cuMemcpyHtoDAsync_v2(dst, src, len, std::ptr::null_mut());
    if r != SUCCESS {
        return r;
    }
    cuCtxSynchronize()
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> CUresult {
    let r = with_waiting(false, |st| st.run_everything());
    if r != SUCCESS {
        return r;
    }
    let r = cuMemcpyDtoHAsync_v2(dst, src, len, std::ptr::null_mut());
    if r != SUCCESS {
        return r;
    }
    cuCtxSynchronize()
}

extern "C" {
    fn emu_f32_to_f16(x: f32) -> u16;
    fn emu_f16_to_f32(x: u16) -> f32;
    fn emu_f32_to_bf16(x: f32) -> u16;
    fn emu_bf16_to_f32(x: u16) -> f32;
}

/// The host shim's fp32 → fp16 conversion (`shim/cuda_fp16.h`), exposed for tests.
pub fn shim_f32_to_f16(x: f32) -> u16 {
    // SAFETY: a pure function of its argument.
    unsafe { emu_f32_to_f16(x) }
}

/// The host shim's fp16 → fp32 conversion.
pub fn shim_f16_to_f32(x: u16) -> f32 {
    // SAFETY: a pure function of its argument.
    unsafe { emu_f16_to_f32(x) }
}

/// The host shim's fp32 → bf16 conversion (`shim/cuda_bf16.h`).
pub fn shim_f32_to_bf16(x: f32) -> u16 {
    // SAFETY: a pure function of its argument.
    unsafe { emu_f32_to_bf16(x) }
}

/// The host shim's bf16 → fp32 conversion.
pub fn shim_bf16_to_f32(x: u16) -> f32 {
    // SAFETY: a pure function of its argument.
    unsafe { emu_bf16_to_f32(x) }
}
