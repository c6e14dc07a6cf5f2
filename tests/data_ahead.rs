//! Batches built ahead of the step on worker threads ([`Ahead`]) are the batches built before
//! each step: the same bits, so training on them gives the same losses, for the synthetic
//! Criteo data, a Criteo TSV file and the text batches (with a repeated step).

mod common;

use tidemem::data::criteo::{rows_from_batch, write_tsv};
use tidemem::data::criteo::{
    Batch, Dataset, IdMap, Synthetic, SyntheticConfig, TsvConfig, TsvReader,
};
use tidemem::data::text::{Split, TokenData};
use tidemem::data::Ahead;
use tidemem::embedding::CachedEmbeddingCollection;
use tidemem::models::dlrm::{self, Dlrm, DlrmConfig};
use tidemem::ops::embedding::BagMode;
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::prelude::*;

fn gen() -> Synthetic {
    Synthetic::new(
        SyntheticConfig::new(Dataset::CriteoKaggle)
            .with_scale(0.0005)
            .with_seed(5),
    )
    .unwrap()
}

/// Losses of `steps` DLRM steps on the batches `next` gives.
fn dlrm_losses(gen: &Synthetic, steps: usize, mut next: impl FnMut() -> Batch) -> Vec<u32> {
    let cfg = DlrmConfig::tiny();
    let dev = common::sim(256 << 20);
    let mut mc = ManagerConfig::new(1 << 16, Policy::Tide);
    mc.param_dtype = DType::F32;
    let mut m = ChunkManager::new(dev.clone(), mc).unwrap();
    let model = Dlrm::register(&mut m, &cfg, 1).unwrap();
    let rows: Vec<usize> = gen.cardinalities().iter().map(|&n| n as usize).collect();
    let mut emb = CachedEmbeddingCollection::new(
        dev,
        &rows,
        cfg.dim,
        64 * cfg.tables,
        BagMode::Sum,
        EmbeddingOptimizer::Sgd { lr: 0.5 },
        |c| c,
        |t, id, row| row.fill(0.01 * ((t as u32 + id) % 7) as f32),
    )
    .unwrap();
    let mut adam = HybridAdam::new(HybridConfig::new(AdamConfig::adam(1e-2))).unwrap();
    (0..steps)
        .map(|_| {
            let b = next();
            let s = dlrm::train_step(&model, &mut m, &mut adam, &mut emb, &b, Default::default())
                .unwrap();
            s.loss.to_bits()
        })
        .collect()
}

#[test]
fn synthetic_batches_built_ahead_train_to_the_same_losses() {
    let (steps, size) = (8, 64);
    let g = gen();
    let mut i = 0;
    let inline = dlrm_losses(&g, steps, || {
        i += 1;
        g.batch(i - 1, size)
    });
    let shared = std::sync::Arc::new(gen());
    let builder = shared.clone();
    let mut ahead = Ahead::indexed(0..u64::MAX, 3, 3, move |i| builder.try_batch(i, size)).unwrap();
    let mut k = 0;
    let built = dlrm_losses(&shared, steps, || {
        let b = ahead.recv().unwrap().unwrap();
        assert_eq!(b, shared.batch(k, size), "batch {k}");
        k += 1;
        b
    });
    assert_eq!(built, inline, "the same losses, bit for bit");
}

#[test]
fn a_tsv_file_read_ahead_gives_the_same_batches_and_report() {
    let g = gen();
    let mut rows = Vec::new();
    for i in 0..6 {
        rows.extend(rows_from_batch(&g.batch(i, 50)).unwrap());
    }
    let mut text = Vec::new();
    write_tsv(&mut text, &rows).unwrap();
    // a malformed line in the middle: both readers skip and report it
    text.extend_from_slice(b"not\ta\tline\n");
    write_tsv(&mut text, &rows[..40]).unwrap();
    let config = TsvConfig {
        ids: IdMap::Hash,
        cardinalities: g.cardinalities().to_vec(),
    };
    let mut plain = TsvReader::new(std::io::Cursor::new(text.clone()), config.clone()).unwrap();
    let mut want = Vec::new();
    while let Some(b) = plain.next_batch(64).unwrap() {
        want.push((b, plain.report().clone()));
    }
    let mut reader = TsvReader::new(std::io::Cursor::new(text), config).unwrap();
    let mut ahead = Ahead::sequential(2, move || {
        Ok(reader.next_batch(64)?.map(|b| (b, reader.report().clone())))
    })
    .unwrap();
    let mut got = Vec::new();
    while let Some(x) = ahead.recv().unwrap() {
        got.push(x);
    }
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the same batches, each with the same report");
    assert_eq!(got.last().unwrap().1.malformed, 1);
}

#[test]
fn text_batches_by_step_survive_a_repeated_step() {
    let data = std::sync::Arc::new(TokenData::generated(20_000, 3, 0.1).unwrap());
    let (accumulate, batch, seq) = (2u64, 3, 16);
    let step = move |d: &TokenData, s: u64| {
        d.batches(
            Split::Train,
            (0..accumulate).map(|k| s * accumulate + k),
            batch,
            seq,
        )
    };
    let d = data.clone();
    let mut ahead = Ahead::indexed(0..u64::MAX, 4, 2, move |s| step(&d, s)).unwrap();
    // step 2 skipped (an overflow) and trained again; a resume jumps ahead to 9
    for s in [0, 1, 2, 2, 3, 9, 10] {
        assert_eq!(ahead.at(s).unwrap(), step(&data, s).unwrap(), "step {s}");
    }
}
