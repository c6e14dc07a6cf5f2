//! What the op suites share: random data (the crate's SplitMix64), model floats on the host
//! (as f64, or as f32 where a suite keeps its inputs in f32), device round trips, rounding
//! bounds and the checks that bad input is refused with nothing written.
#![allow(dead_code)]

use tidemem::device::{Device, DeviceBuffer, Stream};
use tidemem::{decode_f32, encode_f32};
use tidemem::{DType, Error};

// Not every suite draws random data.
#[allow(unused_imports)]
pub use tidemem::rng::{Rng, SplitMix64};

pub const FLOATS: [DType; 3] = DType::FLOATS;

/// Unit roundoff of f32 (`2⁻²⁴`).
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

/// Unit roundoff of a storage type (half an ulp at 1).
pub fn unit(d: DType) -> f64 {
    match d {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-24),
    }
}

/// Half the smallest subnormal of a storage type: the absolute rounding error near zero.
pub fn tiny(d: DType) -> f64 {
    match d {
        DType::F16 => 2f64.powi(-25),
        DType::BF16 => 2f64.powi(-134),
        _ => 2f64.powi(-150),
    }
}

/// Output rounding of an f32 result stored in `d`: (relative, absolute floor). Nothing for
/// f32; half an ulp for f16 (and half its smallest subnormal) and bf16.
pub fn out_rounding(d: DType) -> (f64, f64) {
    match d {
        DType::F16 => (2f64.powi(-11), 2f64.powi(-25)),
        DType::BF16 => (2f64.powi(-8), 0.0),
        _ => (0.0, 0.0),
    }
}

/// The f64 draws the op suites make, from any of the crate's generators (seed one with
/// `SplitMix64::new(seed)`).
pub trait Draw: Rng {
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    /// `n` values uniform in [-scale, scale), not rounded.
    fn uniform(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| scale * self.unit()).collect()
    }
    /// `n` values uniform in [offset - scale, offset + scale), already rounded to `d`.
    fn vals(&mut self, n: usize, scale: f64, offset: f64, d: DType) -> Vec<f64> {
        let v: Vec<f64> = (0..n).map(|_| offset + scale * self.unit()).collect();
        round(&v, d)
    }
    /// `n` f32 values uniform in [-scale, scale) (24 bits), already rounded to `d`.
    fn vals_f32(&mut self, n: usize, scale: f32, d: DType) -> Vec<f32> {
        let v: Vec<f32> = (0..n).map(|_| self.uniform_f32(-scale, scale)).collect();
        round_f32(&v, d)
    }
}

impl<R: Rng> Draw for R {}

/// Elements of `d` (rounded to nearest even through f32).
pub fn enc(v: &[f64], d: DType) -> Vec<u8> {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    encode_f32(&f, d)
}

/// Decodes elements of `d`.
pub fn dec(b: &[u8], d: DType) -> Vec<f64> {
    widen(&decode_f32(b, d))
}

/// `v` as stored in `d`.
pub fn round(v: &[f64], d: DType) -> Vec<f64> {
    dec(&enc(v, d), d)
}

/// `v` widened to f64.
pub fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// f32 values as elements of `d` (rounded to nearest even).
pub fn encf(v: &[f32], d: DType) -> Vec<u8> {
    encode_f32(v, d)
}

/// f32 values as stored in `d`.
pub fn round_f32(v: &[f32], d: DType) -> Vec<f32> {
    decode_f32(&encf(v, d), d)
}

/// f32 values as stored in `d`, widened to f64 (the inputs of an f64 reference).
pub fn stored(v: &[f32], d: DType) -> Vec<f64> {
    widen(&round_f32(v, d))
}

pub fn up(dev: &Device, s: &Stream, bytes: &[u8]) -> DeviceBuffer {
    dev.upload(s, bytes).unwrap()
}

pub fn upv(dev: &Device, s: &Stream, v: &[f64], d: DType) -> DeviceBuffer {
    up(dev, s, &enc(v, d))
}

/// Uploads f32 values as elements of `d`.
pub fn upf(dev: &Device, s: &Stream, v: &[f32], d: DType) -> DeviceBuffer {
    up(dev, s, &encf(v, d))
}

