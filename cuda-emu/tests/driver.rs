//! The emulator's own checks: the fp16/bf16 shims against the `half` crate, and the driver's
//! stream semantics (work runs only when waited for), range checks and faults.
use std::ffi::c_void;
use std::ptr::null_mut;

use tidemem_cuda_emu::*;

mod common;
use common::{faults_in_child, ok, pinned, setup, SERIAL};

#[test]
fn fp16_and_bf16_shims_round_like_the_gpu() {
    let (to16, from16, tob, fromb) = (
        shim_f32_to_f16,
        shim_f16_to_f32,
        shim_f32_to_bf16,
        shim_bf16_to_f32,
    );
    for bits in 0..=u16::MAX {
        let h = half::f16::from_bits(bits);
        let f = from16(bits);
        if h.is_nan() {
            assert!(f.is_nan());
        } else {
            assert_eq!(f.to_bits(), h.to_f32().to_bits(), "f16 {bits:#06x}");
        }
        let b = half::bf16::from_bits(bits);
        let f = fromb(bits);
        if b.is_nan() {
            assert!(f.is_nan());
        } else {
            assert_eq!(f.to_bits(), b.to_f32().to_bits(), "bf16 {bits:#06x}");
        }
    }
    // Every 97th f32 bit pattern, plus the neighbourhoods of every f16 and bf16 rounding
    // boundary region: round to nearest even, NaN to the canonical 0x7fff.
    let check = |u: u32| {
        let x = f32::from_bits(u);
        if x.is_nan() {
            assert_eq!(to16(x), 0x7fff);
            assert_eq!(tob(x), 0x7fff);
        } else {
            assert_eq!(
                to16(x),
                half::f16::from_f32(x).to_bits(),
                "f32 {u:#010x} to f16"
            );
            assert_eq!(
                tob(x),
                half::bf16::from_f32(x).to_bits(),
                "f32 {u:#010x} to bf16"
            );
        }
    };
    for u in (0..=u32::MAX).step_by(97) {
        check(u);
    }
    for hi in 0..=u16::MAX as u32 {
        for lo in [
            0u32, 1, 0x0fff, 0x1000, 0x1001, 0x7fff, 0x8000, 0x8001, 0xffff,
        ] {
            check((hi << 16) | lo);
        }
    }
}

#[test]
fn work_runs_only_when_waited_for() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let c = setup();
    unsafe {
        let mut d = 0u64;
        ok(cuMemAllocAsync(&mut d, 64, c.stream));
        let host = [7u8; 64];
        ok(cuMemcpyHtoDAsync_v2(
            d,
            host.as_ptr() as *const c_void,
            64,
            c.stream,
        ));
        let out = pinned(64);
        std::ptr::write_bytes(out, 0, 64);
        ok(cuMemcpyDtoHAsync_v2(out as *mut c_void, d, 64, c.stream));
        // Not waited for: nothing has run.
        assert_eq!(*out, 0);
        let mut e = null_mut();
        ok(cuEventCreate(&mut e, 2));
        ok(cuEventRecord(e, c.stream));
        assert_eq!(cuEventQuery(e), 600, "first query: not ready");
        // A wait on another stream, then a sync of that stream, runs the first stream's work.
        ok(cuStreamWaitEvent(c.other, e, 0));
        ok(cuStreamSynchronize(c.other));
        assert_eq!(*out, 7);
        ok(cuEventQuery(e));
        ok(cuMemFreeAsync(d, c.stream));
        ok(cuStreamSynchronize(c.stream));
        ok(cuEventDestroy_v2(e));
        ok(cuMemFreeHost(out as *mut c_void));
    }
}

#[test]
fn copies_outside_an_allocation_are_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let c = setup();
    unsafe {
        let mut d = 0u64;
        ok(cuMemAllocAsync(&mut d, 100, c.stream));
        let host = [0u8; 300];
        // Allocations are rounded to 256 bytes; past that is outside.
        assert_eq!(
            cuMemcpyHtoDAsync_v2(d + 200, host.as_ptr() as *const c_void, 100, c.stream),
            1
        );
        assert_eq!(cuMemsetD8Async(d + 1, 0, 256, c.stream), 1);
        assert_eq!(cuMemcpyDtoDAsync_v2(d, d + 1000, 8, c.stream), 1);
        ok(cuMemFreeAsync(d, c.stream));
        // Freed (in stream order): no new work may use it.
        assert_eq!(cuMemsetD8Async(d, 0, 8, c.stream), 1);
        ok(cuStreamSynchronize(c.stream));
    }
}

