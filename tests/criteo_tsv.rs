//! The Criteo TSV reader against files written with known content, and the exact AUC against
//! a brute-force pairwise count.

use std::io::Cursor;

use proptest::prelude::*;
use tidemem::data::criteo::{
    dense_transform, hash_id, rows_from_batch, write_tsv, Malformed, CATEGORICAL_FEATURES,
    MAX_REPORTED_LINES,
};
use tidemem::data::criteo::{
    Dataset, IdMap, Synthetic, SyntheticConfig, TsvConfig, TsvReader, TsvRow, Vocabulary,
    DENSE_FEATURES,
};
use tidemem::metrics::{auc, log_loss};
use tidemem::rng::{Rng, Xoshiro256};
use tidemem::Error;

const CARD: u64 = 1000;

fn hashed() -> TsvConfig {
    TsvConfig {
        ids: IdMap::Hash,
        cardinalities: vec![CARD; CATEGORICAL_FEATURES],
    }
}

/// `n` rows with known values: negatives, zeros, large counts, missing columns, 8-digit hex.
fn known_rows(n: usize, seed: u64) -> Vec<TsvRow> {
    let mut rng = Xoshiro256::new(seed);
    (0..n)
        .map(|_| {
            let mut dense = [None; DENSE_FEATURES];
            for d in &mut dense {
                *d = match rng.below(6) {
                    0 => None,
                    1 => Some(-(rng.below(3) as i64) - 1),
                    2 => Some(0),
                    3 => Some(rng.below(1 << 40) as i64),
                    _ => Some(rng.below(100) as i64),
                };
            }
            let mut categorical = [None; CATEGORICAL_FEATURES];
            for c in &mut categorical {
                // A small value pool so the vocabulary sees repeats.
                *c = (rng.below(5) != 0).then(|| 0x1000_0000 + rng.below(7) as u32 * 0x0101_0101);
            }
            TsvRow {
                label: rng.below(2) as u8,
                dense,
                categorical,
            }
        })
        .collect()
}

fn text_of(rows: &[TsvRow]) -> String {
    let mut out = Vec::new();
    write_tsv(&mut out, rows).unwrap();
    String::from_utf8(out).unwrap()
}

fn read_all(
    text: &str,
    config: TsvConfig,
    n: usize,
) -> (
    Vec<tidemem::data::criteo::Batch>,
    TsvReader<Cursor<Vec<u8>>>,
) {
    let mut reader = TsvReader::new(Cursor::new(text.as_bytes().to_vec()), config).unwrap();
    let mut batches = Vec::new();
    while let Some(b) = reader.next_batch(n).unwrap() {
        batches.push(b);
    }
    (batches, reader)
}

/// Checks `batches` hold `rows` in order, ids through `id(table, value)`.
fn assert_rows(
    batches: &[tidemem::data::criteo::Batch],
    rows: &[TsvRow],
    id: impl Fn(usize, Option<u32>) -> u32,
) {
    let mut i = 0;
    for b in batches {
        assert_eq!(b.dense.len(), b.size * DENSE_FEATURES);
        assert_eq!(b.ids.len(), CATEGORICAL_FEATURES);
        for s in 0..b.size {
            let row = &rows[i];
            assert_eq!(b.labels[s], f32::from(row.label), "row {i}");
            for (j, &x) in row.dense.iter().enumerate() {
                let want = (x.unwrap_or(0).max(0) as f64).ln_1p() as f32;
                assert_eq!(
                    b.dense_row(s)[j].to_bits(),
                    want.to_bits(),
                    "row {i} dense {j}"
                );
            }
            for (t, &v) in row.categorical.iter().enumerate() {
                assert_eq!(b.ids[t][s], id(t, v), "row {i} table {t}");
            }
            i += 1;
        }
    }
    assert_eq!(i, rows.len());
}

#[test]
fn known_rows_round_trip_with_hashed_ids() {
    let rows = known_rows(300, 1);
    let (batches, reader) = read_all(&text_of(&rows), hashed(), 64);
    assert_eq!(
        batches.iter().map(|b| b.size).collect::<Vec<_>>(),
        [64, 64, 64, 64, 44]
    );
    assert_rows(&batches, &rows, |_, v| v.map_or(0, |v| hash_id(v, CARD)));
    let r = reader.report();
    assert_eq!((r.lines, r.samples, r.malformed), (300, 300, 0));
}

