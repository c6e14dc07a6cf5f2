//! The row copy (`ops::copy_rows`) on every backend here: against a host copy of the same
//! rows, bit for bit (NaN payloads and −0 included: it moves words), on shapes from none past
//! one block, with and without index arrays, strides wider than the rows, destination views
//! starting mid-row (a column block); and bad input (a width past a stride, index arrays of the
//! wrong length, indices past a view, repeated destination indices, views too small, an
//! overlap) refused with a typed error and nothing written.

mod common;
mod ops_util;

use ops_util::*;
use tidemem::ops::{copy_rows, CopyRows, RowIndex};

/// `dst` after the copy, on the host.
#[allow(clippy::too_many_arguments)]
fn host_copy(
    src: &[u32],
    dst: &mut [u32],
    n: usize,
    width: usize,
    ss: usize,
    ds: usize,
    si: Option<&[u32]>,
    di: Option<&[u32]>,
) {
    for i in 0..n {
        let s = si.map_or(i, |v| v[i] as usize);
        let d = di.map_or(i, |v| v[i] as usize);
        dst[d * ds..d * ds + width].copy_from_slice(&src[s * ss..s * ss + width]);
    }
}

fn words(b: &[u8]) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(b)
}

fn shuffled(rng: &mut SplitMix64, m: usize, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..m as u32).collect();
    for i in (1..m).rev() {
        v.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    v.truncate(n);
    v
}

#[test]
fn copies_match_a_host_copy_bitwise() {
    let mut rng = SplitMix64::new(3);
    for dev in common::devices("copy_rows") {
        let s = dev.new_stream().unwrap();
        // (rows, width, src stride, dst stride, column offset into dst)
        for (n, width, ss, ds, c0) in [
            (0usize, 4usize, 4usize, 4usize, 0usize),
            (1, 1, 1, 1, 0),
            (5, 3, 3, 7, 2),
            (33, 16, 16, 48, 16),
            (300, 31, 33, 31, 0),
            (1000, 5, 5, 10, 5),
            (70, 257, 257, 300, 40),
        ] {
            for (with_si, with_di) in [(false, false), (true, false), (false, true), (true, true)] {
                let (src_rows, dst_rows) = (n + 2, n + 3);
                let src = rng.bytes(src_rows * ss * 4);
                let dst = rng.bytes((dst_rows * ds) * 4);
                // repeats allowed in the source, distinct destinations
                let si: Vec<u32> = (0..n)
                    .map(|_| (rng.next_u64() % src_rows as u64) as u32)
                    .collect();
                let di = shuffled(&mut rng, dst_rows, n);
                let (sb, db) = (up(&dev, &s, &src), up(&dev, &s, &dst));
                let six = RowIndex::upload(&dev, &s, &si).unwrap();
                let dix = RowIndex::upload(&dev, &s, &di).unwrap();
                let plan = CopyRows {
                    n,
                    width,
                    src_stride: ss,
                    dst_stride: ds,
                    src_index: with_si.then_some(&six),
                    dst_index: with_di.then_some(&dix),
                };
                let view = db.view(c0 * 4, db.len() - c0 * 4).unwrap();
                copy_rows(&dev, &s, &sb, view, &plan).unwrap();
                let mut want = words(&dst);
                host_copy(
                    &words(&src),
                    &mut want[c0..],
                    n,
                    width,
                    ss,
                    ds,
                    with_si.then_some(&si[..]),
                    with_di.then_some(&di[..]),
                );
                let what = format!(
                    "{} n {n} width {width} strides {ss}/{ds} c0 {c0} index {with_si}/{with_di}",
                    dev.name()
                );
                assert_eq!(words(&down(&dev, &s, &db)), want, "{what}");
            }
        }
    }
}

#[test]
fn bad_input_is_refused_with_nothing_written() {
    for dev in common::devices("copy_rows_bad") {
        let s = dev.new_stream().unwrap();
        let src = up(&dev, &s, &[0x11; 6 * 4 * 4]); // 6 rows of 4
        let dst = up(&dev, &s, &[0x5a; 5 * 4 * 4]); // 5 rows of 4
        let ok = RowIndex::upload(&dev, &s, &[0, 4, 2]).unwrap();
        let far = RowIndex::upload(&dev, &s, &[0, 5, 2]).unwrap();
        let twice = RowIndex::upload(&dev, &s, &[1, 3, 1]).unwrap();
        let short = RowIndex::upload(&dev, &s, &[1, 3]).unwrap();
        let plan = |n, width, src_index, dst_index| CopyRows {
            n,
            width,
            src_stride: 4,
            dst_stride: 4,
            src_index,
            dst_index,
        };
        let cases: [(&str, CopyRows<'_>); 6] = [
            ("width past the strides", plan(3, 5, None, None)),
            (
                "index arrays of the wrong length",
                plan(3, 4, Some(&short), None),
            ),
            (
                "a destination index past the view",
                plan(3, 4, None, Some(&far)),
            ),
            (
                "repeated destination indices",
                plan(3, 4, None, Some(&twice)),
            ),
            ("a destination view too small", plan(6, 4, None, None)),
            ("a source view too small", plan(7, 4, None, None)),
        ];
        for (what, p) in cases {
            refused_run(&dev, &s, what, &[&dst], || {
                copy_rows(&dev, &s, &src, &dst, &p)
            });
        }
        // a source index past the source's rows (6 rows)
        let six = RowIndex::upload(&dev, &s, &[6, 0, 1]).unwrap();
        refused_run(&dev, &s, "a source index past the view", &[&dst], || {
            copy_rows(&dev, &s, &src, &dst, &plan(3, 4, Some(&six), Some(&ok)))
        });
        // a view cut short: the rows it holds count, not the buffer's
        let cut = dst.view(0, 4 * 4 * 4 - 4).unwrap(); // 3 whole rows and 3 floats
        refused_run(&dev, &s, "the last destination row cut", &[&dst], || {
            copy_rows(&dev, &s, &src, cut, &plan(3, 4, None, Some(&ok)))
        });
        // the source and destination overlapping
        let a = dst.view(0, 32).unwrap();
        let b = dst.view(16, 32).unwrap();
        refused_run(&dev, &s, "overlapping views", &[&dst], || {
            copy_rows(&dev, &s, a, b, &plan(1, 4, None, None))
        });
        // and a good call goes through
        copy_rows(&dev, &s, &src, &dst, &plan(3, 4, None, Some(&ok))).unwrap();
    }
}
