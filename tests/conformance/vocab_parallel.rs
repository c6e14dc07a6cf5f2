//! Cases of the vocab-parallel ops: the masked embedding and its backward, the three
//! cross-entropy steps. Every one bitwise: the twins keep the kernels' order.

use super::*;
use tidemem::ops::{
    abi::VocabCeParams, abi::VocabEmbeddingBackwardParams, abi::VocabEmbeddingParams,
    vocab_parallel::VocabPlan, vocab_parallel::VocabShard,
};

/// Embedding shapes (N, C, V, start, V_r).
const EMB_SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (0, 3, 5, 1, 2),
    (1, 1, 1, 0, 1),
    (7, 5, 50, 16, 17),
    (40, 33, 97, 32, 33),
    (130, 300, 11, 7, 4),
];

pub(super) fn vocab_embedding_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for (i, (n, c, vocab, start, rows)) in EMB_SHAPES.into_iter().enumerate() {
            // Tokens of the whole vocabulary, most outside the shard; a few repeat.
            let tokens: Vec<i32> = (0..n)
                .map(|k| {
                    if k % 2 == 0 {
                        (start + r.below(rows.min(3) as u64) as usize) as i32
                    } else {
                        r.below(vocab as u64) as i32
                    }
                })
                .collect();
            let label = format!("{d} N {n} C {c} V {vocab} shard {start}+{rows}");
            if backward {
                let shard = VocabShard::new(vocab, start, rows).unwrap();
                let plan = VocabPlan::new(&tokens, &shard).unwrap();
                let accumulate = i % 2 == 0;
                let p = VocabEmbeddingBackwardParams {
                    n: n as u64,
                    c: c as u64,
                    rows: rows as u64,
                    distinct: plan.distinct() as u64,
                    owned: plan.owned() as u64,
                    accumulate: accumulate as u32,
                    pad: 0,
                };
                let dtable = if accumulate {
                    r.floats(rows * c, 1.0, d)
                } else {
                    r.garbage(rows * c * d.size())
                };
                v.push(Case {
                    label: format!("{label} accumulate {accumulate}"),
                    operands: vec![
                        Some((d, r.floats(n * c, 2.0, d))),
                        Some((DType::U32, u32s(&plan.to_words()))),
                        Some((d, dtable)),
                    ],
                    params: bytemuck::bytes_of(&p).to_vec(),
                    agree: Agree::Exact,
                });
            } else {
                let p = VocabEmbeddingParams {
                    n: n as u64,
                    c: c as u64,
                    rows: rows as u64,
                    start: start as u64,
                    vocab: vocab as u64,
                };
                v.push(Case {
                    label,
                    operands: vec![
                        Some((DType::I32, bytemuck::cast_slice(&tokens).to_vec())),
                        Some((d, r.floats(rows * c, 1.0, d))),
                        Some((d, r.garbage(n * c * d.size()))),
                    ],
                    params: bytemuck::bytes_of(&p).to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

/// Cross-entropy shapes (N, V, start, V_r, Vp).
const CE_SHAPES: [(usize, usize, usize, usize, usize); 6] = [
    (0, 5, 0, 5, 5),
    (1, 1, 0, 1, 1),
    (3, 50, 16, 17, 20),
    (4, 700, 300, 300, 320),
    (5, 257, 0, 257, 257),
    (2, 3000, 1000, 1000, 1024),
];

/// Which cross-entropy step a case runs.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum CeStep {
    Max,
    Sums,
    Grad,
}

pub(super) fn vocab_ce_cases(r: &mut Rng, step: CeStep) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for (i, (n, vocab, start, rows, vp)) in CE_SHAPES.into_iter().enumerate() {
            let ignore = if i % 2 == 0 { -100 } else { 2 };
            let mut logits = vec![];
            for _ in 0..n {
                logits.extend(r.floats(rows, 8.0, d));
                logits.extend(r.garbage((vp - rows) * d.size()));
            }
            // Every third row ignored; the rest owned by this shard or another.
            let targets: Vec<i32> = (0..n)
                .map(|k| match k % 3 {
                    1 => ignore,
                    0 => (start + r.below(rows as u64) as usize) as i32,
                    _ => r.below(vocab as u64) as i32,
                })
                .collect();
            let p = VocabCeParams {
                n: n as u64,
                rows: rows as u64,
                stride: vp as u64,
                start: start as u64,
                vocab: vocab as u64,
                ignore_index: ignore,
                grad_scale: 1.0 / (n.max(1) as f32),
            };
            let stat = |r: &mut Rng, lo: f32, hi: f32| -> Vec<u8> {
                let x: Vec<f32> = (0..n)
                    .map(|_| lo + (hi - lo) * (r.unit() + 1.0) / 2.0)
                    .collect();
                bytemuck::cast_slice(&x).to_vec()
            };
            let tb = Some((DType::I32, bytemuck::cast_slice(&targets).to_vec()));
            let f = DType::F32;
            let with_loss = i % 2 == 1;
            let operands = match step {
                CeStep::Max => vec![Some((d, logits)), Some((f, r.garbage(n * 4)))],
                CeStep::Sums => vec![
                    Some((d, logits)),
                    tb,
                    Some((f, stat(r, 0.0, 8.0))),
                    Some((f, r.garbage(n * 4))),
                    Some((f, r.garbage(n * 4))),
                ],
                CeStep::Grad => vec![
                    Some((d, logits)),
                    tb,
                    Some((f, stat(r, 0.0, 8.0))),
                    Some((f, stat(r, 1.0, 100.0))),
                    with_loss.then(|| (f, stat(r, -8.0, 0.0))),
                    with_loss.then(|| (f, r.garbage(n * 4))),
                ],
            };
            v.push(Case {
                label: format!(
                    "{d} [{n}, {rows} of {vp}] V {vocab} start {start} loss {with_loss}"
                ),
                operands,
                params: bytemuck::bytes_of(&p).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}
