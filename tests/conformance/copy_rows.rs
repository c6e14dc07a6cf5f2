//! Cases of the row copy.

use super::*;
use tidemem::ops::abi::CopyRowsParams;

/// A shuffled `0..m` cut to `n` entries (distinct), some past `rows` when `m > rows`.
fn perm(r: &mut Rng, m: usize, n: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..m as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.below(i as u64 + 1) as usize);
    }
    ids.truncate(n);
    ids
}

pub(super) fn copy_rows_cases(r: &mut Rng) -> Vec<Case> {
    let mut v = vec![];
    // (rows, width, src stride, dst stride)
    for (n, width, ss, ds) in [
        (0usize, 3usize, 3usize, 5usize),
        (1, 1, 1, 1),
        (7, 5, 5, 13),
        (64, 33, 40, 33),
        (257, 3, 7, 3),
        (40, 0, 2, 2),
        (300, 300, 301, 300),
    ] {
        for (si, di) in [(false, false), (true, false), (false, true), (true, true)] {
            let (src_rows, dst_rows) = (n + 3, n + 5);
            let src = r.garbage((src_rows * ss) * 4);
            let dst = r.garbage((dst_rows * ds) * 4);
            // source indices may repeat; a few of either side out of range (skipped)
            let s_idx: Vec<u32> = (0..n)
                .map(|_| r.below(src_rows as u64 + 2) as u32)
                .collect();
            let d_idx = perm(r, dst_rows + 2, n);
            let p = CopyRowsParams {
                n: n as u64,
                width: width as u64,
                src_stride: ss as u64,
                dst_stride: ds as u64,
                src_rows: src_rows as u64,
                dst_rows: dst_rows as u64,
            };
            v.push(Case {
                label: format!("n {n} width {width} strides {ss}/{ds} index {si}/{di}"),
                operands: vec![
                    Some((DType::F32, src)),
                    si.then(|| (DType::U32, u32s(&s_idx))),
                    Some((DType::F32, dst)),
                    di.then(|| (DType::U32, u32s(&d_idx))),
                ],
                params: bytemuck::bytes_of(&p).to_vec(),
                agree: Agree::Exact,
            });
        }
    }
    v
}
