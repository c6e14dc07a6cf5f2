//! The cached embedding bag against the fully resident reference, the cache's invariants under
//! random id streams, reorder, flush, checkpoints and bad input.

mod common;

use proptest::prelude::*;
use tidemem::embedding::{
    bincount, CacheConfig, CachePolicy, CachedEmbeddingBag, CachedEmbeddingCollection,
    EmbeddingBag, EmbeddingCache, HostTier, OptimalTrace,
};
use tidemem::ops::embedding::BagMode;
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::rng::{Rng, SplitMix64};
use tidemem::Error;

const ROWS: usize = 400;
const DIM: usize = 8;

fn init(id: u32, row: &mut [f32]) {
    for (k, x) in row.iter_mut().enumerate() {
        *x = ((id as f32 * 0.37 + k as f32 * 1.3).sin()) * 0.1;
    }
}

fn weights() -> Vec<f32> {
    let mut w = vec![0f32; ROWS * DIM];
    for (id, r) in w.chunks_exact_mut(DIM).enumerate() {
        init(id as u32, r);
    }
    w
}

/// Random ids and values for the tests.
struct TestRng(SplitMix64);
impl TestRng {
    fn new(seed: u64) -> Self {
        TestRng(SplitMix64::new(seed))
    }
    fn next(&mut self) -> u32 {
        self.0.next_u32()
    }
    /// Skewed ids: the minimum of two uniforms, through a fixed shuffle.
    fn id(&mut self) -> u32 {
        let r = (self.next() % ROWS as u32).min(self.next() % ROWS as u32);
        (r * 7919 + 13) % ROWS as u32
    }
}

/// A batch of `bags` bags of 1..=4 ids, with weights when asked.
fn batch(rng: &mut TestRng, bags: usize, weighted: bool) -> Case {
    let mut idx = Vec::new();
    let mut off = vec![0u32];
    for _ in 0..bags {
        let n = 1 + rng.next() % 4;
        for _ in 0..n {
            idx.push(rng.id());
        }
        off.push(idx.len() as u32);
    }
    let w = weighted.then(|| {
        (0..idx.len())
            .map(|_| (rng.next() % 100) as f32 / 50.0 - 0.5)
            .collect()
    });
    (idx, off, w)
}

fn grad_of(out: &[f32]) -> Vec<f32> {
    out.iter()
        .enumerate()
        .map(|(i, &y)| y - ((i % 5) as f32 * 0.1 - 0.2))
        .collect()
}

const OPTIMIZERS: [EmbeddingOptimizer; 4] = [
    EmbeddingOptimizer::Sgd { lr: 0.5 },
    EmbeddingOptimizer::RowwiseAdagrad { lr: 0.3, eps: 1e-8 },
    EmbeddingOptimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    },
    EmbeddingOptimizer::Adam8 {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    },
];

/// Ten steps of the cached bag, with a cache of a few batches' worth of rows, equal the fully
/// resident bag bit for bit: outputs every step, then the table and optimizer state after a
/// flush, for every optimizer, mode and policy.
#[test]
fn cached_bag_equals_full_table_bitwise() {
    let w = weights();
    for dev in common::devices("cached_bag_equals_full_table_bitwise") {
        for opt in OPTIMIZERS {
            for (mode, weighted) in [
                (BagMode::Sum, false),
                (BagMode::Mean, false),
                (BagMode::Sum, true),
            ] {
                for policy in [CachePolicy::Frequency, CachePolicy::Lfu, CachePolicy::Lru] {
                    let mut rng = TestRng::new(11);
                    let batches: Vec<_> = (0..10).map(|_| batch(&mut rng, 12, weighted)).collect();
                    let mut full = EmbeddingBag::new(&w, DIM, mode, opt).unwrap();
                    let config = CacheConfig::new(ROWS, DIM, 96)
                        .policy(policy.clone())
                        .staging_rows(7);
                    let mut cached =
                        CachedEmbeddingBag::new(dev.clone(), config, mode, opt, init).unwrap();
                    let counts = bincount(ROWS, batches.iter().map(|b| b.0.as_slice())).unwrap();
                    cached.cache_mut().reorder(&counts).unwrap();
                    cached.cache_mut().warm_up(0.7).unwrap();
                    for (k, (idx, off, wt)) in batches.iter().enumerate() {
                        let a = full.forward(idx, off, wt.as_deref()).unwrap();
                        let b = cached.forward(idx, off, wt.as_deref()).unwrap();
                        assert_eq!(bits(&a), bits(&b), "{opt:?} {mode:?} {}", policy.name());
                        let g = grad_of(&a);
                        let (ids, ga) = full.backward(&g).unwrap();
                        if k % 2 == 0 {
                            cached.backward(&g).unwrap();
                        } else {
                            // the output gradient already on the device
                            let dev = cached.cache().device().clone();
                            let gd = dev
                                .upload(cached.cache().stream(), bytemuck::cast_slice(&g))
                                .unwrap();
                            assert!(cached.backward_device(gd.view(0, 4).unwrap()).is_err());
                            cached
                                .backward_device(gd.view(0, gd.len()).unwrap())
                                .unwrap();
                        }
                        let (ids_b, gb) = cached.sparse_grad(idx).unwrap();
                        assert_eq!(ids, ids_b);
                        assert_eq!(bits(&ga), bits(&gb));
                        full.step().unwrap();
                        cached.step().unwrap();
                    }
                    let stats = cached.cache().stats();
                    assert!(
                        stats.evicted > 0,
                        "the cache must be too small to hold every row"
                    );
                    assert!(cached.cache().moved().d2h_rows > 0);
                    let (wa, sa) = full.to_vecs();
                    let (wb, sb) = cached.cache_mut().to_vecs().unwrap();
                    assert_eq!(bits(&wa), bits(&wb), "{opt:?} {mode:?} {}", policy.name());
                    assert_eq!(bits(&sa), bits(&sb));
                    assert_eq!(sa.len(), ROWS * opt.state_len(DIM));
                }
            }
        }
    }
}

