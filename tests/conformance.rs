//! Every registered op: its CPU twin (the simulated device) against CUDA (a GPU, or the
//! emulator in CI) on random operands of many shapes, empty and odd sizes included; bitwise
//! where the op promises it, within a stated tolerance where it does not. An op without cases
//! here fails the test, so a new op cannot skip conformance.

mod common;

use half::{bf16, f16};
use tidemem::device::{Device, DeviceBuffer, KernelDesc, Operand};
use tidemem::ops::embedding::device::{
    EmbBackwardParams, EmbBagParams, EmbRowsParams, EmbStepParams,
};
use tidemem::ops::{self, adam::AdamParams};
use tidemem::optim::AdamConfig;
use tidemem::DType;

/// How two results of a written operand must agree.
#[derive(Clone, Copy, Debug)]
enum Agree {
    /// Bit for bit.
    Exact,
    /// As floats of the operand's type: |a − b| ≤ abs + rel·|b|.
    Close { abs: f64, rel: f64 },
}

/// One launch: operands (type and initial bytes; `None` = left out), parameters, and how each
/// written operand must agree.
struct Case {
    label: String,
    operands: Vec<Option<(DType, Vec<u8>)>>,
    params: Vec<u8>,
    agree: Agree,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn floats(&mut self, n: usize, scale: f32, d: DType) -> Vec<u8> {
        let v: Vec<f32> = (0..n).map(|_| self.unit() * scale).collect();
        encode(&v, d)
    }
    fn garbage(&mut self, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|_| self.next() as u8).collect()
    }
}

fn encode(v: &[f32], d: DType) -> Vec<u8> {
    tidemem::dtype::encode_f32(v, d)
}

fn u32s(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

const SIZES: [usize; 6] = [0, 1, 7, 64, 257, 3001];
const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn cast_cases(r: &mut Rng) -> Vec<Case> {
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
                    params: bytemuck::bytes_of(&ops::cast::CastParams { n: n as u64 }).to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

fn adam_cases(r: &mut Rng, in_place: bool) -> Vec<Case> {
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
                let var: Vec<f32> = (0..n).map(|_| r.unit().abs() * 0.1).collect();
                let mut operands = vec![
                    Some((DType::F32, r.floats(n, 2.0, DType::F32))),
                    Some((DType::F32, r.floats(n, 0.1, DType::F32))),
                    Some((DType::F32, encode(&var, DType::F32))),
                    Some((g, r.floats(n, 4.0, g))),
                ];
                if !in_place {
                    operands.push(c.map(|c| (c, r.garbage(n * c.size()))));
                }
                v.push(Case {
                    label: format!("grad {g} copy {c:?} n={n}"),
                    operands,
                    params: bytemuck::bytes_of(&AdamParams::new(n, &s)).to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

fn grad_stats_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            v.push(Case {
                label: format!("{d} n={n}"),
                operands: vec![
                    Some((d, r.floats(n, 8.0, d))),
                    Some((DType::F64, r.garbage(ops::GRAD_STATS_BYTES))),
                ],
                params: bytemuck::bytes_of(&ops::grad_stats::GradStatsParams { n: n as u64 })
                    .to_vec(),
                // The sum runs in another order on the GPU: compare the two f64 as floats.
                agree: Agree::Close {
                    abs: 1e-12,
                    rel: 1e-12,
                },
            });
        }
    }
    v
}

fn bag_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for (rows, dim, stride) in [
        (5usize, 1usize, 1usize),
        (17, 3, 5),
        (40, 33, 35),
        (1, 8, 8),
    ] {
        for bags in [0usize, 1, 6] {
            for weighted in [false, true] {
                let n = r.below(3 * bags as u64 + 1) as usize;
                // Some indices out of range: skipped on both sides.
                let idx: Vec<u32> = (0..n).map(|_| r.below(rows as u64 + 2) as u32).collect();
                let mut off: Vec<u32> = (0..=bags).map(|_| r.below(n as u64 + 1) as u32).collect();
                off.sort_unstable();
                let p = EmbBagParams {
                    rows: rows as u64,
                    stride: stride as u64,
                    dim: dim as u64,
                    n: n as u64,
                    bags: bags as u64,
                    mean: (bags % 2) as i32,
                    pad: 0,
                };
                v.push(Case {
                    label: format!("rows {rows} dim {dim} bags {bags} n {n} w {weighted}"),
                    operands: vec![
                        Some((DType::F32, r.floats(rows * stride, 1.0, DType::F32))),
                        Some((DType::U32, u32s(&idx))),
                        Some((DType::U32, u32s(&off))),
                        weighted.then(|| (DType::F32, r.floats(n, 2.0, DType::F32))),
                        Some((DType::F32, r.garbage(bags * dim * 4))),
                    ],
                    params: bytemuck::bytes_of(&p).to_vec(),
                    agree: Agree::Exact,
                });
            }
        }
    }
    v
}

fn backward_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for (nrows, dim, bags) in [(0usize, 4usize, 3usize), (1, 1, 1), (9, 7, 5), (30, 40, 12)] {
        let ne = r.below(3 * nrows as u64 + 1) as usize;
        let mut rp: Vec<u32> = (0..=nrows).map(|_| r.below(ne as u64 + 1) as u32).collect();
        rp.sort_unstable();
        let entries: Vec<u32> = (0..ne).map(|_| r.below(bags as u64) as u32).collect();
        let p = EmbBackwardParams {
            nrows: nrows as u64,
            dim: dim as u64,
            bags: bags as u64,
            nentries: ne as u64,
        };
        v.push(Case {
            label: format!("rows {nrows} dim {dim} bags {bags} entries {ne}"),
            operands: vec![
                Some((DType::F32, r.floats(bags * dim, 1.0, DType::F32))),
                Some((DType::U32, u32s(&rp))),
                Some((DType::U32, u32s(&entries))),
                Some((DType::F32, r.floats(ne, 1.0, DType::F32))),
                Some((DType::F32, r.garbage(nrows * dim * 4))),
            ],
            params: bytemuck::bytes_of(&p).to_vec(),
            agree: Agree::Exact,
        });
    }
    v
}

