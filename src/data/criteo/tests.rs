use std::collections::{HashMap, HashSet};

use super::*;

fn gen(config: SyntheticConfig) -> Synthetic {
    Synthetic::new(config).expect("valid config")
}

/// The setting a refused config names: a value out of range or a count below 1.
fn invalid(config: SyntheticConfig) -> String {
    match Synthetic::new(config) {
        Err(Error::BadValue { what, .. } | Error::TooFew { what, .. }) => what,
        other => panic!("expected BadValue or TooFew, got {other:?}"),
    }
}

/// The `k` ids with the highest counts (ties broken by id, so the result is deterministic).
fn hottest(counts: &HashMap<u32, u64>, k: usize) -> HashSet<u32> {
    let mut v: Vec<(u32, u64)> = counts.iter().map(|(&id, &c)| (id, c)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.into_iter().take(k).map(|(id, _)| id).collect()
}

fn count_table(
    g: &Synthetic,
    table: usize,
    batches: std::ops::Range<u64>,
    size: usize,
) -> HashMap<u32, u64> {
    let mut counts = HashMap::new();
    for i in batches {
        for &id in &g.batch(i, size).ids[table] {
            *counts.entry(id).or_insert(0) += 1;
        }
    }
    counts
}

#[test]
fn published_cardinalities() {
    let sum = |d: Dataset| d.cardinalities().iter().sum::<u64>();
    assert_eq!(Dataset::CriteoKaggle.cardinalities().len(), 26);
    assert_eq!(Dataset::Criteo1Tb.cardinalities().len(), 26);
    assert_eq!(Dataset::Avazu.cardinalities().len(), 13);
    assert_eq!(sum(Dataset::CriteoKaggle), 33_762_577);
    assert_eq!(sum(Dataset::Criteo1Tb), 177_944_275);
    assert_eq!(sum(Dataset::Avazu), 9_445_823);
    // Every id fits the u32 of `Batch::ids`.
    for d in Dataset::ALL {
        assert!(d
            .cardinalities()
            .iter()
            .all(|&n| n >= 1 && n <= u64::from(u32::MAX)));
    }
}

#[test]
fn dataset_names_round_trip() {
    for d in Dataset::ALL {
        assert_eq!(d.name().parse::<Dataset>().unwrap(), d);
        assert_eq!(d.to_string(), d.name());
        assert_eq!(d.name().to_uppercase().parse::<Dataset>().unwrap(), d);
    }
    assert_eq!(Dataset::Criteo1Tb.name(), "criteo-1tb");
    match "criteo".parse::<Dataset>() {
        Err(Error::Parse {
            what: "dataset",
            input,
            expected,
        }) => {
            assert_eq!(input, "criteo");
            for d in Dataset::ALL {
                assert!(expected.contains(d.name()), "{expected}");
            }
        }
        other => panic!("expected Parse, got {other:?}"),
    }
}

#[test]
fn rejects_bad_configs() {
    let base = SyntheticConfig::new(Dataset::Avazu);
    for zipf in [-0.5, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert!(invalid(base.clone().with_zipf(zipf)).contains("zipf"));
    }
    for scale in [0.0, -0.1, 1.0001, 2.0, f64::NAN, f64::INFINITY] {
        assert!(invalid(base.clone().with_scale(scale)).contains("scale"));
    }
    let drift = |batches_per_day, shift| {
        base.clone().with_drift(Drift {
            batches_per_day,
            shift,
        })
    };
    assert!(invalid(drift(0, 0.1)).contains("batches_per_day"));
    for shift in [-0.1, f64::NAN, f64::INFINITY] {
        assert!(invalid(drift(10, shift)).contains("shift"));
    }
    // The edges of the valid ranges are accepted.
    gen(base.clone().with_zipf(0.0).with_scale(1.0));
    gen(base.clone().with_scale(f64::MIN_POSITIVE));
    gen(drift(1, 0.0));
    gen(base.with_zipf(40.0));
}

#[test]
fn scale_shrinks_cardinalities() {
    let full = gen(SyntheticConfig::new(Dataset::CriteoKaggle));
    assert_eq!(full.cardinalities(), Dataset::CriteoKaggle.cardinalities());
    let half = gen(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.5));
    let expect: Vec<u64> = Dataset::CriteoKaggle
        .cardinalities()
        .iter()
        .map(|n| n.div_ceil(2))
        .collect();
    assert_eq!(half.cardinalities(), &expect[..]);
    assert_eq!(half.cardinalities()[1], 292); // ceil(583 / 2)
    let tiny = gen(SyntheticConfig::new(Dataset::Criteo1Tb).with_scale(1e-9));
    assert!(tiny.cardinalities().iter().all(|&n| n == 1));
    let small = gen(SyntheticConfig::new(Dataset::Criteo1Tb).with_scale(1e-3));
    assert_eq!(small.cardinalities()[0], 45_834); // ceil(45,833.188)
    assert_eq!(small.cardinalities()[5], 1); // ceil(0.003)
    assert_eq!(small.num_tables(), 26);

    let offsets = half.table_offsets();
    assert_eq!(offsets.len(), 27);
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[1], 730);
    assert_eq!(offsets[26], expect.iter().sum::<u64>());
    assert!(offsets
        .windows(2)
        .zip(&expect)
        .all(|(w, &n)| w[1] - w[0] == n));
}