#[test]
fn hashed_ids_of_known_hex_values_are_fixed() {
    // mix64 (the SplitMix64 finalizer) of the value, modulo the cardinality.
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for (hex, v) in [
        ("68fd1e64", 0x68fd_1e64u32),
        ("00000000", 0),
        ("ffffffff", u32::MAX),
        ("05db9164", 0x05db_9164),
    ] {
        let mut cols = vec!["0".to_string(); 1 + DENSE_FEATURES];
        cols.extend(std::iter::repeat_n(hex.to_string(), CATEGORICAL_FEATURES));
        let cards: Vec<u64> = (0..CATEGORICAL_FEATURES as u64)
            .map(|t| 3 + t * 1_000_003)
            .collect();
        let config = TsvConfig {
            ids: IdMap::Hash,
            cardinalities: cards.clone(),
        };
        let (batches, _) = read_all(&(cols.join("\t") + "\n"), config, 8);
        for (t, &n) in cards.iter().enumerate() {
            assert_eq!(
                u64::from(batches[0].ids[t][0]),
                mix(u64::from(v)) % n,
                "{hex} table {t}"
            );
            assert_eq!(batches[0].ids[t][0], hash_id(v, n));
        }
    }
    // Upper-case digits and short values are the same numbers.
    let line = |hex: &str| {
        let mut cols = vec!["1".to_string(); 1 + DENSE_FEATURES];
        cols.extend(std::iter::repeat_n(hex.to_string(), CATEGORICAL_FEATURES));
        cols.join("\t")
    };
    let (b, _) = read_all(
        &format!("{}\n{}\n", line("00ABCDEF"), line("abcdef")),
        hashed(),
        8,
    );
    assert_eq!(b[0].ids[5][0], hash_id(0xabcdef, CARD));
    assert_eq!(b[0].ids[5][1], hash_id(0xabcdef, CARD));
}

#[test]
fn vocabulary_ids_follow_frequency_then_first_appearance() {
    let rows = known_rows(400, 2);
    let text = text_of(&rows);
    let cards = vec![6u64; CATEGORICAL_FEATURES]; // 4 values kept of 7: the rest are OOV
    let (vocab, report) = Vocabulary::build(Cursor::new(text.clone()), &cards).unwrap();
    assert_eq!((report.samples, report.malformed), (400, 0));

    // The expected numbering, recomputed from the rows.
    let expect: Vec<Vec<(u32, u32)>> = (0..CATEGORICAL_FEATURES)
        .map(|t| {
            let mut seen: Vec<(u32, u64, usize)> = Vec::new();
            for r in &rows {
                if let Some(v) = r.categorical[t] {
                    match seen.iter_mut().find(|e| e.0 == v) {
                        Some(e) => e.1 += 1,
                        None => {
                            let k = seen.len();
                            seen.push((v, 1, k))
                        }
                    }
                }
            }
            seen.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
            seen.iter()
                .take(4)
                .zip(2..)
                .map(|(e, id)| (e.0, id))
                .collect()
        })
        .collect();
    let id = |t: usize, v: Option<u32>| match v {
        None => Vocabulary::MISSING,
        Some(v) => expect[t]
            .iter()
            .find(|e| e.0 == v)
            .map_or(Vocabulary::OOV, |e| e.1),
    };
    for t in 0..CATEGORICAL_FEATURES {
        assert_eq!(vocab.len(t), 4);
    }
    let config = TsvConfig {
        ids: IdMap::Vocabulary(vocab.clone()),
        cardinalities: cards,
    };
    let (batches, _) = read_all(&text, config, 100);
    assert_rows(&batches, &rows, id);
    assert!(batches
        .iter()
        .all(|b| b.ids.iter().flatten().all(|&i| i < 6)));
    assert_eq!(vocab.id(0, Some(0xdead_beef)), Vocabulary::OOV);

    // A vocabulary built for other cardinalities is refused.
    let wrong = TsvConfig {
        ids: IdMap::Vocabulary(vocab),
        cardinalities: vec![7; CATEGORICAL_FEATURES],
    };
    assert!(matches!(
        TsvReader::new(Cursor::new(Vec::new()), wrong),
        Err(Error::Conflict { .. })
    ));
}