/// Prefetching the union of the next two batches while a batch is in flight (between its
/// forward and its step) makes every forward hit: all moves happen in the prefetches, the batch
/// in flight keeps its rows, and training equals the fully resident bag bit for bit.
#[test]
fn prefetch_moves_everything_ahead_and_keeps_training_exact() {
    let w = weights();
    for dev in common::devices("prefetch_moves_everything_ahead_and_keeps_training_exact") {
        for opt in OPTIMIZERS {
            for policy in [CachePolicy::Frequency, CachePolicy::Lfu, CachePolicy::Lru] {
                let mut rng = TestRng::new(29);
                let batches: Vec<_> = (0..10).map(|_| batch(&mut rng, 12, true)).collect();
                let mut full = EmbeddingBag::new(&w, DIM, BagMode::Sum, opt).unwrap();
                let config = CacheConfig::new(ROWS, DIM, 120)
                    .policy(policy.clone())
                    .staging_rows(16);
                let mut cached =
                    CachedEmbeddingBag::new(dev.clone(), config, BagMode::Sum, opt, init).unwrap();
                cached.prefetch(&[&batches[0].0]).unwrap();
                for (k, (idx, off, wt)) in batches.iter().enumerate() {
                    let moved = cached.cache().moved();
                    let a = full.forward(idx, off, wt.as_deref()).unwrap();
                    let b = cached.forward(idx, off, wt.as_deref()).unwrap();
                    assert_eq!(bits(&a), bits(&b), "{opt:?} {}", policy.name());
                    assert_eq!(
                        cached.cache().moved(),
                        moved,
                        "a prefetched forward moves nothing"
                    );
                    if k % 2 == 0 {
                        let next: Vec<&[u32]> = batches[k + 1..(k + 3).min(batches.len())]
                            .iter()
                            .map(|b| b.0.as_slice())
                            .collect();
                        cached.prefetch(&next).unwrap();
                    }
                    let moved = cached.cache().moved();
                    let g = grad_of(&a);
                    full.backward(&g).unwrap();
                    cached.backward(&g).unwrap();
                    full.step().unwrap();
                    cached.step().unwrap();
                    assert_eq!(cached.cache().moved(), moved);
                }
                // the batch buffers: at least indices, offsets, weights and the output
                let extra = cached.device_bytes() - cached.cache().device_bytes();
                let (idx, off, _) = &batches[0];
                assert!(extra >= (2 * idx.len() + off.len() + (off.len() - 1) * DIM) * 4);
                let stats = cached.cache().stats();
                assert_eq!(stats.misses, 0, "every id occurrence hits");
                assert!(stats.evicted > 0 && stats.prefetched == stats.admitted);
                assert!(cached.cache().moved().d2h_rows > 0);
                let (wa, sa) = full.to_vecs();
                let (wb, sb) = cached.cache_mut().to_vecs().unwrap();
                assert_eq!(bits(&wa), bits(&wb), "{opt:?} {}", policy.name());
                assert_eq!(bits(&sa), bits(&sb));
            }
        }
    }
}

/// A prefetch leaves its transfers on the copy stream until the next call settles them: the
/// host table cannot be read meanwhile, evicted dirty rows reach the host at the settle, and
/// admitted rows are readable from the device after it. The simulated device refuses any
/// access the two streams do not order.
#[test]
fn prefetch_transfers_stay_in_flight_until_settled() {
    let w = weights();
    let config = CacheConfig::new(ROWS, DIM, 6).staging_rows(64);
    let mut cache = EmbeddingCache::from_weights(common::sim(16 << 20), config, &w).unwrap();
    let first = cache.prepare(&[1, 2, 3, 4, 5, 6]).unwrap();
    // Change the first three rows on the device and mark them dirty.
    let rb = DIM * 4;
    let dev = cache.device().clone();
    for &slot in &first.slots[..3] {
        let row = vec![7.5f32; DIM];
        let buf = dev
            .upload(cache.stream(), bytemuck::cast_slice(&row))
            .unwrap();
        dev.copy_d2d(
            cache.stream(),
            buf.view(0, rb).unwrap(),
            cache.device_table().view(slot as usize * rb, rb).unwrap(),
        )
        .unwrap();
    }
    cache.mark_dirty(&first.slots[..3]).unwrap();
    let kept = [first.slots[3]];
    let p = cache.prefetch(&[&[10, 11], &[12, 13, 11]], &kept).unwrap();
    // The frequency policy evicts the highest host rows (6, 5, 3, 2), two of them dirty; 1 stays.
    assert_eq!((p.admit.len(), p.evicted, p.write_back.len()), (4, 4, 2));
    assert!(cache.in_flight());
    assert_eq!(cache.moved().h2d_rows, 6 + 4);
    assert!(cache.host_table().is_err() && cache.read_rows(&[10]).is_err());
    cache.settle().unwrap();
    assert!(!cache.in_flight());
    let host = cache.host_table().unwrap();
    for id in 2..=3usize {
        assert_eq!(
            &host[id * DIM..(id + 1) * DIM],
            &[7.5f32; DIM][..],
            "id {id}"
        );
    }
    assert_eq!(
        &host[DIM..2 * DIM],
        &w[DIM..2 * DIM],
        "id 1 is still cached"
    );
    assert_eq!(cache.read_rows(&[1]).unwrap(), vec![7.5f32; DIM]);
    assert_eq!(cache.read_rows(&[4]).unwrap(), w[4 * DIM..5 * DIM].to_vec());
    let rows = cache.read_rows(&[13, 10]).unwrap();
    assert_eq!(&rows[..DIM], &w[13 * DIM..14 * DIM]);
    assert_eq!(&rows[DIM..], &w[10 * DIM..11 * DIM]);
    let moved = cache.moved();
    for b in [&[10u32, 11][..], &[12, 13, 11], &[4]] {
        assert_eq!(cache.prepare(b).unwrap().misses, 0);
    }
    assert_eq!(cache.moved(), moved);
    // A flush with a prefetch in flight settles it first.
    cache.prefetch(&[&[20, 21]], &[]).unwrap();
    assert!(cache.in_flight());
    cache.flush().unwrap();
    assert!(!cache.in_flight());
    assert_eq!(cache.to_vecs().unwrap().0, {
        let mut e = w.clone();
        e[DIM..4 * DIM].fill(7.5);
        e
    });
}

