//! Cases of the embedding kernels.

use super::*;

pub(super) fn bag_cases(r: &mut Rng) -> Vec<Case> {
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

pub(super) fn backward_cases(r: &mut Rng) -> Vec<Case> {
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

pub(super) fn step_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    // kind 3: Adam on 8-bit moments (random codes and scales); a row wider than a block of
    // threads too
    for kind in 0..4 {
        for (rows, dim, n) in [
            (4usize, 1usize, 0usize),
            (10, 3, 4),
            (50, 33, 20),
            (8, 300, 5),
        ] {
            let stride = dim + [0, 1, 2 * dim, (2 * dim).div_ceil(4) + 2][kind as usize];
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

pub(super) fn rows_cases(r: &mut Rng, scatter: bool) -> Vec<Case> {
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
