//! The elementwise ops on every backend here: `add` (and in place), `scale` and `fill` against
//! f64 references for f32, f16 and bf16 (fill also f64) on sizes from 0 past one block; bad
//! operands refused with nothing written.
//!
//! Tolerances (u: unit roundoff of the stored type; t: half its smallest subnormal, the error
//! near zero):
//! - `add`: |Δ| ≤ 2⁻²³·(|α·a| + |β·b|) + u·|z| + t (two rounded products and a rounded sum in
//!   f32, then one rounding to storage);
//! - `scale`: |Δ| ≤ 2⁻²⁴·|z| + u·|z| + t;
//! - `fill`: exact (the value rounded once to the type).

mod common;
mod ops_util;

use ops_util::*;
use tidemem::ops::{add, add_in_place, fill, scale, Axpby};
use tidemem::DType;

const SIZES: [usize; 6] = [0, 1, 7, 511, 513, 70_001];

#[test]
fn add_and_scale_match_the_f64_reference() {
    let mut rng = SplitMix64::new(11);
    for dev in common::devices("add") {
        let s = dev.new_stream().unwrap();
        for d in FLOATS {
            for n in SIZES {
                let sc = Axpby {
                    alpha: rng.unit() as f32 * 3.0,
                    beta: rng.unit() as f32 * 3.0,
                };
                let (al, be) = (sc.alpha as f64, sc.beta as f64);
                let (a, b) = (rng.vals(n, 4.0, 0.0, d), rng.vals(n, 4.0, 1.0, d));
                let want: Vec<f64> = a.iter().zip(&b).map(|(x, y)| al * x + be * y).collect();
                let tol: Vec<f64> = a
                    .iter()
                    .zip(&b)
                    .zip(&want)
                    .map(|((x, y), z)| {
                        2f64.powi(-23) * ((al * x).abs() + (be * y).abs())
                            + unit(d) * z.abs()
                            + tiny(d)
                    })
                    .collect();
                let check = |what: &str, got: Vec<f64>| {
                    for i in 0..n {
                        assert!(
                            (got[i] - want[i]).abs() <= tol[i],
                            "{d} n={n} {what}: element {i}: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                };
                let (ab, bb) = (upv(&dev, &s, &a, d), upv(&dev, &s, &b, d));
                let z = up(&dev, &s, &vec![0x5a; n * d.size()]);
                add(&dev, &s, sc, &ab, &bb, &z, d).unwrap();
                let out = downv(&dev, &s, &z, d);
                check("add", out.clone());
                add_in_place(&dev, &s, sc, &ab, &bb, d).unwrap();
                let in_place = downv(&dev, &s, &ab, d);
                // In place is the same arithmetic: the same bits.
                assert_eq!(in_place, out, "{d} n={n} add_in_place");
                let alpha = rng.unit() as f32 * 5.0;
                scale(&dev, &s, alpha, &z, d).unwrap();
                let want_s: Vec<f64> = out.iter().map(|v| alpha as f64 * v).collect();
                close(
                    &format!("{d} n={n} scale"),
                    &downv(&dev, &s, &z, d),
                    &want_s,
                    tiny(d),
                    unit(d) + 2f64.powi(-24),
                );
            }
        }
    }
}

#[test]
fn fill_writes_the_value_rounded_once() {
    for dev in common::devices("fill") {
        let s = dev.new_stream().unwrap();
        for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            for n in SIZES {
                for value in [0.1f64, -3.0, 1e6, f64::INFINITY] {
                    let x = up(&dev, &s, &vec![0x5a; n * d.size()]);
                    fill(&dev, &s, &x, value, d).unwrap();
                    let one: Vec<u8> = match d {
                        DType::F64 => value.to_le_bytes().to_vec(),
                        DType::F32 => (value as f32).to_le_bytes().to_vec(),
                        DType::F16 => half::f16::from_f64(value).to_le_bytes().to_vec(),
                        _ => half::bf16::from_f64(value).to_le_bytes().to_vec(),
                    };
                    assert_eq!(down(&dev, &s, &x), one.repeat(n), "{d} n={n} {value}");
                }
            }
        }
    }
}

#[test]
fn bad_operands_are_refused_and_nothing_is_written() {
    for dev in common::devices("elementwise refusals") {
        let s = dev.new_stream().unwrap();
        let a = up(&dev, &s, &[0x11; 40]);
        let b = up(&dev, &s, &[0x22; 40]);
        let z = up(&dev, &s, &[0x33; 40]);
        let short = up(&dev, &s, &[0x44; 36]);
        let keep: Vec<(&tidemem::device::DeviceBuffer, Vec<u8>)> = [&a, &b, &z, &short]
            .into_iter()
            .map(|x| (x, down(&dev, &s, x)))
            .collect();
        let bufs: Vec<(&tidemem::device::DeviceBuffer, &[u8])> =
            keep.iter().map(|(b, v)| (*b, &v[..])).collect();
        let sc = Axpby {
            alpha: 1.0,
            beta: 1.0,
        };
        let f32 = DType::F32;
        refused(
            "z too short",
            add(&dev, &s, sc, &a, &b, &short, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "b too short",
            add(&dev, &s, sc, &a, &short, &z, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "z is a",
            add(&dev, &s, sc, &a, &b, &a, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "z overlaps b",
            add_in_place(&dev, &s, sc, &b, b.view(4, 36).unwrap(), f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "in place, lengths",
            add_in_place(&dev, &s, sc, &z, &short, f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "not a model float",
            add(&dev, &s, sc, &a, &b, &z, DType::U32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "scale misaligned",
            scale(&dev, &s, 2.0, z.view(1, 8).unwrap(), f32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "scale of f64",
            scale(&dev, &s, 2.0, &z, DType::F64),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "fill of an integer type",
            fill(&dev, &s, &z, 1.0, DType::I32),
            &dev,
            &s,
            &bufs,
        );
        refused(
            "fill misaligned",
            fill(&dev, &s, z.view(0, 6).unwrap(), 1.0, DType::F64),
            &dev,
            &s,
            &bufs,
        );
        add(&dev, &s, sc, &a, &b, &z, f32).unwrap();
    }
}
