//! The synthetic Criteo-like generator through its public API, as the embedding cache, its
//! benches and the evaluation example use it.

use std::collections::HashSet;

use tidemem::data::criteo::{Batch, Dataset, Drift, Synthetic, SyntheticConfig, DENSE_FEATURES};
use tidemem::Error;

fn kaggle_small() -> Synthetic {
    Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.01)
            .with_seed(17),
    )
    .unwrap()
}

/// Area under the ROC curve of `scores` against 0/1 `labels` (rank statistic; no ties expected).
fn auroc(scores: &[f64], labels: &[f32]) -> f64 {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut positives) = (0.0, 0.0);
    for (rank, &i) in order.iter().enumerate() {
        if labels[i] == 1.0 {
            rank_sum += (rank + 1) as f64;
            positives += 1.0;
        }
    }
    let negatives = scores.len() as f64 - positives;
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

#[test]
fn batches_do_not_depend_on_order_or_thread() {
    let gen = kaggle_small();
    let sequential: Vec<Batch> = (0..8).map(|i| gen.batch(i, 512)).collect();
    let parallel: Vec<(u64, Batch)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8u64)
            .rev()
            .map(|i| {
                let gen = &gen;
                s.spawn(move || (i, gen.batch(i, 512)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, batch) in parallel {
        assert_eq!(batch, sequential[i as usize], "batch {i}");
    }
    // A clone generates the same data, and the batches are not all alike.
    assert_eq!(gen.clone().batch(3, 512), sequential[3]);
    assert_ne!(sequential[0], sequential[1]);
}

#[test]
fn one_id_space_over_all_tables() {
    let gen = kaggle_small();
    let offsets = gen.table_offsets();
    assert_eq!(offsets.len(), gen.num_tables() + 1);
    assert_eq!(
        *offsets.last().unwrap(),
        gen.cardinalities().iter().sum::<u64>()
    );
    let batch = gen.batch(0, 2048);
    assert_eq!(batch.size, 2048);
    assert_eq!(batch.dense.len(), 2048 * DENSE_FEATURES);
    let mut rows = HashSet::new();
    for (t, ids) in batch.ids.iter().enumerate() {
        for &id in ids {
            let row = offsets[t] + u64::from(id);
            assert!(row >= offsets[t] && row < offsets[t + 1]);
            rows.insert(row);
        }
    }
    // Skewed, but not degenerate: many repeats, many distinct rows.
    let total = 2048 * gen.num_tables();
    assert!(
        rows.len() > total / 10 && rows.len() < total / 2,
        "{} of {total}",
        rows.len()
    );
}

#[test]
fn the_hidden_model_is_learnable() {
    let gen = Synthetic::new(SyntheticConfig::new(Dataset::Avazu).with_seed(5)).unwrap();
    let batch = gen.batch(0, 8192);
    let scores: Vec<f64> = (0..batch.size).map(|i| gen.true_logit(&batch, i)).collect();
    let best = auroc(&scores, &batch.labels);
    assert!(best > 0.7, "Bayes-optimal AUROC {best}");
    // Against the labels of another batch the same scores are no better than chance.
    let other = gen.batch(1, 8192);
    let chance = auroc(&scores, &other.labels);
    assert!((chance - 0.5).abs() < 0.05, "{chance}");
}

#[test]
fn configuration_errors_are_typed() {
    assert!(matches!(
        "criteo-2tb".parse::<Dataset>(),
        Err(Error::Parse {
            what: "dataset",
            ..
        })
    ));
    let bad = [
        SyntheticConfig::new(Dataset::Avazu).with_zipf(-1.0),
        SyntheticConfig::new(Dataset::Avazu).with_scale(0.0),
        SyntheticConfig::new(Dataset::Avazu).with_drift(Drift {
            batches_per_day: 0,
            shift: 0.1,
        }),
        SyntheticConfig::new(Dataset::Avazu).with_drift(Drift {
            batches_per_day: 4,
            shift: f64::NAN,
        }),
    ];
    for config in bad {
        assert!(
            matches!(
                Synthetic::new(config.clone()),
                Err(Error::BadValue { .. } | Error::TooFew { .. })
            ),
            "{config:?}"
        );
    }
    let drifting = Synthetic::new(SyntheticConfig::new(Dataset::Avazu).with_drift(Drift {
        batches_per_day: 4,
        shift: 0.1,
    }))
    .unwrap();
    assert_eq!(
        (0..9).map(|i| drifting.day(i)).collect::<Vec<_>>(),
        [0, 0, 0, 0, 1, 1, 1, 1, 2]
    );
    assert_eq!(drifting.config().drift.unwrap().batches_per_day, 4);
}
