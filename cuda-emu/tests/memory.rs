//! Atomics and dynamic shared memory of the emulator (test kernels in tests/kernels/memory.cu).
use std::ffi::c_void;
use std::ptr::null_mut;

mod common;
use common::*;
use tidemem_cuda_emu::*;

/// `EmuTestAtomics` of memory.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Atomics {
    counter: u32,
    imin: i32,
    imax: i32,
    umin: u32,
    umax: u32,
    ullmax: u64,
    ullmin: u64,
    ullsum: u64,
    fsum: f32,
    dsum: f64,
    icas: i32,
    ucas: u32,
    ullcas: u64,
    scas: [u16; 2],
    exch: u32,
    isum: i32,
}

#[test]
fn atomics_return_the_old_value_and_add_up_across_blocks() {
    let _g = serial();
    let c = setup();
    let (grid, threads) = (5u32, 96u32);
    let n = (grid * threads) as usize;
    let init = Atomics {
        imin: i32::MAX,
        imax: i32::MIN,
        umin: u32::MAX,
        ullmin: u64::MAX,
        exch: 0xdead,
        ..Default::default()
    };
    let da = upload(&[init], c.stream);
    let dt = upload(&vec![0u32; n], c.stream);
    let de = upload(&vec![0u32; n], c.stream);
    let (mut a, mut t, mut e) = (da, dt, de);
    let f = kernel("emu_test_atomics");
    ok(launch(
        f,
        grid,
        [threads, 1, 1],
        0,
        c.stream,
        &mut [arg(&mut a), arg(&mut t), arg(&mut e)],
    ));
    let got: Atomics = download(da, 1, c.stream)[0];
    let g_sum = (n * (n - 1) / 2) as u64;
    let last = got.exch;
    assert_eq!(
        got,
        Atomics {
            counter: n as u32,
            imin: -100,
            imax: n as i32 - 101,
            umin: 7,
            umax: n as u32 + 6,
            ullmax: (n as u64 - 1) << 40,
            ullmin: 1 << 40,
            ullsum: g_sum << 32,
            fsum: g_sum as f32,
            dsum: 0.25 * g_sum as f64,
            icas: 2 * n as i32,
            ucas: 3 * n as u32,
            ullcas: 5 * n as u64,
            scas: [n as u16, 0],
            exch: last,
            isum: -(g_sum as i32),
        }
    );
    // Every ticket is handed out once; each exchange saw the value the previous one stored.
    let mut tickets: Vec<u32> = download(dt, n, c.stream);
    tickets.sort_unstable();
    assert_eq!(tickets, (0..n as u32).collect::<Vec<_>>());
    let mut seen: Vec<u32> = download(de, n, c.stream);
    seen.push(last);
    seen.sort_unstable();
    let mut want: Vec<u32> = (0..n as u32).collect();
    want.push(0xdead);
    assert_eq!(seen, want);
    for p in [da, dt, de] {
        ok(cuMemFreeAsync(p, c.stream));
    }
    ok(cuStreamSynchronize(c.stream));
}

#[test]
fn every_other_launch_runs_its_blocks_in_reverse() {
    let _g = serial();
    let c = setup();
    let f = kernel("emu_test_block_order");
    let grid = 9usize;
    let dc = upload(&[0u32], c.stream);
    let mut orders = Vec::new();
    for _ in 0..2 {
        let dout = upload(&vec![0u32; grid], c.stream);
        let (mut a, mut b) = (dc, dout);
        ok(launch(
            f,
            grid as u32,
            [32, 1, 1],
            0,
            c.stream,
            &mut [arg(&mut a), arg(&mut b)],
        ));
        orders.push(download::<u32>(dout, grid, c.stream));
        ok(cuMemFreeAsync(dout, c.stream));
    }
    let up: Vec<u32> = (0..grid as u32).collect();
    let down: Vec<u32> = up.iter().rev().copied().collect();
    let second = |v: &[u32]| v.iter().map(|x| x + grid as u32).collect::<Vec<_>>();
    assert!(
        (orders[0] == up && orders[1] == second(&down))
            || (orders[0] == down && orders[1] == second(&up)),
        "{orders:?}"
    );
    ok(cuMemFreeAsync(dc, c.stream));
    ok(cuStreamSynchronize(c.stream));
}