pub fn down(dev: &Device, s: &Stream, b: &DeviceBuffer) -> Vec<u8> {
    if b.is_empty() {
        return vec![];
    }
    dev.download(s, b).unwrap()
}

pub fn downv(dev: &Device, s: &Stream, b: &DeviceBuffer, d: DType) -> Vec<f64> {
    dec(&down(dev, s, b), d)
}

/// Downloads elements of `d` as f32.
pub fn downf(dev: &Device, s: &Stream, b: &DeviceBuffer, d: DType) -> Vec<f32> {
    decode_f32(&down(dev, s, b), d)
}

/// The central difference `(f(x + h·e_i) − f(x − h·e_i)) / 2h`.
pub fn central_diff(x: &[f64], i: usize, h: f64, f: impl Fn(&[f64]) -> f64) -> f64 {
    let (mut a, mut b) = (x.to_vec(), x.to_vec());
    a[i] += h;
    b[i] -= h;
    (f(&a) - f(&b)) / (2.0 * h)
}

/// Asserts |got − want| ≤ atol + rtol·|want| element by element.
#[track_caller]
pub fn close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}: element {i}: got {g}, want {w} (atol {atol:e}, rtol {rtol:e})"
        );
    }
}

/// Asserts `r` is an error and every buffer of `bufs` still holds its bytes.
#[track_caller]
pub fn refused<T: std::fmt::Debug>(
    what: &str,
    r: tidemem::Result<T>,
    dev: &Device,
    s: &Stream,
    bufs: &[(&DeviceBuffer, &[u8])],
) {
    assert!(r.is_err(), "{what}: accepted: {r:?}");
    dev.sync_stream(s).unwrap();
    for (i, (b, before)) in bufs.iter().enumerate() {
        assert_eq!(
            &down(dev, s, b)[..],
            *before,
            "{what}: buffer {i} was written"
        );
    }
}

/// Runs `f`, which must fail with an error of its input (not of the device: no `Cuda`,
/// `KernelFailed` or `OutOfMemory`), and checks that `outs` kept their bytes.
#[track_caller]
pub fn refused_run(
    dev: &Device,
    s: &Stream,
    what: &str,
    outs: &[&DeviceBuffer],
    f: impl FnOnce() -> tidemem::Result<()>,
) {
    let before: Vec<Vec<u8>> = outs.iter().map(|b| down(dev, s, b)).collect();
    let err = f().expect_err(what);
    assert!(
        !matches!(
            err,
            Error::Cuda { .. } | Error::KernelFailed { .. } | Error::OutOfMemory { .. }
        ),
        "{what}: {err}"
    );
    dev.sync_stream(s).unwrap();
    for (b, was) in outs.iter().zip(before) {
        assert_eq!(down(dev, s, b), was, "{what}: bytes written");
    }
}

/// Asserts `r` is an error of the op's operands ([`Error::Operands`]) or of a shape, length or
/// range, with a message naming each of `names`.
#[track_caller]
pub fn invalid<T: std::fmt::Debug>(r: tidemem::Result<T>, names: &[&str]) {
    let m = match r {
        Err(
            e @ (Error::Operands { .. }
            | Error::Length { .. }
            | Error::TooFew { .. }
            | Error::IndexOutOfRange { .. }
            | Error::Overflow { .. }
            | Error::BadOffsets { .. }
            | Error::TokenOutOfRange { .. }
            | Error::Empty { .. }
            | Error::InvalidArgument(_)),
        ) => e.to_string(),
        other => panic!("{other:?}"),
    };
    for n in names {
        assert!(m.contains(n), "{m} should name {n}");
    }
}

/// Syncs `s` after a launch given an index out of range. The simulated device (the CPU twin)
/// must fail with `KernelFailed` naming `needle`: returns false. CUDA must run through: returns
/// true, and the caller checks what the kernel wrote (NaN where the index was bad).
#[track_caller]
pub fn ran_past_bad_index(dev: &Device, s: &Stream, needle: &str) -> bool {
    let synced = dev.sync_stream(s);
    if dev.kind() == tidemem::device::BackendKind::Sim {
        let Err(Error::KernelFailed { message, .. }) = synced else {
            panic!("{synced:?}")
        };
        assert!(message.contains(needle), "{message}");
        false
    } else {
        synced.unwrap();
        true
    }
}
