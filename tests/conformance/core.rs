//! Cases of the casts, Adam, gradient statistics and accumulation.

use super::*;

pub(super) fn cast_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for from in FLOATS {
        for to in FLOATS.into_iter().filter(|&t| t != from) {
            for n in SIZES {
                v.push(Case {
                    label: format!("{from}->{to} n={n}"),
                    operands: vec![
                        Some((from, r.floats(n, 300.0, from))),
                        Some((to, r.garbage(n * to.size()))),
                    ],
                    params: bytemuck::bytes_of(&ops::abi::CastParams { n: n as u64 }).to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

/// Adam's cases; with `eight_bit`, the 8-bit step's: random codes under random positive
/// scales stand for any moments, and the twin and the kernel agree on every code, scale and
/// parameter bit.
pub(super) fn adam_cases(r: &mut Rng, in_place: bool, eight_bit: bool) -> Vec<Case> {
    let s = AdamConfig::adamw(1e-2, 0.01).scalars(3, 0.5).unwrap();
    let mut v = vec![];
    let grads: &[DType] = if in_place { &FLOATS[1..] } else { &FLOATS };
    for &g in grads {
        let copies: Vec<Option<DType>> = if in_place {
            vec![None]
        } else {
            vec![None, Some(DType::F16), Some(DType::BF16)]
        };
        for c in copies {
            for n in SIZES {
                let mut operands = vec![Some((DType::F32, r.floats(n, 2.0, DType::F32)))];
                if eight_bit {
                    let blocks = n.div_ceil(ops::QUANT8_BLOCK);
                    let scales = |r: &mut Rng, k: f32| -> Vec<u8> {
                        let x: Vec<f32> = (0..blocks).map(|_| r.unit().abs() * k).collect();
                        encode(&x, DType::F32)
                    };
                    operands.extend([
                        Some((DType::U8, r.garbage(n))),
                        Some((DType::U8, r.garbage(n))),
                        Some((DType::F32, scales(r, 0.1))),
                        Some((DType::F32, scales(r, 0.01))),
                    ]);
                } else {
                    let var: Vec<f32> = (0..n).map(|_| r.unit().abs() * 0.1).collect();
                    operands.extend([
                        Some((DType::F32, r.floats(n, 0.1, DType::F32))),
                        Some((DType::F32, encode(&var, DType::F32))),
                    ]);
                }
                operands.push(Some((g, r.floats(n, 4.0, g))));
                if !in_place {
                    operands.push(c.map(|c| (c, r.garbage(n * c.size()))));
                }
                let bits = if eight_bit { "8-bit " } else { "" };
                v.push(Case {
                    label: format!("{bits}grad {g} copy {c:?} n={n}"),
                    operands,
                    params: bytemuck::bytes_of(&AdamParams::new(n, &s)).to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

pub(super) fn grad_stats_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            v.push(Case {
                label: format!("{d} n={n}"),
                operands: vec![
                    Some((d, r.floats(n, 8.0, d))),
                    Some((DType::F64, r.garbage(ops::GRAD_STATS_BYTES))),
                ],
                params: bytemuck::bytes_of(&ops::abi::GradStatsParams { n: n as u64 }).to_vec(),
                // The twin sums in the kernel's order: the two f64 results agree exactly (the
                // scratch after them is the kernel's alone).
                agree: Agree::Close { abs: 0.0, rel: 0.0 },
            });
        }
    }
    v
}

pub(super) fn accumulate_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            v.push(Case {
                label: format!("{d} n={n}"),
                operands: vec![
                    Some((d, r.floats(n, 3.0, d))),
                    Some((DType::F32, r.floats(n, 100.0, DType::F32))),
                ],
                params: bytemuck::bytes_of(&ops::abi::AccumulateParams { n: n as u64 }).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}
