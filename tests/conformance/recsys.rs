//! Cases of DLRM's interaction and BCE.

use super::*;

pub(super) fn interaction_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    use ops::InteractionShape;
    let mut v = vec![];
    // Empty, no features, dim 0, odd, Criteo-like, and samples too large for shared memory.
    let shapes = [
        (0usize, 3usize, 4usize),
        (1, 0, 5),
        (2, 3, 0),
        (1, 1, 1),
        (3, 5, 7),
        (2, 26, 64),
        (1, 63, 200),
        (1, 26, 512),
    ];
    for d in FLOATS {
        for (batch, features, dim) in shapes {
            let s = InteractionShape {
                batch,
                features,
                dim,
            };
            let mut operands = vec![
                Some((d, r.floats(batch * dim, 2.0, d))),
                Some((d, r.floats(batch * features * dim, 2.0, d))),
            ];
            if backward {
                operands.push(Some((d, r.floats(batch * s.out_width(), 2.0, d))));
                operands.push(Some((d, r.garbage(batch * dim * d.size()))));
                operands.push(Some((d, r.garbage(batch * features * dim * d.size()))));
            } else {
                operands.push(Some((d, r.garbage(batch * s.out_width() * d.size()))));
            }
            v.push(Case {
                label: format!("{d} {s:?}"),
                operands,
                params: bytemuck::bytes_of(&s.params()).to_vec(),
                // Chains of fmas in a fixed order on both sides.
                agree: Agree::Exact,
            });
        }
    }
    v
}

pub(super) fn bce_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            for (grad, probs) in [(true, true), (true, false), (false, true), (false, false)] {
                let labels: Vec<f32> = (0..n)
                    .map(|i| match i % 3 {
                        0 => 0.0,
                        1 => 1.0,
                        _ => r.unit().abs(),
                    })
                    .collect();
                let p = ops::abi::BceParams {
                    n: n as u64,
                    scale: 1.0 / n.max(1) as f32,
                    pad: 0,
                };
                v.push(Case {
                    label: format!("{d} n={n} grad {grad} probs {probs}"),
                    operands: vec![
                        Some((d, r.floats(n, 30.0, d))),
                        Some((DType::F32, encode(&labels, DType::F32))),
                        Some((DType::F32, r.garbage(4 * n))),
                        grad.then(|| (d, r.garbage(n * d.size()))),
                        probs.then(|| (DType::F32, r.garbage(4 * n))),
                    ],
                    params: bytemuck::bytes_of(&p).to_vec(),
                    // exp and ln are math.cuh's: the same bits everywhere.
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}