/// Launches `emu_test_dynamic_shared` on `grid` blocks of `threads` with `words` words of
/// dynamic shared memory; returns the launch's result, and (when it was enqueued and pokes
/// nothing) before, after, last.
fn dynamic_shared(c: &Ctx, grid: u32, threads: u32, words: u32, poke: u32) -> (i32, [Vec<u32>; 3]) {
    let n = (grid * threads) as usize;
    let bufs = [n, n, grid as usize].map(|len| upload(&vec![7u32; len], c.stream));
    let (mut b, mut a, mut l, mut w, mut p) = (bufs[0], bufs[1], bufs[2], words, poke);
    let r = launch(
        kernel("emu_test_dynamic_shared"),
        grid,
        [threads, 1, 1],
        words * 4,
        c.stream,
        &mut [
            arg(&mut b),
            arg(&mut a),
            arg(&mut l),
            arg(&mut w),
            arg(&mut p),
        ],
    );
    if poke != !0 {
        return (r, Default::default());
    }
    let out = if r == 0 {
        [n, n, grid as usize]
            .iter()
            .zip(bufs)
            .map(|(&len, d)| download(d, len, c.stream))
            .collect::<Vec<_>>()
    } else {
        vec![Vec::new(); 3]
    };
    for d in bufs {
        ok(cuMemFreeAsync(d, c.stream));
    }
    (r, out.try_into().unwrap())
}

#[test]
fn dynamic_shared_memory_is_sized_at_launch_and_starts_as_0xff_in_every_block() {
    let _g = serial();
    let c = setup();
    let (grid, threads) = (3u32, 64u32);
    for words in [100u32, 64, 12 * 1024, 1029] {
        let (r, [before, after, last]) = dynamic_shared(&c, grid, threads, words, !0);
        ok(r);
        assert!(before.iter().all(|&w| w == u32::MAX), "{words} words");
        for b in 0..grid {
            for t in 0..threads {
                let want = 1000 * b + threads - 1 - t;
                assert_eq!(after[(b * threads + t) as usize], want);
            }
        }
        let want = if words > threads {
            u32::MAX
        } else {
            1000 * 2 + words - 1
        };
        assert_eq!(last[2], want, "{words} words");
    }
    ok(cuStreamSynchronize(c.stream));
}

#[test]
fn dynamic_shared_memory_is_capped_at_48_kib_unless_the_function_opts_in() {
    let _g = serial();
    let c = setup();
    let f = kernel("emu_test_dynamic_shared");
    let attr = |a: i32| {
        let mut v = 0;
        unsafe { ok(cuFuncGetAttribute(&mut v, a, f)) };
        v
    };
    let dev = |a: i32| {
        let mut v = 0;
        unsafe { ok(cuDeviceGetAttribute(&mut v, a, 0)) };
        v
    };
    assert_eq!(dev(8), 48 * 1024);
    assert_eq!(dev(97), 227 * 1024);
    assert_eq!(attr(8), 48 * 1024);
    // Over the cap: refused at the launch, which enqueues nothing (no fault).
    let (r, _) = dynamic_shared(&c, 1, 32, 12 * 1024 + 1, !0);
    assert_eq!(r, 1);
    assert_eq!(cuFuncSetAttribute(f, 8, 227 * 1024 + 1), 1);
    assert_eq!(cuFuncSetAttribute(f, 0, 512), 1, "read-only");
    ok(cuFuncSetAttribute(f, 8, 100 * 1024));
    assert_eq!(attr(8), 100 * 1024);
    let (r, [_, _, last]) = dynamic_shared(&c, 2, 32, 25 * 1024, !0);
    ok(r);
    assert_eq!(last, vec![u32::MAX; 2]);
    let (r, _) = dynamic_shared(&c, 1, 32, 25 * 1024 + 1, !0);
    assert_eq!(r, 1);
    ok(cuFuncSetAttribute(f, 8, 227 * 1024));
    let (r, [_, _, last]) = dynamic_shared(&c, 2, 32, 227 * 256, !0);
    ok(r);
    assert_eq!(last, vec![u32::MAX; 2]);
    ok(cuFuncSetAttribute(f, 8, 48 * 1024));
    ok(cuStreamSynchronize(c.stream));
}

