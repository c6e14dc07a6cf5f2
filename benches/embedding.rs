//! Id preparation of the embedding cache against a plain `HashMap`-based remap making the same
//! decisions, on a Criteo-Kaggle-like Zipf 1.0 trace (cardinalities × 0.1, batch 2,048, one
//! cache of 1.5% of all rows); and, untimed, the frequency policy's hit rate against the
//! offline optimum's on the same trace.
//!
//! ```sh
//! cargo bench --bench embedding
//! ```

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tidemem::embedding::data::{Dataset, Synthetic, SyntheticConfig};
use tidemem::embedding::{bincount, replay, CacheIndex, OptimalTrace, Policy, ReplayConfig};

const BATCH: usize = 2048;
const BATCHES: u64 = 40;
const RATIO: f64 = 0.015;

fn trace() -> (usize, Vec<Vec<u32>>) {
    let gen = Synthetic::new(SyntheticConfig::new(Dataset::CriteoKaggle).with_scale(0.1))
        .expect("synthetic data");
    let offsets = gen.table_offsets();
    let rows = *offsets.last().expect("offsets") as usize;
    let trace = (0..BATCHES)
        .map(|i| {
            let b = gen.batch(i, BATCH);
            let mut ids = Vec::with_capacity(b.size * b.ids.len());
            for (t, col) in b.ids.iter().enumerate() {
                ids.extend(col.iter().map(|&id| (offsets[t] + id as u64) as u32));
            }
            ids
        })
        .collect();
    (rows, trace)
}

/// The straightforward cache a first version would write: `HashMap` id → slot, a `HashSet` per
/// batch, victims the rarest cached ids not in the batch (the frequency policy's choice).
struct HashMapRemap {
    slot_of: HashMap<u32, u32>,
    id_in: Vec<u32>,
    rank: Vec<u32>,
    free: Vec<u32>,
}

impl HashMapRemap {
    fn new(capacity: usize, rank: Vec<u32>) -> Self {
        Self {
            slot_of: HashMap::new(),
            id_in: vec![u32::MAX; capacity],
            rank,
            free: (0..capacity as u32).rev().collect(),
        }
    }

    fn prepare(&mut self, ids: &[u32]) -> Vec<u32> {
        let batch: HashSet<u32> = ids.iter().copied().collect();
        let mut missed: Vec<u32> = batch
            .iter()
            .copied()
            .filter(|id| !self.slot_of.contains_key(id))
            .collect();
        missed.sort_unstable();
        let need = missed.len().saturating_sub(self.free.len());
        if need > 0 {
            let mut cand: Vec<(u32, u32)> = self
                .slot_of
                .iter()
                .filter(|(id, _)| !batch.contains(id))
                .map(|(&id, &s)| (u32::MAX - self.rank[id as usize], s))
                .collect();
            cand.select_nth_unstable(need);
            for &(_, s) in &cand[..need] {
                let id = self.id_in[s as usize];
                self.slot_of.remove(&id);
                self.free.push(s);
            }
        }
        for id in missed {
            let s = self.free.pop().expect("room");
            self.slot_of.insert(id, s);
            self.id_in[s as usize] = id;
        }
        ids.iter().map(|id| self.slot_of[id]).collect()
    }
}

fn bench(c: &mut Criterion) {
    let (rows, trace) = trace();
    let counts = bincount(rows, trace.iter().map(|b| b.as_slice())).expect("counts");
    let capacity = (rows as f64 * RATIO).ceil() as usize;
    let ids: usize = trace.iter().map(|b| b.len()).sum();
    let mut order: Vec<u32> = (0..rows as u32).collect();
    order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    let mut rank = vec![0u32; rows];
    for (r, &id) in order.iter().enumerate() {
        rank[id as usize] = r as u32;
    }

    let mut g = c.benchmark_group("embedding_prepare");
    g.sample_size(10);
    g.throughput(Throughput::Elements(ids as u64));
    let mut ours = Duration::ZERO;
    let mut base = Duration::ZERO;
    g.bench_function("cache_index_frequency", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut ix = CacheIndex::new(rows, capacity, Policy::Frequency).expect("index");
                ix.reorder(&counts).expect("reorder");
                let t = Instant::now();
                for batch in &trace {
                    std::hint::black_box(ix.prepare(batch).expect("prepare"));
                }
                total += t.elapsed();
            }
            ours += total;
            total
        })
    });
    g.bench_function("hashmap_remap_baseline", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut m = HashMapRemap::new(capacity, rank.clone());
                let t = Instant::now();
                for batch in &trace {
                    std::hint::black_box(m.prepare(batch));
                }
                total += t.elapsed();
            }
            base += total;
            total
        })
    });
    g.finish();

    let rc = ReplayConfig {
        rows,
        capacity,
        row_bytes: 128 * 4,
        warmup: 0.7,
        train: true,
    };
    let one = replay(&trace, &counts, Policy::Frequency, &rc).expect("replay");
    let opt = replay(
        &trace,
        &counts,
        Policy::Optimal(OptimalTrace::new::<_, &[u32]>([]).expect("trace")),
        &rc,
    )
    .expect("replay");
    println!(
        "embedding_prepare: {} ids/iteration; cache index {:.1} M ids/s vs HashMap remap; \
         ratio of times (ours / baseline, lower is better) {:.3}",
        ids,
        one.ids_per_second / 1e6,
        ours.as_secs_f64() / base.as_secs_f64().max(1e-12)
    );
    println!(
        "embedding_hit_rate (criteo-kaggle × 0.1, zipf 1.0, batch {BATCH}, {:.1}% cache): \
         frequency {:.4}, optimal {:.4}, ratio {:.4}",
        RATIO * 100.0,
        one.hit_rate,
        opt.hit_rate,
        one.hit_rate / opt.hit_rate
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
