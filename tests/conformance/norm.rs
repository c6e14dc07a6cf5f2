//! Cases of LayerNorm, ReLU, the bias helpers and the elementwise ops.

use super::*;

pub(super) const LN_SHAPES: [(usize, usize); 7] = [
    (0, 5),
    (1, 1),
    (3, 7),
    (9, 33),
    (17, 64),
    (40, 257),
    (300, 3),
];

pub(super) fn layernorm_forward_cases(r: &mut Rng) -> Vec<Case> {
    use ops::abi::LayerNormParams;
    let mut v = vec![];
    for d in FLOATS {
        for (n, c) in LN_SHAPES {
            for residual in [false, true] {
                let nc = n * c;
                v.push(Case {
                    label: format!("{d} [{n}, {c}] residual {residual}"),
                    operands: vec![
                        Some((d, r.floats(nc, 3.0, d))),
                        residual.then(|| (d, r.floats(nc, 2.0, d))),
                        Some((d, r.floats(c, 1.5, d))),
                        Some((d, r.floats(c, 1.0, d))),
                        residual.then(|| (d, r.garbage(nc * d.size()))),
                        Some((d, r.garbage(nc * d.size()))),
                        Some((DType::F32, r.garbage(n * 4))),
                        Some((DType::F32, r.garbage(n * 4))),
                    ],
                    params: bytemuck::bytes_of(&LayerNormParams {
                        rows: n as u64,
                        cols: c as u64,
                        eps: 1e-5,
                        pad: 0,
                    })
                    .to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

pub(super) fn layernorm_backward_cases(r: &mut Rng) -> Vec<Case> {
    use ops::{abi::LayerNormBackwardParams, layernorm_backward_scratch_bytes};
    let mut v = vec![];
    for d in FLOATS {
        for g in [DType::F32, d] {
            for (n, c) in LN_SHAPES {
                for acc in [false, true] {
                    let nc = n * c;
                    let rstd: Vec<f32> = (0..n).map(|_| r.unit().abs() * 2.0 + 0.25).collect();
                    let dx = if acc {
                        r.floats(nc, 1.0, d)
                    } else {
                        r.garbage(nc * d.size())
                    };
                    v.push(Case {
                        label: format!("{d} grads {g} [{n}, {c}] accumulate {acc}"),
                        operands: vec![
                            Some((d, r.floats(nc, 1.0, d))),
                            Some((d, r.floats(nc, 3.0, d))),
                            Some((DType::F32, r.floats(n, 0.5, DType::F32))),
                            Some((DType::F32, encode(&rstd, DType::F32))),
                            Some((d, r.floats(c, 1.5, d))),
                            Some((d, dx)),
                            Some((g, r.floats(c, 2.0, g))),
                            Some((g, r.floats(c, 2.0, g))),
                            Some((
                                DType::F32,
                                r.garbage(layernorm_backward_scratch_bytes(n, c)),
                            )),
                        ],
                        params: bytemuck::bytes_of(&LayerNormBackwardParams::new(n, c, acc))
                            .to_vec(),
                        agree: Agree::Exact,
                    });
                }
            }
        }
    }
    v
}

pub(super) fn relu_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            let mut x: Vec<f32> = (0..n).map(|_| r.unit() * 4.0).collect();
            // Both zeros and a NaN become +0.
            for (i, z) in [0.0f32, -0.0, f32::NAN].into_iter().enumerate() {
                if let Some(e) = x.get_mut(i * 3) {
                    *e = z;
                }
            }
            let mut operands = vec![Some((d, encode(&x, d)))];
            if backward {
                operands.push(Some((d, r.floats(n, 2.0, d))));
            }
            operands.push(Some((d, r.garbage(n * d.size()))));
            v.push(Case {
                label: format!("{d} n={n}"),
                operands,
                params: bytemuck::bytes_of(&ops::abi::ReluParams { n: n as u64 }).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

pub(super) fn bias_rows_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for (n, c) in LN_SHAPES {
            for acc in [0u32, 1] {
                let y = if acc == 1 {
                    r.floats(n * c, 3.0, d)
                } else {
                    r.garbage(n * c * d.size())
                };
                v.push(Case {
                    label: format!("{d} [{n}, {c}] accumulate {acc}"),
                    operands: vec![Some((d, r.floats(c, 2.0, d))), Some((d, y))],
                    params: bytemuck::bytes_of(&ops::abi::BiasParams {
                        rows: n as u64,
                        cols: c as u64,
                        accumulate: acc,
                        pad: 0,
                    })
                    .to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

pub(super) fn bias_grad_cases(r: &mut Rng) -> Vec<Case> {
    use ops::{abi::BiasGradParams, bias_grad_scratch_bytes};
    let mut v = vec![];
    for d in FLOATS {
        for g in [DType::F32, d] {
            for (n, c) in LN_SHAPES.into_iter().chain([(1000, 3)]) {
                for acc in [false, true] {
                    v.push(Case {
                        label: format!("{d} db {g} [{n}, {c}] accumulate {acc}"),
                        operands: vec![
                            Some((d, r.floats(n * c, 2.0, d))),
                            Some((g, r.floats(c, 5.0, g))),
                            Some((DType::F32, r.garbage(bias_grad_scratch_bytes(n, c)))),
                        ],
                        params: bytemuck::bytes_of(&BiasGradParams::new(n, c, acc)).to_vec(),
                        agree: Agree::Exact,
                    });
                }
            }
        }
    }
    v
}

pub(super) fn add_cases(r: &mut Rng, in_place: bool) -> Vec<Case> {
    use ops::abi::AddParams;
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            let (alpha, beta) = (r.unit() * 3.0, r.unit() * 3.0);
            let mut operands = vec![];
            if !in_place {
                operands.push(Some((d, r.floats(n, 4.0, d))));
            }
            operands.push(Some((d, r.floats(n, 4.0, d))));
            operands.push(Some((
                d,
                if in_place {
                    r.floats(n, 4.0, d)
                } else {
                    r.garbage(n * d.size())
                },
            )));
            v.push(Case {
                label: format!("{d} n={n} alpha {alpha} beta {beta}"),
                operands,
                params: bytemuck::bytes_of(&AddParams {
                    n: n as u64,
                    alpha,
                    beta,
                })
                .to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

pub(super) fn scale_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            let alpha = r.unit() * 5.0;
            v.push(Case {
                label: format!("{d} n={n} alpha {alpha}"),
                operands: vec![Some((d, r.floats(n, 4.0, d)))],
                params: bytemuck::bytes_of(&ops::abi::ScaleParams {
                    n: n as u64,
                    alpha,
                    pad: 0,
                })
                .to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

pub(super) fn fill_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for n in SIZES {
            let value = r.unit() as f64 * 100.0;
            v.push(Case {
                label: format!("{d} n={n} value {value}"),
                operands: vec![Some((d, r.garbage(n * d.size())))],
                params: bytemuck::bytes_of(&ops::abi::FillParams {
                    n: n as u64,
                    bits: ops::fill_bits(value, d).unwrap(),
                })
                .to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}
