//! Warp operations of the emulator (test kernels in tests/kernels/warp.cu): shuffles and votes
//! give what a GPU gives, and masks or call sequences CUDA leaves undefined are faults.
use std::ffi::c_void;

mod common;
use common::*;
use tidemem_cuda_emu::*;

#[test]
fn a_block_reduction_with_shuffles_and_dynamic_shared_memory_is_exact() {
    let _g = serial();
    let c = setup();
    let n = 100_003usize;
    let x: Vec<f64> = (0..n).map(|i| i as f64).collect();
    let f = kernel("emu_test_block_sum");
    for (grid, threads) in [(7u32, 256u32), (3, 1024), (1, 32)] {
        let dx = upload(&x, c.stream);
        let dout = upload(&vec![0f64; grid as usize], c.stream);
        let (mut a, mut b, mut m) = (dx, dout, n as u64);
        let warps = threads / 32;
        ok(launch(
            f,
            grid,
            [threads, 1, 1],
            warps * 8,
            c.stream,
            &mut [arg(&mut a), arg(&mut b), arg(&mut m)],
        ));
        let got: Vec<f64> = download(dout, grid as usize, c.stream);
        let stride = (grid * threads) as usize;
        for (blk, &s) in got.iter().enumerate() {
            let want: f64 = (0..n)
                .filter(|i| (i % stride) / threads as usize == blk)
                .map(|i| i as f64)
                .sum();
            assert_eq!(s, want, "grid {grid} x {threads}, block {blk}");
        }
        ok(cuMemFreeAsync(dx, c.stream));
        ok(cuMemFreeAsync(dout, c.stream));
    }
    ok(cuStreamSynchronize(c.stream));
}

#[test]
fn shuffles_and_votes_follow_the_ptx_rules() {
    let _g = serial();
    let c = setup();
    let f = kernel("emu_test_warp_ops");
    let threads = 64usize; // two warps, as a 32 x 2 block: lanes follow the linear thread index
    let dout = upload(&vec![0i32; threads * 16], c.stream);
    let dfout = upload(&vec![0f32; threads], c.stream);
    let dlout = upload(&vec![0i64; threads], c.stream);
    let (mut a, mut b, mut d) = (dout, dfout, dlout);
    ok(launch(
        f,
        1,
        [32, 2, 1],
        0,
        c.stream,
        &mut [arg(&mut a), arg(&mut b), arg(&mut d)],
    ));
    let out: Vec<i32> = download(dout, threads * 16, c.stream);
    let fout: Vec<f32> = download(dfout, threads, c.stream);
    let lout: Vec<i64> = download(dlout, threads, c.stream);
    let v = |t: usize| 100 + t as i32;
    let third: u32 = (0..32).filter(|l| l % 3 == 0).map(|l| 1u32 << l).sum();
    for t in 0..threads {
        let (l, base) = (t % 32, t - t % 32);
        let want = [
            v(base + (l & !7) + 3),                      // __shfl_sync(.., 3, 8)
            v(base + 5),                                 // source lane 37: lane 5
            v(if (l & 7) + 2 <= 7 { t + 2 } else { t }), // down 2 in segments of 8
            v(if (l & 15) >= 3 { t - 3 } else { t }),    // up 3 in segments of 16
            v(base + (l ^ 5)),                           // xor 5
            v(if l & 8 != 0 { t - 8 } else { t }),       // xor 8, width 4: earlier only
            third as i32,                                // ballot
            1,                                           // all true
            0,                                           // all, lane 7 false
            1,                                           // any, lane 31 true
            0,                                           // any, none
            -1,                                          // active mask: every lane
            v(if l >= 1 { t - 1 } else { t }),           // up 1
            v(if l == 0 { t + 31 } else { t }),          // down 31
            v(base + 31 - l),                            // reverse
            32,                                          // warpSize
        ];
        assert_eq!(&out[t * 16..t * 16 + 16], &want, "thread {t}");
        assert_eq!(fout[t], 0.5 + v(base + (l ^ 1)) as f32, "thread {t}");
        assert_eq!(lout[t], (v(base + (l & !1)) as i64) << 33, "thread {t}");
    }
    for p in [dout, dfout, dlout] {
        ok(cuMemFreeAsync(p, c.stream));
    }
    ok(cuStreamSynchronize(c.stream));
}