#[test]
fn the_barrier_kernel_reduces_like_the_gpu() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let c = setup();
    assert!(kernel_names().contains(&"grad_stats_final"));
    unsafe {
        // A PTX image naming the kernel stands in for NVRTC's output.
        let ptx = c".version 8.0\n.target sm_90\n.visible .entry grad_stats_final(\n)\n";
        let mut m = null_mut();
        ok(cuModuleLoadData(&mut m, ptx.as_ptr() as *const c_void));
        let mut f = std::ptr::null();
        ok(cuModuleGetFunction(&mut f, m, c"grad_stats_final".as_ptr()));
        let mut missing = std::ptr::null();
        assert_eq!(
            cuModuleGetFunction(&mut missing, m, c"cast_f32_f16".as_ptr()),
            500
        );
        // 256 partial (sum, flag) pairs after two result slots; partial i sums to i.
        let mut host = vec![0f64; 2 + 2 * 256];
        for i in 0..256 {
            host[2 + 2 * i] = i as f64;
        }
        host[3 + 2 * 77] = 1.0;
        let bytes = host.len() * 8;
        let mut d = 0u64;
        ok(cuMemAllocAsync(&mut d, bytes, c.stream));
        ok(cuMemcpyHtoDAsync_v2(
            d,
            host.as_ptr() as *const c_void,
            bytes,
            c.stream,
        ));
        // grad_stats_final(const void* src, double* out, GradStatsParams { n })
        let (mut src, mut arg, mut n) = (0u64, d, 0u64);
        let mut params = [
            &mut src as *mut u64 as *mut c_void,
            &mut arg as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
        ];
        ok(cuLaunchKernel(
            f,
            1,
            1,
            1,
            256,
            1,
            1,
            0,
            c.stream,
            params.as_mut_ptr(),
            null_mut(),
        ));
        arg = 0; // the launch copied the value
        let _ = arg;
        let mut out = vec![0f64; 2];
        ok(cuMemcpyDtoHAsync_v2(
            out.as_mut_ptr() as *mut c_void,
            d,
            16,
            c.stream,
        ));
        assert_eq!(out, vec![(255 * 256 / 2) as f64, 1.0]);
        ok(cuMemFreeAsync(d, c.stream));
        ok(cuStreamSynchronize(c.stream));
        ok(cuModuleUnload(m));
    }
}

/// `grad_stats_final` from a PTX image naming it (standing in for NVRTC's output).
unsafe fn grad_stats_final() -> *const EmuKernel {
    let ptx = c".version 8.0\n.target sm_90\n.visible .entry grad_stats_final(\n)\n";
    let mut m = null_mut();
    ok(cuModuleLoadData(&mut m, ptx.as_ptr() as *const c_void));
    let mut f = std::ptr::null();
    ok(cuModuleGetFunction(&mut f, m, c"grad_stats_final".as_ptr()));
    f
}

#[test]
fn an_unordered_free_is_a_fault_whatever_the_host_syncs_first() {
    faults_in_child(
        "an_unordered_free_is_a_fault_whatever_the_host_syncs_first",
        "not ordered before the free",
        || {
            let c = setup();
            unsafe {
                let mut d = 0u64;
                ok(cuMemAllocAsync(&mut d, 64, c.stream));
                ok(cuStreamSynchronize(c.stream));
                let out = pinned(64);
                ok(cuMemcpyDtoHAsync_v2(out as *mut c_void, d, 64, c.other));
                // The copy on `other` has run (the host synced it) but nothing orders it before
                // a free on `stream`: the host saw it finish, so the free is fine...
                ok(cuStreamSynchronize(c.other));
                ok(cuMemFreeAsync(d, c.stream));
                ok(cuStreamSynchronize(c.stream));
                // ...while here nothing does.
                let mut e = 0u64;
                ok(cuMemAllocAsync(&mut e, 64, c.stream));
                ok(cuStreamSynchronize(c.stream));
                ok(cuMemcpyDtoHAsync_v2(out as *mut c_void, e, 64, c.other));
                assert_eq!(cuMemFreeAsync(e, c.stream), 700);
                assert_eq!(
                    cuStreamSynchronize(c.other),
                    700,
                    "the fault poisons every call"
                );
            }
        },
    );
}