#[test]
fn batches_are_deterministic() {
    let config = SyntheticConfig::new(Dataset::CriteoKaggle)
        .with_scale(0.01)
        .with_seed(3);
    let a = gen(config.clone());
    let first = a.batch(5, 300);
    assert_eq!(first.size, 300);
    assert_eq!(first, a.batch(5, 300));
    // Same batch from a fresh generator that produced other batches first.
    let b = gen(config.clone());
    for i in [9, 0, 4, 6] {
        b.batch(i, 77);
    }
    assert_eq!(b.batch(5, 300), first);
    // A shorter batch is a prefix of a longer one.
    let short = b.batch(5, 100);
    assert_eq!(short.dense[..], first.dense[..100 * DENSE_FEATURES]);
    assert_eq!(short.labels[..], first.labels[..100]);
    for t in 0..b.num_tables() {
        assert_eq!(short.ids[t][..], first.ids[t][..100]);
    }
    // Other index, other seed: other data.
    let other = a.batch(6, 300);
    assert_ne!(other.dense, first.dense);
    assert_ne!(other.ids[2], first.ids[2]);
    let reseeded = gen(config.with_seed(4)).batch(5, 300);
    assert_ne!(reseeded.dense, first.dense);
    assert_ne!(reseeded.ids[2], first.ids[2]);
    assert_ne!(reseeded.labels, first.labels);
    // The empty batch is well-formed.
    let empty = a.batch(0, 0);
    assert_eq!(empty.ids.len(), 26);
    assert!(empty.dense.is_empty() && empty.labels.is_empty() && empty.ids[0].is_empty());
}

#[test]
fn ids_stay_in_range() {
    for d in Dataset::ALL {
        for zipf in [0.0, 1.0, 2.0] {
            for scale in [1e-6, 1e-3] {
                let config = SyntheticConfig::new(d).with_scale(scale).with_zipf(zipf);
                let config = config.with_drift(Drift {
                    batches_per_day: 1,
                    shift: 0.37,
                });
                let g = gen(config);
                for index in 0..3 {
                    let batch = g.batch(index, 500);
                    assert_eq!(batch.ids.len(), g.num_tables());
                    for (ids, &n) in batch.ids.iter().zip(g.cardinalities()) {
                        assert_eq!(ids.len(), 500);
                        assert!(ids.iter().all(|&id| u64::from(id) < n), "{d} {n}");
                    }
                    assert_eq!(batch.dense.len(), 500 * DENSE_FEATURES);
                    assert!(batch.dense.iter().all(|x| x.is_finite() && *x >= 0.0));
                    assert!(batch.labels.iter().all(|&y| y == 0.0 || y == 1.0));
                }
            }
        }
    }
}

#[test]
fn hottest_id_is_scattered() {
    let g = gen(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.1));
    let mut zero_hottest = 0;
    let mut checked = 0;
    for (t, table) in g.tables.iter().enumerate() {
        if table.rows < 100 {
            continue;
        }
        let counts = count_table(&g, t, 0..2, 4096);
        let (&top, _) = counts
            .iter()
            .max_by_key(|&(&id, &c)| (c, std::cmp::Reverse(id)))
            .unwrap();
        assert_eq!(u64::from(top), table.perm.apply(0), "table {t}");
        zero_hottest += usize::from(top == 0);
        checked += 1;
    }
    assert!(checked >= 14);
    assert_eq!(zero_hottest, 0);
}

#[test]
fn dense_features_match_their_moments() {
    let g = gen(SyntheticConfig::new(Dataset::Avazu).with_seed(21));
    let batch = g.batch(0, 20_000);
    for j in 0..DENSE_FEATURES {
        let (mean, sd) = log_count_moments(g.count_scale[j]);
        let col: Vec<f64> = (0..batch.size)
            .map(|i| f64::from(batch.dense_row(i)[j]))
            .collect();
        let m = col.iter().sum::<f64>() / col.len() as f64;
        let v = col.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / col.len() as f64;
        assert!(
            (m - mean).abs() < 0.05 * sd,
            "feature {j}: mean {m} vs {mean}"
        );
        assert!(
            (v.sqrt() / sd - 1.0).abs() < 0.05,
            "feature {j}: sd {} vs {sd}",
            v.sqrt()
        );
    }
}