/// Launches `emu_test_shfl_mask` on one block of `threads` and returns out.
fn shfl_mask(c: &Ctx, threads: u32, mask: u32, live: u32) -> (i32, Vec<i32>) {
    let f = kernel("emu_test_shfl_mask");
    let dout = upload(&vec![-1i32; threads as usize], c.stream);
    let (mut a, mut m, mut l) = (dout, mask, live);
    let r = launch(
        f,
        1,
        [threads, 1, 1],
        0,
        c.stream,
        &mut [arg(&mut a), arg(&mut m), arg(&mut l)],
    );
    if r != 0 {
        return (r, Vec::new());
    }
    let r = cuStreamSynchronize(c.stream);
    if r != 0 {
        return (r, Vec::new());
    }
    (0, download(dout, threads as usize, c.stream))
}

#[test]
fn partial_masks_name_only_the_lanes_taking_part() {
    let _g = serial();
    let c = setup();
    // Half the warp exits; the rest shuffle among themselves.
    let (r, out) = shfl_mask(&c, 32, 0xffff, 16);
    ok(r);
    assert_eq!(&out[..16], &[1000; 16]);
    assert_eq!(&out[16..], &[-1; 16]);
    // __activemask(): the lanes that have not exited, in a full and in a partial warp.
    let (r, out) = shfl_mask(&c, 48, 0, 20);
    ok(r);
    assert_eq!(&out[..20], &[1000; 20]);
    let (r, out) = shfl_mask(&c, 48, 0, 48);
    ok(r);
    assert_eq!(&out[..32], &[1000; 32]);
    assert_eq!(&out[32..], &[1032; 16]);
}

/// Runs `emu_test_shfl_mask` or `emu_test_divergent` expecting the launch to fault.
fn expect_fault(name: &str, threads: u32, args: &mut [*mut c_void]) {
    let c = setup();
    let dout = upload(&vec![0i32; threads as usize], c.stream);
    let mut a = dout;
    let mut all = vec![arg(&mut a)];
    all.extend_from_slice(args);
    ok(launch(
        kernel(name),
        1,
        [threads, 1, 1],
        0,
        c.stream,
        &mut all,
    ));
    assert_eq!(cuStreamSynchronize(c.stream), 700);
}

#[test]
fn a_mask_without_the_callers_lane_is_a_fault() {
    faults_in_child(
        "a_mask_without_the_callers_lane_is_a_fault",
        "does not name its own lane",
        || {
            let (mut m, mut l) = (0xffffu32, 32u32);
            expect_fault("emu_test_shfl_mask", 32, &mut [arg(&mut m), arg(&mut l)]);
        },
    );
}

#[test]
fn a_mask_naming_an_exited_lane_is_a_fault() {
    faults_in_child(
        "a_mask_naming_an_exited_lane_is_a_fault",
        "which has exited",
        || {
            let (mut m, mut l) = (u32::MAX, 16u32);
            expect_fault("emu_test_shfl_mask", 32, &mut [arg(&mut m), arg(&mut l)]);
        },
    );
}

#[test]
fn a_mask_naming_a_lane_past_the_block_is_a_fault() {
    faults_in_child(
        "a_mask_naming_a_lane_past_the_block_is_a_fault",
        "leave that lane empty",
        || {
            let (mut m, mut l) = (u32::MAX, 48u32);
            expect_fault("emu_test_shfl_mask", 48, &mut [arg(&mut m), arg(&mut l)]);
        },
    );
}

fn divergent(mode: i32) {
    let mut m = mode;
    expect_fault("emu_test_divergent", 64, &mut [arg(&mut m)]);
}

#[test]
fn one_more_shuffle_in_one_lane_is_a_fault() {
    faults_in_child(
        "one_more_shuffle_in_one_lane_is_a_fault",
        "which has exited",
        || divergent(0),
    );
}

#[test]
fn a_shuffle_waiting_for_a_lane_at_a_barrier_is_a_fault() {
    faults_in_child(
        "a_shuffle_waiting_for_a_lane_at_a_barrier_is_a_fault",
        "which waits at __syncthreads()",
        || divergent(1),
    );
}

#[test]
fn lanes_at_different_warp_operations_are_a_fault() {
    faults_in_child(
        "lanes_at_different_warp_operations_are_a_fault",
        "reach different warp operations",
        || divergent(2),
    );
}

#[test]
fn a_width_that_is_no_power_of_two_is_a_fault() {
    faults_in_child(
        "a_width_that_is_no_power_of_two_is_a_fault",
        "with width 3",
        || divergent(3),
    );
}

#[test]
fn threads_that_end_while_others_wait_at_a_barrier_are_a_fault() {
    faults_in_child(
        "threads_that_end_while_others_wait_at_a_barrier_are_a_fault",
        "did not all reach the same __syncthreads()",
        || divergent(4),
    );
}