fn step_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for kind in 0..3 {
        for (rows, dim, n) in [(4usize, 1usize, 0usize), (10, 3, 4), (50, 33, 20)] {
            let stride = dim + [0, 1, 2 * dim][kind as usize];
            let mut ids: Vec<u32> = (0..rows as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, r.below(i as u64 + 1) as usize);
            }
            ids.truncate(n);
            let mut table: Vec<f32> = (0..rows * stride).map(|_| r.unit()).collect();
            // Optimizer state is non-negative where it is a second moment.
            for row in table.chunks_mut(stride) {
                for x in &mut row[dim..] {
                    *x = x.abs();
                }
            }
            let p = EmbStepParams {
                table_rows: rows as u64,
                stride: stride as u64,
                dim: dim as u64,
                n: n as u64,
                kind,
                lr: 0.05,
                eps: 1e-6,
                beta1: 0.9,
                beta2: 0.999,
                bias1: 0.271,
                bias2: 0.00299,
                pad: 0,
            };
            v.push(Case {
                label: format!("kind {kind} rows {rows} dim {dim} n {n}"),
                operands: vec![
                    Some((DType::F32, encode(&table, DType::F32))),
                    Some((DType::U32, u32s(&ids))),
                    Some((DType::F32, r.floats(n * dim, 1.0, DType::F32))),
                ],
                params: bytemuck::bytes_of(&p).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

fn rows_cases(r: &mut Rng, scatter: bool) -> Vec<Case> {
    let mut v = vec![];
    for (rows, words, n) in [(3usize, 1usize, 0usize), (8, 5, 6), (64, 33, 40)] {
        let mut ids: Vec<u32> = (0..rows as u32 + 3).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, r.below(i as u64 + 1) as usize);
        }
        ids.truncate(n);
        let p = EmbRowsParams {
            rows: rows as u64,
            words: words as u64,
            n: n as u64,
        };
        let (table, packed) = (r.garbage(rows * words * 4), r.garbage(n * words * 4));
        let (src, dst) = if scatter {
            (packed, table)
        } else {
            (table, packed)
        };
        v.push(Case {
            label: format!("rows {rows} words {words} n {n}"),
            operands: vec![
                Some((DType::U32, src)),
                Some((DType::U32, u32s(&ids))),
                Some((DType::U32, dst)),
            ],
            params: bytemuck::bytes_of(&p).to_vec(),
            agree: Agree::Exact,
        });
    }
    v
}

fn gelu_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            let mut operands = vec![Some((d, r.floats(n, 6.0, d)))];
            if backward {
                operands.push(Some((d, r.floats(n, 2.0, d))));
            }
            operands.push(Some((d, r.garbage(n * d.size()))));
            v.push(Case {
                label: format!("{d} n={n}"),
                operands,
                params: bytemuck::bytes_of(&ops::gelu::GeluParams { n: n as u64 }).to_vec(),
                // tanh is math.cuh's, not the libm's: the same bits everywhere.
                agree: Agree::Exact,
            });
        }
    }
    v
}

