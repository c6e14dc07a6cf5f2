//! The NCCL stand-in: collectives run in stream order, ranks meet across threads (and, in
//! tidemem's suites, processes), and a peer that aborts or never comes is an error or a stream
//! that is not ready, never a hang.
mod common;

use std::ffi::c_void;
use std::ptr::null_mut;

use common::*;
use tidemem_cuda_emu::*;

const F32: i32 = 7;
const SUM: i32 = 0;

fn unique_id() -> ncclUniqueId {
    let mut id = ncclUniqueId { internal: [0; 128] };
    unsafe { assert_eq!(ncclGetUniqueId(&mut id), 0) };
    id
}

/// Runs `f(rank)` for every rank of `world` on threads of their own, each with the context
/// current and a blocking communicator of one id, destroyed afterwards unless `f` ended it
/// (and set it null).
fn on_ranks<R: Send>(world: usize, f: impl Fn(usize, &mut ncclComm_t, &Ctx) -> R + Sync) -> Vec<R> {
    let id = unique_id();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let ctx = setup();
                    let mut c = null_mut();
                    unsafe {
                        assert_eq!(ncclCommInitRank(&mut c, world as i32, id, r as i32), 0);
                    }
                    let out = f(r, &mut c, &ctx);
                    if !c.is_null() {
                        unsafe { assert_eq!(ncclCommDestroy(c), 0) };
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn alloc(bytes: usize) -> u64 {
    let mut d = 0u64;
    unsafe { ok(cuMemAlloc_v2(&mut d, bytes)) };
    d
}

/// Rank r's input: (r + 1) · i, written into fresh device memory `x` on `stream` from pinned
/// memory, a copy that runs only when something waits for `stream`.
fn write_input(r: usize, n: usize, x: u64, stream: *mut c_void) {
    let h = pinned(n * 4) as *mut f32;
    for i in 0..n {
        unsafe { *h.add(i) = ((r + 1) * i) as f32 };
    }
    unsafe { ok(cuMemcpyHtoDAsync_v2(x, h as *const c_void, n * 4, stream)) };
}

#[test]
fn a_collective_reads_its_input_in_stream_order() {
    let _g = serial();
    let n = 64;
    let got = on_ranks(2, |r, &mut c, ctx| {
        let mut out = Vec::new();
        for wait in [false, true] {
            let (x, y) = (alloc(n * 4), alloc(n * 4));
            write_input(r, n, x, ctx.other);
            if wait {
                let mut e = null_mut();
                unsafe { ok(cuEventCreate(&mut e, 0)) };
                ok(cuEventRecord(e, ctx.other));
                ok(cuStreamWaitEvent(ctx.stream, e, 0));
            }
            let r = unsafe {
                ncclAllReduce(
                    x as *const c_void,
                    y as *mut c_void,
                    n,
                    F32,
                    SUM,
                    c,
                    ctx.stream,
                )
            };
            assert_eq!(r, 0);
            ok(cuStreamSynchronize(ctx.stream));
            out.push(download::<f32>(y, n, ctx.stream));
            ok(cuStreamSynchronize(ctx.other));
        }
        out
    });
    for per_rank in got {
        // without the wait the copy had not run: the all-reduce summed fresh (NaN) memory
        assert!(per_rank[0].iter().all(|v| v.is_nan()), "{:?}", per_rank[0]);
        let want: Vec<f32> = (0..n).map(|i| (3 * i) as f32).collect();
        assert_eq!(per_rank[1], want);
    }
}

#[test]
fn gathers_broadcasts_and_messages_between_ranks() {
    let _g = serial();
    let n = 5;
    let got = on_ranks(3, |r, &mut c, ctx| {
        let s = ctx.stream;
        let mine: Vec<i32> = (0..n).map(|i| (10 * r + i) as i32).collect();
        let x = upload(&mine, s);
        let all = alloc(3 * n * 4);
        let (next, prev) = ((r + 1) % 3, (r + 2) % 3);
        let from_prev = alloc(n * 4);
        unsafe {
            assert_eq!(ncclAllGather(x as _, all as _, n, 2, c, s), 0);
            assert_eq!(ncclBroadcast(x as _, x as _, n, 2, 1, c, s), 0);
            // every rank sends before it receives: only a send that does not wait allows it
            assert_eq!(ncclGroupStart(), 0);
            assert_eq!(ncclSend(all as _, n, 2, next as i32, c, s), 0);
            assert_eq!(ncclRecv(from_prev as _, n, 2, prev as i32, c, s), 0);
            assert_eq!(ncclGroupEnd(), 0);
        }
        ok(cuStreamSynchronize(s));
        (
            download::<i32>(all, 3 * n, s),
            download::<i32>(x, n, s),
            download::<i32>(from_prev, n, s),
        )
    });
    let every: Vec<i32> = (0..3)
        .flat_map(|r| (0..n).map(move |i| (10 * r + i) as i32))
        .collect();
    for (all, bcast, msg) in got {
        assert_eq!(all, every);
        assert_eq!(bcast, every[n..2 * n]);
        assert_eq!(msg, every[..n], "the first n of the sender's gather");
    }
}

#[test]
fn a_peer_that_aborts_is_a_remote_error_and_a_missing_one_leaves_the_stream_not_ready() {
    let _g = serial();
    let n = 4;
    let barrier = std::sync::Barrier::new(2);
    on_ranks(2, |r, c, ctx| {
        if r == 1 {
            // rank 0 never comes to this collective
            let x = upload(&[1.0f32; 4], ctx.stream);
            unsafe {
                assert_eq!(
                    ncclAllReduce(x as _, x as _, n, F32, SUM, *c, ctx.stream),
                    0
                );
            }
            for _ in 0..3 {
                assert_eq!(cuStreamQuery(ctx.stream), 600, "CUDA_ERROR_NOT_READY");
            }
        }
        barrier.wait();
        if r == 0 {
            unsafe { assert_eq!(ncclCommAbort(*c), 0) };
            *c = null_mut();
        }
        barrier.wait();
        if r == 1 {
            let mut state = 0;
            unsafe { assert_eq!(ncclCommGetAsyncError(*c, &mut state), 0) };
            assert_eq!(state, 6, "ncclRemoteError");
            // a failed communicator's collectives end without computing: the stream goes on
            ok(cuStreamSynchronize(ctx.stream));
        }
        barrier.wait();
    });
}
