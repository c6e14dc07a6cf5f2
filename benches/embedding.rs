//! Id preparation of the embedding cache against a plain `HashMap`-based remap making the same
//! decisions, on a Criteo-Kaggle-like Zipf 1.0 trace (cardinalities × 0.1, batch 2,048, one
//! cache of 1.5% of all rows); and, untimed, the frequency policy's hit rate against the
//! offline optimum's on the same trace.
//!
//! `embedding_host_batch`: all the host work of one batch of the 26 Kaggle tables at full size
//! (batch 16,384: 425,984 ids, 1% cache): the index prefetches the next batch, prepares this one
//! and builds the backward plan, against the `HashMap` remap baseline with a `HashMap`
//! first-occurrence plan. At 81 batches per second (the GPU target) the host has 12.3 ms.
//!
//! `embedding_prefetch_overlap`: training steps of a cached bag on a simulated device whose
//! link is slow enough that moving the next batch's rows takes about as long as a step,
//! prefetching the next batch between each forward and backward; transfers left in flight
//! on the copy stream (overlapped with the backward and step) against the same prefetch
//! settled at once (baseline).
//!
//! ```sh
//! cargo bench --bench embedding
//! ```

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

#[path = "common/kaggle.rs"]
mod kaggle;
#[path = "common/mean.rs"]
mod mean;
use mean::Mean;
use tidemem::device::{Device, LinkModel, SimConfig};
use tidemem::embedding::{
    bincount, replay, CacheConfig, CacheIndex, CachePolicy, CachedEmbeddingBag, OptimalTrace,
    ReplayConfig,
};
use tidemem::ops::embedding::EmbeddingOptimizer;
use tidemem::ops::embedding::{plan_backward, BagMode};
use tidemem::rng::{Rng, SplitMix64};

const BATCH: usize = 2048;
const BATCHES: u64 = 40;
const RATIO: f64 = 0.015;

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
    let (rows, trace) = kaggle::trace(0.1, BATCH, BATCHES);
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
    let (mut ours, mut base) = (Mean::default(), Mean::default());
    g.bench_function("cache_index_frequency", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut ix =
                    CacheIndex::new(rows, capacity, CachePolicy::Frequency).expect("index");
                ix.reorder(&counts).expect("reorder");
                let t = Instant::now();
                for batch in &trace {
                    black_box(ix.prepare(batch).expect("prepare"));
                }
                total += t.elapsed();
            }
            ours.add(total, iters)
        })
    });
    g.bench_function("hashmap_remap_baseline", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut m = HashMapRemap::new(capacity, rank.clone());
                let t = Instant::now();
                for batch in &trace {
                    black_box(m.prepare(batch));
                }
                total += t.elapsed();
            }
            base.add(total, iters)
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
    let one = replay(&trace, &counts, CachePolicy::Frequency, &rc).expect("replay");
    let opt = replay(
        &trace,
        &counts,
        CachePolicy::Optimal(OptimalTrace::new::<_, &[u32]>([]).expect("trace")),
        &rc,
    )
    .expect("replay");
    println!(
        "embedding_prepare: {} ids/iteration; cache index {:.1} M ids/s vs HashMap remap; \
         ratio of times (ours / baseline, lower is better) {:.3}",
        ids,
        one.ids_per_second / 1e6,
        ours.ratio(&base)
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

const HOST_BATCH: usize = 16_384;
const HOST_BATCHES: u64 = 6;

/// The baseline's backward plan: distinct rows numbered through a `HashMap`, then grouped.
fn hashmap_plan(slots: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut first: HashMap<u32, u32> = HashMap::with_capacity(slots.len());
    let mut rows = Vec::new();
    let which: Vec<u32> = slots
        .iter()
        .map(|&s| {
            *first.entry(s).or_insert_with(|| {
                rows.push(s);
                (rows.len() - 1) as u32
            })
        })
        .collect();
    let mut ptr = vec![0u32; rows.len() + 1];
    for &u in &which {
        ptr[u as usize + 1] += 1;
    }
    for i in 0..rows.len() {
        ptr[i + 1] += ptr[i];
    }
    let mut entries = vec![0u32; slots.len()];
    let mut fill = ptr.clone();
    for (b, &u) in which.iter().enumerate() {
        entries[fill[u as usize] as usize] = b as u32;
        fill[u as usize] += 1;
    }
    (rows, entries)
}

fn host_batch(c: &mut Criterion) {
    let (rows, trace) = kaggle::trace(1.0, HOST_BATCH, HOST_BATCHES);
    let counts = bincount(rows, trace.iter().map(|b| b.as_slice())).expect("counts");
    let capacity = rows / 100;
    let mut ix = CacheIndex::new(rows, capacity, CachePolicy::Frequency).expect("index");
    let perm = ix.reorder(&counts).expect("reorder").to_vec();
    ix.preload(capacity * 7 / 10);
    let mut remap = HashMapRemap::new(capacity, perm);
    let bag_offsets: Vec<u32> = (0..=trace[0].len() as u32).collect();
    let n = trace.len();

    let mut g = c.benchmark_group("embedding_host_batch");
    g.sample_size(10);
    g.throughput(Throughput::Elements(trace[0].len() as u64));
    let (mut ours, mut base) = (Mean::default(), Mean::default());
    let mut k = 0usize;
    g.bench_function("index_prefetch_prepare_plan", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                let (cur, next) = (&trace[k % n], &trace[(k + 1) % n]);
                black_box(ix.prefetch(&[next], &[]).expect("prefetch"));
                let p = ix.prepare(cur).expect("prepare");
                black_box(plan_backward(&p.slots, &bag_offsets, None, BagMode::Sum).expect("plan"));
                k += 1;
            }
            ours.add(t.elapsed(), iters)
        })
    });
    let mut k = 0usize;
    g.bench_function("hashmap_remap_and_plan_baseline", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                let slots = remap.prepare(&trace[k % n]);
                black_box(hashmap_plan(&slots));
                k += 1;
            }
            base.add(t.elapsed(), iters)
        })
    });
    g.finish();
    println!(
        "embedding_host_batch (criteo-kaggle, batch {HOST_BATCH}, {} ids, 1% cache): {:.1} ms \
         per batch (prefetch next + prepare + plan) against {:.1} ms for the HashMap baseline \
         (prepare + plan), ratio {:.3}; the 81 it/s target leaves 12.3 ms",
        trace[0].len(),
        ours.per_iter() * 1e3,
        base.per_iter() * 1e3,
        ours.ratio(&base)
    );
}

