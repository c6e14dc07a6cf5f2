//! The host reduction of the in-process backend: exact, in rank order, rounded once.

use half::{bf16, f16};

use super::{Elem, ReduceOp};

/// Element-wise reduction of `parts` (equal lengths) in rank order, accumulating in f64 (floats)
/// or i128 (integers) and rounding once.
pub(crate) fn reduce(elem: Elem, op: ReduceOp, parts: &[&[u8]], world: usize) -> Vec<u8> {
    let Some((first, rest)) = parts.split_first() else {
        return Vec::new();
    };
    let w4 = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let w8 = |c: &[u8]| [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
    match elem {
        Elem::F64 | Elem::F32 | Elem::F16 | Elem::BF16 => {
            let dec = |p: &[u8]| -> Vec<f64> {
                match elem {
                    Elem::F64 => p
                        .chunks_exact(8)
                        .map(|c| f64::from_le_bytes(w8(c)))
                        .collect(),
                    Elem::F32 => p
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(w4(c)) as f64)
                        .collect(),
                    Elem::F16 => p
                        .chunks_exact(2)
                        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
                        .collect(),
                    _ => p
                        .chunks_exact(2)
                        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
                        .collect(),
                }
            };
            let mut acc = dec(first);
            for p in rest {
                for (a, v) in acc.iter_mut().zip(dec(p)) {
                    *a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => *a + v,
                        _ if a.is_nan() || v.is_nan() => f64::NAN,
                        ReduceOp::Max => a.max(v),
                        ReduceOp::Min => a.min(v),
                    };
                }
            }
            if op == ReduceOp::Avg {
                acc.iter_mut().for_each(|a| *a /= world as f64);
            }
            match elem {
                Elem::F64 => acc.iter().flat_map(|a| a.to_le_bytes()).collect(),
                Elem::F32 => acc.iter().flat_map(|&a| (a as f32).to_le_bytes()).collect(),
                Elem::F16 => acc
                    .iter()
                    .flat_map(|&a| f16::from_f64(a).to_le_bytes())
                    .collect(),
                _ => acc
                    .iter()
                    .flat_map(|&a| bf16::from_f64(a).to_le_bytes())
                    .collect(),
            }
        }
        Elem::U8 | Elem::I32 | Elem::U32 | Elem::I64 | Elem::U64 => {
            let dec = |p: &[u8]| -> Vec<i128> {
                match elem {
                    Elem::U8 => p.iter().map(|&b| b as i128).collect(),
                    Elem::I32 => p
                        .chunks_exact(4)
                        .map(|c| i32::from_le_bytes(w4(c)) as i128)
                        .collect(),
                    Elem::U32 => p
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes(w4(c)) as i128)
                        .collect(),
                    Elem::U64 => p
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(w8(c)) as i128)
                        .collect(),
                    _ => p
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(w8(c)) as i128)
                        .collect(),
                }
            };
            let mut acc = dec(first);
            for p in rest {
                for (a, v) in acc.iter_mut().zip(dec(p)) {
                    *a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => *a + v,
                        ReduceOp::Max => (*a).max(v),
                        ReduceOp::Min => (*a).min(v),
                    };
                }
            }
            if op == ReduceOp::Avg {
                // as NCCL: the sum wraps in the element type, then divides (toward zero)
                for a in acc.iter_mut() {
                    let sum = match elem {
                        Elem::U8 => *a as u8 as i128,
                        Elem::I32 => *a as i32 as i128,
                        Elem::U32 => *a as u32 as i128,
                        Elem::U64 => *a as u64 as i128,
                        _ => *a as i64 as i128,
                    };
                    *a = sum / world as i128;
                }
            }
            // integer sums wrap, as in NCCL
            match elem {
                Elem::U8 => acc.iter().map(|&a| a as u8).collect(),
                Elem::I32 => acc.iter().flat_map(|&a| (a as i32).to_le_bytes()).collect(),
                Elem::U32 => acc.iter().flat_map(|&a| (a as u32).to_le_bytes()).collect(),
                Elem::U64 => acc.iter().flat_map(|&a| (a as u64).to_le_bytes()).collect(),
                _ => acc.iter().flat_map(|&a| (a as i64).to_le_bytes()).collect(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsigned_words_reduce_unsigned() {
        let u = |v: u32| v.to_le_bytes();
        let got = reduce(Elem::U32, ReduceOp::Max, &[&u(u32::MAX), &u(3)], 2);
        assert_eq!(got, u(u32::MAX));
        let got = reduce(
            Elem::U64,
            ReduceOp::Sum,
            &[&5u64.to_le_bytes(), &7u64.to_le_bytes()],
            2,
        );
        assert_eq!(got, 12u64.to_le_bytes());
    }

    #[test]
    fn integer_average_wraps_the_sum_first_as_nccl_does() {
        assert_eq!(
            reduce(Elem::U8, ReduceOp::Avg, &[&[200], &[100]], 2),
            vec![22]
        );
        let i = |v: i32| v.to_le_bytes();
        let got = reduce(Elem::I32, ReduceOp::Avg, &[&i(i32::MAX), &i(3)], 2);
        assert_eq!(got, i((i32::MAX).wrapping_add(3) / 2).to_vec());
        assert_eq!(
            reduce(Elem::I32, ReduceOp::Avg, &[&i(-7), &i(2)], 2),
            i(-2).to_vec()
        );
    }

    #[test]
    fn reduce_is_exact_in_rank_order() {
        let a: Vec<u8> = [1.0f32, 2.0, f32::NAN]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let b: Vec<u8> = [3.0f32, -5.0, 1.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let f = |v: Vec<u8>| -> Vec<f32> {
            v.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let s = f(reduce(Elem::F32, ReduceOp::Sum, &[&a, &b], 2));
        assert_eq!(&s[..2], &[4.0, -3.0]);
        assert!(s[2].is_nan());
        assert_eq!(
            &f(reduce(Elem::F32, ReduceOp::Avg, &[&a, &b], 2))[..2],
            &[2.0, -1.5]
        );
        let m = f(reduce(Elem::F32, ReduceOp::Max, &[&a, &b], 2));
        assert_eq!(&m[..2], &[3.0, 2.0]);
        assert!(m[2].is_nan());
        assert_eq!(
            &f(reduce(Elem::F32, ReduceOp::Min, &[&a, &b], 2))[..2],
            &[1.0, -5.0]
        );
        // f16 sums round once: 2048 + 1 + 1 is 2050 exactly, pairwise f16 would give 2048
        let h = |x: f32| f16::from_f32(x).to_le_bytes().to_vec();
        let r = reduce(Elem::F16, ReduceOp::Sum, &[&h(2048.0), &h(1.0), &h(1.0)], 3);
        assert_eq!(f16::from_le_bytes([r[0], r[1]]).to_f32(), 2050.0);
        let i = |x: i32| x.to_le_bytes().to_vec();
        let r = reduce(Elem::I32, ReduceOp::Avg, &[&i(7), &i(-2)], 2);
        assert_eq!(i32::from_le_bytes(r.try_into().unwrap()), 2);
    }
}