#[test]
fn malformed_lines_are_skipped_counted_and_numbered() {
    let rows = known_rows(50, 3);
    let good: Vec<String> = rows.iter().map(TsvRow::to_line).collect();
    let with = |i: usize, col: usize, val: &str| {
        let mut cols: Vec<String> = good[i].split('\t').map(str::to_string).collect();
        cols[col] = val.to_string();
        cols.join("\t")
    };
    // (1-based line number in the file, line, kind)
    let bad: Vec<(String, Malformed)> = vec![
        (
            good[0].rsplit_once('\t').unwrap().0.to_string(),
            Malformed::ColumnCount { found: 39 },
        ),
        (good[1].clone() + "\t", Malformed::ColumnCount { found: 41 }),
        (String::new(), Malformed::ColumnCount { found: 1 }),
        (with(2, 0, "2"), Malformed::Label),
        (with(3, 0, ""), Malformed::Label),
        (with(4, 0, "0.5"), Malformed::Label),
        (with(5, 1, "1.5"), Malformed::Dense { column: 0 }),
        (with(6, 13, "x"), Malformed::Dense { column: 12 }),
        (
            with(7, 4, "99999999999999999999"),
            Malformed::Dense { column: 3 },
        ),
        (with(8, 3, "-"), Malformed::Dense { column: 2 }),
        (
            with(9, 14, "68fd1e6g"),
            Malformed::Categorical { column: 0 },
        ),
        (
            with(10, 39, "123456789"),
            Malformed::Categorical { column: 25 },
        ),
        (with(11, 20, "+abc"), Malformed::Categorical { column: 6 }),
    ];
    let mut lines = Vec::new();
    let mut expect = Vec::new();
    let mut bad_iter = bad.into_iter();
    for (i, g) in good.iter().enumerate() {
        lines.push(g.clone());
        if i % 3 == 1 {
            if let Some((line, kind)) = bad_iter.next() {
                lines.push(line);
                expect.push((lines.len() as u64, kind));
            }
        }
    }
    assert_eq!(expect.len(), 13);
    // Non-UTF-8 bytes in a dense column, at the end, with a CRLF line before it.
    let mut text = lines.join("\n").into_bytes();
    text.extend_from_slice(b"\n");
    let crlf = good[12].clone() + "\r\n";
    text.extend_from_slice(crlf.as_bytes());
    let mut utf = with(13, 2, "").into_bytes();
    let pos = utf.iter().position(|&b| b == b'\t').unwrap() + 1; // dense column 0
    utf.splice(pos..pos, [0xff, 0xfe]);
    text.extend_from_slice(&utf);
    expect.push((lines.len() as u64 + 2, Malformed::Dense { column: 0 }));

    let mut reader = TsvReader::new(Cursor::new(text), hashed()).unwrap();
    let mut batches = Vec::new();
    while let Some(b) = reader.next_batch(7).unwrap() {
        batches.push(b);
    }
    let mut want_rows = rows.clone();
    want_rows.push(rows[12].clone());
    assert_rows(&batches, &want_rows, |_, v| {
        v.map_or(0, |v| hash_id(v, CARD))
    });
    let r = reader.report();
    assert_eq!(r.malformed, expect.len() as u64);
    assert_eq!(r.samples, 51);
    assert_eq!(r.lines, 51 + expect.len() as u64);
    let got: Vec<(u64, Malformed)> = r.malformed_lines.iter().map(|m| (m.line, m.kind)).collect();
    assert_eq!(got, expect);
}

#[test]
fn the_report_keeps_the_first_hundred_line_numbers_and_counts_all() {
    let good = known_rows(1, 4)[0].to_line();
    let mut text = String::new();
    for i in 0..250 {
        text.push_str(if i % 2 == 0 { "garbage" } else { &good });
        text.push('\n');
    }
    let (batches, reader) = read_all(&text, hashed(), 1000);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].size, 125);
    let r = reader.report();
    assert_eq!(r.malformed, 125);
    assert_eq!(r.malformed_lines.len(), MAX_REPORTED_LINES);
    let lines: Vec<u64> = r.malformed_lines.iter().map(|m| m.line).collect();
    assert_eq!(lines, (0..100).map(|i| 2 * i + 1).collect::<Vec<u64>>());
}