#[test]
fn memory_used_before_its_allocation_is_ordered_is_a_fault() {
    faults_in_child(
        "memory_used_before_its_allocation_is_ordered_is_a_fault",
        "without waiting for its allocation",
        || {
            let c = setup();
            unsafe {
                let host = [1u8; 64];
                let mut d = 0u64;
                // Work on the allocating stream first: a block freed there could be reused.
                let mut x = 0u64;
                ok(cuMemAllocAsync(&mut x, 64, c.stream));
                ok(cuMemsetD8Async(x, 0, 64, c.stream));
                ok(cuMemAllocAsync(&mut d, 64, c.stream));
                // An event recorded before the allocation orders nothing after it.
                let mut e = null_mut();
                ok(cuEventCreate(&mut e, 2));
                ok(cuEventRecord(e, c.stream));
                let mut y = 0u64;
                ok(cuMemAllocAsync(&mut y, 64, c.stream));
                ok(cuStreamWaitEvent(c.other, e, 0));
                // `d` was allocated before the record: ordered, no fault.
                ok(cuMemsetD8Async(d, 1, 64, c.other));
                let r = cuMemcpyHtoDAsync_v2(y, host.as_ptr() as *const c_void, 64, c.other);
                assert_eq!(r, 700);
            }
        },
    );
}

#[test]
fn a_kernel_pointer_outside_every_allocation_is_a_fault() {
    faults_in_child(
        "a_kernel_pointer_outside_every_allocation_is_a_fault",
        "not inside a live device allocation",
        || {
            let c = setup();
            unsafe {
                let f = grad_stats_final();
                let mut d = 0u64;
                ok(cuMemAllocAsync(&mut d, 4096, c.stream));
                ok(cuMemFreeAsync(d, c.stream));
                // grad_stats_final(const void* src, double* out, GradStatsParams { n }): the
                // source is not read; `out` points into freed memory.
                let (mut src, mut out, mut n) = (0u64, d, 0u64);
                let mut params = [
                    &mut src as *mut u64 as *mut c_void,
                    &mut out as *mut u64 as *mut c_void,
                    &mut n as *mut u64 as *mut c_void,
                ];
                let r = cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    c.stream,
                    params.as_mut_ptr(),
                    null_mut(),
                );
                assert_eq!(r, 700);
            }
        },
    );
}

#[test]
fn pending_frees_make_room_and_destroyed_streams_run_only_when_waited_for() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let c = setup();
    unsafe {
        let mut total = 0usize;
        let mut free = 0usize;
        ok(cuMemGetInfo_v2(&mut free, &mut total));
        // Allocate and free (in stream order, never synchronised) more than the device holds.
        let chunk = total / 3;
        for _ in 0..7 {
            let mut d = 0u64;
            ok(cuMemAllocAsync(&mut d, chunk, c.stream));
            ok(cuMemFreeAsync(d, c.stream));
        }
        ok(cuStreamSynchronize(c.stream));
        // Work left on a destroyed stream runs when its event is waited for, not before.
        let (mut s, mut e) = (null_mut(), null_mut());
        ok(cuStreamCreate(&mut s, 1));
        ok(cuEventCreate(&mut e, 2));
        let mut d = 0u64;
        ok(cuMemAllocAsync(&mut d, 64, s));
        let host = [9u8; 64];
        ok(cuMemcpyHtoDAsync_v2(
            d,
            host.as_ptr() as *const c_void,
            64,
            s,
        ));
        let out = pinned(64);
        std::ptr::write_bytes(out, 0, 64);
        ok(cuMemcpyDtoHAsync_v2(out as *mut c_void, d, 64, s));
        ok(cuEventRecord(e, s));
        ok(cuStreamDestroy_v2(s));
        assert_eq!(*out, 0);
        assert_eq!(
            cuStreamSynchronize(s),
            400,
            "a destroyed stream is no handle"
        );
        ok(cuEventSynchronize(e));
        assert_eq!(*out, 9);
        ok(cuMemFreeAsync(d, c.stream));
        ok(cuStreamSynchronize(c.stream));
        ok(cuMemFreeHost(out as *mut c_void));
    }
}
