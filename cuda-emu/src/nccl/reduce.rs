//! The stand-in's element types, reductions and arithmetic: exact in rank order and rounded
//! once (f64, or 128-bit integers), as the in-process backend reduces.

use std::ffi::c_int;

use half::{bf16, f16};

/// Element types, as `ncclDataType_t` numbers them.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Dt {
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
    pub(super) fn from(v: c_int) -> Option<Dt> {
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

    pub(super) fn size(self) -> usize {
        match self {
            Dt::I8 | Dt::U8 => 1,
            Dt::F16 | Dt::Bf16 => 2,
            Dt::I32 | Dt::U32 | Dt::F32 => 4,
            Dt::I64 | Dt::U64 | Dt::F64 => 8,
        }
    }

    pub(super) fn is_float(self) -> bool {
        matches!(self, Dt::F16 | Dt::F32 | Dt::F64 | Dt::Bf16)
    }
}

/// Reductions, as `ncclRedOp_t` numbers them.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Red {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl Red {
    pub(super) fn from(v: c_int) -> Option<Red> {
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

pub(super) fn word<const N: usize>(c: &[u8]) -> [u8; N] {
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
pub(super) fn reduce(dt: Dt, op: Red, parts: &[&[u8]]) -> Vec<u8> {
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