#[test]
fn labels_have_criteo_rate_and_signal() {
    let configs = [
        SyntheticConfig::new(Dataset::CriteoKaggle),
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.01)
            .with_seed(1),
        SyntheticConfig::new(Dataset::Criteo1Tb)
            .with_scale(0.001)
            .with_seed(2),
        SyntheticConfig::new(Dataset::Avazu)
            .with_scale(0.1)
            .with_seed(3),
        SyntheticConfig::new(Dataset::Avazu)
            .with_zipf(0.0)
            .with_seed(4),
    ];
    for config in configs {
        let g = gen(config.clone());
        let batch = g.batch(1, 16_384);
        let rate = batch.labels.iter().sum::<f32>() / batch.size as f32;
        assert!((0.15..=0.35).contains(&rate), "{config:?}: rate {rate}");

        let mut by_logit: Vec<(f64, f32)> = (0..batch.size)
            .map(|i| (g.true_logit(&batch, i), batch.labels[i]))
            .collect();
        by_logit.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (low, high) = by_logit.split_at(batch.size / 2);
        let mean =
            |v: &[(f64, f32)]| v.iter().map(|x| f64::from(x.1)).sum::<f64>() / v.len() as f64;
        let (low, high) = (mean(low), mean(high));
        assert!(high - low > 0.2, "{config:?}: {high} vs {low}");
    }
}

#[test]
fn drift_moves_the_hot_set() {
    let base = SyntheticConfig::new(Dataset::CriteoKaggle)
        .with_scale(0.1)
        .with_seed(8);
    let drifting = gen(base.clone().with_drift(Drift {
        batches_per_day: 4,
        shift: 0.05,
    }));
    let fixed = gen(base.clone());
    let table = 2; // about a million rows at this scale
    let overlap = |g: &Synthetic| {
        let day0 = hottest(&count_table(g, table, 0..4, 8192), 100);
        let day1 = hottest(&count_table(g, table, 4..8, 8192), 100);
        day0.intersection(&day1).count()
    };
    assert_eq!((drifting.day(3), drifting.day(4), fixed.day(4)), (0, 1, 0));
    let moved = overlap(&drifting);
    let stable = overlap(&fixed);
    assert!(moved < 10, "drifting hot sets overlap by {moved}");
    assert!(stable > 60, "fixed hot sets overlap by only {stable}");
    // Day 0 is the same with and without drift, and shift 0 is no drift at all.
    assert_eq!(drifting.batch(2, 256), fixed.batch(2, 256));
    let still = gen(base.with_drift(Drift {
        batches_per_day: 1,
        shift: 0.0,
    }));
    assert_eq!(still.batch(9, 256), fixed.batch(9, 256));
}

#[test]
fn rank_offset_follows_the_formula() {
    assert_eq!(rank_offset(0, 0.3, 1000), 0);
    assert_eq!(rank_offset(1, 0.3, 1000), 300);
    assert_eq!(rank_offset(2, 0.3, 1000), 600);
    assert_eq!(rank_offset(4, 0.3, 1000), 200); // 1200 mod 1000
    assert_eq!(rank_offset(4, 1.3, 1000), 200); // the integer part of shift does not matter
    assert_eq!(rank_offset(1, 0.1, 3), 0); // floor(0.3)
    assert_eq!(rank_offset(4, 0.1, 3), 1); // floor(1.2)
    assert!(rank_offset(u64::MAX, 0.999, 48_937_457) < 48_937_457);
    assert_eq!(rank_offset(7, 0.5, 1), 0);
}

#[test]
fn concat_ids_offsets_each_table() {
    let g = Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.001)).unwrap();
    let b = g.batch(3, 5);
    let ids = g.concat_ids(&b).unwrap();
    let offsets = g.table_offsets();
    assert_eq!(ids.len(), 5 * g.num_tables());
    for (t, col) in b.ids.iter().enumerate() {
        for (s, &id) in col.iter().enumerate() {
            let got = ids[t * 5 + s] as u64;
            assert_eq!(got, offsets[t] + id as u64);
            assert!(got < offsets[t + 1]);
        }
    }
}

#[test]
fn generator_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Synthetic>();
    assert_send_sync::<Batch>();
    let g = gen(SyntheticConfig::new(Dataset::Avazu).with_scale(0.01));
    let here = g.batch(12, 64);
    let there = std::thread::scope(|s| s.spawn(|| g.batch(12, 64)).join().unwrap());
    assert_eq!(here, there);
}

#[test]
fn batches_past_host_memory_are_refused_before_allocating() {
    let gen = Synthetic::new(SyntheticConfig::new(Dataset::Avazu).with_scale(0.001)).unwrap();
    let limit = crate::limits::host_limit();
    for size in [usize::MAX, limit as usize / 4 + 1] {
        match gen.try_batch(3, size) {
            Err(Error::TooLarge {
                what,
                requested,
                limit: l,
            }) => {
                assert_eq!(l, limit);
                assert!(requested > u128::from(limit));
                assert!(what.contains(&size.to_string()), "{what}");
            }
            other => panic!("{size}: {other:?}"),
        }
    }
    assert_eq!(gen.try_batch(3, 64).unwrap(), gen.batch(3, 64));
    assert_eq!(gen.try_batch(3, 0).unwrap().size, 0);
    assert_eq!(
        Batch::bytes_for(10, 13).unwrap(),
        10 * (DENSE_FEATURES + 1 + 13) * 4
    );
}