/// A transfer that fails after the index has changed (here: a dirty row written on a stream
/// the cache does not know, so gathering it for write-back is an unordered access) makes the
/// cache refuse every later call that moves or reads rows.
#[test]
fn a_failed_transfer_makes_the_cache_unusable() {
    let w = weights();
    let config = CacheConfig::new(ROWS, DIM, 2).staging_rows(2);
    let mut cache = EmbeddingCache::from_weights(common::sim(16 << 20), config, &w).unwrap();
    let p = cache.prepare(&[1, 2]).unwrap();
    let dev = cache.device().clone();
    let other = dev.new_stream().unwrap();
    let after = dev.new_event().unwrap();
    dev.record(cache.stream(), &after).unwrap();
    dev.wait_event(&other, &after).unwrap();
    let row = dev.upload(&other, &[0u8; DIM * 4]).unwrap();
    dev.copy_d2d(
        &other,
        row.view(0, DIM * 4).unwrap(),
        cache.device_table().view(0, DIM * 4).unwrap(),
    )
    .unwrap();
    cache.mark_dirty(&p.slots).unwrap();
    let e = cache.prepare(&[3, 4]).unwrap_err();
    assert!(matches!(e, Error::UnorderedAccess { .. }), "{e}");
    for r in [
        cache.prepare(&[1]).map(|_| ()),
        cache.flush().map(|_| ()),
        cache.settle(),
        cache.read_rows(&[1]).map(|_| ()),
    ] {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("unusable"), "{e}");
    }
}

#[test]
fn caches_cross_threads() {
    fn check<T: Send + Sync>() {}
    check::<EmbeddingCache>();
    check::<CachedEmbeddingBag>();
    check::<CachedEmbeddingCollection>();
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn reorder_puts_the_hottest_id_in_row_zero_and_flush_frees_nothing_but_cleans() {
    let mut rng = TestRng::new(3);
    let batches: Vec<_> = (0..20).map(|_| batch(&mut rng, 16, false)).collect();
    let counts = bincount(ROWS, batches.iter().map(|b| b.0.as_slice())).unwrap();
    let hottest = (0..ROWS)
        .max_by_key(|&i| (counts[i], std::cmp::Reverse(i)))
        .unwrap();
    let opt = EmbeddingOptimizer::Sgd { lr: 0.1 };
    let config = CacheConfig::new(ROWS, DIM, 120);
    let mut bag =
        CachedEmbeddingBag::new(common::sim(64 << 20), config, BagMode::Sum, opt, init).unwrap();
    bag.cache_mut().reorder(&counts).unwrap();
    assert_eq!(bag.cache().index().row_of(hottest as u32), Some(0));
    // The table moved with the permutation: id `hottest` still reads its own initial row.
    let mut expect = vec![0f32; DIM];
    init(hottest as u32, &mut expect);
    assert_eq!(
        &bag.cache().read_rows(&[hottest as u32]).unwrap()[..DIM],
        &expect[..]
    );
    assert_eq!(bag.cache().host_table().unwrap()[..DIM], expect[..]);
    for (idx, off, _) in &batches {
        let out = bag.forward(idx, off, None).unwrap();
        bag.backward(&grad_of(&out)).unwrap();
        bag.step().unwrap();
    }
    let written = bag.cache_mut().flush().unwrap();
    assert!(written > 0);
    assert_eq!(
        bag.cache_mut().flush().unwrap(),
        0,
        "a second flush has nothing to write"
    );
    // After a flush the host table is exact: reading with the cache cleared gives the same.
    let ids: Vec<u32> = (0..ROWS as u32).collect();
    let before = bag.cache().read_rows(&ids).unwrap();
    bag.cache_mut().clear().unwrap();
    assert_eq!(bag.cache().index().cached(), 0);
    assert_eq!(before, bag.cache().read_rows(&ids).unwrap());
}

#[test]
fn checkpoint_round_trip_after_training_with_a_permutation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("table.safetensors");
    let mut rng = TestRng::new(5);
    let batches: Vec<_> = (0..8).map(|_| batch(&mut rng, 16, false)).collect();
    let counts = bincount(ROWS, batches.iter().map(|b| b.0.as_slice())).unwrap();
    let opt = OPTIMIZERS[2];
    let config = CacheConfig::new(ROWS, DIM, 100);
    let mut bag = CachedEmbeddingBag::new(
        common::sim(64 << 20),
        config.clone(),
        BagMode::Mean,
        opt,
        init,
    )
    .unwrap();
    bag.cache_mut().reorder(&counts).unwrap();
    for (idx, off, _) in &batches {
        let out = bag.forward(idx, off, None).unwrap();
        bag.backward(&grad_of(&out)).unwrap();
        bag.step().unwrap();
    }
    bag.cache_mut().save(&path).unwrap();
    let (w, s) = bag.cache_mut().to_vecs().unwrap();
    // A fresh bag in identity order loads the same table, in id order.
    let mut other = CachedEmbeddingBag::new(
        common::sim(64 << 20),
        config.host(HostTier::Mapped(dir.path().to_path_buf())),
        BagMode::Mean,
        opt,
        |_, r| r.fill(0.0),
    )
    .unwrap();
    other.cache_mut().load(&path).unwrap();
    let (w2, s2) = other.cache_mut().to_vecs().unwrap();
    assert_eq!(bits(&w), bits(&w2));
    assert_eq!(bits(&s), bits(&s2));
    // And the trained bag reloads its own checkpoint unchanged, through its permutation.
    bag.cache_mut().load(&path).unwrap();
    assert_eq!(bits(&w), bits(&bag.cache_mut().to_vecs().unwrap().0));
    // A checkpoint of another shape is refused.
    let mut small = CachedEmbeddingBag::new(
        common::sim(64 << 20),
        CacheConfig::new(ROWS, DIM + 1, 10),
        BagMode::Mean,
        opt,
        init,
    )
    .unwrap();
    let before = small.cache_mut().to_vecs().unwrap();
    let (stats, moved) = (small.cache().stats(), small.cache().moved());
    assert!(small.cache_mut().load(&path).is_err());
    // refused before anything changed: every row and its state, the cache's counters
    let after = small.cache_mut().to_vecs().unwrap();
    assert_eq!(
        (bits(&after.0), bits(&after.1)),
        (bits(&before.0), bits(&before.1))
    );
    assert_eq!(
        (small.cache().stats(), small.cache().moved()),
        (stats, moved)
    );
}

