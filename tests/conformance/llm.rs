//! Cases of the transformer ops: GELU, the attention layouts, softmax, cross-entropy, the encoder and GEMM.

use super::*;

pub(super) fn gelu_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
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
                params: bytemuck::bytes_of(&ops::abi::GeluParams { n: n as u64 }).to_vec(),
                // tanh is math.cuh's, not the libm's: the same bits everywhere.
                agree: Agree::Exact,
            });
        }
    }
    v
}

/// The attention layouts: `name` moves `ins` tensors into `outs` (the interleaved one holds
/// three parts when `qkv`).
pub(super) fn heads_cases(r: &mut Rng, ins: usize, qkv_in: bool, qkv_out: bool) -> Vec<Case> {
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

/// `bh` matrices of `rows × cols` `d` elements, row `i` seeing the columns `j ≤ offset + i`:
/// random floats of `scale` there, garbage bits past them (never read).
fn causal_block(r: &mut Rng, (bh, rows, cols, offset): Block, scale: f32, d: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(bh * rows * cols * d.size());
    for _ in 0..bh {
        for i in 0..rows {
            for j in 0..cols {
                if j <= offset + i {
                    out.extend(r.floats(1, scale, d));
                } else {
                    out.extend(r.garbage(d.size()));
                }
            }
        }
    }
    out
}

/// A block of softmax rows: `(bh, rows, cols, offset)`.
type Block = (usize, usize, usize, usize);

pub(super) fn softmax_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
    // The squares `[BH, T, T]` (offset 0), then blocks of rows of ring attention: rows < cols
    // at an offset, the last rows of a square, rows running past the columns, one row.
    let squares = [
        (0usize, 5usize, 0.125f32),
        (3, 0, 1.0),
        (1, 1, 0.125),
        (3, 7, 1.0),
        (2, 33, 0.125),
        (1, 64, 0.3),
        (2, 100, 0.125),
    ];
    let blocks: [(Block, f32); 6] = [
        ((2, 0, 9, 4), 1.0),
        ((2, 3, 9, 4), 1.0),
        ((3, 25, 100, 50), 0.125),
        ((1, 33, 130, 97), 0.3),
        ((2, 40, 70, 45), 0.125),
        ((3, 1, 65, 31), 1.0),
    ];
    let shapes = squares
        .iter()
        .map(|&(bh, t, scale)| ((bh, t, t, 0), scale))
        .chain(blocks);
    let mut v = vec![];
    for d in FLOATS {
        for (block @ (bh, rows, cols, offset), scale) in shapes.clone() {
            let mut operands = vec![];
            if backward {
                operands.push(Some((d, causal_block(r, block, 1.0, d))));
                operands.push(Some((d, causal_block(r, block, 2.0, d))));
            } else {
                operands.push(Some((d, causal_block(r, block, 12.0, d))));
            }
            operands.push(Some((d, r.garbage(bh * rows * cols * d.size()))));
            let p = ops::abi::SoftmaxParams {
                bh: bh as u64,
                rows: rows as u64,
                cols: cols as u64,
                offset: offset as u64,
                scale,
                pad: 0,
            };
            v.push(Case {
                label: format!("{d} [{bh}, {rows}, {cols}] offset {offset} scale {scale}"),
                operands,
                params: bytemuck::bytes_of(&p).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}

pub(super) fn cross_entropy_cases(r: &mut Rng) -> Vec<Case> {
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
            let p = ops::abi::CrossEntropyParams {
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
pub(super) const ENCODER_SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (0, 3, 4, 5, 3),
    (1, 1, 1, 1, 1),
    (2, 5, 7, 11, 8),
    (3, 17, 33, 50, 20),
    (2, 64, 130, 300, 64),
];

pub(super) fn encoder_cases(r: &mut Rng, backward: bool) -> Vec<Case> {
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
                let p = ops::abi::EncoderBackwardParams {
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
                let p = ops::abi::EncoderParams {
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

/// GEMM: every transpose pair on sizes 0, 1, odd and past a tile, padded leading dimensions,
/// strided and broadcast batches, several (alpha, beta) with NaN in C where beta = 0, TF32 on
/// f32. Inputs and C in [-1, 1]. Twin and CUDA each sum k products in their own order: with
/// u = 2⁻²⁴, each is within (k + 4)·u·S of the exact value (S = |alpha|·k + |beta|, the largest
/// Σ|a||b|-term these inputs allow), CUDA within twice that (tensor cores may truncate), so
/// abs = 3·(k + 4)·u·S; TF32 adds 2·2⁻¹⁰·|alpha|·k (each side's rounding of the inputs, to
/// nearest or truncated). C stored as f16/bf16 is then rounded once by each side from values
/// that close: at most one ulp apart, rel = 2⁻¹⁰ (f16) or 2⁻⁷ (bf16), and f16 subnormals' ulp
/// 2⁻²⁴ on abs.
pub(super) fn gemm_cases(r: &mut Rng) -> Vec<Case> {
    use ops::Gemm;
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
            let ta = p.flags & ops::abi::GemmParams::TRANS_A != 0;
            let tb = p.flags & ops::abi::GemmParams::TRANS_B != 0;
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