#[test]
fn missing_columns_give_zero_dense_and_the_missing_id() {
    let line = "0".to_string() + &"\t".repeat(COLUMNS_MINUS_ONE);
    let (b, _) = read_all(&(line.clone() + "\n"), hashed(), 4);
    assert_eq!(b[0].size, 1);
    assert!(b[0].dense.iter().all(|&x| x == 0.0));
    assert!(b[0].ids.iter().all(|c| c == &[0]));
    let (vocab, _) = Vocabulary::build(Cursor::new(line.clone()), &[10; 26]).unwrap();
    assert!(vocab.is_empty());
    let config = TsvConfig {
        ids: IdMap::Vocabulary(vocab),
        cardinalities: vec![10; 26],
    };
    let (b, _) = read_all(&line, config, 4); // no final newline
    assert!(b[0].ids.iter().all(|c| c == &[Vocabulary::MISSING]));
    assert_eq!(dense_transform(None), 0.0);
}

const COLUMNS_MINUS_ONE: usize = DENSE_FEATURES + CATEGORICAL_FEATURES;

#[test]
fn empty_input_gives_no_batch_and_bad_configs_are_refused() {
    let mut r = TsvReader::new(Cursor::new(Vec::new()), hashed()).unwrap();
    assert!(r.next_batch(16).unwrap().is_none());
    assert!(r.next_batch(16).unwrap().is_none());
    assert_eq!(r.report().lines, 0);
    assert!(matches!(
        r.next_batch(0),
        Err(Error::TooFew {
            got: 0,
            need: 1,
            ..
        })
    ));
    // A huge batch size does not reserve memory for samples that never come.
    let text = text_of(&known_rows(3, 9));
    let (b, _) = read_all(&text, hashed(), usize::MAX);
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].size, 3);
    for cards in [vec![10; 25], vec![0; 26], vec![(1 << 32) + 1; 26]] {
        let c = TsvConfig {
            ids: IdMap::Hash,
            cardinalities: cards.clone(),
        };
        assert!(
            TsvReader::new(Cursor::new(Vec::new()), c).is_err(),
            "{cards:?}"
        );
    }
    assert!(Vocabulary::build(Cursor::new(""), &[1; 26]).is_err());
    let bad = TsvRow {
        label: 2,
        dense: [None; 13],
        categorical: [None; 26],
    };
    let mut out = Vec::new();
    assert!(write_tsv(&mut out, &[bad]).is_err());
    assert!(out.is_empty());
}

#[test]
fn synthetic_batches_written_as_tsv_read_back() {
    let gen = Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.001)
            .with_seed(5),
    )
    .unwrap();
    let batch = gen.batch(0, 200);
    let rows = rows_from_batch(&batch).unwrap();
    let config = TsvConfig {
        ids: IdMap::Hash,
        cardinalities: gen.cardinalities().to_vec(),
    };
    let (b, _) = read_all(&text_of(&rows), config, 200);
    assert_eq!(b[0].labels, batch.labels);
    for (x, y) in b[0].dense.iter().zip(&batch.dense) {
        assert!((x - y).abs() <= 1e-6 * y.max(1.0), "{x} vs {y}");
    }
    for t in 0..CATEGORICAL_FEATURES {
        for s in 0..200 {
            assert_eq!(
                b[0].ids[t][s],
                hash_id(batch.ids[t][s], gen.cardinalities()[t])
            );
        }
    }
}

/// The pairwise definition: P(score_pos > score_neg) + P(tie) / 2.
fn brute_auc(scores: &[f32], labels: &[u8]) -> Option<f64> {
    let (mut num, mut pairs) = (0.0, 0u64);
    for (i, &yi) in labels.iter().enumerate() {
        for (j, &yj) in labels.iter().enumerate() {
            if yi == 1 && yj == 0 {
                pairs += 1;
                if scores[i] > scores[j] {
                    num += 1.0;
                } else if scores[i] == scores[j] {
                    num += 0.5;
                }
            }
        }
    }
    (pairs > 0).then(|| num / pairs as f64)
}

