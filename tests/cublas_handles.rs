//! A cuBLAS handle lives exactly as long as its stream: made on the stream's first GEMM, freed
//! when the stream drops, never met by a later stream (at a reused address, or of a device
//! created after every earlier one was dropped). One test in this file, so the process-wide
//! count of live handles is its own.

mod common;

use tidemem::device::{Device, Stream};
use tidemem::ops::{self, Gemm};
use tidemem::rng::{Rng, SplitMix64};
use tidemem::DType;

const M: usize = 8;
const N: usize = 6;
const K: usize = 5;

/// A random GEMM of small integers (exact in f32, so any summation order gives the reference
/// bit for bit): `(a, b, expected c)`.
fn case(r: &mut SplitMix64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut ints =
        |n: usize| -> Vec<f32> { (0..n).map(|_| (r.next_u64() % 9) as f32 - 4.0).collect() };
    let (a, b) = (ints(M * K), ints(K * N));
    let mut c = vec![0f32; M * N];
    ops::gemm_host(&Gemm::new(M, N, K), &a, &b, &mut c).unwrap();
    (a, b, c)
}

/// Runs one GEMM on `s` and checks it.
fn check(dev: &Device, s: &Stream, r: &mut SplitMix64, what: &str) {
    let (a, b, want) = case(r);
    let enc = |v: &[f32]| tidemem::encode_f32(v, DType::F32);
    let da = dev.upload(s, &enc(&a)).unwrap();
    let db = dev.upload(s, &enc(&b)).unwrap();
    let dc = dev.upload(s, &enc(&[f32::NAN; M * N])).unwrap();
    ops::gemm(dev, s, &Gemm::new(M, N, K), &da, &db, &dc, DType::F32).unwrap();
    assert_eq!(dev.download(s, &dc).unwrap(), enc(&want), "{what}");
}

#[test]
fn handles_live_exactly_as_long_as_their_streams() {
    let Some(dev) = common::cuda("cublas_handles") else {
        return;
    };
    if !ops::cublas_available() {
        common::cuda_half_missing("cublas_handles", "cuBLAS cannot be loaded");
        return;
    }
    let live = ops::cublas_live_handles;
    let mut r = SplitMix64::new(11);
    assert_eq!(live(), 0);

    let s = dev.new_stream().unwrap();
    check(&dev, &s, &mut r, "first stream");
    check(&dev, &s, &mut r, "first stream, again");
    assert_eq!(live(), 1, "one handle per stream");
    drop(s);
    assert_eq!(live(), 0, "freed with its stream");

    // Streams come and go (their addresses reused): each gets a handle of its own, bound to it.
    for i in 0..200 {
        let s = dev.new_stream().unwrap();
        check(&dev, &s, &mut r, &format!("stream {i}"));
        assert_eq!(live(), 1, "stream {i}");
    }
    assert_eq!(live(), 0);
    let streams: Vec<Stream> = (0..3).map(|_| dev.new_stream().unwrap()).collect();
    for (i, s) in streams.iter().enumerate() {
        check(&dev, s, &mut r, &format!("concurrent stream {i}"));
    }
    assert_eq!(live(), 3);
    // dropped on a thread where no context is current
    std::thread::spawn(move || drop(streams)).join().unwrap();
    assert_eq!(live(), 0);

    // A new device after every earlier one is gone (its context released): no stale handle.
    let s = dev.new_stream().unwrap();
    check(&dev, &s, &mut r, "before the device is dropped");
    drop(dev);
    drop(s);
    assert_eq!(live(), 0);
    for round in 0..3 {
        let dev = common::cuda("cublas_handles").unwrap();
        for i in 0..3 {
            let s = dev.new_stream().unwrap();
            check(&dev, &s, &mut r, &format!("device {round}, stream {i}"));
        }
        assert_eq!(live(), 0);
    }
}