/// Indices, offsets and weights of one batch.
type Case = (Vec<u32>, Vec<u32>, Option<Vec<f32>>);

/// A bag checkpoint holds the table, every row's optimizer state and the step count: training
/// resumed from it equals training on, bit for bit, for every optimizer. A save between a
/// forward and its step holds the table before that step; a load there, or of a table saved
/// without the bag's step count, is refused.
#[test]
fn bag_checkpoints_resume_training_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bag.safetensors");
    for opt in OPTIMIZERS {
        let mut rng = TestRng::new(5);
        let batches: Vec<_> = (0..8).map(|_| batch(&mut rng, 12, false)).collect();
        let new_bag = || {
            let config = CacheConfig::new(ROWS, DIM, 96).staging_rows(7);
            CachedEmbeddingBag::new(common::sim(64 << 20), config, BagMode::Sum, opt, init).unwrap()
        };
        let train = |bag: &mut CachedEmbeddingBag, bs: &[Case]| {
            for (idx, off, wt) in bs {
                let out = bag.forward(idx, off, wt.as_deref()).unwrap();
                bag.backward(&grad_of(&out)).unwrap();
                bag.step().unwrap();
            }
        };
        let mut a = new_bag();
        train(&mut a, &batches[..4]);
        let (idx, off, _) = &batches[4];
        let out = a.forward(idx, off, None).unwrap();
        // between a forward and its step: the table as it is before that step
        let mid = dir.path().join("mid.safetensors");
        a.save(&mid).unwrap();
        assert!(
            matches!(a.load(&mid), Err(Error::OutOfOrder { call: "load", .. })),
            "no load mid-step"
        );
        a.backward(&grad_of(&out)).unwrap();
        a.step().unwrap();
        let mut m = new_bag();
        m.load(&mid).unwrap();
        assert_eq!(m.steps(), 4, "{opt:?}");
        a.save(&path).unwrap();
        train(&mut a, &batches[5..]);

        let mut b = new_bag();
        b.load(&path).unwrap();
        assert_eq!(b.steps(), 5, "{opt:?}");
        train(&mut b, &batches[5..]);
        a.cache_mut().flush().unwrap();
        b.cache_mut().flush().unwrap();
        assert_eq!(
            bits(a.cache().host_table().unwrap()),
            bits(b.cache().host_table().unwrap()),
            "{opt:?}"
        );
        // a table without the bag's step count
        let table = dir.path().join("table.safetensors");
        a.cache_mut().save(&table).unwrap();
        let before = bits(b.cache().host_table().unwrap());
        let e = b.load(&table).unwrap_err();
        assert!(e.to_string().contains("bag.steps"), "{e}");
        assert_eq!(
            bits(b.cache().host_table().unwrap()),
            before,
            "nothing changed"
        );
    }
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let opt = EmbeddingOptimizer::Sgd { lr: 0.1 };
    let mut bag = CachedEmbeddingBag::new(
        common::sim(64 << 20),
        CacheConfig::new(ROWS, DIM, 4),
        BagMode::Sum,
        opt,
        init,
    )
    .unwrap();
    bag.forward(&[1, 2], &[0, 1, 2], None).unwrap();
    let stats = bag.cache().stats();
    let moved = bag.cache().moved();
    bag.settle().unwrap();
    let all: Vec<u32> = (0..ROWS as u32).collect();
    let rows = bits(&bag.cache().read_rows(&all).unwrap());
    let bad: Vec<Case> = vec![
        (vec![1, ROWS as u32], vec![0, 2], None),  // id out of range
        (vec![1, 2, 3], vec![0, 2, 1, 3], None),   // offsets decrease
        (vec![1, 2], vec![0, 1], None),            // offsets do not end at the length
        (vec![1, 2], vec![1, 2], None),            // offsets do not start at 0
        (vec![1, 2], vec![], None),                // no offsets
        (vec![1, 2], vec![0, 2], Some(vec![1.0])), // weights length
        (vec![5, 6, 7, 8, 9], vec![0, 5], None),   // more distinct rows than slots
    ];
    // what each bad case is refused with, in the order of `bad`
    let refused: [fn(&Error) -> bool; 7] = [
        |e| matches!(e, Error::IdOutOfRange { .. }),
        |e| {
            matches!(
                e,
                Error::BadOffsets {
                    table: None,
                    at: 2,
                    ..
                }
            )
        },
        |e| matches!(e, Error::BadOffsets { at: 1, why, .. } if why.contains("last")),
        |e| matches!(e, Error::BadOffsets { at: 0, why, .. } if why.contains("first")),
        |e| matches!(e, Error::BadOffsets { at: 0, why, .. } if why.contains("none")),
        |e| {
            matches!(
                e,
                Error::Length {
                    got: 1,
                    expected: 2,
                    ..
                }
            )
        },
        |e| matches!(e, Error::CacheTooSmall { .. }),
    ];
    for ((idx, off, w), refused) in bad.iter().zip(refused) {
        let e = bag.forward(idx, off, w.as_deref()).unwrap_err();
        assert!(refused(&e), "{idx:?} {off:?}: {e}");
        assert_eq!(bag.cache().stats(), stats);
        assert_eq!(bag.cache().moved(), moved);
        // every row (cached ones from the device) as before the refusal
        let ids: Vec<u32> = (0..ROWS as u32).collect();
        assert_eq!(bits(&bag.cache().read_rows(&ids).unwrap()), rows, "{idx:?}");
    }
    assert!(
        bag.backward(&[0.0; DIM]).is_err(),
        "no pending forward after a failed one"
    );
    bag.forward(&[1, 2], &[0, 1, 2], None).unwrap();
    assert!(bag.backward(&[0.0; 3]).is_err());
    assert!(bag.step().is_err(), "step before backward");
    assert!(matches!(
        bincount(3, [&[0u32, 3][..]]),
        Err(Error::IdOutOfRange {
            id: 3,
            position: 1,
            rows: 3,
            ..
        })
    ));
}