proptest! {
    #[test]
    fn auc_equals_the_pairwise_count(
        data in proptest::collection::vec((0u8..6, 0u8..2), 0..60)
    ) {
        // Scores from a few levels so that ties are common.
        let scores: Vec<f32> = data.iter().map(|&(s, _)| f32::from(s) * 0.25 - 0.5).collect();
        let labels: Vec<u8> = data.iter().map(|&(_, y)| y).collect();
        let got = auc(&scores, &labels).unwrap();
        let want = brute_auc(&scores, &labels);
        match (got, want) {
            (Some(g), Some(w)) => prop_assert!((g - w).abs() < 1e-12, "{} vs {}", g, w),
            (g, w) => prop_assert_eq!(g, w),
        }
        let flabels: Vec<f32> = labels.iter().map(|&y| f32::from(y)).collect();
        prop_assert_eq!(auc(&scores, &flabels).unwrap(), got);
    }
}

#[test]
fn auc_of_orderings_ties_and_bad_input() {
    let scores: Vec<f32> = (0..100).map(|i| i as f32).collect();
    let labels: Vec<u8> = (0..100).map(|i| u8::from(i >= 60)).collect();
    assert_eq!(auc(&scores, &labels).unwrap(), Some(1.0));
    let reversed: Vec<f32> = scores.iter().map(|s| -s).collect();
    assert_eq!(auc(&reversed, &labels).unwrap(), Some(0.0));
    assert_eq!(auc(&[0.3; 100], &labels).unwrap(), Some(0.5));
    assert_eq!(auc(&[0.0, -0.0], &[0u8, 1]).unwrap(), Some(0.5));
    assert_eq!(
        auc(&[f32::NEG_INFINITY, f32::INFINITY], &[false, true]).unwrap(),
        Some(1.0)
    );
    assert_eq!(auc::<u8>(&[], &[]).unwrap(), None);
    assert_eq!(auc(&[0.1, 0.2], &[0u8, 0]).unwrap(), None);

    assert!(matches!(
        auc(&[0.1, 0.2], &[0u8]),
        Err(Error::Length {
            got: 1,
            expected: 2,
            ..
        })
    ));
    let bad = |r: tidemem::Result<Option<f64>>| matches!(r, Err(Error::BadValue { .. }));
    assert!(bad(auc(&[0.1, f32::NAN], &[0u8, 1])));
    assert!(matches!(
        auc(&[0.1, 0.2], &[0u8, 2]),
        Err(Error::BadValue { value, .. }) if value == 2.0
    ));
    assert!(bad(auc(&[0.1, 0.2], &[0.0f32, 0.5])));
    assert!(bad(auc(&[0.1, 0.2], &[0.0f32, f32::NAN])));
}

#[test]
fn log_loss_clamps_and_checks() {
    let l = log_loss(&[1.0, 0.0], &[1u8, 0]).unwrap();
    assert!((l - -(1.0f64 - 1e-7).ln()).abs() < 1e-15, "{l}");
    let l = log_loss(&[0.0], &[1u8]).unwrap();
    assert!((l - -(1e-7f64).ln()).abs() < 1e-12, "{l}");
    let l = log_loss(&[0.25, 0.75], &[0.0f32, 0.0]).unwrap();
    let want = -((0.75f64).ln() + (0.25f64).ln()) / 2.0;
    assert!((l - want).abs() < 1e-12);
    assert!(matches!(log_loss::<u8>(&[], &[]), Err(Error::Empty { .. })));
    assert!(matches!(
        log_loss(&[0.5], &[0u8, 1]),
        Err(Error::Length {
            got: 2,
            expected: 1,
            ..
        })
    ));
    let bad = |r: tidemem::Result<f64>| matches!(r, Err(Error::BadValue { .. }));
    assert!(bad(log_loss(&[f32::NAN], &[0u8])));
    assert!(matches!(
        log_loss(&[1.5], &[0u8]),
        Err(Error::BadValue { value, .. }) if value == 1.5
    ));
    assert!(bad(log_loss(&[0.5], &[3u8])));
}
