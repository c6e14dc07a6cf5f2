//! What the op suites (layernorm, relu, bias, elementwise) share: random data, model floats
//! on the host, device round trips and tolerant comparisons.
#![allow(dead_code)]

use tidemem::device::{Device, DeviceBuffer, Stream};
use tidemem::DType;

pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

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

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    /// `n` values uniform in [offset - scale, offset + scale), already rounded to `d`.
    pub fn vals(&mut self, n: usize, scale: f64, offset: f64, d: DType) -> Vec<f64> {
        let v: Vec<f64> = (0..n).map(|_| offset + scale * self.unit()).collect();
        round(&v, d)
    }
}

/// Elements of `d` (rounded to nearest even through f32).
pub fn enc(v: &[f64], d: DType) -> Vec<u8> {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    tidemem::dtype::encode_f32(&f, d)
}

/// Decodes elements of `d`.
pub fn dec(b: &[u8], d: DType) -> Vec<f64> {
    tidemem::dtype::decode_f32(b, d)
        .into_iter()
        .map(f64::from)
        .collect()
}

/// `v` as stored in `d`.
pub fn round(v: &[f64], d: DType) -> Vec<f64> {
    dec(&enc(v, d), d)
}

pub fn up(dev: &Device, s: &Stream, bytes: &[u8]) -> DeviceBuffer {
    dev.upload(s, bytes).unwrap()
}

pub fn upv(dev: &Device, s: &Stream, v: &[f64], d: DType) -> DeviceBuffer {
    up(dev, s, &enc(v, d))
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