#[test]
fn optimal_policy_needs_its_trace_order() {
    let trace = vec![vec![1u32, 2], vec![3]];
    let config = CacheConfig::new(ROWS, DIM, 4)
        .policy(CachePolicy::Optimal(OptimalTrace::new(&trace).unwrap()));
    let mut bag = CachedEmbeddingBag::new(
        common::sim(1 << 20),
        config,
        BagMode::Sum,
        EmbeddingOptimizer::Sgd { lr: 0.1 },
        init,
    )
    .unwrap();
    assert!(bag.forward(&[3], &[0, 1], None).is_err());
    bag.forward(&[1, 2], &[0, 2], None).unwrap();
    bag.forward(&[3], &[0, 1], None).unwrap();
    assert!(
        bag.forward(&[3], &[0, 1], None).is_err(),
        "past the trace's end"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Under random id streams, cache sizes, policies, row optimizers (their per-row state
    /// travelling with the row), sum and mean bags, weighted or not, with prefetches of the
    /// next batches issued and settled at random points: rows the batch uses are resident in
    /// the slots the plan gives; every row not cached has its latest value and optimizer state
    /// on the host once transfers are settled (so an evicted dirty row was written back, state
    /// and all, before its slot was reused); every row, cached or not, reads as the resident
    /// bag's; the cache never holds more rows than slots; and a case whose batches use more
    /// distinct rows than the cache holds evicts.
    #[test]
    fn cache_never_loses_an_update(
        seed in 0u64..100_000,
        capacity in 8usize..64,
        policy in 0usize..3,
        opt in 0usize..4,
        mean in any::<bool>(),
        weighted in any::<bool>(),
        steps in 4usize..14,
    ) {
        let policy = [CachePolicy::Frequency, CachePolicy::Lfu, CachePolicy::Lru][policy].clone();
        let opt = [
            EmbeddingOptimizer::Sgd { lr: 0.25 },
            EmbeddingOptimizer::RowwiseAdagrad { lr: 0.1, eps: 1e-8 },
            EmbeddingOptimizer::Adam { lr: 0.05, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
            EmbeddingOptimizer::Adam8 { lr: 0.05, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
        ][opt];
        let mode = if mean { BagMode::Mean } else { BagMode::Sum };
        let w = weights();
        let mut shadow = EmbeddingBag::new(&w, DIM, mode, opt).unwrap();
        let config = CacheConfig::new(ROWS, DIM, capacity).policy(policy).staging_rows(3);
        let mut bag =
            CachedEmbeddingBag::new(common::sim(16 << 20), config, mode, opt, init).unwrap();
        let mut rng = TestRng::new(seed);
        let batches: Vec<Case> = (0..steps)
            .map(|_| {
                let bags = 1 + (rng.next() % 3) as usize;
                batch(&mut rng, bags, weighted)
            })
            .collect();
        let mut used = std::collections::BTreeSet::new();
        for (k, (idx, off, wt)) in batches.iter().enumerate() {
            let b = match bag.forward(idx, off, wt.as_deref()) {
                Ok(b) => b,
                Err(Error::CacheTooSmall { unique, capacity: c }) => {
                    prop_assert!(unique > c);
                    continue;
                }
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            };
            used.extend(idx.iter().copied());
            let a = shadow.forward(idx, off, wt.as_deref()).unwrap();
            prop_assert_eq!(bits(&a), bits(&b));
            let ix = bag.cache().index();
            prop_assert!(ix.cached() <= ix.capacity());
            for &id in idx {
                let row = ix.row_of(id).unwrap();
                let slot = ix.slot_of_row(row);
                prop_assert!(slot.is_some(), "row of the batch not resident");
                prop_assert_eq!(ix.row_in_slot(slot.unwrap()), Some(row));
            }
            if rng.next().is_multiple_of(2) {
                // prefetch the next one or two batches, with transfers left in flight
                let n = 1 + (rng.next() % 2) as usize;
                let next: Vec<&[u32]> = batches[k + 1..(k + 1 + n).min(steps)]
                    .iter()
                    .map(|b| b.0.as_slice())
                    .collect();
                match bag.prefetch(&next) {
                    Ok(_) | Err(Error::CacheTooSmall { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            let g = grad_of(&a);
            shadow.backward(&g).unwrap();
            bag.backward(&g).unwrap();
            shadow.step().unwrap();
            bag.step().unwrap();
            if rng.next().is_multiple_of(2) {
                bag.settle().unwrap();
            }
            if bag.cache().in_flight() {
                prop_assert!(bag.cache().host_table().is_err());
                continue;
            }
            let (sw, ss) = shadow.to_vecs();
            let st = opt.state_len(DIM);
            let want = |id: usize| {
                let mut r = sw[id * DIM..(id + 1) * DIM].to_vec();
                r.extend_from_slice(&ss[id * st..(id + 1) * st]);
                r
            };
            let ix = bag.cache().index();
            let host = bag.cache().host_table().unwrap();
            let stride = DIM + st;
            for id in 0..ROWS as u32 {
                let row = ix.row_of(id).unwrap();
                if ix.slot_of_row(row).is_none() {
                    let h = &host[row as usize * stride..(row as usize + 1) * stride];
                    prop_assert_eq!(bits(h), bits(&want(id as usize)), "host row of id {}", id);
                }
            }
            // every row as the resident bag has it, from the device for the cached ones
            let ids: Vec<u32> = (0..ROWS as u32).collect();
            let all = bag.cache().read_rows(&ids).unwrap();
            for id in 0..ROWS {
                prop_assert_eq!(
                    bits(&all[id * stride..(id + 1) * stride]),
                    bits(&want(id)),
                    "row of id {}", id
                );
            }
        }
        if used.len() > capacity {
            prop_assert!(
                bag.cache().stats().evicted > 0,
                "{} distinct rows through a cache of {} slots evicted none",
                used.len(),
                capacity
            );
        }
    }
}

/// Tables of a few sizes, one id per sample per table (Criteo-style), `bags` samples.
fn table_batch(rng: &mut TestRng, rows: &[usize], bags: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    rows.iter()
        .map(|&r| {
            let ids: Vec<u32> = (0..bags).map(|_| rng.next() % r as u32).collect();
            (ids, (0..=bags as u32).collect())
        })
        .collect()
}

/// Sum-bag tables of `rows` rows of `dim` floats placed over `comm`'s ranks, 60 cached rows
/// per rank, set by [`table_init`].
fn sharded(
    comm: tidemem::comm::Communicator,
    sharding: tidemem::embedding::Sharding,
    rows: &[usize],
    dim: usize,
    opt: EmbeddingOptimizer,
) -> tidemem::embedding::ShardedEmbedding {
    tidemem::embedding::ShardedEmbedding::new(
        comm,
        sharding,
        rows,
        dim,
        60,
        BagMode::Sum,
        opt,
        table_init,
    )
    .unwrap()
}

/// Tables of every table's `(indices, offsets)` as the sharded and collection APIs take them.
fn view(b: &[(Vec<u32>, Vec<u32>)]) -> Vec<tidemem::embedding::TableBatch<'_>> {
    b.iter()
        .map(|(i, o)| tidemem::embedding::TableBatch {
            indices: i,
            offsets: o,
            weights: None,
        })
        .collect()
}

fn table_init(t: usize, id: u32, row: &mut [f32]) {
    for (k, x) in row.iter_mut().enumerate() {
        *x = (t as f32 * 0.5 + id as f32 * 0.01 + k as f32 * 0.1).cos();
    }
}

/// Sharded tables saved by every rank after two steps and loaded by new ranks train the next
/// two steps to the same bits as the ranks that went on; files from different steps, or from
/// another placement, are refused on every rank.
#[test]
fn sharded_checkpoints_resume_bitwise() {
    use tidemem::comm::Communicator;
    use tidemem::embedding::Sharding;
    const TROWS: [usize; 5] = [50, 7, 120, 30, 9];
    const D: usize = 6;
    const BAGS: usize = 10;
    let mut rng = TestRng::new(23);
    let steps: Vec<_> = (0..4)
        .map(|_| table_batch(&mut rng, &TROWS, BAGS))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let path = |tag: &str, r: usize| dir.join(format!("{tag}-rank{r}.safetensors"));
    for (sharding, opt) in [
        (
            Sharding::TableWise,
            EmbeddingOptimizer::RowwiseAdagrad { lr: 0.2, eps: 1e-8 },
        ),
        (Sharding::ColumnWise, OPTIMIZERS[2]),
    ] {
        let tag = format!("{sharding:?}");
        // load: None trains 4 steps and saves after 2 (and after 1, for the mismatch below)
        let run = |load: Option<&str>| {
            let comms =
                Communicator::local((0..2).map(|_| common::sim(64 << 20)).collect()).unwrap();
            std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|comm| {
                        let (steps, tag) = (&steps, &tag);
                        s.spawn(move || {
                            let r = comm.rank();
                            let mut e = sharded(comm, sharding, &TROWS, D, opt);
                            let mut first = 0;
                            if let Some(from) = load {
                                e.load(path(from, r)).unwrap();
                                first = 2;
                            }
                            let mut outs = Vec::new();
                            for (k, b) in steps.iter().enumerate().skip(first) {
                                let out = e.forward(&view(b)).unwrap();
                                e.backward(&grad_of(&out)).unwrap();
                                e.step().unwrap();
                                if load.is_none() && k == 0 {
                                    e.save(path(&format!("{tag}-step1"), r)).unwrap();
                                }
                                if load.is_none() && k == 1 {
                                    e.save(path(tag, r)).unwrap();
                                }
                                if k >= 2 {
                                    outs.push(bits(&out));
                                }
                            }
                            if load.is_some() {
                                // rank 0 at step 2, rank 1 at step 1: refused everywhere
                                let mixed = match r {
                                    0 => path(tag, 0),
                                    _ => path(&format!("{tag}-step1"), 1),
                                };
                                let e2 = e.load(mixed).unwrap_err();
                                assert!(e2.to_string().contains("different steps"), "{e2}");
                                // the other rank's file: another placement
                                let e3 = e.load(path(tag, 1 - r)).unwrap_err();
                                assert!(e3.to_string().contains("sharded.rank"), "{e3}");
                                // a save that fails on one rank fails on both, each with its
                                // own error, and leaves the earlier file
                                let before = std::fs::read(path(tag, 0)).unwrap();
                                let to = match r {
                                    0 => path(tag, 0),
                                    _ => dir.join("missing").join("x.safetensors"),
                                };
                                let e4 = e.save(to).unwrap_err();
                                match r {
                                    0 => assert!(e4.to_string().contains("another rank"), "{e4}"),
                                    _ => assert!(matches!(e4, Error::FileIo { .. }), "{e4}"),
                                }
                                assert_eq!(std::fs::read(path(tag, 0)).unwrap(), before);
                            }
                            outs
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        };
        let straight = run(None);
        let resumed = run(Some(&tag));
        assert_eq!(straight, resumed, "{tag}");
    }
}

/// Table-wise and column-wise placement on 2 and 4 in-process ranks: after training steps,
/// every rank's batch slice equals the single-rank collection's output bit for bit.
#[test]
fn sharded_outputs_equal_single_rank() {
    use tidemem::comm::Communicator;
    use tidemem::embedding::{batch_slice, CachedEmbeddingCollection, ShardedEmbedding, Sharding};
    const TROWS: [usize; 5] = [50, 7, 120, 30, 9];
    const D: usize = 6;
    const BAGS: usize = 10;
    let mut rng = TestRng::new(21);
    let steps: Vec<_> = (0..4)
        .map(|_| table_batch(&mut rng, &TROWS, BAGS))
        .collect();
    for (sharding, opt) in [
        (
            Sharding::TableWise,
            EmbeddingOptimizer::RowwiseAdagrad { lr: 0.2, eps: 1e-8 },
        ),
        (Sharding::ColumnWise, OPTIMIZERS[2]),
        (Sharding::ColumnWise, OPTIMIZERS[0]),
    ] {
        // Single rank: one collection of every table.
        let mut single = CachedEmbeddingCollection::new(
            common::sim(64 << 20),
            &TROWS,
            D,
            60,
            BagMode::Sum,
            opt,
            |c| c,
            table_init,
        )
        .unwrap();
        let mut expect = Vec::new();
        for b in &steps {
            let out = single.forward(&view(b)).unwrap();
            single.backward(&grad_of(&out)).unwrap();
            single.step().unwrap();
            expect.push(out);
        }
        // [tables, bags, D] → the samples of rank r, in the same layout.
        let slice = |out: &[f32], world: usize, r: usize| -> Vec<f32> {
            let (a, b) = batch_slice(BAGS, world, r);
            let mut v = Vec::new();
            for t in 0..TROWS.len() {
                v.extend_from_slice(&out[(t * BAGS + a) * D..(t * BAGS + b) * D]);
            }
            v
        };
        // Every rank on its own Sim device, and (where there is one) every rank on the GPU.
        let gpu = common::cuda("sharded_outputs_equal_single_rank");
        let groups = [2usize, 4]
            .into_iter()
            .map(|w| (0..w).map(|_| common::sim(64 << 20)).collect::<Vec<_>>())
            .chain(gpu.map(|g| vec![g; 2]));
        for devs in groups {
            let world = devs.len();
            {
                let comms = Communicator::local(devs).unwrap();
                let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
                    let handles: Vec<_> = comms
                        .into_iter()
                        .map(|comm| {
                            let steps = &steps;
                            s.spawn(move || {
                                let r = comm.rank();
                                let mut e = sharded(comm, sharding, &TROWS, D, opt);
                                let mut outs = Vec::new();
                                for b in steps {
                                    let out = e.forward(&view(b)).unwrap();
                                    // The gradient of this rank's samples, as the single rank
                                    // computes it for the whole batch.
                                    let full_like = grad_of_slice(&out, world, r);
                                    e.backward(&full_like).unwrap();
                                    e.step().unwrap();
                                    outs.push(out);
                                }
                                outs
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (r, outs) in got.iter().enumerate() {
                    for (step, out) in outs.iter().enumerate() {
                        assert_eq!(
                            bits(out),
                            bits(&slice(&expect[step], world, r)),
                            "{sharding:?} world {world} rank {r} step {step}"
                        );
                    }
                }
            }
        }
    }
    // Row-wise Adagrad cannot be split by columns.
    let comms = Communicator::local(vec![common::sim(1 << 20), common::sim(1 << 20)]).unwrap();
    let adagrad = EmbeddingOptimizer::RowwiseAdagrad { lr: 0.2, eps: 1e-8 };
    for comm in comms {
        let e = ShardedEmbedding::new(
            comm,
            Sharding::ColumnWise,
            &TROWS,
            D,
            60,
            BagMode::Sum,
            adagrad,
            table_init,
        );
        assert!(
            matches!(&e, Err(Error::Conflict { what, .. }) if what == "row-wise Adagrad"),
            "{e:?}"
        );
    }

    /// `grad_of` applied to a rank's slice gives the slice of `grad_of` of the full output
    /// only if it depends on the element's position in the full output: recompute it there.
    fn grad_of_slice(out: &[f32], world: usize, r: usize) -> Vec<f32> {
        let (a, b) = batch_slice(BAGS, world, r);
        let n = b - a;
        out.iter()
            .enumerate()
            .map(|(i, &y)| {
                let (t, rest) = (i / (n * D), i % (n * D));
                let full = (t * BAGS + a) * D + rest;
                y - ((full % 5) as f32 * 0.1 - 0.2)
            })
            .collect()
    }
}

/// The device all-to-all (`forward_device`, `backward_device`) against the host one
/// (`forward`, `backward`), table-wise and column-wise on 2 and 3 ranks (uneven sample slices
/// and column blocks), Sim devices and, where there is one, both ranks on the CUDA device:
/// every step's output bit for bit (sample-major against table-major), so every backward and
/// step too, and the tables at the end; and a backward that does not follow its forward's
/// path, or a gradient of the wrong size, refused.
#[test]
fn sharded_device_exchange_equals_the_host_one() {
    use tidemem::comm::Communicator;
    use tidemem::embedding::{batch_slice, Sharding};
    const TROWS: [usize; 5] = [50, 7, 120, 30, 9];
    const D: usize = 6;
    const BAGS: usize = 10;
    let mut rng = TestRng::new(33);
    let steps: Vec<_> = (0..3)
        .map(|_| table_batch(&mut rng, &TROWS, BAGS))
        .collect();
    let tables = TROWS.len();
    // [tables, n, D] ↔ [n, tables, D]
    let to_sample_major = |v: &[f32], n: usize| -> Vec<f32> {
        let mut out = vec![0.0; v.len()];
        for t in 0..tables {
            for s in 0..n {
                out[(s * tables + t) * D..(s * tables + t + 1) * D]
                    .copy_from_slice(&v[(t * n + s) * D..(t * n + s + 1) * D]);
            }
        }
        out
    };
    let gpu = common::cuda("sharded_device_exchange_equals_the_host_one");
    for (sharding, opt) in [
        (
            Sharding::TableWise,
            EmbeddingOptimizer::RowwiseAdagrad { lr: 0.2, eps: 1e-8 },
        ),
        (Sharding::ColumnWise, OPTIMIZERS[2]),
    ] {
        let groups: Vec<Vec<tidemem::device::Device>> = [2usize, 3]
            .into_iter()
            .map(|w| (0..w).map(|_| common::sim(64 << 20)).collect())
            .chain(gpu.clone().map(|g| vec![g.clone(), g]))
            .collect();
        for devs in groups {
            let world = devs.len();
            let name = devs[0].name().to_string();
            let run = |device: bool| -> Vec<(Vec<Vec<u32>>, Vec<u32>)> {
                let comms = Communicator::local(devs.clone()).unwrap();
                std::thread::scope(|s| {
                    let hs: Vec<_> = comms
                        .into_iter()
                        .map(|comm| {
                            let steps = &steps;
                            s.spawn(move || {
                                let r = comm.rank();
                                let dev = comm.device().clone();
                                let mut e = sharded(comm, sharding, &TROWS, D, opt);
                                let (a, b) = batch_slice(BAGS, world, r);
                                let n = b - a;
                                let mut outs = vec![];
                                for batch in steps {
                                    // outputs compared in the host layout, gradients made there
                                    let out = if device {
                                        assert_eq!(e.forward_device(&view(batch)).unwrap(), n);
                                        let v: Vec<f32> = bytemuck::pod_collect_to_vec(
                                            &dev.download(e.stream(), e.output().unwrap()).unwrap(),
                                        );
                                        // back to [tables, n, D]
                                        let mut tm = vec![0.0; v.len()];
                                        for t in 0..tables {
                                            for s in 0..n {
                                                tm[(t * n + s) * D..(t * n + s + 1) * D]
                                                    .copy_from_slice(
                                                        &v[(s * tables + t) * D
                                                            ..(s * tables + t + 1) * D],
                                                    );
                                            }
                                        }
                                        tm
                                    } else {
                                        e.forward(&view(batch)).unwrap()
                                    };
                                    let g = grad_of(&out);
                                    if device {
                                        let g = to_sample_major(&g, n);
                                        let st = e.stream();
                                        let gb = dev.upload(st, bytemuck::cast_slice(&g)).unwrap();
                                        let short = gb.view(0, gb.len() - 4).unwrap();
                                        assert!(matches!(
                                            e.backward_device(short),
                                            Err(Error::Length { got, expected, .. })
                                                if got + 4 == expected
                                        ));
                                        assert!(matches!(
                                            e.backward(&grad_of(&out)),
                                            Err(Error::OutOfOrder {
                                                call: "backward",
                                                ..
                                            })
                                        ));
                                        e.backward_device(gb.view(0, gb.len()).unwrap()).unwrap();
                                    } else {
                                        e.backward(&g).unwrap();
                                    }
                                    e.step().unwrap();
                                    outs.push(bits(&out));
                                }
                                let table = match e.local_mut() {
                                    Some(l) => l.bag_mut().cache_mut().to_vecs().unwrap().0,
                                    None => vec![],
                                };
                                (outs, bits(&table))
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                })
            };
            let (host, dev) = (run(false), run(true));
            for (r, (h, d)) in host.iter().zip(&dev).enumerate() {
                assert!(
                    h.0 == d.0,
                    "{name} {sharding:?} world {world} rank {r}: outputs"
                );
                assert!(
                    h.1 == d.1,
                    "{name} {sharding:?} world {world} rank {r}: tables"
                );
            }
        }
    }
}