#[test]
fn a_write_just_past_the_dynamic_shared_memory_is_a_fault() {
    faults_in_child(
        "a_write_just_past_the_dynamic_shared_memory_is_a_fault",
        "wrote byte 400 of dynamic shared memory, past the launch's 400 bytes",
        || {
            let c = setup();
            let (r, _) = dynamic_shared(&c, 2, 64, 100, 100);
            ok(r);
            assert_eq!(cuStreamSynchronize(c.stream), 700);
        },
    );
}

#[test]
fn a_write_pages_past_the_dynamic_shared_memory_is_a_fault() {
    faults_in_child(
        "a_write_pages_past_the_dynamic_shared_memory_is_a_fault",
        "accessed byte 40000 of dynamic shared memory, past the launch's 400 bytes",
        || {
            let c = setup();
            let (r, _) = dynamic_shared(&c, 2, 64, 100, 10_000);
            ok(r);
            assert_eq!(cuStreamSynchronize(c.stream), 700);
        },
    );
}

/// Reads word `at` of `shared` bytes of dynamic shared memory, expecting a fault.
fn read_dynamic(shared: u32, at: u64) {
    let c = setup();
    let d = upload(&[0u32], c.stream);
    let (mut a, mut w) = (d, at);
    ok(launch(
        kernel("emu_test_dynamic_read"),
        1,
        [1, 1, 1],
        shared,
        c.stream,
        &mut [arg(&mut a), arg(&mut w)],
    ));
    assert_eq!(cuStreamSynchronize(c.stream), 700);
    let mut x = 0u32;
    let r = unsafe { cuMemcpyDtoH_v2(&mut x as *mut u32 as *mut c_void, d, 4) };
    assert_eq!(r, 700, "the fault poisons every call");
}

#[test]
fn a_read_past_the_dynamic_shared_memory_is_a_fault() {
    faults_in_child(
        "a_read_past_the_dynamic_shared_memory_is_a_fault",
        "accessed byte 8192 of dynamic shared memory, past the launch's 4096 bytes",
        || read_dynamic(4096, 2048),
    );
}

#[test]
fn a_read_before_the_dynamic_shared_memory_is_a_fault() {
    faults_in_child(
        "a_read_before_the_dynamic_shared_memory_is_a_fault",
        "4 bytes before its start",
        || read_dynamic(256, u64::MAX),
    );
}

#[test]
fn dynamic_shared_memory_with_none_at_launch_is_a_fault() {
    faults_in_child(
        "dynamic_shared_memory_with_none_at_launch_is_a_fault",
        "accessed byte 0 of dynamic shared memory, past the launch's 0 bytes",
        || read_dynamic(0, 0),
    );
}

#[test]
fn launch_parameters_through_extra_are_not_supported() {
    let _g = serial();
    let c = setup();
    let f = kernel("emu_test_dynamic_read");
    let mut extra = [null_mut::<c_void>()];
    let r = unsafe {
        cuLaunchKernel(
            f,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            c.stream,
            null_mut(),
            extra.as_mut_ptr(),
        )
    };
    assert_eq!(r, 801);
}

#[test]
fn a_kernel_thread_overflowing_its_stack_is_a_fault() {
    faults_in_child(
        "a_kernel_thread_overflowing_its_stack_is_a_fault",
        "thread 0 overflowed its 64 KiB stack",
        || {
            let c = setup();
            let d = upload(&[0u32], c.stream);
            let (mut a, mut n) = (d, 100_000u32);
            let f = kernel("emu_test_recurse");
            ok(launch(
                f,
                1,
                [4, 1, 1],
                0,
                c.stream,
                &mut [arg(&mut a), arg(&mut n)],
            ));
            assert_eq!(cuStreamSynchronize(c.stream), 700);
        },
    );
}