fn accumulate_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            v.push(Case {
                label: format!("{d} n={n}"),
                operands: vec![
                    Some((d, r.floats(n, 3.0, d))),
                    Some((DType::F32, r.floats(n, 100.0, DType::F32))),
                ],
                params: bytemuck::bytes_of(&ops::accumulate::AccumulateParams { n: n as u64 })
                    .to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

/// The attention layouts: `name` moves `ins` tensors into `outs` (the interleaved one holds
/// three parts when `qkv`).
fn heads_cases(r: &mut Rng, ins: usize, qkv_in: bool, qkv_out: bool) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for (b, t, h, hd) in [(0, 3, 2, 4), (1, 1, 1, 1), (2, 7, 3, 5), (3, 33, 4, 16)] {
            let n = b * t * h * hd;
            let mut operands = vec![];
            for _ in 0..ins {
                operands.push(Some((d, r.floats(if qkv_in { 3 * n } else { n }, 2.0, d))));
            }
            for _ in 0..(if qkv_in { 3 } else { 1 }) {
                operands.push(Some((
                    d,
                    r.garbage(if qkv_out { 3 * n } else { n } * d.size()),
                )));
            }
            v.push(Case {
                label: format!("{d} B={b} T={t} H={h} D={hd}"),
                operands,
                params: bytemuck::bytes_of(&ops::heads::Heads::new(b, t, h, hd)).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

fn interaction_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    use ops::interaction::InteractionShape;
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

fn bce_cases(r: &mut Rng) -> Vec<Case> {
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
                let p = ops::bce::BceParams {
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

/// `bh` matrices of `t × t` `d` elements: random floats of `scale` on and below the diagonal,
/// garbage bits above it (never read).
fn causal(r: &mut Rng, bh: usize, t: usize, scale: f32, d: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(bh * t * t * d.size());
    for _ in 0..bh {
        for i in 0..t {
            for j in 0..t {
                if j <= i {
                    out.extend(r.floats(1, scale, d));
                } else {
                    out.extend(r.garbage(d.size()));
                }
            }
        }
    }
    out
}

fn softmax_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for (bh, t, scale) in [
            (0usize, 5usize, 0.125f32),
            (3, 0, 1.0),
            (1, 1, 0.125),
            (3, 7, 1.0),
            (2, 33, 0.125),
            (1, 64, 0.3),
            (2, 100, 0.125),
        ] {
            let mut operands = vec![];
            if backward {
                operands.push(Some((d, causal(r, bh, t, 1.0, d))));
                operands.push(Some((d, causal(r, bh, t, 2.0, d))));
            } else {
                operands.push(Some((d, causal(r, bh, t, 12.0, d))));
            }
            operands.push(Some((d, r.garbage(bh * t * t * d.size()))));
            let p = ops::softmax::SoftmaxParams {
                bh: bh as u64,
                t: t as u64,
                scale,
                pad: 0,
            };
            v.push(Case {
                label: format!("{d} [{bh}, {t}, {t}] scale {scale}"),
                operands,
                params: bytemuck::bytes_of(&p).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

fn cross_entropy_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for (n, vocab, vp, ignore) in [
            (0usize, 5usize, 5usize, -100i32),
            (1, 1, 1, -100),
            (3, 7, 9, -100),
            (4, 300, 320, 2),
            (5, 257, 257, -1),
            (2, 1000, 1024, -100),
        ] {
            let mut logits = vec![];
            for _ in 0..n {
                logits.extend(r.floats(vocab, 8.0, d));
                logits.extend(r.garbage((vp - vocab) * d.size()));
            }
            // Every third row ignored.
            let targets: Vec<i32> = (0..n)
                .map(|i| {
                    if i % 3 == 1 {
                        ignore
                    } else {
                        r.below(vocab as u64) as i32
                    }
                })
                .collect();
            let p = ops::cross_entropy::CrossEntropyParams {
                n: n as u64,
                v: vocab as u64,
                vp: vp as u64,
                ignore_index: ignore,
                grad_scale: 1.0 / (n.max(1) as f32),
            };
            v.push(Case {
                label: format!("{d} [{n}, {vocab} of {vp}] ignore {ignore}"),
                operands: vec![
                    Some((d, logits)),
                    Some((DType::I32, bytemuck::cast_slice(&targets).to_vec())),
                    Some((DType::F32, r.garbage(n * 4))),
                ],
                params: bytemuck::bytes_of(&p).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

/// Encoder shapes (B, T, C, V, maxT).
const ENCODER_SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (0, 3, 4, 5, 3),
    (1, 1, 1, 1, 1),
    (2, 5, 7, 11, 8),
    (3, 17, 33, 50, 20),
    (2, 64, 130, 300, 64),
];

fn encoder_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for (b, t, c, vocab, max_t) in ENCODER_SHAPES {
            let n = b * t;
            // Few distinct tokens, so most repeat.
            let tokens: Vec<i32> = (0..n)
                .map(|_| r.below(vocab.min(9) as u64) as i32 * (vocab as i32 / 9).max(1))
                .collect();
            let label = format!("{d} B {b} T {t} C {c} V {vocab} maxT {max_t}");
            if backward {
                let plan = ops::EncoderPlan::new(&tokens, vocab).unwrap();
                let p = ops::encoder::EncoderBackwardParams {
                    n: n as u64,
                    t: t as u64,
                    c: c as u64,
                    v: vocab as u64,
                    max_t: max_t as u64,
                    distinct: plan.distinct() as u64,
                };
                v.push(Case {
                    label,
                    operands: vec![
                        Some((d, r.floats(n * c, 2.0, d))),
                        Some((DType::U32, u32s(&plan.to_words()))),
                        Some((d, r.floats(vocab * c, 1.0, d))),
                        Some((d, r.floats(max_t * c, 1.0, d))),
                    ],
                    params: bytemuck::bytes_of(&p).to_vec(),
                    agree: Agree::Exact,
                });
            } else {
                let p = ops::encoder::EncoderParams {
                    n: n as u64,
                    t: t as u64,
                    c: c as u64,
                    v: vocab as u64,
                    max_t: max_t as u64,
                };
                v.push(Case {
                    label,
                    operands: vec![
                        Some((DType::I32, bytemuck::cast_slice(&tokens).to_vec())),
                        Some((d, r.floats(vocab * c, 1.0, d))),
                        Some((d, r.floats(max_t * c, 1.0, d))),
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

const LN_SHAPES: [(usize, usize); 7] = [
    (0, 5),
    (1, 1),
    (3, 7),
    (9, 33),
    (17, 64),
    (40, 257),
    (300, 3),
];

fn layernorm_forward_cases(r: &mut Rng) -> Vec<Case> {
    use ops::layernorm::LayerNormParams;
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

fn layernorm_backward_cases(r: &mut Rng) -> Vec<Case> {
    use ops::layernorm::{layernorm_backward_scratch_bytes, LayerNormBackwardParams};
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

fn relu_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
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
                params: bytemuck::bytes_of(&ops::relu::ReluParams { n: n as u64 }).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

fn bias_rows_cases(r: &mut Rng) -> Vec<Case> {
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
                    params: bytemuck::bytes_of(&ops::bias::BiasParams {
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

fn bias_grad_cases(r: &mut Rng) -> Vec<Case> {
    use ops::bias::{bias_grad_scratch_bytes, BiasGradParams};
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

fn add_cases(r: &mut Rng, in_place: bool) -> Vec<Case> {
    use ops::elementwise::AddParams;
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

fn scale_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in FLOATS {
        for n in SIZES {
            let alpha = r.unit() * 5.0;
            v.push(Case {
                label: format!("{d} n={n} alpha {alpha}"),
                operands: vec![Some((d, r.floats(n, 4.0, d)))],
                params: bytemuck::bytes_of(&ops::elementwise::ScaleParams {
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

fn fill_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for n in SIZES {
            let value = r.unit() as f64 * 100.0;
            v.push(Case {
                label: format!("{d} n={n} value {value}"),
                operands: vec![Some((d, r.garbage(n * d.size())))],
                params: bytemuck::bytes_of(&ops::elementwise::FillParams {
                    n: n as u64,
                    bits: ops::elementwise::fill_bits(value, d).unwrap(),
                })
                .to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

/// The cases of op `name`, or `None` for an op this test does not know (a failure).
fn cases(name: &str, r: &mut Rng) -> Option<Vec<Case>> {
    Some(match name {
        "cast" => cast_cases(r),
        "accumulate" => accumulate_cases(r),
        "adam" => adam_cases(r, false),
        "adam_in_place" => adam_cases(r, true),
        "grad_stats" => grad_stats_cases(r),
        "embedding_bag" => bag_cases(r),
        "embedding_backward" => backward_cases(r),
        "embedding_step" => step_cases(r),
        "gather_rows" => rows_cases(r, false),
        "scatter_rows" => rows_cases(r, true),
        "gelu_forward" => gelu_cases(r, false),
        "gelu_backward" => gelu_cases(r, true),
        "qkv_split" => heads_cases(r, 1, true, false),
        "qkv_merge" => heads_cases(r, 3, false, true),
        "heads_merge" | "heads_split" => heads_cases(r, 1, false, false),
        "gemm" => gemm_cases(r),
        "interaction_forward" => interaction_cases(r, false),
        "interaction_backward" => interaction_cases(r, true),
        "bce_with_logits" => bce_cases(r),
        "softmax_forward" => softmax_cases(r, false),
        "softmax_backward" => softmax_cases(r, true),
        "cross_entropy_forward" => cross_entropy_cases(r),
        "cross_entropy_forward_backward" => cross_entropy_cases(r),
        "encoder_forward" => encoder_cases(r, false),
        "encoder_backward" => encoder_cases(r, true),
        "layernorm_forward" => layernorm_forward_cases(r),
        "layernorm_backward" => layernorm_backward_cases(r),
        "relu_forward" => relu_cases(r, false),
        "relu_backward" => relu_cases(r, true),
        "bias_rows" => bias_rows_cases(r),
        "bias_grad" => bias_grad_cases(r),
        "add" => add_cases(r, false),
        "add_in_place" => add_cases(r, true),
        "scale" => scale_cases(r),
        "fill" => fill_cases(r),
        _ => return None,
    })
}

/// Runs one case on `dev`; returns the written operands' bytes, in signature order.
fn run(dev: &Device, desc: &'static KernelDesc, case: &Case) -> Vec<Vec<u8>> {
    let s = dev.new_stream().unwrap();
    let bufs: Vec<Option<(DType, DeviceBuffer)>> = case
        .operands
        .iter()
        .map(|o| {
            o.as_ref().map(|(d, bytes)| {
                let b = dev.alloc(bytes.len()).unwrap();
                if !bytes.is_empty() {
                    dev.copy_h2d(
                        &s,
                        tidemem::device::HostBuffer::from_slice(bytes).unwrap(),
                        &b,
                    )
                    .unwrap()
                    .wait()
                    .unwrap();
                }
                (*d, b)
            })
        })
        .collect();
    let ops: Vec<Option<Operand<'_>>> = bufs
        .iter()
        .map(|b| b.as_ref().map(|(d, b)| Operand::new(b, *d)))
        .collect();
    dev.launch(&s, desc, &ops, &case.params)
        .unwrap_or_else(|e| panic!("{} {}: {e}", desc.name, case.label));
    let mut out = vec![];
    for (spec, b) in desc.operands.iter().zip(&bufs) {
        if let (true, Some((_, b))) = (spec.mode.writes(), b) {
            out.push(if b.is_empty() {
                vec![]
            } else {
                dev.download(&s, b).unwrap()
            });
        }
    }
    dev.sync_stream(&s)
        .unwrap_or_else(|e| panic!("{} {}: {e}", desc.name, case.label));
    out
}

fn as_f64(bytes: &[u8], d: DType) -> Vec<f64> {
    match d {
        DType::F64 => bytemuck::pod_collect_to_vec::<u8, f64>(bytes),
        DType::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(bytes)
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F16 => bytemuck::pod_collect_to_vec::<u8, f16>(bytes)
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::BF16 => bytemuck::pod_collect_to_vec::<u8, bf16>(bytes)
            .into_iter()
            .map(f64::from)
            .collect(),
        other => panic!("no float comparison for {other}"),
    }
}

fn compare(desc: &KernelDesc, case: &Case, twin: &[Vec<u8>], cuda: &[Vec<u8>]) {
    let written: Vec<DType> = desc
        .operands
        .iter()
        .zip(&case.operands)
        .filter(|(s, o)| s.mode.writes() && o.is_some())
        .map(|(_, o)| o.as_ref().unwrap().0)
        .collect();
    for ((t, c), d) in twin.iter().zip(cuda).zip(written) {
        let what = format!("{} {}", desc.name, case.label);
        match case.agree {
            Agree::Exact => assert!(t == c, "{what}: twin and CUDA differ"),
            Agree::Close { abs, rel } => {
                // grad_stats: only the two results, not the scratch.
                let n = if desc.name == "grad_stats" {
                    16
                } else {
                    t.len()
                };
                let (a, b) = (as_f64(&t[..n], d), as_f64(&c[..n], d));
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        (x - y).abs() <= abs + rel * y.abs() || (x.is_nan() && y.is_nan()),
                        "{what}: element {i}: twin {x} vs CUDA {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_op_has_cases_and_its_twin_runs_them() {
    let sim = common::sim(64 << 20);
    let mut r = Rng(7);
    for desc in ops::registry() {
        let cases = cases(desc.name, &mut r)
            .unwrap_or_else(|| panic!("op {} has no conformance cases", desc.name));
        assert!(!cases.is_empty());
        for case in &cases {
            run(&sim, desc, case);
        }
    }
}

#[test]
fn every_op_twin_agrees_with_cuda() {
    let Some(gpu) = common::cuda("conformance") else {
        return;
    };
    let sim = common::sim(64 << 20);
    let mut r = Rng(11);
    let mut ran = 0;
    for desc in ops::registry() {
        for case in cases(desc.name, &mut r).unwrap() {
            let (t, c) = (run(&sim, desc, &case), run(&gpu, desc, &case));
            compare(desc, &case, &t, &c);
            ran += 1;
        }
    }
    eprintln!("{ran} cases agree");
}

#[test]
fn names_are_unique_and_signatures_sane() {
    let mut names: Vec<&str> = ops::registry().iter().map(|d| d.name).collect();
    names.sort_unstable();
    let n = names.len();
    names.dedup();
    assert_eq!(names.len(), n, "two ops share a name");
    for d in ops::registry() {
        assert!(
            d.operands.iter().any(|o| o.mode.writes()),
            "{} writes nothing",
            d.name
        );
        assert!(
            d.operands.iter().all(|o| !o.dtypes.is_empty()),
            "{}",
            d.name
        );
        assert!(d.params.size > 0 && d.params.fields.iter().all(|f| f.1 < d.params.size));
    }
}

/// GEMM: every transpose pair on sizes 0, 1, odd and past a tile, padded leading dimensions,
/// strided and broadcast batches, several (alpha, beta) with NaN in C where beta = 0, TF32 on
/// f32. Inputs and C in [-1, 1]. Twin and CUDA each sum k products in their own order: with
/// u = 2⁻²⁴, each is within (k + 4)·u·S of the exact value (S = |alpha|·k + |beta|, the largest
/// Σ|a||b|-term these inputs allow), CUDA within twice that (tensor cores may truncate), so
/// abs = 3·(k + 4)·u·S; TF32 adds 2·2⁻¹⁰·|alpha|·k (each side's rounding of the inputs, to
/// nearest or truncated). C stored as f16/bf16 is then rounded once by each side from values
/// that close: at most one ulp apart, rel = 2⁻¹⁰ (f16) or 2⁻⁷ (bf16), and f16 subnormals' ulp
/// 2⁻²⁴ on abs.
fn gemm_cases(r: &mut Rng) -> Vec<Case> {
    use ops::gemm::Gemm;
    let sizes = [
        (0, 3, 4),
        (3, 0, 2),
        (2, 3, 0),
        (1, 1, 1),
        (7, 5, 3),
        (33, 17, 65),
        (64, 48, 96),
    ];
    let scalars = [(1.0f32, 0.0f32), (-0.5, 1.0), (2.0, 0.25)];
    let mut shapes = vec![];
    for (i, &(m, n, k)) in sizes.iter().enumerate() {
        for (j, (ta, tb)) in [(false, false), (false, true), (true, false), (true, true)]
            .into_iter()
            .enumerate()
        {
            let (alpha, beta) = scalars[(i + j) % scalars.len()];
            let mut g = Gemm::new(m, n, k)
                .trans_a(ta)
                .trans_b(tb)
                .alpha(alpha)
                .beta(beta);
            if (i + j) % 2 == 1 {
                let lda = if ta { m } else { k };
                let ldb = if tb { k } else { n };
                g = g.ld(lda + 2, ldb + 1, n + 3);
            }
            shapes.push(g);
        }
    }
    let (m, n, k) = (9, 13, 21);
    shapes.push(
        Gemm::new(m, n, k)
            .batched(3, m * k + 4, 0, m * n + 2)
            .beta(0.5),
    );
    shapes.push(
        Gemm::new(m, n, k)
            .trans_b(true)
            .ld(k, k, 2 * n)
            .batched(2, 0, n * k, n),
    );
    let mut v = vec![];
    for d in FLOATS {
        for (i, g) in shapes.iter().enumerate() {
            let tf32 = d == DType::F32 && i % 5 == 0;
            let g = g.tf32(tf32);
            let p = g.params();
            let ta = p.flags & ops::gemm::GemmParams::TRANS_A != 0;
            let tb = p.flags & ops::gemm::GemmParams::TRANS_B != 0;
            let ext = |rows: u64, cols: u64, ld: u64, stride: u64| -> usize {
                if rows == 0 || cols == 0 || p.batch == 0 {
                    1
                } else {
                    ((p.batch - 1) * stride + (rows - 1) * ld + cols) as usize
                }
            };
            let (ar, ac) = if ta { (p.k, p.m) } else { (p.m, p.k) };
            let (br, bc) = if tb { (p.n, p.k) } else { (p.k, p.n) };
            let nc = ext(p.m, p.n, p.ldc, p.stride_c);
            let c = if p.beta == 0.0 {
                encode(&vec![f32::NAN; nc], d)
            } else {
                r.floats(nc, 1.0, d)
            };
            let u = 2f64.powi(-24);
            let s = (p.alpha.abs() as f64) * p.k as f64 + p.beta.abs() as f64;
            let tf = if tf32 {
                2.0 * 2f64.powi(-10) * (p.alpha.abs() as f64) * p.k as f64
            } else {
                0.0
            };
            let (rel, sub) = match d {
                DType::F16 => (2f64.powi(-10), 2f64.powi(-24)),
                DType::BF16 => (2f64.powi(-7), 0.0),
                _ => (0.0, 0.0),
            };
            v.push(Case {
                label: format!("{d} {g:?}"),
                operands: vec![
                    Some((d, r.floats(ext(ar, ac, p.lda, p.stride_a), 1.0, d))),
                    Some((d, r.floats(ext(br, bc, p.ldb, p.stride_b), 1.0, d))),
                    Some((d, c)),
                ],
                params: bytemuck::bytes_of(&p).to_vec(),
                agree: Agree::Close {
                    abs: 3.0 * (p.k as f64 + 4.0) * u * s + tf + sub,
                    rel,
                },
            });
        }
    }
    v
}