const OV_ROWS: usize = 200_000;
const OV_DIM: usize = 64;
const OV_BAGS: usize = 1024;
const OV_IDS_PER_BAG: usize = 8;
const OV_BATCHES: usize = 12;

/// Skewed ids (the cube of a uniform) for `OV_BATCHES` batches of `OV_BAGS` bags.
fn overlap_batches() -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15);
    (0..OV_BATCHES)
        .map(|_| {
            let ids: Vec<u32> = (0..OV_BAGS * OV_IDS_PER_BAG)
                .map(|_| {
                    let u = rng.next_f64();
                    ((u * u * u * OV_ROWS as f64) as u32).min(OV_ROWS as u32 - 1)
                })
                .collect();
            let offsets = (0..=OV_BAGS).map(|b| (b * OV_IDS_PER_BAG) as u32).collect();
            (ids, offsets)
        })
        .collect()
}

/// Runs every batch once; returns the time of the steady batches (all but the first) and the
/// bytes moved over the link (both ways).
fn overlap_run(batches: &[(Vec<u32>, Vec<u32>)], overlap: bool) -> (Duration, u64) {
    let link = LinkModel {
        h2d_gbps: 0.25,
        d2h_gbps: 0.25,
        d2d_gbps: 100.0,
        latency: Duration::from_micros(10),
    };
    let dev = Device::sim(SimConfig::with_capacity(1 << 30).link(link)).expect("sim");
    let config = CacheConfig::new(OV_ROWS, OV_DIM, 16_384).staging_rows(16_384);
    let opt = EmbeddingOptimizer::RowwiseAdagrad { lr: 0.1, eps: 1e-8 };
    let mut bag = CachedEmbeddingBag::new(dev, config, BagMode::Sum, opt, |id, row| {
        row.fill(id as f32 * 1e-6)
    })
    .expect("bag");
    bag.prefetch(&[&batches[0].0]).expect("prefetch");
    let mut start = Instant::now();
    for (k, (ids, offsets)) in batches.iter().enumerate() {
        if k == 1 {
            start = Instant::now();
        }
        let out = bag.forward(ids, offsets, None).expect("forward");
        if let Some(next) = batches.get(k + 1) {
            bag.prefetch(&[&next.0]).expect("prefetch");
            if !overlap {
                bag.settle().expect("settle");
            }
        }
        bag.backward(&out).expect("backward");
        bag.step().expect("step");
    }
    bag.settle().expect("settle");
    let m = bag.cache().moved();
    (start.elapsed(), m.h2d_bytes + m.d2h_bytes)
}

fn overlap(c: &mut Criterion) {
    let batches = overlap_batches();
    let mut g = c.benchmark_group("embedding_prefetch_overlap");
    g.sample_size(10);
    let (mut ours, mut base) = (Mean::default(), Mean::default());
    g.bench_function("copy_stream_in_flight", |b| {
        b.iter_custom(|iters| {
            let t: Duration = (0..iters).map(|_| overlap_run(&batches, true).0).sum();
            ours.add(t, iters)
        })
    });
    g.bench_function("settled_at_once_baseline", |b| {
        b.iter_custom(|iters| {
            let t: Duration = (0..iters).map(|_| overlap_run(&batches, false).0).sum();
            base.add(t, iters)
        })
    });
    g.finish();
    let (_, bytes) = overlap_run(&batches, true);
    let per_batch = bytes as f64 / OV_BATCHES as f64;
    println!(
        "embedding_prefetch_overlap: {:.2} MB over the link per batch ({:.1} ms at 0.25 GB/s)",
        per_batch / 1e6,
        per_batch / 0.25e9 * 1e3
    );
    println!(
        "embedding_prefetch_overlap ({OV_ROWS} rows × {OV_DIM}, batch {OV_BAGS} × \
         {OV_IDS_PER_BAG} ids, 0.25 GB/s simulated link): ratio of step times (in flight / \
         settled at once, lower is better) {:.3}",
        ours.ratio(&base)
    );
}

criterion_group!(benches, bench, host_batch, overlap);
criterion_main!(benches);
